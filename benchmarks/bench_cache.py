#!/usr/bin/env python
"""Stock MONAI against monai_cache, side by side in the same run: time, CPU and memory of caching.

The data and transform chain are those of ``monai-cache demo`` (synthetic CT-like NIfTI volumes, the
tutorial chain ending in ``RandCropByPosNegLabeld``), and so is the launcher (:func:`monai_cache.demo.launch`:
ranks started like ``torchrun``, DataLoader workers, memory sampled from outside). For every setting
(``--settings``, default one process x 2 workers and 2 ranks x 2 workers) it runs each configuration

* ``monai-dataset``: ``monai.data.Dataset`` (no cache; the reference for memory),
* ``monai``: ``monai.data.CacheDataset`` (``runtime_cache=False``),
* ``monai-cache``: ``monai_cache.CacheDataset`` (same arguments),
* ``monai-cache-runtime``: ``monai_cache.CacheDataset(runtime_cache=True)``,

``--repeats`` times (in rotating order, so drift on a shared machine spreads over all of them), and prints
medians with their ratio against MONAI's ``CacheDataset`` measured in the same run:

* time to first batch (wall, and CPU seconds of all processes until then),
* warm epoch time (epochs 2..N; wall and CPU),
* memory above the uncached run, all processes together, as a multiple of one copy of the cached data
  (the sum of the cached items' sizes); mean over the warm epochs, and peak,
* CPU seconds spent in the deterministic transforms (filling the cache) and how many times they ran,
  against the number of ranks.

Then it checks the targets of the issue and, with ``--profile``, times and profiles warm reads in this
process. This is a benchmark, not a timed test: on a shared machine the numbers are noisy.

Usage::

    python benchmarks/bench_cache.py            # 24 volumes of 160x160x96, 3 epochs, 2 repeats
    python benchmarks/bench_cache.py --quick    # tiny, about a minute or two
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import resource
import shutil
import statistics
import sys
import time
from collections.abc import Sequence
from copy import deepcopy
from typing import Any

from monai_cache import demo
from monai_cache.synthetic import crop_size_for

CONFIGS = ("monai-dataset", "monai", "monai-cache", "monai-cache-runtime")
BASELINE = "monai"
UNCACHED = "monai-dataset"
_MIB = 1 << 20

# (title, key, format, ratio against MONAI?)
ROWS: tuple[tuple[str, str, str, bool], ...] = (
    ("time to first batch, wall (s)", "ttfb_s", "{:.1f}", True),
    ("time to first batch, CPU all processes (s)", "ttfb_cpu_s", "{:.1f}", True),
    ("warm epoch, wall (s)", "warm_epoch_s", "{:.2f}", True),
    ("warm epoch, CPU all processes (s)", "warm_epoch_cpu_s", "{:.1f}", True),
    ("memory above uncached, warm mean (copies)", "copies_warm", "{:.2f}", True),
    ("memory above uncached, peak (copies)", "copies_peak", "{:.2f}", True),
    ("memory, warm mean (MiB)", "mem_warm_mib", "{:.0f}", True),
    ("deterministic transform runs", "computes", "{:.0f}", True),
    ("CPU in deterministic transforms (s)", "fill_cpu_s", "{:.1f}", True),
    ("CPU, whole run (s)", "cpu_s", "{:.0f}", True),
)


def _median(values: Sequence[float | None]) -> float | None:
    vals = [float(v) for v in values if v is not None]
    return statistics.median(vals) if vals else None


def run_all(args: argparse.Namespace, items: int, shape: tuple[int, int, int], epochs: int) -> list[dict[str, Any]]:
    """Run every (setting, configuration, repeat); returns the raw records of :func:`monai_cache.demo.launch`."""
    from tqdm import tqdm

    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    runs = [
        (ranks, workers, rep, name)
        for ranks, workers in args.settings
        for rep in range(args.repeats)
        for name in args.configs[rep % len(args.configs) :] + args.configs[: rep % len(args.configs)]
    ]
    total = items + sum(1 + epochs * demo.batches_per_epoch(items, r, args.batch_size) for r, _w, _rep, _n in runs)
    bar = tqdm(total=total, desc="synthetic data", unit="step", disable=args.no_progress, dynamic_ncols=True)
    records = []
    shm_dir = demo.private_shm_dir()
    try:
        data_list = demo.prepare_data(out, items, shape, args.seed, bar)
        for i, (ranks, workers, rep, name) in enumerate(runs):
            bar.set_description(f"[{i + 1}/{len(runs)}] {ranks}x{workers} {name}")
            spec = demo.RunSpec(
                config=name,
                data_list=data_list,
                run_dir=os.path.join(out, "runs", f"{ranks}x{workers}-{name}-{rep}"),
                shm_dir=shm_dir,
                ranks=ranks,
                workers=workers,
                epochs=epochs,
                batch_size=args.batch_size,
                spatial_size=crop_size_for(shape),
                fill_threads=args.fill_threads,
                step=args.step,
                seed=args.seed,
            )
            record = demo.launch(spec, lambda _event: bar.update(1), mem_interval=args.mem_interval)
            record["repeat"] = rep
            records.append(record)
    finally:
        bar.close()
        shutil.rmtree(shm_dir, ignore_errors=True)
    return records


def summarize(records: list[dict[str, Any]], items: int) -> dict[tuple[int, int], dict[str, dict[str, Any]]]:
    """Medians per (ranks, workers) and configuration, with memory expressed in copies of the cached data."""
    out: dict[tuple[int, int], dict[str, dict[str, Any]]] = {}
    # one copy of the cached data: MONAI's sum of cached item sizes (monai_cache's encoded bytes if absent)
    copy_bytes = _median([r["one_copy_bytes"] for r in records if r["config"] == BASELINE]) or _median(
        [r["one_copy_bytes"] for r in records if r.get("one_copy_bytes")]
    )
    for key in sorted({(r["ranks"], r["workers"]) for r in records}):
        group = [r for r in records if (r["ranks"], r["workers"]) == key]
        by_config: dict[str, dict[str, Any]] = {}
        for name in dict.fromkeys(r["config"] for r in group):
            rs = [r for r in group if r["config"] == name]
            med = {
                k: _median([r.get(k) for r in rs])
                for k in (
                    "ttfb_s", "ttfb_cpu_s", "warm_epoch_s", "warm_epoch_cpu_s", "first_epoch_s", "mem_warm",
                    "mem_peak", "computes", "fill_cpu_s", "cpu_s", "hits", "misses", "mem_sampler_cpu_s",
                )
            }  # fmt: skip
            med["repeats"] = len(rs)
            med["mem_warm_mib"] = med["mem_warm"] / _MIB if med["mem_warm"] is not None else None
            by_config[name] = med
        base = by_config.get(UNCACHED)
        for med in by_config.values():
            for kind in ("warm", "peak"):
                v, b = med.get(f"mem_{kind}"), base.get(f"mem_{kind}") if base else None
                ok = v is not None and b is not None and copy_bytes
                med[f"copies_{kind}"] = (v - b) / copy_bytes if ok else None  # type: ignore[operator]
        out[key] = by_config
    return out


def _render(header: list[str], body: list[list[str]], markdown: bool) -> str:
    """A Markdown table, or aligned text (first column left, the others right)."""
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|"]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in body])
    widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]

    def line(row: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))

    return "\n".join([line(header), "  ".join("-" * w for w in widths), *(line(r) for r in body)])


def format_setting(by_config: dict[str, dict[str, Any]], markdown: bool) -> str:
    """One table: rows are figures, columns configurations; ``(x r)`` is the ratio against MONAI's CacheDataset."""
    names = list(by_config)
    base = by_config.get(BASELINE)
    header = ["", *names]
    body = []
    for title, key, fmt, ratio in ROWS:
        row = [title]
        for name in names:
            v = by_config[name].get(key)
            cell = "-" if v is None else fmt.format(v)
            b = base.get(key) if base else None
            if ratio and name != BASELINE and v is not None and b:
                cell += f" ({v / b:.2f}x)"
            row.append(cell)
        body.append(row)
    return _render(header, body, markdown)


def format_fill_vs_ranks(summary: dict[tuple[int, int], dict[str, dict[str, Any]]], markdown: bool) -> str:
    """CPU seconds in the deterministic transforms (and their run count) per number of ranks."""
    keys = sorted(summary)
    names = list(dict.fromkeys(n for k in keys for n in summary[k]))
    header = ["configuration", *(f"{r}x{w}: CPU s (runs)" for r, w in keys)]
    if len(keys) > 1:
        header.append(f"{keys[-1][0]}x{keys[-1][1]} / {keys[0][0]}x{keys[0][1]}")
    body = []
    for name in names:
        row = [name]
        vals = []
        for k in keys:
            m = summary[k].get(name, {})
            cpu, runs = m.get("fill_cpu_s"), m.get("computes")
            vals.append(cpu)
            row.append("-" if cpu is None else f"{cpu:.1f} ({runs:.0f})")
        if len(keys) > 1:
            row.append(f"{vals[-1] / vals[0]:.2f}x" if vals[0] and vals[-1] is not None else "-")
        body.append(row)
    return _render(header, body, markdown)


def check_targets(summary: dict[tuple[int, int], dict[str, dict[str, Any]]], items: int) -> list[tuple[bool, str]]:
    """The issue's targets, each as ``(met, description with the numbers)``."""
    checks: list[tuple[bool, str]] = []
    for (ranks, workers), m in sorted(summary.items()):
        where = f"[{ranks}x{workers}]"
        for name in ("monai-cache", "monai-cache-runtime"):
            c = m.get(name, {}).get("copies_warm")
            if c is not None:
                mon = m.get(BASELINE, {}).get("copies_warm")
                ref = f"; MONAI {mon:.2f}" if mon is not None else ""
                checks.append((c <= 1.2, f"{where} {name}: memory above uncached {c:.2f} copies <= 1.2{ref}"))
            runs = m.get(name, {}).get("computes")
            if runs is not None:
                mon_runs = m.get(BASELINE, {}).get("computes")
                ref = f" (MONAI: {mon_runs:.0f})" if mon_runs is not None else ""
                text = f"{where} {name}: deterministic transforms ran {runs:.0f}x for {items} items{ref}"
                checks.append((runs == items, text))
        rt, unc = m.get("monai-cache-runtime", {}).get("ttfb_s"), m.get(UNCACHED, {}).get("ttfb_s")
        if rt is not None and unc:
            text = f"{where} monai-cache-runtime first batch {rt:.1f} s <= 1.1 x uncached {unc:.1f} s"
            checks.append((rt <= 1.1 * unc, text))
        warm = m.get("monai-cache", {}).get("warm_epoch_s")
        fastest = [(m[n]["warm_epoch_s"], n) for n in (BASELINE, UNCACHED) if m.get(n, {}).get("warm_epoch_s")]
        if warm is not None and fastest:
            best, best_name = min(fastest)
            text = f"{where} monai-cache warm epoch {warm:.2f} s < MONAI's fastest ({best_name}) {best:.2f} s"
            checks.append((warm < best, text))
    keys = sorted(summary)
    if len(keys) > 1:
        for name in ("monai-cache", "monai-cache-runtime"):
            a, b = summary[keys[0]].get(name, {}).get("fill_cpu_s"), summary[keys[-1]].get(name, {}).get("fill_cpu_s")
            if a and b is not None:
                text = f"{name}: fill CPU {a:.1f} s -> {b:.1f} s from {keys[0][0]} to {keys[-1][0]} ranks (<= 1.25x)"
                checks.append((b / a <= 1.25, text))
    return checks


# ---------------------------------------------------------------------------------------------------------
# Profile of warm reads (in this process; the code a DataLoader worker runs for each item)
# ---------------------------------------------------------------------------------------------------------


def profile_warm_reads(data_list: str, spatial_size: Sequence[int], top: int = 18) -> str:
    """Time the parts of a warm read (fetching the cached item, the random crop) for MONAI and monai_cache,
    and cProfile monai_cache's ``__getitem__``; returns a report."""
    import monai.data
    import torch

    import monai_cache
    from monai_cache.synthetic import tutorial_transforms

    torch.set_num_threads(1)
    with open(data_list) as f:
        files = json.load(f)
    transform = tutorial_transforms(spatial_size)
    crop = transform.transforms[-1]
    lines = []
    shm = demo.private_shm_dir()
    os.environ["MONAI_CACHE_SHM_DIR"] = shm
    try:
        mon = monai.data.CacheDataset(files, transform, progress=False)
        ours = monai_cache.CacheDataset(files, transform, progress=False, shm_dir=shm)
        n = len(files)

        def timed(fn: Any, reps: int = 3) -> tuple[float, float]:
            """Best CPU ms per item over ``reps`` passes, and minor page faults per item in that pass."""
            best, faults = float("inf"), 0.0
            for _ in range(reps):
                flt0, t = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.process_time()
                for i in range(n):
                    fn(i)
                cpu = (time.process_time() - t) / n
                if cpu < best:
                    best, faults = cpu, (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - flt0) / n
            return best * 1e3, faults

        def touch(item: Any) -> float:
            return float(item["image"].sum()) + float(item["label"].sum())

        rows = (
            ("fetch the cached item (MONAI: deepcopy; ours: mmap + decode)", lambda i: deepcopy(mon._cache[i]),
             lambda i: ours._cache[i]),
            ("fetch + read every voxel", lambda i: touch(deepcopy(mon._cache[i])), lambda i: touch(ours._cache[i])),
            ("fetch + RandCropByPosNegLabeld", lambda i: crop(deepcopy(mon._cache[i])), lambda i: crop(ours._cache[i])),
            ("dataset[i]", lambda i: mon[i], lambda i: ours[i]),
        )  # fmt: skip
        lines.append(f"warm read, CPU ms per item (best of 3 passes over {n} items, one thread)  [minor faults]")
        lines.append(f"  {'':<62} {'MONAI':>14}  {'monai_cache':>14}")
        for what, a_fn, b_fn in rows:
            (a, fa), (b, fb) = timed(a_fn), timed(b_fn)
            lines.append(f"  {what:<62} {a:6.1f} [{fa:5.0f}]  {b:6.1f} [{fb:5.0f}]")
        prof = cProfile.Profile()
        prof.enable()
        for i in range(n):
            ours[i]
        prof.disable()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
        lines.append("cProfile of monai_cache CacheDataset[i] over one warm pass, by own time:")
        lines.append(buf.getvalue())
        ours.release()
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------


def _settings(text: str) -> list[tuple[int, int]]:
    out = []
    for part in text.split(","):
        r, _, w = part.strip().partition("x")
        if not (r.isdigit() and w.isdigit() and int(r) >= 1):
            raise argparse.ArgumentTypeError(f"settings look like 1x2,2x2 (ranks x workers); got {text!r}")
        out.append((int(r), int(w)))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; returns the exit status (0 even when targets are missed: it is not a test)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--items", type=int, default=None, help="volumes (default 24; --quick 8)")
    parser.add_argument("--shape", type=demo._shape, default=None, help="voxels per volume (default 160x160x96)")
    parser.add_argument("--epochs", type=int, default=None, help="epochs per run (default 3; --quick 2)")
    parser.add_argument("--repeats", type=int, default=None, help="runs of each configuration (default 2; --quick 1)")
    parser.add_argument("--settings", type=_settings, default=[(1, 2), (2, 2)], help="ranks x workers, e.g. 1x2,2x2")
    parser.add_argument("--configs", type=demo._compare, default=list(CONFIGS), help=f"default {','.join(CONFIGS)}")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--fill-threads", type=int, default=1, help="CacheDataset num_workers (default 1)")
    parser.add_argument("--step", choices=("conv", "sum"), default="conv")
    parser.add_argument("--mem-interval", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="8 volumes of 64x64x48, 2 epochs, 1 repeat")
    parser.add_argument("--profile", action="store_true", help="also time and cProfile warm reads in this process")
    parser.add_argument("--out", default=os.path.join(demo.default_out_dir(), "bench"), help="results directory")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    items = args.items or (8 if args.quick else 24)
    shape = tuple(args.shape or ((64, 64, 48) if args.quick else (160, 160, 96)))
    epochs = args.epochs or (2 if args.quick else 3)
    args.repeats = args.repeats or (1 if args.quick else 2)
    if UNCACHED not in args.configs:
        print(f"note: without {UNCACHED} memory cannot be expressed above the uncached run", file=sys.stderr)

    t0 = time.perf_counter()
    records = run_all(args, items, shape, epochs)  # type: ignore[arg-type]
    summary = summarize(records, items)
    copy_bytes = next((r["one_copy_bytes"] for r in records if r["config"] == BASELINE and r["one_copy_bytes"]), None)
    report = [
        f"bench_cache: {items} volumes of {'x'.join(map(str, shape))}, {epochs} epochs, batch {args.batch_size}, "
        f"median of {args.repeats} repeat(s); one copy of the cached data = "
        + (f"{copy_bytes / _MIB:.0f} MiB" if copy_bytes else "n/a")
        + f"; ratios against {BASELINE} (MONAI CacheDataset) in the same run"
    ]
    md = [report[0], ""]
    for (ranks, workers), by_config in sorted(summary.items()):
        title = f"{ranks} rank(s) x {workers} workers"
        report += ["", title, format_setting(by_config, markdown=False)]
        md += [f"### {title}", "", format_setting(by_config, markdown=True), ""]
    report += ["", "CPU in deterministic transforms vs ranks (machine-wide)", format_fill_vs_ranks(summary, False)]
    md += ["### CPU in deterministic transforms vs ranks", "", format_fill_vs_ranks(summary, True), ""]
    checks = check_targets(summary, items)
    report += ["", "targets:"] + [f"  [{'ok' if ok else 'MISSED'}] {text}" for ok, text in checks]
    md += ["### Targets", ""] + [f"- {'ok' if ok else '**missed**'}: {text}" for ok, text in checks]
    sampler_cpu = sum(r.get("mem_sampler_cpu_s") or 0 for r in records)
    wall = time.perf_counter() - t0
    report.append(f"\nmemory sampling took {sampler_cpu:.0f} CPU s in the launcher; total wall {wall:.0f} s")
    if args.profile:
        data_list = demo.prepare_data(os.path.abspath(args.out), items, shape, args.seed)
        prof = profile_warm_reads(data_list, crop_size_for(shape))
        report += ["", prof]
        md += ["### Warm reads", "", "```", prof, "```"]
    print("\n".join(report))
    out = os.path.abspath(args.out)
    with open(os.path.join(out, "bench.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    with open(os.path.join(out, "bench.json"), "w") as f:
        json.dump({"items": items, "shape": shape, "epochs": epochs, "records": records}, f, indent=1)
    print(f"results: {os.path.join(out, 'bench.md')}, {os.path.join(out, 'bench.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
