"""monai_cache.DataLoader in a restricted sandbox (a private mount namespace set up by the test).

argv[1]: the cases to run in turn, comma-separated (one interpreter, one MONAI import for all); prints one JSON line
``{case: its result}``.

"small-shm": run under a 64 MB /dev/shm (Docker's default, mounted by the test): batches of 2 x 40 MB through
monai's and our DataLoader; ``{"monai.data.DataLoader": "ok" or the error, "monai_cache.DataLoader": ...}``.
"no-proc": with /proc hidden (a tmpfs mounted over it here, in the test's private mount namespace, unless the test
did); ``{"sums": [...], "warnings": [monai_cache warnings]}``.
"""

import json
import os
import subprocess
import sys
import warnings

import _minimal_monai  # noqa: F401  (first: MONAI as a plain install gives it)
import monai.data
import torch

from monai_cache.errors import BatchFallbackWarning
from monai_cache.loader import DataLoader


class Filled(torch.utils.data.Dataset):
    def __init__(self, numel: int) -> None:
        self.numel = numel

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> dict:
        return {"image": torch.full((self.numel,), float(i))}


def small_shm() -> dict:
    out = {}
    numel = 10 << 20  # 40 MiB of float32: a batch of 2 does not fit in 64 MB
    for name, loader_class in (
        ("monai.data.DataLoader", monai.data.DataLoader),
        ("monai_cache.DataLoader", DataLoader),
    ):
        try:
            sums = [float(b["image"].sum()) for b in loader_class(Filled(numel), batch_size=2, num_workers=2)]
            out[name] = "ok" if sums == [float(numel), float(5 * numel)] else f"wrong values {sums}"
        except Exception as e:  # what torch raises in the main process when /dev/shm is full
            out[name] = f"{type(e).__name__}: {e}"[:300]
    return out


def no_proc() -> dict:
    if os.path.exists("/proc/self"):
        subprocess.run(["mount", "-t", "tmpfs", "none", "/proc"], check=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sums = [float(b["image"].sum()) for b in DataLoader(Filled(1000), batch_size=2, num_workers=2)]
    ours = [str(w.message) for w in caught if issubclass(w.category, BatchFallbackWarning)]
    return {"sums": sums, "warnings": ours}


if __name__ == "__main__":
    cases = {"small-shm": small_shm, "no-proc": no_proc}
    print(json.dumps({case: cases[case]() for case in sys.argv[1].split(",")}), flush=True)
