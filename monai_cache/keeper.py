"""The keeper: a tiny detached process that keeps a shared-memory cache while its job may still need it.

A cache lives while some process holds its lease (``monai_cache.shm_lifetime``). Two cases want it to live
longer than the processes that read it:

* **torchrun restarts.** When a rank fails, torchrun's elastic agent stops every rank of the node and starts them
  again (``--max-restarts``; with ``--nnodes=MIN:MAX`` the world may change size then). For a moment no rank holds
  the lease, and the cache would go with the last one. So the first process of a node that joins a cache under
  torchrun starts a keeper that holds a lease of its own for as long as the node's agent lives: the restarted
  ranks find every entry. The agent is the ranks' parent (torchrun starts them), named by its pid and its start
  time (a reused pid is not mistaken for it), and handed down in ``$MONAI_CACHE_AGENT`` to the processes a rank
  starts (spawned DataLoader workers). The keeper waits on it with a ``pidfd``; when the agent exits, normally
  or killed, the keeper removes the cache (unless ``keep_alive`` asks it to wait) once no other process uses it:
  ranks orphaned by a killed agent may still run, and may be killed in turn. A job killed outright (the keeper
  too) leaves a cache whose lease nobody holds: the next process that joins any cache reclaims it, as always.
* **keep_alive.** Outside torchrun, ``keep_alive=SECONDS`` (or ``$MONAI_CACHE_KEEP_ALIVE``) makes the last user of a
  cache start a keeper that holds it ``SECONDS`` more: a script or notebook run again within that time finds it
  warm. Every user that leaves meanwhile moves the deadline (the lease file's mtime).

* **Users that die.** A cache's last user normally removes it on leaving; one killed (SIGKILL, a signal whose
  default action ends it, an OOM kill) cannot. So the process that creates a cache also starts its *watcher*
  (:func:`watch`): it looks every :data:`WATCH_SECONDS` whether anybody still holds the cache's lease, and when
  nobody does, removes it (:func:`monai_cache.shm_lifetime.reclaim_unused`) and exits. A stopped training, a
  killed process group, a server shut down by SIGTERM: the memory goes within a second, and the process dies as
  it would have (no signal handler of ours). The watcher ignores SIGTERM, SIGINT and SIGHUP, since the signal
  that ends a job (``scancel``, a time limit, ``docker stop``) reaches it with the job's processes, and it exits
  as soon as its cache is gone. Only a kill of every process at once, watcher included (a Slurm step's cgroup
  killed with SIGKILL), leaves a stale cache: ``monai-cache epilog`` removes a Slurm job's (docs/slurm.md), and
  the next process that joins any cache reclaims it as before.

The keeper is a fresh interpreter started with ``-I`` that imports only the standard library and this package's
torch-free modules (a few MB, a few tens of ms); it opens plain files and never ``multiprocessing.shared_memory``,
so Python 3.11's resource tracker cannot unlink anything. It detaches (its own session, its parent gone at once),
so torchrun's stopping of a rank's process group does not reach it. One keeper per cache and anchor: it holds an
exclusive ``flock`` on ``keeper.<anchor>`` in the cache's directory while it lives; one watcher per cache, on
``watcher``. The watcher is the same kind of process.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import select
import signal
import subprocess
import sys
import time

from monai_cache.runtime import pid_alive
from monai_cache.shm_lifetime import reclaim_unused, release_keeper

__all__ = [
    "ENV_AGENT",
    "ENV_KEEP_ALIVE",
    "WATCH_SECONDS",
    "keep_alive_seconds",
    "start",
    "torchrun_agent",
    "wait_for_keepers",
    "watch",
    "watching",
]

ENV_AGENT = "MONAI_CACHE_AGENT"
ENV_KEEP_ALIVE = "MONAI_CACHE_KEEP_ALIVE"
_READY_TIMEOUT = 30.0  # seconds a joining process waits for a keeper to hold its lease (an interpreter start)
_CHECK_SECONDS = 2.0  # how often a waiting keeper looks whether its cache was removed (monai-cache clear)
WATCH_SECONDS = 0.5
"""How often a cache's watcher looks whether anybody still uses it: a cache whose users died goes within this."""
_WATCHER = "watcher"  # the watcher's mark in the cache directory
_BOOT = (
    "import os,sys\n"
    "if os.fork(): os._exit(0)\n"  # detach: the starter reaps us at once, init adopts the keeper
    "sys.path.insert(0, sys.argv[1])\n"
    "from monai_cache.keeper import main\n"
    "main(sys.argv[2:])\n"
)


def keep_alive_seconds(value: float | None = None) -> float:
    """``value`` if given, else ``$MONAI_CACHE_KEEP_ALIVE``, else 0: seconds a cache outlives its last user.

    Raises:
        ValueError: it is not a number >= 0 (the message names where it came from).
    """
    where = "keep_alive"
    if value is None:
        text = os.environ.get(ENV_KEEP_ALIVE, "").strip()
        if not text:
            return 0.0
        where = f"${ENV_KEEP_ALIVE}={text!r}"
        try:
            value = float(text)
        except ValueError:
            raise ValueError(f"{where} is not a number of seconds; set it to e.g. 600, or unset it") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ValueError(f"{where} must be a number of seconds >= 0, got {value!r}")
    return float(value)


def _start_time(pid: int) -> int | None:
    """The start time of process ``pid`` (clock ticks since boot), or None if there is none."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _runs(pid: int, start_time: int) -> bool:
    """Whether process ``pid``, started at ``start_time``, has not exited. A zombie (exited, not yet reaped by its
    parent: a launcher busy with something else) has: its pidfd is readable, so waiting on it returns at once."""
    return _start_time(pid) == start_time and pid_alive(pid)


def torchrun_agent() -> tuple[int, int] | None:
    """``(pid, start time)`` of the torchrun agent that started this process, or None outside torchrun.

    A rank (``$TORCHELASTIC_RUN_ID`` and ``$LOCAL_RANK`` set by the agent) is the agent's child; it records the agent
    in ``$MONAI_CACHE_AGENT`` so that the processes it starts (spawned DataLoader workers) name the same one.
    """
    recorded = os.environ.get(ENV_AGENT, "")
    if recorded:
        with contextlib.suppress(ValueError):
            pid, start = (int(x) for x in recorded.split(":"))
            return pid, start
    # torchrun's own variables, not the launcher's view (monai_cache.launcher): a task that Slurm started has no agent
    if not os.environ.get("TORCHELASTIC_RUN_ID") or "LOCAL_RANK" not in os.environ:
        return None
    parent = os.getppid()
    began = _start_time(parent) if parent > 1 else None
    if began is None:
        return None
    os.environ[ENV_AGENT] = f"{parent}:{began}"
    return parent, began


def _mark(path: str, anchor: int) -> str:
    return os.path.join(path, f"keeper.{anchor}")


def running(path: str, anchor: int) -> bool:
    """Whether a keeper of the cache at ``path`` for ``anchor`` (an agent's pid; 0: keep_alive) is alive."""
    return _held(_mark(path, anchor))


def wait_for_keepers(directory: str, timeout: float = 30.0) -> bool:
    """Wait until no keeper works on a cache under ``directory`` (a shared-memory directory); True if none is left.

    A keeper removes its cache a moment after torchrun's agent exits: a launcher that removes ``directory`` itself
    right after the job (the demo) waits for it first, or the keeper could find the directory half gone.

    Args:
        directory: searched recursively for keepers' marks.
        timeout: seconds to wait at most.
    """
    deadline = time.monotonic() + timeout
    while True:
        marks = [os.path.join(d, name) for d, _dirs, names in os.walk(directory) for name in names
                 if name.startswith("keeper.")]  # fmt: skip
        if not any(_held(mark) for mark in marks):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def _held(mark: str) -> bool:
    """Whether a live keeper holds the lock on its mark file."""
    try:
        fd = os.open(mark, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)


def start(path: str, root: str, anchor: tuple[int, int] | None, linger: float) -> bool:
    """Start a keeper of the cache at ``path`` (the caller holds the root lock and a lease); True once it holds
    its lease. Nothing happens if one for this anchor is alive already.

    Args:
        path: the cache directory.
        root: the per-user root (its ``.lock`` serialises join, leave and reclaim).
        anchor: ``(pid, start time)`` of the process whose life the cache follows (torchrun's agent), or None.
        linger: seconds to keep the cache once the anchor is gone (or, without one, after its last user left).
    """
    pid, start_time = anchor if anchor is not None else (0, 0)
    if running(path, pid):
        return True
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    argv = [sys.executable, "-I", "-c", _BOOT, package_root, path, root, str(pid), str(start_time), repr(linger)]
    try:
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True
        )
    except OSError:
        return False
    assert proc.stdout is not None
    with proc.stdout:
        ready, _, _ = select.select([proc.stdout], [], [], _READY_TIMEOUT)
        ok = bool(ready) and proc.stdout.read(1) == b"1"
    proc.wait()  # the first fork: it exits at once
    return ok


def watching(path: str) -> bool:
    """Whether a watcher of the cache at ``path`` is alive."""
    return _held(os.path.join(path, _WATCHER))


def watch(path: str, root: str) -> bool:
    """Start the watcher of the cache at ``path`` unless one is alive (the caller holds the root lock and a lease);
    True if one was started or is alive. It is not waited for: two started at once settle it between themselves
    (the second finds the mark taken and exits).

    Args:
        path: the cache directory.
        root: the per-user root.
    """
    if watching(path):
        return True
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    argv = [sys.executable, "-I", "-c", _BOOT, package_root, "watch", path, root]
    try:
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
    except OSError:
        return False
    proc.wait()  # the first fork: it exits as soon as the watcher is forked off
    return proc.returncode == 0


def _watch_main(path: str, root: str) -> None:
    """The watcher process: remove the cache at ``path`` once nobody holds its lease, then exit."""
    with contextlib.suppress(OSError):
        os.setsid()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # the end of a job reaches us too: outlive it
        signal.signal(sig, signal.SIG_IGN)
    try:
        # The starter does not wait for us: by now the cache may be gone and its path taken by a directory of
        # another user (whom root could write to). Mark only a directory of ours, the one we checked.
        directory = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            if os.fstat(directory).st_uid != os.getuid():
                os._exit(0)
            mark = os.open(_WATCHER, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600, dir_fd=directory)
        finally:
            os.close(directory)
        fcntl.flock(mark, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os._exit(0)  # the cache went, or another watcher has it
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    unused_since: list[float] = []
    try:
        while True:
            try:
                if reclaim_unused(root, path, unused_since):
                    break
            except OSError:  # the root itself went (a test's directory, a container's /dev/shm): nothing to watch
                break
            time.sleep(WATCH_SECONDS)
    finally:
        os._exit(0)


def _wait_for(pid: int, start_time: int, path: str) -> None:
    """Return when process ``pid`` (started at ``start_time``) has exited, or the cache at ``path`` is gone."""
    try:
        pidfd = os.pidfd_open(pid)
    except (OSError, AttributeError):
        pidfd = -1  # gone already, or no pidfd (Linux < 5.3): look at /proc below
    try:
        while _runs(pid, start_time) and os.path.isdir(path):
            if pidfd >= 0:
                select.select([pidfd], [], [], _CHECK_SECONDS)  # readable once the process exited
            else:
                time.sleep(_CHECK_SECONDS)
    finally:
        if pidfd >= 0:
            os.close(pidfd)


def _linger(path: str, linger: float) -> None:
    """Return ``linger`` seconds after the last user left (the lease file's mtime), or when the cache is gone."""
    lease = os.path.join(path, "lease")
    while True:
        try:
            left = os.stat(lease).st_mtime + linger - time.time()
        except OSError:
            return
        if left <= 0:
            return
        time.sleep(min(left, _CHECK_SECONDS))


def main(args: list[str]) -> None:
    """The keeper process: ``path root anchor_pid anchor_start linger`` (see :func:`start`), or the watcher:
    ``watch path root`` (see :func:`watch`)."""
    if args[0] == "watch":
        _watch_main(args[1], args[2])
    path, root, pid, start_time, linger = args[0], args[1], int(args[2]), int(args[3]), float(args[4])
    with contextlib.suppress(OSError):
        os.setsid()  # a session of its own (the first fork had one; we are not its leader)
    try:
        lease = os.open(os.path.join(path, "lease"), os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        fcntl.flock(lease, fcntl.LOCK_SH)
        mark = os.open(_mark(path, pid), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        fcntl.flock(mark, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os._exit(1)  # the cache went, or another keeper got there first: the starter goes on without us
    os.write(1, b"1")
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    try:
        if pid:
            _wait_for(pid, start_time, path)
        while True:
            _linger(path, linger)
            held = release_keeper(root, path, lease, _mark(path, pid), mark)
            if held is None:
                break
            lease = held  # still in use (e.g. ranks a killed agent left behind): the last of them may be killed too
            time.sleep(_CHECK_SECONDS)
    finally:
        os._exit(0)
