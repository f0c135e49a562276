"""One process of a simulated node of a cluster whose machines share one cache directory.

Env: MONAI_CACHE_SHM_DIR (the node's /dev/shm) and MONAI_CACHE_NODE_ID (the node's identity).
argv: data.json workdir kinds(cd,pd) seed processes
For each kind in turn (one interpreter serves both: a MONAI import less per process), waits until all
``processes`` of the cluster are ready for it (so that they read at once), then reads every item once, in an order
of its own, from the cache in ``workdir/shared-KIND`` (calls logged to ``workdir/calls-KIND``), and prints one JSON
line: the kind, the sums it read and its counters.
"""

import gc
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import _minimal_monai  # noqa: F401  (first: MONAI as a plain install gives it)
from helpers import chain

import monai_cache


def barrier(workdir: str, name: str, seed: str, processes: int) -> None:
    """Wait until ``processes`` processes have reached the barrier ``name`` (files in ``workdir``)."""
    open(os.path.join(workdir, f"ready-{name}-{seed}"), "w").close()
    deadline = time.monotonic() + 240
    while sum(n.startswith(f"ready-{name}-") for n in os.listdir(workdir)) < processes:
        if time.monotonic() > deadline:
            sys.exit(f"barrier {name}: the other processes did not come")
        time.sleep(0.01)


def main() -> None:
    data_path, workdir, kinds, seed, processes = sys.argv[1:6]
    with open(data_path) as f:
        data = json.load(f)
    for kind in kinds.split(","):
        log, cache_dir = os.path.join(workdir, f"calls-{kind}"), os.path.join(workdir, f"shared-{kind}")
        transform = chain(log, crop=False)
        barrier(workdir, kind, seed, int(processes))
        if kind == "cd":
            ds = monai_cache.CacheDataset(
                data, transform, runtime_cache=True, progress=False, cache_dir=cache_dir, shared_dir=True
            )
        else:
            ds = monai_cache.PersistentDataset(data, transform, cache_dir, shm_cache=True, shared_dir=True)
        order = list(range(len(data)))
        random.Random(int(seed)).shuffle(order)
        sums = {i: float(ds[i]["image"].sum()) for i in order}
        stats = ds.cache_stats()
        print(
            json.dumps(
                {
                    "kind": kind,
                    "pid": os.getpid(),
                    "sums": sums,
                    "total": stats["total"],
                    "disk": stats["disk"]["process"],
                }
            ),
            flush=True,
        )
        del ds
        gc.collect()  # this kind's caches are let go before the next kind's


if __name__ == "__main__":
    main()
