"""A main process iterating monai_cache.DataLoader with 2 forked workers, for the SIGKILL test.

Prints ``{"workers": [pids]}`` once it holds a few batches, then sleeps until it is killed.
argv: volumes.json
"""

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import _minimal_monai  # noqa: F401  (first: MONAI as a plain install gives it)
import monai.data

from monai_cache.loader import DataLoader
from monai_cache.synthetic import tutorial_transforms


def main() -> None:
    with open(sys.argv[1]) as f:
        files = json.load(f)
    ds = monai.data.Dataset(files, tutorial_transforms(spatial_size=(16, 16, 8)))
    it = iter(DataLoader(ds, batch_size=2, num_workers=2))
    kept = [next(it), next(it)]
    print(json.dumps({"workers": [w.pid for w in it._workers], "kept": len(kept)}), flush=True)
    while True:
        time.sleep(1)


if __name__ == "__main__":
    main()
