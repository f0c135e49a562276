"""What MONAI's own tests assert of MONAI's caching datasets, asserted of ours.

Each group below restates, in our own code and on our classes, the behaviour that one of MONAI's upstream test
files (Project-MONAI/MONAI) checks of MONAI's class:

* ``tests/data/test_smartcachedataset.py``: the window (``_cache``) holds ``cache_num`` computed items, an update
  drops ``_replace_num`` items from its front and appends ``_replacements``, ``seed`` fixes the shuffled order,
  ``set_data`` between ``shutdown()`` and ``start()`` serves the new data, the input list is left alone;
* ``tests/data/test_handler_smartcache.py``: ``SmartCacheHandler`` moves the window once per epoch;
* ``tests/data/test_cachedataset.py``: partial caches, slices and negative indices, ``set_data`` through
  DataLoader workers, a stateful transform runs on a fresh copy for every item (also for ``SmartCacheDataset``
  and ``PersistentDataset``), ``hash_as_key`` caches each unique item once;
* ``tests/data/test_cachedataset_parallel.py``: the eager fill computes every item, with or without threads;
* ``tests/test_cachedataset_persistent_workers.py``: a persistent worker reads the cached item unchanged;
* ``tests/data/test_persistentdataset.py``: items are hashed, not changed, transforms work on a copy;
  precached and postcached items agree; different transforms do not share entries; ``track_meta`` and
  ``weights_only`` give the documented types; ``MetaTensor`` metadata survive the cache; unsafe metadata are
  never loaded by unpickling;
* ``tests/data/test_persistentdataset_dist.py``: two processes on one (new) cache directory at once;
* ``tests/test_cachentransdataset.py``: the first ``cache_n_trans`` transforms are cached, the rest run;
* ``tests/data/test_dataloader.py``: batches of cached and uncached items, the collate error names the key,
  ``Randomizable`` datasets and ``ZipDataset`` get MONAI's random streams in workers;
* ``tests/data/utils/test_decollate.py``: decollated batches are the dataset's items;
* ``tests/test_inverse_collation.py``, ``tests/transforms/inverse/test_inverse.py`` (the inferred-segmentation
  case) and ``tests/transforms/inverse/test_invertd.py``: items read through a cache and DataLoader workers keep
  what inverting needs.

Where MONAI's class can produce the expected result from the same input, it does (``assert_same``: exact types,
values and metadata), so the tests follow the installed MONAI version rather than a table of numbers.
"""

from __future__ import annotations

import copy
import multiprocessing
import shutil
import time
from collections.abc import Callable, Sequence
from typing import Any

import monai.data
import numpy as np
import pytest
import torch
from helpers import assert_same, one_torch_thread, write_volumes  # noqa: F401 (an autouse fixture)
from monai.data import MetaTensor, decollate_batch, json_hashing, pad_list_data_collate, pickle_hashing
from monai.transforms import (
    CastToTyped,
    Compose,
    CopyItemsd,
    DataStatsd,
    Decollated,
    EnsureChannelFirstd,
    Flip,
    Identity,
    Invertd,
    Lambda,
    LoadImaged,
    Orientationd,
    RandAffined,
    RandAxisFlipd,
    RandCropByPosNegLabeld,
    RandFlipd,
    RandLambda,
    Randomizable,
    RandRotate90d,
    RandZoomd,
    ResizeWithPadOrCrop,
    ResizeWithPadOrCropd,
    ScaleIntensityd,
    ShiftIntensityd,
    SimulateDelayd,
    Spacingd,
    SpatialPadd,
    ThreadUnsafe,
    ToTensord,
    Transform,
    allow_missing_keys_mode,
    convert_applied_interp_mode,
    reset_ops_id,
)
from monai.utils import set_determinism
from monai.utils.enums import TraceKeys

import monai_cache

# the drop-in tests: CI runs them on the oldest supported MONAI and on monai-weekly too (.ci/run)
pytestmark = pytest.mark.dropin

KEYS = ["image", "label"]
# the address of a transform object made during a call (e.g. the resize inside RandZoomd): differs between runs
MADE_IN_CALLS = (TraceKeys.ID,)


def loaded(*more: Any, keys: Sequence[str] = KEYS) -> Compose:
    """Read the NIfTI files (channel first), then ``more``."""
    return Compose([LoadImaged(keys=list(keys), image_only=True), EnsureChannelFirstd(keys=list(keys)), *more])


def seeded_epoch(loader: Any, seed: int = 0) -> list:
    """One epoch with torch's generator seeded first: a DataLoader draws its workers' base seed from it."""
    torch.manual_seed(seed)
    return list(loader)


def assert_batches_same(got: Sequence, expected: Sequence, skip_keys: Sequence = ()) -> None:
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert_same(g, e, skip_keys=skip_keys)


# -- tests/data/test_smartcachedataset.py --------------------------------------------------------------------------


def computed_replacements(ds: monai.data.SmartCacheDataset, timeout: float = 60.0) -> list:
    """A copy of ``_replacements`` once the background thread has computed them, taken under ``_update_lock`` as
    ``update_cache()`` takes them (right after ``start()`` the thread may not have run yet)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with ds._update_lock:
            if ds._replace_done:
                return copy.deepcopy(ds._replacements)
        time.sleep(0.01)
    raise AssertionError("the replacements were not computed in time")


@pytest.mark.parametrize(
    "replace_rate, num_replace_workers, load", [(0.1, 0, True), (0.5, 2, True), (0.1, None, False)]
)
def test_smartcache_window_is_full_and_serves_items_across_updates_and_restarts(
    shm_dir, tmp_path, replace_rate: float, num_replace_workers: int | None, load: bool
):
    path = write_volumes(str(tmp_path), 1)[0]["image"]
    data = [{"image": path, "label": path}] * 20  # one file under both keys: the two must always agree
    transform = Compose([LoadImaged(keys=KEYS, image_only=True)]) if load else None
    kw = dict(replace_rate=replace_rate, cache_num=16, num_init_workers=2, num_replace_workers=num_replace_workers,
              progress=False)
    ours = monai_cache.SmartCacheDataset(data, transform, **kw)
    ref = monai.data.SmartCacheDataset(data, transform, **kw)
    assert len(ours._cache) == ours.cache_num == ref.cache_num == 16
    for i in range(ours.cache_num):
        assert ours._cache[i] is not None
        assert_same(ours._cache[i], ref._cache[i])
    if not load:  # leaving the transform out is the same as passing None
        assert_same(monai_cache.SmartCacheDataset(data, **kw)[0], ours[0])
    for _ in range(2):
        ours.start()
        ref.start()
        for _ in range(3):
            ours.update_cache()
            ref.update_cache()
            item = ours[15]
            assert_same(item, ref[15])
            if load:
                assert torch.equal(item["image"], item["label"])
            else:
                assert item["image"] == item["label"] == path
            assert len(ours._cache) == ours.cache_num
        ours.shutdown()
        ref.shutdown()
    assert not ours.is_started()


def test_update_cache_drops_the_front_of_the_window_and_appends_the_replacements(shm_dir):
    data = [{"image": f"image{i}.nii.gz", "label": f"label{i}.nii.gz"} for i in range(40)]
    kw = dict(transform=None, replace_rate=0.2, cache_num=10, num_init_workers=2, num_replace_workers=2,
              shuffle=False, progress=False)
    ours = monai_cache.SmartCacheDataset(data, **kw)
    ref = monai.data.SmartCacheDataset(data, **kw)
    replace_num = ours._replace_num
    assert replace_num == ref._replace_num and 0 < replace_num < ours.cache_num
    ours.start()
    ref.start()
    old_window = copy.deepcopy(ours._cache)
    replacements = computed_replacements(ours)
    assert replacements == computed_replacements(ref) and None not in replacements
    ours.update_cache()
    ref.update_cache()
    window, kept = ours._cache, ours.cache_num - replace_num
    assert len(window) == ours.cache_num
    assert list(window[:kept]) == list(old_window[replace_num:])  # the rest moved to the front, in order
    assert list(window[kept:]) == replacements  # then the replacements
    assert list(window) == list(ref._cache) and window[0] == ref._cache[0]
    ours.shutdown()
    ref.shutdown()


def test_shuffled_windows_follow_monais_seed(shm_dir):
    data = [{"image": f"image{i}.nii.gz"} for i in range(20)]
    kw = dict(transform=None, replace_rate=0.1, cache_num=16, num_init_workers=2, num_replace_workers=2,
              shuffle=True, seed=123, progress=False)
    ours = monai_cache.SmartCacheDataset(data, **kw)
    ref = monai.data.SmartCacheDataset(data, **kw)
    ours.start()
    ref.start()
    for _ in range(3):
        ours.update_cache()
        ref.update_cache()
        assert [ours[i] for i in range(len(ours))] == [ref[i] for i in range(len(ref))]
        assert list(ours._cache) == list(ref._cache)
    ours.shutdown()
    ref.shutdown()


def _times_ten(x: Any) -> np.ndarray:
    return np.array([x * 10])


def _plus_one(x: Any) -> Any:
    return x + 1


def test_set_data_between_shutdown_and_start_serves_the_new_data_through_workers(shm_dir):
    """MONAI skips its own version of this test (issue #5660); the behaviour it states is MONAI's class built
    afresh on the new data."""
    kw = dict(cache_rate=0.5, replace_rate=0.4, num_init_workers=2, num_replace_workers=2, shuffle=False,
              progress=False)
    first, second = list(range(10)), list(range(-10, 0))
    tens = Lambda(func=_times_ten)  # one transform for both: applied operations name it by id

    def monais_two_epochs(data: list) -> list:
        ref = monai.data.SmartCacheDataset(data, tens, **kw)
        ref.start()
        epochs = [list(monai.data.DataLoader(ref, batch_size=1))]
        ref.update_cache()
        epochs.append(list(monai.data.DataLoader(ref, batch_size=1)))
        ref.shutdown()
        return epochs

    ours = monai_cache.SmartCacheDataset(first, tens, **kw)
    loader = monai_cache.DataLoader(ours, batch_size=1, num_workers=2)
    got = []
    for data in (first, second):
        if data is not first:
            ours.set_data(data)  # after shutdown(), as MONAI asks
        ours.start()
        got.append(list(loader))
        ours.update_cache()  # moves on by ceil(5 * 0.4) = 2 items
        got.append(list(loader))
        ours.shutdown()
    expected = monais_two_epochs(first) + monais_two_epochs(second)
    assert len(got) == len(expected) == 4
    for g, e in zip(got, expected):
        assert_batches_same(g, e)


def test_shuffling_leaves_the_input_list_alone(shm_dir):
    data = [np.array([i]) for i in range(5)]
    before = list(data)
    kw = dict(transform=None, cache_rate=0.5, replace_rate=0.4, shuffle=True, progress=False)
    ours = monai_cache.SmartCacheDataset(data, **kw)
    assert len(data) == len(before) and all(a is b for a, b in zip(data, before))
    ref = monai.data.SmartCacheDataset(data, **kw)
    assert_same([ours[i] for i in range(len(ours))], [ref[i] for i in range(len(ref))])


# -- tests/data/test_handler_smartcache.py -------------------------------------------------------------------------


def test_smartcache_handler_moves_the_window_once_per_epoch(shm_dir):
    from ignite.engine import Engine
    from monai.handlers import SmartCacheHandler

    def run(ds: monai.data.SmartCacheDataset, workers: int) -> list:
        batches: list = []
        engine = Engine(lambda _engine, batch: batches.append(batch.tolist()))
        SmartCacheHandler(ds).attach(engine)
        loader = torch.utils.data.DataLoader(ds, batch_size=5, num_workers=workers, persistent_workers=False)
        engine.run(loader, max_epochs=5)
        return batches

    kw = dict(transform=None, replace_rate=0.2, cache_num=5, shuffle=False, progress=False)
    ours = monai_cache.SmartCacheDataset(list(range(9)), **kw)
    got = run(ours, workers=2)
    assert got == run(monai.data.SmartCacheDataset(list(range(9)), **kw), workers=0)
    assert len(got) == 5 and len({tuple(b) for b in got}) == 5  # a new window every epoch
    assert not ours.is_started()  # the handler shut it down at the end


# -- tests/data/test_cachedataset.py -------------------------------------------------------------------------------


@pytest.mark.parametrize("load", [True, False])
def test_partial_cache_serves_indices_slices_and_negative_indices(shm_dir, volumes, load: bool):
    data = volumes[:2]
    transform = Compose([LoadImaged(keys=KEYS, image_only=True)]) if load else None
    kw = dict(cache_rate=0.5, as_contiguous=True, progress=False)
    ours = monai_cache.CacheDataset(data, transform, **kw)
    ref = monai.data.CacheDataset(data, transform, **kw)
    assert ours.cache_num == ref.cache_num and 0 < ours.cache_num < len(data)
    for index in (0, 1, -1):
        assert_same(ours[index], ref[index])
    part, ref_part = ours[0:-1], ref[0:-1]
    assert isinstance(part, torch.utils.data.Subset) and len(part) == len(ref_part) == 1
    assert_same([part[i] for i in range(len(part))], [ref_part[i] for i in range(len(ref_part))])
    if not load:
        assert_same(monai_cache.CacheDataset(data, **kw)[0], ours[0])


def test_set_data_recomputes_the_cache_for_dataloader_workers(shm_dir):
    transform = Compose([Lambda(func=_times_ten), RandLambda(func=_plus_one)])  # one chain: ids in the records
    kw = dict(cache_rate=1.0, num_workers=2, progress=False, copy_cache=False)
    first, second = list(range(10)), list(range(-10, 0))
    ours = monai_cache.CacheDataset(first, transform, **kw)
    ref = monai.data.CacheDataset(first, transform, **kw)
    loader = monai_cache.DataLoader(ours, batch_size=1, num_workers=2)
    expected = list(monai.data.DataLoader(ref, batch_size=1))
    for _ in range(2):  # the second epoch finds the cache as the first left it
        assert_batches_same(list(loader), expected)
    ours.set_data(second)
    ref.set_data(second)
    expected_second = list(monai.data.DataLoader(ref, batch_size=1))
    assert not torch.equal(expected_second[0], expected[0])
    assert_batches_same(list(loader), expected_second)


class _CountingTransform(Transform, ThreadUnsafe):
    """Deterministic, but each call raises a counter: an item computed by a used copy comes out different, so the
    output shows whether every item got a fresh copy of the cached transforms (MONAI's ``threading=True``)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, x: int) -> int:
        self.calls += 1
        return x * 100 + self.calls


@pytest.mark.parametrize(
    "persistent_workers, fill_workers, loader_workers", [(False, 2, 2), (True, 0, 1)]
)
def test_a_stateful_transform_runs_on_a_fresh_copy_for_every_item(
    shm_dir, persistent_workers: bool, fill_workers: int, loader_workers: int
):
    data = list(range(1, 11))
    for name, kw in (
        ("CacheDataset", dict(cache_rate=1.0, num_workers=fill_workers)),
        ("SmartCacheDataset", dict(cache_rate=0.7, replace_rate=0.5, num_replace_workers=fill_workers,
                                   shuffle=False)),
    ):
        expected = list(getattr(monai.data, name)(data, _CountingTransform(), progress=False, **kw))
        assert len(set(expected)) == len(expected) > 0
        assert list(getattr(monai_cache, name)(data, _CountingTransform(), progress=False, **kw)) == expected
        ds = getattr(monai_cache, name)(data, _CountingTransform(), progress=False, **kw)
        loader = monai_cache.DataLoader(ds, batch_size=1, num_workers=loader_workers,
                                        persistent_workers=persistent_workers)
        for _ in range(2):
            assert [b.item() for b in loader] == expected, name
        del loader


@pytest.mark.parametrize("persistent_workers, loader_workers", [(False, 2), (True, 1)])
def test_persistent_runs_a_stateful_transform_on_a_fresh_copy_for_every_item(
    shm_dir, tmp_path, persistent_workers: bool, loader_workers: int
):
    data = list(range(1, 11))
    ref = monai.data.PersistentDataset(data, _CountingTransform(), cache_dir=tmp_path / "monai")
    expected = [int(x) for x in ref]
    assert len(set(expected)) == len(expected)
    ours = monai_cache.PersistentDataset(data, _CountingTransform(), cache_dir=tmp_path / "ours")
    assert [int(x) for x in ours] == expected
    ours.flush()  # the loader's datasets find every entry written
    loader = monai_cache.DataLoader(
        monai_cache.PersistentDataset(data, _CountingTransform(), cache_dir=tmp_path / "ours"),
        batch_size=1, num_workers=loader_workers, shuffle=False, persistent_workers=persistent_workers,
    )
    for _ in range(2):
        assert [b.item() for b in loader] == expected
    del loader


@pytest.mark.parametrize("load", [True, False])
def test_hash_as_key_caches_each_unique_item_once(shm_dir, volumes, load: bool):
    data = [volumes[0], volumes[1], volumes[1], volumes[2], volumes[2]]
    transform = Compose([LoadImaged(keys=KEYS, image_only=True)]) if load else None
    kw = dict(cache_num=4, num_workers=2, hash_as_key=True, progress=False)
    ours = monai_cache.CacheDataset(data, transform, **kw)
    ref = monai.data.CacheDataset(data, transform, **kw)

    def shape(ds: monai.data.CacheDataset) -> tuple[int, int, int, int]:
        return len(ds), len(ds._cache), len(ds._hash_keys), ds.cache_num

    assert shape(ours) == shape(ref) == (5, 3, 3, 3)  # no duplicated cache content
    assert list(ours._hash_keys) == list(ref._hash_keys)
    for index in (0, 1, -1):
        assert_same(ours[index], ref[index])
    part, ref_part = ours[0:-1], ref[0:-1]
    assert len(part) == len(ref_part) == 4
    assert_same([part[i] for i in range(len(part))], [ref_part[i] for i in range(len(ref_part))])
    ours.set_data(data[:3])
    ref.set_data(data[:3])
    assert len(ours) == len(ref) == 3
    assert (len(ours._cache), ours.cache_num) == (len(ref._cache), ref.cache_num) == (2, 2)
    assert_same([ours[i] for i in range(3)], [ref[i] for i in range(3)])


# -- tests/data/test_cachedataset_parallel.py ----------------------------------------------------------------------


@pytest.mark.parametrize("num_workers, load", [(0, True), (2, True), (2, False)])
def test_the_eager_fill_caches_every_item(shm_dir, tmp_path, num_workers: int, load: bool):
    item = write_volumes(str(tmp_path / "nifti"), 1)[0]
    data = [item] * 5
    transform = Compose([LoadImaged(keys=KEYS, image_only=True)]) if load else None
    ours = monai_cache.CacheDataset(data, transform, cache_rate=1, num_workers=num_workers, progress=False)
    ref = monai.data.CacheDataset(data, transform, cache_rate=1, num_workers=num_workers, progress=False)
    shutil.rmtree(tmp_path / "nifti")  # as upstream, which reads after its temporary directory is gone
    assert len(ours._cache) == ours.cache_num == ref.cache_num == len(data)
    for i in range(ours.cache_num):
        assert ours._cache[i] is not None
        assert_same(ours._cache[i], ref._cache[i])
        assert_same(ours[i], ref[i])


# -- tests/test_cachedataset_persistent_workers.py -----------------------------------------------------------------


def test_a_persistent_worker_reads_the_cached_item_unchanged(shm_dir, volumes):
    data = [{"image": v["image"]} for v in volumes[:2]]
    # one chain for both datasets: applied operations name their transform by id
    transform = loaded(Spacingd("image", pixdim=(1.5, 1.5, 2.0)), RandAffined("image", prob=1.0, rotate_range=0.4),
                       keys=["image"])
    batches = {}
    for name, module in (("monai", monai.data), ("ours", monai_cache)):
        ds = module.CacheDataset(data, transform, cache_num=1, progress=False)
        loader = module.DataLoader(ds, num_workers=1, persistent_workers=True)
        torch.manual_seed(0)
        b1 = next(iter(loader))
        b2 = next(iter(loader))
        # a random transform that wrote into the cached item would leave its record there for the next read
        assert len(b1["image"].applied_operations) == len(b2["image"].applied_operations) > 0
        batches[name] = (b1, b2)
        del loader
    assert_same(batches["ours"], batches["monai"])


# -- tests/data/test_persistentdataset.py and test_persistentdataset_dist.py ---------------------------------------


class _InPlaceTransform(Transform):
    """Changes what it is given (a list): the dataset must hash the item first and transform a copy of it."""

    def __call__(self, data: list) -> list:
        if data:
            data[0] = data[0] + np.pi
        else:
            data.append(1)
        return data


def nested_items() -> list:
    return [[list(range(i))] for i in range(5)]


@pytest.mark.parametrize("hash_func", [pickle_hashing, json_hashing], ids=["pickle_hashing", "json_hashing"])
def test_persistent_hashes_the_item_and_transforms_a_copy(shm_dir, tmp_path, hash_func: Callable):
    items = nested_items()
    kw = dict(hash_func=hash_func, pickle_module="pickle", pickle_protocol=torch.serialization.DEFAULT_PROTOCOL)
    expected = list(monai.data.PersistentDataset(nested_items(), _InPlaceTransform(), tmp_path / "monai", **kw))
    ds = monai_cache.PersistentDataset(items, _InPlaceTransform(), cache_dir=tmp_path / "ours", **kw)
    assert items == nested_items()
    first = list(ds)
    ds.flush()
    again = monai_cache.PersistentDataset(items, _InPlaceTransform(), cache_dir=tmp_path / "ours", **kw)
    assert list(again) == first == expected
    assert again.cache_stats()["process"]["hits"] == len(items)  # the second list came from the cache
    assert items == nested_items()


def _two_datasets_on_one_directory(cache_dir: str, barrier: Any, results: Any) -> None:
    barrier.wait()  # both processes build and fill at once
    items = nested_items()
    out = []
    for hash_func in (pickle_hashing, json_hashing):
        ds = monai_cache.PersistentDataset(items, _InPlaceTransform(), cache_dir=cache_dir, hash_func=hash_func)
        again = monai_cache.PersistentDataset(items, _InPlaceTransform(), cache_dir=cache_dir, hash_func=hash_func)
        out.append((list(ds), list(again), items == nested_items()))
        ds.flush()
        again.flush()
    results.put(out)


@pytest.mark.parametrize("new_dir", [False, True], ids=["existing-dir", "new-dir"])
def test_two_processes_share_one_persistent_cache_dir(shm_dir, tmp_path, new_dir: bool):
    expected = list(monai.data.PersistentDataset(nested_items(), _InPlaceTransform(), tmp_path / "monai"))
    (tmp_path / "shared").mkdir()
    cache_dir = tmp_path / "shared" / "test" if new_dir else tmp_path / "shared"  # both processes make a new one
    ctx = multiprocessing.get_context("fork")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_two_datasets_on_one_directory, args=(str(cache_dir), barrier, results))
             for _ in range(2)]
    for p in procs:
        p.start()
    outs = [results.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    for out in outs:
        for first, again, unchanged in out:
            assert unchanged
            assert first == again == expected


def monais_cached_items(ds: monai.data.PersistentDataset) -> list:
    """What MONAI's ``PersistentDataset`` stores for its items, which its cache hits return: read from its files
    here, as MONAI < 1.6 cannot read them itself under torch >= 2.6 (``weights_only`` by default)."""
    for i in range(len(ds)):
        ds[i]  # writes MONAI's files
    names = [ds.hash_func(item).decode("utf-8") + ds.transform_hash for item in ds.data]
    return [torch.load(ds.cache_dir / f"{name}.pt", weights_only=False) for name in names]


@pytest.mark.parametrize("form", ["compose", "list", "none"])
def test_persistent_precached_and_postcached_items_agree(shm_dir, tmp_path, volumes, form: str):
    chain = [LoadImaged(keys=KEYS, image_only=True), SimulateDelayd(keys=KEYS, delay_time=[1e-7, 1e-6])]
    transform = {"compose": Compose(chain), "list": chain, "none": None}[form]
    data = volumes[:2]
    cache_dir = tmp_path / "cache" / "data"  # made when needed
    ref = monai.data.PersistentDataset(data, transform, cache_dir=tmp_path / "monai" / "data")
    expected = monais_cached_items(ref)
    precached = monai_cache.PersistentDataset(data, transform, cache_dir=cache_dir)
    before = [precached[0], precached[1]]
    precached.flush()
    postcached = monai_cache.PersistentDataset(data, transform, cache_dir=cache_dir)
    after = [postcached[0], postcached[1]]
    assert postcached.cache_stats()["process"]["hits"] == 2
    for got in (before, after):
        assert_same(got, expected)
    part = postcached[0:2]
    assert isinstance(part, torch.utils.data.Subset) and len(part) == 2
    assert_same([part[0], part[1]], expected)
    postcached.set_data(volumes[2:4])
    ref.set_data(volumes[2:4])  # empties its directory, as ours
    assert_same([postcached[0], postcached[1]], monais_cached_items(ref))


def test_persistent_different_transforms_do_not_share_entries(shm_dir, tmp_path):
    shape = (1, 10, 9, 8)
    image = np.arange(np.prod(shape)).reshape(shape)
    got = []
    for transform in (Identity(), Flip(1)):
        ds = monai_cache.PersistentDataset([image], transform, cache_dir=tmp_path / "ours", hash_transform=json_hashing)
        got.append(torch.as_tensor(np.asarray(ds[0])))
        ds.flush()
        expected = monai.data.PersistentDataset([image], transform, cache_dir=tmp_path / "monai",
                                                hash_transform=json_hashing)[0]
        assert torch.equal(got[-1], torch.as_tensor(np.asarray(expected)))
    assert ds.cache_stats()["stored"]["entries"] == 2  # the second transform added its own entry
    assert ((got[0] - got[1]) ** 2).sum() ** 0.5 > 1


@pytest.mark.parametrize("track_meta", [True, False])
@pytest.mark.parametrize("weights_only", [True, False])
def test_persistent_track_meta_gives_metatensors_on_misses_and_hits(
    shm_dir, tmp_path, volumes, track_meta: bool, weights_only: bool
):
    data = [{"image": volumes[0]["image"]}]
    kw = dict(track_meta=track_meta, weights_only=weights_only)
    transform = Compose([LoadImaged(keys=["image"], image_only=True)])
    first = monai_cache.PersistentDataset(data, transform, cache_dir=tmp_path / "cache" / "data", **kw)
    miss = first[0]["image"]
    assert first.cache_stats()["process"]["misses"] == 1
    first.flush()
    second = monai_cache.PersistentDataset(data, transform, cache_dir=tmp_path / "cache" / "data", **kw)
    hit = second[0]["image"]
    assert second.cache_stats()["process"]["hits"] == 1
    for image in (miss, hit):
        assert isinstance(image, torch.Tensor) and isinstance(image, MetaTensor) == track_meta


def test_persistent_metatensor_metadata_survive_the_cache(shm_dir, tmp_path):
    meta = {"test_meta": 123, "foo": "bar", "test_tuple": (1, 2, 3)}
    image = MetaTensor(torch.rand(1, 8, 8, 8), meta=dict(meta), affine=torch.rand(4, 4))
    kw = dict(cache_dir=str(tmp_path / "cache" / "data"), track_meta=True, weights_only=True)
    first = monai_cache.PersistentDataset([{"image": image}], Compose([Identity()]), **kw)
    miss = first[0]["image"]
    first.flush()
    assert first.cache_stats()["stored"]["entries"] == 1
    second = monai_cache.PersistentDataset([{"image": image}], Compose([Identity()]), **kw)
    hit = second[0]["image"]
    assert second.cache_stats()["process"]["hits"] == 1
    for got in (miss, hit):
        assert isinstance(got, MetaTensor)
        for k, v in meta.items():
            assert k in got.meta and got.meta[k] == v and type(got.meta[k]) is type(v), k
        torch.testing.assert_close(got.affine, image.affine)
        assert torch.equal(got.as_tensor(), image.as_tensor())


def _stand_in_for_arbitrary_code() -> str:
    return "ran"


class _RunsCodeWhenUnpickled:
    """Unpickling (or deep-copying) it calls a function of its choosing: a pickle of it must never be loaded."""

    def __reduce__(self) -> tuple:
        return (_stand_in_for_arbitrary_code, ())


def test_persistent_never_stores_or_loads_unsafe_metadata(shm_dir, tmp_path):
    meta = {"test_meta": 123, "foo": "bar", "bad_item": _RunsCodeWhenUnpickled()}
    image = MetaTensor(torch.rand(1, 8, 8, 8), meta=meta, affine=torch.rand(4, 4))
    kw = dict(cache_dir=str(tmp_path / "cache" / "data"), track_meta=True, weights_only=True)
    # nothing is stored (the codec has no place for the object and pickling is off), so nothing can be unpickled:
    # the second dataset computes the item again, with the warning again
    for _ in range(2):
        ds = monai_cache.PersistentDataset([{"image": image}], Compose([Identity()]), **kw)
        with pytest.warns(monai_cache.MonaiCacheWarning):
            got = ds[0]["image"]
        ds.flush()
        assert isinstance(got, MetaTensor) and got.meta["test_meta"] == 123
        assert ds.cache_stats()["stored"]["entries"] == 0
        assert ds.cache_stats()["process"]["hits"] == 0


# -- tests/test_cachentransdataset.py ------------------------------------------------------------------------------


def test_cache_n_trans_caches_the_first_n_and_runs_the_rest(shm_dir, tmp_path, volumes):
    data = [{"image": volumes[0]["image"]}]
    transforms = [
        LoadImaged(keys="image", image_only=True),
        ShiftIntensityd(keys="image", offset=1.0),
        ShiftIntensityd(keys="image", offset=2.0),
        ShiftIntensityd(keys="image", offset=3.0),
    ]
    cache_dir = tmp_path / "cache" / "data"
    expected = monai.data.CacheNTransDataset(data, transforms, cache_n_trans=2, cache_dir=tmp_path / "monai")[0]
    precached = monai_cache.CacheNTransDataset(data, transforms, cache_n_trans=2, cache_dir=cache_dir)
    before = precached[0]
    precached.flush()
    postcached = monai_cache.CacheNTransDataset(data, transforms, cache_n_trans=2, cache_dir=cache_dir)
    after = postcached[0]
    assert postcached.cache_stats()["process"]["hits"] == 1
    assert_same(before, expected)  # MONAI's first-epoch item (its own hits lose the metadata: a MONAI bug)
    assert_same(after, before)
    direct = Compose(transforms)(dict(data[0]))  # the whole chain, uncached: +1 +2 +3 on the loaded image
    assert torch.equal(after["image"].as_tensor(), direct["image"].as_tensor())


# -- tests/data/test_dataloader.py ---------------------------------------------------------------------------------


def test_loader_batches_cached_and_uncached_items(shm_dir):
    data = [
        {"image": "spleen_19.nii.gz", "label": "spleen_label_19.nii.gz"},
        {"image": "spleen_31.nii.gz", "label": "spleen_label_31.nii.gz"},
    ]
    transform = Compose([DataStatsd(keys=KEYS, data_shape=False, value_range=False, data_value=True),
                         SimulateDelayd(keys=KEYS, delay_time=0.01)])
    kw = dict(cache_rate=0.5, cache_num=1, progress=False)
    ours = monai_cache.CacheDataset(data, transform, **kw)
    assert ours.cache_num == 1  # item 0 cached, item 1 not
    got = list(monai_cache.DataLoader(ours, batch_size=2, num_workers=2))
    expected = list(monai.data.DataLoader(monai.data.CacheDataset(data, transform, **kw), batch_size=2))
    assert_batches_same(got, expected)
    assert got[0]["image"] == [d["image"] for d in data] and got[0]["label"] == [d["label"] for d in data]


@pytest.mark.parametrize(
    "data",
    [
        [{"image": np.asarray([1, 2, 3])}, {"image": np.asarray([4, 5])}],
        [{"label": torch.as_tensor([[3], [2]])}, {"label": np.asarray([[1], [2]])}],
    ],
    ids=["shapes", "types"],
)
def test_the_collate_error_names_the_key(shm_dir, data: list):
    # in the main process, as upstream: in a worker, torch's shared-memory stacking fails first (MONAI's message
    # then names no key)
    with pytest.raises((TypeError, RuntimeError), match="Collate error on the key") as monais:
        list(monai.data.DataLoader(monai.data.Dataset(data), batch_size=2, num_workers=0))
    for ds in (monai.data.Dataset(data), monai_cache.CacheDataset(data, progress=False)):
        with pytest.raises(monais.type, match="Collate error on the key"):
            list(monai_cache.DataLoader(ds, batch_size=2, num_workers=0))


class _RandomDataset(torch.utils.data.Dataset, Randomizable):
    def __getitem__(self, index: int) -> np.ndarray:
        return self.R.randint(0, 1000, (1,))

    def __len__(self) -> int:
        return 8


@pytest.fixture
def determinism():
    yield set_determinism
    set_determinism(None)


@pytest.mark.parametrize("workers", [0, 1])
def test_randomizable_datasets_draw_monais_numbers(shm_dir, determinism, workers: int):
    outputs = []
    for loader_cls in (monai.data.DataLoader, monai_cache.DataLoader):
        determinism(0)
        loader = loader_cls(_RandomDataset(), batch_size=2, shuffle=True, num_workers=workers)
        outputs.append(list(loader))
    assert_batches_same(outputs[1], outputs[0])
    assert len({int(x) for b in outputs[0] for x in b}) > 1


def test_zip_datasets_draw_monais_numbers(shm_dir, determinism):
    outputs = []
    for loader_cls in (monai.data.DataLoader, monai_cache.DataLoader):
        determinism(0)
        ds = monai.data.ZipDataset([_RandomDataset(), monai.data.ZipDataset([_RandomDataset(), _RandomDataset()])])
        loader = loader_cls(ds, batch_size=2, num_workers=2)
        outputs.append([list(loader) for _ in range(2)])
    for got, expected in zip(outputs[1], outputs[0]):
        assert_batches_same(got, expected)


# -- tests/data/utils/test_decollate.py ----------------------------------------------------------------------------


def assert_values_match(a: Any, b: Any, path: str = "item") -> None:
    """Upstream's comparison of a decollated item with the dataset's: same keys in order, equal strings and
    numbers, equal array values; the ``*_transforms`` records are not compared."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), path
        for k in a:
            if not (isinstance(k, str) and k.endswith("_transforms")):
                assert_values_match(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_values_match(x, y, f"{path}[{i}]")
    elif isinstance(a, (torch.Tensor, np.ndarray)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=path)
    else:
        assert a == b, path


@pytest.mark.parametrize(
    "middle",
    [
        lambda: (SpatialPadd("image", 30), RandFlipd("image", prob=1.0, spatial_axis=1)),
        lambda: (RandRotate90d("image", prob=0.0, max_k=1),),
        lambda: (RandAffined("image", prob=0.0, translate_range=10),),
    ],
    ids=["pad-flip", "rotate90", "affine"],
)
def test_decollated_batches_are_the_datasets_items(shm_dir, volumes, middle: Callable):
    data = [{"image": v["image"]} for v in volumes[:6]]
    # as upstream, a nested Compose: caching stops there (Compose is Randomizable), after LoadImaged
    transform = Compose([LoadImaged("image", image_only=True),
                         Compose([EnsureChannelFirstd("image"), Compose(list(middle())), ToTensord("image")])])
    decollated = {}
    for name, module in (("monai", monai.data), ("ours", monai_cache)):
        ds = module.CacheDataset(data, transform, progress=False)
        items = []
        for b, batch in enumerate(seeded_epoch(module.DataLoader(ds, batch_size=2, shuffle=False, num_workers=2))):
            for by in (decollate_batch(batch), Decollated(detach=True)(batch)):
                for i, d in enumerate(by):
                    assert_values_match(ds[b * 2 + i], d)
            items += decollate_batch(batch)
        assert len(items) == len(data)
        decollated[name] = items
    assert_same(decollated["ours"], decollated["monai"])


# -- tests/test_inverse_collation.py, tests/transforms/inverse/test_inverse.py and test_invertd.py -----------------


@pytest.mark.parametrize(
    "random, collate_fn",
    [
        (lambda: RandFlipd(KEYS, prob=0.5, spatial_axis=[1, 2]), None),
        (lambda: RandAxisFlipd(KEYS, prob=0.5), pad_list_data_collate),
        (lambda: RandZoomd(KEYS, prob=0.5, min_zoom=0.5, max_zoom=1.1, keep_size=True), None),
        (lambda: RandAffined(KEYS, prob=0.5, rotate_range=np.pi), pad_list_data_collate),
    ],
    ids=["flip-default", "axisflip-pad", "zoom-default", "affine-pad"],
)
def test_collated_items_keep_matching_inverse_records(shm_dir, volumes, random: Callable, collate_fn: Any):
    random_transform = random()
    random_name = type(random_transform).__name__  # the class its records name
    # default_collate needs one size: pad or crop to it; pad_list_data_collate pads the batch itself
    transform = loaded(random_transform, *([] if collate_fn else [ResizeWithPadOrCropd(KEYS, 24)]))
    batches = {}
    for name, module in (("monai", monai.data), ("ours", monai_cache)):
        ds = module.CacheDataset(volumes, transform, progress=False)
        collate = {"collate_fn": collate_fn} if collate_fn else {}  # else MONAI's list_data_collate
        batches[name] = seeded_epoch(module.DataLoader(ds, batch_size=3, num_workers=2, **collate))
        for batch in batches[name]:
            items = decollate_batch(batch)
            assert 0 < len(items) <= 3
            for item in items:
                assert isinstance(item["image"], MetaTensor)
                image_ops, label_ops = item["image"].applied_operations, item["label"].applied_operations
                np.testing.assert_array_equal(image_ops[-1]["orig_size"], label_ops[-1]["orig_size"])
                # one random decision for both keys, recorded for each
                drawn = [[op[TraceKeys.DO_TRANSFORM] for op in ops if op[TraceKeys.CLASS_NAME] == random_name]
                         for ops in (image_ops, label_ops)]
                assert len(drawn[0]) == 1 and drawn[0] == drawn[1]
    assert_batches_same(batches["ours"], batches["monai"], skip_keys=MADE_IN_CALLS)


def test_inverting_cropped_samples_of_a_batch_restores_the_original_shape(shm_dir, volumes):
    num_samples, batch_size = 3, 4
    transform = loaded(SpatialPadd(KEYS, (28, 24, 20)),
                       RandCropByPosNegLabeld(KEYS, "label", (12, 12, 8), num_samples=num_samples))
    original_shape = transform.transforms[1](transform.transforms[0](dict(volumes[0])))["label"].shape[1:]
    conv = torch.nn.Conv3d(1, 1, 1)  # stands for the model: its output keeps the label's metadata
    firsts = {}
    for name, module in (("monai", monai.data), ("ours", monai_cache)):
        ds = module.CacheDataset(volumes, transform, progress=False)
        loader = module.DataLoader(ds, batch_size=batch_size, shuffle=False, num_workers=2)
        torch.manual_seed(0)
        batch = firsts[name] = next(iter(loader))
        del loader
        assert batch["image"].shape[0] == batch_size * num_samples
        labels = batch["label"]
        assert isinstance(labels, MetaTensor)
        segs = decollate_batch(conv(labels.float()).detach())
        assert isinstance(segs[0], MetaTensor)
        seg = segs[0]
        convert_applied_interp_mode(seg.applied_operations, mode="nearest", align_corners=None)
        crop = seg.applied_operations.pop(-1)  # undo the last crop by hand, as upstream does
        resizer = ResizeWithPadOrCrop(spatial_size=crop["orig_size"])
        with resizer.trace_transform(False):
            seg = resizer(seg)
        with allow_missing_keys_mode(transform):
            for candidate in (seg, reset_ops_id(copy.deepcopy(seg))):
                assert transform.inverse({"label": candidate})["label"].shape[1:] == original_shape
    assert_same(firsts["ours"], firsts["monai"], skip_keys=MADE_IN_CALLS)


def test_invertd_restores_items_read_through_the_cache_and_workers(shm_dir, volumes):
    transform = loaded(
        Orientationd(KEYS, "RPS", labels=None),
        Spacingd(KEYS, pixdim=(1.2, 1.01, 0.9), mode=["bilinear", "nearest"], dtype=np.float32),
        ScaleIntensityd("image", minv=1, maxv=10),
        RandFlipd(KEYS, prob=0.5, spatial_axis=[1, 2]),
        RandAxisFlipd(KEYS, prob=0.5),
        RandZoomd(KEYS, prob=0.5, min_zoom=0.5, max_zoom=1.1, keep_size=True),
        RandAffined(KEYS, prob=0.5, rotate_range=np.pi, mode=["bilinear", "nearest"]),  # no scipy
        ResizeWithPadOrCropd(KEYS, 20),
        CastToTyped(KEYS, dtype=[torch.uint8, np.uint8]),
        CopyItemsd("label", times=1, names=["label_inverted"]),
        CopyItemsd("image", times=1, names=["image_inverted"]),
    )
    inverter = Invertd(keys=["image_inverted", "label_inverted"], transform=transform, orig_keys=["label", "label"],
                       nearest_interp=True, device=None, post_func=torch.as_tensor)
    data = volumes[:4]
    inverted = {}
    for name, module in (("monai", monai.data), ("ours", monai_cache)):
        ds = module.CacheDataset(data, transform, progress=False)
        items = []
        for batch in seeded_epoch(module.DataLoader(ds, batch_size=1, num_workers=2)):
            items += [inverter(item) for item in decollate_batch(batch)]
        for item, source in zip(items, data):
            original = LoadImaged(KEYS, image_only=True)(dict(source))
            for key in ("image_inverted", "label_inverted"):
                got = item[key]
                assert got.shape[1:] == original["label"].shape
                assert torch.equal(got.to(torch.uint8).float(), got.float())  # nearest: whole numbers only
            assert item["label_inverted"].meta["filename_or_obj"] == source["label"]
            assert item["image"].shape[1:] == (20, 20, 20)
        inverted[name] = items
    assert_same(inverted["ours"], inverted["monai"], skip_keys=MADE_IN_CALLS)

