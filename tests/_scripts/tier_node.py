"""One process of a simulated node of a cluster whose machines share one cache directory.

Env: MONAI_CACHE_SHM_DIR (the node's /dev/shm) and MONAI_CACHE_NODE_ID (the node's identity).
argv: data.json log_path cache_dir kind(cd|pd) seed
Reads every item once, in an order of its own, and prints one JSON line: the sums it read and its counters.
"""

import json
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from helpers import chain

import monai_cache


def main() -> None:
    data_path, log, cache_dir, kind, seed = sys.argv[1:6]
    with open(data_path) as f:
        data = json.load(f)
    transform = chain(log, crop=False)
    if kind == "cd":
        ds = monai_cache.CacheDataset(data, transform, runtime_cache=True, progress=False, cache_dir=cache_dir,
                                      shared_dir=True)
    else:
        ds = monai_cache.PersistentDataset(data, transform, cache_dir, shm_cache=True, shared_dir=True)
    order = list(range(len(data)))
    random.Random(int(seed)).shuffle(order)
    sums = {i: float(ds[i]["image"].sum()) for i in order}
    stats = ds.cache_stats()
    print(json.dumps({"pid": os.getpid(), "sums": sums, "total": stats["total"], "disk": stats["disk"]["process"]}),
          flush=True)


if __name__ == "__main__":
    main()
