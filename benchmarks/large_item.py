"""Peak memory and time of storing one large item and reading it back, in a process of its own.

Usage::

    python benchmarks/large_item.py MODE SIZE_BYTES WHERE

``MODE`` is one of ``shm`` (a ``SharedMemoryStore`` in the tmpfs directory ``WHERE``), ``raw`` (a
``DiskStore`` in ``WHERE`` without compression), ``zstd`` (compressed) or ``zstd-downcast`` (compressed, with
lossless downcasting of an integral float32 volume, as CT intensities are: the check passes and an int16
copy is stored). The other modes store a random float32 tensor, which nothing downcasts.

Prints one JSON line: ``mode``, ``write_x`` and ``read_x`` (growth of the peak RSS over the RSS before the
item was made, while writing and while reading, as multiples of the item's size: the item itself counts 1),
``write_s`` and ``read_s`` (seconds), and ``same`` (the item read back holds the bytes written).

Run as a script by ``benchmarks/bench_scale.py`` (the 2 GiB item) and ``tests/test_scale.py`` (256 MiB), so
that each measurement starts from a fresh process and its peak RSS is its own. Linux only (``/proc``).
"""

from __future__ import annotations

import gc
import json
import sys
import time
import zlib

import torch

from monai_cache.disk import DiskStore
from monai_cache.shm import SharedMemoryStore

MODES = ("shm", "raw", "zstd", "zstd-downcast")


def rss() -> dict[str, int]:
    """``VmRSS`` and ``VmHWM`` (the peak since the last reset) of this process, in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, v = line.split(":", 1)
            if k in ("VmHWM", "VmRSS"):
                out[k] = int(v.split()[0]) * 1024
    return out


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def measure(mode: str, size: int, where: str) -> dict:
    if mode not in MODES:
        raise SystemExit(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    torch.set_num_threads(1)
    gc.collect()
    base = rss()["VmRSS"]
    g = torch.Generator().manual_seed(0)
    if mode == "zstd-downcast":
        item = {"image": torch.randint(-1000, 3000, (size // 4,), generator=g, dtype=torch.int32).float()}
    else:
        item = {"image": torch.rand(size // 4, generator=g)}
    crc = zlib.crc32(item["image"].numpy())
    gc.collect()
    reset_peak()  # from here on: the item, and what storing it adds (not the temporaries that made it)
    t = time.perf_counter()
    if mode == "shm":
        store: SharedMemoryStore | DiskStore = SharedMemoryStore("large", 1, shm_dir=where)
        store[0] = item
    else:
        store = DiskStore(where, compression=None if mode == "raw" else "zstd", downcast=mode == "zstd-downcast",
                          max_pending_bytes=size // 2)
        store.put("large", item)
        if not store.flush(600):
            raise SystemExit("the write did not finish within 600 s")
    write_s = time.perf_counter() - t
    write_peak = rss()["VmHWM"] - base
    del item
    gc.collect()
    reset_peak()
    base = rss()["VmRSS"]
    t = time.perf_counter()
    got = store[0] if isinstance(store, SharedMemoryStore) else store.get("large")
    read_s = time.perf_counter() - t
    same = zlib.crc32(got["image"].numpy()) == crc
    read_peak = rss()["VmHWM"] - base
    return {"mode": mode, "write_x": write_peak / size, "read_x": read_peak / size, "write_s": write_s,
            "read_s": read_s, "same": same}


if __name__ == "__main__":
    if len(sys.argv) != 4:
        raise SystemExit(__doc__)
    print(json.dumps(measure(sys.argv[1], int(sys.argv[2]), sys.argv[3])))
