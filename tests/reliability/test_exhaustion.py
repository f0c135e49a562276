"""Running out of room mid-training: a full shared-memory tmpfs, a full disk, a cache directory remounted
read-only. Training must continue uncached with exactly one warning (from all workers together), return
the right items throughout, and leave nothing partial behind.

Every file system here is a real, size-limited tmpfs mounted for the test (skipped where mounting is not
allowed); the trainers are forked processes with two real DataLoader workers each.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import signal
import warnings

import torch

from monai_cache import codec
from monai_cache.dataset import CacheDataset
from monai_cache.disk import DiskStore
from monai_cache.disk_format import read_entry, read_packed
from monai_cache.persistent import PersistentDataset
from monai_cache.runtime import sweep_temp_files, temp_owner
from monai_cache.shm import SharedMemoryStore, cache_root

from ._harness import (
    MakeItem,
    Tally,
    batch_problem,
    data_list,
    fill,
    item_problem,
    join_or_kill,
    remount,
    temp_files,
    tmpfs,
    tree_bytes,
    tree_files,
)

FORK = multiprocessing.get_context("fork")
_STANDALONE = 0xFFFFFFFF


def _train(build, epochs: int, sizes, log: str, on_batch=None, finish=None) -> None:
    """Body of a forked trainer: DataLoader with two forked workers, every item checked.

    Every warning of this process and of its workers is appended to ``log`` (one line each); the items checked
    and the wrong ones are counted into ``<log>.counts`` (JSON) at the end. Exits 3 if an item was wrong.
    """
    from monai.data import DataLoader

    torch.set_num_threads(1)
    warnings.resetwarnings()
    warnings.simplefilter("always")

    def show(message, category, filename, lineno, file=None, line=None):
        fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        os.write(fd, (f"{os.getpid()} {category.__name__}: {message}".replace("\n", " ") + "\n").encode())
        os.close(fd)

    warnings.showwarning = show
    ds = build()
    g = torch.Generator().manual_seed(0)
    checked = wrong = 0
    for epoch in range(epochs):
        for k, batch in enumerate(DataLoader(ds, batch_size=1, shuffle=True, generator=g, num_workers=2)):
            checked += len(batch["i"])
            wrong += batch_problem(batch, sizes) is not None
            if on_batch is not None:
                on_batch(epoch, k)
    with open(log + ".counts", "w") as f:
        json.dump({"items_checked": checked, "wrong_items": wrong}, f)
    if finish is not None:
        finish(ds)
    if wrong:
        os._exit(3)


def run_trainer(build, epochs: int, sizes, log: str, on_batch=None, finish=None, timeout: float = 240.0) -> dict:
    """Run :func:`_train` in a forked process: its ``exit_code`` (None: it hung and was killed after ``timeout``
    seconds) and what it counted (``items_checked``, ``wrong_items``; None if it did not get that far)."""
    p = FORK.Process(target=_train, args=(build, epochs, sizes, log, on_batch, finish))
    p.start()
    counts = {"exit_code": join_or_kill(p, timeout), "items_checked": None, "wrong_items": None}
    if os.path.exists(log + ".counts"):
        with open(log + ".counts") as f:
            counts.update(json.load(f))
    return counts


def check_trainer(t: Tally, run: dict) -> None:
    """Count the trainer's figures into ``t``: whether it hung, its items checked and wrong, its exit code."""
    t.add("hung", run["exit_code"] is None)
    t.add("items_checked", run["items_checked"] or 0)
    t.add("wrong_items", run["wrong_items"] or 0)
    t.check(run["exit_code"] == 0, f"trainer exit code {run['exit_code']} (3: a wrong item; None: it hung)")


def monai_cache_warnings(log: str) -> list[str]:
    if not os.path.exists(log):
        return []
    with open(log) as f:
        return [line for line in f if "monai_cache" in line]


def shm_layout_problems(store: SharedMemoryStore, n: int) -> tuple[int, int, list[str]]:
    """(entries, unreferenced bytes in segments, problems) of a shared-memory cache directory at rest:
    no temporary file, no entry file without its slot, every published entry complete and right."""
    problems, pages, entries = [], {}, 0
    names = os.listdir(store.path)
    problems += [f"temporary file left: {x}" for x in names if temp_owner(x) is not None]
    for i in range(n):
        slot = store._dir.read_slot(i)
        if slot is None:
            if f"{i}.e" in names:
                problems.append(f"{i}.e has no index slot (an orphaned entry file)")
            continue
        seg, offset, length, _tag = slot
        if seg != _STANDALONE:
            pages.setdefault(seg, set()).update(range(offset // 4096, (offset + length - 1) // 4096 + 1))
        entries += 1
        got = store[i]
        if got is None or item_problem(got, i):
            problems.append(f"entry {i} is published but not right")
    allocated = {int(x[2:]): os.stat(os.path.join(store.path, x)).st_blocks * 512 for x in names if x.startswith("s.")}
    unreferenced = sum(max(0, allocated[s] - 4096 * len(pages.get(s, ()))) for s in allocated)
    return entries, unreferenced, problems


# ------------------------------------------------------------------------------------ shared memory
def test_shared_memory_runs_out_mid_epoch(tmp_path):
    """Another job eats the shared memory in the middle of epoch 1: training carries on uncached."""
    n = 24
    with tmpfs(str(tmp_path / "shm"), "size=16m") as shm:
        def build():
            return CacheDataset(data_list(n), MakeItem(), runtime_cache=True, cache_key="exhaustion",
                                progress=False, shm_dir=shm)

        reader = build()  # holds the cache open so it can be inspected after the trainer exits
        store = reader._cache
        log = str(tmp_path / "warnings.log")
        filler = str(tmp_path / "filler-path")

        def eat_shm(epoch: int, k: int) -> None:
            if epoch == 0 and k == 5:
                with open(filler, "w") as f:
                    f.write(fill(shm, leave=0))

        t = Tally("exhaustion/shm-mid-epoch", "hung", "items_checked", "wrong_items", epochs=3, items=n)
        check_trainer(t, run_trainer(build, 3, None, log, eat_shm, lambda ds: ds.release()))
        full = monai_cache_warnings(log)
        t.check(len(full) == 1 and "full" in full[0], full)
        t.check(full and "--shm-size" in full[0] and "shm_budget" in full[0], full)  # says what to do
        entries, unreferenced, problems = shm_layout_problems(store, n)
        t.check(not problems, problems)
        machine = store.stats()["total"]  # every process of the machine
        t.check(1 <= entries < n and machine["skipped"] >= 1 and machine["corrupt"] == 0, (entries, machine))
        # partial writes that hit ENOSPC leave no allocated bytes behind (posix_fallocate fails cleanly)
        segments = sum(1 for x in os.listdir(store.path) if x.startswith("s."))
        t.check(unreferenced <= 4096 * segments, f"{unreferenced} unreferenced bytes in {segments} segments")
        with open(filler) as f:
            os.unlink(f.read())
        reader.release()
        leftovers = tree_files(shm)
        leaked = tree_bytes(shm)
        t.check(leftovers == [f"{os.path.basename(cache_root(shm))}/.lock"] and leaked == 0, leftovers)
        t.record(entries_cached=entries, skipped=machine["skipped"], corrupt=machine["corrupt"], warnings=len(full),
                 layout_problems=len(problems), unreferenced_bytes=unreferenced, files_left=len(leftovers) - 1,
                 bytes_leaked=leaked)
        t.assert_clean("hung", "wrong_items", "corrupt", "layout_problems", "files_left", "bytes_leaked")


def test_shared_memory_already_full_when_a_dataset_is_built(tmp_path):
    """/dev/shm already full (another job) when a rank builds its dataset: it must train uncached, not die."""
    with tmpfs(str(tmp_path / "shm"), "size=1m") as shm:
        fill(shm, leave=0)
        assert os.statvfs(shm).f_bavail == 0
        log = str(tmp_path / "warnings.log")

        def build():
            return CacheDataset(data_list(4, 1000), MakeItem(), runtime_cache=True, cache_key="full-at-start",
                                progress=False, shm_dir=shm)

        t = Tally("exhaustion/shm-full-at-start", "hung", "items_checked", "wrong_items", epochs=1, items=4)
        run = run_trainer(build, 1, dict.fromkeys(range(4), 1000), log, timeout=120)
        sigbus = run["exit_code"] == -signal.SIGBUS
        t.check(not sigbus, "the trainer was killed by SIGBUS")
        check_trainer(t, run)
        msgs = monai_cache_warnings(log)
        t.check(len(msgs) == 1, msgs)
        t.record(killed_by_sigbus=int(sigbus), warnings=len(msgs))
        t.assert_clean("hung", "wrong_items", "killed_by_sigbus")


def test_budget_smaller_than_an_item_serves_everything_uncached(shm_dir, tmp_path):
    """A budget too small for even one item: nothing cached, every item right, one warning, no file left."""
    log = str(tmp_path / "warnings.log")
    n = 8

    def build():
        return CacheDataset(data_list(n), MakeItem(), runtime_cache=True, cache_key="tiny-budget", progress=False,
                            shm_dir=shm_dir, shm_budget=1000)

    t = Tally("exhaustion/shm-budget-below-one-item", "hung", "items_checked", "wrong_items", epochs=2, items=n)
    check_trainer(t, run_trainer(build, 2, None, log, None, lambda ds: ds.release()))
    msgs = monai_cache_warnings(log)
    t.check(len(msgs) == 1 and "budget reached" in msgs[0], msgs)
    leftovers = tree_files(shm_dir)
    t.check(leftovers == [f"{os.path.basename(cache_root(shm_dir))}/.lock"], leftovers)
    t.record(warnings=len(msgs), files_left=len(leftovers) - 1)
    t.assert_clean("hung", "wrong_items", "files_left")


# --------------------------------------------------------------------------------------------- disk
def _check_disk_dir(cache_dir: str, ds: PersistentDataset, n: int, size: int) -> tuple[int, list[str], list[str]]:
    """(entries stored, temporary files, problems): every entry file or packed record found for an item must be
    right."""
    problems, files = [], 0
    for i in range(n):
        where = ds.entry_location(i)
        if where is None:
            continue
        files += 1
        try:
            got = read_packed(where) if where.packed else read_entry(where.path)
            problem = item_problem(got, i, size)
        except codec.CorruptEntryError as e:
            problem = f"{os.path.basename(where.path)}@{where.offset}: {e}"
        if problem:
            problems.append(problem)
    return files, temp_files(cache_dir), problems


def test_disk_fills_up_mid_epoch(tmp_path):
    """The disk fills up during epoch 1 (writes of two workers): one warning, training goes on uncached.

    Uncompressed files, so that each item takes its own 400 KB on the disk; the disk filling up while zstd is
    writing (an ENOSPC inside the compressor, once a ZstdError, fixed in d790492) is
    test_disk_full_while_compressing_is_reported_as_disk_full below.
    """
    n, size = 24, 100_000  # 400 KB of random floats each: about 7 fit in 3 MiB
    sizes = dict.fromkeys(range(n), size)
    with tmpfs(str(tmp_path / "disk"), "size=3m") as cache_dir:
        def build():
            return PersistentDataset(data_list(n, size), MakeItem(), cache_dir=cache_dir, compression=None)

        log = str(tmp_path / "warnings.log")
        t = Tally("exhaustion/disk-full-mid-epoch", "hung", "items_checked", "wrong_items", epochs=3, items=n)
        check_trainer(t, run_trainer(build, 3, sizes, log, None, lambda ds: ds.flush()))
        msgs = monai_cache_warnings(log)
        t.check(len(msgs) == 1 and "is full" in msgs[0] and "cache_dir" in msgs[0], msgs)
        left_by_trainer = temp_files(cache_dir)  # before a new dataset sweeps what dead writers left
        files, temp, problems = _check_disk_dir(cache_dir, build(), n, size)
        t.check(not temp and not problems, (temp, problems))
        t.check(1 <= files < n, f"{files} files written")
        t.record(files_written=files, warnings=len(msgs), wrong_entries=len(problems),
                 temp_files_left_by_trainer=len(left_by_trainer), partial_files=len(temp))
        t.assert_clean("hung", "wrong_items", "wrong_entries", "partial_files")


def test_disk_full_while_compressing_is_reported_as_disk_full(tmp_path):
    outcomes = []
    with tmpfs(str(tmp_path / "disk"), "size=3m") as mnt:
        for k, floats in enumerate((100_000, 107_000, 114_000, 121_000)):
            d = os.path.join(mnt, f"d{k}")
            os.makedirs(d)
            store = DiskStore(d, async_writes=False)  # compression="zstd", the default
            g = torch.Generator().manual_seed(k)
            with warnings.catch_warnings(record=True) as rec:
                warnings.simplefilter("always")
                try:
                    for i in range(8):  # 8 x 400+ KB of random floats do not fit in 3 MiB
                        store.put(f"k{i}", {"x": torch.randn(floats, generator=g)})
                    raised = None
                except Exception as e:
                    raised = repr(e)
            msgs = [str(w.message) for w in rec if "monai_cache" in str(w.message)]
            outcomes.append((floats, raised, len(msgs), store.writes_disabled is not None))
            assert not any(n.endswith(".tmp") for n in os.listdir(d))  # never anything partial
            shutil.rmtree(d)
    assert all(raised is None and warned == 1 and disabled for _, raised, warned, disabled in outcomes), outcomes


def test_cache_dir_remounted_read_only_mid_epoch(tmp_path):
    n, size = 16, 50_000
    sizes = dict.fromkeys(range(n), size)
    with tmpfs(str(tmp_path / "disk"), "size=64m") as cache_dir:
        def build():
            return PersistentDataset(data_list(n, size), MakeItem(), cache_dir=cache_dir)

        def go_read_only(epoch: int, k: int) -> None:
            if epoch == 0 and k == 6:
                remount(cache_dir, "ro")

        log = str(tmp_path / "warnings.log")
        t = Tally("exhaustion/disk-read-only-mid-epoch", "hung", "items_checked", "wrong_items", epochs=3, items=n)
        check_trainer(t, run_trainer(build, 3, sizes, log, go_read_only, lambda ds: ds.flush()))
        msgs = monai_cache_warnings(log)
        t.check(len(msgs) == 1 and "cannot write" in msgs[0] and "cache_dir" in msgs[0], msgs)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "cannot write files in the cache directory": right, and expected
            reader = build()  # read-only now: reading works, nothing is written or removed
        files, temp_before, problems = _check_disk_dir(cache_dir, reader, n, size)
        t.check(not problems and 1 <= files < n, (files, problems))
        remount(cache_dir, "rw")
        swept = sweep_temp_files(cache_dir)  # what the next PersistentDataset does: a killed or stopped writer's
        files_after, temp, problems_after = _check_disk_dir(cache_dir, build(), n, size)  # leftovers
        t.check(not temp and not problems_after and files_after == files, (files_after, temp, problems_after))
        t.record(files_written=files, warnings=len(msgs), wrong_entries=len(problems) + len(problems_after),
                 temp_files_while_read_only=len(temp_before), swept=len(swept), partial_files=len(temp))
        t.assert_clean("hung", "wrong_items", "wrong_entries", "partial_files")
