#!/usr/bin/env python
"""MONAI's fast-training recipe: ``ToDeviced`` at the end of the cached chain, ``ThreadDataLoader(num_workers=0)``.
Stock MONAI against monai_cache, side by side in the same run: warm-epoch time, CPU and device memory.

MONAI's ``CacheDataset`` keeps every item resident on the device. monai_cache's keeps the machine's copy in shared
memory and, by default, each process's copy of an item on the device from its first read (``process_cache``);
``process_cache=False`` shows what a read costs without that tier (a host-to-device copy of the item per read).

On a machine without CUDA the items end on the CPU (``ToDeviced`` to ``cpu``), where the default keeps nothing:
``ours`` then runs with ``process_cache=True`` to measure the same path, and the table says so. Every
configuration is built and run ``--repeats`` times, alternating; the table gives medians and the ratio to MONAI:

* time to build the dataset (the eager fill), wall;
* the first epoch and the warm epochs (median over epochs 2..n and repeats), wall and CPU of this process;
* on CUDA: the peak device memory of a warm epoch (``torch.cuda.max_memory_allocated``).

Usage::

    python -m benchmarks device               # 16 volumes of 96x96x64, crops 64x64x32, 5 epochs, 3 repeats
    python -m benchmarks device --quick       # 8 volumes of 64x64x48, 3 epochs, 2 repeats

``--out``: ``device.md`` (what was printed) and ``device.json``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
import uuid

import harness  # the benchmarks' shared helpers (its neighbour here)

CONFIGS = ("monai", "ours", "ours-no-tier")


def run_config(config: str, files: list, device: str, epochs: int, crop: tuple) -> dict:
    import monai.data
    import torch
    from monai.transforms import ToDeviced

    import monai_cache
    from monai_cache.synthetic import tutorial_transforms

    transform = tutorial_transforms(spatial_size=crop, after=[ToDeviced(keys=["image", "label"], device=device)])
    on_gpu = device.startswith("cuda")
    started = time.perf_counter()
    if config == "monai":
        ds = monai.data.CacheDataset(files, transform, progress=False, num_workers=2)
    else:
        tier = (None if on_gpu else True) if config == "ours" else False
        ds = monai_cache.CacheDataset(files, transform, progress=False, num_workers=2, process_cache=tier)
    built = time.perf_counter() - started
    loader = monai.data.ThreadDataLoader(ds, batch_size=2, num_workers=0)
    walls, cpus, peaks = [], [], []
    for _ in range(epochs):
        if on_gpu:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        wall, cpu = time.perf_counter(), time.process_time()
        for batch in loader:
            batch["image"].sum().item()  # the training step's read of the batch (and a device synchronisation)
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
        peaks.append(torch.cuda.max_memory_allocated() if on_gpu else None)
    if config != "monai":
        ds.release()
    return {"build": built, "first": walls[0], "first_cpu": cpus[0], "warm": walls[1:], "warm_cpu": cpus[1:],
            "peak": peaks[1:]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--items", type=int, default=16)
    parser.add_argument("--shape", type=int, nargs=3, default=(96, 96, 64))
    parser.add_argument("--crop", type=int, nargs=3, default=(64, 64, 32))
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default=None, help="default: cuda:0 if there is one, else cpu")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=None, help="write device.md (what was printed) and device.json here")
    args = parser.parse_args()
    if args.quick:
        args.items, args.shape, args.crop, args.epochs, args.repeats = 8, (64, 64, 48), (32, 32, 16), 3, 2

    import torch

    from monai_cache.synthetic import make_dataset

    torch.set_num_threads(1)
    device = args.device or ("cuda:0" if torch.cuda.is_available() else "cpu")
    machine = harness.machine_info()
    work = tempfile.mkdtemp(prefix="bench-device-")
    shm_dir = f"/dev/shm/bench-device-{uuid.uuid4().hex[:8]}"
    os.makedirs(shm_dir)
    os.environ["MONAI_CACHE_SHM_DIR"] = shm_dir
    try:
        files = make_dataset(os.path.join(work, "ct"), items=args.items, shape=tuple(args.shape))
        runs: dict[str, list[dict]] = {c: [] for c in CONFIGS}
        for repeat in range(args.repeats):
            for config in CONFIGS if repeat % 2 == 0 else reversed(CONFIGS):
                runs[config].append(run_config(config, files, device, args.epochs, tuple(args.crop)))
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm_dir, ignore_errors=True)

    def med(config: str, key: str) -> float | None:
        values = [v for run in runs[config] for v in (run[key] if isinstance(run[key], list) else [run[key]])]
        return harness.median(values)

    rows = [("build (s)", "build"), ("first epoch (s)", "first"), ("first epoch CPU (s)", "first_cpu"),
            ("warm epoch (s)", "warm"), ("warm epoch CPU (s)", "warm_cpu")]  # fmt: skip
    if device.startswith("cuda"):
        rows.append(("warm peak device memory (MiB)", "peak"))
    ours_note = "" if device.startswith("cuda") else " (process_cache=True: the items end on the CPU)"
    rep = harness.Report("device")
    rep.machine(machine, at_end=True)
    rep.line(f"MONAI's fast-training recipe on {device}: {args.items} volumes {tuple(args.shape)}, crops "
             f"{tuple(args.crop)}, ThreadDataLoader(num_workers=0), {args.epochs} epochs x {args.repeats} repeats, "
             f"medians; ours{ours_note}")  # fmt: skip
    table = [["", *CONFIGS]]
    for label, key in rows:
        base = med("monai", key)
        cells = []
        for config in CONFIGS:
            value = med(config, key)
            scale = 1 / 2**20 if key == "peak" else 1.0
            text = "n/a" if value is None else f"{value * scale:.3f}"
            if config != "monai" and value is not None and base:
                text += f" ({value / base:.2f}x)"
            cells.append(text)
        table.append([label, *cells])
    rep.table(table)
    if args.out:
        rep.save(args.out, {"machine": machine, "device": device, "runs": runs})


if __name__ == "__main__":
    main()
