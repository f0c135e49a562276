"""``monai-cache demo``: stock MONAI against monai_cache on a small distributed job, side by side.

One command, no downloads. It writes synthetic CT-like NIfTI volumes (:mod:`monai_cache.synthetic`), then
for each configuration to compare it starts ``--ranks`` training processes the way ``torchrun`` does
(independent interpreters with ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT`` set, ``gloo`` process group), each with a ``monai.data.DataLoader`` of
``--workers`` worker processes and a ``DistributedSampler``, runs a few epochs of a tiny 3-D convolution
with an ``all_reduce`` per step, and prints a table: time to first batch, time per epoch, memory of all
processes together, deterministic transform runs and cache hits.

The launcher (this process) measures memory from the outside, every ``--mem-interval`` seconds: the
proportional set size (PSS, ``/proc/<pid>/smaps_rollup``) of every rank and every descendant (DataLoader
workers), plus the bytes of monai_cache's shared-memory files that no process has mapped (mapped pages are
already in the PSS). See :class:`MemorySampler`.

The ranks measure their own times and CPU (``getrusage``), and the deterministic part of the transform chain
is bracketed by two tiny transforms (:class:`ComputeLog`) that append one line per computed item (with its
thread CPU time) to a log shared by all processes, so transform runs are counted the same way for MONAI
and monai_cache.

The pieces are importable: :func:`launch` runs one configuration and returns its measurements (the
benchmark script uses it), :func:`format_table` prints results side by side.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import re
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from monai.transforms import Transform

from monai_cache.synthetic import CROP_SIZE, crop_size_for, make_dataset, tutorial_transforms

__all__ = [
    "CONFIGS",
    "ComputeLog",
    "Config",
    "MemorySampler",
    "RunSpec",
    "add_arguments",
    "format_table",
    "launch",
    "main",
    "run",
]


@dataclasses.dataclass(frozen=True)
class Config:
    """One way of building the training dataset.

    Attributes:
        name: short name used on the command line (``--compare``).
        label: what it is, for the table.
        library: ``"monai"`` or ``"monai_cache"``.
        cached: whether it is a ``CacheDataset`` (else ``monai.data.Dataset``).
        runtime_cache: the ``runtime_cache`` argument of the ``CacheDataset``.
    """

    name: str
    label: str
    library: str
    cached: bool
    runtime_cache: bool = False


CONFIGS: dict[str, Config] = {
    c.name: c
    for c in (
        Config("monai", "monai.data.CacheDataset", "monai", True),
        Config("monai-runtime", "monai.data.CacheDataset(runtime_cache=True)", "monai", True, True),
        Config("monai-dataset", "monai.data.Dataset (no cache)", "monai", False),
        Config("monai-cache", "monai_cache.CacheDataset", "monai_cache", True),
        Config("monai-cache-runtime", "monai_cache.CacheDataset(runtime_cache=True)", "monai_cache", True, True),
    )
}
DEFAULT_COMPARE = ("monai", "monai-cache")
DEFAULTS = {"items": 24, "shape": (160, 160, 96), "epochs": 3}
QUICK = {"items": 8, "shape": (64, 64, 48), "epochs": 2}
_QUICK_SHAPE = "64x64x48"


@dataclasses.dataclass
class RunSpec:
    """Everything a rank needs to run one configuration (written as JSON for the rank processes).

    Attributes:
        config: a key of :data:`CONFIGS`.
        data_list: JSON file with the data list (``[{"image": ..., "label": ...}, ...]``).
        run_dir: directory for this run's logs and results (emptied first).
        shm_dir: tmpfs directory for monai_cache's shared-memory cache (``$MONAI_CACHE_SHM_DIR`` of the ranks).
        ranks: number of rank processes.
        workers: DataLoader worker processes per rank.
        epochs: number of epochs.
        batch_size: items per batch (each item yields ``num_samples`` patches).
        spatial_size: patch size of the random crop.
        num_samples: patches per item.
        fill_threads: ``num_workers`` of the ``CacheDataset`` (threads computing the cache at construction).
        sharded_sampler: use ``monai_cache.sampler.ShardedDistributedSampler(shard_by="node")`` for the
            monai_cache configurations instead of torch's ``DistributedSampler``.
        step: ``"conv"`` (tiny 3-D conv forward/backward, gradients all-reduced) or ``"sum"`` (sum the batch,
            all-reduce the sum).
        seed: seed of the random crops and the sampler.
    """

    config: str
    data_list: str
    run_dir: str
    shm_dir: str
    ranks: int = 2
    workers: int = 2
    epochs: int = 3
    batch_size: int = 2
    spatial_size: tuple[int, ...] = CROP_SIZE
    num_samples: int = 2
    fill_threads: int = 1
    sharded_sampler: bool = False
    step: str = "conv"
    seed: int = 0


# ---------------------------------------------------------------------------------------------------------
# Instrumentation inside the ranks
# ---------------------------------------------------------------------------------------------------------

_PHASE = "setup"  # "setup" while the dataset is built, "epoch" afterwards (DataLoader workers inherit it)
_clock = threading.local()


class ComputeLog(Transform):
    """Counts runs of the deterministic transforms and their CPU time, in a log shared by all processes.

    Put one with ``start=True`` before the first deterministic transform and one with ``start=False`` after
    the last one. The second appends ``"<phase> <pid> <CPU seconds>"`` to ``path`` (one ``O_APPEND`` write,
    atomic between processes). Both are deterministic MONAI transforms, so caches store their output like
    that of the others, and they are picklable and fingerprint the same way in every process.

    The CPU time is that of the whole process while the transforms ran, so that torch's intra-op threads
    (``Spacingd`` resamples with them when a process has more than one) are included. It is exact when one
    thread per process runs transforms (DataLoader workers; ``CacheDataset(num_workers=1)``, the default
    here) and counts overlapping runs more than once with more fill threads.

    Args:
        path: the log file.
        start: True for the opening marker, False for the closing one.
    """

    def __init__(self, path: str, start: bool) -> None:
        self.path = path
        self.start = start

    def __call__(self, data: Any) -> Any:
        if self.start:
            _clock.t0 = time.process_time()
        else:
            cpu = time.process_time() - getattr(_clock, "t0", time.process_time())
            line = f"{_PHASE} {os.getpid()} {cpu:.6f}\n".encode()
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                os.write(fd, line)
            finally:
                os.close(fd)
        return data


def read_compute_log(path: str) -> dict[str, float]:
    """Sum a :class:`ComputeLog` file: ``{"computes", "computes_setup", "computes_epoch", "fill_cpu_s"}``."""
    out = {"computes": 0.0, "computes_setup": 0.0, "computes_epoch": 0.0, "fill_cpu_s": 0.0}
    with contextlib.suppress(FileNotFoundError), open(path) as f:
        for line in f:
            parts = line.split()
            if len(parts) != 3:
                continue
            out["computes"] += 1
            out["computes_setup" if parts[0] == "setup" else "computes_epoch"] += 1
            out["fill_cpu_s"] += float(parts[2])
    return out


def _cpu_seconds() -> dict[str, float]:
    """CPU seconds of this process (all threads) and of its reaped children (finished DataLoader workers)."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {"self": me.ru_utime + me.ru_stime, "children": kids.ru_utime + kids.ru_stime}


def _stat_cpu(pid: int | str) -> tuple[float, float]:
    """``(own, reaped children)`` CPU seconds of a process, from ``/proc/<pid>/stat``."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0, 0.0
    tick = os.sysconf("SC_CLK_TCK")
    # after the command name: state is field 3, so utime..cstime (fields 14-17) are at 11..14
    return (int(fields[11]) + int(fields[12])) / tick, (int(fields[13]) + int(fields[14])) / tick


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds used so far by ``pid``, its living descendants and the children it has reaped."""
    total = 0.0
    for p in process_tree([pid]):
        own, reaped = _stat_cpu(p)
        total += own + reaped
    return total


def _nbytes(value: Any) -> int:
    """Bytes of the tensors and arrays in a (nested) item."""
    import numpy as np
    import torch

    if isinstance(value, torch.Tensor):
        return int(value.numel() * value.element_size())
    if isinstance(value, np.ndarray):
        return int(value.nbytes)
    if isinstance(value, dict):
        return sum(_nbytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


def _build_dataset(config: Config, files: list[dict[str, str]], transform: Any, fill_threads: int) -> Any:
    if config.library == "monai_cache":
        from monai_cache import CacheDataset

        return CacheDataset(
            files, transform, num_workers=fill_threads, progress=False, runtime_cache=config.runtime_cache
        )
    import monai.data

    if not config.cached:
        return monai.data.Dataset(files, transform)
    return monai.data.CacheDataset(
        files, transform, num_workers=fill_threads, progress=False, runtime_cache=config.runtime_cache
    )


def _make_sampler(spec: RunSpec, config: Config, dataset: Any) -> Any:
    if spec.sharded_sampler and config.library == "monai_cache":
        from monai_cache.sampler import ShardedDistributedSampler

        return ShardedDistributedSampler(dataset, shuffle=True, seed=spec.seed, shard_by="node")
    from torch.utils.data.distributed import DistributedSampler

    return DistributedSampler(dataset, shuffle=True, seed=spec.seed)


class _Events:
    """Progress events of rank 0, appended to a file the launcher polls."""

    def __init__(self, path: str | None) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600) if path else -1

    def emit(self, event: str) -> None:
        if self._fd >= 0:
            os.write(self._fd, f"{event}\n".encode())

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def rank_main(spec_path: str) -> None:
    """Body of one rank process: build the dataset, train ``epochs`` epochs, write ``rank<r>.json``.

    Reads ``RANK``, ``WORLD_SIZE`` (and ``MASTER_ADDR``/``MASTER_PORT``) from the environment, as under
    ``torchrun``.
    """
    global _PHASE
    import torch
    import torch.distributed as dist
    from monai.data import DataLoader

    with open(spec_path) as f:
        raw = json.load(f)
    raw["spatial_size"] = tuple(raw["spatial_size"])
    spec = RunSpec(**raw)
    config = CONFIGS[spec.config]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")
    torch.manual_seed(spec.seed + rank)
    events = _Events(os.path.join(spec.run_dir, "events") if rank == 0 else None)
    with open(spec.data_list) as f:
        files = json.load(f)
    log = os.path.join(spec.run_dir, "computes.log")
    transform = tutorial_transforms(
        spec.spatial_size, spec.num_samples, before=[ComputeLog(log, True)], after=[ComputeLog(log, False)]
    )
    model = torch.nn.Conv3d(1, 4, kernel_size=3, stride=2)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

    dist.barrier()  # every rank starts building its dataset at the same moment, as after torchrun's rendezvous
    _PHASE = "setup"
    cpu0 = _cpu_seconds()
    cpu0_tree = tree_cpu_seconds(os.getpid())
    cpu_ttfb = 0.0
    wall0 = time.time()
    t0 = time.perf_counter()
    dataset = _build_dataset(config, files, transform, spec.fill_threads)
    setup_s = time.perf_counter() - t0
    cpu_setup = _cpu_seconds()
    _PHASE = "epoch"
    events.emit("S")
    sampler = _make_sampler(spec, config, dataset)
    loader = DataLoader(dataset, batch_size=spec.batch_size, sampler=sampler, num_workers=spec.workers)
    ttfb: float | None = None
    epochs = []
    for epoch in range(spec.epochs):
        sampler.set_epoch(epoch)
        start_wall, start = time.time(), time.perf_counter()
        batches = 0
        for batch in loader:
            if ttfb is None:
                ttfb = time.perf_counter() - t0
                cpu_ttfb = tree_cpu_seconds(os.getpid()) - cpu0_tree
            image = batch["image"]
            image = image.as_tensor() if hasattr(image, "as_tensor") else image
            if spec.step == "conv":
                loss = model(image).mean()
                loss.backward()
                grads = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
                dist.all_reduce(grads)
                optimizer.step()
                optimizer.zero_grad()
            else:
                total = image.sum()
                dist.all_reduce(total)
            batches += 1
            events.emit(f"B{epoch}")
        epochs.append(
            {
                "seconds": time.perf_counter() - start,
                "start": start_wall,
                "end": time.time(),
                "batches": batches,
                "reads": len(sampler),
                "cpu": _cpu_seconds(),
            }
        )
    dist.barrier()  # all workers of all ranks are done: the shared counters are final
    stats = dataset.cache_stats() if hasattr(dataset, "cache_stats") else None
    one_copy = None
    if stats is not None:
        one_copy = stats["stored"]["bytes"]
    elif config.cached and not config.runtime_cache:
        one_copy = sum(_nbytes(item) for item in dataset._cache)
    result = {
        "rank": rank,
        "world": world,
        "pid": os.getpid(),
        "config": spec.config,
        "setup_s": setup_s,
        "ttfb_s": ttfb,
        "ttfb_cpu_s": cpu_ttfb,
        "start": wall0,
        "epochs": epochs,
        "cpu_start": cpu0,
        "cpu_setup": cpu_setup,
        "cpu_end": _cpu_seconds(),
        "stats": stats,
        "one_copy_bytes": one_copy,
        "sampler": type(sampler).__name__,
    }
    tmp = os.path.join(spec.run_dir, f".rank{rank}.json")
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, os.path.join(spec.run_dir, f"rank{rank}.json"))
    events.close()
    dist.barrier()  # nobody leaves (and removes the shared cache) before everyone has read its counters
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------------------
# Memory of a process tree, measured from the launcher
# ---------------------------------------------------------------------------------------------------------

_PSS = re.compile(rb"^Pss:\s+(\d+) kB", re.M)


def _children(pid: int) -> list[int]:
    """Direct children of ``pid`` (from ``/proc/<pid>/task/*/children``)."""
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                out.extend(int(x) for x in f.read().split())
        except OSError:
            continue
    return out


def process_tree(roots: Iterable[int]) -> list[int]:
    """``roots`` and all their living descendants."""
    seen: list[int] = []
    todo = [int(p) for p in roots]
    while todo:
        pid = todo.pop()
        if pid in seen or not os.path.exists(f"/proc/{pid}"):
            continue
        seen.append(pid)
        todo.extend(_children(pid))
    return seen


def _pss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            m = _PSS.search(f.read())
    except OSError:  # the process just exited
        return 0
    return int(m.group(1)) * 1024 if m else 0


def _tmpfs_files(root: str) -> dict[int, int]:
    """``{inode: allocated bytes}`` of the files under ``root``."""
    out: dict[int, int] = {}
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            with contextlib.suppress(OSError):
                st = os.lstat(os.path.join(dirpath, name))
                out[st.st_ino] = st.st_blocks * 512
    return out


def _mapped_ranges(pid: int, prefix: str) -> list[tuple[int, int, int]]:
    """``(inode, start offset, end offset)`` of the mappings of files under ``prefix`` (``/proc/<pid>/maps``)."""
    out: list[tuple[int, int, int]] = []
    try:
        with open(f"/proc/{pid}/maps") as f:
            lines = f.readlines()
    except OSError:
        return out
    for line in lines:
        parts = line.split(None, 5)
        if len(parts) < 6 or not parts[5].startswith(prefix):
            continue
        lo, hi = (int(v, 16) for v in parts[0].split("-"))
        off = int(parts[2], 16)
        out.append((int(parts[4]), off, off + hi - lo))
    return out


def _union_length(ranges: list[tuple[int, int]], cap: int) -> int:
    total, end = 0, 0
    for lo, hi in sorted(ranges):
        hi = min(hi, cap)
        if hi <= end:
            continue
        total += hi - max(lo, end)
        end = hi
    return total


class MemorySampler:
    """Samples the memory of process trees together, from outside, in a background thread.

    ``total = sum of PSS of every process + bytes of the files under shm_dir - the part of them mapped``.

    PSS (proportional set size) charges each resident page to the processes mapping it in equal parts, so
    the sum over a group of processes counts every page they use once: MONAI's cache inherited by
    forked workers, shared libraries, torch's shared-memory batches, and the pages of monai_cache's
    tmpfs files that are mapped. tmpfs pages that no process maps are in no PSS, so the allocated bytes of
    the files under ``shm_dir`` are added, minus the mapped byte ranges of those files (counted already).
    That correction assumes mapped pages have been touched, which holds for decoded cache entries (the
    transforms read them whole); between samples, short-lived batches can be missed, so peaks are lower
    bounds.

    Args:
        roots: pids whose trees are measured (the ranks); descendants are found at every sample.
        shm_dir: tmpfs directory whose files count as well (monai_cache's cache of this run).
        interval: seconds between samples.
    """

    def __init__(self, roots: Sequence[int], shm_dir: str | None, interval: float = 0.5) -> None:
        self.roots = list(roots)
        self.shm_dir = shm_dir
        self.interval = interval
        self.samples: list[dict[str, float]] = []
        self.cpu_s = 0.0  # CPU seconds the sampling itself took (kernel time walking page tables, mostly)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="memory-sampler", daemon=True)

    def sample(self) -> dict[str, float]:
        """Take one sample now: ``{"t", "total", "pss", "shm_files", "shm_mapped", "processes"}`` (bytes)."""
        t = time.time()
        pids = process_tree(self.roots)
        pss = sum(_pss_bytes(p) for p in pids)
        files: dict[int, int] = {}
        mapped = 0
        if self.shm_dir and os.path.isdir(self.shm_dir):
            files = _tmpfs_files(self.shm_dir)
            prefix = os.path.realpath(self.shm_dir) + "/"
            by_inode: dict[int, list[tuple[int, int]]] = {}
            for p in pids:
                for ino, lo, hi in _mapped_ranges(p, prefix):
                    if ino in files:
                        by_inode.setdefault(ino, []).append((lo, hi))
            mapped = sum(_union_length(r, files[ino]) for ino, r in by_inode.items())
        shm = sum(files.values())
        s = {
            "t": t,
            "total": pss + shm - mapped,
            "pss": pss,
            "shm_files": shm,
            "shm_mapped": mapped,
            "processes": len(pids),
        }
        self.samples.append(s)
        return s

    def _loop(self) -> None:
        cpu0 = time.thread_time()
        while not self._stop.is_set():
            started = time.monotonic()
            self.sample()
            self.cpu_s = time.thread_time() - cpu0
            self._stop.wait(max(0.0, self.interval - (time.monotonic() - started)))

    def start(self) -> MemorySampler:
        """Start sampling in the background."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop sampling (waits for the sample in progress)."""
        self._stop.set()
        self._thread.join()

    def summary(self, window: tuple[float, float] | None = None) -> dict[str, float | None]:
        """Peak and mean of ``total`` over all samples, and the mean within ``window`` (wall-clock times)."""
        totals = [s["total"] for s in self.samples if s["processes"] > 0]
        inside = [s["total"] for s in self.samples if window and window[0] <= s["t"] <= window[1] and s["processes"]]
        return {
            "mem_peak": max(totals) if totals else None,
            "mem_mean": sum(totals) / len(totals) if totals else None,
            "mem_warm": sum(inside) / len(inside) if inside else None,
            "mem_samples": len(totals),
            "mem_processes_max": max((int(s["processes"]) for s in self.samples), default=0),
            "mem_sampler_cpu_s": self.cpu_s,
        }


# ---------------------------------------------------------------------------------------------------------
# The launcher
# ---------------------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def batches_per_epoch(items: int, ranks: int, batch_size: int) -> int:
    """Batches each rank runs per epoch with ``DistributedSampler`` (padded to equal shards, no drop_last)."""
    return math.ceil(math.ceil(items / ranks) / batch_size)


def _tail(path: str, lines: int = 30) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


def launch(
    spec: RunSpec,
    progress: Callable[[str], None] | None = None,
    mem_interval: float = 0.5,
    timeout: float = 1800.0,
) -> dict[str, Any]:
    """Run one configuration: start the ranks like ``torchrun``, sample memory, collect the measurements.

    Args:
        spec: what to run; ``spec.run_dir`` is emptied first.
        progress: called with each event of rank 0 (``"S"``: dataset built, ``"B<epoch>"``: a batch done).
        mem_interval: seconds between memory samples.
        timeout: seconds after which the ranks are killed and an error is raised.

    Returns:
        the measurements (see the keys of :func:`summarize_run`).

    Raises:
        RuntimeError: a rank failed or timed out (the message holds the end of its log).
    """
    if spec.config not in CONFIGS:
        raise ValueError(f"unknown configuration {spec.config!r}; choose from {', '.join(CONFIGS)}")
    shutil.rmtree(spec.run_dir, ignore_errors=True)
    os.makedirs(spec.run_dir)
    os.makedirs(spec.shm_dir, exist_ok=True)
    spec_path = os.path.join(spec.run_dir, "spec.json")
    with open(spec_path, "w") as f:
        json.dump(dataclasses.asdict(spec), f)
    port = _free_port()
    procs: list[subprocess.Popen] = []
    logs = []
    t_launch = time.time()
    try:
        for rank in range(spec.ranks):
            env = dict(os.environ)
            env.update(
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                GROUP_RANK="0",
                ROLE_RANK=str(rank),
                WORLD_SIZE=str(spec.ranks),
                LOCAL_WORLD_SIZE=str(spec.ranks),
                ROLE_WORLD_SIZE=str(spec.ranks),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                MONAI_CACHE_SHM_DIR=spec.shm_dir,
                PYTHONWARNINGS=env.get("PYTHONWARNINGS", "ignore::FutureWarning"),
            )
            if spec.ranks > 1:
                env.setdefault("OMP_NUM_THREADS", "1")  # what torchrun does with more than one process per node
            log_path = os.path.join(spec.run_dir, f"rank{rank}.log")
            logs.append(log_path)
            with open(log_path, "wb") as log:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "monai_cache.demo", "--rank-spec", spec_path],
                        env=env,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                    )
                )
        sampler = MemorySampler([p.pid for p in procs], spec.shm_dir, mem_interval).start()
        events_path = os.path.join(spec.run_dir, "events")
        seen = 0
        deadline = time.monotonic() + timeout
        failed = None
        try:
            while True:
                codes = [p.poll() for p in procs]
                seen = _poll_events(events_path, seen, progress)
                if any(c not in (None, 0) for c in codes):
                    failed = next(i for i, c in enumerate(codes) if c not in (None, 0))
                    break
                if all(c == 0 for c in codes):
                    break
                if time.monotonic() > deadline:
                    failed = -1
                    break
                time.sleep(0.1)
        finally:
            sampler.stop()
        t_end = time.time()
        _poll_events(events_path, seen, progress)
        if failed is not None:
            what = f"rank {failed} exited with code {procs[failed].returncode}" if failed >= 0 else "the run timed out"
            log_path = logs[max(failed, 0)]
            raise RuntimeError(f"{spec.config}: {what}. End of {log_path}:\n{_tail(log_path)}")
    finally:
        for p in procs:  # only our own rank processes, by pid; their DataLoader workers exit with them
            if p.poll() is None:
                p.kill()
                p.wait()
    ranks = []
    for rank in range(spec.ranks):
        with open(os.path.join(spec.run_dir, f"rank{rank}.json")) as f:
            ranks.append(json.load(f))
    result = summarize_run(spec, ranks, read_compute_log(os.path.join(spec.run_dir, "computes.log")), sampler)
    result["wall_s"] = t_end - t_launch
    with open(os.path.join(spec.run_dir, "result.json"), "w") as f:
        json.dump(result, f, indent=1)
    return result


def _poll_events(path: str, seen: int, progress: Callable[[str], None] | None) -> int:
    try:
        with open(path, "rb") as f:
            f.seek(seen)
            chunk = f.read()
    except OSError:
        return seen
    end = chunk.rfind(b"\n") + 1
    if progress is not None:
        for event in chunk[:end].decode().split():
            progress(event)
    return seen + end


def summarize_run(
    spec: RunSpec, ranks: list[dict[str, Any]], computes: dict[str, float], sampler: MemorySampler
) -> dict[str, Any]:
    """Combine the ranks' reports, the transform log and the memory samples into one record.

    Times are the slowest rank's (the per-step ``all_reduce`` keeps ranks in step); CPU, reads and
    transform runs are summed over ranks (workers included).
    """
    config = CONFIGS[spec.config]
    epochs = [max(r["epochs"][e]["seconds"] for r in ranks) for e in range(spec.epochs)]
    reads = sum(ep["reads"] for r in ranks for ep in r["epochs"])
    cpu = sum(r["cpu_end"]["self"] + r["cpu_end"]["children"] for r in ranks)
    setup_cpu = sum(r["cpu_setup"]["self"] - r["cpu_start"]["self"] for r in ranks)
    stats = next((r["stats"] for r in ranks if r["stats"] is not None), None)
    if stats is not None:  # monai_cache: the machine-wide counters
        hits, misses = int(stats["total"]["hits"]), int(stats["total"]["misses"])
    elif config.cached:  # MONAI: every read not computed during the epochs was served from the cache
        hits, misses = int(reads - computes["computes_epoch"]), int(computes["computes"])
    else:
        hits, misses = 0, int(computes["computes"])
    one_copy = next((r["one_copy_bytes"] for r in ranks if r.get("one_copy_bytes")), None)
    warm_cpu = 0.0  # CPU of epochs 2.. (DataLoader workers are reaped at the end of each epoch)
    for r in ranks:
        ends = [ep["cpu"]["self"] + ep["cpu"]["children"] for ep in r["epochs"]]
        warm_cpu += ends[-1] - ends[0]
    warm_window = None
    if spec.epochs > 1:
        warm_window = (min(r["epochs"][1]["start"] for r in ranks), max(r["epochs"][-1]["end"] for r in ranks))
    return {
        "config": spec.config,
        "label": config.label,
        "ranks": spec.ranks,
        "workers": spec.workers,
        "epochs": spec.epochs,
        "ttfb_s": max(r["ttfb_s"] for r in ranks),
        "ttfb_cpu_s": sum(r["ttfb_cpu_s"] for r in ranks),
        "setup_s": max(r["setup_s"] for r in ranks),
        "setup_cpu_s": setup_cpu,
        "epoch_s": epochs,
        "first_epoch_s": epochs[0],
        "warm_epoch_s": sum(epochs[1:]) / (len(epochs) - 1) if len(epochs) > 1 else None,
        "warm_epoch_cpu_s": warm_cpu / (spec.epochs - 1) if spec.epochs > 1 else None,
        "train_s": max(r["epochs"][-1]["end"] for r in ranks) - min(r["start"] for r in ranks),
        "cpu_s": cpu,
        "reads": reads,
        "hits": hits,
        "misses": misses,
        "computes": int(computes["computes"]),
        "computes_setup": int(computes["computes_setup"]),
        "computes_epoch": int(computes["computes_epoch"]),
        "fill_cpu_s": computes["fill_cpu_s"],
        "one_copy_bytes": one_copy,
        "sampler": ranks[0]["sampler"],
        **sampler.summary(warm_window),
    }


# ---------------------------------------------------------------------------------------------------------
# The table
# ---------------------------------------------------------------------------------------------------------

_MIB = 1 << 20
ROWS: tuple[tuple[str, str, str], ...] = (
    ("time to first batch (s)", "ttfb_s", "{:.1f}"),
    ("  of which building the dataset (s)", "setup_s", "{:.1f}"),
    ("epoch 1 (s)", "first_epoch_s", "{:.1f}"),
    ("warm epochs, mean (s)", "warm_epoch_s", "{:.1f}"),
    ("training, start to end (s)", "train_s", "{:.1f}"),
    ("CPU time, ranks + workers (s)", "cpu_s", "{:.0f}"),
    ("memory peak, all processes (MiB)", "mem_peak", "{:.0f}"),
    ("memory mean, all processes (MiB)", "mem_mean", "{:.0f}"),
    ("deterministic transform runs", "computes", "{:d}"),
    ("cache hits", "hits", "{:d}"),
    ("cache misses", "misses", "{:d}"),
)
_SCALE = {"mem_peak": _MIB, "mem_mean": _MIB}


def _cell(value: Any, fmt: str, key: str) -> str:
    if value is None:
        return "-"
    value = value / _SCALE[key] if key in _SCALE else value
    return fmt.format(value)


def format_table(results: Sequence[dict[str, Any]], baseline: str | None = None, markdown: bool = False) -> str:
    """Results side by side, one column per configuration; columns after the baseline show ``(x ratio)``.

    Args:
        results: records from :func:`launch`.
        baseline: the configuration the ratios are taken against (default: the first one).
        markdown: a Markdown table instead of aligned text.
    """
    if not results:
        return ""
    base = next((r for r in results if r["config"] == baseline), results[0])
    header = ["", *(r["config"] for r in results)]
    body = []
    for title, key, fmt in ROWS:
        row = [title]
        for r in results:
            cell = _cell(r.get(key), fmt, key)
            b, v = base.get(key), r.get(key)
            if r is not base and isinstance(v, (int, float)) and isinstance(b, (int, float)) and b:
                cell += f" ({v / b:.2f}x)"
            row.append(cell)
        body.append(row)
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|"]
        lines += ["| " + " | ".join(row) + " |" for row in body]
        return "\n".join(lines)
    widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]
    fmt_row = lambda row: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))  # noqa: E731
    return "\n".join([fmt_row(header), "  ".join("-" * w for w in widths), *(fmt_row(r) for r in body)])


# ---------------------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------------------


def _shape(text: str) -> tuple[int, int, int]:
    parts = [p for p in re.split(r"[x,\s]+", text.strip()) if p]
    if len(parts) != 3 or not all(p.isdigit() and int(p) >= 8 for p in parts):
        raise argparse.ArgumentTypeError(f"--shape needs 3 sizes of at least 8 voxels, like 160x160x96; got {text!r}")
    return (int(parts[0]), int(parts[1]), int(parts[2]))


def _compare(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown configuration(s) {unknown}; choose from {', '.join(CONFIGS)}")
    return names


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def default_out_dir() -> str:
    """Where results and the synthetic data go by default (the data is reused by later runs)."""
    return os.path.join(tempfile.gettempdir(), "monai-cache-demo")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the demo's options to ``parser`` (used by ``monai-cache demo``)."""
    parser.add_argument("--items", type=_positive, default=None, help=f"volumes (default {DEFAULTS['items']})")
    parser.add_argument("--shape", type=_shape, default=None, help="voxels per volume (default 160x160x96)")
    parser.add_argument("--epochs", type=_positive, default=None, help=f"epochs (default {DEFAULTS['epochs']})")
    parser.add_argument("--ranks", type=_positive, default=2, help="processes, started like torchrun (default 2)")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers per rank (default 2)")
    parser.add_argument("--batch-size", type=_positive, default=2, help="volumes per batch (default 2)")
    parser.add_argument(
        "--compare",
        type=_compare,
        default=list(DEFAULT_COMPARE),
        help=f"configurations, comma-separated; ratios are against the first (default {','.join(DEFAULT_COMPARE)}; "
        f"available: {', '.join(CONFIGS)})",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"tiny run (~30 s): {QUICK['items']} volumes of {_QUICK_SHAPE}, "
        f"{QUICK['epochs']} epochs (explicit --items/--shape/--epochs still win)",
    )
    parser.add_argument("--out", default=None, help=f"directory for data, logs, results (default {default_out_dir()})")
    parser.add_argument("--fill-threads", type=_positive, default=1, help="CacheDataset num_workers (default 1)")
    parser.add_argument(
        "--sharded-sampler",
        action="store_true",
        help="use monai_cache.sampler.ShardedDistributedSampler(shard_by='node') for the monai_cache configurations",
    )
    parser.add_argument("--step", choices=("conv", "sum"), default="conv", help="training step (default: 3-D conv)")
    parser.add_argument("--mem-interval", type=float, default=0.5, help="seconds between memory samples (default 0.5)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the data and the random crops")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def resolve_sizes(args: argparse.Namespace) -> tuple[int, tuple[int, int, int], int]:
    """``(items, shape, epochs)`` from the options, ``--quick`` and the defaults."""
    preset = QUICK if args.quick else DEFAULTS
    items = args.items if args.items is not None else int(preset["items"])  # type: ignore[call-overload]
    shape = tuple(args.shape) if args.shape is not None else tuple(preset["shape"])  # type: ignore[arg-type]
    epochs = args.epochs if args.epochs is not None else int(preset["epochs"])  # type: ignore[call-overload]
    return items, shape, epochs  # type: ignore[return-value]


def prepare_data(out: str, items: int, shape: Sequence[int], seed: int, bar: Any = None) -> str:
    """Write (or reuse) the synthetic volumes under ``out``; returns the path of the data list (JSON)."""
    data_dir = os.path.join(out, "data", f"ct-{'x'.join(map(str, shape))}-seed{seed}")
    update = bar.update if bar is not None else None
    files = make_dataset(data_dir, items=items, shape=shape, seed=seed, progress=update)
    data_list = os.path.join(out, f"datalist-{items}-{'x'.join(map(str, shape))}-seed{seed}.json")
    with open(data_list, "w") as f:
        json.dump(files, f)
    return data_list


def private_shm_dir() -> str:
    """A fresh tmpfs directory for one demo's caches, so that other users of monai_cache on the machine
    neither disturb nor are counted in the measurements."""
    base = os.environ.get("MONAI_CACHE_SHM_DIR") or "/dev/shm"
    return tempfile.mkdtemp(prefix="monai_cache-demo-", dir=base)


def run(args: argparse.Namespace) -> int:
    """The ``demo`` command: returns the exit status."""
    from tqdm import tqdm

    items, shape, epochs = resolve_sizes(args)
    if args.workers < 0:
        raise SystemExit("--workers must be >= 0")
    if args.sharded_sampler:
        try:
            import monai_cache.sampler  # noqa: F401
        except ImportError as e:
            raise SystemExit(f"--sharded-sampler: monai_cache.sampler is not available ({e})") from None
    out = os.path.abspath(args.out or default_out_dir())
    os.makedirs(out, exist_ok=True)
    crop = crop_size_for(shape)
    per_epoch = batches_per_epoch(items, args.ranks, args.batch_size)
    total = items + len(args.compare) * (1 + epochs * per_epoch)
    print(
        f"monai-cache demo: {items} volumes of {'x'.join(map(str, shape))} (int16 CT-like, .nii.gz), patches "
        f"{'x'.join(map(str, crop))} x2, {args.ranks} ranks x {args.workers} workers, {epochs} epochs, batch "
        f"{args.batch_size}; comparing {', '.join(args.compare)}; output in {out}",
        flush=True,
    )
    bar = tqdm(total=total, desc="synthetic data", unit="step", disable=args.no_progress, dynamic_ncols=True)
    results = []
    shm_dir = private_shm_dir()
    t_start = time.perf_counter()
    try:
        data_list = prepare_data(out, items, shape, args.seed, bar)
        for name in args.compare:
            bar.set_description(f"{name}: starting")

            def on_event(event: str, name: str = name) -> None:
                bar.update(1)
                if event == "S":
                    bar.set_description(f"{name}: epoch 1")
                elif event.startswith("B"):
                    bar.set_description(f"{name}: epoch {int(event[1:]) + 1}")

            spec = RunSpec(
                config=name,
                data_list=data_list,
                run_dir=os.path.join(out, "runs", name),
                shm_dir=shm_dir,
                ranks=args.ranks,
                workers=args.workers,
                epochs=epochs,
                batch_size=args.batch_size,
                spatial_size=crop,
                fill_threads=args.fill_threads,
                sharded_sampler=args.sharded_sampler,
                step=args.step,
                seed=args.seed,
            )
            results.append(launch(spec, on_event, mem_interval=args.mem_interval))
        bar.close()
    except RuntimeError as e:
        bar.close()
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(shm_dir, ignore_errors=True)
    elapsed = time.perf_counter() - t_start
    table = format_table(results)
    copies = [
        f"{r['config']}: {r['one_copy_bytes'] / _MIB:.0f} MiB" for r in results if r.get("one_copy_bytes") is not None
    ]
    print()
    print(table)
    print()
    print(
        f"Ratios are against {results[0]['config']}. Times: the slowest rank; time to first batch counts from the "
        "start of the dataset's construction. Memory: PSS of all ranks and workers plus unmapped shared-memory "
        "cache files, sampled every "
        f"{args.mem_interval:g} s. One copy of the cached data: {'; '.join(copies) or 'n/a'}. "
        f"Total wall time {elapsed:.0f} s."
    )
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump({"items": items, "shape": shape, "epochs": epochs, "results": results}, f, indent=1)
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write(format_table(results, markdown=True) + "\n")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m monai_cache.demo`` (also the rank processes' entry point)."""
    parser = argparse.ArgumentParser(prog="monai-cache demo", description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--rank-spec", help=argparse.SUPPRESS)
    add_arguments(parser)
    args = parser.parse_args(argv)
    if args.rank_spec:
        rank_main(args.rank_spec)
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
