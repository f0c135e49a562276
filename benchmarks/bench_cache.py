#!/usr/bin/env python
"""Stock MONAI against monai_cache, side by side in the same run: time, CPU and memory of caching.

The data and transform chain are those ``monai-cache demo`` trains on (:mod:`monai_cache.synthetic`: synthetic
CT-like NIfTI volumes, the tutorial chain ending in ``RandCropByPosNegLabeld``); the ranks are started like
``torchrun`` by :func:`harness.run_ranks`, with DataLoader workers, and memory is sampled from outside by
:class:`harness.MemorySampler`. For every setting (``--settings``, default one process x 2 workers and 2 ranks
x 2 workers) it runs each configuration

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

Then it checks its targets: transforms run once per item on the machine, memory at most 1.2 copies above the
uncached run, the first batch on the fly at most 1.1x an uncached one, the fill's CPU not growing with ranks. Warm
epochs, per loader and every one of them, are the ``warm`` suite's (``python -m benchmarks warm``). This is a
benchmark, not a timed test: on a shared machine the numbers are noisy.

The script is also the ranks' program (``--rank-spec``): :func:`launch` runs one configuration (:class:`RunSpec`)
and returns its measurements (:func:`summarize_run`).

Usage::

    python -m benchmarks cache                # 24 volumes of 160x160x96, 3 epochs, 2 repeats
    python -m benchmarks cache --quick        # tiny, about a minute or two
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import resource
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import harness
from monai.transforms import Transform

from monai_cache.codec import item_nbytes
from monai_cache.synthetic import CROP_SIZE, crop_size_for, make_dataset, tutorial_transforms
from monai_cache.utils import format_table

DEFAULT_CONFIGS = ("monai-dataset", "monai", "monai-cache", "monai-cache-runtime")
BASELINE = "monai"
UNCACHED = "monai-dataset"
_MIB = 1 << 20


@dataclasses.dataclass(frozen=True)
class Config:
    """One way of building the training dataset.

    Attributes:
        name: short name used on the command line (``--configs``).
        label: what it is.
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
        step: ``"conv"`` (tiny 3-D conv forward/backward, gradients all-reduced) or ``"sum"`` (sum the batch,
            all-reduce the sum).
        seed: seed of the random crops and the sampler.
        persistent_workers: the DataLoader's ``persistent_workers`` (workers forked once, not per epoch).
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
    step: str = "conv"
    seed: int = 0
    persistent_workers: bool = False


# ---------------------------------------------------------------------------------------------------------
# Inside the ranks
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


def rank_main(spec_path: str) -> None:
    """Body of one rank process: build the dataset, train ``epochs`` epochs, write ``rank<r>.json``.

    Reads ``RANK``, ``WORLD_SIZE`` (and ``MASTER_ADDR``/``MASTER_PORT``) from the environment, as under
    ``torchrun``.
    """
    global _PHASE
    import torch
    import torch.distributed as dist
    from monai.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    with open(spec_path) as f:
        raw = json.load(f)
    raw["spatial_size"] = tuple(raw["spatial_size"])
    spec = RunSpec(**raw)
    config = CONFIGS[spec.config]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")
    torch.manual_seed(spec.seed + rank)
    events = harness.Events(os.path.join(spec.run_dir, "events") if rank == 0 else None)
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
    cpu0_tree = harness.tree_cpu_seconds(os.getpid())
    cpu_ttfb = 0.0
    wall0 = time.time()
    t0 = time.perf_counter()
    dataset = _build_dataset(config, files, transform, spec.fill_threads)
    setup_s = time.perf_counter() - t0
    cpu_setup = _cpu_seconds()
    _PHASE = "epoch"
    events.emit("S")
    sampler: DistributedSampler = DistributedSampler(dataset, shuffle=True, seed=spec.seed)
    loader = DataLoader(
        dataset,
        batch_size=spec.batch_size,
        sampler=sampler,
        num_workers=spec.workers,
        persistent_workers=spec.persistent_workers and spec.workers > 0,
    )
    tree_setup = harness.tree_cpu_seconds(os.getpid())
    ttfb: float | None = None
    epochs = []
    for epoch in range(spec.epochs):
        sampler.set_epoch(epoch)
        start_wall, start = time.time(), time.perf_counter()
        batches = 0
        for batch in loader:
            if ttfb is None:
                ttfb = time.perf_counter() - t0
                cpu_ttfb = harness.tree_cpu_seconds(os.getpid()) - cpu0_tree
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
                # this process, its living workers (persistent ones are never reaped) and those it reaped
                "tree_cpu": harness.tree_cpu_seconds(os.getpid()),
            }
        )
    dist.barrier()  # all workers of all ranks are done: the shared counters are final
    stats = dataset.cache_stats() if hasattr(dataset, "cache_stats") else None
    one_copy = None
    if stats is not None:
        one_copy = stats["stored"]["bytes"]
    elif config.cached and not config.runtime_cache:
        one_copy = sum(item_nbytes(item) for item in dataset._cache)
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
        "tree_cpu_setup": tree_setup,
        "cpu_end": _cpu_seconds(),
        "tree_cpu_end": harness.tree_cpu_seconds(os.getpid()),  # persistent workers are alive, never reaped
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
# The launcher: one configuration
# ---------------------------------------------------------------------------------------------------------


def batches_per_epoch(items: int, ranks: int, batch_size: int) -> int:
    """Batches each rank runs per epoch with ``DistributedSampler`` (padded to equal shards, no drop_last)."""
    return math.ceil(math.ceil(items / ranks) / batch_size)


def default_out_dir() -> str:
    """Where results and the synthetic data go by default (the data is reused by later runs)."""
    return os.path.join(tempfile.gettempdir(), "monai-cache-bench")


def shape_text(shape: Sequence[int]) -> str:
    """``160x160x96``, or ``160x160x83-108`` for a range of depths (see :func:`depths_for`)."""
    return "x".join(map(str, shape[:3])) + (f"-{shape[3]}" if len(shape) > 3 else "")


def depths_for(shape: Sequence[int], items: int) -> list[int] | None:
    """The z size of each volume for a shape with a range of depths ``(x, y, z_min, z_max)``, spread evenly over the
    items (as CT series of different lengths); None for a fixed ``(x, y, z)``."""
    if len(shape) == 3:
        return None
    lo, hi = shape[2], shape[3]
    return [lo + round(i * (hi - lo) / max(1, items - 1)) for i in range(items)]


def prepare_data(out: str, items: int, shape: Sequence[int], seed: int, bar: Any = None) -> str:
    """Write (or reuse) the synthetic volumes under ``out``; returns the path of the data list (JSON).

    ``shape`` is ``(x, y, z)``, or ``(x, y, z_min, z_max)`` for volumes of different depths."""
    depths = depths_for(shape, items)
    spread = f"-{items}" if depths else ""  # the depths depend on the item count: one directory per count
    data_dir = os.path.join(out, "data", f"ct-{shape_text(shape)}{spread}-seed{seed}")
    update = bar.update if bar is not None else None
    files = make_dataset(data_dir, items=items, shape=shape[:3], seed=seed, progress=update, depths=depths)
    data_list = os.path.join(out, f"datalist-{items}-{shape_text(shape)}-seed{seed}.json")
    with open(data_list, "w") as f:
        json.dump(files, f)
    return data_list


def private_shm_dir() -> str:
    """A fresh tmpfs directory for one benchmark's caches, so that other users of monai_cache on the machine
    neither disturb nor are counted in the measurements."""
    base = os.environ.get("MONAI_CACHE_SHM_DIR") or "/dev/shm"
    return tempfile.mkdtemp(prefix="monai_cache-bench-", dir=base)


def prepare_run(spec: RunSpec) -> tuple[str, dict[str, str]]:
    """Empty ``spec.run_dir`` and write the spec there for the ranks; returns its path and the ranks' environment
    (``MONAI_CACHE_SHM_DIR`` set to ``spec.shm_dir``)."""
    shutil.rmtree(spec.run_dir, ignore_errors=True)
    os.makedirs(spec.run_dir)
    os.makedirs(spec.shm_dir, exist_ok=True)
    spec_path = os.path.join(spec.run_dir, "spec.json")
    with open(spec_path, "w") as f:
        json.dump(dataclasses.asdict(spec), f)
    env = dict(os.environ, MONAI_CACHE_SHM_DIR=spec.shm_dir)
    env.setdefault("PYTHONWARNINGS", "ignore::FutureWarning")
    return spec_path, env


def launch(
    spec: RunSpec,
    progress: Callable[[str], object] | None = None,
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
    spec_path, env = prepare_run(spec)
    sampler = harness.MemorySampler([], spec.shm_dir, mem_interval)
    events = harness.Events(os.path.join(spec.run_dir, "events"))
    t_launch = time.time()
    try:
        harness.run_ranks(
            [os.path.abspath(__file__), "--rank-spec", spec_path],
            spec.ranks,
            spec.run_dir,
            env,
            timeout,
            on_start=sampler.start,
            on_poll=lambda: events.poll(progress),
        )
    finally:
        sampler.stop()
    t_end = time.time()
    ranks = []
    for rank in range(spec.ranks):
        with open(os.path.join(spec.run_dir, f"rank{rank}.json")) as f:
            ranks.append(json.load(f))
    result = summarize_run(spec, ranks, read_compute_log(os.path.join(spec.run_dir, "computes.log")), sampler)
    result["wall_s"] = t_end - t_launch
    with open(os.path.join(spec.run_dir, "result.json"), "w") as f:
        json.dump(result, f, indent=1)
    return result


def summarize_run(
    spec: RunSpec, ranks: list[dict[str, Any]], computes: dict[str, float], sampler: harness.MemorySampler
) -> dict[str, Any]:
    """Combine the ranks' reports, the transform log and the memory samples into one record.

    Times are the slowest rank's (the per-step ``all_reduce`` keeps ranks in step); CPU, reads and
    transform runs are summed over ranks (workers included).
    """
    config = CONFIGS[spec.config]
    epochs = [max(r["epochs"][e]["seconds"] for r in ranks) for e in range(spec.epochs)]
    reads = sum(ep["reads"] for r in ranks for ep in r["epochs"])
    cpu = sum(r.get("tree_cpu_end", r["cpu_end"]["self"] + r["cpu_end"]["children"]) for r in ranks)
    setup_cpu = sum(r["cpu_setup"]["self"] - r["cpu_start"]["self"] for r in ranks)
    stats = next((r["stats"] for r in ranks if r["stats"] is not None), None)
    if stats is not None:  # monai_cache: the machine-wide counters
        hits, misses = int(stats["total"]["hits"]), int(stats["total"]["misses"])
    elif config.cached:  # MONAI: every read not computed during the epochs was served from the cache
        hits, misses = int(reads - computes["computes_epoch"]), int(computes["computes"])
    else:
        hits, misses = 0, int(computes["computes"])
    one_copy = next((r["one_copy_bytes"] for r in ranks if r.get("one_copy_bytes")), None)
    warm_cpu = first_cpu = 0.0  # CPU of epochs 2.., and of epoch 1: each rank's whole process tree (workers too)
    for r in ranks:
        ends = [ep["tree_cpu"] for ep in r["epochs"]]
        warm_cpu += ends[-1] - ends[0]
        first_cpu += ends[0] - r["tree_cpu_setup"]
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
        "first_epoch_cpu_s": first_cpu,
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
# The benchmark: every setting, configuration and repeat
# ---------------------------------------------------------------------------------------------------------

# (title, key, format, ratio against MONAI?)
ROWS: tuple[tuple[str, str, str, bool], ...] = (
    ("time to first batch, wall (s)", "ttfb_s", "{:.1f}", True),
    ("time to first batch, CPU all processes (s)", "ttfb_cpu_s", "{:.1f}", True),
    ("first epoch, wall (s)", "first_epoch_s", "{:.2f}", True),
    ("first epoch, CPU all processes (s)", "first_epoch_cpu_s", "{:.1f}", True),
    ("warm epoch, wall (s)", "warm_epoch_s", "{:.2f}", True),
    ("warm epoch, CPU all processes (s)", "warm_epoch_cpu_s", "{:.1f}", True),
    ("memory above uncached, warm mean (copies)", "copies_warm", "{:.2f}", True),
    ("memory above uncached, peak (copies)", "copies_peak", "{:.2f}", True),
    ("memory, warm mean (MiB)", "mem_warm_mib", "{:.0f}", True),
    ("deterministic transform runs", "computes", "{:.0f}", True),
    ("CPU in deterministic transforms (s)", "fill_cpu_s", "{:.1f}", True),
    ("CPU, whole run (s)", "cpu_s", "{:.0f}", True),
)


def run_all(args: argparse.Namespace, items: int, shape: tuple[int, ...], epochs: int) -> list[dict[str, Any]]:
    """Run every (setting, configuration, repeat); returns the raw records of :func:`launch`."""
    from tqdm import tqdm

    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    # repeats outermost (every setting and configuration once, then again): drift on a shared machine spreads over
    # all of them, and a run cut short still has whole repeats
    runs = [
        (ranks, workers, rep, name)
        for rep in range(args.repeats)
        for ranks, workers in args.settings
        for name in args.configs[rep % len(args.configs) :] + args.configs[: rep % len(args.configs)]
    ]
    total = items + sum(1 + epochs * batches_per_epoch(items, r, args.batch_size) for r, _w, _rep, _n in runs)
    bar = tqdm(total=total, desc="synthetic data", unit="step", disable=args.no_progress, dynamic_ncols=True)
    records = []
    shm_dir = private_shm_dir()
    try:
        data_list = prepare_data(out, items, shape, args.seed, bar)
        for i, (ranks, workers, rep, name) in enumerate(runs):
            bar.set_description(f"[{i + 1}/{len(runs)}] {ranks}x{workers} {name}")
            spec = RunSpec(
                config=name,
                data_list=data_list,
                run_dir=os.path.join(out, "runs", f"{ranks}x{workers}-{name}-{rep}"),
                shm_dir=shm_dir,
                ranks=ranks,
                workers=workers,
                epochs=epochs,
                batch_size=args.batch_size,
                spatial_size=args.crop or crop_size_for(shape[:3]),
                fill_threads=args.fill_threads,
                step=args.step,
                seed=args.seed,
                persistent_workers=args.persistent_workers,
            )
            record = launch(spec, lambda _event: bar.update(1), mem_interval=args.mem_interval)
            record["repeat"] = rep
            records.append(record)
    finally:
        bar.close()
        shutil.rmtree(shm_dir, ignore_errors=True)
    return records


def load_runs(out: str) -> list[dict[str, Any]]:
    """The records of the finished runs under ``out/runs`` (those :func:`run_all` wrote), in the order they ran."""
    records = []
    runs = os.path.join(os.path.abspath(out), "runs")
    for name in os.listdir(runs):
        path = os.path.join(runs, name, "result.json")
        if os.path.isfile(path):
            with open(path) as f:
                record = json.load(f)
            record["repeat"] = int(name.rsplit("-", 1)[1])
            records.append((os.path.getmtime(path), record))
    return [r for _t, r in sorted(records, key=lambda tr: tr[0])]


def summarize(records: list[dict[str, Any]], items: int) -> dict[tuple[int, int], dict[str, dict[str, Any]]]:
    """Medians per (ranks, workers) and configuration, with memory expressed in copies of the cached data."""
    out: dict[tuple[int, int], dict[str, dict[str, Any]]] = {}
    # one copy of the cached data: MONAI's sum of cached item sizes (monai_cache's encoded bytes if absent)
    copy_bytes = harness.median([r["one_copy_bytes"] for r in records if r["config"] == BASELINE]) or harness.median(
        [r["one_copy_bytes"] for r in records if r.get("one_copy_bytes")]
    )
    for key in sorted({(r["ranks"], r["workers"]) for r in records}):
        group = [r for r in records if (r["ranks"], r["workers"]) == key]
        by_config: dict[str, dict[str, Any]] = {}
        for name in dict.fromkeys(r["config"] for r in group):
            rs = [r for r in group if r["config"] == name]
            med = {
                k: harness.median([r.get(k) for r in rs])
                for k in (
                    "ttfb_s", "ttfb_cpu_s", "warm_epoch_s", "warm_epoch_cpu_s", "first_epoch_s", "first_epoch_cpu_s",
                    "mem_warm",
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
    return format_table([header, *body], markdown=markdown, rule=True)


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
    return format_table([header, *body], markdown=markdown, rule=True)


# (title, configuration, reference, key): per-repeat ratios, each configuration against its reference of the same repeat
RATIOS: tuple[tuple[str, str, str, str], ...] = (
    ("first epoch on the fly / uncached, wall", "monai-cache-runtime", UNCACHED, "first_epoch_s"),
    ("first epoch on the fly / uncached, CPU", "monai-cache-runtime", UNCACHED, "first_epoch_cpu_s"),
)


def per_repeat_ratios(records: list[dict[str, Any]]) -> dict[tuple[int, int], dict[str, list[float]]]:
    """``{(ranks, workers): {title: [ratio of each repeat]}}`` for the :data:`RATIOS` whose configurations ran: each
    repeat's configuration against the reference run in the same rotation (so drift on a shared machine cancels)."""
    out: dict[tuple[int, int], dict[str, list[float]]] = {}
    by_run = {(r["ranks"], r["workers"], r["repeat"], r["config"]): r for r in records}
    for ranks, workers in sorted({(r["ranks"], r["workers"]) for r in records}):
        repeats = sorted({r["repeat"] for r in records if (r["ranks"], r["workers"]) == (ranks, workers)})
        table: dict[str, list[float]] = {}
        for title, name, ref, key in RATIOS:
            vals = []
            for rep in repeats:
                a, b = by_run.get((ranks, workers, rep, name)), by_run.get((ranks, workers, rep, ref))
                if a and b and a.get(key) is not None and b.get(key):
                    vals.append(a[key] / b[key])
            if vals:
                table[title] = vals
        out[(ranks, workers)] = table
    return out


def format_ratios(ratios: dict[str, list[float]], markdown: bool) -> str:
    """Each repeat's ratio and their median, one row per :data:`RATIOS` entry."""
    n = max((len(v) for v in ratios.values()), default=0)
    header = ["ratio", *(f"repeat {i + 1}" for i in range(n)), "median"]
    body = [[title, *(f"{v:.3f}" for v in vals), *([""] * (n - len(vals))), f"{harness.median(vals):.3f}"]
            for title, vals in ratios.items()]  # fmt: skip
    return format_table([header, *body], markdown=markdown, rule=True)


def check_ratio_targets(ratios: dict[tuple[int, int], dict[str, list[float]]]) -> list[tuple[bool, str]]:
    """Issue #27's target on medians of per-repeat ratios: the first epoch on the fly at most 1.03x an uncached one
    (wall and CPU). Warm epochs are the warm suite's."""
    checks = []
    for (ranks, workers), table in sorted(ratios.items()):
        for title, vals in table.items():
            bound = 1.03
            med = harness.median(vals)
            text = f"[{ranks}x{workers}] {title}: median of per-repeat ratios {med:.3f} <= {bound}"
            checks.append((med <= bound, text))
    return checks


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
    keys = sorted(summary)
    if len(keys) > 1:
        for name in ("monai-cache", "monai-cache-runtime"):
            a, b = summary[keys[0]].get(name, {}).get("fill_cpu_s"), summary[keys[-1]].get(name, {}).get("fill_cpu_s")
            if a and b is not None:
                text = f"{name}: fill CPU {a:.1f} s -> {b:.1f} s from {keys[0][0]} to {keys[-1][0]} ranks (<= 1.25x)"
                checks.append((b / a <= 1.25, text))
    return checks


# ---------------------------------------------------------------------------------------------------------


def _shape(text: str, what: str = "--shape") -> tuple[int, ...]:
    """``XxYxZ``, or ``XxYxZMIN-ZMAX`` (volumes of different depths: ``(x, y, z_min, z_max)``)."""
    parts = text.strip().split("x")
    if len(parts) == 3 and what == "--shape" and "-" in parts[2]:
        parts = parts[:2] + parts[2].split("-", 1)
    sizes = [int(p) for p in parts if p.isdigit()]
    if (
        len(sizes) != len(parts)
        or len(sizes) not in (3, 4)
        or min(sizes) < 8
        or sizes[2:] != sorted(sizes[2:])
        or (what != "--shape" and len(sizes) != 3)
    ):
        example = "160x160x96 or 160x160x83-108" if what == "--shape" else "64x64x64"
        raise argparse.ArgumentTypeError(f"{what} needs sizes of at least 8 voxels, like {example}; got {text!r}")
    return tuple(sizes)


def _configs(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown configuration(s) {unknown}; choose from {', '.join(CONFIGS)}")
    return names


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark (or, with ``--rank-spec``, one rank of a run); returns the exit status (0 even when
    targets are missed: it is not a test)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--rank-spec", help=argparse.SUPPRESS)
    parser.add_argument("--items", type=int, default=None, help="volumes (default 24; --quick 8)")
    parser.add_argument(
        "--shape",
        type=_shape,
        default=None,
        help="voxels per volume (default 160x160x96); 160x160x83-108: depths spread over 83..108",
    )
    parser.add_argument(
        "--crop",
        type=lambda t: _shape(t, "--crop"),
        default=None,
        help="RandCropByPosNegLabeld patch size (default: the tutorial's 96x96x64, shrunk to fit)",
    )
    parser.add_argument("--persistent-workers", action="store_true", help="DataLoader(persistent_workers=True)")
    parser.add_argument("--epochs", type=int, default=None, help="epochs per run (default 3; --quick 2)")
    parser.add_argument("--repeats", type=int, default=None, help="runs of each configuration (default 2; --quick 1)")
    parser.add_argument(
        "--settings", type=harness.parse_settings, default=[(1, 2), (2, 2)], help="ranks x workers, e.g. 1x2,2x2"
    )
    parser.add_argument(
        "--configs", type=_configs, default=list(DEFAULT_CONFIGS), help=f"of {', '.join(CONFIGS)}; default all but "
        "monai-runtime"
    )
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--fill-threads", type=int, default=1, help="CacheDataset num_workers (default 1)")
    parser.add_argument("--step", choices=("conv", "sum"), default="conv")
    parser.add_argument("--mem-interval", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="8 volumes of 64x64x48, 2 epochs, 1 repeat")
    parser.add_argument("--out", default=default_out_dir(), help=f"results directory (default {default_out_dir()})")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument(
        "--summarize", action="store_true", help="run nothing: report the runs under --out/runs (of a run cut short)"
    )
    args = parser.parse_args(argv)
    if args.rank_spec:
        rank_main(args.rank_spec)
        return 0
    items = args.items or (8 if args.quick else 24)
    shape = tuple(args.shape or ((64, 64, 48) if args.quick else (160, 160, 96)))
    epochs = args.epochs or (2 if args.quick else 3)
    args.repeats = args.repeats or (1 if args.quick else 2)
    if UNCACHED not in args.configs:
        print(f"note: without {UNCACHED} memory cannot be expressed above the uncached run", file=sys.stderr)

    t0 = time.perf_counter()
    records = load_runs(args.out) if args.summarize else run_all(args, items, shape, epochs)
    summary = summarize(records, items)
    copy_bytes = next((r["one_copy_bytes"] for r in records if r["config"] == BASELINE and r["one_copy_bytes"]), None)
    rep = harness.Report("cache")
    rep.line(
        f"cache: {items} volumes of {shape_text(shape)}, {epochs} epochs, batch {args.batch_size}, "
        f"crop {'x'.join(map(str, args.crop or crop_size_for(shape[:3])))}, "
        f"{'persistent' if args.persistent_workers else 'per-epoch'} workers, "
        f"median of {args.repeats} repeat(s); one copy of the cached data = "
        + (f"{copy_bytes / _MIB:.0f} MiB" if copy_bytes else "n/a")
        + f"; ratios against {BASELINE} (MONAI CacheDataset) in the same run"
    )
    for (ranks, workers), by_config in sorted(summary.items()):
        rep.heading(f"{ranks} rank(s) x {workers} workers")
        rep.line(format_setting(by_config, markdown=False))
    rep.heading("CPU in deterministic transforms vs ranks (machine-wide)")
    rep.line(format_fill_vs_ranks(summary, False))
    ratios = per_repeat_ratios(records)
    for (ranks, workers), table in sorted(ratios.items()):
        if table:
            rep.heading(f"{ranks} rank(s) x {workers} workers: per-repeat ratios (same rotation), medians")
            rep.line(format_ratios(table, markdown=False))
    rep.heading("targets")
    rep.targets(check_targets(summary, items) + check_ratio_targets(ratios))
    sampler_cpu = sum(r.get("mem_sampler_cpu_s") or 0 for r in records)
    wall = time.perf_counter() - t0
    rep.line(f"\nmemory sampling took {sampler_cpu:.0f} CPU s in the launcher; total wall {wall:.0f} s")
    out = os.path.abspath(args.out)
    path = rep.save(out, {"items": items, "shape": shape, "epochs": epochs, "records": records})
    print(f"results: {path}, {os.path.join(out, 'cache.json')}")
    return 0

if __name__ == "__main__":
    sys.exit(main())
