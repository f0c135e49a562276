"""Stable fingerprints of datasets and transform chains, so that independent processes find the same cache.

Two processes that build the same dataset (same data, same deterministic transforms, same options) compute
the same fingerprint without talking to each other; any difference gives another fingerprint, so train
and validation sets, or a changed ``Spacingd``, never collide.

Transforms are fingerprinted by their pickled settings. Code that is not part of a library (functions,
lambdas and classes of the user's own modules, ``__main__`` included) is taken by value: its bytecode and
constants, default arguments, closure variables and the module globals it reads, so that a lambda over
another constant, a closure over another value, a global changed between two jobs, or an edited function
body gives another fingerprint. Library code (MONAI, torch, numpy, the standard library, ...) is taken by
name, and the versions of MONAI and torch are part of every fingerprint (:func:`library_versions`).
"""

from __future__ import annotations

import hashlib
import io
import os
import pickle
import re
import sys
import types
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from monai.transforms import Compose, RandomizableTrait, Transform

__all__ = [
    "cacheable_transforms",
    "chain_fingerprint",
    "first_random_index",
    "fingerprint",
    "library_versions",
    "transforms_fingerprint",
]

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


# Top-level packages whose functions and classes are fingerprinted by name (their versions stand for their
# code); anything else is taken by value.
_BY_NAME = frozenset(
    {"monai", "monai_cache", "torch", "numpy", "scipy", "nibabel", "itk", "SimpleITK", "skimage", "cupy", "einops"}
    | set(sys.stdlib_module_names)
)
# Class attributes that are caches or interpreter bookkeeping, not behaviour.
_CLASS_SKIP = frozenset({"__dict__", "__weakref__", "__doc__", "__module__", "__qualname__", "_abc_impl"})


def _by_name(obj: Any) -> bool:
    module = getattr(obj, "__module__", None)
    return isinstance(module, str) and module.split(".")[0] in _BY_NAME


def _code_state(code: types.CodeType) -> tuple:
    """What a code object does, without where it sits (line numbers) or what its locals are called."""
    consts = []
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            consts.append(_code_state(c))
        elif isinstance(c, frozenset):  # iteration order depends on the hash seed, which differs per process
            consts.append(("frozenset", sorted(repr(v) for v in c)))
        else:
            consts.append(c)
    return code.co_code, tuple(consts), code.co_names


def _global_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names |= _global_names(c)
    return names


def _function_parts(fn: types.FunctionType) -> tuple:
    """A user function by value: code, defaults, closure values and the module globals its code reads.

    Not its module's name: the same script is ``__main__`` in a rank and ``train`` where it is imported.
    """
    closure = []
    for cell in fn.__closure__ or ():
        try:
            closure.append(cell.cell_contents)
        except ValueError:  # an empty cell (a variable assigned later)
            closure.append("<empty cell>")
    reads = {}
    for name in sorted(_global_names(fn.__code__)):
        if name in fn.__globals__:
            value = fn.__globals__[name]
            reads[name] = ("module", value.__name__) if isinstance(value, types.ModuleType) else value
    return fn.__qualname__, _code_state(fn.__code__), fn.__defaults__, fn.__kwdefaults__, tuple(closure), reads


def _class_parts(cls: type) -> tuple:
    """A user class by value: its bases and what its body defines (methods by value, class attributes).

    Not its module's name (see :func:`_function_parts`).
    """
    body = []
    for name, value in sorted(vars(cls).items()):
        if name in _CLASS_SKIP:
            continue
        if isinstance(value, (staticmethod, classmethod)):
            value = (type(value).__name__, value.__func__)
        elif isinstance(value, property):
            value = ("property", value.fget, value.fset, value.fdel)
        body.append((name, value))
    return cls.__qualname__, cls.__bases__, tuple(body)


def _user_code(kind: str, *parts: Any) -> None:  # pragma: no cover - named in pickles that are never loaded
    """Stands for a function or class taken by value in a fingerprint pickle."""


def _tensor_value(kind: str, dtype: str, shape: tuple, raw: bytes, extra: Any) -> None:  # pragma: no cover
    """Stands for a tensor in a fingerprint pickle: its values, not ``torch.save``'s archive (which a tensor's own
    pickle goes through, and which carries a random serialization id)."""


def _tensor_parts(obj: Any) -> tuple | None:
    """``_tensor_value``'s arguments for a torch tensor (a MetaTensor with its metadata), else None."""
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(obj, torch.Tensor) or obj.layout != torch.strided:
        return None
    values = obj.detach().cpu().contiguous()
    raw = values.reshape(-1).view(torch.uint8).numpy().tobytes()  # any dtype, bfloat16 included
    extra = None
    if type(obj) is not torch.Tensor:  # MetaTensor: what MONAI's transforms read besides the values
        extra = (getattr(obj, "meta", None), getattr(obj, "applied_operations", None))
    return type(obj).__qualname__, str(values.dtype), tuple(values.shape), raw, extra


def _describe(obj: Any, depth: int = 0) -> str:
    """A process-independent description of an object that cannot be pickled (e.g. holds a lambda)."""
    if depth > 6:
        return type(obj).__qualname__
    if isinstance(obj, (list, tuple)):
        return "[" + ",".join(_describe(o, depth + 1) for o in obj) + "]"
    if isinstance(obj, dict):
        return "{" + ",".join(f"{k!r}:{_describe(v, depth + 1)}" for k, v in obj.items()) + "}"
    if isinstance(obj, types.FunctionType):  # functions and lambdas: what they do, not their address
        if _by_name(obj):
            return f"<fn {obj.__module__}.{obj.__qualname__}>"
        return f"<fn {_describe(_function_parts(obj), depth + 1)}>"
    if isinstance(obj, type):
        if _by_name(obj):
            return f"<class {obj.__module__}.{obj.__qualname__}>"
        return f"<class {_describe(_class_parts(obj), depth + 1)}>"
    if isinstance(obj, types.CodeType):
        return repr(_code_state(obj))
    if isinstance(obj, types.ModuleType):
        return f"<module {obj.__name__}>"
    if isinstance(obj, (set, frozenset)):
        return "{" + ",".join(sorted(_describe(o, depth + 1) for o in obj)) + "}"
    if hasattr(obj, "__dict__") and not isinstance(obj, type):
        inner = ",".join(f"{k}={_describe(v, depth + 1)}" for k, v in sorted(vars(obj).items()))
        return f"{_describe(type(obj), depth + 1)}({inner})"
    return _ADDRESS.sub("", repr(obj))


# Attributes that are state, not settings: MONAI's image readers remember the last file they read (left in, a
# transform that has already run would fingerprint differently), and a random transform's generator is seeded
# anew in every run unless the user sets a seed (left in, a cache holding random transforms, such as
# CacheNTransDataset's, would never be found again by the next run; MONAI reuses those entries too).
_VOLATILE_ATTRIBUTES = {"ImageReader": frozenset({"filenames"}), "Randomizable": frozenset({"R"})}


class _SettingsPickler(pickle.Pickler):
    """Pickles objects for hashing only: user code by value, per-call state left out."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=4)
        self._in_progress: set[int] = set()  # user code being described (recursion, e.g. super()'s __class__)

    def persistent_id(self, obj: Any) -> Any:
        # Sets pickle in hash order, which differs between processes (PYTHONHASHSEED): sort their members'
        # pickles. (Called for every object; reducer_override is not called for plain sets.)
        if type(obj) in (set, frozenset):
            return type(obj).__name__, sorted(_dumps_nested(self, member) for member in obj)
        return None

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, (types.FunctionType, type)) and not _by_name(obj):
            if id(obj) in self._in_progress:
                return _user_code, ("ref", obj.__qualname__)
            self._in_progress.add(id(obj))
            try:  # pickle the parts now, while the recursion guard holds
                if isinstance(obj, type):
                    raw = _dumps_nested(self, _class_parts(obj))
                    return _user_code, ("class", raw)
                return _user_code, ("function", _dumps_nested(self, _function_parts(obj)))
            finally:
                self._in_progress.discard(id(obj))
        tensor = _tensor_parts(obj)
        if tensor is not None:
            return _tensor_value, tensor
        skip = frozenset().union(*(_VOLATILE_ATTRIBUTES.get(base.__name__, ()) for base in type(obj).__mro__))
        if skip and hasattr(obj, "__dict__"):
            state = {k: v for k, v in vars(obj).items() if k not in skip}
            return type(obj), (), state
        return NotImplemented


def _dumps(obj: Any) -> bytes:
    buf = io.BytesIO()
    _SettingsPickler(buf).dump(obj)
    return buf.getvalue()


def _dumps_nested(outer: _SettingsPickler, obj: Any) -> bytes:
    """Pickle ``obj`` with a pickler that shares ``outer``'s recursion guard."""
    buf = io.BytesIO()
    inner = _SettingsPickler(buf)
    inner._in_progress = outer._in_progress
    inner.dump(obj)
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
    # a user class by its qualified name only: its module is __main__ in a rank, another name where imported
    names = [(type(t).__module__ + "." if _by_name(type(t)) else "") + type(t).__qualname__ for t in transforms]
    return _digest_parts([names, *transforms])


def chain_fingerprint(transform: Compose, cached: Sequence[Callable] | None = None) -> str:
    """SHA-256 of the part of a ``Compose`` that a cache stores and the ``Compose`` settings that change its
    output (``lazy`` fuses spatial transforms into one resampling).

    Args:
        transform: the dataset's chain.
        cached: the transforms whose output the cache stores; default: the leading deterministic ones.
    """
    settings = {
        name: getattr(transform, name, None) for name in ("lazy", "map_items", "unpack_items", "overrides")
    }
    if cached is None:
        cached = cacheable_transforms(transform)
    return fingerprint(transforms_fingerprint(cached), settings)


def library_versions() -> tuple[str, str]:
    """Versions of MONAI and torch: their transforms are fingerprinted by name, so a new version (which may
    compute other values) must give new fingerprints. torch's build tag (``+cpu``, ``+cu124``) is left out,
    so that CPU and GPU machines sharing a cache directory agree."""
    import monai
    import torch

    return str(monai.__version__), str(torch.__version__).split("+")[0]


def relative_paths_base(data: Any) -> str | None:
    """The working directory if ``data`` names an existing file or directory by a relative path, else None.

    A node-wide cache is found by its data's fingerprint: two jobs started in different directories with the same
    relative paths (``ct/img_0000.nii.gz``) read different files, so the directory they resolve against is part of
    what the cache holds. Looks at the strings of the items (and of their dicts, lists and tuples) up to the first
    relative path that exists.

    Args:
        data: a dataset's data (a sequence of items).
    """

    def strings(obj: Any, depth: int) -> Iterator[str]:
        if isinstance(obj, str):
            yield obj
        elif depth and isinstance(obj, dict):
            for value in obj.values():
                yield from strings(value, depth - 1)
        elif depth and isinstance(obj, (list, tuple)):
            for value in obj:
                yield from strings(value, depth - 1)

    found = any(s and not os.path.isabs(s) and os.path.exists(s) for s in strings(data, 3))
    return os.getcwd() if found else None


def fingerprint(*parts: Any) -> str:
    """SHA-256 over any picklable (or describable) values, in order."""
    return _digest_parts(parts)
