"""A long-lived server that trains in its own process twice (MONAI Label's ``run_sync=true``), idle in between.

Each training fills a monai_cache.CacheDataset on the fly through monai.data.DataLoader with 2 workers, for one epoch,
and leaves the dataset in a reference cycle, as ignite's engines and their handlers do: only a cyclic collection can
free it, and an idle server makes no allocations that would start one. The idle collector (``MONAI_CACHE_IDLE_COLLECT``
seconds, set by the caller) is what runs it.

Prints one JSON line: per training, the bytes of shared memory the server held right after it and the seconds until
it held none (None: still held after ``wait`` seconds of idling).
argv: shm_dir wait
"""

import contextlib
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import _minimal_monai  # noqa: F401  (first: MONAI as a plain install gives it)
import monai.data
import monai.transforms as mt
import numpy as np
import torch

import monai_cache


def held(shm_dir: str) -> int:
    """Bytes in this user's caches under ``shm_dir``."""
    root = os.path.join(shm_dir, f"monai_cache-{os.getuid()}")
    total = 0
    for d, _dirs, files in os.walk(root):
        for f in files:
            with contextlib.suppress(FileNotFoundError):  # removed while we look
                total += os.path.getsize(os.path.join(d, f))
    return total


class Engine:
    """Stands for ignite's Engine: it holds the loader, and its handlers hold it."""

    def __init__(self, loader: monai.data.DataLoader) -> None:
        self.loader = loader
        self.handlers = [self.log]

    def log(self) -> None:
        pass

    def run(self) -> None:
        for _batch in self.loader:
            pass


def train(shm_dir: str) -> None:
    data = [{"image": np.full((4, 32, 32), i, np.float32)} for i in range(32)]
    chain = mt.Compose([mt.ScaleIntensityd(keys="image"), mt.RandFlipd(keys="image", prob=0.5)])
    ds = monai_cache.CacheDataset(data, chain, runtime_cache=True, shm_dir=shm_dir, progress=False)
    Engine(monai.data.DataLoader(ds, batch_size=4, num_workers=2)).run()


def main() -> None:
    shm_dir, wait = sys.argv[1], float(sys.argv[2])
    torch.set_num_threads(1)
    out = []
    for _ in range(2):
        train(shm_dir)
        after = held(shm_dir)
        ended, released = time.monotonic(), None
        while time.monotonic() - ended < wait:  # idle: sleeping allocates nothing
            if not held(shm_dir):
                released = round(time.monotonic() - ended, 2)
                break
            time.sleep(0.1)
        out.append({"held_after": after, "released_after": released})
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
