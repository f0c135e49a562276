"""monai_cache: drop-in replacements for MONAI's caching datasets.

``from monai_cache import CacheDataset, PersistentDataset`` replaces the ``monai.data`` import.
"""

__version__ = "0.1.0"
