#!/usr/bin/env python
"""Many small items through a DataLoader: the on-the-fly first epoch against an uncached one, warm reads against
MONAI's ``CacheDataset``, side by side in one run (issue #27's "many small items").

The items are ``bench_scale.py``'s: 64x64 float32 images of 16 KiB made by a cheap deterministic transform (a
seeded ``torch.rand``, tens of microseconds; ``--compute-ms`` adds that much CPU work to it, standing for a decode
and resize; ``--meta`` makes each image a ``MetaTensor`` with the metadata ``LoadImaged`` gives a NIfTI image, about
40 header fields, as a MONAI chain that loads files has), then ``RandFlipd`` (the random part, run on every read). Each
configuration runs in a fresh process tree, started like ``torchrun`` ranks (``harness.run_ranks``; a gloo group
and a barrier around each epoch so that the ranks' epochs line up), with ``monai.data.DataLoader(batch_size,
shuffle or DistributedSampler, num_workers, persistent_workers=True)``:

* ``uncached``: ``monai.data.Dataset`` (the reference of the first epoch),
* ``monai``: ``monai.data.CacheDataset`` (filled before the loader starts: the reference of the warm epochs),
* ``ours-runtime``: ``monai_cache.CacheDataset(runtime_cache=True)`` (filled by the workers on the fly),
* ``ours``: ``monai_cache.CacheDataset`` (filled before the loader starts).

CPU is the CPU seconds of each rank's whole process tree (the rank and its living workers, read from ``/proc``)
over the epoch, summed over the ranks; wall is the epoch's time between barriers. The repeats are outermost, the
configurations rotate within each, and the ratios are taken per repeat against the reference of the same repeat;
every repeat's ratio is printed with their median.

Usage::

    python benchmarks/small_items.py                       # 20,000 items, 1x2 and 2x1, 5 repeats
    python benchmarks/small_items.py --items 4000 --repeats 2 --settings 1x2
    python benchmarks/small_items.py --compute-ms 1      # items that take a millisecond to make
    python benchmarks/small_items.py --meta              # items with a NIfTI image's metadata
    python benchmarks/small_items.py --loader thread --settings 1x0   # monai.data.ThreadDataLoader(num_workers=0)

``--loader`` picks the DataLoader of every configuration: ``monai`` (``monai.data.DataLoader``, the default),
``thread`` (``monai.data.ThreadDataLoader``, MONAI's pattern for a cache read in the main process: a background
thread fetches the batches; thread workers, ``use_thread_workers=True``, made stock MONAI's ``RandFlipd`` fail) or
``ours`` (``monai_cache.DataLoader``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import harness
from monai.transforms import Transform

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
os.environ["PYTHONPATH"] = ROOT + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")

from monai_cache.utils import format_table  # noqa: E402

CONFIGS = ("uncached", "monai", "ours-runtime", "ours")
# (what, configuration, reference, epoch): 0 is the first epoch, 1 the warm one
RATIOS = (
    ("first epoch on the fly / uncached", "ours-runtime", "uncached", 0),
    ("warm epoch eager / MONAI", "ours", "monai", 1),
    ("warm epoch on the fly / MONAI", "ours-runtime", "monai", 1),
)


class Spin(Transform):
    """A deterministic transform that burns about ``ms`` milliseconds of CPU (a stand-in for decoding): a loop of
    integer additions, sized once per process, with no system call in it (a loop reading the CPU clock is a system
    call at every turn, and those change what runs around them).

    A MONAI ``Transform``: MONAI's caches stop at the first callable that is not one, as at a random one."""

    def __init__(self, ms: float) -> None:
        self.ms = ms
        self.turns = 0

    def __call__(self, d: dict) -> dict:
        if not self.turns:
            t = time.thread_time()
            sum(range(1_000_000))
            self.turns = max(1, int(1_000_000 * self.ms / 1e3 / max(time.thread_time() - t, 1e-6)))
        sum(range(self.turns))
        return d


class WithNiftiMeta(Transform):
    """Makes the image a ``MetaTensor`` with the metadata ``LoadImaged`` + ``EnsureChannelFirstd`` give a 64x64 NIfTI
    image (read once per process from a file written for it), its file name the item's: what a MONAI chain that
    loads files carries into the cache. Deterministic, so it is cached."""

    def __init__(self) -> None:
        self.meta: dict | None = None

    def _nifti_meta(self) -> dict:
        import nibabel as nib
        import numpy as np
        from monai.transforms import EnsureChannelFirstd, LoadImaged

        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "image.nii.gz")
            nib.save(nib.Nifti1Image(np.zeros((64, 64), np.float32), np.diag([0.8, 0.8, 1.0, 1.0])), path)
            loaded = EnsureChannelFirstd(keys="image")(LoadImaged(keys="image")({"image": path}))
        return dict(loaded["image"].meta)

    def __call__(self, d: dict) -> dict:
        from monai.data import MetaTensor

        if self.meta is None:
            self.meta = self._nifti_meta()
        meta = dict(self.meta, filename_or_obj=f"case{d['i']:06d}.nii.gz", affine=self.meta["affine"].clone())
        return dict(d, image=MetaTensor(d["image"], meta=meta))


def rank_main(config: str, items: int, workers: int, batch: int, epochs: int, result: str, compute_ms: float,
              loader_kind: str, meta: bool = False) -> None:
    """One rank of one run: build ``config``'s dataset, read ``epochs`` epochs, write their wall and CPU."""
    import torch
    import torch.distributed as dist
    from bench_scale import _make_transform
    from monai.data import DataLoader
    from monai.transforms import Compose, RandFlipd
    from torch.utils.data import DistributedSampler

    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1:
        dist.init_process_group("gloo")
    make = _make_transform()
    sys.modules["__main__"].MakeImage = make  # picklable by reference
    sys.modules["__main__"].Spin = Spin
    sys.modules["__main__"].WithNiftiMeta = WithNiftiMeta
    spin = [Spin(compute_ms)] if compute_ms > 0 else []
    with_meta = [WithNiftiMeta()] if meta else []
    chain = Compose([make(), *with_meta, *spin, RandFlipd(keys="image", prob=0.5, spatial_axis=0)])
    data = [{"i": i} for i in range(items)]
    if config == "uncached":
        from monai.data import Dataset

        ds: torch.utils.data.Dataset = Dataset(data, chain)
    elif config == "monai":
        from monai.data import CacheDataset

        ds = CacheDataset(data, chain, progress=False, num_workers=1)
    elif config in ("ours", "ours-runtime"):
        from monai_cache import CacheDataset as OurCacheDataset

        runtime = config == "ours-runtime"
        ds = OurCacheDataset(data, chain, progress=False, num_workers=1, runtime_cache=runtime)
    else:
        raise SystemExit(f"unknown configuration {config}")
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=0) if world > 1 else None
    common = {"batch_size": batch, "shuffle": sampler is None, "sampler": sampler, "num_workers": workers}
    if loader_kind == "thread":
        from monai.data import ThreadDataLoader

        loader = ThreadDataLoader(ds, use_thread_workers=True, **common)
    elif loader_kind == "ours":
        from monai_cache import DataLoader as OurDataLoader

        loader = OurDataLoader(ds, persistent_workers=True, **common)
    else:
        loader = DataLoader(ds, persistent_workers=True, **common)
    out = []
    for epoch in range(epochs):
        if sampler is not None:
            sampler.set_epoch(epoch)
        if world > 1:
            dist.barrier()
        wall, cpu = time.perf_counter(), harness.tree_cpu_seconds(os.getpid())
        seen = sum(len(b["i"]) for b in loader)
        cpu_after = harness.tree_cpu_seconds(os.getpid())  # before the barrier: a rank waiting spins in gloo
        if world > 1:
            dist.barrier()
        out.append({"wall": time.perf_counter() - wall, "cpu": cpu_after - cpu, "seen": seen})
    with open(result, "w") as f:
        json.dump(out, f)
    if world > 1:
        dist.destroy_process_group()


def run(config: str, ranks: int, workers: int, args: argparse.Namespace, tmp: str) -> list[dict]:
    """One run of ``config`` as ``ranks`` x ``workers``: per epoch, wall (slowest rank) and CPU (summed)."""
    run_dir = tempfile.mkdtemp(dir=tmp)
    env = dict(os.environ, MONAI_CACHE_SHM_DIR=run_dir)  # a cache of its own: nothing left warm from a run before
    argv = [os.path.abspath(__file__), "--rank", config, "--items", str(args.items), "--workers", str(workers),
            "--batch", str(args.batch), "--epochs", str(args.epochs), "--compute-ms", str(args.compute_ms),
            "--loader", args.loader, *(["--meta"] if args.meta else []),
            "--out", run_dir]
    harness.run_ranks(argv, ranks, os.path.join(run_dir, "logs"), env=env, timeout=1800)
    per_rank = []
    for r in range(ranks):
        with open(os.path.join(run_dir, f"rank{r}.json")) as f:
            per_rank.append(json.load(f))
    shutil.rmtree(run_dir, ignore_errors=True)
    epochs = []
    for e in range(args.epochs):
        assert sum(p[e]["seen"] for p in per_rank) >= args.items, "an epoch missed items"
        epochs.append({"wall": max(p[e]["wall"] for p in per_rank), "cpu": sum(p[e]["cpu"] for p in per_rank)})
    return epochs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--settings", default="1x2,2x1", help="ranks x workers, comma separated")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--loader", choices=("monai", "thread", "ours"), default="monai")
    parser.add_argument("--compute-ms", type=float, default=0.0, help="CPU milliseconds added to making an item")
    parser.add_argument("--meta", action="store_true", help="items are MetaTensors with a NIfTI image's metadata")
    parser.add_argument("--workers", type=int, default=2, help=argparse.SUPPRESS)
    parser.add_argument("--rank", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank:
        rank = os.environ.get("RANK", "0")
        rank_main(args.rank, args.items, args.workers, args.batch, args.epochs,
                  os.path.join(args.out, f"rank{rank}.json"), args.compute_ms, args.loader, args.meta)
        return 0
    tmp = tempfile.mkdtemp(prefix="small_items-", dir="/dev/shm")
    extra = f", {args.compute_ms:g} ms more to make each" if args.compute_ms else ""
    extra += ", with a NIfTI image's metadata" if args.meta else ""
    print(f"small_items: {args.items:,} items of 16 KiB{extra}, batch {args.batch}, loader {args.loader}, "
          f"{args.repeats} repeats; load average {os.getloadavg()[0]:.1f}", flush=True)
    try:
        for ranks, workers in harness.parse_settings(args.settings):
            records: dict[str, list[list[dict]]] = {c: [] for c in CONFIGS}
            for rep in range(args.repeats):
                for c in CONFIGS[rep % len(CONFIGS):] + CONFIGS[: rep % len(CONFIGS)]:
                    records[c].append(run(c, ranks, workers, args, tmp))
            print(f"\n{ranks} rank(s) x {workers} worker(s): epoch wall and CPU (s), per repeat")
            rows = [["configuration", "epoch", *(f"repeat {r + 1}" for r in range(args.repeats))]]
            for c in CONFIGS:
                for e in range(args.epochs):
                    rows.append([c, "first" if e == 0 else f"warm {e}",
                                 *(f"{rec[e]['wall']:.2f} / {rec[e]['cpu']:.2f}" for rec in records[c])])
            print(format_table(rows, left=2, rule=True))
            rows = [["ratio", "", *(f"repeat {r + 1}" for r in range(args.repeats)), "median"]]
            for what, config, ref, epoch in RATIOS:
                for key in ("wall", "cpu"):
                    vals = [a[epoch][key] / b[epoch][key] for a, b in zip(records[config], records[ref])]
                    rows.append([what, key, *(f"{v:.3f}" for v in vals), f"{statistics.median(vals):.3f}"])
            print(format_table(rows, left=2, rule=True), flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
