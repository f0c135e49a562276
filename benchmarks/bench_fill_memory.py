#!/usr/bin/env python
"""Memory of the node right after the eager fill, side by side with stock MONAI in the same run.

Each configuration runs as 1 process and as 2 ranks (started like torchrun, gloo on CPU); every rank builds its
dataset (the tutorial chain on the synthetic CT volumes, ``runtime_cache=False``: the cache is filled in the
constructor), waits for the others, then reads its own private memory (USS: ``Private_Clean + Private_Dirty`` of
``/proc/self/smaps_rollup``) and releases the dataset:

* ``monai-dataset``: ``monai.data.Dataset``, nothing cached (the reference);
* ``monai``: ``monai.data.CacheDataset``: every rank holds a copy of the cache in its own memory;
* ``monai-cache``: ``monai_cache.CacheDataset``: one copy in shared memory for the machine (``/dev/shm``, counted
  once, beside the ranks' USS).

The node's cache copies are ``(USS of all ranks - the reference's + shared-memory bytes) / one copy``: 1.00 is the
cache itself and nothing else. ``--repeats`` runs in rotating order, medians.

Usage::

    python -m benchmarks fill-memory                # 24 volumes of 160x160x96, 3 repeats
    python -m benchmarks fill-memory --quick        # 8 volumes of 96x96x64, 2 repeats

``--out``: ``fill-memory.md`` (what was printed) and ``fill-memory.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import uuid

import harness  # the benchmarks' shared helpers (its neighbour here)

CONFIGS = ("monai-dataset", "monai", "monai-cache")


def private_bytes() -> int:
    total = 0
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("Private_Clean", "Private_Dirty"):
                total += int(value.split()[0]) * 1024
    return total


def rank_main(config: str, files_path: str, out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    import monai.data

    import monai_cache
    from monai_cache.codec import item_nbytes
    from monai_cache.synthetic import tutorial_transforms

    with open(files_path) as f:
        files = json.load(f)
    chain = tutorial_transforms()
    if config == "monai-dataset":
        ds = monai.data.Dataset(files, chain)
    elif config == "monai":
        ds = monai.data.CacheDataset(files, chain, progress=False)
    else:
        ds = monai_cache.CacheDataset(files, chain, progress=False)
    dist.barrier()  # every rank has filled (or joined) the cache
    result = {"uss": private_bytes()}
    if config == "monai":
        result["one_copy"] = sum(item_nbytes(item) for item in ds._cache)
    if config == "monai-cache":
        result["shm"] = ds.cache_stats()["stored"]["bytes"]
    with open(os.path.join(out_dir, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    if config == "monai-cache":
        ds.release()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rank", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--items", type=int, default=24)
    parser.add_argument("--shape", type=int, nargs=3, default=(160, 160, 96))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=None, help="write fill-memory.md (what was printed) and .json here")
    args = parser.parse_args()
    if args.rank:
        rank_main(*args.rank)
        return
    if args.quick:
        args.items, args.shape, args.repeats = 8, (96, 96, 64), 2
    from monai_cache.synthetic import make_dataset

    machine = harness.machine_info()
    work = tempfile.mkdtemp(prefix="bench-fill-memory-")
    shm_dir = f"/dev/shm/bench-fill-{uuid.uuid4().hex[:8]}"
    os.makedirs(shm_dir)
    env = {**os.environ, "MONAI_CACHE_SHM_DIR": shm_dir, "OMP_NUM_THREADS": "1"}
    results: dict[tuple[int, str], list[dict]] = {}
    try:
        files = make_dataset(os.path.join(work, "ct"), items=args.items, shape=tuple(args.shape))
        files_path = os.path.join(work, "files.json")
        with open(files_path, "w") as f:
            json.dump(files, f)
        for repeat in range(args.repeats):
            for world in (1, 2):
                for config in harness.rotated(CONFIGS, repeat):
                    out = os.path.join(work, f"{config}-{world}-{repeat}")
                    os.makedirs(out)
                    harness.run_ranks([os.path.abspath(__file__), "--rank", config, files_path, out], world,
                                      out, env=env)  # fmt: skip
                    ranks = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(world)]
                    results.setdefault((world, config), []).append({
                        "uss": sum(r["uss"] for r in ranks), "shm": ranks[0].get("shm", 0),
                        "one_copy": ranks[0].get("one_copy"),
                    })  # fmt: skip
                    print(f"repeat {repeat + 1} {world} rank(s) {config} done", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm_dir, ignore_errors=True)

    one_copy = harness.median([r["one_copy"] for runs in results.values() for r in runs if r["one_copy"]]) or 1
    rep = harness.Report("fill-memory")
    rep.machine(machine, at_end=True)
    rep.line(f"Node memory after the eager fill: {args.items} volumes of {tuple(args.shape)}, the tutorial chain; one "
             f"copy of the cached data = {one_copy / 2**20:.0f} MiB; medians of {args.repeats} repeats")  # fmt: skip
    rows = [["ranks", "configuration", "USS of the ranks (MiB)", "shared memory (MiB)", "above uncached (MiB)",
             "cache copies on the node", "vs MONAI"]]
    for world in (1, 2):
        base = harness.median([r["uss"] for r in results[(world, "monai-dataset")]]) or 0
        copies: dict[str, float] = {}
        for config in CONFIGS:
            runs = results[(world, config)]
            uss = harness.median([r["uss"] for r in runs]) or 0
            shm = harness.median([r["shm"] for r in runs]) or 0
            copies[config] = (uss - base + shm) / one_copy
            ratio = "" if config != "monai-cache" else f"{copies[config] / copies['monai']:.2f}x"
            rows.append([str(world), config, f"{uss / 2**20:.0f}", f"{shm / 2**20:.0f}",
                         f"{(uss - base + shm) / 2**20:.0f}", f"{copies[config]:.2f}", ratio])
    rep.table(rows, left=2)
    if args.out:
        rep.save(args.out, {"machine": machine, "runs": {f"{w} {c}": runs for (w, c), runs in results.items()}})


if __name__ == "__main__":
    main()
