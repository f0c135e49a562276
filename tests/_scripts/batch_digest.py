"""A digest of a batch as a training loop sees it: every tensor's dtype, shape, strides and bytes, and every value of
its metadata (not ``TraceKeys.ID``, the address of a transform object in the process that ran it). Two runs whose
batches have equal digests delivered byte-identical batches. Dict keys are taken in sorted order: the order of a
MetaTensor's meta keys comes from a set inside MONAI, so it differs between two interpreters of stock MONAI (string
hashing is randomized per process)."""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import torch


def _feed(h: Any, x: Any) -> None:
    if isinstance(x, torch.Tensor):
        h.update(f"T{x.dtype}{tuple(x.shape)}{x.stride()}".encode())
        h.update(x.detach().contiguous().view(torch.uint8).numpy().tobytes() if x.numel() else b"")
        state = getattr(x, "__dict__", None)
        if state:  # a MetaTensor: meta, applied_operations, is_batch
            _feed(h, state)
    elif isinstance(x, np.ndarray):
        h.update(f"N{x.dtype}{x.shape}".encode() + x.tobytes())
    elif isinstance(x, dict):
        h.update(b"{")
        for k, v in sorted(x.items(), key=lambda kv: repr(kv[0])):
            if k != "id":  # TraceKeys.ID
                _feed(h, k)
                _feed(h, v)
        h.update(b"}")
    elif isinstance(x, (list, tuple)):
        h.update(b"[" if isinstance(x, list) else b"(")
        for v in x:
            _feed(h, v)
        h.update(b"]")
    else:
        h.update(f"{type(x).__name__}:{x!r};".encode())


def batch_digest(batch: Any) -> str:
    """The hex digest of one batch (see the module's docstring)."""
    h = hashlib.sha256()
    _feed(h, batch)
    return h.hexdigest()


def takes_block_path(batch: Any) -> bool:
    """Whether the batch's first tensor lies in a ``monai_cache.DataLoader`` segment (it came as one block)."""
    first = next(v for v in (batch.values() if isinstance(batch, dict) else batch) if isinstance(v, torch.Tensor))
    pointer = first.untyped_storage().data_ptr()
    with open("/proc/self/maps") as maps:
        for line in maps:
            if "monai_cache-batch" in line and "control" not in line:
                lo, hi = (int(a, 16) for a in line.split()[0].split("-"))
                if lo <= pointer < hi:
                    return True
    return False
