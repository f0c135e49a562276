"""A rank of an elastic torchrun job on two "nodes" of this machine (``--nnodes=1:2``, one rank each, c10d).

Usage: ``torchrun --nnodes=1:2 --nproc-per-node=1 --max-restarts=1 --rdzv-backend=c10d ... elastic_rank.py OUT``
with ``NODE`` (A or B) and ``MONAI_CACHE_SHM_DIR`` (one per node) set per agent.

Each step reads a batch, all-reduces (the ranks stay in lockstep), then commits in one atomic file per node the
sampler's state and the items trained on. In epoch 1 of the first attempt node B stops after 2 committed steps
and writes its pid to ``B.parked`` (the test then kills B's agent and rank); node A's collective fails, its agent
restarts it alone and the epoch is finished at world size 1 from A's checkpoint. The deterministic chain logs each
call in ``calls.<NODE>.log``; each attempt writes ``<NODE>.attempt<k>.json`` (world size, entries in the node's
cache).
"""

from __future__ import annotations

import json
import os
import sys
import time

import _minimal_monai  # noqa: F401  (first: MONAI as a plain install gives it)
import torch
import torch.distributed as dist
from monai.transforms import Lambdad
from restart_rank import init_process_group  # this directory is on sys.path: the script's own

import monai_cache
from monai_cache import ShardedDistributedSampler

N_ITEMS, EPOCHS = 8, 2
OUT, NODE = sys.argv[1], os.environ["NODE"]


def slow_chain(i: int) -> torch.Tensor:
    """The deterministic chain: logs each call on this node."""
    with open(os.path.join(OUT, f"calls.{NODE}.log"), "a") as f:
        f.write(f"{i}\n")
    return torch.full((64, 64), 2.0 * i)


def main() -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
    init_process_group(rank, world)  # a store key prefix per attempt (restart_rank.py says why)
    ds = monai_cache.CacheDataset(
        [{"img": i} for i in range(N_ITEMS)], Lambdad("img", slow_chain), runtime_cache=True, progress=False
    )
    with open(os.path.join(OUT, f"{NODE}.attempt{attempt}.json"), "w") as f:
        json.dump({"world": world, "entries": ds.cache_stats()["stored"]["entries"]}, f)
    sampler = ShardedDistributedSampler(ds, shuffle=True, seed=3)
    ckpt = os.path.join(OUT, f"ckpt.{NODE}.json")
    state: dict = {"sampler": None, "seen": {}}
    if os.path.exists(ckpt):
        with open(ckpt) as f:
            state = json.load(f)
        sampler.load_state_dict(state["sampler"])  # saved at world size 2, loaded at world size 1
    loader = monai_cache.DataLoader(ds, batch_size=1, sampler=sampler, num_workers=0)
    for epoch in range(sampler.epoch, EPOCHS):
        sampler.set_epoch(epoch)
        seen = state["seen"].setdefault(str(epoch), [])
        done = sampler.state_dict()["consumed"]
        for step, batch in enumerate(loader, 1):
            dist.all_reduce(torch.ones(1))
            seen.append(int(batch["img"][0, 0, 0]) // 2)
            state["sampler"] = sampler.state_dict(consumed=done + step)
            with open(ckpt + ".tmp", "w") as f:
                json.dump(state, f)
            os.replace(ckpt + ".tmp", ckpt)  # the step is committed
            if NODE == "B" and attempt == "0" and epoch == 1 and step == 2:
                with open(os.path.join(OUT, "B.parked.tmp"), "w") as f:
                    f.write(str(os.getpid()))
                os.replace(os.path.join(OUT, "B.parked.tmp"), os.path.join(OUT, "B.parked"))
                time.sleep(600)  # killed here, with its agent
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
