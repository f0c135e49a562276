"""What moving one batch from a worker to the main process costs, torch's way and as a block, beside the estimates
with which ``monai_cache.DataLoader`` chooses between them.

Each case is a prebuilt batch that a dataset hands out (a fresh deep copy per batch, as a collate function makes
fresh tensors); ``monai.data.DataLoader`` moves it torch's way, ``monai_cache.DataLoader`` with the block path forced
moves it as a block, and ``monai_cache.DataLoader`` as it is moves it the way its estimate chooses. The figure is the
CPU time of the whole process tree (main process and workers) per batch, median of the repeats, from which the same
loop over the same dataset with ``num_workers=0`` (the deep copy, the loop) is subtracted. The cases span both sides
of the choice: the tutorial's volume crops, MedNIST-shaped batches of 8 and 64 items, many tensors, many dicts.

Usage::

    python -m benchmarks loader-paths              # 2 workers, 100 batches, 3 repeats: about 4 minutes
    python -m benchmarks loader-paths --batches 40 --repeats 1
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile
import time
from typing import Any

import harness

CASES = ("volume crops", "MedNIST x8", "MedNIST x64", "64 MetaTensors", "1000 tiny tensors", "5000 dicts")


def _mednist(n: int) -> Any:
    import monai.data
    import numpy as np

    from monai_cache.synthetic import mednist_transforms

    rng = np.random.default_rng(0)
    chain = mednist_transforms(load=False)
    items = [chain({"image": rng.random((1, 64, 64), dtype=np.float32), "label": i % 6}) for i in range(n)]
    return monai.data.list_data_collate(items)


def build(case: str, data_dir: str) -> Any:
    """The batch of a case."""
    import monai.data
    import torch

    from monai_cache.synthetic import make_dataset, tutorial_transforms

    if case == "volume crops":  # the tutorial's: 2 volumes x 2 crops of 64^3, batch of MetaTensors with their meta
        files = make_dataset(data_dir, items=2, shape=(128, 128, 80))
        chain = tutorial_transforms((64, 64, 64), num_samples=2)
        return monai.data.list_data_collate([chain(f) for f in files])
    if case.startswith("MedNIST"):
        return _mednist(int(case.split("x")[1]))
    if case == "64 MetaTensors":
        return [monai.data.MetaTensor(torch.ones(1, 64, 64)) for _ in range(64)]
    if case == "1000 tiny tensors":
        return [torch.arange(16.0) + i for i in range(1000)]
    if case == "5000 dicts":
        return {"image": torch.ones(1 << 18), "rows": [{"a": i, "b": "xy", "c": True} for i in range(5000)]}
    raise ValueError(case)


class Prebuilt:
    """A dataset whose every item is a fresh deep copy of one batch."""

    def __init__(self, batch: Any, n: int) -> None:
        self.batch, self.n = batch, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        return copy.deepcopy(self.batch)


def first(samples: list) -> Any:
    return samples[0]


def cpu_per_batch(loader: Any, batches: int) -> float:
    """CPU milliseconds of the process tree per batch over one pass (workers already started)."""
    me = os.getpid()
    cpu = harness.tree_cpu_seconds(me)
    for _ in loader:
        pass
    return (harness.tree_cpu_seconds(me) - cpu) / batches * 1e3


def measure(batch: Any, batches: int, repeats: int, workers: int) -> dict[str, float]:
    import monai.data

    import monai_cache.loader as block_loader

    dataset = Prebuilt(batch, batches)
    common = {"batch_size": 1, "collate_fn": first}
    forked = {**common, "multiprocessing_context": "fork"}
    loaders = {
        "baseline": monai.data.DataLoader(dataset, num_workers=0, **common),
        "torch": monai.data.DataLoader(dataset, num_workers=workers, persistent_workers=True, **forked),
        "chosen": block_loader.DataLoader(dataset, num_workers=workers, persistent_workers=True, **forked),
    }
    for loader in loaders.values():  # start the workers, warm the segments
        for _ in loader:
            pass
    saved = block_loader.BLOCK_PER_HEADER_BYTE_S, block_loader.BLOCK_PER_BYTE_S
    block_loader.BLOCK_PER_HEADER_BYTE_S = block_loader.BLOCK_PER_BYTE_S = 0.0  # estimated free: always a block
    try:  # the workers forked now keep the constants as they are now
        loaders["block"] = block_loader.DataLoader(dataset, num_workers=workers, persistent_workers=True, **forked)
        for _ in loaders["block"]:
            pass
    finally:
        block_loader.BLOCK_PER_HEADER_BYTE_S, block_loader.BLOCK_PER_BYTE_S = saved
    out: dict[str, list[float]] = {k: [] for k in loaders}
    for r in range(repeats):
        for name in harness.rotated(list(loaders), r):
            out[name].append(cpu_per_batch(loaders[name], batches))
    med = {k: harness.median(v) or 0.0 for k, v in out.items()}
    return {k: v - med["baseline"] for k, v in med.items() if k != "baseline"}


def estimates(batch: Any) -> dict[str, Any]:
    import monai_cache.loader as block_loader
    from monai_cache.codec import encode

    encoded = encode(batch, exact=True)
    header, data = len(encoded.header), encoded.nbytes - encoded.data_offset
    m = block_loader
    torch_s = m.TORCH_PER_TENSOR_S * encoded.tensors + m.TORCH_PER_BYTE_S * data + m.TORCH_PER_HEADER_BYTE_S * header
    block_s = m.BLOCK_PER_HEADER_BYTE_S * header + m.BLOCK_PER_BYTE_S * data
    return {"header": header, "tensors": encoded.tensors, "bytes": data, "torch": torch_s * 1e3, "block": block_s * 1e3}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=100, help="batches per pass (default 100)")
    parser.add_argument("--repeats", type=int, default=3, help="passes of each loader, interleaved (default 3)")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers (default 2)")
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated, of: " + ", ".join(CASES))
    parser.add_argument("--out", default=None, help="write loader-paths.md and .json here")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    report = harness.Report("loader-paths")
    report.line(harness.describe_machine(harness.machine_info()))
    report.line(
        f"{args.workers} workers, {args.batches} batches per pass, {args.repeats} interleaved repeats; CPU ms of the "
        "process tree per batch, less the same loop without workers; estimates: monai_cache.loader's constants"
    )
    rows = [["batch", "header KB", "tensors", "data MB", "torch's way", "est.", "block", "est.", "chosen", "cost"]]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for case in args.cases.split(","):
            t0 = time.perf_counter()
            batch = build(case, os.path.join(tmp, "data"))
            est = estimates(batch)
            got = measure(batch, args.batches, args.repeats, args.workers)
            chosen = "torch" if est["torch"] < est["block"] else "block"
            results[case] = {"estimate": est, "measured": got, "chosen": chosen}
            rows.append([
                case, f"{est['header'] / 1024:.0f}", str(est["tensors"]), f"{est['bytes'] / 2**20:.1f}",
                f"{got['torch']:.2f}", f"{est['torch']:.2f}", f"{got['block']:.2f}", f"{est['block']:.2f}",
                chosen, f"{got['chosen']:.2f}",
            ])  # fmt: skip
            print(f"  {case}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    report.table(rows)
    wrong = [c for c, r in results.items() if r["measured"]["chosen"] > 1.25 * min(r["measured"].values())]
    report.targets([(not wrong, "the chosen way costs at most 1.25x the cheaper one for every batch" +
                     (f" (not for: {', '.join(wrong)})" if wrong else ""))])  # fmt: skip
    if args.out:
        report.save(args.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
