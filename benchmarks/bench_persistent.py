"""monai_cache.PersistentDataset vs MONAI's PersistentDataset, measured side by side in one run.

Usage::

    python -m benchmarks persistent                # ~160x160x96 volumes (a few minutes on 2 cores)
    python -m benchmarks persistent --quick        # small volumes, well under a minute

What it does, on the main job's data (``monai_cache.synthetic``: the CT-like volumes and the chain of
MONAI's 3-D segmentation tutorials that ``monai-cache demo`` trains on: LoadImaged, EnsureChannelFirstd,
Orientationd, Spacingd, ScaleIntensityRanged(clip=True), RandCropByPosNegLabeld; ``--data quantized``: the
simpler volumes of :func:`make_volumes`, whose resampled values repeat exactly and compress much better),
with a ``monai.data.DataLoader`` of ``--workers`` worker processes in a single process:

1. bytes on disk per item: the ``.nii.gz`` sources, MONAI's ``torch.save`` files, ours (lossless default,
   other zstd levels, no compression, no downcasting, lossy float16 images);
2. epoch times (wall and CPU seconds, CPU including the workers): uncached ``monai.data.Dataset``; MONAI
   and ours cold (first epoch, empty cache directory: for ours the epoch ends when the workers have
   flushed their writes); MONAI and ours warm;
3. the time a cache miss spends in ``__getitem__`` when the store is slow (an artificial delay added to
   every file write), ours asynchronous vs synchronous;
4. per zstd level: write and read time per item (single thread), to choose the default level.

Medians over ``--repeats`` repeats (interleaved, so drift of a shared machine hits every variant alike).
This is not a test: nothing is asserted, targets are printed next to the measurements.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import warnings
import zlib
from collections.abc import Callable
from typing import Any

import nibabel as nib
import numpy as np
import torch

warnings.filterwarnings("ignore")

import harness  # noqa: E402  # the benchmarks' shared helpers (its neighbour here)
from monai.data import DataLoader, Dataset  # noqa: E402
from monai.data import PersistentDataset as MonaiPersistentDataset  # noqa: E402
from monai.transforms import (  # noqa: E402
    Compose,
    EnsureChannelFirstd,
    LoadImaged,
    Orientationd,
    RandCropByPosNegLabeld,
    ScaleIntensityRanged,
    Spacingd,
)

from monai_cache import codec, disk, disk_format, disk_writer  # noqa: E402
from monai_cache.persistent import DEFAULT_COMPRESSION_LEVEL, PersistentDataset  # noqa: E402
from monai_cache.synthetic import crop_size_for, make_dataset, tutorial_transforms  # noqa: E402

KEYS = ("image", "label")
COLD_MAX = 1.03  # the target: a cold epoch at most this times an uncached one (median of per-repeat ratios)


# ------------------------------------------------------------------------------------------------ data
def make_volumes(directory: str, items: int, shape: tuple[int, int, int], seed: int = 0) -> list[dict]:
    """CT-like int16 images (air -1000 HU, a noisy elliptic body, 4 blobs) and uint8 labels, 1x1x2 mm voxels."""
    os.makedirs(directory, exist_ok=True)
    rng = np.random.default_rng(seed)
    zz, yy, xx = np.ogrid[: shape[0], : shape[1], : shape[2]]
    body = ((zz - shape[0] / 2) / (shape[0] * 0.42)) ** 2 + ((yy - shape[1] / 2) / (shape[1] * 0.35)) ** 2 < 1
    body = np.broadcast_to(body, shape)
    out = []
    for i in range(items):
        img = np.full(shape, -1000, np.int16)
        lab = np.zeros(shape, np.uint8)
        img[body] = 40
        for k in range(4):
            c = rng.integers(np.array(shape) // 4, 3 * np.array(shape) // 4)
            r = int(rng.integers(max(3, shape[0] // 25), max(4, shape[0] // 11)))
            m = (zz - c[0]) ** 2 + (yy - c[1]) ** 2 + ((xx - c[2]) * 2) ** 2 < r * r
            img[m] = int(rng.integers(60, 200))
            lab[m] = k % 2 + 1
        noise = rng.normal(0, 12, shape).astype(np.int16)
        img = np.where(body, img + noise, img).astype(np.int16)
        affine = np.diag([1.0, 1.0, 2.0, 1.0])
        ip, lp = os.path.join(directory, f"img{i}.nii.gz"), os.path.join(directory, f"lab{i}.nii.gz")
        nib.save(nib.Nifti1Image(img, affine), ip)
        nib.save(nib.Nifti1Image(lab, affine), lp)
        out.append({"image": ip, "label": lp})
    return out


DATA = "main"  # which data and chain: "main" (the demo's) or "quantized" (make_volumes); set by --data


def make_data(directory: str, items: int, shape: tuple[int, int, int]) -> list[dict]:
    """The benchmark's volumes: the main job's (``monai_cache.synthetic``, as ``monai-cache demo`` uses) or,
    with ``--data quantized``, :func:`make_volumes`."""
    if DATA == "main":
        return make_dataset(directory, items, shape)
    return make_volumes(directory, items, shape)


def make_chain(crop: tuple[int, int, int]) -> Compose:
    """The tutorial chain: ``monai_cache.synthetic.tutorial_transforms`` for the main job's data."""
    if DATA == "main":
        return tutorial_transforms(crop)
    return Compose(
        [
            LoadImaged(keys=KEYS),
            EnsureChannelFirstd(keys=KEYS),
            Orientationd(keys=KEYS, axcodes="RAS", labels=None),
            Spacingd(keys=KEYS, pixdim=(1.5, 1.5, 2.0), mode=("bilinear", "nearest")),
            ScaleIntensityRanged(keys="image", a_min=-57, a_max=164, b_min=0.0, b_max=1.0, clip=True),
            RandCropByPosNegLabeld(keys=KEYS, label_key="label", spatial_size=crop, num_samples=2),
        ]
    )


# ------------------------------------------------------------------------------------------- timing
def run_epoch(ds: Any, workers: int) -> tuple[float, float]:
    """Wall and CPU seconds of one epoch (workers are started and joined inside: their CPU is counted)."""
    loader = DataLoader(ds, batch_size=2, num_workers=workers, shuffle=False, persistent_workers=False)
    c0, t0 = harness.own_cpu_seconds(), time.perf_counter()
    for _ in loader:
        pass
    del loader
    return time.perf_counter() - t0, harness.own_cpu_seconds() - c0


def evict(directory: str) -> None:
    """Drop the files of ``directory`` from the page cache (fsync, then POSIX_FADV_DONTNEED): a cold read."""
    for e in os.scandir(directory):
        fd = os.open(e.path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def measure_epochs(data: list, crop: tuple, workers: int, repeats: int, root: str, warm: bool = True) -> dict:
    """Medians (wall, CPU) of: uncached epochs, cold first epochs (order rotated per repeat), warm epochs
    with the cache files in the page cache and evicted from it."""
    names = ["uncached", "ours_nocache", "monai_cold", "ours_cold"]
    if warm:
        names += ["monai_warm", "ours_warm", "monai_warm_evicted", "ours_warm_evicted"]
    t: dict[str, list[tuple[float, float]]] = {k: [] for k in names}
    for r in range(repeats):
        mdir, odir = os.path.join(root, f"monai{r}"), os.path.join(root, f"ours{r}")
        jobs: list[tuple[str, Callable[[], Any]]] = [
            ("uncached", lambda: Dataset(data, make_chain(crop))),
            ("ours_nocache", lambda: PersistentDataset(data, make_chain(crop), None)),
            ("monai_cold", lambda d=mdir: MonaiPersistentDataset(data, make_chain(crop), d)),
            ("ours_cold", lambda d=odir: PersistentDataset(data, make_chain(crop), d)),
        ]
        jobs = jobs[r % len(jobs) :] + jobs[: r % len(jobs)]
        for name, build in jobs:
            t[name].append(run_epoch(build(), workers))
        assert len(list(disk_format.stored_entries(odir))) == len(data), "writes not flushed"
    if warm:
        mdir, odir = os.path.join(root, "monai0"), os.path.join(root, "ours0")
        for r in range(repeats):
            pair = [("monai", MonaiPersistentDataset, mdir), ("ours", PersistentDataset, odir)]
            for name, cls, d in pair if r % 2 == 0 else pair[::-1]:
                t[f"{name}_warm"].append(run_epoch(cls(data, make_chain(crop), d), workers))
            for name, cls, d in pair if r % 2 == 0 else pair[::-1]:
                evict(d)
                t[f"{name}_warm_evicted"].append(run_epoch(cls(data, make_chain(crop), d), workers))
    out = {k: {"wall": harness.median(w for w, _ in v), "cpu": harness.median(c for _, c in v)} for k, v in t.items()}
    # Paired ratios: each repeat ran every cold variant back to back, so the ratio within a repeat cancels the
    # slow drifts of a shared machine; their median is the steadier figure for a target of a few percent.
    out["paired"] = {  # type: ignore[assignment]
        f"{a}/{b}": harness.median([x[0] / y[0] for x, y in zip(t[a], t[b])])
        for a, b in (("ours_cold", "uncached"), ("monai_cold", "uncached"), ("ours_cold", "ours_nocache"),
                     ("ours_cold", "monai_cold"))
    }
    out["raw"] = {k: [[round(w, 4), round(c, 4)] for w, c in v] for k, v in t.items()}  # type: ignore[assignment]
    out["workers"] = workers  # type: ignore[assignment]
    return out


def dir_bytes(path: str, suffix: str) -> int:
    """Bytes of the files ending in ``suffix``; for ours (``".mcache"``), also small entries' packs and indexes."""
    ours = suffix == disk_format.ENTRY_SUFFIX
    suffixes = (suffix, disk_format.PACK_SUFFIX, disk_format.INDEX_SUFFIX) if ours else (suffix,)
    return sum(e.stat().st_size for e in os.scandir(path) if e.name.endswith(suffixes))


# --------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small volumes and few repeats (well under a minute)")
    ap.add_argument("--items", type=int, help="number of volumes (default 24, quick 6)")
    ap.add_argument("--repeats", type=int, help="repeats of every epoch measurement (default 3)")
    ap.add_argument("--workers", type=int, default=2, help="DataLoader worker processes (default 2)")
    ap.add_argument("--delay", type=float, default=0.25, help="artificial delay per file write, 'slow store' (s)")
    ap.add_argument("--json", help="also write the results to this JSON file")
    ap.add_argument("--out", help="write persistent.md (what was printed) and persistent.json here")
    ap.add_argument(
        "--no-spare-core", action="store_true", help="skip the cold epochs with one worker fewer than CPUs"
    )
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory")
    ap.add_argument(
        "--data", choices=("main", "quantized"), default="main",
        help="main: the main job's volumes and chain (monai_cache.synthetic, as `monai-cache demo`); quantized: "
        "simpler volumes whose resampled values repeat exactly (the earlier benchmark's data)",
    )
    args = ap.parse_args(argv)
    global DATA
    DATA = args.data
    shape = (64, 64, 40) if args.quick else (160, 160, 96)
    if DATA == "main":
        crop = crop_size_for(shape)
    else:
        crop = (32, 32, 16) if args.quick else (64, 64, 48)
    items = args.items or (6 if args.quick else 24)
    repeats = args.repeats or 3
    levels = [-5, -1, 1, 3, 6] if args.quick else [-10, -5, -3, -1, 1, 2, 3, 6]

    root = tempfile.mkdtemp(prefix="bench_persistent_")
    rep = harness.Report("persistent")
    results: dict[str, Any] = {
        "machine": harness.machine_info(),
        "shape": shape,
        "items": items,
        "repeats": repeats,
        "workers": args.workers,
        "data": DATA,
    }
    try:
        data = make_data(os.path.join(root, "data"), items, shape)
        src = sum(os.path.getsize(v) for d in data for v in d.values()) / items
        rep.machine(results["machine"])
        rep.line(f"{items} items of {shape} voxels ({DATA} data), {args.workers} DataLoader workers, {repeats} repeats")

        # ---- epochs
        run_epoch(Dataset(data[:2], make_chain(crop)), args.workers)  # warm-up: page cache, lazy imports
        epochs = measure_epochs(data, crop, args.workers, repeats, os.path.join(root, "main"))
        results["epochs"] = epochs
        spare = (os.cpu_count() or 1) - 1
        if not args.no_spare_core and 1 <= spare < args.workers:
            results["epochs_spare_core"] = measure_epochs(
                data, crop, spare, repeats, os.path.join(root, "spare"), warm=False
            )
        mdir, odir = os.path.join(root, "main", "monai0"), os.path.join(root, "main", "ours0")

        # ---- sizes (and per-level write/read speed) from the preprocessed items
        monai_b = dir_bytes(mdir, ".pt") / items
        ours_b = dir_bytes(odir, ".mcache") / items
        reader = PersistentDataset(data, make_chain(crop), odir)
        pre = [reader._cachecheck(d) for d in data]
        variants: list[tuple[str, dict]] = [("no compression", {"compression": None})]
        variants += [(f"zstd {lv}", {"compression_level": lv}) for lv in levels]
        variants += [
            (f"zstd {DEFAULT_COMPRESSION_LEVEL}, no downcast", {"downcast": False}),
            (f"zstd {DEFAULT_COMPRESSION_LEVEL}, lossy image float16", {"lossy": {"image": torch.float16}}),
        ]
        torch.set_num_threads(1)
        sizes = []
        for name, kw in variants:
            vdir = os.path.join(root, "v-" + name.replace(" ", "_").replace(",", ""))
            os.makedirs(vdir)
            store = disk.DiskStore(vdir, async_writes=False, **kw)
            walls, cpus = [], []
            for i, item in enumerate(pre):
                c0, t0 = time.process_time(), time.perf_counter()
                store.write(f"k{i}", item)
                walls.append(time.perf_counter() - t0)
                cpus.append(time.process_time() - c0)
            w_wall, w_cpu = harness.median(walls), harness.median(cpus)
            rounds = []
            for _ in range(5):
                t0 = time.perf_counter()
                for i in range(items):
                    store.get(f"k{i}")
                rounds.append((time.perf_counter() - t0) / items)
            r_wall = harness.median(rounds)
            st = store.stats()["process"]
            # zstd alone, best of 5 per item (robust to other load on a shared machine)
            zc = zd = 0.0
            if store.compression:
                import zstandard

                cctx = zstandard.ZstdCompressor(level=store.compression_level)
                dctx = zstandard.ZstdDecompressor()
                for item in pre:
                    blob = codec.encode(item, downcast=store.downcast, lossy=store.lossy).to_bytes()
                    best_c = best_d = float("inf")
                    for _ in range(5):
                        t0 = time.perf_counter()
                        comp = cctx.compress(blob)
                        best_c = min(best_c, time.perf_counter() - t0)
                        out = np.empty(len(blob), np.uint8)
                        t0 = time.perf_counter()
                        dctx.stream_reader(comp).readinto(out.data)
                        best_d = min(best_d, time.perf_counter() - t0)
                    zc += best_c / items
                    zd += best_d / items
            sizes.append(
                {
                    "variant": name,
                    "bytes": dir_bytes(vdir, ".mcache") / items,
                    "write_s": w_wall,
                    "write_cpu_s": w_cpu,
                    "read_s": r_wall,
                    "read_GBps": st["bytes_raw"] / items / r_wall / 1e9,
                    "zstd_compress_s": zc,
                    "zstd_decompress_s": zd,
                }
            )
            shutil.rmtree(vdir)
        results["bytes"] = {"nii.gz": src, "monai": monai_b, "ours_default": ours_b, "variants": sizes}

        # MONAI's read of one of its files, for comparison with the per-level read times
        pts = sorted(e.path for e in os.scandir(mdir) if e.name.endswith(".pt"))
        rounds = []
        for _ in range(5):
            t0 = time.perf_counter()
            for p in pts:
                torch.load(p, weights_only=True)
            rounds.append((time.perf_counter() - t0) / len(pts))
        results["monai_read_s"] = harness.median(rounds)

        # checksum speed (why CRC-32): over one default-level payload and one uncompressed blob
        blob = bytes(codec.encode(pre[0], downcast=True).to_bytes())
        cs = {}
        for fn_name, fn in (("crc32", zlib.crc32), ("adler32", zlib.adler32)):
            t0 = time.perf_counter()
            for _ in range(5):
                fn(blob)
            cs[fn_name] = 5 * len(blob) / (time.perf_counter() - t0) / 1e9
        results["checksum_GBps"] = cs

        # ---- slow store: time in __getitem__ on a miss, async vs sync, fast vs slow writes
        original = disk_writer.write_record
        slow_rows = []
        for delay in (0.0, args.delay):

            def slowed(*a: Any, _d: float = delay, **k: Any) -> int:
                time.sleep(_d)
                return original(*a, **k)

            disk_writer.write_record = slowed  # type: ignore[assignment]
            for async_writes in (True, False):
                sdir = tempfile.mkdtemp(dir=root)
                ds = PersistentDataset(data, make_chain(crop), sdir, async_writes=async_writes)
                times = []
                for i in range(min(items, 4)):
                    t0 = time.perf_counter()
                    ds[i]
                    times.append(time.perf_counter() - t0)
                ds.flush()
                slow_rows.append({"delay": delay, "async": async_writes, "miss_s": harness.median(times)})
            disk_writer.write_record = original  # type: ignore[assignment]
        results["slow_store"] = slow_rows
        torch.set_num_threads(os.cpu_count() or 1)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
        else:
            print("kept", root, file=sys.stderr)

    results["loadavg_end"] = os.getloadavg()
    report(results, rep)
    if args.out:
        rep.save(args.out, results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


EPOCH_ROWS = (  # label, key, reference of "wall / MONAI"
    ("uncached monai Dataset", "uncached", None),
    ("ours, cache_dir=None", "ours_nocache", None),
    ("MONAI cold (1st epoch)", "monai_cold", "monai_cold"),
    ("ours cold (1st epoch)", "ours_cold", "monai_cold"),
    ("MONAI warm", "monai_warm", "monai_warm"),
    ("ours warm", "ours_warm", "monai_warm"),
    ("MONAI warm, files not cached", "monai_warm_evicted", "monai_warm_evicted"),
    ("ours warm, files not cached", "ours_warm_evicted", "monai_warm_evicted"),
)


def epochs_table(rep: harness.Report, e: dict, repeats: int, note: str = "") -> None:
    rep.heading(f"Epochs ({e['workers']} DataLoader workers{'; ' + note if note else ''}; medians of {repeats})")
    rows = [["epoch", "wall s", "CPU s", "wall / uncached", "wall / MONAI"]]
    for label, k, ref in EPOCH_ROWS:
        if k in e:
            vs_monai = f"{e[k]['wall'] / e[ref]['wall']:.2f}" if ref else ""
            wall, cpu, uncached = e[k]["wall"], e[k]["cpu"], e["uncached"]["wall"]
            rows.append([label, f"{wall:.2f}", f"{cpu:.2f}", f"{wall / uncached:.2f}", vs_monai])
    rep.table(rows)


def report(res: dict, rep: harness.Report) -> None:
    b = res["bytes"]
    e = res["epochs"]
    rep.heading("Bytes on disk per item")
    rows = [["stored as", "MB/item", "x .nii.gz", "x MONAI", "write/item", "read/item", "read GB/s", "zstd c/d (best)"]]
    rows.append([".nii.gz sources", f"{b['nii.gz'] / 1e6:.3f}", "1.00", f"{b['nii.gz'] / b['monai']:.3f}", "", "", "",
                 ""])  # fmt: skip
    rows.append(["MONAI torch.save", f"{b['monai'] / 1e6:.3f}", f"{b['monai'] / b['nii.gz']:.2f}", "1.000", "",
                 f"{res['monai_read_s'] * 1e3:.1f} ms", "", ""])  # fmt: skip
    rows.append([f"ours default (zstd {DEFAULT_COMPRESSION_LEVEL}, lossless)", f"{b['ours_default'] / 1e6:.3f}",
                 f"{b['ours_default'] / b['nii.gz']:.2f}", f"{b['ours_default'] / b['monai']:.3f}", "", "", "", ""])
    for v in b["variants"]:
        zc, zd = v["zstd_compress_s"] * 1e3, v["zstd_decompress_s"] * 1e3
        rows.append([
            "  " + v["variant"], f"{v['bytes'] / 1e6:.3f}", f"{v['bytes'] / b['nii.gz']:.2f}",
            f"{v['bytes'] / b['monai']:.3f}", f"{v['write_s'] * 1e3:.1f} ms", f"{v['read_s'] * 1e3:.1f} ms",
            f"{v['read_GBps']:.2f}", f"{zc:.1f} / {zd:.1f} ms" if zc else "",
        ])  # fmt: skip
    rep.table(rows)
    speeds = ", ".join(f"{k} {v:.2f} GB/s" for k, v in res["checksum_GBps"].items())
    rep.line(
        "write: encode + downcast + compress + write, one thread; read: read + check + decompress + decode, page cache "
        "warm; GB/s of in-memory item bytes; zstd c/d: compression / decompression alone, best of 5.\n"
        f"Checksums over an uncompressed blob: {speeds}."
    )

    epochs_table(rep, e, res["repeats"])
    if "epochs_spare_core" in res:
        epochs_table(rep, res["epochs_spare_core"], res["repeats"], "one CPU left free for the writer threads")

    rep.heading("Slow store: median time of a cache miss in __getitem__ (main process)")
    rows = [["write delay", "async", "sync"]]
    for delay in sorted({r["delay"] for r in res["slow_store"]}):
        a = next(r for r in res["slow_store"] if r["delay"] == delay and r["async"])
        s = next(r for r in res["slow_store"] if r["delay"] == delay and not r["async"])
        rows.append([f"{delay:.2f} s", f"{a['miss_s']:.3f} s", f"{s['miss_s']:.3f} s"])
    rep.table(rows, left=0)

    rep.heading("Targets")
    checks = [(b["ours_default"] <= b["nii.gz"],
               f"bytes, lossless default <= .nii.gz sources: {b['ours_default'] / b['nii.gz']:.2f}x the sources, "
               f"{b['ours_default'] / b['monai']:.3f}x MONAI's cache (about 0.12x)")]  # fmt: skip
    for key in ("epochs", "epochs_spare_core"):
        if key in res:
            x = res[key]
            pr = x["paired"]
            checks.append((pr["ours_cold/uncached"] <= COLD_MAX,
                           f"cold epoch <= {COLD_MAX:.2f}x uncached ({x['workers']} workers), median of per-repeat "
                           f"ratios: {pr['ours_cold/uncached']:.3f}x (MONAI cold: {pr['monai_cold/uncached']:.3f}x); "
                           f"{pr['ours_cold/ours_nocache']:.3f}x ours with cache_dir=None (same outputs); "
                           f"{pr['ours_cold/monai_cold']:.3f}x MONAI cold. Ratio of the medians: "
                           f"{x['ours_cold']['wall'] / x['uncached']['wall']:.2f}x (MONAI cold: "
                           f"{x['monai_cold']['wall'] / x['uncached']['wall']:.2f}x)"))  # fmt: skip
    warm = e["ours_warm"]["wall"] / e["monai_warm"]["wall"]
    checks.append((warm <= 1.0, f"warm epoch <= MONAI warm: {warm:.2f}x (files not in the page cache: "
                   f"{e['ours_warm_evicted']['wall'] / e['monai_warm_evicted']['wall']:.2f}x)"))  # fmt: skip
    rep.targets(checks)
    end = res["loadavg_end"]
    rep.line(f"Load average at the end: {end[0]:.1f} / {end[1]:.1f} / {end[2]:.1f} (1 / 5 / 15 min).")


if __name__ == "__main__":
    main(sys.argv[1:])
