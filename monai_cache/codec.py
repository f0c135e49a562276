"""One encoding for every store: a cached item becomes a small JSON header plus raw, aligned buffers.

The same bytes live in a shared-memory entry (:mod:`monai_cache.shm`) and, wrapped with a checksum and
optional compression, in a disk file (:mod:`monai_cache.disk`). Nothing here unpickles unless the caller
explicitly opts in with ``allow_pickle=True``.

Layout of an encoded blob (all integers little endian)::

    offset 0   prefix: magic "MCACHE\\0\\1" (8 bytes), format version (u32), flags (u32),
               header length (u64), total length (u64), CRC-32 of the header (u32),
               CRC-32 of the buffers' bytes in order, padding excluded (u32)
    offset 40  header: UTF-8 JSON, strict (no NaN literals)
    aligned    data: the raw buffers, each starting at a multiple of 64 bytes from the blob start

The header is ``{"root": node, "buffers": [[offset, nbytes], ...]}`` where buffer offsets are relative to
the start of the data area. A *node* is a JSON ``null``, boolean, string, integer, finite float or list
(a Python list), or an object tagged by its ``"~"`` member:

=====  ==========================================================================================
tag    meaning
=====  ==========================================================================================
``d``  dict: ``"k"`` list of key nodes, ``"v"`` list of value nodes
``t``  tuple: ``"v"`` list of nodes
``f``  non-finite float: ``"v"`` is ``"nan"``, ``"inf"`` or ``"-inf"``
``c``  complex: ``"r"``, ``"i"`` float nodes
``e``  enum member: ``"c"`` ``"module:QualName"`` (only from ``monai.*`` or imported modules), ``"v"`` value
``T``  torch.Tensor  ``"dt"`` dtype name, ``"sh"`` shape, ``"b"`` buffer index or ``"x"`` base64 bytes,
       optional ``"pm"`` permutation (the stored order is ``tensor.permute(pm)``, restored by the inverse),
       optional ``"sd"`` stored dtype (lossless or requested downcast), optional ``"dev"`` device
``M``  monai MetaTensor: like ``T`` plus ``"a"``, a ``d`` node of the tensor's attributes (meta,
       applied_operations, is_batch, ...)
``N``  numpy.ndarray: ``"dt"`` numpy dtype string, ``"sh"``, ``"b"``/``"x"``, optional ``"F"`` for Fortran order,
       optional ``"sd"``
``n``  numpy scalar: ``"dt"``, ``"x"`` base64 bytes
``B``  bytes: ``"b"``/``"x"``
``td`` torch.dtype, ``nd`` numpy dtype: ``"v"`` name
``P``  pickled value (only with ``allow_pickle=True``): ``"b"``/``"x"``
``r``  the object of an earlier node again (an object met twice in the item): ``"i"``, the number of that node
=====  ==========================================================================================

An object met twice in an item (a dict, list, tensor or array) is stored once and decoded as one object again, as
pickle and ``copy.deepcopy`` keep it: MONAI's random crops of one image share the dicts of its cached transforms in
``applied_operations``. The nodes a reference can name are numbered in the order they are completed (children before
their parent): every JSON list node and every ``d``, ``T``, ``M`` and ``N`` node. A header holding a reference says
``"refs": true``; without one, a decoder numbers nothing.
"""

from __future__ import annotations

import base64
import binascii
import enum
import importlib
import json
import math
import struct
import sys
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

try:  # a compiled JSON writer: the stdlib's took a quarter of a small item's encode (below, _header_json)
    import orjson as _orjson
except ImportError:  # pragma: no cover - an install without its wheel (it is a dependency): the stdlib writes it
    _orjson = None  # type: ignore[assignment]

from monai_cache.downcast import DOWNCAST_MIN_BYTES, NUMPY_DOWNCASTABLE, lossless_downcast
from monai_cache.errors import CorruptEntryError, UnsupportedValueError

__all__ = [
    "ALIGN",
    "FORMAT_VERSION",
    "MAGIC",
    "CorruptEntryError",
    "Encoded",
    "UnsupportedValueError",
    "blob_identity",
    "decode",
    "encode",
    "item_nbytes",
]

MAGIC = b"MCACHE\x00\x01"
FORMAT_VERSION = 1
ALIGN = 64
_PREFIX = struct.Struct("<8sIIQQII")
FLAG_NO_DATA_CRC = 1  # prefix flag: the data CRC field is not set (the container checksums the blob)
_KNOWN_FLAGS = FLAG_NO_DATA_CRC
PREFIX_SIZE = _PREFIX.size  # 40
INLINE_LIMIT = 256  # buffers up to this many bytes go into the header (meta arrays, affines)
MAX_DEPTH = 64
MAX_HEADER = 64 << 20

_TORCH_DTYPES: dict[str, torch.dtype] = {
    name: dt
    for name, dt in {
        "bool": torch.bool,
        "uint8": torch.uint8,
        "int8": torch.int8,
        "int16": torch.int16,
        "uint16": getattr(torch, "uint16", None),
        "int32": torch.int32,
        "uint32": getattr(torch, "uint32", None),
        "int64": torch.int64,
        "uint64": getattr(torch, "uint64", None),
        "float16": torch.float16,
        "bfloat16": torch.bfloat16,
        "float32": torch.float32,
        "float64": torch.float64,
        "complex64": torch.complex64,
        "complex128": torch.complex128,
    }.items()
    if dt is not None
}
_TORCH_DTYPE_NAMES = {dt: name for name, dt in _TORCH_DTYPES.items()}
# little-endian numpy dtypes of the torch dtypes numpy has (not bfloat16): decoding makes tensors through them
_NUMPY_OF_TORCH = {dt: np.dtype(name).newbyteorder("<") for name, dt in _TORCH_DTYPES.items() if name != "bfloat16"}
STORABLE_DTYPES = frozenset(_TORCH_DTYPES.values())  # tensor dtypes an entry can hold
# tensor dtypes whose .numpy() every supported torch has (its unsigned 16-64 bit ones came in 2.3)
_NUMPY_VIEWABLE = frozenset({
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.float16, torch.float32, torch.float64, torch.complex64, torch.complex128,
})  # fmt: skip
# numpy kinds we store raw: booleans, integers, floats, complex (no objects, strings or structured types).
_NUMPY_KINDS = frozenset("biufc")

def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


_ATTR_NAMES = {
    "_meta": "meta",
    "_applied_operations": "applied_operations",
    "_pending_operations": "pending_operations",
}

# Where a value sits in the item, for error messages: "item", or (parent, how, what) with how one of "key" (a dict
# key), "attr" (a MetaTensor attribute), "index" (a list or tuple position) or "." (a named part). Built as tuples and
# spelled out only for an error: a NIfTI image's meta dict has dozens of keys, and formatting each key's path showed
# in the cost of encoding it.
_Path = Any


def _path_text(path: _Path) -> str:
    if isinstance(path, str):
        return path
    parent, how, what = path
    if how == "key":
        return f"{_path_text(parent)}[{(what.value if isinstance(what, enum.Enum) else what)!r}]"
    if how == "attr":
        return f"{_path_text(parent)}.{_ATTR_NAMES.get(what, what)}"
    if how == "index":
        return f"{_path_text(parent)}[{what}]"
    return f"{_path_text(parent)}.{what}"


@dataclass
class Encoded:
    """An item encoded as a header plus raw buffers; nothing is copied until it is written.

    Attributes:
        header: the JSON header bytes.
        buffers: the raw buffers (contiguous byte views of the tensors and arrays).
        offsets: offset of each buffer from the start of the data area.
        data_offset: where the data area starts in the blob.
        nbytes: total size of the blob.
        tensors: how many torch tensors the item holds (what torch's pickling would move one by one).
        objects: with ``encode(exact=True)``: each container, tensor and array of the item (its node numbered), with
            how many times the item refers to it (what tells whether anything else holds it).
    """

    header: bytes
    buffers: list[memoryview]
    offsets: list[int]
    data_offset: int
    nbytes: int
    borrowed: list[bool] = field(default_factory=list)  # per buffer: a view of the item's own memory
    tensors: int = 0
    keepalive: list[Any] = field(default_factory=list)  # what the buffers point into (contiguous copies, casts)
    objects: list[tuple[Any, int]] = field(default_factory=list)
    _data_crc: int | None = None
    _prefixes: dict[bool, bytes] = field(default_factory=dict)  # by data_crc: a writer asks twice (data, identity)

    def detach(self) -> Encoded:
        """This encoding, sharing no memory with the encoded item: buffers that are views of the item's
        tensors and arrays are copied; those the encoder made (downcast, made contiguous) are kept.

        What a background writer needs: later in-place changes to the item cannot reach it, and it costs
        one copy of the stored bytes (not of the item, whose float label maps may be four times larger).
        """
        if not any(self.borrowed):
            return self
        buffers = [memoryview(bytearray(b)) if own else b for b, own in zip(self.buffers, self.borrowed)]
        out = Encoded(self.header, buffers, self.offsets, self.data_offset, self.nbytes, [False] * len(buffers))
        out.keepalive = [self.keepalive]
        out.tensors = self.tensors
        return out

    def prefix(self, data_crc: bool = True) -> bytes:
        """The blob's fixed prefix.

        Args:
            data_crc: record the CRC-32 of the buffers (a pass over the data). A container that checksums the
                whole blob itself (a disk entry) passes False: the prefix then says that no data CRC is
                recorded, and ``decode(verify=True)`` has nothing to check.
        """
        made = self._prefixes.get(data_crc)
        if made is not None:
            return made
        if not data_crc:
            made = _PREFIX.pack(MAGIC, FORMAT_VERSION, FLAG_NO_DATA_CRC, len(self.header), self.nbytes,
                                zlib.crc32(self.header), 0)
        else:
            if self._data_crc is None:
                crc = 0
                for buf in self.buffers:
                    crc = zlib.crc32(buf, crc)
                self._data_crc = crc
            made = _PREFIX.pack(MAGIC, FORMAT_VERSION, 0, len(self.header), self.nbytes, zlib.crc32(self.header),
                                self._data_crc)
        self._prefixes[data_crc] = made
        return made

    def chunks(self, data_crc: bool = True) -> Iterator[memoryview | bytes]:
        """Yield the blob as consecutive pieces (padding included), for ``os.writev`` or a stream.

        Args:
            data_crc: see :meth:`prefix`.
        """
        head = self.prefix(data_crc) + self.header
        yield head
        pos = len(head)
        for off, buf in zip(self.offsets, self.buffers):
            start = self.data_offset + off
            if start > pos:
                yield bytes(start - pos)
            yield buf
            pos = start + buf.nbytes
        if self.nbytes > pos:
            yield bytes(self.nbytes - pos)

    def write_into(self, out: memoryview, data_crc: bool = True) -> None:
        """Copy the blob into ``out`` (at least ``nbytes`` long); padding is left as it is in ``out``.

        Args:
            out: the destination.
            data_crc: see :meth:`prefix`.
        """
        head = self.prefix(data_crc) + self.header
        out[: len(head)] = head
        for off, buf in zip(self.offsets, self.buffers):
            start = self.data_offset + off
            out[start : start + buf.nbytes] = buf

    def to_bytes(self, data_crc: bool = True) -> bytearray:
        """The blob as a new ``bytearray`` (``data_crc``: see :meth:`prefix`)."""
        out = bytearray(self.nbytes)
        self.write_into(memoryview(out), data_crc)
        return out


def _byte_view(t: torch.Tensor) -> memoryview:
    """A byte view of a contiguous CPU tensor, without copying."""
    if t.numel() == 0:
        return memoryview(b"")
    if t.dtype in _NUMPY_VIEWABLE:  # through numpy's own dtype: a third of the reshape-and-view way's cost
        return memoryview(t.numpy()).cast("B")  # type: ignore[arg-type]
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]


# Memos of the arrays small enough for the header (a NIfTI meta dict's fields), each cleared when it holds _MEMO_MAX
_SMALL_NODES: dict[tuple, dict] = {}  # _Encoder._small_ndarray's nodes, by (dtype, shape, Fortran order, bytes)
_SMALL_ARRAYS: dict[tuple, np.ndarray] = {}  # _Decoder._ndarray's inline arrays, by their node's fields
_MEMO_MAX = 4096
_ENUM_NAMES: dict[type, str] = {}  # an enum class -> its "module:QualName" in the header
_ENUM_NODES: dict[enum.Enum, dict] = {}  # a member whose value is a string or an integer -> its node


class _Encoder:
    def __init__(
        self, allow_pickle: bool, downcast: bool, lossy: Mapping[str, torch.dtype] | None, exact: bool = False
    ) -> None:
        self.allow_pickle = allow_pickle
        self.downcast = downcast
        self.lossy = dict(lossy or {})
        self.exact = exact
        self.numbered = 0  # nodes a reference can name, counted as they are completed
        self.done: dict[int, int] = {}  # id of an object of the item -> the number of its node
        self.refs = False
        self.storages: set[int] = set()  # exact: the tensors' storages met so far
        # exact: the numbered objects (containers, tensors, arrays) and how often the item refers to each
        self.objects: list[Any] = []
        self.met: dict[int, int] = {}
        self.tensors = 0
        self.buffers: list[memoryview] = []
        self.offsets: list[int] = []
        self.borrowed: list[bool] = []
        self.keepalive: list[Any] = []  # contiguous copies whose memory the buffers point into
        self.size = 0

    def _add_buffer(self, node: dict, view: memoryview, borrowed: bool = False) -> None:
        """Add a raw buffer (``borrowed``: a view of the item's own, mutable memory)."""
        if view.nbytes <= INLINE_LIMIT:
            node["x"] = base64.b64encode(view).decode("ascii")
            return
        self.size = _align(self.size)
        node["b"] = len(self.buffers)
        self.buffers.append(view)
        self.borrowed.append(borrowed)
        self.offsets.append(self.size)
        self.size += view.nbytes

    def _tensor(self, t: torch.Tensor, path: _Path, top_key: str | None, depth: int) -> dict:
        # Only look for MetaTensor if MONAI is loaded: importing it takes seconds, and without it none exists.
        meta_module = sys.modules.get("monai.data.meta_tensor")
        is_meta = meta_module is not None and isinstance(t, meta_module.MetaTensor)
        node: dict[str, Any] = {"~": "M" if is_meta else "T"}
        self.tensors += 1
        data = t.as_tensor() if is_meta else t  # type: ignore[attr-defined]
        requires_grad = data.requires_grad
        data = data.detach()
        if data.layout != torch.strided or data.is_nested or data.device.type == "meta":
            what = "a nested" if data.is_nested else ("a meta-device" if data.device.type == "meta" else "a sparse")
            return self._fallback(t, path, f"{what} tensor ({data.layout}) has no dense bytes to store")
        if data.is_conj() or data.is_neg():  # lazy views: store the values they stand for
            data = data.resolve_conj().resolve_neg()
        own_storage = data.untyped_storage().data_ptr()
        if self.exact:
            self._check_exact(t, data, requires_grad, path)
        if data.dtype not in _TORCH_DTYPE_NAMES:
            raise UnsupportedValueError(f"cannot cache {_path_text(path)}: torch dtype {data.dtype} is not supported")
        if data.device.type != "cpu":
            node["dev"] = str(data.device)
            data = data.cpu()
        node["dt"] = _TORCH_DTYPE_NAMES[data.dtype]
        node["sh"] = list(data.shape)
        if not data.is_contiguous() and data.dim() > 1 and _is_dense_permutation(data):
            strides, sizes = data.stride(), data.shape
            perm = sorted(range(data.dim()), key=lambda d: (-strides[d], -sizes[d]))
            data = data.permute(perm)
            if data.is_contiguous():
                node["pm"] = perm
            else:  # pragma: no cover - defensive, dense permutations are contiguous once permuted
                data = data.contiguous()
        else:
            data = data.contiguous()
        stored: torch.Tensor | None = None
        if top_key is not None and top_key in self.lossy:
            stored = data.to(self.lossy[top_key])
        elif self.downcast and data.numel() * data.element_size() >= DOWNCAST_MIN_BYTES:
            stored = lossless_downcast(data)
        if stored is not None and stored.dtype != data.dtype:
            node["sd"] = _TORCH_DTYPE_NAMES[stored.dtype]
            data = stored
        self.keepalive.append(data)
        borrowed = data.device.type == "cpu" and data.untyped_storage().data_ptr() == own_storage
        self._add_buffer(node, _byte_view(data), borrowed)
        if is_meta:
            attrs = dict(t.__dict__)
            node["a"] = self._dict(attrs, path, depth + 1, attr=True)
            self.numbered += 1  # the attributes' dict node (made here: nothing can refer to it)
        self._done(t)
        return node

    def _check_exact(self, t: torch.Tensor, data: torch.Tensor, requires_grad: bool, path: _Path) -> None:
        """Refuse a tensor that pickling would bring back differently than a decode: a subclass other than
        MetaTensor, one that requires grad, a lazy view, memory shared with another tensor of the item, or memory
        that is not exactly its own elements (an offset, gaps, overlaps)."""
        meta_module = sys.modules.get("monai.data.meta_tensor")
        why = None
        if type(t) is not torch.Tensor and (meta_module is None or type(t) is not meta_module.MetaTensor):
            why = f"a tensor of subclass {type(t).__qualname__}"
        elif requires_grad:
            why = "a tensor that requires grad"
        elif data.is_conj() or data.is_neg() or data.device.type != "cpu":
            why = "a lazy view or a tensor not on the CPU"
        else:
            storage = data.untyped_storage()
            nbytes = data.numel() * data.element_size()
            if data.storage_offset() != 0 or storage.nbytes() != nbytes or not (
                data.is_contiguous() or _is_dense_permutation(data)
            ):
                why = "a view of a part of its memory"
            elif nbytes and storage.data_ptr() in self.storages:
                why = "a tensor sharing memory with another"
            elif nbytes:
                self.storages.add(storage.data_ptr())
        if why is not None:
            raise UnsupportedValueError(f"cannot encode {_path_text(path)} exactly: {why}")

    def _done(self, value: Any) -> None:
        """Number the node just completed for ``value``; a later occurrence of ``value`` refers to it."""
        self.done[id(value)] = self.numbered
        self.numbered += 1
        if self.exact:
            self.objects.append(value)
            self.met[id(value)] = 1

    def _ndarray(self, a: np.ndarray, path: _Path, top_key: str | None) -> dict:
        if a.dtype.kind not in _NUMPY_KINDS or a.dtype.fields is not None:
            return self._fallback(a, path, f"numpy dtype {a.dtype} is not supported")
        if a.nbytes <= INLINE_LIMIT and (top_key is None or top_key not in self.lossy):
            self._done(a)
            return self._small_ndarray(a)
        node: dict[str, Any] = {"~": "N", "dt": a.dtype.str, "sh": list(a.shape)}
        if a.ndim > 1 and a.flags.f_contiguous and not a.flags.c_contiguous:
            node["F"] = True
            data = a
        else:
            data = np.ascontiguousarray(a)
        if data.dtype.byteorder == ">":  # stored little-endian; decode casts back to the original byte order
            data = data.astype(data.dtype.newbyteorder("<"))
            node["sd"] = data.dtype.str
        if top_key is not None and top_key in self.lossy:
            lossy = self.lossy[top_key]
            sd = np.dtype(str(lossy).replace("torch.", "")) if lossy != torch.bfloat16 else None
            if sd is not None and sd != data.dtype:
                node["sd"] = sd.str
                data = data.astype(sd, order="K")
        elif self.downcast and data.dtype in NUMPY_DOWNCASTABLE and data.nbytes >= DOWNCAST_MIN_BYTES:
            # checked in storage order (a view of the C- or Fortran-ordered data); numpy has no bfloat16
            cast = lossless_downcast(torch.from_numpy(data.reshape(-1, order="A")))
            if cast is not None and cast.dtype != torch.bfloat16:
                stored = cast.numpy()
                node["sd"] = stored.dtype.str
                data = stored.reshape(data.shape, order="F" if node.get("F") else "C")
        self.keepalive.append(data)
        view = memoryview(data.reshape(-1, order="A")).cast("B")  # type: ignore[arg-type]
        self._add_buffer(node, view, borrowed=np.may_share_memory(data, a))
        self._done(a)
        return node

    @staticmethod
    def _small_ndarray(a: np.ndarray) -> dict:
        """The node of an array inlined in the header (meta dicts hold dozens: a NIfTI header's fields): what
        :meth:`_ndarray` writes for it, without the buffer bookkeeping (no buffer; too small to downcast).

        Nodes are remembered by dtype, shape and bytes: one image's header fields are mostly another's (the same
        header size, codes and units), and a node is only read once made."""
        fortran = a.ndim > 1 and a.flags.f_contiguous and not a.flags.c_contiguous
        raw = a.tobytes(order="F" if fortran else "C")
        key = (a.dtype.str, a.shape, fortran, raw)
        node = _SMALL_NODES.get(key)
        if node is not None:
            return node
        node = {"~": "N", "dt": a.dtype.str, "sh": list(a.shape)}
        if fortran:
            node["F"] = True
        if a.dtype.byteorder == ">":  # stored little-endian; decode casts back to the original byte order
            a = a.astype(a.dtype.newbyteorder("<"))
            node["sd"] = a.dtype.str
            raw = a.tobytes(order="F" if fortran else "C")
        node["x"] = base64.b64encode(raw).decode("ascii")
        if len(_SMALL_NODES) >= _MEMO_MAX:
            _SMALL_NODES.clear()
        _SMALL_NODES[key] = node
        return node

    def _small_tensor(self, t: torch.Tensor) -> dict | None:
        """The node :meth:`_tensor` writes for a plain, contiguous CPU tensor small enough for the header (a meta
        dict's affine), remembered by dtype, shape and bytes as :meth:`_small_ndarray` remembers arrays; None for
        any other tensor (one that requires grad, a lazy view, a dtype the format lacks: :meth:`_tensor` decides)."""
        if (
            t.numel() * t.element_size() > INLINE_LIMIT
            or t.device.type != "cpu"
            or t.layout != torch.strided
            or t.requires_grad
            or t.is_conj()
            or t.is_neg()
            or not t.is_contiguous()
        ):
            return None
        name = _TORCH_DTYPE_NAMES.get(t.dtype)
        if name is None:
            return None
        shape = tuple(t.shape)
        raw = _byte_view(t).tobytes()
        key = ("T", name, shape, raw)
        node = _SMALL_NODES.get(key)
        if node is None:
            node = {"~": "T", "dt": name, "sh": list(shape), "x": base64.b64encode(raw).decode("ascii")}
            if len(_SMALL_NODES) >= _MEMO_MAX:
                _SMALL_NODES.clear()
            _SMALL_NODES[key] = node
        self.tensors += 1
        self._done(t)
        return node

    def _fallback(self, value: Any, path: _Path, why: str) -> dict:
        if not self.allow_pickle:
            raise UnsupportedValueError(
                f"cannot cache {_path_text(path)}: {why} (type {type(value).__module__}.{type(value).__qualname__}). "
                "monai_cache stores tensors, numpy arrays, numbers, strings, None, enums and dict/list/tuple "
                "of these without pickle. Convert the value in a transform before the first random one, "
                "or pass allow_pickle=True to store it with pickle (only load such caches from trusted sources)."
            )
        import pickle

        node: dict[str, Any] = {"~": "P"}
        self._add_buffer(node, memoryview(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)))
        return node

    def _dict(self, d: Mapping, path: _Path, depth: int, attr: bool = False) -> dict:
        keys, values = [], []
        for k, v in d.items():
            keys.append(k if type(k) is str else self.node(k, (path, ".", "<key>"), depth + 1))
            if attr:
                values.append(self.node(v, (path, "attr", k), depth + 1))
            else:
                top = k if depth == 0 and isinstance(k, str) else None
                values.append(self.node(v, (path, "key", k), depth + 1, top))
        return {"~": "d", "k": keys, "v": values}

    def node(self, value: Any, path: _Path, depth: int, top_key: str | None = None) -> Any:
        if depth > MAX_DEPTH:
            raise UnsupportedValueError(
                f"cannot cache {_path_text(path)}: nested deeper than {MAX_DEPTH} levels (a cycle?)"
            )
        kind = type(value)
        if value is None or kind in (bool, str, int):
            return value
        if kind is float:
            if math.isfinite(value):
                return value
            return {"~": "f", "v": "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}
        number = self.done.get(id(value))
        if number is not None:  # met before: pickle and deepcopy keep one object, and so does the decode
            self.refs = True
            if self.exact:
                self.met[id(value)] += 1
            return {"~": "r", "i": number}
        # the exact containers and arrays before the isinstance checks below (none of them is an enum or a tensor):
        # a meta dict is mostly small arrays
        if kind is np.ndarray:
            return self._ndarray(value, path, top_key)
        if kind is dict:
            out = self._dict(value, path, depth)
            self._done(value)
            return out
        if kind is list:
            items = [self.node(v, (path, "index", i), depth + 1) for i, v in enumerate(value)]
            self._done(value)
            return items
        if kind is tuple:
            return {"~": "t", "v": [self.node(v, (path, "index", i), depth + 1) for i, v in enumerate(value)]}
        if kind is torch.Tensor and not self.exact and (top_key is None or top_key not in self.lossy):
            small = self._small_tensor(value)  # a meta dict's affine: the same one item after item
            if small is not None:
                return small
        if isinstance(value, enum.Enum):
            known = _ENUM_NODES.get(value)
            if known is not None:
                return known
            name = _ENUM_NAMES.get(kind)
            if name is None:
                if "<locals>" in kind.__qualname__:  # decode finds enum classes by module and name only
                    raise UnsupportedValueError(
                        f"cannot cache {_path_text(path)}: enum {kind.__module__}.{kind.__qualname__} is defined "
                        "inside a function, so a reader could not find its class. Define it at module level, or "
                        "convert the value (e.g. to value.value) in a transform before the first random one."
                    )
                name = _ENUM_NAMES[kind] = f"{kind.__module__}:{kind.__qualname__}"
            member = {"~": "e", "c": name, "v": self.node(value.value, path, depth + 1)}
            if type(value.value) in (str, int, bool):  # the same node every time: MONAI's meta keys
                _ENUM_NODES[value] = member
            return member
        if isinstance(value, torch.Tensor):
            return self._tensor(value, path, top_key, depth)
        if isinstance(value, np.generic) and value.dtype.kind in _NUMPY_KINDS:
            return {"~": "n", "dt": value.dtype.str, "x": base64.b64encode(value.tobytes()).decode("ascii")}
        if kind is complex:
            return {"~": "c", "r": self.node(value.real, path, depth + 1), "i": self.node(value.imag, path, depth + 1)}
        if isinstance(value, torch.dtype) and value in _TORCH_DTYPE_NAMES:
            return {"~": "td", "v": _TORCH_DTYPE_NAMES[value]}
        if isinstance(value, np.dtype) and value.kind in _NUMPY_KINDS and value.fields is None:
            return {"~": "nd", "v": value.str}
        if kind is bytes:
            node: dict[str, Any] = {"~": "B"}
            self._add_buffer(node, memoryview(value))
            return node
        return self._fallback(value, path, "unsupported type")


def _is_dense_permutation(t: torch.Tensor) -> bool:
    """True if ``t`` covers its memory exactly once in some dimension order (a transposed/permuted view)."""
    expected = 1
    for d in sorted(range(t.dim()), key=lambda d: t.stride(d)):
        if t.shape[d] == 1:
            continue
        if t.stride(d) != expected:
            return False
        expected *= t.shape[d]
    return True


def encode(
    item: Any,
    *,
    allow_pickle: bool = False,
    downcast: bool = False,
    lossy: Mapping[str, torch.dtype] | None = None,
    exact: bool = False,
) -> Encoded:
    """Encode ``item`` as a header plus raw buffers (no copy of the tensor data is made).

    Args:
        item: a nested dict/list/tuple of MetaTensor, Tensor, ndarray, numbers, strings, enums and None.
        allow_pickle: store values of other types with pickle instead of raising. Readers must opt in too.
        downcast: store floating and wide integer tensors in the smallest dtype that holds every value
            exactly (restored bit for bit by :func:`decode`).
        lossy: ``{top-level key: dtype}``: store the tensors and arrays under that key of a dict item in
            ``dtype`` even when this loses precision (e.g. ``{"image": torch.float16}``).
        exact: refuse what a decode would not give back as pickling does (a tensor subclass other than
            MetaTensor, a tensor that requires grad, a view of part of its memory, tensors sharing memory):
            the DataLoader's batches must be the ones torch would deliver.

    Raises:
        UnsupportedValueError: naming the key path and type of a value that cannot be stored (or, with
            ``exact``, encoded exactly).
    """
    enc = _Encoder(allow_pickle, downcast, lossy, exact)
    root = enc.node(item, "item", 0)
    fields: dict[str, Any] = {"root": root, "buffers": [[o, b.nbytes] for o, b in zip(enc.offsets, enc.buffers)]}
    if enc.refs:
        fields["refs"] = True
    header = _header_json(fields)
    if len(header) > MAX_HEADER:
        raise UnsupportedValueError(
            f"cannot cache this item: its header (metadata and structure) takes {len(header)} bytes, more than "
            f"the {MAX_HEADER} a reader accepts. Store large values as tensors or arrays, not as Python lists."
        )
    data_offset = _align(PREFIX_SIZE + len(header))
    total = data_offset + (enc.size if enc.buffers else 0)
    out = Encoded(header, enc.buffers, enc.offsets, data_offset, total, enc.borrowed)
    out.keepalive = enc.keepalive
    out.tensors = enc.tensors
    if exact:
        out.objects = [(obj, enc.met[id(obj)]) for obj in enc.objects]
    return out


def _header_json(fields: dict) -> bytes:
    """The header's compact JSON. Its nodes hold only exact dicts with string keys, lists, strings, integers, finite
    floats, booleans and None (non-finite floats are tagged nodes), which orjson writes as JSON that reads back to
    the same values as the stdlib's (the text may differ: ``1e-5`` for ``1e-05``, UTF-8 for ``\\u`` escapes). What
    orjson refuses (an integer beyond 64 bits, a string with a lone surrogate) the stdlib writes."""
    if _orjson is not None:
        try:
            return _orjson.dumps(fields)  # type: ignore[no-any-return]
        except TypeError:  # orjson.JSONEncodeError
            pass
    return json.dumps(fields, separators=(",", ":"), allow_nan=False).encode()


def blob_identity(blob: memoryview | bytes | bytearray) -> memoryview:
    """The blob's total length and the checksums of its header and data (16 bytes of its prefix, a view: no
    copy): what tells one encoded item from another without reading it (the shared-memory index binds entries to
    it). Empty for a blob too short to have a prefix."""
    view = memoryview(blob)
    return view[24:40] if view.nbytes >= PREFIX_SIZE else view[:0]


def item_nbytes(item: Any, depth: int = 0) -> int:
    """Bytes of the tensors and arrays in ``item`` as they are in memory (a MetaTensor's data; not its metadata).

    Args:
        item: a nested dict/list/tuple of tensors, arrays and other values.
        depth: how deep the call is (nesting beyond 64 levels is not counted).
    """
    if isinstance(item, torch.Tensor):
        # not through MetaTensor.__torch_function__: two method calls there cost 4-9 us, the whole item's count
        # a quarter of a small item's encode
        with torch._C.DisableTorchFunctionSubclass():
            return item.element_size() * item.numel()
    if isinstance(item, np.ndarray):
        return int(item.nbytes)
    if depth > MAX_DEPTH:
        return 0
    if isinstance(item, Mapping):
        return sum(item_nbytes(v, depth + 1) for v in item.values())
    if isinstance(item, (list, tuple)):
        return sum(item_nbytes(v, depth + 1) for v in item)
    return 0


def _check_prefix(fields: tuple) -> None:
    """Check the unpacked fixed prefix of a blob (``_PREFIX`` fields)."""
    magic, version, flags, hlen, total, _crc, _ = fields
    if magic != MAGIC:
        raise CorruptEntryError("not a monai_cache entry (bad magic number)")
    if version != FORMAT_VERSION:
        raise CorruptEntryError(f"format version {version} is not supported (this monai_cache reads {FORMAT_VERSION})")
    if flags & ~_KNOWN_FLAGS:
        raise CorruptEntryError(f"unknown flags {flags:#x} in the entry prefix")
    if hlen > MAX_HEADER or PREFIX_SIZE + hlen > total:
        raise CorruptEntryError(f"header length {hlen} does not fit the entry")


_JSON = json.JSONDecoder()
_JSON_SCALARS = frozenset((type(None), bool, int, float, str))


class _Decoder:
    def __init__(self, data: memoryview, buffers: list, allow_pickle: bool, refs: bool = False) -> None:
        self.data = data
        self.buffers = buffers
        self.allow_pickle = allow_pickle
        self.table: list[Any] | None = [] if refs else None  # the numbered nodes' objects, if referred to

    def _bytes(self, node: dict) -> memoryview:
        if "x" in node:
            raw = node["x"]
            if not isinstance(raw, str):
                raise CorruptEntryError("inline buffer is not a string")
            try:
                return memoryview(bytearray(binascii.a2b_base64(raw, strict_mode=True)))
            except (ValueError, binascii.Error) as e:
                raise CorruptEntryError(f"bad inline buffer: {e}") from None
        idx = node.get("b")
        if type(idx) is not int or not 0 <= idx < len(self.buffers):
            raise CorruptEntryError(f"buffer index {idx!r} out of range")
        off, n = self.buffers[idx]
        return self.data[off : off + n]

    @staticmethod
    def _shape(node: dict) -> list[int]:
        shape = node.get("sh")
        if type(shape) is not list or len(shape) > 64:
            raise CorruptEntryError(f"bad shape {shape!r}")
        for s in shape:
            if type(s) is not int or s < 0:
                raise CorruptEntryError(f"bad shape {shape!r}")
        return shape

    def _tensor(self, node: dict) -> torch.Tensor:
        # The hit path of every cached tensor: kept flat (each call and lookup shows in reads of small items).
        try:
            dtype = _TORCH_DTYPES[node["dt"]]
        except (KeyError, TypeError):  # TypeError: not hashable (a list), so not a dtype name either
            raise CorruptEntryError(f"unknown torch dtype {node.get('dt')!r}") from None
        stored = dtype
        if "sd" in node:
            try:
                stored = _TORCH_DTYPES[node["sd"]]
            except (KeyError, TypeError):
                raise CorruptEntryError(f"unknown stored dtype {node['sd']!r}") from None
        shape = self._shape(node)
        perm = node.get("pm")
        if perm is not None:
            if not isinstance(perm, list) or sorted(perm) != list(range(len(shape))):
                raise CorruptEntryError(f"bad permutation {perm!r}")
            stored_shape = [shape[p] for p in perm]
        else:
            stored_shape = shape
        buf = self._bytes(node)
        numel = math.prod(stored_shape)
        if numel * stored.itemsize != buf.nbytes:
            raise CorruptEntryError(f"shape {shape} of {stored} needs {numel * stored.itemsize} B, not {buf.nbytes}")
        if numel == 0:
            t = torch.empty(stored_shape, dtype=stored)
        else:
            np_dtype = _NUMPY_OF_TORCH.get(stored)
            if np_dtype is not None:  # through numpy: about 3x cheaper than torch.frombuffer + view
                t = torch.from_numpy(np.ndarray(stored_shape, np_dtype, buf))
            else:  # bfloat16: no numpy dtype
                t = torch.frombuffer(buf, dtype=stored).view(stored_shape)
        if perm is not None:
            inverse = [0] * len(perm)
            for i, p in enumerate(perm):
                inverse[p] = i
            t = t.permute(inverse)
        if stored is not dtype:
            t = t.to(dtype)
        if "dev" in node:
            t = t.to(str(node["dev"]))
        if node["~"] == "M":
            from monai.data.meta_tensor import MetaTensor

            mt = t.as_subclass(MetaTensor)
            attrs = self.node(node.get("a"), 1)
            if not isinstance(attrs, dict):
                raise CorruptEntryError("MetaTensor attributes are not a dict")
            mt.__dict__.update(attrs)
            t = mt
        if self.table is not None:
            self.table.append(t)
        return t

    def _ndarray(self, node: dict) -> np.ndarray:
        # An array inlined in the header (a meta dict's: dozens per NIfTI image, mostly the same from one image to
        # the next) is decoded once per content and copied after that: the key, the lookup and the copy take about a
        # third of decoding it again (0.9 us against 3 us for an 8-element array).
        key = None
        inline, shape = node.get("x"), node.get("sh")
        if type(inline) is str and type(shape) is list and all(type(s) is int for s in shape):
            try:
                key = (inline, node.get("dt"), node.get("sd"), bool(node.get("F")), tuple(shape))
                known = _SMALL_ARRAYS.get(key)
            except TypeError:  # an unhashable dtype field: a damaged header, reported below
                key = known = None
            if known is not None:
                a = known.copy(order="K")
                if self.table is not None:
                    self.table.append(a)
                return a
        dtype = _numpy_dtype(node.get("dt"))
        stored = _numpy_dtype(node["sd"]) if "sd" in node else dtype
        shape = self._shape(node)
        buf = self._bytes(node)
        numel = math.prod(shape)
        if numel * stored.itemsize != buf.nbytes:
            raise CorruptEntryError(f"shape {shape} of {stored} needs {numel * stored.itemsize} B, not {buf.nbytes}")
        a = np.frombuffer(buf, dtype=stored, count=numel).reshape(tuple(shape), order="F" if node.get("F") else "C")
        if stored != dtype:
            a = a.astype(dtype, order="K")
        if key is not None:
            if len(_SMALL_ARRAYS) >= _MEMO_MAX:
                _SMALL_ARRAYS.clear()
            known = a.copy(order="K")
            known.flags.writeable = False
            _SMALL_ARRAYS[key] = known
        if self.table is not None:
            self.table.append(a)
        return a

    def node(self, node: Any, depth: int) -> Any:
        if depth > MAX_DEPTH + 8:
            raise CorruptEntryError("nesting too deep")
        kind = type(node)  # json.loads makes only these exact types
        if kind in _JSON_SCALARS:
            return node
        if kind is list:  # leaves are most of a meta dict: no call for them
            items = [v if type(v) in _JSON_SCALARS else self.node(v, depth + 1) for v in node]
            if self.table is not None:
                self.table.append(items)
            return items
        if kind is not dict:
            raise CorruptEntryError(f"unexpected header node {kind.__name__}")
        tag = node.get("~")
        if tag == "d":
            keys, values = node.get("k"), node.get("v")
            if not isinstance(keys, list) or not isinstance(values, list) or len(keys) != len(values):
                raise CorruptEntryError("malformed dict node")
            out = {}
            for k, v in zip(keys, values):
                key = k if type(k) is str else self.node(k, depth + 1)
                try:
                    out[key] = v if type(v) in _JSON_SCALARS else self.node(v, depth + 1)
                except TypeError:
                    raise CorruptEntryError(f"unhashable dict key of type {type(key).__name__}") from None
            if self.table is not None:
                self.table.append(out)
            return out
        if tag in ("T", "M"):
            return self._tensor(node)
        if tag == "N":
            return self._ndarray(node)
        if tag == "r":
            number = node.get("i")
            if self.table is None or type(number) is not int or not 0 <= number < len(self.table):
                raise CorruptEntryError(f"reference {number!r} to no earlier node")
            return self.table[number]
        if tag == "t":
            values = node.get("v")
            if not isinstance(values, list):
                raise CorruptEntryError("malformed tuple node")
            return tuple(self.node(v, depth + 1) for v in values)
        if tag == "f":
            special = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
            if node.get("v") not in special:
                raise CorruptEntryError(f"bad float {node.get('v')!r}")
            return special[node["v"]]
        if tag == "e":
            return _load_enum(node.get("c"), self.node(node.get("v"), depth + 1))
        if tag == "n":
            dtype = _numpy_dtype(node.get("dt"))
            raw = self._bytes(node)
            if raw.nbytes != dtype.itemsize:
                raise CorruptEntryError(f"bad numpy scalar of {dtype}")
            return np.frombuffer(raw, dtype=dtype)[0]
        if tag == "c":
            return complex(self.node(node.get("r"), depth + 1), self.node(node.get("i"), depth + 1))
        if tag == "td":
            dt = _TORCH_DTYPES.get(str(node.get("v")))
            if dt is None:
                raise CorruptEntryError(f"unknown torch dtype {node.get('v')!r}")
            return dt
        if tag == "nd":
            return _numpy_dtype(node.get("v"))
        if tag == "B":
            return bytes(self._bytes(node))
        if tag == "P":
            if not self.allow_pickle:
                raise CorruptEntryError("entry holds a pickled value and allow_pickle is False; it is not loaded")
            import pickle

            return pickle.loads(self._bytes(node))  # explicit opt-in
        raise CorruptEntryError(f"unknown node tag {tag!r}")


_numpy_dtypes: dict[str, np.dtype] = {}


def _numpy_dtype(spec: Any) -> np.dtype:
    """A plain numeric numpy dtype from its string (cached: meta dicts hold dozens of small arrays)."""
    dt = _numpy_dtypes.get(spec) if isinstance(spec, str) else None
    if dt is not None:
        return dt
    try:
        dt = np.dtype(spec) if isinstance(spec, str) else None
    except (TypeError, ValueError):
        dt = None
    if dt is None or dt.kind not in _NUMPY_KINDS or dt.fields is not None or dt.subdtype is not None:
        raise CorruptEntryError(f"numpy dtype {spec!r} is not allowed")
    if len(_numpy_dtypes) < 256:
        _numpy_dtypes[spec] = dt
    return dt


_enum_classes: dict[str, type] = {}


_enum_members: dict[tuple[str, Any], enum.Enum] = {}  # (class spec, value) -> member: meta dicts repeat a few


def _load_enum(spec: Any, value: Any) -> enum.Enum:
    if type(spec) is str and type(value) in (str, int):
        member = _enum_members.get((spec, value))
        if member is not None:
            return member
    cls = _enum_classes.get(spec) if isinstance(spec, str) else None
    if cls is None:
        cls = _find_enum(spec)
        _enum_classes[spec] = cls
    try:
        member = cls(value)
    except ValueError:
        raise CorruptEntryError(f"{value!r} is not a member of {spec}") from None
    if type(value) in (str, int) and len(_enum_members) < 1024:
        _enum_members[(spec, value)] = member
    return member


def _find_enum(spec: Any) -> type:
    if not isinstance(spec, str) or ":" not in spec:
        raise CorruptEntryError(f"bad enum class {spec!r}")
    module, qualname = spec.split(":", 1)
    # Only enums of MONAI (or already imported modules) are loaded: importing arbitrary modules runs code.
    if module not in sys.modules and not (module == "monai" or module.startswith("monai.")):
        raise CorruptEntryError(f"enum class {spec} is from a module that is not loaded")
    try:
        obj: Any = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError):
        raise CorruptEntryError(f"enum class {spec} not found") from None
    if not (isinstance(obj, type) and issubclass(obj, enum.Enum)):
        raise CorruptEntryError(f"{spec} is not an enum")
    return obj


def decode(blob: memoryview | bytes | bytearray, *, allow_pickle: bool = False, verify: bool = False) -> Any:
    """Decode a blob produced by :func:`encode`.

    Tensors and arrays are views into ``blob`` (zero-copy) unless their stored dtype differs. Pass a
    writable buffer (a ``bytearray`` or a copy-on-write ``mmap``) so that in-place writes by later
    transforms are allowed and never reach the underlying store.

    Args:
        blob: the encoded bytes.
        allow_pickle: load values that were stored with pickle. Off by default: a blob that holds a
            pickled value then raises :class:`CorruptEntryError`.
        verify: also check the CRC-32 of the buffers' bytes (the header is always checked). Costs a pass
            over the data (about 1 ms per MB). Blobs written without one (disk entries, whose file or pack
            record carries a CRC-32 of the whole blob) have nothing more to check.

    Raises:
        CorruptEntryError: the blob is truncated, damaged, foreign, or asks for something not allowed.
    """
    buf = memoryview(blob).cast("B")
    if buf.nbytes < PREFIX_SIZE:
        raise CorruptEntryError(f"truncated: {buf.nbytes} bytes, shorter than the {PREFIX_SIZE}-byte prefix")
    fields = _PREFIX.unpack_from(buf, 0)
    _check_prefix(fields)
    _magic, _version, flags, hlen, total, header_crc, data_crc = fields
    if total != buf.nbytes:
        raise CorruptEntryError(f"entry claims {total} bytes but has {buf.nbytes}")
    raw_header = buf[PREFIX_SIZE : PREFIX_SIZE + hlen]
    if zlib.crc32(raw_header) != header_crc:
        raise CorruptEntryError("header checksum mismatch")
    try:
        text = str(raw_header, "utf-8")
        header, end = _JSON.raw_decode(text)  # json.loads without its encoding sniffing and wrappers
        if end != len(text):
            raise ValueError(f"extra data at character {end}")
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise CorruptEntryError(f"header is not valid JSON: {e}") from None
    if not isinstance(header, dict) or "root" not in header or not isinstance(header.get("buffers"), list):
        raise CorruptEntryError("header lacks root/buffers")
    data_offset = _align(PREFIX_SIZE + hlen)
    data = buf[data_offset:] if data_offset <= total else buf[total:]
    spans = []
    size = data.nbytes
    for span in header["buffers"]:
        if type(span) is not list or len(span) != 2:
            raise CorruptEntryError(f"buffer span {span!r} outside the entry")
        off, n = span
        if type(off) is not int or type(n) is not int or off < 0 or n < 0 or off + n > size:
            raise CorruptEntryError(f"buffer span {span!r} outside the entry")
        spans.append((off, n))
    end = 0
    for off, n in sorted(spans) if len(spans) > 1 else spans:
        if off < end:
            raise CorruptEntryError("overlapping buffers")
        end = off + n
    if verify and not flags & FLAG_NO_DATA_CRC:
        crc = 0
        for off, n in spans:
            crc = zlib.crc32(data[off : off + n], crc)
        if crc != data_crc:
            raise CorruptEntryError("data checksum mismatch")
    try:
        return _Decoder(data, spans, allow_pickle, header.get("refs") is True).node(header["root"], 0)
    except CorruptEntryError:
        raise
    except RecursionError:
        raise CorruptEntryError("nesting too deep") from None
    except Exception as e:  # a crafted header reaching torch/numpy with values they refuse: still just corrupt
        raise CorruptEntryError(f"undecodable entry ({type(e).__name__}: {e})") from None
