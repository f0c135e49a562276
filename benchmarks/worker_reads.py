#!/usr/bin/env python
"""A warm read inside a persistent DataLoader worker: a cache filled eagerly (before the workers fork), one filled
on the fly (by the workers), and MONAI's ``CacheDataset``, one after another on the same volumes.

Each read (``dataset[i]``: the cached item, then ``RandCropByPosNegLabeld``) is measured inside the worker:
user and system CPU milliseconds and minor page faults (``getrusage`` of the worker, before and after the read),
medians per epoch. A worker of an eager cache reads entries written by its parent process; a worker of an
on-the-fly cache reads entries written by itself and the other workers; MONAI's deep-copies items inherited from
the parent. This isolates what the issue #27 asked about (eager warm epochs slower than on-the-fly ones) from
the rest of a training run. Note that the kernel accounts user and system time in ticks: single-read values are
coarse, medians over many reads are not.

Usage::

    python benchmarks/worker_reads.py                # 12 volumes of 160x160x83-108, crop 64x64x64, 3 epochs
    python benchmarks/worker_reads.py --items 4 --shape 64x64x32
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import warnings
from collections.abc import Sequence
from typing import Any

warnings.filterwarnings("ignore")

import bench_cache  # noqa: E402
import torch  # noqa: E402

from monai_cache.synthetic import tutorial_transforms  # noqa: E402


def build(config: str, files: list[dict[str, str]], shm_dir: str) -> Any:
    """The dataset of ``config``: ``eager``, ``runtime`` (monai_cache) or ``monai`` (MONAI's CacheDataset)."""
    chain = tutorial_transforms(ARGS.crop)
    if config == "monai":
        import monai.data

        return monai.data.CacheDataset(files, chain, progress=False)
    import monai_cache

    return monai_cache.CacheDataset(files, chain, progress=False, runtime_cache=config == "runtime", shm_dir=shm_dir)


class Probe(torch.utils.data.Dataset):
    """``dataset[i]`` in the worker, returning what it cost: user ms, system ms, minor faults."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> torch.Tensor:
        a = resource.getrusage(resource.RUSAGE_SELF)
        self.dataset[i]
        b = resource.getrusage(resource.RUSAGE_SELF)
        ms = 1e3
        return torch.tensor([(b.ru_utime - a.ru_utime) * ms, (b.ru_stime - a.ru_stime) * ms, b.ru_minflt - a.ru_minflt])


ARGS: argparse.Namespace


def main(argv: Sequence[str] | None = None) -> int:
    """Run every configuration and print one line per configuration and epoch; returns 0."""
    global ARGS
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--items", type=int, default=12)
    parser.add_argument("--shape", type=bench_cache._shape, default=(160, 160, 83, 108))
    parser.add_argument("--crop", type=lambda t: bench_cache._shape(t, "--crop"), default=(64, 64, 64))
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "monai-cache-worker-reads"))
    ARGS = parser.parse_args(argv)
    torch.set_num_threads(1)
    with open(bench_cache.prepare_data(os.path.abspath(ARGS.out), ARGS.items, ARGS.shape, 0)) as f:
        files = json.load(f)
    print(f"worker_reads: {len(files)} volumes of {bench_cache.shape_text(ARGS.shape)}, one persistent worker, "
          f"medians per read; load average {os.getloadavg()[0]:.1f}")  # fmt: skip
    for config in ("eager", "runtime", "monai"):
        shm_dir = tempfile.mkdtemp(prefix="monai_cache-bench-", dir=os.environ.get("MONAI_CACHE_SHM_DIR", "/dev/shm"))
        try:
            dataset = build(config, files, shm_dir)
            loader = torch.utils.data.DataLoader(
                Probe(dataset), batch_size=1, num_workers=1, persistent_workers=True, shuffle=True
            )
            for epoch in range(ARGS.epochs):
                rows = torch.cat(list(loader))
                user, system, faults = (float(rows[:, k].median()) for k in range(3))
                print(f"  {config:<8} epoch {epoch + 1}: user {user:5.1f} ms  system {system:5.1f} ms  "
                      f"minor faults {faults:6.0f}", flush=True)  # fmt: skip
            del loader
            if hasattr(dataset, "release"):
                dataset.release()
        finally:
            shutil.rmtree(shm_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
