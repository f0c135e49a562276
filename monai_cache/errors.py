"""What monai_cache raises and warns: one exception per kind of bad entry or value, one warning category tree.

Every warning we emit is a :class:`MonaiCacheWarning` (a ``RuntimeWarning``), so that a user can silence or
escalate ours alone::

    warnings.filterwarnings("ignore", category=monai_cache.CacheFullWarning)
    warnings.filterwarnings("error", category=monai_cache.MonaiCacheWarning)   # e.g. in a test suite
"""

from __future__ import annotations

import warnings

__all__ = [
    "BatchFallbackWarning",
    "CacheFullWarning",
    "CacheUnavailableWarning",
    "CorruptEntryError",
    "CorruptEntryWarning",
    "MonaiCacheWarning",
    "UncachedItemWarning",
    "UnsupportedValueError",
    "warn",
]


class CorruptEntryError(ValueError):
    """An encoded blob or cache file is truncated, damaged, foreign or otherwise not safely decodable."""


class UnsupportedValueError(TypeError):
    """A value in a cached item has a type that the codec cannot store without pickle."""


class MonaiCacheWarning(RuntimeWarning):
    """Base class of every warning monai_cache emits. Training always continues after one."""


class CacheFullWarning(MonaiCacheWarning):
    """No room for more entries (shared-memory budget or free space, a full disk): further items are served
    uncached."""


class CorruptEntryWarning(MonaiCacheWarning):
    """A damaged cache entry was found; it is removed (or ignored) and the item recomputed."""


class UncachedItemWarning(MonaiCacheWarning):
    """An item holds a value the codec cannot store without pickle: it is computed on every read."""


class CacheUnavailableWarning(MonaiCacheWarning):
    """The cache cannot be used as asked (directory not writable, I/O error, cache removed while in use,
    shared memory missing): items are served uncached."""


class BatchFallbackWarning(MonaiCacheWarning):
    """A batch of :class:`monai_cache.DataLoader` cannot travel as one shared-memory block (a value the codec
    cannot store, too many of a worker's batches alive at once, no memfd or ``/proc/<pid>/fd``): it takes torch's
    ordinary path, the same batch at torch's cost."""


class SwitchWarning(MonaiCacheWarning):
    """The switch (``monai_cache.install()``, ``monai-cache run``) cannot reach a module: it bound MONAI's classes
    before the switch was turned on."""


def warn(message: str, category: type[MonaiCacheWarning] = MonaiCacheWarning, stacklevel: int = 3) -> None:
    """Emit ``message`` (prefixed with ``monai_cache:``) as a ``category`` warning.

    Args:
        message: what happened and what to do.
        category: a :class:`MonaiCacheWarning` subclass.
        stacklevel: as for :func:`warnings.warn`, counted from the caller of this function.
    """
    warnings.warn(f"monai_cache: {message}", category, stacklevel=stacklevel)
