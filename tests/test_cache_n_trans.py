"""``monai_cache.CacheNTransDataset`` against MONAI's own, on real NIfTI files and real DataLoader workers."""

from __future__ import annotations

import pickle

import pytest
import torch
from helpers import KEYS, assert_signature_extends, one_torch_thread, write_volumes  # noqa: F401 (an autouse fixture)
from monai.data import CacheNTransDataset as MonaiCacheNTransDataset
from monai.data import DataLoader, MetaTensor
from monai.data import PersistentDataset as MonaiPersistentDataset
from monai.data.utils import pickle_hashing
from monai.transforms import (
    Compose,
    EnsureChannelFirstd,
    LoadImaged,
    Orientationd,
    RandFlipd,
    RandSpatialCropd,
    ScaleIntensityRanged,
    Spacingd,
)
from monai.utils import TraceKeys
from test_codec import assert_same
from test_persistent import same

import monai_cache
from monai_cache import CacheNTransDataset, compat

# the drop-in tests: CI runs them on the oldest supported MONAI and on monai-weekly too (.ci/run)
pytestmark = pytest.mark.dropin


@pytest.fixture(scope="module")
def nifti(tmp_path_factory) -> list[dict]:
    return write_volumes(str(tmp_path_factory.mktemp("nifti")), 3)


def chain(pixdim=(1.5, 1.5, 2.0), flip_axis: int = 0, roi: int = 8) -> Compose:
    """Load, channel first, a random flip (cached with cache_n_trans >= 3), then transforms that read the
    metadata (Orientationd, Spacingd), a scaling and a random crop."""
    return Compose([
        LoadImaged(keys=KEYS),
        EnsureChannelFirstd(keys=KEYS),
        RandFlipd(keys=KEYS, prob=0.5, spatial_axis=flip_axis),
        Orientationd(keys=KEYS, axcodes="RAS", labels=None),
        Spacingd(keys=KEYS, pixdim=pixdim, mode=("bilinear", "nearest")),
        ScaleIntensityRanged(keys="image", a_min=-57, a_max=164, b_min=0.0, b_max=1.0, clip=True),
        RandSpatialCropd(keys=KEYS, roi_size=(roi, roi, roi), random_size=False),
    ])  # fmt: skip


def epoch(ds, seed: int = 0) -> list:
    ds.transform.set_random_state(seed)
    return [ds[i] for i in range(len(ds))]


def entry_names(ds) -> list[str]:
    return [ds._entry_key(item) for item in ds.data]


def test_signature_is_monais_plus_keyword_only_extras():
    assert assert_signature_extends(CacheNTransDataset, MonaiCacheNTransDataset) == ["track_meta", "options"]
    # MONAI's class and our disk cache: isinstance checks for either hold
    assert CacheNTransDataset.__mro__[1:4] == (
        MonaiCacheNTransDataset, monai_cache.PersistentDataset, MonaiPersistentDataset,
    )  # fmt: skip


@pytest.mark.filterwarnings("ignore:`data_array` is not of type MetaTensor")  # MONAI's hits: the bug shown here
@pytest.mark.parametrize("cache_n_trans", [2, 4])
def test_every_epoch_gives_monais_first_epoch(nifti, tmp_path, cache_n_trans):
    """MONAI's hits lose the metadata that the transforms after the cache read (Orientationd, Spacingd); ours
    keep it, so misses and hits both give MONAI's first-epoch output (a random flip among the cached transforms
    is frozen, as in MONAI)."""
    transform = chain()  # one chain: the transform IDs recorded in the outputs are the same
    monai_ds = MonaiCacheNTransDataset(nifti, transform, cache_n_trans, tmp_path / "monai")
    ours = CacheNTransDataset(nifti, transform, cache_n_trans, tmp_path / "ours")
    m_miss, m_hit = epoch(monai_ds), epoch(monai_ds)
    o_miss = epoch(ours)
    assert ours.flush(30)
    o_hit = epoch(ours)
    stats = ours.cache_stats()["process"]
    assert stats["misses"] == stats["hits"] == stats["writes"] == len(nifti)
    for i in range(len(nifti)):
        assert_same(o_miss[i], m_miss[i], f"ours miss / monai miss {i}")
        assert_same(o_hit[i], m_miss[i], f"ours hit / monai miss {i}")
    # the MONAI bug this fixes (from 1.5, which stores plain tensors): from the second epoch on, the transforms
    # after the cache get no metadata (1.3 and 1.4 store the items as computed; on the torch they were made for,
    # their hits keep it)
    assert all("filename_or_obj" in m_miss[i]["image"].meta for i in range(len(nifti)))
    lost = ["filename_or_obj" not in m_hit[i]["image"].meta for i in range(len(nifti))]
    assert all(lost) if compat.PERSISTENT_CONVERTS_STORED else not any(lost)
    cached = ours._cachecheck(nifti[0])
    assert type(cached["image"]) is MetaTensor and cached["image"].meta["filename_or_obj"] == nifti[0]["image"]


@pytest.mark.skipif(
    not compat.PERSISTENT_CONVERTS_STORED, reason="MONAI < 1.5 stores the items as computed: its hits keep metadata"
)
def test_track_meta_false_gives_monais_cache_hit_output_on_both_paths(nifti, tmp_path):
    transform = chain()
    monai_ds = MonaiCacheNTransDataset(nifti, transform, 2, tmp_path / "monai")
    ours = CacheNTransDataset(nifti, transform, 2, tmp_path / "ours", track_meta=False, async_writes=False)
    epoch(monai_ds)
    m_hit = epoch(monai_ds)
    o_miss, o_hit = epoch(ours), epoch(ours)
    assert ours.cache_stats()["process"]["hits"] == len(nifti)
    for i in range(len(nifti)):
        assert_same(o_miss[i], m_hit[i], f"ours miss / monai hit {i}")
        assert_same(o_hit[i], m_hit[i], f"ours hit / monai hit {i}")
    assert type(ours._cachecheck(nifti[0])["image"]) is torch.Tensor


def test_dataloader_workers_match_monais_first_epoch(nifti, tmp_path):
    def run(ds):
        torch.manual_seed(0)  # the workers' seeds, and so the random transforms, derive from it
        return list(DataLoader(ds, batch_size=1, num_workers=2, shuffle=False))

    transform = chain()
    monai_first = run(MonaiCacheNTransDataset(nifti, transform, 3, tmp_path / "monai"))
    ours = CacheNTransDataset(nifti, transform, 3, tmp_path / "ours")
    first, second = run(ours), run(ours)
    total = ours.cache_stats()["total"]
    assert total["misses"] == total["hits"] == len(nifti) and total["writes_pending"] == 0
    for i in range(len(nifti)):
        assert_same(first[i], monai_first[i], f"first epoch {i}")
        assert_same(second[i], monai_first[i], f"second epoch {i}")


def test_a_shared_memory_copy_in_front_of_the_disk_serves_the_same_items(nifti, tmp_path, shm_dir):
    transform = chain()
    plain = CacheNTransDataset(nifti, transform, 3, tmp_path / "plain", async_writes=False)
    tiered = CacheNTransDataset(nifti, transform, 3, tmp_path / "tiered", shm_cache=True)
    expected = epoch(plain)
    for _ in range(2):
        for i, got in enumerate(epoch(tiered)):
            assert_same(expected[i], got, f"item {i}")
    stats = tiered.cache_stats()
    assert stats["stored"]["entries"] == stats["total"]["misses"] == stats["total"]["hits"] == len(nifti)
    assert tiered.flush(30) and stats["disk"]["total"]["misses"] == len(nifti)
    tiered.release()


def test_entry_names_fingerprint_exactly_the_cached_transforms(nifti, tmp_path):
    base = entry_names(CacheNTransDataset(nifti, chain(), 3, tmp_path))
    # a changed transform after the cached ones: same entries (they do not hold its output)
    assert entry_names(CacheNTransDataset(nifti, chain(pixdim=(2.0, 2.0, 2.0), roi=4), 3, tmp_path)) == base
    # a changed transform among them, random ones included: other entries
    assert entry_names(CacheNTransDataset(nifti, chain(flip_axis=1), 3, tmp_path)).count(base[0]) == 0
    assert entry_names(CacheNTransDataset(nifti, chain(pixdim=(2.0, 2.0, 2.0)), 5, tmp_path))[0] != (
        entry_names(CacheNTransDataset(nifti, chain(), 5, tmp_path))[0]
    )
    # another seed of the random transforms (each run without set_determinism): the next run finds the entries
    reseeded = chain()
    reseeded.set_random_state(12345)
    assert entry_names(CacheNTransDataset(nifti, reseeded, 3, tmp_path)) == base
    # how many transforms are cached is part of the names, also with an explicit hash_transform
    assert entry_names(CacheNTransDataset(nifti, chain(), 2, tmp_path))[0] != base[0]
    explicit = [
        CacheNTransDataset(nifti, chain(), n, tmp_path, hash_transform=pickle_hashing)._entry_key(nifti[0])
        for n in (2, 3)
    ]
    assert explicit[0] != explicit[1]


def test_reassigned_cache_n_trans_never_serves_the_other_counts_entries(nifti, tmp_path):
    ds = CacheNTransDataset(nifti[:1], chain(), 3, tmp_path, async_writes=False)
    ds[0]
    ds.cache_n_trans = 2  # MONAI would serve the entry of 3 transforms and flip it again
    got = epoch(ds)[0]
    assert ds.cache_stats()["process"]["hits"] == 0
    assert_same(got, epoch(CacheNTransDataset(nifti[:1], ds.transform, 2, None))[0])


def test_a_pickled_copy_reads_the_same_entries(nifti, tmp_path):
    """What a spawned DataLoader worker gets: the same entry names, so the entries written here are hits there."""
    ds = CacheNTransDataset(nifti[:2], chain(), 3, tmp_path, async_writes=False)
    first = epoch(ds)
    clone = pickle.loads(pickle.dumps(ds))
    assert entry_names(clone) == entry_names(ds)
    for expected, got in zip(first, epoch(clone)):
        same(expected, got)  # a copy's transforms are other objects: the IDs they record differ
    assert clone.cache_stats()["process"]["hits"] == 2


def test_reset_ops_id_false_is_honoured(nifti, tmp_path):
    """MONAI's CacheNTransDataset resets the transform IDs in the cached items whatever reset_ops_id says."""

    def ids(item) -> set:
        return {op[TraceKeys.ID] for op in item["image"].applied_operations}

    theirs = MonaiCacheNTransDataset(nifti[:1], chain(), 4, None, reset_ops_id=False)._pre_transform(nifti[0])
    assert ids(theirs) == {TraceKeys.NONE}
    for reset, cache_dir in ((False, tmp_path), (True, None)):
        ours = CacheNTransDataset(nifti[:1], chain(), 4, cache_dir, reset_ops_id=reset, async_writes=False)
        ours[0]
        cached = ours._cachecheck(nifti[0])  # a hit with cache_dir, computed again without
        assert ids(cached) == {TraceKeys.NONE} if reset else TraceKeys.NONE not in ids(cached)


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        ("2", TypeError, "cache_n_trans must be an int"),
        (1.5, TypeError, "cache_n_trans must be an int"),
        (-1, ValueError, "cache_n_trans=-1 is out of range: transform has 7 transforms"),
        (8, ValueError, "cache_n_trans=8 is out of range: transform has 7 transforms"),
    ],
)
def test_bad_cache_n_trans_is_a_clear_error_at_construction(nifti, tmp_path, value, error, message):
    with pytest.raises(error, match=message):
        CacheNTransDataset(nifti, chain(), value, tmp_path / "c")
    assert not (tmp_path / "c").exists()
    CacheNTransDataset(nifti, list(chain().transforms), 7, None)  # a list of transforms counts the same way
