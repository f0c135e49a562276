"""Whether a value shares objects or memory with anything outside it.

What decides whether an object may be handed on without a copy: a computed item to the random transforms
(:func:`make_private`), a batch's MetaTensor to a block of shared memory (``loader``). Objects are counted
by their reference counts, a tensor's memory by how many tensors hold it; both against probes that nothing else
holds, measured the same way in this process.
"""

from __future__ import annotations

import enum
import functools
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

__all__ = ["immutable_leaves", "make_private", "storage_holders", "alone_holders", "with_new_containers"]

_storage_use_count: Callable[[int], int] | None = getattr(torch._C, "_storage_Use_Count", None)

# a data list's leaves, which nothing can change in place
_SCALARS = (str, bytes, int, float, complex, bool, type(None), os.PathLike)
# a computed item's leaves that a random transform can replace but not write into
_IMMUTABLE = (*_SCALARS, enum.Enum)
_MAX_DEPTH = 8


def immutable_leaves(value: Any, depth: int = 0) -> bool:
    """Whether ``value`` is dicts, lists and tuples of strings, numbers and paths only (at most 8 levels deep)."""
    if isinstance(value, _SCALARS):
        return True
    if depth < _MAX_DEPTH and isinstance(value, (dict, list, tuple)):
        return all(immutable_leaves(v, depth + 1) for v in (value.values() if isinstance(value, dict) else value))
    return False


def storage_holders(t: torch.Tensor) -> tuple[int, int]:
    """How many tensors hold ``t``'s memory, and the references to its view base (-1: none), as seen from here.

    Raises:
        RuntimeError: this torch cannot count a storage's holders (see :func:`alone_holders`).
    """
    if _storage_use_count is None:
        raise RuntimeError("torch._C._storage_Use_Count is missing from this torch")
    with torch._C.DisableTorchFunctionSubclass():
        base = t._base
        uses = _storage_use_count(t.untyped_storage()._cdata)
    return uses, -1 if base is None else sys.getrefcount(base)


@functools.lru_cache(maxsize=1)
def alone_holders() -> tuple[tuple[int, int], tuple[int, int]] | None:
    """What :func:`storage_holders` gives for a fresh tensor and for a MetaTensor whose view base (torch makes one
    for a subclass) nothing else holds; None where torch cannot count a storage's holders."""
    if _storage_use_count is None:
        return None
    from monai.data import MetaTensor

    return storage_holders(torch.empty(1)), storage_holders(torch.empty(1).as_subclass(MetaTensor))


def _with_refs(container: Any) -> Iterator[tuple[Any, Any, int]]:
    """Each key (an index for a list or tuple), value and the value's reference count of a dict, list or tuple: the
    one place counts are read, so that :func:`_refs_alone` measures what a value only its container holds shows."""
    for key in list(container) if type(container) is dict else range(len(container)):
        child = container[key]
        yield key, child, sys.getrefcount(child)


@functools.lru_cache(maxsize=1)
def _refs_alone() -> dict[type, int]:
    """What :func:`_with_refs` counts for a value that nothing but its container holds, by container type."""
    probe: dict[int, object] = {}
    probe[0] = object()
    return {
        dict: next(_with_refs(probe))[2],
        list: next(_with_refs([object()]))[2],
        tuple: next(_with_refs((object(),)))[2],
    }


def _memory_holders_alone(t: torch.Tensor) -> bool:
    """Whether no other tensor holds ``t``'s memory (its storage), as far as torch counts them."""
    alone = alone_holders()
    if alone is None:
        return False
    holders = storage_holders(t)
    return holders == (alone[0] if holders[1] == -1 else alone[1])


def _with_own_memory(t: torch.Tensor) -> torch.Tensor:
    """``t`` over a copy of its memory: the same type, attributes (a MetaTensor's metadata: the same objects, ``t``
    is dropped), dtype, shape and strides."""
    with torch._C.DisableTorchFunctionSubclass():  # torch's clone: MetaTensor's own also deep-copies the metadata
        copy = torch.Tensor.clone(t, memory_format=torch.preserve_format)
    if type(copy) is not type(t):
        copy = copy.as_subclass(type(t))
        copy.__dict__.update(t.__dict__)
    return copy


def make_private(item: Any) -> Any | None:
    """``item`` made safe to hand on as it is, so that writing into it changes nothing else: ``item`` itself, or
    ``item`` with parts replaced by copies; None where that cannot be done cheaply (the caller copies it whole).

    ``item`` qualifies when nothing outside it holds the containers, tensors and arrays found through its dicts,
    lists and tuples, nor another tensor their memory. A tensor over memory torch did not allocate (a numpy
    array's, which ``torch.as_tensor`` shares: whether anything else holds that array cannot be told) and an array
    that does not own its data are replaced by a copy in their dict or list (None in a tuple). None for anything
    else held elsewhere, an object of another type, nesting deeper than 8 levels. Not counted: ``item`` itself
    (its caller holds it; an item that is a tensor is checked for its memory only) and a MetaTensor's metadata.

    What lets a computed item go on to the random transforms without MONAI's deep copy: one of them that writes
    into its input (``RandCoarseDropoutd``) then changes nothing that a transform, a module or a loader's cache
    keeps, nor the next items computed from it.
    """
    if isinstance(item, torch.Tensor):
        if not _memory_holders_alone(item):
            return None
        return item if _allocated_by_torch(item) else _with_own_memory(item)
    if type(item) not in (dict, list, tuple):
        return item if isinstance(item, _IMMUTABLE) else None
    to_copy: list[tuple[Any, Any]] = []  # (container, key) of the tensors and arrays to give memory of their own
    if not _check(item, to_copy, 0):
        return None
    for container, key in to_copy:
        value = container[key]
        container[key] = _with_own_memory(value) if isinstance(value, torch.Tensor) else value.copy(order="K")
    return item


def _allocated_by_torch(t: torch.Tensor) -> bool:
    with torch._C.DisableTorchFunctionSubclass():
        return bool(t.untyped_storage().resizable())


def _check(container: Any, to_copy: list[tuple[Any, Any]], depth: int) -> bool:
    if depth > _MAX_DEPTH:
        return False
    alone = _refs_alone()[type(container)]
    mutable = type(container) is not tuple
    for key, child, refs in _with_refs(container):
        if isinstance(child, _IMMUTABLE):
            continue
        if refs != alone:
            return False
        if isinstance(child, torch.Tensor):
            if not _memory_holders_alone(child):
                return False
            if not _allocated_by_torch(child):
                if not mutable:
                    return False
                to_copy.append((container, key))
        elif isinstance(child, np.ndarray):
            if not child.flags.owndata:
                if not mutable:
                    return False
                to_copy.append((container, key))
        elif type(child) in (dict, list, tuple):
            if not _check(child, to_copy, depth + 1):
                return False
        else:
            return False
    return True


def with_new_containers(item: Any, depth: int = 0) -> Any:
    """``item`` in new containers over the same memory: new dicts, lists and tuples, and each tensor of a subclass (a
    MetaTensor) a new object over the same storage whose attributes' dicts and lists are copies (``meta``,
    ``applied_operations``; their values shared). Anything else, plain tensors and arrays included, as it is; below
    8 levels, as it is.

    What ``copy_cache=False`` hands the random transforms of an item a process keeps: a random transform that does
    not run records itself in its input's ``applied_operations`` (MONAI's ``push_transform`` on the object it was
    given), which on the kept object itself piles up the records of every epoch (MONAI's bug); one that writes
    into its input still changes the kept tensor, as in MONAI.
    """
    if isinstance(item, torch.Tensor):
        if type(item) is torch.Tensor:
            return item
        with torch._C.DisableTorchFunctionSubclass():
            alias = torch.Tensor.as_subclass(item, type(item))
        alias.__dict__.update({k: v.copy() if type(v) in (dict, list) else v for k, v in item.__dict__.items()})
        return alias
    if depth >= _MAX_DEPTH:
        return item
    if type(item) is dict:
        return {k: with_new_containers(v, depth + 1) for k, v in item.items()}
    if type(item) in (list, tuple):
        return type(item)(with_new_containers(v, depth + 1) for v in item)
    return item
