"""One rank of the 2-rank gloo check, started the way torchrun starts a worker (RANK, WORLD_SIZE, ... env vars).

Usage: python gloo_worker.py OUT_DIR. For each sampler under test it trains a dummy loop over a dataset that
keeps a private, bounded per-rank cache (capacity ceil(n / world): what one rank can afford), counts hits per
epoch, all-reduces once per step to check the ranks stay in lockstep, and writes ``OUT_DIR/rank{RANK}.json``.
"""

from __future__ import annotations

import json
import math
import os
import sys
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from monai_cache.sampler import ShardedDistributedSampler

N_ITEMS = 101  # odd: rank 1's shard is one short, so padding is exercised
EPOCHS = 4
BATCH = 4


class CachedRange(Dataset):
    """Items ``0..n-1`` behind a dict cache that keeps the first ``capacity`` items it sees (no eviction)."""

    def __init__(self, n: int, capacity: int) -> None:
        self.n, self.capacity = n, capacity
        self.cache: dict[int, int] = {}
        self.hits = self.misses = 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        if i in self.cache:
            self.hits += 1
            return self.cache[i]
        self.misses += 1
        if len(self.cache) < self.capacity:
            self.cache[i] = i
        return i


def run(name: str, make_sampler, world: int) -> dict:
    ds = CachedRange(N_ITEMS, capacity=math.ceil(N_ITEMS / world))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sampler = make_sampler(ds)
    loader = DataLoader(ds, batch_size=BATCH, sampler=sampler, num_workers=0)
    epochs = []
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        ds.hits = ds.misses = 0
        seen: list[int] = []
        lockstep = True
        steps = 0
        for step, batch in enumerate(loader):
            # SUM over ranks is [world * step, world] only if every rank is at this same step
            t = torch.tensor([step, 1], dtype=torch.int64)
            dist.all_reduce(t)
            lockstep &= t.tolist() == [world * step, world]
            seen += batch.tolist()
            steps += 1
        lo = torch.tensor([steps])
        hi = torch.tensor([steps])
        dist.all_reduce(lo, op=dist.ReduceOp.MIN)
        dist.all_reduce(hi, op=dist.ReduceOp.MAX)
        epochs.append(
            {
                "hits": ds.hits,
                "misses": ds.misses,
                "indices": seen,
                "steps": steps,
                "steps_min": int(lo),
                "steps_max": int(hi),
                "lockstep": lockstep,
            }
        )
    return {"name": name, "epochs": epochs, "warnings": [str(w.message) for w in caught],
            "num_replicas": sampler.num_replicas, "rank": sampler.rank}  # fmt: skip


def main() -> None:
    out_dir = sys.argv[1]
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    world, rank = dist.get_world_size(), dist.get_rank()
    results = [
        # num_replicas / rank left out on purpose: read from the process group, as in real use
        run("sharded", lambda ds: ShardedDistributedSampler(ds, seed=1), world),
        run("torch", lambda ds: DistributedSampler(ds, seed=1), world),
        # local_world_size from LOCAL_WORLD_SIZE (checked against LOCAL_RANK / GROUP_RANK)
        run("sharded_node", lambda ds: ShardedDistributedSampler(ds, seed=1, shard_by="node"), world),
    ]
    # the same ranks then play a launcher that does not set LOCAL_WORLD_SIZE (Lightning, srun, mpirun): one launch
    # of processes instead of two
    for var in ("LOCAL_WORLD_SIZE", "GROUP_RANK"):
        os.environ.pop(var, None)
    from node_layout_worker import check_layout

    layout = check_layout(world, rank)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "world": world, "results": results, "layout": layout}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
