"""Stable fingerprints of datasets and transform chains, so that independent processes find the same cache.

Two processes that build the same dataset (same data, same deterministic transforms, same options) compute
the same fingerprint without talking to each other; any difference gives another fingerprint, so train
and validation sets, or a changed ``Spacingd``, never collide.
"""

from __future__ import annotations

import hashlib
import io
import pickle
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from monai.transforms import Compose, RandomizableTrait, Transform

__all__ = ["cacheable_transforms", "first_random_index", "fingerprint", "transforms_fingerprint"]

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _is_random(t: Any) -> bool:
    # MONAI's rule: caching stops at the first randomizable transform or the first non-Transform callable.
    return isinstance(t, RandomizableTrait) or not isinstance(t, Transform)


def first_random_index(transform: Compose) -> int | None:
    """Index of the first transform that is not cached, by MONAI's rule (``None`` if all are cached)."""
    return transform.get_index_of_first(_is_random)


def cacheable_transforms(transform: Compose) -> list[Callable]:
    """The leading deterministic transforms whose output the caches store."""
    end = first_random_index(transform)
    return list(transform.transforms[:end] if end is not None else transform.transforms)


def _describe(obj: Any, depth: int = 0) -> str:
    """A process-independent description of an object that cannot be pickled (e.g. holds a lambda)."""
    if depth > 6:
        return type(obj).__qualname__
    if isinstance(obj, (list, tuple)):
        return "[" + ",".join(_describe(o, depth + 1) for o in obj) + "]"
    if isinstance(obj, dict):
        return "{" + ",".join(f"{k!r}:{_describe(v, depth + 1)}" for k, v in obj.items()) + "}"
    if callable(obj) and hasattr(obj, "__code__"):  # functions and lambdas: their code, not their address
        code = obj.__code__
        return f"<fn {getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', '')} {code.co_code.hex()}>"
    if hasattr(obj, "__dict__") and not isinstance(obj, type):
        inner = ",".join(f"{k}={_describe(v, depth + 1)}" for k, v in sorted(vars(obj).items()))
        return f"{type(obj).__module__}.{type(obj).__qualname__}({inner})"
    return _ADDRESS.sub("", repr(obj))


# Attributes that transforms overwrite on every call (not settings): MONAI's image readers remember the
# last file they read. Left in, a transform that has already run would fingerprint differently.
_VOLATILE_ATTRIBUTES = {"ImageReader": frozenset({"filenames"})}


class _SettingsPickler(pickle.Pickler):
    """Pickles objects for hashing only, leaving out per-call state."""

    def reducer_override(self, obj: Any) -> Any:
        for base in type(obj).__mro__:
            skip = _VOLATILE_ATTRIBUTES.get(base.__name__)
            if skip is not None and hasattr(obj, "__dict__"):
                state = {k: v for k, v in vars(obj).items() if k not in skip}
                return type(obj), (), state
        return NotImplemented


def _dumps(obj: Any) -> bytes:
    buf = io.BytesIO()
    _SettingsPickler(buf, protocol=4).dump(obj)
    return buf.getvalue()


def _digest_parts(parts: Iterable[Any]) -> str:
    h = hashlib.sha256()
    for part in parts:
        try:
            raw = _dumps(part)
        except Exception:  # unpicklable (lambdas, open handles): fall back to a structural description
            raw = _describe(part).encode()
        h.update(len(raw).to_bytes(8, "little"))
        h.update(raw)
    return h.hexdigest()


def transforms_fingerprint(transforms: Sequence[Callable]) -> str:
    """SHA-256 of the given transforms (their classes and settings)."""
    return _digest_parts([[type(t).__module__ + "." + type(t).__qualname__ for t in transforms], *transforms])


def fingerprint(*parts: Any) -> str:
    """SHA-256 over any picklable (or describable) values, in order."""
    return _digest_parts(parts)
