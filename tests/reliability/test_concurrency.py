"""Many processes (8, plus this one) reading and writing one cache at once for several epochs, with the
cache invalidated under them at every epoch: every read must return exactly the right item.

The processes are forked, independent of each other (each builds its own dataset, as DDP ranks do) and
started together; each visits every item once per epoch in its own random order. At the start of each
epoch one of them wipes the cache (``clear()`` of the shared-memory entries, deleting the cache files), so
entries are being recomputed, published, read and removed concurrently throughout.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import random
import signal
import time
import warnings

import torch

from monai_cache.dataset import CacheDataset
from monai_cache.disk_format import read_entry, read_packed
from monai_cache.persistent import PersistentDataset
from monai_cache.shm import cache_root

from ._harness import MakeItem, data_list, env_int, item_problem, record, tree_bytes, tree_files

FORK = multiprocessing.get_context("fork")
PROCESSES = env_int("MONAI_CACHE_RELIABILITY_PROCESSES", 8)
EPOCHS = env_int("MONAI_CACHE_RELIABILITY_EPOCHS", 6)
N_ITEMS = 32


def _participant(k: int, build, wipe, go, out: str) -> None:
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    ds = build()
    rng = random.Random(1000 + k)
    reads = wrong = 0
    problems = []
    go.wait(60)
    for epoch in range(EPOCHS):
        if epoch % PROCESSES == k:
            wipe(ds)
        order = list(range(N_ITEMS))
        rng.shuffle(order)
        for i in order:
            problem = item_problem(ds[i], i)
            reads += 1
            if problem:
                wrong += 1
                problems.append(problem)
    if isinstance(ds, CacheDataset):
        stats = ds.cache_stats()["process"]
        ds.release()
    else:
        ds.flush()
        stats = ds.cache_stats()["process"]
    with open(out, "w") as f:
        json.dump({"reads": reads, "wrong": wrong, "problems": problems[:5], "stats": stats}, f)


def run_participants(build, wipe, tmp_path) -> list[dict]:
    go = FORK.Event()
    outs = [str(tmp_path / f"p{k}.json") for k in range(PROCESSES)]
    procs = [FORK.Process(target=_participant, args=(k, build, wipe, go, outs[k])) for k in range(PROCESSES)]
    for p in procs:
        p.start()
    time.sleep(0.2)
    go.set()
    deadline = time.monotonic() + 240
    for p in procs:
        p.join(max(1.0, deadline - time.monotonic()))
    hung = [p.pid for p in procs if p.is_alive()]
    for p in procs:
        if p.is_alive():
            os.kill(p.pid, signal.SIGKILL)
            p.join()
    assert not hung, f"processes {hung} did not finish (blocked?)"
    assert [p.exitcode for p in procs] == [0] * PROCESSES
    results = []
    for out in outs:
        with open(out) as f:
            results.append(json.load(f))
    return results


def test_many_processes_share_one_shared_memory_cache(shm_dir, tmp_path):
    def build():
        return CacheDataset(data_list(N_ITEMS), MakeItem(), runtime_cache=True, cache_key="many", progress=False,
                            shm_dir=shm_dir)

    def wipe(ds):
        ds._cache.clear()

    watcher = build()  # holds the cache open, to inspect it afterwards
    t0 = time.monotonic()
    results = run_participants(build, wipe, tmp_path)
    seconds = time.monotonic() - t0
    reads = sum(r["reads"] for r in results)
    wrong = sum(r["wrong"] for r in results)
    assert wrong == 0, [r["problems"] for r in results if r["problems"]]
    machine = watcher.cache_stats()["total"]
    assert machine["corrupt"] == 0
    hits = sum(r["stats"]["hits"] for r in results)
    misses = sum(r["stats"]["misses"] for r in results)
    # every wipe forces recomputation, but an entry is computed once per wipe at most (not once per process)
    wipes = min(EPOCHS, PROCESSES)
    assert misses <= N_ITEMS * (wipes + 1), misses
    for i in range(N_ITEMS):
        got = watcher._cache[i]
        assert got is None or item_problem(got, i) is None
    watcher.release()
    leftovers = tree_files(cache_root(shm_dir, create=False))
    assert leftovers == [".lock"] and tree_bytes(shm_dir) == 0, leftovers
    record("concurrency/shm", processes=PROCESSES, epochs=EPOCHS, items=N_ITEMS, reads_checked=reads, wrong=wrong,
           hits=hits, misses=misses, wipes=wipes, corrupt=machine["corrupt"], bytes_leaked=0,
           seconds=round(seconds, 1), failures=0)


def test_many_processes_share_one_disk_cache(tmp_path):
    cache_dir = str(tmp_path / "cache")

    def build():
        return PersistentDataset(data_list(N_ITEMS), MakeItem(), cache_dir=cache_dir)

    def wipe(ds):
        for i in range(N_ITEMS):  # the entry file, or the pack holding the record (and other entries)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(ds.entry_path(i))

    ref = build()
    t0 = time.monotonic()
    results = run_participants(build, wipe, tmp_path)
    seconds = time.monotonic() - t0
    reads = sum(r["reads"] for r in results)
    wrong = sum(r["wrong"] for r in results)
    assert wrong == 0, [r["problems"] for r in results if r["problems"]]
    corrupt = sum(r["stats"]["corrupt"] for r in results)
    assert corrupt == 0
    names = os.listdir(cache_dir)
    assert not [n for n in names if n.endswith(".tmp")], names
    files = 0
    for i in range(N_ITEMS):
        where = ref.entry_location(i)
        if where is not None:
            files += 1
            got = read_packed(where) if where.packed else read_entry(where.path)
            assert item_problem(got, i) is None
    assert files == N_ITEMS  # the last epoch wrote everything back and every process flushed at the end
    record("concurrency/disk", processes=PROCESSES, epochs=EPOCHS, items=N_ITEMS, reads_checked=reads, wrong=wrong,
           hits=sum(r["stats"]["hits"] for r in results), writes=sum(r["stats"]["writes"] for r in results),
           corrupt=corrupt, temp_files_left=0, seconds=round(seconds, 1), failures=0)
