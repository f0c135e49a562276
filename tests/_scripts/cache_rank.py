"""One rank of a torchrun-style job: build monai_cache.CacheDataset, read every item through a DataLoader.

Started as an independent process with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT set, like
torchrun starts ranks. argv: data.json log_path runtime_caches epochs. ``runtime_caches``: comma-separated 0/1,
run in turn by this one interpreter (a MONAI import less per rank); the calls of each go to ``log_path-VALUE``;
every cache but the last is released by all ranks before the next starts, the last is left to the exit. Prints
one JSON line: ``{value: this rank's result}``.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import _minimal_monai  # noqa: F401  (first: MONAI as a plain install gives it)
import torch
import torch.distributed as dist
from helpers import chain
from monai.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

import monai_cache


def run(data: list, log_path: str, runtime: bool, epochs: int) -> tuple[dict, monai_cache.CacheDataset]:
    rank = dist.get_rank()
    ds = monai_cache.CacheDataset(data, chain(log_path), runtime_cache=runtime, progress=False, num_workers=2)
    sampler = DistributedSampler(ds, shuffle=True, seed=0)
    loader = DataLoader(ds, batch_size=1, sampler=sampler, num_workers=2)
    seen = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for batch in loader:
            seen += [int(c) for c in batch["case"]]
            total = torch.tensor([float(batch["image"].sum())])
            dist.all_reduce(total)  # ranks in lockstep, as in training
    dist.barrier()
    stats = ds.cache_stats()
    return {"rank": rank, "seen": seen, "total": stats["total"], "stored": stats["stored"], "path": ds._cache.path}, ds


def main() -> None:
    data_path, log_path, runtimes, epochs = sys.argv[1], sys.argv[2], sys.argv[3].split(","), int(sys.argv[4])
    with open(data_path) as f:
        data = json.load(f)
    dist.init_process_group("gloo")
    results = {}
    for n, runtime in enumerate(runtimes):
        results[runtime], ds = run(data, f"{log_path}-{runtime}", bool(int(runtime)), epochs)
        dist.barrier()
        if n < len(runtimes) - 1:  # the last one goes with the process
            ds.release()
            dist.barrier()  # released by every rank: removed before the next one is made
    print(json.dumps(results), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
