#!/usr/bin/env python
"""Auto3DSeg's segresnet pipeline, stock MONAI against monai_cache, side by side in the same run.

The training is written the way the segresnet template writes it (``scripts/segmenter.py`` of
Project-MONAI/research-contributions): rank 0 makes ``multiprocessing.Manager().list([None] * n)`` and broadcasts
it to the ranks of its node; ``CacheDataset(data, transform, copy_cache=False, cache_rate=1.0,
runtime_cache=that_list)``; a ``DistributedSampler``; DataLoader workers with ``persistent_workers=True``; a tiny
3-D conv in ``DistributedDataParallel`` and a ``DiceCELoss``. Configurations, on CT-like volumes
(:mod:`monai_cache.synthetic`, the tutorial chain):

* ``uncached``: ``monai.data.Dataset`` (the reference for memory),
* ``stock``: ``monai.data.CacheDataset`` with the Manager list (MONAI: the Manager's server holds the items, and every
  read is a request to it),
* ``switch``: the same code with the switch on (``monai_cache.install()`` in the rank, the code ``monai-cache run``
  runs at start-up; the start-up cost of ``run``'s ``sitecustomize`` itself, about 15 ms per interpreter, is not
  measured): ``monai.data.CacheDataset`` is monai_cache's, the list is left empty, the items live in the node-wide
  shared-memory cache.

For every setting (``--settings``, default one process x 2 workers and 2 ranks x 2 workers) each configuration runs
``--repeats`` times in rotating order; the table shows medians of the per-repeat ratios against ``stock`` (each
repeat's ratio is taken against the stock run of the same repeat):

* first epoch (the cache is filled on the fly) and warm epochs (2..N): wall, and CPU seconds of every process (the
  ranks, their workers, the Manager's server);
* memory of every process together (PSS, shared-memory files included, the Manager's server included) above the
  uncached run, in copies of the cached data, mean over the warm epochs and peak;
* how many times the deterministic transforms ran (once per item on the machine is the floor).

Usage::

    python -m benchmarks switch                # 24 volumes of 160x160x96, 3 epochs, 2 repeats
    python -m benchmarks switch --quick        # 8 volumes of 64x64x48, 3 epochs, 1 repeat
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from collections.abc import Sequence
from typing import Any

import bench_cache
import harness

from monai_cache.codec import item_nbytes
from monai_cache.synthetic import crop_size_for, tutorial_transforms

CONFIGS = {
    "uncached": "monai.data.Dataset (no cache)",
    "stock": "monai.data.CacheDataset, runtime_cache=Manager list",
    "switch": "the same, under the switch (CacheDataset being monai_cache's)",
}
BASELINE = "stock"
_MIB = 1 << 20


# ---------------------------------------------------------------------------------------------------------
# Inside the ranks: the segresnet pattern
# ---------------------------------------------------------------------------------------------------------


def get_shared_memory_list(length: int) -> Any:
    """The template's list shared by the ranks of a node: rank 0's Manager list, broadcast (single node)."""
    import multiprocessing as mp

    import numpy as np
    import torch.distributed as dist

    mp.current_process().authkey = np.arange(32, dtype=np.uint8).tobytes()  # the same key in every rank
    shl = [mp.Manager().list([None] * length) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(shl, src=0)
    return shl[0]


def rank_main(spec_path: str) -> None:
    """Body of one rank: build the dataset as segresnet does, train, write ``rank<r>.json``."""
    import monai.data
    import torch
    import torch.distributed as dist
    from monai.data import DataLoader
    from monai.losses import DiceCELoss
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DistributedSampler

    with open(spec_path) as f:
        raw = json.load(f)
    raw["spatial_size"] = tuple(raw["spatial_size"])
    spec = bench_cache.RunSpec(**raw)
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    torch.manual_seed(spec.seed)
    with open(spec.data_list) as f:
        files = json.load(f)
    log = os.path.join(spec.run_dir, "computes.log")
    transform = tutorial_transforms(
        spec.spatial_size, spec.num_samples, before=[bench_cache.ComputeLog(log, True)],
        after=[bench_cache.ComputeLog(log, False)],
    )  # fmt: skip
    if spec.config == "switch":
        import monai_cache

        monai_cache.install(children=False)  # the switch (its workers are forked: they inherit it)
    dist.barrier()
    cpu0 = harness.tree_cpu_seconds(os.getpid())
    runtime_cache = None
    if spec.config == "uncached":
        ds: Any = monai.data.Dataset(files, transform)
    else:
        runtime_cache = get_shared_memory_list(len(files))
        ds = monai.data.CacheDataset(
            data=files, transform=transform, copy_cache=False, cache_rate=1.0, runtime_cache=runtime_cache,
            progress=False,
        )  # fmt: skip
    sampler = DistributedSampler(ds, shuffle=True, seed=spec.seed)
    loader = DataLoader(
        ds, batch_size=spec.batch_size, sampler=sampler, num_workers=spec.workers,
        persistent_workers=spec.workers > 0,
    )  # fmt: skip
    model = DistributedDataParallel(torch.nn.Conv3d(1, 4, kernel_size=3, padding=1))  # background and 3 organs
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    loss_function = DiceCELoss(to_onehot_y=True, softmax=True)
    epochs = []
    for epoch in range(spec.epochs):
        sampler.set_epoch(epoch)
        dist.barrier()
        start_wall, start = time.time(), time.perf_counter()
        for batch in loader:
            optimizer.zero_grad()
            loss_function(model(batch["image"]), batch["label"]).backward()
            optimizer.step()
        # the ranks, their living workers and the Manager's server (rank 0's child): every process of this rank
        epochs.append(
            {"seconds": time.perf_counter() - start, "start": start_wall, "end": time.time(),
             "cpu": harness.tree_cpu_seconds(os.getpid()) - cpu0}
        )  # fmt: skip
    dist.barrier()
    one_copy = manager_items = None
    if runtime_cache is not None and rank == 0:
        held = [item for item in runtime_cache if item is not None]
        manager_items = len(held)
        stats = ds.cache_stats() if hasattr(ds, "cache_stats") else None
        one_copy = sum(item_nbytes(item) for item in held) if held else (stats and stats["total"]["bytes_raw"])
    result = {"rank": rank, "epochs": epochs, "one_copy_bytes": one_copy, "manager_items": manager_items}
    with open(os.path.join(spec.run_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()  # rank 0's Manager stays up until every rank is done with its list
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------------------
# The launcher
# ---------------------------------------------------------------------------------------------------------


def launch(spec: bench_cache.RunSpec, mem_interval: float) -> dict[str, Any]:
    """Run one configuration like torchrun, sampling memory from outside; returns its measurements."""
    spec_path, env = bench_cache.prepare_run(spec)
    sampler = harness.MemorySampler([], spec.shm_dir, mem_interval)
    try:
        harness.run_ranks(
            [os.path.abspath(__file__), "--rank-spec", spec_path], spec.ranks, spec.run_dir, env,
            on_start=sampler.start,
        )  # fmt: skip
    finally:
        sampler.stop()
    ranks = []
    for r in range(spec.ranks):
        with open(os.path.join(spec.run_dir, f"rank{r}.json")) as f:
            ranks.append(json.load(f))
    n = spec.epochs
    epoch_s = [max(r["epochs"][e]["seconds"] for r in ranks) for e in range(n)]
    cpu = [sum(r["epochs"][e]["cpu"] for r in ranks) for e in range(n)]
    window = (min(r["epochs"][1]["start"] for r in ranks), max(r["epochs"][-1]["end"] for r in ranks))
    computes = bench_cache.read_compute_log(os.path.join(spec.run_dir, "computes.log"))
    return {
        "config": spec.config,
        "ranks": spec.ranks,
        "workers": spec.workers,
        "first_epoch_s": epoch_s[0],
        "first_epoch_cpu_s": cpu[0],
        "warm_epoch_s": sum(epoch_s[1:]) / (n - 1),
        "warm_epoch_cpu_s": (cpu[-1] - cpu[0]) / (n - 1),
        "computes": computes["computes"],
        "one_copy_bytes": next((r["one_copy_bytes"] for r in ranks if r["one_copy_bytes"]), None),
        "manager_items": next((r["manager_items"] for r in ranks if r["manager_items"] is not None), None),
        **sampler.summary(window),
    }


# (title, key, format)
ROWS = (
    ("first epoch, wall (s)", "first_epoch_s", "{:.2f}"),
    ("first epoch, CPU all processes (s)", "first_epoch_cpu_s", "{:.1f}"),
    ("warm epoch, wall (s)", "warm_epoch_s", "{:.2f}"),
    ("warm epoch, CPU all processes (s)", "warm_epoch_cpu_s", "{:.1f}"),
    ("memory above uncached, warm mean (copies)", "copies_warm", "{:.2f}"),
    ("memory above uncached, peak (copies)", "copies_peak", "{:.2f}"),
    ("deterministic transform runs", "computes", "{:.0f}"),
    ("items in the Manager's list", "manager_items", "{:.0f}"),
)


def table(records: list[dict[str, Any]]) -> list[list[str]]:
    """Medians per configuration; ``(x r)``: the median over repeats of the ratio against that repeat's stock run."""
    names = [n for n in CONFIGS if any(r["config"] == n for r in records)]
    repeats = sorted({r["repeat"] for r in records})

    def of(name: str, rep: int) -> dict[str, Any] | None:
        return next((r for r in records if r["config"] == name and r["repeat"] == rep), None)

    body = []
    for title, key, fmt in ROWS:
        row = [title]
        for name in names:
            values = [(of(name, rep) or {}).get(key) for rep in repeats]
            v = harness.median(values)
            cell = "-" if v is None else fmt.format(v)
            bases = [(of(BASELINE, rep) or {}).get(key) for rep in repeats]
            ratios = harness.ratios(values, bases)  # the repeats where both ran and the base is not 0
            if name != BASELINE and ratios:
                cell += f" ({harness.median(ratios):.2f}x)"
            row.append(cell)
        body.append(row)
    return [["", *names], *body]


def add_copies(records: list[dict[str, Any]]) -> None:
    """Memory above the uncached run of the same setting and repeat, in copies of the cached data."""
    copy_bytes = harness.median([r["one_copy_bytes"] for r in records if r["config"] == BASELINE])
    for r in records:
        base = next(
            (b for b in records if b["config"] == "uncached" and (b["ranks"], b["workers"], b["repeat"])
             == (r["ranks"], r["workers"], r["repeat"])), None,
        )  # fmt: skip
        for kind in ("warm", "peak"):
            v, b = r.get(f"mem_{kind}"), base.get(f"mem_{kind}") if base else None
            r[f"copies_{kind}"] = (v - b) / copy_bytes if v is not None and b is not None and copy_bytes else None


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark (or, with ``--rank-spec``, one rank); returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--rank-spec", help=argparse.SUPPRESS)
    parser.add_argument("--items", type=int, default=None, help="volumes (default 24; --quick 8)")
    parser.add_argument("--shape", default=None, help="voxels per volume (default 160x160x96; --quick 64x64x48)")
    parser.add_argument("--epochs", type=int, default=3, help="epochs per run (default 3)")
    parser.add_argument("--repeats", type=int, default=None, help="runs of each configuration (default 2; --quick 1)")
    parser.add_argument(
        "--settings", type=harness.parse_settings, default=[(1, 2), (2, 2)], help="ranks x workers, e.g. 1x2,2x2"
    )
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--mem-interval", type=float, default=0.25)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="8 volumes of 64x64x48, 1 repeat")
    parser.add_argument("--out", default=os.path.join(bench_cache.default_out_dir(), "switch"),
                        help="the runs, and switch.md (what was printed) and switch.json")
    args = parser.parse_args(argv)
    if args.rank_spec:
        rank_main(args.rank_spec)
        return 0
    if args.epochs < 2:
        parser.error("--epochs must be at least 2 (the first fills the cache)")
    items = args.items or (8 if args.quick else 24)
    shape = bench_cache._shape(args.shape) if args.shape else ((64, 64, 48) if args.quick else (160, 160, 96))
    repeats = args.repeats or (1 if args.quick else 2)
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    data_list = bench_cache.prepare_data(os.path.dirname(out), items, shape, args.seed)
    shm_dir = bench_cache.private_shm_dir()
    names = list(CONFIGS)
    records = []
    machine = harness.machine_info()
    t0 = time.perf_counter()
    try:
        for ranks, workers in args.settings:
            for rep in range(repeats):
                for name in harness.rotated(names, rep):
                    spec = bench_cache.RunSpec(
                        config=name, data_list=data_list, run_dir=os.path.join(out, f"{ranks}x{workers}-{name}-{rep}"),
                        shm_dir=shm_dir, ranks=ranks, workers=workers, epochs=args.epochs,
                        batch_size=args.batch_size, spatial_size=crop_size_for(shape), seed=args.seed,
                    )  # fmt: skip
                    print(f"[{ranks}x{workers}] {name} (repeat {rep + 1}/{repeats})", file=sys.stderr, flush=True)
                    records.append({**launch(spec, args.mem_interval), "repeat": rep})
    finally:
        shutil.rmtree(shm_dir, ignore_errors=True)
    add_copies(records)
    copy_bytes = harness.median([r["one_copy_bytes"] for r in records if r["config"] == BASELINE])
    rep = harness.Report("switch")
    rep.machine(machine, at_end=True)
    rep.line(
        f"The segresnet pattern on {items} CT-like volumes of {'x'.join(map(str, shape))}, {args.epochs} epochs, batch "
        f"{args.batch_size}, persistent workers, median of {repeats} repeat(s); one copy of the cached data = "
        f"{(copy_bytes or 0) / _MIB:.0f} MiB; (x r): median of the per-repeat ratios against stock; "
        f"{time.perf_counter() - t0:.0f} s in all.\n" + ", ".join(f"{k}: {v}" for k, v in CONFIGS.items()) + "."
    )
    for ranks, workers in args.settings:
        group = [r for r in records if (r["ranks"], r["workers"]) == (ranks, workers)]
        rep.heading(f"{ranks} rank(s) x {workers} workers")
        rep.table(table(group))
    print(f"results: {rep.save(out, {'machine': machine, 'items': items, 'shape': shape, 'records': records})}",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
