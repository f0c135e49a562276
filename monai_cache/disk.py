"""A directory of cache files, one per item: checksummed, optionally zstd-compressed codec blobs.

Each file is a 64-byte header followed by the item encoded by :mod:`monai_cache.codec` (the same bytes
that the shared-memory store keeps), compressed with zstd unless compression is off. The full
specification is in ``docs/disk-format.md``; in short (little endian)::

    offset  size  field
    0       8     magic  b"MCDISK\\r\\n"
    8       2     disk format version (1)
    10      2     header size (64)
    12      4     flags: bit 0 = payload is one zstd frame; other bits must be 0
    16      8     blob length: size of the codec blob (after decompression)
    24      8     stored length: size of the payload that follows the header (= file size - 64)
    32      4     CRC-32 (zlib) of the stored payload
    36      4     codec format version of the blob
    40      16    key tag: the first 16 bytes of SHA-256 of the entry key (the file name without ``.mcache``)
    56      4     reserved, 0
    60      4     CRC-32 of header bytes 0..59

Guarantees:

* Writes go to a temporary file in the same directory (mode 0600), which is renamed onto the final name
  once complete: a process killed at any moment never leaves a file under a final name that is not
  complete, and concurrent writers of one entry leave one complete file (the last rename wins).
* Readers check the header checksum, the key tag, the lengths and the payload checksum before decoding;
  a bad file (truncated, bit-flipped, foreign, renamed) raises :class:`~monai_cache.codec.CorruptEntryError`
  in :func:`read_entry`, and :meth:`DiskStore.get` reports it once, removes it and returns :data:`MISSING`.
  A crash of the machine (power loss) with ``fsync=False`` may leave a final file whose data never reached
  the disk; the checksums reject it in the same way.
* Nothing is unpickled unless the store was created with ``allow_pickle=True``.
* :meth:`DiskStore.put` hands the item to a background writer thread (bounded by item count and bytes,
  blocking the caller when full). Pending writes are flushed when the process exits normally, DataLoader
  worker processes included (their exit runs ``multiprocessing.util._exit_function``), and the writer is
  re-created lazily in a forked child.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import fcntl
import hashlib
import itertools
import mmap
import multiprocessing
import multiprocessing.util
import os
import socket
import stat
import struct
import sys
import threading
import time
import weakref
import zlib
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch

from monai_cache import codec
from monai_cache.utils import format_bytes, parse_bytes, pid_alive, warn

zstd: Any
try:
    import zstandard as zstd
except ImportError:  # pragma: no cover - zstandard is a dependency; compression="zstd" then errors clearly
    zstd = None

__all__ = [
    "DEFAULT_COMPRESSION_LEVEL",
    "DISK_FORMAT_VERSION",
    "DISK_MAGIC",
    "ENTRY_SUFFIX",
    "HEADER_SIZE",
    "MISSING",
    "DiskStore",
    "empty_stats",
    "prepare_cache_dir",
    "read_entry",
    "read_blob",
    "read_header",
    "sweep_temp_files",
    "write_entry",
]

DISK_MAGIC = b"MCDISK\r\n"
DISK_FORMAT_VERSION = 1
ENTRY_SUFFIX = ".mcache"
_TMP_SUFFIX = ".tmp"
_HEADER = struct.Struct("<8sHHIQQII16sII")
HEADER_SIZE = _HEADER.size  # 64
FLAG_ZSTD = 1
_KNOWN_FLAGS = FLAG_ZSTD
MAX_BLOB = 1 << 40  # 1 TiB: a header claiming more is rejected before allocating anything
DEFAULT_COMPRESSION_LEVEL = -1
"""zstd level used by default, chosen with ``benchmarks/bench_persistent.py`` (see ``docs/persistent.md``): the
files stay well under the size of the ``.nii.gz`` sources, and negative levels store literals raw, which
makes both compression (cold epoch) and decompression (warm epochs) about twice as fast as levels >= 1."""
STALE_TMP_SECONDS = 3600.0  # temporary files older than this are left-overs of killed writers
_HOST_TAG = hashlib.sha1(socket.gethostname().encode()).hexdigest()[:8]
_IO_CHUNK = 1 << 30


class _Missing:
    __slots__ = ()

    def __repr__(self) -> str:
        return "MISSING"

    def __bool__(self) -> bool:
        return False


MISSING: Any = _Missing()
"""Returned by :meth:`DiskStore.get` when there is no (valid) entry."""


# ----------------------------------------------------------------------------------------------- format
def key_tag(key: str) -> bytes:
    """The 16 bytes that bind a file to its entry key (first half of SHA-256 of the key).

    Args:
        key: the entry key (the file name without ``.mcache``).
    """
    return hashlib.sha256(key.encode()).digest()[:16]


def _pack_header(flags: int, blob_len: int, stored_len: int, payload_crc: int, key: str) -> bytes:
    head = _HEADER.pack(
        DISK_MAGIC, DISK_FORMAT_VERSION, HEADER_SIZE, flags, blob_len, stored_len, payload_crc,
        codec.FORMAT_VERSION, key_tag(key), 0, 0,
    )
    return head[:60] + struct.pack("<I", zlib.crc32(head[:60]))


def read_header(head: bytes | bytearray | memoryview, key: str | None = None, file_size: int | None = None) -> dict:
    """Parse and check a file header.

    Args:
        head: the first :data:`HEADER_SIZE` bytes of a file (at least).
        key: the entry key the file is expected to hold; ``None`` skips the key check.
        file_size: the size of the whole file; ``None`` skips the length check.

    Returns:
        ``{"version", "flags", "compressed", "blob_len", "stored_len", "crc", "codec_version", "key_tag"}``.

    Raises:
        CorruptEntryError: the header is short, foreign, damaged, of another version, or does not match.
    """
    if len(head) < HEADER_SIZE:
        raise codec.CorruptEntryError(f"truncated: {len(head)} bytes, shorter than the {HEADER_SIZE}-byte header")
    magic, version, hsize, flags, blob_len, stored_len, crc, codec_version, tag, _res, hcrc = _HEADER.unpack_from(
        head, 0
    )
    if magic != DISK_MAGIC:
        raise codec.CorruptEntryError("not a monai_cache disk entry (bad magic number)")
    if zlib.crc32(bytes(head[:60])) != hcrc:
        raise codec.CorruptEntryError("header checksum mismatch")
    if version != DISK_FORMAT_VERSION or hsize != HEADER_SIZE:
        raise codec.CorruptEntryError(
            f"disk format version {version} (header {hsize} bytes) is not supported; this reads {DISK_FORMAT_VERSION}"
        )
    if codec_version != codec.FORMAT_VERSION:
        raise codec.CorruptEntryError(f"codec format version {codec_version} is not supported")
    if flags & ~_KNOWN_FLAGS:
        raise codec.CorruptEntryError(f"unknown flags {flags:#x}")
    compressed = bool(flags & FLAG_ZSTD)
    if blob_len > MAX_BLOB or (not compressed and stored_len != blob_len):
        raise codec.CorruptEntryError(f"bad lengths: blob {blob_len}, stored {stored_len}")
    if key is not None and tag != key_tag(key):
        raise codec.CorruptEntryError("the file belongs to another entry (key tag mismatch)")
    if file_size is not None and file_size != HEADER_SIZE + stored_len:
        raise codec.CorruptEntryError(
            f"file has {file_size} bytes, the header says {HEADER_SIZE + stored_len} (truncated or extended)"
        )
    return {
        "version": version,
        "flags": flags,
        "compressed": compressed,
        "blob_len": blob_len,
        "stored_len": stored_len,
        "crc": crc,
        "codec_version": codec_version,
        "key_tag": tag,
    }


class _Sink:
    """Sequential writes to a file descriptor, with a running CRC-32 and byte count (a zstd stream target)."""

    __slots__ = ("crc", "error", "fd", "n")

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.crc = 0
        self.n = 0
        self.error: OSError | None = None  # kept because zstd replaces it with an error of its own

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        total = view.nbytes
        self.crc = zlib.crc32(view, self.crc)
        while view.nbytes:
            try:
                n = os.write(self.fd, view[:_IO_CHUNK])
            except OSError as e:
                self.error = e
                raise
            view = view[n:]
        self.n += total
        return total

    def flush(self) -> None:  # zstandard calls it when the stream is flushed
        pass


_local = threading.local()


def _compressor(level: int, threads: int) -> Any:
    cache = getattr(_local, "cctx", None)
    if cache is None:
        cache = _local.cctx = {}
    cctx = cache.get((level, threads))
    if cctx is None:
        cctx = cache[(level, threads)] = zstd.ZstdCompressor(level=level, threads=threads, write_checksum=False)
    return cctx


def _decompressor() -> Any:
    dctx = getattr(_local, "dctx", None)
    if dctx is None:
        dctx = _local.dctx = zstd.ZstdDecompressor()
    return dctx


def write_entry(fd: int, key: str, enc: codec.Encoded, level: int | None = 1, threads: int = 0) -> int:
    """Write a complete entry (header + payload) to ``fd``, positioned at offset 0 of an empty file.

    Args:
        fd: a file descriptor opened for writing.
        key: the entry key, recorded as a tag in the header.
        enc: the encoded item.
        level: zstd level, or ``None`` to store the blob uncompressed.
        threads: zstd worker threads (0: compress in the calling thread; -1: one per CPU).

    Returns:
        the file size.
    """
    os.lseek(fd, HEADER_SIZE, os.SEEK_SET)
    sink = _Sink(fd)
    if level is None:
        for chunk in enc.chunks():
            sink.write(chunk)
        flags = 0
    else:
        if zstd is None:  # pragma: no cover
            raise RuntimeError("compression needs the 'zstandard' package: pip install zstandard")
        try:
            with _compressor(level, threads).stream_writer(sink, size=enc.nbytes, closefd=False) as writer:
                for chunk in enc.chunks():
                    writer.write(chunk)
        except Exception:
            if sink.error is not None:  # e.g. ENOSPC, which zstd reports as "Src size is incorrect"
                raise sink.error from None
            raise
        flags = FLAG_ZSTD
    head = _pack_header(flags, enc.nbytes, sink.n, sink.crc, key)
    if os.pwrite(fd, head, 0) != HEADER_SIZE:  # pragma: no cover - a 64-byte pwrite is not split
        raise OSError(errno.EIO, "short header write")
    return HEADER_SIZE + sink.n


def _read_exact(fd: int, out: memoryview, offset: int) -> None:
    pos = 0
    while pos < out.nbytes:
        n = os.preadv(fd, [out[pos : pos + _IO_CHUNK]], offset + pos)
        if n == 0:
            raise codec.CorruptEntryError(f"truncated while reading: {pos} of {out.nbytes} payload bytes")
        pos += n


def _buffer(n: int) -> memoryview:
    """A fresh, writable, uninitialized byte buffer (numpy's allocator: no zero-fill, huge pages when large)."""
    try:
        return np.empty(n, dtype=np.uint8).data
    except (MemoryError, ValueError):
        raise codec.CorruptEntryError(f"cannot allocate {n} bytes for the entry") from None


def read_blob(fd: int, key: str | None = None) -> tuple[memoryview, int]:
    """Read and check the entry in ``fd``; return its codec blob (a fresh, writable buffer) and the file size.

    Args:
        fd: a file descriptor of the entry file, opened for reading.
        key: the entry key the file must hold; ``None`` skips the key check.

    Raises:
        CorruptEntryError: any check failed.
        OSError: the file could not be read.
    """
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise codec.CorruptEntryError("not a regular file")
    head = os.pread(fd, HEADER_SIZE, 0)
    if len(head) < HEADER_SIZE:
        raise codec.CorruptEntryError("empty file" if not head else f"truncated: {len(head)} bytes")
    h = read_header(head, key, st.st_size)
    if h["compressed"] and h["stored_len"] >= STREAM_READ_BYTES and zstd is not None:
        return _read_streaming(fd, h), st.st_size
    view = _buffer(h["stored_len"])
    _read_exact(fd, view, HEADER_SIZE)
    if zlib.crc32(view) != h["crc"]:
        raise codec.CorruptEntryError("payload checksum mismatch")
    if not h["compressed"]:
        return view, st.st_size
    if zstd is None:  # pragma: no cover
        raise codec.CorruptEntryError("entry is zstd-compressed and the 'zstandard' package is not installed")
    out = _buffer(h["blob_len"])
    try:
        with _decompressor().stream_reader(view, read_across_frames=False, closefd=False) as reader:
            pos = 0
            while pos < out.nbytes:
                n = reader.readinto(out[pos:])
                if not n:
                    break
                pos += n
            extra = reader.read(1)
    except zstd.ZstdError as e:
        raise codec.CorruptEntryError(f"bad zstd payload: {e}") from None
    if pos != out.nbytes or extra:
        got = f"more than {pos}" if extra else str(pos)
        raise codec.CorruptEntryError(f"payload decompresses to {got} bytes, expected {out.nbytes}")
    return out, st.st_size


STREAM_READ_BYTES = 64 << 20
"""Compressed payloads of this size or more are decompressed straight from the file, in chunks, instead of
being read into memory first: reading a multi-gigabyte entry then holds the decoded blob and a few MiB."""


class _CheckedReader:
    """Reads ``length`` bytes of ``fd`` from ``offset`` in chunks (a zstd stream source), with a running CRC-32."""

    __slots__ = ("crc", "fd", "left", "pos")

    def __init__(self, fd: int, offset: int, length: int) -> None:
        self.fd, self.pos, self.left, self.crc = fd, offset, length, 0

    def read(self, size: int = -1) -> bytes:
        n = self.left if size is None or size < 0 else min(size, self.left)
        data = os.pread(self.fd, n, self.pos) if n else b""
        if n and not data:
            raise codec.CorruptEntryError(f"truncated while reading: {self.left} payload bytes missing")
        self.pos += len(data)
        self.left -= len(data)
        self.crc = zlib.crc32(data, self.crc)
        return data

    def drain(self) -> None:
        while self.left:
            self.read(1 << 24)


def _read_streaming(fd: int, h: dict) -> memoryview:
    """Decompress a large payload from ``fd`` into a fresh buffer, checking the payload CRC as it goes."""
    out = _buffer(h["blob_len"])
    src = _CheckedReader(fd, HEADER_SIZE, h["stored_len"])
    error = None
    try:
        with _decompressor().stream_reader(src, read_size=1 << 22, read_across_frames=False, closefd=False) as r:
            pos = 0
            while pos < out.nbytes:
                n = r.readinto(out[pos:])
                if not n:
                    break
                pos += n
            extra = r.read(1)
        if pos != out.nbytes or extra:
            got = f"more than {pos}" if extra else str(pos)
            error = f"payload decompresses to {got} bytes, expected {out.nbytes}"
    except zstd.ZstdError as e:
        error = f"bad zstd payload: {e}"
    src.drain()  # the checksum covers the whole stored payload: a damaged file reports a checksum mismatch
    if src.crc != h["crc"]:
        raise codec.CorruptEntryError("payload checksum mismatch")
    if error is not None:
        raise codec.CorruptEntryError(error)
    return out


def read_entry(path: str, key: str | None = None, allow_pickle: bool = False) -> Any:
    """Read, check and decode one cache file (a helper for tools and tests; the store uses :meth:`DiskStore.get`).

    Args:
        path: the file.
        key: the entry key it should hold (default: its file name without ``.mcache``); ``""`` skips the check.
        allow_pickle: decode values stored with pickle.

    Raises:
        CorruptEntryError: the file is not a valid entry for ``key``.
        OSError: it could not be opened or read.
    """
    if key is None:
        name = os.path.basename(path)
        key = name[: -len(ENTRY_SUFFIX)] if name.endswith(ENTRY_SUFFIX) else name
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        blob, _ = read_blob(fd, key or None)
    finally:
        os.close(fd)
    return codec.decode(blob, allow_pickle=allow_pickle)


# ---------------------------------------------------------------------------------------- directories
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
    probe = os.path.join(path, f".probe.{_HOST_TAG}.{os.getpid()}.{threading.get_ident()}{_TMP_SUFFIX}")
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        os.close(fd)
        os.unlink(probe)
    except FileExistsError:
        with contextlib.suppress(OSError):
            os.unlink(probe)
    except OSError as e:
        return f"cannot write files in the cache directory {path!r}: {e.strerror or e}"
    return None


def sweep_temp_files(directory: str, max_age: float = STALE_TMP_SECONDS) -> int:
    """Remove temporary files left by killed writers: those of dead processes on this host, or older than
    ``max_age`` seconds.

    Args:
        directory: the cache directory.
        max_age: age in seconds after which any temporary file counts as left over.

    Returns:
        how many files were removed.
    """
    removed = 0
    now = time.time()
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return 0
    for entry in entries:
        name = entry.name
        if not (name.startswith(".") and name.endswith(_TMP_SUFFIX)):
            continue
        parts = name.split(".")
        dead = False
        if len(parts) >= 5 and parts[2] == _HOST_TAG and parts[3].isdigit():
            dead = not pid_alive(int(parts[3]))
        try:
            old = now - entry.stat(follow_symlinks=False).st_mtime > max_age
        except OSError:
            continue
        if dead or old:
            with contextlib.suppress(OSError):
                os.unlink(entry.path)
                removed += 1
    return removed


# ------------------------------------------------------------------------------------------- counters
_FIELDS = (
    "hits", "misses", "corrupt", "unsupported", "writes", "write_errors", "skipped", "writes_pending",
    "bytes_read", "bytes_written", "bytes_raw", "bytes_encoded",
)
_INDEX = {name: i for i, name in enumerate(_FIELDS)}
_FLAGS_SLOT = len(_FIELDS)
_Q = struct.Struct("<q")
WARNED_UNWRITABLE = 1
WARNED_FULL = 2
WARNED_UNSUPPORTED = 4
WARNED_IO = 8


class _SharedCounters:
    """Counters in an anonymous shared mapping: shared with forked children (DataLoader workers).

    They are guarded by a POSIX record lock on a memory file (taken per process, dropped by the kernel when
    its holder dies: a worker killed while counting blocks nobody) and a thread lock (taken per thread).
    A pickled copy (spawned worker, ``deepcopy``) starts its own counters.
    """

    __slots__ = ("__weakref__", "_fd", "_map", "_pid", "_thread_lock")

    def __init__(self) -> None:
        self._map = mmap.mmap(-1, 8 * (len(_FIELDS) + 1))  # MAP_SHARED | MAP_ANONYMOUS
        self._fd = os.memfd_create("monai_cache-counters", os.MFD_CLOEXEC)
        weakref.finalize(self, os.close, self._fd)
        self._thread_lock = threading.Lock()
        self._pid = os.getpid()

    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state: dict) -> None:
        self.__init__()  # type: ignore[misc]

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        if self._pid != os.getpid():  # forked: a thread of the parent may have held the thread lock
            self._thread_lock, self._pid = threading.Lock(), os.getpid()
        with self._thread_lock:
            fcntl.lockf(self._fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.lockf(self._fd, fcntl.LOCK_UN)

    def add(self, deltas: Mapping[str, int]) -> None:
        with self._locked():
            for name, d in deltas.items():
                off = 8 * _INDEX[name]
                _Q.pack_into(self._map, off, _Q.unpack_from(self._map, off)[0] + d)

    def first(self, flag: int) -> bool:
        """Set ``flag``; True for the one process (of this family) that set it first."""
        with self._locked():
            off = 8 * _FLAGS_SLOT
            flags = _Q.unpack_from(self._map, off)[0]
            if flags & flag:
                return False
            _Q.pack_into(self._map, off, flags | flag)
            return True

    def snapshot(self) -> dict[str, int]:
        return {name: _Q.unpack_from(self._map, 8 * i)[0] for i, name in enumerate(_FIELDS)}


def _with_ratio(counts: dict[str, int]) -> dict[str, Any]:
    out: dict[str, Any] = dict(counts)
    out["compression_ratio"] = counts["bytes_raw"] / counts["bytes_written"] if counts["bytes_written"] else 0.0
    return out


def empty_stats() -> dict[str, dict[str, Any]]:
    """Counters of a store that never did anything (the shape of :meth:`DiskStore.stats`)."""
    return {"process": _with_ratio(dict.fromkeys(_FIELDS, 0)), "total": _with_ratio(dict.fromkeys(_FIELDS, 0))}


def _nbytes(item: Any, depth: int = 0) -> int:
    """Bytes of the tensors and arrays in ``item`` (as they are in memory)."""
    if isinstance(item, torch.Tensor):
        return item.element_size() * item.numel()
    if isinstance(item, np.ndarray):
        return int(item.nbytes)
    if depth > 64:
        return 0
    if isinstance(item, Mapping):
        return sum(_nbytes(v, depth + 1) for v in item.values())
    if isinstance(item, (list, tuple)):
        return sum(_nbytes(v, depth + 1) for v in item)
    return 0


# --------------------------------------------------------------------------------------------- store
_STORES: weakref.WeakSet[DiskStore] = weakref.WeakSet()
_exit_hook_pid = -1
_exit_hook_lock = threading.Lock()
EXIT_FLUSH_TIMEOUT = 120.0
WRITER_IDLE_SECONDS = 2.0
WRITER_NICE = 0  # >0 lowers the writer thread's priority (Linux); see _writer_loop


def _flush_all_at_exit() -> None:
    deadline = time.monotonic() + EXIT_FLUSH_TIMEOUT
    for store in list(_STORES):
        store.flush(timeout=max(0.0, deadline - time.monotonic()))


def _ensure_exit_hook() -> None:
    """Flush pending writes when this process exits normally.

    ``multiprocessing.util.Finalize`` with an exit priority runs from ``util._exit_function``: at interpreter
    exit through ``atexit`` in the main process, and at the end of ``Process._bootstrap`` in a child started by
    multiprocessing (DataLoader workers end with ``os._exit`` and never run ``atexit``).
    """
    global _exit_hook_pid
    with _exit_hook_lock:
        if _exit_hook_pid != os.getpid():
            multiprocessing.util.Finalize(None, _flush_all_at_exit, exitpriority=100)
            _exit_hook_pid = os.getpid()


def _after_fork_in_child() -> None:
    global _exit_hook_lock
    _exit_hook_lock = threading.Lock()
    for store in list(_STORES):
        store._reset_after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)


class DiskStore:
    """Cache files in one directory, named by key; reads are checked, writes are atomic and asynchronous.

    Args:
        directory: an existing directory (see :func:`prepare_cache_dir`).
        compression: ``"zstd"`` or ``None`` (store the codec blob as it is).
        compression_level: zstd level (negative levels are faster and compress less).
        compression_threads: zstd worker threads per write (0: compress in the writer thread; -1: one per CPU).
        downcast: store tensors in the smallest dtype that holds them exactly (lossless).
        lossy: ``{top-level key: dtype}`` of values to store in a smaller dtype even when this loses precision.
        allow_pickle: store and load values that the codec cannot store natively with pickle.
        async_writes: write in a background thread (True) or in :meth:`put` itself (False).
        fsync: ``fsync`` each file and the directory after the rename (survives power loss; slower).
        max_pending_writes: most items waiting for the writer; :meth:`put` blocks when reached.
        max_pending_bytes: most bytes of items waiting for the writer (an int or a string like ``"512MiB"``);
            a single larger item is still accepted when nothing else is pending.
        writable: False to only read (no file is ever written or removed).
        describe: names an entry key in warnings (e.g. with the data item); default: the key.
    """

    __slots__ = (
        "__weakref__", "_bad_reported", "_cond", "_counts", "_describe", "_disabled", "_pending",
        "_pending_bytes", "_pid", "_shared", "_thread", "_tmp_counter", "_unsupported", "_warned_io",
        "_writing", "allow_pickle", "async_writes", "compression", "compression_level", "compression_threads",
        "directory", "downcast", "fsync", "lossy", "max_pending_bytes", "max_pending_writes", "writable",
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
    ) -> None:
        if compression not in (None, "zstd", "none"):
            raise ValueError(f"compression must be 'zstd' or None, got {compression!r}")
        if compression == "zstd" and zstd is None:  # pragma: no cover
            raise ValueError("compression='zstd' needs the 'zstandard' package: pip install zstandard")
        if compression == "zstd":
            lo, hi = -(1 << 17), zstd.MAX_COMPRESSION_LEVEL  # zstd's fastest "negative" level is -131072
            if isinstance(compression_level, bool) or not isinstance(compression_level, int):
                raise ValueError(f"compression_level must be an int, got {compression_level!r}")
            if not lo <= compression_level <= hi:
                raise ValueError(f"compression_level must be an int in [{lo}, {hi}], got {compression_level!r}")
        if int(max_pending_writes) < 1:
            raise ValueError(f"max_pending_writes must be at least 1, got {max_pending_writes!r}")
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
        self._describe = describe
        self._shared = _SharedCounters()
        self._init_runtime()
        _STORES.add(self)

    # -- process-local state (not pickled, reset in a forked child) --
    def _init_runtime(self, disabled: str | None = None) -> None:
        self._pid = os.getpid()
        self._cond = threading.Condition(threading.Lock())
        self._pending: dict[str, tuple[Any, int]] = {}
        self._pending_bytes = 0
        self._writing: str | None = None
        self._thread: threading.Thread | None = None
        self._counts = dict.fromkeys(_FIELDS, 0)
        self._tmp_counter = itertools.count()
        self._bad_reported: set[str] = set()
        self._unsupported: set[str] = set()
        self._disabled: str | None = disabled if self.writable else "read-only store"
        self._warned_io = False

    def _reset_after_fork(self) -> None:
        # The writer thread does not exist in the child and the parent writes its own pending items; a
        # reason not to write (unwritable directory, full disk) still holds.
        self._init_runtime(self._disabled)

    def __getstate__(self) -> dict:
        state = {name: getattr(self, name) for name in self.__slots__ if not name.startswith("_")}
        state.update(_describe=self._describe, _shared=self._shared, _disabled=self._disabled)
        return state

    def __setstate__(self, state: dict) -> None:
        disabled = state.pop("_disabled", None)
        for name, value in state.items():
            object.__setattr__(self, name, value)
        self._init_runtime(disabled)
        _STORES.add(self)

    def __repr__(self) -> str:
        level = f"zstd-{self.compression_level}" if self.compression else "uncompressed"
        return f"DiskStore({self.directory!r}, {level}, {'async' if self.async_writes else 'sync'})"

    def path(self, key: str) -> str:
        """The file of entry ``key``.

        Args:
            key: the entry key (letters, digits, ``_.-``; it becomes the file name).
        """
        return os.path.join(self.directory, key + ENTRY_SUFFIX)

    def _name(self, key: str) -> str:
        return self._describe(key) if self._describe is not None else key

    def _count(self, **deltas: int) -> None:
        for k, d in deltas.items():
            self._counts[k] += d
        self._shared.add(deltas)

    # -- reads --
    def contains(self, key: str) -> bool:
        """Whether a file exists for ``key`` (not checked) or its write is pending in this process.

        Args:
            key: the entry key.
        """
        with self._cond:
            if key in self._pending:
                return True
        return os.path.exists(self.path(key))

    def get(self, key: str) -> Any:
        """The item stored under ``key``, or :data:`MISSING`.

        A write still pending in this process is served from memory (a private copy). A file that fails a
        check is reported once, removed, and counted as corrupt; the caller then recomputes the item.

        Args:
            key: the entry key.
        """
        with self._cond:
            pending = self._pending.get(key)
        if pending is not None:
            self._count(hits=1)
            return copy.deepcopy(pending[0])
        path = self.path(key)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except (FileNotFoundError, NotADirectoryError):  # no entry (or no cache directory at all)
            self._count(misses=1)
            return MISSING
        except OSError as e:
            if e.errno == errno.ELOOP:  # a symlink planted under an entry name
                self._discard(key, path, None, "it is a symbolic link")
            else:
                self._warn_io(f"cannot open cache file {path}: {e.strerror or e}")
            self._count(misses=1)
            return MISSING
        st = None
        try:
            st = os.fstat(fd)
            blob, size = read_blob(fd, key)
            item = codec.decode(blob, allow_pickle=self.allow_pickle)
        except codec.CorruptEntryError as e:
            self._discard(key, path, st, str(e))
            self._count(misses=1)
            return MISSING
        except OSError as e:
            self._warn_io(f"cannot read cache file {path}: {e.strerror or e}")
            self._count(misses=1)
            return MISSING
        except Exception as e:  # whatever a damaged or crafted file provokes in decoding: never crash training
            self._discard(key, path, st, f"cannot decode: {e!r}")
            self._count(misses=1)
            return MISSING
        finally:
            os.close(fd)
        self._count(hits=1, bytes_read=size)
        return item

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
            aside = self._tmp_path(key, "bad")
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
        warn(f"corrupt disk cache file for {self._name(key)} ({why}): {path} {action}", stacklevel=5)

    def _warn_io(self, message: str) -> None:
        if not self._warned_io and self._shared.first(WARNED_IO):
            warn(f"{message}; such items are served uncached", stacklevel=5)
        self._warned_io = True

    # -- writes --
    def put(self, key: str, item: Any) -> None:
        """Store ``item`` under ``key``: hand it to the writer thread, or write it now if writes are synchronous.

        The writer gets its own copy of ``item`` (so that later in-place changes by the caller cannot reach
        the file). Blocks while the pending writes exceed ``max_pending_writes`` or ``max_pending_bytes``.
        Never raises for I/O problems: they are reported once and the item stays uncached.

        Args:
            key: the entry key.
            item: the value to store (tensors, arrays, numbers, strings, enums, dict/list/tuple of these).
        """
        if self._disabled is not None or key in self._unsupported:
            self._count(skipped=1)
            return
        if not self.async_writes:
            self.write(key, item)
            return
        if os.getpid() != self._pid:  # forked without the fork hook (should not happen): start afresh
            self._reset_after_fork()
        with self._cond:
            if key in self._pending:
                return
        if _nbytes(item) > self.max_pending_bytes:
            # A volume larger than the whole queue: write it now, from the caller's item, rather than hold a
            # deep copy of it for the writer (that copy would double the memory a multi-gigabyte item takes).
            self.write(key, item)
            return
        try:
            snapshot = copy.deepcopy(item)
        except Exception:  # an object that cannot be copied: write it now (the codec will say if it can)
            self.write(key, item)
            return
        size = _nbytes(snapshot)
        with self._cond:
            while (
                self._pending
                and self._disabled is None
                and (
                    len(self._pending) >= self.max_pending_writes
                    or self._pending_bytes + size > self.max_pending_bytes
                )
            ):
                self._cond.wait(1.0)
                if self._thread is None or not self._thread.is_alive():
                    self._start_writer()  # (defensive: the writer only exits when nothing is pending)
            if self._disabled is not None or key in self._pending:
                return
            self._pending[key] = (snapshot, size)
            self._pending_bytes += size
            self._count(writes_pending=1)
            if self._thread is None:
                self._start_writer()
            else:
                self._cond.notify_all()

    def _start_writer(self) -> None:
        # called with self._cond held
        _ensure_exit_hook()
        t = threading.Thread(target=self._writer_loop, name=f"monai_cache-disk-writer-{id(self):x}", daemon=True)
        self._thread = t
        t.start()

    def _writer_loop(self) -> None:
        if sys.platform.startswith("linux") and WRITER_NICE:
            # Linux applies setpriority to one thread when given its id. Off by default: on a shared machine a
            # low-priority writer is starved by other users' processes while back-pressure makes
            # __getitem__ wait for it (a priority inversion measured with benchmarks/bench_persistent.py).
            with contextlib.suppress(OSError, AttributeError):
                tid = threading.get_native_id()
                os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + WRITER_NICE))
        me = threading.current_thread()
        while True:
            with self._cond:
                if self._thread is not me:  # replaced after a fork or a reset
                    return
                deadline = time.monotonic() + WRITER_IDLE_SECONDS
                while not self._pending:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        self._thread = None  # exit when idle; put() starts a new one
                        self._cond.notify_all()
                        return
                    self._cond.wait(left)
                key = next(iter(self._pending))
                item, size = self._pending[key]
                self._writing = key
            try:
                self.write(key, item)
            except BaseException as e:  # never let the writer die with items pending
                self._count(write_errors=1)
                with contextlib.suppress(Exception):
                    warn(f"unexpected error while writing the disk cache entry for {self._name(key)}: {e!r}")
            finally:
                del item
                with self._cond:
                    if self._pending.pop(key, None) is not None:
                        self._pending_bytes -= size
                        self._count(writes_pending=-1)
                    self._writing = None
                    self._cond.notify_all()

    def _tmp_path(self, key: str, kind: str = "w") -> str:
        # .<key prefix>.<host>.<pid>.<kind><n>.tmp : never matches an entry name; pid lets sweeps find left-overs
        return os.path.join(
            self.directory, f".{key[:16]}.{_HOST_TAG}.{os.getpid()}.{kind}{next(self._tmp_counter)}{_TMP_SUFFIX}"
        )

    def write(self, key: str, item: Any) -> bool:
        """Encode and write ``item`` now (atomically). Returns True if the file exists afterwards.

        An existing file for ``key`` is kept (another worker or rank wrote the same item). Values that the
        codec cannot store are reported once and the item is not cached; a full disk or an unwritable
        directory is reported once and disables writing in this store.

        Args:
            key: the entry key.
            item: the value to store.
        """
        if self._disabled is not None:
            self._count(skipped=1)
            return False
        final = self.path(key)
        if os.path.exists(final):
            self._count(skipped=1)
            return True
        try:
            enc = codec.encode(item, allow_pickle=self.allow_pickle, downcast=self.downcast, lossy=self.lossy)
        except codec.UnsupportedValueError as e:
            self._unsupported.add(key)
            self._count(unsupported=1)
            if self._shared.first(WARNED_UNSUPPORTED):
                warn(f"{self._name(key)} is not cached: {e}", stacklevel=4)
            return False
        tmp = self._tmp_path(key)
        written = 0
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
            try:
                level = self.compression_level if self.compression else None
                written = write_entry(fd, key, enc, level, self.compression_threads)
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, final)
            tmp = ""
            if self.fsync:
                self._fsync_dir()
        except OSError as e:
            self._write_failed(key, e, enc.nbytes)
            return False
        finally:
            if tmp:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
        self._count(writes=1, bytes_written=written, bytes_raw=_nbytes(item), bytes_encoded=enc.nbytes)
        return True

    def _fsync_dir(self) -> None:
        fd = os.open(self.directory, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _write_failed(self, key: str, e: OSError, size: int) -> None:
        self._count(write_errors=1)
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            self._disable(
                WARNED_FULL,
                f"the disk holding the cache directory {self.directory!r} is full ({e.strerror}; the entry for "
                f"{self._name(key)} needed about {format_bytes(size)} before compression). Training continues "
                "without writing more cache files; existing ones are still read. Free some space or pass another "
                "cache_dir.",
            )
        elif e.errno in (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOENT, errno.ENOTDIR):
            self._disable(
                WARNED_UNWRITABLE,
                f"cannot write in the cache directory {self.directory!r} ({e.strerror or e}). Training continues "
                "uncached; check its permissions or pass another cache_dir.",
            )
        elif not self._warned_io and self._shared.first(WARNED_IO):
            self._warned_io = True
            warn(f"could not write the disk cache entry for {self._name(key)}: {e}; it stays uncached", stacklevel=5)

    def _disable(self, flag: int, message: str) -> None:
        with self._cond:
            already = self._disabled is not None
            self._disabled = message
            dropped = len(self._pending) - (1 if self._writing in self._pending else 0)
            for k in [k for k in self._pending if k != self._writing]:
                _, size = self._pending.pop(k)
                self._pending_bytes -= size
            self._cond.notify_all()
        if dropped:
            self._count(writes_pending=-dropped, skipped=dropped)
        if not already and self._shared.first(flag):
            warn(message, stacklevel=6)

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
        """Wait until this process's pending writes are on disk; False if ``timeout`` seconds passed first.

        Args:
            timeout: seconds to wait at most; None waits as long as needed.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._cond:
                if not self._pending or self._pid != os.getpid():
                    return True
                alive = self._thread is not None and self._thread.is_alive()
                if alive:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        return False
                    self._cond.wait(0.5 if left is None else min(0.5, left))
                    continue
                # no writer (e.g. threads can no longer start at interpreter exit): write here
                key = next(iter(self._pending))
                item, size = self._pending[key]
                self._writing = key
            try:
                self.write(key, item)
            finally:
                del item
                with self._cond:
                    if self._pending.pop(key, None) is not None:
                        self._pending_bytes -= size
                        self._count(writes_pending=-1)
                    self._writing = None
                    self._cond.notify_all()

    def discard_pending(self) -> int:
        """Drop the writes that have not started (e.g. the data changed); wait for the one in progress."""
        with self._cond:
            keys = [k for k in self._pending if k != self._writing]
            for k in keys:
                _, size = self._pending.pop(k)
                self._pending_bytes -= size
            while self._writing is not None and self._pid == os.getpid():
                self._cond.wait(0.5)
            self._cond.notify_all()
        if keys:
            self._count(writes_pending=-len(keys), skipped=len(keys))
        return len(keys)

    def reset_writes(self) -> None:
        """Allow writing again after a failure disabled it (e.g. space was freed, the directory recreated)."""
        with self._cond:
            self._disabled = None if self.writable else "read-only store"
            self._unsupported.clear()

    # -- bookkeeping --
    def stats(self) -> dict[str, dict[str, Any]]:
        """Counters: ``{"process": {...}, "total": {...}}``.

        ``process`` counts this process only; ``total`` adds up this process and every process forked from
        the one that created the store (DataLoader workers). Keys: ``hits``, ``misses``, ``corrupt``,
        ``unsupported``, ``writes`` (files written), ``write_errors``, ``skipped`` (writes not needed or not
        possible), ``writes_pending``, ``bytes_read``, ``bytes_written`` (file bytes), ``bytes_raw`` (the
        written items' tensor bytes in memory), ``bytes_encoded`` (codec blob bytes, after downcasting) and
        ``compression_ratio`` (``bytes_raw / bytes_written``).
        """
        return {"process": _with_ratio(dict(self._counts)), "total": _with_ratio(self._shared.snapshot())}

    def entries(self) -> Iterator[os.DirEntry]:
        """The entry files in the directory (any key)."""
        with os.scandir(self.directory) as it:
            for entry in it:
                if entry.name.endswith(ENTRY_SUFFIX) and not entry.name.startswith("."):
                    yield entry
