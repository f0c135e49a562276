"""A ``monai.data.DataLoader`` whose worker processes hand each batch to the main process as one block.

torch moves a batch from a worker to the main process tensor by tensor: every storage becomes its own
shared-memory file whose descriptor the main process fetches over a socket. A collated MetaTensor batch
holds about a hundred tensors (the image, the label and the affines and other tensors of ``meta`` and
``applied_operations``), so this costs more than the warm read of a cached item itself. Here each worker
encodes its collated batch with :mod:`monai_cache.codec` into one block of a small ring of reusable memfd
segments, and only a tiny handle travels through torch's result queue; unpickling the handle in the main
process decodes the block zero-copy (tensors are views of the segment).

How it works:

* **Worker side.** :class:`_BlockCollate` wraps the collate function (also ``default_convert`` when
  automatic batching is off). It collates with ``torch.utils.data.get_worker_info()`` hidden, so that
  ``default_collate`` stacks into ordinary memory (in a worker it would allocate fresh shared memory for
  every batch, page faults included, which the encode would then copy again), encodes the batch and copies
  it into a free segment of this worker's :class:`_Ring`. A segment is an anonymous ``memfd`` (never a name in
  ``/dev/shm``, so Docker's 64 MB ``--shm-size`` does not apply, and freed by the kernel when the last process
  holding or mapping it is gone); once written, its pages are reused at memcpy speed.
* **Main side.** The handle unpickles into :func:`_receive_block`: the main process opens the worker's segment
  through ``/proc/<worker pid>/fd/<fd>`` (checked by inode), keeps one mapping per segment, and decodes the
  batch from a per-batch buffer object that every tensor of the batch keeps alive. When the last of them is
  gone, a ``weakref.finalize`` marks the segment free in the worker's control page (one byte per segment,
  also a memfd). A segment is never rewritten while any tensor of its batch is referenced: kept batches stay
  valid, pinned copies simply release it sooner.
* **Which way.** A block costs the codec's walk over the batch in Python; torch's way costs a shared-memory file
  per tensor. Each encoded batch is weighed both ways (:meth:`_BlockCollate._torch_is_cheaper`, from the
  header's length, the tensors and the bytes). Where torch's way wins (batches of many small items with their
  metadata), the batch goes that way and so do the worker's next ones, collated as ``monai.data.DataLoader``
  does and not encoded, until it re-checks after :data:`RECHECK_AFTER` batches (then twice as many each time);
  the next workers of the loader start from the last choice, which the main process learns from a
  :class:`_Choice` around the batch that changed it.
* **Bounds.** A worker that finds no free segment large enough makes a new one, up to
  :data:`MAX_SEGMENTS` per worker (batches alive in the main process at once); beyond that, and for a batch
  holding a value the codec cannot store, the batch takes torch's ordinary path, with one
  :class:`~monai_cache.errors.BatchFallbackWarning` per loader. At most :data:`SPARE_SEGMENTS` free segments are
  kept per worker; the others are given back.
* **Across epochs.** Workers are new processes every epoch unless ``persistent_workers=True``. When they exit,
  the main process keeps their segments (a :class:`_Pool` per loader, at most ``num_workers x (prefetch_factor +
  1)``, including those whose batch the user still holds, which join once released) and hands them to the next
  workers, so that their batches are copied into pages already allocated and mapped.
* **Another loader over our datasets.** In a worker of ``monai.data.DataLoader`` (or torch's) that reads one of
  monai_cache's datasets, :func:`send_meta_tensors_as_blocks` has ``ForkingPickler`` send each MetaTensor of a batch
  as one block of the same ring (chosen the same way), unless something outside it shares its objects or memory;
  the main process maps the block only while the MetaTensor lives.
* **Faults.** A worker killed mid-epoch: torch's SIGCHLD handler raises its usual ``RuntimeError``; batches
  already received stay valid (their segments live as long as the main process maps them). The main process
  killed: workers exit (torch's watchdog) and the kernel frees their memfds; nothing is ever left in
  ``/dev/shm``. Where memfds or ``/proc/<pid>/fd`` cannot be used, every batch takes torch's path, with one
  warning.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import io
import logging
import mmap
import os
import pickle
import secrets
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import monai.data
import numpy as np
import torch
from torch.utils.data import Dataset
from torch.utils.data import _utils as torch_data_utils
from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

from monai_cache.codec import Encoded, decode, encode
from monai_cache.errors import BatchFallbackWarning, UnsupportedValueError, warn
from monai_cache.runtime import keep_inherited_pages_shared
from monai_cache.sharing import alone_holders, storage_holders

__all__ = [
    "MAX_SEGMENTS",
    "SPARE_SEGMENTS",
    "DataLoader",
    "block_path_refusal",
    "same_batches_only",
    "send_meta_tensors_as_blocks",
]

_log = logging.getLogger("monai_cache.loader")

MAX_SEGMENTS = 64
"""Segments per worker: the most batches of one worker that can be alive in the main process at once before
further batches take torch's path (one warning). Each also holds a descriptor in the worker."""
SPARE_SEGMENTS = 2
"""Free segments a worker keeps for reuse; it gives back the others (smallest first) after each batch. Twice as many
in a worker of another loader, which sends a block per MetaTensor (:func:`send_meta_tensors_as_blocks`)."""
_FREE, _BUSY, _RETIRED = 0, 1, 2  # one byte per segment in the control page

# What moving a batch costs, in CPU seconds of the worker and the main process together (fitted on 2 cores with
# `python -m benchmarks loader-paths`, which prints these estimates beside the measured costs). torch's way pays per
# tensor (a shared-memory file each, its descriptor fetched over a socket) and per byte (fresh pages); the block pays
# for the codec walking the batch in Python, which the JSON header's length tracks, and one copy of the bytes.
TORCH_PER_TENSOR_S = 300e-6
TORCH_PER_BYTE_S = 0.3e-9
TORCH_PER_HEADER_BYTE_S = 20e-9  # pickling the structure, in C
BLOCK_PER_HEADER_BYTE_S = 100e-9
BLOCK_PER_BYTE_S = 0.1e-9
RECHECK_AFTER = 64
"""Batches a worker sends torch's way (its estimate said cheaper) before it encodes one again to re-check; the
interval doubles at each re-check that confirms it, up to 16 times this."""
_CONTROL_SIZE = 4096
_GRANULE = 64 << 10  # segment sizes are multiples of this (plus 1/8 headroom: padded batches vary a little)


# ---------------------------------------------------------------------------------------------------------
# Worker side
# ---------------------------------------------------------------------------------------------------------


def _map(fd: int, size: int) -> mmap.mmap:
    """A shared mapping with its page table filled at once (far cheaper than a fault per page)."""
    return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))


class _Segment:
    """A memfd owned by this worker and the worker's writable mapping of it."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        st = os.fstat(fd)
        self.ino, self.size = st.st_ino, st.st_size
        self.map = _map(fd, self.size)

    @classmethod
    def create(cls, size: int) -> _Segment:
        fd = os.memfd_create("monai_cache-batch", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            return cls(fd)
        except BaseException:
            os.close(fd)
            raise

    def grow(self, size: int) -> None:
        """Enlarge (only while free: the main process's mapping of the old size stays valid)."""
        os.ftruncate(self.fd, size)
        self.map.close()
        self.map = _map(self.fd, size)
        self.size = size

    def close(self) -> None:
        self.map.close()
        os.close(self.fd)


def _open_proc_file(pid: int, fd: int, ino: int) -> io.FileIO:
    """Open process ``pid``'s descriptor ``fd`` through /proc, checking that it is still the file ``ino``.

    A file object, not a bare descriptor: in the main process torch's SIGCHLD handler raises when a worker dies,
    between any two calls, also the instant a call that made a descriptor returns, before the descriptor is kept
    anywhere. An object that owns its descriptor is closed when that exception drops it; a bare one would stay
    open for good.
    """
    mine = io.FileIO(f"/proc/{pid}/fd/{fd}", "r+")  # close-on-exec, as every file Python opens
    if os.fstat(mine.fileno()).st_ino != ino:
        mine.close()
        raise FileNotFoundError(f"descriptor {fd} of process {pid} is no longer the segment it was")
    return mine


def _open_proc_fd(pid: int, fd: int, ino: int) -> int:
    """:func:`_open_proc_file`'s descriptor, for a worker to own (no SIGCHLD handler of torch's runs there)."""
    with _open_proc_file(pid, fd, ino) as f:
        return os.dup(f.fileno())


def _same_file(fd: int, ino: int) -> bool:
    try:
        return os.fstat(fd).st_ino == ino
    except OSError:
        return False


def _check_proc_access(main_pid: int, control_fd: int, control_ino: int) -> str | None:
    """Why the main process could not open this worker's memfds through /proc, or None if it can.

    Tests what the main process will do, from this side: reopening a memfd by its /proc path, and reading the
    descriptor links of the main process (the same ptrace "read" permission, symmetric between a process and
    its workers, which run with the same credentials).
    """
    try:
        _open_proc_file(os.getpid(), control_fd, control_ino).close()
        links = os.listdir(f"/proc/{main_pid}/fd")
        if links:
            os.readlink(f"/proc/{main_pid}/fd/{links[0]}")
    except OSError as e:
        return f"/proc/<pid>/fd cannot be used to share memfds here ({e})"
    return None


class _Ring:
    """This worker's segments and the control page in which the main process marks them free.

    Args:
        main_pid: the process iterating the loader.
        adopt: ``(descriptor in the main process, inode)`` of free segments left by this loader's previous
            workers, for this worker to reuse (their pages are already allocated).
        inherited: descriptors of the main process's other segments handed to this loader's workers; a forked
            worker closes its copies of those it does not adopt.
    """

    def __init__(self, main_pid: int, adopt: list[tuple[int, int]], inherited: list[tuple[int, int]]) -> None:
        self.pid = os.getpid()
        self.spare = SPARE_SEGMENTS  # free segments kept for reuse
        self.segments: list[_Segment | None] = [None] * MAX_SEGMENTS
        self.control_fd = os.memfd_create("monai_cache-batch-control", os.MFD_CLOEXEC)
        os.ftruncate(self.control_fd, _CONTROL_SIZE)
        self.control = mmap.mmap(self.control_fd, _CONTROL_SIZE)
        self.control_ino = os.fstat(self.control_fd).st_ino
        self.unusable = _check_proc_access(main_pid, self.control_fd, self.control_ino)
        forked = [(fd, ino) for fd, ino in inherited if _same_file(fd, ino)]
        if self.unusable is None:
            for slot, (fd, ino) in enumerate(adopt[:MAX_SEGMENTS]):
                with contextlib.suppress(OSError):  # the main process dropped it meanwhile: make a new one later
                    own = os.dup(fd) if (fd, ino) in forked else _open_proc_fd(main_pid, fd, ino)
                    os.set_inheritable(own, False)
                    self.segments[slot] = _Segment(own)
        for fd, _ino in forked:  # copies inherited by fork: do not keep the main process's segments alive
            os.close(fd)

    def close(self) -> None:
        for seg in self.segments:
            if seg is not None:
                seg.close()
        self.control.close()
        os.close(self.control_fd)

    def _pick(self, nbytes: int) -> int | None:
        """A free slot whose segment holds ``nbytes`` (grown or created if needed), or None at the bound."""
        fitting, largest, empty = None, None, None
        for slot, seg in enumerate(self.segments):
            if seg is None:
                if empty is None:
                    empty = slot
                continue
            if self.control[slot] != _FREE:
                continue
            if seg.size >= nbytes and (fitting is None or seg.size < self.segments[fitting].size):  # type: ignore[union-attr]
                fitting = slot
            if largest is None or seg.size > self.segments[largest].size:  # type: ignore[union-attr]
                largest = slot
        if fitting is not None:
            return fitting
        size = -(-(nbytes + nbytes // 8) // _GRANULE) * _GRANULE
        if largest is not None:
            self.segments[largest].grow(size)  # type: ignore[union-attr]
            return largest
        if empty is None:
            return None
        self.segments[empty] = _Segment.create(size)
        return empty

    def _trim(self) -> None:
        """Give back free segments beyond :attr:`spare`, smallest first."""
        free = [s for s, seg in enumerate(self.segments) if seg is not None and self.control[s] == _FREE]
        if len(free) <= self.spare:
            return
        free.sort(key=lambda s: self.segments[s].size)  # type: ignore[union-attr]
        for slot in free[: len(free) - self.spare]:
            self.control[slot] = _RETIRED  # the main process drops its hold when it next looks
            self.segments[slot].close()  # type: ignore[union-attr]
            self.segments[slot] = None

    def put(self, encoded: Encoded) -> _BlockHandle | None:
        """Copy ``encoded`` into a free segment; its handle, or None when every segment is in use."""
        slot = self._pick(encoded.nbytes)
        if slot is None:
            return None
        seg = self.segments[slot]
        assert seg is not None
        with memoryview(seg.map) as out:
            encoded.write_into(out[: encoded.nbytes], data_crc=False)
        self.control[slot] = _BUSY
        self._trim()
        return _BlockHandle((self.pid, self.control_fd, self.control_ino, slot, seg.fd, seg.ino, encoded.nbytes))

    def cancel(self, handle: _BlockHandle) -> None:
        """Free the segment of a block that will not be sent after all."""
        self.control[handle.where[3]] = _FREE


_ring: tuple[int, _Ring | None, str | None] | None = None  # (pid, ring, why there is none)


def _worker_ring(main_pid: int, pool: list[tuple[int, int]]) -> tuple[_Ring | None, str | None]:
    """This process's ring (made on first use; a forked child makes its own), or None and why not.

    Args:
        main_pid: the process that receives the batches.
        pool: free segments of the loader's earlier workers (see :class:`_Ring`).
    """
    global _ring, _held, _attached, _lock
    if _ring is None or _ring[0] != os.getpid():
        # Forked from the main process: its tables describe the main process's holds, not this one's (the
        # descriptors are copies; those of the pool are closed by _Ring). Forget them, without closing anything;
        # the lock may have been held by another thread of the main process at the fork.
        _held, _attached, _lock = {}, {}, threading.RLock()
        info = torch_data_utils.worker._worker_info
        share = pool[info.id :: info.num_workers] if info is not None else []
        try:
            ring = _Ring(main_pid, share, pool)
        except (OSError, AttributeError) as e:  # AttributeError: no os.memfd_create (not Linux)
            _ring = (os.getpid(), None, f"memfd segments are not available ({e})")
        else:
            if ring.unusable is None:
                _ring = (ring.pid, ring, None)
            else:
                ring.close()
                _ring = (ring.pid, None, ring.unusable)
    return _ring[1], _ring[2]


class _BlockHandle:
    """What travels through torch's result queue for a batch: where its block is. Unpickles as the batch."""

    __slots__ = ("where",)

    def __init__(self, where: tuple[int, ...]) -> None:
        self.where = where

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[int, ...]]:
        return _receive_block, self.where


class _TorchPath:
    """A batch sent torch's ordinary way; unpickles as the batch, warning once per loader why
    (:class:`~monai_cache.errors.BatchFallbackWarning`)."""

    __slots__ = ("batch", "reason", "token")

    def __init__(self, batch: Any, reason: str, token: str) -> None:
        self.batch, self.reason, self.token = batch, reason, token

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        return _receive_torch_path, (self.batch, self.reason, self.token)


class _Choice:
    """A batch (or its handle) whose worker changed its choice of way; unpickles as the batch, recording it."""

    __slots__ = ("batch", "token", "torch_cheaper")

    def __init__(self, batch: Any, token: str, torch_cheaper: bool) -> None:
        self.batch, self.token, self.torch_cheaper = batch, token, torch_cheaper

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        return _receive_choice, (self.batch, self.token, self.torch_cheaper)


@contextlib.contextmanager
def _worker_info_hidden() -> Iterator[None]:
    """``get_worker_info()`` returns None inside: ``default_collate`` then stacks into ordinary memory."""
    worker = torch_data_utils.worker
    saved = worker._worker_info
    worker._worker_info = None
    try:
        yield
    finally:
        worker._worker_info = saved


class _WayChoice:
    """Which way a worker sends what it sends (a batch, or a batch's MetaTensor): as a block, or torch's way.

    Each encoded value is weighed both ways (:meth:`weigh`); once torch's way wins, values go that way without
    being encoded (:meth:`skip_encode`) until a re-check after :data:`RECHECK_AFTER` of them, and twice as many
    after each re-check that confirms it, up to 16 times that.

    Args:
        torch_cheaper: the way to start with (the last choice of the loader's earlier workers).
    """

    def __init__(self, torch_cheaper: bool = False) -> None:
        self.torch_cheaper = torch_cheaper
        self.sends = 0
        self.recheck_every = RECHECK_AFTER
        self.recheck_at = RECHECK_AFTER if torch_cheaper else 0

    def skip_encode(self) -> bool:
        """Count a send; True while torch's way stands and no re-check is due."""
        self.sends += 1
        return self.torch_cheaper and self.sends <= self.recheck_at

    def weigh(self, encoded: Encoded, shared_bytes: int = 0) -> bool:
        """Estimate both ways for ``encoded`` (``shared_bytes`` of its data already in shared memory, which
        torch's way sends without a copy); True, and torch's way until the next re-check, if torch's wins."""
        header, data = len(encoded.header), encoded.nbytes - encoded.data_offset
        torch_s = (
            TORCH_PER_TENSOR_S * encoded.tensors
            + TORCH_PER_BYTE_S * max(0, data - shared_bytes)
            + TORCH_PER_HEADER_BYTE_S * header
        )
        block_s = BLOCK_PER_HEADER_BYTE_S * header + BLOCK_PER_BYTE_S * data
        cheaper = torch_s < block_s
        if cheaper:
            if self.torch_cheaper:  # confirmed: re-check less often
                self.recheck_every = min(2 * self.recheck_every, 16 * RECHECK_AFTER)
            self.recheck_at = self.sends + self.recheck_every
        self.torch_cheaper = cheaper
        return cheaper


class _BlockCollate:
    """Collate, then move the batch into a block of this worker's ring (in DataLoader workers only).

    Args:
        collate_fn: the loader's collate function (or ``default_convert``).
        main_pid: pid of the process iterating the loader.
        token: identifies the loader, so that each loader warns once.
        pool: ``(descriptor, inode)`` in the main process of free segments of earlier workers, shared out among
            the workers.
        torch_cheaper: the way the loader's earlier workers chose last (see :class:`_WayChoice`).
    """

    def __init__(
        self,
        collate_fn: Callable[[Any], Any],
        main_pid: int,
        token: str,
        pool: list[tuple[int, int]],
        torch_cheaper: bool = False,
    ) -> None:
        self.collate_fn = collate_fn
        self.main_pid = main_pid
        self.token = token
        self.pool = pool
        # per worker (each has its own copy): which way the batches go, and which the main process last heard of
        self.way = _WayChoice(torch_cheaper)
        self.reported = torch_cheaper

    def __call__(self, samples: Any) -> Any:
        if torch_data_utils.worker._worker_info is None:  # not in a worker: nothing to move
            return self.collate_fn(samples)
        global _block_collate_here
        if not _block_collate_here:  # this worker's first batch
            _block_collate_here = True
            keep_inherited_pages_shared()
        ring, why_not = _worker_ring(self.main_pid, self.pool)
        if self.way.skip_encode() and ring is not None:
            return self.collate_fn(samples)  # exactly monai.data.DataLoader's way: no encode to pay
        with _worker_info_hidden():
            batch = self.collate_fn(samples)
        if ring is None:
            return _TorchPath(batch, f"batches take torch's path: {why_not}", self.token)
        try:  # exact: what a decode cannot give back as torch's pickling would takes torch's path
            encoded = encode(batch, exact=True)
            if self.way.weigh(encoded):
                return self._report(batch)
            handle = ring.put(encoded)
        except UnsupportedValueError as e:
            return _TorchPath(batch, f"a batch takes torch's path: {e}", self.token)
        except (OSError, ValueError, RecursionError) as e:  # no memory for a segment, a value json refuses, ...
            return _TorchPath(batch, f"a batch takes torch's path: {type(e).__name__}: {e}", self.token)
        if handle is None:
            return _TorchPath(
                batch,
                f"more than {MAX_SEGMENTS} batches of one worker are alive in the main process; further batches "
                "take torch's path until some are released",
                self.token,
            )
        return self._report(handle)

    def _report(self, batch: Any) -> Any:
        """The batch as sent; when the choice changed, marked so that the main process hands it to later workers."""
        if self.way.torch_cheaper == self.reported:
            return batch
        self.reported = self.way.torch_cheaper
        return _Choice(batch, self.token, self.reported)


# ---------------------------------------------------------------------------------------------------------
# Another loader's workers reading our datasets: each MetaTensor of a batch as one block
# ---------------------------------------------------------------------------------------------------------

_block_collate_here = False  # a _BlockCollate runs in this process (our loader's worker): it moves the batches
_meta_blocks_checked = False  # this process has looked whether it is a DataLoader worker (reset in forked children)
_meta_way = _WayChoice()


def send_meta_tensors_as_blocks() -> None:
    """In a worker of another DataLoader (``monai.data.DataLoader``, torch's), send each MetaTensor as one block.

    monai_cache's datasets call this on every read; after the first call in a process it costs a test. torch's
    workers pickle a batch with ``multiprocessing``'s ``ForkingPickler``, which sends every tensor as a
    shared-memory file of its own: a collated MetaTensor with its ``meta`` and ``applied_operations`` is about fifty.
    In a worker, this registers :func:`_reduce_meta_tensor` with ``ForkingPickler`` (in that process only): a
    MetaTensor is encoded exactly into one block of the worker's ring, as :class:`DataLoader` does for a whole batch,
    and the main process decodes it as the same MetaTensor. What cannot travel so exactly takes torch's way. It also
    leaves what the worker holds out of its garbage collections
    (:func:`~monai_cache.runtime.keep_inherited_pages_shared`).
    """
    global _meta_blocks_checked
    _meta_blocks_checked = True
    if torch_data_utils.worker._worker_info is None:
        return
    keep_inherited_pages_shared()
    from multiprocessing.reduction import ForkingPickler

    from monai.data import MetaTensor

    ForkingPickler.register(MetaTensor, _reduce_meta_tensor)


def _forget_meta_blocks_check() -> None:
    global _meta_blocks_checked, _block_collate_here, _meta_way
    _meta_blocks_checked = _block_collate_here = False
    _meta_way = _WayChoice()


os.register_at_fork(after_in_child=_forget_meta_blocks_check)


def _reduce_meta_tensor(mt: Any) -> Any:
    """How ``ForkingPickler`` sends a MetaTensor from a DataLoader worker: as a block when it can, else as pickle."""
    if not _block_collate_here and torch_data_utils.worker._worker_info is not None:
        try:
            handle = _meta_tensor_block(mt)
        except Exception as e:  # a way to move a batch faster must never be why it is not moved
            _log.debug("a MetaTensor takes torch's way: %s: %s", type(e).__name__, e)
            handle = None
        if handle is not None:
            return _receive_meta_tensor, handle.where
    return mt.__reduce_ex__(pickle.DEFAULT_PROTOCOL)  # what pickle does without this reducer


def _meta_tensor_block(mt: Any) -> _BlockHandle | None:
    """``mt`` written into a block of this worker's ring, or None where torch's way is the exact or cheaper one."""
    ring, _why = _worker_ring(os.getppid(), [])  # a DataLoader's workers are children of the process iterating it
    if ring is None or _meta_way.skip_encode():
        return None
    ring.spare = 2 * SPARE_SEGMENTS  # a block per MetaTensor: a batch of MONAI's dicts has two (image, label)
    try:
        encoded = encode(mt, exact=True)
        if _meta_way.weigh(encoded, shared_bytes=_nbytes(mt) if mt.is_shared() else 0):
            return None
        handle = ring.put(encoded)
    except (UnsupportedValueError, OSError, ValueError, RecursionError):
        return None  # as DataLoader's batches: a value the codec cannot store exactly, no memory for a segment, ...
    objects = encoded.objects
    del encoded  # its buffers and copies hold references to the objects
    if handle is None:
        return None
    alone = False
    try:
        alone = _held_only_by(mt, objects)
        if not alone and gc.collect(1):
            # what held them may have been garbage in reference cycles (MONAI 1.3's crops): a young collection
            # frees it without walking what the worker inherited (a full one would copy those pages)
            alone = _held_only_by(mt, objects)
    finally:
        if not alone:  # something else shares part of it (torch's way keeps that sharing), or the check raised
            ring.cancel(handle)
    return handle if alone else None


def _nbytes(t: Any) -> int:
    with torch._C.DisableTorchFunctionSubclass():
        return int(t.untyped_storage().nbytes())


def _most_references(objects: list[tuple[Any, int]], skip: Any = None) -> int:
    """The most references any of ``objects`` but ``skip`` has beyond the ``met`` the value itself holds."""
    most = -(1 << 30)
    for obj, met in objects:
        if obj is not skip:
            most = max(most, sys.getrefcount(obj) - met)
    return most


@functools.lru_cache(maxsize=1)
def _refs_alone() -> int:
    """What :func:`_most_references` gives for objects nothing else holds (a fresh list)."""
    return _most_references([([], 0)])


def _held_only_by(mt: Any, objects: list[tuple[Any, int]]) -> bool:
    """Whether nothing but ``mt`` holds its containers, arrays and tensors, nor shares its tensors' memory.

    A batch whose MetaTensor shares an object or a tensor's memory with the rest of the batch (or with anything
    else in the worker, such as a transform's attribute) arrives from torch's way sharing it as well; from a block,
    it would arrive as a copy. Those take torch's way. Objects are counted by reference counts, tensors' memory by
    how many tensors hold it; both against a probe that nothing else holds.
    """
    alone = alone_holders()
    if alone is None:
        return False
    plain, subclass = alone
    if len(objects) > 1 and _most_references(objects, skip=mt) != _refs_alone():  # mt: the batch and pickle hold it
        return False
    for obj, _met in objects:
        if isinstance(obj, torch.Tensor):
            holders = storage_holders(obj)
            if holders != (plain if holders[1] == -1 else subclass):
                return False
    return True


# ---------------------------------------------------------------------------------------------------------
# Main-process side
# ---------------------------------------------------------------------------------------------------------

_lock = threading.RLock()  # guards the three tables below


class _Held:
    """The main process's hold on a worker's segment: the segment's file (whose descriptor the loader's next
    workers may adopt) and one mapping of it."""

    __slots__ = ("file", "map")

    def __init__(self, file: io.FileIO) -> None:
        self.file = file
        self.remap()

    @property
    def fd(self) -> int:
        return self.file.fileno()

    @classmethod
    def open(cls, pid: int, fd: int, ino: int) -> _Held:
        """Hold worker ``pid``'s segment (closed with this object, whatever interrupts: :func:`_open_proc_file`)."""
        return cls(_open_proc_file(pid, fd, ino))

    def remap(self) -> None:
        """Map the segment, as large as it is now (again when its worker grew it)."""
        self.map = _map(self.fd, os.fstat(self.fd).st_size)


_held: dict[int, _Held] = {}  # inode -> hold, for every segment this process has mapped and not given up


def _drop(ino: int) -> None:
    """Give up a segment: its memory goes once no batch maps it any more."""
    held = _held.pop(ino, None)
    if held is not None:
        held.file.close()


class _Attachment:
    """One worker's ring seen from the main process: its control page and which segment is in which slot."""

    def __init__(self, pid: int, control_fd: int, control_ino: int) -> None:
        self.pid = pid
        with _open_proc_file(pid, control_fd, control_ino) as f:
            self.control = mmap.mmap(f.fileno(), _CONTROL_SIZE)
        self.slots: dict[int, int] = {}  # slot -> inode of the segment last seen there

    def block(self, slot: int, fd: int, ino: int, nbytes: int) -> np.ndarray:
        """The batch's bytes, as a new array object (its lifetime is the batch's)."""
        with _lock:
            for s in [s for s, i in self.slots.items() if self.control[s] == _RETIRED]:
                _drop(self.slots.pop(s))  # the worker gave it back
            held = _held.get(ino)
            if held is None:
                held = _held[ino] = _Held.open(self.pid, fd, ino)
            elif len(held.map) < nbytes:  # the worker grew it
                held.remap()
            self.slots[slot] = ino
            return np.frombuffer(held.map, dtype=np.uint8, count=nbytes)


_attached: dict[tuple[int, int], _Attachment] = {}  # (worker pid, control inode) -> attachment


def _release(control: mmap.mmap, slot: int) -> None:
    """Mark a segment free for its worker (the last tensor of its batch is gone)."""
    with contextlib.suppress(ValueError):  # closed at interpreter exit
        control[slot] = _FREE


def _receive_block(pid: int, control_fd: int, control_ino: int, slot: int, fd: int, ino: int, nbytes: int) -> Any:
    """Unpickling a :class:`_BlockHandle` in the main process: decode the batch from the worker's segment."""
    att = None
    try:
        with _lock:
            att = _attached.get((pid, control_ino))
            if att is None:
                att = _attached[(pid, control_ino)] = _Attachment(pid, control_fd, control_ino)
        buffer = att.block(slot, fd, ino, nbytes)
    except OSError as e:
        if att is not None:
            _release(att.control, slot)
        raise RuntimeError(f"monai_cache.DataLoader: cannot read the batch that worker {pid} sent ({e})") from e
    weakref.finalize(buffer, _release, att.control, slot).atexit = False
    return decode(memoryview(buffer))  # type: ignore[arg-type]


def _map_proc_fd(pid: int, fd: int, ino: int, size: int) -> mmap.mmap:
    """:func:`_map` of ``size`` bytes of process ``pid``'s descriptor ``fd`` (checked to be the file ``ino``)."""
    with _open_proc_file(pid, fd, ino) as f:
        return _map(f.fileno(), size)


def _receive_meta_tensor(pid: int, control_fd: int, control_ino: int, slot: int, fd: int, ino: int, nbytes: int) -> Any:
    """Unpickling a MetaTensor that another loader's worker sent as a block (:func:`_reduce_meta_tensor`).

    The segment is mapped for as long as the MetaTensor's tensors live, then marked free for the worker. No
    descriptor or mapping is kept beyond that: these loaders have no pool, and their workers may come and go.
    """
    try:
        control = _map_proc_fd(pid, control_fd, control_ino, _CONTROL_SIZE)
    except OSError as e:
        raise RuntimeError(f"cannot read the MetaTensor that DataLoader worker {pid} sent ({e})") from e
    try:
        segment = _map_proc_fd(pid, fd, ino, nbytes)
    except OSError as e:
        _release(control, slot)
        raise RuntimeError(f"cannot read the MetaTensor that DataLoader worker {pid} sent ({e})") from e
    buffer = np.frombuffer(segment, dtype=np.uint8, count=nbytes)
    weakref.finalize(buffer, _release, control, slot).atexit = False
    return decode(memoryview(buffer))  # type: ignore[arg-type]


class _Pool:
    """Segments of a loader's exited workers, handed to its next workers (whose pages then need no faults).

    An entry is ``(inode, control page, slot)``: the segment is free once ``control[slot]`` says so (a
    segment whose batch the user still held when its worker exited becomes free later); ``None`` for a
    segment known to be free.
    """

    def __init__(self) -> None:
        self.entries: list[tuple[int, mmap.mmap | None, int]] = []
        self.closed = False  # the loader is gone: segments given back later are dropped

    def take(self) -> list[tuple[int, int]]:
        """``(descriptor, inode)`` of the free segments, which leave the pool."""
        with _lock:
            ready = [e for e in self.entries if e[1] is None or e[1][e[2]] == _FREE]
            self.entries = [e for e in self.entries if e not in ready]
            return [(_held[ino].fd, ino) for ino, _c, _s in ready if ino in _held]

    def give(self, entries: list[tuple[int, mmap.mmap | None, int]], limit: int) -> None:
        """Add segments; beyond ``limit`` entries, drop those still in use first, then the smallest."""
        with _lock:
            known = {e[0] for e in self.entries}
            self.entries += [e for e in entries if e[0] in _held and e[0] not in known]
            self.entries.sort(key=lambda e: (e[1] is not None and e[1][e[2]] != _FREE, -len(_held[e[0]].map)))
            for ino, _c, _s in self.entries[0 if self.closed else limit :]:
                _drop(ino)
            del self.entries[0 if self.closed else limit :]

    def close(self) -> None:
        self.closed = True
        self.give([], 0)

    def __reduce__(self) -> tuple[type, tuple[()]]:
        return _Pool, ()  # a copied or pickled loader starts with an empty pool of its own


_torch_cheaper: dict[str, bool] = {}  # loader token -> the last choice its workers reported


def _receive_choice(batch: Any, token: str, torch_cheaper: bool) -> Any:
    if _torch_cheaper.get(token, False) != torch_cheaper:
        _log.debug(
            "DataLoader: batches now take %s: its estimated cost is the lower for them",
            "torch's path" if torch_cheaper else "the block path",
        )
    _torch_cheaper[token] = torch_cheaper
    return batch


_warned: set[tuple[str, str]] = set()


def _receive_torch_path(batch: Any, reason: str, token: str) -> Any:
    kind = reason.split(":", 1)[0]
    if (token, kind) not in _warned:
        _warned.add((token, kind))
        if _SAME_BATCHES_ONLY:  # the switch's loader: the batch is torch's own; nothing for the user to do
            _log.debug("DataLoader: %s", reason)
        else:
            warn(f"DataLoader: {reason}", BatchFallbackWarning)
    return batch


# ---------------------------------------------------------------------------------------------------------
# Which loaders take the block path
# ---------------------------------------------------------------------------------------------------------

_SAME_BATCHES_ONLY = False


def same_batches_only(on: bool = True) -> None:
    """Take the block path only with collate functions whose batches it reproduces exactly (the switch's loader).

    The block path runs the collate function with ``get_worker_info()`` hidden; the collate functions of torch and
    MONAI (:func:`block_path_refusal`) never ask for it, so their batches are the ones ``monai.data.DataLoader``
    gives. A loader with another collate function then iterates exactly as ``monai.data.DataLoader`` (one debug
    line says why), and a batch that takes torch's path logs a debug line instead of a
    :class:`~monai_cache.errors.BatchFallbackWarning`. The switch turns this on in every process it reaches.

    Args:
        on: the setting for every loader of this process.
    """
    global _SAME_BATCHES_ONLY
    _SAME_BATCHES_ONLY = bool(on)


@functools.lru_cache(maxsize=1)
def _exact_collates() -> tuple[Callable[..., Any], ...]:
    from monai.data import utils as monai_data_utils

    return (
        monai_data_utils.list_data_collate,
        monai_data_utils.pad_list_data_collate,
        torch_data_utils.collate.default_collate,
        torch_data_utils.collate.default_convert,
    )


def block_path_refusal(collate_fn: Any) -> str | None:
    """Why a loader in :func:`same_batches_only` mode leaves batches of ``collate_fn`` to MONAI's path, or None.

    The block path gives the same batches for torch's ``default_collate`` and ``default_convert`` and MONAI's
    ``list_data_collate``, ``pad_list_data_collate`` and ``PadListDataCollate`` (also behind
    ``functools.partial``): none of them asks ``get_worker_info()``, which is hidden during the collate. Any other
    function might.

    Args:
        collate_fn: the loader's collate function.
    """
    fn = collate_fn.func if isinstance(collate_fn, functools.partial) else collate_fn
    if fn in _exact_collates():
        return None
    from monai.transforms import PadListDataCollate

    if type(fn) is PadListDataCollate:
        return None
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    return (
        f"collate_fn {getattr(fn, '__module__', '?')}.{name} is not one whose batches the block path is known to "
        "reproduce (torch's default_collate, MONAI's list_data_collate, pad_list_data_collate)"
    )


class _BlockIterator(_MultiProcessingDataLoaderIter):
    """torch's multi-process iterator with the collate function wrapped by :class:`_BlockCollate`."""

    def __init__(self, loader: DataLoader) -> None:
        self._block_token = loader._block_token
        self._block_pool = loader._block_pool
        self._block_handed = self._block_pool.take()
        try:
            super().__init__(loader)
        except BaseException:
            self._block_pool.give([(ino, None, 0) for _fd, ino in self._block_handed], len(self._block_handed))
            raise

    @property  # type: ignore[override]
    def _collate_fn(self) -> Callable[[Any], Any]:
        return self._wrapped_collate

    @_collate_fn.setter
    def _collate_fn(self, fn: Callable[[Any], Any]) -> None:
        self._wrapped_collate = _BlockCollate(
            fn, os.getpid(), self._block_token, self._block_handed, _torch_cheaper.get(self._block_token, False)
        )

    def _shutdown_workers(self) -> None:
        try:
            super()._shutdown_workers()
        finally:  # also when torch's shutdown raised (a worker's SIGCHLD may land in it)
            if getattr(self, "_shutdown", False):  # not at interpreter exit, where torch does nothing either
                self._give_back_segments()

    def _give_back_segments(self) -> None:
        """Once the workers are told to stop: segments of exited workers go to the pool, the others are dropped.

        torch joins each worker for a while, then terminates those still alive without waiting for them: a
        worker may still be alive here (a loaded machine). Its segments are not pooled (it might still write
        into them) but dropped, never left held: the kernel frees them when it is gone.
        """
        handed, self._block_handed = getattr(self, "_block_handed", []), []
        workers = getattr(self, "_workers", [])
        exited = {w.pid for w in workers if not w.is_alive()}
        # handed segments in which no batch was seen are free (the worker may have written one that was lost)
        entries: dict[int, tuple[int, mmap.mmap | None, int]] = {}
        with _lock:
            for i, (_fd, ino) in enumerate(handed):
                if workers and workers[i % len(workers)].pid in exited:  # worker i got handed[i::num_workers]
                    entries[ino] = (ino, None, 0)
                else:
                    _drop(ino)
            pids = {w.pid for w in workers}
            for key in [k for k in _attached if k[0] in pids]:
                att = _attached.pop(key)
                for slot, ino in att.slots.items():
                    state = att.control[slot]
                    if state == _RETIRED or key[0] not in exited:  # given back by the worker, or it lives on
                        entries.pop(ino, None)
                        _drop(ino)
                    else:  # free, or free once the user lets go of its batch
                        entries[ino] = (ino, None if state == _FREE else att.control, slot)
        self._block_pool.give(list(entries.values()), len(workers) * (self._prefetch_factor + 1))


class DataLoader(monai.data.DataLoader):
    """``monai.data.DataLoader`` whose workers move each batch to the main process as one shared-memory block.

    A drop-in replacement: same signature and same batches (values, dtypes, MetaTensor ``meta``,
    ``applied_operations`` and ``is_batch``), for every collate function. With ``num_workers=0`` it is
    ``monai.data.DataLoader``. With workers, each batch is collated in the worker, encoded with
    :mod:`monai_cache.codec` into a reusable memfd segment, and decoded zero-copy in the main process; a
    segment is reused only once no tensor of its batch is referenced any more. See :mod:`monai_cache.loader`.

    The difference a collate function may notice (also documented in ``docs/loader.md``): inside it, in a worker,
    ``torch.utils.data.get_worker_info()`` returns None (so that ``default_collate`` stacks into ordinary memory
    instead of fresh shared memory); under the switch (:func:`same_batches_only`), a loader whose collate function
    is not torch's or MONAI's iterates as ``monai.data.DataLoader`` instead. Batches are encoded exactly (objects
    shared within a batch stay shared, tensors keep their strides); a batch that cannot be (a view of part of a
    tensor's memory, tensors sharing memory, a value the codec cannot store such as a ``set``) takes torch's
    ordinary path, with one :class:`~monai_cache.errors.BatchFallbackWarning` per loader and reason.

    Args:
        dataset: dataset from which to load the data.
        num_workers: how many subprocesses to use for data loading; ``0`` loads in the main process.
        kwargs: the other arguments of ``monai.data.DataLoader`` / ``torch.utils.data.DataLoader``
            (``batch_size``, ``shuffle``, ``sampler``, ``batch_sampler``, ``collate_fn`` (default MONAI's
            ``list_data_collate``), ``pin_memory``, ``drop_last``, ``timeout``, ``worker_init_fn`` (default
            MONAI's), ``multiprocessing_context``, ``generator``, ``prefetch_factor``, ``persistent_workers``,
            ``pin_memory_device``, ``in_order``), with the same meaning.
    """

    def __init__(self, dataset: Dataset, num_workers: int = 0, **kwargs: Any) -> None:
        super().__init__(dataset, num_workers=num_workers, **kwargs)
        self._block_token = secrets.token_hex(8)
        self._block_pool = _Pool()
        weakref.finalize(self, self._block_pool.close)

    def _get_iterator(self) -> Any:
        if self.num_workers == 0:
            return super()._get_iterator()
        if _SAME_BATCHES_ONLY:
            why = block_path_refusal(self.collate_fn)
            if why is not None:
                if self._block_token not in _refusals_logged:
                    _refusals_logged.add(self._block_token)
                    _log.debug("DataLoader: batches take monai.data.DataLoader's path: %s", why)
                return super()._get_iterator()
        self.check_worker_number_rationality()
        return _BlockIterator(self)


_refusals_logged: set[str] = set()
