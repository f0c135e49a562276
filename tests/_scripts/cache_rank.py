"""One rank of a torchrun-style job: build monai_cache.CacheDataset, read every item through a DataLoader.

Started as an independent process with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT set, like
torchrun starts ranks. argv: data.json log_path runtime_cache(0/1) epochs
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.distributed as dist
from helpers import chain
from monai.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

import monai_cache


def main() -> None:
    data_path, log_path, runtime, epochs = sys.argv[1], sys.argv[2], bool(int(sys.argv[3])), int(sys.argv[4])
    with open(data_path) as f:
        data = json.load(f)
    dist.init_process_group("gloo")
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
    result = {"rank": rank, "seen": seen, "total": stats["total"], "stored": stats["stored"], "path": ds._cache.path}
    print(json.dumps(result), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
