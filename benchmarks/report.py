"""``python -m benchmarks report``: run the suites and write the report ``docs/benchmarks.md`` with its plots::

    python -m benchmarks report [--quick] [--only cache,persistent,...]

It runs each suite through the one entry point (``python -m benchmarks <suite>``, a subprocess each, from the
repository's root): ``cache`` (CacheDataset: time to first batch, epoch times, memory of all processes),
``persistent`` (PersistentDataset: bytes on disk, cold and warm epochs), ``sampler`` (ShardedDistributedSampler: hit
rate, epoch time), ``scale`` (many small items; ``--quick``: 2,000 items, the full mode that suite's ``--quick``
sizes; its full sizes, run by hand, see docs/scale.md), ``warm`` (every epoch of MONAI, ours with MONAI's
DataLoader and ours with ours, volumes and small items; ``--quick``: one setting of that suite's ``--quick`` mode),
``smartcache`` (SmartCacheDataset, 2 ranks), ``tiers`` (PersistentDataset with and without the shared-memory tier; a
restart of ``CacheDataset(cache_dir=...)``), ``restart`` (a rank's crash under ``torchrun --max-restarts=1``) and
``switch`` (Auto3DSeg's segresnet pattern, stock against the switch). Every ratio in their tables is against stock
MONAI measured in the same run. It prints their tables as they come, describes the machine (cores, memory, CPU
model, load average) and writes the Markdown report and PNG plots (epoch time per epoch, memory across processes,
bytes on disk per item, small items as their count grows).

``--quick`` runs reduced versions that finish in a few minutes on an idle 2-core machine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from harness import describe_machine, machine_info

__all__ = ["BENCHMARKS", "add_arguments", "find_benchmarks", "run", "run_benchmark", "write_report"]

BENCHMARKS = ("cache", "persistent", "sampler", "scale", "warm", "smartcache", "tiers", "restart", "switch")
"""The suites of the report, in the order they run (``python -m benchmarks <suite>``)."""

_MIB = 1 << 20


def find_benchmarks(directory: str | None = None) -> Path | None:
    """The ``benchmarks/`` package whose entry point runs the suites: ``directory`` if given, else this script's.
    ``None`` if it has no ``__main__.py``."""
    c = Path(directory) if directory else Path(__file__).resolve().parent
    return c.resolve() if (c / "__main__.py").is_file() else None


def _commands(bench_dir: Path, work: Path, quick: bool) -> dict[str, list[str]]:
    """Each suite's command line, run from the parent of ``bench_dir``."""

    def suite(name: str, *args: str) -> list[str]:
        return [sys.executable, "-m", bench_dir.name, name, *args]

    cache = suite("cache", "--out", str(work / "cache"), "--no-progress")
    persistent = suite("persistent", "--out", str(work / "persistent"))
    sampler = suite("sampler", "--out", str(work / "sampler"))
    scale = suite("scale", "--out", str(work / "scale"))
    warm = suite("warm", "--out", str(work / "warm"))
    if quick:
        # Reduced versions of the suites' own --quick modes: 4 volumes, 2 ranks (where one shared copy shows),
        # one repeat. About a minute on an idle 2-core machine; a few minutes on a busy one.
        cache += ["--quick", "--items", "4", "--epochs", "3", "--settings", "2x1", "--configs", "monai,monai-cache"]
        cache += ["--mem-interval", "0.25"]
        persistent += ["--quick", "--items", "4", "--repeats", "1", "--workers", "1"]
        sampler += ["--quick"]
        # 2,000 small items, ours against MONAI's eager CacheDataset (the large item is left to the full mode:
        # each of its four cases starts an interpreter, which alone would take the quick mode past a minute)
        scale += ["--sizes", "2000", "--variants", "ours-cache", "monai-cache", "--workers", "2", "--large-mb", "0"]
        # the suite's --quick mode (8 small volumes, 500 images, one repeat) in one setting
        warm += ["--quick", "--settings", "1x2"]
    else:
        scale += ["--quick"]
    smartcache = suite("smartcache", "--out", str(work / "smartcache"))
    tiers = suite("tiers", "--out", str(work / "tiers"))
    restart = suite("restart", "--out", str(work / "restart"))
    switch = suite("switch", "--out", str(work / "switch"))
    if quick:
        smartcache += ["--quick", "--repeats", "1"]
        tiers += ["--quick"]
        restart += ["--items", "8", "--shape", "64,64,48", "--crop", "32", "--repeats", "1"]
        switch += ["--quick", "--settings", "2x1"]
    return {"cache": cache, "persistent": persistent, "sampler": sampler, "scale": scale, "warm": warm,
            "smartcache": smartcache, "tiers": tiers, "restart": restart, "switch": switch}


def run_benchmark(
    cmd: Sequence[str], echo: bool = True, timeout: float | None = None, cwd: str | os.PathLike | None = None
) -> tuple[int, str, float]:
    """Run one suite (from ``cwd``); print its output as it comes (``echo``). Returns (exit status, output,
    seconds)."""
    t0 = time.perf_counter()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        list(cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, bufsize=1, cwd=cwd
    )
    lines: list[str] = []
    assert proc.stdout is not None
    deadline = None if timeout is None else time.monotonic() + timeout
    for line in proc.stdout:
        lines.append(line)
        if echo:
            sys.stdout.write(line)
            sys.stdout.flush()
        if deadline is not None and time.monotonic() > deadline:
            proc.kill()
            lines.append(f"(killed after {timeout:.0f} s)\n")
            break
    rc = proc.wait()
    return rc, "".join(lines), time.perf_counter() - t0


def _read_json(path: Path) -> Any:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


# ------------------------------------------------------------------------------------------------ plots
def _plot_epochs(cache: dict[str, Any], path: Path) -> bool:
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    records = cache.get("records") or []
    if not records:
        return False
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    seen: set[str] = set()
    for r in records:
        label = f"{r.get('label', r['config'])} ({r['ranks']}x{r['workers']})"
        if label in seen:  # repeats: plot the first only
            continue
        seen.add(label)
        epochs = r.get("epoch_s") or []
        ax.plot(range(1, len(epochs) + 1), epochs, marker="o", label=label)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("epoch")
    ax.set_ylabel("epoch time (s)")
    ax.set_title("CacheDataset: epoch time per epoch")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def _plot_memory(cache: dict[str, Any], path: Path) -> bool:
    import matplotlib.pyplot as plt

    records = [r for r in cache.get("records") or [] if r.get("mem_peak")]
    if not records:
        return False
    labels: list[str] = []
    peaks: list[float] = []
    means: list[float] = []
    for r in records:
        label = f"{r.get('label', r['config'])}\n{r['ranks']}x{r['workers']}"
        if label in labels:
            continue
        labels.append(label)
        peaks.append(r["mem_peak"] / _MIB)
        means.append((r.get("mem_mean") or 0) / _MIB)
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    xs = range(len(labels))
    ax.bar([x - 0.2 for x in xs], peaks, width=0.4, label="peak")
    ax.bar([x + 0.2 for x in xs], means, width=0.4, label="mean")
    ax.set_xticks(list(xs), labels, fontsize="small")
    ax.set_ylabel("MiB (all processes, PSS + shared memory)")
    ax.set_title("CacheDataset: memory across processes")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def _plot_disk(persistent: dict[str, Any], path: Path) -> bool:
    import matplotlib.pyplot as plt

    sizes = persistent.get("bytes") if isinstance(persistent, dict) else None
    if not isinstance(sizes, dict):
        return False
    names = {"nii.gz": ".nii.gz sources", "monai": "MONAI (torch.save)", "ours_default": "monai_cache (default)"}
    pairs = [(label, sizes[k]) for k, label in names.items() if isinstance(sizes.get(k), (int, float))]
    for v in sizes.get("variants") or []:
        if isinstance(v, dict) and isinstance(v.get("bytes"), (int, float)) and v.get("variant"):
            pairs.append((f"monai_cache {v['variant']}", v["bytes"]))
    pairs = [(k, v) for k, v in pairs if v > 0]
    if not pairs:
        return False
    fig, ax = plt.subplots(figsize=(8.0, 0.4 * len(pairs) + 1.4))
    ax.barh([k for k, _ in pairs], [v / _MIB for _, v in pairs])
    ax.invert_yaxis()
    ax.set_xlabel("MiB per item")
    ax.set_title("PersistentDataset: bytes on disk per item")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def _plots(results: dict[str, Any], img_dir: Path) -> dict[str, str]:
    """Write the PNG plots that the results allow; ``{kind: file name}``. Empty without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
    except ImportError:
        return {}
    img_dir.mkdir(parents=True, exist_ok=True)
    made: dict[str, str] = {}
    cache = results.get("cache", {}).get("data") or {}
    persistent = results.get("persistent", {}).get("data") or {}
    for kind in ("scale",):  # drawn by the scale suite itself
        plot = results.get(kind, {}).get("plot")
        if isinstance(plot, Path) and plot.is_file():
            shutil.copyfile(plot, img_dir / f"bench_{kind}.png")
            made[kind] = f"bench_{kind}.png"
    for kind, fn, data in (
        ("epochs", _plot_epochs, cache),
        ("memory", _plot_memory, cache),
        ("disk", _plot_disk, persistent),
    ):
        name = f"bench_{kind}.png"
        try:
            if data and fn(data, img_dir / name):
                made[kind] = name
        except Exception as e:  # a plot must not lose the report
            print(f"report.py: could not plot {kind}: {e}", file=sys.stderr)
    return made


# ----------------------------------------------------------------------------------------------- report
_TITLES = {
    "cache": "CacheDataset (shared memory) — `python -m benchmarks cache`",
    "persistent": "PersistentDataset (disk) — `python -m benchmarks persistent`",
    "sampler": "ShardedDistributedSampler — `python -m benchmarks sampler`",
    "scale": "Scale: many small items — `python -m benchmarks scale` (details: [scale.md](scale.md))",
    "warm": "Every epoch: MONAI, ours with MONAI's DataLoader, ours with ours — `python -m benchmarks warm` (details: "
    "[benchmarks-cache.md](benchmarks-cache.md), [loader.md](loader.md#benchmark))",
    "smartcache": "SmartCacheDataset — `python -m benchmarks smartcache` (details: [smartcache.md](smartcache.md))",
    "tiers": "Tiers: shared memory in front of the disk, and a restart from disk — `python -m benchmarks tiers` "
    "(details: [tiers.md](tiers.md))",
    "restart": "A rank's crash under torchrun --max-restarts — `python -m benchmarks restart` "
    "(details: [distributed.md](distributed.md#restarts-and-elastic-jobs))",
    "switch": "Auto3DSeg's segresnet pattern: a Manager list as runtime_cache — `python -m benchmarks switch` "
    "(details: [migrating.md](migrating.md))",
}


def write_report(results: dict[str, Any], docs_dir: str | os.PathLike, quick: bool) -> Path:
    """Write ``benchmarks.md`` and its plots (under ``img/``) into ``docs_dir``.

    Args:
        results: ``{"machine": machine_info(), "<benchmark>": {"cmd", "rc", "seconds", "output", "data",
            "markdown"}}`` as :func:`run` collects them.
        docs_dir: the documentation directory.
        quick: whether the benchmarks ran in ``--quick`` mode (said in the report).

    Returns:
        the path of the report.
    """
    docs = Path(docs_dir)
    docs.mkdir(parents=True, exist_ok=True)
    plots = _plots(results, docs / "img")
    machine = results["machine"]
    when = results.get("date") or datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    mode = "`--quick` (reduced sizes: indicative only)" if quick else "full"
    md = [
        "# Benchmark report",
        "",
        "Generated by `python -m benchmarks report"
        + (" --quick" if quick else "")
        + f"` on {when}; mode: {mode}. Do not edit by hand: rerun the command.",
        "",
        f"**Machine:** {describe_machine(machine)}",
        "",
        "Every ratio is against stock MONAI (`monai.data.CacheDataset`, `monai.data.PersistentDataset`, "
        "`torch.utils.data.DistributedSampler`, `monai.data.DataLoader`) measured in the same run, on the same "
        "synthetic data. On a shared "
        "machine (see the load average) the numbers are noisy. How the caches work: "
        "[shared memory](shared-memory.md), [disk cache](persistent.md), [sampler](sampler.md); "
        "the detailed cache study is in [benchmarks-cache.md](benchmarks-cache.md).",
        "",
    ]
    if plots:
        md += ["## Plots", ""]
        captions = {
            "epochs": "Epoch time per epoch (the first epoch fills the cache)",
            "memory": "Memory of all processes together (peak and mean)",
            "disk": "Bytes on disk per item",
            "scale": "Small items: cost as the item count grows",
        }
        for kind, name in plots.items():
            md += [f"![{captions[kind]}](img/{name})", ""]
    for name in BENCHMARKS:
        r = results.get(name)
        if r is None:
            continue
        md += [f"## {_TITLES[name]}", ""]
        cmd = " ".join(["python", *r["cmd"][1:]])
        md += [f"Command: `{_shorten(cmd)}` — exit status {r['rc']}, {r['seconds']:.0f} s.", ""]
        if r.get("markdown"):
            md += [r["markdown"].rstrip(), ""]
        else:
            md += ["```text", _clean_output(r["output"]), "```", ""]
    path = docs / "benchmarks.md"
    path.write_text("\n".join(md).rstrip() + "\n")
    return path


def _shorten(cmd: str) -> str:
    """Drop temporary paths (``--out /tmp/...``) from a command shown in the report."""
    parts = cmd.split()
    out: list[str] = []
    skip = False
    for p in parts:
        if skip:
            skip = False
            continue
        if p in ("--out", "--json"):
            skip = True
            continue
        out.append(p)
    return " ".join(out)


def _clean_output(text: str) -> str:
    """Benchmark output without progress bars and carriage returns, for a code block."""
    lines = []
    for line in text.splitlines():
        line = line.rsplit("\r", 1)[-1].rstrip()
        if line.startswith("```"):
            continue
        lines.append(line)
    return "\n".join(lines).strip()


# ------------------------------------------------------------------------------------------------ command
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``python -m benchmarks report``."""
    parser.add_argument("--quick", action="store_true", help="reduced sizes: a few minutes in all")
    parser.add_argument(
        "--only",
        default=",".join(BENCHMARKS),
        help=f"comma-separated benchmarks to run (default {','.join(BENCHMARKS)})",
    )
    parser.add_argument(
        "--benchmarks-dir", default=None, help="the benchmarks/ package that runs the suites (default: this one)"
    )
    parser.add_argument(
        "--docs-dir",
        default=None,
        help="where to write benchmarks.md and img/ (default: the checkout's docs/; '-' writes nothing)",
    )
    parser.add_argument("--work-dir", default=None, help="keep the raw results here (default: a temporary directory)")
    parser.add_argument("--json", action="store_true", help="print a JSON summary at the end")


def run(args: argparse.Namespace) -> int:
    """Run the benchmarks; returns the exit status (0 all ran, 1 a benchmark failed, 2 usage)."""
    names = [n.strip() for n in str(args.only).split(",") if n.strip()]
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown or not names:
        print(
            f"report.py: unknown benchmark(s) {unknown}; choose from {', '.join(BENCHMARKS)}", file=sys.stderr
        )
        return 2
    bench_dir = find_benchmarks(args.benchmarks_dir)
    if bench_dir is None:
        where = args.benchmarks_dir or str(Path(__file__).resolve().parent)
        print(
            f"report.py: no benchmarks package (__main__.py) in {where}; pass --benchmarks-dir.",
            file=sys.stderr,
        )
        return 2
    docs_dir: Path | None
    if args.docs_dir == "-":
        docs_dir = None
    elif args.docs_dir:
        docs_dir = Path(args.docs_dir)
    else:
        docs_dir = bench_dir.parent / "docs"
    with tempfile.TemporaryDirectory(prefix="monai-cache-bench-") as tmp:
        work = Path(args.work_dir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        cmds = _commands(bench_dir, work, args.quick)
        results: dict[str, Any] = {"machine": machine_info()}
        results["date"] = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        failed = []
        for name in names:
            print(f"\n=== {name}: {' '.join(cmds[name])}", file=sys.stderr if args.json else sys.stdout, flush=True)
            rc, output, seconds = run_benchmark(cmds[name], echo=not args.json, cwd=bench_dir.parent)
            r: dict[str, Any] = {"cmd": cmds[name], "rc": rc, "seconds": seconds, "output": output}
            # every suite saves harness.Report's files: <suite>.md (what it printed) and <suite>.json
            r["data"] = _read_json(work / name / f"{name}.json")
            md = work / name / f"{name}.md"
            r["markdown"] = md.read_text() if rc == 0 and md.is_file() else None
            if name == "scale":
                r["plot"] = work / "scale" / "bench_scale.png"
            if rc != 0:
                failed.append(name)
                print(f"report.py: {name} failed with exit status {rc}", file=sys.stderr)
            results[name] = r
        results["machine"]["loadavg_end"] = list(os.getloadavg())
        report = write_report(results, docs_dir, args.quick) if docs_dir is not None else None
    summary = {
        "machine": results["machine"],
        "benchmarks": {n: {"rc": results[n]["rc"], "seconds": results[n]["seconds"]} for n in names},
        "report": str(report) if report else None,
        "failed": failed,
    }
    if args.json:
        print(json.dumps(summary, indent=1))
    else:
        print(f"\nmachine: {describe_machine(results['machine'])}")
        if report:
            print(f"report: {report} (plots in {report.parent / 'img'})")
    return 1 if failed else 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m benchmarks report [options]``."""
    parser = argparse.ArgumentParser(description="Run the benchmarks (stock MONAI vs monai_cache in the same run) "
                                     "and write docs/benchmarks.md and its plots.")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
