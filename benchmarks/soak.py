"""Soak run: many epochs of DDP-style loading through both caches, watching for leaks.

``--ranks`` independent rank processes (started like ``torchrun`` starts them: ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``; a gloo process group keeps them in lockstep) each read a
``ConcatDataset`` of a ``monai_cache.CacheDataset`` (shared memory, filled at run time by the workers) and a
``monai_cache.PersistentDataset`` (disk, asynchronous writes) through a ``DataLoader`` with ``--workers``
workers and a ``DistributedSampler``, for every combination of ``--contexts`` (fork, spawn) and
``--persistent`` (on, off). Every item is checked. After each epoch every rank measures, from ``/proc``, its
own and its workers' open file descriptors (``/proc/<pid>/fd``), memory maps (``/proc/<pid>/maps``, also those
of shared-memory files), threads (``/proc/<pid>/task``) and resident memory (``VmRSS`` in
``/proc/<pid>/status``), and rank 0 measures the bytes the caches hold in shared memory.

Pass/fail: nothing may grow after the first epoch (the last epoch's value against the first's; for file
descriptors, threads and shared-memory maps the least of the later epochs', see :data:`_SAMPLED_IN_FLIGHT`):
file descriptors, threads and shared-memory maps not at all, memory maps by at most ``--maps-slack``, resident memory
(anonymous + shared-memory pages; see :func:`proc_metrics`) by at most ``--rss-slack-mib`` (allocator noise),
shared-memory bytes and segments not at all. Descriptors of
shared-memory segments are counted apart: a process opens each segment once, when it first reads from it, so
their number may rise until it has read from all of them, and must never exceed the number of segments (+1 for
the segment a writer appends to). After the ranks exit, nothing of ours may be left in shared memory (no cache
directory, zero bytes) and no temporary file in the disk cache. With ``--private-shm`` the run gets a fresh,
private ``/dev/shm`` (a tmpfs in its own mount namespace, needs root), so anything left there at the end is
ours for sure, DataLoader and semaphore segments included.

Long form (minutes)::

    python -m benchmarks soak --epochs 20 --items 64 --item-kb 1024 --private-shm --json soak.json

Short form, as run by tests/reliability/test_soak.py::

    python -m benchmarks soak --epochs 3 --items 16 --item-kb 16 --private-shm --json soak.json

Exit status 0 when every check passed, 1 otherwise; ``--json`` writes every measurement, ``--out`` ``soak.md`` (what
was printed) and ``soak.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

import harness  # the benchmarks' shared helpers (its neighbour here)

METRICS = ("fds", "segment_fds", "batch_fds", "maps", "shm_maps", "threads", "rss", "vm_rss")


# --------------------------------------------------------------------------------------- measuring
def proc_metrics(pid: int, shm_roots: tuple[str, ...]) -> dict[str, int] | None:
    """Open file descriptors, maps, maps of shared-memory files, threads and resident memory of ``pid``, from /proc.

    ``rss`` is the process's own resident memory, ``RssAnon + RssShmem`` of ``/proc/<pid>/status`` (heap, and
    pages of shared-memory files it maps): what a leak makes grow. ``vm_rss`` (``VmRSS``) adds ``RssFile``, the
    pages of shared libraries it has touched, which depends on what the page cache holds at the time (other
    processes) and is reported, not checked: fresh workers of two epochs can differ by 50 MB there.

    ``fds`` leaves out the read-only descriptors of shared-memory cache segments (``segment_fds``): a process
    opens each segment once, the first time it reads an entry from it, and keeps it (one per segment, not per
    entry), so their number rises until the process has read from every segment and is bounded by the number of
    segments, which is checked separately. It also leaves out torch's shared-memory files of batches in flight
    (``/dev/shm/torch_*``, reported as ``batch_fds``): a DataLoader worker holds one per tensor it has sent
    until the main process has taken it, so their number at any moment depends on timing, not on leaks.
    """
    try:
        fds = segment_fds = batch_fds = 0
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith(shm_roots[0]) and os.path.basename(target).startswith("s."):
                    segment_fds += 1
                    continue
                if os.path.basename(target).startswith("torch_"):
                    batch_fds += 1
                    continue
            fds += 1
        threads = len(os.listdir(f"/proc/{pid}/task"))
        with open(f"/proc/{pid}/maps") as f:
            maps = f.read().splitlines()
        with open(f"/proc/{pid}/status") as f:
            status = {k: v.split() for k, _, v in (line.partition(":") for line in f)}
        vm_rss = int(status["VmRSS"][0]) * 1024
        rss = (int(status["RssAnon"][0]) + int(status["RssShmem"][0])) * 1024
    except (FileNotFoundError, ProcessLookupError, KeyError):
        return None
    shm_maps = sum(1 for m in maps if any(root in m for root in shm_roots))
    return {"fds": fds, "segment_fds": segment_fds, "batch_fds": batch_fds, "maps": len(maps), "shm_maps": shm_maps,
            "threads": threads,
            "rss": rss, "vm_rss": vm_rss}


def segment_count(path: str) -> int:
    """Shared-memory segment files (``s.<n>``) in all caches under ``path``."""
    return sum(1 for _root, _dirs, names in os.walk(path) for n in names if n.startswith("s."))


def tree_usage(path: str) -> tuple[int, list[str]]:
    """(bytes allocated, relative paths of the files) under ``path``."""
    total, files = 0, []
    for root, _dirs, names in os.walk(path):
        for name in names:
            p = os.path.join(root, name)
            with contextlib.suppress(FileNotFoundError):
                total += os.lstat(p).st_blocks * 512
                files.append(os.path.relpath(p, path))
    return total, sorted(files)


# ------------------------------------------------------------------------------------------- items
def _make(i: int, floats: int) -> dict:
    import torch

    g = torch.Generator().manual_seed(7919 + i)
    return {"i": i, "image": torch.randn(floats, generator=g), "name": f"case{i}"}


def item_floats(i: int, floats: int) -> int:
    """Every fourth item has the full size, the others a sixteenth of it: with ``--item-kb 1024`` the shared
    memory holds both kinds of entries (files of their own from 1 MiB, the rest packed into segments)."""
    return floats if i % 4 == 0 else max(256, floats // 16)


def make_item(data: dict) -> dict:
    """The deterministic transform (wrapped in ``monai.transforms.Lambda``, so the caches store its output):
    ``{"i", "n"}`` -> ``{"i", "image" (n float32), "name"}``."""
    return _make(int(data["i"]), int(data["n"]))


# -------------------------------------------------------------------------------------------- rank
def rank_main(spec_path: str) -> int:
    import torch
    import torch.distributed as dist
    from monai.data import DataLoader
    from monai.data.utils import no_collation
    from monai.transforms import Lambda
    from torch.utils.data import ConcatDataset
    from torch.utils.data.distributed import DistributedSampler

    from monai_cache.dataset import CacheDataset
    from monai_cache.persistent import PersistentDataset

    with open(spec_path) as f:
        spec = json.load(f)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    shm_roots = (spec["shm_dir"], "/dev/shm/")
    data = [{"i": i, "n": item_floats(i, spec["floats"])} for i in range(spec["items"])]
    expected = {d["i"]: _make(d["i"], d["n"])["image"] for d in data}
    results: dict[str, Any] = {"rank": rank, "pid": os.getpid(), "configs": []}
    for context, persistent in spec["configs"]:
        name = f"{context}/persistent_workers={'on' if persistent else 'off'}"
        t0 = time.monotonic()
        shm_ds = CacheDataset(data, Lambda(make_item), runtime_cache=True, progress=False,
                              cache_key=f"soak-{context}-{persistent}", shm_dir=spec["shm_dir"])
        disk_ds = PersistentDataset(data, Lambda(make_item),
                                    cache_dir=os.path.join(spec["cache_dir"], f"{context}-{persistent}"))
        ds = ConcatDataset([shm_ds, disk_ds])
        sampler = DistributedSampler(ds, shuffle=True, seed=0)
        # items of two sizes: batches are lists (no stacking); their tensors still travel through shared memory
        loader = DataLoader(ds, batch_size=2, sampler=sampler, num_workers=spec["workers"], collate_fn=no_collation,
                            persistent_workers=persistent, multiprocessing_context=context)
        epochs, checked, wrong = [], 0, 0
        for epoch in range(spec["epochs"]):
            sampler.set_epoch(epoch)
            it = iter(loader)
            workers: list[dict | None] = []
            n_batches = len(loader)
            for k, batch in enumerate(it):
                for item in batch:
                    checked += 1
                    i = int(item["i"])
                    if not torch.equal(item["image"], expected[i]) or item["name"] != f"case{i}":
                        wrong += 1
                if k == n_batches - 1:  # all workers alive and idle at this point
                    workers = [proc_metrics(w.pid, shm_roots) for w in it._workers]
                total = torch.tensor([float(len(batch))])
                dist.all_reduce(total)  # lockstep, as in training
            del it
            dist.barrier()  # every rank has finished the epoch
            shm_bytes, _ = tree_usage(spec["shm_dir"])
            epochs.append({"epoch": epoch + 1, "rank": proc_metrics(os.getpid(), shm_roots),
                           "workers": workers, "shm_bytes": shm_bytes, "segments": segment_count(spec["shm_dir"])})
        del loader
        shm_ds.release()
        disk_ds.flush()
        dist.barrier()
        results["configs"].append({"config": name, "epochs": epochs, "items_checked": checked, "wrong": wrong,
                                   "seconds": round(time.monotonic() - t0, 1)})
    with open(spec["out"].format(rank=rank), "w") as f:
        json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()
    return 0


# ---------------------------------------------------------------------------------------- launcher
def _growth(series: list[int | None]) -> int | None:
    """Last epoch minus first epoch: a leak accumulates, so it shows at the end; a transient in between (a
    disk writer thread started for a write still in flight from epoch 1, gone 2 s later) does not count."""
    values = [v for v in series if v is not None]
    if len(values) < 2:
        return None
    return values[-1] - values[0]


_SAMPLED_IN_FLIGHT = ("fds", "threads", "shm_maps")
"""Counts a sample can catch in flight (a descriptor, a thread and the shared-memory maps of a batch being handed
over): they must grow in every later epoch to count."""


def _sustained_growth(series: list[int | None]) -> int | None:
    """The least any later epoch exceeds the first by: a leak accumulates and shows in every later epoch; a
    descriptor held for a moment when one sample was taken (IPC of a batch in flight) shows in one only."""
    values = [v for v in series if v is not None]
    if len(values) < 2:
        return None
    return min(values[1:]) - values[0]


def analyze(ranks: list[dict], args: argparse.Namespace) -> tuple[list[dict], list[str]]:
    """Growth after the first epoch, per config, per process (rank, rank's worker k) and metric."""
    rows, failures = [], []
    limits = {"fds": 0, "threads": 0, "shm_maps": 0, "maps": args.maps_slack, "rss": args.rss_slack_mib << 20,
              "segment_fds": None, "batch_fds": None, "vm_rss": None}
    for r in ranks:
        for cfg in r["configs"]:
            if cfg["wrong"]:
                failures.append(f"rank {r['rank']} {cfg['config']}: {cfg['wrong']} wrong items")
            series = {f"rank{r['rank']}": [e["rank"] for e in cfg["epochs"]]}
            for k in range(args.workers):
                series[f"rank{r['rank']}.worker{k}"] = [
                    e["workers"][k] if k < len(e["workers"]) else None for e in cfg["epochs"]
                ]
            for proc, samples in series.items():
                row: dict[str, Any] = {"config": cfg["config"], "process": proc}
                for m in METRICS:
                    values = [s[m] if s else None for s in samples]
                    g = _sustained_growth(values) if m in _SAMPLED_IN_FLIGHT else _growth(values)
                    row[m] = values
                    row[f"{m}_growth"] = g
                    if g is not None and limits[m] is not None and g > limits[m]:
                        failures.append(f"{cfg['config']} {proc}: {m} grew by {g} after epoch 1: {values}")
                segments = [e["segments"] for e in cfg["epochs"]]
                # one descriptor per segment at most, whatever the number of entries read (plus the one a process
                # that wrote entries keeps open on its own segment, for appending)
                over = [(s["segment_fds"], n) for s, n in zip(samples, segments) if s and s["segment_fds"] > n + 1]
                if over:
                    failures.append(f"{cfg['config']} {proc}: more segment descriptors than segments: {over}")
                rows.append(row)
            if r["rank"] == 0:
                shm = [e["shm_bytes"] for e in cfg["epochs"]]
                segments = [e["segments"] for e in cfg["epochs"]]
                g, gs = _growth(shm), _growth(segments)
                rows.append({"config": cfg["config"], "process": "shared memory (bytes)", "shm": shm,
                             "shm_growth": g, "segments": segments})
                if g:
                    failures.append(f"{cfg['config']}: shared memory grew by {g} bytes after epoch 1: {shm}")
                if gs:
                    failures.append(f"{cfg['config']}: segments grew by {gs} after epoch 1: {segments}")
    return rows, failures


def _fmt(row: dict, m: str) -> str:
    g = row.get(f"{m}_growth")
    vals = row.get(m)
    if not vals:
        return "-"
    last = vals[-1]
    if m in ("rss", "vm_rss"):
        return f"{(last or 0) / 2**20:.0f}M ({'+' if (g or 0) >= 0 else ''}{(g or 0) / 2**20:.1f})"
    return f"{last} ({'+' if (g or 0) >= 0 else ''}{g})"


def report(rep: harness.Report, rows: list[dict], summary: dict[str, Any], failures: list[str]) -> None:
    """The table of every process's last epoch and growth, and the checks."""
    rep.heading("Every process: the last epoch, and the growth after the first (in brackets)")
    table = [["config", "process", *METRICS]]
    shm_lines = []
    for row in rows:
        if "shm" in row:
            shm_lines.append(f"{row['config']}: shared memory {row['shm'][-1]} bytes (growth {row['shm_growth']}), "
                             f"{row['segments'][-1]} segments")
            continue
        table.append([row["config"], row["process"], *(_fmt(row, m) for m in METRICS)])
    if len(table) > 1:
        rep.table(table, left=2)
    rep.line("\n".join(shm_lines))
    rep.heading("Checks")
    kinds = (
        ("the ranks ran to the end", ("rank exit codes", "did not finish", "missing rank results")),
        (f"every item read back as written ({summary['items_checked']} checked)", ("wrong items",)),
        ("nothing grows after the first epoch (descriptors, threads, maps, memory, shared memory, segments)",
         ("grew by", "more segment descriptors")),
        ("nothing left behind (shared memory, temporary files)", ("left in", "temporary files")),
    )  # fmt: skip
    checks = []
    for text, marks in kinds:
        mine = [f for f in failures if any(m in f for m in marks)]
        checks.append((not mine, text + "".join(f"\n    {f}" for f in mine)))
    rep.targets(checks)
    rep.line(f"{summary['seconds']} s; largest growth per metric: {summary['max_growth']}")


def _reexec_private(argv: list[str], size: str) -> int | None:
    """Run this script again in a private mount namespace with a fresh tmpfs on /dev/shm (None if impossible)."""
    if shutil.which("unshare") is None:
        return None
    inner = " ".join(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=1777", "tmpfs", "/dev/shm", "&&", "exec",
         sys.executable, os.path.abspath(__file__), *(f"'{a}'" for a in argv), "--in-namespace"]
    )
    probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "true"], capture_output=True)
    if probe.returncode != 0:
        return None
    return subprocess.call(["unshare", "--mount", "--propagation", "private", "sh", "-c", inner])


def configs(args: argparse.Namespace) -> list[tuple[str, bool]]:
    """(start method, persistent_workers) pairs to run: ``--configs``, else ``--contexts`` x ``--persistent``."""
    if args.configs:
        pairs = [c.split("/") for c in args.configs.split(",")]
        return [(ctx, flag == "on") for ctx, flag in pairs]
    return [(ctx, flag == "on") for ctx in args.contexts.split(",") for flag in args.persistent.split(",")]


def launch(args: argparse.Namespace) -> int:
    work = tempfile.mkdtemp(prefix="monai-cache-soak-")
    shm_dir = os.path.join("/dev/shm", f"monai-cache-soak-{os.getpid()}")
    os.makedirs(shm_dir)
    cache_dir = os.path.join(work, "disk")
    shm_before = set(os.listdir("/dev/shm"))
    spec = {
        "epochs": args.epochs, "items": args.items, "floats": max(1, args.item_kb * 1024 // 4),
        "workers": args.workers, "configs": configs(args), "shm_dir": shm_dir, "cache_dir": cache_dir,
        "out": os.path.join(work, "rank{rank}.json"),
    }
    spec_path = os.path.join(work, "spec.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    failures: list[str] = []
    machine = harness.machine_info()
    t0 = time.monotonic()
    env = dict(os.environ, MONAI_CACHE_SHM_DIR=shm_dir, OMP_NUM_THREADS="1")
    try:  # ranks started like torchrun; rank<r>.log in work
        harness.run_ranks([os.path.abspath(__file__), "--rank-main", spec_path], args.ranks, work, env=env,
                          timeout=args.timeout)  # fmt: skip
    except RuntimeError as e:  # a rank failed or did not finish: its log's end is in the message
        failures.append(f"rank exit codes or timeout: {str(e).splitlines()[0]}")
        print(e, file=sys.stderr)
    seconds = time.monotonic() - t0
    ranks = []
    for r in range(args.ranks):
        with contextlib.suppress(FileNotFoundError):
            with open(spec["out"].format(rank=r)) as f:
                ranks.append(json.load(f))
    rows, more = analyze(ranks, args) if len(ranks) == args.ranks else ([], ["missing rank results"])
    failures += more
    # What the run left behind, once every process has exited.
    shm_bytes, shm_files = tree_usage(shm_dir)
    cache_dirs = [os.path.join(shm_dir, n) for n in os.listdir(shm_dir)]
    cache_dirs = [os.path.join(d, n) for d in cache_dirs if os.path.isdir(d) for n in os.listdir(d)]
    leftover_caches = [d for d in cache_dirs if os.path.isdir(d)]
    if shm_bytes or leftover_caches:
        failures.append(f"left in shared memory: {shm_bytes} bytes, caches {leftover_caches}, files {shm_files}")
    temp_files = [n for _, _, names in os.walk(cache_dir) for n in names if n.endswith(".tmp")]
    if temp_files:
        failures.append(f"temporary files left in the disk cache: {temp_files}")
    shutil.rmtree(shm_dir, ignore_errors=True)
    new_in_shm = sorted(set(os.listdir("/dev/shm")) - shm_before)
    if args.in_namespace and new_in_shm:
        failures.append(f"left in the (private) /dev/shm after exit: {new_in_shm}")
    items_checked = sum(c["items_checked"] for r in ranks for c in r["configs"])
    summary = {
        "ok": not failures, "failures": failures, "seconds": round(seconds, 1), "private_shm": bool(args.in_namespace),
        "epochs": args.epochs, "items": args.items, "item_kb": args.item_kb, "ranks": args.ranks,
        "workers": args.workers, "configs": [c["config"] for c in ranks[0]["configs"]] if ranks else [],
        "items_checked": items_checked, "wrong_items": sum(c["wrong"] for r in ranks for c in r["configs"]),
        "shm_bytes_left": shm_bytes, "shm_files_left": shm_files, "new_in_dev_shm": new_in_shm,
        "temp_files_left": len(temp_files),
        "max_growth": {m: max((row.get(f"{m}_growth") or 0 for row in rows if "shm" not in row), default=0)
                       for m in METRICS},
    }
    rep = harness.Report("soak")
    rep.machine(machine, at_end=True)
    rep.line(f"{args.ranks} ranks x {args.workers} DataLoader workers, {args.epochs} epochs, {args.items} + "
             f"{args.items} items ({args.item_kb} KiB), configurations {', '.join(summary['configs'])}; private "
             f"/dev/shm: {summary['private_shm']}")
    report(rep, rows, summary, failures)
    if args.out:
        rep.save(args.out, {"machine": machine, "summary": summary, "rows": rows, "ranks": ranks})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": summary, "rows": rows, "ranks": ranks}, f, indent=1)
    shutil.rmtree(work, ignore_errors=True)
    return 0 if not failures else 1


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--rank-main"]:
        return rank_main(argv[1])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--items", type=int, default=64, help="items in each of the two datasets")
    parser.add_argument("--item-kb", type=int, default=1024,
                        help="size of every fourth item's image (KiB); the others are 16 times smaller")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers per rank")
    parser.add_argument("--contexts", default="fork,spawn", help="DataLoader start methods to run")
    parser.add_argument("--persistent", default="on,off", help="persistent_workers settings to run")
    parser.add_argument("--configs", default=None,
                        help="explicit list instead of contexts x persistent, e.g. fork/on,fork/off,spawn/on")
    parser.add_argument("--maps-slack", type=int, default=8, help="memory maps a process may gain after epoch 1")
    parser.add_argument("--rss-slack-mib", type=int, default=16, help="RSS a process may gain after epoch 1 (MiB)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds before the ranks are killed")
    parser.add_argument("--private-shm", action="store_true",
                        help="run in a private mount namespace with a fresh /dev/shm (root; falls back if impossible)")
    parser.add_argument("--shm-size", default="2g", help="size of the private /dev/shm")
    parser.add_argument("--json", default=None, help="write all measurements here")
    parser.add_argument("--out", default=None, help="write soak.md (what was printed) and soak.json here")
    parser.add_argument("--in-namespace", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.private_shm and not args.in_namespace:
        forwarded = [a for a in argv if a != "--private-shm"]
        code = _reexec_private(forwarded, args.shm_size)
        if code is not None:
            return code
        print("note: no private /dev/shm here (unshare/mount refused); running in the shared one", file=sys.stderr)
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())
