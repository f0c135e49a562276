"""The disk cache's files: entry files, packs and their indexes. Read, write, list, verify and remove.

An entry is a 64-byte header followed by the item encoded by :mod:`monai_cache.codec` (the same bytes that
the shared-memory store keeps), compressed with zstd unless compression is off. Small entries (record under
:data:`PACK_LIMIT`) are records appended to shared *pack* files, large ones get a file of their own
(``<key>.mcache``). ``docs/disk-format.md`` is the full specification; in short (little endian)::

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

Packs: records (header + payload, as above) back to back in ``pack.<host>.<pid>.<n>.mcpack``, each followed by
one 48-byte index record (key tag, offset, length, write time, flags, CRC-32) in ``pack.<host>.<pid>.<n>.mcidx``.
A later record for a key supersedes an earlier one (later in the same index, else written later).

Checks: readers verify the header checksum, the key tag, the lengths and the payload checksum before decoding;
a bad record raises :class:`~monai_cache.errors.CorruptEntryError`. Nothing is unpickled unless asked.

This module knows the bytes and the names; :mod:`monai_cache.disk` decides what to read and write, and the
command line (``monai-cache info / clear / verify``) uses :func:`summarize`, :func:`clear` and :func:`verify`.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import hashlib
import os
import re
import stat
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np
import zstandard as zstd

from monai_cache import codec
from monai_cache.errors import CorruptEntryError
from monai_cache.runtime import read_into, temp_owner, write_all

__all__ = [
    "DEFAULT_COMPRESSION_LEVEL",
    "DISK_FORMAT_VERSION",
    "DISK_MAGIC",
    "ENTRY_SUFFIX",
    "HEADER_SIZE",
    "INDEX_MAGIC",
    "INDEX_RECORD_SIZE",
    "INDEX_SUFFIX",
    "PACK_LIMIT",
    "PACK_MAX_BYTES",
    "PACK_SUFFIX",
    "PackIndex",
    "PackedRecord",
    "StoredEntry",
    "clear",
    "index_header",
    "index_record",
    "is_pack_file",
    "key_tag",
    "pack_header",
    "read_blob",
    "read_entry",
    "read_header",
    "read_index",
    "read_packed",
    "remove_packed",
    "stored_entries",
    "summarize",
    "verify",
    "write_record",
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
HEADER = struct.Struct("<8sHHIQQII16sII")
HEADER_SIZE = HEADER.size  # 64
FLAG_ZSTD = 1
_KNOWN_FLAGS = FLAG_ZSTD
MAX_BLOB = 1 << 40  # 1 TiB: a header claiming more is rejected before allocating anything
DEFAULT_COMPRESSION_LEVEL = -1
"""zstd level used by default, chosen with ``benchmarks/bench_persistent.py`` (see ``docs/persistent.md``): the
files stay well under the size of the ``.nii.gz`` sources, and negative levels store literals raw, which
makes both compression (cold epoch) and decompression (warm epochs) about twice as fast as levels >= 1."""
STREAM_READ_BYTES = 64 << 20
"""Compressed payloads of this size or more are decompressed straight from the file, in chunks, instead of
being read into memory first: reading a multi-gigabyte entry then holds the decoded blob and a few MiB."""
RELIST_SECONDS = 0.5
"""On a miss, a reader lists the directory again for new pack indexes when it changed, but at most this often:
a directory of 10^5 large entry files takes tens of milliseconds to list, and it changes with every entry file
written. A pack discovered late only costs a recomputed item."""
LOCKS_NAME = ".locks"
"""A cache directory's lock file: byte :func:`entry_lock_byte` of it is locked while a process computes that
entry (shared stores only). Empty: only its locks matter."""
READ_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
"""Opening files of a cache directory to read: no symlinks, and O_NONBLOCK so that a FIFO planted under an
entry or index name cannot block the reader (it is then rejected as not a regular file)."""
_COMPRESS_PIECE = 4 << 20  # bytes per compressor call


# ------------------------------------------------------------------------------------------------ records
def key_tag(key: str) -> bytes:
    """The 16 bytes that bind a record to its entry key (first half of SHA-256 of the key).

    Args:
        key: the entry key (the file name without ``.mcache``).
    """
    return hashlib.sha256(key.encode()).digest()[:16]


_SAFE_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,200}")


def entry_key(item_hash: str, variant: str) -> str:
    """The entry key (file name without ``.mcache``) of an item: its hash and the variant of what is stored,
    ``<item hash>-<variant>``; a name that is not ``[A-Za-z0-9_.-]{1,200}`` (custom hash functions) is replaced by
    its SHA-256 hex digest, so that every key is a safe file name.

    Args:
        item_hash: the data item's hash (MONAI's ``hash_func(item)``, plus its ``transform_hash``).
        variant: names what is stored beyond the data item (transforms, options, format versions).
    """
    key = f"{item_hash}-{variant}"
    if not _SAFE_NAME.fullmatch(key) or key.startswith("."):
        key = hashlib.sha256(key.encode()).hexdigest()
    return key


def entry_lock_byte(key: str) -> int:
    """The byte of :data:`LOCKS_NAME` that stands for entry ``key`` (two keys rarely share one: 2^30 bytes)."""
    return int.from_bytes(key_tag(key)[:4], "little") & ((1 << 30) - 1)


def pack_header(flags: int, blob_len: int, stored_len: int, payload_crc: int, key: str) -> bytes:
    """The 64-byte header of a record.

    Args:
        flags: :data:`FLAG_ZSTD` if the payload is compressed, else 0.
        blob_len: size of the codec blob.
        stored_len: size of the payload that follows the header.
        payload_crc: CRC-32 of the payload.
        key: the entry key (its tag goes into the header).
    """
    head = HEADER.pack(
        DISK_MAGIC, DISK_FORMAT_VERSION, HEADER_SIZE, flags, blob_len, stored_len, payload_crc,
        codec.FORMAT_VERSION, key_tag(key), 0, 0,
    )
    return head[:60] + struct.pack("<I", zlib.crc32(head[:60]))


def read_header(head: bytes | bytearray | memoryview, key: str | None = None, file_size: int | None = None) -> dict:
    """Parse and check a record header.

    Args:
        head: the first :data:`HEADER_SIZE` bytes of a record (at least).
        key: the entry key the record is expected to hold; ``None`` skips the key check.
        file_size: the size of the whole file (an entry file); ``None`` skips the length check.

    Returns:
        ``{"version", "flags", "compressed", "blob_len", "stored_len", "crc", "codec_version", "key_tag"}``.

    Raises:
        CorruptEntryError: the header is short, foreign, damaged, of another version, or does not match.
    """
    if len(head) < HEADER_SIZE:
        raise CorruptEntryError(f"truncated: {len(head)} bytes, shorter than the {HEADER_SIZE}-byte header")
    magic, version, hsize, flags, blob_len, stored_len, crc, codec_version, tag, _res, hcrc = HEADER.unpack_from(
        head, 0
    )
    if magic != DISK_MAGIC:
        raise CorruptEntryError("not a monai_cache disk entry (bad magic number)")
    if zlib.crc32(bytes(head[:60])) != hcrc:
        raise CorruptEntryError("header checksum mismatch")
    if version not in _READABLE_VERSIONS or hsize != HEADER_SIZE:
        raise CorruptEntryError(
            f"disk format version {version} (header {hsize} bytes) is not supported; this reads {DISK_FORMAT_VERSION}"
        )
    if codec_version != codec.FORMAT_VERSION:
        raise CorruptEntryError(f"codec format version {codec_version} is not supported")
    if flags & ~_KNOWN_FLAGS:
        raise CorruptEntryError(f"unknown flags {flags:#x}")
    compressed = bool(flags & FLAG_ZSTD)
    if blob_len > MAX_BLOB or (not compressed and stored_len != blob_len):
        raise CorruptEntryError(f"bad lengths: blob {blob_len}, stored {stored_len}")
    if key is not None and tag != key_tag(key):
        raise CorruptEntryError("the file belongs to another entry (key tag mismatch)")
    if file_size is not None and file_size != HEADER_SIZE + stored_len:
        raise CorruptEntryError(
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


class _Sink:
    """Sequential ``pwrite``s to a file descriptor from a position, with a running CRC-32 and byte count."""

    __slots__ = ("crc", "fd", "n", "pos")

    def __init__(self, fd: int, pos: int) -> None:
        self.fd, self.pos, self.crc, self.n = fd, pos, 0, 0

    def write(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        self.crc = zlib.crc32(view, self.crc)
        n = write_all(self.fd, (view,), self.pos)
        self.pos += n
        self.n += n


def write_record(
    fd: int, key: str, enc: codec.Encoded, level: int | None = 1, threads: int = 0, offset: int = 0
) -> int:
    """Write a complete record (header + payload) to ``fd`` at ``offset`` (0: an empty entry file; a pack's end).

    The payload is written first and the header last: its checksums are known only then.

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
    sink = _Sink(fd, offset + HEADER_SIZE)
    if level is None:
        for chunk in enc.chunks(data_crc=False):
            sink.write(chunk)
        flags = 0
    else:
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
    head = pack_header(flags, enc.nbytes, sink.n, sink.crc, key)
    if os.pwrite(fd, head, offset) != HEADER_SIZE:  # pragma: no cover - a 64-byte pwrite is not split
        raise OSError(errno.EIO, "short header write")
    return HEADER_SIZE + sink.n


def _buffer(n: int) -> memoryview:
    """A fresh, writable, uninitialized byte buffer (numpy's allocator: no zero-fill, huge pages when large)."""
    try:
        return np.empty(n, dtype=np.uint8).data
    except (MemoryError, ValueError):
        raise CorruptEntryError(f"cannot allocate {n} bytes for the entry") from None


def _read_exact(fd: int, out: memoryview, offset: int) -> None:
    got = read_into(fd, out, offset)
    if got != out.nbytes:
        raise CorruptEntryError(f"truncated while reading: {got} of {out.nbytes} payload bytes")


def read_blob(
    fd: int, key: str | None = None, offset: int = 0, length: int | None = None, tag: bytes | None = None
) -> tuple[memoryview, int]:
    """Read and check the record in ``fd``; return its codec blob (a fresh, writable buffer) and the record size.

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
        raise CorruptEntryError("not a regular file")
    if length is not None and offset + length > st.st_size:
        raise CorruptEntryError(f"truncated pack: the record ends at {offset + length}, the pack at {st.st_size}")
    head = os.pread(fd, HEADER_SIZE, offset)
    if len(head) < HEADER_SIZE:
        raise CorruptEntryError("empty file" if not head else f"truncated: {len(head)} bytes")
    h = read_header(head, key, st.st_size if length is None else None)
    size = HEADER_SIZE + h["stored_len"]
    if length is not None and size != length:
        raise CorruptEntryError(f"the record has {size} bytes, its index says {length}")
    if tag is not None and h["key_tag"] != tag:
        raise CorruptEntryError("the record belongs to another entry (key tag mismatch)")
    if h["compressed"] and h["stored_len"] >= STREAM_READ_BYTES:
        return _read_streaming(fd, h, offset), size
    view = _buffer(h["stored_len"])
    _read_exact(fd, view, offset + HEADER_SIZE)
    if zlib.crc32(view) != h["crc"]:
        raise CorruptEntryError("payload checksum mismatch")
    if not h["compressed"]:
        return view, size
    out = _buffer(h["blob_len"])
    try:
        with _decompressor().stream_reader(view, read_across_frames=False, closefd=False) as reader:
            pos = _read_all(reader, out)
            extra = reader.read(1)
    except zstd.ZstdError as e:
        raise CorruptEntryError(f"bad zstd payload: {e}") from None
    _check_decompressed(pos, extra, out.nbytes)
    return out, size


def _read_all(reader: Any, out: memoryview) -> int:
    pos = 0
    while pos < out.nbytes:
        n = reader.readinto(out[pos:])
        if not n:
            break
        pos += n
    return pos


def _check_decompressed(got: int, extra: bytes, expected: int) -> None:
    if got != expected or extra:
        got_text = f"more than {got}" if extra else str(got)
        raise CorruptEntryError(f"payload decompresses to {got_text} bytes, expected {expected}")


class _CheckedReader:
    """Reads ``length`` bytes of ``fd`` from ``offset`` in chunks (a zstd stream source), with a running CRC-32."""

    __slots__ = ("crc", "fd", "left", "pos")

    def __init__(self, fd: int, offset: int, length: int) -> None:
        self.fd, self.pos, self.left, self.crc = fd, offset, length, 0

    def read(self, size: int = -1) -> bytes:
        n = self.left if size is None or size < 0 else min(size, self.left)
        data = os.pread(self.fd, n, self.pos) if n else b""
        if n and not data:
            raise CorruptEntryError(f"truncated while reading: {self.left} payload bytes missing")
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
            pos = _read_all(r, out)
            extra = r.read(1)
        _check_decompressed(pos, extra, out.nbytes)
    except zstd.ZstdError as e:
        error = f"bad zstd payload: {e}"
    except CorruptEntryError as e:
        error = str(e)
    src.drain()  # the checksum covers the whole stored payload: a damaged file reports a checksum mismatch
    if src.crc != h["crc"]:
        raise CorruptEntryError("payload checksum mismatch")
    if error is not None:
        raise CorruptEntryError(error)
    return out


def read_entry(path: str, key: str | None = None, allow_pickle: bool = False) -> Any:
    """Read, check and decode one entry file (a helper for tools and tests; the store uses :meth:`DiskStore.get`).

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
    fd = os.open(path, READ_FLAGS)
    try:
        blob, _ = read_blob(fd, key or None)
    finally:
        os.close(fd)
    return codec.decode(blob, allow_pickle=allow_pickle)


# ------------------------------------------------------------------------------------------------ packs
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


def index_header() -> bytes:
    """The 16-byte header that starts every pack index."""
    head = _INDEX_HEAD.pack(INDEX_MAGIC, DISK_FORMAT_VERSION, INDEX_RECORD_SIZE, 0)
    return head[:12] + struct.pack("<I", zlib.crc32(head[:12]))


def index_record(tag: bytes, offset: int, length: int, stamp: int, flags: int = 0) -> bytes:
    """One 48-byte index record: ``tag``'s record is at ``offset`` of the pack, ``length`` bytes, written at
    ``stamp`` (ns since the epoch)."""
    rec = _INDEX_REC.pack(tag, offset, length, stamp, flags, 0)
    return rec[:44] + struct.pack("<I", zlib.crc32(rec[:44]))


class PackedRecord(NamedTuple):
    """Where a packed record is, as an index says."""

    pack: str
    """The pack's file name (no directory)."""
    offset: int
    length: int
    stamp: int
    """Write time, ns since the epoch."""


_Loc = tuple[str, int, int, int]
"""A :class:`PackedRecord`'s fields as a plain tuple, as :class:`PackIndex` passes them around and holds its recent
changes (the rest it keeps in numpy columns): the garbage collector stops tracking a plain tuple of strings and ints,
but tracks a ``NamedTuple`` for ever."""


def supersedes(new: _Loc, old: _Loc | None) -> bool:
    """Whether record ``new`` replaces ``old`` for a key: later in the same pack, else written later.

    Args:
        new: a :class:`PackedRecord`, or its fields as a plain tuple.
        old: the record it may replace (the same), or None.
    """
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
        position after the last record read, torn)``: the position is -1 when the file is not an index (foreign,
        damaged header, unknown version); ``torn`` says that reading stopped at a complete record that failed its
        CRC.

    Raises:
        OSError: the file could not be opened or read.
    """
    fd = os.open(path, READ_FLAGS)
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
    """The pack's index file (``None`` for an entry file)."""
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
    latest: dict[bytes, tuple[StoredEntry, PackedRecord]] = {}
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
            pack = name[: -len(INDEX_SUFFIX)] + PACK_SUFFIX
            for tag, offset, length, stamp, index_pos in records:
                entry = StoredEntry(os.path.join(directory, pack), offset, length, tag, path, index_pos)
                loc = PackedRecord(pack, offset, length, stamp)
                if superseded:
                    yield entry
                elif supersedes(loc, latest[tag][1] if tag in latest else None):
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
    fd = os.open(entry.path, READ_FLAGS)
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
        rec = index_record(entry.tag, entry.offset, entry.length, 0, INDEX_REMOVED)
        if os.pwrite(fd, rec, entry.index_pos) != len(rec):  # pragma: no cover - 48 bytes
            raise OSError(errno.EIO, "short write to a pack index")
    finally:
        os.close(fd)


def _tag_halves(tag: bytes) -> tuple[int, int]:
    """A 16-byte key tag as the two signed 64-bit integers :class:`PackIndex` sorts and searches by."""
    return int.from_bytes(tag[:8], "big", signed=True), int.from_bytes(tag[8:16], "big", signed=True)


class PackIndex:
    """A reader's view of the pack indexes of one directory: key tag -> the record that a read should use.

    Index files are read lazily (every one on the first lookup), then only their new tails, and the directory
    is listed again for new indexes when it changed (at most every :data:`RELIST_SECONDS`). Records found bad
    are remembered and never served again. Thread-safe.

    The records are kept in numpy columns sorted by key tag (44 bytes per entry, searched by bisection), with
    the latest changes in a small dict merged into them in bulk: every DataLoader worker of every rank holds
    one, and a dict of tuples cost 392 bytes per entry in each (19 MiB per worker at 50,000 entries). Nothing
    in them is an object the garbage collector tracks, and a lookup writes to none of their pages, so a forked
    worker shares what its parent had read.

    Args:
        directory: the cache directory.
    """

    __slots__ = ("_bad", "_columns", "_dir_mtime", "_directory", "_listed_at", "_loaded", "_lock", "_pack_ids",
                 "_packs", "_read", "_recent", "_unsure")

    def __init__(self, directory: str) -> None:
        self._directory = directory
        self._lock = threading.Lock()
        self._columns: tuple[np.ndarray, ...] = _empty_columns()  # hi, lo (the tag), pack, offset, length
        # (-1: removed), stamp; sorted by (hi, lo)
        self._recent: dict[bytes, _Loc | None] = {}  # changes since the last merge; None: removed
        self._packs: list[str] = []  # pack names, by the numbers the columns hold
        self._pack_ids: dict[str, int] = {}
        self._read: dict[str, list[int]] = {}  # index name -> [position read up to, size then]
        self._bad: set[tuple[str, int]] = set()  # (pack, offset) of records found bad
        self._loaded = False
        self._dir_mtime = -1
        self._listed_at = -RELIST_SECONDS
        self._unsure = False

    def after_fork(self) -> None:
        """In a forked child: what the parent read stays valid (append-only files); only the lock is new."""
        self._lock = threading.Lock()

    def lookup(self, key: str, refresh: bool = False, fresh: bool = False) -> PackedRecord | None:
        """The packed record of ``key`` as last read; the indexes are read again (new tails only) if it is
        unknown and ``refresh``, or on the first lookup. ``fresh`` also lists the directory for new indexes now,
        however recently it was listed (a process that waited for another to write the entry)."""
        tag = key_tag(key)
        with self._lock:
            loc = self._get(tag)
            if loc is None and (refresh or fresh or not self._loaded):
                with _no_collections():
                    self._refresh_locked(fresh)
                self._loaded = True
                loc = self._get(tag)
        return None if loc is None else PackedRecord._make(loc)

    def add(self, key: str, loc: PackedRecord) -> None:
        """Record that ``key`` was just appended at ``loc`` (by this process)."""
        with self._lock:
            self._set(key_tag(key), (loc.pack, loc.offset, loc.length, loc.stamp))

    def forget(self, key: str, loc: PackedRecord, bad: bool = False) -> None:
        """Stop serving ``loc`` for ``key`` (its pack is gone; or, with ``bad``, the record is damaged: then the
        latest other record of the key that is not known bad takes its place, if there is one)."""
        tag = key_tag(key)
        with self._lock:
            if self._get(tag) == tuple(loc):
                self._set(tag, None)
            if not bad:
                return
            self._bad.add((loc.pack, loc.offset))
            # Another process may have rewritten the key in its own pack, and which of the two records the
            # indexes gave us depends on the order they were read in: look for the latest record that is not
            # known bad (reads every index again; only ever done for a bad record).
            alternative: _Loc | None = None
            for name in sorted(self._read):
                if self._read[name][0] < 0:
                    continue
                try:
                    records, _, _ = read_index(os.path.join(self._directory, name))
                except OSError:
                    continue
                pack = name[: -len(INDEX_SUFFIX)] + PACK_SUFFIX
                for t, offset, length, stamp, _ in records:
                    other = (pack, offset, length, stamp)
                    if t == tag and (pack, offset) not in self._bad and supersedes(other, alternative):
                        alternative = other
            if alternative is not None and self._get(tag) is None:
                self._set(tag, alternative)

    def forget_pack(self, pack: str) -> None:
        """Stop serving every record of ``pack``: its file was found gone (the cache cleared), so they all went."""
        with self._lock:
            self._forget_pack(pack)

    # -- the table: sorted columns and the recent changes --
    def _get(self, tag: bytes) -> _Loc | None:
        if tag in self._recent:
            return self._recent[tag]
        row = self._row(*_tag_halves(tag))
        if row < 0:
            return None
        _hi, _lo, pack, offset, length, stamp = self._columns
        if length.item(row) < 0:
            return None
        return self._packs[pack.item(row)], offset.item(row), length.item(row), stamp.item(row)

    def _row(self, hi: int, lo: int) -> int:
        """The row of the tag ``(hi, lo)`` in the columns, or -1."""
        his, los = self._columns[0], self._columns[1]
        n = len(his)
        row = int(his.searchsorted(hi)) if n else 0
        while row < n and his.item(row) == hi:  # more than one row only if two tags share their first 8 bytes
            if los.item(row) == lo:
                return row
            row += 1
        return -1

    def _set(self, tag: bytes, loc: _Loc | None, merge: bool = True) -> None:
        self._recent[tag] = loc
        if merge:
            self._merge_if_many()

    def _merge_if_many(self) -> None:
        if len(self._recent) >= max(_MERGE_MIN, len(self._columns[0]) // 16):  # amortised: a sort per 1/16 more
            self._merge()

    def _merge(self) -> None:
        """Move the recent changes into the sorted columns (a bulk update, then one sort if keys were added)."""
        if not self._recent:
            return
        changes, self._recent = self._recent, {}
        n = len(changes)
        halves = np.frombuffer(b"".join(changes), dtype=">i8").reshape(n, 2).astype(np.int64)  # as _tag_halves
        hi, lo = halves[:, 0].copy(), halves[:, 1].copy()
        kept = [(self._pack_number(loc[0]), loc[1], loc[2], loc[3]) if loc is not None else (0, 0, -1, 0)
                for loc in changes.values()]
        pack, offset, length, stamp = (np.array(c, dtype) for c, dtype in zip(
            zip(*kept), (np.uint32, np.int64, np.int64, np.int64)))
        given: tuple[np.ndarray, ...] = (hi, lo, pack, offset, length, stamp)
        rows = self._rows(hi, lo)
        known = rows >= 0
        for column, values in zip(self._columns, given):
            column[rows[known]] = values[known]
        new = ~known & (length >= 0)  # a removal of a key that has no row is nothing to keep
        if new.any():
            merged = [np.concatenate([c, v[new]]) for c, v in zip(self._columns, given)]
            order = np.lexsort((merged[1], merged[0]))
            self._columns = tuple(c[order] for c in merged)

    def _rows(self, hi: np.ndarray, lo: np.ndarray) -> np.ndarray:
        """:meth:`_row` of many tags at once."""
        his, los = self._columns[0], self._columns[1]
        if not len(his):
            return np.full(len(hi), -1, np.int64)
        first = np.minimum(np.searchsorted(his, hi), len(his) - 1)  # the first row whose hi is not smaller
        same_hi = his[first] == hi
        rows = np.where(same_hi & (los[first] == lo), first, -1)
        for k in np.flatnonzero(same_hi & (rows < 0)):  # first 8 bytes shared with another tag: look further
            rows[k] = self._row(int(hi[k]), int(lo[k]))
        return rows

    def _pack_number(self, pack: str) -> int:
        number = self._pack_ids.get(pack)
        if number is None:
            number = self._pack_ids[pack] = len(self._packs)
            self._packs.append(pack)
        return number

    def _forget_pack(self, pack: str) -> None:
        """Remove every record of ``pack`` (its files are gone: a new pack may get the name)."""
        self._merge()
        number = self._pack_ids.get(pack)
        if number is not None:
            self._columns[4][self._columns[2] == number] = -1

    def _refresh_locked(self, fresh: bool = False) -> None:
        now = time.monotonic()
        try:
            mtime = os.stat(self._directory).st_mtime_ns
        except OSError:
            return
        # New index files change the directory's mtime. A listing made within the timestamp granularity of
        # the last change may miss a file created in the same tick: list again next time then.
        if fresh or (now - self._listed_at >= RELIST_SECONDS and (mtime != self._dir_mtime or self._unsure)):
            self._dir_mtime, self._listed_at = mtime, now
            self._unsure = time.time_ns() - mtime < 2_000_000_000
            try:
                with os.scandir(self._directory) as it:
                    for entry in it:
                        name = entry.name
                        if name not in self._read and name.endswith(INDEX_SUFFIX) and is_pack_file(name):
                            self._read[name] = [0, -1]
            except OSError:
                return
        for name, state in list(self._read.items()):
            pos, seen = state
            if pos < 0:
                continue  # not an index (foreign or damaged header)
            path = os.path.join(self._directory, name)
            try:
                size = os.stat(path, follow_symlinks=False).st_size
            except FileNotFoundError:  # cleared: forget its records (a new pack may get the name)
                del self._read[name]
                self._forget_pack(name[: -len(INDEX_SUFFIX)] + PACK_SUFFIX)
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
                if (pack, offset) not in self._bad and supersedes(loc, self._get(tag)):
                    self._set(tag, loc, merge=False)  # (the columns stay as they are while a refresh reads)
        self._merge_if_many()


_MERGE_MIN = 64  # recent changes kept as a dict before they are merged into PackIndex's columns


@contextlib.contextmanager
def _no_collections() -> Iterator[None]:
    """No garbage collection while a reader reads the indexes. Reading every index makes a tuple or two per record,
    freed once the records are in the columns; a collection meanwhile would find tens of thousands of them alive,
    move them to the oldest generation and so start a full collection, which in a forked DataLoader worker writes
    to every object the worker inherited and copies those pages (about a rank's size per worker, measured)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _empty_columns() -> tuple[np.ndarray, ...]:
    return (np.empty(0, np.int64), np.empty(0, np.int64), np.empty(0, np.uint32), np.empty(0, np.int64),
            np.empty(0, np.int64), np.empty(0, np.int64))


# ------------------------------------------------------------------------------------ directory tools
def _is_temp_file(name: str) -> bool:
    return temp_owner(name) is not None


def summarize(directory: str) -> dict[str, Any]:
    """Describe a disk cache directory from its record headers (nothing is decoded).

    Args:
        directory: a ``PersistentDataset`` ``cache_dir``.

    Returns:
        ``path``, ``entries`` (entry files with a valid header, plus packed records with one: the record each
        key's latest index record points to), ``packed`` (of which in packs), ``packs`` (pack files),
        ``bytes`` (size of the entry files, packs and pack indexes), ``bytes_on_disk`` (allocated blocks),
        ``blob_bytes`` (the encoded items, uncompressed), ``compression_ratio`` (``blob_bytes / bytes``),
        ``compressed`` (entries stored with zstd), ``format_versions`` and ``codec_versions``
        (``{version: count}``), ``reader_format_version``, ``bad_headers`` (entry files or packed records whose
        header does not read), ``temp_files`` (writes in progress or left by killed writers), ``other_files``
        (not ours, e.g. MONAI's ``.pt``; never opened) and ``hits`` (``None``: hit counters live in the
        training processes).

    Raises:
        NotADirectoryError: ``directory`` is not a directory.
    """
    if not os.path.isdir(directory):
        raise NotADirectoryError(f"{directory!r} is not a directory")
    info: dict[str, Any] = {
        "path": os.path.abspath(directory),
        "entries": 0,
        "packed": 0,
        "packs": 0,
        "bytes": 0,
        "bytes_on_disk": 0,
        "blob_bytes": 0,
        "compression_ratio": 0.0,
        "compressed": 0,
        "format_versions": {},
        "codec_versions": {},
        "reader_format_version": DISK_FORMAT_VERSION,
        "bad_headers": 0,
        "temp_files": 0,
        "other_files": 0,
        "hits": None,
    }

    def count_record(h: dict) -> None:
        info["entries"] += 1
        info["blob_bytes"] += h["blob_len"]
        info["compressed"] += int(h["compressed"])
        for field, version in (("format_versions", h["version"]), ("codec_versions", h["codec_version"])):
            info[field][str(version)] = info[field].get(str(version), 0) + 1

    with os.scandir(directory) as it:
        for entry in it:
            name = entry.name
            if not entry.is_file(follow_symlinks=False):
                continue
            if _is_temp_file(name):
                info["temp_files"] += 1
                continue
            if name == LOCKS_NAME:
                continue
            if is_pack_file(name):  # its records are counted below, from the indexes
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                info["bytes"] += st.st_size
                info["bytes_on_disk"] += st.st_blocks * 512
                info["packs"] += int(name.endswith(PACK_SUFFIX))
                continue
            if name.startswith(".") or not name.endswith(ENTRY_SUFFIX):
                info["other_files"] += 1
                continue
            try:
                st = entry.stat(follow_symlinks=False)
                with open(entry.path, "rb") as f:
                    head = f.read(HEADER_SIZE)
                h = read_header(head, None, st.st_size)
            except (OSError, CorruptEntryError):
                info["bad_headers"] += 1
                continue
            info["bytes"] += st.st_size
            info["bytes_on_disk"] += st.st_blocks * 512
            count_record(h)
    fds: dict[str, int] = {}
    try:
        for rec in stored_entries(directory):
            if rec.tag is None:
                continue  # entry files: counted above
            try:
                if rec.path not in fds:
                    fds[rec.path] = os.open(rec.path, READ_FLAGS)
                h = read_header(os.pread(fds[rec.path], HEADER_SIZE, rec.offset))
                if HEADER_SIZE + h["stored_len"] != rec.length or h["key_tag"] != rec.tag:
                    raise CorruptEntryError("record does not match its index")
            except (OSError, CorruptEntryError):
                info["bad_headers"] += 1
                continue
            info["packed"] += 1
            count_record(h)
    finally:
        for fd in fds.values():
            os.close(fd)
    if info["bytes"]:
        info["compression_ratio"] = info["blob_bytes"] / info["bytes"]
    return info


def clear(directory: str) -> dict[str, Any]:
    """Remove monai_cache's files from a disk cache directory, and the directory if it is then empty.

    Only entry files (``*.mcache`` starting with the disk magic number), packs and their indexes
    (``pack.<host>.<pid>.<n>.mcpack`` / ``.mcidx``, empty or starting with our magic numbers) and our temporary
    files (``.<label>.<host>.<pid>.<kind><n>.tmp``) are removed; anything else (MONAI's ``.pt`` files, the user's
    own files) is left alone.

    Args:
        directory: a ``PersistentDataset`` ``cache_dir``.

    Returns:
        ``{"path", "removed", "bytes", "kept", "removed_dir"}``.

    Raises:
        NotADirectoryError: ``directory`` is not a directory.
    """
    if not os.path.isdir(directory):
        raise NotADirectoryError(f"{directory!r} is not a directory")
    removed = kept = nbytes = 0
    with os.scandir(directory) as it:
        entries = list(it)
    for entry in entries:
        name = entry.name
        if not entry.is_file(follow_symlinks=False):
            kept += 1
            continue
        magic = None
        if _is_temp_file(name) or name == LOCKS_NAME:
            ours = True
        elif not name.startswith(".") and name.endswith(ENTRY_SUFFIX):
            magic, whole = DISK_MAGIC, True
        elif is_pack_file(name):
            magic, whole = (INDEX_MAGIC if name.endswith(INDEX_SUFFIX) else DISK_MAGIC), False
        else:
            ours = False
        if magic is not None:
            try:
                with open(entry.path, "rb") as f:
                    head = f.read(len(magic))
            except OSError:
                head = None
            # a pack or index empty or torn at creation (a killed writer) counts as ours
            ours = head is not None and (head == magic if whole else magic.startswith(head))
        if not ours:
            kept += 1
            continue
        try:
            size = entry.stat(follow_symlinks=False).st_size
            os.unlink(entry.path)
        except FileNotFoundError:
            continue
        removed += 1
        nbytes += size
    removed_dir = False
    if kept == 0:
        with contextlib.suppress(OSError):
            os.rmdir(directory)
            removed_dir = True
    return {"path": os.path.abspath(directory), "removed": removed, "bytes": nbytes, "kept": kept,
            "removed_dir": removed_dir}


def verify(directory: str, remove: bool = False, allow_pickle: bool = False) -> dict[str, Any]:
    """Read, check (header and payload checksums, key tag, lengths) and decode every entry of a disk cache:
    every entry file, and every record that a pack index points to (superseded ones included).

    Args:
        directory: a ``PersistentDataset`` ``cache_dir``.
        remove: delete the bad entry files, and mark bad packed records removed in their pack's index (their
            bytes stay in the pack, which other entries share; the items are appended anew when next used).
        allow_pickle: decode pickled values too; without it their checksums are checked but they are not decoded.

    Returns:
        ``{"path", "checked", "ok", "bad": [{"file", "error", "removed"}], "not_decoded"}`` (``not_decoded``:
        entries holding pickled values, checksums fine; ``file`` of a packed record: ``<pack name>@<offset>``).

    Raises:
        NotADirectoryError: ``directory`` is not a directory.
    """
    if not os.path.isdir(directory):
        raise NotADirectoryError(f"{directory!r} is not a directory")
    ok = not_decoded = 0
    bad: list[dict[str, Any]] = []
    for rec in list(stored_entries(directory, superseded=True)):
        name = os.path.basename(rec.path) + (f"@{rec.offset}" if rec.packed else "")
        try:
            if rec.packed:
                read_packed(rec, allow_pickle=allow_pickle)
            else:
                read_entry(rec.path, allow_pickle=allow_pickle)
            ok += 1
            continue
        except FileNotFoundError:
            continue  # removed meanwhile (another clear, a reset)
        except CorruptEntryError as e:
            if not allow_pickle and "allow_pickle" in str(e):
                not_decoded += 1
                ok += 1
                continue
            error = str(e)
        except OSError as e:
            error = f"cannot read: {e.strerror or e}"
        except Exception as e:  # a decoder bug must not stop the scan
            error = f"{type(e).__name__}: {e}"
        removed = False
        if remove:
            try:
                if rec.packed:
                    remove_packed(rec)
                else:
                    os.unlink(rec.path)
                removed = True
            except OSError:
                pass
        bad.append({"file": name, "error": error, "removed": removed})
    return {"path": os.path.abspath(directory), "checked": ok + len(bad), "ok": ok, "bad": bad,
            "not_decoded": not_decoded}
