"""Writing a disk cache: every name is made by the threads that use the store, the bytes by a background thread.

Two small classes, used by :class:`monai_cache.disk.DiskStore`:

* :class:`EntryWriter` puts encoded entries into one directory in three steps: :meth:`~EntryWriter.reserve`
  (a temporary file for a large entry, or this process's pack for a small one), :meth:`~EntryWriter.write`
  (the bytes; a packed record is visible once its index record is written), and :meth:`~EntryWriter.publish`
  (written entry files are renamed to their final names).
* :class:`AsyncWriter` is the queue and the thread: :meth:`~AsyncWriter.put`, :meth:`~AsyncWriter.flush`,
  :meth:`~AsyncWriter.discard`, :meth:`~AsyncWriter.disable`; one :meth:`~AsyncWriter._write_one` serves the
  thread and ``flush`` alike.

The rule that joins them: **the background thread never creates, renames or removes a name in the cache
directory**. ``reserve`` and ``publish`` run in the threads that call the store (at each read and write, in
``flush()``, and when the process exits); the writer thread only writes into files that already have a name,
which it opens for each write and closes after it. So once the program stops using a dataset, nothing appears
in its cache directory any more, and removing the directory right after use (``tempfile.TemporaryDirectory``,
a sweep's cleanup) always wins: the writer finds its files gone and drops what it held, without a warning. And
between writes no descriptor is open for writing: the file system can be remounted read-only or unmounted.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from monai_cache import codec
from monai_cache.disk_format import (
    ENTRY_SUFFIX,
    HEADER_SIZE,
    INDEX_RECORD_SIZE,
    INDEX_SUFFIX,
    PACK_MAX_BYTES,
    PACK_SUFFIX,
    PackedRecord,
    index_header,
    index_record,
    key_tag,
    read_header,
    write_record,
)
from monai_cache.errors import CorruptEntryError
from monai_cache.runtime import HOST_TAG, temp_name

__all__ = ["AsyncWriter", "DirectoryGone", "EntryWriter", "Published", "Reservation", "adopt_written"]

_pack_numbers = itertools.count()  # per process: two stores of one process never share a pack
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW
_OPEN = os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
WRITER_IDLE_SECONDS = 2.0
_LABEL_MAX = 160  # of an entry key in a temporary file's name (a longer key's file is never adopted)


class DirectoryGone(OSError):
    """The cache directory was removed while entries were being written into it."""


class _Pack:
    """A pack and its index, named when made; this process appends to it, one record at a time."""

    __slots__ = ("index_size", "name", "removed", "size")

    def __init__(self, name: str) -> None:
        self.name = name
        self.size = 0
        self.index_size = 0
        self.removed = False  # found gone (``monai-cache clear``): the next reservation makes a new pack


class Reservation(NamedTuple):
    """Where an entry will be written: a temporary file of its own, or this process's pack."""

    temp: str | None
    """The temporary file (a large entry), renamed to the entry's name when published."""
    pack: _Pack | None
    """The pack (a small entry)."""
    replace: bool


class Published(NamedTuple):
    """What one :meth:`EntryWriter.publish` named."""

    files: list[str]
    """Keys whose entry file got its name."""


class EntryWriter:
    """Puts encoded entries into one cache directory, for one process (see the module's docstring).

    Args:
        directory: the cache directory (it must exist).
        level: zstd level, or ``None`` to store blobs uncompressed.
        threads: zstd threads per write.
        fsync: ``fsync`` each file when written, and the directory after a publication.
        pack_limit: records smaller than this many bytes are appended to a pack.
    """

    def __init__(self, directory: str, level: int | None, threads: int, fsync: bool, pack_limit: int) -> None:
        self.directory = directory
        self.level = level
        self.threads = threads
        self.fsync = fsync
        self.pack_limit = pack_limit
        self._pack: _Pack | None = None
        self._pack_lock = threading.Lock()  # appends, one at a time
        self._lock = threading.Lock()  # the written files waiting to be published (never held during a write)
        self._written: list[tuple[str, str]] = []  # (key, temporary file)

    def gone(self) -> bool:
        """Whether the directory was removed."""
        return not os.path.isdir(self.directory)

    def after_fork(self) -> None:
        """In a forked child: never append to the parent's pack, never publish the parent's files."""
        self._pack = None
        self._pack_lock = threading.Lock()
        self._lock = threading.Lock()
        self._written = []

    # -- 1. reserve (the threads that use the store) --
    def reserve(self, key: str, enc: codec.Encoded, replace: bool = False) -> Reservation:
        """Make the names that writing ``key`` will need: a temporary file, or a pack if this process has none.

        Raises:
            DirectoryGone: the directory was removed.
            OSError: a file could not be created (no space, no permission...).
        """
        if HEADER_SIZE + enc.nbytes < self.pack_limit:
            pack = self._pack
            if pack is None or pack.size >= PACK_MAX_BYTES or not self._still_there(pack):
                pack = self._pack = self._new_pack()
            return Reservation(None, pack, replace)
        # The whole key names the temporary file: a killed writer's complete entry can be finished by the next
        # process that opens the directory (adopt_written).
        temp = os.path.join(self.directory, temp_name(key[:_LABEL_MAX]))
        try:
            os.close(os.open(temp, _CREATE, 0o600))
        except FileNotFoundError:
            raise DirectoryGone(errno.ENOENT, "the cache directory was removed") from None
        return Reservation(temp, None, replace)

    @staticmethod
    def _still_there(pack: _Pack) -> bool:
        """Whether ``pack`` and its index still have their names (``monai-cache clear`` removes them under a
        running training). Looked at for each reservation: the writer thread finds a removed pack only when it
        writes, and drops what was reserved in it. Two ``stat`` calls, about 1 us each, against the tens of
        microseconds of encoding a small entry."""
        if pack.removed:
            return False
        if os.path.exists(pack.name + PACK_SUFFIX) and os.path.exists(pack.name + INDEX_SUFFIX):
            return True
        pack.removed = True
        return False

    def _new_pack(self) -> _Pack:
        while True:
            name = os.path.join(self.directory, f"pack.{HOST_TAG}.{os.getpid()}.{next(_pack_numbers)}")
            try:
                pack_fd = os.open(name + PACK_SUFFIX, _CREATE, 0o600)
            except FileExistsError:  # left by an earlier process that had our pid: never append to its pack
                continue
            except FileNotFoundError:
                raise DirectoryGone(errno.ENOENT, "the cache directory was removed") from None
            try:
                index_fd = os.open(name + INDEX_SUFFIX, _CREATE, 0o600)
            except BaseException as e:
                os.close(pack_fd)
                with contextlib.suppress(OSError):
                    os.unlink(name + PACK_SUFFIX)
                if isinstance(e, FileExistsError):
                    continue
                raise
            break
        pack = _Pack(name)
        try:
            head = index_header()
            if os.pwrite(index_fd, head, 0) != len(head):  # pragma: no cover - 16 bytes are not split
                raise OSError(errno.EIO, "short write to a pack index")
            pack.index_size = len(head)
            if self.fsync:
                os.fsync(index_fd)
                os.fsync(pack_fd)
                self._fsync_directory()
        finally:
            os.close(pack_fd)
            os.close(index_fd)
        return pack

    def cancel(self, reservation: Reservation) -> None:
        """Remove the temporary file of an entry that will not be written (the threads that use the store)."""
        if reservation.temp is not None:
            with contextlib.suppress(OSError):
                os.unlink(reservation.temp)

    # -- 2. write (any thread, the writer's in particular) --
    def write(self, key: str, enc: codec.Encoded, reservation: Reservation) -> tuple[int, PackedRecord | None]:
        """Write the entry ``key`` where it was reserved.

        Returns:
            ``(bytes written, the packed record, or None for an entry file: it is visible once published)``.

        Raises:
            DirectoryGone: the directory, or the file reserved in it, was removed: nothing was written.
            OSError: the write failed (e.g. ENOSPC); nothing of it is visible.
        """
        if reservation.pack is not None:
            return self._append(key, enc, reservation.pack)
        temp = reservation.temp
        assert temp is not None
        try:
            fd = os.open(temp, _OPEN)
        except FileNotFoundError:  # removed with the directory (or cleared): never create it again
            raise DirectoryGone(errno.ENOENT, "the entry's temporary file was removed") from None
        try:
            n = write_record(fd, key, enc, self.level, self.threads)
            if self.fsync:
                os.fsync(fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)  # give the space back now; the name goes at publication or the next sweep
            raise
        finally:
            os.close(fd)
        with self._lock:
            self._written.append((key, temp))
        return n, None

    def _append(self, key: str, enc: codec.Encoded, pack: _Pack) -> tuple[int, PackedRecord]:
        """Append the record to ``pack``, then its index record."""
        with self._pack_lock:
            try:
                pack_fd = os.open(pack.name + PACK_SUFFIX, _OPEN)
                try:
                    index_fd = os.open(pack.name + INDEX_SUFFIX, _OPEN)
                except BaseException:
                    os.close(pack_fd)
                    raise
            except FileNotFoundError:  # removed (cache cleared, or the whole directory)
                pack.removed = True
                raise DirectoryGone(errno.ENOENT, "the pack was removed") from None
            offset = pack.size
            indexed = False
            try:
                n = write_record(pack_fd, key, enc, self.level, self.threads, offset)
                if self.fsync:
                    os.fsync(pack_fd)  # the record is on disk before any index record points to it
                stamp = time.time_ns()
                rec = index_record(key_tag(key), offset, n, stamp)
                if os.pwrite(index_fd, rec, pack.index_size) != len(rec):  # pragma: no cover - 48 bytes
                    raise OSError(errno.EIO, "short write to a pack index")
                indexed = True
                if self.fsync:
                    os.fsync(index_fd)
            except BaseException:
                # The tail of this pack (or its index) is now unknown: never append to it again. Give back
                # the space of a record no index record points to.
                if not indexed:
                    with contextlib.suppress(OSError):
                        os.ftruncate(pack_fd, offset)
                pack.removed = True
                raise
            finally:
                os.close(pack_fd)
                os.close(index_fd)
            pack.size = offset + n
            pack.index_size += INDEX_RECORD_SIZE
        return n + INDEX_RECORD_SIZE, PackedRecord(os.path.basename(pack.name) + PACK_SUFFIX, offset, n, stamp)

    # -- 3. publish (the threads that use the store) --
    def has_written(self) -> bool:
        """Whether entry files wait for :meth:`publish` (cheap; no lock)."""
        return bool(self._written)

    def publish(self) -> Published:
        """Rename the written entry files to their final names (replacing an entry of the same key, if any).

        Raises:
            DirectoryGone: the directory was removed; the written files went with it.
            OSError: a rename failed; the files not renamed are removed.
        """
        with self._lock:
            written, self._written = self._written, []
        done: list[str] = []
        try:
            for k, (key, temp) in enumerate(written):
                try:
                    os.rename(temp, os.path.join(self.directory, key + ENTRY_SUFFIX))
                except FileNotFoundError:
                    if self.gone():
                        raise DirectoryGone(errno.ENOENT, "the cache directory was removed") from None
                    continue  # its temporary file was swept or cleared: the entry stays uncached
                except BaseException:
                    for _key, other in written[k:]:
                        with contextlib.suppress(OSError):
                            os.unlink(other)
                    raise
                done.append(key)
        finally:
            if done and self.fsync:
                self._fsync_directory()
        return Published(done)

    def _fsync_directory(self) -> None:
        fd = os.open(self.directory, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def adopt_written(path: str, name: str) -> bool:
    """Finish the entry file a killed writer completed but did not publish: rename it to its entry's name.

    A large entry is written into a temporary file by the writer thread and renamed by the next call into the
    store (or at exit); a process killed in between leaves a complete entry under a temporary name. Its header
    is written last and binds it to its key and size, so a valid header means a complete record (the payload's
    checksum is checked at every read, as for any entry). Passed to :func:`monai_cache.runtime.sweep_temp_files`
    by :meth:`monai_cache.disk.DiskStore.open`, for the left-overs of dead writers only.

    Args:
        path: the temporary file.
        name: its name (``.<key>.<host>.<pid>.w<n>.tmp``).

    Returns:
        True if it is now the entry (or another process adopted it first); False to remove it.
    """
    parts = name.split(".")
    if len(parts) != 6 or not parts[4].startswith("w"):
        return False
    key = parts[1]
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return True  # adopted or swept by another process meanwhile
    except OSError:
        return False
    try:
        read_header(os.pread(fd, HEADER_SIZE, 0), key, os.fstat(fd).st_size)
    except (CorruptEntryError, OSError):
        return False
    finally:
        os.close(fd)
    final = os.path.join(os.path.dirname(path), key + ENTRY_SUFFIX)
    if os.path.exists(final):  # written again since: the file under the name wins, this copy goes
        return False
    try:
        os.rename(path, final)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return True


class AsyncWriter:
    """A bounded queue of jobs and the thread that does them.

    :meth:`put` blocks while the queue holds ``max_items`` jobs or ``max_bytes`` bytes (a single larger job
    is still accepted when nothing else waits). The thread exits when idle and is started again by the next
    :meth:`put`; after a fork the child starts its own (the parent does what it queued).

    Args:
        do: does one job: ``do(key, job)``; it handles its own errors.
        max_items: most jobs waiting.
        max_bytes: most bytes waiting (as each job's ``nbytes`` says).
        name: the thread's name.
    """

    def __init__(self, do: Callable[[str, Any], None], max_items: int, max_bytes: int, name: str) -> None:
        self._do = do
        self.max_items = max_items
        self.max_bytes = max_bytes
        self.name = name
        self._reset()

    def _reset(self) -> None:
        self._pid = os.getpid()
        self._cond = threading.Condition(threading.Lock())
        self._queue: dict[str, tuple[Any, int]] = {}  # key -> (job, its size)
        self._queued_bytes = 0
        self._doing: str | None = None
        self._thread: threading.Thread | None = None
        self._disabled = False

    def after_fork(self) -> None:
        """In a forked child: an empty queue and no thread (the parent does what it queued)."""
        self._reset()

    def get(self, key: str) -> Any:
        """The queued job of ``key`` (also while it is being done), or None."""
        with self._cond:
            queued = self._queue.get(key)
        return None if queued is None else queued[0]

    def put(self, key: str, job: Any, nbytes: int) -> bool:
        """Queue ``job`` (``nbytes`` bytes) under ``key``.

        Returns:
            False if it was not queued: a job of ``key`` is queued already, or the writer is disabled.
        """
        if os.getpid() != self._pid:  # forked without the fork hook (should not happen): start afresh
            self._reset()
        with self._cond:
            while (
                self._queue
                and not self._disabled
                and (len(self._queue) >= self.max_items or self._queued_bytes + nbytes > self.max_bytes)
            ):
                self._cond.wait(1.0)
                if self._thread is None or not self._thread.is_alive():
                    self._start()  # (defensive: the thread only exits when nothing is queued)
            if self._disabled or key in self._queue:
                return False
            self._queue[key] = (job, nbytes)
            self._queued_bytes += nbytes
            if self._thread is None:
                self._start()
            else:
                self._cond.notify_all()
        return True

    def _start(self) -> None:
        # called with self._cond held
        t = threading.Thread(target=self._loop, name=self.name, daemon=True)
        self._thread = t
        t.start()

    def _loop(self) -> None:
        me = threading.current_thread()
        while True:
            with self._cond:
                if self._thread is not me:  # replaced after a fork
                    return
                deadline = time.monotonic() + WRITER_IDLE_SECONDS
                while not self._queue:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        self._thread = None  # exit when idle; put() starts a new one
                        self._cond.notify_all()
                        return
                    self._cond.wait(left)
                key = next(iter(self._queue))
            self._write_one(key)

    def _write_one(self, key: str) -> None:
        """Do the queued job of ``key`` (in the thread, or in :meth:`flush` when there is no thread)."""
        with self._cond:
            queued = self._queue.get(key)
            if queued is None:
                return
            self._doing = key
        try:
            self._do(key, queued[0])
        finally:
            # Every reference to the job (and the tensors it keeps alive) goes before flush() can return:
            # at interpreter exit, tensors freed by this thread after the main thread moved on abort the process.
            del queued
            with self._cond:
                entry = self._queue.pop(key, None)
                if entry is not None:
                    self._queued_bytes -= entry[1]
                del entry
                self._doing = None
                self._cond.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued job is done; False if ``timeout`` seconds passed first.

        Args:
            timeout: seconds to wait at most; None waits as long as needed.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._cond:
                if not self._queue or self._pid != os.getpid():
                    return True
                if self._thread is not None and self._thread.is_alive():
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        return False
                    self._cond.wait(0.5 if left is None else min(0.5, left))
                    continue
                key = next(iter(self._queue))  # no thread (e.g. none can start at interpreter exit): do it here
            self._write_one(key)

    def discard(self, wait: bool = True) -> list[Any]:
        """Drop the jobs not being done; returns them.

        Args:
            wait: also wait until the job being done (if any) is done.
        """
        with self._cond:
            dropped = [self._queue.pop(k) for k in list(self._queue) if k != self._doing]
            self._queued_bytes -= sum(size for _job, size in dropped)
            while wait and self._doing is not None and self._pid == os.getpid():
                self._cond.wait(0.5)
            self._cond.notify_all()
        return [job for job, _size in dropped]

    def disable(self) -> list[Any]:
        """Drop what is queued (but the job being done) and refuse new jobs; returns the jobs dropped."""
        with self._cond:
            self._disabled = True
        return self.discard(wait=False)
