"""The disk store: file format, integrity checks, atomic and asynchronous writes, real failures.

Everything here uses real files, real processes (forked, SIGKILLed), real mounts (a tiny and a read-only
tmpfs, skipped where mounting is not permitted). Nothing is mocked; the only patching slows writes down.

Tests about the entry file itself (its format, damaged files, renames, races between renames) give every
entry its own file (``pack_limit=0``, or items above ``PACK_LIMIT``); ``tests/test_disk_pack.py`` checks
the same properties for records packed into shared files, which is where small items go by default.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import multiprocessing
import os
import random
import signal
import struct
import subprocess
import textwrap
import threading
import time
import warnings
import zlib

import numpy as np
import pytest
import torch
import zstandard
from helpers import (  # noqa: F401 (an autouse fixture)
    assert_same,
    mounted_tmpfs,
    one_torch_thread,
    open_for_writing,
    python_c,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from monai_cache import codec, disk, disk_format, disk_writer, runtime
from monai_cache.disk import MISSING, DiskStore
from monai_cache.disk_format import HEADER_SIZE, INDEX_RECORD_SIZE, read_entry, read_header

FORK = multiprocessing.get_context("fork")


# ---------------------------------------------------------------------------------------------- helpers
def item_for(key: str, nbytes: int = 64 << 10) -> dict:
    """A deterministic item for ``key``: a compressible image, a label map, metadata."""
    seed = int(hashlib.sha256(key.encode()).hexdigest()[:8], 16)
    g = torch.Generator().manual_seed(seed)
    n = max(nbytes // 8, 16)
    image = torch.zeros(n)
    image[: n // 3] = torch.rand(n // 3, generator=g)
    label = (torch.rand(n, generator=g) > 0.7).float()
    return {"image": image, "label": label, "key": key, "seed": seed, "spacing": (1.5, 1.5, 2.0)}


def read_back(directory, key: str, nbytes: int = 64 << 10) -> None:
    """A fresh store (as another process would open it) serves ``key``, equal to ``item_for(key, nbytes)``."""
    got = DiskStore(directory, writable=False).get(key)
    assert got is not MISSING, key
    assert_same(got, item_for(key, nbytes))


def monai_cache_warnings(records) -> list[str]:
    return [str(w.message) for w in records if "monai_cache" in str(w.message)]


class SlowWrites:
    """Slow down :func:`monai_cache.disk_writer.write_record` (the file write itself) by ``delay`` seconds."""

    def __init__(self, monkeypatch, delay: float) -> None:
        original = disk_writer.write_record

        def slow(*args, **kwargs):
            time.sleep(delay)
            return original(*args, **kwargs)

        monkeypatch.setattr(disk_writer, "write_record", slow)


class GatedWrites:
    """Hold every :func:`monai_cache.disk_writer.write_record` (the file write itself) until :meth:`open`: a call that
    returns before then returned while its write was pending. A write held ``hang_guard`` seconds goes on anyway
    (a store that wrongly waits for its writes then fails its test rather than hanging it)."""

    def __init__(self, monkeypatch, hang_guard: float = 20.0) -> None:
        self.gate = threading.Event()
        original = disk_writer.write_record

        def gated(*args, **kwargs):
            self.gate.wait(hang_guard)
            return original(*args, **kwargs)

        monkeypatch.setattr(disk_writer, "write_record", gated)

    def open(self) -> None:
        self.gate.set()


# ---------------------------------------------------------------------------------------------- format
@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("compression", ["zstd", None])
@pytest.mark.parametrize("async_writes", [True, False])
def test_roundtrip_modes_and_permissions(tmp_path, compression, async_writes, packed):
    limit = disk_format.PACK_LIMIT if packed else 0
    store = DiskStore(tmp_path, compression=compression, async_writes=async_writes, pack_limit=limit)
    item = item_for("a")
    item["meta"] = {"affine": np.diag([1.5, 1.5, 2.0, 1.0]), "name": "x.nii.gz", "n": np.int64(3)}
    store.put("a", item)
    assert store.flush(10)
    loc = store.location("a")
    assert loc is not None and loc.packed == packed
    path = loc.path
    assert path == store.path("a") or packed
    for name in os.listdir(tmp_path):  # entry file, or pack and its index
        assert oct(os.stat(tmp_path / name).st_mode & 0o777) == "0o600"
    got = store.get("a")
    assert torch.equal(got["image"], item["image"]) and got["image"].dtype == torch.float32
    assert torch.equal(got["label"], item["label"]) and got["label"].dtype == torch.float32
    np.testing.assert_array_equal(got["meta"]["affine"], item["meta"]["affine"])
    assert got["meta"]["name"] == "x.nii.gz" and got["spacing"] == (1.5, 1.5, 2.0)
    got["image"].add_(1)  # decoded tensors are writable views of a private buffer
    assert torch.equal(store.get("a")["image"], item["image"])
    s = store.stats()["process"]
    assert s["writes"] == 1 and s["hits"] == 2
    assert s["bytes_written"] == os.path.getsize(path) + (INDEX_RECORD_SIZE if packed else 0)
    assert s["bytes_encoded"] < s["bytes_raw"]  # the float32 label map was stored as uint8
    if compression:
        assert s["compression_ratio"] > 2


def test_format_matches_the_documented_spec(tmp_path):
    """Read a file with nothing but struct, zlib and zstandard, as docs/disk-format.md describes."""
    store = DiskStore(tmp_path, async_writes=False, compression_level=3, pack_limit=0)
    item = item_for("spec")
    store.put("spec", item)
    raw = open(store.path("spec"), "rb").read()
    magic, version, hsize, flags, blob_len, stored_len, crc, codec_version, tag, reserved, hcrc = struct.unpack(
        "<8sHHIQQII16sII", raw[:64]
    )
    assert (magic, version, hsize, flags, reserved) == (b"MCDISK\r\n", 2, 64, 1, 0)
    assert hcrc == zlib.crc32(raw[:60])
    assert tag == hashlib.sha256(b"spec").digest()[:16]
    assert stored_len == len(raw) - 64 and crc == zlib.crc32(raw[64:])
    blob = zstandard.ZstdDecompressor().decompress(raw[64:], max_output_size=blob_len)
    assert len(blob) == blob_len
    # the codec blob: 40-byte prefix, JSON header, aligned buffers
    cmagic, cversion, _, hlen, total, hcrc2, _ = struct.unpack("<8sIIQQII", blob[:40])
    assert cmagic == b"MCACHE\x00\x01" and cversion == codec_version == codec.FORMAT_VERSION and total == blob_len
    assert zlib.crc32(blob[40 : 40 + hlen]) == hcrc2
    header = json.loads(blob[40 : 40 + hlen])
    root = header["root"]
    assert root["~"] == "d"
    keys = root["k"]
    image_node = root["v"][keys.index("image")]
    assert image_node["~"] == "T" and image_node["dt"] == "float32"
    label_node = root["v"][keys.index("label")]
    assert label_node["sd"] == "uint8"  # stored downcast, restored to float32
    off, n = header["buffers"][label_node["b"]]
    data_start = (40 + hlen + 63) // 64 * 64
    stored_label = np.frombuffer(blob, np.uint8, count=n, offset=data_start + off)
    np.testing.assert_array_equal(stored_label.astype(np.float32), item["label"].numpy())
    assert read_header(raw[:64], "spec", len(raw))["compressed"]


# ---------------------------------------------------------------------------------------- integrity
def _corrupt(path: str, kind: str) -> None:
    raw = bytearray(open(path, "rb").read())
    if kind == "truncated-header":
        raw = raw[:30]
    elif kind == "truncated-payload":
        raw = raw[: len(raw) // 2]
    elif kind == "zero-length":
        raw = bytearray()
    elif kind == "flip-header":
        raw[20] ^= 0x04  # blob length
    elif kind == "flip-header-crc":
        raw[61] ^= 0x80
    elif kind == "flip-payload":
        raw[HEADER_SIZE + (len(raw) - HEADER_SIZE) // 2] ^= 0x01
    elif kind == "extended":
        raw += b"\0" * 10
    elif kind == "foreign-random":
        raw = bytearray(random.Random(0).randbytes(5000))
    elif kind == "foreign-gzip":
        import gzip

        raw = bytearray(gzip.compress(b"not a cache entry" * 100))
    elif kind == "foreign-pickle":
        import pickle

        raw = bytearray(pickle.dumps({"image": [1, 2, 3]}))
    with open(path, "wb") as f:
        f.write(raw)


CORRUPTIONS = [
    "truncated-header", "truncated-payload", "zero-length", "flip-header", "flip-header-crc", "flip-payload",
    "extended", "foreign-random", "foreign-gzip", "foreign-pickle",
]


@pytest.mark.parametrize("kind", CORRUPTIONS)
@pytest.mark.parametrize("compression", ["zstd", None])
def test_corrupt_file_reported_once_removed_and_rewritable(tmp_path, kind, compression):
    store = DiskStore(tmp_path, async_writes=False, compression=compression, pack_limit=0)
    item = item_for("k")
    store.put("k", item)
    _corrupt(store.path("k"), kind)
    with pytest.raises(codec.CorruptEntryError):
        read_entry(store.path("k"))
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        assert store.get("k") is MISSING
        assert store.get("k") is MISSING  # now simply missing: no second report
    msgs = monai_cache_warnings(rec)
    assert len(msgs) == 1 and "corrupt disk cache file" in msgs[0] and "removed" in msgs[0], msgs
    assert not os.path.exists(store.path("k"))
    assert [n for n in os.listdir(tmp_path)] == []  # nothing left aside
    assert store.stats()["process"]["corrupt"] == 1
    store.put("k", item)
    assert_same(store.get("k"), item)


def test_corrupt_file_a_reader_cannot_remove_is_reported_once(tmp_path):
    """A store that may not write (``writable=False``) leaves a bad file where it is and finds it bad on every read:
    it says so once per entry and process, counts each detection, and serves a miss each time."""
    DiskStore(tmp_path, async_writes=False, pack_limit=0).put("k", item_for("k"))
    reader = DiskStore(tmp_path, writable=False)
    path = reader.path("k")
    _corrupt(path, "flip-payload")
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for _ in range(3):
            assert reader.get("k") is MISSING
    msgs = monai_cache_warnings(rec)
    assert len(msgs) == 1 and "corrupt disk cache file" in msgs[0] and "could not be removed" in msgs[0], msgs
    assert os.path.exists(path)
    assert reader.stats()["process"]["corrupt"] == 3


def test_file_under_another_key_is_rejected(tmp_path):
    store = DiskStore(tmp_path, async_writes=False, pack_limit=0)
    store.put("a", item_for("a"))
    os.link(store.path("a"), store.path("b"))  # a valid file, but for another entry
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        assert store.get("b") is MISSING
    assert "key tag mismatch" in monai_cache_warnings(rec)[0]
    assert_same(store.get("a"), item_for("a"))


def test_symlink_at_entry_name_is_not_followed(tmp_path):
    store = DiskStore(tmp_path, async_writes=False, pack_limit=0)
    store.put("a", item_for("a"))
    os.symlink(store.path("a"), store.path("b"))
    with pytest.warns(RuntimeWarning, match="symbolic link"):
        assert store.get("b") is MISSING
    assert not os.path.lexists(store.path("b")) and os.path.exists(store.path("a"))


@pytest.mark.parametrize("compression", ["zstd", None])
def test_every_single_bit_flip_is_detected(tmp_path, compression):
    """Exhaustive: flipping any one bit of a (small) file makes it rejected, never decoded wrongly."""
    store = DiskStore(tmp_path, async_writes=False, compression=compression, pack_limit=0)
    store.put("k", {"x": torch.arange(40, dtype=torch.int16), "s": "abc"})
    raw = open(store.path("k"), "rb").read()
    fd = os.open(store.path("k"), os.O_RDWR)
    try:
        undetected = []
        for byte in range(len(raw)):
            for bit in range(8):
                os.pwrite(fd, bytes([raw[byte] ^ (1 << bit)]), byte)
                try:
                    disk_format.read_blob(fd, "k")
                    undetected.append((byte, bit))
                except codec.CorruptEntryError:
                    pass
                os.pwrite(fd, raw[byte : byte + 1], byte)
    finally:
        os.close(fd)
    assert undetected == []
    assert len(raw) > 100


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_damaged_files_never_raise_anything_but_corrupt(tmp_path, data):
    """Random edits of a valid file (and random files) are rejected or decode to the original item."""
    compression = data.draw(st.sampled_from(["zstd", None]))
    where = tmp_path / str(compression)  # the examples share tmp_path: one valid file per compression
    where.mkdir(exist_ok=True)
    path = str(where / "k.mcache")
    store = DiskStore(where, async_writes=False, compression=compression, pack_limit=0)
    if not os.path.exists(path):
        store.put("k", {"x": torch.arange(64, dtype=torch.float32) / 7, "n": 1})
    raw = bytearray(open(path, "rb").read())
    mode = data.draw(st.sampled_from(["random", "edit", "truncate"]))
    if mode == "random":
        bad = bytearray(data.draw(st.binary(max_size=400)))
        if data.draw(st.booleans()) and len(bad) >= 8:
            bad[:8] = disk_format.DISK_MAGIC
    elif mode == "edit":
        bad = bytearray(raw)
        for _ in range(data.draw(st.integers(1, 6))):
            i = data.draw(st.integers(0, len(bad) - 1))
            bad[i] = data.draw(st.integers(0, 255))
    else:
        bad = raw[: data.draw(st.integers(0, len(raw) - 1))]
    with open(path + ".bad", "wb") as f:
        f.write(bad)
    try:
        got = read_entry(path + ".bad", key="k")
    except codec.CorruptEntryError:
        return
    finally:
        os.unlink(path + ".bad")
    assert bytes(bad) == bytes(raw)  # only an unchanged file may decode
    assert torch.equal(got["x"], torch.arange(64, dtype=torch.float32) / 7)


def test_planted_pickle_entry_is_never_unpickled(tmp_path):
    """A well-formed entry holding a pickled value (allow_pickle=True) is refused by a default store."""
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    writer = DiskStore(tmp_path, async_writes=False, allow_pickle=True, pack_limit=0)
    writer.put("k", {"image": torch.zeros(4), "evil": Evil()})
    assert os.path.exists(writer.path("k")) and not marker.exists()
    reader = DiskStore(tmp_path, async_writes=False)
    with pytest.warns(RuntimeWarning, match="allow_pickle is False"):
        assert reader.get("k") is MISSING
    assert not marker.exists()


def test_unsupported_value_is_reported_once_and_not_cached(tmp_path):
    store = DiskStore(tmp_path, async_writes=False)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for key in ("a", "b"):
            store.put(key, {"image": torch.zeros(3), "obj": object()})
    msgs = monai_cache_warnings(rec)
    assert len(msgs) == 1 and "item['obj']" in msgs[0] and "allow_pickle" in msgs[0], msgs
    assert os.listdir(tmp_path) == [] and store.stats()["process"]["unsupported"] == 2


# --------------------------------------------------------------------------------------------- async
def test_put_returns_before_the_write_and_flush_waits(tmp_path, monkeypatch):
    gate = GatedWrites(monkeypatch)
    store = DiskStore(tmp_path)
    item = item_for("a")
    store.put("a", item)
    assert store.stats()["process"]["writes_pending"] == 1  # put returned with its write held
    item["image"].fill_(7)  # the caller changes its item in place: the writer has its own copy
    pending = store.get("a")  # served from memory while pending, as a private copy
    assert not torch.equal(pending["image"], item["image"])
    assert_same(pending, item_for("a"))  # and exactly what a read of the file will give
    pending["image"].fill_(9)
    assert not store.flush(0.05)  # the write is still held: flush says it did not complete
    gate.open()
    assert store.flush(10)
    assert store.stats()["process"]["writes_pending"] == 0
    assert_same(store.get("a"), item_for("a"))


def test_bounded_queue_applies_back_pressure(tmp_path, monkeypatch):
    gate = GatedWrites(monkeypatch)
    store = DiskStore(tmp_path, max_pending_writes=2, max_pending_bytes="10MiB")
    seen = []

    def put_six():
        for i in range(6):
            store.put(f"k{i}", item_for(f"k{i}"))
            seen.append(store.stats()["process"]["writes_pending"])

    caller = threading.Thread(target=put_six, daemon=True)
    caller.start()
    caller.join(0.3)  # time enough for six puts that do not wait
    # with every write held, the caller is stuck in a put: the one after the queue's two (the writer holds one)
    assert caller.is_alive() and len(seen) <= 3, seen
    gate.open()
    caller.join(30)
    assert not caller.is_alive() and len(seen) == 6 and max(seen) <= 2, seen
    assert store.flush(10) and len(list(store.entries())) == 6
    # by bytes: one 256 KiB item fits a 300 KB budget, two do not
    (tmp_path / "b").mkdir()
    store2 = DiskStore(tmp_path / "b", max_pending_bytes=300_000)
    for i in range(3):
        store2.put(f"k{i}", item_for(f"k{i}", 256 << 10))
        assert store2.stats()["process"]["writes_pending"] <= 1
    assert store2.flush(10)


def _child_puts_then_returns(directory: str, keys: list[str]) -> None:
    torch.set_num_threads(1)  # as in DataLoader workers: OpenMP pools do not survive fork
    original = disk_writer.write_record

    def slow(*args, **kwargs):
        time.sleep(0.2)
        return original(*args, **kwargs)

    disk_writer.write_record = slow
    store = DiskStore(directory)
    for key in keys:
        store.put(key, item_for(key))
    # return without flushing: multiprocessing's exit path must flush (DataLoader workers exit this way)


def test_pending_writes_flushed_when_a_multiprocessing_child_exits(tmp_path):
    p = FORK.Process(target=_child_puts_then_returns, args=(str(tmp_path), ["a", "b", "c"]))
    p.start()
    p.join(30)
    assert p.exitcode == 0
    for key in "abc":
        read_back(tmp_path, key)


def test_pending_writes_flushed_when_the_main_process_exits(tmp_path):
    script = textwrap.dedent(
        f"""
        import sys, time
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from monai_cache import disk, disk_writer
        from test_disk import item_for
        original = disk_writer.write_record
        def slow(*a, **k):
            time.sleep(0.3)
            return original(*a, **k)
        disk_writer.write_record = slow
        store = disk.DiskStore({str(tmp_path)!r})
        for key in ("a", "b"):
            store.put(key, item_for(key))
        print(store.stats()["process"]["writes_pending"])
        """
    )
    r = subprocess.run(python_c(script), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "2"  # still pending when the script ended
    for key in "ab":
        read_back(tmp_path, key)


def _child_after_fork(directory: str, q) -> None:
    torch.set_num_threads(1)  # as in DataLoader workers: OpenMP pools do not survive fork
    store = _FORKED_STORE
    store.put("child", item_for("child"))
    q.put((store.flush(10), store.stats()))


_FORKED_STORE: DiskStore | None = None


def test_writer_is_recreated_in_a_forked_child_and_counters_are_shared(tmp_path, monkeypatch):
    global _FORKED_STORE
    SlowWrites(monkeypatch, 0.3)
    store = _FORKED_STORE = DiskStore(tmp_path)
    store.put("parent", item_for("parent"))  # the parent's writer thread is busy while we fork
    q = FORK.Queue()
    p = FORK.Process(target=_child_after_fork, args=(str(tmp_path), q))
    p.start()
    flushed, child_stats = q.get(timeout=30)
    p.join(30)
    assert flushed and p.exitcode == 0
    assert child_stats["process"]["writes"] == 1  # the child wrote its own item, not the parent's pending one
    assert store.flush(10)
    for key in ("child", "parent"):
        read_back(tmp_path, key)
    # each process appended to a pack of its own (the child never appends to its parent's)
    assert len(list(store.entries())) == 2 and sum(n.endswith(".mcpack") for n in os.listdir(tmp_path)) == 2
    total = store.stats()["total"]
    assert total["writes"] == 2 and store.stats()["process"]["writes"] == 1
    _FORKED_STORE = None


# ---------------------------------------------------------------------------------- crashes and races
def _writer_forever(directory: str, start: int) -> None:
    torch.set_num_threads(1)  # as in DataLoader workers: OpenMP pools do not survive fork
    store = DiskStore(directory, max_pending_writes=4)
    i = start
    while True:
        key = f"w{i:05d}"
        store.put(key, item_for(key, 512 << 10))
        i += 1


def test_sigkill_at_random_moments_never_leaves_a_readable_partial_file(tmp_path):
    rng = random.Random(1234)
    start = 0
    kills = in_write = 0
    # At least 8 kills, and go on (up to 40) until some kill has landed inside a write: on a loaded
    # machine a kill can keep landing between writes, and then the test would prove nothing.
    while kills < 8 or (in_write == 0 and kills < 40):
        before = len(os.listdir(tmp_path))
        p = FORK.Process(target=_writer_forever, args=(str(tmp_path), start))
        p.start()
        deadline = time.monotonic() + 30
        while len(os.listdir(tmp_path)) == before and time.monotonic() < deadline:
            time.sleep(0.005)  # wait until this writer is writing, however slow its start
        time.sleep(rng.uniform(0.0, 0.3))
        os.kill(p.pid, signal.SIGSTOP)  # look at what it holds at the moment it dies
        in_write += open_for_writing(p.pid, tmp_path) > 0
        os.kill(p.pid, signal.SIGKILL)
        p.join(10)
        assert p.exitcode == -signal.SIGKILL
        kills += 1
        start += 1000
    entries = [n for n in os.listdir(tmp_path) if n.endswith(".mcache")]
    assert entries, "the writer never completed a file"
    assert in_write > 0, "no kill landed during a write (the test did not exercise the hazard)"
    for name in entries:  # every file under a final name is complete and holds its own item
        key = name[: -len(".mcache")]
        assert_same(read_entry(os.path.join(tmp_path, name)), item_for(key, 512 << 10))
    assert len(runtime.sweep_temp_files(str(tmp_path))) > 0  # the killed writers' temporary files are reclaimed
    assert all(n.endswith(".mcache") for n in os.listdir(tmp_path))


def _race_writer(directory: str, keys: list[str], rounds: int) -> None:
    torch.set_num_threads(1)  # as in DataLoader workers: OpenMP pools do not survive fork
    store = DiskStore(directory, async_writes=False, pack_limit=0)  # races between renames of entry files
    for _ in range(rounds):
        for key in keys:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(store.path(key))  # force a rewrite, racing with the other writer
            store.put(key, item_for(key, 256 << 10))


def _race_reader(directory: str, keys: list[str], stop, result) -> None:
    torch.set_num_threads(1)  # as in DataLoader workers: OpenMP pools do not survive fork
    bad = good = 0
    while not stop.is_set():
        for key in keys:
            try:
                assert_same(read_entry(os.path.join(directory, key + ".mcache")), item_for(key, 256 << 10))
                good += 1
            except FileNotFoundError:
                pass
            except (codec.CorruptEntryError, AssertionError):
                bad += 1
    result.put((good, bad))


def test_two_processes_writing_the_same_items_leave_one_valid_file(tmp_path):
    keys = ["x", "y", "z"]
    stop, result = FORK.Event(), FORK.Queue()
    reader = FORK.Process(target=_race_reader, args=(str(tmp_path), keys, stop, result))
    reader.start()
    writers = [FORK.Process(target=_race_writer, args=(str(tmp_path), keys, 25)) for _ in range(2)]
    for w in writers:
        w.start()
    for w in writers:
        w.join(60)
        assert w.exitcode == 0
    stop.set()
    good, bad = result.get(timeout=30)
    reader.join(10)
    assert bad == 0 and good > 0
    assert sorted(os.listdir(tmp_path)) == ["x.mcache", "y.mcache", "z.mcache"]


# ------------------------------------------------------------------------------------- real failures
def test_prepare_cache_dir(tmp_path):
    new = tmp_path / "a" / "b"
    assert disk.prepare_cache_dir(new) is None
    assert oct(os.stat(new).st_mode & 0o777) == "0o700"
    afile = tmp_path / "file"
    afile.write_text("x")
    with pytest.raises(ValueError, match="is not a directory"):
        disk.prepare_cache_dir(afile)
    reason = disk.prepare_cache_dir(afile / "sub")  # a file where a parent directory is expected
    assert reason is not None and "cannot create" in reason


def test_disk_full_gives_one_warning_and_stops_writing(tmp_path):
    with mounted_tmpfs(str(tmp_path / "mnt"), "size=1m") as mnt:
        store = DiskStore(mnt, compression=None, async_writes=True)
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            for i in range(6):  # 6 x 300 KB does not fit in 1 MiB
                store.put(f"k{i}", {"x": torch.rand(75_000)})
            store.flush(10)
        msgs = monai_cache_warnings(rec)
        assert len(msgs) == 1 and "is full" in msgs[0], msgs
        s = store.stats()["process"]
        assert s["writes"] >= 1 and s["write_errors"] == 1 and store.writes_disabled
        names = os.listdir(mnt)
        assert all(n.endswith(".mcache") for n in names)  # no temporary file left behind
        for n in names:
            read_entry(os.path.join(mnt, n))


def test_read_only_directory(tmp_path):
    with mounted_tmpfs(str(tmp_path / "ro"), "size=1m,ro") as ro:
        reason = disk.prepare_cache_dir(ro)
        assert reason is not None and "Read-only file system" in reason
        store = DiskStore(ro, async_writes=False)
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            store.put("a", item_for("a"))
            store.put("b", item_for("b"))
        msgs = monai_cache_warnings(rec)
        assert len(msgs) == 1 and "cannot write" in msgs[0], msgs
        assert store.get("a") is MISSING


def test_sweep_keeps_live_writers_temp_files(tmp_path):
    live = tmp_path / f".k.{runtime.HOST_TAG}.{os.getpid()}.w0.tmp"
    dead_pid = FORK.Process(target=int)
    dead_pid.start()
    dead_pid.join()
    dead = tmp_path / f".k.{runtime.HOST_TAG}.{dead_pid.pid}.w0.tmp"
    other_host = tmp_path / f".k.deadbeef.{dead_pid.pid}.w0.tmp"
    for p in (live, dead, other_host):
        p.write_bytes(b"partial")
    assert [path for path, _size in runtime.sweep_temp_files(str(tmp_path))] == [str(dead)]
    assert live.exists() and other_host.exists() and not dead.exists()
    old = time.time() - 2 * runtime.STALE_TMP_SECONDS
    os.utime(other_host, (old, old))
    assert len(runtime.sweep_temp_files(str(tmp_path))) == 1 and not other_host.exists()


def _write_then_wait(directory: str, marker: str) -> None:
    torch.set_num_threads(1)
    store = DiskStore(directory)
    # the packed record first: a call into the store renames the entry files already written, and the writer
    # thread may have written the large one before a call that came after it
    store.put("small", item_for("small", 4 << 10))  # a packed record: visible once its index record is written
    store.put("large", item_for("large", 2 << 20))  # an entry file: renamed at the next call into the store
    store._writer.flush()  # the writer thread wrote both (the bound of docs/persistent.md); no call follows
    with open(marker, "w"):
        pass
    time.sleep(600)  # no further read or write: killed here


def test_an_entry_written_before_a_sigkill_survives_it_without_a_further_call(tmp_path):
    """Issue 26 point 4: what the writer thread wrote is kept when the process is killed before it published it."""
    directory, marker = tmp_path / "cache", str(tmp_path / "written")
    directory.mkdir()
    p = FORK.Process(target=_write_then_wait, args=(str(directory), marker))
    p.start()
    deadline = time.monotonic() + 120  # a hang guard, not a timing assertion
    while not os.path.exists(marker) and p.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert os.path.exists(marker), "the writer process did not finish its writes"
    os.kill(p.pid, signal.SIGKILL)
    p.join(30)
    assert p.exitcode == -signal.SIGKILL
    names = os.listdir(directory)
    assert "large.mcache" not in names and any(n.startswith(".large.") for n in names)  # written, not published
    DiskStore.open(directory)  # what the next process does: it finishes the entry the killed one wrote
    read_back(directory, "large", 2 << 20)
    read_back(directory, "small", 4 << 10)
    assert sorted(n for n in os.listdir(directory) if not n.startswith("pack.")) == ["large.mcache"]
    # a partial entry file (its header, written last, missing) is removed, never adopted
    partial = directory / f".half.{runtime.HOST_TAG}.{p.pid}.w0.tmp"
    partial.write_bytes(bytes(HEADER_SIZE) + b"payload")
    DiskStore.open(directory)
    assert not partial.exists() and "half.mcache" not in os.listdir(directory)
