#!/usr/bin/env python
"""Two passes over many small items in one process: what a read through an empty cache (the first pass) and
through a full one (the second) costs per item, and how much of it lands in the random transform after the cache.

No DataLoader, no workers: one thread reads ``bench_scale.py``'s 16 KiB images (a seeded ``torch.rand``) followed
by ``RandFlipd``, each item once per pass, in a shuffled order, through

* ``uncached``: ``monai.data.Dataset``;
* ``monai``, ``monai-runtime``: ``monai.data.CacheDataset`` filled when it is built, or on the fly
  (``runtime_cache=True``: a list in this process);
* ``ours``, ``ours-runtime``: ``monai_cache.CacheDataset`` the same two ways, each on a fresh shared-memory cache.

Building a dataset (and an eager fill) is not timed. The configurations rotate within each repeat. CPU is
``time.thread_time`` over a pass; the random transform's share is timed inside it (``RandFlipd`` wrapped in a
transform that adds up its own CPU, the same wrapper in every configuration). Per repeat and their medians, in
microseconds per item, and the medians' differences from ``uncached`` (first pass) or ``monai`` (second pass).

Usage::

    python benchmarks/first_pass.py                    # 20,000 items, 5 repeats
    python benchmarks/first_pass.py --items 2000 --repeats 3
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from monai_cache.utils import format_table  # noqa: E402

CONFIGS = ("uncached", "monai", "monai-runtime", "ours", "ours-runtime")
PASSES = ("first", "second")


def timed_random(transform: Any) -> Any:
    """``transform`` (a random MONAI transform) wrapped so that its CPU seconds add up in ``.seconds``; still a
    random transform to MONAI's caches (they stop before it)."""
    from monai.transforms import MapTransform, Randomizable

    class TimedRandom(Randomizable, MapTransform):
        def __init__(self) -> None:
            MapTransform.__init__(self, transform.keys)
            self.seconds = 0.0

        def set_random_state(self, seed: Any = None, state: Any = None) -> TimedRandom:
            transform.set_random_state(seed, state)
            return self

        def randomize(self, data: Any) -> None:  # the wrapped transform draws its own
            pass

        def __call__(self, data: Any) -> Any:
            t = time.thread_time()
            out = transform(data)
            self.seconds += time.thread_time() - t
            return out

    return TimedRandom()


def two_passes(config: str, items: int, seed: int, shm_dir: str) -> list[tuple[float, float]]:
    """Per pass, CPU microseconds per item of ``config`` and those spent in the random transform."""
    import bench_scale
    from monai.data import CacheDataset as MonaiCacheDataset
    from monai.data import Dataset
    from monai.transforms import Compose, RandFlipd

    import monai_cache

    make = bench_scale._make_transform()
    sys.modules["__main__"].MakeImage = make  # type: ignore[attr-defined]
    flip = timed_random(RandFlipd(keys="image", prob=0.5, spatial_axis=0))
    chain = Compose([make(), flip])
    data = [{"i": i, "pass": seed} for i in range(items)]  # "pass": a cache of its own for each repeat
    runtime = config.endswith("-runtime")
    ds: Any
    if config == "uncached":
        ds = Dataset(data, chain)
    elif config.startswith("monai"):
        ds = MonaiCacheDataset(data, chain, progress=False, runtime_cache=runtime)
    else:
        ds = monai_cache.CacheDataset(data, chain, progress=False, runtime_cache=runtime, shm_dir=shm_dir)
    order = list(range(items))
    out = []
    for p in range(len(PASSES)):
        random.Random(seed * len(PASSES) + p).shuffle(order)
        flip.seconds = 0.0
        gc.collect()
        gc.disable()  # a collection falling into one pass and not another is noise here
        try:
            start = time.thread_time()
            for i in order:
                ds[i]
            spent = time.thread_time() - start
        finally:
            gc.enable()
        out.append((spent / items * 1e6, flip.seconds / items * 1e6))
    if config.startswith("ours"):
        ds.release()
    return out


def measure(items: int, repeats: int) -> dict[str, list[list[tuple[float, float]]]]:
    """{configuration: per repeat, per pass: (CPU us per item, of which the random transform)}."""
    shm_dir = tempfile.mkdtemp(prefix="first_pass-", dir="/dev/shm")
    results: dict[str, list[list[tuple[float, float]]]] = {c: [] for c in CONFIGS}
    try:
        for rep in range(repeats):
            for config in CONFIGS[rep % len(CONFIGS):] + CONFIGS[: rep % len(CONFIGS)]:
                results[config].append(two_passes(config, items, rep, shm_dir))
    finally:
        shutil.rmtree(shm_dir, ignore_errors=True)
    return results


def table(results: dict[str, list[list[tuple[float, float]]]]) -> str:
    repeats = len(results[CONFIGS[0]])
    rows = [["pass", "configuration", "CPU us / item", *(f"repeat {r + 1}" for r in range(repeats)), "median",
             "difference"]]  # fmt: skip

    def values(config: str, p: int, part: int) -> list[float]:
        return [rep[p][0] - rep[p][1] if part == 2 else rep[p][part] for rep in results[config]]

    for p, name in enumerate(PASSES):
        ref = "uncached" if p == 0 else "monai"
        for config in CONFIGS:
            for part, what in ((0, "whole read"), (1, "random transform"), (2, "the rest")):
                vals = values(config, p, part)
                median = statistics.median(vals)
                diff = median - statistics.median(values(ref, p, part))
                rows.append([name, config, what, *(f"{v:.1f}" for v in vals), f"{median:.1f}",
                             "" if config == ref else f"{diff:+.1f}"])  # fmt: skip
    return format_table(rows, left=3, rule=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    print(f"first_pass: {args.items:,} items of 16 KiB + RandFlipd, one thread, two passes, {args.repeats} repeats; "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)
    print(table(measure(args.items, args.repeats)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
