"""monai_cache: drop-in replacements for MONAI's caching datasets.

``from monai_cache import CacheDataset, PersistentDataset, DataLoader`` replaces the ``monai.data`` import: one
shared-memory cache per machine, an asynchronous compact disk cache, a shard-local sampler, and a DataLoader
whose workers hand each batch over as one shared-memory block.

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
    "ShardedDistributedSampler": "monai_cache.sampler",
    "SharedMemoryStore": "monai_cache.shm",
    "CorruptEntryError": "monai_cache.codec",
    "UnsupportedValueError": "monai_cache.codec",
}

__all__ = [
    "CacheDataset",
    "CorruptEntryError",
    "DataLoader",
    "PersistentDataset",
    "SharedMemoryStore",
    "ShardedDistributedSampler",
    "UnsupportedValueError",
    "__version__",
]

if TYPE_CHECKING:
    from monai_cache.codec import CorruptEntryError, UnsupportedValueError
    from monai_cache.dataset import CacheDataset
    from monai_cache.loader import DataLoader
    from monai_cache.persistent import PersistentDataset
    from monai_cache.sampler import ShardedDistributedSampler
    from monai_cache.shm import SharedMemoryStore


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'monai_cache' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
