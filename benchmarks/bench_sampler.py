"""Benchmark: cache hit rate, epoch time, coverage and batch mixing of ShardedDistributedSampler.

Run ``python -m benchmarks sampler [--quick] [--out DIR]``. Not a timed test; it prints tables (``--out``:
``sampler.md`` as printed and ``sampler.json``).

1. A 2-rank run (gloo, each rank an independent process started like torchrun starts it). Each rank keeps a
   private cache of what one rank can afford (``ceil(n / 2)`` items, first come first kept); a miss costs a fixed,
   deterministic numpy computation. Compared: torch's ``DistributedSampler``, VisCy's sharded scheme
   (re-implemented below from its description) and this package's sampler. Reported: hit rate per epoch, wall and
   CPU seconds per epoch, medians over repeats, ratios against torch measured in the same run.
2. Coverage over several epochs when the length does not divide by the world size (computed from the samplers).
3. Batch mixing for 4 simulated ranks, 2 per node: the share of all item pairs that ever meet in a per-rank batch.
4. The world-size-independent order (``canonical_shards``) against the default order on 1, 2, 4 and 8 ranks:
   whether the global order is the same as on one rank, the fill, the hit rate of warm epochs, global-batch mixing.
5. An epoch interrupted on 2 nodes and taken up by 1: resumed on the new layout, restarted, or skipped.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DistributedSampler

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import harness  # noqa: E402  # the benchmarks' shared helpers (its neighbour here)

from monai_cache.sampler import ShardedDistributedSampler  # noqa: E402

SAMPLERS = ("torch", "viscy", "sharded", "canonical")
CANONICAL = 8  # canonical_shards of the world-size-independent order: every world size here divides it


class VisCyStyleSampler(DistributedSampler):
    """VisCy's ``ShardedDistributedSampler`` scheme, re-implemented from its description.

    ``num_samples`` (torch's: ``ceil`` of ``n / world``, or ``floor`` with ``drop_last``) consecutive indices
    per rank, shard ``i`` starting at ``min(i * num_samples, n - num_samples)``: when the length does not
    divide, the last shard overlaps the one before (the same items read twice every epoch), and with
    ``drop_last=True`` the tail past ``world * num_samples`` is never read. Each epoch every shard is shuffled
    with a generator seeded by ``seed + epoch``.
    """

    def __iter__(self) -> Iterator[int]:
        n = len(self.dataset)  # type: ignore[arg-type]
        size = self.num_samples
        gen = torch.Generator()
        gen.manual_seed(self.seed + self.epoch)
        perms = [
            torch.randperm(size, generator=gen) if self.shuffle else torch.arange(size)
            for _ in range(self.num_replicas)
        ]
        start = min(self.rank * size, n - size)
        return iter((perms[self.rank] + start).tolist())


def make_sampler(kind: str, n: int, world: int | None, rank: int | None, **kw) -> DistributedSampler:
    data = range(n)
    if kind == "torch":
        return DistributedSampler(data, world, rank, **kw)
    if kind == "viscy":
        return VisCyStyleSampler(data, world, rank, **kw)
    if kind == "sharded":
        return ShardedDistributedSampler(data, world, rank, **kw)
    if kind == "sharded_node":
        return ShardedDistributedSampler(data, world, rank, shard_by="node", local_world_size=2, **kw)
    if kind == "canonical":
        return ShardedDistributedSampler(data, world, rank, canonical_shards=CANONICAL, **kw)
    raise ValueError(kind)


# ----------------------------------------------------------------------------- 2-rank gloo run (worker side)


def miss_work(i: int, elems: int) -> float:
    """A deterministic numpy computation standing in for loading + transforming one item."""
    x = np.arange(elems, dtype=np.float64) * (1.0 + i * 1e-6)
    return float(np.sqrt(x).sum() + np.sin(x[: elems // 4]).sum())


def worker(cfg: dict) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    world, rank = dist.get_world_size(), dist.get_rank()
    n, epochs, batch, elems = cfg["n_items"], cfg["epochs"], cfg["batch_size"], cfg["miss_elems"]
    capacity = math.ceil(n / world)
    rows = []
    for repeat in range(cfg["repeats"]):
        # rotate the order of the samplers between repeats, so none always runs first
        for kind in harness.rotated(SAMPLERS, repeat):
            sampler = make_sampler(kind, n, None, None, seed=repeat)  # world / rank from the process group
            cache: dict[int, float] = {}
            for epoch in range(epochs):
                sampler.set_epoch(epoch)
                hits = misses = 0
                dist.barrier()
                t0, c0 = time.perf_counter(), time.process_time()
                indices = list(sampler)
                for step in range(0, len(indices), batch):
                    for i in indices[step : step + batch]:
                        if i in cache:
                            hits += 1
                        else:
                            misses += 1
                            value = miss_work(i, elems)
                            if len(cache) < capacity:
                                cache[i] = value
                    dist.all_reduce(torch.ones(1))  # the gradient all-reduce of a training step: lockstep
                wall, cpu = time.perf_counter() - t0, time.process_time() - c0
                t = torch.tensor([wall, cpu, hits, misses], dtype=torch.float64)
                tmax = t.clone()
                dist.all_reduce(t)  # sums: CPU of both ranks, hits, misses
                dist.all_reduce(tmax, op=dist.ReduceOp.MAX)  # the epoch lasts as long as its slowest rank
                rows.append({"repeat": repeat, "sampler": kind, "epoch": epoch, "wall": float(tmax[0]),
                             "cpu": float(t[1]), "hits": int(t[2]), "misses": int(t[3])})  # fmt: skip
    if rank == 0:
        with open(cfg["out"], "w") as f:
            json.dump(rows, f)
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- coordinator side


def run_gloo(cfg: dict, world: int = 2, timeout: float = 900.0) -> list[dict]:
    """The 2-rank run: ``world`` ranks started like torchrun (gloo), rank 0's rows."""
    with tempfile.TemporaryDirectory() as tmp:
        cfg = {**cfg, "out": os.path.join(tmp, "rows.json")}
        harness.run_ranks([os.path.abspath(__file__), "--worker", json.dumps(cfg)], world, tmp, timeout=timeout)
        with open(cfg["out"]) as f:
            return json.load(f)


def report_gloo(rep: harness.Report, rows: list[dict], cfg: dict, miss_ms: float) -> None:
    epochs, repeats = cfg["epochs"], cfg["repeats"]
    n = cfg["n_items"]
    rep.heading(
        f"1. Two ranks (gloo, independent processes), {n} items, per-rank cache of {math.ceil(n / 2)} items, "
        f"miss = {miss_ms:.1f} ms of numpy; medians of {repeats} repeats"
    )

    def pick(kind, epoch, key):
        return harness.median(r[key] for r in rows if r["sampler"] == kind and r["epoch"] == epoch)

    def rate(kind, epoch):
        return harness.median(
            r["hits"] / (r["hits"] + r["misses"]) for r in rows if r["sampler"] == kind and r["epoch"] == epoch
        )

    steady = range(1, epochs)
    table = [["sampler", *(f"hit e{e}" for e in range(epochs)), "hit e>=1", "vs torch"]]
    torch_steady = statistics.mean(rate("torch", e) for e in steady)
    for kind in SAMPLERS:
        s = statistics.mean(rate(kind, e) for e in steady)
        table.append([kind, *(f"{rate(kind, e):.0%}" for e in range(epochs)), f"{s:.0%}", f"{s / torch_steady:.2f}x"])
    rep.table(table)
    table = [["sampler", "wall s, e0", "CPU s, e0", "wall s/epoch, e>=1", "CPU s/epoch, e>=1 (both ranks)",
              "wall vs torch", "CPU vs torch"]]

    def steady_median(kind, key):
        # per repeat: mean over the steady epochs; then the median over repeats
        per_rep = [
            statistics.mean(r[key] for r in rows if r["sampler"] == kind and r["repeat"] == rep and r["epoch"] >= 1)
            for rep in range(repeats)
        ]
        return harness.median(per_rep)

    tw, tc = steady_median("torch", "wall"), steady_median("torch", "cpu")
    for kind in SAMPLERS:
        w, c = steady_median(kind, "wall"), steady_median(kind, "cpu")
        table.append([kind, f"{pick(kind, 0, 'wall'):.3f}", f"{pick(kind, 0, 'cpu'):.3f}", f"{w:.3f}", f"{c:.3f}",
                      f"{w / tw:.2f}x", f"{c / tc:.2f}x"])
    rep.line()
    rep.table(table)


def report_coverage(rep: harness.Report, n: int, world: int, epochs: int) -> None:
    rep.heading(f"2. Coverage over {epochs} epochs, {n} items on {world} ranks (not divisible), computed from the "
                "samplers")
    capacity = math.ceil(n / world)
    table = [["sampler", "drop_last", "never read", "read twice in every epoch",
              f"cache miss rate e>=1 (per-rank cache of {capacity} items)"]]
    for drop_last, kind in itertools.product((False, True), SAMPLERS):
        ss = [make_sampler(kind, n, world, r, drop_last=drop_last) for r in range(world)]
        caches: list[set[int]] = [set() for _ in range(world)]
        seen: set[int] = set()
        dup_every = set(range(n))
        misses = reads_after_first = 0
        for e in range(epochs):
            reads = []
            for s in ss:
                s.set_epoch(e)
                reads.append(list(s))
            counts = Counter(i for r in reads for i in r)
            seen |= set(counts)
            dup_every &= {i for i, c in counts.items() if c > 1}
            for cache, r in zip(caches, reads):
                for i in r:
                    if i not in cache:
                        misses += e > 0
                        if len(cache) < capacity:
                            cache.add(i)
                reads_after_first += len(r) * (e > 0)
        miss_rate = misses / reads_after_first
        table.append([kind, str(drop_last), str(n - len(seen)), str(len(dup_every)), f"{miss_rate:.1%}"])
    rep.table(table, left=2)


def report_mixing(rep: harness.Report, n: int, batch: int, epochs: int, world: int = 4) -> None:
    rep.heading(f"3. Batch mixing, {world} simulated ranks (2 per node), {n} items, batch {batch} per rank, {epochs} "
                "epochs: share of all item pairs that ever meet in a batch")
    table = [["sampler", "per-rank batch: pairs met", "share of all pairs", "vs torch",
              "ceiling (pairs within a shard)", "global batch (all ranks, one step): share"]]
    all_pairs = n * (n - 1) // 2
    results = {}
    for kind in ("torch", "sharded", "sharded_node", "canonical"):
        ss = [make_sampler(kind, n, world, r) for r in range(world)]
        local: set[tuple[int, int]] = set()
        glob: set[tuple[int, int]] = set()
        for e in range(epochs):
            per_rank = []
            for s in ss:
                s.set_epoch(e)
                per_rank.append(list(s))
            for b in range(0, len(per_rank[0]), batch):
                step = [sorted(set(idx[b : b + batch])) for idx in per_rank]
                for items in step:
                    local.update(itertools.combinations(items, 2))
                glob.update(itertools.combinations(sorted(set().union(*step)), 2))
        if kind == "torch":
            ceiling = all_pairs
        else:
            shards = {tuple(s.shard_indices()) for s in ss}
            ceiling = sum(len(sh) * (len(sh) - 1) // 2 for sh in shards)
        results[kind] = (len(local), ceiling, len(glob))
    for kind, (count, ceiling, glob_count) in results.items():
        label = {"sharded": "sharded, shard_by='rank'", "sharded_node": "sharded, shard_by='node'",
                 "canonical": f"sharded, canonical_shards={CANONICAL}"}.get(kind, kind)  # fmt: skip
        table.append([label, str(count), f"{count / all_pairs:.1%}", f"{count / results['torch'][0]:.2f}x",
                      f"{ceiling / all_pairs:.0%}", f"{glob_count / all_pairs:.1%}"])
    rep.table(table)


def _reads(samplers, epoch: int) -> list[list[int]]:
    out = []
    for s in samplers:
        s.set_epoch(epoch)
        out.append(list(s))
    return out


def _global_order(reads: list[list[int]]) -> list[int]:
    return [r[j] for j in range(max(map(len, reads))) for r in reads if j < len(r)]


def report_world_sizes(rep: harness.Report, n: int, epochs: int, global_batch: int) -> None:
    """The world-size-independent order against the default one on 1 to 8 ranks: order, hits, fill, mixing."""
    rep.heading(
        f"4. World sizes 1, 2, 4, 8: the default order against canonical_shards={CANONICAL}; {n} items, "
        f"{epochs} epochs, per-rank cache of ceil({n} / world) items, global batch {global_batch} "
        "(computed from the samplers)"
    )
    table = [["order", "world", "same global order as 1 rank (epochs)", "items computed, e0 (fill)", "hit rate e>=1",
              "global-batch pairs met (share of all)", f"the same, global batch {global_batch // 4}"]]
    all_pairs = n * (n - 1) // 2
    for kind in ("sharded", "canonical"):
        reference = [_global_order(_reads([make_sampler(kind, n, 1, 0)], e)) for e in range(epochs)]
        for world in (1, 2, 4, 8):
            ss = [make_sampler(kind, n, world, r) for r in range(world)]
            caches: list[set[int]] = [set() for _ in range(world)]
            same = computed0 = hits = reads_after = 0
            pairs: set[tuple[int, int]] = set()
            small: set[tuple[int, int]] = set()  # a global batch smaller than canonical_shards
            for e in range(epochs):
                reads = _reads(ss, e)
                order = _global_order(reads)
                same += order == reference[e]
                for step in range(0, len(order), global_batch):
                    pairs.update(itertools.combinations(sorted(set(order[step : step + global_batch])), 2))
                for step in range(0, len(order), global_batch // 4):
                    small.update(itertools.combinations(sorted(set(order[step : step + global_batch // 4])), 2))
                for cache, r in zip(caches, reads):
                    for i in r:
                        hit = i in cache
                        computed0 += e == 0 and not hit
                        if e > 0:
                            hits += hit
                            reads_after += 1
                        if not hit and len(cache) < math.ceil(n / world):
                            cache.add(i)
            label = "default (shard-local)" if kind == "sharded" else f"canonical_shards={CANONICAL}"
            table.append([label, str(world), f"{same}/{epochs}", str(computed0), f"{hits / reads_after:.0%}",
                          f"{len(pairs)} ({len(pairs) / all_pairs:.1%})",
                          f"{len(small)} ({len(small) / all_pairs:.1%})"])
    rep.table(table)


def report_resume(rep: harness.Report, n: int, batch: int) -> None:
    """An epoch interrupted on 2 nodes of 2 ranks and taken up by 1 node of 2 ranks (node 1 is lost)."""
    rep.heading(
        f"5. Resume on another world size: {n} items, node caches (shard_by='node'), 2 nodes x 2 ranks read "
        f"epochs 0-1 and half of epoch 2 (batch {batch}), then node 1 is lost and 1 node x 2 ranks goes on; "
        "node 0's cache survives (computed from the samplers)"
    )
    table = [["what the job does", "epoch 2: items read twice", "never read", "items computed, rest of e2 + e3"]]

    def node_samplers(world: int) -> list[ShardedDistributedSampler]:
        return [
            ShardedDistributedSampler(range(n), world, r, seed=1, shard_by="node", local_world_size=2)
            for r in range(world)
        ]

    for how in ("resume on the new layout (load_state_dict)", "restart the epoch", "skip to the next epoch"):
        old = node_samplers(4)
        cache: set[int] = set()  # node 0's cache: the items its ranks (0, 1) read
        for e in range(2):
            for r, lst in enumerate(_reads(old, e)):
                if r < 2:
                    cache.update(lst)
        for s in old:
            s.set_epoch(2)
        half = (len(old[0].indices_for_epoch(2)) // (2 * batch)) * batch
        before = [lst[:half] for lst in (s.indices_for_epoch(2) for s in old)]
        for r in range(2):
            cache.update(before[r])
        new = node_samplers(2)
        if how.startswith("resume"):
            for s in new:
                s.load_state_dict(old[0].state_dict(consumed=half))
            rest = _reads(new, 2)
        elif how.startswith("restart"):
            rest = _reads(new, 2)
        else:
            rest = [[], []]
        counts = Counter(x for lst in before + rest for x in lst)
        computed = 0
        for lst in rest + _reads(new, 3):
            for x in lst:
                computed += x not in cache
                cache.add(x)
        table.append([how, str(sum(c > 1 for c in counts.values())), str(n - len(counts)), str(computed)])
    rep.table(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes; well under a minute")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help="write sampler.md (what was printed) and sampler.json here")
    args = parser.parse_args()
    if args.worker:
        worker(json.loads(args.worker))
        return
    if args.quick:
        cfg = {"n_items": 96, "epochs": 3, "repeats": 3, "batch_size": 4, "miss_elems": 150_000}
        cov = (101, 4, 8)
        mix = (96, 4, 10)
        sizes, resume = (96, 4, 16), (96, 4)
    else:
        cfg = {"n_items": 400, "epochs": 5, "repeats": 5, "batch_size": 4, "miss_elems": 300_000}
        cov = (101, 4, 30)
        mix = (200, 4, 30)
        sizes, resume = (400, 5, 32), (400, 4)
    t0 = time.perf_counter()
    for _ in range(3):
        miss_work(0, cfg["miss_elems"])
    miss_ms = harness.median([_timed(miss_work, i, cfg["miss_elems"]) for i in range(15)]) * 1e3
    rep, machine = harness.Report("sampler"), harness.machine_info()
    rep.machine(machine)
    rep.line(f"ShardedDistributedSampler benchmark ({'quick' if args.quick else 'full'})")
    rows = run_gloo(cfg)
    report_gloo(rep, rows, cfg, miss_ms)
    report_coverage(rep, *cov)
    report_mixing(rep, *mix)
    report_world_sizes(rep, *sizes)
    report_resume(rep, *resume)
    rep.line(f"\n(total {time.perf_counter() - t0:.1f} s)")
    if args.out:
        rep.save(args.out, {"machine": machine, "config": cfg, "miss_ms": miss_ms, "rows": rows})


def _timed(fn, *a) -> float:
    t = time.perf_counter()
    fn(*a)
    return time.perf_counter() - t


if __name__ == "__main__":
    main()
