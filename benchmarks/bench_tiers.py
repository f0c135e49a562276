"""The two tiers against MONAI, side by side in one run: 2 ranks started like torchrun.

Usage::

    python -m benchmarks tiers                # 12 volumes of 160x160x96, 4 epochs, median of 3 (about 150 s on 2 cores)
    python -m benchmarks tiers --quick        # 4 volumes of 64x64x48, 3 epochs, 1 repeat

Two questions, on the tutorial chain of ``monai_cache.synthetic`` (the deterministic part cached, two random
crops per item on every read), with a ``monai.data.DataLoader`` of ``--workers`` workers per rank and a
``DistributedSampler`` (a different half of the items on each rank every epoch, as in stock DDP training):

1. **A shared-memory tier in front of the disk cache** (``persistent``): ``monai.data.PersistentDataset`` (the
   baseline), ``monai_cache.PersistentDataset`` and ``monai_cache.PersistentDataset(shm_cache=True)``, each on an
   empty cache directory. Epoch 1 fills the cache; later epochs are warm (the disk files are then in the page
   cache, as on a node that has read them once: the tier saves the read and the decompression, not a disk seek).
   Memory is that of all processes together (PSS) plus the shared-memory files; the page cache is not counted.
2. **A restart of ``CacheDataset(cache_dir=...)``** (``restart``): MONAI's ``CacheDataset`` (computes every item
   before the first batch; the baseline), ours on an empty cache directory (a cold start, which also writes the
   disk tier), then ours again on that directory with an empty shared-memory directory, as after a reboot or on
   another node: it fills shared memory from disk instead of computing.

Times are the slowest rank's; CPU is that of both ranks and their workers; each figure is the median of
``--repeats`` repeats, interleaved so that a shared machine's drift hits every configuration alike. Ratios
are against the MONAI baseline of the same question, in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import harness

QUESTIONS: dict[str, dict[str, str]] = {
    "persistent": {
        "monai": "monai.data.PersistentDataset",
        "ours-disk": "monai_cache.PersistentDataset",
        "ours-tiered": "monai_cache.PersistentDataset(shm_cache=True)",
    },
    "restart": {
        "monai": "monai.data.CacheDataset",
        "ours-cold": "monai_cache.CacheDataset(cache_dir=...), empty directory",
        "ours-restart": "monai_cache.CacheDataset(cache_dir=...), restarted on it, shared memory empty",
    },
}
BASELINE = "monai"
_MIB = 1 << 20


# ---------------------------------------------------------------------------------------------------------
# Inside the ranks
# ---------------------------------------------------------------------------------------------------------
def _dataset(question: str, config: str, files: list[dict], transform: Any, cache_dir: str) -> Any:
    import monai.data

    import monai_cache

    if question == "persistent":
        if config == "monai":
            return monai.data.PersistentDataset(files, transform, cache_dir)
        return monai_cache.PersistentDataset(files, transform, cache_dir, shm_cache=config == "ours-tiered")
    if config == "monai":
        return monai.data.CacheDataset(files, transform, progress=False)
    return monai_cache.CacheDataset(files, transform, progress=False, cache_dir=cache_dir)


def rank_main(spec_path: str) -> None:
    """One rank: build the dataset, run the epochs, write ``rank<r>.json`` next to the spec."""
    import torch
    import torch.distributed as dist
    from monai.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    from monai_cache.synthetic import tutorial_transforms

    with open(spec_path) as f:
        spec = json.load(f)
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    torch.manual_seed(spec["seed"] + rank)
    with open(spec["data_list"]) as f:
        files = json.load(f)
    transform = tutorial_transforms(spatial_size=spec["crop"])
    dist.barrier()  # the clock starts when every rank is ready to build
    start, cpu0 = time.perf_counter(), harness.own_cpu_seconds()
    dataset = _dataset(spec["question"], spec["config"], files, transform, spec["cache_dir"])
    sampler = DistributedSampler(dataset, shuffle=True, seed=spec["seed"])
    loader = DataLoader(dataset, batch_size=spec["batch_size"], sampler=sampler, num_workers=spec["workers"])
    first_batch = None
    epochs = []
    for epoch in range(spec["epochs"]):
        sampler.set_epoch(epoch)
        t0, c0, w0 = time.perf_counter(), harness.own_cpu_seconds(), time.time()
        for batch in loader:
            if first_batch is None:
                first_batch = time.perf_counter() - start
            total = torch.tensor([float(batch["image"].sum())])  # stands for a training step
            dist.all_reduce(total)
        cpu = harness.own_cpu_seconds() - c0
        epochs.append({"seconds": time.perf_counter() - t0, "cpu": cpu, "start": w0, "end": time.time()})
    flush = getattr(dataset, "flush", None)
    t0 = time.perf_counter()
    if flush is not None:
        flush()  # the disk tier complete before the next run reads it (not counted in the epochs)
    flush_s = time.perf_counter() - t0
    dist.barrier()  # nobody releases a shared cache before everyone is done
    cpu_total = harness.own_cpu_seconds() - cpu0
    result = {"first_batch_s": first_batch, "epochs": epochs, "flush_s": flush_s, "cpu_total": cpu_total}
    with open(os.path.join(os.path.dirname(spec_path), f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------------------
# The launcher
# ---------------------------------------------------------------------------------------------------------
def run_config(spec: dict[str, Any], run_dir: str, shm_dir: str, ranks: int) -> dict[str, Any]:
    """Run one configuration as ``ranks`` ranks; its measurements summed (CPU) or the slowest rank's (time)."""
    shutil.rmtree(run_dir, ignore_errors=True)
    os.makedirs(run_dir)
    spec_path = os.path.join(run_dir, "spec.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    env = dict(os.environ, MONAI_CACHE_SHM_DIR=shm_dir)
    env.setdefault("PYTHONWARNINGS", "ignore")
    memory = harness.MemorySampler([], shm_dir, 0.1 if spec["quick"] else 0.25)  # quick: warm epochs are short
    try:
        harness.run_ranks([os.path.abspath(__file__), "--rank-spec", spec_path], ranks, run_dir, env,
                          on_start=memory.start)
    finally:
        memory.stop()
    results = []
    for r in range(ranks):
        with open(os.path.join(run_dir, f"rank{r}.json")) as f:
            results.append(json.load(f))
    warm = range(1, spec["epochs"])
    window = (min(r["epochs"][1]["start"] for r in results), max(r["epochs"][-1]["end"] for r in results))
    mem = memory.summary(window)
    return {
        "first_batch_s": max(r["first_batch_s"] for r in results),
        "first_epoch_s": max(r["epochs"][0]["seconds"] for r in results),
        "first_epoch_cpu": sum(r["epochs"][0]["cpu"] for r in results),
        "warm_epoch_s": max(sum(r["epochs"][e]["seconds"] for e in warm) / len(warm) for r in results),
        "warm_epoch_cpu": sum(sum(r["epochs"][e]["cpu"] for e in warm) / len(warm) for r in results),
        "mem_peak": mem["mem_peak"],
        "mem_warm": mem["mem_warm"],
        "flush_s": max(r["flush_s"] for r in results),
    }


def run_all(args: argparse.Namespace, data_list: str, crop: Sequence[int], work: str,
            rep: harness.Report) -> dict[str, Any]:
    """Every question's configurations, ``args.repeats`` times, interleaved, each run's line printed through ``rep``
    as it ends; ``{question: {config: [runs]}}``."""
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {q: {c: [] for c in QUESTIONS[q]} for q in args.questions}
    base = os.environ.get("MONAI_CACHE_SHM_DIR") or "/dev/shm"
    for repeat in range(args.repeats):
        for question in args.questions:
            disk_of_cold = None
            for config in QUESTIONS[question]:
                cache_dir = disk_of_cold if config == "ours-restart" else os.path.join(work, "disk", question, config)
                if config != "ours-restart":
                    shutil.rmtree(cache_dir, ignore_errors=True)
                    os.makedirs(cache_dir)
                if config == "ours-cold":
                    disk_of_cold = cache_dir
                shm_dir = tempfile.mkdtemp(prefix="monai_cache-bench-tiers-", dir=base)  # empty: as after a boot
                spec = {
                    "question": question, "config": config, "data_list": data_list, "cache_dir": cache_dir,
                    "epochs": args.epochs, "workers": args.workers, "batch_size": args.batch_size,
                    "crop": list(crop), "seed": args.seed, "quick": args.quick,
                }
                try:
                    result = run_config(spec, os.path.join(work, "runs", question, config), shm_dir, args.ranks)
                finally:
                    shutil.rmtree(shm_dir, ignore_errors=True)
                runs[question][config].append(result)
                rep.line(f"  repeat {repeat + 1}/{args.repeats} {question:10s} {config:13s} first batch "
                         f"{result['first_batch_s']:.2f} s, warm epoch {result['warm_epoch_s']:.2f} s")
    return runs


_ROWS = (
    ("time to first batch, wall (s)", "first_batch_s", 1.0, "{:.2f}"),
    ("first epoch, wall (s)", "first_epoch_s", 1.0, "{:.2f}"),
    ("first epoch, CPU both ranks (s)", "first_epoch_cpu", 1.0, "{:.2f}"),
    ("warm epoch, wall (s)", "warm_epoch_s", 1.0, "{:.2f}"),
    ("warm epoch, CPU both ranks (s)", "warm_epoch_cpu", 1.0, "{:.2f}"),
    ("memory in warm epochs (MiB)", "mem_warm", _MIB, "{:.0f}"),
    ("memory, peak (MiB)", "mem_peak", _MIB, "{:.0f}"),
)


def table(question: str, runs: dict[str, list[dict[str, Any]]]) -> list[list[str]]:
    """Rows of medians, each with its ratio against the baseline: ``[[label, monai, ours..., ], ...]``."""
    rows = [["", *runs]]
    for label, key, scale, fmt in _ROWS:
        medians = {c: harness.median(r[key] for r in rs) for c, rs in runs.items()}
        base = medians.get(BASELINE)
        row = [label]
        for config, value in medians.items():
            if value is None:
                row.append("-")
                continue
            text = fmt.format(value / scale)
            if config != BASELINE and base:
                text += f" ({value / base:.2f}x)"
            row.append(text)
        rows.append(row)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rank-spec", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="4 volumes of 64x64x48, 3 epochs, 1 repeat")
    parser.add_argument("--items", type=int)
    parser.add_argument("--shape", type=lambda s: tuple(int(v) for v in s.split("x")), help="e.g. 160x160x96")
    parser.add_argument("--epochs", type=int)
    parser.add_argument("--repeats", type=int)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--workers", type=int, default=1, help="DataLoader workers per rank (default 1)")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--questions", type=lambda s: s.split(","), default=list(QUESTIONS),
                        help=f"comma-separated, of {','.join(QUESTIONS)}")
    parser.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "monai-cache-bench-tiers"),
                        help="the data, the caches, and tiers.md (what was printed) and tiers.json (the raw runs)")
    args = parser.parse_args(argv)
    if args.rank_spec:
        rank_main(args.rank_spec)
        return 0
    if unknown := [q for q in args.questions if q not in QUESTIONS]:
        parser.error(f"unknown question(s) {unknown}")
    items = args.items or (4 if args.quick else 12)
    shape = args.shape or ((64, 64, 48) if args.quick else (160, 160, 96))
    args.epochs = args.epochs or (3 if args.quick else 4)
    args.repeats = args.repeats or (1 if args.quick else 3)
    if args.epochs < 2:
        parser.error("--epochs must be at least 2 (the first fills the cache)")

    from monai_cache.synthetic import crop_size_for, make_dataset

    data_dir = os.path.join(args.out, "data", f"ct-{'x'.join(map(str, shape))}-seed{args.seed}")
    files = make_dataset(data_dir, items=items, shape=shape, seed=args.seed)
    data_list = os.path.join(args.out, f"datalist-{items}.json")
    with open(data_list, "w") as f:
        json.dump(files, f)
    crop = crop_size_for(shape)
    machine = harness.machine_info()
    rep = harness.Report("tiers")
    rep.machine(machine)
    rep.line(f"{items} volumes of {'x'.join(map(str, shape))}, {args.ranks} ranks x {args.workers} worker(s), batch "
             f"{args.batch_size}, {args.epochs} epochs (warm: 2..{args.epochs}), median of {args.repeats}; ratios "
             f"against `{BASELINE}` in the same run")
    runs = run_all(args, data_list, crop, args.out, rep)
    titles = {"persistent": "PersistentDataset with and without the shared-memory tier",
              "restart": "CacheDataset(cache_dir=...): a restart against a cold start"}
    for question, by_config in runs.items():
        rep.heading(titles[question])
        rep.line(", ".join(f"{c}: {QUESTIONS[question][c]}" for c in by_config) + ".")
        rep.table(table(question, by_config))
        if question == "restart":
            cold, warm = (
                harness.median(r["first_batch_s"] for r in by_config[c]) for c in ("ours-cold", "ours-restart")
            )
            if cold and warm:
                rep.line(f"A restart reaches its first batch in {warm / cold:.2f}x the time of our cold start.")
    machine["loadavg_end"] = list(os.getloadavg())
    rep.line(f"\nLoad average at the end: {machine['loadavg_end'][0]:.1f}.")
    rep.save(args.out, {"machine": machine, "items": items, "shape": shape, "runs": runs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
