"""Material for fuzzing the decoders: diverse real items, blob (re)assembly with valid checksums, a deep
comparison, and a pickle payload that leaves a marker file if it ever runs."""

from __future__ import annotations

import json
import math
import pickle
import struct
import zlib
from typing import Any

import numpy as np
import torch

from monai_cache import codec

PREFIX = struct.Struct("<8sIIQQII")


# ------------------------------------------------------------------------------------------- items
def sample_items() -> list[Any]:
    """Items covering every node type of the codec (tensors of several dtypes, a permuted view, Fortran
    arrays, a MetaTensor with metadata, enums, non-finite floats, complex, bytes, numpy scalars, dtypes)."""
    from monai.data import MetaTensor
    from monai.utils.enums import SpaceKeys

    meta = MetaTensor(torch.arange(24, dtype=torch.float32).reshape(2, 3, 4),
                      meta={"filename_or_obj": "case0.nii.gz", "spacing": np.array([1.0, 1.5, 2.0]), "space": "RAS"})
    return [
        {"image": torch.arange(64, dtype=torch.float32).reshape(4, 4, 4), "label": torch.ones(2, 3, dtype=torch.uint8)},
        {"image": meta, "space": SpaceKeys.RAS, "case": 3},
        [np.asfortranarray(np.arange(300, dtype=np.int16).reshape(10, 30)), np.float64(2.5), (1, "x", None)],
        {"t": torch.arange(600.0).reshape(10, 60).t(), "b": bytes(range(256)) * 2, "c": 1.5 + 2j,
         "f": [1.5, math.inf, -math.inf], "dt": torch.float16, "nd": np.dtype("<i4")},
        {"big": torch.linspace(0, 1, 5000, dtype=torch.float64), "half": torch.ones(300, dtype=torch.bfloat16),
         "flags": torch.tensor([True, False] * 200)},
    ]


def deep_equal(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        if hasattr(a, "meta") and not deep_equal(dict(a.meta), dict(b.meta)):
            return False
        return bool(torch.equal(a.as_subclass(torch.Tensor), b.as_subclass(torch.Tensor)))
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and bool(np.array_equal(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(deep_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(deep_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    return bool(a == b)


def structure_equal(a: Any, b: Any) -> bool:
    """Equal except for the contents of buffers (tensors, arrays, long bytes values): what damage to the data
    area can change when it is not checksummed on read."""
    if type(a) is not type(b):
        return False
    if isinstance(a, bytes):
        return len(a) == len(b)
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(structure_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(structure_equal(x, y) for x, y in zip(a, b))
    return deep_equal(a, b)


def nbytes(value: Any, depth: int = 0) -> int:
    if isinstance(value, torch.Tensor):
        return 0 if value.device.type == "meta" else value.element_size() * value.numel()
    if isinstance(value, np.ndarray):
        return int(value.nbytes)
    if isinstance(value, (bytes, str)):
        return len(value)
    if depth > 200:
        return 0
    if isinstance(value, dict):
        return sum(nbytes(k, depth + 1) + nbytes(v, depth + 1) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return sum(nbytes(v, depth + 1) for v in value)
    return 0


# -------------------------------------------------------------------------------------------- blobs
def assemble(header: bytes, data: bytes, fix_data_crc: bool = True, spans: Any = None) -> bytes:
    """A codec blob with this header text and data area, with a valid prefix (lengths and checksums)."""
    data_offset = (codec.PREFIX_SIZE + len(header) + codec.ALIGN - 1) // codec.ALIGN * codec.ALIGN
    total = data_offset + len(data)
    crc = 0
    if fix_data_crc and isinstance(spans, list):
        for span in spans:
            if isinstance(span, list) and len(span) == 2 and all(type(v) is int and v >= 0 for v in span):
                crc = zlib.crc32(data[span[0] : span[0] + span[1]], crc)
    prefix = PREFIX.pack(codec.MAGIC, codec.FORMAT_VERSION, 0, len(header), total, zlib.crc32(header), crc)
    return prefix + header + bytes(data_offset - codec.PREFIX_SIZE - len(header)) + data


def split(blob: bytes) -> tuple[bytes, bytes]:
    """(header text, data area) of a valid blob."""
    hlen = PREFIX.unpack_from(blob)[3]
    data_offset = (codec.PREFIX_SIZE + hlen + codec.ALIGN - 1) // codec.ALIGN * codec.ALIGN
    return blob[codec.PREFIX_SIZE : codec.PREFIX_SIZE + hlen], blob[data_offset:]


def blob_of(root: Any, buffers: Any = (), data: bytes = b"") -> bytes:
    header = json.dumps({"root": root, "buffers": list(buffers)}, separators=(",", ":")).encode()
    return assemble(header, data, spans=list(buffers))


# ------------------------------------------------------------------------------------------- payload
class Payload:
    """Unpickling this runs code: it creates ``marker``. Used to prove that nothing ever unpickles."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (exec, (f"open({self.marker!r}, 'w').close()",))


def payload_pickle(marker: str) -> bytes:
    return pickle.dumps({"image": Payload(marker)}, protocol=pickle.HIGHEST_PROTOCOL)
