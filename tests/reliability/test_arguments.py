"""Bad arguments fail at once, with an error that names the argument and says what to do: negative or
unparsable budgets and sizes, dtypes the cache cannot store, a cache directory that is a file, a shared-memory
directory that is missing or not a directory."""

from __future__ import annotations

import os

import pytest
import torch

from monai_cache.dataset import CacheDataset
from monai_cache.persistent import PersistentDataset
from monai_cache.shm import SharedMemoryStore

from ._harness import MakeItem, Tally, data_list, item_problem


def shm_dataset(shm_dir, **kw):
    return CacheDataset(data_list(2, 64), MakeItem(), runtime_cache=True, progress=False, shm_dir=shm_dir, **kw)


def disk_dataset(cache_dir, **kw):
    return PersistentDataset(data_list(2, 64), MakeItem(), cache_dir=cache_dir, async_writes=False, **kw)


def a_file(directory: str) -> str:
    path = os.path.join(directory, "a_file")
    with open(path, "w") as f:
        f.write("not a directory")
    return path


# (what, how to call it, the exception, words the message must contain)
CASES = [
    ("negative shm_budget", lambda t, s: shm_dataset(s, shm_budget=-1), ValueError, ["shm_budget", "negative"]),
    ("shm_budget not a size", lambda t, s: shm_dataset(s, shm_budget="lots"), ValueError, ["shm_budget", "512MiB"]),
    ("shm_budget as bool", lambda t, s: shm_dataset(s, shm_budget=True), ValueError, ["shm_budget", "8GiB"]),
    ("negative reserve", lambda t, s: SharedMemoryStore("k", 1, shm_dir=s, reserve=-1), ValueError, ["reserve"]),
    ("missing shm_dir", lambda t, s: shm_dataset(os.path.join(s, "nope")), FileNotFoundError,
     ["shm_dir", "does not exist", "shared_memory=False"]),
    ("shm_dir is a file", lambda t, s: shm_dataset(a_file(t)), OSError, ["shm_dir", "a_file"]),
    ("cache_dir is a file", lambda t, s: disk_dataset(a_file(t)), ValueError,
     ["cache_dir", "not a directory", "cache_dir=None"]),
    ("unknown dtype name in lossy_dtypes", lambda t, s: disk_dataset(t, lossy_dtypes={"image": "float17"}),
     ValueError, ["lossy_dtypes['image']", "torch.float16"]),
    ("non-dtype in lossy_dtypes", lambda t, s: disk_dataset(t, lossy_dtypes={"image": 5}), ValueError,
     ["lossy_dtypes['image']"]),
    ("unknown compression", lambda t, s: disk_dataset(t, compression="gzip"), ValueError, ["compression", "zstd"]),
    ("compression level out of range", lambda t, s: disk_dataset(t, compression_level=99), ValueError,
     ["compression_level", "22"]),
    ("no pending writes allowed", lambda t, s: disk_dataset(t, max_pending_writes=0), ValueError,
     ["max_pending_writes", "at least 1"]),
    ("negative max_pending_bytes", lambda t, s: disk_dataset(t, max_pending_bytes=-5), ValueError,
     ["max_pending_bytes", "negative"]),
    ("unknown pickle module", lambda t, s: disk_dataset(t, pickle_module="marshal"), ValueError, ["marshal"]),
]


@pytest.mark.parametrize("what, call, error, words", CASES, ids=[c[0] for c in CASES])
def test_bad_argument_fails_with_an_error_that_says_what_to_do(shm_dir, tmp_path, what, call, error, words):
    t = Tally(f"arguments/{what}")
    raised: BaseException | None = None
    try:
        call(str(tmp_path), shm_dir)
    except Exception as e:
        raised = e
    message = str(raised)
    t.check(isinstance(raised, error), f"{what}: expected {error.__name__}, got {raised!r}")
    for w in words:
        t.check(w in message, f"{what}: {message!r} lacks {w!r}")
    t.record(error=type(raised).__name__ if raised else None, message=message[:200])
    t.assert_clean()


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.qint8], ids=["float8_e4m3fn", "qint8"])
def test_a_dtype_the_cache_cannot_store_is_refused_at_construction(tmp_path, dtype):
    """(Found by this suite: accepted, then a bare KeyError/RuntimeError on the first item.)"""
    with pytest.raises(ValueError, match="lossy_dtypes") as info:
        disk_dataset(str(tmp_path), lossy_dtypes={"image": dtype})
    assert "'image'" in str(info.value) and "torch.float16" in str(info.value)  # names the key and what to pass


@pytest.mark.parametrize("budget", [float("inf"), float("nan")], ids=["inf", "nan"])
def test_non_finite_budget_is_refused_by_name(shm_dir, budget):
    """(Found by this suite: OverflowError / 'cannot convert float NaN to integer'; fixed in 0a94e99.)"""
    with pytest.raises(ValueError, match="shm_budget"):
        shm_dataset(shm_dir, shm_budget=budget)


@pytest.mark.parametrize("kw", [{"cache_rate": -0.5}, {"cache_num": -1}], ids=["cache_rate", "cache_num"])
def test_negative_cache_size_behaves_like_monai(shm_dir, kw):
    """MONAI accepts it and caches nothing (its cache_num ends up negative); so do we. (Found by this suite:
    'length must be >= 0, got -1'; fixed in 0a94e99.)"""
    import monai.data

    ref = monai.data.CacheDataset(data_list(2, 64), MakeItem(), runtime_cache=True, progress=False, **kw)
    ds = shm_dataset(shm_dir, **kw)
    assert (ds.cache_num, len(ds)) == (ref.cache_num, len(ref))
    for i in range(len(ref)):
        assert item_problem(ds[i], i, 64) is None and item_problem(ref[i], i, 64) is None
    assert ds.cache_stats()["stored"]["entries"] == 0 and ds._cache_index_of(0) is None  # nothing cached
    ds.release()
