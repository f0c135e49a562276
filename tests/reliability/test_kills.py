"""SIGKILL at random moments of DataLoader workers and of whole ranks while they write to the
shared-memory cache (CacheDataset) and to the disk cache (PersistentDataset).

Two forked ranks (one with persistent workers, one without), each with two real DataLoader workers, run
epochs forever and check every item they get. Before each trial the test invalidates the cache (clears
the shared-memory entries / deletes the cache files) so that the workers are writing when the kill comes;
after a seeded random delay it SIGKILLs one worker (its rank rebuilds the loader and carries on) or a whole
rank (its process group; a new rank is started); every tenth trial kills instead a worker it sees writing an
entry file, so that some kills surely land inside a write. After each trial every entry a fresh reader accepts is
compared with the item it must be; every tenth trial every rank must complete another epoch (nothing
blocks). At the end all ranks are killed at once, the stale cache they leave is reclaimed, and a next run
must complete and leave nothing behind.

``MONAI_CACHE_RELIABILITY_TRIALS`` (default 100 per store) and ``MONAI_CACHE_RELIABILITY_SEED`` set the
number of trials and the seed (the long form: ``MONAI_CACHE_RELIABILITY_TRIALS=1000``).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import random
import signal
import time
import warnings

import pytest
import torch
from helpers import freeze_watcher

from monai_cache import codec, disk_format, runtime
from monai_cache.dataset import CacheDataset
from monai_cache.disk import DiskStore
from monai_cache.disk_format import read_entry
from monai_cache.persistent import PersistentDataset
from monai_cache.runtime import OFDLock
from monai_cache.shm import SharedMemoryStore, cache_root, list_caches, remove_cache

from ._harness import (
    MakeItem,
    Tally,
    deadline,
    env_int,
    gone,
    item_problem,
    item_size,
    join_or_kill,
    kill_child_of,
    make_item,
    stacks,
    start_rank,
    temp_files,
    tree_bytes,
    tree_files,
)

FORK = multiprocessing.get_context("fork")


def _temp_of(name: str, pid: int) -> bool:
    """Whether ``name`` is a temporary file written by process ``pid``."""
    owner = runtime.temp_owner(name)
    return owner is not None and owner[1] == pid
TRIALS = env_int("MONAI_CACHE_RELIABILITY_TRIALS", 100)
SEED = env_int("MONAI_CACHE_RELIABILITY_SEED", 20_240)
N_ITEMS = 12
PROGRESS_EVERY = 10
AIM_EVERY = 10  # every tenth trial kills a worker it sees inside a write (waiting 0.5 s at most for one)
PROGRESS_TIMEOUT = 120.0

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


# ----------------------------------------------------------------------------------------- targets
def _names(directory: str) -> list[str]:
    try:
        return os.listdir(directory)
    except FileNotFoundError:
        return []


class ShmTarget:
    """CacheDataset(runtime_cache=True) in a shared-memory directory; the test process holds a reader.

    Every fourth item is 1.2 MB (a file of its own), the others 16 KiB (packed into segments)."""

    name = "shm"
    sizes = {i: item_size(i) for i in range(N_ITEMS)}

    def __init__(self, shm_dir: str) -> None:
        self.shm_dir = shm_dir
        self.seen: set[str] = set()
        self.reader = self.build()
        self.store: SharedMemoryStore = self.reader._cache  # type: ignore[assignment]
        self.verifier = SharedMemoryStore(self.store.key, N_ITEMS, shm_dir=shm_dir, verify=True)

    def build(self) -> CacheDataset:
        return CacheDataset(sized_data(self.sizes), MakeItem(), runtime_cache=True, cache_key="reliability-kills",
                            progress=False, shm_dir=self.shm_dir)

    def invalidate(self) -> None:
        self.store.clear()

    def dead_temp_files(self) -> set[str]:
        """Large entries that killed processes left half written (``runtime.temp_name``)."""
        return {n for n in os.listdir(self.store.path) if (o := runtime.temp_owner(n)) is not None and gone(o[1])}

    def writers(self) -> set[int]:
        """Processes writing a large entry now (they hold a temporary file of it)."""
        return {o[1] for n in _names(self.store.path) if (o := runtime.temp_owner(n)) is not None and not gone(o[1])}

    def mid_write(self) -> bool:
        """Whether this kill left a large entry half written."""
        new = self.dead_temp_files() - self.seen
        self.seen |= new
        return bool(new)

    def check(self) -> tuple[int, list[str]]:
        """(entries accepted, problems): every entry the default reader accepts must be exactly right, and
        must pass the full data checksum too."""
        accepted, problems = 0, []
        for i in range(N_ITEMS):
            got = self.store[i]
            if got is None:
                continue
            accepted += 1
            problem = item_problem(got, i, self.sizes[i])
            if problem:
                problems.append(problem)
            if self.verifier[i] is None:  # only this process clears entries: None means it failed the check
                problems.append(f"entry {i} accepted by the reader fails the data checksum")
        corrupt = self.store.stats()["total"]["corrupt"]
        if corrupt:
            problems.append(f"{corrupt} corrupt entries were found and removed")
        return accepted, problems

    def state(self) -> dict:
        """What the kills left in the live cache: bytes the counters account for, bytes actually allocated
        (segments of killed writers stay until the cache is removed), segment files."""
        names = os.listdir(self.store.path)
        dead = self.dead_temp_files()
        return {"accounted_bytes": self.store.stats()["stored"]["bytes"],
                "allocated_bytes": tree_bytes(self.store.path), "segments": sum(n.startswith("s.") for n in names),
                "dead_temp_files_in_live_cache": len(dead),
                "dead_temp_bytes_in_live_cache": sum(os.stat(os.path.join(self.store.path, n)).st_blocks * 512
                                                     for n in dead)}

    def release(self) -> None:
        # the whole job dies at once, the cache's watcher with it (a Slurm step's cgroup killed): nothing removes the
        # cache until the next process joins one (tests/test_ended_training.py: the watcher, when it lives on). It is
        # stopped now and killed once the ranks are (a rank's worker joining meanwhile finds it and starts none).
        self.watcher = freeze_watcher(self.store.path)
        self.verifier.release()
        self.reader.release()


class DiskTarget:
    """PersistentDataset (asynchronous writes) in a cache directory; the test process reads the entries.

    Every fourth item is 8 MB (a file of its own, which takes a while to write, so that kills land during
    writes), the others 16 KiB (records appended to each writer's pack)."""

    name = "disk"
    sizes = {i: 2_000_000 if i % 4 == 0 else 4096 for i in range(N_ITEMS)}

    def __init__(self, cache_dir: str) -> None:
        self.cache_dir = cache_dir
        self.seen: set[str] = set()
        self.reader = self.build()
        self.keys = [self.reader._entry_key(self.reader.data[i]) for i in range(N_ITEMS)]
        self.paths = [os.path.join(cache_dir, key + disk_format.ENTRY_SUFFIX) for key in self.keys]

    def build(self) -> PersistentDataset:
        return PersistentDataset(sized_data(self.sizes), MakeItem(), cache_dir=self.cache_dir)

    def invalidate(self) -> None:
        """Delete the entry files and the packs (with their indexes): every entry must be written again."""
        for name in os.listdir(self.cache_dir):
            if name.endswith(disk_format.ENTRY_SUFFIX) or disk_format.is_pack_file(name):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(self.cache_dir, name))

    def writers(self) -> set[int]:
        """Processes writing an entry file now (they hold a temporary file with bytes in it)."""
        found = set()
        for n in _names(self.cache_dir):
            owner = runtime.temp_owner(n)
            if owner is not None and not gone(owner[1]):
                with contextlib.suppress(FileNotFoundError):
                    if os.path.getsize(os.path.join(self.cache_dir, n)) > 0:
                        found.add(owner[1])
        return found

    def mid_write(self) -> bool:
        """Whether this kill left a file written into but not published (a temporary file, ``runtime.temp_name``,
        with bytes in it; one still empty was only reserved) or a record half appended (a pack of a dead writer
        with bytes after its last indexed record, or a torn index record)."""
        new = set()
        for n in os.listdir(self.cache_dir):
            owner = runtime.temp_owner(n)
            if owner is not None and gone(owner[1]):
                with contextlib.suppress(FileNotFoundError):
                    if os.path.getsize(os.path.join(self.cache_dir, n)) > 0:
                        new.add(n)
        for name in os.listdir(self.cache_dir):
            index_of_dead = name.endswith(disk_format.INDEX_SUFFIX) and disk_format.is_pack_file(name)
            if not index_of_dead or not gone(int(name.split(".")[2])):
                continue
            index = os.path.join(self.cache_dir, name)
            with contextlib.suppress(FileNotFoundError):
                records, pos, torn = disk_format.read_index(index)
                end = max((o + n for _, o, n, _, _ in records), default=0)
                pack = index[: -len(disk_format.INDEX_SUFFIX)] + disk_format.PACK_SUFFIX
                if torn or os.path.getsize(index) > pos or os.path.getsize(pack) > end:
                    new.add(name)
        new -= self.seen
        self.seen |= new
        return bool(new)

    def check(self) -> tuple[int, list[str]]:
        """(entries accepted, problems): every entry file, and every packed record an index points to, that a
        fresh reader finds must be complete and exactly right."""
        accepted, problems = 0, []
        store = DiskStore(self.cache_dir, writable=False)  # what a new process reads
        for i, key in enumerate(self.keys):
            where = store.location(key)
            if where is None:
                continue
            try:
                got = disk_format.read_packed(where) if where.packed else read_entry(where.path)
            except FileNotFoundError:
                continue  # removed meanwhile (a new rank's invalidation)
            except codec.CorruptEntryError as e:
                # rename-on-complete (files) and index-after-record (packs): nothing a reader finds is partial
                kind = f"indexed record at {where.offset} of {where.path}" if where.packed else "file under its name"
                problems.append(f"entry {i}: corrupt {kind} ({e})")
                continue
            accepted += 1
            problem = item_problem(got, i, self.sizes[i])
            if problem:
                problems.append(problem)
        return accepted, problems

    def state(self) -> dict:
        entries = list(disk_format.stored_entries(self.cache_dir))
        return {"files": sum(not e.packed for e in entries), "packed_entries": sum(e.packed for e in entries)}

    def release(self) -> None:
        pass


# ------------------------------------------------------------------------------------------ trials
def sized_data(sizes: dict[int, int]) -> list[dict]:
    return [{"i": i, "n": n} for i, n in sorted(sizes.items())]


def _final_run(target_factory, sizes: dict[int, int], epochs: int) -> None:
    """A next run after the crash: a fresh process, two workers, ``epochs`` complete epochs, exits normally."""
    from monai.data import DataLoader

    torch.set_num_threads(1)
    ds = target_factory()
    for _ in range(epochs):
        for batch in DataLoader(ds, batch_size=1, shuffle=True, num_workers=2):
            i = int(batch["i"][0])
            got = {"i": i, "image": batch["image"][0], "name": batch["name"][0],
                   "spacing": [float(s[0]) for s in batch["spacing"]]}
            if item_problem(got, i, sizes[i]):
                os._exit(3)
    if isinstance(ds, CacheDataset):
        ds.release()
    else:
        ds.flush()


def run_kill_trials(t: Tally, target, trials: int, seed: int) -> None:
    """Run the kill trials, counting into ``t``. A trial whose fresh reader finds a wrong or corrupt entry, a rank
    that reports a wrong item or an error, and a rank that makes no progress (``hangs``) are failed checks: the
    trials stop at the first, and the test records what it counted before it fails."""
    rng = random.Random(seed)
    incarnation = 0

    def new_rank(r: int):
        nonlocal incarnation
        incarnation += 1
        return start_rank(FORK, target.build, f"rank{r}", seed=seed * 1000 + incarnation, persistent=(r == 0),
                          sizes=target.sizes)

    def progress(r: int, epochs: int, when: str) -> bool:
        rank = ranks[r]
        ok = rank.wait_epochs(epochs, PROGRESS_TIMEOUT)
        stuck = not ok and not rank.failures  # no wrong item, no error: it is stuck
        where = stacks(rank.pid) if stuck else ""
        if stuck and torch_event_deadlock(where):
            # torch's own deadlock, not a cache's: counted, and the rank replaced as if it had been killed whole
            t.add("torch_event_deadlocks")
            print(f"{rank.name} {when}: torch's DataLoader deadlock on its workers' done_event; replaced", flush=True)
            rank.kill_group()
            finished.append(rank)
            ranks[r] = new_rank(r)
            return progress(r, 1, f"replacing {rank.name}, in its first epoch")
        t.add("hangs", stuck)
        if stuck:  # where: printed in full (the problem list keeps the start and the end)
            print(f"{rank.name} made no progress {when}; its stacks:\n{where}", flush=True)
        problem = f"{rank.name} made no progress {when}: {rank.failures}"
        return t.check(ok, problem + (f"; stacks: {where}" if stuck else ""))

    ranks = [new_rank(0), new_rank(1)]
    finished = []  # ranks killed whole: their counts
    t0 = time.monotonic()
    try:
        ok = all([progress(r, 1, "in its first epoch") for r in range(len(ranks))])
        while ok and t.figures["trials"] < trials:
            target.invalidate()
            # writes start as soon as the workers miss: half the kills come within 30 ms, the others within 200
            delay = rng.uniform(0.0, 0.03) if rng.random() < 0.5 else rng.uniform(0.0, 0.2)
            aim = t.figures["trials"] % AIM_EVERY == AIM_EVERY - 1  # (instead of the delay)
            time.sleep(0 if aim else delay)
            r = rng.randrange(2)
            rank = ranks[r]
            rank.pump()
            whole_rank = rng.random() >= 0.6
            aimed = worker_inside_a_write(target, ranks) if aim else None
            if aimed is not None:  # (the kill may still come a moment after that write ended)
                r, victim = aimed
                rank, whole_rank = ranks[r], False
                if not kill_child_of(rank.pid, victim):
                    continue
                t.add("worker_kills")
                t.add("aimed_kills")
            elif not whole_rank:
                if not rank.workers or not kill_child_of(rank.pid, rng.choice(rank.workers)):
                    continue  # that worker had already exited (end of epoch): draw again
                t.add("worker_kills")
            else:
                rank.kill_group()
                finished.append(rank)
                t.add("rank_kills")
            t.add("kills_mid_write", target.mid_write())  # (before a new rank sweeps the leftovers)
            if whole_rank:
                ranks[r] = new_rank(r)
            t.add("trials")
            accepted, found = target.check()
            t.add("entries_checked", N_ITEMS)
            t.add("entries_accepted", accepted)
            ok = t.check(not found, [f"trial {t.figures['trials']}: {p}" for p in found][:5])
            for rank in ranks:
                rank.pump()
            ok = ok and not any(rank.failures for rank in ranks)  # (counted below)
            if ok and t.figures["trials"] % PROGRESS_EVERY == 0:  # nothing blocks: every rank completes an epoch
                ok = all([progress(r, ranks[r].epochs + 1, f"after trial {t.figures['trials']}")
                          for r in range(len(ranks))])
                t.add("progress_checks", ok)
        t.figures.update(target.state())
        # The whole job dies: this process lets go of the cache first, so that nobody holds it when the
        # ranks and their workers are killed together.
        target.release()
    finally:
        for rank in ranks:
            rank.stop()
    every = finished + ranks
    t.add("items_checked_by_ranks", sum(r.checked for r in every))
    t.add("epochs_completed", sum(r.epochs for r in every))
    t.add("worker_deaths_seen", sum(r.worker_deaths for r in every))
    reported = [line for r in every for line in r.failures]  # F: a wrong item, X: an error
    t.add("wrong_items_or_errors_in_ranks", len(reported))
    t.check(not reported, reported[:5])
    t.figures["seconds"] = round(time.monotonic() - t0, 1)


def torch_event_deadlock(where: str) -> bool:
    """Whether a rank's stacks (``py-spy dump``) show torch's DataLoader waiting forever for the lock of its workers'
    ``done_event``: every worker checks that ``multiprocessing.Event`` in its loop (``Event.is_set`` takes the
    Event's lock, a semaphore shared by the processes), and a worker SIGKILLed while it holds the lock never releases
    it, so the next ``is_set`` in the main process (``_mark_worker_as_unavailable``, on that worker's death) waits for
    ever. It happens with any dataset, MONAI's too: torch 2.13 ``utils/data/_utils/worker.py`` and ``dataloader.py``."""
    main = where.split("Thread ", 2)[1] if where.count("Thread ") >= 2 else where  # the first thread: the main one
    return "SemLock.__enter__" in main and "Event.is_set" in main and "torch/utils/data/dataloader.py" in main


def worker_inside_a_write(target, ranks, timeout: float = 0.5) -> tuple[int, int] | None:
    """``(rank index, pid)`` of a DataLoader worker stopped (SIGSTOP) inside a write of an entry (``target.writers()``
    before and after the stop), or None if none is seen within ``timeout`` seconds: random kill times alone land
    inside a write seldom (a few in 100)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        writing = target.writers()
        for r, rank in enumerate(ranks):
            rank.pump()
            for pid in writing.intersection(rank.workers):
                if kill_child_of(rank.pid, pid, signal.SIGSTOP):
                    if pid in target.writers():
                        return r, pid  # (left stopped: the caller kills it)
                    kill_child_of(rank.pid, pid, signal.SIGCONT)  # its write ended meanwhile
        time.sleep(0.001)
    return None


def kill_tally(test: str, store: str) -> Tally:
    return Tally(test, "trials", "worker_kills", "rank_kills", "aimed_kills", "kills_mid_write", "entries_checked",
                 "entries_accepted", "progress_checks", "hangs", "torch_event_deadlocks", store=store,
                 trials_asked=TRIALS)


def run_final(t: Tally, target, epochs: int = 2, timeout: float = 180.0) -> None:
    """The next run after the crash (:func:`_final_run`), counted into ``t``: a hang, or an exit code but 0."""
    p = FORK.Process(target=_final_run, args=(target.build, target.sizes, epochs))
    p.start()
    code = join_or_kill(p, timeout)
    t.add("hangs", code is None)
    t.check(code == 0, f"the next run failed (exit code {code}; None: it did not complete within {timeout} s)")
    t.figures["next_run_exit_code"] = code


def test_sigkill_workers_and_ranks_writing_shared_memory(shm_dir):
    target = ShmTarget(shm_dir)
    path = target.store.path
    t = kill_tally("kills/shm", "shared memory")
    run_kill_trials(t, target, TRIALS, SEED)
    os.kill(target.watcher, signal.SIGKILL)
    # Whole job killed: ranks and workers died, the cache stays behind with nobody holding its lease...
    t.check(os.path.isdir(path), "the ranks were killed: their cache should still be there, stale")
    states = [c["state"] for c in list_caches(shm_dir) if c["path"] == path]
    t.check(states == ["stale"], f"the cache of the killed job is {states}, not stale")
    stale_bytes = tree_bytes(path) if os.path.isdir(path) else 0
    # ...and the next process to join any cache on the machine reclaims it.
    probe = SharedMemoryStore("probe", 1, shm_dir=shm_dir)
    probe.release()
    reclaimed = not os.path.exists(path)
    t.check(reclaimed, "stale shared memory of the killed processes was not reclaimed")
    run_final(t, target)
    leftovers = tree_files(cache_root(shm_dir, create=False))
    leaked = tree_bytes(shm_dir)
    t.check(leftovers == [".lock"] and leaked == 0, leftovers)
    t.record(stale_bytes_reclaimed=stale_bytes if reclaimed else 0, files_left=len(set(leftovers) - {".lock"}),
             bytes_leaked=leaked)
    t.assert_clean("hangs", "files_left", "bytes_leaked")
    assert t.figures["kills_mid_write"] >= 1, "no kill landed while a large entry was being written"
    assert t.figures["worker_kills"] >= TRIALS // 4 and t.figures["rank_kills"] >= TRIALS // 5
    assert t.figures["worker_deaths_seen"] >= 1


def wait_reaped(pids: list[int], timeout: float = 30.0) -> None:
    """Wait until the killed processes are gone from the process table: the workers of a killed rank are
    orphans, reaped by init a moment later. A sweep takes a dead process for dead even before it is reaped
    (test_sweep_removes_the_temporary_file_of_a_dead_unreaped_writer), but one SIGKILLed an instant ago may still
    be exiting, not yet a zombie: a sweep then rightly takes it for alive and keeps its temporary file."""
    deadline = time.monotonic() + timeout
    while any(os.path.exists(f"/proc/{pid}") for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)


def temp_file_pids(directory: str) -> list[int]:
    return [owner[1] for n in os.listdir(directory) if (owner := runtime.temp_owner(n)) is not None]


def test_sigkill_workers_and_ranks_writing_the_disk_cache(tmp_path):
    cache_dir = str(tmp_path / "cache")
    target = DiskTarget(cache_dir)
    t = kill_tally("kills/disk", "disk")
    run_kill_trials(t, target, TRIALS, SEED + 1)
    temp_left = len(temp_files(cache_dir))
    wait_reaped(temp_file_pids(cache_dir))
    run_final(t, target)  # a new PersistentDataset sweeps the killed writers' temporary files
    names = os.listdir(cache_dir)
    # nothing but entry files of these items, and packs with their indexes (no temporary file left)
    expected_files = {os.path.basename(p) for p in target.paths}
    stray = [n for n in names if not (n in expected_files or disk_format.is_pack_file(n))]
    t.check(not stray, names)
    accepted, problems = target.check()
    t.check(accepted == N_ITEMS and not problems, problems)
    stray_bytes = sum(os.lstat(os.path.join(cache_dir, n)).st_blocks * 512 for n in stray)
    t.record(temp_files_left_by_kills=temp_left, temp_files_after_next_run=len(temp_files(cache_dir)),
             entries_after_next_run=accepted, wrong_entries_after_next_run=len(problems),
             stray_files_after_next_run=len(stray), bytes_leaked=stray_bytes)
    t.assert_clean("hangs", "temp_files_after_next_run", "wrong_entries_after_next_run", "stray_files_after_next_run",
                   "bytes_leaked")
    assert t.figures["kills_mid_write"] >= 1, "no kill landed while a file was being written"
    assert t.figures["worker_kills"] >= TRIALS // 4 and t.figures["rank_kills"] >= TRIALS // 5


def _leave_a_temp_file(directory: str) -> None:
    with open(os.path.join(directory, f".somekey.{runtime.HOST_TAG}.{os.getpid()}.w0.tmp"), "wb") as f:
        f.write(b"half an entry")
    os._exit(0)  # as if killed mid-write; its parent has not reaped it yet


def test_sweep_removes_the_temporary_file_of_a_dead_unreaped_writer(tmp_path):
    pid = os.fork()
    if pid == 0:
        _leave_a_temp_file(str(tmp_path))
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # wait until it is a zombie (dead, not reaped)
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break
            time.sleep(0.01)
        assert len(runtime.sweep_temp_files(str(tmp_path))) == 1
    finally:
        os.waitpid(pid, 0)


def _write_big_entries_forever(shm_dir: str) -> None:
    torch.set_num_threads(1)
    store = SharedMemoryStore("kept", 1, shm_dir=shm_dir, keep_warm=True)
    big = {"x": torch.zeros(12_500_000)}  # 50 MB: a file of its own, written for some milliseconds
    while True:
        store.clear()
        store[0] = big


def test_partial_entry_of_a_killed_writer_is_reclaimed_when_a_kept_cache_is_joined(shm_dir):
    path = os.path.join(cache_root(shm_dir), "kept")
    left = []
    for _ in range(20):  # kill the writer while a large entry is being written
        p = FORK.Process(target=_write_big_entries_forever, args=(shm_dir,))
        p.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if os.path.isdir(path) and any(_temp_of(n, p.pid) for n in os.listdir(path)):
                break
            time.sleep(0.0005)
        os.kill(p.pid, signal.SIGKILL)
        p.join(30)
        left = [n for n in os.listdir(path) if _temp_of(n, p.pid)]
        if left:
            break
    assert left, "no kill landed during a write"
    store = SharedMemoryStore("kept", 1, shm_dir=shm_dir, keep_warm=True)  # the next run joins the kept cache
    try:
        remaining = [n for n in os.listdir(path) if runtime.temp_owner(n) is not None]
        assert remaining == [], f"partial entries of killed writers left in shared memory: {remaining}"
    finally:
        store.release()
        remove_cache("kept", shm_dir, force=True)


# ------------------------------------------------------------- a kill inside a critical section
def _die_holding(lock_acquire) -> None:
    lock_acquire()
    os.kill(os.getpid(), signal.SIGKILL)


HANG_GUARD = 60  # seconds: a read blocked by a dead holder's lock would wait forever; a read takes milliseconds


def test_worker_killed_holding_the_shared_memory_counters_lock_blocks_nobody(shm_dir):
    """The shared-memory store's counters are guarded by an OFD lock: the kernel drops it with its holder."""
    store = SharedMemoryStore("counters", 2, shm_dir=shm_dir)
    store[0] = make_item(0, 64)
    # the state a worker killed while counting leaves behind: the cache's own counters lock, taken by a dying process
    p = FORK.Process(target=_die_holding, args=(store._dir.counters._locked().__enter__,))
    p.start()
    p.join(30)
    assert p.exitcode == -signal.SIGKILL
    probe = OFDLock(os.path.join(store.path, "stats"), 0)  # the lock the counters take: free again
    assert probe.acquire(blocking=False), "the killed worker's counters lock is still held"
    probe.release()
    misses = store.stats()["total"]["misses"]
    with deadline(HANG_GUARD):
        for _ in range(5):
            assert item_problem(store.get_or_compute(0, lambda: make_item(0, 64)), 0, 64) is None
            store.get_or_compute(1, lambda: make_item(1, 64))
    assert store.stats()["total"]["misses"] == misses + 1  # entry 1's miss, counted under that lock
    store.release()


def test_worker_killed_holding_the_disk_counters_lock_blocks_nobody(tmp_path):
    store = DiskStore(str(tmp_path), async_writes=False)
    store.put("a", make_item(0, 64))
    # the state a worker killed inside _SharedCounters.add leaves behind: the real lock, taken by a dying process
    p = FORK.Process(target=_die_holding, args=(store._shared._locked().__enter__,))
    p.start()
    p.join(30)
    assert p.exitcode == -signal.SIGKILL
    hits = store.stats()["total"]["hits"]
    with deadline(HANG_GUARD), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert item_problem(store.get("a"), 0, 64) is None
    assert store.stats()["total"]["hits"] == hits + 1  # counted, under the lock the dead worker held
