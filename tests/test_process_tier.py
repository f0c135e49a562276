"""The per-process tier in front of the shared-memory cache (``process_cache``), on the CPU.

On a GPU machine, a cached chain that ends with ``ToDeviced`` (MONAI's fast-training recipe) fills the tier by
itself: ``tests/test_gpu.py`` checks that there. Here ``process_cache=True`` makes the CPU take the same path, so that
its logic is checked on every machine: the items are MONAI's, each process reads an entry from shared memory once
and then serves it from the tier, the item is still computed once on the machine, what a read hands out is a copy
(a random transform writing into its input leaves the kept item alone), and the tier follows ``set_data``,
``release``, SmartCacheDataset's window, pickling and DataLoader workers.
"""

from __future__ import annotations

import pickle

import monai.data
import pytest
import torch
from helpers import RandZeroInPlace, assert_same, chain, one_torch_thread  # noqa: F401 (an autouse fixture)
from monai.transforms import Compose, ToDeviced

import monai_cache
from monai_cache.process_tier import ProcessTier, item_device

# the drop-in tests: CI runs them on the oldest supported MONAI and on monai-weekly too (.ci/run)
pytestmark = pytest.mark.dropin


def reads(ds, seed: int) -> list:
    ds.transform.set_random_state(seed)
    return [ds[i] for i in range(len(ds))]


@pytest.mark.parametrize("runtime_cache", [False, True])
def test_items_are_monais_and_the_store_is_read_once_per_entry(shm_dir, volumes, runtime_cache):
    transform = chain(crop=8)
    kw = dict(transform=transform, progress=False, runtime_cache=runtime_cache)
    ref = monai.data.CacheDataset(volumes, **kw)
    ours = monai_cache.CacheDataset(volumes, process_cache=True, **kw)
    first: dict = {}
    for epoch in range(3):
        for expected, got in zip(reads(ref, epoch), reads(ours, epoch)):
            assert_same(expected, got)
        stats = ours.cache_stats()
        tier, process = stats["process_cache"], stats["process"]
        # the first epoch reads each entry from shared memory (or computes it); later epochs read none
        first = first or {k: process[k] for k in ("hits", "misses", "bytes_read")}
        assert {k: process[k] for k in first} == first
        assert tier["entries"] == len(volumes) and tier["hits"] == epoch * len(volumes)
        assert tier["device"] == "cpu" and tier["bytes"] > 0
    assert stats["total"]["writes"] == len(volumes)  # still computed once, and stored once, on the machine
    ours.release()


def test_what_a_read_hands_out_is_a_copy_of_the_kept_item(shm_dir, volumes):
    """A random transform that writes into its input (the worst case) never reaches the kept item, with MONAI's
    default ``copy_cache=True``; without random transforms the item handed out is a copy too."""
    for transforms in ([RandZeroInPlace(keys="image")], []):
        ds = monai_cache.CacheDataset(
            volumes[:2], Compose([*chain(crop=None).transforms, *transforms]), progress=False, process_cache=True
        )
        ds[0]
        kept = ds._process_tier.get(0)["image"]
        before = kept.clone()
        assert before.abs().sum() > 0
        for _ in range(2):
            ds[0]["image"].mul_(0)  # the random transform zeroes its input; a user's in-place change
        assert ds._process_tier.get(0)["image"] is kept and torch.equal(kept, before)
        ds.release()


def test_default_keeps_only_items_on_an_accelerator(shm_dir, volumes):
    """On a CPU-only chain the default keeps nothing (one copy per machine, as without the tier); ``ToDeviced``
    to the CPU ends the chain on the CPU, so nothing is kept either. ``process_cache=False`` never keeps."""
    for kw in ({}, {"process_cache": False}):
        ds = monai_cache.CacheDataset(volumes[:3], chain(), progress=False, **kw)
        reads(ds, 0)
        reads(ds, 1)
        assert "process_cache" not in ds.cache_stats() and len(ds._process_tier) == 0
        assert ds.cache_stats()["process"]["hits"] == 6  # every read went to shared memory
        ds.release()
    on_cpu = Compose([*chain(crop=None).transforms, ToDeviced(keys=["image", "label"], device="cpu")])
    ds = monai_cache.CacheDataset(volumes[:3], on_cpu, progress=False)
    reads(ds, 0)
    assert len(ds._process_tier) == 0
    ds.release()


def test_item_device_and_the_decision_made_once():
    assert item_device({"a": "x", "b": [1, {"c": torch.zeros(1)}]}) == torch.device("cpu")
    assert item_device({"a": [1, 2], "b": "s"}) is None
    tier = ProcessTier(None)
    assert not tier.offer(0, {"image": torch.zeros(2)})  # a CPU item: the tier decides once, and keeps none
    assert not tier.offer(1, {"image": torch.zeros(2)}) and len(tier) == 0
    keep_all = ProcessTier(True)
    assert keep_all.offer(3, {"image": torch.zeros(2)}) and keep_all.get(3) is not None and keep_all.hits == 1
    keep_all.keep_only([])
    assert keep_all.get(3) is None and len(keep_all) == 0


def test_set_data_release_pickling_and_workers(shm_dir, volumes, tmp_path):
    ds = monai_cache.CacheDataset(volumes[:4], chain(), progress=False, process_cache=True)
    reads(ds, 0)
    assert len(ds._process_tier) == 4
    clone = pickle.loads(pickle.dumps(ds))  # a spawned worker's copy: its own tier, empty
    assert len(clone._process_tier) == 0 and clone.process_cache is True
    assert_same(reads(clone, 5), reads(ds, 5), skip_keys=("id",))  # id: the address of the clone's transform
    assert len(clone._process_tier) == 4
    ds.set_data(volumes[4:6])  # other data: nothing kept of the old items
    assert len(ds._process_tier) == 0
    assert_same(reads(ds, 1), reads(monai.data.CacheDataset(volumes[4:6], ds.transform, progress=False), 1))
    # forked DataLoader workers keep their own; batches are MONAI's
    torch.manual_seed(0)
    theirs = list(monai.data.DataLoader(monai.data.CacheDataset(volumes[4:6], chain(), progress=False), num_workers=2))
    torch.manual_seed(0)
    ours = list(monai.data.DataLoader(ds, num_workers=2))
    for a, b in zip(ours, theirs):
        assert_same(a, b, skip_keys=("id",))
    ds.release()
    assert len(ds._process_tier) == 0
    clone.release()


def test_smartcache_keeps_the_window_and_the_next_replacements(shm_dir):
    data = [{"x": torch.full((3,), float(i))} for i in range(10)]
    kw = dict(replace_rate=0.25, cache_num=4, seed=1, progress=False)
    ref = monai.data.SmartCacheDataset(data, **kw)
    ours = monai_cache.SmartCacheDataset(data, process_cache=True, **kw)
    ref.start()
    ours.start()
    for _ in range(5):
        for i in range(len(ours)):
            assert_same(ours[i], ref[i])
        ref.update_cache()
        ours.update_cache()
        window = set(ours._window) | set(ours._replace_data_idx)
        assert set(ours._process_tier._items) <= window  # items that left MONAI's lists left the tier
    ref.shutdown()
    ours.shutdown()
    ours.release()
