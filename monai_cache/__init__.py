"""monai_cache: drop-in replacements for MONAI's caching datasets.

``from monai_cache import CacheDataset, PersistentDataset, SmartCacheDataset, DataLoader`` replaces the
``monai.data`` import: one shared-memory cache per machine, an asynchronous compact disk cache, a shard-local
sampler, and a DataLoader whose workers hand each batch over as one shared-memory block.

Names are imported lazily, so that ``monai_cache.shm`` or the command line start without importing
MONAI (which takes seconds).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "CacheDataset": "monai_cache.dataset",
    "DataLoader": "monai_cache.loader",
    "PersistentDataset": "monai_cache.persistent",
    "CacheNTransDataset": "monai_cache.cache_n_trans",
    "SmartCacheDataset": "monai_cache.smartcache",
    "ShardedDistributedSampler": "monai_cache.sampler",
    "SharedMemoryStore": "monai_cache.shm",
    "DiskStore": "monai_cache.disk",
    "BatchFallbackWarning": "monai_cache.errors",
    "CorruptEntryError": "monai_cache.errors",
    "UnsupportedValueError": "monai_cache.errors",
    "MonaiCacheWarning": "monai_cache.errors",
    "CacheFullWarning": "monai_cache.errors",
    "CorruptEntryWarning": "monai_cache.errors",
    "UncachedItemWarning": "monai_cache.errors",
    "CacheUnavailableWarning": "monai_cache.errors",
    "SwitchWarning": "monai_cache.errors",
    "install": "monai_cache.switch",
    "uninstall": "monai_cache.switch",
}

__all__ = [
    "BatchFallbackWarning",
    "CacheDataset",
    "CacheFullWarning",
    "CacheNTransDataset",
    "CacheUnavailableWarning",
    "CorruptEntryError",
    "CorruptEntryWarning",
    "DataLoader",
    "DiskStore",
    "MonaiCacheWarning",
    "PersistentDataset",
    "SharedMemoryStore",
    "ShardedDistributedSampler",
    "SmartCacheDataset",
    "SwitchWarning",
    "UncachedItemWarning",
    "UnsupportedValueError",
    "__version__",
    "install",
    "load_ipython_extension",
    "uninstall",
]

if TYPE_CHECKING:
    from monai_cache.cache_n_trans import CacheNTransDataset
    from monai_cache.dataset import CacheDataset
    from monai_cache.disk import DiskStore
    from monai_cache.errors import (
        BatchFallbackWarning,
        CacheFullWarning,
        CacheUnavailableWarning,
        CorruptEntryError,
        CorruptEntryWarning,
        MonaiCacheWarning,
        SwitchWarning,
        UncachedItemWarning,
        UnsupportedValueError,
    )
    from monai_cache.loader import DataLoader
    from monai_cache.persistent import PersistentDataset
    from monai_cache.sampler import ShardedDistributedSampler
    from monai_cache.shm import SharedMemoryStore
    from monai_cache.smartcache import SmartCacheDataset
    from monai_cache.switch import install, uninstall


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext monai_cache``: turns the switch on in the notebook's kernel (:func:`monai_cache.install`).

    Args:
        ipython: the IPython shell.
    """
    from monai_cache import switch

    switch.load_ipython_extension(ipython)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'monai_cache' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
