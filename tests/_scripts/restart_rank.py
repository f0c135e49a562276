"""A rank of a torchrun job that is restarted (``--max-restarts=1``): the cache and the sampler outlive the crash.

Usage: ``torchrun --standalone --nproc-per-node=2 --max-restarts=1 restart_rank.py OUT_DIR``.

Attempt 0 (``TORCHELASTIC_RESTART_COUNT=0``) reads with 2 DataLoader workers per rank; after 2 steps of epoch 1
rank 1 ends with ``os._exit(1)`` and rank 0 kills itself with SIGKILL. Attempt 1 reads without workers and finishes
(one restart: an interpreter start per rank less than a crash per attempt). Each step commits, in one atomic file
per rank, the sampler's state and the items that step trained on (a training checkpoint: what was not committed is
trained on again), then all-reduces (the ranks stay in lockstep). The deterministic chain appends one line per call
to ``calls.log``. Each attempt writes ``attempt<k>.rank<r>.json``: the first step's cache statistics after a restart.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from datetime import timedelta

import _minimal_monai  # noqa: F401  (first: MONAI as a plain install gives it)
import torch
import torch.distributed as dist
from monai.transforms import Lambdad

import monai_cache
from monai_cache import ShardedDistributedSampler

N_ITEMS, EPOCHS = 8, 2
OUT = sys.argv[1]


def slow_chain(i: int) -> torch.Tensor:
    """The deterministic chain: logs each call, so the test counts what was computed in the whole job."""
    with open(os.path.join(OUT, "calls.log"), "a") as f:
        f.write(f"{i}\n")
    return torch.full((64, 64), 2.0 * i)


def init_process_group(rank: int, world: int) -> None:
    # Restarted ranks reuse the agent's store, whose keys carry no attempt: a rank could read the dead rank's
    # old address (gloo's connectFullMesh then fails, or init hangs). A prefix per attempt keeps them apart.
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world,
        is_master=os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" and rank == 0,
        timeout=timedelta(seconds=120),
    )
    prefixed = dist.PrefixStore(f"attempt_{os.environ['TORCHELASTIC_RESTART_COUNT']}", store)
    dist.init_process_group("gloo", store=prefixed, rank=rank, world_size=world, timeout=timedelta(seconds=120))


def main() -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    init_process_group(rank, world)
    data = [{"img": i} for i in range(N_ITEMS)]
    ds = monai_cache.CacheDataset(data, Lambdad("img", slow_chain), runtime_cache=True, progress=False)
    sampler = ShardedDistributedSampler(ds, shuffle=True, seed=3)
    ckpt = os.path.join(OUT, f"ckpt.rank{rank}.json")
    state = {"sampler": None, "seen": {}}
    if os.path.exists(ckpt):
        with open(ckpt) as f:
            state = json.load(f)
        sampler.load_state_dict(state["sampler"])
    workers = 2 if attempt == 0 else 0
    loader = monai_cache.DataLoader(ds, batch_size=1, sampler=sampler, num_workers=workers)
    first = True
    for epoch in range(sampler.epoch, EPOCHS):
        sampler.set_epoch(epoch)
        seen = state["seen"].setdefault(str(epoch), [])
        for batch in loader:
            item = int(batch["img"][0, 0, 0]) // 2
            seen.append(item)
            if first:  # the first step of this attempt: was it served from the cache?
                with open(os.path.join(OUT, f"attempt{attempt}.rank{rank}.json"), "w") as f:
                    json.dump({"stats": ds.cache_stats()["total"], "agent": os.environ.get("MONAI_CACHE_AGENT")}, f)
                first = False
            state["sampler"] = sampler.state_dict(consumed=len(seen))
            tmp = ckpt + ".tmp"
            with open(tmp, "w") as f:
                json.dump(state, f)
            os.replace(tmp, ckpt)  # the step is committed
            if attempt == 0 and epoch == 1 and len(seen) == 2:
                if rank == 1:
                    os._exit(1)
                os.kill(os.getpid(), signal.SIGKILL)
            dist.all_reduce(torch.ones(1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
