"""monai_cache.CacheDataset against monai.data.CacheDataset: same outputs, one shared cache, MONAI bugs fixed."""

from __future__ import annotations

import gc
import multiprocessing
import os
import time
import warnings
import weakref
from collections import Counter

import monai.data
import numpy as np
import pytest
import torch
from helpers import RandZeroInPlace, Times10, chain, python_c, read_calls
from monai.data import DataLoader
from monai.transforms import Compose, RandomizableTrait, Transform
from test_codec import assert_same

import monai_cache

HANG_GUARD_S = 120  # seconds a DataLoader waits for a batch, then raises: a hang fails the test; no pass is timed

# the drop-in tests: CI runs them on the oldest supported MONAI and on monai-weekly too (.ci/run)
pytestmark = pytest.mark.dropin


def without_ids(x):
    """Applied-operation records carry id(transform); equal chains built twice differ only there."""
    if isinstance(x, dict):
        return {k: without_ids(v) for k, v in x.items() if k != "id"}
    if isinstance(x, list):
        return [without_ids(v) for v in x]
    return x


def outputs(ds, seed, n=None):
    ds.transform.set_random_state(seed)
    return [ds[i] for i in range(n or len(ds))]


@pytest.mark.parametrize("runtime_cache", [False, True, "processes", "a Manager list"])
@pytest.mark.parametrize("copy_cache", [True, False])
def test_same_tensors_and_metadata_as_monai(shm_dir, volumes, runtime_cache, copy_cache):
    tr = chain()
    kw = dict(transform=tr, progress=False, copy_cache=copy_cache)
    lists = []
    if runtime_cache == "a Manager list":  # Auto3DSeg's segresnet: one each, as each would be filled by MONAI
        manager = multiprocessing.Manager()
        lists = [manager.list([None] * len(volumes)) for _ in range(2)]
    ref = monai.data.CacheDataset(volumes, runtime_cache=lists[0] if lists else runtime_cache, **kw)
    ours = monai_cache.CacheDataset(volumes, runtime_cache=lists[1] if lists else runtime_cache, **kw)
    assert isinstance(ours, monai.data.CacheDataset)
    for epoch in range(2):  # miss then hit for the runtime modes
        expected = outputs(ref, 100 + epoch)
        got = outputs(ours, 100 + epoch)
        for e, g in zip(expected, got):
            assert_same(e, g)
    if runtime_cache in ("processes", "a Manager list"):
        assert "ListProxy" not in type(ours._cache).__name__  # shared memory, not a Manager
        assert ours.cache_stats()["total"]["hits"] == len(volumes)
    if lists:  # MONAI's items are in its list; ours stays empty (the user's object, left as it was)
        assert None not in list(lists[0]) and list(lists[1]) == [None] * len(volumes)
        assert ours.runtime_cache is lists[1]
        manager.shutdown()
    ours.release()


def _skippable_chain() -> Compose:
    """Random transforms that may not run (``prob`` 0.5): one that does not hands on its input object itself."""
    from monai.transforms import EnsureTyped, RandFlipd, RandRotate90d

    return Compose([
        EnsureTyped(keys="image", track_meta=True),
        RandFlipd(keys="image", prob=0.5, spatial_axis=0),
        RandRotate90d(keys="image", prob=0.5),
    ])  # fmt: skip


@pytest.mark.parametrize(
    "kw",
    [{}, {"runtime_cache": True}, {"process_cache": True}, {"shared_memory": False}],
    ids=["eager", "on-the-fly", "kept-in-process", "private"],
)
def test_copy_cache_false_hands_out_no_records_of_earlier_epochs(shm_dir, kw):
    """MONAI bug fixed (docs/migrating.md): with ``copy_cache=False``, a random transform that does not run on an item
    records itself in its input's ``applied_operations``, and that input is MONAI's cached MetaTensor, so MONAI's
    items gather the records of earlier epochs. Ours are over 3 epochs what MONAI gives with ``copy_cache=True``:
    reads from shared memory are new objects, and an item a process keeps (or a private cache holds) goes to the
    random transforms in new containers over its memory."""
    rng = np.random.default_rng(0)
    data = [{"image": rng.random((1, 6, 6), dtype=np.float32)} for _ in range(6)]
    transform = _skippable_chain()
    ref = monai.data.CacheDataset(data, transform, progress=False)
    ours = monai_cache.CacheDataset(data, transform, progress=False, copy_cache=False, **kw)
    for epoch in range(3):
        for expected, got in zip(outputs(ref, epoch), outputs(ours, epoch)):
            assert_same(expected, got, skip_keys=("id",))  # RandRotate90d records a Rotate90 it makes per call
            assert len(got["image"].applied_operations) == 2
    if kw.get("process_cache"):
        assert ours.cache_stats()["process_cache"]["hits"] > 0  # the kept items served the reads
    ours.release()


@pytest.mark.parametrize(
    "name, kw",
    [
        ("CacheDataset", {"progress": False}),
        ("CacheDataset", {"progress": False, "runtime_cache": True}),
        ("SmartCacheDataset", {"progress": False, "cache_num": 4, "replace_rate": 0.5}),
        ("PersistentDataset", {"cache_dir": "{tmp}"}),
        ("CacheNTransDataset", {"cache_dir": "{tmp}", "cache_n_trans": 3}),
    ],
    ids=["cache", "cache-runtime", "smartcache", "persistent", "cache_n_trans"],
)
def test_monais_dataloader_seeds_the_transforms_as_it_seeds_monais_after_reads(shm_dir, volumes, tmp_path, name, kw):
    """MONAI's DataLoader, made with num_workers=0 (and each worker), seeds the random transforms it finds in the
    dataset's attributes (``set_rnd``). Whatever ours keeps after reads must not be found and seeded again."""
    from monai.data.utils import set_rnd
    from monai.transforms import Randomizable

    datasets = []
    for module, sub in ((monai.data, "monai"), (monai_cache, "ours")):
        args = {k: v.format(tmp=tmp_path / sub) if isinstance(v, str) else v for k, v in kw.items()}
        tr = chain()
        tr.set_random_state(1)  # SmartCacheDataset is itself Randomizable: set_rnd seeds it, not its transforms
        datasets.append(getattr(module, name)(volumes, transform=tr, **args))
    ref, ours = datasets
    for ds in datasets:
        for i in range(len(ds)):  # reads first: what a dataset remembers of them must not change the seeding
            ds[i]
    for seed in (0, 5):
        draws = []
        for ds in datasets:
            set_rnd(ds, seed)
            draws.append([t.R.randint(1 << 30) for t in ds.transform.transforms if isinstance(t, Randomizable)])
            set_rnd(ds, seed)
        assert draws[0] == draws[1]
        if name != "CacheNTransDataset":  # MONAI's hits there lose their metadata (a bug ours fixes): not compared
            for i in range(len(ref)):
                assert_same(ref[i], ours[i], skip_keys=("id",))
    if hasattr(ours, "release"):
        ours.release()


def test_compatible_cache_attributes(shm_dir, volumes):
    tr = chain(crop=None)
    ref = monai.data.CacheDataset(volumes, tr, cache_rate=0.5, progress=False)
    ours = monai_cache.CacheDataset(volumes, tr, cache_rate=0.5, progress=False)
    assert ours.cache_num == ref.cache_num == 4 and len(ours._cache) == len(ref._cache) == 4
    for i in range(4):
        assert_same(ref._cache[i], ours._cache[i])
    assert [x is not None for x in ours._cache] == [True] * 4
    assert ours._hash_keys == ref._hash_keys == []
    # items past cache_num are computed on the fly, as in MONAI
    assert_same(ref[6], ours[6])
    assert_same(ref[-1], ours[-1])
    h_ref = monai.data.CacheDataset(volumes + volumes[:2], tr, hash_as_key=True, progress=False)
    h_ours = monai_cache.CacheDataset(volumes + volumes[:2], tr, hash_as_key=True, progress=False)
    assert h_ours._hash_keys == h_ref._hash_keys and h_ours.cache_num == 8


@pytest.mark.parametrize("kw", [{}, {"runtime_cache": True}, {"cache_num": 3}, {"shared_memory": False}])
def test_out_of_range_index_raises_so_iteration_ends(shm_dir, kw):
    data = [{"x": i} for i in range(4)]
    ref = monai.data.CacheDataset(data, progress=False, **{k: v for k, v in kw.items() if k != "shared_memory"})
    ours = monai_cache.CacheDataset(data, progress=False, **kw)
    assert list(ours) == list(ref) == data  # Python's iteration protocol stops at the IndexError
    for index in (4, -5, 100):
        with pytest.raises(IndexError):
            ref[index]
        with pytest.raises(IndexError, match=f"index {index} is out of range for a dataset of 4 items"):
            ours[index]
    assert ours[-1] == ref[-1] == {"x": 3}


def test_transform_reassigned_to_a_plain_callable_gives_monais_error(shm_dir):
    for cls in (monai.data.CacheDataset, monai_cache.CacheDataset):
        ds = cls([{"x": 1}], progress=False)
        ds.transform = lambda d: d
        with pytest.raises(ValueError, match=r"transform must be an instance of monai\.transforms\.Compose"):
            ds[0]


class _PlusOne(Transform):
    def __call__(self, d):
        return {"x": d["x"] + 1}


class _RandTimes3(Transform, RandomizableTrait):  # random by position, deterministic in value: outputs compare
    def __call__(self, d):
        return {"x": d["x"] * 3}


class _FailOn(Transform):
    def __init__(self, bad: float) -> None:
        self.bad = bad

    def __call__(self, d):
        if d["x"] == self.bad:
            raise ValueError(f"cannot make x={self.bad}")
        return d


def test_a_batch_publishes_its_items_together_once_each_even_when_it_fails(shm_dir):
    """A DataLoader batch (``__getitems__``) publishes the entries it computed when it ends: an index twice in a
    batch is computed once (its second read decodes what the first staged), and the items computed before one
    that raises are published all the same."""
    ds = monai_cache.CacheDataset(
        [{"x": float(i)} for i in range(6)], Compose([_PlusOne(), _FailOn(5.0)]), runtime_cache=True, progress=False
    )
    assert [d["x"] for d in ds.__getitems__([1, 2, 1])] == [2.0, 3.0, 2.0]
    stats = ds.cache_stats()
    assert (stats["total"]["misses"], stats["total"]["hits"], stats["stored"]["entries"]) == (2, 1, 2)
    with pytest.raises(RuntimeError, match="applying transform") as raised:  # MONAI's Compose wraps the error
        ds.__getitems__([3, 4, 5])
    assert "cannot make x=5.0" in str(raised.value.__cause__)
    assert ds._store.missing() == [0, 4, 5]  # 3 was published when the failed batch ended
    assert [d["x"] for d in ds.__getitems__([3, 0])] == [4.0, 1.0]
    assert ds.cache_stats()["total"]["hits"] == 2


class _Logged(Transform):
    """Logs ``(what, item, whether its entry is published)`` when it runs: the order of a batch's transforms."""

    def __init__(self, log: list, what: str, n: int = 0) -> None:
        self.log, self.what, self.n, self.ds = log, what, n, None

    def __call__(self, d):
        i = int(d["i"])
        self.log.append((self.what, i, self.ds is not None and self.ds._store.contains(i)))
        return {"i": i, "x": torch.full((self.n,), float(i)), "zeroed": torch.ones(1)} if self.n else d


class _RandLogged(_Logged, RandomizableTrait):
    pass


@pytest.mark.parametrize("item_mib", [0, 5], ids=["small", "5MiB"])
def test_a_batch_runs_its_cached_parts_then_its_random_transforms_in_order(shm_dir, item_mib):
    """``__getitems__``: small items' cached parts all run first (the misses published together, before any random
    transform: nothing has written into them), then each item's random transforms in the batch's order; items of 4
    MiB or more go one at a time (each one's random transforms before the next is computed), as one by one. The
    random numbers drawn are MONAI's read one by one, and a random transform that writes into its input (on the very
    item computed) changes no entry."""
    from monai.transforms import RandScaleIntensityd

    n = (item_mib << 18) or 4  # float32 elements

    def transform(log):
        return Compose([
            _Logged(log, "cached", n), _RandLogged(log, "random"), RandScaleIntensityd(keys="x", factors=0.5, prob=0.5),
            RandZeroInPlace(keys="zeroed"),
        ])  # fmt: skip

    data = [{"i": i} for i in range(3)]
    theirs = monai.data.CacheDataset(data, transform([]), runtime_cache=True, progress=False)
    theirs.transform.set_random_state(seed=3)
    expected = [theirs[i] for i in range(3)]
    log: list = []
    ds = monai_cache.CacheDataset(data, transform(log), runtime_cache=True, progress=False)
    ds.transform.transforms[1].ds = ds
    ds.transform.set_random_state(seed=3)
    got = ds.__getitems__([0, 1, 2])
    if item_mib:
        assert log == [entry for i in range(3) for entry in (("cached", i, False), ("random", i, True))]
    else:
        assert log == [("cached", i, False) for i in range(3)] + [("random", i, True) for i in range(3)]
    for e, g in zip(expected, got):
        assert_same(e, g)
    for i in range(3):
        assert float(ds._cache[i]["zeroed"].sum()) == 1.0 and float(ds._cache[i]["x"][0]) == i
    assert float(got[0]["zeroed"].sum()) == 0.0  # the random transform did write into what it was given
    ds.release()


class _KeepRef(Transform):
    """A cached transform whose items' tensors are watched (weak references)."""

    def __init__(self, refs: list) -> None:
        self.refs = refs

    def __call__(self, d):
        x = torch.full((4,), float(d["i"]))
        self.refs.append(weakref.ref(x))
        return {"i": d["i"], "x": x}


class _RandReplace(Transform, RandomizableTrait):
    """A random transform that makes a new tensor, and notes which of the batch's cached tensors are still alive."""

    def __init__(self, refs: list, alive: list) -> None:
        self.refs, self.alive = refs, alive

    def __call__(self, d):
        gc.collect()
        self.alive.append([ref() is not None for ref in self.refs])
        return {"i": d["i"], "x": d["x"] + 1}


def test_a_batch_lets_go_of_each_cached_part_once_its_random_transforms_ran(shm_dir):
    """In a batch, an item's cached part (here the computed item itself) is not held past its random transforms,
    as item by item: when item k's random transforms run, the cached parts of the items before it are gone."""
    refs: list = []
    alive: list = []
    ds = monai_cache.CacheDataset([{"i": i} for i in range(3)], Compose([_KeepRef(refs), _RandReplace(refs, alive)]),
                                  runtime_cache=True, progress=False)  # fmt: skip
    assert [float(d["x"][0]) for d in ds.__getitems__([0, 1, 2])] == [1.0, 2.0, 3.0]
    assert alive == [[True, True, True], [False, True, True], [False, False, True]]
    ds.release()


def test_a_subclass_with_its_own_transform_reads_a_batch_through_it(shm_dir):
    """A subclass overriding ``_transform`` (a MONAI habit) gets a DataLoader batch through it, item by item."""

    class Doubled(monai_cache.CacheDataset):
        def _transform(self, index):
            return {"x": super()._transform(index)["x"] * 2}

    ds = Doubled([{"x": float(i)} for i in range(3)], Compose([_PlusOne(), _RandTimes3()]), runtime_cache=True,
                 progress=False)  # fmt: skip
    assert [d["x"] for d in ds.__getitems__([0, 2])] == [6.0, 18.0]
    assert ds.cache_stats()["stored"]["entries"] == 2
    ds.release()


class _ToSet(Transform):
    def __call__(self, d):
        return {"x": {d["x"]}}  # a set: the codec cannot store it


def test_a_batch_of_items_the_codec_cannot_store_counts_each_miss_machine_wide(shm_dir):
    ds = monai_cache.CacheDataset([{"x": float(i)} for i in range(3)], Compose([_ToSet()]), runtime_cache=True,
                                  progress=False)
    with pytest.warns(monai_cache.UncachedItemWarning):
        assert [d["x"] for d in ds.__getitems__([0, 1])] == [{0.0}, {1.0}]
    stats = ds.cache_stats()
    assert (stats["total"]["misses"], stats["total"]["unsupported"], stats["stored"]["entries"]) == (2, 2, 0)


@pytest.mark.parametrize("index", [1, np.int64(1), True])
def test_chain_changed_after_reads_is_followed_as_monai_does(shm_dir, index):
    """A hit finds the first random transform once per chain (not per read): a chain swapped after reads, or whose
    tuple of transforms is replaced, must still run from its own first random transform, as MONAI's does."""
    got = {}
    for cls in (monai.data.CacheDataset, monai_cache.CacheDataset):
        ds = cls([{"x": 1}, {"x": 2}], Compose([_PlusOne(), _RandTimes3()]), progress=False)
        first = ds[index]["x"]  # cached (x + 1), then x 3
        ds.transform = Compose([_PlusOne(), _PlusOne(), _RandTimes3()])  # the cache keeps x + 1; runs from 2
        second = ds[index]["x"]
        ds.transform.transforms = (_RandTimes3(), _RandTimes3())  # a new tuple: runs from 0
        third = ds[index]["x"]
        ds.transform.transforms = [_PlusOne(), _RandTimes3()]  # a list (never memoised): runs from 1
        fourth = ds[index]["x"]
        got[cls] = (first, second, third, fourth, ds[0:2][1]["x"], ds[[1]][0]["x"])
    assert got[monai_cache.CacheDataset] == got[monai.data.CacheDataset] == (9, 9, 27, 9, 9, 9)


def _number_to_array(x):
    return np.full((4,), x, np.float32)


def _numbers_chain(top: float = 4.0) -> Compose:
    from monai.transforms import EnsureTyped, Lambdad, ScaleIntensityRanged

    return Compose([Lambdad("x", _number_to_array), EnsureTyped("x"),
                    ScaleIntensityRanged("x", a_min=0.0, a_max=top, b_min=0.0, b_max=1.0)])  # fmt: skip


# a setting: (the first dataset's, the second's, MONAI's for the second, the tiers whose entries it changes)
ENTRY_SETTINGS = {
    "cache_rate": ({}, {"cache_rate": 0.5}, {"cache_rate": 0.5}, ("shared memory",)),
    # as many entries (4), numbered otherwise: items 0 0 1 1 against the distinct items 0 1 2 3
    "hash_as_key": ({"cache_rate": 0.5}, {"hash_as_key": True}, {"hash_as_key": True}, ("shared memory",)),
    "as_contiguous": ({}, {"as_contiguous": False}, {"as_contiguous": False}, ("shared memory", "disk")),
    "allow_pickle": ({}, {"allow_pickle": True}, {}, ("shared memory", "disk")),
    "set_track_meta": ({}, {}, {}, ("shared memory", "disk")),
    "monai": ({}, {}, {}, ("shared memory", "disk")),
    "transforms": ({}, {}, {}, ("disk",)),  # the shared-memory name's part: tests/test_fingerprint.py
}


@pytest.mark.parametrize(
    "setting, tier", [(setting, tier) for setting, (*_, tiers) in ENTRY_SETTINGS.items() for tier in tiers]
)
def test_a_dataset_whose_entries_could_differ_gets_a_cache_of_its_own(shm_dir, tmp_path, monkeypatch, setting, tier):
    """Over the same data and transforms, a dataset whose settings would give other entries (which items it caches
    and how it numbers them, what it stores, its transforms, the MONAI that computes them) never reads another's:
    it gets a shared-memory cache of its own while the other lives, and entries of its own in a disk tier both
    use, and MONAI's items."""
    from monai.data import get_track_meta, set_track_meta

    from monai_cache.disk_format import stored_entries
    from monai_cache.shm import list_caches

    firsts, ours, monais, _ = ENTRY_SETTINGS[setting]
    data = [{"x": i // 2} for i in range(8)]  # 0 0 1 1 2 2 3 3
    disk = {"cache_dir": str(tmp_path / "disk")} if tier == "disk" else {}
    first = monai_cache.CacheDataset(data, _numbers_chain(), progress=False, **firsts, **disk)
    for i in range(len(data)):
        first[i]
    if tier == "disk":
        assert first.flush(60)
        first.release()  # the next dataset's shared-memory cache fills from the disk tier
    if setting == "monai":
        monkeypatch.setattr(monai, "__version__", monai.__version__ + ".post99")
    top = 8.0 if setting == "transforms" else 4.0
    track_meta = get_track_meta()
    set_track_meta(setting != "set_track_meta")
    try:
        second = monai_cache.CacheDataset(data, _numbers_chain(top), progress=False, **ours, **disk)
        reference = monai.data.CacheDataset(data, _numbers_chain(top), progress=False, **monais)
        for i in range(len(data)):
            assert_same(second[i], reference[i], skip_keys=("id",))  # the id: a transform object's address
    finally:
        set_track_meta(track_meta)
    if tier == "disk":
        assert second.flush(60)
        assert len(list(stored_entries(str(tmp_path / "disk")))) == 2 * 4  # 4 distinct items, twice
    else:
        assert len(list_caches(shm_dir)) == 2
    second.release()
    first.release()


def test_hash_as_key_with_runtime_cache_returns_the_right_item(shm_dir):
    """MONAI bug: the lazy path loads data[cache_position] instead of the item for that hash."""
    data = [{"x": 0}, {"x": 1}, {"x": 1}, {"x": 2}]
    tr = Compose([Times10(keys="x")])
    ref = monai.data.CacheDataset(data, tr, hash_as_key=True, runtime_cache=True, progress=False)
    assert [ref[i]["x"] for i in range(4)] == [0, 10, 10, 10]  # MONAI's wrong answer (documented)
    for shared in (True, False):
        ours = monai_cache.CacheDataset(
            data, tr, hash_as_key=True, runtime_cache=True, progress=False, shared_memory=shared
        )
        assert [ours[i]["x"] for i in range(4)] == [0, 10, 10, 20]
        assert ours.cache_num == 3


def test_transform_writing_in_place_never_changes_the_cache(shm_dir, volumes):
    for copy_cache in (True, False):
        ds = monai_cache.CacheDataset(
            volumes[:2], Compose([*chain(crop=None).transforms, RandZeroInPlace(keys="image")]),
            copy_cache=copy_cache, progress=False,
        )
        assert float(ds[0]["image"].abs().sum()) == 0.0  # the transform zeroed its input...
        cached = ds._cache[0]["image"]
        assert float(cached.abs().sum()) > 0  # ...but the shared copy is intact
        assert float(ds[0]["image"].abs().sum()) == 0.0
        assert torch.equal(ds._cache[0]["image"], cached)
        ds.release()


def test_transform_writing_in_place_never_changes_what_a_worker_computed_on_the_fly(shm_dir, volumes):
    """On the fly, a DataLoader worker publishes the small entries a batch computed when the batch ends, after the
    random transforms have run on the computed items it hands out: what it publishes must be what the cached
    transforms made, not what a transform later wrote into it."""
    ds = monai_cache.CacheDataset(
        volumes[:2], Compose([*chain(crop=None).transforms, RandZeroInPlace(keys="image")]), runtime_cache=True,
        progress=False,
    )
    loader = DataLoader(ds, batch_size=2, num_workers=1, multiprocessing_context="fork", collate_fn=list)
    (batch,) = list(loader)  # one batch of both (their shapes differ: not stacked)
    assert ds.cache_stats()["stored"]["entries"] == 2
    expected = monai.data.Dataset(volumes[:2], chain(crop=None))
    for i in range(2):
        assert not torch.equal(batch[i]["image"], expected[i]["image"])  # the transform changed what it was given...
        assert torch.equal(ds._cache[i]["image"], expected[i]["image"])  # ...but not the entry
    ds.release()


@pytest.mark.parametrize("tiers", ["shm", "shm+disk"])
@pytest.mark.parametrize("kept", ["array", "tensor"])
@pytest.mark.parametrize("read", ["batch", "item"])
def test_memory_a_cached_transform_keeps_is_never_written_by_a_random_transform(
    shm_dir, tmp_path, volumes, read, kept, tiers
):
    """On a miss, the computed item goes on to the random transforms without MONAI's deep copy. A cached transform
    that returns memory it keeps (a preloaded mask: a numpy array that ``torch.as_tensor`` shares, or a tensor
    itself) must not have it written by a random transform that writes into its input (MONAI's
    ``RandCoarseDropoutd``): not the kept mask, not the entries computed after it, not the items read. Read in
    DataLoader batches (``__getitems__``: entries staged, published when the batch ends) and one by one, with and
    without the disk tier (whose entries, read back, are the reader's own)."""
    from monai.transforms import Lambda, RandCoarseDropoutd
    from monai.utils import TraceKeys

    mask = np.ones((1, 6, 6, 6), np.float32)
    kept_mask = torch.as_tensor(mask) if kept == "array" else torch.ones(1, 6, 6, 6)

    def transform() -> Compose:
        tr = Compose([
            *chain(crop=None).transforms,
            Lambda(lambda d: {**d, "mask": kept_mask}),
            RandCoarseDropoutd(keys="mask", holes=4, spatial_size=2, fill_value=0.0, prob=1.0),
        ])  # fmt: skip
        return tr.set_random_state(seed=0)

    def two_epochs(ds) -> list:
        if read == "batch" and hasattr(ds, "__getitems__"):
            return [ds.__getitems__([0, 1, 2]) for _ in range(2)]
        return [[ds[i] for i in range(3)] for _ in range(2)]

    theirs = two_epochs(monai.data.CacheDataset(volumes[:3], transform(), runtime_cache=True, progress=False))
    assert float(kept_mask.sum()) == 216  # MONAI deep-copies what it cached: the mask is left alone
    cache_dir = str(tmp_path / "disk") if tiers == "shm+disk" else None
    ds = monai_cache.CacheDataset(volumes[:3], transform(), runtime_cache=True, progress=False, cache_dir=cache_dir)
    ours = two_epochs(ds)
    assert float(kept_mask.sum()) == 216 and mask.sum() == 216
    assert ds.cache_stats()["stored"]["entries"] == 3
    for i in range(3):
        assert float(ds._cache[i]["mask"].sum()) == 216  # what the cached transforms made
    assert float(ours[0][0]["mask"].sum()) < 216  # the random transform did write into what it was given
    for epoch, (a, b) in enumerate(zip(ours, theirs)):
        assert_same(a, b, f"epoch{epoch}", skip_keys=(TraceKeys.ID,))  # ID: an object's address
    ds.release()


@pytest.mark.parametrize("loader_class", [DataLoader, monai_cache.DataLoader], ids=["monai-loader", "our-loader"])
@pytest.mark.parametrize("runtime_cache", [False, True], ids=["eager", "on-the-fly"])
def test_epochs_through_dataloader_workers_equal_monais(shm_dir, volumes, runtime_cache, loader_class):
    """What a training loop gets, epoch by epoch, through DataLoader workers (batches: ``__getitems__``), with
    MONAI's random transforms after the cache, one of which writes into its input (``RandCoarseDropoutd``). Items
    equal those of MONAI's CacheDataset through MONAI's DataLoader."""
    from monai.transforms import RandCoarseDropoutd, RandFlipd
    from monai.utils import TraceKeys

    tr = Compose([
        *chain(crop=None).transforms,
        RandCoarseDropoutd(keys="image", holes=2, spatial_size=4, fill_value=5.0, prob=0.5),
        RandFlipd(keys=["image", "label"], spatial_axis=0, prob=0.5),
    ])  # fmt: skip

    def three_epochs(dataset_class, make_loader):
        ds = dataset_class(volumes[:4], tr, runtime_cache=runtime_cache, progress=False)
        torch.manual_seed(0)  # the workers' seeds, and so the random transforms' states
        loader = make_loader(ds, batch_size=2, num_workers=2, persistent_workers=True, collate_fn=list,
                             multiprocessing_context="fork", timeout=HANG_GUARD_S)  # fmt: skip
        return [[item for batch in loader for item in batch] for _ in range(3)]  # whole volumes: not stacked

    theirs = three_epochs(monai.data.CacheDataset, DataLoader)
    ours = three_epochs(monai_cache.CacheDataset, loader_class)
    for epoch, (a, b) in enumerate(zip(ours, theirs)):
        assert_same(a, b, f"epoch{epoch}", skip_keys=(TraceKeys.ID,))


@pytest.mark.parametrize("kw", [{}, {"runtime_cache": True}, {"runtime_cache": True, "cache_dir": "disk"}],
                         ids=["eager", "runtime", "runtime+disk"])
def test_thread_workers_share_the_cache_safely(shm_dir, volumes, tmp_path, kw):
    """ThreadDataLoader(use_thread_workers=True): worker threads of one process read, compute and write the same
    cache at once (fill threads too). A chain without random transforms: MONAI's are not thread-safe there."""
    tr = chain(crop=None)
    expected = [monai.data.Dataset(volumes, tr)[i] for i in range(len(volumes))]
    args = {k: str(tmp_path / v) if k == "cache_dir" else v for k, v in kw.items()}
    ds = monai_cache.CacheDataset(volumes, tr, progress=False, num_workers=4, **args)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a failed write or a corrupt entry warns
        warnings.filterwarnings("ignore", message=".*worker processes in total.*")  # torch: 4 workers on 2 cores
        for _epoch in range(2):
            loader = monai.data.ThreadDataLoader(ds, batch_size=1, num_workers=4, use_thread_workers=True)
            got = [monai.data.decollate_batch(b)[0] for b in loader]
            assert len(got) == len(expected)
            for e, g in zip(expected, got):
                assert torch.equal(e["image"], g["image"]) and torch.equal(e["label"], g["label"])
    total = ds.cache_stats()["total"]
    assert total["writes"] == len(volumes) and total["corrupt"] == total["write_errors"] == 0
    ds.release()


@pytest.mark.parametrize("kw", [{}, {"runtime_cache": True, "cache_dir": "disk"}], ids=["eager", "runtime+disk"])
def test_reads_add_no_attribute_for_thread_workers_seeding_to_trip_on(shm_dir, volumes, tmp_path, kw):
    """MONAI's worker_init_fn walks the dataset's __dict__ in each worker; thread workers do it while other workers
    read. A read that added an attribute made that walk raise "dictionary changed size during iteration"."""
    args = {k: str(tmp_path / v) if k == "cache_dir" else v for k, v in kw.items()}
    ds = monai_cache.CacheDataset(volumes[:2], chain(crop=None), progress=False, **args)
    keys = list(vars(ds))
    ds[0], ds[1], ds[0]  # a miss or a hit, and the memo of the chain's first random transform
    assert list(vars(ds)) == keys
    ds.release()


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_dataloader_workers_share_one_cache(shm_dir, volumes, tmp_path, context):
    """runtime_cache=True with worker processes: MONAI caches nothing useful; ours computes each item once."""
    log_ref, log_ours = str(tmp_path / "ref"), str(tmp_path / "ours")
    n = len(volumes)

    def run(ds, log, start_method):
        torch.manual_seed(7)
        loader = DataLoader(
            ds, batch_size=2, num_workers=2, multiprocessing_context=start_method, shuffle=True,
            persistent_workers=context == "spawn",  # spawning imports MONAI anew: do it once, not per epoch
        )
        batches = []
        for _ in range(3):
            batches += [b["image"].as_tensor().clone() for b in loader]
        return batches, Counter(case for _, case in read_calls(log))

    # MONAI's reference from forked workers, for the spawn case too (spawning two more costs two MONAI imports): a
    # worker's seeds do not depend on how it was started. torch draws the loader's base seed in this process (from
    # the generator seeded in run()); each worker, forked or spawned, seeds random, numpy and torch from it and its
    # worker id, and MONAI's worker_init_fn seeds the dataset's random transforms (set_rnd) from that seed: no
    # random state comes through fork. The shuffle and which worker reads which batch are decided here too.
    ref = monai.data.CacheDataset(volumes, chain(log_ref), runtime_cache=True, progress=False)
    ref_batches, ref_calls = run(ref, log_ref, "fork")
    ours = monai_cache.CacheDataset(volumes, chain(log_ours), runtime_cache=True, progress=False)
    our_batches, our_calls = run(ours, log_ours, context)
    assert sum(ref_calls.values()) > n  # MONAI recomputes in every worker of every epoch
    assert our_calls == Counter(range(n))  # once per item, shared by both workers and all epochs
    assert len(our_batches) == len(ref_batches)
    for a, b in zip(ref_batches, our_batches):  # same seeds, same random crops
        assert torch.equal(a, b)
    stats = ours.cache_stats()
    assert stats["stored"]["entries"] == n and stats["total"]["misses"] == n and stats["total"]["hits"] >= 2 * n


def test_eager_fill_matches_monai_and_counts(shm_dir, volumes, tmp_path):
    log = str(tmp_path / "calls")
    ds = monai_cache.CacheDataset(volumes, chain(log), num_workers=2, progress=True)
    assert Counter(c for _, c in read_calls(log)) == Counter(range(len(volumes)))
    stats = ds.cache_stats()
    assert stats["stored"]["entries"] == len(volumes) and stats["process"]["misses"] == len(volumes)
    assert stats["stored"]["bytes"] > 0
    # what the threads filled is what MONAI's own eager fill caches: the same item for every index, hence, after
    # the random crop, the same tensors and metadata
    ref = monai.data.CacheDataset(volumes, chain(), num_workers=2, progress=False)
    for i in range(len(volumes)):
        assert torch.equal(ds._cache[i]["image"], ref._cache[i]["image"])
    for expected, got in zip(outputs(ref, 3), outputs(ds, 3)):
        for key in ("image", "label"):  # (the records of applied operations differ in id(transform) only)
            assert torch.equal(expected[key], got[key])
            assert_same(dict(expected[key].meta), dict(got[key].meta))
            assert_same(without_ids(expected[key].applied_operations), without_ids(got[key].applied_operations))
    # a second dataset object with the same data and transforms finds the cache filled: computes nothing
    again = monai_cache.CacheDataset(volumes, chain(log), num_workers=2, progress=False)
    assert again._cache.path == ds._cache.path
    assert len(read_calls(log)) == len(volumes)


def test_different_datasets_never_collide(shm_dir, volumes):
    train = monai_cache.CacheDataset(volumes[:4], chain(), progress=False)
    val = monai_cache.CacheDataset(volumes[4:], chain(), progress=False)
    other_chain = monai_cache.CacheDataset(volumes[:4], chain(crop=None, log_path=None), progress=False)
    assert train._cache.path != val._cache.path
    scaled = Compose([t for t in chain(crop=None).transforms])
    scaled.transforms[-1].scaler.a_max = 300  # a changed deterministic transform is another cache
    changed = monai_cache.CacheDataset(volumes[:4], scaled, progress=False)
    assert changed._cache.path != other_chain._cache.path
    assert train._cache[0]["image"].meta["filename_or_obj"] == volumes[0]["image"]
    assert val._cache[0]["image"].meta["filename_or_obj"] == volumes[4]["image"]


def test_set_data_recomputes_and_releases_old_entries(shm_dir, volumes):
    ds = monai_cache.CacheDataset(volumes[:3], chain(crop=None), progress=False)
    old = ds._cache.path
    ds.set_data(volumes[3:6])
    assert not os.path.exists(old)
    assert ds._cache.path != old and ds.cache_num == 3
    assert ds[0]["image"].meta["filename_or_obj"] == volumes[3]["image"]
    path = ds._cache.path
    del ds
    import gc

    gc.collect()
    assert not os.path.exists(path)  # garbage collection releases the cache too


class ReadNumber(Transform):
    """Deterministic (so cached): reads the number in the item's file."""

    def __call__(self, item):
        with open(item["path"]) as f:
            return {"x": torch.tensor(float(f.read()))}


OTHER_RANK = """
import sys
sys.path.insert(0, {tests!r})
import monai_cache
from test_cache_dataset import ReadNumber

ds = monai_cache.CacheDataset({data!r}, ReadNumber(), progress=False)
print(float(ds[0]["x"]), ds._cache.path, flush=True)
sys.stdin.readline()  # hold the cache until the test is done
"""


def test_set_data_recomputes_even_while_another_process_uses_the_old_cache(shm_dir, tmp_path):
    """Another rank still holds the cache when this one calls set_data after the files changed."""
    import subprocess

    path = tmp_path / "value.txt"
    path.write_text("1")
    data = [{"path": str(path)}]
    ours = monai_cache.CacheDataset(data, ReadNumber(), progress=False)
    script = OTHER_RANK.format(tests=os.path.dirname(os.path.abspath(__file__)), data=data)
    other = subprocess.Popen(python_c(script), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        value, other_path = other.stdout.readline().split()
        assert float(value) == 1.0 and other_path == ours._cache.path  # one cache, two processes
        path.write_text("2")
        ours.set_data(data)
        assert float(ours[0]["x"]) == 2.0  # MONAI recomputes in set_data; so must we
        assert float(monai.data.CacheDataset(data, ReadNumber(), progress=False)[0]["x"]) == 2.0
    finally:
        other.communicate("done\n", timeout=60)
    assert other.returncode == 0


class ListFillingDataset(monai_cache.CacheDataset):
    """MONAI's contract: set_data keeps whatever _fill_cache returns as the cache."""

    def _fill_cache(self, indices=None):
        return [{"x": self.data[i]["x"] + 1000} for i in range(self.cache_num)]


def test_a_subclass_fill_cache_result_is_the_cache(shm_dir):
    data = [{"x": i} for i in range(3)]
    ours = ListFillingDataset(data, progress=False)
    assert [ours[i]["x"] for i in range(3)] == [1000, 1001, 1002]
    assert isinstance(ours._cache, list)
    caches = [name for _, dirs, _ in os.walk(shm_dir) for name in dirs if name.startswith("cd-")]
    assert caches == []  # the shared-memory cache it replaced was released


class ThroughMonaisInit(monai_cache.CacheDataset):
    """A subclass that calls MONAI's CacheDataset.__init__ by name (as MONAI's apps datasets do), past ours."""

    def __init__(self, data, transform, offset: int) -> None:
        self.offset = offset  # set before, as the apps datasets set theirs: part of what is cached
        monai.data.CacheDataset.__init__(self, data, transform, progress=False)

    def _load_cache_item(self, idx):
        item = super()._load_cache_item(idx)
        return {**item, "image": item["image"] + self.offset}


def test_monais_init_called_by_name_still_gives_the_shared_memory_cache(shm_dir, volumes):
    """Our options take their defaults, the cache is in shared memory, and an attribute the subclass set before
    names it: another offset is another cache."""
    tr = chain(crop=None)
    ours, other = ThroughMonaisInit(volumes[:3], tr, 1), ThroughMonaisInit(volumes[:3], tr, 2)
    ref = monai.data.CacheDataset(volumes[:3], tr, progress=False)
    for i in range(3):
        assert torch.equal(ours[i]["image"], ref[i]["image"] + 1)
        assert torch.equal(other[i]["image"], ref[i]["image"] + 2)
    assert isinstance(ours._cache, monai_cache.SharedMemoryStore) and ours.shared_memory is True
    assert ours._cache.path != other._cache.path and ours.cache_stats()["stored"]["entries"] == 3
    assert ours._subclass_attributes == ("offset",)
    ours.release()
    other.release()


def test_budget_full_degrades_with_one_warning(shm_dir, volumes):
    tr = chain(crop=None)
    ref = monai.data.CacheDataset(volumes, tr, progress=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ds = monai_cache.CacheDataset(volumes, tr, progress=False, shm_budget="100KB")
        got = [ds[i] for i in range(len(volumes))]
    full = [w for w in caught if "cache is full" in str(w.message)]
    assert len(full) == 1
    for a, b in zip([ref[i] for i in range(len(volumes))], got):
        assert_same(a, b)
    assert ds.cache_stats()["stored"]["bytes"] <= 100_000


class Opaque:
    """A value the codec cannot store without pickle (MONAI's in-process list caches it as it is)."""

    def __init__(self, value):
        self.value = value

    def __eq__(self, other):
        return type(other) is Opaque and other.value == self.value


@pytest.mark.parametrize("runtime_cache", [False, True])
def test_item_the_codec_cannot_store_is_served_uncached_with_one_warning(shm_dir, volumes, tmp_path, runtime_cache):
    """As in PersistentDataset: not an error; that item is computed on every read, one warning names it."""
    log = str(tmp_path / "calls")
    data = [dict(v, extra=Opaque(i)) if i in (1, 3) else dict(v) for i, v in enumerate(volumes)]
    tr = chain(log)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = monai_cache.CacheDataset(data, tr, progress=False, runtime_cache=runtime_cache)
        got = [outputs(ours, 100 + epoch) for epoch in range(2)]
    msgs = [str(w.message) for w in caught if "is not cached" in str(w.message)]
    assert len(msgs) == 1, msgs
    assert "data item 1 " in msgs[0] and "item['extra']" in msgs[0] and "allow_pickle=True" in msgs[0], msgs
    calls = Counter(case for _, case in read_calls(log))
    ref = monai.data.CacheDataset(data, tr, progress=False, runtime_cache=runtime_cache)  # same transform ids
    for epoch in range(2):
        for expected, item in zip(outputs(ref, 100 + epoch), got[epoch]):
            assert_same(expected, item)
    reads = 2 + (0 if runtime_cache else 1)  # two epochs, plus the eager fill's attempt
    assert calls == Counter({i: reads if i in (1, 3) else 1 for i in range(len(volumes))})
    stats = ours.cache_stats()
    assert stats["stored"]["entries"] == len(volumes) - 2 and stats["total"]["skipped"] == 2
    # with allow_pickle=True the same items are cached
    pickled = monai_cache.CacheDataset(data, chain(), progress=False, allow_pickle=True)
    assert pickled.cache_stats()["stored"]["entries"] == len(volumes)
    assert pickled[1]["extra"] == Opaque(1)


UNSTORABLE_IN_WORKERS = """
import sys
sys.path.insert(0, {tests!r})
import monai_cache
from helpers import chain
from monai.data import DataLoader
from test_cache_dataset import Opaque

data = [dict(v, extra=Opaque(i)) for i, v in enumerate({data!r})]
ds = monai_cache.CacheDataset(data, chain(), progress=False, runtime_cache=True)
loader = DataLoader(ds, batch_size=2, num_workers=2, multiprocessing_context="fork", collate_fn=list)
for _ in range(2):
    assert [item["extra"] for batch in loader for item in batch] == [Opaque(i) for i in range(len(data))]
print(ds.cache_stats()["stored"]["entries"], ds.cache_stats()["total"]["skipped"])
"""


def test_item_the_codec_cannot_store_warns_once_across_dataloader_workers(shm_dir, volumes):
    """Real worker processes, whose warnings go to their own stderr: one warning for the whole run."""
    import subprocess

    tests = os.path.dirname(os.path.abspath(__file__))
    script = UNSTORABLE_IN_WORKERS.format(tests=tests, data=volumes)
    r = subprocess.run(python_c(script), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("is not cached") == 1, r.stderr
    entries, skipped = (int(x) for x in r.stdout.split())
    # a worker tries to store an item once and then stops trying; workers are new in each of the two epochs
    assert entries == 0 and skipped == 2 * len(volumes)


def test_private_cache_option_gives_monai_behaviour(shm_dir, volumes):
    ds = monai_cache.CacheDataset(volumes[:2], chain(crop=None), shared_memory=False, progress=False)
    assert isinstance(ds._cache, list) and os.listdir(shm_dir) == []
    user = [None, None]
    ds2 = monai_cache.CacheDataset(volumes[:2], chain(crop=None), runtime_cache=user, progress=False)
    ds2[1]
    assert user[0] is None and user[1] is not None  # a user container keeps MONAI's meaning


@pytest.mark.parametrize("kw", [{"shared_memory": False}, {"runtime_cache": "a plain list"}])
def test_private_cache_stats_in_the_main_process_count_its_workers(shm_dir, kw):
    """A private cache is each process's own (MONAI's meaning); the main process's ``total`` still counts the reads
    of the DataLoader workers forked from it, which ``process`` leaves out."""
    n = 8
    if "runtime_cache" in kw:
        kw = {"runtime_cache": [None] * n}
    ds = monai_cache.CacheDataset([{"x": i} for i in range(n)], Compose([Times10(keys="x")]), progress=False, **kw)
    if "runtime_cache" not in kw:
        ds[0]  # the main process's own read: the eager fill already holds it
    loader = DataLoader(ds, batch_size=1, num_workers=2, persistent_workers=True)
    for _ in range(2):
        assert sorted(int(b["x"]) for b in loader) == [10 * i for i in range(n)]
    stats = ds.cache_stats()
    own = 0 if "runtime_cache" in kw else 1
    assert (stats["process"]["hits"], stats["process"]["misses"]) == (own, 0)
    if "runtime_cache" in kw:  # each worker fills its own copy of the list in epoch 1 (the same items each epoch)
        assert (stats["total"]["hits"], stats["total"]["misses"]) == (n, n)
    else:
        assert (stats["total"]["hits"], stats["total"]["misses"]) == (2 * n + own, 0)
    assert os.listdir(shm_dir) == []


KILLED_WORKER = """
import os, random, signal, sys, threading
sys.path.insert(0, {tests!r})
import monai_cache
from helpers import chain
from monai.data import DataLoader

for seed, shm_dir in enumerate({shm_dirs!r}):  # one trial per seed, each with a cache directory of its own
    random.seed(seed)
    delay = random.uniform(0.0, 0.3)

    def kill_me_soon(worker_id):  # SIGKILL this DataLoader worker at a random moment of its epoch
        threading.Timer(delay, os.kill, (os.getpid(), signal.SIGKILL)).start()

    ds = monai_cache.CacheDataset({data!r}, chain(), runtime_cache=True, progress=False, keep_warm=True,
                                  shm_dir=shm_dir)
    it = None
    outcome = "finished before the kill"
    try:
        it = iter(DataLoader(ds, batch_size=1, num_workers=1, worker_init_fn=kill_me_soon))
        # torch's SIGCHLD handler raises from wherever the main thread happens to be; without it the loader
        # finds the dead worker itself (its liveness check) and raises inside this loop
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for _ in it:
            pass
    except RuntimeError as e:
        died = "killed by signal" in str(e) or "exited unexpectedly" in str(e)
        outcome = "killed" if died else f"other error: {{e}}"
    except (EOFError, ConnectionError):  # killed while handing a batch over: its descriptors are gone
        outcome = "killed"
    try:
        if it is not None:
            it._shutdown_workers()
    except Exception:
        pass
    print(outcome)
    sys.stdout.flush()
os._exit(0)  # the caches are kept warm; skip interpreter teardown racing the DataLoaders' threads
"""


def test_worker_killed_mid_epoch_leaves_nothing_bad_and_nothing_blocking(shm_dir, volumes):
    import subprocess

    tests = os.path.dirname(os.path.abspath(__file__))
    tr = chain()
    ref = monai.data.CacheDataset(volumes, chain(crop=None), progress=False)
    # three trials (a worker killed at another moment in each) in one interpreter, each in a directory of its own
    trial_dirs = [os.path.join(shm_dir, f"trial{seed}") for seed in range(3)]
    for path in trial_dirs:
        os.makedirs(path)
    script = KILLED_WORKER.format(tests=tests, shm_dirs=trial_dirs, data=volumes)
    r = subprocess.run(python_c(script), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    outcomes = r.stdout.splitlines()  # one a line: "finished before the kill" is one outcome
    assert len(outcomes) == len(trial_dirs), (r.stdout, r.stderr[-3000:])
    for trial_dir in trial_dirs:
        # the same dataset in this process finds the kept cache: every entry it accepts is right...
        ds = monai_cache.CacheDataset(volumes, tr, runtime_cache=True, progress=False, keep_warm=True,
                                      shm_dir=trial_dir)
        for i in range(len(volumes)):
            entry = ds._cache[i]
            if entry is not None:
                assert torch.equal(ref._cache[i]["image"], entry["image"])
                assert_same(
                    without_ids(ref._cache[i]["image"].applied_operations),
                    without_ids(entry["image"].applied_operations),
                )
        assert not any(f".{os.getpid()}.w" in n for n in os.listdir(ds._cache.path))  # no temporary file of ours
        # ...and nothing blocks: a full epoch with two workers completes (a batch that never comes raises after
        # the hang guard instead of hanging the suite)
        assert len(list(DataLoader(ds, batch_size=2, num_workers=2, timeout=HANG_GUARD_S))) == len(volumes) // 2
        assert monai_cache.shm.remove_cache(os.path.basename(ds._cache.path), shm_dir=trial_dir, force=True)
        ds.release()
    assert "killed" in outcomes, outcomes


def test_bundle_target_full_dotted_path(shm_dir, volumes):
    from monai.bundle import ConfigParser

    parser = ConfigParser({"ds": {"_target_": "monai_cache.CacheDataset", "data": volumes[:2], "transform": "$None",
                                  "progress": False, "runtime_cache": True}})
    ds = parser.get_parsed_content("ds")
    assert type(ds) is monai_cache.CacheDataset and ds[0]["case"] == 0


def test_fingerprint_does_not_change_once_transforms_have_run(shm_dir, volumes):
    """MONAI's image readers remember the last file read; that must not change the cache's identity."""
    tr = chain(crop=None)
    first = monai_cache.CacheDataset(volumes[:2], tr, progress=False)  # the eager fill runs the transforms
    again = monai_cache.CacheDataset(volumes[:2], tr, progress=False)
    fresh = monai_cache.CacheDataset(volumes[:2], chain(crop=None), progress=False)
    assert first._cache.path == again._cache.path == fresh._cache.path


def full_of(v):
    return torch.full((4,), float(v))


def live_deleted_files(shm_dir: str) -> list[str]:
    """This process's descriptors on files of shm_dir that were removed (memory still held)."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(shm_dir) and target.endswith("(deleted)"):
            out.append(target)
    return out


def test_clear_all_on_a_live_cache_degrades_to_uncached_reads(shm_dir):
    """`monai-cache clear --all` while a job runs: its processes compute what they read, with one warning."""
    import subprocess
    import sys

    from monai.transforms import Lambdad

    data = [{"x": i} for i in range(8)]
    ds = monai_cache.CacheDataset(data, Compose([Lambdad("x", full_of)]), progress=False, runtime_cache=True)
    loader = DataLoader(ds, batch_size=2, num_workers=2, multiprocessing_context="fork")
    assert sorted(int(v) for b in loader for v in b["x"][:, 0]) == list(range(8))
    r = subprocess.run([sys.executable, "-m", "monai_cache", "clear", "--all"], capture_output=True, text=True,
                       env=dict(os.environ), timeout=120)
    assert r.returncode == 0 and "removed 1 cache" in r.stdout, (r.stdout, r.stderr)
    for _ in range(2):  # new workers each epoch: they find the cache gone too
        assert sorted(int(v) for b in loader for v in b["x"][:, 0]) == list(range(8))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert [float(ds[i]["x"][0]) for i in range(8)] == [float(i) for i in range(8)]
    assert sum("was removed while this process used it" in str(w.message) for w in caught) == 1
    ds.release()
    assert live_deleted_files(shm_dir) == []  # the removed files' memory is given back
    assert ds.cache_stats()["stored"]["entries"] == 0


def test_set_data_with_persistent_workers_keeps_them_serving_as_monai_does(shm_dir):
    """MONAI documents persistent_workers=False for set_data; with True its workers serve the old data."""
    from monai.transforms import Lambdad

    results = {}
    for cls in (monai.data.CacheDataset, monai_cache.CacheDataset):
        ds = cls([{"x": i} for i in range(6)], Compose([Lambdad("x", full_of)]), progress=False, runtime_cache=True)
        loader = DataLoader(  # shuffled: a worker then reads entries another one wrote, in files it never opened
            ds, batch_size=2, num_workers=2, persistent_workers=True, multiprocessing_context="fork", shuffle=True
        )
        epochs = []
        for epoch in range(3):
            epochs.append(sorted(int(v) for b in loader for v in b["x"][:, 0]))
            ds.set_data([{"x": i + 10 * (epoch + 1)} for i in range(6)])
        results[cls.__module__] = epochs
        del loader
    assert results["monai_cache.dataset"] == results["monai.data.dataset"] == [list(range(6))] * 3


def test_reading_after_release_computes_the_item(shm_dir):
    from monai.transforms import Lambdad

    ds = monai_cache.CacheDataset([{"x": i} for i in range(3)], Compose([Lambdad("x", full_of)]), progress=False)
    path = ds._cache.path
    ds.release()
    assert not os.path.exists(path)
    assert [float(ds[i]["x"][0]) for i in range(3)] == [0.0, 1.0, 2.0] and ds._cache[0] is None
    assert ds.cache_stats()["stored"]["bytes"] == 0


def test_a_copy_of_the_dataset_gives_its_reference_back_when_collected(shm_dir):
    import copy
    import gc
    import pickle

    for make_copy in (copy.deepcopy, lambda d: pickle.loads(pickle.dumps(d))):
        ds = monai_cache.CacheDataset([{"x": torch.tensor(float(i))} for i in range(3)], progress=False)
        path = ds._cache.path
        clone = make_copy(ds)
        assert clone._cache.path == path and float(clone[2]["x"]) == 2.0
        del clone
        gc.collect()
        ds.release()
        assert not os.path.exists(path)  # it was pinned until the process exited


def test_listing_caches_while_jobs_start_and_end(shm_dir):
    import threading

    from monai_cache.shm import list_caches

    stop = threading.Event()
    errors: list[BaseException] = []
    churned = [0]

    def churn():
        try:
            while not stop.is_set():
                store = monai_cache.SharedMemoryStore(f"churn{churned[0] % 5}", 4, shm_dir=shm_dir)
                store[0] = {"x": torch.zeros(4)}
                store.release()
                churned[0] += 1
        except BaseException as e:  # collected and reported below (a thread's exception is otherwise lost)
            errors.append(e)

    thread = threading.Thread(target=churn)
    thread.start()
    listings, live_seen, hang_guard = 0, 0, time.monotonic() + 60
    try:
        # at least 200 listings, and on until one of them caught a cache in use (the job starting or ending)
        while (listings < 200 or not live_seen) and thread.is_alive() and time.monotonic() < hang_guard:
            try:
                for cache in list_caches(shm_dir):
                    assert cache["state"] in ("live", "stale", "kept")
                    live_seen += cache["state"] == "live"
            except BaseException as e:  # collected and reported below
                errors.append(e)
            listings += 1
    finally:
        stop.set()
        thread.join()
    assert errors == []
    assert live_seen >= 1 and churned[0] >= 1, (listings, live_seen, churned)
    assert [c for c in list_caches(shm_dir) if c["state"] != "stale"] == []
