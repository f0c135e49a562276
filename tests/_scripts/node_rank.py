"""One rank of a simulated two-node job: each "node" has its own shared-memory directory.

Env: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT, MONAI_CACHE_SHM_DIR (the node's /dev/shm) and
MONAI_CACHE_NODE_ID (the node's identity). argv: data.json epochs
Prints one JSON line: the indices this rank read per epoch and the node cache's counters after each epoch.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

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
    dist.init_process_group("gloo")
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
                      "entries": [i for i in range(len(ds)) if ds._cache.contains(i)]}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
