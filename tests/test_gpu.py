"""What only an accelerator shows: pinned batches from our DataLoader, and ``ToDeviced`` inside the cached chain.

Skipped without CUDA. ``MONAI_CACHE_TEST_DEVICE=cpu`` runs them on the CPU, where what can be checked is checked
(equal batches and items); nothing is pinned there, and ``pin_memory_device`` needs an accelerator.
"""

from __future__ import annotations

import os
import warnings

import monai.data
import pytest
import torch
from helpers import assert_same
from monai.transforms import ToDeviced
from test_loader import assert_batches_equal, epochs

import monai_cache
from monai_cache.synthetic import make_dataset, tutorial_transforms

DEVICE = os.environ.get("MONAI_CACHE_TEST_DEVICE") or ("cuda:0" if torch.cuda.is_available() else None)
ON_GPU = DEVICE is not None and DEVICE.startswith("cuda")
pytestmark = pytest.mark.skipif(DEVICE is None, reason="needs a CUDA device (or MONAI_CACHE_TEST_DEVICE=cpu)")
CROP = (16, 16, 8)
KEYS = ["image", "label"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return make_dataset(str(tmp_path_factory.mktemp("ct")), items=4, shape=(40, 40, 24))


PIN = [{"pin_memory": True}] + ([{"pin_memory": True, "pin_memory_device": DEVICE}] if ON_GPU else [])


@pytest.mark.parametrize("pin", PIN, ids=[",".join(p) for p in PIN])
@pytest.mark.parametrize("persistent", [False, True], ids=["new-workers", "persistent-workers"])
def test_pinned_batches_are_monais_and_kept_ones_keep_their_values(shm_dir, files, pin, persistent):
    dataset = monai_cache.CacheDataset(files, tutorial_transforms(spatial_size=CROP), progress=False)
    kw = dict(num_workers=2, persistent_workers=persistent, **pin)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*pin_memory.*")  # on the CPU: torch has nothing to pin
        theirs = epochs(monai.data.DataLoader, dataset, batch_size=2, **kw)[0]
        loader = monai_cache.DataLoader(dataset, batch_size=2, **kw)
        torch.manual_seed(0)
        kept = list(loader)
        assert_batches_equal(kept, theirs)
        copies = [{k: v.clone() for k, v in b.items() if k in KEYS} for b in kept]
        for _ in range(3):  # more epochs reuse the blocks: the kept (pinned) batches must not change
            for batch in loader:
                batch["image"].fill_(-1)
    for b, c in zip(kept, copies):
        for k in KEYS:
            assert torch.equal(b[k], c[k]), k
            if ON_GPU:
                assert b[k].is_pinned(), f"{k} is not in pinned memory"
    dataset.release()


@pytest.mark.parametrize("runtime_cache", [False, True])
def test_todeviced_in_the_cached_chain_gives_monais_items_on_the_device(shm_dir, files, runtime_cache):
    """MONAI's fast-training recipe: the cached chain ends by moving the item to the device; the random crop
    then runs there. The shared-memory cache holds the host bytes, once per machine; each process copies an item
    to its device once, at its first read, and keeps it there as MONAI does (on a GPU by default; on the CPU
    ``process_cache=True`` takes the same path)."""
    chain = tutorial_transforms(spatial_size=CROP, after=[ToDeviced(keys=KEYS, device=DEVICE)])
    kw = dict(transform=chain, progress=False, runtime_cache=runtime_cache)
    ref = monai.data.CacheDataset(files, **kw)
    ours = monai_cache.CacheDataset(files, **kw, **({} if ON_GPU else {"process_cache": True}))
    read_from_shared_memory = None
    for epoch in range(3):  # a miss (runtime cache), then hits
        ref.transform.set_random_state(100 + epoch)
        expected = [ref[i] for i in range(len(files))]
        ours.transform.set_random_state(100 + epoch)
        got = [ours[i] for i in range(len(files))]
        for e, g in zip(expected, got):
            assert_same(e, g, skip_keys=("id",))
        assert all(crop[k].device == torch.device(DEVICE) for item in got for crop in item for k in KEYS)
        stats = ours.cache_stats()
        # the first epoch reads each item from shared memory once (copied to the device once); then none
        read_from_shared_memory = read_from_shared_memory or stats["process"]["bytes_read"]
        assert stats["process"]["bytes_read"] == read_from_shared_memory
        tier = stats["process_cache"]
        assert tier["entries"] == len(files) and tier["hits"] == epoch * len(files)
        assert tier["device"] == str(torch.device(DEVICE))
    kept = [ours._process_tier.get(i) for i in range(len(files))]
    assert all(item[k].device == torch.device(DEVICE) for item in kept for k in KEYS)
    # and through MONAI's ThreadDataLoader, the loader of that recipe (made with num_workers=0, it seeds the
    # transforms from torch's generator)
    theirs = epochs(monai.data.ThreadDataLoader, ref, batch_size=2, num_workers=0)[0]
    assert_batches_equal(epochs(monai.data.ThreadDataLoader, ours, batch_size=2, num_workers=0)[0], theirs)
    assert ours.cache_stats()["total"]["writes"] == len(files)  # computed and stored once on the machine
    ours.release()
