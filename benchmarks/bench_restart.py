"""Benchmark: a rank crashes mid-epoch under ``torchrun --max-restarts=1``; how long until training goes on?

Run ``python -m benchmarks restart [--items 16] [--shape 128,128,80] [--repeats 2] [--out DIR]``. Not a timed
test; it prints a table (``--out``: ``restart.md`` as printed and ``restart.json``).

The same job, once with MONAI's ``CacheDataset`` (its default: every rank fills its own cache before the first
batch) and ``DistributedSampler``, once with ``monai_cache.CacheDataset(runtime_cache=True)`` and
``ShardedDistributedSampler``: 2 gloo ranks on synthetic CT-like NIfTI volumes and MONAI's tutorial chain, no
DataLoader workers. Epoch 0 runs whole; in epoch 1 rank 1 ends with ``os._exit(1)`` after 2 steps, and torchrun
restarts both ranks, which run epoch 1 again. Measured: the time from the crash to the first batch after the
restart (the crashing rank writes its time just before it exits; each restarted rank when it has its first batch,
the later of the two counts), the CPU seconds the restarted ranks spent until then (interpreter start and imports
included), and how many times the deterministic chain ran after the restart (a transform at its head counts
calls). Each repeat runs both configurations; ratios are per repeat, then the median.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import harness  # the benchmarks' shared helpers (its neighbour here)

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

CONFIGS = ("monai", "monai_cache")


def count_call(item: dict) -> dict:
    """The head of the deterministic chain: one line per call in ``$BENCH_RESTART_CALLS``."""
    with open(os.environ["BENCH_RESTART_CALLS"], "a") as f:
        f.write(f"{os.environ['TORCHELASTIC_RESTART_COUNT']}\n")
    return item


def rank_main(out: str, config: str, spatial: int) -> None:
    """One rank of the job (started by torchrun)."""
    import torch.distributed as dist
    from monai.data import DataLoader
    from monai.transforms import Lambda
    from torch.utils.data import DistributedSampler

    import monai_cache
    from monai_cache.synthetic import tutorial_transforms

    attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world,
        is_master=rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True",
        timeout=timedelta(seconds=600),
    )
    # a key prefix per attempt: restarted gloo ranks must not read the dead ranks' addresses (docs/distributed.md)
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore(f"attempt_{attempt}", store),
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=600),
    )
    with open(os.path.join(out, "files.json")) as f:
        files = json.load(f)
    chain = tutorial_transforms(spatial_size=(spatial,) * 3, before=[Lambda(count_call)])
    if config == "monai":
        from monai.data import CacheDataset

        ds = CacheDataset(files, chain, progress=False)
        sampler = DistributedSampler(ds, shuffle=True, seed=0)
    else:
        ds = monai_cache.CacheDataset(files, chain, runtime_cache=True, progress=False)
        sampler = monai_cache.ShardedDistributedSampler(ds, shuffle=True, seed=0)
    loader_class = DataLoader if config == "monai" else monai_cache.DataLoader
    loader = loader_class(ds, batch_size=2, sampler=sampler, num_workers=0)
    for epoch in (0, 1) if attempt == "0" else (1,):
        sampler.set_epoch(epoch)
        for step, batch in enumerate(loader, 1):
            if attempt != "0" and step == 1:
                use = resource.getrusage(resource.RUSAGE_SELF)
                with open(os.path.join(out, f"first.rank{rank}.json"), "w") as f:
                    json.dump({"t": time.time(), "cpu": use.ru_utime + use.ru_stime}, f)
            float(batch["image"].mean())  # touch the batch, as a training step would
            if attempt == "0" and epoch == 1 and step == min(2, len(loader)) and rank == 1:
                with open(os.path.join(out, "crash.json"), "w") as f:
                    json.dump({"t": time.time()}, f)
                os._exit(1)
            dist.barrier()
    dist.destroy_process_group()


def run_job(work: str, config: str, spatial: int) -> dict:
    out = os.path.join(work, config)
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    shutil.copy(os.path.join(work, "files.json"), out)
    shm = tempfile.mkdtemp(prefix="bench-restart-", dir="/dev/shm")
    env = {**os.environ, "MONAI_CACHE_SHM_DIR": shm, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    env["BENCH_RESTART_CALLS"] = os.path.join(out, "calls.log")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "--max-restarts=1",
        f"--rdzv-endpoint=127.0.0.1:{harness.free_port()}",
        __file__,
        "--rank",
        out,
        config,
        str(spatial),
    ]
    start = time.time()
    try:
        with open(os.path.join(out, "torchrun.log"), "wb") as log:
            code = subprocess.run(argv, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=1800).returncode
        wall = time.time() - start
        if code != 0:
            raise RuntimeError(f"{config}: torchrun exited with {code}; see {out}/torchrun.log")
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    crash = json.load(open(os.path.join(out, "crash.json")))["t"]
    firsts = [json.load(open(os.path.join(out, f"first.rank{r}.json"))) for r in range(2)]
    with open(os.path.join(out, "calls.log")) as f:
        calls = f.read().split()
    return {
        "to_first_batch": max(x["t"] for x in firsts) - crash,
        "cpu_to_first_batch": sum(x["cpu"] for x in firsts),
        "computed_before": calls.count("0"),
        "computed_again": len(calls) - calls.count("0"),
        "job_wall": wall,
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--items", type=int, default=16)
    ap.add_argument("--shape", default="128,128,80")
    ap.add_argument("--crop", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=None, help="write restart.md (what was printed) and restart.json here")
    ap.add_argument("--rank", nargs=3, metavar=("OUT", "CONFIG", "CROP"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.rank:
        rank_main(args.rank[0], args.rank[1], int(args.rank[2]))
        return {}
    from monai_cache.synthetic import make_dataset

    shape = tuple(int(s) for s in args.shape.split(","))
    machine = harness.machine_info()
    work = tempfile.mkdtemp(prefix="bench-restart-")
    try:
        files = make_dataset(os.path.join(work, "ct"), items=args.items, shape=shape)
        with open(os.path.join(work, "files.json"), "w") as f:
            json.dump(files, f)
        runs: dict[str, list[dict]] = {c: [] for c in CONFIGS}
        for _ in range(args.repeats):
            for config in CONFIGS:
                runs[config].append(run_job(work, config, args.crop))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rep = harness.Report("restart")
    rep.machine(machine, at_end=True)
    rep.line(f"{args.items} volumes of {shape} voxels, crops of {args.crop}^3, 2 gloo ranks, no DataLoader workers; "
             f"medians of {args.repeats} repeats")
    keys = ("to_first_batch", "cpu_to_first_batch", "computed_before", "computed_again", "job_wall")
    rows = [["", "crash -> first batch after the restart, s", "CPU s of the restarted ranks until then",
             "chain runs before the crash", "chain runs after the restart", "whole job, wall s"]]
    for config in CONFIGS:
        m = [harness.median(r[k] for r in runs[config]) or 0.0 for k in keys]
        rows.append([config, f"{m[0]:.2f}", f"{m[1]:.2f}", f"{m[2]:.0f}", f"{m[3]:.0f}", f"{m[4]:.1f}"])
    ratio = [harness.median(o[k] / b[k] for o, b in zip(runs["monai_cache"], runs["monai"]) if b[k]) for k in keys]
    rows.append(["monai_cache / monai", *("-" if r is None else f"{r:.2f}x" for r in ratio)])
    rep.table(rows)
    if args.out:
        rep.save(args.out, {"machine": machine, "runs": runs})
    return runs


if __name__ == "__main__":
    main()
