"""MONAI's apps datasets (``monai.apps.MedNISTDataset``, ``DecathlonDataset``, ``TciaDataset``) on the
shared-memory cache of :class:`monai_cache.CacheDataset`:
``from monai_cache.apps import MedNISTDataset`` replaces ``from monai.apps import MedNISTDataset``."""

from monai_cache.apps.datasets import DecathlonDataset, MedNISTDataset, TciaDataset

__all__ = ["DecathlonDataset", "MedNISTDataset", "TciaDataset"]
