"""``monai-cache plan``: how much a cache will take, and whether it fits, before the run.

A few items are computed (the cached, deterministic part of the chain, as the dataset computes them), picked across
the data list so that their sizes vary; each is encoded as the shared-memory cache stores it and as the disk cache
writes it (downcast, zstd), and timed. The whole cache is projected from them with a 95% band, and set against what
this machine offers (the tmpfs, ``MemAvailable``, the memory cgroup, the ``cache_dir``'s disk) for the ranks that
share it; the settings that would give it room come from :mod:`monai_cache.capacity`.

Where the items name files (NIfTI volumes, say), each item's input size is known for every item at the cost of a
``stat``: the projection is then a ratio estimate (cached bytes per input byte, times the input bytes of the whole
list), which follows items of varying sizes; otherwise it is the sample's mean times the number of items.
"""

from __future__ import annotations

import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from copy import deepcopy
from dataclasses import dataclass, field
from typing import Any

from monai_cache.capacity import Fit, advice, fit, local_ranks
from monai_cache.memory_limits import MachineMemory, read_machine
from monai_cache.utils import format_bytes, format_table

__all__ = ["CachePlan", "Projection", "plan_bundle", "plan_dataset"]

# two-sided 95% quantiles of Student's t, by degrees of freedom (1-30); 1.96 beyond
_T95 = (12.71, 4.30, 3.18, 2.78, 2.57, 2.45, 2.36, 2.31, 2.26, 2.23, 2.20, 2.18, 2.16, 2.14, 2.13, 2.12, 2.11, 2.10,
        2.09, 2.09, 2.08, 2.07, 2.07, 2.06, 2.06, 2.06, 2.05, 2.05, 2.05, 2.04)  # fmt: skip


@dataclass
class Projection:
    """A quantity per item and for the whole cache, from a sample.

    Attributes:
        per_item: the sample's mean per item.
        total: the projection for every item of the cache.
        low: the lower end of its 95% band (None with a single sample: unknown).
        high: the upper end.
    """

    per_item: float
    total: float
    low: float | None
    high: float | None

    def as_dict(self) -> dict[str, float | None]:
        return {"per_item": self.per_item, "total": self.total, "low": self.low, "high": self.high}


def _project(values: Sequence[float], aux_sample: Sequence[float] | None, aux_all: Sequence[float] | None,
             count: int) -> Projection:  # fmt: skip
    """Project ``values`` (one per sampled item) to ``count`` items: a ratio estimate on an auxiliary size of every
    item (``aux_all``; ``aux_sample`` for the sampled ones), else the mean; with the 95% band of the estimate (finite
    population corrected)."""
    n = len(values)
    mean = statistics.fmean(values)
    if aux_sample is not None and aux_all is not None and sum(aux_sample) > 0:
        ratio = sum(values) / sum(aux_sample)
        total = ratio * sum(aux_all)
        residuals = [v - ratio * x for v, x in zip(values, aux_sample)]
    else:
        total = mean * count
        residuals = [v - mean for v in values]
    if n >= count:
        return Projection(mean, total, total, total)
    if n < 2:
        return Projection(mean, total, None, None)
    spread = math.sqrt(sum(r * r for r in residuals) / (n - 1))
    half = _T95[min(n - 1, len(_T95)) - 1] * count * spread * math.sqrt((1 - n / count) / n)
    return Projection(mean, total, max(0.0, total - half), total + half)


def _best_projection(values: Sequence[float], sample: Sequence[int], sizes: Sequence[dict[str, float]],
                     count: int) -> tuple[Projection, str]:  # fmt: skip
    """The projection of ``values`` whose band is narrowest among the mean and a ratio on each input size known
    for every item (the one the cached bytes follow best), and its name."""
    best = (_project(values, None, None, count), "mean")
    names = set.intersection(*(set(s) for s in sizes)) if sizes else set()
    for name in sorted(names):
        column = [s[name] for s in sizes]
        if min(column) <= 0:
            continue
        candidate = _project(values, [column[i] for i in sample], column, count)
        width = (candidate.high or 0) - (candidate.low or 0)
        if candidate.low is not None and width < (best[0].high or 0) - (best[0].low or 0):
            best = (candidate, f"ratio to input {name}")
    return best


def _files(item: Any, depth: int = 0) -> list[str]:
    """The existing files an item names (its strings that are paths)."""
    if isinstance(item, (str, os.PathLike)):
        try:
            return [os.fspath(item)] if os.path.isfile(item) else []
        except (OSError, ValueError):
            return []
    if depth < 4 and isinstance(item, dict):
        return [f for v in item.values() for f in _files(v, depth + 1)]
    if depth < 4 and isinstance(item, (list, tuple)):
        return [f for v in item for f in _files(v, depth + 1)]
    return []


def _input_sizes(item: Any) -> dict[str, float]:
    """Sizes of an item's input that the bytes it caches may follow: the bytes of the files it names, and for NIfTI
    files (read from their headers) the voxels and the physical volume (voxels times the voxel size, what resampling
    to a fixed spacing makes voxels of). Empty where the item names no file."""
    files = _files(item)
    if not files:
        return {}
    sizes = {"file bytes": float(sum(os.stat(f).st_size for f in files))}
    voxels = volume = 0.0
    try:
        import nibabel

        for f in files:
            if not f.endswith((".nii", ".nii.gz")):
                raise ValueError(f)
            header: Any = nibabel.load(f).header  # a Nifti1Header: shape and voxel size, the data is not read
            count = float(math.prod(header.get_data_shape()))
            voxels += count
            volume += count * float(math.prod(header.get_zooms()[:3]))
    except Exception:  # not all NIfTI, or unreadable: the file sizes only
        return sizes
    sizes.update({"voxels": voxels, "physical volume": volume})
    return sizes


def _spread_order(count: int, k: int) -> list[int]:
    """``k`` positions out of ``count`` sorted ones, at evenly spaced quantiles, in an order that covers the range
    early (the middle, then the ends, then between), so that a sample stopped by its time limit still spans it."""
    if k >= count:
        picks = list(range(count))
    else:
        picks = sorted({min(count - 1, int((j + 0.5) * count / k)) for j in range(k)})
    order: list[int] = []
    seen: set[int] = set()
    # van der Corput order over the picks: 1/2, 1/4, 3/4, 1/8, ...
    denominator = 1
    while len(order) < len(picks):
        denominator *= 2
        for numerator in range(1, denominator, 2):
            position = picks[min(len(picks) - 1, int(numerator / denominator * len(picks)))]
            if position not in seen:
                seen.add(position)
                order.append(position)
    for position in picks:  # anything the halving missed
        if position not in seen:
            order.append(position)
    return order


@dataclass
class _Spec:
    """What is planned: the data list, how one item's cached part is computed, how it is stored."""

    name: str
    target: str
    data: Sequence
    cached: Callable[[Any], Any]  # data item -> what the cache stores
    cached_items: int  # how many items are cached (cache_num, cache_rate)
    memory: bool  # a shared-memory cache (CacheDataset and the like; PersistentDataset with shm_cache)
    disk: bool  # a disk cache (PersistentDataset, or a cache_dir tier)
    in_process: bool  # MONAI's own CacheDataset: one copy per rank
    cache_dir: str | None = None
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class CachePlan:
    """What ``monai-cache plan`` found for one dataset (see :func:`plan_dataset`).

    Attributes:
        name: the dataset (a bundle section such as ``train#dataset``, or the class name).
        target: its class.
        items: items in the data list.
        cached_items: items the cache holds (``cache_num`` / ``cache_rate``).
        sampled: the data indices computed.
        sample_seconds: the time taken to sample.
        memory: projected bytes in shared memory (None if the dataset keeps no shared-memory cache).
        disk: projected bytes on disk, after downcasting and compression (None if it keeps no disk cache).
        compute: seconds to compute an item's cached part.
        read: seconds to decode a cached item (what a hit costs, besides the random transforms).
        machine: what this machine offers.
        cache_dir: the disk cache directory, if any, and its free bytes.
        ranks: ranks of the job on this machine (they share one copy; MONAI's CacheDataset holds one per rank).
        in_process: the dataset is MONAI's own (an in-process cache per rank).
        fit: whether the shared-memory cache fits (None without one).
        advice: settings that give it room.
        models: how each quantity was projected (``"mean"``, or ``"ratio to input voxels"`` and the like).
    """

    name: str
    target: str
    items: int
    cached_items: int
    sampled: list[int]
    sample_seconds: float
    memory: Projection | None
    disk: Projection | None
    compute: Projection
    read: Projection
    machine: MachineMemory
    cache_dir: str | None
    cache_dir_free: int | None
    ranks: int
    in_process: bool
    fit: Fit | None
    advice: list[str]
    models: dict[str, str] = field(default_factory=dict)

    @property
    def first_epoch_seconds(self) -> float:
        """One process computing every item (the first epoch, divided among the processes that compute)."""
        return self.compute.per_item * self.items

    @property
    def warm_epoch_seconds(self) -> float:
        """One process reading every cached item and computing the others, besides the random transforms."""
        return self.read.per_item * self.cached_items + self.compute.per_item * (self.items - self.cached_items)

    def as_dict(self) -> dict[str, Any]:
        """The plan as plain values (``--json``)."""
        m = self.machine
        return {
            "name": self.name, "target": self.target, "items": self.items, "cached_items": self.cached_items,
            "sampled": self.sampled, "sample_seconds": self.sample_seconds,
            "memory_bytes": None if self.memory is None else self.memory.as_dict(),
            "disk_bytes": None if self.disk is None else self.disk.as_dict(),
            "compute_seconds": self.compute.as_dict(), "read_seconds": self.read.as_dict(),
            "first_epoch_seconds": self.first_epoch_seconds, "warm_epoch_seconds": self.warm_epoch_seconds,
            "machine": {
                "tmpfs_total": m.tmpfs_total, "tmpfs_free": m.tmpfs_free, "mem_total": m.mem_total,
                "mem_available": m.mem_available,
                "cgroup": None if m.cgroup is None else {
                    "version": m.cgroup.version, "path": m.cgroup.path, "limit": m.cgroup.limit,
                    "usage": m.cgroup.usage, "working_set": m.cgroup.working_set,
                },
            },
            "cache_dir": self.cache_dir, "cache_dir_free": self.cache_dir_free, "ranks": self.ranks,
            "in_process": self.in_process,
            "fit": None if self.fit is None else {
                "fits": self.fit.fits, "needed": self.fit.needed, "room": self.fit.room, "limit": self.fit.limit,
                "cache_rate": self.fit.cache_rate,
            },
            "advice": self.advice, "models": self.models,
        }  # fmt: skip

    def format(self) -> str:
        """The plan as a table, for people."""

        def size(p: Projection | None) -> list[str]:
            if p is None:
                return ["-", "-"]
            band = "" if p.low is None else f" ({format_bytes(p.low)} to {format_bytes(p.high or 0)})"
            return [format_bytes(p.per_item), format_bytes(p.total) + band]

        lines = [
            f"{self.name} ({self.target}): {self.items} items, {self.cached_items} cached; "
            f"{len(self.sampled)} computed in {self.sample_seconds:.1f} s, picked across the list; bytes projected by "
            f"{self.models.get('memory', self.models.get('disk', 'mean'))}",
            "",
        ]
        rows = [["", "per item (mean)", f"all {self.cached_items} cached items (95% band)"]]
        if self.memory is not None:
            label = "in each rank's memory (MONAI's CacheDataset)" if self.in_process else "shared memory"
            rows.append([label, *size(self.memory)])
        if self.disk is not None:
            rows.append(["disk (downcast, zstd)", *size(self.disk)])
        rows.append(["compute (first epoch)", f"{self.compute.per_item:.3f} s", f"{self.first_epoch_seconds:.1f} s"])
        rows.append(["read (warm epoch)", f"{self.read.per_item * 1e3:.2f} ms", f"{self.warm_epoch_seconds:.1f} s"])
        lines.append(format_table(rows))
        lines.append("(times are one process's, before the random transforms: the processes that read share them)")
        m = self.machine
        offer = [["this machine", ""], ["tmpfs", f"{format_bytes(m.tmpfs_free)} free of {format_bytes(m.tmpfs_total)}"]]
        if m.mem_available is not None:
            offer.append(["memory available", f"{format_bytes(m.mem_available)} of {format_bytes(m.mem_total or 0)}"])
        offer.append(["memory cgroup", "no limit" if m.cgroup is None else
                      f"limit {format_bytes(m.cgroup.limit)}, {format_bytes(m.cgroup.working_set)} in use (cgroup v"
                      f"{m.cgroup.version})"])  # fmt: skip
        if self.cache_dir is not None:
            free = "?" if self.cache_dir_free is None else format_bytes(self.cache_dir_free)
            offer.append(["cache_dir", f"{free} free ({self.cache_dir})"])
        copies = f"{self.ranks} (one shared copy)" if not self.in_process else f"{self.ranks} (a copy in each)"
        offer.append(["ranks on this machine", copies])
        lines += ["", format_table(offer)]
        lines.append("")
        lines.append(self.verdict())
        lines += [f"  {line}" for line in self.advice]
        return "\n".join(lines)

    def verdict(self) -> str:
        """One line: what fits."""
        if self.fit is None:
            if self.disk is not None and self.cache_dir_free is not None:
                ok = self.disk.total <= self.cache_dir_free
                return f"disk cache: {'fits' if ok else 'does NOT fit'} in the free space of {self.cache_dir}"
            return "no shared-memory cache to fit"
        f = self.fit
        if f.fits:
            room = format_bytes(f.room)
            return f"fits: all {self.cached_items} items, {format_bytes(f.needed)} of the {room} that {f.limit} leaves"
        return (
            f"does NOT fit: {format_bytes(f.needed)} needed, {format_bytes(max(f.room, 0))} left by {f.limit}; "
            f"cache_rate={f.cache_rate:.2f} fits"
        )


# the options that change what a cache stores or where, read from a dataset's attributes or a bundle's arguments
_OPTIONS = ("cache_num", "cache_rate", "cache_dir", "cache_n_trans", "as_contiguous", "shm_cache", "shared_memory",
            "downcast", "compression", "compression_level", "lossy_dtypes", "reset_ops_id", "track_meta")  # fmt: skip


def _spec(name: str, cls: type, data: Sequence, transform: Any, options: dict[str, Any]) -> _Spec:
    """What ``cls`` (a MONAI dataset class, ours or MONAI's) with these arguments caches, and where."""
    import torch
    from monai.transforms import Compose, convert_to_contiguous, reset_ops_id

    from monai_cache import compat
    from monai_cache.fingerprint import first_random_index
    from monai_cache.switch import original  # MONAI's classes even under the switch

    chain = transform if isinstance(transform, Compose) else Compose(transform)
    ours = cls.__module__.startswith("monai_cache")
    target = f"{cls.__module__}.{cls.__qualname__}"
    cache_dir = options.get("cache_dir")
    cache_dir = None if cache_dir is None else os.fspath(cache_dir)
    if issubclass(cls, original("PersistentDataset")):
        end = options.get("cache_n_trans")
        end = first_random_index(chain) if end is None else int(end)
        reset = options.get("reset_ops_id", True)
        default = compat.PERSISTENT_TRACK_META_DEFAULT if not issubclass(cls, original("CacheNTransDataset")) else None
        track_meta = options.get("track_meta", default) if ours else None

        def persistent(item: Any) -> Any:
            out = chain(deepcopy(item), end=end, threading=True)
            if reset:
                reset_ops_id(out)
            return out if track_meta is None else compat.to_stored_form(out, bool(track_meta))

        return _Spec(name, target, data, persistent, len(data), memory=bool(options.get("shm_cache")), disk=True,
                     in_process=False, cache_dir=cache_dir, options=options)  # fmt: skip
    first_random = first_random_index(chain)
    contiguous = options.get("as_contiguous", True)

    def cached(item: Any) -> Any:
        out = chain(item, end=first_random, threading=True)
        return convert_to_contiguous(out, memory_format=torch.contiguous_format) if contiguous else out

    count = len(data)
    if issubclass(cls, original("CacheDataset")):
        rate = float(options.get("cache_rate", 1.0))
        count = max(0, min(int(options.get("cache_num", sys.maxsize)), int(count * rate), count))
    in_process = issubclass(cls, original("CacheDataset")) and (not ours or not options.get("shared_memory", True))
    return _Spec(name, target, data, cached, count, memory=True, disk=cache_dir is not None, in_process=in_process,
                 cache_dir=cache_dir, options=options)  # fmt: skip


def _disk_record_bytes(enc: Any, options: dict[str, Any]) -> int:
    """The bytes of the record the disk cache writes for ``enc`` (header and payload, zstd unless disabled)."""
    from monai_cache.disk_format import DEFAULT_COMPRESSION_LEVEL, write_record

    level = options.get("compression_level", DEFAULT_COMPRESSION_LEVEL)
    if options.get("compression", "zstd") in (None, "none"):
        level = None
    fd = os.memfd_create("monai-cache-plan", os.MFD_CLOEXEC)
    try:
        return int(write_record(fd, "plan", enc, level))
    finally:
        os.close(fd)


def _free_space(directory: str | None) -> int | None:
    """Free bytes of the file system that holds (or will hold) ``directory``."""
    if directory is None:
        return None
    path = os.path.abspath(directory)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _plan(spec: _Spec, samples: int, max_seconds: float, shm_dir: str | None, ranks: int | None,
          progress: bool) -> CachePlan:  # fmt: skip
    from monai_cache import codec
    from monai_cache.shm import default_shm_dir

    count = spec.cached_items if spec.memory and not spec.disk else len(spec.data)
    count = max(count, 0)
    sizes = [_input_sizes(spec.data[i]) for i in range(count)]
    spread_by = "file bytes" if sizes and all("file bytes" in s for s in sizes) else None
    by_size = sorted(range(count), key=lambda i: sizes[i][spread_by]) if spread_by else list(range(count))
    order = [by_size[p] for p in _spread_order(count, min(samples, count))]
    downcast = spec.options.get("downcast", True)
    lossy = spec.options.get("lossy_dtypes") or None
    started = time.perf_counter()
    got: list[tuple[int, float, int, int, float]] = []  # index, compute s, memory bytes, disk bytes, read s
    for k, index in enumerate(order):
        if len(got) >= 2 and time.perf_counter() - started > max_seconds:
            break
        if progress:
            print(f"\rplan {spec.name}: computing item {index} ({k + 1} of {len(order)})", end="", file=sys.stderr,
                  flush=True)  # fmt: skip
        t0 = time.perf_counter()
        item = spec.cached(spec.data[index])
        seconds = time.perf_counter() - t0
        enc = codec.encode(item)
        memory_bytes = enc.nbytes
        disk_bytes = _disk_record_bytes(codec.encode(item, downcast=downcast, lossy=lossy), spec.options) \
            if spec.disk else 0  # fmt: skip
        blob = bytearray(b"".join(bytes(memoryview(c).cast("B")) for c in enc.chunks(data_crc=False)))
        t1 = time.perf_counter()
        codec.decode(blob)
        got.append((index, seconds, memory_bytes, disk_bytes, time.perf_counter() - t1))
        del item, enc, blob
    if progress and order:
        print("", file=sys.stderr)
    elapsed = time.perf_counter() - started
    indices = [g[0] for g in got]
    models: dict[str, str] = {}

    def project(column: int, label: str) -> Projection:
        if not got:
            return Projection(0.0, 0.0, 0.0, 0.0)
        projection, models[label] = _best_projection([float(g[column]) for g in got], indices, sizes, count)
        return projection

    memory = project(2, "memory") if spec.memory else None
    disk = project(3, "disk") if spec.disk else None
    machine = read_machine(shm_dir or default_shm_dir())
    ranks = ranks or local_ranks()
    verdict = None
    lines: list[str] = []
    if memory is not None:
        needed = int(memory.high if memory.high is not None else memory.total)
        if spec.in_process:
            needed *= ranks
            lines.append(
                f"MONAI's CacheDataset holds a copy in each of the {ranks} ranks ({format_bytes(needed)} in all); "
                f"monai_cache.CacheDataset holds one for the machine ({format_bytes(memory.high or memory.total)})"
            )
        verdict = fit(needed, machine)
        if not verdict.fits:
            lines.append(f"cache part of it: cache_rate={verdict.cache_rate:.2f}")
            lines.append(
                "or keep it on disk with shared memory in front: CacheDataset(..., cache_dir=DIR) (the items "
                "that do not fit are read from DIR), or PersistentDataset(..., shm_cache=True)"
            )
            lines += advice(needed, machine)
    cache_dir = spec.cache_dir
    cache_dir_free = _free_space(cache_dir) if cache_dir is not None else None
    if disk is not None and cache_dir_free is not None and (disk.high or disk.total) > cache_dir_free:
        lines.append(f"the disk cache needs {format_bytes(disk.high or disk.total)}: free space on {cache_dir}, or "
                     "point cache_dir at a larger disk")  # fmt: skip
    return CachePlan(
        name=spec.name, target=spec.target, items=len(spec.data), cached_items=count, sampled=indices,
        sample_seconds=elapsed, memory=memory, disk=disk, compute=project(1, "compute"), read=project(4, "read"),
        machine=machine, models=models,
        cache_dir=cache_dir, cache_dir_free=cache_dir_free, ranks=ranks, in_process=spec.in_process, fit=verdict,
        advice=lines,
    )  # fmt: skip


def plan_dataset(
    dataset: Any,
    samples: int = 8,
    max_seconds: float = 60.0,
    shm_dir: str | None = None,
    ranks: int | None = None,
    progress: bool = False,
    name: str | None = None,
) -> CachePlan:
    """Plan the cache of ``dataset``: project its size from a few items computed now, and set it against what this
    machine offers.

    Args:
        dataset: a MONAI dataset with ``data`` and ``transform``: monai_cache's ``CacheDataset`` (build it with
            ``runtime_cache=True`` so that it computes nothing yet), ``PersistentDataset``, ``CacheNTransDataset``,
            ``SmartCacheDataset``, or MONAI's own classes (whose in-process cache is held by every rank).
        samples: how many items to compute at most, picked across the data list (by input size where the items
            name files).
        max_seconds: stop sampling after this long (at least 2 items are computed).
        shm_dir: the tmpfs of the shared-memory cache (default ``$MONAI_CACHE_SHM_DIR`` or ``/dev/shm``).
        ranks: ranks of the job on this machine (default: torchrun's ``$LOCAL_WORLD_SIZE``, else Slurm's tasks on
            this node, else 1: :func:`monai_cache.capacity.local_ranks`).
        progress: show which item is being computed, on standard error.
        name: how the report names the dataset.

    Returns:
        a :class:`CachePlan` (``format()`` for the table, ``as_dict()`` for JSON).
    """
    options = {key: getattr(dataset, key) for key in _OPTIONS if hasattr(dataset, key)}
    if "cache_num" in options and hasattr(dataset, "cache_num"):  # a built CacheDataset: cache_num is the count
        options.pop("cache_rate", None)
    spec = _spec(name or type(dataset).__name__, type(dataset), dataset.data, dataset.transform, options)
    return _plan(spec, samples, max_seconds, shm_dir, ranks, progress)


def plan_bundle(
    config_file: str | Sequence[str],
    sections: Sequence[str] = ("train#dataset", "validate#dataset"),
    overrides: dict[str, Any] | None = None,
    **kwargs: Any,
) -> list[CachePlan]:
    """Plan the datasets of a MONAI bundle config without building them (building a ``CacheDataset`` fills it).

    Args:
        config_file: the bundle's config file(s), as ``monai.bundle`` takes them.
        sections: the ids of the dataset sections to plan; those not in the config are skipped.
        overrides: ``{id: value}`` set in the config first, as ``python -m monai.bundle run --id value`` does.
        kwargs: passed on as :func:`plan_dataset` takes them (``samples``, ``max_seconds``, ``shm_dir``, ``ranks``,
            ``progress``).

    Returns:
        a :class:`CachePlan` for each section found.
    """
    import pydoc

    import monai.data
    from monai.bundle import ConfigParser

    parser = ConfigParser()
    parser.read_config(config_file)
    for key, value in (overrides or {}).items():
        parser[key] = value
    plans = []
    for section in sections:
        if section not in parser:
            continue
        config = parser[section]
        target = config.get("_target_", "") if isinstance(config, dict) else ""
        cls = pydoc.locate(target) if "." in target else getattr(monai.data, target, None)
        if not isinstance(cls, type) or not issubclass(cls, monai.data.Dataset):
            raise ValueError(f"{section} is not a MONAI dataset (its _target_ is {target!r})")
        if "data" not in config:
            raise ValueError(f"{section} has no 'data' to plan")
        read = {name: parser.get_parsed_content(f"{section}#{name}") for name in ("data", "transform", *_OPTIONS)
                if name in config}  # fmt: skip
        spec = _spec(section, cls, read.pop("data"), read.pop("transform", None), read)
        samples, max_seconds = int(kwargs.get("samples", 8)), float(kwargs.get("max_seconds", 60.0))
        plans.append(_plan(spec, samples, max_seconds, kwargs.get("shm_dir"), kwargs.get("ranks"),
                           bool(kwargs.get("progress", False))))  # fmt: skip
    return plans
