"""A directory of cache entries: reads are checked, writes are asynchronous, atomic and never recreate it.

:class:`DiskStore` holds the read path and the write decision; the bytes are :mod:`monai_cache.disk_format`'s,
the writing is :mod:`monai_cache.disk_writer`'s, the counters and process hooks :mod:`monai_cache.runtime`'s.

A read (:meth:`DiskStore.get`), top to bottom:

1. publish what this process's writer has finished (entry files get their final names);
2. an entry still queued in this process is decoded from its queued copy;
3. else its packed record (from the pack indexes) or its entry file is read, checked and decoded;
4. a record that fails a check is reported once and removed (a file) or never used again (a packed record),
   and the read is a miss: the caller computes the item and puts it.

A write (:meth:`DiskStore.put`): publish what is finished; skip the item if writes are off, it is known not to
be storable, or it is queued already; encode it here (the queued copy shares no memory with the caller's item);
reserve its names (a temporary file, or this process's pack); queue it. The writer thread writes it (unless an
entry of the key exists by then); the next read, write or ``flush()`` publishes it.

Guarantees:

* A process killed at any moment never leaves a record that a reader accepts: entry files get their name only
  once complete; a packed record is indexed only once complete, and a torn index record fails its CRC.
* Concurrent writers of one entry leave one complete entry (the last rename wins); a packed record superseded
  by a later one of the same key is never read again.
* Only the threads that use the store create names in the directory: removing it while entries are queued
  drops them, and nothing is recreated, no error raised, no warning given.
* Pending writes are published when the process exits normally, DataLoader workers included.
* Nothing is unpickled unless the store was created with ``allow_pickle=True``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

import torch

from monai_cache import codec
from monai_cache.disk_format import (
    DEFAULT_COMPRESSION_LEVEL,
    ENTRY_SUFFIX,
    LOCKS_NAME,
    PACK_LIMIT,
    READ_FLAGS,
    PackedRecord,
    PackIndex,
    StoredEntry,
    entry_lock_byte,
    key_tag,
    read_blob,
    stored_entries,
)
from monai_cache.disk_writer import AsyncWriter, DirectoryGone, EntryWriter, Reservation, adopt_written
from monai_cache.errors import (
    CacheFullWarning,
    CacheUnavailableWarning,
    CorruptEntryError,
    CorruptEntryWarning,
    UncachedItemWarning,
    UnsupportedValueError,
    warn,
)
from monai_cache.runtime import (
    COUNTERS,
    OFDLock,
    SharedCounters,
    arm_exit_hook,
    cache_stats,
    register,
    sweep_temp_files,
    temp_name,
)
from monai_cache.utils import format_bytes, parse_bytes

__all__ = ["DEFAULT_COMPRESSION_LEVEL", "MISSING", "DiskStore", "prepare_cache_dir"]

ENTRY_LOCK_TIMEOUT = 600.0
"""Seconds :meth:`DiskStore.entry_lock` waits for another process computing the same entry before computing it
too."""
EXIT_FLUSH_TIMEOUT = 120.0
"""Seconds a process exiting normally waits, in all, for its pending writes."""
_exit_deadline: float | None = None
WARNED_UNWRITABLE = 1
WARNED_FULL = 2
WARNED_UNSUPPORTED = 4
WARNED_IO = 8
# Write errors that stop this store's writes (one warning), as opposed to a failure of one entry.
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
_NOT_ALLOWED = (errno.EACCES, errno.EPERM, errno.EROFS)


class _Missing:
    __slots__ = ()

    def __repr__(self) -> str:
        return "MISSING"

    def __bool__(self) -> bool:
        return False


MISSING: Any = _Missing()
"""Returned by :meth:`DiskStore.get` when there is no (valid) entry."""
_NO_FILE: Any = object()  # DiskStore._get_file: there is no entry file for the key
_BAD: Any = object()  # DiskStore._get_packed: the record is bad (reported)
_GONE: Any = object()  # DiskStore._get_packed: the pack no longer exists


class _Job(NamedTuple):
    """An entry queued for the writer thread."""

    enc: codec.Encoded
    """The encoded item, sharing no memory with the caller's item."""
    raw: int
    """The item's tensor bytes in memory (for the counters)."""
    reservation: Reservation


def prepare_cache_dir(path: str | os.PathLike) -> str | None:
    """Create ``path`` (mode 0700) if needed and check that files can be created in it.

    Args:
        path: the cache directory.

    Returns:
        ``None`` if the directory is usable, else a sentence saying why not (it cannot be created, or files
        cannot be written in it); the caller then serves items uncached.

    Raises:
        ValueError: ``path`` exists and is not a directory.
    """
    path = os.fspath(path)
    if os.path.lexists(path) and not os.path.isdir(path):
        raise ValueError(
            f"cache_dir {path!r} exists and is not a directory. Pass the path of a directory (it is created if "
            "missing), remove or rename that file, or pass cache_dir=None to disable the disk cache."
        )
    if not os.path.isdir(path):
        try:
            os.makedirs(path, mode=0o700, exist_ok=True)
        except OSError as e:
            return f"cannot create the cache directory {path!r}: {e.strerror or e}"
    probe = os.path.join(path, temp_name("probe", "p"))
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        return f"cannot write files in the cache directory {path!r}: {e.strerror or e}"
    return None


class DiskStore:
    """Cache entries in one directory; reads are checked, writes are atomic and asynchronous.

    Entries whose record (64-byte header + encoded item) is smaller than ``pack_limit`` are appended to this
    process's pack (``pack.<host>.<pid>.<n>.mcpack``, indexed by ``.mcidx``); larger ones get their own file,
    ``<key>.mcache``. Use :meth:`open` to create the directory if needed and check that it is writable.

    Args:
        directory: an existing directory.
        compression: ``"zstd"`` or ``None`` (store the codec blob as it is).
        compression_level: zstd level (negative levels are faster and compress less).
        compression_threads: zstd worker threads per write (0: compress in the writer thread; -1: one per CPU).
        downcast: store tensors in the smallest dtype that holds them exactly (lossless).
        lossy: ``{top-level key: dtype}`` of values to store in a smaller dtype even when this loses precision.
        allow_pickle: store and load values that the codec cannot store natively with pickle.
        async_writes: write in a background thread (True) or in :meth:`put` itself (False).
        fsync: ``fsync`` each file when written, and the directory after (survives power loss; slower).
        max_pending_writes: most items waiting for the writer; :meth:`put` blocks when reached.
        max_pending_bytes: most bytes of encoded items waiting for the writer (an int or a string like ``"512MiB"``);
            a single larger item is still accepted when nothing else is pending.
        writable: False to only read (no file is ever written or removed).
        describe: names an entry key in warnings (e.g. with the data item); default: the key.
        pack_limit: records (header + encoded item, before compression) smaller than this many bytes are
            packed; 0 gives every entry its own file. Packed entries written by others are read either way.
        shared: the directory is shared by several machines (a cluster file system) or by processes that may
            miss the same entry at once: :meth:`get_or_compute` then computes an entry missing everywhere in one
            process only (the others wait for it, under an entry lock in the directory) and writes it before
            letting them go.
    """

    __slots__ = (
        "__weakref__", "_bad_reported", "_counts", "_describe", "_disabled", "_failing", "_files", "_packs", "_pid",
        "_shared", "_unsupported", "_warned_io", "_writer", "allow_pickle", "async_writes", "compression",
        "compression_level", "compression_threads", "directory", "downcast", "fsync", "lossy", "max_pending_bytes",
        "max_pending_writes", "pack_limit", "shared", "writable",
    )

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        compression: str | None = "zstd",
        compression_level: int = DEFAULT_COMPRESSION_LEVEL,
        compression_threads: int = 0,
        downcast: bool = True,
        lossy: Mapping[str, torch.dtype] | None = None,
        allow_pickle: bool = False,
        async_writes: bool = True,
        fsync: bool = False,
        max_pending_writes: int = 8,
        max_pending_bytes: int | str = "512MiB",
        writable: bool = True,
        describe: Any = None,
        pack_limit: int = PACK_LIMIT,
        shared: bool = False,
    ) -> None:
        if compression not in (None, "zstd", "none"):
            raise ValueError(f"compression must be 'zstd' or None, got {compression!r}")
        if compression == "zstd":
            lo, hi = -(1 << 17), 22  # zstd's fastest "negative" level is -131072, its strongest 22
            if isinstance(compression_level, bool) or not isinstance(compression_level, int):
                raise ValueError(f"compression_level must be an int, got {compression_level!r}")
            if not lo <= compression_level <= hi:
                raise ValueError(f"compression_level must be an int in [{lo}, {hi}], got {compression_level!r}")
        if int(max_pending_writes) < 1:
            raise ValueError(f"max_pending_writes must be at least 1, got {max_pending_writes!r}")
        if isinstance(pack_limit, bool) or not isinstance(pack_limit, int) or pack_limit < 0:
            raise ValueError(f"pack_limit must be an int >= 0, got {pack_limit!r}")
        self.directory = os.fspath(directory)
        self.compression = None if compression == "none" else compression
        self.compression_level = compression_level
        self.compression_threads = int(compression_threads)
        self.downcast = bool(downcast)
        self.lossy = dict(lossy or {})
        self.allow_pickle = bool(allow_pickle)
        self.async_writes = bool(async_writes)
        self.fsync = bool(fsync)
        self.max_pending_writes = int(max_pending_writes)
        self.max_pending_bytes = int(parse_bytes(max_pending_bytes, "max_pending_bytes") or 0)
        self.writable = bool(writable)
        self.pack_limit = pack_limit
        self.shared = bool(shared)
        self._describe = describe
        self._shared = SharedCounters(COUNTERS)
        self._packs = PackIndex(self.directory)
        self._init_process_state()
        register(self)

    @classmethod
    def open(cls, directory: str | os.PathLike, **options: Any) -> DiskStore:
        """A store on ``directory``, created (mode 0700) if missing, with the left-overs of killed writers swept.

        A directory that cannot be created or written gives a store that only reads, and one warning at the
        first write.

        Args:
            directory: the cache directory.
            **options: the keyword arguments of :class:`DiskStore`.

        Raises:
            ValueError: ``directory`` exists and is not a directory.
        """
        problem = prepare_cache_dir(directory)
        store = cls(directory, **options)
        if problem is not None:
            store.disable_writes(f"{problem}. Training continues uncached; pass a writable cache_dir to cache.")
        else:
            sweep_temp_files(store.directory, adopt=adopt_written)  # a killed writer's complete entries are kept
        return store

    # -- process-local state (not pickled, renewed in a forked child) --
    def _init_process_state(self, disabled: str | None = None) -> None:
        self._pid = os.getpid()
        self._counts = dict.fromkeys(COUNTERS, 0)
        self._writer = AsyncWriter(
            self._write_job, self.max_pending_writes, self.max_pending_bytes, f"monai_cache-disk-writer-{id(self):x}"
        )
        self._files: EntryWriter | None = None  # made at the first write
        self._bad_reported: set[str] = set()
        self._unsupported: set[str] = set()
        self._disabled: str | None = disabled if self.writable else "read-only store"
        self._warned_io = False
        self._failing = threading.Lock()  # the writer thread and a reserving caller can fail at the same time

    def _after_fork_in_child(self) -> None:
        # The parent writes and publishes what it queued; the child starts its own writer and pack. What the
        # parent read of the pack indexes stays valid (append-only files). A reason not to write still holds.
        self._packs.after_fork()
        self._init_process_state(self._disabled)

    def _at_exit(self) -> None:
        global _exit_deadline
        if _exit_deadline is None:
            _exit_deadline = time.monotonic() + EXIT_FLUSH_TIMEOUT
        if self._pid == os.getpid():
            self.flush(timeout=max(0.0, _exit_deadline - time.monotonic()))

    def __getstate__(self) -> dict:
        state = {name: getattr(self, name) for name in self.__slots__ if not name.startswith("_")}
        state.update(_describe=self._describe, _shared=self._shared, _disabled=self._disabled)
        return state

    def __setstate__(self, state: dict) -> None:
        disabled = state.pop("_disabled", None)
        for name, value in state.items():
            object.__setattr__(self, name, value)
        self._packs = PackIndex(self.directory)
        self._init_process_state(disabled)
        register(self)

    def __repr__(self) -> str:
        level = f"zstd-{self.compression_level}" if self.compression else "uncompressed"
        return f"DiskStore({self.directory!r}, {level}, {'async' if self.async_writes else 'sync'})"

    def path(self, key: str) -> str:
        """The entry file of ``key`` (``<key>.mcache``): where a large entry is, or would be, stored.

        A packed entry has no file of its own; :meth:`location` says where it is.

        Args:
            key: the entry key (letters, digits, ``_.-``; it becomes the file name).
        """
        return os.path.join(self.directory, key + ENTRY_SUFFIX)

    def location(self, key: str) -> StoredEntry | None:
        """Where the entry of ``key`` is stored (its packed record, else its entry file), or None (not checked).

        Args:
            key: the entry key.
        """
        self._publish()
        loc = self._standing_record(key, refresh=True)
        if loc is not None:
            tag = key_tag(key)
            for entry in stored_entries(self.directory, superseded=True):  # where its index record is
                if entry.tag == tag and entry.offset == loc.offset and os.path.basename(entry.path) == loc.pack:
                    return entry
            return StoredEntry(os.path.join(self.directory, loc.pack), loc.offset, loc.length, tag)
        path = self.path(key)
        try:
            st = os.stat(path, follow_symlinks=False)
        except OSError:
            return None
        return StoredEntry(path, 0, st.st_size, None)

    def _name(self, key: str) -> str:
        return self._describe(key) if self._describe is not None else key

    def _count(self, **deltas: int) -> None:
        for k, d in deltas.items():
            self._counts[k] += d
        self._shared.add(deltas)

    # -- reads --
    def contains(self, key: str) -> bool:
        """Whether a record exists for ``key`` (not checked) or its write is pending in this process.

        Args:
            key: the entry key.
        """
        self._publish()
        if self._writer.get(key) is not None:
            return True
        return self._packs.lookup(key, refresh=True) is not None or os.path.exists(self.path(key))

    def get(self, key: str, fresh: bool = False) -> Any:
        """The item stored under ``key``, or :data:`MISSING`.

        A write still queued in this process is served from memory (a private copy). A file that fails a
        check is reported once, removed, and counted as corrupt; the caller then recomputes the item. A
        packed record that fails a check is reported once and never read again by this process; the
        recomputed item is appended anew and its record supersedes the bad one for every reader.

        Args:
            key: the entry key.
            fresh: look for packs written by other processes now, however recently the directory was listed
                (by default at most every :data:`~monai_cache.disk_format.RELIST_SECONDS`: a pack found late
                only costs a recomputed item).
        """
        self._publish()
        queued = self._writer.get(key)
        if queued is not None:  # decoded from a copy of its blob, exactly as a read of the file would be
            self._count(hits=1)
            return codec.decode(queued.enc.to_bytes(data_crc=False), allow_pickle=self.allow_pickle)
        loc = self._packs.lookup(key)
        if loc is None:
            item = self._get_file(key)
            if item is not _NO_FILE:
                return item
            loc = self._packs.lookup(key, refresh=True, fresh=fresh)  # written by another process since?
        for _ in range(4):
            if loc is None:
                break
            item = self._get_packed(key, loc)
            if item is _GONE:  # its pack was removed (cache cleared): rewritten elsewhere since?
                loc = self._packs.lookup(key, refresh=True)
            elif item is _BAD:
                loc = self._packs.lookup(key)  # another record of the key that forget() found, if any
            else:
                return item
        self._count(misses=1)
        return MISSING

    def _get_packed(self, key: str, loc: PackedRecord) -> Any:
        """The item in a packed record; ``_BAD`` (reported) if the record is bad, ``_GONE`` if its pack is."""
        path = os.path.join(self.directory, loc.pack)
        try:
            fd = os.open(path, READ_FLAGS)
        except (FileNotFoundError, NotADirectoryError):  # the pack was removed (cache cleared)
            self._packs.forget_pack(loc.pack)
            return _GONE
        except OSError as e:
            if e.errno == errno.ELOOP:
                self._bad_record(key, loc, "the pack is a symbolic link")
                return _BAD
            self._warn_io(f"cannot open cache pack {path}: {e.strerror or e}")
            self._count(misses=1)
            return MISSING
        try:
            return self._read_record(fd, path, key, loc.offset, loc.length)
        except CorruptEntryError as e:
            self._bad_record(key, loc, str(e))
            return _BAD

    def _read_record(self, fd: int, path: str, key: str, offset: int = 0, length: int | None = None) -> Any:
        """Read, check and decode the record at ``offset`` of ``fd`` (then closed), counted as a hit; on an I/O
        error :data:`MISSING` (reported once, counted as a miss).

        Raises:
            CorruptEntryError: the record is damaged, foreign, or its decoding fails in any way (a crafted
                record must never crash training).
        """
        try:
            blob, size = read_blob(fd, key, offset, length)
            item = codec.decode(blob, allow_pickle=self.allow_pickle)
        except CorruptEntryError:
            raise
        except OSError as e:
            self._warn_io(f"cannot read cache file {path}: {e.strerror or e}")
            self._count(misses=1)
            return MISSING
        except Exception as e:
            raise CorruptEntryError(f"cannot decode: {e!r}") from None
        finally:
            os.close(fd)
        self._count(hits=1, bytes_read=size)
        return item

    def _bad_record(self, key: str, loc: PackedRecord, why: str) -> None:
        """Never serve this record again (in this process); report it once per entry and process."""
        self._packs.forget(key, loc, bad=True)
        self._count(corrupt=1)
        if key in self._bad_reported:
            return
        self._bad_reported.add(key)
        action = "will be recomputed" if self._disabled is None else "is ignored"
        where = os.path.join(self.directory, loc.pack)
        warn(f"corrupt disk cache record for {self._name(key)} ({why}): {where} at offset {loc.offset} {action}",
             CorruptEntryWarning, stacklevel=5)

    def _get_file(self, key: str) -> Any:
        """The item in the entry file of ``key``; :data:`MISSING` if it is bad, ``_NO_FILE`` if there is none."""
        path = self.path(key)
        try:
            fd = os.open(path, READ_FLAGS)
        except (FileNotFoundError, NotADirectoryError):  # no entry (or no cache directory at all)
            return _NO_FILE
        except OSError as e:
            if e.errno == errno.ELOOP:  # a symlink planted under an entry name
                self._discard(key, path, None, "it is a symbolic link")
            else:
                self._warn_io(f"cannot open cache file {path}: {e.strerror or e}")
            self._count(misses=1)
            return MISSING
        st = os.fstat(fd)
        try:
            return self._read_record(fd, path, key)
        except CorruptEntryError as e:
            self._discard(key, path, st, str(e))
            self._count(misses=1)
            return MISSING

    def _discard(self, key: str, path: str, st: os.stat_result | None, why: str) -> None:
        """Move a bad file aside and remove it; whoever moves it reports it (once per entry and process)."""
        removed = False
        if self.writable:
            try:
                now = os.stat(path, follow_symlinks=False)
            except FileNotFoundError:
                return  # another process removed (and reported) it
            except OSError:
                now = None
            if now is not None and st is not None and (now.st_ino, now.st_dev) != (st.st_ino, st.st_dev):
                return  # replaced by a fresh file meanwhile: leave that one alone
            aside = os.path.join(self.directory, temp_name(key[:16], "bad"))
            try:
                os.rename(path, aside)
            except FileNotFoundError:
                return
            except OSError:
                pass
            else:
                with contextlib.suppress(OSError):
                    os.unlink(aside)
                removed = True
        self._count(corrupt=1)
        if key in self._bad_reported:
            return
        self._bad_reported.add(key)
        action = "was removed and will be recomputed" if removed else "is ignored (it could not be removed)"
        warn(f"corrupt disk cache file for {self._name(key)} ({why}): {path} {action}", CorruptEntryWarning,
             stacklevel=5)

    def _warn_io(self, message: str) -> None:
        if not self._warned_io and self._shared.first(WARNED_IO):
            warn(f"{message}; such items are served uncached", CacheUnavailableWarning, stacklevel=5)
        self._warned_io = True

    def get_or_compute(self, key: str, compute: Callable[[], Any]) -> Any:
        """The item stored under ``key``; if there is none, ``compute()``, store it and return it.

        In a ``shared`` store, the computation runs under the entry's lock (see :meth:`entry_lock`): a process
        that misses the same entry meanwhile, on this machine or another one using the directory, waits and then
        reads the entry instead of computing it again; the entry is written before the lock is released.

        Args:
            key: the entry key.
            compute: makes the item when it is missing.
        """
        item = self.get(key)
        if item is not MISSING:
            return item
        if not self.shared:
            item = compute()
            self.put(key, item)
            return item
        with self.entry_lock(key):
            item = self.get(key, fresh=True)  # computed by the process we waited for?
            if item is not MISSING:
                return item
            item = compute()
            self.write(key, item)  # visible to every process before the lock goes
            return item

    @contextlib.contextmanager
    def entry_lock(self, key: str, timeout: float | None = ENTRY_LOCK_TIMEOUT) -> Iterator[bool]:
        """Hold the lock of entry ``key`` across processes (and machines, on a file system with POSIX locks
        shared by its clients, such as NFSv4 or Lustre): an OFD byte-range lock on the directory's
        :data:`~monai_cache.disk_format.LOCKS_NAME` file, which the kernel (or the file server, when a client
        dies) releases with its holder.

        Args:
            key: the entry key.
            timeout: seconds to wait at most; then the caller goes ahead without it (an entry computed twice is
                better than a stalled job). ``None`` waits as long as it takes.

        Yields:
            whether the lock is held (False: it could not be taken in time, or the directory cannot hold it).
        """
        lock = OFDLock(os.path.join(self.directory, LOCKS_NAME), entry_lock_byte(key))
        try:
            held = lock.acquire(timeout=timeout)
        except OSError:  # a read-only or removed directory: nothing to coordinate through
            held = False
        try:
            yield held
        finally:
            if held:
                lock.release()

    # -- writes --
    def put(self, key: str, item: Any) -> None:
        """Store ``item`` under ``key``: queue it for the writer thread, or write it now if writes are synchronous.

        ``item`` is encoded here, and the writer gets its own copy of the encoded bytes (so that later
        in-place changes by the caller cannot reach the file; downcast values are only stored in their
        smaller dtype). Blocks while the pending writes exceed ``max_pending_writes`` or
        ``max_pending_bytes``. Never raises for I/O problems: they are reported once and the item stays
        uncached.

        Args:
            key: the entry key.
            item: the value to store (tensors, arrays, numbers, strings, enums, dict/list/tuple of these).
        """
        self._publish()
        if self._disabled is not None or key in self._unsupported:
            self._count(skipped=1)
            return
        if not self.async_writes:
            self.write(key, item)
            return
        if self._writer.get(key) is not None:
            return
        raw = codec.item_nbytes(item)
        enc = self._encode(key, item)
        if enc is None:
            return
        reservation = self._reserve(key, enc)
        if reservation is None:
            return
        if enc.nbytes > self.max_pending_bytes:
            # A volume larger than the whole queue: write it now, from the caller's item, rather than hold a
            # copy of it for the writer (that copy would double the memory a multi-gigabyte item takes).
            self._write_encoded(key, enc, raw, reservation)
            self._publish()
            return
        arm_exit_hook()  # flushed when this process exits (a DataLoader worker too)
        self._count(writes_pending=1)  # before the writer can count it done
        if not self._writer.put(key, _Job(enc.detach(), raw, reservation), enc.nbytes):
            self._count(writes_pending=-1)
            self._cancel(reservation)

    def write(self, key: str, item: Any, replace: bool = False) -> bool:
        """Encode and write ``item`` now, and publish it. Returns True if an entry for ``key`` exists afterwards.

        An existing entry for ``key`` is kept (another worker or rank wrote the same item) unless ``replace``.
        Values that the codec cannot store are reported once and the item is not cached; a full disk or an
        unwritable directory is reported once and disables writing in this store.

        Args:
            key: the entry key.
            item: the value to store.
            replace: write even if an entry exists; the new one supersedes it (packed: a later record).
        """
        self._publish()
        if self._disabled is not None:
            self._count(skipped=1)
            return False
        if not replace and self._exists(key):
            self._count(skipped=1)
            return True
        enc = self._encode(key, item)
        reservation = None if enc is None else self._reserve(key, enc, replace=True)
        if enc is None or reservation is None:
            return False
        self._write_encoded(key, enc, codec.item_nbytes(item), reservation)
        self._publish()
        return self._exists(key)

    def _exists(self, key: str) -> bool:
        """Whether ``key`` is stored: a packed record whose pack is still there, or an entry file (a write skipped
        for a record in a removed pack would leave the key uncached)."""
        return self._standing_record(key) is not None or os.path.exists(self.path(key))

    def _standing_record(self, key: str, refresh: bool = False) -> PackedRecord | None:
        """The packed record of ``key`` (``refresh``: see :meth:`PackIndex.lookup`) whose pack is still there; the
        records of a pack found gone (cleared) are all forgotten, and a record of the key written since in another
        pack, if any, is looked at instead."""
        loc = self._packs.lookup(key, refresh=refresh)
        while loc is not None and not os.path.exists(os.path.join(self.directory, loc.pack)):
            self._packs.forget_pack(loc.pack)
            loc = self._packs.lookup(key, refresh=refresh)
        return loc

    def _encode(self, key: str, item: Any) -> codec.Encoded | None:
        """``item`` encoded, or None (reported once, and never tried again) if the codec cannot store it."""
        try:
            return codec.encode(item, allow_pickle=self.allow_pickle, downcast=self.downcast, lossy=self.lossy)
        except UnsupportedValueError as e:
            self._unsupported.add(key)
            self._count(unsupported=1, skipped=1)
            if self._shared.first(WARNED_UNSUPPORTED):
                warn(f"{self._name(key)} is not cached: {e}", UncachedItemWarning, stacklevel=5)
            return None

    def _reserve(self, key: str, enc: codec.Encoded, replace: bool = False) -> Reservation | None:
        """Make the names writing ``key`` needs (in the threads that use the store); None if it will not be written."""
        files = self._entry_writer()
        if files is None:
            self._count(skipped=1)
            return None
        try:
            return files.reserve(key, enc, replace)
        except DirectoryGone:
            self._directory_gone()
        except OSError as e:
            self._write_failed(key, e, enc.nbytes)
        self._count(skipped=1)
        return None

    def _cancel(self, reservation: Reservation) -> None:
        if self._files is not None:
            self._files.cancel(reservation)

    def _write_job(self, key: str, job: _Job) -> None:
        """The writer thread's work for one queued entry: never raises (the thread must not die)."""
        try:
            self._write_encoded(key, job.enc, job.raw, job.reservation)
        except BaseException as e:
            self._count(write_errors=1)
            with contextlib.suppress(Exception):
                warn(f"unexpected error while writing the disk cache entry for {self._name(key)}: {e!r}",
                     CacheUnavailableWarning)
        finally:
            self._count(writes_pending=-1)

    def _write_encoded(self, key: str, enc: codec.Encoded, raw: int, reservation: Reservation) -> bool:
        """Write an encoded item where it was reserved (``raw``: the item's size in memory, for the counters)."""
        files = self._files
        if self._disabled is not None or files is None:
            self._count(skipped=1)
            self._cancel(reservation)
            return False
        if not reservation.replace and self._exists(key):
            self._count(skipped=1)
            files.cancel(reservation)
            return True
        try:
            written, record = files.write(key, enc, reservation)
        except DirectoryGone:
            if files.gone():
                self._directory_gone()
            self._count(skipped=1)  # else its reserved file was cleared (monai-cache clear): not cached
            return False
        except OSError as e:
            files.cancel(reservation)
            self._write_failed(key, e, enc.nbytes)
            return False
        if record is not None:
            self._packs.add(key, record)
        self._count(writes=1, bytes_written=written, bytes_raw=raw, bytes_encoded=enc.nbytes)
        return True

    def _entry_writer(self) -> EntryWriter | None:
        """This process's writer of the directory; None if the directory is gone (it is never recreated)."""
        files = self._files
        if files is None:
            if not os.path.isdir(self.directory):
                return None
            level = self.compression_level if self.compression else None
            files = self._files = EntryWriter(self.directory, level, self.compression_threads, self.fsync,
                                              self.pack_limit)
        return files

    def _publish(self) -> None:
        """Name what the writer finished (called from the threads that use the store, never the writer's)."""
        files = self._files
        if files is None or not files.has_written() or self._pid != os.getpid():
            return
        try:
            published = files.publish()
        except DirectoryGone:
            self._directory_gone()
            return
        except OSError as e:
            self._write_failed("(several entries)", e, 0)
            return
        for key in published.files:
            loc = self._packs.lookup(key)
            if loc is not None:  # replaced by a file: this process reads the file from now on
                self._packs.forget(key, loc)

    def _directory_gone(self) -> None:
        """The directory was removed: drop what this process held for it, silently (removing it wins).

        Called from the threads that use the store or from the writer thread: never waits for the writer.
        """
        dropped = len(self._writer.discard(wait=False))
        if dropped:
            self._count(writes_pending=-dropped, skipped=dropped)
        self._files = None

    def _write_failed(self, key: str, e: OSError, size: int) -> None:
        with self._failing:
            if e.errno in _DISK_FULL + _NOT_ALLOWED and self._disabled is not None:
                self._count(skipped=1)  # in flight when another write failed and stopped writes: one cause, one error
                return
            self._report_write_failure(key, e, size)

    def _report_write_failure(self, key: str, e: OSError, size: int) -> None:
        self._count(write_errors=1)
        if e.errno in _DISK_FULL:
            self._disable(
                WARNED_FULL,
                f"the disk holding the cache directory {self.directory!r} is full ({e.strerror}; the entry for "
                f"{self._name(key)} needed about {format_bytes(size)} before compression). Training continues "
                "without writing more cache files; existing ones are still read. Free some space or pass another "
                "cache_dir.",
                CacheFullWarning,
            )
        elif e.errno in _NOT_ALLOWED:
            self._disable(
                WARNED_UNWRITABLE,
                f"cannot write in the cache directory {self.directory!r} ({e.strerror or e}). Training continues "
                "uncached; check its permissions or pass another cache_dir.",
                CacheUnavailableWarning,
            )
        elif not self._warned_io and self._shared.first(WARNED_IO):
            self._warned_io = True
            warn(f"could not write the disk cache entry for {self._name(key)}: {e}; it stays uncached",
                 CacheUnavailableWarning, stacklevel=5)

    def _disable(self, flag: int, message: str, category: type = CacheUnavailableWarning) -> None:
        already = self._disabled is not None
        self._disabled = message
        dropped = self._writer.disable()
        for job in dropped:
            self._cancel(job.reservation)
        if dropped:
            self._count(writes_pending=-len(dropped), skipped=len(dropped))
        if not already and self._shared.first(flag):
            warn(message, category, stacklevel=6)

    def disable_writes(self, reason: str) -> None:
        """Stop writing (e.g. the directory is known to be unwritable), reporting ``reason`` once.

        Args:
            reason: the warning to show (once for this store and the processes forked from it).
        """
        self._disable(WARNED_UNWRITABLE, reason)

    @property
    def writes_disabled(self) -> str | None:
        """Why this store no longer writes in this process, or None."""
        return self._disabled

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until this process's pending writes are written and published; False if ``timeout`` seconds
        passed first.

        Args:
            timeout: seconds to wait at most; None waits as long as needed.
        """
        done = self._writer.flush(timeout)
        self._publish()
        return done

    def discard_pending(self) -> int:
        """Drop the writes that have not started (e.g. the data changed); wait for the one in progress."""
        dropped = self._writer.discard()
        for job in dropped:
            self._cancel(job.reservation)
        if dropped:
            self._count(writes_pending=-len(dropped), skipped=len(dropped))
        self._publish()
        return len(dropped)

    # -- bookkeeping --
    def stats(self) -> dict[str, dict[str, Any]]:
        """Counters in the shape of :func:`monai_cache.runtime.cache_stats`.

        ``total`` adds up this process and every process forked from the one that created the store (DataLoader
        workers). ``stored`` counts the entries in the directory now (entry files and packed records), and their
        file bytes.
        """
        entries = nbytes = 0
        with contextlib.suppress(OSError):
            for entry in stored_entries(self.directory):
                entries += 1
                nbytes += entry.length
        return cache_stats(self._counts, self._shared.snapshot(), entries, nbytes)

    def entries(self) -> Iterator[StoredEntry]:
        """The entries in the directory (any key, any writer): entry files and the packed records readers use
        (one per key; see :func:`monai_cache.disk_format.stored_entries`)."""
        return stored_entries(self.directory)
