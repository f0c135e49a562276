"""A SmartCacheDataset's current window (the data indices its cache holds, in order), shared with its workers.

The process that runs the dataset's ``update_cache()`` (its *owner*) writes the window into a small file of its
own in the cache's directory in ``/dev/shm`` (``window.<pid>.<token>``); its DataLoader workers map that file
(inherited through ``fork``, reopened by path after ``spawn``) and read it at every item, so that persistent and
spawned workers follow every update. A read costs one 8-byte load while the window is unchanged.

Layout (little-endian)::

    0   magic "MCW1", capacity (u32)
    8   generation of the published window (u64); 0: none yet
    16  slot 0: generation (u64), length (u32), CRC-32 of generation, length and indices (u32), capacity x i64
        slot 1: the same

Window ``g`` is written into slot ``g % 2`` (the one readers are not directed to), then the header is pointed at
it. A reader accepts a slot only if it carries the generation the header names and its CRC matches, so a writer
killed at any point, or a read racing two writes, never yields a window that was not published whole.

The owner removes its file when the dataset releases its cache (or is collected, or the process exits); the cache
directory, and any file a crashed owner left in it, goes with the cache's last user.
"""

from __future__ import annotations

import mmap
import os
import secrets
import struct
import weakref
import zlib
from collections.abc import Sequence

from monai_cache.errors import CacheUnavailableWarning, warn

__all__ = ["SharedWindow", "WINDOW_PREFIX"]

WINDOW_PREFIX = "window."
_MAGIC = b"MCW1"
_HEADER = struct.Struct("<4sIQ")  # magic, capacity, published generation
_SLOT_HEAD = struct.Struct("<QII")  # generation, length, CRC-32
_GENERATION = struct.Struct("<Q")
_INDEX = struct.Struct("<q")
_READ_TRIES = 1000  # a read only retries while the owner rewrites the slot it was reading: two publishes in a row


def _file_size(capacity: int) -> int:
    return _HEADER.size + 2 * (_SLOT_HEAD.size + _INDEX.size * capacity)


def _checksum(generation: int, length: int, body: bytes) -> int:
    return zlib.crc32(body, zlib.crc32(struct.pack("<QI", generation, length)))


class SharedWindow:
    """The window of one dataset: written by its owner process, read by every process it forks or spawns.

    Args:
        directory: where the owner's file goes (the shared-memory cache's directory).
        capacity: the most indices a window holds.
        indices: the first window.
    """

    def __init__(self, directory: str, capacity: int, indices: Sequence[int]) -> None:
        self._directory = directory
        self._capacity = max(int(capacity), 0)
        self._indices: tuple[int, ...] = ()
        self._generation = 0
        self._owner = -1
        self._map: mmap.mmap | None = None
        self.path = ""
        self._finalizer: weakref.finalize | None = None
        self.publish(indices)

    # -- pickling: a spawned worker maps the owner's file and follows it --
    def __reduce__(self) -> tuple:
        return _reopen, (self._directory, self._capacity, self.path, self.indices())

    def __repr__(self) -> str:
        return f"SharedWindow(path={self.path!r}, generation={self._generation}, length={len(self._indices)})"

    @property
    def generation(self) -> int:
        """How many windows this file has published."""
        return self._generation

    def indices(self) -> tuple[int, ...]:
        """The current window: the owner's last published one (read from its file in other processes)."""
        if self._owner == os.getpid() or self._map is None:
            return self._indices
        published = _GENERATION.unpack_from(self._map, 8)[0]
        if published != self._generation:
            self._reload()
        return self._indices

    def _reload(self) -> None:
        assert self._map is not None
        slot_size = _SLOT_HEAD.size + _INDEX.size * self._capacity
        for _ in range(_READ_TRIES):
            published = _GENERATION.unpack_from(self._map, 8)[0]
            offset = _HEADER.size + (published % 2) * slot_size
            generation, length, crc = _SLOT_HEAD.unpack_from(self._map, offset)
            if generation != published or length > self._capacity:
                continue  # being rewritten under us (or a publish interrupted before the header moved)
            start = offset + _SLOT_HEAD.size
            body = self._map[start : start + _INDEX.size * length]
            if _checksum(generation, length, body) != crc:
                continue
            self._indices = struct.unpack(f"<{length}q", body)
            self._generation = generation
            return
        raise RuntimeError(
            f"the shared SmartCacheDataset window {self.path} stays unreadable (damaged, or rewritten faster than it "
            "can be read); restart the DataLoader workers"
        )

    def publish(self, indices: Sequence[int]) -> None:
        """Make ``indices`` the window, for this process and the processes reading its file.

        A process other than the owner (a spawned copy of the dataset driving its own schedule) takes over:
        it writes a file of its own from then on, for the workers it starts.

        Raises:
            ValueError: more than ``capacity`` indices.
        """
        values = tuple(int(i) for i in indices)
        if len(values) > self._capacity:
            raise ValueError(f"a window of {len(values)} items does not fit the {self._capacity} it was made for")
        if self._owner != os.getpid():
            self._take_over()
        generation = self._generation + 1
        self._indices = values
        self._generation = generation
        if self._map is None:  # no file (shared memory unavailable): this process's own view only
            return
        body = struct.pack(f"<{len(values)}q", *values)
        offset = _HEADER.size + (generation % 2) * (_SLOT_HEAD.size + _INDEX.size * self._capacity)
        self._map[offset + _SLOT_HEAD.size : offset + _SLOT_HEAD.size + len(body)] = body
        _SLOT_HEAD.pack_into(self._map, offset, generation, len(values), _checksum(generation, len(values), body))
        _GENERATION.pack_into(self._map, 8, generation)  # published: readers go to the new slot from now on

    def _take_over(self) -> None:
        """Become the owner: a new file of this process's (readers elsewhere keep the file they mapped)."""
        self._owner, self._map = os.getpid(), None
        try:
            self._create()
        except OSError as e:
            warn(
                f"could not create the shared SmartCacheDataset window in {self._directory} ({e}): DataLoader workers "
                "started from now on see the window of their start only, as with MONAI's class (use "
                "persistent_workers=False and the fork start method)",
                CacheUnavailableWarning,
                stacklevel=5,
            )

    def _create(self) -> None:
        path = os.path.join(self._directory, f"{WINDOW_PREFIX}{os.getpid()}.{secrets.token_hex(4)}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            os.ftruncate(fd, _file_size(self._capacity))
            mapped = mmap.mmap(fd, _file_size(self._capacity), mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        os.close(fd)
        _HEADER.pack_into(mapped, 0, _MAGIC, self._capacity, 0)  # nothing published yet
        self.path, self._map = path, mapped
        self._finalizer = weakref.finalize(self, _remove_in_owner, path, os.getpid())

    def close(self) -> None:
        """Remove the owner's file (workers that mapped it keep reading the last window); a no-op elsewhere."""
        if self._finalizer is not None and self._owner == os.getpid():
            self._finalizer()


def _remove_in_owner(path: str, pid: int) -> None:
    if os.getpid() == pid:
        try:
            os.unlink(path)
        except FileNotFoundError:  # the cache's directory went first
            pass


def _reopen(directory: str, capacity: int, path: str, indices: tuple[int, ...]) -> SharedWindow:
    """A spawned process's view of the owner's window: its file mapped read-only, or, if the file is gone (the
    dataset was pickled to something other than a worker of a live owner), the window it was pickled with."""
    window = SharedWindow.__new__(SharedWindow)
    window._directory, window._capacity, window.path = directory, capacity, path
    window._indices, window._generation, window._owner, window._finalizer = tuple(indices), 0, -1, None
    window._map = None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return window
    try:
        if os.fstat(fd).st_size == _file_size(capacity):
            mapped = mmap.mmap(fd, _file_size(capacity), mmap.MAP_SHARED, mmap.PROT_READ)
            if _HEADER.unpack_from(mapped, 0)[:2] == (_MAGIC, capacity):
                window._map = mapped
    finally:
        os.close(fd)
    return window
