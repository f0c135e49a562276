"""A directory of cache entries: checksummed, optionally zstd-compressed codec blobs.

An entry is a 64-byte header followed by the item encoded by :mod:`monai_cache.codec` (the same bytes
that the shared-memory store keeps), compressed with zstd unless compression is off. Small entries (record
under :data:`PACK_LIMIT`) are appended to shared *pack* files, large ones get a file of their own
(``<key>.mcache``). The full specification is in ``docs/disk-format.md``; in short (little endian)::

    offset  size  field
    0       8     magic  b"MCDISK\\r\\n"
    8       2     disk format version (2; version 1 entry files, same layout, are read too)
    10      2     header size (64)
    12      4     flags: bit 0 = payload is one zstd frame; other bits must be 0
    16      8     blob length: size of the codec blob (after decompression)
    24      8     stored length: size of the payload that follows the header
    32      4     CRC-32 (zlib) of the stored payload
    36      4     codec format version of the blob
    40      16    key tag: the first 16 bytes of SHA-256 of the entry key
    56      4     reserved, 0
    60      4     CRC-32 of header bytes 0..59

Packs: each writing process appends records (header + payload, as above) to
``pack.<host>.<pid>.<n>.mcpack`` and then one 48-byte index record (key tag, offset, length, write time,
flags, CRC-32) to ``pack.<host>.<pid>.<n>.mcidx``. Readers map key tags to records by reading the index
files (lazily, then only their new tails on a miss); a later record for a key supersedes an earlier one
(later in the same index, else written later).

Guarantees:

* Entry files are written to a temporary file in the same directory (mode 0600), which is renamed onto
  the final name once complete: a process killed at any moment never leaves a file under a final name that
  is not complete, and concurrent writers of one entry leave one complete file (the last rename wins).
* Packed records are appended by one thread of one process per pack (mode 0600), the record before its
  index record: a writer killed mid-append leaves bytes no index record points to, or a torn index record
  that its CRC rejects. Every record is checked like a file (header, key tag, lengths, payload CRC).
* Readers check the header checksum, the key tag, the lengths and the payload checksum before decoding;
  a bad file (truncated, bit-flipped, foreign, renamed) raises :class:`~monai_cache.codec.CorruptEntryError`
  in :func:`read_entry`, and :meth:`DiskStore.get` reports it once, removes it and returns :data:`MISSING`
  (a bad packed record is reported once, never read again by this process, and superseded when rewritten).
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
import errno
import fcntl
import hashlib
import itertools
import mmap
import multiprocessing
import multiprocessing.util
import os
import re
import socket
import stat
import struct
import sys
import threading
import time
import weakref
import zlib
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

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
    "INDEX_SUFFIX",
    "MISSING",
    "PACK_LIMIT",
    "PACK_MAX_BYTES",
    "PACK_SUFFIX",
    "DiskStore",
    "StoredEntry",
    "empty_stats",
    "prepare_cache_dir",
    "read_entry",
    "read_blob",
    "read_header",
    "read_index",
    "read_packed",
    "remove_packed",
    "stored_entries",
    "sweep_temp_files",
    "write_entry",
]

DISK_MAGIC = b"MCDISK\r\n"
DISK_FORMAT_VERSION = 2
_READABLE_VERSIONS = (1, 2)  # version 2 added packs; entry files and record headers are laid out as in 1
ENTRY_SUFFIX = ".mcache"
PACK_SUFFIX = ".mcpack"
INDEX_SUFFIX = ".mcidx"
PACK_LIMIT = 256 << 10
"""Entries whose record (64-byte header + encoded blob, before compression) is smaller than this are appended
to a pack instead of getting a file of their own. A file wastes up to one file-system block (4 KiB) plus an
inode: 25% of a 16 KiB item, and at most 1.6% from 256 KiB up. Larger entries keep their own file and, with it,
streaming reads and per-entry removal."""
PACK_MAX_BYTES = 256 << 20
"""A writer starts a new pack once its current one holds this many bytes (bounds what one lost or damaged
pack takes with it, and keeps packs easy to copy)."""
INDEX_MAGIC = b"MCPKIDX\n"
_INDEX_HEAD = struct.Struct("<8sHHI")  # magic, disk format version, record size, CRC-32 of bytes 0..11
_INDEX_REC = struct.Struct("<16sQQQII")  # key tag, offset, length, write time (ns), flags, CRC-32 of bytes 0..43
INDEX_REMOVED = 1  # index record flag: the record was found bad and removed (``monai-cache verify --remove``)
INDEX_HEADER_SIZE = _INDEX_HEAD.size  # 16
INDEX_RECORD_SIZE = _INDEX_REC.size  # 48
_Loc = tuple[str, int, int, int]  # a packed record: pack name, offset, length, write time (ns)
RELIST_SECONDS = 0.5
"""On a miss, a reader lists the directory again for new pack indexes when it changed, but at most this often:
a directory of 10^5 large entry files takes tens of milliseconds to list, and it changes with every entry file
written. A pack discovered late only costs a recomputed item."""
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
# Opening files of the cache directory for reading: no symlinks, and O_NONBLOCK so that a FIFO planted under
# an entry or index name cannot block the reader (it is then rejected as not a regular file).
_READ_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
STALE_TMP_SECONDS = 3600.0  # temporary files older than this are left-overs of killed writers
_HOST_TAG = hashlib.sha1(socket.gethostname().encode()).hexdigest()[:8]
_IO_CHUNK = 1 << 30
_COMPRESS_PIECE = 4 << 20  # bytes per compressor call


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
    if version not in _READABLE_VERSIONS or hsize != HEADER_SIZE:
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
    """Sequential writes to a file descriptor, with a running CRC-32 and byte count."""

    __slots__ = ("crc", "fd", "n")

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.crc = 0
        self.n = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        total = view.nbytes
        self.crc = zlib.crc32(view, self.crc)
        while view.nbytes:
            n = os.write(self.fd, view[:_IO_CHUNK])
            view = view[n:]
        self.n += total
        return total


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


def write_entry(
    fd: int, key: str, enc: codec.Encoded, level: int | None = 1, threads: int = 0, offset: int = 0
) -> int:
    """Write a complete entry (header + payload) to ``fd`` at ``offset`` (0: an empty entry file; a pack's end).

    Args:
        fd: a file descriptor opened for writing.
        key: the entry key, recorded as a tag in the header.
        enc: the encoded item.
        level: zstd level, or ``None`` to store the blob uncompressed.
        threads: zstd worker threads (0: compress in the calling thread; -1: one per CPU).
        offset: where the record starts.

    Returns:
        the record size (header + payload).
    """
    os.lseek(fd, offset + HEADER_SIZE, os.SEEK_SET)
    sink = _Sink(fd)
    if level is None:
        for chunk in enc.chunks(data_crc=False):
            sink.write(chunk)
        flags = 0
    else:
        if zstd is None:  # pragma: no cover
            raise RuntimeError("compression needs the 'zstandard' package: pip install zstandard")
        # The compressor gets 4 MiB per call, each without the GIL, and we write its output: a stream writer
        # would call back into Python (our sink) for every 128 KiB it produces, and each callback must win
        # the GIL back from the thread computing the next item. The pieces bound the output held in memory.
        cobj = _compressor(level, threads).compressobj(size=enc.nbytes)
        for chunk in enc.chunks(data_crc=False):
            view = memoryview(chunk).cast("B")
            for start in range(0, view.nbytes, _COMPRESS_PIECE):
                out = cobj.compress(view[start : start + _COMPRESS_PIECE])
                if out:
                    sink.write(out)
        sink.write(cobj.flush())
        flags = FLAG_ZSTD
    head = _pack_header(flags, enc.nbytes, sink.n, sink.crc, key)
    if os.pwrite(fd, head, offset) != HEADER_SIZE:  # pragma: no cover - a 64-byte pwrite is not split
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


def read_blob(
    fd: int, key: str | None = None, offset: int = 0, length: int | None = None, tag: bytes | None = None
) -> tuple[memoryview, int]:
    """Read and check the entry in ``fd``; return its codec blob (a fresh, writable buffer) and the record size.

    Args:
        fd: a file descriptor of the entry file or pack, opened for reading.
        key: the entry key the record must hold; ``None`` skips the key check.
        offset: where the record starts (a packed record's offset; 0 for an entry file).
        length: the record's size as its index records it; ``None``: the record is the whole file.
        tag: the key tag the record must hold (when the key itself is not known, e.g. checking a pack's index).

    Raises:
        CorruptEntryError: any check failed.
        OSError: the file could not be read.
    """
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise codec.CorruptEntryError("not a regular file")
    if length is not None and offset + length > st.st_size:
        raise codec.CorruptEntryError(f"truncated pack: the record ends at {offset + length}, the pack at {st.st_size}")
    head = os.pread(fd, HEADER_SIZE, offset)
    if len(head) < HEADER_SIZE:
        raise codec.CorruptEntryError("empty file" if not head else f"truncated: {len(head)} bytes")
    h = read_header(head, key, st.st_size if length is None else None)
    size = HEADER_SIZE + h["stored_len"]
    if length is not None and size != length:
        raise codec.CorruptEntryError(f"the record has {size} bytes, its index says {length}")
    if tag is not None and h["key_tag"] != tag:
        raise codec.CorruptEntryError("the record belongs to another entry (key tag mismatch)")
    if h["compressed"] and h["stored_len"] >= STREAM_READ_BYTES and zstd is not None:
        return _read_streaming(fd, h, offset), size
    view = _buffer(h["stored_len"])
    _read_exact(fd, view, offset + HEADER_SIZE)
    if zlib.crc32(view) != h["crc"]:
        raise codec.CorruptEntryError("payload checksum mismatch")
    if not h["compressed"]:
        return view, size
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
    return out, size


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


def _read_streaming(fd: int, h: dict, offset: int = 0) -> memoryview:
    """Decompress a large payload from ``fd`` into a fresh buffer, checking the payload CRC as it goes."""
    out = _buffer(h["blob_len"])
    src = _CheckedReader(fd, offset + HEADER_SIZE, h["stored_len"])
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
    fd = os.open(path, _READ_FLAGS)
    try:
        blob, _ = read_blob(fd, key or None)
    finally:
        os.close(fd)
    return codec.decode(blob, allow_pickle=allow_pickle)


# ----------------------------------------------------------------------------------------------- packs
_PACK_STEM = re.compile(r"pack\.[0-9a-f]{8}\.[0-9]+\.[0-9]+")


def is_pack_file(name: str) -> bool:
    """Whether ``name`` is the name of a pack (``pack.<host>.<pid>.<n>.mcpack``) or of its index (``.mcidx``).

    Args:
        name: a file name (no directory).
    """
    for suffix in (PACK_SUFFIX, INDEX_SUFFIX):
        if name.endswith(suffix):
            return _PACK_STEM.fullmatch(name[: -len(suffix)]) is not None
    return False


def _index_header() -> bytes:
    head = _INDEX_HEAD.pack(INDEX_MAGIC, DISK_FORMAT_VERSION, INDEX_RECORD_SIZE, 0)
    return head[:12] + struct.pack("<I", zlib.crc32(head[:12]))


def _index_record(tag: bytes, offset: int, length: int, stamp: int, flags: int = 0) -> bytes:
    rec = _INDEX_REC.pack(tag, offset, length, stamp, flags, 0)
    return rec[:44] + struct.pack("<I", zlib.crc32(rec[:44]))


def _supersedes(new: _Loc, old: _Loc | None) -> bool:
    """Whether record ``new`` replaces ``old`` for a key: later in the same pack, else written later."""
    return old is None or new[0] == old[0] or new[3] >= old[3]


def read_index(path: str, pos: int = 0) -> tuple[list[tuple[bytes, int, int, int, int]], int, bool]:
    """Read the complete, valid records of a pack index from byte ``pos`` on (removed ones left out).

    Reading stops at the first record that is incomplete (being written) or fails its CRC (torn by a killed
    writer; its writer never appends after a failed write, so nothing valid follows it).

    Args:
        path: the ``.mcidx`` file.
        pos: where to start (0: the beginning; else a position this function returned).

    Returns:
        ``([(key tag, record offset, record length, write time in ns, position of the index record), ...],
        position after the last record read, torn)``: the position is -1 when the file is not an index (foreign, damaged
        header, unknown version); ``torn`` says that reading stopped at a complete record that failed its CRC.

    Raises:
        OSError: the file could not be opened or read.
    """
    fd = os.open(path, _READ_FLAGS)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return [], -1, False
        if pos == 0:
            head = os.pread(fd, INDEX_HEADER_SIZE, 0)
            if len(head) < INDEX_HEADER_SIZE:
                return [], (0 if INDEX_MAGIC.startswith(head[:8]) else -1), False  # being created, or foreign
            magic, version, rec_size, hcrc = _INDEX_HEAD.unpack(head)
            if (
                magic != INDEX_MAGIC
                or zlib.crc32(head[:12]) != hcrc
                or version != DISK_FORMAT_VERSION
                or rec_size != INDEX_RECORD_SIZE
            ):
                return [], -1, False
            pos = INDEX_HEADER_SIZE
        n = max(0, st.st_size - pos) // INDEX_RECORD_SIZE
        data = os.pread(fd, n * INDEX_RECORD_SIZE, pos) if n else b""
    finally:
        os.close(fd)
    out: list[tuple[bytes, int, int, int, int]] = []
    for start in range(0, len(data) - INDEX_RECORD_SIZE + 1, INDEX_RECORD_SIZE):
        tag, offset, length, stamp, flags, crc = _INDEX_REC.unpack_from(data, start)
        if zlib.crc32(data[start : start + 44]) != crc or length < HEADER_SIZE:
            return out, pos, True
        if not flags & INDEX_REMOVED:
            out.append((tag, offset, length, stamp, pos))
        pos += INDEX_RECORD_SIZE
    return out, pos, False


class StoredEntry(NamedTuple):
    """Where one entry is stored: a whole ``.mcache`` file, or a record of a pack."""

    path: str
    """The entry file, or the pack file."""
    offset: int
    """Where the record starts (0 for an entry file)."""
    length: int
    """Record size: header + stored payload (for an entry file, its size)."""
    tag: bytes | None
    """The key tag from the pack's index (``None`` for an entry file: its name is the key)."""
    index_path: str | None = None
    """The pack's index file (``None`` for an entry file, or when not known)."""
    index_pos: int = -1
    """Where the record's index record is in ``index_path``."""

    @property
    def packed(self) -> bool:
        """Whether the entry is a record in a pack."""
        return self.tag is not None


def stored_entries(directory: str, superseded: bool = False) -> Iterator[StoredEntry]:
    """The entries in a cache directory: entry files (not opened), then the indexed records of every pack.

    Args:
        directory: the cache directory.
        superseded: also list packed records that a later record of the same key replaced (``verify`` checks
            them all); by default only the record a reader would use, once per key.

    Raises:
        OSError: the directory could not be listed.
    """
    with os.scandir(directory) as it:
        names = sorted(e.name for e in it if not e.name.startswith("."))
    latest: dict[bytes, tuple[StoredEntry, _Loc]] = {}
    for name in names:
        path = os.path.join(directory, name)
        if name.endswith(ENTRY_SUFFIX):
            try:
                st = os.stat(path, follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                yield StoredEntry(path, 0, st.st_size, None)
        elif name.endswith(INDEX_SUFFIX) and is_pack_file(name):
            try:
                records, _, _ = read_index(path)
            except OSError:
                continue
            pack = path[: -len(INDEX_SUFFIX)] + PACK_SUFFIX
            for tag, offset, length, stamp, index_pos in records:
                entry = StoredEntry(pack, offset, length, tag, path, index_pos)
                loc = (pack, offset, length, stamp)
                if superseded:
                    yield entry
                elif _supersedes(loc, latest[tag][1] if tag in latest else None):
                    latest[tag] = (entry, loc)
    for entry, _ in latest.values():
        yield entry


def read_packed(entry: StoredEntry, allow_pickle: bool = False) -> Any:
    """Read, check and decode one packed record (a helper for tools and tests).

    Args:
        entry: the record, as :func:`stored_entries` lists it.
        allow_pickle: decode values stored with pickle.

    Raises:
        CorruptEntryError: the record is not a valid entry for its indexed key tag.
        OSError: the pack could not be opened or read.
    """
    fd = os.open(entry.path, _READ_FLAGS)
    try:
        blob, _ = read_blob(fd, None, entry.offset, entry.length, entry.tag)
    finally:
        os.close(fd)
    return codec.decode(blob, allow_pickle=allow_pickle)


def remove_packed(entry: StoredEntry) -> None:
    """Mark a packed record removed in its index (``monai-cache verify --remove`` of a bad record).

    The record's bytes stay in the pack (other entries share it); readers that load the index from now on
    skip it, and the entry is recomputed and appended anew when next used. The index record is rewritten in
    place (its writer only ever writes at the index's end).

    Args:
        entry: a packed record as :func:`stored_entries` lists it.

    Raises:
        ValueError: ``entry`` is not a packed record with a known index record.
        OSError: the index could not be written.
    """
    if entry.tag is None or entry.index_path is None or entry.index_pos < INDEX_HEADER_SIZE:
        raise ValueError(f"not a packed record with a known index record: {entry!r}")
    fd = os.open(entry.index_path, os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        rec = _index_record(entry.tag, entry.offset, entry.length, 0, INDEX_REMOVED)
        if os.pwrite(fd, rec, entry.index_pos) != len(rec):  # pragma: no cover - 48 bytes
            raise OSError(errno.EIO, "short write to a pack index")
    finally:
        os.close(fd)


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
        # Not at interpreter exit: the exit flush of pending writes (which counts them) runs after
        # weakref's exit hook, and would find the descriptor closed. The process's end closes it.
        weakref.finalize(self, os.close, self._fd).atexit = False
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


_pack_numbers = itertools.count()  # per process: two stores of one process never share a pack


class _PackWriter:
    """The pack (and index) that one store appends to in this process; used under the store's pack lock.

    Both files are opened for each append and closed after it: no descriptor stays open between writes (a
    file system can be remounted read-only or unmounted between them, and a fork inherits nothing), and a
    pack removed meanwhile (cache cleared) is noticed as a missing file.
    """

    __slots__ = ("index_size", "name", "size")

    def __init__(self, directory: str, fsync: bool) -> None:
        self.size, self.index_size = 0, INDEX_HEADER_SIZE
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW
        while True:
            self.name = os.path.join(directory, f"pack.{_HOST_TAG}.{os.getpid()}.{next(_pack_numbers)}")
            try:
                pack_fd = os.open(self.name + PACK_SUFFIX, flags, 0o600)
            except FileExistsError:  # left by an earlier process that had our pid: never append to its pack
                continue
            try:
                index_fd = os.open(self.name + INDEX_SUFFIX, flags, 0o600)
            except BaseException as e:
                os.close(pack_fd)
                with contextlib.suppress(OSError):
                    os.unlink(self.name + PACK_SUFFIX)
                if isinstance(e, FileExistsError):
                    continue
                raise
            break
        try:
            head = _index_header()
            if os.pwrite(index_fd, head, 0) != len(head):  # pragma: no cover - 16 bytes are not split
                raise OSError(errno.EIO, "short write to a pack index")
            if fsync:
                os.fsync(index_fd)
                os.fsync(pack_fd)
                dfd = os.open(directory, os.O_RDONLY | os.O_CLOEXEC)
                try:
                    os.fsync(dfd)
                finally:
                    os.close(dfd)
        finally:
            os.close(pack_fd)
            os.close(index_fd)


_NO_FILE: Any = object()  # DiskStore._get_file: there is no entry file for the key
_BAD: Any = object()  # DiskStore._get_packed: the record is bad (reported)
_GONE: Any = object()  # DiskStore._get_packed: the pack no longer exists


class DiskStore:
    """Cache entries in one directory; reads are checked, writes are atomic (or appended) and asynchronous.

    Entries whose record (64-byte header + encoded item) is smaller than ``pack_limit`` are appended to this
    process's pack (``pack.<host>.<pid>.<n>.mcpack``, indexed by ``.mcidx``); larger ones get their own file,
    ``<key>.mcache``.

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
        max_pending_bytes: most bytes of encoded items waiting for the writer (an int or a string like ``"512MiB"``);
            a single larger item is still accepted when nothing else is pending.
        writable: False to only read (no file is ever written or removed).
        describe: names an entry key in warnings (e.g. with the data item); default: the key.
        pack_limit: records (header + encoded item, before compression) smaller than this many bytes are
            packed; 0 gives every entry its own file. Packed entries written by others are read either way.
    """

    __slots__ = (
        "__weakref__", "_bad_reported", "_cond", "_counts", "_describe", "_disabled", "_pack_lock", "_packer",
        "_pending", "_pending_bytes", "_pid", "_pk_bad", "_pk_dir_mtime", "_pk_listed_at", "_pk_loaded",
        "_pk_lock", "_pk_map", "_pk_read", "_pk_unsure", "_shared", "_thread", "_tmp_counter", "_unsupported",
        "_warned_io", "_writing", "allow_pickle", "async_writes", "compression", "compression_level",
        "compression_threads", "directory", "downcast", "fsync", "lossy", "max_pending_bytes", "max_pending_writes",
        "pack_limit", "writable",
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
        if isinstance(pack_limit, bool) or not isinstance(pack_limit, int) or pack_limit < 0:
            raise ValueError(f"pack_limit must be an int >= 0, got {pack_limit!r}")
        self.pack_limit = pack_limit
        self._describe = describe
        self._shared = _SharedCounters()
        self._init_runtime()
        _STORES.add(self)

    # -- process-local state (not pickled, reset in a forked child) --
    def _init_runtime(self, disabled: str | None = None) -> None:
        self._pid = os.getpid()
        self._cond = threading.Condition(threading.Lock())
        self._pending: dict[str, tuple[codec.Encoded, int, int]] = {}  # key -> (encoded copy, its size, raw size)
        self._pending_bytes = 0
        self._writing: str | None = None
        self._thread: threading.Thread | None = None
        self._counts = dict.fromkeys(_FIELDS, 0)
        self._tmp_counter = itertools.count()
        self._bad_reported: set[str] = set()
        self._unsupported: set[str] = set()
        self._disabled: str | None = disabled if self.writable else "read-only store"
        self._warned_io = False
        # appending: this process's own pack (never the parent's: one process appends to a pack)
        self._pack_lock = threading.Lock()
        self._packer: _PackWriter | None = None
        # reading packs: key tag -> (pack name, record offset, record length), from the index files
        self._pk_lock = threading.Lock()
        self._pk_map: dict[bytes, _Loc] = {}
        self._pk_read: dict[str, list[int]] = {}  # index name -> [position read up to, size then]
        self._pk_bad: set[tuple[str, int]] = set()  # records found bad: never served again
        self._pk_loaded = False
        self._pk_dir_mtime = -1
        self._pk_listed_at = -RELIST_SECONDS
        self._pk_unsure = False

    def _reset_after_fork(self) -> None:
        # The writer thread does not exist in the child and the parent writes its own pending items; a
        # reason not to write (unwritable directory, full disk) still holds. What the parent read of the
        # pack indexes stays valid (append-only files): keep it rather than re-read every index.
        known = (self._pk_map, self._pk_read, self._pk_bad, self._pk_loaded, self._pk_dir_mtime, self._pk_listed_at,
                 self._pk_unsure)
        self._init_runtime(self._disabled)
        (self._pk_map, self._pk_read, self._pk_bad, self._pk_loaded, self._pk_dir_mtime, self._pk_listed_at,
         self._pk_unsure) = known

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
        loc = self._locate(key, refresh=True)
        if loc is not None and not os.path.exists(os.path.join(self.directory, loc[0])):
            self._forget(key, loc)  # its pack was removed
            loc = self._locate(key, refresh=True)
        if loc is not None:
            return StoredEntry(os.path.join(self.directory, loc[0]), loc[1], loc[2], key_tag(key))
        path = self.path(key)
        try:
            st = os.stat(path, follow_symlinks=False)
        except OSError:
            return None
        return StoredEntry(path, 0, st.st_size, None)

    # -- the pack indexes --
    def _locate(self, key: str, refresh: bool = False) -> _Loc | None:
        """The packed record of ``key`` as last read from the indexes; re-read (new tails only) if unknown
        and ``refresh``. The first call reads every index."""
        tag = key_tag(key)
        with self._pk_lock:
            loc = self._pk_map.get(tag)
            if loc is None and (refresh or not self._pk_loaded):
                self._refresh_locked()
                self._pk_loaded = True
                loc = self._pk_map.get(tag)
            return loc

    def _refresh_locked(self) -> None:
        now = time.monotonic()
        try:
            mtime = os.stat(self.directory).st_mtime_ns
        except OSError:
            return
        # New index files change the directory's mtime. A listing made within the timestamp granularity of
        # the last change may miss a file created in the same tick: list again next time then.
        if now - self._pk_listed_at >= RELIST_SECONDS and (mtime != self._pk_dir_mtime or self._pk_unsure):
            self._pk_dir_mtime, self._pk_listed_at = mtime, now
            self._pk_unsure = time.time_ns() - mtime < 2_000_000_000
            try:
                with os.scandir(self.directory) as it:
                    for entry in it:
                        name = entry.name
                        if name not in self._pk_read and name.endswith(INDEX_SUFFIX) and is_pack_file(name):
                            self._pk_read[name] = [0, -1]
            except OSError:
                return
        for name, state in list(self._pk_read.items()):
            pos, seen = state
            if pos < 0:
                continue  # not an index (foreign or damaged header)
            path = os.path.join(self.directory, name)
            try:
                size = os.stat(path, follow_symlinks=False).st_size
            except FileNotFoundError:  # cleared: forget its records (a new pack may get the name)
                del self._pk_read[name]
                pack = name[: -len(INDEX_SUFFIX)] + PACK_SUFFIX
                for tag in [t for t, loc in self._pk_map.items() if loc[0] == pack]:
                    del self._pk_map[tag]
                continue
            except OSError:
                continue
            if size == seen:
                continue
            try:
                records, state[0], torn = read_index(path, pos)
            except OSError:
                continue
            # after a record that fails its CRC, read again next time even if the size stays: it may have been
            # seen while ``verify --remove`` rewrote it in place
            state[1] = -1 if torn else size
            pack = name[: -len(INDEX_SUFFIX)] + PACK_SUFFIX
            for tag, offset, length, stamp, _ in records:
                loc = (pack, offset, length, stamp)
                if (pack, offset) not in self._pk_bad and _supersedes(loc, self._pk_map.get(tag)):
                    self._pk_map[tag] = loc

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
        return self._locate(key, refresh=True) is not None or os.path.exists(self.path(key))

    def get(self, key: str) -> Any:
        """The item stored under ``key``, or :data:`MISSING`.

        A write still pending in this process is served from memory (a private copy). A file that fails a
        check is reported once, removed, and counted as corrupt; the caller then recomputes the item. A
        packed record that fails a check is reported once and never read again by this process; the
        recomputed item is appended anew and its record supersedes the bad one for every reader.

        Args:
            key: the entry key.
        """
        with self._cond:
            pending = self._pending.get(key)
        if pending is not None:  # decoded from a copy of its blob, exactly as a read of the file would be
            self._count(hits=1)
            return codec.decode(pending[0].to_bytes(data_crc=False), allow_pickle=self.allow_pickle)
        loc = self._locate(key)
        if loc is None:
            item = self._get_file(key)
            if item is not _NO_FILE:
                return item
            loc = self._locate(key, refresh=True)  # written by another process since we last looked?
        for _ in range(4):
            if loc is None:
                break
            item = self._get_packed(key, loc)
            if item is _GONE:  # its pack was removed (cache cleared): rewritten elsewhere since?
                loc = self._locate(key, refresh=True)
            elif item is _BAD:
                loc = self._locate(key)  # another record of the key that _bad_record found, if any
            else:
                return item
        self._count(misses=1)
        return MISSING

    def _get_packed(self, key: str, loc: _Loc) -> Any:
        """The item in a packed record; ``_BAD`` (reported) if the record is bad, ``_GONE`` if its pack is."""
        name, offset, length, _ = loc
        path = os.path.join(self.directory, name)
        try:
            fd = os.open(path, _READ_FLAGS)
        except (FileNotFoundError, NotADirectoryError):  # the pack was removed (cache cleared)
            self._forget(key, loc)
            return _GONE
        except OSError as e:
            if e.errno == errno.ELOOP:
                self._bad_record(key, loc, "the pack is a symbolic link")
                return _BAD
            self._warn_io(f"cannot open cache pack {path}: {e.strerror or e}")
            self._count(misses=1)
            return MISSING
        try:
            blob, size = read_blob(fd, key, offset, length)
            item = codec.decode(blob, allow_pickle=self.allow_pickle)
        except codec.CorruptEntryError as e:
            self._bad_record(key, loc, str(e))
            return _BAD
        except OSError as e:
            self._warn_io(f"cannot read cache pack {path}: {e.strerror or e}")
            self._count(misses=1)
            return MISSING
        except Exception as e:  # whatever a damaged or crafted record provokes in decoding: never crash training
            self._bad_record(key, loc, f"cannot decode: {e!r}")
            return _BAD
        finally:
            os.close(fd)
        self._count(hits=1, bytes_read=size)
        return item

    def _forget(self, key: str, loc: _Loc, bad: bool = False) -> None:
        tag = key_tag(key)
        with self._pk_lock:
            if self._pk_map.get(tag) == loc:
                del self._pk_map[tag]
            if not bad:
                return
            self._pk_bad.add(loc[:2])
            # Another process may have rewritten the key in its own pack, and which of the two records the
            # indexes gave us depends on the order they were read in: look for the latest record that is not
            # known bad (reads every index again; only ever done for a bad record).
            alternative: _Loc | None = None
            for name in sorted(self._pk_read):
                if self._pk_read[name][0] < 0:
                    continue
                try:
                    records, _, _ = read_index(os.path.join(self.directory, name))
                except OSError:
                    continue
                pack = name[: -len(INDEX_SUFFIX)] + PACK_SUFFIX
                for t, offset, length, stamp, _ in records:
                    other = (pack, offset, length, stamp)
                    if t == tag and (pack, offset) not in self._pk_bad and _supersedes(other, alternative):
                        alternative = other
            if alternative is not None and tag not in self._pk_map:
                self._pk_map[tag] = alternative

    def _bad_record(self, key: str, loc: _Loc, why: str) -> None:
        """Never serve this record again (in this process); report it once per entry and process."""
        self._forget(key, loc, bad=True)
        self._count(corrupt=1)
        if key in self._bad_reported:
            return
        self._bad_reported.add(key)
        action = "will be recomputed" if self._disabled is None else "is ignored"
        where = os.path.join(self.directory, loc[0])
        warn(
            f"corrupt disk cache record for {self._name(key)} ({why}): {where} at offset {loc[1]} {action}",
            stacklevel=5,
        )

    def _get_file(self, key: str) -> Any:
        """The item in the entry file of ``key``; :data:`MISSING` if it is bad, ``_NO_FILE`` if there is none."""
        path = self.path(key)
        try:
            fd = os.open(path, _READ_FLAGS)
        except (FileNotFoundError, NotADirectoryError):  # no entry (or no cache directory at all)
            return _NO_FILE
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

        ``item`` is encoded here, and the writer gets its own copy of the encoded bytes (so that later
        in-place changes by the caller cannot reach the file; downcast values are only stored in their
        smaller dtype). Blocks while the pending writes exceed ``max_pending_writes`` or
        ``max_pending_bytes``. Never raises for I/O problems: they are reported once and the item stays
        uncached.

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
        raw = _nbytes(item)
        enc = self._encode(key, item)
        if enc is None:
            return
        if enc.nbytes > self.max_pending_bytes:
            # A volume larger than the whole queue: write it now, from the caller's item, rather than hold a
            # copy of it for the writer (that copy would double the memory a multi-gigabyte item takes).
            self._write_encoded(key, enc, raw)
            return
        enc = enc.detach()
        size = enc.nbytes
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
            self._pending[key] = (enc, size, raw)
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
                enc, size, raw = self._pending[key]
                self._writing = key
            try:
                self._write_encoded(key, enc, raw)
            except BaseException as e:  # never let the writer die with items pending
                self._count(write_errors=1)
                with contextlib.suppress(Exception):
                    warn(f"unexpected error while writing the disk cache entry for {self._name(key)}: {e!r}")
            finally:
                del enc
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

    def write(self, key: str, item: Any, replace: bool = False) -> bool:
        """Encode and write ``item`` now (atomically, or appended to this process's pack). Returns True if an
        entry for ``key`` exists afterwards.

        An existing entry for ``key`` is kept (another worker or rank wrote the same item) unless ``replace``.
        Values that the codec cannot store are reported once and the item is not cached; a full disk or an
        unwritable directory is reported once and disables writing in this store.

        Args:
            key: the entry key.
            item: the value to store.
            replace: write even if an entry exists; the new one supersedes it (packed: a later record).
        """
        if self._disabled is not None:
            self._count(skipped=1)
            return False
        if not replace and self._exists(key):
            self._count(skipped=1)
            return True
        enc = self._encode(key, item)
        return enc is not None and self._write_encoded(key, enc, _nbytes(item), replace=True)

    def _exists(self, key: str) -> bool:
        return self._locate(key) is not None or os.path.exists(self.path(key))

    def _encode(self, key: str, item: Any) -> codec.Encoded | None:
        """``item`` encoded, or None (reported once, and never tried again) if the codec cannot store it."""
        try:
            return codec.encode(item, allow_pickle=self.allow_pickle, downcast=self.downcast, lossy=self.lossy)
        except codec.UnsupportedValueError as e:
            self._unsupported.add(key)
            self._count(unsupported=1)
            if self._shared.first(WARNED_UNSUPPORTED):
                warn(f"{self._name(key)} is not cached: {e}", stacklevel=5)
            return None

    def _write_encoded(self, key: str, enc: codec.Encoded, raw: int, replace: bool = False) -> bool:
        """Write an encoded item (``raw``: the item's size in memory, for the counters); see :meth:`write`."""
        if self._disabled is not None:
            self._count(skipped=1)
            return False
        if not replace and self._exists(key):
            self._count(skipped=1)
            return True
        final = self.path(key)
        level = self.compression_level if self.compression else None
        if HEADER_SIZE + enc.nbytes < self.pack_limit:
            try:
                written = self._append(key, enc, level)
            except OSError as e:
                self._write_failed(key, e, enc.nbytes)
                return False
            self._count(writes=1, bytes_written=written, bytes_raw=raw, bytes_encoded=enc.nbytes)
            return True
        tmp = self._tmp_path(key)
        written = 0
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
            try:
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
        loc = self._locate(key)
        if loc is not None:  # replaced by a file: this process reads the file from now on
            self._forget(key, loc)
        self._count(writes=1, bytes_written=written, bytes_raw=raw, bytes_encoded=enc.nbytes)
        return True

    def _open_pack(self) -> tuple[_PackWriter, int]:
        """This process's current pack (a new one when there is none, it is full, or it was removed) and a
        descriptor of it open for writing; called with the pack lock held."""
        w = self._packer
        if w is not None and w.size < PACK_MAX_BYTES:
            try:
                return w, os.open(w.name + PACK_SUFFIX, os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
            except FileNotFoundError:  # removed (cache cleared): start a new pack
                pass
        self._packer = None
        w = self._packer = _PackWriter(self.directory, self.fsync)
        return w, os.open(w.name + PACK_SUFFIX, os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW)

    def _append(self, key: str, enc: codec.Encoded, level: int | None) -> int:
        """Append the entry to this process's pack, then its index record; returns the bytes written."""
        tag = key_tag(key)
        with self._pack_lock:
            w, pack_fd = self._open_pack()
            offset = w.size
            indexed = False
            try:
                index_fd = os.open(w.name + INDEX_SUFFIX, os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
                try:
                    n = write_entry(pack_fd, key, enc, level, self.compression_threads, offset)
                    if self.fsync:
                        os.fsync(pack_fd)  # the record is on disk before any index record points to it
                    stamp = time.time_ns()
                    rec = _index_record(tag, offset, n, stamp)
                    if os.pwrite(index_fd, rec, w.index_size) != len(rec):  # pragma: no cover - 48 bytes
                        raise OSError(errno.EIO, "short write to a pack index")
                    indexed = True
                    if self.fsync:
                        os.fsync(index_fd)
                finally:
                    os.close(index_fd)
            except BaseException:
                # The tail of this pack (or its index) is now unknown: never append to it again. Give back
                # the space of a record no index record points to.
                if not indexed:
                    with contextlib.suppress(OSError):
                        os.ftruncate(pack_fd, offset)
                self._packer = None
                raise
            finally:
                os.close(pack_fd)
            w.size = offset + n
            w.index_size += INDEX_RECORD_SIZE
            loc = (os.path.basename(w.name) + PACK_SUFFIX, offset, n, stamp)
        with self._pk_lock:
            self._pk_map[tag] = loc
        return n + INDEX_RECORD_SIZE

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
                size = self._pending.pop(k)[1]
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
                enc, size, raw = self._pending[key]
                self._writing = key
            try:
                self._write_encoded(key, enc, raw)
            finally:
                del enc
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
                size = self._pending.pop(k)[1]
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
        ``unsupported``, ``writes`` (entries written: files or packed records), ``write_errors``, ``skipped``
        (writes not needed or not possible), ``writes_pending``, ``bytes_read``, ``bytes_written`` (file bytes,
        pack index records included), ``bytes_raw`` (the
        written items' tensor bytes in memory), ``bytes_encoded`` (codec blob bytes, after downcasting) and
        ``compression_ratio`` (``bytes_raw / bytes_written``).
        """
        return {"process": _with_ratio(dict(self._counts)), "total": _with_ratio(self._shared.snapshot())}

    def entries(self) -> Iterator[StoredEntry]:
        """The entries in the directory (any key, any writer): entry files and the packed records readers use
        (one per key; see :func:`stored_entries`)."""
        return stored_entries(self.directory)
