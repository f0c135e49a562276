"""What both stores need from the process they run in: shared counters, fork and exit hooks, temporary
files, locks and I/O loops.

Nothing here knows a cache format. :mod:`monai_cache.shm` and :mod:`monai_cache.disk` build on it:

* :class:`SharedCounters`: named counters in shared memory, for every process that maps them (all the users
  of one shared-memory cache, or one process and its forked DataLoader workers).
* :func:`register`: an object's ``_after_fork_in_child`` runs in every forked child, and its ``_at_exit``
  when the process ends normally, DataLoader workers included.
* :func:`temp_name` and :func:`sweep_temp_files`: one naming scheme for files being written, so that the
  left-overs of killed writers are recognised and removed.
* :class:`OFDLock`: byte-range locks that the kernel releases when their holder dies.
* :func:`write_all` and :func:`read_into`: ``pwrite``/``preadv`` loops.
* :func:`release_freed_memory` and :func:`keep_inherited_pages_shared`: a process's heap, given back after large
  items, and kept shared with a forked worker's parent.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import gc
import hashlib
import itertools
import mmap
import multiprocessing.util
import os
import socket
import struct
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

__all__ = [
    "COUNTERS",
    "COUNTERS_SIZE",
    "ENV_NODE_ID",
    "HOST_TAG",
    "SLOTS_AT",
    "OFDLock",
    "SharedCounters",
    "fallocate",
    "freed_large_item",
    "keep_inherited_pages_shared",
    "node_identity",
    "ofd_lock",
    "ofd_unlock",
    "arm_exit_hook",
    "cache_stats",
    "pid_alive",
    "read_into",
    "register",
    "release_freed_memory",
    "sweep_temp_files",
    "temp_name",
    "temp_owner",
    "write_all",
]

# ------------------------------------------------------------------------------------------------ the heap
# glibc's malloc raises its mmap threshold to the size of each large block freed (up to 32 MiB), so once a process
# has freed one computed volume, the next ones come from its heap and stay there when freed: a process computing
# items of 25 MiB grew by 25 MiB per item it did not keep, 250 MiB over ten (measured in a memory cgroup, where it
# ends in the OOM killer). Giving the freed pages back before the next large item is computed bounds that at about
# one item; malloc_trim costs under a microsecond when there is nothing to give back. The shared-memory store asks
# for it only while memory is tight (shm._TIGHT_ITEMS): with room to spare, the pages given back are faulted in again
# by the next item (5,000-11,000 faults, 7-13 % of a CT volume's compute), and the heap stays at about one item
# without it.

_freed_large = False


def freed_large_item() -> None:
    """Note that this process computed an item of 1 MiB or more, which it will free: see
    :func:`release_freed_memory`."""
    global _freed_large
    _freed_large = True


def release_freed_memory(force: bool = False) -> None:
    """Give the heap pages freed since the last large item back to the OS (``malloc_trim``; glibc only), if this
    process computed a large item since (or ``force``)."""
    global _freed_large
    if not (_freed_large or force):
        return
    _freed_large = False
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def _malloc_trim() -> Any:
    global _TRIM
    if _TRIM is None:
        try:
            _TRIM = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):  # not glibc: nothing to do
            _TRIM = False
    return _TRIM or None


_TRIM: Any = None

# A forked DataLoader worker shares its parent's heap page by page until either writes to a page. A full garbage
# collection writes to every object it examines (its gc header), so the first one in a worker copies every page that
# holds an object inherited from the parent (about 100 MiB per worker with torch and MONAI imported); in a spawned
# worker, each one walks all that the imports made. Frozen objects (gc.freeze) are left out of every collection;
# objects made afterwards are collected as usual. What a worker holds when it starts reading (its dataset, the
# loader's state, the modules) lives as long as it does; one of them that becomes cyclic garbage later stays until
# the worker exits. Measured in docs/loader.md ("Garbage collection in the workers").

_frozen_in = -1  # pid of the process that froze its objects


def keep_inherited_pages_shared() -> None:
    """In a DataLoader worker, leave the objects it holds now out of its garbage collections (``gc.freeze``), once.

    Our datasets call it on their first read in a worker of any loader, our DataLoader on its first batch: see the
    comment above. Cheap after the first call in a process.
    """
    global _frozen_in
    if _frozen_in != _my_pid:
        _frozen_in = _my_pid
        gc.freeze()


# ------------------------------------------------------------------------------------------------ processes


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs; a zombie (dead, not yet reaped by its parent) counts as dead."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, another user's
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return not os.path.isdir("/proc/self")  # gone since kill(), unless there is no /proc to ask
    except OSError:
        return True
    # "pid (comm) state ...": comm may hold spaces and parentheses, so the state follows the last ")"
    state = stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3]
    return state not in (b"Z", b"X")


_my_pid = os.getpid()


def _pid() -> int:
    """This process's id, without a system call (updated in forked children)."""
    return _my_pid


_registered: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
_registry_lock = threading.Lock()
_exit_hook_pid = -1
EXIT_PRIORITY = 100  # multiprocessing runs finalizers of priority >= 0 before it joins the child processes


def register(obj: Any, exit_order: int = 0) -> None:
    """Call ``obj._after_fork_in_child()`` in every child forked from now on, and ``obj._at_exit()`` when this
    process exits normally, while ``obj`` lives (it is held weakly).

    The exit calls run from :mod:`multiprocessing`'s exit function, in ``exit_order`` (lowest first): at
    interpreter exit in the main process, and at the end of a child started by multiprocessing (a DataLoader
    worker ends with ``os._exit`` and never runs ``atexit``). Exceptions in the calls are swallowed: an exit
    must not fail because a cache could not be tidied.

    Args:
        obj: an object with ``_after_fork_in_child()`` and ``_at_exit()`` methods (and a ``__weakref__``).
        exit_order: when its ``_at_exit`` runs relative to the others' (e.g. flush writes before leaving).
    """
    with _registry_lock:
        _registered[obj] = exit_order
    arm_exit_hook()


def arm_exit_hook() -> None:
    """Make sure the exit calls of :func:`register` run in this process.

    Call it when an object registered before a fork gets work to finish in the child (e.g. a store's first
    write in a DataLoader worker): multiprocessing clears the finalizers a child inherits when it starts one.
    Cheap after the first call in a process.
    """
    global _exit_hook_pid
    if _exit_hook_pid != os.getpid():
        with _registry_lock:
            if _exit_hook_pid != os.getpid():
                multiprocessing.util.Finalize(None, _run_at_exit, exitpriority=EXIT_PRIORITY)
                _exit_hook_pid = os.getpid()


def _run_at_exit() -> None:
    with _registry_lock:
        objects = sorted(_registered.items(), key=lambda kv: kv[1])
    for obj, _order in objects:
        with contextlib.suppress(Exception):
            obj._at_exit()


def _after_fork_in_child() -> None:
    global _registry_lock, _my_pid
    _my_pid = os.getpid()
    _registry_lock = threading.Lock()  # another thread of the parent may have held it
    for obj in list(_registered):
        obj._after_fork_in_child()
    # The exit hook is armed again by the next register() or arm_exit_hook() here: a child started by
    # multiprocessing drops the finalizers made before its target runs.


os.register_at_fork(after_in_child=_after_fork_in_child)

# ------------------------------------------------------------------------------------------------ locks

# struct flock on Linux (x86-64 and aarch64): short l_type, short l_whence, off_t l_start, off_t l_len, pid_t l_pid.
_FLOCK = struct.Struct("hhqqi4x")


def ofd_lock(fd: int, start: int = 0, blocking: bool = True) -> bool:
    """Take the OFD write lock on byte ``start`` of the file open as ``fd``; False if busy and not ``blocking``."""
    while True:
        try:
            fcntl.fcntl(fd, fcntl.F_OFD_SETLKW if blocking else fcntl.F_OFD_SETLK,
                        _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, start, 1, 0))
            return True
        except OSError as e:
            if not blocking and e.errno in (errno.EAGAIN, errno.EACCES):
                return False
            if e.errno in (errno.EINTR, errno.EDEADLK):
                time.sleep(0.001)
                continue
            raise


def ofd_unlock(fd: int, start: int = 0) -> None:
    """Release the OFD lock on byte ``start`` of ``fd``."""
    fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _FLOCK.pack(fcntl.F_UNLCK, os.SEEK_SET, start, 1, 0))


class OFDLock:
    """A byte-range lock owned by an open file description (Linux OFD lock).

    Unlike ``fcntl.lockf`` locks, these are not shared by the threads of a process (each acquisition opens
    its own descriptor), are not lost when another descriptor of the file is closed, and are released by
    the kernel when the holder dies: a dead holder never blocks anyone.

    Args:
        path: the lock file (created with mode 0600 if missing).
        start: the byte to lock: one file serves many locks.
    """

    __slots__ = ("_fd", "_path", "_start")

    def __init__(self, path: str, start: int = 0) -> None:
        self._path = path
        self._start = start
        self._fd = -1

    def acquire(self, blocking: bool = True, timeout: float | None = None) -> bool:
        """Take the lock; False if another holder has it and not ``blocking``, or still has it after ``timeout``
        seconds (``None``: wait as long as it takes)."""
        self._fd = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            if timeout is None or not blocking:
                if ofd_lock(self._fd, self._start, blocking):
                    return True
            else:
                deadline = time.monotonic() + timeout
                while True:  # F_OFD_SETLKW has no timeout: poll
                    if ofd_lock(self._fd, self._start, blocking=False):
                        return True
                    if time.monotonic() >= deadline:
                        break
                    time.sleep(0.01)
        except BaseException:
            os.close(self._fd)
            self._fd = -1
            raise
        os.close(self._fd)
        self._fd = -1
        return False

    def release(self) -> None:
        """Give the lock back (no-op if not held)."""
        if self._fd >= 0:
            try:
                ofd_unlock(self._fd, self._start)
            finally:
                os.close(self._fd)
                self._fd = -1

    def __enter__(self) -> OFDLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


# ------------------------------------------------------------------------------------------------ counters

COUNTERS = (
    "hits", "misses", "writes", "skipped", "unsupported", "corrupt", "write_errors", "writes_pending",
    "bytes_read", "bytes_written", "bytes_raw", "bytes_encoded",
)
"""What every store counts, in every process (:func:`cache_stats` documents them); a store may add its own."""


def cache_stats(process: Mapping[str, int], total: Mapping[str, int], entries: int, nbytes: int) -> dict[str, Any]:
    """The one shape of ``cache_stats()``, for every dataset of monai_cache::

        {"process": {...}, "total": {...}, "stored": {"entries": int, "bytes": int}}

    ``process`` counts this process only (in a DataLoader worker: that worker; in a main process whose workers do
    the reading: nothing). ``total`` counts every process that shares the cache's counters: for the shared-memory
    cache, every process of the machine using it (DataLoader workers and ranks); for the disk cache and a
    ``CacheDataset``'s private cache, this process and the DataLoader workers forked from it (spawned workers
    count alone). Both hold the same keys:

    * ``hits``: items read from the cache; ``misses``: items computed because they were not cached;
    * ``writes``: entries stored; ``skipped``: entries not stored (no room, writes disabled, a value the codec
      cannot store, or another process stored the same entry first); ``unsupported``: items holding a value
      the codec cannot store (they are computed on every read); ``corrupt``: damaged entries found (removed or
      ignored, then recomputed); ``write_errors``: writes that failed; ``writes_pending``: entries waiting for
      the background writer;
    * ``bytes_read`` and ``bytes_written``: bytes read from and written to the cache (for the disk cache, file
      bytes: compressed); ``bytes_raw``: the stored items' tensor and array bytes in memory; ``bytes_encoded``:
      the encoded items' bytes (after downcasting, before compression); ``compression_ratio``:
      ``bytes_raw / bytes_written`` (0.0 before the first write).

    ``stored`` is what the cache holds now: ``entries`` and ``bytes`` (for the disk cache, counted from the
    directory at each call: entry files and pack records, file sizes).

    Args:
        process: this process's counters.
        total: the shared counters.
        entries: entries held.
        nbytes: bytes held.
    """
    return {
        "process": _with_ratio(process),
        "total": _with_ratio(total),
        "stored": {"entries": int(entries), "bytes": int(nbytes)},
    }


def _with_ratio(counts: Mapping[str, int]) -> dict[str, Any]:
    out: dict[str, Any] = {name: int(counts.get(name, 0)) for name in COUNTERS}
    out["compression_ratio"] = out["bytes_raw"] / out["bytes_written"] if out["bytes_written"] else 0.0
    return out

_U64 = struct.Struct("<Q")
_I64 = struct.Struct("<q")
COUNTERS_SIZE = 4096
_FLAGS_AT = 8
_FIELDS_AT = 16
SLOTS_AT = 512
"""Per-process slots of (hits, bytes_read), 16 bytes each, from here to the end of a counters mapping."""
_SLOT = struct.Struct("<QQ")
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.ENOMEM)  # tmpfs full, quota, or no memory to back it


class SharedCounters:
    """Named signed 64-bit counters in a 4 KiB shared mapping, for every process that maps it.

    Backed by a file (``path``: every process that opens it shares the counters, e.g. the users of one
    shared-memory cache on a machine), or by an anonymous memory file that forked children inherit (one
    process and its DataLoader workers). A pickled copy (a spawned worker) starts counters of its own.

    Updates take an OFD lock on this process's own descriptor of the file (released by the kernel if the
    holder dies: a process killed while counting blocks nobody) plus a thread lock. Reads of cached items
    are counted without either: each process owns a slot (it holds an OFD lock on it) where it adds its
    ``hits`` and ``bytes_read``, and :meth:`snapshot` sums the slots. A slot keeps its counts when its owner
    exits; the next process to claim it adds to them.

    Args:
        fields: the counter names, in layout order (at most 60).
        path: the backing file (created with mode 0600 and zero-filled if new or short); ``None`` for an
            anonymous one.
        magic: the layout's identifier, written at offset 0 of a fresh file.
    """

    __slots__ = ("__weakref__", "_fd", "_fields", "_lock", "_lock_pid", "_magic", "_map", "_memfd", "_offsets",
                 "_open_fds", "_path", "_slot", "_slot_pid", "_thread_lock_pid")

    def __init__(self, fields: Sequence[str], path: str | None = None, magic: int = 0) -> None:
        if _FIELDS_AT + 8 * len(fields) > SLOTS_AT:
            raise ValueError(f"too many counters: {len(fields)}")
        self._fields = tuple(fields)
        self._offsets = {name: _FIELDS_AT + 8 * i for i, name in enumerate(self._fields)}
        self._path = path
        self._magic = magic
        self._memfd = -1
        # Descriptors to close when the counters are collected (not at interpreter exit: stores still count
        # while they flush at exit, after weakref's exit hook has run).
        self._open_fds: list[int] = []
        weakref.finalize(self, _close_fds, self._open_fds).atexit = False
        if path is None:
            self._memfd = os.memfd_create("monai_cache-counters", os.MFD_CLOEXEC)
            self._open_fds.append(self._memfd)
            os.ftruncate(self._memfd, COUNTERS_SIZE)
            self._map = mmap.mmap(self._memfd, COUNTERS_SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            _U64.pack_into(self._map, 0, magic)
        else:
            self._map = self._map_file(path)
        self._lock = threading.Lock()
        self._thread_lock_pid = os.getpid()
        self._fd = -1  # this process's own descriptor, for its OFD locks
        self._lock_pid = -1
        self._slot = -1  # offset of this process's read slot; -1: none (count under the lock)
        self._slot_pid = -1

    def _map_file(self, path: str) -> mmap.mmap:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            try:
                if os.fstat(fd).st_size < COUNTERS_SIZE:
                    # Allocate the page now: a sparse one would raise SIGBUS at its first write on a full tmpfs.
                    fallocate(fd, 0, COUNTERS_SIZE)
                    if os.fstat(fd).st_size < COUNTERS_SIZE:  # (file systems without fallocate)
                        os.ftruncate(fd, COUNTERS_SIZE)
                return mmap.mmap(fd, COUNTERS_SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            except OSError as e:
                if e.errno not in _NO_SPACE:
                    raise
                # Shared memory is full before anything is stored: count in private memory; the first
                # write will fail for the same reason and warn once that items are served uncached.
                self._path = None
                private = mmap.mmap(-1, COUNTERS_SIZE)
                _U64.pack_into(private, 0, self._magic)
                return private
        finally:
            os.close(fd)

    # -- pickling: a spawned process starts counters of its own (file-backed ones are reopened by path) --
    def __reduce__(self) -> tuple:
        return (SharedCounters, (self._fields, self._path, self._magic))

    @property
    def magic(self) -> int:
        """The layout identifier found at offset 0 (0 for a fresh file)."""
        return 0 if self._map.closed else int(_U64.unpack_from(self._map, 0)[0])

    def _own_fd(self) -> int:
        # One descriptor per process, opened once: an OFD lock belongs to the open file description, which a
        # forked child shares with its parent, so a child opens its own. -1 if the file is gone.
        if self._lock_pid != os.getpid():
            self._lock_pid = os.getpid()
            self._fd = -1  # the parent's descriptor stays the parent's (closed with the exec/exit)
            self._slot_pid = -1
            if self._memfd >= 0:
                source = f"/proc/self/fd/{self._memfd}"
            elif self._path is not None:
                source = self._path
            else:
                return -1
            try:
                self._fd = os.open(source, os.O_RDWR | os.O_CLOEXEC)
            except OSError:
                self._fd = -1
            else:
                self._open_fds.append(self._fd)
        return self._fd

    def _thread_lock(self) -> threading.Lock:
        if self._thread_lock_pid != os.getpid():  # forked: a thread of the parent may have held it
            self._lock, self._thread_lock_pid = threading.Lock(), os.getpid()
        return self._lock

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """Exclusive across processes and threads."""
        with self._thread_lock():
            fd = self._own_fd()
            if fd < 0:  # the file was removed under us (or no /proc): the counters are ours alone
                yield
                return
            ofd_lock(fd)
            try:
                yield
            finally:
                ofd_unlock(fd)

    def add(self, deltas: Mapping[str, int]) -> dict[str, int]:
        """Add ``deltas`` to counters, atomically across processes; returns the new values of those counters."""
        # _locked() spelled out: a miss of a small item updates the counters once, and the generator's
        # set-up showed in its cost
        with self._lock if self._thread_lock_pid == _pid() else self._thread_lock():
            fd = self._fd if self._lock_pid == _pid() else self._own_fd()
            if fd >= 0:
                ofd_lock(fd)
            try:
                if self._map.closed:
                    return dict.fromkeys(deltas, 0)
                out = {}
                for name, d in deltas.items():
                    off = self._offsets[name]
                    v = _I64.unpack_from(self._map, off)[0] + d
                    _I64.pack_into(self._map, off, v)
                    out[name] = v
                return out
            finally:
                if fd >= 0:
                    ofd_unlock(fd)

    def count_read(self, nbytes: int) -> None:
        """``hits += 1`` and ``bytes_read += nbytes``, in this process's own slot: no system call once claimed."""
        with self._lock if self._thread_lock_pid == _pid() else self._thread_lock():
            if self._slot_pid != _pid():
                self._claim_slot()
            off = self._slot
            if off >= 0 and not self._map.closed:
                hits, nread = _SLOT.unpack_from(self._map, off)
                _SLOT.pack_into(self._map, off, hits + 1, nread + nbytes)
                return
        self.add({"hits": 1, "bytes_read": nbytes})  # every slot taken by a live process

    def _claim_slot(self) -> None:
        # Called with self._lock held.
        self._slot = -1
        fd = self._own_fd()
        self._slot_pid = os.getpid()
        if fd < 0:
            return
        for off in range(SLOTS_AT, COUNTERS_SIZE, _SLOT.size):
            if ofd_lock(fd, off, blocking=False):
                self._slot = off
                return

    def flagged(self, flag: int) -> bool:
        """Whether bit ``flag`` is set (by any process sharing the counters)."""
        if self._map.closed:
            return False
        return bool(_U64.unpack_from(self._map, _FLAGS_AT)[0] & flag)

    def first(self, flag: int) -> bool:
        """Set bit ``flag``; True for the one process (of those sharing the counters) that set it first."""
        with self._locked():
            if self._map.closed:
                return False
            v = _U64.unpack_from(self._map, _FLAGS_AT)[0]
            _U64.pack_into(self._map, _FLAGS_AT, v | flag)
            return not v & flag

    def reset(self) -> None:
        """Zero every counter, flag and slot, and write the layout's magic."""
        with self._locked():
            self._map[:] = bytes(COUNTERS_SIZE)
            _U64.pack_into(self._map, 0, self._magic)

    def snapshot(self) -> dict[str, int]:
        """Every counter, with ``hits`` and ``bytes_read`` summed over the per-process slots."""
        if self._map.closed:  # released: nothing is held any more
            return dict.fromkeys(self._fields, 0)
        return unpack_counters(self._map, self._fields)

    def close(self) -> None:
        """Give up this process's descriptor (and read slot; its counts stay) and the mapping."""
        with self._thread_lock():
            if self._fd >= 0 and self._lock_pid == os.getpid():
                self._open_fds.remove(self._fd)
                with contextlib.suppress(OSError):
                    os.close(self._fd)
            self._fd, self._lock_pid, self._slot, self._slot_pid = -1, -1, -1, -1
            with contextlib.suppress(BufferError, ValueError):
                self._map.close()


def _close_fds(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
    fds.clear()


def unpack_counters(raw: bytes | mmap.mmap, fields: Sequence[str], slots: bool = True) -> dict[str, int]:
    """The counters of a :class:`SharedCounters` layout read from ``raw`` (its 4 KiB).

    Args:
        raw: the mapping or the file's bytes.
        fields: the counter names in layout order.
        slots: add the per-process slots to ``hits`` and ``bytes_read`` (False: the shared fields alone).
    """
    out = {name: _I64.unpack_from(raw, _FIELDS_AT + 8 * i)[0] for i, name in enumerate(fields)}
    if slots and len(raw) >= COUNTERS_SIZE:
        for off in range(SLOTS_AT, COUNTERS_SIZE, _SLOT.size):
            hits, nread = _SLOT.unpack_from(raw, off)
            if "hits" in out:
                out["hits"] += hits
            if "bytes_read" in out:
                out["bytes_read"] += nread
    return out


def read_counters(path: str, fields: Sequence[str]) -> tuple[int, dict[str, int]] | None:
    """``(magic, counters)`` of a counters file, without mapping it; None if it cannot be read.

    Args:
        path: the file.
        fields: the counter names in layout order.
    """
    try:
        with open(path, "rb") as f:
            raw = f.read(COUNTERS_SIZE)
    except OSError:
        return None
    if len(raw) < _FIELDS_AT + 8 * len(fields):
        return None
    return _U64.unpack_from(raw, 0)[0], unpack_counters(raw, fields)


# ------------------------------------------------------------------------------------------- temporary files

ENV_NODE_ID = "MONAI_CACHE_NODE_ID"


def node_identity() -> str:
    """This machine's identity: processes with equal identities share a machine (its ``/dev/shm``, its pids).

    ``$MONAI_CACHE_NODE_ID`` if set; otherwise the host name, plus the kernel's boot id where Linux provides one,
    so that two machines that happen to share a host name are still told apart. Set ``MONAI_CACHE_NODE_ID`` when
    host names do not tell which processes share a machine, e.g. containers with their own host names sharing
    the host's ``/dev/shm`` (``--ipc=host``) should get one value. ``ShardedDistributedSampler(shard_by="node")``
    groups ranks by it, and files that several machines may write into one cache directory are named by it.
    """
    override = os.environ.get(ENV_NODE_ID)
    if override:
        return override
    host = socket.gethostname()
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f"{host} (boot {f.read().strip()[:8]})"
    except OSError:
        return host


HOST_TAG = hashlib.sha1(node_identity().encode()).hexdigest()[:8]
"""This machine in file names (8 hex digits of SHA-1 of :func:`node_identity`): processes of several machines
may write into one cache directory, and a process id means something on its own machine only."""
TMP_SUFFIX = ".tmp"
STALE_TMP_SECONDS = 3600.0
"""A temporary file older than this is a left-over of a killed writer, whichever machine wrote it."""
_tmp_numbers = itertools.count()


def temp_name(label: str, kind: str = "w") -> str:
    """A name for a file being written, unique in this process: ``.<label>.<host>.<pid>.<kind><n>.tmp``.

    It never looks like an entry (leading dot), and it names its writer, so that :func:`sweep_temp_files`
    removes what a killed writer left.

    Args:
        label: a short hint of what is written (letters, digits, ``_-``), e.g. the start of an entry key.
        kind: one letter or word saying why (``w``: a write, ``bad``: a damaged file moved aside).
    """
    label = label.replace(".", "_")  # the dots separate the fields
    return f".{label}.{HOST_TAG}.{os.getpid()}.{kind}{next(_tmp_numbers)}{TMP_SUFFIX}"


def temp_owner(name: str) -> tuple[str, int] | None:
    """``(host tag, pid)`` of the writer of a :func:`temp_name`, or None if ``name`` is not one."""
    if not (name.startswith(".") and name.endswith(TMP_SUFFIX)):
        return None
    parts = name.split(".")
    if len(parts) < 6 or not parts[3].isdigit():
        return None
    return parts[2], int(parts[3])


def sweep_temp_files(
    directory: str, max_age: float = STALE_TMP_SECONDS, adopt: Callable[[str, str], bool] | None = None
) -> list[tuple[str, int]]:
    """Remove temporary files left by killed writers: those of dead processes of this machine, and any older
    than ``max_age`` seconds.

    Args:
        directory: where to look.
        max_age: age in seconds after which a temporary file counts as left over, whoever wrote it.
        adopt: called as ``adopt(path, name)`` for each left-over first; when it returns True it took the file
            (e.g. a complete entry renamed to its name), which is then neither removed nor counted.

    Returns:
        ``[(path, size), ...]`` of the files removed by this call.
    """
    removed = []
    now = time.time()
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return []
    for entry in entries:
        owner = temp_owner(entry.name)
        if owner is None:
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        dead = owner[0] == HOST_TAG and not pid_alive(owner[1])
        if dead or now - st.st_mtime > max_age:
            if adopt is not None and adopt(entry.path, entry.name):
                continue
            try:
                os.unlink(entry.path)
            except OSError:
                continue  # another process swept it first
            removed.append((entry.path, st.st_size))
    return removed


# ------------------------------------------------------------------------------------------------ I/O

_IO_CHUNK = 1 << 30  # Linux moves at most ~2 GiB per read/write call
_IOV_MAX = 1024  # Linux's limit on the buffers of one pwritev


def fallocate(fd: int, offset: int, size: int) -> None:
    """Reserve the blocks now: a full tmpfs then fails with ENOSPC here rather than with SIGBUS later."""
    try:
        os.posix_fallocate(fd, offset, size)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise


def write_all(fd: int, chunks: Iterable[Any], pos: int) -> int:
    """``pwrite`` every chunk (bytes-like) one after another from ``pos``; returns the bytes written.

    Chunks are written with one ``pwritev`` while they fit in one call (a small entry's prefix, header, padding
    and data: one system call instead of four); a short write, or a chunk too large for it, goes on chunk by chunk.
    """
    start = pos
    views = [memoryview(chunk).cast("B") for chunk in chunks]
    if 0 < len(views) <= _IOV_MAX and sum(v.nbytes for v in views) <= _IO_CHUNK:
        written = os.pwritev(fd, views, pos)
        pos += written
        while views and written >= views[0].nbytes:  # drop what the one call wrote: the rest goes on below
            written -= views[0].nbytes
            views.pop(0)
        if views:
            views[0] = views[0][written:]
    for view in views:
        while view.nbytes:
            n = os.pwrite(fd, view[:_IO_CHUNK], pos)
            pos += n
            view = view[n:]
    return pos - start


def read_into(fd: int, out: memoryview, pos: int) -> int:
    """``preadv`` into ``out`` from ``pos`` until it is full or the file ends; returns the bytes read."""
    got = 0
    while got < out.nbytes:
        n = os.preadv(fd, [out[got : got + _IO_CHUNK]], pos + got)
        if n == 0:
            break
        got += n
    return got
