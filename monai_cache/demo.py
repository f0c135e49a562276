"""``monai-cache demo``: stock MONAI against monai_cache on a small distributed job, side by side.

One command, no downloads. It writes synthetic CT-like NIfTI volumes (:mod:`monai_cache.synthetic`), then runs
the same job twice, once on ``monai.data.CacheDataset`` and once on ``monai_cache.CacheDataset``: ``--ranks``
processes started by torch's own launcher (``python -m torch.distributed.run``, i.e. ``torchrun``; ``gloo``),
each with a ``monai.data.DataLoader`` of ``--workers`` worker processes and torch's ``DistributedSampler``,
training a tiny 3-D convolution for a few epochs with an ``all_reduce`` of its gradients per step. Then it
prints a table.

How it measures (``benchmarks/bench_cache.py`` in the source repository measures more, with repeats):

* Times: each rank's, from the start of building its dataset (after a barrier, so all start together); the
  table shows the slowest rank. CPU: ``getrusage`` of each rank and its reaped DataLoader workers, summed.
* Deterministic transform runs: :class:`CountRuns`, placed after the cached part of the chain, appends a
  byte to a file shared by every process each time it runs (``w`` in a DataLoader worker, ``r`` in a rank).
* Cache hits: monai_cache's machine-wide counters (``cache_stats()``); for MONAI, the items the samplers
  yielded minus the runs in DataLoader workers.
* Memory of all processes together, sampled by this process every half second: the PSS of every process
  torchrun started (ranks and their workers) less its shared-memory part (``Pss - Pss_Shmem``), plus the
  allocated bytes of monai_cache's shared-memory files (a private directory for each run), so that every page
  counts once. torch's short-lived shared-memory batches are left out, the same for both.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from monai.transforms import Transform

from monai_cache.keeper import wait_for_keepers
from monai_cache.launcher import launch_view
from monai_cache.synthetic import crop_size_for, make_dataset, tutorial_transforms
from monai_cache.utils import format_table as render_table

__all__ = ["CONFIGS", "ROWS", "CountRuns", "add_arguments", "format_table", "main", "run"]

#: The two runs: name -> the dataset class used.
CONFIGS = {"monai": "monai.data.CacheDataset", "monai-cache": "monai_cache.CacheDataset"}
#: (volumes, voxels per volume, epochs) by default, and with ``--quick``.
DEFAULT_SIZE: tuple[int, tuple[int, int, int], int] = (24, (160, 160, 96), 3)
QUICK_SIZE: tuple[int, tuple[int, int, int], int] = (8, (64, 64, 48), 2)
_MIB = 1 << 20

#: Rows of the table: (title, key of a result, format).
ROWS: tuple[tuple[str, str, str], ...] = (
    ("time to first batch (s)", "ttfb_s", "{:.1f}"),
    ("  of which building the dataset (s)", "setup_s", "{:.1f}"),
    ("epoch 1 (s)", "first_epoch_s", "{:.1f}"),
    ("warm epochs, mean (s)", "warm_epoch_s", "{:.1f}"),
    ("training, start to end (s)", "train_s", "{:.1f}"),
    ("CPU time, ranks + workers (s)", "cpu_s", "{:.0f}"),
    ("memory peak, all processes (MiB)", "mem_peak_mib", "{:.0f}"),
    ("memory mean, all processes (MiB)", "mem_mean_mib", "{:.0f}"),
    ("deterministic transform runs", "computes", "{:d}"),
    ("cache hits", "hits", "{:d}"),
    ("cache misses", "misses", "{:d}"),
)


# ---------------------------------------------------------------------------------------------------------
# In each rank (started by torchrun)
# ---------------------------------------------------------------------------------------------------------


class CountRuns(Transform):
    """Appends one byte to ``path`` each time it runs: ``w`` in a DataLoader worker, ``r`` in a rank.

    Placed after the deterministic transforms, it counts their runs in MONAI and monai_cache alike: being a
    deterministic transform itself, a cache stores its output with theirs (one ``O_APPEND`` write is atomic
    between processes).

    Args:
        path: the file the bytes go to.
    """

    def __init__(self, path: str) -> None:
        self.path = path

    def __call__(self, data: Any) -> Any:
        from torch.utils.data import get_worker_info

        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, b"w" if get_worker_info() is not None else b"r")
        finally:
            os.close(fd)
        return data


def _rank(job_path: str) -> None:
    """One rank: build the dataset, train, write ``rank<RANK>.json`` beside the job file."""
    import torch
    import torch.distributed as dist
    from monai.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    from monai_cache.codec import item_nbytes

    with open(job_path) as f:
        job = json.load(f)
    run_dir, rank = os.path.dirname(job_path), launch_view(os.environ).rank
    if rank is None:
        raise RuntimeError("a rank of the demo runs under the torchrun that the demo starts (RANK is not set)")
    dist.init_process_group("gloo")
    torch.manual_seed(job["seed"] + rank)
    files = make_dataset(job["data_dir"], job["items"], job["shape"], job["seed"])  # written already: reused
    transform = tutorial_transforms(job["crop"], after=[CountRuns(os.path.join(run_dir, "runs"))])
    model = torch.nn.Conv3d(1, 4, kernel_size=3, stride=2)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    say = rank == 0 and job["progress"]

    dist.barrier()  # every rank starts building its dataset at the same moment
    start, t0 = time.time(), time.perf_counter()
    if job["config"] == "monai":
        from monai_cache.switch import original

        dataset = original("CacheDataset")(files, transform, progress=False)  # MONAI's, even under the switch
    else:
        from monai_cache import CacheDataset

        dataset = CacheDataset(files, transform, progress=False)
    setup_s = time.perf_counter() - t0
    sampler: DistributedSampler = DistributedSampler(dataset, shuffle=True, seed=job["seed"])
    loader = DataLoader(dataset, batch_size=job["batch_size"], sampler=sampler, num_workers=job["workers"])
    ttfb, epochs = None, []
    for epoch in range(job["epochs"]):
        sampler.set_epoch(epoch)
        t = time.perf_counter()
        for batch in loader:
            ttfb = time.perf_counter() - t0 if ttfb is None else ttfb
            image = batch["image"]
            loss = model(image.as_tensor() if hasattr(image, "as_tensor") else image).mean()
            loss.backward()
            grads = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
            dist.all_reduce(grads)
            optimizer.step()
            optimizer.zero_grad()
        epochs.append(time.perf_counter() - t)
        if say:
            print(f"  {job['config']}: epoch {epoch + 1} of {job['epochs']}: {epochs[-1]:.1f} s", flush=True)
    end = time.time()
    dist.barrier()  # every worker of every rank is done: monai_cache's counters are final
    stats = dataset.cache_stats() if hasattr(dataset, "cache_stats") else None
    usage = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    result = {
        "setup_s": setup_s,
        "ttfb_s": ttfb,
        "epoch_s": epochs,
        "start": start,
        "end": end,
        "cpu_s": sum(u.ru_utime + u.ru_stime for u in usage),
        "reads": len(sampler) * job["epochs"],
        "stats": stats,
        "one_copy_bytes": stats["stored"]["bytes"] if stats else sum(item_nbytes(i) for i in dataset._cache),
    }
    with open(os.path.join(run_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()  # nobody removes the shared cache before everyone has read its counters
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------------------
# In the demo's process
# ---------------------------------------------------------------------------------------------------------

_PSS = re.compile(rb"^(Pss|Pss_Shmem):\s+(\d+) kB", re.M)


def _memory(agent: int, shm_dir: str) -> tuple[int, int]:
    """``(bytes, processes)``: every process below torchrun's ``agent``, and the files under ``shm_dir``.

    A process's shared-memory pages (``Pss_Shmem``) are left out of its PSS, and ``shm_dir``'s files are
    counted whole instead, so monai_cache's entries count once however many processes map them.
    """
    parents: dict[int, int] = {}
    for name in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError, IndexError, ValueError), open(f"/proc/{name}/stat", "rb") as f:
            parents[int(name)] = int(f.read().rsplit(b")", 1)[1].split()[1])
    below, todo = [], [agent]
    while todo:
        parent = todo.pop()
        children = [pid for pid, ppid in parents.items() if ppid == parent]
        below += children
        todo += children
    total = 0
    for pid in below:
        with contextlib.suppress(OSError), open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            kib = dict(_PSS.findall(f.read()))
            total += (int(kib.get(b"Pss", 0)) - int(kib.get(b"Pss_Shmem", 0))) << 10
    for root, _dirs, names in os.walk(shm_dir):
        for name in names:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
    return total, len(below)


def _run_config(config: str, job: dict[str, Any], ranks: int, out: str) -> dict[str, Any]:
    """Run ``config`` under torchrun, sampling memory meanwhile; returns its row of results."""
    run_dir = os.path.join(out, "runs", config)
    shutil.rmtree(run_dir, ignore_errors=True)
    os.makedirs(run_dir)
    job_path = os.path.join(run_dir, "job.json")
    with open(job_path, "w") as f:
        json.dump({**job, "config": config}, f)
    # a private directory for this run's cache: other users of monai_cache are neither disturbed nor counted
    shm_dir = tempfile.mkdtemp(prefix="monai_cache-demo-", dir=os.environ.get("MONAI_CACHE_SHM_DIR") or "/dev/shm")
    env = {**os.environ, "MONAI_CACHE_SHM_DIR": shm_dir}
    env.setdefault("PYTHONWARNINGS", "ignore::FutureWarning")
    if ranks > 1:
        env.setdefault("OMP_NUM_THREADS", "1")  # torchrun's own choice, without its warning about it
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
    samples: list[tuple[int, int]] = []
    try:
        agent = subprocess.Popen([*launch, "-m", "monai_cache.demo", "--rank-job", job_path], env=env)
        try:
            while agent.poll() is None:
                samples.append(_memory(agent.pid, shm_dir))
                with contextlib.suppress(subprocess.TimeoutExpired):
                    agent.wait(0.5)
        finally:
            if agent.poll() is None:  # interrupted: torchrun stops its ranks
                agent.terminate()
                agent.wait()
    finally:
        # the node's keeper removes the cache a moment after the agent exits: let it finish before the directory goes
        wait_for_keepers(shm_dir)
        shutil.rmtree(shm_dir, ignore_errors=True)
    if agent.returncode != 0:
        raise RuntimeError(f"{config}: torchrun exited with status {agent.returncode} (the ranks' errors are above)")
    results = []
    for rank in range(ranks):
        with open(os.path.join(run_dir, f"rank{rank}.json")) as f:
            results.append(json.load(f))
    with open(os.path.join(run_dir, "runs"), "rb") as f:
        runs = f.read()
    epochs = [max(r["epoch_s"][e] for r in results) for e in range(job["epochs"])]
    reads = sum(r["reads"] for r in results)
    stats = results[0]["stats"]
    memory = [m for m, n in samples if n]
    return {
        "config": config,
        "dataset": CONFIGS[config],
        "ttfb_s": max(r["ttfb_s"] for r in results),
        "setup_s": max(r["setup_s"] for r in results),
        "epoch_s": epochs,
        "first_epoch_s": epochs[0],
        "warm_epoch_s": sum(epochs[1:]) / (len(epochs) - 1) if len(epochs) > 1 else None,
        "train_s": max(r["end"] for r in results) - min(r["start"] for r in results),
        "cpu_s": sum(r["cpu_s"] for r in results),
        "mem_peak_mib": max(memory) / _MIB if memory else None,
        "mem_mean_mib": sum(memory) / len(memory) / _MIB if memory else None,
        "mem_samples": len(memory),
        "mem_processes_max": max((n for _m, n in samples), default=0),
        "computes": len(runs),
        "computes_in_ranks": runs.count(b"r"),
        "computes_in_workers": runs.count(b"w"),
        "reads": reads,
        "hits": int(stats["total"]["hits"]) if stats else reads - runs.count(b"w"),
        "misses": int(stats["total"]["misses"]) if stats else len(runs),
        "one_copy_bytes": results[0]["one_copy_bytes"],
    }


def format_table(results: Sequence[dict[str, Any]], markdown: bool = False) -> str:
    """Results side by side, one column each; the columns after the first show ``(x ratio)`` against it.

    Args:
        results: rows of results (dicts with the keys of :data:`ROWS` and ``"config"``).
        markdown: a Markdown table instead of aligned text.
    """
    if not results:
        return ""
    base = results[0]
    rows = [["", *(r["config"] for r in results)]]
    for title, key, fmt in ROWS:
        row = [title]
        for r in results:
            value, ref = r.get(key), base.get(key)
            row.append("-" if value is None else fmt.format(value))
            if r is not base and value is not None and ref:
                row[-1] += f" ({value / ref:.2f}x)"
        rows.append(row)
    return render_table(rows, markdown=markdown, rule=True)


# ---------------------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------------------


def _shape(text: str) -> tuple[int, int, int]:
    parts = [p for p in re.split(r"[x,\s]+", text.strip()) if p]
    if len(parts) != 3 or not all(p.isdigit() and int(p) >= 8 for p in parts):
        raise argparse.ArgumentTypeError(f"--shape needs 3 sizes of at least 8 voxels, like 160x160x96; got {text!r}")
    return (int(parts[0]), int(parts[1]), int(parts[2]))


def _count(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the demo's options to ``parser`` (used by ``monai-cache demo``)."""
    parser.add_argument("--items", type=_count, default=None, help="volumes (default 24 of 160x160x96, 3 epochs)")
    parser.add_argument("--shape", type=_shape, default=None, help="voxels per volume, like 160x160x96")
    parser.add_argument("--epochs", type=_count, default=None, help="epochs")
    parser.add_argument("--quick", action="store_true", help="8 volumes of 64x64x48, 2 epochs (the options above win)")
    parser.add_argument("--ranks", type=_count, default=2, help="processes, started by torchrun (default 2)")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers per rank (default 2)")
    parser.add_argument("--batch-size", type=_count, default=2, help="volumes per batch (default 2)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the data and the random crops")
    parser.add_argument("--out", default=None, help="for data, logs, results ($TMPDIR/monai-cache-demo)")
    parser.add_argument("--no-progress", action="store_true", help="print only the table")


def run(args: argparse.Namespace) -> int:
    """The ``demo`` command: returns the exit status."""
    if args.workers < 0:
        raise SystemExit("--workers must be >= 0")
    items, shape, epochs = QUICK_SIZE if args.quick else DEFAULT_SIZE
    items, shape, epochs = args.items or items, args.shape or shape, args.epochs or epochs
    out = os.path.abspath(args.out or os.path.join(tempfile.gettempdir(), "monai-cache-demo"))
    crop = crop_size_for(shape)
    data_dir = os.path.join(out, "data", f"ct-{'x'.join(map(str, shape))}-seed{args.seed}")
    print(
        f"monai-cache demo: {items} volumes of {'x'.join(map(str, shape))} (int16 CT-like, .nii.gz), patches "
        f"{'x'.join(map(str, crop))} x2, {args.ranks} ranks x {args.workers} workers, {epochs} epochs, batch "
        f"{args.batch_size}; output in {out}",
        flush=True,
    )
    t_start = time.perf_counter()
    if not args.no_progress:
        print(f"synthetic volumes: {data_dir} (written once, then reused)", flush=True)
    make_dataset(data_dir, items=items, shape=shape, seed=args.seed)
    job = {
        "data_dir": data_dir, "items": items, "shape": shape, "seed": args.seed, "crop": crop, "epochs": epochs,
        "workers": args.workers, "batch_size": args.batch_size, "progress": not args.no_progress,
    }  # fmt: skip
    results = []
    for config in CONFIGS:
        if not args.no_progress:
            print(f"{config}: {CONFIGS[config]}, {args.ranks} ranks started by torchrun", flush=True)
        try:
            results.append(_run_config(config, job, args.ranks, out))
        except RuntimeError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    copies = "; ".join(f"{r['config']}: {r['one_copy_bytes'] / _MIB:.0f} MiB" for r in results)
    print(f"\n{format_table(results)}\n")
    print(
        "Ratios are against monai. Times: the slowest rank; time to first batch counts from the start of the "
        "dataset's construction. Memory: PSS of all ranks and workers without their shared-memory pages, plus "
        f"monai_cache's shared-memory files, sampled every 0.5 s. One copy of the cached data: {copies}. Total "
        f"wall time {time.perf_counter() - t_start:.0f} s."
    )
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump({"items": items, "shape": shape, "epochs": epochs, "results": results}, f, indent=1)
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write(format_table(results, markdown=True) + "\n")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m monai_cache.demo`` (also that of the ranks, with ``--rank-job``)."""
    parser = argparse.ArgumentParser(prog="monai-cache demo", description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--rank-job", help=argparse.SUPPRESS)
    add_arguments(parser)
    args = parser.parse_args(argv)
    if args.rank_job:
        _rank(args.rank_job)
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
