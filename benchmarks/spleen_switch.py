#!/usr/bin/env python
"""A stock script shaped like MONAI's spleen tutorial, run as it is and under the switch, side by side.

The script (``--script-body``, run as its own interpreter each time) imports only MONAI: ``monai.data.CacheDataset``
(eager, ``cache_rate=1``) over CT-like volumes (:mod:`monai_cache.synthetic`, the tutorial chain with
``RandCropByPosNegLabeld(num_samples=4)``), ``monai.data.DataLoader(batch_size=2, shuffle=True, num_workers=2)``,
a sum of each batch standing for the training step. It is run three ways per repeat, in rotating order:

* ``stock``: ``python stock.py``;
* ``switch``: ``monai-cache run -- python stock.py`` (the default: our datasets and our DataLoader);
* ``datasets``: ``monai-cache run --no-dataloader -- python stock.py`` (our datasets, MONAI's loader).

Every epoch of every run is printed: wall, and CPU of the script and its DataLoader workers (``getrusage`` of the
process and of its reaped children: workers end with each epoch), then the median of the per-repeat ratios of the
warm epochs (2..N) against ``stock`` of the same repeat. Each run then reads one more epoch, untimed, recording a
digest of every batch (``tests/_scripts/batch_digest.py``'s): the line ``same batches`` compares them with
stock's. Usage::

    python -m benchmarks spleen-switch                 # 16 volumes of 160x160x96, 4 epochs, 3 repeats
    python -m benchmarks spleen-switch --items 8 --shape 96x96x64 --repeats 1

``--out``: ``spleen-switch.md`` (what was printed) and ``spleen-switch.json`` (with the machine).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import harness  # the benchmarks' shared helpers (its neighbour here)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = {
    "stock": [],
    "switch": [sys.executable, "-m", "monai_cache", "run", "--"],
    "datasets": [sys.executable, "-m", "monai_cache", "run", "--no-dataloader", "--"],
}

SCRIPT = """
import json, os, resource, sys, time
sys.path.insert(0, {scripts!r})
import torch
from monai.data import CacheDataset, DataLoader
from monai.utils import set_determinism
from batch_digest import batch_digest
from monai_cache.synthetic import crop_size_for, make_dataset, tutorial_transforms

torch.set_num_threads(1)
files = make_dataset({data!r}, items={items}, shape={shape!r})
set_determinism(seed=0)
chain = tutorial_transforms(spatial_size=crop_size_for({shape!r}, (96, 96, 64)), num_samples=4)
ds = CacheDataset(files, chain, cache_rate=1.0, num_workers=2, progress=False)
loader = DataLoader(ds, batch_size=2, shuffle=True, num_workers=2)


def cpu():
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


epochs = []
for epoch in range({epochs}):
    t0, c0 = time.perf_counter(), cpu()
    for batch in loader:
        batch["image"].sum()
    epochs.append((time.perf_counter() - t0, cpu() - c0))
digests = [batch_digest(batch) for batch in loader]  # one more epoch, not timed: hashing costs as much as loading
print("RESULT " + json.dumps({{"epochs": epochs, "digests": digests, "loader": type(loader).__module__}}))
"""


def run(kind: str, script: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run([*RUNS[kind], sys.executable, script], capture_output=True, text=True, env=env, timeout=1800)
    if p.returncode != 0:
        raise SystemExit(f"{kind} failed:\n{p.stderr[-3000:]}")
    line = next(x for x in p.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line.split(" ", 1)[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--items", type=int, default=16)
    parser.add_argument("--shape", default="160x160x96")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--data", default=os.path.join(tempfile.gettempdir(), "monai_cache_spleen_switch"))
    parser.add_argument("--out", default=None, help="write spleen-switch.md (what was printed) and .json here")
    args = parser.parse_args()
    shape = tuple(int(s) for s in args.shape.split("x"))
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "stock.py")
        with open(script, "w") as f:
            f.write(SCRIPT.format(scripts=os.path.join(REPO, "tests", "_scripts"), data=args.data, items=args.items,
                                  shape=shape, epochs=args.epochs))
        rep, machine = harness.Report("spleen-switch"), harness.machine_info()
        rep.line(f"spleen_switch: {args.items} volumes of {args.shape}, {args.epochs} epochs, {args.repeats} repeats, "
                 f"load average {os.getloadavg()[0]:.1f} at the start")
        ratios: dict[str, dict[str, list[float]]] = {k: {"wall": [], "cpu": []} for k in RUNS if k != "stock"}
        same: dict[str, bool] = {k: True for k in ratios}
        runs = []
        for repeat in range(args.repeats):
            results = {}
            for kind in harness.rotated(list(RUNS), repeat):
                results[kind] = run(kind, script)
                epochs = ", ".join(f"{w:.2f} s / {c:.2f} CPU s" for w, c in results[kind]["epochs"])
                rep.line(f"repeat {repeat + 1} {kind:8s} ({results[kind]['loader']}): {epochs}")
            runs.append(results)
            stock = results["stock"]["epochs"][1:]
            for kind in ratios:
                warm = results[kind]["epochs"][1:]
                ratios[kind]["wall"].append(sum(w for w, _ in warm) / sum(w for w, _ in stock))
                ratios[kind]["cpu"].append(sum(c for _, c in warm) / sum(c for _, c in stock))
                same[kind] &= results[kind]["digests"] == results["stock"]["digests"]
        for kind, r in ratios.items():
            walls = ", ".join(f"{x:.2f}" for x in r["wall"])
            cpus = ", ".join(f"{x:.2f}" for x in r["cpu"])
            rep.line(f"{kind}: warm epochs {harness.median(r['wall']):.2f}x stock's wall (per repeat {walls}), "
                     f"{harness.median(r['cpu']):.2f}x its CPU ({cpus}); same batches: {same[kind]}")
        if args.out:
            rep.save(args.out, {"machine": machine, "runs": runs, "ratios": ratios, "same": same})


if __name__ == "__main__":
    main()
