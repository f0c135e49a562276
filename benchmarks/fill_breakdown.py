#!/usr/bin/env python
"""What filling the shared-memory cache on the fly costs beside computing the item, part by part, in one process.

A ``CacheDataset(runtime_cache=True)`` read that misses does what an uncached ``monai.data.Dataset`` read does
(the cached transforms, then the random crop) plus the store's miss path: take the entry's lock, encode the item,
reserve its bytes, write them into a new file in ``/dev/shm``, publish the slot, count. This times each part on the
CT-like volumes of ``bench_cache.py`` (one thread, as in a DataLoader worker), interleaved over ``--rounds`` passes,
and prints CPU milliseconds (user + system, ``getrusage``) and minor page faults per item: medians over the passes.
CPU time and fault counts hold up on a busy machine, where wall time does not.

Parts:

* ``compute``: the cached part of the tutorial chain (load ... ScaleIntensityRanged), glibc's heap as it is;
* ``compute after malloc_trim(0)``: the same after the freed heap was given back (what the store did before every
  miss until issue #27; it now does it only when memory is tight): the difference is pages faulted in again;
* ``random crop``: ``RandCropByPosNegLabeld`` on the computed item (every read does it, cached or not);
* ``store miss path``: ``SharedMemoryStore.get_or_compute`` of an item already computed, on an empty cache, returning
  the computed object (what a DataLoader worker's miss adds to an uncached read), and its parts:
  ``encode`` (the header; buffers are not copied), ``write into tmpfs`` (``posix_fallocate`` + ``pwrite`` of the
  blob into a new file: the kernel allocates, zeroes and fills its pages, a copy of every byte);
* what the miss path does not do by default: ``data CRC-32`` (``verify=True`` only), ``read back`` (map the
  entry and touch every voxel; a miss returns the computed object instead), ``deepcopy`` (MONAI's ``copy_cache``).

Then the same for many small items (``--small``, default 2,000: ``bench_scale.py``'s 64x64 float32 images of 16 KiB,
packed into shared segments), in microseconds per item: making one, the random part of a read (``RandFlipd``), the
store's miss path alone (the same code again and again) and as a worker runs it (each miss followed by the flip, the
two timed apart), the floor of any cache that publishes each entry to other processes (its system calls with no
Python around them: lock the entry, write its bytes into fresh tmpfs pages, write its index slot, unlock) followed
by the flip in the same way, and a hit.

Usage::

    python benchmarks/fill_breakdown.py                 # 8 volumes of 160x160x83-108, 5 passes
    python benchmarks/fill_breakdown.py --items 4 --rounds 3 --shape 96x96x48
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

warnings.filterwarnings("ignore")

import bench_cache  # noqa: E402
import torch  # noqa: E402
from monai.transforms import Compose  # noqa: E402

from monai_cache import codec  # noqa: E402
from monai_cache.runtime import ofd_lock, ofd_unlock  # noqa: E402
from monai_cache.shm import SharedMemoryStore  # noqa: E402
from monai_cache.synthetic import tutorial_transforms  # noqa: E402
from monai_cache.utils import format_table  # noqa: E402


def _usage() -> tuple[float, int]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime, r.ru_minflt


def per_item(fn: Callable[[int], Any], n: int) -> tuple[float, float]:
    """CPU ms and minor faults per item of ``fn(0) ... fn(n - 1)``."""
    cpu0, flt0 = _usage()
    for i in range(n):
        fn(i)
    cpu1, flt1 = _usage()
    return (cpu1 - cpu0) / n * 1e3, (flt1 - flt0) / n


def main(argv: Sequence[str] | None = None) -> int:
    """Run the breakdown and print the table; returns 0."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--items", type=int, default=8, help="volumes (0: skip them)")
    parser.add_argument("--shape", type=bench_cache._shape, default=(160, 160, 83, 108))
    parser.add_argument("--crop", type=lambda t: bench_cache._shape(t, "--crop"), default=(64, 64, 64))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "monai-cache-bench"), help="data dir")
    parser.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    parser.add_argument("--small", type=int, default=2000, help="small items (0: skip them)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # as in a DataLoader worker
    if args.items:
        volumes(args)
    if args.small:
        if args.items:
            print()
        print(format_table(small_items(args.small, args.rounds), markdown=args.markdown, rule=True))
    return 0


def volumes(args: argparse.Namespace) -> None:
    """Print the breakdown for CT-like volumes."""
    with open(bench_cache.prepare_data(os.path.abspath(args.out), args.items, args.shape, 0)) as f:
        files = json.load(f)
    chain = tutorial_transforms(args.crop)
    deterministic, crop = Compose(chain.transforms[:-1]), chain.transforms[-1]
    items = [deterministic(dict(f)) for f in files]
    n = len(items)
    trim = ctypes.CDLL("libc.so.6").malloc_trim
    shm_dir = tempfile.mkdtemp(prefix="monai_cache-bench-", dir=os.environ.get("MONAI_CACHE_SHM_DIR", "/dev/shm"))
    scratch = tempfile.mkdtemp(dir=shm_dir)

    def write_tmpfs(i: int) -> None:
        enc = codec.encode(items[i])
        path = os.path.join(scratch, str(i))
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.posix_fallocate(fd, 0, enc.nbytes)
            pos = 0
            for chunk in enc.chunks(data_crc=False):
                pos += os.pwrite(fd, chunk, pos)
        finally:
            os.close(fd)
        os.unlink(path)

    def compute_trimmed(i: int) -> None:
        trim(0)
        deterministic(dict(files[i]))

    def touch(item: Any) -> float:
        return float(item["image"].sum()) + float(item["label"].sum())

    parts: dict[str, Callable[[int], Any]] = {
        "compute": lambda i: deterministic(dict(files[i])),
        "compute after malloc_trim(0)": compute_trimmed,
        "random crop (every read)": lambda i: crop(items[i]),
        "encode": lambda i: codec.encode(items[i]),
        "write into tmpfs (fallocate + pwrite)": write_tmpfs,
        "data CRC-32 (verify=True only)": lambda i: codec.encode(items[i]).prefix(data_crc=True),
        "deepcopy (MONAI's copy_cache)": lambda i: copy.deepcopy(items[i]),
    }
    results: dict[str, list[tuple[float, float]]] = {k: [] for k in [*parts, "store miss path", "read back"]}
    try:
        for r in range(args.rounds):
            for name, fn in parts.items():
                results[name].append(per_item(fn, n))
            store = SharedMemoryStore(f"breakdown{r}", n, shm_dir=shm_dir)
            results["store miss path"].append(
                per_item(lambda i: store.get_or_compute(i, lambda: items[i], reuse_computed=True), n)  # noqa: B023
            )
            results["read back"].append(per_item(lambda i: touch(store[i]), n))  # noqa: B023
            store.release()
    finally:
        shutil.rmtree(shm_dir, ignore_errors=True)
    mib = statistics.median(codec.item_nbytes(item) for item in items) / (1 << 20)
    rows = [["part", "CPU ms / item", "minor faults / item"]]
    for name, vals in results.items():
        cpu, faults = statistics.median(v[0] for v in vals), statistics.median(v[1] for v in vals)
        rows.append([name, f"{cpu:.1f}", f"{faults:.0f}"])
    print(
        f"fill_breakdown: {n} volumes of {bench_cache.shape_text(args.shape)} ({mib:.1f} MiB cached each), "
        f"crop {'x'.join(map(str, args.crop))}, one thread, medians of {args.rounds} interleaved passes; "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    print(format_table(rows, markdown=args.markdown, rule=True))


def small_items(n: int, rounds: int) -> list[list[str]]:
    """Rows of the small-item breakdown: CPU microseconds per item, medians over ``rounds`` interleaved passes.

    The miss path is timed alone (the same code again and again, its caches warm) and then as a DataLoader worker
    runs it: each miss followed by the random transform (``RandFlipd``), the two timed apart in the same loop."""
    import bench_scale
    from monai.transforms import RandFlipd

    make = bench_scale._make_transform()()
    flip = RandFlipd(keys="image", prob=0.5, spatial_axis=0)
    items = [make({"i": i}) for i in range(n)]
    shm_dir = tempfile.mkdtemp(prefix="monai_cache-bench-", dir=os.environ.get("MONAI_CACHE_SHM_DIR", "/dev/shm"))
    names = ("make a 16 KiB item (uncached read)", "random flip (every read)", "store miss path, alone",
             "store miss path, before each flip", "random flip, after each miss",
             "floor: its system calls alone, before each flip", "random flip, after each floor", "hit")
    results: dict[str, list[float]] = {name: [] for name in names}

    def then_flip(miss_path: Callable[[int], Any]) -> tuple[float, float]:
        miss = flipped = 0.0
        for i in range(n):
            t0 = time.thread_time()
            item = miss_path(i)
            t1 = time.thread_time()
            flip(dict(item))
            t2 = time.thread_time()
            miss, flipped = miss + t1 - t0, flipped + t2 - t1
        return miss / n * 1e3, flipped / n * 1e3

    def floor_path(fd: int, blob: bytes) -> Callable[[int], Any]:
        # What any cache shared by processes does per new entry, with no Python around it: lock the entry (an OFD
        # lock, and its release), write its bytes into fresh tmpfs pages, write its index slot.
        def miss(i: int) -> Any:
            ofd_lock(fd, 1 << 30 | i)
            os.pwrite(fd, blob, i * len(blob))
            os.pwrite(fd, blob[:32], (1 << 31) + 32 * i)
            ofd_unlock(fd, 1 << 30 | i)
            return items[i]

        return miss

    try:
        for r in range(rounds):
            results[names[0]].append(per_item(lambda i: make({"i": i}), n)[0])
            results[names[1]].append(per_item(lambda i: flip(dict(items[i])), n)[0])
            store = SharedMemoryStore(f"small{r}", n, shm_dir=shm_dir)
            results[names[2]].append(
                per_item(lambda i: store.get_or_compute(i, lambda: items[i], reuse_computed=True), n)[0]  # noqa: B023
            )
            results[names[7]].append(per_item(lambda i: store[i], n)[0])  # noqa: B023
            store.release()
            store = SharedMemoryStore(f"small-flip{r}", n, shm_dir=shm_dir)
            miss, flipped = then_flip(
                lambda i: store.get_or_compute(i, lambda: items[i], reuse_computed=True)  # noqa: B023
            )
            results[names[3]].append(miss)
            results[names[4]].append(flipped)
            store.release()
            fd = os.open(os.path.join(shm_dir, f"floor{r}"), os.O_RDWR | os.O_CREAT, 0o600)
            try:
                miss, flipped = then_flip(floor_path(fd, codec.encode(items[0]).to_bytes(data_crc=False)))
            finally:
                os.close(fd)
                os.unlink(os.path.join(shm_dir, f"floor{r}"))
            results[names[5]].append(miss)
            results[names[6]].append(flipped)
    finally:
        shutil.rmtree(shm_dir, ignore_errors=True)
    rows = [[f"{n:,} small items, one thread", "CPU us / item"]]
    for name, vals in results.items():
        rows.append([name, f"{statistics.median(vals) * 1e3:.1f}"])
    return rows


if __name__ == "__main__":
    sys.exit(main())
