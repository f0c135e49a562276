"""One entry point for the benchmarks: ``python -m benchmarks <suite> [options]`` (from the repository's root).

Each suite runs stock MONAI and monai_cache side by side in the same run and prints ratios against MONAI measured
there; ``python -m benchmarks <suite> --help`` lists a suite's options, ``python -m benchmarks`` the suites. They
share :mod:`harness` (ranks started as torchrun starts them, CPU and memory of process trees) and print through its
one report format (``harness.Report``: ``--out DIR`` saves what was printed as ``DIR/<suite>.md`` and the
measurements as ``DIR/<suite>.json``). Each suite is also a script of its own (``python benchmarks/<module>.py``),
which is how the suites start their ranks.
"""

from __future__ import annotations

import importlib
import os
import sys

SUITES: dict[str, tuple[str, str]] = {
    # suite: (module, what it measures)
    "warm": ("warm", "every epoch: MONAI, ours with MONAI's DataLoader, ours with ours; volumes and small items"),
    "loader-paths": ("loader_paths", "one batch moved torch's way and as a block, beside the loader's estimates"),
    "cache": ("bench_cache", "CacheDataset: first batch, warm epochs, memory, fills (eager and on the fly)"),
    "switch": ("bench_switch", "Auto3DSeg's segresnet pipeline, stock and under the switch"),
    "spleen-switch": ("spleen_switch", "a stock spleen-shaped script, stock / under the switch / --no-dataloader"),
    "persistent": ("bench_persistent", "PersistentDataset: first epoch, warm epochs, file sizes, restarts"),
    "tiers": ("bench_tiers", "the two tiers (shared memory and disk) against MONAI, 2 ranks started like torchrun"),
    "smartcache": ("bench_smartcache", "SmartCacheDataset: epochs, CPU and memory"),
    "sampler": ("bench_sampler", "the shard-local sampler against DistributedSampler: hits per epoch"),
    "restart": ("bench_restart", "a rank killed mid-epoch under torchrun --max-restarts=1: time to resume"),
    "scale": ("bench_scale", "100,000 small items and large items: throughput and memory"),
    "fill-memory": ("bench_fill_memory", "memory right after the eager fill"),
    "plan": ("bench_plan", "monai-cache plan: its time and how far its projection is"),
    "device": ("bench_device", "ToDeviced at the end of the cached chain with ThreadDataLoader (needs CUDA)"),
    "soak": ("soak", "many epochs of DDP-style loading through both caches, watching for leaks"),
    "report": ("report", "runs the suites the report needs and writes docs/benchmarks.md"),
}


def _usage() -> str:
    width = max(map(len, SUITES))
    lines = [f"  {name:{width}s}  {what}" for name, (_module, what) in SUITES.items()]
    return "usage: python -m benchmarks <suite> [options]\n\nsuites:\n" + "\n".join(lines)


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in SUITES:
        print(_usage(), file=sys.stderr if argv and argv[0] not in ("-h", "--help") else sys.stdout)
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    here = os.path.dirname(os.path.abspath(__file__))
    if here not in sys.path:
        sys.path.insert(0, here)  # the suites import harness and each other as top-level modules
    module = importlib.import_module(SUITES[argv[0]][0])
    sys.argv = [module.__file__ or argv[0], *argv[1:]]
    result = module.main()
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
