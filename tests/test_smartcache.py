"""monai_cache.SmartCacheDataset against monai.data.SmartCacheDataset: MONAI's schedule and items, one shared copy
per machine that every rank and worker follows, MONAI's bugs fixed."""

from __future__ import annotations

import json
import os
import pickle
import struct
import threading
from collections import Counter

import monai.data
import numpy as np
import pytest
import torch
from helpers import chain, read_calls
from monai.transforms import Compose, RandGaussianNoised, Transform
from test_cache_dataset import outputs
from test_cache_distributed import launch_ranks
from test_codec import assert_same

import monai_cache
from monai_cache.shm_window import SharedWindow

# the drop-in tests: CI runs them on the oldest supported MONAI and on monai-weekly too (.ci/run)
pytestmark = pytest.mark.dropin

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_scripts", "smartcache_rank.py")


def numbered(n):
    return [{"case": i} for i in range(n)]


def cases(ds):
    return [int(ds[i]["case"]) for i in range(len(ds))]


@pytest.mark.parametrize(
    "shuffle, replace_rate, cache_num",
    [(True, 0.25, 4), (False, 0.5, 5), (True, 1.5, 3)],  # 1.5: MONAI's list grows past cache_num, mirrored
)
def test_same_items_as_monai_at_every_update(shm_dir, volumes, shuffle, replace_rate, cache_num):
    kw = dict(replace_rate=replace_rate, cache_num=cache_num, shuffle=shuffle, seed=3, progress=False)
    tr = chain()  # one chain: applied operations name their transform by id
    ref = monai.data.SmartCacheDataset(volumes, tr, **kw)
    ours = monai_cache.SmartCacheDataset(volumes, tr, **kw)
    assert isinstance(ours, monai.data.SmartCacheDataset) and len(ours) == len(ref) == cache_num
    ref.start()
    ours.start()
    for update in range(5):
        expected, got = outputs(ref, 10 + update), outputs(ours, 10 + update)
        assert len(expected) == len(got)
        for e, g in zip(expected, got):
            assert_same(e, g)
        ref.update_cache()
        ours.update_cache()
    ref.shutdown()
    ours.shutdown()
    assert not ours.is_started()
    ours.release()


def test_monais_argument_errors(shm_dir):
    for bad, error in ((dict(replace_rate=0), ValueError), (dict(runtime_cache=True), NotImplementedError)):
        with pytest.raises(error) as monai_error:
            monai.data.SmartCacheDataset(numbered(4), cache_num=2, progress=False, **bad)
        with pytest.raises(error, match=str(monai_error.value).replace("(", r"\(").replace(")", r"\)")):
            monai_cache.SmartCacheDataset(numbered(4), cache_num=2, progress=False, **bad)


@pytest.mark.parametrize("shared_memory", [True, False])
def test_smartcache_handler_drives_it_in_an_ignite_run(shm_dir, shared_memory):
    from ignite.engine import Engine, Events
    from monai.handlers import SmartCacheHandler

    def epochs(ds):
        seen: list[list[int]] = []
        engine = Engine(lambda _engine, batch: seen[-1].extend(int(c) for c in batch["case"]))
        engine.add_event_handler(Events.EPOCH_STARTED, lambda _engine: seen.append([]))
        SmartCacheHandler(ds).attach(engine)
        engine.run(monai.data.DataLoader(ds, batch_size=2), max_epochs=4)
        return seen

    kw = dict(replace_rate=0.25, cache_num=4, seed=2, progress=False)
    ours = monai_cache.SmartCacheDataset(numbered(10), shared_memory=shared_memory, **kw)
    assert epochs(ours) == epochs(monai.data.SmartCacheDataset(numbered(10), **kw))
    assert isinstance(ours._store, monai_cache.SharedMemoryStore) == shared_memory
    assert not ours.is_started()  # the handler shut it down


def test_shutdown_then_start_continues_the_window(shm_dir):
    """MONAI resets its position on shutdown but keeps its cache: after start() some items are there twice."""
    kw = dict(replace_rate=0.25, cache_num=4, shuffle=False, progress=False)
    ref = monai.data.SmartCacheDataset(numbered(6), **kw)  # never shut down: the running window
    ours = monai_cache.SmartCacheDataset(numbered(6), **kw)
    ref.start()
    ours.start()
    for update in range(5):
        if update == 2:
            ours.shutdown()
            ours.start()
        ref.update_cache()
        ours.update_cache()
        assert cases(ours) == [x["case"] for x in ref._cache]
        assert len(set(cases(ours))) == 4
    ref.shutdown()
    ours.shutdown()


def test_set_data_of_another_length_starts_its_own_schedule(shm_dir):
    kw = dict(replace_rate=0.25, cache_num=4, shuffle=False, progress=False)
    ours = monai_cache.SmartCacheDataset(numbered(10), **kw)
    ours.start()
    ours.update_cache()
    with pytest.warns(UserWarning, match="not shutdown yet"):  # MONAI's warning: shut down for you
        ours.set_data(numbered(6))  # MONAI keeps 10 as the length: its thread indexes past the new data, forever
    ref = monai.data.SmartCacheDataset(numbered(6), **kw)
    ref.start()
    ours.start()
    for _ in range(4):
        assert cases(ours) == [x["case"] for x in ref._cache]
        ref.update_cache()
        ours.update_cache()
    ref.shutdown()
    ours.shutdown()


class FailOn(Transform):
    def __init__(self, case):
        self.case = case

    def __call__(self, data):
        if data["case"] == self.case:
            raise OSError(f"cannot read case {self.case}")
        return data


def test_failing_replacement_is_raised_by_update_cache_naming_the_item(shm_dir):
    ds = monai_cache.SmartCacheDataset(
        numbered(8), Compose([FailOn(5)]), replace_rate=0.25, cache_num=4, shuffle=False, progress=False
    )
    ds.start()
    ds.update_cache()  # window 1..4; the thread now computes item 5 for the next update and fails
    outcome: list[BaseException] = []

    def update():
        try:
            ds.update_cache()
        except Exception as e:
            outcome.append(e)

    caller = threading.Thread(target=update, daemon=True)  # MONAI's update_cache() waits forever here
    caller.start()
    caller.join(30)
    assert outcome, "update_cache() did not return"
    assert isinstance(outcome[0], RuntimeError)
    assert "data item 5" in str(outcome[0]) and "cannot read case 5" in str(outcome[0])
    assert cases(ds) == [1, 2, 3, 4]  # the window did not move
    ds.shutdown()


def test_entries_leave_shared_memory_one_update_after_the_window(shm_dir):
    n, cache_num = 10, 4  # replace_num 1
    ds = monai_cache.SmartCacheDataset(numbered(n), replace_rate=0.25, cache_num=cache_num, shuffle=False,
                                       progress=False)
    store = ds._store
    ds.start()
    for update in range(1, 6):
        ds.update_cache()
        ds.shutdown()  # waits for the next replacement: the store's content is settled
        held = {i for i in range(n) if store.contains(i)}
        window, previous, upcoming = set(range(update, update + 4)), set(range(update - 1, update + 3)), {update + 4}
        assert held == window | previous | upcoming
        assert ds.cache_stats()["stored"]["entries"] == cache_num + 2
        ds.start()
    ds.shutdown()
    path = ds._store.path
    # each entry is a file of its own, so a removed one gives its memory back (no segment keeps its bytes)
    files = {name for name in os.listdir(path) if name.endswith(".e") or name.startswith("s.")}
    assert files == {f"{i}.e" for i in held}
    window_file = ds._shared_window.path
    assert os.path.exists(window_file)
    ds.release()
    assert not os.path.exists(path)  # the last user removed the cache, its window file with it
    assert os.listdir(os.path.join(shm_dir, f"monai_cache-{os.getuid()}")) == [".lock"]


def test_a_pickled_copy_follows_the_owners_updates(shm_dir):
    """What a spawned (or persistent) DataLoader worker gets: MONAI's class cannot be pickled at all."""
    with pytest.raises(TypeError):
        pickle.dumps(monai.data.SmartCacheDataset(numbered(8), cache_num=4, progress=False))
    ds = monai_cache.SmartCacheDataset(numbered(8), replace_rate=0.25, cache_num=4, progress=False)
    copy = pickle.loads(pickle.dumps(ds))
    ds.start()
    for _ in range(3):
        ds.update_cache()
        assert cases(copy) == cases(ds)
    ds.shutdown()
    copy.release()
    ds.release()


def test_window_readers_accept_only_whole_windows(shm_dir):
    window = SharedWindow(shm_dir, 4, [0, 1, 2, 3])
    reader = pickle.loads(pickle.dumps(window))  # maps the owner's file, as a spawned worker does
    assert reader.indices() == (0, 1, 2, 3)
    window.publish([1, 2, 3, 4])
    assert reader.indices() == (1, 2, 3, 4)
    # A writer killed while writing window 3 leaves its slot (1) half written, the header still at window 2.
    slot_1 = 16 + (16 + 8 * 4)
    with open(window.path, "r+b") as f:
        f.seek(slot_1)
        f.write(struct.pack("<QII", 3, 4, 0) + struct.pack("<2q", 2, 3))
    assert reader.indices() == (1, 2, 3, 4)
    fresh = pickle.loads(pickle.dumps(window))
    assert fresh.indices() == (1, 2, 3, 4)
    # A header pointing at it (damage no crash makes) is never accepted either.
    with open(window.path, "r+b") as f:
        f.seek(8)
        f.write(struct.pack("<Q", 3))
    with pytest.raises(RuntimeError, match="unreadable"):
        reader.indices()
    window.close()
    assert not os.path.exists(window.path)


def test_two_ranks_with_persistent_fork_and_spawn_workers_share_one_copy(shm_dir, volumes, tmp_path):
    """2 independently started gloo ranks x 2 persistent workers (rank 0 forks them, rank 1 spawns them), 4 rounds:
    both ranks read MONAI's window at every round, and each item was computed once on the machine."""
    data_path, log = tmp_path / "data.json", str(tmp_path / "calls")
    data_path.write_text(json.dumps(volumes))
    rounds = 4  # 3 updates: positions 0..7 of the shuffled data are computed, none twice
    results = launch_ranks(2, [str(data_path), log, str(rounds), "fork", "spawn"], script=SCRIPT)
    ref = monai.data.SmartCacheDataset(volumes, replace_rate=0.25, cache_num=4, seed=0, progress=False)
    expected = []
    ref.start()
    for r in range(rounds):
        if r:
            ref.update_cache()
        expected.append([item["case"] for item in ref._cache])
    ref.shutdown()
    assert results[0]["rounds"] == results[1]["rounds"] == expected
    assert Counter(case for _, case in read_calls(log)) == Counter(range(len(volumes)))  # once on the machine
    assert results[0]["path"] == results[1]["path"]
    assert results[0]["stored"]["entries"] == 4 + 2  # window, the one before, the next replacement
    assert os.listdir(os.path.join(shm_dir, f"monai_cache-{os.getuid()}")) == [".lock"]  # nothing left behind


def test_dataloader_workers_seed_the_random_transforms(shm_dir):
    """MONAI's SmartCacheDataset leaves its workers' random transforms unseeded: both workers, and every epoch,
    add the same noise. Ours seeds them as MONAI's DataLoader seeds a CacheDataset's."""
    data = [{"img": np.zeros((1, 2), np.float32), "case": i} for i in range(8)]
    noise = Compose([RandGaussianNoised("img", prob=1.0)])

    def epochs(ds):
        torch.manual_seed(0)  # the DataLoader's base seed, from which each worker's seed comes
        loader = monai.data.DataLoader(ds, batch_size=1, num_workers=2)
        return [[b["img"].as_tensor().clone() for b in loader] for _ in range(2)]

    ours = epochs(monai_cache.SmartCacheDataset(data, noise, cache_num=4, shuffle=False, progress=False))
    like = epochs(monai.data.CacheDataset(data[:4], noise, progress=False))
    assert [len(epoch) for epoch in ours] == [len(epoch) for epoch in like] == [4, 4]
    for epoch_ours, epoch_like in zip(ours, like):
        for a, b in zip(epoch_ours, epoch_like):
            assert torch.equal(a, b)
    assert not torch.equal(ours[0][0], ours[0][1]) and not torch.equal(ours[0][0], ours[1][0])
