"""A shared-memory cache on disk: the directory of one cache in ``/dev/shm``, its files, and its lifetime.

Layout (``root`` is ``/dev/shm`` unless configured; docs/shared-memory.md describes it in full)::

    root/monai_cache-<uid>/            mode 0700, owned by the user: nobody else can read or plant entries
        .lock                          flock'ed while a process joins, leaves or removes a cache (short)
        .trash.<pid>.<n>/              a cache being removed by process <pid> (under .lock), or left
                                       half-removed by it, killed meanwhile (state half-removed)
        <key>/                         one directory per dataset fingerprint
            lease                      every process using the cache holds a shared flock on it
            keep                       present when the cache is to outlive its users (keep_warm=True)
            keeper.<pid>               flock'ed by the keeper holding the cache while torchrun's agent <pid>
                                       lives (keeper.0: for keep_alive seconds); monai_cache.keeper
            watcher                    flock'ed by the cache's watcher, which removes it when its users die
            slurm_job.<id>             the Slurm jobs whose processes used it (monai-cache epilog)
            keep_alive                 the keep_alive seconds its users asked (the longest): shm_lifetime
            disk_tier                  the disk cache directory behind this cache, if any (one line)
            length                     how many entries the cache has room for (one line; monai-cache top)
            stats                      4 KiB of shared counters (runtime.SharedCounters)
            locks                      byte i is OFD-locked while someone computes entry i outside a batch;
                                       byte PUBLISH_LOCK_AT while someone publishes entries
            index                      a 32-byte slot per entry: where it lives, its tag and checksum
            s.<n>                      a segment: small entries (under STANDALONE_MIN) one after another
            <i>.e                      entry i when it is STANDALONE_MIN bytes or larger (any size in a store
                                       made with pack=False): a file of its own
            window.<pid>.<token>       a SmartCacheDataset's window (monai_cache.shm_window)
            .e<i>.<host>.<pid>.w<n>.tmp  a large entry being written; renamed to <i>.e when complete

:class:`CacheDirectory` is one process's handle on one such directory (one per process and cache, shared by
the stores of the process through :func:`acquire` and :func:`release`): its index slots, segments and entry
files, its counters, and its lease. :func:`list_caches`, :func:`remove_cache` and :func:`remove_half_removed` serve
the command line.

Lifetime (:mod:`monai_cache.shm_lifetime`, which holds its rules): each process using a cache holds a shared
``flock`` on its lease file; the last to leave removes the cache, unless it is kept or a keeper holds it
(:mod:`monai_cache.keeper`); a cache whose lease nobody holds is reclaimed by the next process that joins any cache.

Why plain files and not ``multiprocessing.shared_memory``: on Linux POSIX shared memory *is* a tmpfs file,
and Python 3.11's ``SharedMemory`` registers every segment with a resource tracker that unlinks it when any
independently started process that attached to it exits (torchrun ranks are such processes). Files we open
and ``mmap`` ourselves are not tracked, so nothing deletes entries under other processes.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import os
import stat
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from typing import Any, NamedTuple

from monai_cache import keeper
from monai_cache.memory_limits import read_machine
from monai_cache.runtime import (
    COUNTERS,
    SharedCounters,
    fallocate,
    ofd_lock,
    ofd_unlock,
    pid_alive,
    read_counters,
    register,
    sweep_temp_files,
    temp_name,
    write_all,
)
from monai_cache.shm_lifetime import (
    RootLock,
    defer,
    enter_critical,
    exit_critical,
    in_critical,
    keep_alive_left,
    owned_directory,
    reclaim_stale,
    record_keep_alive,
    recorded_keep_alive,
    remove_abandoned,
    remove_dir,
    remover_of,
    start_idle_collector,
    touch_private,
    try_exclusive,
    unlink_quiet,
)

__all__ = [
    "ENV_SHM_DIR",
    "FIELDS",
    "SEGMENT_SIZE",
    "STANDALONE_MIN",
    "CacheDirectory",
    "Slot",
    "acquire",
    "cache_root",
    "caches_in_front_of",
    "default_shm_dir",
    "half_removed",
    "list_caches",
    "release",
    "remove_cache",
    "remove_half_removed",
    "verify",
]

ENV_SHM_DIR = "MONAI_CACHE_SHM_DIR"
SLURM_JOB_MARK = "slurm_job."  # + the job id: a file in the cache directory for each Slurm job that used it
STANDALONE_MIN = 1 << 20
"""Entries of this many bytes or more get a file of their own (zero-copy mappings, page rounding negligible);
smaller ones are packed one after another into segment files, so a 16 KiB item costs 16 KiB."""
SEGMENT_SIZE = 64 << 20
ROOM_RECHECK_BYTES = 4 << 20  # a process writes at most this much between two looks at the tmpfs's free space
ROOM_RECHECK_SECONDS = 0.1  # ... and looks again at least this often while it writes
STANDALONE = 0xFFFFFFFF  # the segment number of an entry that is a file of its own
FIELDS = (*COUNTERS, "entries", "bytes", "segments")
"""The shared counters of a cache: every store's, plus what it holds and how many segments it has made."""
MAGIC = 0x4D43535433  # "MCST3": this layout (32-byte index slots, runtime.SharedCounters stats)
FLAG_WARNED_FULL = 1
FLAG_WARNED_UNSUPPORTED = 2
FLAG_WARNED_PROJECTION = 4  # the early warning of a cache that will not fit
FLAG_WARNED_BUDGET = 8  # an explicit shm_budget above what the machine offers
# segment, tag (CRC-32 of the entry's size, checksums and number), byte offset, length, reserved, CRC-32 of the slot
_SLOT = struct.Struct("<IIQQII")
SLOT_SIZE = _SLOT.size
PUBLISH_LOCK_AT = 1 << 48  # the publish lock's byte in the locks file, past every entry's (byte i: entry i)
_EMPTY_SLOT = bytes(_SLOT.size)
_ENTRY_SUFFIX = ".e"
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.ENOMEM)  # tmpfs full, quota, or no memory to back it


class Slot(NamedTuple):
    """Where entry ``i`` lives, as its index slot says."""

    segment: int
    """The segment number, or :data:`STANDALONE` for a file of its own."""
    offset: int
    length: int
    tag: int
    """Binds the slot to the blob it points at (:func:`entry_tag`)."""


class _Corrupt:
    __slots__ = ()

    def __repr__(self) -> str:
        return "CORRUPT"


CORRUPT = _Corrupt()
"""What :meth:`CacheDirectory.read_slot` returns for a damaged slot."""


def entry_tag(identity: bytes | memoryview, i: int) -> int:
    """The tag of entry ``i`` whose blob has ``identity`` (:func:`monai_cache.codec.blob_identity`): a slot
    copied from another entry, or pointing at other data, does not match."""
    return zlib.crc32(i.to_bytes(8, "little"), zlib.crc32(identity))


def default_shm_dir() -> str:
    """``$MONAI_CACHE_SHM_DIR`` if set, else ``/dev/shm``."""
    return os.environ.get(ENV_SHM_DIR) or "/dev/shm"


def cache_root(shm_dir: str | None = None, create: bool = True) -> str:
    """The per-user directory holding this user's caches, created with mode 0700.

    Args:
        shm_dir: the tmpfs directory (default :func:`default_shm_dir`).
        create: create the per-user directory if it is missing.

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


# ------------------------------------------------------------------------------------------- a cache
class CacheDirectory:
    """One process's handle on one cache directory: its lease, counters, index slots, segments and entry files.

    Made by :func:`acquire` (one per process and cache, reference counted); joining takes a shared lease under
    the root lock, reclaiming stale caches and starting a stale or foreign copy of this one afresh.

    Args:
        root: the per-user root (:func:`cache_root`).
        key: the cache's name.
        keep: keep the cache after its last user leaves (``keep_warm``).
        keep_alive: seconds to keep the cache after its last user leaves (or, under torchrun, after the node's
            agent exits): :mod:`monai_cache.keeper`.
    """

    def __init__(self, root: str, key: str, keep: bool, keep_alive: float = 0.0) -> None:
        self.root = root
        self.key = key
        self.path = os.path.join(root, key)
        self.refs = 0
        self.owner_pid = os.getpid()
        self.lease_fd = -1
        self.keep_alive = keep_alive
        self._join(keep)
        self.counters = SharedCounters(FIELDS, os.path.join(self.path, "stats"), MAGIC)
        self._sweep_dead_writers()
        self.locks_path = os.path.join(self.path, "locks")
        flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
        self.index_fd = os.open(os.path.join(self.path, "index"), flags, 0o600)
        self._segment_fds: dict[int, int] = {}  # read-only descriptors, one per segment (not per entry)
        self._publish_fd = -1  # this process's descriptor of the locks file for the publish lock (opened once)
        self._publish_lock = threading.Lock()  # ... and its threads' turn at it (one OFD: threads share the lock)
        self._append_lock = threading.Lock()
        self._writer: tuple[int, int, int] | None = None  # (pid, segment number, fd) being appended to
        self._writing: dict[int, int] = {}  # writer fd -> threads of this process writing into it now
        self._retired: set[int] = set()  # writer fds of finished segments, closed when their last write ends
        self._room_unchecked = 0  # bytes room_for() may let through before it asks statvfs again
        self._room_until = 0.0
        self.limiting = ""  # the limit room_for() last found too tight
        self.room = 1 << 62  # the room room_for() last saw (stale by up to ROOM_RECHECK_BYTES); none seen yet: ample
        self._write_pos = 0
        register(self, exit_order=1)  # after the disk stores have flushed (a tier may read from here)

    # -- the index --
    def read_slot(self, i: int) -> Slot | _Corrupt | None:
        """Entry ``i``'s slot, ``None`` if empty, :data:`CORRUPT` if damaged (its CRC binds it to ``i``)."""
        raw = os.pread(self.index_fd, SLOT_SIZE, SLOT_SIZE * i)
        if len(raw) < SLOT_SIZE or raw == _EMPTY_SLOT:
            return None
        seg, tag, offset, length, _reserved, check = _SLOT.unpack(raw)
        if check != zlib.crc32(i.to_bytes(8, "little"), zlib.crc32(memoryview(raw)[: SLOT_SIZE - 4])):
            return CORRUPT
        return Slot(seg, offset, length, tag)

    def _write_slot(self, i: int, slot: Slot) -> None:
        """Write entry ``i``'s slot (the caller holds the publish lock: :meth:`publish`)."""
        head = _SLOT.pack(slot.segment, slot.tag, slot.offset, slot.length, 0, 0)[:-4]
        os.pwrite(self.index_fd, head + struct.pack("<I", zlib.crc32(head + i.to_bytes(8, "little"))), SLOT_SIZE * i)

    def publish(self, slots: list[tuple[int, Slot]]) -> list[bool]:
        """Publish entries whose data is complete: write each one's slot if it is still empty, as one
        compare-and-set under the cache's publish lock; returns which were written.

        An entry already published stays as it is (two processes may compute an entry at once, as batches do:
        :meth:`monai_cache.shm.SharedMemoryStore.publishing_batch`), so a reader never gets two values for one
        entry. Slots go from published to empty only under their entry's lock (:meth:`unpublish`).

        Raises:
            OSError: the cache was removed (ENOENT).
        """
        with self._publish_lock:
            if self._publish_fd < 0:
                self._publish_fd = os.open(self.locks_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW,
                                           0o600)
            ofd_lock(self._publish_fd, PUBLISH_LOCK_AT)
            try:
                written = []
                for i, slot in slots:
                    empty = self.read_slot(i) is None  # a damaged slot is not empty: its reader discards it
                    if empty:
                        self._write_slot(i, slot)
                    written.append(empty)
                return written
            finally:
                ofd_unlock(self._publish_fd, PUBLISH_LOCK_AT)

    def remove_entry_file(self, i: int) -> None:
        """Remove entry ``i``'s file of its own, written but not published (the caller holds the entry's lock)."""
        unlink_quiet(self.entry_path(i))

    def unpublish(self, i: int, slot: Slot | _Corrupt) -> None:
        """Remove entry ``i``, whose slot was ``slot`` (the caller holds its lock): clear the slot, remove its file
        if it has one (a packed entry's bytes stay in the segment until the cache goes), count it gone."""
        os.pwrite(self.index_fd, _EMPTY_SLOT, SLOT_SIZE * i)
        if isinstance(slot, Slot) and slot.segment == STANDALONE:
            unlink_quiet(self.entry_path(i))
            self.counters.add({"bytes": -slot.length})
        self.counters.add({"entries": -1})

    def empty_slots(self, n: int) -> list[int]:
        """Indices of the entries of ``range(n)`` not published (one read of the whole index)."""
        raw = os.pread(self.index_fd, SLOT_SIZE * n, 0)
        raw += bytes(SLOT_SIZE * n - len(raw))
        return [i for i in range(n) if raw[SLOT_SIZE * i : SLOT_SIZE * (i + 1)] == _EMPTY_SLOT]

    def removed(self) -> bool:
        """Whether this cache was removed while in use (its index file was unlinked)."""
        try:
            return os.fstat(self.index_fd).st_nlink == 0
        except OSError:
            return True

    # -- entries' bytes --
    def entry_path(self, i: int) -> str:
        """The file of entry ``i`` when it is a file of its own."""
        return f"{self.path}/{i}{_ENTRY_SUFFIX}"

    def segment_fd(self, seg: int) -> int:
        """A read-only descriptor of segment ``seg`` (opened once per process)."""
        fd = self._segment_fds.get(seg)
        if fd is None:
            fd = os.open(f"{self.path}/s.{seg}", os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
            with self._append_lock:
                if seg in self._segment_fds:  # another thread opened it meanwhile
                    os.close(fd)
                    fd = self._segment_fds[seg]
                else:
                    self._segment_fds[seg] = fd
        return fd

    def append(self, chunks: Iterator[Any], size: int) -> tuple[int, int]:
        """Write a small entry's ``size`` bytes into this process's segment; returns ``(segment, offset)``.

        Raises:
            OSError: no space (ENOSPC) or the cache was removed (ENOENT).
        """
        with self._append_lock:
            w = self._writer
            if w is None or w[0] != os.getpid() or self._write_pos + size > SEGMENT_SIZE:
                if w is not None and w[0] == os.getpid():
                    self._retire(w[2])
                seg = self.counters.add({"segments": 1})["segments"]
                fd = os.open(
                    f"{self.path}/s.{seg}", os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600
                )
                w = self._writer = (os.getpid(), seg, fd)
                self._write_pos = 0
            offset = self._write_pos
            self._write_pos += (size + 63) // 64 * 64
            fd = w[2]
            self._writing[fd] = self._writing.get(fd, 0) + 1
        try:
            fallocate(fd, offset, size)
            write_all(fd, chunks, offset)
        finally:
            with self._append_lock:
                left = self._writing.pop(fd) - 1
                if left:
                    self._writing[fd] = left
                elif fd in self._retired:
                    self._retired.discard(fd)
                    os.close(fd)
        return w[1], offset

    def _retire(self, fd: int) -> None:
        """Done appending to the segment of ``fd`` (caller holds the append lock): close it now, or when the last
        thread still writing into it finishes (closed early, a descriptor could be reused for another file)."""
        if self._writing.get(fd):
            self._retired.add(fd)
        else:
            os.close(fd)

    def write_entry_file(self, i: int, chunks: Iterator[Any], size: int) -> None:
        """Write a large entry to a temporary file of its own and rename it to ``<i>.e`` once complete.

        Raises:
            OSError: no space (ENOSPC) or the cache was removed (ENOENT); nothing is left behind.
        """
        tmp = os.path.join(self.path, temp_name(f"e{i}"))
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            try:
                fallocate(fd, 0, size)
                write_all(fd, chunks, 0)
            finally:
                os.close(fd)
            os.rename(tmp, self.entry_path(i))
        except BaseException:
            unlink_quiet(tmp)
            raise

    def record_length(self, length: int) -> None:
        """Record how many entries the cache has room for (``monai-cache top`` shows how full it is), once. Best
        effort: a full tmpfs (or any error) leaves it unrecorded, and the cache works as well without it."""
        if length_of(self.path) == length:
            return
        tmp = os.path.join(self.path, temp_name("length"))
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
            try:
                os.write(fd, f"{int(length)}\n".encode())
            finally:
                os.close(fd)
            os.rename(tmp, os.path.join(self.path, "length"))
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(tmp)

    def record_disk_tier(self, directory: str) -> None:
        """Record the disk cache directory behind this cache (shown and cleared with it by the command line)."""
        path = os.path.join(self.path, "disk_tier")
        text = os.path.abspath(directory) + "\n"
        if disk_tier_of(self.path) == text.strip():
            return
        tmp = os.path.join(self.path, temp_name("disk_tier"))
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            os.write(fd, text.encode())
        finally:
            os.close(fd)
        os.rename(tmp, path)

    def space_left(self, reserve: int | None, memory: bool = False) -> tuple[int, str]:
        """``(bytes that may still be used, the limit that says so)``: the tmpfs's free space less ``reserve``
        (default: the smaller of 512 MiB and a quarter of its size; DataLoader workers pass batches through it) and,
        with ``memory``, the memory cgroup's room and ``MemAvailable``, each less a reserve for the training processes
        (:func:`monai_cache.memory_limits.memory_reserve`): tmpfs pages are memory, charged to the cgroup of the
        process that writes them."""
        machine = read_machine(self.path, memory=memory)
        if memory:
            return machine.room(reserve)
        name, room = machine.limits(reserve)[0]
        return room, name

    def room_for(self, size: int, reserve: int | None, memory: bool = False) -> bool:
        """Whether ``size`` more bytes fit beside ``reserve`` (see :meth:`space_left`); when they do not,
        :attr:`limiting` names the limit.

        The limits are read again once this process has written up to ``ROOM_RECHECK_BYTES`` (never more than the
        room it last saw) or after ``ROOM_RECHECK_SECONDS``: once per write, it cost a system call per small entry,
        on which threads filling a cache queued for the GIL. What other processes write meanwhile was never seen by
        the check anyway (it is not atomic across processes); the reserves cover it, and a full tmpfs still fails
        the write itself.
        """
        left = self._room_unchecked - size  # threads may race here: the bytes let through stay within the bound
        if left >= 0 and time.monotonic() < self._room_until:
            self._room_unchecked = left
            return True
        room, self.limiting = self.space_left(reserve, memory)
        self.room = room
        self._room_unchecked = max(0, min(room, ROOM_RECHECK_BYTES) - size)
        self._room_until = time.monotonic() + ROOM_RECHECK_SECONDS
        return room >= size

    # -- joining and leaving --
    def _join(self, keep: bool) -> None:
        with RootLock(self.root):
            reclaim_stale(self.root, skip=self.path)
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
            fd = try_exclusive(lease_path)
            found = None if fresh else read_counters(stats_path, FIELDS)
            magic = None if found is None else found[0]
            other_layout = magic not in (None, 0, MAGIC)  # kept by another version of monai_cache
            if other_layout and fd is None:
                raise RuntimeError(
                    f"the shared-memory cache {self.path} is in use by another version of monai_cache; "
                    "use the same version in every process, or another cache_key / shm_dir"
                )
            wiped = False
            kept = os.path.exists(os.path.join(self.path, "keep")) or keep_alive_left(self.path) > 0
            if fd is not None and not fresh and (other_layout or not kept):
                # Nobody holds a lease: left over by processes that crashed (or kept by another version, whose
                # entries this version cannot read). Start it afresh.
                for name in os.listdir(self.path):
                    if name != "lease":
                        unlink_quiet(os.path.join(self.path, name))
                wiped = True
            if fd is None:
                fd = os.open(lease_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
            fcntl.flock(fd, fcntl.LOCK_SH)  # converts our exclusive lock, if any, under the root lock
            self.lease_fd = fd
            record_keep_alive(self.path, self.keep_alive)
            job = os.environ.get("SLURM_JOB_ID", "")
            if job.isdigit():  # whose it is, for `monai-cache epilog` when the job ends
                touch_private(os.path.join(self.path, f"{SLURM_JOB_MARK}{job}"))
            if keep:
                touch_private(os.path.join(self.path, "keep"))
            else:
                agent = keeper.torchrun_agent()
                if agent is not None:  # the cache outlives a restart of the node's ranks: held while the agent lives
                    keeper.start(self.path, self.root, agent, self.keep_alive)
                keeper.watch(self.path, self.root)  # removes it if its users die without leaving
            if fresh or wiped or magic != MAGIC:
                fresh_counters = SharedCounters(FIELDS, stats_path, MAGIC)
                fresh_counters.reset()
                fresh_counters.close()

    def _sweep_dead_writers(self) -> None:
        """Remove the partial entries of writers killed while writing: they hold shared memory and budget.

        Each joining process sweeps, so a live cache (a restarted worker or rank) and a kept one (the next
        run) both get them back. A temporary file names its writer's pid; a live writer's is never touched.
        """
        freed = sum(size for _path, size in sweep_temp_files(self.path))  # fallocated to its full size first
        if freed:
            self.counters.add({"bytes": -freed})

    def close_files(self) -> None:
        """Close this process's descriptors of the cache (its counts stay in the counters)."""
        for fd in [self.index_fd, *self._segment_fds.values(), *([self._publish_fd] if self._publish_fd >= 0 else [])]:
            try:
                os.close(fd)
            except OSError:
                pass
        self._publish_fd = -1
        if self._writer is not None and self._writer[0] == os.getpid():
            os.close(self._writer[2])
        self.index_fd = -1
        self._segment_fds = {}
        self._writer = None

    def leave(self) -> bool:
        """Drop this process's lease; remove the cache if nobody else holds one. True if removed."""
        if self.lease_fd < 0 or os.getpid() != self.owner_pid:
            return False
        if not os.path.isdir(self.path):  # removed under us (monai-cache clear --all): free what we still hold
            os.close(self.lease_fd)
            self.lease_fd = -1
            self.counters.close()  # the removed files' memory is freed when their last descriptor and map go
            self.close_files()
            return False
        with RootLock(self.root):
            os.close(self.lease_fd)
            self.lease_fd = -1
            if os.path.exists(os.path.join(self.path, "keep")):
                self.close_files()
                return False
            lease = os.path.join(self.path, "lease")
            linger = max(self.keep_alive, recorded_keep_alive(self.path))  # the longest any user asked
            if linger > 0:
                with contextlib.suppress(OSError):
                    os.utime(lease)  # a keeper's deadline counts from the last user's leaving
            fd = try_exclusive(lease)
            if fd is not None and linger > 0:
                os.close(fd)  # nobody else can join meanwhile: we hold the root lock
                if keeper.start(self.path, self.root, None, linger):
                    fd = None  # held by the keeper now
                else:
                    fd = try_exclusive(lease)
            if fd is None:
                self.close_files()
                return False
            try:
                self.counters.close()
                self.close_files()
                remove_dir(self.path)
                return True
            finally:
                os.close(fd)

    def _after_fork_in_child(self) -> None:
        # The child shares the parent's lease (the open file description): drop our reference so that the
        # parent alone decides when the lease ends. Children never leave.
        if self.lease_fd >= 0:
            os.close(self.lease_fd)
            self.lease_fd = -1
        self._append_lock = threading.Lock()  # a lock held by another thread at fork time stays held
        self._publish_lock = threading.Lock()
        if self._publish_fd >= 0:  # the parent's open file description: its lock is not ours to take
            os.close(self._publish_fd)  # (not the last reference: a lock the parent holds stays held)
            self._publish_fd = -1
        self._writer = None  # never append to the parent's segment: start our own on the first write
        self._writing, self._retired = {}, set()  # the parent's writes: its threads did not come along

    def _at_exit(self) -> None:
        self.leave()


# ------------------------------------------------------------------------------------ the process registry
# One CacheDirectory per cache path and process, shared by every store of the process. Taking the registry lock is
# a critical section (shm_lifetime.enter_critical): a finalizer's release inside it waits until it is left.
_registry: dict[str, CacheDirectory] = {}
_registry_lock = threading.Lock()


def acquire(root: str, key: str, keep: bool, keep_alive: float = 0.0) -> CacheDirectory:
    """This process's handle on cache ``key`` (joined now if this process has none), with one more reference.

    Args:
        root: the per-user root (:func:`cache_root`).
        key: the cache's name.
        keep: keep the cache after its last user leaves.
        keep_alive: seconds to keep it after its last user leaves (the longest its stores in this process ask).
    """
    path = os.path.join(root, key)
    enter_critical()
    try:
        with _registry_lock:
            d = _registry.get(path)
            if d is None or d.owner_pid != os.getpid():  # none yet, or inherited through fork without a lease
                d = CacheDirectory(root, key, keep, keep_alive)
                _registry[path] = d
            elif keep:
                touch_private(os.path.join(d.path, "keep"))
            d.keep_alive = max(d.keep_alive, keep_alive)
            d.refs += 1
    finally:
        exit_critical()
    start_idle_collector(_holding)
    return d


def _holding() -> bool:
    """Whether this process holds any cache."""
    return any(d.owner_pid == os.getpid() for d in list(_registry.values()))


def release(d: CacheDirectory) -> None:
    """Give back one reference to ``d``; the last one leaves the cache (which removes it if nobody else uses it)."""
    if in_critical():  # called by a finalizer inside a critical section: later
        defer(functools.partial(release, d))
        return
    enter_critical()
    try:
        with _registry_lock:
            d.refs -= 1
            if d.refs > 0:
                return
            if _registry.get(d.path) is d:
                del _registry[d.path]
    finally:
        exit_critical()
    d.leave()


def release_in_owner(d: CacheDirectory, pid: int) -> None:
    """A store's finalizer: give its reference to ``d`` back, in the process that took it (not in a fork)."""
    if os.getpid() == pid:
        release(d)


def _after_fork_in_child() -> None:
    global _registry_lock
    _registry_lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


# ------------------------------------------------------------------------------------ the command line's
def list_caches(shm_dir: str | None = None) -> list[dict[str, Any]]:
    """Describe this user's shared-memory caches.

    Args:
        shm_dir: the tmpfs directory (default :func:`default_shm_dir`).

    Returns:
        one dict per cache: ``key``, ``path``, ``bytes`` (allocated), ``entries``, ``length`` (the entries it has room
        for, or None), ``stored`` (the bytes of its entries), ``hits``, ``misses``, ``state`` (``live``, ``kept``,
        ``stale`` or ``half-removed``), ``ours`` (its counters have this version's layout), ``disk_tier`` (the disk
        cache directory behind it, or None), and ``remover`` and ``remover_alive`` (None but for a half-removed one:
        :func:`half_removed`).
    """
    root = cache_root(shm_dir, create=False)
    if not os.path.isdir(root):
        return []
    out = []
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        if remover_of(name) is not None:
            info = half_removed(root, name)
            if info is not None:
                out.append(info)
            continue
        if name.startswith(".") or not os.path.isdir(path) or not os.path.exists(os.path.join(path, "stats")):
            continue  # not one of our caches
        try:
            # The probe takes the lease exclusively for an instant: under the root lock, so that a last user
            # leaving at that moment (it probes under the same lock) never mistakes us for another user.
            with RootLock(root):
                fd = try_exclusive(os.path.join(path, "lease"), create=False)
                live = fd is None and os.path.exists(os.path.join(path, "lease"))
                if fd is not None:
                    os.close(fd)
            found = read_counters(os.path.join(path, "stats"), FIELDS)
            with os.scandir(path) as it:
                nbytes = sum(_blocks_of(e) for e in it)
        except FileNotFoundError:  # removed while we looked (its last user left): not a cache any more
            continue
        magic, counts = found if found is not None else (None, {})
        out.append(
            {
                "key": name,
                "path": path,
                "bytes": nbytes,
                "entries": counts.get("entries", 0),
                "length": length_of(path),
                "stored": counts.get("bytes", 0),
                "hits": counts.get("hits", 0),
                "misses": counts.get("misses", 0),
                "state": "live" if live else ("kept" if os.path.exists(os.path.join(path, "keep")) else "stale"),
                "ours": magic == MAGIC,
                "disk_tier": disk_tier_of(path),
                "remover": None,
                "remover_alive": None,
            }
        )
    return out


def half_removed(root: str, name: str) -> dict[str, Any] | None:
    """The cache ``name`` of ``root`` left half-removed (``.trash.<pid>.<n>``: :func:`.shm_lifetime.remover_of`) as
    :func:`list_caches` describes caches; None if it is not ours, or is gone once the root lock is ours (its remover
    was at work: it finished).

    ``state`` is ``half-removed``, ``bytes`` and ``stored`` what its files still hold, ``remover`` the pid that
    began the removal and ``remover_alive`` whether that pid runs now (a zombie counts as dead). Seen under the root
    lock, it is abandoned either way: a live pid is another process's now, or one of another pid namespace.
    """
    path = os.path.join(root, name)
    pid = remover_of(name)
    if pid is None or not owned_directory(path):
        return None
    with RootLock(root):  # a removal under way holds it to the end: we see it done, or abandoned
        try:
            with os.scandir(path) as it:
                nbytes = sum(_blocks_of(e) for e in it)
        except FileNotFoundError:
            return None
    return {
        "key": name,
        "path": path,
        "bytes": nbytes,
        "entries": 0,
        "length": None,
        "stored": nbytes,
        "hits": 0,
        "misses": 0,
        "state": "half-removed",
        "ours": True,
        "disk_tier": None,
        "remover": pid,
        "remover_alive": pid_alive(pid),
    }


def remove_half_removed(key: str, shm_dir: str | None = None) -> bool:
    """Remove the half-removed cache ``key`` (``.trash.<pid>.<n>``: its remover was killed). True if removed.

    Taken under the root lock, which every removal holds until its last file: a removal under way is never
    touched (it is over when the lock is ours). The pid in the name is not asked: it may be reused, or name a
    process of another pid namespace.

    Args:
        key: the directory's name (``list_caches()[i]["key"]`` of a ``half-removed`` one).
        shm_dir: the tmpfs directory (default :func:`default_shm_dir`).
    """
    root = cache_root(shm_dir, create=False)
    if "/" in key or remover_of(key) is None:
        return False
    with RootLock(root):
        return remove_abandoned(root, key)


def length_of(path: str) -> int | None:
    """How many entries the cache at ``path`` has room for, as its users recorded it (None if not recorded)."""
    try:
        with open(os.path.join(path, "length")) as f:
            return int(f.read(64).strip())
    except (OSError, ValueError):
        return None


def disk_tier_of(path: str) -> str | None:
    """The disk cache directory recorded behind the cache at ``path``, or None."""
    try:
        with open(os.path.join(path, "disk_tier")) as f:
            return f.read(4096).strip() or None
    except OSError:
        return None


def caches_in_front_of(directory: str, shm_dir: str | None = None) -> list[dict[str, Any]]:
    """The shared-memory caches whose disk tier is ``directory`` (as :func:`list_caches` describes them).

    Args:
        directory: a disk cache directory.
        shm_dir: the tmpfs directory (default :func:`default_shm_dir`).
    """
    target = os.path.abspath(directory)
    try:
        return [c for c in list_caches(shm_dir) if c["disk_tier"] == target]
    except (FileNotFoundError, NotADirectoryError, PermissionError):  # no shared memory here: no tier
        return []


def verify(path: str, allow_pickle: bool = False) -> dict[str, Any]:
    """Read and check every published entry of the cache at ``path`` without joining it: its index slot
    (checksum), the bytes it points at (the tag binds them to the slot), and their decoding.

    Args:
        path: a cache directory (``list_caches()[i]["path"]``).
        allow_pickle: decode pickled values too; without it their entries are checked but not decoded.

    Returns:
        ``{"path", "checked", "ok", "bad": [{"entry", "error"}], "not_decoded"}``.
    """
    from monai_cache import codec  # torch: only when asked to decode

    ok = not_decoded = 0
    bad: list[dict[str, Any]] = []
    try:
        with open(os.path.join(path, "index"), "rb") as f:
            index = f.read()
    except FileNotFoundError:
        index = b""
    segments: dict[int, memoryview] = {}  # writable copies: decoded tensors may be written into
    for i in range(len(index) // SLOT_SIZE):
        raw = index[SLOT_SIZE * i : SLOT_SIZE * (i + 1)]
        if raw == _EMPTY_SLOT:
            continue
        seg, tag, offset, length, _reserved, check = _SLOT.unpack(raw)
        try:
            if check != zlib.crc32(raw[: SLOT_SIZE - 4] + i.to_bytes(8, "little")):
                raise codec.CorruptEntryError("damaged index slot")
            if seg == STANDALONE:
                with open(f"{path}/{i}{_ENTRY_SUFFIX}", "rb") as f:
                    blob = memoryview(bytearray(f.read()))
            else:
                if seg not in segments:
                    with open(f"{path}/s.{seg}", "rb") as f:
                        segments[seg] = memoryview(bytearray(f.read()))
                blob = segments[seg][offset : offset + length]
            if len(blob) != length or entry_tag(codec.blob_identity(blob), i) != tag:
                raise codec.CorruptEntryError("the slot points at data that is not this entry's")
            codec.decode(blob, allow_pickle=allow_pickle, verify=True)
            ok += 1
        except codec.CorruptEntryError as e:
            if not allow_pickle and "allow_pickle" in str(e):
                not_decoded += 1
                ok += 1
                continue
            bad.append({"entry": i, "error": str(e)})
        except OSError as e:
            bad.append({"entry": i, "error": f"cannot read: {e.strerror or e}"})
    return {"path": path, "checked": ok + len(bad), "ok": ok, "bad": bad, "not_decoded": not_decoded}


def _blocks_of(entry: os.DirEntry) -> int:
    try:
        return entry.stat(follow_symlinks=False).st_blocks * 512 if entry.is_file(follow_symlinks=False) else 0
    except FileNotFoundError:  # removed since the directory was listed
        return 0


def remove_cache(key: str, shm_dir: str | None = None, force: bool = False) -> bool:
    """Remove one cache: stale or kept ones always, live ones only with ``force``. True if removed.

    Args:
        key: the cache's name (a directory of the per-user root).
        shm_dir: the tmpfs directory (default :func:`default_shm_dir`).
        force: remove it even while processes use it (they compute what they read from then on).
    """
    root = cache_root(shm_dir, create=False)
    path = os.path.join(root, key)
    if "/" in key or key.startswith(".") or not owned_directory(path):
        return False  # not a cache of ours
    if not os.path.exists(os.path.join(path, "stats")):
        return False
    with RootLock(root):
        lease = os.path.join(path, "lease")
        fd = try_exclusive(lease, create=False)
        if fd is None and os.path.exists(lease) and not force:
            return False  # live
        try:
            remove_dir(path)
        finally:
            if fd is not None:
                os.close(fd)
    return True
