#!/usr/bin/env python
"""``monai-cache plan``: how long it takes and how far its projection is from what the caches then hold, on the
benchmark datasets, beside the time stock MONAI takes to find out by building its cache (in the same run).

Datasets (the tutorial's chain, :mod:`monai_cache.synthetic`):

* ``ct``: the synthetic CT volumes of ``bench_cache.py`` (24 of 160x160x96; ``--quick``: 12 of 96x96x64);
* ``varied``: as many volumes of varying shapes (a third to the whole of that shape, per axis) and spacings
  (0.8-2.5 mm), so that the cached sizes vary;

For each: ``plan_dataset`` with its defaults (8 items, 60 s at most), wall and CPU seconds; then the truth: a
``monai_cache.CacheDataset`` filled (shared-memory bytes) and a ``monai_cache.PersistentDataset`` read once (disk
bytes); and ``monai.data.CacheDataset`` built, the time MONAI takes to show what the cache holds. ``--repeats``
runs, medians. The table gives the plan's time as a ratio of MONAI's build, and the projection's error.

Usage::

    python -m benchmarks plan                # 24 volumes of 160x160x96, 3 repeats
    python -m benchmarks plan --quick        # 12 volumes of 96x96x64, 2 repeats

``--out``: ``plan.md`` (what was printed) and ``plan.json``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
import uuid

import harness  # the benchmarks' shared helpers (its neighbour here)


def varied_dataset(root: str, items: int, shape: tuple[int, int, int], seed: int = 0) -> list[dict]:
    """``items`` CT-like image/label pairs whose shapes and spacings vary (written with nibabel)."""
    import nibabel as nib
    import numpy as np

    rng = np.random.default_rng(seed)
    os.makedirs(root, exist_ok=True)
    data = []
    for i in range(items):
        size = tuple(int(rng.integers(max(8, s // 3), s + 1)) for s in shape)
        affine = np.diag([*(float(x) for x in rng.uniform(0.8, 2.5, 3)), 1.0])
        body = rng.normal(40, 30, size).astype(np.int16)
        image, label = os.path.join(root, f"img_{i:03d}.nii.gz"), os.path.join(root, f"lab_{i:03d}.nii.gz")
        nib.save(nib.Nifti1Image(body, affine), image)
        nib.save(nib.Nifti1Image((body > 60).astype(np.uint8), affine), label)
        data.append({"image": image, "label": label})
    return data


def measure(data: list, crop: tuple[int, int, int], work: str) -> dict:
    import monai.data

    import monai_cache
    from monai_cache.plan import plan_dataset
    from monai_cache.synthetic import tutorial_transforms

    chain = tutorial_transforms(spatial_size=crop)
    lazy = monai_cache.CacheDataset(data, chain, runtime_cache=True, progress=False)
    wall, cpu = time.perf_counter(), time.process_time()
    memory_plan = plan_dataset(lazy)
    plan_wall, plan_cpu = time.perf_counter() - wall, time.process_time() - cpu
    lazy.release()
    disk_dir = os.path.join(work, f"disk-{uuid.uuid4().hex[:6]}")
    disk = monai_cache.PersistentDataset(data, chain, cache_dir=disk_dir)
    disk_plan = plan_dataset(disk)

    wall = time.perf_counter()
    filled = monai_cache.CacheDataset(data, chain, progress=False)
    ours_build = time.perf_counter() - wall
    memory_truth = filled.cache_stats()["stored"]["bytes"]
    filled.release()
    for i in range(len(data)):
        disk[i]
    disk.flush()
    disk_truth = disk.cache_stats()["stored"]["bytes"]
    shutil.rmtree(disk_dir, ignore_errors=True)
    wall = time.perf_counter()
    theirs = monai.data.CacheDataset(data, chain, progress=False)
    monai_build = time.perf_counter() - wall
    del theirs
    return {
        "plan_wall": plan_wall, "plan_cpu": plan_cpu, "monai_build": monai_build, "ours_build": ours_build,
        "memory_error": memory_plan.memory.total / memory_truth - 1,
        "disk_error": disk_plan.disk.total / disk_truth - 1,
        "memory_in_band": memory_plan.memory.low <= memory_truth <= memory_plan.memory.high,
        "sampled": len(memory_plan.sampled), "model": memory_plan.models.get("memory"), "memory_truth": memory_truth,
        "disk_truth": disk_truth,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--items", type=int, default=24)
    parser.add_argument("--shape", type=int, nargs=3, default=(160, 160, 96))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=None, help="write plan.md (what was printed) and plan.json here")
    args = parser.parse_args()
    if args.quick:
        args.items, args.shape, args.repeats = 12, (96, 96, 64), 2
    import torch

    from monai_cache.synthetic import make_dataset

    torch.set_num_threads(1)
    machine = harness.machine_info()
    work = tempfile.mkdtemp(prefix="bench-plan-")
    shm_dir = f"/dev/shm/bench-plan-{uuid.uuid4().hex[:8]}"
    os.makedirs(shm_dir)
    os.environ["MONAI_CACHE_SHM_DIR"] = shm_dir
    crop = (16, 16, 16)  # the random crop runs on every read of the disk cache; it changes nothing cached
    results: dict[str, list[dict]] = {}
    try:
        datasets = {
            "ct": make_dataset(os.path.join(work, "ct"), items=args.items, shape=tuple(args.shape)),
            "varied": varied_dataset(os.path.join(work, "varied"), args.items, tuple(args.shape)),
        }
        for repeat in range(args.repeats):
            for name, data in datasets.items():
                results.setdefault(name, []).append(measure(data, crop, work))
                print(f"repeat {repeat + 1}/{args.repeats} {name} done", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm_dir, ignore_errors=True)

    rep = harness.Report("plan")
    rep.machine(machine, at_end=True)
    rep.line(f"monai-cache plan on {args.items} volumes of {tuple(args.shape)} (tutorial chain, crops {crop}), "
             f"{args.repeats} repeats, medians; plan_dataset's defaults (8 items, 60 s at most); plan / MONAI build: "
             "median of the per-repeat ratios")  # fmt: skip
    rows = [["dataset", "plan wall s", "plan CPU s", "MONAI CacheDataset build s", "plan / MONAI build",
             "shared-memory error", "disk error", "truth in the 95% band", "projected by"]]
    for name, runs in results.items():
        def med(key: str, runs: list[dict] = runs) -> float:
            return float(harness.median([r[key] for r in runs]) or 0.0)

        ratio = harness.median(harness.ratios([r["plan_wall"] for r in runs], [r["monai_build"] for r in runs]))
        inside = sum(r["memory_in_band"] for r in runs)
        rows.append([name, f"{med('plan_wall'):.1f}", f"{med('plan_cpu'):.1f}", f"{med('monai_build'):.1f}",
                     f"{ratio or 0:.2f}x", f"{med('memory_error'):+.1%}", f"{med('disk_error'):+.1%}",
                     f"{inside}/{len(runs)}", runs[0]["model"]])  # fmt: skip
    rep.table(rows)
    if args.out:
        rep.save(args.out, {"machine": machine, "runs": results})


if __name__ == "__main__":
    main()
