"""Start rank processes the way ``torchrun`` does, and measure CPU of process trees: shared by the benchmarks.

``torchrun --nproc-per-node N script args`` starts N independent interpreters with ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``ROLE_RANK``, ``ROLE_WORLD_SIZE``, ``MASTER_ADDR`` and
``MASTER_PORT`` set, and ``OMP_NUM_THREADS=1`` when there is more than one process per node;
:func:`run_ranks` does the same without needing torchrun's rendezvous, and waits for all of them.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence

__all__ = ["free_port", "process_tree", "run_ranks", "torchrun_env", "tree_cpu_seconds"]


def free_port() -> int:
    """A TCP port free on localhost right now (for ``MASTER_PORT``)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def torchrun_env(rank: int, world: int, port: int, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment torchrun gives rank ``rank`` of ``world`` processes on one node."""
    env = dict(os.environ if base is None else base)
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        GROUP_RANK="0",
        ROLE_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        ROLE_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    if world > 1:
        env.setdefault("OMP_NUM_THREADS", "1")
    return env


def run_ranks(
    argv: Sequence[str], world: int, log_dir: str, env: dict[str, str] | None = None, timeout: float = 1800.0
) -> None:
    """Run ``python argv...`` as ``world`` ranks; return when all exited with 0.

    Args:
        argv: the script and its arguments (run with this interpreter).
        world: number of ranks.
        log_dir: where ``rank<r>.log`` (stdout and stderr of each rank) goes.
        env: environment to start from (default: this process's).
        timeout: seconds after which the ranks are killed.

    Raises:
        RuntimeError: a rank failed or the run timed out; the message holds the end of its log.
    """
    os.makedirs(log_dir, exist_ok=True)
    port = free_port()
    procs: list[subprocess.Popen] = []
    logs = [os.path.join(log_dir, f"rank{r}.log") for r in range(world)]
    try:
        for rank in range(world):
            with open(logs[rank], "wb") as log:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, *argv],
                        env=torchrun_env(rank, world, port, env),
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                    )
                )
        deadline = time.monotonic() + timeout
        while True:
            codes = [p.poll() for p in procs]
            failed = next((r for r, c in enumerate(codes) if c not in (None, 0)), None)
            if failed is not None or time.monotonic() > deadline:
                what = f"rank {failed} exited with {codes[failed]}" if failed is not None else "timed out"
                with open(logs[failed or 0], errors="replace") as f:
                    tail = "".join(f.readlines()[-30:])
                raise RuntimeError(f"{' '.join(argv)}: {what}. End of {logs[failed or 0]}:\n{tail}")
            if all(c == 0 for c in codes):
                return
            time.sleep(0.1)
    finally:
        for p in procs:  # only our own ranks, by pid; their DataLoader workers exit with them
            if p.poll() is None:
                p.kill()
                p.wait()


def _children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                out.extend(int(x) for x in f.read().split())
        except OSError:
            continue
    return out


def process_tree(roots: Iterable[int]) -> list[int]:
    """``roots`` and all their living descendants."""
    seen: list[int] = []
    todo = [int(p) for p in roots]
    while todo:
        pid = todo.pop()
        if pid not in seen and os.path.exists(f"/proc/{pid}"):
            seen.append(pid)
            todo.extend(_children(pid))
    return seen


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds used so far by ``pid``, its living descendants, and the children they have reaped."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for p in process_tree([pid]):
        try:
            with open(f"/proc/{p}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        total += sum(int(v) for v in fields[11:15]) / tick  # utime, stime, cutime, cstime
    return total
