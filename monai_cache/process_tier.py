"""The per-process tier in front of the shared-memory cache: decoded items kept in this process, for items that end
on an accelerator.

MONAI's fast-training recipe ends the cached part of the chain with ``ToDeviced``, so that ``CacheDataset`` keeps
every item resident on the GPU and a read costs no host-to-device copy. The shared-memory cache holds host bytes
(one copy per machine, shared by every rank), so without this tier each read would decode the item and copy it to
the device again. With it, each process copies an item to its device once, at its first read, and keeps it there
as MONAI does; the item is still computed once per machine, and the machine's host copy fills each rank's device
copy.

The tier holds items whose tensors are on a device other than the CPU (``process_cache=None``, the default), every
item read (``True``: on the CPU a private copy per process, MONAI's in-process reads for single-process jobs), or
nothing (``False``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["ProcessTier", "item_device"]


def item_device(item: Any, depth: int = 0) -> torch.device | None:
    """The device of the first tensor found in ``item`` (dicts, lists and tuples, depth-first), or None."""
    if isinstance(item, torch.Tensor):
        return item.device
    if depth < 8 and isinstance(item, (dict, list, tuple)):
        for value in item.values() if isinstance(item, dict) else item:
            device = item_device(value, depth + 1)
            if device is not None:
                return device
    return None


class ProcessTier:
    """Decoded items kept in this process, by cache entry.

    A dict (MONAI's ``set_rnd``, run by its DataLoader, does not walk into dicts). Threads of one process share it
    (``ThreadDataLoader``); two threads that miss the same entry at once both keep it, the last one stays: the same
    values. Forked DataLoader workers start with a copy of the parent's items and keep their own.

    Args:
        mode: None: keep items that end on an accelerator (decided once, at the first item offered: a chain ends
            on one device); True: keep every item; False: keep none.
    """

    __slots__ = ("_items", "_keeps", "_mode", "device", "hits")

    def __init__(self, mode: bool | None = None) -> None:
        self._mode = mode
        self._keeps: bool | None = None if mode is None else bool(mode)
        self._items: dict[int, Any] = {}
        self.device: torch.device | None = None
        self.hits = 0

    def __reduce__(self) -> tuple:  # a copy (a spawned worker's, a deep copy of the dataset) starts empty
        return ProcessTier, (self._mode,)

    def get(self, entry: int) -> Any:
        """Entry ``entry``'s item if this process keeps it, else None."""
        item = self._items.get(entry)
        if item is not None:
            self.hits += 1
        return item

    def offer(self, entry: int, item: Any) -> bool:
        """Keep ``item`` as entry ``entry`` if this tier keeps items like it; whether it did."""
        keeps = self._keeps
        if keeps is None:
            device = item_device(item)
            keeps = self._keeps = device is not None and device.type != "cpu"
        if keeps:
            if self.device is None:
                self.device = item_device(item)
            self._items[entry] = item
        return keeps

    def keep_only(self, entries: Iterable[int]) -> None:
        """Drop the items of every entry not in ``entries`` (a SmartCacheDataset's window moved on)."""
        keep = set(entries)
        for entry in [e for e in self._items if e not in keep]:
            del self._items[entry]

    def clear(self) -> None:
        """Drop every item (the dataset's data changed, or it released its cache)."""
        self._items.clear()
        self._keeps = None if self._mode is None else bool(self._mode)

    def stats(self) -> dict[str, Any]:
        """``{"entries", "bytes", "hits", "device"}``: items kept, their tensor bytes, reads served from them, where."""
        from monai_cache.codec import item_nbytes

        items = list(self._items.values())
        return {
            "entries": len(items),
            "bytes": sum(item_nbytes(item) for item in items),
            "hits": self.hits,
            "device": None if self.device is None else str(self.device),
        }

    def __len__(self) -> int:
        return len(self._items)
