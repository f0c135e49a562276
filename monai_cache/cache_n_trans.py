"""Drop-in ``CacheNTransDataset``: MONAI's ``cache_n_trans`` on the disk cache of :mod:`monai_cache.persistent`.

Thin glue: what is cached (the first ``cache_n_trans`` transforms) and what its entries are named after; files,
writer thread and encoding are :class:`monai_cache.PersistentDataset`'s.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from monai.data import CacheNTransDataset as _MonaiCacheNTransDataset
from monai.data.meta_obj import get_track_meta
from monai.data.utils import pickle_hashing
from monai.transforms import Compose, reset_ops_id
from monai.utils import ensure_tuple
from torch.serialization import DEFAULT_PROTOCOL

from monai_cache import compat
from monai_cache.persistent import PersistentDataset

__all__ = ["CacheNTransDataset"]


def _checked_count(cache_n_trans: Any, transform: Sequence[Callable] | Callable | None) -> int:
    """``cache_n_trans`` as an int between 0 and the number of transforms, or an error that says what to pass."""
    try:
        count = operator.index(cache_n_trans)
    except TypeError:
        raise TypeError(
            f"cache_n_trans must be an int (how many leading transforms to cache), got {cache_n_trans!r}"
        ) from None
    if isinstance(transform, Compose):
        available = len(transform.transforms)
    else:  # wrapped in a Compose by MONAI's Dataset, as here: count the same way without building it twice
        available = 0 if transform is None else len(ensure_tuple(transform))
    if not 0 <= count <= available:
        raise ValueError(
            f"cache_n_trans={count} is out of range: transform has {available} transforms, so cache_n_trans must be "
            f"between 0 and {available}"
        )
    return count


def _default_track_meta() -> bool | None:
    """``track_meta=None``: as ``monai.data.get_track_meta()`` says now; with MONAI 1.3 and 1.4, whose class stores the
    items as computed (and so keeps their metadata on hits), None: the items as computed."""
    return get_track_meta() if compat.PERSISTENT_CONVERTS_STORED else None


class CacheNTransDataset(_MonaiCacheNTransDataset, PersistentDataset):
    """MONAI's ``CacheNTransDataset`` on the disk cache of :class:`monai_cache.PersistentDataset`.

    The first ``cache_n_trans`` transforms, random or not, run once per item and their output is stored in
    ``cache_dir``; the rest run on every access. Every argument of :class:`monai.data.CacheNTransDataset` keeps
    its meaning, and the store is :class:`monai_cache.PersistentDataset`'s: asynchronous, compact, checksummed
    files that load without unpickling; a killed writer never leaves an entry that a reader accepts. It is a
    subclass of both (``isinstance(ds, monai.data.CacheNTransDataset)`` holds).

    As in MONAI, a random transform among the first ``cache_n_trans`` runs on a copy of itself for each item
    (``Compose(..., threading=True)``): every item starts from the same random state and so gets the same draw,
    which the cache keeps for the next epochs and runs.

    Differences from MONAI, all fixes:

    * **Hits keep the metadata that later transforms need.** MONAI stores the cached items as plain tensors
      (its ``track_meta`` attribute is False) but returns the ``MetaTensor`` it computed on a miss, so the
      transforms after the first ``cache_n_trans`` see the metadata in the first epoch only: a ``Spacingd`` or
      ``Orientationd`` after the cache computes another output from the second epoch on (it takes the
      identity affine). Here both paths return the cached transforms' output with its metadata when MONAI
      tracks metadata (``track_meta=None``, the default: ``monai.data.get_track_meta()``, True unless you
      turned it off), so every epoch gives MONAI's first-epoch output; ``track_meta=False`` gives plain tensors
      on both paths (MONAI's output on a hit).
    * **``reset_ops_id=False`` is honoured** (MONAI resets the transform IDs in the cached items always).
    * **A changed transform never serves old entries**: with the default ``hash_transform=None`` the file names
      include a fingerprint of exactly the first ``cache_n_trans`` transforms (random ones by their settings, not
      by the state of their random generator, so that the next run finds the entries, as in MONAI) and of
      ``cache_n_trans``. An explicit ``hash_transform`` keeps MONAI's meaning (a hash of the transforms up to
      the first random one), and ``cache_n_trans`` is still part of the names.
    * **A ``cache_n_trans`` that is not an int from 0 to the number of transforms is an error at construction**
      that names it (MONAI fails at the first item, inside ``Compose``).

    Args:
        data: input data file paths to load and transform to generate dataset for model.
            `PersistentDataset` expects input data to be a list of serializable
            and hashes them as cache keys using `hash_func`.
        transform: transforms to execute operations on input data.
        cache_n_trans: cache the result of first N transforms.
        cache_dir: If specified, this is the location for persistent storage
            of pre-computed transformed data tensors. The cache_dir is computed once, and
            persists on disk until explicitly removed.  Different runs, programs, experiments
            may share a common cache dir provided that the transforms pre-processing is consistent.
            If `cache_dir` doesn't exist, will automatically create it (with mode 0700).
            If `cache_dir` is `None`, there is effectively no caching.
        hash_func: a callable to compute hash from data items to be cached.
            defaults to `monai.data.utils.pickle_hashing`.
        pickle_module: accepted for compatibility and, when ``cache_dir`` is given, checked against
            ``monai.data.utils.SUPPORTED_PICKLE_MOD``; not used (the files are not pickles).
        pickle_protocol: accepted for compatibility; not used (the files are not pickles).
        hash_transform: a callable to compute hash from the transform information when caching, appended to
            the file names as in MONAI (e.g. `pickle_hashing` or `json_hashing` from `monai.data.utils`).
            Default None: a fingerprint of the first ``cache_n_trans`` transforms is used instead.
        reset_ops_id: whether to set `TraceKeys.ID` to ``TraceKeys.NONE``, defaults to ``True``.
            When this is enabled, the traced transform instance IDs will be removed from the cached MetaTensors.
            This is useful for skipping the transform instance checks when inverting applied operations
            using the cached content and with re-created transform instances.
        track_meta: whether the cached items keep their metadata (``MetaTensor``) on misses and hits alike.
            None (default): as ``monai.data.get_track_meta()`` says when the dataset is built (with MONAI 1.3 and
            1.4, whose class stores the items as computed: the items as computed). Not a parameter of MONAI's
            class (see above).
        options: the keyword-only options of :class:`monai_cache.PersistentDataset` (``async_writes``,
            ``compression``, ``compression_level``, ``compression_threads``, ``downcast``, ``lossy_dtypes``,
            ``allow_pickle``, ``fsync``, ``max_pending_writes``, ``max_pending_bytes``, ``shared_dir``, and
            ``shm_cache`` with ``shm_dir``, ``shm_budget``, ``keep_warm`` for a shared-memory copy in front of the
            disk cache), with the same meaning.
    """

    def __init__(
        self,
        data: Sequence,
        transform: Sequence[Callable] | Callable,
        cache_n_trans: int,
        cache_dir: Path | str | None,
        hash_func: Callable[..., bytes] = pickle_hashing,
        pickle_module: str = "pickle",
        pickle_protocol: int = DEFAULT_PROTOCOL,
        hash_transform: Callable[..., bytes] | None = None,
        reset_ops_id: bool = True,
        *,
        track_meta: bool | None = None,
        **options: Any,
    ) -> None:
        # Set before the store is set up, which names the entries after the cached transforms. An int, so MONAI's
        # worker seeding (set_rnd walks __dict__) seeds the transforms as it does for MONAI's class.
        self.cache_n_trans = _checked_count(cache_n_trans, transform)
        # Ours, not MONAI's CacheNTransDataset.__init__ (which sets cache_n_trans after the store is set up and
        # has no track_meta); MONAI's PersistentDataset.__init__ runs below it.
        PersistentDataset.__init__(
            self,
            data=data,
            transform=transform,
            cache_dir=cache_dir,
            hash_func=hash_func,
            pickle_module=pickle_module,
            pickle_protocol=pickle_protocol,
            hash_transform=hash_transform,
            reset_ops_id=reset_ops_id,
            track_meta=_default_track_meta() if track_meta is None else bool(track_meta),
            **options,
        )

    # -- what is cached --
    def _cached_transforms(self) -> Sequence[Callable]:
        return list(self.transform.transforms[: self.cache_n_trans])

    def _variant_options(self) -> tuple:
        return (*super()._variant_options(), ("cache_n_trans", self.cache_n_trans))

    # -- MONAI's hooks --
    def _pre_transform(self, item_transformed: Any) -> Any:
        """Process the data from original state up to the N element.

        Args:
            item_transformed: The data to be transformed

        Returns:
            the transformed element up to the N transform object
        """
        item_transformed = self.transform(item_transformed, end=self.cache_n_trans, threading=True)
        if self.reset_ops_id:
            reset_ops_id(item_transformed)
        return item_transformed

    def _post_transform(self, item_transformed: Any) -> Any:
        """Process the data from before the N + 1 transform to the final state ready for evaluation.

        Args:
            item_transformed: The data to be transformed (already processed up to the first N transform)

        Returns:
            the final transformed result
        """
        return self.transform(item_transformed, start=self.cache_n_trans)
