"""The shared-memory store, with real /dev/shm, real independent processes and real SIGKILLs."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import numpy as np
import pytest
import torch
from helpers import python_c

from monai_cache import runtime, shm_directory
from monai_cache.errors import CacheFullWarning, CorruptEntryWarning
from monai_cache.shm import SharedMemoryStore, cache_root, list_caches, remove_cache

PY = sys.executable


def spawn(code: str, **kw) -> subprocess.Popen:
    """Start an independent Python process (like torchrun starts a rank) running ``code``."""
    return subprocess.Popen(
        [PY, "-c", textwrap.dedent(code)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, **kw,
    )


def run(code: str, timeout: float = 60) -> str:
    p = spawn(code)
    out, err = p.communicate(timeout=timeout)
    assert p.returncode == 0, err
    return out


def item(i: int) -> dict:
    return {"image": torch.full((64, 64), float(i)), "index": i, "name": f"case{i}"}


def test_permissions_owner_only(shm_dir):
    store = SharedMemoryStore("k1", 2)
    store[0] = item(0)
    root = cache_root(shm_dir)
    assert stat.S_IMODE(os.stat(root).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(store.path).st_mode) == 0o700
    for name in os.listdir(store.path):
        assert stat.S_IMODE(os.stat(os.path.join(store.path, name)).st_mode) & 0o077 == 0, name
    store.release()


def test_root_owned_by_someone_else_is_refused(shm_dir):
    root = os.path.join(shm_dir, f"monai_cache-{os.getuid()}")
    os.mkdir(root, 0o777)
    try:
        os.chown(root, 65534, 65534)  # "nobody" pre-created our directory: it could plant entries
    except PermissionError:
        pytest.skip("giving a directory to another user (chown) needs root (CAP_CHOWN)")
    with pytest.raises(PermissionError, match="not a directory owned by"):
        SharedMemoryStore("k", 1)


def test_missing_or_file_shm_dir_is_named_with_what_to_do(shm_dir):
    missing, a_file = os.path.join(shm_dir, "nope"), os.path.join(shm_dir, "a-file")
    open(a_file, "w").close()
    with pytest.raises(FileNotFoundError, match=r"'.*nope' does not exist\. Pass shm_dir="):
        SharedMemoryStore("k", 1, shm_dir=missing)
    with pytest.raises(NotADirectoryError, match=r"'.*a-file' is not a directory\. Pass shm_dir="):
        SharedMemoryStore("k", 1, shm_dir=a_file)


def test_get_set_len_and_negative_index(shm_dir):
    store = SharedMemoryStore("k2", 3)
    assert len(store) == 3 and store[0] is None and store[-1] is None
    store[2] = item(2)
    got = store[-1]
    assert torch.equal(got["image"], item(2)["image"]) and got["name"] == "case2"
    with pytest.raises(IndexError):
        store[3]
    store.release()


def test_reads_are_zero_copy_and_copy_on_write(shm_dir):
    store = SharedMemoryStore("k3", 1)
    store[0] = {"image": torch.arange(400_000, dtype=torch.float32)}  # >= 1 MiB: mapped, not copied
    a = store[0]["image"]
    # zero-copy: the tensor's memory lies inside a mapping of the entry file
    ptr = a.data_ptr()
    with open("/proc/self/maps") as f:
        maps = [line for line in f if store.path in line]
    assert any(int(r.split()[0].split("-")[0], 16) <= ptr < int(r.split()[0].split("-")[1], 16) for r in maps)
    a.mul_(-1)  # a random transform writing into its input...
    a[5] = 1e9
    b = store[0]["image"]  # ...never changes the shared copy
    assert torch.equal(b, torch.arange(400_000, dtype=torch.float32))
    store.release()


def test_independent_processes_share_and_exit_does_not_unlink(shm_dir):
    writer = """
        import torch
        from monai_cache.shm import SharedMemoryStore
        s = SharedMemoryStore("shared", 4)
        for i in range(4):
            s[i] = {"x": torch.full((1000,), float(i))}
        print(s.path, flush=True)
        input()  # stay alive until told
    """
    p = spawn(writer)
    path = p.stdout.readline().strip()
    store = SharedMemoryStore("shared", 4)
    assert store.path == path
    assert float(store[3]["x"][0]) == 3.0
    # an independently started reader attaches, reads, exits: Python 3.11's resource tracker would unlink
    # multiprocessing.shared_memory segments here; our entries must survive
    run("""
        from monai_cache.shm import SharedMemoryStore
        s = SharedMemoryStore("shared", 4)
        assert float(s[1]["x"][0]) == 1.0
    """)
    p.communicate("\n", timeout=30)
    assert p.returncode == 0
    files = os.listdir(path)
    assert "index" in files and any(n.startswith("s.") for n in files)
    assert [store.contains(i) for i in range(4)] == [True] * 4
    assert [float(store[i]["x"][5]) for i in range(4)] == [0.0, 1.0, 2.0, 3.0]
    store.release()  # last user leaves normally: the cache goes away
    assert not os.path.exists(path)


def test_last_process_exit_removes_cache(shm_dir):
    out = run("""
        import torch
        from monai_cache.shm import SharedMemoryStore
        s = SharedMemoryStore("gone", 2)
        s[0] = {"x": torch.zeros(10)}
        print(s.path)
    """)
    assert not os.path.exists(out.strip())
    assert list_caches() == []


def test_crash_leftovers_are_reclaimed_and_keep_warm_survives(shm_dir):
    crash = """
        import os, signal, sys, torch
        sys.path.insert(0, {tests!r})
        from helpers import kill_watcher
        from monai_cache.shm import SharedMemoryStore
        s = SharedMemoryStore("{key}", 2, keep_warm={keep})
        s[0] = {{"x": torch.ones(10)}}
        print(s.path, flush=True)
        if not {keep}:  # killed with every process at once, its watcher too (a kept cache has none)
            kill_watcher(s.path)
        os.kill(os.getpid(), signal.SIGKILL)
    """.replace("{tests!r}", repr(os.path.dirname(os.path.abspath(__file__))))
    p = spawn(crash.format(key="crashed", keep=False))
    stale_path = p.stdout.readline().strip()
    p.wait(30)
    assert p.returncode == -signal.SIGKILL and os.path.isdir(stale_path)
    assert [c["state"] for c in list_caches() if c["key"] == "crashed"] == ["stale"]
    # a kept cache outlives its users on purpose
    p = spawn(crash.format(key="warm", keep=True))
    warm_path = p.stdout.readline().strip()
    p.wait(30)
    # the next process to join any cache reclaims the stale one, but not the kept one
    other = SharedMemoryStore("other", 1)
    assert not os.path.exists(stale_path)
    assert os.path.exists(warm_path)
    warm = SharedMemoryStore("warm", 2, keep_warm=True)
    assert torch.equal(warm[0]["x"], torch.ones(10))  # the next run starts warm
    warm.release()
    other.release()
    assert os.path.exists(warm_path)
    assert remove_cache("warm")
    assert not os.path.exists(warm_path)


def test_same_key_after_crash_starts_afresh(shm_dir):
    p = spawn("""
        import os, signal, torch
        from monai_cache.shm import SharedMemoryStore
        s = SharedMemoryStore("again", 2)
        s[0] = {"x": torch.ones(10)}
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    p.wait(30)
    store = SharedMemoryStore("again", 2)
    assert store[0] is None  # leftovers of a crashed run are not trusted by default
    assert store.stats()["stored"]["entries"] == 0
    store.release()


def test_compute_once_across_processes(shm_dir, tmp_path):
    log = tmp_path / "computed"
    code = f"""
        import os, time, torch
        from monai_cache.shm import SharedMemoryStore
        s = SharedMemoryStore("once", 1)
        print("joined", flush=True)
        input()  # start together
        def compute():
            with open({str(log)!r}, "a") as f:
                f.write(f"{{os.getpid()}}\\n")
            time.sleep(1.0)
            return {{"x": torch.arange(10.0)}}
        v = s.get_or_compute(0, compute)
        assert torch.equal(v["x"], torch.arange(10.0))
        print("ok", flush=True)
    """
    procs = [spawn(code) for _ in range(2)]
    for p in procs:
        assert p.stdout.readline().strip() == "joined"
    for p in procs:
        p.stdin.write("\n")
        p.stdin.flush()
    for p in procs:
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0 and "ok" in out, err
    assert len(log.read_text().split()) == 1


def test_dead_holder_never_blocks(shm_dir):
    holder = spawn("""
        import time
        from monai_cache.shm import SharedMemoryStore
        s = SharedMemoryStore("blocked", 1)
        def compute():
            print("computing", flush=True)
            time.sleep(600)
        s.get_or_compute(0, compute)
    """)
    assert holder.stdout.readline().strip() == "computing"
    store = SharedMemoryStore("blocked", 1)
    assert store.fill(0, lambda: {"x": 1}) is False  # someone is on it
    holder.kill()
    holder.wait(30)
    assert store.fill(0, lambda: {"x": 2}) is True  # its lock went with it: taken at once, not waited for
    assert store.get_or_compute(0, lambda: {"x": 3}) == {"x": 2}
    store.release()


def test_sigkill_during_writes_leaves_nothing_readable_half_written(shm_dir):
    rng = np.random.default_rng(0)
    writer = """
        import itertools, torch
        from monai_cache.shm import SharedMemoryStore
        s = SharedMemoryStore("killed", 64, keep_warm=True)
        print("ready", flush=True)
        for n in itertools.count():  # keep writing (and rewriting) until killed
            i = n % 64
            s.clear() if i == 0 else None
            s[i] = {"x": torch.full((1_000_000,), float(i)), "i": i}
    """
    killed_mid_write = 0
    for trial in range(20):  # 5 kills, more until one lands mid-write (how often depends on the machine's load)
        if trial >= 5 and killed_mid_write:
            break
        p = spawn(writer)
        assert p.stdout.readline().strip() == "ready"
        time.sleep(float(rng.uniform(0.05, 0.3)))
        p.kill()
        p.wait(30)
        path = os.path.join(cache_root(), "killed")
        killed_mid_write += any(n.endswith(".tmp") for n in os.listdir(path))
        # every entry a reader accepts is complete and right
        store = SharedMemoryStore("killed", 64, keep_warm=True)
        for i in range(64):
            got = store[i]
            if got is not None:
                assert got["i"] == i and got["x"].shape == (1_000_000,) and bool((got["x"] == i).all())
        store.release()
    assert remove_cache("killed", force=True)
    assert killed_mid_write >= 1  # the kills did land while an entry was being written


def entry_location(store: SharedMemoryStore, i: int) -> tuple[str, int, int]:
    """(file, offset, length) of entry i: a packed segment, or a file of its own."""
    seg, offset, length, _tag = store._dir.read_slot(i)
    if seg == 0xFFFFFFFF:
        return os.path.join(store.path, f"{i}.e"), 0, length
    return os.path.join(store.path, f"s.{seg}"), offset, length


def damage_entry(store: SharedMemoryStore, i: int, damage: str) -> None:
    """Damage entry i where ``damage`` says: its index slot's tag (``slot``) or segment number (``slot-segment``:
    a segment that does not exist, which only the slot's checksum tells from an entry that is simply gone), or its
    blob's ``header`` or ``payload``."""
    path, offset, length = entry_location(store, i)
    if damage.startswith("slot"):
        with open(os.path.join(store.path, "index"), "r+b") as f:
            f.seek(shm_directory.SLOT_SIZE * i + (0 if damage == "slot-segment" else 4))
            f.write(b"\x07")
    else:
        with open(path, "r+b") as f:
            f.seek(offset + (50 if damage == "header" else length - 8))
            f.write(b"\xff" * 8)


@pytest.mark.parametrize("size", [1000, 400_000, 2_000_000])  # packed into a segment / a file of its own
@pytest.mark.parametrize("damage", ["payload", "header", "slot", "slot-segment"])
@pytest.mark.parametrize("verify", [False, True])
def test_corrupt_entry_reported_once_removed_and_recomputed(shm_dir, size, damage, verify):
    store = SharedMemoryStore("corrupt", 2, verify=verify)
    value = {"x": torch.arange(size, dtype=torch.float32), "name": "case0"}
    store[0] = value
    store[1] = {"x": torch.ones(3), "name": "case1"}
    damage_entry(store, 0, damage)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first, second = store[0], store[0]
    if damage == "payload" and not verify:
        # by default tensor bytes are not checksummed on every read (a crash cannot damage them: entries
        # are published only once complete); verify=True checks them
        assert first is not None and not torch.equal(first["x"], value["x"])
        store.release()
        return
    assert first is None and second is None
    assert len([w for w in caught if "corrupt" in str(w.message)]) == 1
    assert not store.contains(0) and store.contains(1)
    got = store.get_or_compute(0, lambda: value)
    assert got["name"] == "case0" and torch.equal(got["x"], value["x"]) and store.contains(0)
    assert store.stats()["total"]["corrupt"] == 1
    assert store[1]["name"] == "case1"
    store.release()


@pytest.mark.parametrize("damage", ["header", "slot"])
def test_entry_found_bad_by_the_read_under_its_lock_is_recomputed(shm_dir, damage):
    # The read under the entry's lock (after a caller found the entry missing: CacheDataset's miss) finds it bad,
    # damaged meanwhile: it is discarded under the lock already held. Taking the lock again on a second descriptor
    # waited for this thread's own lock forever (OFD locks conflict across descriptors; no deadlock detection).
    store = SharedMemoryStore("bad-under-lock", 2)
    store[0] = {"x": torch.ones(8), "name": "old"}
    damage_entry(store, 0, damage)
    got: list = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        reader = threading.Thread(
            target=lambda: got.append(store.get_or_compute(0, lambda: {"x": torch.zeros(8), "name": "new"},
                                                           missing=True)),
            daemon=True,
        )
        reader.start()
        reader.join(15)
    assert got, "the read under the entry's lock hung on the same lock"
    assert got[0]["name"] == "new" and store[0]["name"] == "new"
    assert len([w for w in caught if "corrupt" in str(w.message)]) == 1
    assert store.stats()["total"]["corrupt"] == 1
    store.release()


def test_small_entries_are_packed_without_per_entry_files(shm_dir):
    store = SharedMemoryStore("packed", 2000)
    for i in range(2000):
        store[i] = {"x": torch.full((4096,), float(i))}  # 16 KiB
    files = os.listdir(store.path)
    assert len(files) < 20  # no file per entry
    held = sum(os.stat(os.path.join(store.path, f)).st_blocks * 512 for f in files)
    assert held < 2000 * 16384 * 1.10  # at most 10% over the raw data, headers and index included
    assert float(store[1234]["x"][7]) == 1234.0
    store.release()


def test_threads_filling_across_segment_ends_write_every_entry(shm_dir, monkeypatch):
    """Threads of one process append to one segment; the thread that starts the next segment must not close the
    one that others are still writing (a closed, perhaps reused, descriptor: lost or misplaced entries)."""
    from multiprocessing.pool import ThreadPool

    monkeypatch.setattr(shm_directory, "SEGMENT_SIZE", 256 << 10)  # a new segment every 15 entries
    store = SharedMemoryStore("threads", 600)

    def put(i: int) -> None:
        store[i] = {"x": torch.full((4096,), float(i))}  # 16 KiB, packed

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a failed write or a corrupt entry warns
        for _ in range(3):
            with ThreadPool(4) as pool:
                pool.map(put, range(600), chunksize=1)
            assert store.missing() == []
            for i in range(600):
                assert torch.equal(store[i]["x"], torch.full((4096,), float(i))), i
            store.clear()
    assert store.stats()["total"]["corrupt"] == 0
    store.release()


def test_budget_full_degrades_with_one_warning(shm_dir):
    one = SharedMemoryStore("measure", 1)
    one[0] = item(0)
    size = one.stats()["stored"]["bytes"]
    one.release()
    store = SharedMemoryStore("budget", 10, budget=int(size * 3.5))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = [store.get_or_compute(i, lambda i=i: item(i)) for i in range(10)]
        again = [store.get_or_compute(i, lambda i=i: item(i)) for i in range(10)]
    full = [w for w in caught if issubclass(w.category, CacheFullWarning)]
    assert len(full) == 1, [str(w.message) for w in caught]
    assert "shm_budget" in str(full[0].message) and "--shm-size" in str(full[0].message)
    assert [o["index"] for o in out] == list(range(10)) == [o["index"] for o in again]
    stats = store.stats()
    assert stats["stored"]["entries"] == 3 and stats["total"]["skipped"] >= 7
    assert not any(n.endswith(".tmp") for n in os.listdir(store.path))
    store.release()


def test_small_tmpfs_running_out(tiny_tmpfs):
    store = SharedMemoryStore("tiny", 20, shm_dir=tiny_tmpfs, reserve=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = [store.get_or_compute(i, lambda i=i: {"x": torch.full((100_000,), float(i))}) for i in range(20)]
    assert [float(o["x"][0]) for o in out] == [float(i) for i in range(20)]
    full = [w for w in caught if issubclass(w.category, CacheFullWarning)]
    assert len(full) == 1
    entries = store.stats()["stored"]["entries"]
    assert 3 <= entries < 20  # 4 MiB hold some 400 KB entries, not all
    assert not any(n.endswith(".tmp") for n in os.listdir(store.path))
    for i in range(20):
        got = store[i]
        assert got is None or float(got["x"][-1]) == float(i)
    store.release()


def test_free_space_seen_once_is_trusted_only_within_its_bounds(tiny_tmpfs):
    """The tmpfs's free space is looked at again after ROOM_RECHECK_BYTES of this process's writes or
    ROOM_RECHECK_SECONDS: space that someone else takes meanwhile is then seen, and nothing more is let through."""
    store = SharedMemoryStore("room", 4, shm_dir=tiny_tmpfs, reserve=0)
    d, step = store._dir, 64 << 10
    assert d.room_for(step, 0)  # a fresh look: the 4 MiB tmpfs is nearly empty
    fd = os.open(os.path.join(tiny_tmpfs, "someone-else"), os.O_WRONLY | os.O_CREAT, 0o600)
    with pytest.raises(OSError):  # ENOSPC: it took every block left
        while True:
            os.write(fd, bytes(step))
    os.close(fd)
    let_through = 0
    while d.room_for(step, 0):
        let_through += 1
        assert let_through * step <= shm_directory.ROOM_RECHECK_BYTES, "the free space was not looked at again"
    time.sleep(shm_directory.ROOM_RECHECK_SECONDS)
    assert not d.room_for(step, 0)
    os.unlink(os.path.join(tiny_tmpfs, "someone-else"))
    time.sleep(shm_directory.ROOM_RECHECK_SECONDS)
    assert d.room_for(step, 0)  # and freed space is seen again
    store.release()


def test_pickled_store_reopens_same_cache(shm_dir):
    import pickle

    store = SharedMemoryStore("pickled", 2)
    store[1] = item(1)
    clone = pickle.loads(pickle.dumps(store))
    assert clone.path == store.path and clone[1]["name"] == "case1"
    clone.release()
    store.release()


class _StoreItems(torch.utils.data.Dataset):
    def __init__(self, store: SharedMemoryStore) -> None:
        self.store = store

    def __len__(self) -> int:
        return len(self.store)

    def __getitem__(self, i: int) -> int:
        return int(self.store[i]["index"])


def test_hits_are_counted_machine_wide_without_a_lock_per_read(shm_dir):
    """Each process counts its hits in a slot of its own: threads, forked DataLoader workers, independent
    processes, one killed, and one that finds every slot taken all add up to the machine-wide count."""
    import threading

    from monai_cache.runtime import ofd_lock

    n = 8
    store = SharedMemoryStore("hits", n)
    for i in range(n):
        store[i] = item(i)
    expected = 0

    def read_all(times: int) -> None:
        for _ in range(times):
            for i in range(n):
                assert store[i]["index"] == i

    threads = [threading.Thread(target=read_all, args=(200,)) for _ in range(4)]  # racing on one slot
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    expected += 4 * 200 * n
    assert store.stats()["process"]["hits"] == expected

    loader = torch.utils.data.DataLoader(_StoreItems(store), batch_size=2, num_workers=2,
                                         multiprocessing_context="fork")
    for _ in range(3):
        assert sorted(int(v) for batch in loader for v in batch) == list(range(n))
    expected += 3 * n

    reader = """
        import sys
        from monai_cache.shm import SharedMemoryStore
        s = SharedMemoryStore("hits", 8)
        for _ in range(int(sys.argv[1])):
            for i in range(8):
                assert s[i]["index"] == i
        print("read", flush=True)
        if sys.argv[2] == "wait":
            input()
    """
    killed = subprocess.Popen([PY, "-c", textwrap.dedent(reader), "5", "wait"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    assert killed.stdout.readline().strip() == "read"
    killed.kill()  # its slot is freed by the kernel; its count stays
    killed.wait(30)
    expected += 5 * n
    for _ in range(2):  # these reuse freed slots
        subprocess.run([PY, "-c", textwrap.dedent(reader), "3", "exit"], check=True, timeout=60)
        expected += 3 * n
    assert store.stats()["total"]["hits"] == expected

    # Every slot held by someone alive (as by hundreds of workers): a newcomer counts under the shared lock.
    stats_path = os.path.join(store.path, "stats")
    holder = os.open(stats_path, os.O_RDWR)
    try:
        for off in range(runtime.SLOTS_AT, runtime.COUNTERS_SIZE, 16):
            ofd_lock(holder, off, blocking=False)
        subprocess.run([PY, "-c", textwrap.dedent(reader), "4", "exit"], check=True, timeout=60)
        expected += 4 * n
        raw = open(stats_path, "rb").read()
        shared = runtime.unpack_counters(raw, shm_directory.FIELDS, slots=False)
        assert shared["hits"] == 4 * n  # the newcomer's hits, all in the shared field
    finally:
        os.close(holder)
    assert store.stats()["total"]["hits"] == expected
    assert list_caches()[0]["hits"] == expected  # `monai-cache ls` reads the file, slots included
    store.release()


GC_INSIDE_THE_LOCKS = """
import gc, os, sys
import torch
import monai_cache


def collect_inside_the_locks(frame, event, arg):
    # The cycle collector runs finalizers at any allocation; make it run (and release the unreachable
    # dataset's cache) at the worst moment: as a cache is joined or left, with the registry and root locks held.
    if event == "call" and frame.f_code.co_name in ("_join", "leave"):
        gc.collect()


data = [{"x": torch.tensor(float(i))} for i in range(3)]
gc.disable()
for round_ in range(5):
    ds = monai_cache.CacheDataset(data, progress=False, cache_key=f"garbage{round_}")
    ds.self_cycle = ds  # unreachable after del: freed only by the cycle collector
    assert float(ds[2]["x"]) == 2.0
    del ds
    sys.setprofile(collect_inside_the_locks)
    other = monai_cache.CacheDataset(data, progress=False, cache_key=f"other{round_}")
    sys.setprofile(None)
    assert float(other[1]["x"]) == 1.0
    other.release()
gc.enable()
root = os.path.join(os.environ["MONAI_CACHE_SHM_DIR"], f"monai_cache-{os.getuid()}")
print(sorted(name for name in os.listdir(root) if not name.startswith(".")))
"""


def test_dataset_garbage_collected_while_a_cache_is_joined_does_not_deadlock(shm_dir):
    """Its finalizer releases its cache later, once this thread holds no lock (it hung before)."""
    r = subprocess.run(python_c(GC_INSIDE_THE_LOCKS), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"  # every cache released, the collected ones included


def test_remove_one_entry_frees_it_for_every_process(shm_dir):
    store = SharedMemoryStore("remove", 3)
    for i in range(3):
        store[i] = {"x": torch.full((300_000,), float(i))} if i == 0 else {"x": torch.arange(4) + i}
    held = store.stats()["stored"]
    assert store.remove(0) and store.remove(1) and not store.remove(1)  # the second time: nothing to remove
    assert not store.contains(0) and not store.contains(1) and store.contains(2)
    after = store.stats()["stored"]
    assert after["entries"] == held["entries"] - 2 == 1
    assert after["bytes"] < held["bytes"] - 1_000_000  # the large entry's file is gone at once
    other = SharedMemoryStore("remove", 3)  # another handle (as another process would have) sees the misses
    assert other[0] is None and other[1] is None and float(other[2]["x"][0]) == 2.0
    other.release()
    store.release()


@pytest.mark.parametrize("sizes", [[40, 300, 0, 16384, 24], [3] * 1500, [1 << 20, 7]])
def test_write_all_writes_every_chunk_in_order(shm_dir, sizes):
    """One ``pwritev`` for a few chunks, chunk by chunk past the kernel's 1024-buffer limit: the same bytes."""
    rng = np.random.default_rng(len(sizes))
    chunks = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in sizes]
    path = os.path.join(shm_dir, "write_all")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        assert runtime.write_all(fd, (memoryview(c) for c in chunks), 100) == sum(sizes)
        out = bytearray(sum(sizes))
        assert runtime.read_into(fd, memoryview(out), 100) == sum(sizes)
    finally:
        os.close(fd)
        os.unlink(path)
    assert bytes(out) == b"".join(chunks)


def test_freed_heap_is_given_back_only_when_memory_is_tight(shm_dir):
    """After a large entry is written, its freed heap is marked to be given back (malloc_trim before the next compute)
    only while the room left for the cache is under 64 times the entry: with room to spare, the pages given back were
    faulted in again by the next item (13 % of a CT volume's compute)."""
    item = {"image": torch.zeros(1 << 19)}  # 2 MiB: an entry file of its own
    runtime.release_freed_memory(force=True)
    ample = SharedMemoryStore("ample", 1)
    assert torch.equal(ample.get_or_compute(0, lambda: item)["image"], item["image"])
    assert ample.contains(0) and not runtime._freed_large
    st = os.statvfs(shm_dir)
    # about 4 MiB of room (whatever others write meanwhile: an entry that no longer fits is marked all the same)
    tight = SharedMemoryStore("tight", 1, reserve=st.f_bavail * st.f_frsize - (4 << 20))
    assert torch.equal(tight.get_or_compute(0, lambda: item)["image"], item["image"])
    assert runtime._freed_large
    runtime.release_freed_memory()
    assert not runtime._freed_large
    ample.release()
    tight.release()


def marked(i: int, by: int, nbytes: int = 0) -> dict:
    """Entry ``i`` as process ``by`` computes it (``nbytes``: an image that large, for an entry of its own). Made by
    numpy: torch fills a large tensor with its OpenMP threads, which a process forked after using them waits for
    forever."""
    return {"image": torch.from_numpy(np.zeros(max(nbytes // 4, 1), np.float32)), "index": i, "by": by}


def _run_sides(side, n: int = 2, timeout: float = 60) -> None:
    """Run ``side(me)`` in ``n`` forked processes; fail if one hangs or fails."""
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=side, args=(me,)) for me in range(n)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    hung = [p.pid for p in procs if p.is_alive()]
    for p in procs:
        p.kill()
    assert not hung, "a process hung"
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]


def test_an_untouched_batch_counts_its_misses_when_its_cache_is_gone_before_it_ends(shm_dir):
    """``publishing_batch(untouched=True)`` encodes its misses when it ends; released meanwhile, it publishes
    nothing, and its misses are counted all the same."""
    store = SharedMemoryStore("gone", 2)
    with store.publishing_batch(untouched=True):
        for i in range(2):
            assert store.get_or_compute(i, lambda i=i: marked(i, 0), reuse_computed=True, missing=True)["by"] == 0
        store.release()
    assert store.stats()["process"]["misses"] == 2


def test_batches_of_two_processes_that_miss_each_others_staged_entry_publish_each_entry_once(shm_dir):
    """Within ``publishing_batch`` a miss takes no entry lock, and its entry stays unpublished until the batch
    ends. Two processes, each holding one staged entry and then missing the other's, compute it too rather than
    wait: the batch that publishes first has computed both and publishes both (a compare-and-set of each slot),
    the other's are counted skipped, and every read afterwards, in either process, gives the first batch's values."""
    ctx = multiprocessing.get_context("fork")
    staged, ended = [ctx.Event(), ctx.Event()], [ctx.Event(), ctx.Event()]
    results = ctx.Queue()

    def side(me: int) -> None:
        store = SharedMemoryStore("crossed", 2)
        with store.publishing_batch():
            assert store.get_or_compute(me, lambda: marked(me, me), reuse_computed=True)["by"] == me
            staged[me].set()
            assert staged[1 - me].wait(30)
            second = store.get_or_compute(1 - me, lambda: marked(1 - me, me), reuse_computed=True)["by"]
        ended[me].set()
        assert ended[1 - me].wait(30)
        process = store.stats()["process"]
        results.put((me, second, process["misses"], process["skipped"], [store[i]["by"] for i in (0, 1)]))
        store.release()

    _run_sides(side)
    got = sorted(results.get(timeout=5) for _ in range(2))
    first = got[0][4][0]  # the batch that published first
    assert all(read == [first, first] for *_, read in got), got  # one value per entry, the same in both processes
    for me, second, misses, skipped, _ in got:
        assert second in (me, first)  # its own computation, or a hit on the first batch's entry
        assert misses == (2 if second == me else 1) and skipped == (0 if me == first else misses), got


def test_an_entry_a_batch_published_first_stands_against_one_computed_under_its_lock(shm_dir):
    """A process computing entry 0 outside a batch (under its lock) while another's batch computes, stages and
    publishes it: the batch's entry stands; the locked computation is not published over it (counted skipped)
    and hands out what it computed, equal to the entry for a deterministic chain."""
    ctx = multiprocessing.get_context("fork")
    computing, published = ctx.Event(), ctx.Event()
    results = ctx.Queue()

    def side(me: int) -> None:
        store = SharedMemoryStore("cas", 1)
        if me == 0:  # outside a batch: holds entry 0's lock while it computes, until the batch has published

            def slow() -> dict:
                computing.set()
                assert published.wait(30)
                return marked(0, me)

            got = store.get_or_compute(0, slow, reuse_computed=True)["by"]
        else:
            assert computing.wait(30)
            with store.publishing_batch():
                got = store.get_or_compute(0, lambda: marked(0, me), reuse_computed=True)["by"]
            published.set()
        results.put((me, got, store.stats()["process"]["skipped"], store[0]["by"]))
        store.release()

    _run_sides(side)
    assert sorted(results.get(timeout=5) for _ in range(2)) == [(0, 0, 1, 1), (1, 1, 0, 1)]


def test_a_large_entry_two_batches_compute_at_once_is_published_once_and_reads_cleanly(shm_dir):
    """A large entry (a file of its own) computed by two batches at the same moment: each is renamed into place
    under the entry's lock, so the loser neither replaces the winner's file nor removes it; every read afterwards
    accepts the entry (no corrupt-entry warning) and gives the winner's values."""
    ctx = multiprocessing.get_context("fork")
    both, both_publishing = ctx.Barrier(2), ctx.Barrier(2)
    results = ctx.Queue()
    nbytes = 2 * shm_directory.STANDALONE_MIN
    publish = SharedMemoryStore._publish

    def publish_together(self, *args, **kwargs):  # widen the race: both write at once, if the lock lets them
        with contextlib.suppress(threading.BrokenBarrierError):
            both_publishing.wait(1)  # the lock lets one through: it waits a second alone
        return publish(self, *args, **kwargs)

    def side(me: int) -> None:
        SharedMemoryStore._publish = publish_together  # in this forked process only
        store = SharedMemoryStore("large", 1)

        def compute() -> dict:
            both.wait(30)  # both computing: neither has published
            return marked(0, me, nbytes)

        with warnings.catch_warnings():
            warnings.simplefilter("error", CorruptEntryWarning)  # one fails the process
            with store.publishing_batch():
                store.get_or_compute(0, compute, reuse_computed=True)
            both.wait(30)
            reads = [store[0]["by"] for _ in range(3)]
        results.put((me, store.stats()["process"]["skipped"], reads, sorted(os.listdir(store.path))))
        store.release()

    _run_sides(side)
    got = sorted(results.get(timeout=5) for _ in range(2))
    winner = got[0][2][0]
    assert [r for *_, r, _ in got] == [[winner] * 3] * 2
    assert sorted(skipped for _, skipped, _, _ in got) == [0, 1]
    assert [f for f in got[0][3] if f.endswith(".e") or f.endswith(".tmp")] == ["0.e"]
