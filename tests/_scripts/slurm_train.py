"""A task of a Slurm job (srun's, or a rank torchrun started inside srun): monai_cache.CacheDataset on the fly over
8 items, read through monai.data.DataLoader with a worker. Every computation of an item appends a line to the calls
log, so a test counts them across tasks and jobs. No process group: the tasks of a node share the cache through
shared memory, which is what is tested.

argv: calls_log mode, mode ``once`` (one epoch, then a normal end), ``crash-once`` (as once, but under torchrun rank 0
of the first attempt fails after its epoch) or ``until`` (after the first epoch, ``<calls_log>.ready.<task>`` appears,
holding the task's pid, and the task waits in the middle of its second epoch, its DataLoader worker started, until
``<calls_log>.finish`` appears; then it ends normally, unless the job was ended first). The shared-memory directory is
``$MONAI_CACHE_SHM_DIR``.
"""

import os
import sys
import time

import _minimal_monai  # noqa: F401  (first: MONAI as a plain install gives it)
import monai.data
import monai.transforms as mt
import numpy as np

import monai_cache

ITEMS = 8


class Counted(mt.MapTransform):
    """A deterministic transform that logs each computation (cached with the rest of the chain)."""

    def __init__(self, log: str) -> None:
        super().__init__(keys="image")
        self.log = log

    def __call__(self, data: dict) -> dict:
        with open(self.log, "a") as f:
            f.write(f"{int(data['case'])}\n")
        return dict(data)


def main() -> None:
    log, mode = sys.argv[1], sys.argv[2]
    task = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))
    with open(f"{log}.starts", "a") as f:  # "<task> <torchrun's restart count>": which attempts ran
        f.write(f"{task} {os.environ.get('TORCHELASTIC_RESTART_COUNT', '-')}\n")
    data = [{"image": np.full((4, 16, 16), i, np.float32), "case": i} for i in range(ITEMS)]
    chain = mt.Compose([Counted(log), mt.ScaleIntensityd(keys="image"), mt.RandFlipd(keys="image", prob=0.5)])
    ds = monai_cache.CacheDataset(data, chain, runtime_cache=True, progress=False)
    loader = monai.data.DataLoader(ds, batch_size=2, num_workers=1)
    for _batch in loader:
        time.sleep(0.02)
    if mode == "crash-once" and task == "0" and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
        os._exit(1)  # a rank fails after its first epoch: torchrun restarts every rank of the node
    if mode == "until":
        batches = iter(loader)  # the second epoch begun, its worker started; idle there, so many jobs cost little
        next(batches)
        with open(f"{log}.ready.{task}.tmp", "w") as f:
            f.write(str(os.getpid()))
        os.replace(f"{log}.ready.{task}.tmp", f"{log}.ready.{task}")
        while not os.path.exists(f"{log}.finish"):
            time.sleep(0.1)
        for _batch in batches:
            pass


if __name__ == "__main__":
    main()
