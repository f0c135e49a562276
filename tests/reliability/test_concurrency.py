"""Many processes (8, plus this one) reading and writing one cache at once for several epochs, with the
cache invalidated under them at every epoch: every read must return exactly the right item.

The processes are forked, independent of each other (each builds its own dataset, as DDP ranks do) and
started together; each visits every item once per epoch in its own random order (half of those sharing the
shared-memory cache in batches of 4, through ``__getitems__`` as a DataLoader's fetcher reads: misses that take no
entry lock and are published together). At the start of each epoch one of them wipes the cache (``clear()`` of the
shared-memory entries, deleting the cache files), so entries are being recomputed, published, read and removed
concurrently throughout.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import random
import time
import warnings

import torch

from monai_cache.dataset import CacheDataset
from monai_cache.disk_format import read_entry, read_packed
from monai_cache.persistent import PersistentDataset
from monai_cache.shm import cache_root

from ._harness import (
    MakeItem,
    Tally,
    data_list,
    env_int,
    item_problem,
    join_or_kill,
    temp_files,
    tree_bytes,
    tree_files,
)

FORK = multiprocessing.get_context("fork")
PROCESSES = env_int("MONAI_CACHE_RELIABILITY_PROCESSES", 8)
EPOCHS = env_int("MONAI_CACHE_RELIABILITY_EPOCHS", 6)
N_ITEMS = 32


def _participant(k: int, build, wipe, go, out: str) -> None:
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    ds = build()
    rng = random.Random(1000 + k)
    reads = wrong = wipes = 0
    problems = []
    go.wait(60)
    for epoch in range(EPOCHS):
        if epoch % PROCESSES == k:
            wipe(ds)
            wipes += 1
        order = list(range(N_ITEMS))
        rng.shuffle(order)
        size = 4 if isinstance(ds, CacheDataset) and k % 2 else 1
        for start in range(0, N_ITEMS, size):
            indices = order[start : start + size]
            for i, got in zip(indices, ds.__getitems__(indices) if size > 1 else [ds[indices[0]]]):
                problem = item_problem(got, i)
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
        json.dump({"reads": reads, "wrong": wrong, "wipes": wipes, "problems": problems[:5], "stats": stats}, f)


def run_participants(t: Tally, build, wipe, tmp_path) -> list[dict]:
    """Run the processes; count those that hung (``hung``, killed after 240 s) or failed (``crashed``: an exit code
    other than 0) and add up what the others counted (``reads_checked``, ``wrong``, ``wipes``)."""
    go = FORK.Event()
    outs = [str(tmp_path / f"p{k}.json") for k in range(PROCESSES)]
    procs = [FORK.Process(target=_participant, args=(k, build, wipe, go, outs[k])) for k in range(PROCESSES)]
    for p in procs:
        p.start()
    time.sleep(0.2)
    go.set()
    deadline = time.monotonic() + 240
    codes = [join_or_kill(p, max(1.0, deadline - time.monotonic())) for p in procs]
    hung = [p.pid for p, code in zip(procs, codes) if code is None]
    t.add("hung", len(hung))
    t.check(not hung, f"processes {hung} did not finish (blocked?)")
    t.add("crashed", sum(code not in (0, None) for code in codes))
    t.check(codes == [0] * PROCESSES, f"exit codes {codes}")
    results = []
    for out in outs:
        if os.path.exists(out):
            with open(out) as f:
                results.append(json.load(f))
    t.add("reads_checked", sum(r["reads"] for r in results))
    t.add("wrong", sum(r["wrong"] for r in results))
    t.add("wipes", sum(r["wipes"] for r in results))
    t.check(t.figures["wrong"] == 0, [r["problems"] for r in results if r["problems"]])
    return results


def test_many_processes_share_one_shared_memory_cache(shm_dir, tmp_path):
    def build():
        return CacheDataset(data_list(N_ITEMS), MakeItem(), runtime_cache=True, cache_key="many", progress=False,
                            shm_dir=shm_dir)

    def wipe(ds):
        ds._cache.clear()

    t = Tally("concurrency/shm", "hung", "crashed", "reads_checked", "wrong", "wipes", "wrong_after",
              processes=PROCESSES, epochs=EPOCHS, items=N_ITEMS)
    watcher = build()  # holds the cache open, to inspect it afterwards
    t0 = time.monotonic()
    results = run_participants(t, build, wipe, tmp_path)
    seconds = time.monotonic() - t0
    machine = watcher.cache_stats()["total"]
    t.check(machine["corrupt"] == 0, f"{machine['corrupt']} corrupt entries")
    hits = sum(r["stats"]["hits"] for r in results)
    misses = sum(r["stats"]["misses"] for r in results)
    skipped = sum(r["stats"]["skipped"] for r in results)  # computed by a batch while another process did too
    # every wipe forces recomputation, but an entry is published once per wipe at most (not once per process)
    t.check(misses - skipped <= N_ITEMS * (t.figures["wipes"] + 1),
            f"{misses} computations ({skipped} not published) for {t.figures['wipes']} wipes")
    for i in range(N_ITEMS):
        got = watcher._cache[i]
        t.add("wrong_after", got is not None and item_problem(got, i) is not None)
    t.check(t.figures["wrong_after"] == 0, "wrong entries in the cache after the run")
    watcher.release()
    leftovers = tree_files(cache_root(shm_dir, create=False))
    leaked = tree_bytes(shm_dir)
    t.check(leftovers == [".lock"] and leaked == 0, leftovers)
    t.record(hits=hits, misses=misses, skipped=skipped, corrupt=machine["corrupt"],
             files_left=len(leftovers) - (".lock" in leftovers),
             bytes_leaked=leaked, seconds=round(seconds, 1))
    t.assert_clean("hung", "crashed", "wrong", "wrong_after", "corrupt", "files_left", "bytes_leaked")


def test_many_processes_share_one_disk_cache(tmp_path):
    cache_dir = str(tmp_path / "cache")

    def build():
        return PersistentDataset(data_list(N_ITEMS), MakeItem(), cache_dir=cache_dir)

    def wipe(ds):
        # Writes still queued at a clear go with it (the files they were reserved in are gone): this process's
        # are written first, as they would be if it did not also clear, so that what it reads after the wipe is
        # stored at the end (the check after the run).
        ds.flush()
        for i in range(N_ITEMS):  # the entry file, or the pack holding the record (and other entries)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(ds.entry_path(i))

    t = Tally("concurrency/disk", "hung", "crashed", "reads_checked", "wrong", "wipes", "entries_after",
              "wrong_after", processes=PROCESSES, epochs=EPOCHS, items=N_ITEMS)
    ref = build()
    t0 = time.monotonic()
    results = run_participants(t, build, wipe, tmp_path)
    seconds = time.monotonic() - t0
    corrupt = sum(r["stats"]["corrupt"] for r in results)
    t.check(corrupt == 0, f"{corrupt} corrupt entries")
    temp = temp_files(cache_dir)
    t.check(not temp, temp)
    for i in range(N_ITEMS):
        where = ref.entry_location(i)
        if where is not None:
            t.add("entries_after")
            with t.trial(f"entry {i}"):
                got = read_packed(where) if where.packed else read_entry(where.path)
                t.add("wrong_after", item_problem(got, i) is not None)
    t.check(t.figures["wrong_after"] == 0, "wrong entries in the cache after the run")
    # the last epoch wrote everything back and every process flushed at the end
    t.check(t.figures["entries_after"] == N_ITEMS, f"{t.figures['entries_after']} of {N_ITEMS} entries stored")
    t.record(hits=sum(r["stats"]["hits"] for r in results), writes=sum(r["stats"]["writes"] for r in results),
             corrupt=corrupt, temp_files_left=len(temp), seconds=round(seconds, 1))
    t.assert_clean("hung", "crashed", "wrong", "wrong_after", "corrupt", "temp_files_left")
