#!/usr/bin/env python
"""SmartCacheDataset: stock MONAI against monai_cache, side by side in the same run: epoch time, CPU and memory.

Ranks are started as independent processes with torchrun's environment (gloo on CPU), each with a DataLoader over
a ``DistributedSampler`` of the dataset and ``update_cache()`` at the end of every epoch, as
``monai.handlers.SmartCacheHandler`` does. The data are synthetic CT-like NIfTI volumes and the chain is the
tutorial's (:mod:`monai_cache.synthetic`), with a counting transform first so that the deterministic work is
counted, not estimated. Each configuration runs ``--repeats`` times, alternating, and the table gives medians with
the ratio monai_cache / MONAI:

* time to build the dataset (the first window cached), wall and CPU of all processes;
* epoch time (every epoch, ``update_cache()`` included; median over epochs and repeats), wall and CPU of all
  processes (each rank with its DataLoader workers and its replacement thread);
* memory of all processes together, sampled from outside (``harness.MemorySampler``): the PSS of every process
  (shared pages split among the processes mapping them, so each is counted once) plus the part of monai_cache's
  shared-memory files that no process maps; mean over the epochs, and peak;
* the bytes of cached items held on the machine once the epochs are over (MONAI: every rank's cache list and
  next replacements, summed over the ranks; monai_cache: its shared-memory store, once per machine);
* how many times the deterministic transforms ran.

Usage::

    python -m benchmarks smartcache                # 32 volumes of 128x128x80, cache 16, 5 epochs, 3 repeats
    python -m benchmarks smartcache --quick        # about a minute on an idle 2-core machine
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import harness  # the launcher and memory sampler the benchmarks share (its neighbour here)

CONFIGS = ("monai", "monai-cache")
_MIB = 1 << 20


# ---------------------------------------------------------------------------------------------- one rank
def rank_main(spec_path: str) -> None:
    import torch
    import torch.distributed as dist
    from monai.data import DataLoader
    from monai.transforms import Transform
    from torch.utils.data.distributed import DistributedSampler

    from monai_cache.codec import item_nbytes
    from monai_cache.synthetic import crop_size_for, tutorial_transforms

    with open(spec_path) as f:
        spec = json.load(f)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    class CountRuns(Transform):  # a Transform, so deterministic: cached with the rest
        """One line per item it sees, so that the deterministic work is counted."""

        def __call__(self, data: Mapping[Hashable, Any]) -> dict:
            fd = os.open(spec["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                os.write(fd, b"1\n")
            finally:
                os.close(fd)
            return dict(data)

    transform = tutorial_transforms(crop_size_for(spec["shape"]), num_samples=2, before=[CountRuns()])
    if spec["config"] == "monai":
        from monai.data import SmartCacheDataset
    else:
        from monai_cache import SmartCacheDataset
    kw = dict(replace_rate=spec["replace_rate"], cache_num=spec["cache_num"], seed=0, progress=False)
    dist.barrier()
    t0, c0 = time.time(), harness.own_cpu_seconds()
    ds = SmartCacheDataset(spec["data"], transform, **kw)
    init = (time.time() - t0, harness.own_cpu_seconds() - c0)
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(ds, batch_size=2, sampler=sampler, num_workers=spec["workers"])
    ds.start()
    dist.barrier()
    epochs, started = [], time.time()
    for epoch in range(spec["epochs"]):
        sampler.set_epoch(epoch)
        t, c = time.time(), harness.own_cpu_seconds()
        for batch in loader:
            total = batch["image"].float().mean().reshape(1)
            dist.all_reduce(total)  # ranks in lockstep, as in training
        ds.update_cache()
        epochs.append((time.time() - t, harness.own_cpu_seconds() - c))
    ended = time.time()
    ds.shutdown()  # waits for the next replacements: what the cache holds is settled
    if spec["config"] == "monai":  # this rank's own copies: its cache list and the next replacements
        held = sum(item_nbytes(item) for item in [*ds._cache, *ds._replacements] if item is not None)
    else:  # the machine's one copy
        held = ds.cache_stats()["stored"]["bytes"]
    result = {"rank": rank, "init": init, "epochs": epochs, "started": started, "ended": ended, "held": held}
    with open(spec["result"].format(rank=rank), "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------- launcher
def run_config(config: str, args: argparse.Namespace, data: list, work: str) -> dict[str, Any]:
    """Start the ranks of one run as torchrun does, sample their memory, and collect what they measured."""
    run_dir = os.path.join(work, f"{config}-{uuid.uuid4().hex[:6]}")
    os.makedirs(run_dir)
    shm_dir = tempfile.mkdtemp(prefix="mc-bench-smartcache-", dir="/dev/shm")  # this run's caches only
    spec = {
        "config": config, "data": data, "shape": args.shape, "cache_num": args.cache_num,
        "replace_rate": args.replace_rate, "workers": args.workers, "epochs": args.epochs,
        "log": os.path.join(run_dir, "runs.log"), "result": os.path.join(run_dir, "rank{rank}.json"),
    }  # fmt: skip
    spec_path = os.path.join(run_dir, "spec.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    env = dict(os.environ, MONAI_CACHE_SHM_DIR=shm_dir)
    memory = harness.MemorySampler([], shm_dir, args.mem_interval)
    try:
        harness.run_ranks([os.path.abspath(__file__), "--rank-spec", spec_path], args.ranks, run_dir, env,
                          args.timeout, on_start=memory.start)
    except RuntimeError as e:
        raise RuntimeError(f"{config}: {e}") from None
    finally:
        memory.stop()
        shutil.rmtree(shm_dir, ignore_errors=True)
    ranks = []
    for rank in range(args.ranks):
        with open(spec["result"].format(rank=rank)) as f:
            ranks.append(json.load(f))
    mem = memory.summary((max(r["started"] for r in ranks), min(r["ended"] for r in ranks)))
    with open(spec["log"]) as f:
        runs = sum(1 for _ in f)
    shutil.rmtree(run_dir, ignore_errors=True)
    return {
        "config": config,
        "init_s": max(r["init"][0] for r in ranks),
        "init_cpu_s": sum(r["init"][1] for r in ranks),
        # epoch e of the run lasts as long as its slowest rank; CPU adds up over the ranks (and their workers)
        "epoch_s": [max(r["epochs"][e][0] for r in ranks) for e in range(args.epochs)],
        "epoch_cpu_s": [sum(r["epochs"][e][1] for r in ranks) for e in range(args.epochs)],
        "held": sum(r["held"] for r in ranks) if config == "monai" else max(r["held"] for r in ranks),
        "mem_mean": mem["mem_warm"],  # over the epochs
        "mem_peak": mem["mem_peak"],
        "deterministic_runs": runs,
    }


def summarize(records: list[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    out: dict[str, dict[str, float | None]] = {}
    for config in CONFIGS:
        mine = [r for r in records if r["config"] == config]
        med = harness.median
        out[config] = {
            "init_s": med([r["init_s"] for r in mine]),
            "init_cpu_s": med([r["init_cpu_s"] for r in mine]),
            "epoch_s": med([e for r in mine for e in r["epoch_s"]]),
            "epoch_cpu_s": med([e for r in mine for e in r["epoch_cpu_s"]]),
            "held_mib": med([r["held"] / _MIB for r in mine]),
            "mem_mean_mib": med([r["mem_mean"] / _MIB if r["mem_mean"] else None for r in mine]),
            "mem_peak_mib": med([r["mem_peak"] / _MIB if r["mem_peak"] else None for r in mine]),
            "deterministic_runs": med([r["deterministic_runs"] for r in mine]),
        }
    return out


ROWS = (
    ("build the dataset (first window), wall (s)", "init_s", "{:.1f}"),
    ("build the dataset, CPU all processes (s)", "init_cpu_s", "{:.1f}"),
    ("epoch incl. update_cache(), wall (s)", "epoch_s", "{:.2f}"),
    ("epoch incl. update_cache(), CPU all processes (s)", "epoch_cpu_s", "{:.1f}"),
    ("cached items held on the machine at the end (MiB)", "held_mib", "{:.0f}"),
    ("memory, mean over the epochs (MiB)", "mem_mean_mib", "{:.0f}"),
    ("memory, peak (MiB)", "mem_peak_mib", "{:.0f}"),
    ("deterministic transform runs", "deterministic_runs", "{:.0f}"),
)


def table(summary: dict[str, dict[str, float | None]]) -> list[list[str]]:
    rows = [["", "MONAI SmartCacheDataset", "monai_cache SmartCacheDataset", "ratio (ours / MONAI)"]]
    for title, key, fmt in ROWS:
        a, b = summary["monai"][key], summary["monai-cache"][key]
        cell = [fmt.format(v) if v is not None else "n/a" for v in (a, b)]
        ratio = f"{b / a:.2f}" if a and b is not None else "n/a"
        rows.append([title, cell[0], cell[1], ratio])
    return rows


def _shape(text: str) -> list[int]:
    parts = [int(p) for p in text.lower().split("x")]
    if len(parts) != 3:
        raise argparse.ArgumentTypeError(f"a shape looks like 128x128x80, got {text!r}")
    return parts


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="12 volumes of 64x64x48, cache 6, 4 epochs, 2 repeats")
    parser.add_argument("--items", type=int, default=None, help="volumes (default 32; --quick 12)")
    parser.add_argument("--shape", type=_shape, default=None, help="voxels per volume (default 128x128x80)")
    parser.add_argument("--cache-num", type=int, default=None, help="cached items (default 16; --quick 6)")
    parser.add_argument("--replace-rate", type=float, default=0.25)
    parser.add_argument("--epochs", type=int, default=None, help="epochs per run (default 5; --quick 4)")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--workers", type=int, default=None, help="DataLoader workers per rank (default 2; --quick 1)")
    parser.add_argument("--repeats", type=int, default=None, help="runs of each configuration (default 3; --quick 2)")
    parser.add_argument("--mem-interval", type=float, default=0.5, help="seconds between memory samples")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds a run may take")
    parser.add_argument("--out", default=None, help="write smartcache.md (what was printed) and smartcache.json here")
    parser.add_argument("--rank-spec", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank_spec:
        rank_main(args.rank_spec)
        return 0
    args.items = args.items or (12 if args.quick else 32)
    args.shape = args.shape or ([64, 64, 48] if args.quick else [128, 128, 80])
    args.cache_num = args.cache_num or (6 if args.quick else 16)
    args.epochs = args.epochs or (4 if args.quick else 5)
    args.workers = args.workers if args.workers is not None else (1 if args.quick else 2)
    args.repeats = args.repeats or (2 if args.quick else 3)

    from monai_cache.synthetic import make_dataset

    machine = harness.machine_info()
    rep = harness.Report("smartcache")
    rep.machine(machine)
    t0 = time.perf_counter()
    work = tempfile.mkdtemp(prefix="monai-cache-bench-smartcache-")
    records = []
    try:
        data = make_dataset(os.path.join(work, "data"), args.items, args.shape)
        for repeat in range(args.repeats):
            for config in CONFIGS if repeat % 2 == 0 else CONFIGS[::-1]:  # alternate: drift spreads over both
                records.append(run_config(config, args, data, work))
                rep.line(f"  {config}: epochs {', '.join(f'{s:.2f}' for s in records[-1]['epoch_s'])} s")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    summary = summarize(records)
    machine["loadavg_end"] = list(os.getloadavg())
    rep.line(
        f"{args.items} volumes of {'x'.join(map(str, args.shape))}, cache_num {args.cache_num}, replace_rate "
        f"{args.replace_rate}, {args.ranks} ranks x {args.workers} DataLoader workers, {args.epochs} epochs, median of "
        f"{args.repeats} repeat(s); {time.perf_counter() - t0:.0f} s in all"
    )
    rep.table(table(summary))
    if args.out:
        rep.save(args.out, {"machine": machine, "args": vars(args), "records": records, "summary": summary})
    return 0


if __name__ == "__main__":
    sys.exit(main())
