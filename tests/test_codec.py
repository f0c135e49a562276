"""The codec: cached items to a header plus raw buffers and back, exactly, without pickle."""

from __future__ import annotations

import enum
import json
import os
import pickle
import struct
import sys
import zlib

import numpy as np
import pytest
import torch
from helpers import assert_same, bits
from hypothesis import given, settings
from hypothesis import strategies as st
from monai.data import MetaTensor
from monai.utils.enums import MetaKeys, SpaceKeys, TraceKeys

from monai_cache import codec
from monai_cache import downcast as downcast_module
from monai_cache.codec import ALIGN, FORMAT_VERSION, MAGIC, CorruptEntryError, UnsupportedValueError, decode, encode


def roundtrip(item, **kw):
    enc = encode(item, **kw)
    blob = enc.to_bytes()
    assert len(blob) == enc.nbytes
    assert b"".join(bytes(c) for c in enc.chunks()) == bytes(blob)
    return decode(blob, allow_pickle=kw.get("allow_pickle", False))


def test_real_monai_chain_item_roundtrips_exactly(volumes):
    from helpers import chain

    item = chain(crop=None)(volumes[0])
    assert isinstance(item["image"], MetaTensor) and len(item["image"].applied_operations) >= 2
    out = roundtrip(item)
    assert_same(item, out)
    # keys stay MONAI's enums, and the metadata behaves as MetaTensor metadata
    assert isinstance(next(k for k in out["image"].meta if k == "affine"), MetaKeys)
    assert out["image"].meta[MetaKeys.SPACE] is SpaceKeys.RAS
    assert isinstance(next(iter(out["image"].applied_operations[0])), TraceKeys)
    assert torch.equal(out["image"].affine, item["image"].affine)
    assert torch.equal(out["image"].pixdim, item["image"].pixdim)


def test_metatensor_attributes_batch_and_pending_ops():
    t = MetaTensor(torch.arange(24.0).reshape(2, 3, 4), affine=torch.eye(4) * 2, meta={"x": 1})
    t.is_batch = True
    t.push_applied_operation({"class": "Foo", "extra_info": {"m": torch.ones(3)}})
    t.push_pending_operation({"lazy": True})
    out = roundtrip({"img": t})
    assert_same({"img": t}, out)
    assert out["img"].is_batch is True
    assert out["img"].pending_operations == [{"lazy": True}]


def test_buffers_are_aligned_and_zero_copy():
    big = torch.arange(10_000, dtype=torch.float32)
    enc = encode({"a": big, "b": np.arange(1000, dtype=np.int64)})
    assert enc.data_offset % ALIGN == 0 and all(o % ALIGN == 0 for o in enc.offsets)
    blob = enc.to_bytes()
    out = decode(blob)
    # the decoded tensor is a view of the blob, not a copy
    out["a"][0] = 42.0
    assert np.frombuffer(blob, np.float32, count=1, offset=enc.data_offset + enc.offsets[0])[0] == 42.0


@pytest.mark.parametrize("make", [
    lambda: torch.arange(60.0).reshape(3, 4, 5).permute(2, 0, 1),  # permuted view: strides kept
    lambda: torch.arange(60.0).reshape(3, 4, 5).transpose(0, 2),
    lambda: torch.arange(60.0).reshape(3, 4, 5)[:, 1:3],  # non-dense slice: stored contiguous
    lambda: torch.zeros(0, 3),
    lambda: torch.tensor(3.5),
    lambda: torch.tensor([True, False]),
    lambda: torch.randn(4, 4, dtype=torch.float64).to(torch.bfloat16),
    lambda: torch.randn(3, dtype=torch.complex64),
    lambda: np.asfortranarray(np.arange(12.0).reshape(3, 4)),
    lambda: np.arange(6, dtype=">i4"),
    lambda: np.float32(1.5),
    lambda: np.int64(-7),
    lambda: np.bool_(True),
])
def test_tensor_and_array_kinds(make):
    value = make()
    out = roundtrip({"v": value})["v"]
    if isinstance(value, torch.Tensor) and not value.is_contiguous() and value.shape == (3, 2, 5):
        assert out.is_contiguous()  # a non-dense slice comes back contiguous, values equal
        assert torch.equal(out, value)
    else:
        assert_same({"v": value}, {"v": out})


@settings(max_examples=120, deadline=None)
@given(
    st.sampled_from(["<f4", ">f4", "<f8", ">f8", "<i2", ">i2", "|u1", "|b1", "<c8", ">i8", "<u4"]),
    st.lists(st.integers(0, 9), min_size=0, max_size=3),
    st.sampled_from(["C", "F", "strided"]),
    st.integers(0, 2**31),
)
def test_arrays_either_side_of_the_inline_limit_roundtrip_exactly(dtype, shape, layout, seed):
    # Arrays up to INLINE_LIMIT bytes go into the header (a NIfTI meta dict holds dozens) by a path of their own;
    # larger ones become buffers. Either way: the same dtype (byte order included), shape, memory order and values.
    a = np.random.default_rng(seed).integers(-100, 100, size=[2 * n if layout == "strided" else n for n in shape])
    a = a.astype(dtype)
    if layout == "strided" and shape:  # (a[()] of a 0-d array is a scalar, not a view)
        a = a[tuple(slice(None, None, 2) for _ in shape)]
    elif layout == "F":
        a = np.asfortranarray(a)
    out = roundtrip({"meta": {"a": a}})["meta"]["a"]
    assert type(out) is np.ndarray and out.dtype == a.dtype and out.shape == a.shape
    assert np.array_equal(out, a)
    if a.ndim > 1 and a.flags.f_contiguous and not a.flags.c_contiguous:
        assert out.flags.f_contiguous  # Fortran order is kept
    # the header holds the bytes inline exactly when they fit under the limit
    header = json.loads(encode({"a": a}).header)
    assert ("x" in header["root"]["v"][0]) == (a.nbytes <= codec.INLINE_LIMIT)


def test_small_arrays_decoded_again_are_private_writable_copies():
    # Inline arrays are decoded once per content and copied after that (meta dicts repeat them from one item to
    # the next): each decode must still hand out arrays of its own, writable, in their own memory order.
    meta = {"dim": np.arange(8, dtype="<i2"), "pixdim": np.float32(0.8) * np.ones(8, ">f4"), "zero_d": np.ones(()),
            "srow": np.asfortranarray(np.arange(12.0).reshape(3, 4))}
    blob = bytes(encode({"meta": meta}).to_bytes())
    first, second = (decode(memoryview(bytearray(blob)))["meta"] for _ in range(2))
    for key, want in meta.items():
        a, b = first[key], second[key]
        assert a.dtype == want.dtype and a.shape == want.shape and np.array_equal(a, want) and np.array_equal(b, want)
        assert a.flags.writeable and b.flags.writeable and not np.shares_memory(a, b), key
        assert b.flags.f_contiguous == want.flags.f_contiguous and b.flags.c_contiguous == want.flags.c_contiguous
        a[...] = 7  # a transform writing into one item's meta...
    third = decode(memoryview(bytearray(blob)))["meta"]
    for key, want in meta.items():
        assert np.array_equal(second[key], want) and np.array_equal(third[key], want), key  # ...changes no other


def test_small_tensors_and_enum_keys_encoded_from_the_memo_are_each_their_own():
    # A meta dict's affine and MONAI's enum keys are encoded once per content and reused item after item: tensors
    # of the same bytes but another shape or dtype, one that requires grad, and a transposed one stay what they were.
    raw = torch.arange(16, dtype=torch.float64)
    pieces = {
        "aff": raw.reshape(4, 4), "flat": raw.clone(), "as_int": raw.view(torch.int64).reshape(4, 4),
        "grad": raw.reshape(4, 4).clone().requires_grad_(), "transposed": raw.reshape(4, 4).t(),
        MetaKeys.AFFINE: "enum key", "again": raw.reshape(4, 4),
    }
    for _ in range(2):  # the second pass comes from the memo
        item = {k: (v.detach().clone().requires_grad_() if k == "grad" else v) for k, v in pieces.items()}
        out = decode(memoryview(bytearray(encode(item).to_bytes())))
        assert list(out) == list(item) and isinstance(list(out)[5], MetaKeys)
        for key, want in item.items():
            got = out[key]
            if isinstance(want, torch.Tensor):
                want = want.detach()
                assert got.dtype == want.dtype and got.shape == want.shape and got.stride() == want.stride(), key
                assert torch.equal(got, want), key
            else:
                assert got == want
        out["aff"][0, 0] = 99  # each decode has tensors of its own
        assert pieces["aff"][0, 0] == 0


class Color(enum.Enum):
    RED = "red"


scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True), st.text(max_size=20),
    st.complex_numbers(allow_nan=False), st.binary(max_size=300),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.tuples(inner, inner),
        st.dictionaries(st.one_of(st.text(max_size=8), st.integers()), inner, max_size=4),
    ),
    max_leaves=20,
)


@settings(max_examples=150, deadline=None)
@given(values)
def test_nested_python_values_roundtrip(value):
    assert_same(value, roundtrip(value))


# numbers whose text differs between JSON writers (exponents, the shortest digits, the extremes), and strings to escape
AWKWARD_SCALARS = [1e-05, 1e16, 0.1, -0.0, 5e-324, 1.7976931348623157e308, 2**63 - 1, -(2**63), 2**64 - 1,
                   "é ✓ 🙂", "\"\\\n\t\x00\x7f"]  # fmt: skip


def test_headers_from_the_compiled_json_writer_read_as_the_stdlib_writers(monkeypatch):
    meta = MetaTensor(torch.ones(1, 4, 4), meta={"filename_or_obj": "ü.png", MetaKeys.SPATIAL_SHAPE: np.array([4, 4])})
    item = {"x": AWKWARD_SCALARS, "image": meta, "nan": float("nan")}
    assert codec._orjson is not None  # a dependency: small items' encode relies on it (docs/benchmarks-cache.md)
    compiled = encode(item).header
    monkeypatch.setattr(codec, "_orjson", None)
    stdlib = encode(item).header
    assert compiled != stdlib  # two writers, each used
    assert json.loads(compiled) == json.loads(stdlib)
    assert_same(roundtrip(item), item)


@pytest.mark.parametrize("value", [2**64, -(2**63) - 1, 10**40, "lone \ud800 surrogate", {"k": [2**70, "\udfff"]}])
def test_values_the_compiled_json_writer_refuses_are_written_by_the_stdlibs(value):
    assert_same(roundtrip({"v": value}), {"v": value})


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from([torch.float32, torch.float64, torch.int64, torch.int32, torch.int16, torch.uint8]),
    st.lists(st.integers(1, 5), min_size=0, max_size=4),
    st.integers(0, 2**31),
)
def test_tensors_roundtrip_with_lossless_downcast_bit_for_bit(dtype, shape, seed):
    g = torch.Generator().manual_seed(seed)
    low = 0 if dtype == torch.uint8 else -300
    t = torch.randint(low, 255, shape, generator=g).to(dtype)
    if dtype.is_floating_point and seed % 2:
        t = t / 7  # non-integral floats must not be squeezed into integers
    if dtype.is_floating_point and seed % 3 == 0 and t.numel():
        t.view(-1)[0] = -0.0  # negative zero must survive bit for bit
    out = roundtrip({"t": t}, downcast=True)["t"]
    assert out.dtype == t.dtype and out.shape == t.shape
    assert torch.equal(bits(out), bits(t))


WIDE_DTYPES = [
    torch.uint16, torch.uint32, torch.uint64, torch.int16, torch.int32, torch.int64,
    torch.float16, torch.bfloat16, torch.float32, torch.float64,
]


@pytest.mark.parametrize("dtype", WIDE_DTYPES)
@pytest.mark.parametrize("high", [200, 2000, 60000])
def test_downcast_of_every_wide_dtype_above_the_size_threshold(dtype, high):
    """Large enough to be checked (the property test above stays under DOWNCAST_MIN_BYTES)."""
    t = torch.randint(0, high, (64, 96), generator=torch.Generator().manual_seed(high)).to(dtype)
    enc = encode({"t": t}, downcast=True)
    out = decode(enc.to_bytes())["t"]
    assert out.dtype == t.dtype and torch.equal(bits(out), bits(t))
    stored = json.loads(enc.header)["root"]["v"][0].get("sd")
    if high == 200:
        assert stored == "uint8"
    elif high == 2000 and dtype.itemsize > 2 and dtype != torch.bfloat16:  # bfloat16 rounds 2000-range values
        assert stored == "int16"


@pytest.mark.parametrize("dtype", ["<u2", ">u2", "<u4", "<u8", ">i4", ">f8", "<f2", np.longdouble])
def test_numpy_arrays_of_every_byte_order_and_width_roundtrip(dtype):
    a = (np.arange(5000) % 300).astype(dtype)
    for downcast in (False, True):
        out = roundtrip({"a": a}, downcast=downcast)["a"]
        assert out.dtype == a.dtype and np.array_equal(out, a), (dtype, downcast)
    out = roundtrip({"a": a[:7]})["a"]  # small, stored inline
    assert out.dtype == a.dtype and np.array_equal(out, a[:7])


def test_tensors_without_dense_bytes_are_refused_clearly_and_lazy_views_resolved():
    for value, what in (
        (torch.eye(3).to_sparse(), "sparse"),
        (torch.empty(3, device="meta"), "meta-device"),
    ):
        with pytest.raises(UnsupportedValueError, match=rf"item\['x'\]: a {what} tensor"):
            encode({"x": value})
    out = roundtrip({"x": torch.eye(3).to_sparse()}, allow_pickle=True)["x"]
    assert torch.equal(out.to_dense(), torch.eye(3))
    z = torch.complex(torch.arange(3000.0), torch.ones(3000))
    for lazy in (z.conj(), z.conj().imag):  # a conjugate view, and a negative view of its imaginary part
        out = roundtrip({"x": lazy})["x"]
        assert torch.equal(out, lazy.resolve_conj().resolve_neg()) and not out.is_conj() and not out.is_neg()


def test_enum_defined_in_a_function_is_refused_when_encoding():
    """Decoding finds enum classes by module and name; one defined in a function could never be read back."""

    class Local(enum.Enum):
        A = 1

    with pytest.raises(UnsupportedValueError, match=r"item\['mode'\]: enum .*<locals>.Local is defined inside a"):
        encode({"mode": Local.A})


def test_header_over_the_readers_limit_is_refused_when_encoding(monkeypatch):
    import monai_cache.codec as codec

    monkeypatch.setattr(codec, "MAX_HEADER", 1000)
    with pytest.raises(UnsupportedValueError, match="header"):
        encode({"spacing": list(range(1000))})
    encode({"spacing": list(range(100))})


def test_downcast_stores_small_types():
    labels = torch.randint(0, 3, (32, 32, 32)).float()
    ct = torch.randint(-1024, 3000, (32, 32, 32)).float()
    plain = encode({"l": labels, "c": ct}).nbytes
    small = encode({"l": labels, "c": ct}, downcast=True)
    header = json.loads(small.header)
    stored = [n["sd"] for n in header["root"]["v"]]
    assert stored == ["uint8", "int16"]
    assert small.nbytes < plain * 0.4


@pytest.mark.parametrize(
    "spoil, stored",
    [(None, "int16"), (0.5, "float16"), (-0.0, "float16"), (float("nan"), None), (float("inf"), "float16"),
     (40000.0, "float16"), (1e-30, None)],
)
def test_lossless_check_looks_at_every_piece_of_a_large_tensor(monkeypatch, spoil, stored):
    """The check runs piecewise (bounded temporaries); a value that forbids a dtype in the *last* piece counts."""
    monkeypatch.setattr(downcast_module, "_CHECK_CHUNK", 1000)
    t = torch.randint(-1000, 1000, (4, 2501)).float()  # 10,004 values: 11 pieces, the last one of 4 values
    if spoil is not None:
        t.view(-1)[-1] = spoil
    header = json.loads(encode({"t": t}, downcast=True).header)
    assert header["root"]["v"][0].get("sd") == stored
    out = roundtrip({"t": t}, downcast=True)["t"]
    assert torch.equal(bits(out), bits(t))


def _reference_target(t: torch.Tensor) -> torch.dtype | None:
    """The slow, whole-tensor definition of the lossless target: the first smaller dtype that round-trips."""
    order = [torch.uint8, torch.int8, torch.int16, torch.int32]
    if t.dtype.is_floating_point:
        order += [torch.float16, torch.bfloat16]
    elif t.dtype in (torch.uint8, torch.int8, torch.bool):
        return None
    for cand in order:
        if cand.itemsize < t.dtype.itemsize and torch.equal(bits(t.to(cand).to(t.dtype)), bits(t)):
            return cand
    return None


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64,
                                   torch.int32, torch.int16])
@pytest.mark.parametrize("kind", ["labels", "ct", "wide", "half", "fraction", "spoiled"])
def test_lossless_target_matches_the_whole_tensor_definition(monkeypatch, dtype, kind):
    """Probe, pieces, numpy casts: the chosen dtype is the first smaller one through which every value survives
    a round trip with torch, bit for bit (what the decoder does), and the round trip is exact."""
    monkeypatch.setattr(downcast_module, "_CHECK_CHUNK", 1000)
    g = torch.Generator().manual_seed(hash((str(dtype), kind)) % 2**31)
    n = 7001
    t = {
        "labels": torch.randint(0, 3, (n,), generator=g).double(),
        "ct": torch.randint(-1024, 3000, (n,), generator=g).double(),
        "wide": torch.randint(-70000, 70000, (n,), generator=g).double(),
        "half": torch.randint(-2048, 2048, (n,), generator=g).double() / 8,
        "fraction": torch.rand(n, generator=g, dtype=torch.float64),
        "spoiled": torch.randint(0, 3, (n,), generator=g).double(),
    }[kind]
    if kind == "spoiled":  # one bad value where the probe does not look (index 1 is not a multiple of 61)
        t[1] = -0.0 if dtype.is_floating_point else -1
    t = t.to(dtype)
    if kind == "spoiled" and dtype.is_floating_point:
        assert bits(t[1:2]).tolist() != bits(torch.zeros(1, dtype=dtype)).tolist()
    header = json.loads(encode({"t": t}, downcast=True).header)
    expected = _reference_target(t)
    assert header["root"]["v"][0].get("sd") == (None if expected is None else str(expected).split(".")[1])
    assert torch.equal(bits(roundtrip({"t": t}, downcast=True)["t"]), bits(t))
    if dtype not in (torch.bfloat16,):  # numpy arrays take the same decision
        a = t.numpy()
        out = roundtrip({"a": a}, downcast=True)["a"]
        assert out.dtype == a.dtype and out.tobytes() == a.tobytes()


@pytest.mark.parametrize("order", ["C", "F"])
def test_numpy_arrays_are_downcast_in_their_storage_order(order):
    a = np.array(np.arange(3600).reshape(60, 60) % 2000 - 300, dtype=np.float64, order=order)
    a[7, 3] = -0.0 if order == "C" else 5.0  # -0.0 forbids integers: float16 then (exact for these values)
    node = json.loads(encode({"a": a}, downcast=True).header)["root"]["v"][0]
    assert node["sd"] == ("<f2" if order == "C" else "<i2") and node.get("F", False) == (order == "F")
    out = roundtrip({"a": a}, downcast=True)["a"]
    assert out.dtype == a.dtype and out.flags.f_contiguous == (order == "F") and out.tobytes("A") == a.tobytes("A")


def test_detach_copies_only_the_items_own_memory():
    """A detached encoding survives in-place changes to the item; buffers the encoder made are not copied."""
    image = torch.rand(1, 40, 40, 8)
    label = (image > 0.5).float()
    array = np.arange(4096, dtype=np.float32) / 3
    item = {"image": image, "label": label, "array": array, "t": torch.rand(64, 32).T}
    enc = encode(item, downcast=True)
    assert enc.borrowed == [True, False, True, True]  # the label was downcast to uint8: a new buffer
    detached = enc.detach()
    assert detached.buffers[1] is enc.buffers[1]
    expected = decode(enc.to_bytes())
    image.fill_(7)
    array[:] = 0
    item["t"].zero_()
    assert_same(decode(detached.to_bytes()), expected)
    assert not torch.equal(decode(enc.to_bytes())["image"], expected["image"])  # the undetached one changed


def test_disk_blobs_record_no_data_crc_and_unknown_flags_are_refused():
    item = {"x": torch.rand(100, 100)}
    enc = encode(item)
    blob = b"".join(bytes(c) for c in enc.chunks(data_crc=False))
    flags, dcrc = struct.unpack_from("<8sIIQQII", blob)[2], struct.unpack_from("<8sIIQQII", blob)[6]
    assert (flags, dcrc) == (codec.FLAG_NO_DATA_CRC, 0)
    assert torch.equal(decode(bytearray(blob), verify=True)["x"], item["x"])  # nothing more to verify: not an error
    with_crc = enc.to_bytes()
    with_crc[-1] ^= 1
    with pytest.raises(CorruptEntryError, match="data checksum"):
        decode(with_crc, verify=True)
    odd = bytearray(blob)
    struct.pack_into("<I", odd, 12, 6)
    with pytest.raises(CorruptEntryError, match="unknown flags"):
        decode(odd)


def test_lossy_per_key_is_explicit():
    img = torch.rand(16, 16) * 100
    enc = encode({"image": img, "label": img.clone()}, lossy={"image": torch.float16})
    out = decode(enc.to_bytes())
    assert out["image"].dtype == torch.float32
    assert torch.allclose(out["image"], img, rtol=1e-3) and not torch.equal(out["image"], img)
    assert torch.equal(out["label"], img)  # other keys untouched


class Opaque:
    pass


def test_unsupported_value_names_key_path_and_type():
    item = {"image": MetaTensor(torch.zeros(2), meta={"bad": [1, Opaque()]})}
    with pytest.raises(UnsupportedValueError) as e:
        encode(item)
    msg = str(e.value)
    assert "item['image'].meta['bad'][1]" in msg and "Opaque" in msg and "allow_pickle=True" in msg


def test_pickle_only_on_explicit_opt_in():
    value = {"obj": Color.RED, "other": Opaque()}
    with pytest.raises(UnsupportedValueError):
        encode({"o": Opaque()})
    blob = encode(value, allow_pickle=True).to_bytes()
    with pytest.raises(CorruptEntryError, match="allow_pickle"):
        decode(blob)
    out = decode(blob, allow_pickle=True)
    assert isinstance(out["other"], Opaque) and out["obj"] is Color.RED


def make_blob(root, buffers=(), data=b"", header=None):
    """A well-formed blob around a hand-written header (to reach the decoder's checks past the checksum)."""
    header = header or json.dumps({"root": root, "buffers": list(buffers)}).encode()
    data_offset = (40 + len(header) + ALIGN - 1) // ALIGN * ALIGN
    total = data_offset + len(data)
    prefix = struct.pack("<8sIIQQII", MAGIC, FORMAT_VERSION, 0, len(header), total, zlib.crc32(header), 0)
    return prefix + header + bytes(data_offset - 40 - len(header)) + data


def test_enum_from_unloaded_module_is_refused():
    assert decode(make_blob({"~": "e", "c": "monai.utils.enums:SpaceKeys", "v": "RAS"})) is SpaceKeys.RAS
    with pytest.raises(CorruptEntryError, match="not loaded"):
        decode(make_blob({"~": "e", "c": "evil_mod_xyz.enums:Color", "v": "red"}))
    assert "evil_mod_xyz" not in sys.modules
    with pytest.raises(CorruptEntryError, match="not an enum"):
        decode(make_blob({"~": "e", "c": "os:system", "v": "true"}))


@pytest.mark.parametrize("root, buffers, data", [
    ({"~": "T", "dt": "float32", "sh": [10**12], "b": 0}, [[0, 16]], bytes(64)),  # huge claimed shape
    ({"~": "T", "dt": "float32", "sh": [4], "b": 0}, [[-64, 16]], bytes(64)),  # negative offset
    ({"~": "T", "dt": "float32", "sh": [4], "b": 0}, [[0, 16], [8, 16]], bytes(64)),  # overlapping
    ({"~": "T", "dt": "float32", "sh": [4], "b": 3}, [[0, 16]], bytes(64)),  # buffer index out of range
    ({"~": "T", "dt": "object", "sh": [4], "b": 0}, [[0, 16]], bytes(64)),  # unknown dtype
    ({"~": "N", "dt": "|O", "sh": [2], "b": 0}, [[0, 16]], bytes(64)),  # numpy object arrays
    ({"~": "T", "dt": "float32", "sh": [-4], "b": 0}, [[0, 16]], bytes(64)),
    ({"~": "zz"}, [], b""),
    ({"~": "d", "k": [[1]], "v": [1]}, [], b""),  # unhashable key
])
def test_decoder_rejects_hostile_headers(root, buffers, data):
    with pytest.raises(CorruptEntryError):
        decode(make_blob(root, buffers, data))


@pytest.mark.parametrize("header, why", [
    (b'{"root":1,"buffers":[]} {"root":2}', "not valid JSON"),  # a second document after the first
    (b'{"root":1,"buffers":[]}x', "not valid JSON"),
    (b'{"root":"\xff\xfe","buffers":[]}', "not valid JSON"),  # not UTF-8
    (b' {"root":1,"buffers":[]}', "not valid JSON"),  # our encoder writes no whitespace
    (b'[1,2]', "lacks root/buffers"),
    (b'{"root":1,"buffers":[[true,0]]}', "outside the entry"),  # a bool is not an offset
    (b'{"root":1,"buffers":[[0,1.5]]}', "outside the entry"),
    (b'{"root":1,"buffers":[7]}', "outside the entry"),
])
def test_decoder_rejects_headers_that_are_not_one_well_formed_object(header, why):
    with pytest.raises(CorruptEntryError, match=why):
        decode(make_blob(None, header=header))
    assert decode(make_blob(None, header=b'{"root":1,"buffers":[]}')) == 1


def test_decoder_rejects_deep_nesting():
    for depth in (200, 100_000):
        header = b'{"root":' + b"[" * depth + b"1" + b"]" * depth + b',"buffers":[]}'
        with pytest.raises(CorruptEntryError):
            decode(make_blob(None, header=header))


def test_decoder_rejects_damage():
    blob = encode({"a": torch.arange(1000.0), "b": "x"}).to_bytes()
    with pytest.raises(CorruptEntryError):
        decode(blob[:-1])  # truncated
    with pytest.raises(CorruptEntryError):
        decode(b"")
    with pytest.raises(CorruptEntryError):
        decode(pickle.dumps({"a": 1}))  # foreign
    bad = bytearray(blob)
    bad[45] ^= 0xFF  # header bit flip
    with pytest.raises(CorruptEntryError):
        decode(bad)
    with pytest.raises(CorruptEntryError):
        decode(os.urandom(len(blob)))


def test_objects_met_twice_decode_as_one_object_as_pickle_keeps_them():
    from helpers import sharing

    ops = [{"class": "Spacingd", "extra_info": {"affine": np.eye(4)}}]
    image = MetaTensor(torch.rand(2, 3), applied_operations=ops)
    label = MetaTensor(torch.rand(2, 3), applied_operations=list(ops))  # a shallow copy, as MONAI's crops make
    shared_tensor, shared_array = torch.arange(100.0), np.arange(100)
    item = {
        "image": image,
        "label": label,
        "t": [shared_tensor, shared_tensor],
        "a": (shared_array, {"again": shared_array}),
        "twice": [ops, ops],
        "image again": image,
    }
    out = roundtrip(item)
    assert sharing(out) == sharing(pickle.loads(pickle.dumps(item))) and len(sharing(item)) == 6
    assert_same(out, item)
    assert out["image again"] is out["image"] and out["t"][0] is out["t"][1]
    assert out["label"].applied_operations[0] is out["image"].applied_operations[0]
    out["t"][0][0] = -1  # one object: a change shows through both places, as after pickle or deepcopy
    assert out["t"][1][0] == -1 and item["t"][0][0] == 0
    # an item with nothing met twice keeps the header it had before references existed
    assert b'"refs"' not in encode({"a": [1, 2], "b": [1, 2], "c": torch.ones(3)}).header


def test_exact_encoding_refuses_what_pickling_would_bring_back_otherwise():
    base = torch.arange(12.0)
    encode({"x": base, "y": base.view(3, 4).t().contiguous().t()}, exact=True)  # a dense permutation: exact
    for item, why in [
        ({"x": base[2:6]}, "a view of a part of its memory"),
        ({"x": base.view(3, 4)[:, ::2]}, "a view of a part of its memory"),
        ({"x": base, "y": base.view(3, 4)}, "sharing memory with another"),
        ({"x": torch.nn.Parameter(torch.ones(2))}, "subclass Parameter"),
        ({"x": torch.ones(2, requires_grad=True)}, "requires grad"),
    ]:
        with pytest.raises(UnsupportedValueError, match=why):
            encode(item, exact=True)
        roundtrip(item)  # a cache stores the values (a view's elements, a copy of shared memory)


@pytest.mark.parametrize("root", [
    {"~": "r", "i": 0},  # a reference without "refs" in the header
    [[1], {"~": "r", "i": 5}],  # to no node
    [[1], {"~": "r", "i": "0"}],
    [[1], {"~": "r", "i": True}],
])
def test_decoder_rejects_references_to_no_earlier_node(root):
    refs = b',"refs":true' if isinstance(root, list) else b""
    header = b'{"root":' + json.dumps(root, separators=(",", ":")).encode() + b',"buffers":[]' + refs + b"}"
    with pytest.raises(CorruptEntryError, match="reference"):
        decode(make_blob(None, header=header))
    ok = b'{"root":[[1],{"~":"r","i":0}],"buffers":[],"refs":true}'
    first, second = decode(make_blob(None, header=ok))
    assert first is second == [1]
