"""One rank of a simulated two-node job: each "node" has its own shared-memory directory.

Env: a Slurm task's variables (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NODEID, SLURM_TASKS_PER_NODE...),
MASTER_ADDR, MASTER_PORT and MONAI_CACHE_SHM_DIR (the node's /dev/shm); none of torchrun's. argv: data.json epochs
Prints one JSON line: the indices this rank read per epoch and the node cache's counters after each epoch.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import _minimal_monai  # noqa: F401  (first: MONAI as a plain install gives it)
import torch
import torch.distributed as dist
from helpers import Times10
from monai.data import DataLoader
from monai.transforms import Compose

import monai_cache


def main() -> None:
    with open(sys.argv[1]) as f:
        data = json.load(f)
    epochs = int(sys.argv[2])
    assert not {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK"} & set(os.environ)
    # as Lightning's SLURMEnvironment does: rank and world size from Slurm's variables, passed to the call
    rank, world = int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    ds = monai_cache.CacheDataset(data, Compose([Times10(keys="x")]), runtime_cache=True, progress=False)
    sampler = monai_cache.ShardedDistributedSampler(ds, shuffle=True, seed=3, shard_by="node")
    loader = DataLoader(ds, batch_size=2, sampler=sampler, num_workers=1)
    per_epoch, stats = [], []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        seen = []
        for batch in loader:
            seen += [int(v) // 10 for v in batch["x"]]
            dist.all_reduce(torch.zeros(1))  # lockstep
        dist.barrier()  # every rank of the node finished the epoch before we read the node's counters
        per_epoch.append(seen)
        stats.append(ds.cache_stats()["total"])
        dist.barrier()
    print(json.dumps({"rank": dist.get_rank(), "seen": per_epoch, "stats": stats,
                      "layout": [sampler.local_world_size, sampler.node_rank, sampler.local_rank],
                      "entries": [i for i in range(len(ds)) if ds._cache.contains(i)]}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
