"""One rank of a torchrun-style job: monai_cache.SmartCacheDataset read by persistent DataLoader workers over several
update_cache() calls.

Started as an independent process with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT set, like torchrun
starts ranks. argv: data.json log_path rounds start_method_of_rank_0 start_method_of_rank_1. Prints one JSON line:
the cases read in each round (every rank reads the whole window), the cache's path and counters.
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

import monai_cache


def main() -> None:
    data_path, log_path, rounds, contexts = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:]
    with open(data_path) as f:
        data = json.load(f)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ds = monai_cache.SmartCacheDataset(
        data, chain(log_path, crop=None), replace_rate=0.25, cache_num=4, seed=0, num_init_workers=2, progress=False
    )
    loader = DataLoader(ds, batch_size=1, num_workers=2, persistent_workers=True,
                        multiprocessing_context=contexts[rank])
    ds.start()
    seen = []
    for r in range(rounds):
        if r:
            ds.update_cache()
        cases = []
        for batch in loader:
            cases += [int(c) for c in batch["case"]]
            total = torch.tensor([float(batch["image"].sum())])
            dist.all_reduce(total)  # ranks in lockstep, as in training
        seen.append(cases)
    ds.shutdown()
    dist.barrier()
    stats = ds.cache_stats()
    print(json.dumps({"rank": rank, "rounds": seen, "stored": stats["stored"], "path": ds._store.path}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
