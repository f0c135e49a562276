"""monai_cache: drop-in replacements for MONAI's caching datasets.

``from monai_cache import CacheDataset, PersistentDataset`` replaces the ``monai.data`` import: one
shared-memory cache per machine, an asynchronous compact disk cache, and a shard-local sampler.
"""

__version__ = "0.1.0"

from monai_cache.codec import CorruptEntryError, UnsupportedValueError  # noqa: E402
from monai_cache.dataset import CacheDataset  # noqa: E402
from monai_cache.shm import SharedMemoryStore  # noqa: E402

__all__ = [
    "CacheDataset",
    "CorruptEntryError",
    "SharedMemoryStore",
    "UnsupportedValueError",
    "__version__",
]
