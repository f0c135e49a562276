"""A node-wide cache of encoded items in POSIX shared memory (``/dev/shm``), shared by every process.

:class:`SharedMemoryStore` holds the read path and the write decision; the files are
:mod:`monai_cache.shm_directory`'s, the encoding :mod:`monai_cache.codec`'s, the counters :mod:`monai_cache.runtime`'s.

A read (:meth:`SharedMemoryStore.get_or_compute`), top to bottom:

1. read entry ``i``'s index slot: empty is a miss; a damaged slot is reported once, cleared, and a miss;
2. map the entry (a file of its own: copy-on-write, zero-copy) or read it into a private buffer (packed in a
   segment); check that the slot's tag matches the blob, and decode it (tensors are views of that memory);
3. on a miss, take entry ``i``'s lock (an OFD lock: the kernel drops it if the holder dies), read again (another
   process may have published it meanwhile), else compute the item, encode it, write it (a segment or a
   temporary file renamed into place) and publish it by writing its slot last, if it is still empty (a
   compare-and-set under the cache's publish lock). Then read it back, so that every process gets the same
   zero-copy view. Within :meth:`SharedMemoryStore.publishing_batch` (a DataLoader batch:
   ``CacheDataset.__getitems__``), a miss takes no entry lock: a small entry is kept and the batch's entries are
   published together when it ends: one reservation, one write, their slots. The dataset's batches run their
   random transforms once the block has ended, so what is kept is the item itself, encoded with the others at the
   end; otherwise, a copy of its bytes (the caller's random transforms may write into the item meanwhile). Another
   process missing one of them meanwhile computes it too; the first publication stands, the other is counted
   ``skipped``.

Guarantees:

* An entry becomes visible only when its index slot is written, after its bytes are complete, so a crash at
  any moment never leaves an entry that a reader accepts; readers also validate the slot (checksum, tag) and
  the blob and treat a bad one as missing (reported once, recomputed).
* Reads never share writable memory: a transform writing into the tensor it got never changes the shared copy.
* An entry, once published, stays as it is until it is removed: a reader never gets two values for one entry.
* Each entry is computed once across the machine, except by batches that miss it at the same time (disjoint in a
  DataLoader's workers and a ``DistributedSampler``'s ranks); a crashed computer never blocks the others (a
  process killed within a batch loses that batch's staged entries, as it loses the item it was computing: they
  are computed again).
* A full budget or tmpfs, or an item the codec cannot store, makes items uncached with one warning per cache;
  a cache removed while in use (``monai-cache clear --all``) makes this process compute items uncached.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from monai_cache.capacity import Fit, advice, projected_bytes
from monai_cache.errors import (
    CacheFullWarning,
    CacheUnavailableWarning,
    CorruptEntryWarning,
    UncachedItemWarning,
    warn,
)
from monai_cache.keeper import keep_alive_seconds
from monai_cache.launcher import launch_view
from monai_cache.memory_limits import MachineMemory, read_machine
from monai_cache.runtime import COUNTERS, OFDLock, cache_stats, freed_large_item, release_freed_memory
from monai_cache.shm_directory import (
    FLAG_WARNED_BUDGET,
    FLAG_WARNED_FULL,
    FLAG_WARNED_PROJECTION,
    FLAG_WARNED_UNSUPPORTED,
    STANDALONE,
    STANDALONE_MIN,
    Slot,
    acquire,
    cache_root,
    default_shm_dir,
    entry_tag,
    list_caches,
    release_in_owner,
    remove_cache,
)
from monai_cache.utils import format_bytes, parse_bytes

__all__ = ["SharedMemoryStore", "cache_root", "default_shm_dir", "list_caches", "remove_cache"]

_MISSING = object()
# A process gives back the heap a large item freed (runtime.release_freed_memory) only while the room left for the
# cache is under this many times the item's size: about one item's intermediates stay in each process computing
# items (up to 64 of them: ranks x DataLoader workers) until then.
_TIGHT_ITEMS = 64
_codec_module: Any = None


def _codec() -> Any:
    """The codec module, imported at the first read or write: it imports torch (seconds), which ``monai-cache ls``
    and ``clear`` do not need."""
    global _codec_module
    if _codec_module is None:
        from monai_cache import codec

        _codec_module = codec
    return _codec_module
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.ENOMEM)  # tmpfs full, quota, or no memory to back it
_STAGED_BYTES = 4 << 20  # a batch's staged entries are published once they reach this many bytes


class _Staging(threading.local):
    """One thread's batch being published together (see :meth:`SharedMemoryStore.publishing_batch`)."""

    def __init__(self) -> None:
        self.batch = False  # within a batch
        self.untouched = False  # its caller writes into no item it got before the batch ends (publishing_batch)
        self.pid = 0  # the process that opened it: a forked copy publishes nothing of it
        self.entries: list[tuple[int, Any, int]] = []  # (entry, encoded, item bytes)
        self.computed: list[tuple[int, Any, int]] = []  # untouched: (entry, the item itself, its bytes)
        self.staged: set[int] = set()  # the entries among them
        self.nbytes = 0
        self.computed_bytes = 0  # the bytes of the items the block's misses computed and handed out

    @property
    def full(self) -> bool:
        """The block's misses have handed out :data:`_STAGED_BYTES` of computed items: an untouched caller (see
        :meth:`SharedMemoryStore.publishing_batch`) holds them all, so it ends the block and starts another rather
        than hold a batch of large items at once."""
        return self.computed_bytes >= _STAGED_BYTES


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
        keep_alive: seconds to keep the cache after the last process using it leaves (a script or notebook run
            again within that time finds it warm); ``None`` reads ``$MONAI_CACHE_KEEP_ALIVE``, else 0 (removed at
            once, unless ``keep_warm``). Under torchrun the cache lives as long as the node's agent whatever this
            says, so that restarted ranks find it; then this many seconds more.
        allow_pickle: store and load values the codec cannot encode with pickle. Off by default.
        reserve: bytes of ``shm_dir`` left free for others (DataLoader workers pass batches through
            ``/dev/shm``); by default the smaller of 512 MiB and a quarter of its size.
        describe: how warnings name an entry, e.g. ``lambda i: f"item {i}"``.
        verify: record a checksum of the data of every entry written, and check it on every read. Off by
            default: entries are published only once complete, so a crash cannot damage them, and the header and
            layout are always validated; a full check costs about 1 ms per MB written and read. (Entries written
            by a store without ``verify`` carry no data checksum, so a ``verify`` reader of them checks the rest.)
        disk_tier: the disk cache directory behind this cache, if any (a dataset with two tiers): recorded in the
            cache's directory, so that ``monai-cache ls``, ``info`` and ``clear`` show and treat the tiers together.
        pack: pack entries under 1 MiB one after another into segments (default). ``False`` gives every entry a
            file of its own, so that :meth:`remove` gives its memory back at once (for caches whose entries come
            and go, such as ``SmartCacheDataset``'s).
    """

    __slots__ = (
        "__weakref__",
        "_allow_pickle",
        "_budget",
        "_counts",
        "_describe",
        "_dir",
        "_finalizer",
        "_keep",
        "_keep_alive",
        "_length",
        "_pack",
        "_pid",
        "_projected",
        "_released",
        "_removed",
        "_reported",
        "_reserve",
        "_shm_dir",
        "_staging",
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
        keep_alive: float | None = None,
        allow_pickle: bool = False,
        reserve: int | str | None = None,
        describe: Callable[[int], str] | None = None,
        verify: bool = False,
        disk_tier: str | None = None,
        pack: bool = True,
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
        self._keep_alive = keep_alive_seconds(keep_alive)
        self._allow_pickle = bool(allow_pickle)
        self._describe = describe
        self._verify = bool(verify)
        self._pack = bool(pack)
        self._dir = acquire(cache_root(self._shm_dir), key, self._keep, self._keep_alive)
        self._dir.record_length(self._length)
        if disk_tier is not None:
            self._dir.record_disk_tier(disk_tier)
        self._pid = os.getpid()
        # Every store (a dataset's, or a copy unpickled or deep-copied in this process) gives its reference
        # back when it is garbage collected; release() does it now. A finalizer runs at most once.
        self._finalizer = weakref.finalize(self, release_in_owner, self._dir, self._pid)
        self._removed = False  # the directory was removed while in use (monai-cache clear --all)
        self._counts = dict.fromkeys(COUNTERS, 0)
        self._reported: set[int] = set()
        self._unsupported: set[int] = set()  # entries whose item the codec cannot store: computed on each read
        self._released = False
        self._projected: set[int] = set()  # entry counts at which this process projected the cache's size
        self._staging = _Staging()  # per thread: the entries of a batch being published together
        if self._budget is not None:
            self._check_budget()

    def _check_budget(self) -> None:
        """An explicit ``shm_budget`` overrides the machine's limits: say once if it is above what the machine offers
        (past that, a memory cgroup's OOM killer ends the job, or the tmpfs fills)."""
        machine = read_machine(self._dir.path)
        room, limit = machine.room(self._reserve)
        held = self._dir.counters.snapshot()["bytes"]
        budget = int(self._budget or 0)
        if budget > held + max(room, 0) and _is_local_lead() and self._dir.counters.first(FLAG_WARNED_BUDGET):
            warn(
                f"shm_budget={format_bytes(budget)} is more than the machine offers this cache now: "
                f"{format_bytes(held + max(room, 0))} by {limit} ({self._machine_summary(machine)}). An explicit "
                "shm_budget overrides those limits: past them a container's memory limit ends the job (OOM kill) or "
                "the tmpfs fills. Leave shm_budget=None to stay within them.",
                CacheFullWarning,
                stacklevel=4,
            )

    # -- pickling: a spawned DataLoader worker reopens the cache (and holds its own lease while it lives) --
    def __reduce__(self) -> tuple:
        return (
            _attach,
            (self.key, self._length, self._shm_dir, self._budget, self._allow_pickle, self._reserve, self._describe,
             self._verify, self._pack),
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
        with self._entry_locked(i):
            if self._dir.read_slot(i) is None:
                self._write(i, item)

    def __iter__(self) -> Iterator[Any]:
        for i in range(self._length):
            yield self[i]

    def __contains__(self, item: object) -> bool:
        raise TypeError(
            "`item in store` is not supported: it would decode every entry. Use store.contains(index) to ask "
            "whether entry index is cached."
        )

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

    def _name(self, i: int) -> str:
        return self._describe(i) if self._describe is not None else f"entry {i}"

    def _count(self, **deltas: int) -> None:
        """Count in this process and in the cache's shared counters."""
        for k, d in deltas.items():
            self._counts[k] += d
        self._dir.counters.add(deltas)

    # -- reads --
    def missing(self) -> list[int]:
        """Indices of the entries not published yet (one read of the whole index)."""
        return self._dir.empty_slots(self._length)

    def contains(self, index: int) -> bool:
        """Whether entry ``index`` is published (cheap: one read of its index slot, no decoding)."""
        slot = self._dir.read_slot(self._check_index(index))
        return isinstance(slot, Slot)

    def _map(self, i: int, slot: Slot) -> memoryview | None:
        """Entry ``i``'s blob: a copy-on-write mapping (a file of its own: zero-copy; writes land in private pages)
        or a private buffer (packed); None if its file is gone."""
        if slot.segment == STANDALONE:
            try:
                fd = os.open(self._dir.entry_path(i), os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
            except FileNotFoundError:
                return None
            try:
                size = os.fstat(fd).st_size
                if size != slot.length or size == 0:
                    return memoryview(b"")  # not what the slot says: rejected by the decoder
                return memoryview(mmap.mmap(fd, size, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE))
            finally:
                os.close(fd)
        try:
            fd = self._dir.segment_fd(slot.segment)
        except FileNotFoundError:
            return None
        # A packed entry (< 1 MiB) is read into a private buffer: cheaper than map + fault + unmap, and it
        # holds no descriptor or mapping per live item (Python < 3.13 keeps a dup'ed fd for every mmap).
        if not 0 < slot.length < STANDALONE_MIN:
            return memoryview(b"")  # no packed entry is this size: a damaged slot, rejected by the decoder
        buf = bytearray(slot.length)
        got = os.preadv(fd, [buf], slot.offset)
        return memoryview(buf) if got == slot.length else memoryview(b"")  # short: past the segment's end

    def _read(self, i: int, count: bool = True, locked: bool = False) -> Any:
        # The hit path: kept flat (every call and attribute lookup shows in reads of small entries). ``locked``: the
        # caller holds entry i's lock (a bad entry is discarded under it, not under a second lock on i).
        directory = self._dir
        slot = directory.read_slot(i)
        if slot is None:
            return _MISSING
        if slot.__class__ is not Slot:
            self._discard_corrupt(i, slot, "damaged index slot", locked)
            return _MISSING
        view = self._map(i, slot)
        if view is None:
            return _MISSING
        codec = _codec()
        if entry_tag(codec.blob_identity(view), i) != slot.tag:
            self._discard_corrupt(i, slot, "its index slot points at data that is not this entry's", locked)
            return _MISSING
        try:
            item = codec.decode(view, allow_pickle=self._allow_pickle, verify=self._verify)
        except codec.CorruptEntryError as e:
            self._discard_corrupt(i, slot, str(e), locked)
            return _MISSING
        if count:
            counts = self._counts
            counts["hits"] += 1
            counts["bytes_read"] += view.nbytes
            directory.counters.count_read(view.nbytes)
        return item

    def _discard_corrupt(self, i: int, slot: Any, why: str, locked: bool = False) -> None:
        # Under the entry's lock, and only if the slot still says the same: concurrent readers of the same
        # bad entry stay quiet, and an entry republished meanwhile is left alone. A caller holding the lock
        # (``locked``) must not take it again: OFD locks of two descriptors conflict even in one thread, and
        # the kernel detects no deadlock for them (a bad entry found by the read under the lock hung forever).
        with contextlib.nullcontext() if locked else self._entry_locked(i):
            if self._dir.read_slot(i) != slot:
                return
            self._dir.unpublish(i, slot)
        self._count(corrupt=1)
        if i not in self._reported:
            self._reported.add(i)
            warn(f"corrupt shared-memory cache entry for {self._name(i)} ({why}) was removed and will be recomputed",
                 CorruptEntryWarning)

    # -- writes --
    def _write(self, i: int, item: Any) -> bool:
        """Publish entry ``i`` (caller holds its lock); False, with one warning per cache, if it does not fit.

        Raises:
            UnsupportedValueError: the item holds a value the codec cannot store.
        """
        codec = _codec()
        enc = codec.encode(item, allow_pickle=self._allow_pickle)
        return self._publish(i, enc, codec.item_nbytes(item), miss=False)

    def _publish(self, i: int, enc: Any, raw: int, miss: bool) -> bool:
        """Write encoded entry ``i`` (``raw``: the item's bytes in memory) and publish its slot; see :meth:`_write`."""
        codec = _codec()
        size = enc.nbytes
        # The write's counts go into the shared counters with the space it reserves, in one update (each update
        # is a lock and its release: three of them were a quarter of a small item's miss path); they are taken
        # back if the entry is not published.
        done = {"writes": 1, "bytes_written": size, "bytes_encoded": size, "bytes_raw": raw}
        entries = self._reserve_space(size, done, misses=int(miss))
        if size >= STANDALONE_MIN and self._dir.room < _TIGHT_ITEMS * size:
            # Computed, and freed once the caller is done with it: with memory this tight, give the heap it freed
            # back before the next is computed (see runtime). Not otherwise: re-faulting the pages cost 7-13 % of a
            # CT volume's compute (25-51 ms, 5,000-11,000 more page faults, measured part by part in one process), and
            # glibc reuses them anyway.
            freed_large_item()
        if not entries:
            return False
        # The data CRC costs a pass over every byte written (about 5 ms for a 19 MB volume): it is recorded only
        # by stores that check it on every read (verify=True); a published entry cannot be half written anyway.
        with_crc = self._verify
        try:
            if size < STANDALONE_MIN and self._pack:
                seg, offset = self._dir.append(enc.chunks(data_crc=with_crc), size)
            else:
                seg, offset = STANDALONE, 0
                self._dir.write_entry_file(i, enc.chunks(data_crc=with_crc), size)
            # Publish: the data is complete before the slot that points to it is written.
            identity = codec.blob_identity(enc.prefix(data_crc=with_crc))
            published = self._dir.publish([(i, Slot(seg, offset, size, entry_tag(identity, i)))])[0]
        except OSError as e:
            self._unreserve(size, done)
            self._write_failed(i, size, e)
            return False
        if not published:  # a batch elsewhere computed entry i too and published it first: its entry stands
            if seg == STANDALONE:  # ours is unused (large entries are written under the entry's lock, as here)
                self._dir.remove_entry_file(i)
            self._unreserve(size if seg == STANDALONE else 0, done)  # a packed entry's bytes stay in its segment
            return False
        for k, d in done.items():
            self._counts[k] += d
        if entries & (entries - 1) == 0 and entries >= min(4, self._length):  # 4, 8, 16, ...: see _check_projection
            self._check_projection()
        return True

    def _write_failed(self, i: int, size: int, e: OSError) -> None:
        """Say why entries (``size`` bytes, from entry ``i``) could not be written; they are served uncached."""
        if e.errno in _NO_SPACE:
            self._warn_full(size, str(e))
        elif e.errno != errno.ENOENT:  # ENOENT: the cache was removed under us (its last user left)
            self._count(write_errors=1)
            warn(f"could not write the shared-memory cache entry for {self._name(i)}: {e}; serving it uncached",
                 CacheUnavailableWarning)

    def _write_computed(self, i: int, item: Any) -> bool:
        """:meth:`_write` of a miss: an item a dataset computed (counted as a miss here; one that the codec cannot
        store is not an error).

        As in the disk store, the item is served uncached from then on (this process does not try to store
        it again) and one warning per cache names it, its key path and what to do.
        """
        enc = self._encode_computed(i, item)
        return enc is not None and self._publish(i, enc, _codec().item_nbytes(item), miss=True)

    def _encode_computed(self, i: int, item: Any) -> Any:
        """Count a miss of entry ``i`` in this process and encode the computed item; None if the codec cannot store
        it (then the miss is counted in the shared counters too, the entry is served uncached, said once)."""
        codec = _codec()
        self._counts["misses"] += 1
        try:
            return codec.encode(item, allow_pickle=self._allow_pickle)
        except BaseException as e:
            self._dir.counters.add({"misses": 1})  # a published miss counts it with the write's reservation
            if not isinstance(e, codec.UnsupportedValueError):
                raise
            self._unsupported.add(i)
            self._count(skipped=1, unsupported=1)
            if self._dir.counters.first(FLAG_WARNED_UNSUPPORTED):
                warn(f"{self._name(i)} is not cached, it is computed on every read: {e}", UncachedItemWarning,
                     stacklevel=6)
            return None

    def _reserve_space(
        self, size: int, done: dict[str, int], misses: int, entries: int = 1, warn_full: bool = True
    ) -> int:
        """Reserve ``size`` bytes of the cache's budget and count ``entries`` more entries, adding ``done`` (the
        writes' counts) and ``misses`` to the shared counters in the same update; returns the entries counted then,
        or 0 if they do not fit: taken back (the misses kept), counted skipped and said once (``warn_full``), or,
        without ``warn_full``, taken back only (the caller publishes them one by one)."""
        new = self._dir.counters.add({"bytes": size, "entries": entries, "misses": misses, **done})
        used = new["bytes"]
        over_budget = self._budget is not None and used > self._budget
        # with no budget, the memory the machine has is the budget: the tmpfs, the memory cgroup, MemAvailable
        if over_budget or not self._dir.room_for(size, self._reserve, memory=self._budget is None):
            self._unreserve(size, done, entries, skipped=warn_full)
            if not warn_full:
                return 0
            self._warn_full(size, "shm_budget reached" if over_budget else f"no room left by {self._dir.limiting}")
            return 0
        return new["entries"]

    def _unreserve(self, size: int, done: dict[str, int], entries: int = 1, skipped: bool = True) -> None:
        """Take back what :meth:`_reserve_space` added for entries that were not published, and count them skipped
        (not ``skipped``: the caller tries them again)."""
        counted = int(skipped) * entries
        self._dir.counters.add(
            {"bytes": -size, "entries": -entries, "skipped": counted, **{k: -d for k, d in done.items()}}
        )
        self._counts["skipped"] += counted

    def _machine_summary(self, machine: MachineMemory) -> str:
        """What the machine offers, in words, for the warnings."""
        parts = [f"{format_bytes(machine.tmpfs_free)} of {format_bytes(machine.tmpfs_total)} free in {self._shm_dir}"]
        if machine.cgroup is not None:
            parts.append(
                f"a memory cgroup limit of {format_bytes(machine.cgroup.limit)} with "
                f"{format_bytes(machine.cgroup.working_set)} in use"
            )
        if machine.mem_available is not None:
            parts.append(f"{format_bytes(machine.mem_available)} of memory available")
        return "; ".join(parts)

    def _warn_full(self, size: int, why: str) -> None:
        # one warning per cache: none if the early warning (_check_projection) said already that it will not fit
        if not self._dir.counters.first(FLAG_WARNED_FULL) or self._dir.counters.flagged(FLAG_WARNED_PROJECTION):
            return
        snapshot = self._dir.counters.snapshot()
        used, entries = snapshot["bytes"], snapshot["entries"]
        machine = read_machine(self._dir.path)
        needed = max(projected_bytes(entries, used, self._length), used + size)
        budget = "no shm_budget set" if self._budget is None else f"shm_budget {format_bytes(self._budget)}"
        warn(
            f"the shared-memory cache is full ({why}): it holds {format_bytes(used)} in {entries} entries ({budget}); "
            f"the machine offers {self._machine_summary(machine)}; the next entry needs {format_bytes(size)}, and "
            f"all {self._length} entries about {format_bytes(needed)}. Further items are served uncached. To cache "
            "them all: " + "; ".join(advice(needed, machine, held=used)) + " (`monai-cache plan` tells before a run).",
            CacheFullWarning,
            stacklevel=4,
        )

    def _check_projection(self) -> None:
        """The early warning: once the first entries are stored (4, then 8, 16, ...: as more are seen the projection
        gets better), project the bytes of all entries and say once, in this machine's rank 0 (its main process or a
        DataLoader worker of it), if they will not fit in what the machine offers."""
        if not _is_local_lead():
            return
        snapshot = self._dir.counters.snapshot()
        entries, used = snapshot["entries"], snapshot["bytes"]
        if entries in self._projected:
            return
        self._projected.add(entries)
        needed = projected_bytes(entries, used, self._length)
        machine = read_machine(self._dir.path, memory=self._budget is None)
        room, limit = machine.room(self._reserve)
        if self._budget is not None and self._budget - used < room:
            room, limit = self._budget - used, f"shm_budget ({format_bytes(self._budget)})"
        verdict = Fit(needed, used, room, limit)
        if verdict.fits or self._dir.counters.flagged(FLAG_WARNED_FULL):
            return
        if not self._dir.counters.first(FLAG_WARNED_PROJECTION):
            return
        warn(
            f"this shared-memory cache will not fit: its {self._length} entries need about {format_bytes(needed)} "
            f"(projected from the first {entries}, {format_bytes(used)}), and {limit} leaves room for "
            f"{format_bytes(used + max(room, 0))} (the machine offers {self._machine_summary(machine)}). About "
            f"{verdict.cache_rate:.0%} of the items will be cached; the others are computed on every read, with no "
            "further warning. To cache them all: " + "; ".join(advice(needed, machine, used))
            + ".",
            CacheFullWarning,
            stacklevel=5,
        )

    def get_or_compute(
        self,
        index: int,
        compute: Callable[[], Any],
        reuse_computed: bool | Callable[[Any], Any] = False,
        missing: bool = False,
    ) -> Any:
        """Return entry ``index``, computing and publishing it if missing; computed once across processes (but for
        misses with ``reuse_computed`` within :meth:`publishing_batch`, which take no lock).

        Args:
            index: entry index.
            compute: makes the item when it is missing.
            reuse_computed: on a miss, return the computed object itself once it is published, rather than a
                decoded view of what was written (the same values: the codec is exact). Saves a read and, for
                a large entry, the page faults of mapping it; only for computed objects that share no mutable
                memory with anything else, since the caller may change what it gets: True, or a function that
                returns the computed object made so (itself, or with parts copied), or None to read it back (such
                as :func:`monai_cache.sharing.make_private`).
            missing: the caller has just read the entry and found it missing: the first look (taken without
                the entry's lock) is skipped; the look under the lock (if it is taken) is not.

        Returns:
            the item: decoded from shared memory when it could be published (or, with ``reuse_computed``, the
            computed object), else the computed object (also after :meth:`release`, or once the cache was
            removed under this process).
        """
        i = self._check_index(index)
        if i in self._unsupported or self._released or self._removed:
            self._counts["misses"] += 1
            return compute()
        computed: list[Any] = []
        try:
            return self._get_or_compute(i, compute, computed, reuse_computed, missing)
        except FileNotFoundError:
            if not self._cache_removed():
                raise  # not ours (e.g. the transforms' input file is missing)
            if computed:
                return computed[0]
            self._counts["misses"] += 1
            return compute()

    def _get_or_compute(
        self, i: int, compute: Callable[[], Any], computed: list[Any], reuse: bool | Callable[[Any], Any],
        missing: bool,
    ) -> Any:
        if not missing:
            item = self._read(i)
            if item is not _MISSING:
                return item
        staging = self._staging
        if staging.batch and reuse is not False and self._pack and staging.pid == os.getpid():
            # Within a batch, the look its start took for a removed cache stands (one ``fstat`` a batch).
            return self._compute_in_batch(i, compute, computed, reuse)
        if self._cache_removed():  # removed (and perhaps made anew) under us: our files are not its files
            self._counts["misses"] += 1
            return compute()
        lock = self._lock_entry(i)
        try:
            item = self._read(i, locked=True)  # someone may have published it while we waited
            if item is not _MISSING:
                return item
            release_freed_memory()  # the last large item this process computed, freed since: see runtime
            value = compute()
            computed.append(value)
            if callable(reuse):
                private = reuse(value)
                reuse = private is not None
                if reuse:
                    value = computed[0] = private
            if not self._write_computed(i, value) or reuse:
                return value
        finally:
            lock.release()
        item = self._read(i, count=False)
        return value if item is _MISSING else item

    def _compute_in_batch(
        self, i: int, compute: Callable[[], Any], computed: list[Any], reuse: bool | Callable[[Any], Any]
    ) -> Any:
        """A miss within :meth:`publishing_batch`: computed without the entry's lock (a lock taken and given back
        cost about 1 % of a 16 KiB item's first epoch), and staged if small. Another process that misses the entry
        meanwhile computes it too; the first publication stands, the other is counted skipped."""
        staging = self._staging
        if i in staging.staged:  # the batch's second read of an entry it computed: published now, read as a hit
            self._publish_staged()
            item = self._read(i)
            if item is not _MISSING:
                return item
            self._counts["misses"] += 1  # not stored (full, or uncacheable): computed again, as any uncached item
            return compute()
        release_freed_memory()  # the last large item this process computed, freed since: see runtime
        value = compute()
        computed.append(value)
        if callable(reuse):
            private = reuse(value)
            if private is None:  # handed out as the entry reads back: published now, then read
                enc = self._encode_computed(i, value)
                if enc is not None:
                    self._publish_at_once(i, enc, _codec().item_nbytes(value))
                item = self._read(i, count=False)
                return value if item is _MISSING else item
            value = computed[0] = private
        self._stage(i, value)
        return value

    # -- publishing in batches --
    @contextlib.contextmanager
    def publishing_batch(self, untouched: bool = False) -> Iterator[_Staging]:
        """Within this block, this thread's misses of small entries are published together when it ends (a
        DataLoader batch's items: one space reservation, one write and their index slots, rather than one of each
        per item). Its misses take no entry lock: a process that misses an entry this batch has staged (or is
        computing) computes it too, and the first to publish it wins (a compare-and-set of its slot; the other is
        counted ``skipped``), so readers never get two values for one entry. A DataLoader's workers and the ranks
        of a ``DistributedSampler`` read disjoint batches: what they compute twice is what they read at once.
        Nested blocks publish with the outermost.

        Args:
            untouched: the caller writes into none of the items it gets within the block before the block ends
                (``CacheDataset.__getitems__`` runs the random transforms after it). A miss's item is then kept as
                it is and encoded with the batch's others when they are published, rather than encoded and
                copied as it is computed: encoding the batch's entries one after another, then running the random
                transforms one item after another, took 7-11 % less CPU than turn by turn in a 16 KiB item's first
                epoch (each part's code and data stay in the processor's caches). Such a caller ends the block
                once it is ``full`` (the block's state, what it yields), and starts another.
        """
        staging = self._staging
        if staging.batch:
            yield staging
            return
        staging.batch, staging.untouched, staging.pid, staging.computed_bytes = True, untouched, os.getpid(), 0
        try:
            if not self._released:
                self._cache_removed()  # the batch's misses compute uncached if so (see _get_or_compute)
            yield staging
        finally:
            staging.batch = False
            self._publish_staged()

    def _lock_entry(self, i: int) -> OFDLock:
        """Entry ``i``'s lock, taken (staged entries hold none: waiting for one never waits for a batch)."""
        lock = OFDLock(self._dir.locks_path, i)
        lock.acquire()
        return lock

    @contextlib.contextmanager
    def _entry_locked(self, i: int) -> Iterator[None]:
        """Entry ``i``'s lock (:meth:`_lock_entry`) held for a block."""
        lock = self._lock_entry(i)
        try:
            yield
        finally:
            lock.release()

    def _stage(self, i: int, value: Any) -> None:
        """Keep computed entry ``i`` for the batch's publishing; a large one (or one found uncacheable) is
        published (or not) at once instead."""
        staging = self._staging
        raw = _codec().item_nbytes(value)
        if staging.untouched:
            staging.computed_bytes += raw
            if raw < STANDALONE_MIN:  # encoded when the batch is published: nothing writes into it before
                staging.computed.append((i, value, raw))
                staging.staged.add(i)
                staging.nbytes += raw
                if staging.nbytes >= _STAGED_BYTES:
                    self._publish_staged()
                return
        enc = self._encode_computed(i, value)
        if enc is None:
            return
        if enc.nbytes >= STANDALONE_MIN:
            self._publish_at_once(i, enc, raw)
            return
        # The caller's random transforms run on ``value`` before the batch is published, and may write into it:
        # the staged encoding keeps copies of the buffers it borrowed from the item (less than STANDALONE_MIN).
        staging.entries.append((i, enc.detach(), raw))
        staging.staged.add(i)
        staging.nbytes += enc.nbytes
        if staging.nbytes >= _STAGED_BYTES:
            self._publish_staged()

    def _publish_at_once(self, i: int, enc: Any, raw: int) -> None:
        """Publish computed entry ``i`` now, under its lock (a large entry's file is renamed into place under it);
        one that another process published meanwhile stands, and this one is counted skipped."""
        with self._entry_locked(i):
            if self._dir.read_slot(i) is None:
                self._publish(i, enc, raw, miss=True)
                return
        self._dir.counters.add({"misses": 1, "skipped": 1})  # the miss: what _publish counts with its reservation
        self._counts["skipped"] += 1

    def _publish_staged(self) -> None:
        """Publish this thread's staged entries (a forked copy of another process's batch publishes nothing)."""
        staging = self._staging
        entries, computed = staging.entries, staging.computed
        staging.entries, staging.computed, staging.staged, staging.nbytes = [], [], set(), 0
        if staging.pid != os.getpid() or self._released or self._removed:
            self._counts["misses"] += len(computed)  # computed all the same (the others count at their encoding)
            return
        for i, value, raw in computed:  # kept as computed (untouched): encoded now, one after another
            enc = self._encode_computed(i, value)
            if enc is None:
                continue
            if enc.nbytes >= STANDALONE_MIN:  # its header took it over the line: a file of its own
                self._publish_at_once(i, enc, raw)
            else:
                entries.append((i, enc, raw))
        if entries:
            self._publish_batch(entries)

    def _publish_batch(self, entries: list[tuple[int, Any, int]]) -> None:
        """Write staged entries into this process's segment one after another and publish their slots (those
        another process published first are counted skipped)."""
        codec = _codec()
        n = len(entries)
        sizes = [enc.nbytes for _, enc, _ in entries]
        total = sum(sizes)
        done = {"writes": n, "bytes_written": total, "bytes_encoded": total, "bytes_raw": sum(e[2] for e in entries)}
        counted = self._reserve_space(total, done, misses=n, entries=n, warn_full=False)
        if not counted:  # not all of them fit: each on its own, as many as fit (the misses are counted)
            for i, enc, raw in entries:
                self._publish(i, enc, raw, miss=False)
            return
        with_crc = self._verify
        chunks: list[Any] = []
        offsets = []
        pos = 0
        for (_, enc, _), size in zip(entries, sizes):
            if pos % 64:
                chunks.append(bytes(64 - pos % 64))
                pos += 64 - pos % 64
            offsets.append(pos)
            chunks.extend(enc.chunks(data_crc=with_crc))
            pos += size
        try:
            seg, base = self._dir.append(iter(chunks), pos)
            written = self._dir.publish([
                (i, Slot(seg, base + offset, size, entry_tag(codec.blob_identity(enc.prefix(data_crc=with_crc)), i)))
                for (i, enc, _), offset, size in zip(entries, offsets, sizes)
            ])
        except OSError as e:
            self._unreserve(total, done, entries=n)
            self._write_failed(entries[0][0], total, e)
            return
        lost = [(size, raw) for (_, _, raw), size, ok in zip(entries, sizes, written) if not ok]
        if lost:  # published first by another process that computed them too: theirs stand, ours are skipped
            nbytes = sum(size for size, _ in lost)
            taken = {"writes": len(lost), "bytes_written": nbytes, "bytes_encoded": nbytes,
                     "bytes_raw": sum(raw for _, raw in lost)}  # fmt: skip
            self._unreserve(0, taken, entries=len(lost))  # their bytes stay in the segment, as a removed entry's
            done = {k: d - taken[k] for k, d in done.items()}
        for k, d in done.items():
            self._counts[k] += d
        if (counted.bit_length() > (counted - n).bit_length()) and counted >= min(4, self._length):
            self._check_projection()  # the count passed 4, 8, 16, ...: see _check_projection

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
                release_freed_memory()
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
        if self._dir.removed():
            self._removed = True
            warn(
                f"the shared-memory cache {self._dir.path} was removed while this process used it (by "
                "`monai-cache clear --all`, or by set_data() in the process that built the dataset while "
                "persistent DataLoader workers still read it): items are now computed on every read here",
                CacheUnavailableWarning,
                stacklevel=5,
            )
        return self._removed

    def wait_for(self, index: int) -> None:
        """Block until nobody is computing entry ``index``."""
        i = self._check_index(index)
        if self._released or self._removed:
            return
        try:
            with self._entry_locked(i):
                pass
        except FileNotFoundError:
            if not self._cache_removed():
                raise

    # -- bookkeeping --
    def stats(self) -> dict[str, dict[str, Any]]:
        """Counters in the shape of :func:`monai_cache.runtime.cache_stats`: ``total`` is shared by every
        process of the machine using this cache, and ``stored`` counts its entries and their bytes."""
        shared = self._dir.counters.snapshot()
        return cache_stats(self._counts, shared, shared["entries"], shared["bytes"])

    def release(self) -> None:
        """Stop using the cache in this process; the last process to release it removes it (unless kept)."""
        if self._released or os.getpid() != self._pid:
            return
        self._released = True
        self._finalizer()

    def remove(self, index: int) -> bool:
        """Remove entry ``index`` (other processes then see a miss); True if it was published. Its memory is given
        back at once if it is a file of its own; a packed entry's bytes stay in its segment until the cache goes.

        Args:
            index: entry index.
        """
        i = self._check_index(index)
        if self._released or self._removed:
            return False
        with self._entry_locked(i):
            slot = self._dir.read_slot(i)
            if slot is not None:
                self._dir.unpublish(i, slot)
        return slot is not None

    def clear(self) -> None:
        """Forget every entry (other processes using the cache then see misses and recompute).

        Packed entries stay in their segments (counted in ``bytes``) until the cache is removed.
        """
        for i in range(self._length):
            self.remove(i)


def _is_local_lead() -> bool:
    """Whether this process belongs to this machine's rank 0 (the local rank of torchrun's ``LOCAL_RANK`` or Slurm's
    ``SLURM_LOCALID``, else the rank; any process outside a launcher: :func:`monai_cache.launcher.launch_view`), its
    DataLoader workers included: the early warnings are given there, not by every rank."""
    return launch_view(os.environ).node_lead


def _attach(
    key: str, length: int, shm_dir: str, budget: int | None, allow_pickle: bool, reserve: int | None,
    describe: Callable[[int], str] | None, verify: bool, pack: bool = True,
) -> SharedMemoryStore:
    """A spawned worker's store: the same cache, reopened (with a lease of its own)."""
    return SharedMemoryStore(
        key, length, shm_dir=shm_dir, budget=budget, allow_pickle=allow_pickle, reserve=reserve,
        describe=describe, verify=verify, pack=pack,
    )


