#!/usr/bin/env python
"""Where a small item's miss goes: a sampling profile (py-spy) of the shared-memory store's miss path, by part.

``fill_breakdown.py`` times the parts of a miss one by one; this samples the whole miss path as it runs, so the
parts add up to it and nothing is timed twice. It runs ``SharedMemoryStore.get_or_compute`` on ``bench_scale.py``'s
16 KiB images (computed beforehand: only the store's own work is sampled), one new entry after another on fresh
caches, for ``--seconds``: once alone, measuring the CPU per miss (``time.thread_time``), then under ``py-spy record``
(which pauses the process for each sample, slowing it), and prints each part's share of the samples taken inside
the miss path and the CPU microseconds per miss it stands for (the share times the CPU per miss of the run alone).

Parts, by the outermost store function on the sampled stack below ``get_or_compute``:

* ``encode``: ``codec.encode``, the JSON header and byte views of the buffers (no copy);
* ``shared counters and room``: ``_reserve_space`` (one locked update of the counters, the budget and room check);
* ``write into the segment``: ``CacheDirectory.append`` (``posix_fallocate`` + ``pwritev`` into fresh tmpfs pages);
* ``publish the slot``: ``CacheDirectory.write_slot`` and the entry's tag;
* ``entry lock``: taking and releasing the entry's OFD lock (open, ``fcntl`` twice, close);
* ``read under the lock``: the look for an entry published meanwhile (one ``pread`` of the slot);
* ``raw size``: ``codec.item_nbytes`` (the ``bytes_raw`` counter);
* ``the rest``: the store's own lines (checks, dicts, calls).

Usage::

    pip install py-spy
    python benchmarks/profile_miss.py                 # 20 s of misses alone, then 20 s under py-spy
    python benchmarks/profile_miss.py --seconds 5
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from monai_cache.utils import format_table  # noqa: E402

# (part, what marks it on a stack below get_or_compute): the first part whose marker a frame holds names the sample
PARTS = (
    ("encode", "encode (monai_cache/codec.py"),
    ("shared counters and room", "_reserve_space"),
    ("write into the segment", "CacheDirectory.append"),
    ("publish the slot", "write_slot"),
    ("entry lock", "OFDLock"),
    ("read under the lock", "_read (monai_cache/shm.py"),
    ("raw size", "item_nbytes"),
)


def child(seconds: float, items: int, result: str) -> None:
    """The profiled loop: misses of pre-computed items on fresh caches for ``seconds``; writes CPU us per miss."""
    import bench_scale
    import torch

    from monai_cache.shm import SharedMemoryStore

    torch.set_num_threads(1)
    make = bench_scale._make_transform()()
    values = [make({"i": i}) for i in range(items)]
    shm_dir = tempfile.mkdtemp(prefix="monai_cache-profile-", dir=os.environ.get("MONAI_CACHE_SHM_DIR", "/dev/shm"))
    misses, cpu, rounds = 0, 0.0, 0
    try:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            store = SharedMemoryStore(f"miss{rounds}", items, shm_dir=shm_dir)
            t0 = time.thread_time()
            for i in range(items):
                store.get_or_compute(i, lambda i=i: values[i], reuse_computed=True, missing=True)
            cpu += time.thread_time() - t0
            misses += items
            store.release()
            rounds += 1
    finally:
        shutil.rmtree(shm_dir, ignore_errors=True)
    with open(result, "w") as f:
        json.dump({"misses": misses, "cpu_us_per_miss": cpu / misses * 1e6}, f)


def parts_of(raw_path: str) -> tuple[collections.Counter, int]:
    """Samples per part (py-spy's raw format: one stack per line, frames joined by ';', then the count)."""
    counts: collections.Counter = collections.Counter()
    total = 0
    with open(raw_path) as f:
        for line in f:
            stack, _, n = line.rstrip("\n").rpartition(" ")
            frames = stack.split(";")
            below = [k for k, frame in enumerate(frames) if frame.startswith("SharedMemoryStore.get_or_compute (")]
            if not below or not n.isdigit():
                continue
            total += int(n)
            inner = frames[below[0] + 1:]
            part = next((name for frame in inner for name, mark in PARTS if mark in frame), "the rest")
            counts[part] += int(n)
    return counts, total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--items", type=int, default=4000, help="entries per cache")
    parser.add_argument("--rate", type=int, default=2000, help="samples a second")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.seconds, args.items, args.child)
        return 0
    py_spy = shutil.which("py-spy")
    if py_spy is None:
        raise SystemExit("py-spy is not installed: pip install py-spy")
    work = tempfile.mkdtemp(prefix="profile_miss-")
    loop = [sys.executable, os.path.abspath(__file__), "--seconds", str(args.seconds), "--items", str(args.items)]
    try:
        raw, plain, profiled = (os.path.join(work, name) for name in ("samples.txt", "plain.json", "profiled.json"))
        # First the loop alone (what a miss costs), then under py-spy (where it goes). py-spy pauses the process
        # for each sample (its default: --nonblocking reads the stacks of a running process, and they came out
        # torn, frames of one call under another), which slows the loop, so the shares are taken from the
        # profiled run and the microseconds from the plain one.
        subprocess.run([*loop, "--child", plain], check=True)
        subprocess.run([py_spy, "record", "--format", "raw", "-r", str(args.rate), "-o", raw, "--", *loop,
                        "--child", profiled], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        measured = {}
        for name, path in (("plain", plain), ("profiled", profiled)):
            with open(path) as f:
                measured[name] = json.load(f)
        counts, total = parts_of(raw)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if not total:
        raise SystemExit("no sample fell inside the miss path")
    per_miss = measured["plain"]["cpu_us_per_miss"]
    print(f"profile_miss: {measured['plain']['misses']:,} misses of 16 KiB items, {per_miss:.1f} CPU us each "
          f"(time.thread_time; {measured['profiled']['cpu_us_per_miss']:.1f} under py-spy, {total:,} samples "
          f"inside the miss path); load average {os.getloadavg()[0]:.1f}")
    rows = [["part of the miss path", "share of samples", "CPU us / miss"]]
    for name in [p for p, _ in PARTS] + ["the rest"]:
        share = counts[name] / total
        rows.append([name, f"{share:.1%}", f"{share * per_miss:.1f}"])
    print(format_table(rows, left=1, rule=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
