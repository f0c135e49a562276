"""Lossless downcasting: a tensor in the smallest dtype that holds every one of its values exactly.

The codec stores a float32 label map as uint8, a float32 CT volume of integral Hounsfield units as int16, and
restores the original dtype bit for bit when decoding (``-0.0``, NaN payloads and infinities included). The check
runs piecewise and stops at the first piece that fails, so a volume that cannot be downcast costs little, and
no temporary of the volume's size is ever made.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

__all__ = ["DOWNCAST_MIN_BYTES", "NUMPY_DOWNCASTABLE", "lossless_downcast"]

NUMPY_DOWNCASTABLE = frozenset(
    np.dtype(name).newbyteorder("<")
    for name in ("int16", "int32", "int64", "uint16", "uint32", "uint64", "float16", "float32", "float64")
)
"""numpy dtypes that can be downcast (torch can view them; float128 / longdouble cannot): the check works on
torch tensors."""

# Smaller arrays (affines, metadata: dozens per item) are stored as they are: checking them would cost more
# time than the few bytes it saves.
DOWNCAST_MIN_BYTES = 4096
_CHECK_CHUNK = 1 << 18  # elements per step of the lossless check: temporaries stay small and in cache
_PROBE_STRIDE = 61  # every 61st element is probed first (a prime, so that it does not follow the rows of a volume)
_INT_OF_WIDTH = {2: torch.int16, 4: torch.int32, 8: torch.int64}  # floats are compared as these bit patterns


def _pieces(n: int) -> Iterator[slice]:
    for start in range(0, n, _CHECK_CHUNK):
        yield slice(start, min(start + _CHECK_CHUNK, n))


def _bits(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a contiguous tensor in which floats are their bit patterns (so that comparing two of
    them also requires -0.0, NaN and infinities to match exactly)."""
    if t.is_floating_point():
        t = t.view(_INT_OF_WIDTH[t.element_size()])
    return t.numpy()


def _round_trip_cast(flat: torch.Tensor, cand: torch.dtype, sample: torch.Tensor | None) -> torch.Tensor | None:
    """``flat`` (1-D, contiguous) cast to ``cand`` if every value survives the cast and back bit for bit,
    else None.

    ``sample`` (a strided sample of ``flat``, or None) is tried first: most float images fail on it at once,
    while their first pieces are often air (exact zeros) that pass, so that without it the piecewise check
    would read a good part of the volume before it fails.
    The check runs piecewise and stops at the first piece that fails; the pieces it casts become the result,
    so a successful check costs no second cast. To integer dtypes numpy does the work (about twice as fast as
    torch on one thread; a value that survives the round trip is an integer in range, which both libraries
    cast exactly). To float dtypes torch does, because the decoder casts back with torch and NaN payloads
    need not come back the same from another library.
    """
    if sample is not None and not np.array_equal(_bits(sample.to(cand).to(flat.dtype)), _bits(sample)):
        return None
    out = torch.empty(flat.shape, dtype=cand)
    back = torch.empty(min(flat.numel(), _CHECK_CHUNK), dtype=flat.dtype)  # reused: no page faults per piece
    by_numpy = not cand.is_floating_point and flat.dtype != torch.bfloat16
    src, dst, again = (flat.numpy(), out.numpy(), back.numpy()) if by_numpy else (None, None, None)
    with np.errstate(over="ignore", invalid="ignore"):
        for piece in _pieces(flat.numel()):
            n = piece.stop - piece.start
            if src is not None and dst is not None and again is not None:
                np.copyto(dst[piece], src[piece], casting="unsafe")
                np.copyto(again[:n], dst[piece], casting="unsafe")
            else:
                out[piece].copy_(flat[piece])
                back[:n].copy_(out[piece])
            if not np.array_equal(_bits(back[:n]), _bits(flat[piece])):
                return None
    return out


def lossless_downcast(t: torch.Tensor) -> torch.Tensor | None:
    """``t`` (contiguous) in the smallest dtype that holds every value exactly (bit for bit after casting
    back), if there is a smaller one; else None. The result has ``t``'s shape.

    Holds no temporary of ``t``'s size: only the result (in the smaller dtype) and one piece at a time, so
    that checking a multi-GB volume costs no extra copy of it.
    """
    if t.numel() == 0 or t.dtype in (torch.bool, torch.uint8, torch.int8) or t.is_complex():
        return None
    flat = t.reshape(-1)  # a view of a contiguous tensor
    sample = flat[::_PROBE_STRIDE].contiguous() if flat.numel() > _CHECK_CHUNK else None
    lo = hi = 0
    if not t.dtype.is_floating_point:
        if t.dtype in (torch.uint16, torch.uint32, torch.uint64):  # no torch CPU min/max kernels for these
            values = flat.numpy()
            lo, hi = int(values.min()), int(values.max())
        else:
            lo, hi = (int(v) for v in torch.aminmax(flat))
    for cand in (torch.uint8, torch.int8, torch.int16, torch.int32):
        if cand.itemsize >= t.dtype.itemsize:
            break
        if not t.dtype.is_floating_point:
            info = torch.iinfo(cand)
            if info.min <= lo and hi <= info.max:
                return t.to(cand)
            continue
        # Floats: the round trip itself checks the range (out-of-range, non-integral, NaN and -0.0 fail).
        cast = _round_trip_cast(flat, cand, sample)
        if cast is not None:
            return cast.view(t.shape)
    if t.dtype in (torch.float32, torch.float64):
        for cand in (torch.float16, torch.bfloat16, torch.float32):
            if cand.itemsize >= t.dtype.itemsize:
                break
            cast = _round_trip_cast(flat, cand, sample)
            if cast is not None:
                return cast.view(t.shape)
    return None
