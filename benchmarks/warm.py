#!/usr/bin/env python
"""Every epoch, side by side in one run: MONAI, our CacheDataset with MONAI's DataLoader, and ours with ours.

The one benchmark to run to see where monai_cache stands against stock MONAI, on two workloads (``--workloads``):

* ``volumes``: the tutorial chain of :mod:`monai_cache.synthetic` on CT-like NIfTI volumes (``LoadImaged`` ...
  ``ScaleIntensityRanged`` cached, ``RandCropByPosNegLabeld(num_samples=2)`` on every read), batch 2;
* ``small``: MedNIST-like items, 64x64 PNG images (written with PIL) and MONAI's MedNIST chain (``LoadImaged``,
  ``EnsureChannelFirstd``, ``ScaleIntensityd`` cached; ``RandRotated(range_x=pi/12, prob=0.5, keep_size=True)``,
  ``RandFlipd(spatial_axis=0, prob=0.5)``, ``RandZoomd(0.9, 1.1, prob=0.5)`` on every read), batch 64.

Configurations, each eager (``cache_rate=1``, the default) and on the fly (``runtime_cache=True``, MONAI's and ours):

=======================  ===============================  ===========================================
label                    dataset                          loader
=======================  ===============================  ===========================================
``MONAI``                ``monai.data.CacheDataset``      ``monai.data.DataLoader``
``ours + MONAI DL``      ``monai_cache.CacheDataset``     ``monai.data.DataLoader``
``ours + our DL``        ``monai_cache.CacheDataset``     ``monai_cache.DataLoader``
``uncached`` (small)     ``monai.data.Dataset``           ``monai.data.DataLoader``, first epoch only
``ours + ThreadDL``      ``monai_cache.CacheDataset``     ``monai.data.ThreadDataLoader(num_workers=0)``,
(``--thread``, eager)                                     MONAI's fast-training pattern
``MONAI again``          ``monai.data.CacheDataset``      ``monai.data.DataLoader``: MONAI a second time,
(``--control``, eager)                                    the control (below)
``free read``            ``FreeReadCacheDataset``         ``monai.data.DataLoader``: what a cache whose read
(``--floor``, eager)     (below)                          costs nothing gives, the floor (below)
=======================  ===============================  ===========================================

every loader with ``collate_fn=list_data_collate``. Settings: ``--settings`` ranks x workers (default 1x2 and 2x1;
ranks started like torchrun, a ``DistributedSampler`` each and a gloo ``all_reduce`` per step, the step standing for
a GPU step whose CPU cost is small), ``--persistent`` (persistent workers on, off or both), ``--start-method``
(fork, spawn or both). Each configuration runs in a process tree of its own, ``--repeats`` times; the repeats are
outermost and the configurations rotate within each.

Printed, per workload and setting: **every epoch of every repeat** (wall: the slowest rank; CPU: every process of
the run, the ranks and their workers, read from ``/proc``); per configuration, the warm epochs (2..N) against
MONAI's eager ``CacheDataset`` + ``DataLoader`` of the same repeat (the median of the per-repeat ratios, and each
repeat's), the first epoch against MONAI's in the same mode, and the main process's CPU per warm batch; for small
items, the first epoch on the fly against an uncached one and MONAI's ``runtime_cache=True``. Then the targets,
computed from those measurements: every warm epoch of ours (both loaders, both modes) at most MONAI's slowest warm
epoch of the same repeat (wall and CPU; the worst such ratio and how many warm epochs are above), and, for small
items, the first epoch on the fly at most MONAI's ``runtime_cache=True`` first epoch and at most 1.25x an uncached
one (medians, wall and CPU). With ``--control``, MONAI's own configuration runs a second time in each repeat and is
held to the warm-epoch rule as if it were ours: how often the same code misses the rule is what the machine's noise
alone gives (printed, not a target). With ``--floor``, :class:`FreeReadCacheDataset` (MONAI's cache with a read that
costs nothing) runs too and is held to the same rule: how far any cache could go below MONAI's warm epochs, and how
often even it misses the rule (printed, not a target).

``--out`` gets ``warm.md`` (what was printed, in Markdown: the tables of the docs), ``warm.json`` (every
measurement), and the data, which later runs reuse. This is a benchmark, not a test: a shared machine makes single
wall times noisy, which is why every repeat is printed and ratios are taken within a repeat.

Usage::

    python -m benchmarks warm            # 12 volumes of 128x128x80 and 2,000 images, 3 repeats: 10-15 min on 2 cores
    python -m benchmarks warm --quick    # 8 volumes of 96x96x64 and 500 images, 1 repeat: a few minutes
    python -m benchmarks warm --workloads small --settings 1x2 --persistent both --start-method both
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import multiprocessing
import os
import resource
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import harness
import monai.data

from monai_cache.fingerprint import first_random_index
from monai_cache.sharing import with_new_containers


@dataclasses.dataclass(frozen=True)
class Config:
    """A dataset and a loader: ``dataset`` monai | ours | uncached | free-read, ``loader`` monai | ours | thread."""

    key: str
    dataset: str
    loader: str
    runtime_cache: bool
    label: str

    @property
    def mode(self) -> str:
        return "uncached" if self.dataset == "uncached" else "on the fly" if self.runtime_cache else "eager"

    @property
    def ours(self) -> bool:
        return self.dataset == "ours"


CONFIGS = {
    c.key: c
    for c in (
        Config("monai", "monai", "monai", False, "MONAI"),
        Config("ours+monai", "ours", "monai", False, "ours + MONAI DL"),
        Config("ours+ours", "ours", "ours", False, "ours + our DL"),
        Config("monai-rt", "monai", "monai", True, "MONAI"),
        Config("ours-rt+monai", "ours", "monai", True, "ours + MONAI DL"),
        Config("ours-rt+ours", "ours", "ours", True, "ours + our DL"),
        Config("uncached", "uncached", "monai", False, "MONAI Dataset"),
        Config("ours+thread", "ours", "thread", False, "ours + ThreadDL"),
        Config("monai-again", "monai", "monai", False, "MONAI again"),
        Config("free-read", "free-read", "monai", False, "free read"),
    )
}
BASELINE = "monai"  # the warm epochs' reference: MONAI's eager CacheDataset with its DataLoader
FIRST_REF = {"eager": "monai", "on the fly": "monai-rt"}  # the first epoch's reference, per mode
# held to the warm-epoch rule and printed, not targets: MONAI against itself, and a read that costs nothing
REFERENCES = {"monai-again": "control", "free-read": "floor"}
UNCACHED_MAX = 1.25  # issue #34: the small items' first epoch on the fly, at most this times an uncached one


@dataclasses.dataclass(frozen=True)
class Setting:
    ranks: int
    workers: int
    persistent: bool
    start_method: str

    @property
    def text(self) -> str:
        return (f"{self.ranks} rank(s) x {self.workers} worker(s), persistent workers "
                f"{'on' if self.persistent else 'off'}, {self.start_method}")

    @property
    def short(self) -> str:
        return f"{self.ranks}x{self.workers} {'persistent' if self.persistent else 'per-epoch'} {self.start_method}"


# ---------------------------------------------------------------------------------------------------------
# Data and chains
# ---------------------------------------------------------------------------------------------------------


def make_images(directory: str, items: int, seed: int = 0) -> list[dict[str, Any]]:
    """``items`` 64x64 8-bit PNG images like MedNIST's (a few smooth blobs and noise), with labels 0-5; written once
    (a manifest marks a complete set) and reused."""
    manifest = os.path.join(directory, f"manifest-{items}-{seed}.json")
    if os.path.isfile(manifest):
        with open(manifest) as f:
            return json.load(f)
    import numpy as np
    from PIL import Image

    os.makedirs(directory, exist_ok=True)
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:64, 0:64]
    files = []
    for i in range(items):
        image = np.zeros((64, 64), np.float32)
        for _ in range(4):
            (cy, cx), s, a = rng.uniform(10, 54, 2), rng.uniform(4, 14), rng.uniform(40, 160)
            image += a * np.exp(-((yy - cy) ** 2 + (xx - cx) ** 2) / (2 * s * s))
        image += rng.normal(0, 6, image.shape)
        path = os.path.join(directory, f"{i:06d}.png")
        Image.fromarray(np.clip(image, 0, 255).astype(np.uint8)).save(path)
        files.append({"image": path, "label": i % 6})
    with open(manifest + ".tmp", "w") as f:
        json.dump(files, f)
    os.replace(manifest + ".tmp", manifest)
    return files


def mednist_transforms() -> Any:
    """MONAI's MedNIST training chain, on dictionaries: the first three are cached, the rest run on every read."""
    from monai_cache.synthetic import mednist_transforms as chain

    return chain()


# ---------------------------------------------------------------------------------------------------------
# One rank
# ---------------------------------------------------------------------------------------------------------


class FreeReadCacheDataset(monai.data.CacheDataset):
    """``--floor``: MONAI's eager CacheDataset (``cache_rate=1``) whose read costs nothing but new objects.

    MONAI deep-copies a cached item before its random transforms (``copy_cache=True``); with ``copy_cache=False`` it
    hands them the cached objects, which they change (a MetaTensor's ``applied_operations`` grows every epoch). Here
    a read is ``monai_cache.sharing.with_new_containers``: new dicts and new MetaTensors over the cached memory,
    with copies of their metadata's containers, what a cache whose read cost nothing would hand on. Its items are
    MONAI's for chains whose random transforms write into no tensor of their input, such as the MedNIST chain
    (tests/test_benchmarks_harness.py). A benchmark's reference, not a cache to use: a random transform writing
    into its input would change the cache.
    """

    def _transform(self, index: int) -> Any:
        if self.hash_as_key or self.runtime_cache or not 0 <= index < self.cache_num:
            raise NotImplementedError("FreeReadCacheDataset reads eager caches of every item, by position")
        first_random = first_random_index(self.transform)  # MONAI's rule, as our CacheDataset applies it
        data = self._cache[index]
        return data if first_random is None else self.transform(with_new_containers(data), start=first_random)


def _build(config: Config, files: list[dict], transform: Any) -> Any:
    import monai_cache

    if config.dataset == "uncached":
        return monai.data.Dataset(files, transform)
    if config.dataset == "free-read":
        return FreeReadCacheDataset(files, transform, progress=False)
    cls = monai_cache.CacheDataset if config.ours else monai.data.CacheDataset
    return cls(files, transform, progress=False, runtime_cache=config.runtime_cache)


class _CollectAtEpoch:
    """``--collect-in-workers``: the dataset, read as it is, but the first read of epoch ``epoch`` in each worker
    runs a full garbage collection there first (the epoch in shared memory, set by the rank)."""

    def __init__(self, dataset: Any, epoch_now: Any, epoch: int) -> None:
        self.dataset, self.epoch_now, self.epoch, self.seen = dataset, epoch_now, epoch, 0
        if hasattr(dataset, "__getitems__"):  # a batch's items in one call, as torch's fetcher does for the dataset
            self.__getitems__ = self._getitems

    def __len__(self) -> int:
        return len(self.dataset)

    def _collect_at_epoch_start(self) -> None:
        if self.seen != self.epoch_now.value:
            self.seen = self.epoch_now.value
            if self.seen == self.epoch:
                gc.collect()

    def __getitem__(self, index: Any) -> Any:
        self._collect_at_epoch_start()
        return self.dataset[index]

    def _getitems(self, indices: Any) -> Any:
        self._collect_at_epoch_start()
        return self.dataset.__getitems__(indices)


def _main_cpu() -> float:
    """CPU seconds of this process, all its threads (not its workers)."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    return me.ru_utime + me.ru_stime


def rank_main(spec_path: str) -> None:
    """One rank: build the dataset, run the epochs, write ``rank<r>.json`` next to the spec."""
    import monai.data
    import torch
    import torch.distributed as dist
    from torch.utils.data.distributed import DistributedSampler

    import monai_cache
    from monai_cache.synthetic import tutorial_transforms

    with open(spec_path) as f:
        spec = json.load(f)
    config = CONFIGS[spec["config"]]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(spec["seed"] + rank)
    torch.set_num_threads(1)  # the step stands for a GPU step: idle OpenMP threads would take CPU from the workers
    with open(spec["data_list"]) as f:
        files = json.load(f)
    if spec["workload"] == "volumes":
        transform = tutorial_transforms(spec["crop"], num_samples=2)
    else:
        transform = mednist_transforms()
    dist.barrier()  # all ranks start building at once, as after torchrun's rendezvous
    t0 = time.perf_counter()
    dataset = _build(config, files, transform)
    setup_s = time.perf_counter() - t0
    sampler = DistributedSampler(dataset, shuffle=True, seed=spec["seed"])
    epoch_now = multiprocessing.get_context("fork").RawValue("i", 0)
    if spec.get("collect_in_workers"):
        dataset = _CollectAtEpoch(dataset, epoch_now, spec["collect_in_workers"])
    cls = monai_cache.DataLoader if config.loader == "ours" else monai.data.DataLoader
    workers = 0 if config.loader == "thread" else spec["workers"]
    if config.loader == "thread":  # MONAI's fast-training pattern: the random transforms in a thread of the rank
        cls = monai.data.ThreadDataLoader
    loader = cls(
        dataset, batch_size=spec["batch_size"], sampler=sampler, num_workers=workers,
        collate_fn=monai.data.list_data_collate, persistent_workers=spec["persistent"] and workers > 0,
        multiprocessing_context=spec["start_method"] if workers > 0 else None,
    )  # fmt: skip
    me = os.getpid()
    epochs = []
    for epoch in range(spec["epochs"]):
        sampler.set_epoch(epoch)
        epoch_now.value = epoch + 1
        dist.barrier()  # the ranks' epochs line up
        wall, cpu, main = time.perf_counter(), harness.tree_cpu_seconds(me), _main_cpu()
        batches = items = 0
        for batch in loader:
            image = batch["image"]
            image = image.as_tensor() if isinstance(image, monai.data.MetaTensor) else image
            total = image.sum()  # the training step: a reduction over the batch, in step across ranks
            dist.all_reduce(total)
            batches += 1
            items += len(image)
        wall = time.perf_counter() - wall
        # before the next barrier (a rank waiting there spins in gloo); workers of an epoch that are not persistent
        # were reaped when the iterator ended, and count in the rank's children
        cpu, main = harness.tree_cpu_seconds(me) - cpu, _main_cpu() - main
        epochs.append({"wall": wall, "cpu": cpu, "main_cpu": main, "batches": batches, "items": items,
                       "pss": harness.tree_pss_bytes(me)})  # fmt: skip
    dist.barrier()  # nobody leaves (and releases a shared cache) before everyone is done
    with open(os.path.join(os.path.dirname(spec_path), f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "setup_s": setup_s, "epochs": epochs}, f)
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------------------
# The launcher
# ---------------------------------------------------------------------------------------------------------


def run_one(spec: dict[str, Any], run_dir: str) -> dict[str, Any]:
    """One configuration's process tree: start its ranks, combine their epochs (wall: the slowest rank's; CPU, main
    process CPU and batches: summed over the ranks)."""
    shutil.rmtree(run_dir, ignore_errors=True)
    os.makedirs(run_dir)
    spec_path = os.path.join(run_dir, "spec.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    shm_dir = tempfile.mkdtemp(prefix="bench-warm-", dir=os.environ.get("MONAI_CACHE_SHM_DIR", "/dev/shm"))
    try:  # a cache of its own: nothing left warm by a run before, and nobody else's entries counted
        env = {**os.environ, "MONAI_CACHE_SHM_DIR": shm_dir, "PYTHONWARNINGS": "ignore"}
        harness.run_ranks([os.path.abspath(__file__), "--rank-spec", spec_path], spec["ranks"], run_dir, env)
    finally:
        shutil.rmtree(shm_dir, ignore_errors=True)
    ranks = []
    for r in range(spec["ranks"]):
        with open(os.path.join(run_dir, f"rank{r}.json")) as f:
            ranks.append(json.load(f))
    epochs = [
        {
            "wall": max(rk["epochs"][e]["wall"] for rk in ranks),
            **{k: sum(rk["epochs"][e].get(k, 0) for rk in ranks)
               for k in ("cpu", "main_cpu", "batches", "items", "pss")},
        }
        for e in range(spec["epochs"])
    ]
    return {"setup_s": max(rk["setup_s"] for rk in ranks), "epochs": epochs}


def warm_mean(record: dict[str, Any], key: str) -> float | None:
    """The mean of ``key`` over the warm epochs (2..N) of one run."""
    warm = [e[key] for e in record["epochs"][1:]]
    return sum(warm) / len(warm) if warm else None


def _median_text(values: Iterable[float | None], digits: int = 2) -> str:
    """The median of the values there are (a run of one epoch has no warm ones), or ``-``."""
    present = [v for v in values if v is not None]
    return f"{harness.median(present):.{digits}f}" if present else "-"


def _cell(values: Sequence[float], digits: int = 2) -> str:
    """``median (each repeat)`` of ratios."""
    if not values:
        return "-"
    med = harness.median(values)
    each = ", ".join(f"{v:.{digits}f}" for v in values)
    return f"{med:.{digits}f}" + (f" ({each})" if len(values) > 1 else "")


def report_group(rep: harness.Report, title: str, configs: list[str], runs: dict[str, list[dict]]) -> list:
    """Print one workload in one setting: every epoch, the ratios, the targets; returns the targets' checks."""
    rep.heading(title)
    repeats = max(len(v) for v in runs.values())
    epochs = max(len(r["epochs"]) for v in runs.values() for r in v)
    def every_epoch(title: str, cell: Callable[[dict[str, Any]], str]) -> None:
        rows = [["mode", "dataset + loader", *(f"repeat {i + 1}" for i in range(repeats))]]
        for key in configs:
            cells = ["  ".join(cell(e) for e in r["epochs"]) for r in runs[key]]
            rows.append([CONFIGS[key].mode, CONFIGS[key].label, *cells, *[""] * (repeats - len(cells))])
        rep.table(rows, left=2 + repeats, title=title)
        rep.line()

    every_epoch(f"every epoch of every repeat, epochs 1 to {epochs} left to right, each wall/CPU of all processes (s):",
                lambda e: f"{e['wall']:.2f}/{e['cpu']:.2f}")  # fmt: skip
    collect = {r.get("collect_in_workers") for v in runs.values() for r in v} - {None}
    if collect:  # what the forced collection did to the memory: the process trees after each epoch
        every_epoch(f"PSS of every process of the run after each epoch, epochs 1 to {epochs} left to right (MiB); a "
                    f"full garbage collection forced in every worker at the start of epoch {min(collect)}:",
                    lambda e: f"{e.get('pss', 0) / 2**20:5.0f}")  # fmt: skip

    base = runs.get(BASELINE, [])
    rows = [["mode", "dataset + loader", "warm wall (s)", "warm CPU (s)", "warm wall / MONAI", "warm CPU / MONAI",
             "first wall / ref", "first CPU / ref", "main CPU / warm batch (ms)"]]
    for key in configs:
        c = CONFIGS[key]
        rs = runs[key]
        if c.dataset == "uncached":
            continue
        ref = runs.get(FIRST_REF[c.mode], [])
        first = [harness.ratios([r["epochs"][0][k] for r in rs], [r["epochs"][0][k] for r in ref]) for k in
                 ("wall", "cpu")]
        warm = [harness.ratios([warm_mean(r, k) for r in rs], [warm_mean(b, k) for b in base]) for k in ("wall", "cpu")]
        per_batch = [1e3 * warm_mean(r, "main_cpu") / max(1.0, warm_mean(r, "batches"))  # type: ignore[operator]
                     for r in rs if len(r["epochs"]) > 1]  # fmt: skip
        rows.append([
            c.mode, c.label, _median_text(warm_mean(r, "wall") for r in rs),
            _median_text(warm_mean(r, "cpu") for r in rs), _cell(warm[0]), _cell(warm[1]),
            *(("ref", "ref") if key == FIRST_REF[c.mode] else (_cell(first[0]), _cell(first[1]))),
            _median_text(per_batch, 1),
        ])  # fmt: skip
    rep.table(rows, left=2, title=(
        f"medians of {repeats} repeat(s), each repeat's ratio in brackets; warm: epochs 2..{epochs}, against MONAI's "
        "eager CacheDataset + DataLoader of the same repeat; first epoch against MONAI's of the same mode (ref):"
    ))
    checks = []
    for key in configs:
        c = CONFIGS[key]
        if not (c.ours or key in REFERENCES) or c.loader == "thread" or not base:
            continue
        worst, above = {}, {}
        for k in ("wall", "cpu"):
            pairs = [
                (e[k] / max(b[k] for b in mb["epochs"][1:]), i + 1, n + 2)
                for i, (r, mb) in enumerate(zip(runs[key], base)) for n, e in enumerate(r["epochs"][1:])
            ]  # fmt: skip
            worst[k] = max(pairs) if pairs else None
            above[k] = f"{sum(p[0] > 1.0 for p in pairs)} of {len(pairs)} above"
        if worst["wall"] is None:
            continue
        ok = all(w[0] <= 1.0 for w in worst.values() if w)
        text = ", ".join(f"{k} {w[0]:.2f} (repeat {w[1]}, epoch {w[2]}; {above[k]})" for k, w in worst.items() if w)
        rule = f"every warm epoch of {c.label}, {c.mode}, <= MONAI's slowest warm epoch of the same repeat"
        if key in REFERENCES:  # the control and the floor: held to the rule, printed, not targets of ours
            rep.line()
            rep.line(f"{REFERENCES[key]}, {title}: {rule}: {'holds' if ok else 'missed'}; worst {text}")
            continue
        checks.append((ok, f"{title}: {rule}; worst {text}"))
    if "uncached" in runs:
        rep.line()
        unc, mrt = runs["uncached"], runs.get("monai-rt", [])
        rows = [["dataset + loader", "first wall (s)", "first CPU (s)", "wall / uncached", "CPU / uncached",
                 "wall / MONAI rt", "CPU / MONAI rt"]]
        for key in ("uncached", "monai-rt", "ours-rt+monai", "ours-rt+ours"):
            if key not in runs:
                continue
            rs = runs[key]
            first = {k: [r["epochs"][0][k] for r in rs] for k in ("wall", "cpu")}
            vs_unc = {k: harness.ratios(first[k], [r["epochs"][0][k] for r in unc]) for k in ("wall", "cpu")}
            vs_mrt = {k: harness.ratios(first[k], [r["epochs"][0][k] for r in mrt]) for k in ("wall", "cpu")}
            label = CONFIGS[key].label + ("" if key == "uncached" else ", runtime_cache=True")
            rows.append([label, f"{harness.median(first['wall']):.2f}", f"{harness.median(first['cpu']):.2f}",
                         _cell(vs_unc["wall"]), _cell(vs_unc["cpu"]),
                         _cell(vs_mrt["wall"]) if key != "uncached" else "-",
                         _cell(vs_mrt["cpu"]) if key != "uncached" else "-"])  # fmt: skip
            if CONFIGS[key].ours:
                targets = (("uncached", vs_unc, UNCACHED_MAX), ("MONAI's runtime_cache=True", vs_mrt, 1.0))
                for what, vals, bound in targets:
                    meds = {k: harness.median(v) for k, v in vals.items()}
                    if None in meds.values():
                        continue
                    checks.append((
                        all(m <= bound for m in meds.values()),
                        f"{title}: first epoch of {CONFIGS[key].label}, on the fly, <= {bound:g}x {what}; wall "
                        f"{meds['wall']:.2f}x, CPU {meds['cpu']:.2f}x (medians of per-repeat ratios)",
                    ))
        rep.table(rows, title="the first epoch on the fly against an uncached one (monai.data.Dataset) and MONAI's "
                               "runtime_cache=True, medians of per-repeat ratios:")  # fmt: skip
    return checks


def _settings(args: argparse.Namespace) -> list[Setting]:
    persistent = {"on": [True], "off": [False], "both": [True, False]}[args.persistent]
    methods = {"fork": ["fork"], "spawn": ["spawn"], "both": ["fork", "spawn"]}[args.start_method]
    return [Setting(r, w, p, m) for r, w in args.settings for p in persistent for m in methods]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--rank-spec", help=argparse.SUPPRESS)
    parser.add_argument("--workloads", default="volumes,small", help="volumes, small or both (default volumes,small)")
    parser.add_argument("--settings", type=harness.parse_settings, default=[(1, 2), (2, 1)],
                        help="ranks x workers (default 1x2,2x1)")
    parser.add_argument("--persistent", choices=("on", "off", "both"), default="on",
                        help="persistent_workers (default on)")
    parser.add_argument("--start-method", choices=("fork", "spawn", "both"), default="fork",
                        help="how DataLoader workers start (default fork)")
    parser.add_argument("--modes", default="eager,on-the-fly", help="eager, on-the-fly or both (default both)")
    parser.add_argument("--repeats", type=int, help="runs of each configuration (default 3; --quick 1)")
    parser.add_argument("--volumes", type=int, help="volumes (default 12; --quick 8)")
    parser.add_argument("--shape", help="voxels per volume, e.g. 128x128x80 (default; --quick 96x96x64)")
    parser.add_argument("--crop", help="the random crop, e.g. 64x64x64 (default: 64 per side, shrunk to fit)")
    parser.add_argument("--images", type=int, help="small items (default 2000; --quick 500)")
    parser.add_argument("--epochs", type=int, help="epochs per run, the first one cold (default 3)")
    parser.add_argument("--thread", action="store_true",
                        help="also our CacheDataset with monai.data.ThreadDataLoader(num_workers=0), eager")
    parser.add_argument("--control", action="store_true",
                        help="run MONAI's eager configuration twice per repeat and hold the second to the targets' "
                             "warm-epoch rule: what the machine's noise alone gives")
    parser.add_argument("--floor", action="store_true",
                        help="also MONAI's eager cache with a read that costs nothing (FreeReadCacheDataset), held to "
                             "the targets' warm-epoch rule: how far below MONAI's warm epochs any cache could go")
    parser.add_argument("--collect-in-workers", type=int, metavar="EPOCH",
                        help="force a full garbage collection in every DataLoader worker at the start of epoch EPOCH "
                             "(forked workers) and print the process trees' PSS after each epoch: what such a "
                             "collection costs where it runs by itself")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="small sizes, 1 repeat: a few minutes")
    parser.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "monai-cache-bench", "warm"),
                        help="results (warm.md, warm.json) and the data, reused by later runs")
    parser.add_argument("--summarize", action="store_true",
                        help="run nothing: print the report of the run saved in --out (warm.json) again")
    args = parser.parse_args(argv)
    if args.rank_spec:
        rank_main(args.rank_spec)
        return 0
    out = os.path.abspath(args.out)
    if args.summarize:  # the same tables from the same measurements, e.g. after the report's format changed
        with open(os.path.join(out, "warm.json")) as f:
            result = json.load(f)
        report = harness.Report("warm")
        report.line(result["head"])
        print_report(report, result)
        print(f"results: {report.save(out, result)}")
        return 0
    from monai_cache.synthetic import crop_size_for, make_dataset

    if args.collect_in_workers is not None and (args.collect_in_workers < 1 or args.start_method != "fork"):
        parser.error("--collect-in-workers takes an epoch from 1, with forked workers (--start-method fork)")
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if set(workloads) - {"volumes", "small"} or set(modes) - {"eager", "on-the-fly"} or not workloads or not modes:
        parser.error("--workloads takes volumes and/or small, --modes eager and/or on-the-fly")
    repeats = args.repeats or (1 if args.quick else 3)
    shape = tuple(int(v) for v in (args.shape or ("96x96x64" if args.quick else "128x128x80")).split("x"))
    crop = tuple(int(v) for v in args.crop.split("x")) if args.crop else crop_size_for(shape, (64, 64, 64))
    volumes = args.volumes or (8 if args.quick else 12)
    images = args.images or (500 if args.quick else 2000)
    os.makedirs(out, exist_ok=True)
    machine = harness.machine_info()
    shape_text = "x".join(map(str, shape))
    data: dict[str, dict[str, Any]] = {}
    if "volumes" in workloads:
        files = make_dataset(os.path.join(out, "data", f"ct-{shape_text}-seed{args.seed}"), items=volumes, shape=shape,
                             seed=args.seed)  # fmt: skip
        data["volumes"] = {"files": files, "batch_size": 2, "epochs": args.epochs or 3,
                           "what": f"{volumes} CT-like volumes of {shape_text}, the tutorial chain (2 crops of "
                                   f"{'x'.join(map(str, crop))}), batch 2"}  # fmt: skip
    if "small" in workloads:
        files = make_images(os.path.join(out, "data", f"mednist-64x64-seed{args.seed}"), images, args.seed)
        data["small"] = {"files": files, "batch_size": 64, "epochs": args.epochs or 3,
                         "what": f"{images:,} MedNIST-like 64x64 PNG images, MONAI's MedNIST chain, batch 64"}
    for w, d in data.items():
        d["data_list"] = os.path.join(out, f"datalist-{w}.json")
        with open(d["data_list"], "w") as f:
            json.dump(d["files"], f)
    optional = ("uncached", "ours+thread", "monai-again", "free-read")
    keys = [k for k in CONFIGS if k not in optional and CONFIGS[k].mode.replace(" ", "-") in modes]
    keys += ["ours+thread"] if args.thread and "eager" in modes else []
    keys += ["monai-again"] if args.control and "eager" in modes else []
    keys += ["free-read"] if args.floor and "eager" in modes else []
    plan = []  # (repeat, workload, setting, config): repeats outermost, the configurations rotating within each
    for rep in range(repeats):
        for w in data:
            configs = keys + (["uncached"] if w == "small" and "on-the-fly" in modes else [])
            for s in _settings(args):
                plan += [(rep, w, s, key) for key in harness.rotated(configs, rep)]
    report = harness.Report("warm")
    workloads_text = "; ".join(f"{d['what']}, {d['epochs']} epochs" for d in data.values())
    head = (
        f"warm: {repeats} repeat(s); {workloads_text}.\n"
        f"{harness.describe_machine(machine)}\n"
        "MONAI: monai.data.CacheDataset; ours: monai_cache.CacheDataset; MONAI DL: monai.data.DataLoader; our DL: "
        "monai_cache.DataLoader; eager: cache_rate=1; on the fly: runtime_cache=True; MONAI Dataset: no cache."
        + ("\nfree read: MONAI's eager CacheDataset whose read costs nothing (warm.FreeReadCacheDataset), the floor of "
           "any cache's warm epoch." if "free-read" in keys else "")
    )
    report.line(head)
    t0 = time.perf_counter()
    records: list[dict[str, Any]] = []
    for i, (rep, w, s, key) in enumerate(plan):
        print(f"[{i + 1}/{len(plan)}] repeat {rep + 1}, {w}, {s.short}, {CONFIGS[key].mode}, {CONFIGS[key].label}",
              file=sys.stderr, flush=True)  # fmt: skip
        spec = {
            "config": key, "workload": w, "data_list": data[w]["data_list"], "ranks": s.ranks, "workers": s.workers,
            "persistent": s.persistent, "start_method": s.start_method, "batch_size": data[w]["batch_size"],
            "epochs": 1 if key == "uncached" else data[w]["epochs"], "crop": list(crop), "seed": args.seed,
            "collect_in_workers": args.collect_in_workers,
        }  # fmt: skip
        record = run_one(spec, os.path.join(out, "runs", f"{w}-{s.short.replace(' ', '-')}-{key}-{rep}"))
        records.append({**spec, "repeat": rep, **record})
    machine["loadavg_end"] = list(os.getloadavg())
    result = {"head": head, "machine": machine, "records": records, "seconds": time.perf_counter() - t0}
    print_report(report, result)
    path = report.save(out, result)
    print(f"results: {path}, {os.path.join(out, 'warm.json')}")
    return 0


def print_report(report: harness.Report, result: dict[str, Any]) -> list[tuple[bool, str]]:
    """Every workload and setting of ``result`` (``warm.json``: its records, in the order they ran), then the
    targets and the totals; returns the targets' checks."""
    records = result["records"]
    checks = []
    for w in dict.fromkeys(r["workload"] for r in records):
        for s in dict.fromkeys(Setting(r["ranks"], r["workers"], r["persistent"], r["start_method"]) for r in records):
            group = [r for r in records if r["workload"] == w and
                     Setting(r["ranks"], r["workers"], r["persistent"], r["start_method"]) == s]  # fmt: skip
            configs = [k for k in CONFIGS if any(r["config"] == k for r in group)]
            runs = {k: sorted((r for r in group if r["config"] == k), key=lambda r: r["repeat"]) for k in configs}
            if runs:
                checks += report_group(report, f"{w}, {s.text}", configs, runs)
    report.heading("targets")
    report.targets(checks)
    load = result["machine"].get("loadavg_end") or [0.0]
    report.line(f"\ntotal wall {result['seconds']:.0f} s; load average at the end {load[0]:.1f}")
    return checks


if __name__ == "__main__":
    sys.exit(main())
