"""A node-wide cache of encoded items in POSIX shared memory (``/dev/shm``), shared by every process.

Layout (``root`` is ``/dev/shm`` unless configured; docs/shared-memory.md describes it in full)::

    root/monai_cache-<uid>/            mode 0700, owned by the user: nobody else can read or plant entries
        .lock                          flock'ed while a process joins or leaves a cache (short)
        <key>/                         one directory per dataset fingerprint
            lease                      every process using the cache holds a shared flock on it
            keep                       present when the cache is to outlive its users (keep_warm=True)
            stats                      4 KiB of shared counters (bytes, entries, hits, misses, ...) and
                                       per-process hit slots
            locks                      byte i is OFD-locked while someone computes entry i
            index                      a 32-byte slot per entry: where it lives, its tag and checksum
            s.<n>                      a segment: small entries (under PACK_LIMIT) packed one after another
            <i>.e                      entry i when it is PACK_LIMIT bytes or larger: a file of its own
            .tmp.<pid>.<tid>.<n>       a large entry being written; renamed to <i>.e when complete

Why plain files and not ``multiprocessing.shared_memory``: on Linux POSIX shared memory *is* a tmpfs
file, and Python 3.11's ``SharedMemory`` registers every segment with a resource tracker that unlinks it
when any independently started process that attached to it exits (torchrun ranks are such processes).
Files we open and ``mmap`` ourselves are not tracked, so nothing deletes entries under other processes.

Guarantees:

* An entry becomes visible only when its index slot is written, after its bytes are complete (a large
  entry's file is renamed into place first), so a crash at any moment never leaves an entry that a reader
  accepts; readers also validate the slot (checksum, tag) and the blob and treat a bad one as missing.
* Reads never share writable memory: a large entry is mapped copy-on-write (``MAP_PRIVATE``, zero-copy),
  a small one is read into a private buffer. A transform writing into the tensor it got never changes the
  shared copy.
* Lifetime: each process using a cache holds a shared ``flock`` on its lease file; the kernel drops it when
  the process dies. The last process to leave normally removes the cache. A cache whose lease nobody holds
  is stale (its users crashed) and is reclaimed by the next process that joins any cache, unless it was
  created with ``keep_warm=True``.
* Computing an entry takes an OFD byte-range lock on ``locks``: concurrent processes (and threads) that
  miss the same entry compute it once, and a holder that dies releases the lock.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import itertools
import mmap
import os
import shutil
import stat
import struct
import threading
import weakref
import zlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the codec imports torch (seconds); `monai-cache ls` and `clear` need none of it
    from monai_cache import codec
from monai_cache.utils import OFDLock, format_bytes, ofd_lock, ofd_unlock, parse_bytes, pid_alive, warn

__all__ = ["SharedMemoryStore", "cache_root", "default_shm_dir", "list_caches", "remove_cache"]

ENV_SHM_DIR = "MONAI_CACHE_SHM_DIR"
_ENTRY_SUFFIX = ".e"
_TMP_PREFIX = ".tmp."
_MISSING = object()
_CORRUPT = object()

# Small entries are packed one after another into shared segment files (one being appended to per
# process), so a 16 KiB item costs 16 KiB and not a page-rounded file; an index of fixed 32-byte slots
# (_SLOT: segment, tag, offset, length, checksum) says where entry i lives. Entries of PACK_LIMIT bytes or more
# get a file of their own (slot segment STANDALONE), where page rounding is negligible.
PACK_LIMIT = 1 << 20
SEGMENT_SIZE = 64 << 20
_STANDALONE = 0xFFFFFFFF
# segment, tag (CRC-32 of the entry's size, checksums and number), byte offset, length, reserved, CRC-32 of the slot
_SLOT = struct.Struct("<IIQQII")
_EMPTY_SLOT = bytes(_SLOT.size)
_PAGE = mmap.ALLOCATIONGRANULARITY

# Shared counters in the stats file: name -> byte offset (u64 each).
_STAT_FIELDS = ("bytes", "entries", "hits", "misses", "skipped", "flags", "corrupt", "segments")
_STAT_OFFSET = {name: 8 + 8 * i for i, name in enumerate(_STAT_FIELDS)}
_STATS_MAGIC = 0x4D43535432  # "MCST2": the layout of this version (32-byte index slots)
_STATS_SIZE = 4096
_FLAG_WARNED_FULL = 1
_FLAG_WARNED_UNSUPPORTED = 2
_U64 = struct.Struct("<Q")
# Hits are counted on every read, so each process counts them in a u64 slot of its own after the shared
# counters, without the cross-process lock; the machine-wide count is the shared "hits" plus every slot. A
# process owns its slot by holding an OFD lock on the slot's first byte, which the kernel drops when the
# process dies; the next process to claim that slot keeps adding to its count. (Older versions, same magic,
# never touch these bytes: they only miss this version's hits when both share one cache at once.)
_HIT_SLOTS_AT = 128
_HIT_SLOTS = (_STATS_SIZE - _HIT_SLOTS_AT) // 8
_HIT_SLOTS_FMT = struct.Struct(f"<{_HIT_SLOTS}Q")


def default_shm_dir() -> str:
    """``$MONAI_CACHE_SHM_DIR`` if set, else ``/dev/shm``."""
    return os.environ.get(ENV_SHM_DIR) or "/dev/shm"


def cache_root(shm_dir: str | None = None, create: bool = True) -> str:
    """The per-user directory holding this user's caches, created with mode 0700.

    Raises:
        PermissionError: if it exists but belongs to another user or is not a directory (someone may be
            trying to plant entries); remove it or choose another ``shm_dir``.
        FileNotFoundError: if ``shm_dir`` does not exist.
        NotADirectoryError: if ``shm_dir`` is not a directory.
    """
    base = shm_dir or default_shm_dir()
    if not os.path.isdir(base):
        what = "is not a directory" if os.path.exists(base) else "does not exist"
        error = NotADirectoryError if os.path.exists(base) else FileNotFoundError
        raise error(
            f"shared-memory directory {base!r} {what}. Pass shm_dir=... (or set ${ENV_SHM_DIR}) to a "
            "tmpfs directory, or shared_memory=False to keep MONAI's in-process cache."
        )
    root = os.path.join(base, f"monai_cache-{os.getuid()}")
    if create:
        try:
            os.mkdir(root, 0o700)
        except FileExistsError:
            pass
    try:
        st = os.lstat(root)
    except FileNotFoundError:
        return root
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise PermissionError(
            f"{root} is not a directory owned by uid {os.getuid()}; monai_cache will not use it. "
            "Remove it, or choose another shm_dir."
        )
    if st.st_mode & 0o077:
        os.chmod(root, 0o700)
    return root


_NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.ENOMEM)  # tmpfs full, quota, or no memory to back it


class _Stats:
    """Counters shared by every process of one cache (a small MAP_SHARED file)."""

    __slots__ = ("_fd", "_hit_slot", "_hit_slot_pid", "_lock", "_map", "_path", "_pid")

    def __init__(self, path: str) -> None:
        self._path = path
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            try:
                if os.fstat(fd).st_size < _STATS_SIZE:
                    # Allocate the page now: a sparse one would raise SIGBUS at its first write on a full tmpfs.
                    _fallocate(fd, 0, _STATS_SIZE)
                    if os.fstat(fd).st_size < _STATS_SIZE:  # (file systems without fallocate)
                        os.ftruncate(fd, _STATS_SIZE)
                self._map = mmap.mmap(fd, _STATS_SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            except OSError as e:
                if e.errno not in _NO_SPACE:
                    raise
                # Shared memory is full before anything is cached: count in private memory; the first
                # write will fail for the same reason and warn once that items are served uncached.
                self._map = mmap.mmap(-1, _STATS_SIZE)
                _U64.pack_into(self._map, 0, _STATS_MAGIC)
        finally:
            os.close(fd)
        self._pid = -1
        self._fd = -1
        self._hit_slot = -1  # byte offset of this process's hit slot; -1: none (count under the lock)
        self._hit_slot_pid = -1  # the process that claimed it (a forked child claims its own)
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """Exclusive across processes (the caller holds ``self._lock``, which excludes this process's threads)."""
        fd = self._lock_fd()
        if fd < 0:  # the cache was removed under us: the counters are ours alone
            yield
            return
        ofd_lock(fd)
        try:
            yield
        finally:
            ofd_unlock(fd)

    def _lock_fd(self) -> int:
        # One descriptor per process, opened once (not per update: counting is on every read's path). An OFD
        # lock belongs to the open file description, which a forked child shares with its parent: so a
        # child opens its own.
        if self._pid != os.getpid():
            if self._fd >= 0:
                os.close(self._fd)  # the parent's, inherited
            try:
                self._fd = os.open(self._path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
            except FileNotFoundError:
                self._fd = -1
            self._pid = os.getpid()
        return self._fd

    def add(self, **deltas: int) -> dict[str, int]:
        """Add to counters atomically across processes; returns the new values of those counters."""
        with self._lock, self._locked():
            return self._add(deltas)

    def count_hit(self) -> None:
        """``hits += 1``, in this process's own slot: no system call once the slot is claimed."""
        with self._lock:
            if self._hit_slot_pid != os.getpid():
                self._claim_hit_slot()
            off = self._hit_slot
            if off < 0:  # every slot taken by a live process, or the cache was removed under us
                with self._locked():
                    self._add({"hits": 1})
                return
            _U64.pack_into(self._map, off, _U64.unpack_from(self._map, off)[0] + 1)

    def _claim_hit_slot(self) -> None:
        # Called with self._lock held. The lock must be on this process's own descriptor (see _lock_fd):
        # locks on one open file description do not conflict with each other.
        self._hit_slot_pid = os.getpid()
        self._hit_slot = -1
        fd = self._lock_fd()
        if fd < 0:
            return
        for off in range(_HIT_SLOTS_AT, _STATS_SIZE, 8):
            if ofd_lock(fd, off, blocking=False):
                self._hit_slot = off
                return

    def _add(self, deltas: dict[str, int]) -> dict[str, int]:
        out = {}
        for name, d in deltas.items():
            off = _STAT_OFFSET[name]
            v = max(0, _U64.unpack_from(self._map, off)[0] + d)
            _U64.pack_into(self._map, off, v)
            out[name] = v
        return out

    def set_flag(self, flag: int) -> bool:
        """Set a flag bit; True if this call set it (it was clear before)."""
        with self._lock, self._locked():
            off = _STAT_OFFSET["flags"]
            v = _U64.unpack_from(self._map, off)[0]
            _U64.pack_into(self._map, off, v | flag)
            return not v & flag

    def reset(self) -> None:
        with self._lock, self._locked():
            self._map[:] = bytes(_STATS_SIZE)
            _U64.pack_into(self._map, 0, _STATS_MAGIC)

    def snapshot(self) -> dict[str, int]:
        if self._map.closed:  # the cache was left and removed: nothing is held any more
            return _unpack_stats(bytes(_STATS_SIZE))
        return _unpack_stats(self._map)

    def reinit_after_fork(self) -> None:
        self._lock = threading.Lock()

    def close_fd(self) -> None:
        if self._fd >= 0 and self._pid == os.getpid():
            os.close(self._fd)  # also gives up this process's hit slot (its count stays)
        self._fd, self._pid = -1, -1
        self._hit_slot, self._hit_slot_pid = -1, -1

    def close(self) -> None:
        self.close_fd()
        try:
            self._map.close()
        except (BufferError, ValueError):
            pass


def _read_stats(path: str) -> dict[str, int] | None:
    try:
        with open(path, "rb") as f:
            raw = f.read(_STATS_SIZE)
    except OSError:
        return None
    if len(raw) < 8 + 8 * len(_STAT_FIELDS):
        return None
    return _unpack_stats(raw)


def _unpack_stats(raw: bytes | mmap.mmap) -> dict[str, int]:
    """The shared counters, with ``hits`` summed over the per-process hit slots."""
    out = {name: _U64.unpack_from(raw, off)[0] for name, off in _STAT_OFFSET.items()}
    if len(raw) >= _STATS_SIZE:
        out["hits"] += sum(_HIT_SLOTS_FMT.unpack_from(raw, _HIT_SLOTS_AT))
    return out


def _stats_magic(path: str) -> int | None:
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
    except OSError:
        return None
    return _U64.unpack_from(raw)[0] if len(raw) == 8 else None


def _try_exclusive(lease_path: str, create: bool = True) -> int | None:
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


def _remove_dir(path: str) -> None:
    """Remove a cache directory: rename it away first so no reader sees it half-deleted."""
    trash = f"{os.path.dirname(path)}/.trash.{os.getpid()}.{next(_COUNTER)}"
    try:
        os.rename(path, trash)
    except FileNotFoundError:
        return
    shutil.rmtree(trash, ignore_errors=True)


_COUNTER = itertools.count()


class _RootLock:
    """flock on the per-user root's .lock: serialises join, leave and reclaim (all short)."""

    def __init__(self, root: str) -> None:
        self.path = os.path.join(root, ".lock")

    def __enter__(self) -> _RootLock:
        _enter_critical()
        try:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        except BaseException:
            _exit_critical()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)
        _exit_critical()


def _reclaim_stale(root: str, skip: str | None = None) -> list[str]:
    """Remove caches nobody holds a lease on (their users crashed), except kept ones. Caller holds the root lock."""
    removed = []
    for name in os.listdir(root):
        path = os.path.join(root, name)
        if not _owned_directory(path):
            continue  # not ours (planted by another user, or not a directory): never removed
        if name.startswith(".trash."):
            shutil.rmtree(path, ignore_errors=True)
            continue
        if name.startswith(".") or path == skip:
            continue
        if os.path.exists(os.path.join(path, "keep")) or not os.path.exists(os.path.join(path, "stats")):
            continue  # kept on purpose, or not one of our caches
        fd = _try_exclusive(os.path.join(path, "lease"), create=False)
        if fd is None:
            continue
        try:
            _remove_dir(path)
            removed.append(name)
        finally:
            os.close(fd)
    return removed


class _Directory:
    """One process's handle on one cache directory: lease, counters, reference count."""

    def __init__(self, root: str, key: str, keep: bool) -> None:
        self.root = root
        self.key = key
        self.path = os.path.join(root, key)
        self.refs = 0
        self.owner_pid = os.getpid()
        self.lease_fd = -1
        self._join(keep)
        self.stats = _Stats(os.path.join(self.path, "stats"))
        self._sweep_dead_writers()
        self.locks_path = os.path.join(self.path, "locks")
        flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
        self.index_fd = os.open(os.path.join(self.path, "index"), flags, 0o600)
        self.segment_fds: dict[int, int] = {}  # read-only descriptors, one per segment (not per entry)
        self.append_lock = threading.Lock()
        self.writer: tuple[int, int, int] | None = None  # (pid, segment number, fd) being appended to
        self.write_pos = 0

    # -- the index --
    def read_slot(self, i: int) -> tuple[int, int, int, int] | object | None:
        """``(segment, offset, length, tag)`` of entry ``i``, ``None`` if empty, ``_CORRUPT`` if damaged.

        The slot's CRC binds it to ``i``; ``tag`` binds it to the blob it points at (see :func:`blob_tag`).
        """
        raw = os.pread(self.index_fd, _SLOT.size, _SLOT.size * i)
        if len(raw) < _SLOT.size or raw == _EMPTY_SLOT:
            return None
        seg, tag, offset, length, _reserved, check = _SLOT.unpack(raw)
        if check != zlib.crc32(raw[: _SLOT.size - 4] + i.to_bytes(8, "little")):
            return _CORRUPT
        return seg, offset, length, tag

    def write_slot(self, i: int, seg: int, offset: int, length: int, tag: int) -> None:
        head = _SLOT.pack(seg, tag, offset, length, 0, 0)[:-4]
        os.pwrite(self.index_fd, head + struct.pack("<I", zlib.crc32(head + i.to_bytes(8, "little"))), _SLOT.size * i)

    def clear_slot(self, i: int) -> None:
        os.pwrite(self.index_fd, _EMPTY_SLOT, _SLOT.size * i)

    # -- segments --
    def segment_fd(self, seg: int) -> int:
        fd = self.segment_fds.get(seg)
        if fd is None:
            fd = os.open(f"{self.path}/s.{seg}", os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
            with self.append_lock:
                if seg in self.segment_fds:  # another thread opened it meanwhile
                    os.close(fd)
                    fd = self.segment_fds[seg]
                else:
                    self.segment_fds[seg] = fd
        return fd

    def append_region(self, size: int) -> tuple[int, int, int]:
        """Reserve ``size`` bytes in this process's segment: ``(segment, fd, offset)``."""
        with self.append_lock:
            w = self.writer
            if w is None or w[0] != os.getpid() or self.write_pos + size > SEGMENT_SIZE:
                if w is not None and w[0] == os.getpid():
                    os.close(w[2])
                seg = self.stats.add(segments=1)["segments"]
                fd = os.open(
                    f"{self.path}/s.{seg}", os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600
                )
                w = self.writer = (os.getpid(), seg, fd)
                self.write_pos = 0
            offset = self.write_pos
            self.write_pos += (size + 63) // 64 * 64
            return w[1], w[2], offset

    def close_files(self) -> None:
        for fd in [self.index_fd, *self.segment_fds.values()]:
            try:
                os.close(fd)
            except OSError:
                pass
        if self.writer is not None and self.writer[0] == os.getpid():
            os.close(self.writer[2])
        self.index_fd = -1
        self.segment_fds = {}
        self.writer = None
        self.stats.close_fd()

    def _join(self, keep: bool) -> None:
        with _RootLock(self.root):
            _reclaim_stale(self.root, skip=self.path)
            try:
                os.mkdir(self.path, 0o700)
                fresh = True
            except FileExistsError:
                fresh = False
            st = os.lstat(self.path)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():  # planted by someone else
                raise PermissionError(
                    f"{self.path} is not a directory owned by uid {os.getuid()}; monai_cache will not use it. "
                    "Remove it, or choose another shm_dir."
                )
            lease_path = os.path.join(self.path, "lease")
            stats_path = os.path.join(self.path, "stats")
            fd = _try_exclusive(lease_path)
            magic = None if fresh else _stats_magic(stats_path)
            other_layout = magic not in (None, 0, _STATS_MAGIC)  # kept by an earlier version of monai_cache
            if other_layout and fd is None:
                raise RuntimeError(
                    f"the shared-memory cache {self.path} is in use by another version of monai_cache; "
                    "use the same version in every process, or another cache_key / shm_dir"
                )
            wiped = False
            if fd is not None and not fresh and (other_layout or not os.path.exists(os.path.join(self.path, "keep"))):
                # Nobody holds a lease: left over by processes that crashed (or kept by an earlier version,
                # whose entries this version cannot read). Start it afresh.
                for name in os.listdir(self.path):
                    if name != "lease":
                        _unlink_quiet(os.path.join(self.path, name))
                wiped = True
            if fd is None:
                fd = os.open(lease_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
            fcntl.flock(fd, fcntl.LOCK_SH)  # converts our exclusive lock, if any, under the root lock
            self.lease_fd = fd
            if keep:
                _touch_private(os.path.join(self.path, "keep"))
            if fresh or wiped or _stats_magic(stats_path) != _STATS_MAGIC:
                fresh_stats = _Stats(stats_path)
                fresh_stats.reset()
                fresh_stats.close()

    def _sweep_dead_writers(self) -> None:
        """Remove the partial entries of writers killed while writing: they hold shared memory and budget.

        Each joining process sweeps, so a live cache (a restarted worker or rank) and a kept one (the next
        run) both get them back. A temporary file names its writer's pid; a live writer's is never touched.
        """
        freed = 0
        for path in _dead_tmp_files(self.path):
            try:
                size = os.lstat(path).st_size
                os.unlink(path)
            except FileNotFoundError:  # another process swept it first, and returned its bytes
                continue
            freed += size  # the size reserved for it: the file is fallocated to it before writing
        if freed:
            self.stats.add(bytes=-freed)

    def leave(self) -> bool:
        """Drop this process's lease; remove the cache if nobody else holds one. True if removed."""
        if self.lease_fd < 0 or os.getpid() != self.owner_pid:
            return False
        if not os.path.isdir(self.path):  # removed under us (monai-cache clear --all): free what we still hold
            os.close(self.lease_fd)
            self.lease_fd = -1
            self.stats.close()  # the removed files' memory is freed when their last descriptor and map go
            self.close_files()
            return False
        with _RootLock(self.root):
            os.close(self.lease_fd)
            self.lease_fd = -1
            if os.path.exists(os.path.join(self.path, "keep")):
                self.close_files()
                return False
            fd = _try_exclusive(os.path.join(self.path, "lease"))
            if fd is None:
                self.close_files()
                return False
            try:
                self.stats.close()
                self.close_files()
                _remove_dir(self.path)
                return True
            finally:
                os.close(fd)

    def after_fork_in_child(self) -> None:
        # The child shares the parent's lease (the open file description): drop our reference so that the
        # parent alone decides when the lease ends. Children never leave.
        if self.lease_fd >= 0:
            os.close(self.lease_fd)
            self.lease_fd = -1
        self.stats.reinit_after_fork()
        self.append_lock = threading.Lock()  # a lock held by another thread at fork time stays held
        self.writer = None  # never append to the parent's segment: start our own on the first write


def _touch_private(path: str) -> None:
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600))


def _unlink_quiet(path: str) -> None:
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.unlink(path)
    except FileNotFoundError:
        pass


# Process-wide registry: one _Directory per cache path, shared by every store of this process.
_registry: dict[str, _Directory] = {}
_registry_lock = threading.Lock()
# A dataset garbage-collected while its thread holds the registry lock or the root lock (the collector runs
# finalizers at any allocation) must not release its cache there: both locks would be taken again by the
# same thread and never granted. Such releases wait in _deferred until the thread leaves the last of them.
_held = threading.local()
_deferred: list[_Directory] = []


def _enter_critical() -> None:
    _held.depth = getattr(_held, "depth", 0) + 1


def _exit_critical() -> None:
    _held.depth -= 1
    while _held.depth == 0 and _deferred:
        try:
            d = _deferred.pop()
        except IndexError:  # another thread took the last one
            break
        _release_directory(d)


def _acquire_directory(root: str, key: str, keep: bool) -> _Directory:
    path = os.path.join(root, key)
    _enter_critical()
    try:
        with _registry_lock:
            d = _registry.get(path)
            if d is None or d.owner_pid != os.getpid():  # none yet, or inherited through fork without a lease
                d = _Directory(root, key, keep)
                _registry[path] = d
            elif keep:
                _touch_private(os.path.join(d.path, "keep"))
            d.refs += 1
            return d
    finally:
        _exit_critical()


def _release_directory(d: _Directory) -> None:
    if getattr(_held, "depth", 0):  # called by a finalizer inside a critical section: later
        _deferred.append(d)
        return
    _enter_critical()
    try:
        with _registry_lock:
            d.refs -= 1
            if d.refs > 0:
                return
            if _registry.get(d.path) is d:
                del _registry[d.path]
    finally:
        _exit_critical()
    d.leave()


def _release_in_owner(d: _Directory, pid: int) -> None:
    """A store's finalizer: give its reference to ``d`` back, in the process that took it (not in a fork)."""
    if os.getpid() == pid:
        _release_directory(d)


def _after_fork_in_child() -> None:
    global _registry_lock
    _registry_lock = threading.Lock()
    _held.depth = 0
    _deferred.clear()
    for d in list(_registry.values()):
        d.after_fork_in_child()


def _leave_all_at_exit() -> None:
    for d in list(_registry.values()):
        try:
            d.leave()
        except OSError:
            pass


os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(_leave_all_at_exit)


class SharedMemoryStore:
    """A list-like, node-wide cache of items, usable as MONAI's ``CacheDataset._cache``.

    ``store[i]`` returns the decoded item (tensors are copy-on-write views of shared memory) or ``None``
    when entry ``i`` is not cached; ``store[i] = item`` publishes it (or skips it when the budget or
    ``/dev/shm`` is full). :meth:`get_or_compute` computes a missing entry once across all processes.

    Args:
        key: the cache's name, a fingerprint of the dataset; processes that use the same key share entries.
        length: number of entries (MONAI's ``cache_num``).
        shm_dir: tmpfs directory to keep caches in; defaults to ``$MONAI_CACHE_SHM_DIR`` or ``/dev/shm``.
        budget: most bytes this cache may take in shared memory (an int or a string like ``"8GiB"``);
            ``None`` for no limit other than the free space of ``shm_dir`` (minus a reserve).
        keep_warm: keep the cache after the last process using it exits, for the next run.
        allow_pickle: store and load values the codec cannot encode with pickle. Off by default.
        reserve: bytes of ``shm_dir`` left free for others (DataLoader workers pass batches through
            ``/dev/shm``); by default the smaller of 512 MiB and a quarter of its size.
        describe: how warnings name an entry, e.g. ``lambda i: f"item {i}"``.
        verify: check every read against the data checksum too. Off by default: entries are published only
            once complete, so a crash cannot damage them, and the header and layout are always validated;
            a full check costs about 1 ms per MB read.
    """

    __slots__ = (
        "__weakref__",
        "_allow_pickle",
        "_budget",
        "_describe",
        "_dir",
        "_finalizer",
        "_keep",
        "_length",
        "_pid",
        "_proc_stats",
        "_released",
        "_removed",
        "_reported",
        "_reserve",
        "_shm_dir",
        "_tmp_counter",
        "_unsupported",
        "_verify",
        "key",
    )

    def __init__(
        self,
        key: str,
        length: int,
        *,
        shm_dir: str | None = None,
        budget: int | str | None = None,
        keep_warm: bool = False,
        allow_pickle: bool = False,
        reserve: int | str | None = None,
        describe: Callable[[int], str] | None = None,
        verify: bool = False,
    ) -> None:
        if not key or "/" in key or key.startswith("."):
            raise ValueError(f"invalid cache key {key!r}")
        if length < 0:
            raise ValueError(f"length must be >= 0, got {length}")
        self.key = key
        self._length = int(length)
        self._shm_dir = shm_dir or default_shm_dir()
        self._budget = parse_bytes(budget, "shm_budget")
        self._reserve = parse_bytes(reserve, "reserve")
        self._keep = bool(keep_warm)
        self._allow_pickle = bool(allow_pickle)
        self._describe = describe
        self._verify = bool(verify)
        root = cache_root(self._shm_dir)
        self._dir = _acquire_directory(root, key, self._keep)
        self._pid = os.getpid()
        # Every store (a dataset's, or a copy unpickled or deep-copied in this process) gives its reference
        # back when it is garbage collected; release() does it now. A finalizer runs at most once.
        self._finalizer = weakref.finalize(self, _release_in_owner, self._dir, self._pid)
        self._removed = False  # the directory was removed while in use (monai-cache clear --all)
        self._proc_stats = {"hits": 0, "misses": 0, "bytes_read": 0, "bytes_written": 0, "skipped": 0, "corrupt": 0}
        self._reported: set[int] = set()
        self._unsupported: set[int] = set()  # entries whose item the codec cannot store: computed on each read
        self._tmp_counter = itertools.count()
        self._released = False

    # -- pickling: a spawned DataLoader worker reopens the cache (and holds its own lease while it lives) --
    def __reduce__(self) -> tuple:
        return (
            _attach,
            (self.key, self._length, self._shm_dir, self._budget, self._allow_pickle, self._reserve, self._describe,
             self._verify),
        )

    # -- sequence protocol (what MONAI's CacheDataset expects of ``_cache``) --
    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: int) -> Any:
        i = self._check_index(index)
        if self._released or self._removed:
            return None
        try:
            item = self._read(i)
        except FileNotFoundError:
            if not self._cache_removed():
                raise
            return None
        return None if item is _MISSING else item

    def __setitem__(self, index: int, item: Any) -> None:
        if item is None:
            return
        i = self._check_index(index)
        with OFDLock(self._dir.locks_path, i):
            if self._dir.read_slot(i) is None:
                self._write(i, item)

    def __iter__(self) -> Iterator[Any]:
        for i in range(self._length):
            yield self[i]

    def __contains__(self, item: object) -> bool:  # pragma: no cover - identity semantics are meaningless here
        return False

    def __repr__(self) -> str:
        return f"SharedMemoryStore(key={self.key!r}, length={self._length}, path={self._dir.path!r})"

    @property
    def path(self) -> str:
        """The cache directory."""
        return self._dir.path

    def _check_index(self, index: int) -> int:
        i = int(index)
        if i < 0:
            i += self._length
        if not 0 <= i < self._length:
            raise IndexError(f"cache index {index} out of range for {self._length} entries")
        return i

    def _entry_path(self, i: int) -> str:
        return f"{self._dir.path}/{i}{_ENTRY_SUFFIX}"

    def _name(self, i: int) -> str:
        return self._describe(i) if self._describe is not None else f"entry {i}"

    # -- reads --
    def missing(self) -> list[int]:
        """Indices of the entries not published yet (one read of the whole index)."""
        raw = os.pread(self._dir.index_fd, _SLOT.size * self._length, 0)
        raw += bytes(_SLOT.size * self._length - len(raw))
        return [i for i in range(self._length) if raw[_SLOT.size * i : _SLOT.size * (i + 1)] == _EMPTY_SLOT]

    def contains(self, index: int) -> bool:
        """Whether entry ``index`` is published (cheap: one read of its index slot, no decoding)."""
        slot = self._dir.read_slot(self._check_index(index))
        return slot is not None and slot is not _CORRUPT

    def _map(self, i: int, slot: tuple[int, int, int, int]) -> memoryview | None:
        """Map entry ``i`` copy-on-write (zero-copy; writes land in private pages); None if its file is gone."""
        seg, offset, length, _tag = slot
        if seg == _STANDALONE:
            try:
                fd = os.open(self._entry_path(i), os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
            except FileNotFoundError:
                return None
            try:
                size = os.fstat(fd).st_size
                if size != length or size == 0:
                    return memoryview(b"")  # not what the slot says: rejected by the decoder
                return memoryview(mmap.mmap(fd, size, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE))
            finally:
                os.close(fd)
        try:
            fd = self._dir.segment_fd(seg)
        except FileNotFoundError:
            return None
        # A packed entry (< 1 MiB) is read into a private buffer: cheaper than map + fault + unmap, and it
        # holds no descriptor or mapping per live item (Python < 3.13 keeps a dup'ed fd for every mmap).
        if not 0 < length < PACK_LIMIT:
            return memoryview(b"")  # no packed entry is this size: a damaged slot, rejected by the decoder
        buf = bytearray(length)
        got = os.preadv(fd, [buf], offset)
        return memoryview(buf) if got == length else memoryview(b"")  # short: past the segment's end

    def _read(self, i: int, count: bool = True) -> Any:
        slot = self._dir.read_slot(i)
        if slot is None:
            return _MISSING
        if slot is _CORRUPT:
            self._discard_corrupt(i, slot, "damaged index slot")
            return _MISSING
        view = self._map(i, slot)  # type: ignore[arg-type]
        if view is None:
            return _MISSING
        if blob_tag(view, i) != slot[3]:  # type: ignore[index]
            self._discard_corrupt(i, slot, "its index slot points at data that is not this entry's")
            return _MISSING
        from monai_cache import codec

        try:
            item = codec.decode(view, allow_pickle=self._allow_pickle, verify=self._verify)
        except codec.CorruptEntryError as e:
            self._discard_corrupt(i, slot, str(e))
            return _MISSING
        if count:
            self._proc_stats["hits"] += 1
            self._proc_stats["bytes_read"] += view.nbytes
            self._dir.stats.count_hit()
        return item

    def _discard_corrupt(self, i: int, slot: Any, why: str) -> None:
        # Under the entry's lock, and only if the slot still says the same: concurrent readers of the same
        # bad entry stay quiet, and an entry republished meanwhile is left alone.
        with OFDLock(self._dir.locks_path, i):
            if self._dir.read_slot(i) != slot:
                return
            self._dir.clear_slot(i)
            if slot is not _CORRUPT and slot[0] == _STANDALONE:
                _unlink_quiet(self._entry_path(i))
                self._dir.stats.add(bytes=-slot[2])
        self._dir.stats.add(entries=-1, corrupt=1)
        self._proc_stats["corrupt"] += 1
        if i not in self._reported:
            self._reported.add(i)
            warn(f"corrupt shared-memory cache entry for {self._name(i)} ({why}) was removed and will be recomputed")

    # -- writes --
    def _write(self, i: int, item: Any) -> bool:
        """Publish entry ``i`` (caller holds its lock); False, with one warning per cache, if it does not fit.

        Raises:
            UnsupportedValueError: the item holds a value the codec cannot store.
        """
        from monai_cache import codec

        enc = codec.encode(item, allow_pickle=self._allow_pickle)
        size = enc.nbytes
        if not self._reserve_space(size):
            return False
        try:
            if size < PACK_LIMIT:
                seg, fd, offset = self._dir.append_region(size)
                _fallocate(fd, offset, size)
                _write_all(fd, enc, offset)
            else:
                seg, offset = _STANDALONE, 0
                self._write_standalone(i, enc)
            # Publish: the data is complete before the slot that points to it is written.
            self._dir.write_slot(i, seg, offset, size, blob_tag(enc.prefix(), i))
        except OSError as e:
            self._dir.stats.add(bytes=-size)
            self._proc_stats["skipped"] += 1
            if e.errno in _NO_SPACE:
                self._warn_full(size, str(e))
            elif e.errno != errno.ENOENT:  # ENOENT: the cache was removed under us (its last user left)
                warn(f"could not write the shared-memory cache entry for {self._name(i)}: {e}; serving it uncached")
            return False
        self._dir.stats.add(entries=1)
        self._proc_stats["bytes_written"] += size
        return True

    def _write_computed(self, i: int, item: Any) -> bool:
        """:meth:`_write` for an item a dataset computed: one that the codec cannot store is not an error.

        As in the disk store, the item is served uncached from then on (this process does not try to store
        it again) and one warning per cache names it, its key path and what to do.
        """
        from monai_cache import codec

        try:
            return self._write(i, item)
        except codec.UnsupportedValueError as e:
            self._unsupported.add(i)
            self._proc_stats["skipped"] += 1
            self._dir.stats.add(skipped=1)
            if self._dir.stats.set_flag(_FLAG_WARNED_UNSUPPORTED):
                warn(f"{self._name(i)} is not cached, it is computed on every read: {e}", stacklevel=5)
            return False

    def _write_standalone(self, i: int, enc: codec.Encoded) -> None:
        tmp = f"{self._dir.path}/{_TMP_PREFIX}{os.getpid()}.{threading.get_ident()}.{next(self._tmp_counter)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            try:
                _fallocate(fd, 0, enc.nbytes)
                _write_all(fd, enc, 0)
            finally:
                os.close(fd)
            os.rename(tmp, self._entry_path(i))
        except BaseException:
            _unlink_quiet(tmp)
            raise

    def _space_left(self) -> tuple[int, int]:
        st = os.statvfs(self._dir.path)
        total = st.f_blocks * st.f_frsize
        free = st.f_bavail * st.f_frsize
        reserve = self._reserve if self._reserve is not None else min(512 << 20, total // 4)
        return free - reserve, free

    def _reserve_space(self, size: int) -> bool:
        used = self._dir.stats.add(bytes=size)["bytes"]
        over_budget = self._budget is not None and used > self._budget
        room, _free = self._space_left()
        if over_budget or room < size:
            self._dir.stats.add(bytes=-size, skipped=1)
            self._proc_stats["skipped"] += 1
            self._warn_full(size, "budget reached" if over_budget else "shared memory nearly full")
            return False
        return True

    def _warn_full(self, size: int, why: str) -> None:
        if not self._dir.stats.set_flag(_FLAG_WARNED_FULL):
            return
        st = os.statvfs(self._dir.path)
        used = self._dir.stats.snapshot()["bytes"]
        budget = "no budget set" if self._budget is None else f"budget {format_bytes(self._budget)}"
        warn(
            f"the shared-memory cache is full ({why}): it holds {format_bytes(used)} ({budget}); "
            f"{format_bytes(st.f_bavail * st.f_frsize)} of {format_bytes(st.f_blocks * st.f_frsize)} are free in "
            f"{self._shm_dir}, and the next entry needs {format_bytes(size)}. Further items are served uncached. "
            "To cache more, raise shm_budget, or give the machine more shared memory "
            "(Docker: docker run --shm-size=16g ...; Kubernetes: an emptyDir volume with medium: Memory at "
            "/dev/shm), or point shm_dir / $MONAI_CACHE_SHM_DIR at a larger tmpfs.",
            stacklevel=4,
        )

    def get_or_compute(self, index: int, compute: Callable[[], Any], wait: bool = True) -> Any:
        """Return entry ``index``, computing and publishing it if missing; computed once across processes.

        Args:
            index: entry index.
            compute: makes the item when it is missing.
            wait: if another process is computing this entry, wait for it (True), or return ``_MISSING``
                sentinel-free ``None`` right away (False; used to split an eager fill between processes).

        Returns:
            the item: decoded from shared memory when it could be published, else the computed object
            (also after :meth:`release`, or once the cache was removed under this process).
        """
        i = self._check_index(index)
        if i in self._unsupported or self._released or self._removed:
            self._proc_stats["misses"] += 1
            return compute()
        computed: list[Any] = []
        try:
            return self._get_or_compute(i, compute, wait, computed)
        except FileNotFoundError:
            if not self._cache_removed():
                raise  # not ours (e.g. the transforms' input file is missing)
            if computed:
                return computed[0]
            self._proc_stats["misses"] += 1
            return compute()

    def _get_or_compute(self, i: int, compute: Callable[[], Any], wait: bool, computed: list[Any]) -> Any:
        item = self._read(i)
        if item is not _MISSING:
            return item
        if self._cache_removed():  # removed (and perhaps made anew) under us: our files are not its files
            self._proc_stats["misses"] += 1
            return compute()
        lock = OFDLock(self._dir.locks_path, i)
        if not lock.acquire(blocking=wait):
            return None
        try:
            item = self._read(i)  # someone may have published it while we waited
            if item is not _MISSING:
                return item
            self._proc_stats["misses"] += 1
            self._dir.stats.add(misses=1)
            value = compute()
            computed.append(value)
            if not self._write_computed(i, value):
                return value
        finally:
            lock.release()
        item = self._read(i, count=False)
        return value if item is _MISSING else item

    def fill(self, index: int, compute: Callable[[], Any]) -> bool:
        """Make sure entry ``index`` exists without decoding it; False if another process is on it now."""
        i = self._check_index(index)
        if i in self._unsupported or self._released or self._removed:
            return True
        try:
            return self._fill(i, compute)
        except FileNotFoundError:
            if not self._cache_removed():
                raise
            return True

    def _fill(self, i: int, compute: Callable[[], Any]) -> bool:
        if self.contains(i):
            return True
        lock = OFDLock(self._dir.locks_path, i)
        if not lock.acquire(blocking=False):
            return False
        try:
            if not self.contains(i):
                self._proc_stats["misses"] += 1
                self._dir.stats.add(misses=1)
                self._write_computed(i, compute())
        finally:
            lock.release()
        return True

    def _cache_removed(self) -> bool:
        """Whether this cache was removed while in use (``monai-cache clear --all``, or ``set_data`` in the
        process that owned it with persistent DataLoader workers still reading): one warning per process, and
        from then on this process computes items uncached, as MONAI computes items past ``cache_num``."""
        if self._removed:
            return True
        try:
            removed = os.fstat(self._dir.index_fd).st_nlink == 0  # our index file was unlinked
        except OSError:
            removed = True
        if removed:
            self._removed = True
            warn(
                f"the shared-memory cache {self._dir.path} was removed while this process used it (by "
                "`monai-cache clear --all`, or by set_data() in the process that built the dataset while "
                "persistent DataLoader workers still read it): items are now computed on every read here",
                stacklevel=5,
            )
        return removed

    def wait_for(self, index: int) -> None:
        """Block until nobody is computing entry ``index``."""
        i = self._check_index(index)
        if self._released or self._removed:
            return
        try:
            with OFDLock(self._dir.locks_path, i):
                pass
        except FileNotFoundError:
            if not self._cache_removed():
                raise

    # -- bookkeeping --
    def stats(self) -> dict[str, dict[str, int]]:
        """Counters: ``{"process": {...}, "machine": {...}}``.

        ``process`` counts this process's hits, misses (entries it computed), bytes read and written, items
        skipped (not stored: no space, or a value the codec cannot store) and corrupt entries removed.
        ``machine`` is shared by every process using this cache: bytes and entries held, hits, misses,
        skipped, corrupt.
        """
        shared = self._dir.stats.snapshot()
        machine = {k: shared[k] for k in ("bytes", "entries", "hits", "misses", "skipped", "corrupt")}
        return {"process": dict(self._proc_stats), "machine": machine}

    def release(self) -> None:
        """Stop using the cache in this process; the last process to release it removes it (unless kept)."""
        if self._released or os.getpid() != self._pid:
            return
        self._released = True
        self._finalizer()

    def clear(self) -> None:
        """Forget every entry (other processes using the cache then see misses and recompute).

        Packed entries stay in their segments (counted in ``bytes``) until the cache is removed.
        """
        for i in range(self._length):
            with OFDLock(self._dir.locks_path, i):
                slot = self._dir.read_slot(i)
                if slot is None:
                    continue
                self._dir.clear_slot(i)
                if slot is not _CORRUPT and slot[0] == _STANDALONE:  # type: ignore[index]
                    _unlink_quiet(self._entry_path(i))
                    self._dir.stats.add(bytes=-slot[2])  # type: ignore[index]
                self._dir.stats.add(entries=-1)


def _attach(key, length, shm_dir, budget, allow_pickle, reserve, describe, verify) -> SharedMemoryStore:  # type: ignore[no-untyped-def]
    return SharedMemoryStore(
        key, length, shm_dir=shm_dir, budget=budget, allow_pickle=allow_pickle, reserve=reserve,
        describe=describe, verify=verify,
    )


def _fallocate(fd: int, offset: int, size: int) -> None:
    """Reserve the pages now: a full tmpfs then fails with ENOSPC here rather than SIGBUS later."""
    try:
        os.posix_fallocate(fd, offset, size)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise


def _write_all(fd: int, enc: codec.Encoded, pos: int) -> None:
    for chunk in enc.chunks():
        view = memoryview(chunk).cast("B")
        while view.nbytes:
            n = os.pwrite(fd, view[: 1 << 30], pos)
            pos += n
            view = view[n:]


def list_caches(shm_dir: str | None = None) -> list[dict[str, Any]]:
    """Describe this user's shared-memory caches: key, path, bytes, entries, live/stale/kept."""
    root = cache_root(shm_dir, create=False)
    if not os.path.isdir(root):
        return []
    out = []
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        if name.startswith(".") or not os.path.isdir(path) or not os.path.exists(os.path.join(path, "stats")):
            continue  # not one of our caches
        try:
            # The probe takes the lease exclusively for an instant: under the root lock, so that a last user
            # leaving at that moment (it probes under the same lock) never mistakes us for another user.
            with _RootLock(root):
                fd = _try_exclusive(os.path.join(path, "lease"), create=False)
                live = fd is None and os.path.exists(os.path.join(path, "lease"))
                if fd is not None:
                    os.close(fd)
            stats = _read_stats(os.path.join(path, "stats")) or {}
            nbytes = sum(_blocks_of(e) for e in os.scandir(path))
        except FileNotFoundError:  # removed while we looked (its last user left): not a cache any more
            continue
        entries = stats.get("entries", 0)
        out.append(
            {
                "key": name,
                "path": path,
                "bytes": nbytes,
                "entries": entries,
                "hits": stats.get("hits", 0),
                "misses": stats.get("misses", 0),
                "state": "live" if live else ("kept" if os.path.exists(os.path.join(path, "keep")) else "stale"),
            }
        )
    return out


def _blocks_of(entry: os.DirEntry) -> int:
    try:
        return entry.stat(follow_symlinks=False).st_blocks * 512 if entry.is_file(follow_symlinks=False) else 0
    except FileNotFoundError:  # removed since the directory was listed
        return 0


def remove_cache(key: str, shm_dir: str | None = None, force: bool = False) -> bool:
    """Remove one cache: stale or kept ones always, live ones only with ``force``. True if removed."""
    root = cache_root(shm_dir, create=False)
    path = os.path.join(root, key)
    if "/" in key or key.startswith(".") or not _owned_directory(path):
        return False  # not a cache of ours
    if not os.path.exists(os.path.join(path, "stats")):
        return False
    with _RootLock(root):
        lease = os.path.join(path, "lease")
        fd = _try_exclusive(lease, create=False)
        if fd is None and os.path.exists(lease) and not force:
            return False  # live
        try:
            _remove_dir(path)
        finally:
            if fd is not None:
                os.close(fd)
    return True


def blob_tag(blob: memoryview | bytes, i: int) -> int:
    """CRC-32 of a codec blob's size, header CRC and data CRC (prefix bytes 24-40) and of the entry number:
    binds entry ``i``'s slot to its blob (a slot copied from another entry, or pointing elsewhere, fails)."""
    return zlib.crc32(i.to_bytes(8, "little"), zlib.crc32(blob[24:40])) if len(blob) >= 40 else -1


def _owned_directory(path: str) -> bool:
    """Whether ``path`` is a real directory (not a link) owned by this user."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid()


def _dead_tmp_files(path: str) -> Iterator[str]:
    for name in os.listdir(path):
        if name.startswith(_TMP_PREFIX):
            parts = name[len(_TMP_PREFIX) :].split(".")
            if parts and parts[0].isdigit() and not pid_alive(int(parts[0])):
                yield os.path.join(path, name)
