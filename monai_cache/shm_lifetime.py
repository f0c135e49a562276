"""The lifetime of a shared-memory cache: who holds it, and when it goes. Standard library only.

Each process using a cache holds a shared ``flock`` on its ``lease`` file; the kernel drops it when the process
dies. The last process to leave normally removes the cache (:meth:`monai_cache.shm_directory.CacheDirectory.leave`).
A cache whose lease nobody holds is stale (its users crashed) and is reclaimed by the next process that joins any
cache (:func:`reclaim_stale`), unless it is kept (a ``keep`` file: ``keep_warm``). Under torchrun a keeper process
holds a lease while the node's agent lives, so that restarted ranks find the cache; with ``keep_alive`` one holds it
that many seconds after its last user left (:mod:`monai_cache.keeper`, which ends with :func:`release_keeper`). And
a watcher, started with each cache, removes it within a second of its last user's death however that user died
(:func:`reclaim_unused`), without waiting for another process to join a cache.
Joining, leaving, reclaiming and a keeper's end all happen under the per-user root's lock (:class:`RootLock`), so
that a process probing a lease never mistakes another prober for a user. A removal holds it too, from the renaming
of the directory to ``.trash.<pid>.<n>`` to its last file (:func:`remove_dir`): a ``.trash.`` directory seen under
the lock was left half-removed by a killed process, and is removed (:func:`remove_abandoned`).

The caches' processes (:mod:`monai_cache.shm_directory`) and the keeper (a process without torch) both use this
module; it imports neither of them.
"""

from __future__ import annotations

import contextlib
import fcntl
import gc
import itertools
import os
import shutil
import stat
import threading
import time
from collections.abc import Callable

__all__ = [
    "TRASH_PREFIX",
    "RootLock",
    "ENV_IDLE_COLLECT",
    "defer",
    "enter_critical",
    "exit_critical",
    "in_critical",
    "keep_alive_left",
    "owned_directory",
    "reclaim_stale",
    "reclaim_job",
    "reclaim_unused",
    "record_keep_alive",
    "recorded_keep_alive",
    "release_keeper",
    "remove_abandoned",
    "remove_dir",
    "remover_of",
    "start_idle_collector",
    "touch_private",
    "try_exclusive",
    "unlink_quiet",
]

# ----------------------------------------------------------------------------------------- critical sections
# A dataset garbage-collected while its thread holds the registry lock of monai_cache.shm_directory or the root
# lock (the collector runs finalizers at any allocation) must not release its cache there: both locks would be
# taken again by the same thread and never granted. Such releases wait in _deferred until the thread leaves the
# last of them.
_held = threading.local()  # how deep this thread is in the registry lock or the root lock
_deferred: list[Callable[[], None]] = []


def enter_critical() -> None:
    """This thread takes the registry lock or the root lock: releases asked meanwhile wait (:func:`defer`)."""
    _held.depth = getattr(_held, "depth", 0) + 1


def exit_critical() -> None:
    """This thread leaves a critical section; leaving the last one runs the releases deferred meanwhile."""
    _held.depth -= 1
    while _held.depth == 0 and _deferred:
        try:
            release = _deferred.pop()
        except IndexError:  # another thread took the last one
            break
        release()


def in_critical() -> bool:
    """Whether this thread is inside a critical section (a release asked now must wait: :func:`defer`)."""
    return bool(getattr(_held, "depth", 0))


def defer(release: Callable[[], None]) -> None:
    """Run ``release`` when a thread leaves its last critical section."""
    _deferred.append(release)


def _after_fork_in_child() -> None:
    _held.depth = 0
    _deferred.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


# ------------------------------------------------------------------------------------------- idle processes
# A dataset is released when it is garbage-collected. One caught in a reference cycle (ignite's engines and their
# handlers hold one another, and the dataset through the DataLoader) goes only with a cyclic collection, which Python
# starts after enough allocations: a server idle after a training may never make them, and would keep the cache. So a
# process holding a cache that falls idle collects once; a dataset nobody can reach any more then releases its cache.
ENV_IDLE_COLLECT = "MONAI_CACHE_IDLE_COLLECT"
"""Seconds between a process's looks at whether it fell idle while holding a cache (default 30; 0: never)."""
_IDLE_CPU_SHARE = 0.02  # a process that used less than this share of one core since the last look is idle
_collector: tuple[int, threading.Thread] | None = None  # (pid, thread): one per process, not inherited by fork


def _idle_seconds() -> float:
    try:
        return max(0.0, float(os.environ.get(ENV_IDLE_COLLECT, "30")))
    except ValueError:
        return 30.0


def start_idle_collector(holding: Callable[[], bool]) -> None:
    """Start this process's idle collector, unless it runs (or ``$MONAI_CACHE_IDLE_COLLECT`` is 0): a daemon thread
    that looks every that many seconds whether the process holds a cache (``holding()``) and used almost no CPU since
    its last look; the first such look after a busy spell runs ``gc.collect()`` once."""
    global _collector
    interval = _idle_seconds()
    if interval <= 0 or (_collector is not None and _collector[0] == os.getpid()):
        return

    def run() -> None:
        last, collected = time.process_time(), True
        while True:
            time.sleep(interval)
            now = time.process_time()
            busy, last = now - last > _IDLE_CPU_SHARE * interval, now
            if busy:
                collected = False
            elif not collected and holding():
                gc.collect()  # unreachable datasets' finalizers release their caches
                collected = True

    thread = threading.Thread(target=run, name="monai_cache-idle-collect", daemon=True)
    _collector = (os.getpid(), thread)
    thread.start()


# ------------------------------------------------------------------------------------------- the root lock
class RootLock:
    """flock on the per-user root's .lock: serialises join, leave and reclaim (all short).

    Args:
        root: the per-user root.
        create: create the lock file if it is missing; False raises ``FileNotFoundError`` instead (a watcher, whose
            root may be being removed: it must not put a file back into it).
    """

    def __init__(self, root: str, create: bool = True) -> None:
        self.path = os.path.join(root, ".lock")
        self.create = create

    def __enter__(self) -> RootLock:
        enter_critical()
        try:
            flags = os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | (os.O_CREAT if self.create else 0)
            self.fd = os.open(self.path, flags, 0o600)
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        except BaseException:
            exit_critical()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)
        exit_critical()


# ------------------------------------------------------------------------------------------- leases
def try_exclusive(lease_path: str, create: bool = True) -> int | None:
    """Open the lease file and try to lock it exclusively; the fd if nobody holds it, else None."""
    try:
        fd = os.open(lease_path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | (os.O_CREAT if create else 0), 0o600)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


_trash_numbers = itertools.count()
TRASH_PREFIX = ".trash."
"""A cache being removed is renamed ``.trash.<pid>.<n>`` (:func:`remove_dir`): ``pid`` the remover's."""


def remove_dir(path: str) -> None:
    """Remove a cache directory: rename it away first so no reader sees it half-deleted. Caller holds the root
    lock (every caller does), from the rename to the last file: whoever holds that lock sees no removal under way,
    and a ``.trash.`` directory it finds is one whose remover was killed (:func:`remover_of`)."""
    trash = f"{os.path.dirname(path)}/{TRASH_PREFIX}{os.getpid()}.{next(_trash_numbers)}"
    try:
        os.rename(path, trash)
    except FileNotFoundError:
        return
    shutil.rmtree(trash, ignore_errors=True)


def remover_of(name: str) -> int | None:
    """The pid of the process that began removing the cache now named ``name`` (``.trash.<pid>.<n>``), or None if
    ``name`` is not such a half-removed cache's. Under the root lock no removal is under way, so the directory is
    abandoned whatever the pid is now: that process was killed (SIGKILL in the middle of the removal), and the pid
    may since be another process's, or name one in another pid namespace sharing the tmpfs (containers with
    ``--ipc=host``)."""
    if not name.startswith(TRASH_PREFIX):
        return None
    pid, dot, n = name[len(TRASH_PREFIX) :].partition(".")
    return int(pid) if pid.isdigit() and dot and n.isdigit() else None


def remove_abandoned(root: str, name: str) -> bool:
    """Remove the half-removed cache ``name`` of ``root`` (:func:`remover_of`) if it is still there; True if it
    was. Caller holds the root lock: no remover is at work on it."""
    path = os.path.join(root, name)
    if remover_of(name) is None or not owned_directory(path):
        return False
    shutil.rmtree(path, ignore_errors=True)
    return not os.path.lexists(path)


def owned_directory(path: str) -> bool:
    """Whether ``path`` is a real directory (not a link) owned by this user."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid()


# ------------------------------------------------------------------------------------------- keep_alive
# A cache made with keep_alive records its seconds (a ``keep_alive`` file); its window runs from the lease file's mtime,
# which the last user moves as it leaves. Within the window nobody removes it, even if its keeper was killed with the
# job (a Slurm step's cgroup): a stale cache within its window is reused as it is, and a watcher (its own, or one the
# Slurm epilog starts) removes it when the window ends.
def record_keep_alive(path: str, seconds: float) -> None:
    """Record that the cache at ``path`` is to outlive its last user by ``seconds`` (the longest any user asked)."""
    if seconds <= 0 or recorded_keep_alive(path) >= seconds:
        return
    fd = os.open(os.path.join(path, "keep_alive"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW,
                 0o600)  # fmt: skip
    try:
        os.write(fd, f"{seconds!r}\n".encode())
    finally:
        os.close(fd)


def recorded_keep_alive(path: str) -> float:
    """The keep_alive seconds recorded for the cache at ``path`` (0: none)."""
    try:
        with open(os.path.join(path, "keep_alive")) as f:
            return max(0.0, float(f.read().strip() or 0))
    except (OSError, ValueError):
        return 0.0


def keep_alive_left(path: str) -> float:
    """Seconds left in the keep_alive window of the cache at ``path`` (0: none, or it ended)."""
    seconds = recorded_keep_alive(path)
    if seconds <= 0:
        return 0.0
    try:
        return max(0.0, os.stat(os.path.join(path, "lease")).st_mtime + seconds - time.time())
    except OSError:
        return 0.0


def reclaim_stale(root: str, skip: str | None = None) -> list[str]:
    """Remove caches nobody holds a lease on (their users crashed), except kept ones. Caller holds the root lock."""
    removed = []
    for name in os.listdir(root):
        path = os.path.join(root, name)
        if not owned_directory(path):
            continue  # not ours (planted by another user, or not a directory): never removed
        if remover_of(name) is not None:  # its remover was killed: we hold the root lock, every remover does
            remove_abandoned(root, name)
            continue
        if name.startswith(".") or path == skip:
            continue
        if os.path.exists(os.path.join(path, "keep")) or not os.path.exists(os.path.join(path, "stats")):
            continue  # kept on purpose, or not one of our caches
        if keep_alive_left(path) > 0:
            continue  # within its keep_alive window
        if _remove_if_unused(path):
            removed.append(name)
    return removed


def _remove_if_unused(path: str) -> bool:
    """Remove the cache at ``path`` if nobody holds its lease; True if removed. Caller holds the root lock."""
    fd = try_exclusive(os.path.join(path, "lease"), create=False)
    if fd is None:
        return False
    try:
        remove_dir(path)
    finally:
        os.close(fd)
    return True


def reclaim_unused(root: str, path: str, unused_since: list[float]) -> bool:
    """The watcher's look at its cache (:func:`monai_cache.keeper.watch`): remove it if nobody holds its lease (its
    users died, SIGKILL included: the kernel dropped their locks), with any half-removed cache whose remover was
    killed. A cache with a keep_alive window is removed when the window ends, counted from when the watcher first
    found it unused (``unused_since``, the watcher's memory between looks: its users and keeper died). True once there
    is nothing left to watch: the cache is gone (removed now or by its last user) or kept on purpose (``keep``); False
    while someone uses it or its window runs. Taken under the root lock, as every join and leave."""
    with RootLock(root, create=False):
        if not owned_directory(path) or os.path.exists(os.path.join(path, "keep")):
            return True
        lease = os.path.join(path, "lease")
        fd = try_exclusive(lease, create=False)
        if fd is None:
            unused_since.clear()
            return False  # in use (a lease held); a cache is never without its lease file under the root lock
        os.close(fd)
        if recorded_keep_alive(path) > 0:
            if not unused_since:  # its users (and keeper) are gone: the window starts now
                unused_since.append(time.time())
                with contextlib.suppress(OSError):
                    os.utime(lease)
            if keep_alive_left(path) > 0:
                return False
        if not _remove_if_unused(path):
            return False
        for name in os.listdir(root):
            if remover_of(name) is not None:
                remove_abandoned(root, name)
        return True


def reclaim_job(root: str, job: str, mark: str, lingering: list[str] | None = None) -> list[str]:
    """Remove the caches of ``root`` that Slurm job ``job`` used (they hold ``mark + job``) and nobody holds a lease
    on any more, except kept ones; and half-removed caches whose remover was killed. Another job's caches, and any
    cache still in use (by another job sharing it, or a keeper), are left alone. A cache made with keep_alive is not
    removed: its window starts now (its lease touched) and its path is added to ``lingering``, for a watcher to remove
    it when the window ends. Returns the names removed."""
    removed = []
    with RootLock(root):
        for name in os.listdir(root):
            path = os.path.join(root, name)
            if not owned_directory(path):
                continue
            if remover_of(name) is not None:
                if remove_abandoned(root, name):
                    removed.append(name)
                continue
            if not os.path.exists(os.path.join(path, mark + job)) or os.path.exists(os.path.join(path, "keep")):
                continue
            if recorded_keep_alive(path) > 0:
                fd = try_exclusive(os.path.join(path, "lease"), create=False)
                if fd is not None:  # unused: the window runs from the job's end, not from its last leave
                    with contextlib.suppress(OSError):
                        os.utime(os.path.join(path, "lease"))
                    os.close(fd)
                    if lingering is not None:
                        lingering.append(path)
                continue
            if _remove_if_unused(path):
                removed.append(name)
    return removed


def touch_private(path: str) -> None:
    """Create an empty file only this user can read (``keep``), or leave it as it is."""
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600))


def unlink_quiet(path: str) -> None:
    """Remove a file (or a directory and what it holds); one already gone is no error."""
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.unlink(path)
    except FileNotFoundError:
        pass


def release_keeper(root: str, path: str, lease_fd: int, mark: str, mark_fd: int) -> int | None:
    """A keeper's end (:mod:`monai_cache.keeper`): if nobody else holds a lease, drop its own and its mark and remove
    the cache (unless kept), as its last user would have; returns None. If others still use it (ranks orphaned by a
    killed agent), keep holding: returns the keeper's lease descriptor (a new one) to try again later."""
    with RootLock(root):
        os.close(lease_fd)
        lease = os.path.join(path, "lease")
        fd = try_exclusive(lease, create=False)
        if fd is None and os.path.isdir(path):
            with contextlib.suppress(OSError):
                again = os.open(lease, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
                fcntl.flock(again, fcntl.LOCK_SH)  # others hold it shared: granted at once (we hold the root lock)
                return again
        unlink_quiet(mark)
        os.close(mark_fd)
        if fd is not None:
            try:
                if not os.path.exists(os.path.join(path, "keep")):
                    remove_dir(path)
            finally:
                os.close(fd)
        return None
