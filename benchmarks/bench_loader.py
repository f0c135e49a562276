#!/usr/bin/env python
"""Warm epochs, first epoch and first batch: MONAI's loaders against monai_cache's, side by side in one run.

The data is the tutorial chain of :mod:`monai_cache.synthetic` (synthetic CT-like NIfTI volumes; ``LoadImaged``
... ``ScaleIntensityRanged`` cached, then ``RandCropByPosNegLabeld`` with 2 crops on every read), batch 2. For
every setting (``--settings``, default 1 rank x 2 workers and 2 ranks x 1 worker; ranks started like
``torchrun``, a ``DistributedSampler`` each, a ``gloo`` all-reduce per step) it runs each configuration

=================  =======================================================  ===================================
name               dataset                                                  loader
=================  =======================================================  ===================================
``monai``          ``monai.data.CacheDataset`` (the baseline)                ``monai.data.DataLoader``
``ours+theirs``    ``monai_cache.CacheDataset``                              ``monai.data.DataLoader``
``ours+ours``      ``monai_cache.CacheDataset``                              ``monai_cache.DataLoader``
``ours+thread``    ``monai_cache.CacheDataset``                              ``monai.data.ThreadDataLoader``
                                                                            (``num_workers=0``, as in MONAI's
                                                                            fast-training tutorial)
``runtime+ours``   ``monai_cache.CacheDataset(runtime_cache=True)``          ``monai_cache.DataLoader``
``uncached``       ``monai.data.Dataset``                                    ``monai.data.DataLoader``
``plain``          ``monai.data.CacheDataset``, no metadata (1)              ``monai.data.DataLoader``
``plain+ours``     the same plain-tensor pipeline                           ``monai_cache.DataLoader``
=================  =======================================================  ===================================

(1) ``EnsureTyped(track_meta=False)`` after the cached transforms and ``set_track_meta(False)`` for the random
crops, as in MONAI's fast-training tutorial: every tensor is a plain ``torch.Tensor``.

``--repeats`` times in rotating order (``uncached`` with 2 epochs only: it is never warm, and each of its epochs
takes as long as filling a cache), and prints medians with their ratio against ``monai`` measured in the same
run: time to first batch (from the start of the dataset's construction), first epoch, warm epoch (epochs 2..N),
each with the CPU seconds of all processes (ranks and workers) beside the wall time, and the main process's CPU
per warm batch (the time a training loop loses to loading). The plain-tensor pair is compared with each other.
The training step is a sum of the image batch on one thread and an ``all_reduce``: it stands for a GPU step,
whose CPU cost is small, so that the table shows what loading costs.
Results go to ``--out`` as ``bench_loader.json``, ``bench_loader.md`` and ``bench_loader.png``. This is a
benchmark, not a timed test: on a shared machine the numbers are noisy, which is why ratios are taken within
one run.

Usage::

    python benchmarks/bench_loader.py            # 24 volumes of 160x160x96, 6 epochs, 3 repeats
    python benchmarks/bench_loader.py --quick    # 8 volumes of 64x64x48, 3 epochs, 1 repeat
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from harness import median, parse_settings, run_ranks, tree_cpu_seconds

from monai_cache.utils import format_table


@dataclasses.dataclass(frozen=True)
class Config:
    """A dataset and a loader. ``dataset``: monai | ours | ours-runtime | uncached | plain;
    ``loader``: monai | ours | thread."""

    name: str
    dataset: str
    loader: str
    label: str


CONFIGS = {
    c.name: c
    for c in (
        Config("monai", "monai", "monai", "MONAI CacheDataset + MONAI DataLoader"),
        Config("ours+theirs", "ours", "monai", "our CacheDataset + MONAI DataLoader"),
        Config("ours+ours", "ours", "ours", "our CacheDataset + our DataLoader"),
        Config("ours+thread", "ours", "thread", "our CacheDataset + ThreadDataLoader(num_workers=0)"),
        Config("runtime+ours", "ours-runtime", "ours", "our CacheDataset(runtime_cache=True) + our DataLoader"),
        Config("uncached", "uncached", "monai", "MONAI Dataset (no cache) + MONAI DataLoader"),
        Config("plain", "plain", "monai", "plain tensors: MONAI CacheDataset, track_meta off + MONAI DataLoader"),
        Config("plain+ours", "plain", "ours", "plain tensors: the same + our DataLoader"),
    )
}
BASELINE = "monai"

# (title, key, format)
ROWS: tuple[tuple[str, str, str], ...] = (
    ("warm epoch, wall (s)", "warm_s", "{:.2f}"),
    ("warm epoch, CPU all processes (s)", "warm_cpu_s", "{:.2f}"),
    ("main process CPU per warm batch (ms)", "main_cpu_per_batch_ms", "{:.1f}"),
    ("worker CPU per warm batch (ms)", "worker_cpu_per_batch_ms", "{:.1f}"),
    ("first epoch, wall (s)", "first_epoch_s", "{:.2f}"),
    ("first epoch, CPU all processes (s)", "first_epoch_cpu_s", "{:.1f}"),
    ("time to first batch, wall (s)", "ttfb_s", "{:.2f}"),
    ("time to first batch, CPU all processes (s)", "ttfb_cpu_s", "{:.1f}"),
    ("building the dataset, wall (s)", "setup_s", "{:.2f}"),
)


# ---------------------------------------------------------------------------------------------------------
# One rank
# ---------------------------------------------------------------------------------------------------------


def _rusage(loader: Any) -> tuple[float, float]:
    """CPU seconds of this process (all threads) and of its DataLoader workers: those reaped (past epochs'), and
    persistent ones, which live on (read from /proc)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    alive = getattr(loader, "_iterator", None)  # set for persistent workers only
    workers = sum(tree_cpu_seconds(w.pid) for w in alive._workers) if alive is not None else 0.0
    return me.ru_utime + me.ru_stime, kids.ru_utime + kids.ru_stime + workers


def _build(config: Config, files: list[dict], transform: Any) -> Any:
    import monai.data

    import monai_cache

    if config.dataset == "ours":
        return monai_cache.CacheDataset(files, transform, progress=False)
    if config.dataset == "ours-runtime":
        return monai_cache.CacheDataset(files, transform, progress=False, runtime_cache=True)
    if config.dataset == "uncached":
        return monai.data.Dataset(files, transform)
    return monai.data.CacheDataset(files, transform, progress=False)  # monai, plain


def _loader(config: Config, dataset: Any, sampler: Any, batch_size: int, workers: int, persistent: bool) -> Any:
    import monai.data

    import monai_cache

    if config.loader == "thread":
        return monai.data.ThreadDataLoader(dataset, batch_size=batch_size, sampler=sampler, num_workers=0)
    cls = monai_cache.DataLoader if config.loader == "ours" else monai.data.DataLoader
    return cls(dataset, batch_size=batch_size, sampler=sampler, num_workers=workers, persistent_workers=persistent)


def rank_main(spec_path: str) -> None:
    """One rank: build the dataset, run the epochs, write ``rank<r>.json`` next to the spec."""
    import monai.data
    import torch
    import torch.distributed as dist
    from monai.transforms import EnsureTyped
    from torch.utils.data.distributed import DistributedSampler

    from monai_cache.synthetic import tutorial_transforms

    with open(spec_path) as f:
        spec = json.load(f)
    config = CONFIGS[spec["config"]]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(spec["seed"] + rank)
    # The step stands for a GPU step, whose CPU cost is small: on one thread, so that idle OpenMP threads spinning
    # in the main process do not take CPU from the workers (torchrun sets OMP_NUM_THREADS=1 for 2 ranks anyway).
    torch.set_num_threads(1)
    with open(spec["data_list"]) as f:
        files = json.load(f)
    plain = config.dataset == "plain"  # cached items without metadata, as in MONAI's fast-training tutorial
    after = [EnsureTyped(keys=["image", "label"], track_meta=False)] if plain else []
    transform = tutorial_transforms(spec["crop"], num_samples=2, after=after)
    dist.barrier()  # all ranks start building at once, as after torchrun's rendezvous
    t0, tree0 = time.perf_counter(), tree_cpu_seconds(os.getpid())
    dataset = _build(config, files, transform)
    setup_s = time.perf_counter() - t0
    if plain:
        monai.data.set_track_meta(False)  # the random crops (in forked workers) then return plain tensors too
    sampler = DistributedSampler(dataset, shuffle=True, seed=spec["seed"])
    loader = _loader(config, dataset, sampler, spec["batch_size"], spec["workers"], spec["persistent_workers"])
    ttfb = ttfb_cpu = None
    epochs = []
    for epoch in range(spec["epochs"]):
        sampler.set_epoch(epoch)
        (self0, kids0), start = _rusage(loader), time.perf_counter()
        batches = 0
        for batch in loader:
            if ttfb is None:
                ttfb, ttfb_cpu = time.perf_counter() - t0, tree_cpu_seconds(os.getpid()) - tree0
            image = batch["image"]
            image = image.as_tensor() if isinstance(image, monai.data.MetaTensor) else image
            total = image.sum()  # the training step: a reduction over the batch, in step across ranks
            dist.all_reduce(total)
            batches += 1
        seconds = time.perf_counter() - start
        self1, kids1 = _rusage(loader)  # non-persistent workers of this epoch are reaped by now
        epochs.append({"seconds": seconds, "main_cpu": self1 - self0, "worker_cpu": kids1 - kids0, "batches": batches})
    dist.barrier()  # nobody leaves (and releases a shared cache) before everyone is done
    result = {"rank": rank, "setup_s": setup_s, "ttfb_s": ttfb, "ttfb_cpu_s": ttfb_cpu, "epochs": epochs}
    with open(os.path.join(os.path.dirname(spec_path), f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------------------
# The launcher side
# ---------------------------------------------------------------------------------------------------------


def run_one(spec: dict[str, Any], run_dir: str) -> dict[str, Any]:
    """Launch one configuration's ranks and combine their reports (times: the slowest rank; CPU: the sum)."""
    shutil.rmtree(run_dir, ignore_errors=True)
    os.makedirs(run_dir)
    spec_path = os.path.join(run_dir, "spec.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    shm_dir = tempfile.mkdtemp(prefix="bench-loader-", dir=os.environ.get("MONAI_CACHE_SHM_DIR", "/dev/shm"))
    try:
        env = {**os.environ, "MONAI_CACHE_SHM_DIR": shm_dir, "PYTHONWARNINGS": "ignore"}
        run_ranks([os.path.abspath(__file__), "--rank-spec", spec_path], spec["ranks"], run_dir, env)
    finally:
        shutil.rmtree(shm_dir, ignore_errors=True)
    ranks = []
    for r in range(spec["ranks"]):
        with open(os.path.join(run_dir, f"rank{r}.json")) as f:
            ranks.append(json.load(f))
    warm = [rk["epochs"][1:] for rk in ranks]
    warm_batches = [sum(e["batches"] for e in w) for w in warm]

    def cpu(e: dict) -> float:
        return e["main_cpu"] + e["worker_cpu"]

    return {
        "config": spec["config"],
        "ranks": spec["ranks"],
        "workers": spec["workers"],
        "setup_s": max(rk["setup_s"] for rk in ranks),
        "ttfb_s": max(rk["ttfb_s"] for rk in ranks),
        "ttfb_cpu_s": sum(rk["ttfb_cpu_s"] for rk in ranks),
        "first_epoch_s": max(rk["epochs"][0]["seconds"] for rk in ranks),
        "first_epoch_cpu_s": sum(cpu(rk["epochs"][0]) for rk in ranks),
        "warm_s": max(statistics.mean(e["seconds"] for e in w) for w in warm),
        "warm_cpu_s": sum(statistics.mean(cpu(e) for e in w) for w in warm),
        "main_cpu_per_batch_ms": statistics.mean(
            1e3 * sum(e["main_cpu"] for e in w) / n for w, n in zip(warm, warm_batches)
        ),
        "worker_cpu_per_batch_ms": statistics.mean(
            1e3 * sum(e["worker_cpu"] for e in w) / n for w, n in zip(warm, warm_batches)
        ),
        "ranks_raw": ranks,
    }


def summarize(records: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """Medians per setting (``"<ranks>x<workers>"``) and configuration."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for r in records:
        out.setdefault(f"{r['ranks']}x{r['workers']}", {}).setdefault(r["config"], {"runs": []})["runs"].append(r)
    for by_config in out.values():
        for med in by_config.values():
            runs = med.pop("runs")
            for _title, key, _fmt in ROWS:
                med[key] = median(r[key] for r in runs)
            med["repeats"] = len(runs)
    return out


def table(by_config: dict[str, dict[str, Any]], markdown: bool) -> str:
    """Rows are figures, columns configurations; ``(x r)``: ratio against ``monai`` (``plain+ours``: against
    ``plain``)."""
    names = [n for n in CONFIGS if n in by_config]
    body = []
    for title, key, fmt in ROWS:
        row = [title]
        for name in names:
            v = by_config[name][key]
            ref_name = "plain" if name == "plain+ours" else BASELINE
            ref = by_config.get(ref_name, {}).get(key)
            cell = fmt.format(v)
            if name != ref_name and ref:
                cell += f" ({v / ref:.2f}x)"
            row.append(cell)
        body.append(row)
    return format_table([["", *names], *body], markdown=markdown)


def paired_ratios(records: list[dict[str, Any]], setting: str, a: str, b: str, key: str) -> list[float]:
    """``b / a`` of ``key`` for each repeat that ran both (runs of one repeat are minutes apart, not hours)."""
    by = {(f"{r['ranks']}x{r['workers']}", r["config"], r["repeat"]): r[key] for r in records}
    reps = sorted({r["repeat"] for r in records})
    return [by[(setting, b, i)] / by[(setting, a, i)] for i in reps if (setting, a, i) in by and (setting, b, i) in by]


def check_targets(
    summary: dict[str, dict[str, dict[str, Any]]], records: list[dict[str, Any]]
) -> list[tuple[bool, str]]:
    """The issue's targets, each as ``(met, text with the numbers)``."""
    checks = []
    for setting, m in summary.items():
        base, ours = m.get(BASELINE, {}).get("warm_s"), m.get("ours+ours", {}).get("warm_s")
        if base and ours:
            per_repeat = ", ".join(f"{x:.2f}" for x in paired_ratios(records, setting, "ours+ours", BASELINE, "warm_s"))
            cpu = m[BASELINE]["warm_cpu_s"] / m["ours+ours"]["warm_cpu_s"]
            checks.append(
                (
                    base / ours >= 2.0,
                    f"[{setting}] warm epoch: ours+ours {ours:.2f} s, {base / ours:.2f}x faster than MONAI's "
                    f"{base:.2f} s (target >= 2x; per repeat {per_repeat}; CPU {cpu:.2f}x less)",
                )
            )
        runtime, uncached = m.get("runtime+ours", {}).get("first_epoch_s"), m.get("uncached", {}).get("first_epoch_s")
        if runtime and uncached:  # informational: filling on the fly is the stores' part of the issue
            checks.append(
                (
                    True,
                    f"[{setting}] info: first epoch with runtime_cache=True {runtime:.2f} s, {runtime / uncached:.2f}x "
                    f"the uncached first epoch ({uncached:.2f} s)",
                )
            )
        plain, plain_ours = m.get("plain", {}).get("warm_s"), m.get("plain+ours", {}).get("warm_s")
        if plain and plain_ours:
            checks.append(
                (
                    plain_ours <= plain * 1.05,
                    f"[{setting}] plain tensors: our DataLoader {plain_ours:.2f} s "
                    f"vs MONAI's {plain:.2f} s ({plain_ours / plain:.2f}x; target not slower, 5% noise)",
                )
            )
    return checks


def plot(summary: dict[str, dict[str, dict[str, Any]]], path: str) -> None:
    """Warm epoch wall time and CPU per configuration and setting, as grouped bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = list(summary)
    names = [n for n in CONFIGS if any(n in summary[s] for s in settings) and n != "uncached"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    width = 0.8 / max(1, len(settings))
    for ax, key, title in zip(
        axes, ("warm_s", "warm_cpu_s"), ("warm epoch, wall (s)", "warm epoch, CPU of all processes (s)")
    ):
        for i, s in enumerate(settings):
            xs = [j + (i - (len(settings) - 1) / 2) * width for j in range(len(names))]
            ax.bar(xs, [summary[s].get(n, {}).get(key, 0) for n in names], width, label=f"{s} (ranks x workers)")
        ax.set_xticks(range(len(names)), names, rotation=30, ha="right")
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _configs(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names or any(n not in CONFIGS for n in names):
        raise argparse.ArgumentTypeError(f"choose configurations from {', '.join(CONFIGS)}; got {text!r}")
    return names


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--rank-spec", help=argparse.SUPPRESS)
    parser.add_argument("--items", type=int, default=None, help="volumes (default 24; --quick 8)")
    parser.add_argument(
        "--epochs", type=int, default=None, help="epochs per run, the first one cold (default 4; --quick 3)"
    )
    parser.add_argument("--repeats", type=int, default=None, help="runs of each configuration (default 3; --quick 1)")
    parser.add_argument(
        "--settings", type=parse_settings, default=[(1, 2), (2, 1)], help="ranks x workers (default 1x2,2x1)"
    )
    parser.add_argument("--configs", type=_configs, default=list(CONFIGS), help=f"default {','.join(CONFIGS)}")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument(
        "--persistent-workers", action="store_true", help="persistent_workers=True for every DataLoader (default: off)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="8 volumes of 64x64x48, 3 epochs, 1 repeat")
    parser.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "monai-cache-bench-loader"))
    args = parser.parse_args(argv)
    if args.rank_spec:
        rank_main(args.rank_spec)
        return 0
    from monai_cache.synthetic import crop_size_for, make_dataset

    items = args.items or (8 if args.quick else 24)
    shape = (64, 64, 48) if args.quick else (160, 160, 96)
    epochs = args.epochs or (3 if args.quick else 6)
    repeats = args.repeats or (1 if args.quick else 3)
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    files = make_dataset(os.path.join(out, "data", "x".join(map(str, shape))), items=items, shape=shape, seed=args.seed)
    data_list = os.path.join(out, f"datalist-{items}-{'x'.join(map(str, shape))}.json")
    with open(data_list, "w") as f:
        json.dump(files, f)
    runs = [
        (ranks, workers, rep, name)
        for ranks, workers in args.settings
        for rep in range(repeats)
        for name in args.configs[rep % len(args.configs) :] + args.configs[: rep % len(args.configs)]
    ]
    t0 = time.perf_counter()
    records = []
    for i, (ranks, workers, rep, name) in enumerate(runs):
        print(f"[{i + 1}/{len(runs)}] {ranks}x{workers} {name} (repeat {rep + 1})", file=sys.stderr, flush=True)
        spec = {
            "config": name,
            "data_list": data_list,
            "ranks": ranks,
            "workers": workers,
            "epochs": min(epochs, 2) if name == "uncached" else epochs,
            "batch_size": args.batch_size,
            "persistent_workers": args.persistent_workers,
            "crop": list(crop_size_for(shape)),
            "seed": args.seed,
        }
        record = run_one(spec, os.path.join(out, "runs", f"{ranks}x{workers}-{name}-{rep}"))
        record["repeat"] = rep
        records.append(record)
    summary = summarize(records)
    head = (
        f"bench_loader: {items} volumes of {'x'.join(map(str, shape))}, tutorial chain (2 crops of "
        f"{'x'.join(map(str, crop_size_for(shape)))}), batch {args.batch_size}, {epochs} epochs (warm: 2..{epochs}), "
        + ("persistent workers, " if args.persistent_workers else "")
        + f"load average {os.getloadavg()[0]:.1f} at the end, "
        f"median of {repeats}; ratios against {BASELINE} (plain+ours: against plain) in the same run"
    )
    text, md = [head], [head, ""]
    for setting, by_config in summary.items():
        r, w = setting.split("x")
        title = f"{r} rank(s) x {w} worker(s)"
        text += ["", title, table(by_config, markdown=False)]
        md += [f"### {title}", "", table(by_config, markdown=True), ""]
    checks = check_targets(summary, records)
    text += ["", "targets:"] + [f"  [{'ok' if ok else 'MISSED'}] {t}" for ok, t in checks]
    md += ["### Targets", ""] + [f"- {'ok' if ok else '**missed**'}: {t}" for ok, t in checks]
    text.append(f"\ntotal wall {time.perf_counter() - t0:.0f} s; results in {out}")
    print("\n".join(text))
    with open(os.path.join(out, "bench_loader.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    with open(os.path.join(out, "bench_loader.json"), "w") as f:
        json.dump(
            {"items": items, "shape": shape, "epochs": epochs, "summary": summary, "records": records}, f, indent=1
        )
    try:
        plot(summary, os.path.join(out, "bench_loader.png"))
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
