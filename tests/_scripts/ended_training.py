"""Trainings ended the ways a launcher ends them, in one interpreter: what each leaves in shared memory.

Imports MONAI and monai_cache once, then forks one training per ending (a process group of its own, as a launcher
starts it: MONAI Label's training subprocess, a Slurm task). Each training fills a monai_cache.CacheDataset on the fly
through monai.data.DataLoader with 2 persistent forked workers, epoch after epoch, until it is ended by:

* ``kill-main``: SIGKILL of the training process (MONAI Label's stop button);
* ``kill-group``: SIGKILL of its whole process group, workers included;
* ``kill-worker``: SIGKILL of one DataLoader worker (torch raises in the training, which ends with that error);
* ``sigterm``: SIGTERM with Python's default action (``scancel``, a time limit, ``docker stop``);
* ``sigterm-handler``: SIGTERM to a training that installed its own handler, which restores the default and
  re-raises the signal, as uvicorn does.

The trainings run at once, each in a tmpfs directory of its own (``shm_dir/<ending>``). Prints one JSON line: per
ending, the training's exit status (a negative signal number when a signal ended it), whether its own handler ran,
the seconds from the signal until its cache was gone (None: not within 15 s), and what was left then.
argv: shm_dir endings (comma-separated)
"""

import json
import os
import signal
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import _minimal_monai  # noqa: F401  (first: MONAI as a plain install gives it)
import monai.data
import monai.transforms as mt
import numpy as np
import torch

import monai_cache

ITEMS = 64


def train(shm_dir: str, ending: str, ready_fd: int) -> None:
    """The training (a forked child): report "ready" mid-epoch, then wait for its end."""
    os.setpgid(0, 0)
    torch.set_num_threads(1)
    if ending == "sigterm-handler":

        def handler(signum: int, frame: object) -> None:
            os.write(ready_fd, b"handler\n")
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

        signal.signal(signal.SIGTERM, handler)
    data = [{"image": np.full((4, 16, 16), i, np.float32)} for i in range(ITEMS)]
    chain = mt.Compose([mt.ScaleIntensityd(keys="image"), mt.RandFlipd(keys="image", prob=0.5)])
    ds = monai_cache.CacheDataset(data, chain, runtime_cache=True, shm_dir=shm_dir, progress=False)
    loader = monai.data.DataLoader(ds, batch_size=2, num_workers=2, persistent_workers=True)
    for epoch in range(1000):  # until it is ended
        batches = iter(loader)
        for i, _batch in enumerate(batches):
            if epoch == 0 and i == 4:
                workers = [w.pid for w in batches._workers]  # type: ignore[attr-defined]
                os.write(ready_fd, (json.dumps({"workers": workers}) + "\n").encode())
            time.sleep(0.05)  # a training step: the end comes mid-epoch
    os.write(ready_fd, b"finished\n")


def cache_dirs(shm_dir: str) -> list[str]:
    """What is left of this user's caches (the per-user root and its lock are not a cache)."""
    root = os.path.join(shm_dir, f"monai_cache-{os.getuid()}")
    return sorted(n for n in os.listdir(root) if n != ".lock") if os.path.isdir(root) else []


def start(shm_dir: str, ending: str) -> tuple[int, Any, dict]:
    """Fork the training; return its pid, the pipe it reports on, and its report once it is mid-epoch."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        code = 0
        try:
            train(shm_dir, ending, w)
        except BaseException:
            code = 1
        os._exit(code)
    os.close(w)
    lines = os.fdopen(r)
    return pid, lines, json.loads(lines.readline())


def end(pid: int, ending: str, workers: list[int]) -> None:
    if ending == "kill-main":
        os.kill(pid, signal.SIGKILL)
    elif ending == "kill-group":
        os.killpg(pid, signal.SIGKILL)
    elif ending == "kill-worker":
        os.kill(workers[0], signal.SIGKILL)
    else:
        os.kill(pid, signal.SIGTERM)


def main() -> None:
    shm_dir, endings = sys.argv[1], sys.argv[2].split(",")
    dirs = {e: os.path.join(shm_dir, e) for e in endings}  # a tmpfs directory per training: whose cache is whose
    started = {}
    for e in endings:  # one after the other, each mid-epoch before the next starts (2 cores)
        os.makedirs(dirs[e])
        started[e] = start(dirs[e], e)
    out: dict[str, dict[str, Any]] = {}
    for e, (pid, _lines, first) in started.items():  # all ended at once
        out[e] = {"before": cache_dirs(dirs[e])}
        end(pid, e, first["workers"])
        out[e]["signalled"] = time.monotonic()
    while time.monotonic() - min(o["signalled"] for o in out.values()) < 15.0:
        for e, o in out.items():
            pid = started[e][0]
            if "exit" not in o:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    o["exit"] = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            if "gone_after" not in o and not cache_dirs(dirs[e]):
                o["gone_after"] = round(time.monotonic() - o["signalled"], 2)
        if all("gone_after" in o and "exit" in o for o in out.values()):
            break
        time.sleep(0.05)
    for e, o in out.items():
        if "exit" not in o:  # still running after 15 s
            os.killpg(started[e][0], signal.SIGKILL)
            os.waitpid(started[e][0], 0)
            o["exit"] = None
        rest = started[e][1].read()
        started[e][1].close()
        o["handler_ran"], o["finished"] = "handler" in rest, "finished" in rest
        o.setdefault("gone_after", None)
        o["left"] = cache_dirs(dirs[e])
        del o["signalled"]
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
