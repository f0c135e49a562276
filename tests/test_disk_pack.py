"""Packed entries: small items appended to shared pack files, found through append-only indexes.

Real files, real processes (forked, SIGKILLed), a real tiny tmpfs (skipped where mounting is not permitted).
Nothing is mocked. The entry-file counterparts of these checks are in ``tests/test_disk.py``.
"""

from __future__ import annotations

import gc
import hashlib
import multiprocessing
import os
import random
import shutil
import signal
import time
import tracemalloc
import warnings

import pytest
import torch
from helpers import mounted_tmpfs, one_torch_thread  # noqa: F401 (an autouse fixture)

from monai_cache import disk_format, disk_writer
from monai_cache.disk import MISSING, DiskStore
from monai_cache.disk_format import INDEX_RECORD_SIZE, PACK_SUFFIX, stored_entries
from monai_cache.disk_format import summarize as disk_cache_info
from monai_cache.disk_format import verify as verify_disk_cache

FORK = multiprocessing.get_context("fork")
ITEM_BYTES = 64 * 64 * 4  # one 64x64 float32 image: 16 KiB


def item_for(key: str, numel: int = 64 * 64) -> dict:
    """A deterministic, incompressible item for ``key``."""
    seed = int(hashlib.sha256(key.encode()).hexdigest()[:8], 16)
    return {"image": torch.rand(numel, generator=torch.Generator().manual_seed(seed)), "key": key}


def check(got, key: str, numel: int = 64 * 64) -> None:
    want = item_for(key, numel)
    assert got is not MISSING, key
    assert got["key"] == key and torch.equal(got["image"], want["image"]), key


def packs(directory) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n.endswith(PACK_SUFFIX))


def mc_warnings(records) -> list[str]:
    return [str(w.message) for w in records if "monai_cache" in str(w.message)]


def used_bytes(directory) -> int:
    return sum(os.lstat(os.path.join(directory, n)).st_blocks * 512 for n in os.listdir(directory))


# ---------------------------------------------------------------------------------------------- basics
@pytest.mark.parametrize("compression", ["zstd", None])
def test_small_items_are_packed_and_read_back(tmp_path, compression):
    store = DiskStore(tmp_path, compression=compression)
    keys = [f"k{i}" for i in range(300)]
    for key in keys:
        store.put(key, item_for(key))
    assert store.flush(60)
    names = os.listdir(tmp_path)
    assert len(names) == 2 and len(packs(tmp_path)) == 1  # one pack and its index for 300 items
    for name in names:
        assert oct(os.stat(tmp_path / name).st_mode & 0o777) == "0o600"
    reader = DiskStore(tmp_path, writable=False)  # as another process or rank would open it
    for key in random.Random(0).sample(keys, len(keys)):
        check(reader.get(key), key)
        assert reader.contains(key)
    assert reader.get("absent") is MISSING and not reader.contains("absent")
    # No index (the writer's, the reader's) keeps an object per entry that the garbage collector tracks: 50,000 of
    # them made every forked DataLoader worker run full collections, which copied the pages it inherited.
    for s in (store, reader):
        s._packs._merge()
        assert not s._packs._recent and len(s._packs._columns[0]) == len(keys)
    s = reader.stats()["process"]
    assert s["hits"] == len(keys) and s["misses"] == 1 and s["corrupt"] == 0
    assert len(list(reader.entries())) == len(keys)
    assert store.stats()["process"]["writes"] == len(keys)
    loc = reader.location("k7")
    assert loc.packed and loc.path == str(tmp_path / packs(tmp_path)[0])


def index_bytes(directory, keys) -> tuple[int, int]:
    """Memory a fresh reader of ``directory`` holds once its first lookup has read every index (tracemalloc), and
    how many garbage collections ran during that lookup."""
    reader = DiskStore(directory, writable=False)
    collections: list[int] = []

    def count(phase, info):
        if phase == "start":
            collections.append(info["generation"])

    gc.callbacks.append(count)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        assert reader.contains(keys[0])
        during = len(collections)
        gc.collect()  # a full collection also empties CPython's free lists (of the tuples read_index made, ...)
        return tracemalloc.get_traced_memory()[0] - before, during
    finally:
        tracemalloc.stop()
        gc.callbacks.remove(count)


def test_a_reader_keeps_a_compact_index_that_follows_rewrites_and_removed_packs(tmp_path):
    """Every DataLoader worker of every rank keeps a reader's index: at most 64 bytes more per entry (a dict of
    tuples took 392; tracemalloc counted 265 of them), read without a garbage collection, and it serves what the
    indexes say after another pack rewrote keys and after a pack was removed."""
    n = 6000
    keys = [f"k{i}" for i in range(n)]
    big, small = tmp_path / "big", tmp_path / "small"
    big.mkdir()
    small.mkdir()
    first = DiskStore(big)
    small_store = DiskStore(small)
    for i, key in enumerate(keys):
        first.put(key, item_for(key, 16))
        if i < n // 3:
            small_store.put(key, item_for(key, 16))
    assert first.flush(60) and small_store.flush(60)
    first_pack = packs(big)
    # per entry: what a reader of 6,000 entries holds beyond one of 2,000 (fixed costs cancel out)
    (big_bytes, big_collections), (small_bytes, small_collections) = index_bytes(big, keys), index_bytes(small, keys)
    per_entry = (big_bytes - small_bytes) / (n - n // 3)
    assert per_entry <= 64, f"{per_entry:.0f} bytes per entry"
    # and no garbage collection while it reads them: collections meanwhile (one per 700 tuples made per record)
    # move them to the oldest generation and so start a full collection, which copies every page a forked worker
    # inherited (python -m benchmarks scale, 50,000 items: 1.8 GiB of processes in some runs, 1.0 GiB without).
    # One young-generation collection may follow the read: the tuples CPython keeps on its free lists still count.
    assert big_collections <= 1 and small_collections <= 1, (big_collections, small_collections)
    reader = DiskStore(big, writable=False)
    assert reader.contains(keys[0])
    # another writer (its own pack) rewrites a third of the keys with other items
    rewritten = set(keys[::3])
    second = DiskStore(big)
    for key in sorted(rewritten):
        assert second.write(key, item_for(key + "+", 16), replace=True)
    assert reader.get("absent", fresh=True) is MISSING  # an unknown key: the reader reads the new records
    for key in random.Random(0).sample(keys, 600):
        got = reader.get(key)
        assert got is not MISSING and got["key"] == (key + "+" if key in rewritten else key), key
    # the first pack goes: what only it held is gone, the rewritten keys stay
    for name in first_pack:
        os.remove(big / name)
        os.remove(big / (name[: -len(PACK_SUFFIX)] + disk_format.INDEX_SUFFIX))
    for key in random.Random(1).sample(keys, 600):
        got = reader.get(key)
        if key in rewritten:
            assert got is not MISSING and got["key"] == key + "+", key
        else:
            assert got is MISSING, key


def test_large_items_keep_a_file_of_their_own(tmp_path):
    store = DiskStore(tmp_path, async_writes=False, compression=None)
    numel = disk_format.PACK_LIMIT // 4 + 16  # just above the limit: its own file
    store.put("big", item_for("big", numel))
    store.put("small", item_for("small"))
    assert os.path.exists(store.path("big")) and not os.path.exists(store.path("small"))
    assert not store.location("big").packed and store.location("small").packed
    check(disk_format.read_entry(store.path("big")), "big", numel)
    reader = DiskStore(tmp_path)
    check(reader.get("big"), "big", numel)
    check(reader.get("small"), "small")
    assert sorted(e.packed for e in reader.entries()) == [False, True]


@pytest.mark.parametrize("compression", ["zstd", None])
def test_overhead_of_2000_16k_entries_is_at_most_10_percent(tmp_path, compression):
    store = DiskStore(tmp_path, compression=compression, async_writes=False)
    n = 2000
    for i in range(n):
        store.write(f"k{i}", {"image": torch.rand(64, 64, generator=torch.Generator().manual_seed(i))})
    used = used_bytes(tmp_path)
    overhead = used / (n * ITEM_BYTES) - 1
    print(f"\n{compression}: {used} bytes allocated for {n} x {ITEM_BYTES}: overhead {overhead:.2%}")
    assert overhead <= 0.10
    assert len(os.listdir(tmp_path)) == 2
    got = DiskStore(tmp_path).get("k1234")["image"]
    assert torch.equal(got, torch.rand(64, 64, generator=torch.Generator().manual_seed(1234)))


def test_packs_rotate_and_fsync_works(tmp_path, monkeypatch):
    monkeypatch.setattr(disk_writer, "PACK_MAX_BYTES", 100 << 10)
    store = DiskStore(tmp_path, async_writes=False, compression=None, fsync=True)
    for i in range(30):
        store.put(f"k{i}", item_for(f"k{i}"))
    assert len(packs(tmp_path)) >= 4  # about six 16 KiB records per pack
    reader = DiskStore(tmp_path)
    for i in range(30):
        check(reader.get(f"k{i}"), f"k{i}")


def test_rewritten_key_supersedes(tmp_path):
    first = DiskStore(tmp_path, async_writes=False)
    first.put("k", {"v": torch.zeros(100), "key": "old"})
    first.put("other", item_for("other"))
    assert first.write("k", {"v": torch.ones(100), "key": "ignored"})  # an entry exists: kept
    assert DiskStore(tmp_path).get("k")["key"] == "old"
    second = DiskStore(tmp_path, async_writes=False)  # another process/rank, its own pack
    assert second.write("k", {"v": torch.ones(100), "key": "new"}, replace=True)
    assert len(packs(tmp_path)) == 2
    assert second.get("k")["key"] == "new"
    assert DiskStore(tmp_path).get("k")["key"] == "new"  # a fresh reader: the later record wins
    assert first.write("k", {"v": torch.full((100,), 2.0), "key": "newest"}, replace=True)
    assert first.get("k")["key"] == "newest"  # same pack, later index record
    check(DiskStore(tmp_path).get("other"), "other")
    assert len(list(stored_entries(str(tmp_path)))) == 2
    assert len(list(stored_entries(str(tmp_path), superseded=True))) == 4


# ---------------------------------------------------------------------------------------- integrity
@pytest.mark.parametrize("where", ["payload", "header", "tag"])
def test_corrupt_record_reported_once_and_recomputed(tmp_path, where):
    store = DiskStore(tmp_path, async_writes=False, compression=None)  # records of equal sizes
    keys = [f"k{i}" for i in range(5)]
    for key in keys:
        store.put(key, item_for(key))
    loc = store.location("k2")
    with open(loc.path, "r+b") as f:
        if where == "tag":  # a valid record of another key, copied over this one (same size)
            other = store.location("k3")
            f.seek(other.offset)
            raw = f.read(other.length)
            f.seek(loc.offset)
            f.write(raw)
        else:
            pos = loc.offset + (20 if where == "header" else loc.length // 2)
            f.seek(pos)
            b = f.read(1)
            f.seek(pos)
            f.write(bytes([b[0] ^ 0x01]))
    reader = DiskStore(tmp_path, async_writes=False)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        assert reader.get("k2") is MISSING
        assert reader.get("k2") is MISSING  # not read again, not reported again
        for key in ("k0", "k1", "k3", "k4"):  # the other records of the pack are fine
            check(reader.get(key), key)
        reader.put("k2", item_for("k2"))  # recomputed: appended anew
        check(reader.get("k2"), "k2")
    msgs = mc_warnings(rec)
    assert len(msgs) == 1 and "corrupt disk cache record" in msgs[0] and "k2" in msgs[0], msgs
    s = reader.stats()["process"]
    assert s["corrupt"] == 1 and s["writes"] == 1
    assert reader.location("k2").path != loc.path  # in the reader's own pack
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        fresh = DiskStore(tmp_path)
        for key in keys:
            check(fresh.get(key), key)
    # a fresh reader may meet the bad record before the new one (index order): it reports it, never serves it
    assert len(mc_warnings(rec)) <= 1
    result = verify_disk_cache(str(tmp_path))
    assert result["ok"] == 5 and [b["file"] for b in result["bad"]] == [f"{os.path.basename(loc.path)}@{loc.offset}"]
    result = verify_disk_cache(str(tmp_path), remove=True)
    assert result["bad"][0]["removed"]
    assert verify_disk_cache(str(tmp_path))["bad"] == []
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        fresh = DiskStore(tmp_path)
        for key in keys:
            check(fresh.get(key), key)
    assert mc_warnings(rec) == []


def _flip_middle(loc) -> None:
    with open(loc.path, "r+b") as f:
        f.seek(loc.offset + loc.length // 2)
        b = f.read(1)
        f.seek(loc.offset + loc.length // 2)
        f.write(bytes([b[0] ^ 0x01]))


def _recompute_into_a_bad_record(directory) -> None:
    """Another process: finds the key's record bad, recomputes it into a record of its own, which goes bad too."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        store = DiskStore(directory, async_writes=False, compression=None)
        assert store.get("k") is MISSING
        store.put("k", item_for("k"))
        _flip_middle(store.location("k"))


def test_a_key_recomputed_into_a_bad_record_again_is_reported_once(tmp_path):
    """Once per entry and process: a reader that meets a bad record of a key, then the bad record another process
    recomputed it into (a failing disk), warns once, counts both, and reads neither again."""
    DiskStore(tmp_path, async_writes=False, compression=None).put("k", item_for("k"))
    reader = DiskStore(tmp_path, async_writes=False, writable=False)
    first = reader.location("k")
    _flip_middle(first)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        assert reader.get("k") is MISSING
        other = FORK.Process(target=_recompute_into_a_bad_record, args=(str(tmp_path),))
        other.start()
        other.join(60)
        assert other.exitcode == 0
        second = DiskStore(tmp_path, writable=False).location("k")  # the newest record, as a new reader finds it
        assert (second.path, second.offset) != (first.path, first.offset)
        assert reader.get("k", fresh=True) is MISSING
        assert reader.get("k", fresh=True) is MISSING
    msgs = mc_warnings(rec)
    assert len(msgs) == 1 and "corrupt disk cache record" in msgs[0], msgs
    assert reader.stats()["process"]["corrupt"] == 2


def test_torn_index_tail_is_ignored(tmp_path):
    store = DiskStore(tmp_path, async_writes=False, compression=None)
    for i in range(10):
        store.put(f"k{i}", item_for(f"k{i}"))
    index = next(str(tmp_path / n) for n in os.listdir(tmp_path) if n.endswith(disk_format.INDEX_SUFFIX))
    pack = index[: -len(disk_format.INDEX_SUFFIX)] + PACK_SUFFIX
    size = os.path.getsize(pack)
    # what a writer killed mid-append leaves: half a record at the pack's end, and a torn index record for it
    with open(pack, "ab") as f:
        f.write(b"\x01" * 5000)
    with open(index, "ab") as f:
        now = time.time_ns()
        record = disk_format.index_record(disk_format.key_tag("k10"), size, 5000 + 64, now)
        f.write(record[:-4] + b"\0\0\0\0")  # CRC wrong
        f.write(disk_format.index_record(disk_format.key_tag("k11"), size, 64, now)[:17])  # and an incomplete one
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        reader = DiskStore(tmp_path)
        for i in range(10):
            check(reader.get(f"k{i}"), f"k{i}")
        assert reader.get("k10") is MISSING and reader.get("k11") is MISSING
    assert mc_warnings(rec) == []
    assert reader.stats()["process"]["corrupt"] == 0
    assert len(list(reader.entries())) == 10
    assert verify_disk_cache(str(tmp_path))["bad"] == []
    info = disk_cache_info(str(tmp_path))
    assert info["entries"] == 10 and info["packed"] == 10 and info["bad_headers"] == 0


# ------------------------------------------------------------------------------------------ processes
def _write_keys(directory: str, prefix: str, n: int) -> None:
    torch.set_num_threads(1)
    store = DiskStore(directory)
    for i in range(n):
        store.put(f"{prefix}{i}", item_for(f"{prefix}{i}"))
    assert store.flush(60)


def _read_while_written(directory: str, keys: list[str], stop, result) -> None:
    torch.set_num_threads(1)
    store = DiskStore(directory, writable=False)
    seen: set[str] = set()
    bad = 0
    rng = random.Random(5)

    def read(key: str) -> bool:
        nonlocal bad
        got = store.get(key)
        if got is MISSING:
            return False
        if got["key"] != key or not torch.equal(got["image"], item_for(key)["image"]):
            bad += 1
        seen.add(key)
        return True

    while not stop.is_set():  # while the writers append
        read(rng.choice(keys))
    deadline = time.monotonic() + 10  # new packs are found within disk_format.RELIST_SECONDS
    for key in keys:
        while not read(key) and time.monotonic() < deadline:
            time.sleep(0.05)
    s = store.stats()["process"]
    result.put((bad, len(seen), s["corrupt"]))


def test_two_writer_processes_and_a_reader(tmp_path):
    n = 150
    keys = [f"a{i}" for i in range(n)] + [f"b{i}" for i in range(n)]
    stop, result = FORK.Event(), FORK.Queue()
    reader = FORK.Process(target=_read_while_written, args=(str(tmp_path), keys, stop, result))
    reader.start()
    writers = [FORK.Process(target=_write_keys, args=(str(tmp_path), p, n)) for p in "ab"]
    for w in writers:
        w.start()
    for w in writers:
        w.join(120)
        assert w.exitcode == 0
    stop.set()
    bad, seen, corrupt = result.get(timeout=120)
    reader.join(30)
    assert bad == 0 and seen == len(keys) and corrupt == 0
    assert len(packs(tmp_path)) == 2  # one pack per writing process
    final = DiskStore(tmp_path)
    for key in keys:
        check(final.get(key), key)


def _append_forever(directory: str, start: int, numel: int) -> None:
    torch.set_num_threads(1)
    store = DiskStore(directory, async_writes=False, compression_level=3)
    i = start
    while True:
        store.put(f"w{i:06d}", item_for(f"w{i:06d}", numel))
        i += 1


def _tail_state(directory: str) -> tuple[int, int]:
    """(packs with bytes after their last indexed record, indexes with a partial last record)."""
    loose = torn = 0
    for name in os.listdir(directory):
        if not name.endswith(disk_format.INDEX_SUFFIX):
            continue
        index = os.path.join(directory, name)
        records, _, _ = disk_format.read_index(index)
        end = max((o + n for _, o, n, _, _ in records), default=0)
        loose += os.path.getsize(index[: -len(disk_format.INDEX_SUFFIX)] + PACK_SUFFIX) > end
        torn += (os.path.getsize(index) - disk_format.INDEX_HEADER_SIZE) % INDEX_RECORD_SIZE != 0
    return loose, torn


def test_sigkill_during_packed_appends_never_serves_wrong_data(tmp_path):
    rng = random.Random(4321)
    numel = 48 << 10  # 192 KiB records (packed), compressed at level 3: appends take a while
    trials = mid_append = 0
    start = 0
    while trials < 20 or (mid_append == 0 and trials < 60):
        before = sum(n.endswith(disk_format.INDEX_SUFFIX) for n in os.listdir(tmp_path))
        p = FORK.Process(target=_append_forever, args=(str(tmp_path), start, numel))
        p.start()
        deadline = time.monotonic() + 30
        while sum(n.endswith(disk_format.INDEX_SUFFIX) for n in os.listdir(tmp_path)) == before:
            assert time.monotonic() < deadline
            time.sleep(0.002)  # wait until this writer has its pack
        time.sleep(rng.uniform(0.0, 0.15))
        os.kill(p.pid, signal.SIGKILL)
        p.join(10)
        assert p.exitcode == -signal.SIGKILL
        trials += 1
        loose, torn = _tail_state(str(tmp_path))
        mid_append = max(mid_append, loose + torn)
        start += 10_000
    # every entry a reader accepts is the right one; nothing is reported corrupt (partial appends are unindexed)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        reader = DiskStore(tmp_path, writable=False)
        accepted = 0
        for trial in range(trials):
            i = trial * 10_000
            while (got := reader.get(f"w{i:06d}")) is not MISSING:  # each writer wrote its keys in order
                check(got, f"w{i:06d}", numel)
                accepted += 1
                i += 1
    assert mc_warnings(rec) == [] and reader.stats()["process"]["corrupt"] == 0
    assert accepted > 0, "no writer completed a record"
    assert mid_append > 0, "no kill landed during an append (the test did not exercise the hazard)"
    assert accepted == len(list(stored_entries(str(tmp_path))))
    result = verify_disk_cache(str(tmp_path))
    assert result["bad"] == [] and result["ok"] == accepted


# ------------------------------------------------------------------------------------- real failures
def test_disk_full_while_appending_gives_one_warning(tmp_path):
    with mounted_tmpfs(str(tmp_path / "mnt"), "size=1m") as mnt:
        store = DiskStore(mnt, compression=None)
        numel = 20_000  # 80 KB records: packed; about 12 fit
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            for i in range(30):
                store.put(f"k{i}", item_for(f"k{i}", numel))
            store.flush(30)
        msgs = mc_warnings(rec)
        assert len(msgs) == 1 and "is full" in msgs[0], msgs
        s = store.stats()["process"]
        assert s["writes"] >= 1 and s["write_errors"] == 1 and store.writes_disabled
        reader = DiskStore(mnt, writable=False)
        ok = 0
        for i in range(30):
            got = reader.get(f"k{i}")
            if got is not MISSING:
                check(got, f"k{i}", numel)
                ok += 1
        assert ok == s["writes"] and reader.stats()["process"]["corrupt"] == 0
        assert not any(n.endswith(".tmp") for n in os.listdir(mnt))


def test_pack_format_matches_the_documented_spec(tmp_path):
    """Read a pack with the index reader of docs/disk-format.md and nothing but struct, zlib and zstandard."""
    import struct
    import zlib

    import zstandard

    doc = open(os.path.join(os.path.dirname(os.path.dirname(__file__)), "docs", "disk-format.md")).read()
    code = doc[doc.index("def read_index(path):") :]
    namespace: dict = {"struct": struct, "zlib": zlib}
    exec(code[: code.index("```")], namespace)
    store = DiskStore(tmp_path, async_writes=False)
    for i in range(4):
        store.put(f"k{i}", item_for(f"k{i}"))
    (index,) = (n for n in os.listdir(tmp_path) if n.endswith(disk_format.INDEX_SUFFIX))
    records = namespace["read_index"](str(tmp_path / index))
    assert len(records) == 4
    pack = (tmp_path / index).with_suffix(PACK_SUFFIX).read_bytes()
    offset, length, stamp = records[hashlib.sha256(b"k2").digest()[:16]]
    assert abs(stamp - time.time_ns()) < 60e9
    raw = pack[offset : offset + length]
    magic, version, hsize, flags, blob_len, stored_len, crc, _, tag, _, hcrc = struct.unpack(
        "<8sHHIQQII16sII", raw[:64]
    )
    assert (magic, version, hsize, flags) == (b"MCDISK\r\n", 2, 64, 1) and hcrc == zlib.crc32(raw[:60])
    assert tag == hashlib.sha256(b"k2").digest()[:16] and stored_len == length - 64 and crc == zlib.crc32(raw[64:])
    blob = zstandard.ZstdDecompressor().decompress(raw[64:], max_output_size=blob_len)
    assert len(blob) == blob_len and blob[:8] == b"MCACHE\x00\x01"


def test_location_of_a_packed_entry_is_complete_enough_to_remove_it(tmp_path):
    store = DiskStore(tmp_path, async_writes=False)
    for key in ("k", "j"):
        store.put(key, item_for(key))
    where = store.location("k")
    assert where is not None and where.packed and where.index_path is not None
    disk_format.remove_packed(where)  # what `monai-cache verify --remove` does to a bad record
    fresh = DiskStore(tmp_path, writable=False)
    assert fresh.get("k") is MISSING
    check(fresh.get("j"), "j")


def test_entries_written_after_a_clear_under_a_running_store_are_stored(tmp_path):
    """``monai-cache clear --cache-dir`` while a training runs removes the pack its store appends to and the records
    the store knows of: what it writes afterwards is stored, in a new pack (not reserved in the removed one, which
    the writer thread would drop), and a record it wrote into the removed pack does not pass for an entry (a key
    written before the clear is written again, not skipped as stored)."""
    (tmp_path / "cache").mkdir()
    store = DiskStore(tmp_path / "cache")
    for key in ("a", "b"):
        store.put(key, item_for(key))
    assert store.flush(60) and len(packs(tmp_path / "cache")) == 1
    (tmp_path / "cache" / "model.pt").write_bytes(b"not ours")  # keeps the directory (a cleared one that goes
    # takes the store's writes with it, as documented)
    assert disk_format.clear(str(tmp_path / "cache"))["removed"] == 2  # the pack and its index
    store.put("c", item_for("c"))  # computed after the clear
    assert store.write("a", item_for("a"))  # written before it: an entry again, not skipped as stored
    assert store.flush(60)
    fresh = DiskStore(tmp_path / "cache", writable=False)
    for key in ("a", "c"):
        check(fresh.get(key), key)
    assert fresh.get("b") is MISSING
    assert store.stats()["process"]["skipped"] == 0


def test_a_cache_written_before_the_store_redesign_still_reads(tmp_path):
    """tests/data/disk-cache-v1 was written by monai_cache b9c55cc (before the disk store was split into
    disk_format, disk_writer and disk): a kept cache must read the same items, and verify clean."""
    from _disk_fixture_items import fixture_items
    from helpers import assert_same

    kept = tmp_path / "kept"
    shutil.copytree(os.path.join(os.path.dirname(__file__), "data", "disk-cache-v1"), kept)
    kinds = sorted(n.rsplit(".", 1)[-1] for n in os.listdir(kept))
    assert kinds == ["mcache", "mcidx", "mcidx", "mcpack", "mcpack"]  # a file of its own, and two packs
    result = verify_disk_cache(str(kept))
    assert result["bad"] == [] and result["ok"] == 3
    reader = DiskStore(kept, writable=False)
    items = fixture_items()
    stored_image, fresh_image = reader.get("packed")["image"], items["packed"]["image"]
    if sorted(vars(stored_image)) != sorted(vars(fresh_image)):
        # The MONAI that wrote it (1.6) gives a MetaTensor other attributes than the installed one (1.3 has no
        # _spatial_ndim). No reader meets such a cache: every cache's name holds the MONAI version.
        pytest.skip(f"MetaTensor attributes of the writer's MONAI {sorted(vars(stored_image))} differ from the "
                    f"installed MONAI's {sorted(vars(fresh_image))}")
    for key, item in items.items():
        assert_same(reader.get(key), item)
    assert reader.stats()["process"]["corrupt"] == 0
