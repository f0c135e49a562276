"""Hostile and broken input: fuzzed cache entries, fuzzed shared-memory index slots and disk headers,
planted pickles and ``torch.save`` files.

Whatever is in the cache, a reader must answer with the right item, a clear ``CorruptEntryError`` (the
stores then recompute), never a crash, a hang, a huge allocation, an import of a module, or the execution
of anything. Random damage (checksums left as they are) must never yield wrong data; crafted entries
(checksums recomputed, as an attacker would) may decode to whatever they describe, but nothing worse.

Examples per fuzz test: ``MONAI_CACHE_FUZZ_EXAMPLES`` (default 300); ``MONAI_CACHE_FUZZ_RANDOM=1`` draws
new examples on every run instead of the reproducible, derandomized default.
"""

from __future__ import annotations

import base64
import json
import os
import pickle
import re
import struct
import subprocess
import sys
import time
import warnings
import zlib
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from monai_cache import codec, disk_format, runtime
from monai_cache.codec import CorruptEntryError, decode, encode
from monai_cache.dataset import CacheDataset
from monai_cache.disk import MISSING, DiskStore
from monai_cache.disk_format import read_entry
from monai_cache.persistent import PersistentDataset
from monai_cache.shm import SharedMemoryStore
from monai_cache.shm_directory import entry_tag

from ._fuzzing import (
    Payload,
    assemble,
    blob_of,
    deep_equal,
    nbytes,
    payload_pickle,
    sample_items,
    split,
    structure_equal,
)
from ._harness import (
    Hang,
    MakeItem,
    Tally,
    data_list,
    deadline,
    env_int,
    item_problem,
    join_or_kill,
    make_item,
)

EXAMPLES = env_int("MONAI_CACHE_FUZZ_EXAMPLES", 300)
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=not os.environ.get("MONAI_CACHE_FUZZ_RANDOM"),
    database=None,
    suppress_health_check=list(HealthCheck),
)
DECODE_SECONDS = 2.0  # a hang detector: decoding a few KB never takes this long
STANDALONE = 0xFFFFFFFF

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning", "ignore::UserWarning")

_samples: list[tuple[Any, bytes]] = []


def samples() -> list[tuple[Any, bytes]]:
    if not _samples:
        for item in sample_items():
            _samples.append((item, bytes(encode(item).to_bytes())))
            _samples.append((item, bytes(encode(item, downcast=True).to_bytes())))
    return _samples


def attempt(t: Tally, blob: bytes, verify: bool = False) -> tuple[str, Any]:
    """Decode ``blob``: ('value', item), ('corrupt', None), or ('crash', None) / ('hang', None).

    Counted into ``t`` (each a failed check too): ``crashes`` (an exception other than CorruptEntryError), ``hangs``
    (interrupted after DECODE_SECONDS, or a call into C that returned after that), ``oversized`` (a result far
    bigger than the entry), ``imports`` (decodes that imported a module other than MONAI's)."""
    t.add("decodes")
    before = set(sys.modules)
    t0 = time.monotonic()
    got, outcome, error = None, "crash", ""
    try:
        with deadline(DECODE_SECONDS):
            try:
                got = decode(bytearray(blob), verify=verify)
                outcome = "value"
            except CorruptEntryError:
                outcome = "corrupt"
    except Hang:
        outcome = "hang"
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    if outcome != "crash" and time.monotonic() - t0 >= DECODE_SECONDS:
        outcome = "hang"  # interrupted, or a call into C that returned too late
    t.add("crashes", outcome == "crash")
    t.check(outcome != "crash", f"decode(verify={verify}) raised {error}: {blob[:300]!r}")
    t.add("hangs", outcome == "hang")
    t.check(outcome != "hang", f"decode(verify={verify}) took {DECODE_SECONDS} s or more: {blob[:300]!r}")
    oversized = nbytes(got) > 16 * len(blob) + (1 << 20)
    t.add("oversized", oversized)
    t.check(not oversized, f"decoding allocated far more than the entry holds: {blob[:300]!r}")
    imported = [m for m in set(sys.modules) - before if m != "monai" and not m.startswith("monai.")]
    t.add("imports", bool(imported))
    t.check(not imported, f"decoding imported {imported}")
    return outcome, got


# ------------------------------------------------------------------------------- codec: random damage
def test_random_damage_is_detected_or_only_changes_unverified_buffer_bytes():
    t = Tally("fuzz/codec-random-damage", "examples_run", "decodes", "wrong_data_accepted_with_verify",
              "wrong_data_unverified", "crashes", "hangs", "oversized", "imports", examples=EXAMPLES)

    @FUZZ
    @given(
        k=st.integers(0, len(samples()) - 1),
        op=st.sampled_from(["truncate", "flip", "overwrite", "insert", "delete", "extend"]),
        where=st.floats(0, 1, exclude_max=True),
        bit=st.integers(0, 7),
        junk=st.binary(min_size=1, max_size=48),
    )
    def run(k, op, where, bit, junk):
        t.add("examples_run")
        item, blob = samples()[k]
        pos = int(where * len(blob))
        bad = bytearray(blob)
        span = (pos, pos + 1)
        if op == "truncate":
            bad = bad[:pos]
        elif op == "flip":
            bad[pos] ^= 1 << bit
        elif op == "overwrite":
            bad[pos : pos + len(junk)] = junk[: len(blob) - pos]
            span = (pos, min(len(blob), pos + len(junk)))
        elif op == "insert":
            bad[pos:pos] = junk
        elif op == "delete":
            del bad[pos : pos + len(junk)]
        else:
            bad += junk
        _, data = split(blob)
        data_start = len(blob) - len(data)
        for verify in (True, False):
            outcome, got = attempt(t, bytes(bad), verify)
            if outcome in ("crash", "hang"):
                continue
            if outcome == "corrupt" or deep_equal(got, item):
                t.add("rejected" if outcome == "corrupt" else "unchanged")
                continue
            # The only tolerated difference: without verify=True, buffer bytes are not checksummed on read.
            where = f"{op} at {pos} of sample {k} (junk {junk!r}, bit {bit})"
            t.add("wrong_data_accepted_with_verify", verify)
            if not t.check(not verify, f"{where}: wrong data passed the full checksum"):
                continue
            tolerated = t.check(op in ("flip", "overwrite") and span[0] >= data_start, f"{where} changed the item")
            tolerated = t.check(structure_equal(got, item), f"{where} changed the item's structure") and tolerated
            t.add("buffer bytes changed (verify=False)" if tolerated else "wrong_data_unverified")

    run()
    t.record()
    t.assert_clean("wrong_data_accepted_with_verify", "wrong_data_unverified", "crashes", "hangs", "oversized",
                   "imports")


# ----------------------------------------------------------------------------- codec: crafted headers
TOKEN = re.compile(rb'-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?|"(?:[^"\\]|\\.)*"|true|false|null')
HOSTILE_TOKENS = [
    b"-1", b"0", b"1", b"3", b"63", b"64", b"65", b"2147483648", b"4294967296", b"9223372036854775808",
    b"18446744073709551616", b"1" + b"0" * 30, b"1e308", b"-1e308", b"1.5", b"true", b"false", b"null", b'""',
    b'"x"', b'"~"', b"[]", b"{}", b"[[]]", b"[0,0]", b"[0,4611686018427387904,4611686018427387904]",
    b"[1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1]",
    b'"T"', b'"N"', b'"M"', b'"P"', b'"d"', b'"t"', b'"e"', b'"c"', b'"f"', b'"n"', b'"B"', b'"td"', b'"nd"',
    b'"float32"', b'"bfloat16"', b'"float17"', b'"<f8"', b'">f8"', b'"|O"', b'"<U8"', b'"|V8"', b'"<M8[ns]"',
    b'"(2,)<f4"', b'"object"', b'"os:system"', b'"builtins:int"', b'"enum:Enum"', b'"subprocess:Popen"',
    b'"monai.utils.enums:SpaceKeys"', b'"monai.nonexistent_xyz:A"', b'"dev"', b'"cpu"', b'"meta"', b'"nan"',
    b'"inf"', b'"' + b"A" * 999 + b'"', b'"AAAA"', b'"!!!!"', b"[" * 150 + b"]" * 150,
    b'{"~":"d","k":[[1]],"v":[1]}', b'{"~":"t"}', b'{"~":"P","x":"gASVAAAAAAAAAAAu"}',
]


NUDGES = {"+1": lambda v: v + 1, "-1": lambda v: v - 1, "*2": lambda v: v * 2, "+64": lambda v: v + 64,
          "-64": lambda v: v - 64, "neg": lambda v: -v, "zero": lambda v: 0, "//2": lambda v: v // 2}

EDITS = st.sampled_from(sorted(NUDGES)) | st.sampled_from(HOSTILE_TOKENS)


def test_crafted_headers_never_crash_hang_or_import():
    t = Tally("fuzz/codec-crafted-headers", "examples_run", "decodes", "crashes", "hangs", "oversized", "imports",
              examples=EXAMPLES)

    @FUZZ
    @given(
        k=st.integers(0, len(samples()) - 1),
        edits=st.lists(st.tuples(st.floats(0, 1, exclude_max=True), EDITS), min_size=1, max_size=3),
        flips=st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(0, 7)), max_size=2),
        verify=st.booleans(),
    )
    def run(k, edits, flips, verify):
        t.add("examples_run")
        _, blob = samples()[k]
        header, data = split(blob)
        tokens = list(TOKEN.finditer(header))
        chosen = {}
        for where, edit in edits:
            n = int(where * len(tokens))
            if isinstance(edit, bytes):
                chosen[n] = edit
            elif re.fullmatch(rb"-?\d+", tokens[n].group()):  # nudge an integer (offsets, lengths, shapes...)
                chosen[n] = str(NUDGES[edit](int(tokens[n].group()))).encode()
        out, last = bytearray(), 0
        for n, m in enumerate(tokens):
            if n in chosen:
                out += header[last : m.start()] + chosen[n]
                last = m.end()
        out += header[last:]
        for where, bit in flips:
            out[int(where * len(out))] ^= 1 << bit
        try:
            spans = json.loads(bytes(out)).get("buffers")
        except (ValueError, AttributeError, RecursionError):
            spans = None
        outcome, _ = attempt(t, assemble(bytes(out), data, spans=spans), verify)
        if outcome in ("value", "corrupt"):  # (crashes and hangs: counted by attempt)
            t.add(outcome)

    run()
    t.record()
    t.assert_clean("crashes", "hangs", "oversized", "imports")


# -------------------------------------------------------------------------- codec: generated headers
INTS = st.sampled_from([0, 1, 2, 3, 4, 8, 64, -1, -64, 2**31, 2**32 + 1, 2**62, 2**63, 2**64, 10**30, True, False])
INTS = INTS | st.integers(-5, 300)
DTYPES = st.sampled_from([
    "float32", "uint8", "int64", "bool", "bfloat16", "complex128", "float16", "float17", "object", "", "<f4", ">f8",
    "|b1", "<c16", "|O", "<U4", "|V8", "<m8[ns]", "<M8[D]", "(2,)<f4", "[('a','<f4')]", "|S3", "float", "i", "(,)f4",
]) | st.text(max_size=6) | st.integers() | st.none() | st.lists(st.integers(), max_size=2)
SHAPES = st.lists(INTS, max_size=5) | st.sampled_from([[0, 2**62, 2**62], [1] * 65, "ab", None, [[1]], [1.5], [-3]])
B64 = st.binary(max_size=80).map(lambda b: base64.b64encode(b).decode()) | st.sampled_from(["", "!!!", "AAA", "A"])
ENUMS = st.sampled_from([
    "monai.utils.enums:SpaceKeys", "monai.utils.enums:TraceKeys", "monai.utils.enums:SpaceKeys.RAS",
    "monai.nonexistent_xyz:A", "os:system", "subprocess:Popen", "builtins:int", "enum:Enum", "json:JSONDecodeError",
    "antigravity:fly", "nonexistent_mod_xyz:E", "monai", ":", "", "monai.utils.enums:Nope",
]) | st.integers() | st.none()
LEAF = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False, allow_infinity=False)
LEAF = LEAF | st.text(max_size=8)


def _tagged(children):
    tensor_fields = {"dt": DTYPES, "sh": SHAPES, "b": INTS | st.text(max_size=2), "x": B64 | st.integers(),
                     "pm": st.lists(INTS, max_size=4) | st.none() | st.integers(), "sd": DTYPES,
                     "dev": st.sampled_from(["cpu", "meta"]), "a": children}
    return st.one_of(
        st.fixed_dictionaries({"~": st.sampled_from(["T", "M"])}, optional=tensor_fields),
        st.fixed_dictionaries({"~": st.just("N")}, optional={**tensor_fields, "F": st.booleans() | INTS}),
        st.fixed_dictionaries({"~": st.just("d")}, optional={"k": st.lists(children, max_size=3) | children,
                                                               "v": st.lists(children, max_size=3) | children}),
        st.fixed_dictionaries({"~": st.just("t")}, optional={"v": st.lists(children, max_size=3) | children}),
        st.fixed_dictionaries({"~": st.just("f")},
                              optional={"v": st.sampled_from(["nan", "inf", "-inf", "NaN"]) | children}),
        st.fixed_dictionaries({"~": st.just("c")}, optional={"r": children, "i": children}),
        st.fixed_dictionaries({"~": st.just("e")}, optional={"c": ENUMS, "v": children}),
        st.fixed_dictionaries({"~": st.just("n")}, optional={"dt": DTYPES, "x": B64 | children, "b": INTS}),
        st.fixed_dictionaries({"~": st.sampled_from(["B", "P"])}, optional={"b": INTS, "x": B64 | children}),
        st.fixed_dictionaries({"~": st.sampled_from(["td", "nd"])}, optional={"v": DTYPES}),
        st.fixed_dictionaries({"~": st.text(max_size=3) | st.integers() | st.none()}),
        st.lists(children, max_size=4),
    )


NODES = st.recursive(LEAF, _tagged, max_leaves=12)
SPANS = st.lists(st.lists(INTS, max_size=3) | INTS | st.none(), max_size=4)


def test_generated_headers_never_crash_hang_import_or_unpickle(tmp_path):
    marker = str(tmp_path / "PWNED")
    planted = base64.b64encode(payload_pickle(marker)).decode()
    t = Tally("fuzz/codec-generated-headers", "examples_run", "decodes", "with_pickled_payload", "executed_payloads",
              "crashes", "hangs", "oversized", "imports", examples=EXAMPLES)

    @FUZZ
    @given(root=NODES, spans=SPANS, data=st.binary(max_size=600), pickled=st.booleans(), verify=st.booleans(),
           shape=st.sampled_from(["normal", "no root", "no buffers", "list"]))
    def run(root, spans, data, pickled, verify, shape):
        t.add("examples_run")
        t.add("with_pickled_payload", pickled)
        if pickled:  # a pickled value somewhere in the tree: must never be loaded
            root = {"~": "d", "k": ["a", "b"], "v": [root, {"~": "P", "x": planted}]}
        doc: Any = {"root": root, "buffers": spans}
        if shape == "no root":
            doc.pop("root")
        elif shape == "no buffers":
            doc.pop("buffers")
        elif shape == "list":
            doc = [root, spans]
        header = json.dumps(doc, separators=(",", ":")).encode()
        outcome, _ = attempt(t, assemble(header, data, spans=spans), verify)
        if outcome in ("value", "corrupt"):  # (crashes and hangs: counted by attempt)
            t.add(outcome)
        executed = os.path.exists(marker)  # the payload creates it when unpickled
        t.add("executed_payloads", executed)
        if not t.check(not executed, f"a pickled payload was executed: {header[:300]!r}"):
            os.unlink(marker)  # so that the next execution counts too

    run()
    t.record()
    t.assert_clean("executed_payloads", "crashes", "hangs", "oversized", "imports")


# ------------------------------------------------------------ codec: headers that crashed the decoder
# Crafted headers (valid checksums) on which codec.decode raised something other than CorruptEntryError: found
# by this suite (the last two by atheris), fixed in 0a94e99 (decode turns any error into CorruptEntryError).
CRASHERS = {  # name: (root node, what decode did)
    "unknown device": (
        {"~": "T", "dt": "float32", "sh": [1], "x": "AAAAAA==", "dev": "junk"},
        "_Decoder._tensor: 'dev' goes to Tensor.to unchecked: RuntimeError"),
    "CUDA device on a CPU-only build": (
        {"~": "T", "dt": "float32", "sh": [1], "x": "AAAAAA==", "dev": "cuda:0"},
        "_Decoder._tensor: Tensor.to('cuda:0') without CUDA: AssertionError"),
    "complex with a list part": (
        {"~": "c", "r": [1], "i": 0}, "_Decoder.node tag 'c': complex([1], 0): TypeError"),
    "complex with a string part": (
        {"~": "c", "r": "1", "i": 0}, "_Decoder.node tag 'c': complex('1', 0): TypeError"),
    "empty tensor, overflowing shape": (
        {"~": "T", "dt": "float32", "sh": [2**62, 2**62, 0], "x": ""},
        "_Decoder._tensor: torch.empty of a zero-size shape whose storage size overflows: RuntimeError"),
    "empty tensor, shape beyond int64": (
        {"~": "T", "dt": "float32", "sh": [10**30, 0], "x": ""},
        "_Decoder._tensor: torch.empty with a dimension beyond int64: TypeError"),
    "empty array, overflowing shape": (
        {"~": "N", "dt": "<f4", "sh": [2**40, 2**40, 0], "x": ""},
        "_Decoder._ndarray: reshape of an empty array to an overflowing shape: ValueError (not CorruptEntryError)"),
    "enum class without members": (
        {"~": "e", "c": "enum:Enum", "v": 1}, "_load_enum: cls(value) of an enum without members: TypeError"),
    "list as a tensor dtype": (
        {"~": "T", "dt": [1], "sh": [1], "x": "AAAAAA=="},
        "_Decoder._tensor: _TORCH_DTYPES.get(unhashable 'dt'): TypeError"),
    "list as a stored dtype": (
        {"~": "T", "dt": "float32", "sd": [1], "sh": [1], "x": "AAAAAA=="},
        "_Decoder._tensor: _TORCH_DTYPES.get(unhashable 'sd'): TypeError"),
    "list as a torch.dtype name": (
        {"~": "td", "v": [1]}, "_Decoder.node tag 'td': _TORCH_DTYPES.get(unhashable 'v'): TypeError"),
    "list as a non-finite float name": (
        {"~": "f", "v": [1]}, "_Decoder.node tag 'f': unhashable 'v' in a dict: TypeError (found by atheris)"),
    "numpy dtype '(,)f4'": (
        {"~": "N", "dt": "(,)f4", "sh": [1], "x": "AAAAAA=="},
        "_numpy_dtype: np.dtype('(,)f4') raises SyntaxError, only TypeError/ValueError are caught (found by atheris)"),
}


@pytest.mark.parametrize("name", list(CRASHERS))
def test_crafted_headers_that_used_to_crash_the_decoder_raise_corrupt_entry_error(name):
    with pytest.raises(CorruptEntryError):
        decode(bytearray(blob_of(CRASHERS[name][0])))


def test_shared_memory_reader_recomputes_any_undecodable_entry(shm_dir):
    """(Found by this suite: such an entry crashed the reader; fixed in 0a94e99.)"""
    store = SharedMemoryStore("crafted", 1, shm_dir=shm_dir)
    blob = blob_of({"~": "c", "r": [1], "i": 0})
    plant_slot(store.path, 0, plant_segment(store.path, blob), 0, len(blob), blob_tag(blob, 0))
    try:
        assert store[0] is None
        assert item_problem(store.get_or_compute(0, lambda: make_item(0, 64)), 0, 64) is None
    finally:
        store.release()


# ----------------------------------------------------------------------------- atheris (if installed)
def test_atheris_bounded_run(tmp_path):
    """Coverage-guided fuzzing of the decoders (tests/reliability/fuzz_codec.py) for a bounded number of inputs."""
    pytest.importorskip("atheris")
    # Bounded by runs, not time, from a fixed seed and corpus: a slow CI machine explores as much as a fast
    # one. (Not bit-for-bit reproducible: the coverage the Python code reports varies a little between runs.)
    runs = env_int("MONAI_CACHE_ATHERIS_RUNS", 100_000)
    seconds = env_int("MONAI_CACHE_ATHERIS_SECONDS", 300)  # a cap only, for a very slow machine
    script = os.path.join(os.path.dirname(__file__), "fuzz_codec.py")
    corpus = str(tmp_path / "corpus")
    artifacts = str(tmp_path / "artifacts")  # libFuzzer saves each input that crashed, hung or ran out of memory
    os.makedirs(artifacts)
    env = dict(os.environ, PYTHONHASHSEED="0")
    subprocess.run([sys.executable, script, "--make-corpus", corpus], check=True, timeout=300, env=env)
    t0 = time.monotonic()
    r = subprocess.run(
        [sys.executable, script, corpus, f"-runs={runs}", f"-max_total_time={seconds}", "-rss_limit_mb=3072",
         "-timeout=10", "-print_final_stats=1", "-seed=1", f"-artifact_prefix={artifacts}/"],
        capture_output=True, text=True, timeout=300 + seconds, env=env, cwd=str(tmp_path),
    )
    tail = (r.stdout + r.stderr)[-3000:]
    saved = os.listdir(artifacts)
    t = Tally("fuzz/atheris", runs=runs)
    for figure, kinds in (("crashes", ("crash-", "leak-", "deadly-")), ("hangs", ("timeout-",)), ("ooms", ("oom-",))):
        t.add(figure, sum(name.startswith(kinds) for name in saved))
    t.check(r.returncode == 0, f"exit code {r.returncode}: {tail}")
    done = re.findall(r"stat::number_of_executed_units:\s*(\d+)", r.stderr)
    t.record(seconds=round(time.monotonic() - t0, 1), executions=int(done[-1]) if done else None,
             exit_code=r.returncode)
    t.assert_clean("crashes", "hangs", "ooms")


# ------------------------------------------------------------------------ shared-memory index slots
def blob_tag(blob: bytes, i: int) -> int:
    """The tag an honest writer gives entry ``i`` holding ``blob``."""
    return entry_tag(codec.blob_identity(blob), i)


def plant_slot(cache: str, i: int, seg: int, offset: int, length: int, tag: int) -> None:
    """Write index slot ``i`` of the cache directory ``cache`` as docs/shared-memory.md lays it out (32 bytes):
    segment and tag (u32), offset and length (u64), 4 reserved bytes, then the CRC-32 of those 28 bytes
    followed by the entry number (u64)."""
    head = struct.pack("<IIQQI", seg, tag, offset, length, 0)
    check = zlib.crc32(head + i.to_bytes(8, "little"))
    fd = os.open(os.path.join(cache, "index"), os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        os.pwrite(fd, head + check.to_bytes(4, "little"), SLOT * i)
    finally:
        os.close(fd)


def plant_segment(cache: str, content: bytes, seg: int = 9999) -> int:
    with open(os.path.join(cache, f"s.{seg}"), "wb") as f:
        f.write(content)
    return seg


def read_slot_raw(cache: str, i: int) -> tuple[int, int, int, int]:
    """``(segment, offset, length, tag)`` of slot ``i``."""
    with open(os.path.join(cache, "index"), "rb") as f:
        f.seek(SLOT * i)
        raw = f.read(SLOT)
    seg, tag, offset, length, _ = struct.unpack_from("<IIQQI", raw)
    return seg, offset, length, tag


SLOT = 32  # bytes per index slot
SLOT_SECONDS = 10.0  # a hang detector: damaging a slot, reading and recomputing an entry takes milliseconds
SLOT_SIZES = {i: 1024 + 100 * i for i in range(5)} | {5: 300_005}  # distinct sizes; entry 5 has a file of its own


def test_fuzzed_index_slots_never_serve_wrong_data(shm_dir):
    n = len(SLOT_SIZES)
    store = SharedMemoryStore("slots", n, shm_dir=shm_dir)
    items = {i: make_item(i, s) for i, s in SLOT_SIZES.items()}
    for i in range(n):
        store[i] = items[i]
    t = Tally("fuzz/shm-index-slots", "examples_run", "wrong_data", "wrong_recomputed", "crashes", "hangs",
              examples=EXAMPLES)

    @FUZZ
    @given(i=st.integers(0, n - 1), kind=st.sampled_from(["raw", "checksummed"]),
           raw=st.binary(min_size=SLOT, max_size=SLOT),
           seg=st.sampled_from(["same", "next", "zero", "missing", "standalone", "random"]),
           off_delta=st.integers(-3, 3) | st.sampled_from([-(2**20), 2**20]), len_delta=st.integers(-130, 130),
           big=st.integers(0, 2**32 - 1), huge_len=st.booleans(), huge=st.integers(0, 2**64 - 1),
           tag=st.sampled_from(["right", "other entry's", "random"]))
    def run(i, kind, raw, seg, off_delta, len_delta, big, huge_len, huge, tag):
        t.add("examples_run")
        with t.trial(f"slot {i}: {kind} {raw!r} {seg} {off_delta} {len_delta} {big} {huge_len} {huge} {tag}"), \
                deadline(SLOT_SECONDS):
            damage_slot_and_read(i, kind, raw, seg, off_delta, len_delta, big, huge_len, huge, tag)

    def damage_slot_and_read(i, kind, raw, seg, off_delta, len_delta, big, huge_len, huge, tag):
        if not store.contains(i):
            store[i] = items[i]
        real_seg, real_off, real_len, real_tag = read_slot_raw(store.path, i)
        if kind == "raw":
            fd = os.open(os.path.join(store.path, "index"), os.O_WRONLY)
            os.pwrite(fd, raw, SLOT * i)
            os.close(fd)
        else:
            s = {"same": real_seg, "next": (real_seg + 1) % STANDALONE, "zero": 0, "missing": 7777,
                 "standalone": STANDALONE, "random": big}[seg]
            off = max(0, real_off + 64 * off_delta)
            length = huge if huge_len else max(0, real_len + len_delta)
            other_tag = read_slot_raw(store.path, (i + 1) % n)[3]
            slot_tag = {"right": real_tag, "other entry's": other_tag, "random": big}[tag]
            plant_slot(store.path, i, s, off, length, slot_tag)
        got = store[i]
        if got is None:
            t.add("rejected")
        else:
            wrong = item_problem(got, i, SLOT_SIZES[i])
            t.add("wrong_data", wrong is not None)
            if t.check(wrong is None, f"a damaged slot served wrong data: {wrong}"):
                t.add("accepted (right item)")
        again = store.get_or_compute(i, lambda: items[i])  # and the entry is recomputed
        wrong = item_problem(again, i, SLOT_SIZES[i])
        t.add("wrong_recomputed", wrong is not None)
        t.check(wrong is None, f"recomputed after a damaged slot: {wrong}")

    try:
        run()
        for i in range(n):
            with t.trial(f"entry {i} after the run"):
                wrong = item_problem(store.get_or_compute(i, lambda i=i: items[i]), i, SLOT_SIZES[i])
                t.add("wrong_recomputed", wrong is not None)
                t.check(wrong is None, f"entry {i} after the run: {wrong}")
    finally:
        store.release()
    t.record()
    t.assert_clean("wrong_data", "wrong_recomputed", "crashes", "hangs")


def test_a_slot_pointing_at_another_entry_is_rejected(shm_dir):
    store = SharedMemoryStore("swapped", 2, shm_dir=shm_dir)
    try:
        store[0] = make_item(0, 1000)
        store[1] = make_item(1, 1000)
        plant_slot(store.path, 0, *read_slot_raw(store.path, 1))
        got = store[0]
        assert got is None or item_problem(got, 0, 1000) is None
    finally:
        store.release()


# ------------------------------------------------------------------------------- disk file headers
def test_crafted_disk_headers_never_crash(tmp_path):
    """Every field of the 64-byte header crafted (checksums recomputed or not) over various payloads."""
    import zstandard

    d = str(tmp_path / "cache")
    os.makedirs(d)
    key = "entry"
    path = os.path.join(d, key + disk_format.ENTRY_SUFFIX)
    item, blob = samples()[0]
    other_blob = samples()[2][1]
    zc = zstandard.ZstdCompressor()
    payloads = {  # the first is what a writer writes; the fuzzer starts from there
        "zstd": zc.compress(blob),
        "zstd of another item": zc.compress(other_blob),
        "raw": blob,
        "random": os.urandom(len(blob) // 2),
        "truncated zstd": zc.compress(blob)[:-7],
        "two frames": zc.compress(blob) + zc.compress(blob),
        "skippable frame first": b"\x50\x2a\x4d\x18" + (4).to_bytes(4, "little") + b"abcd" + zc.compress(blob),
        "empty": b"",
        "zstd without content size": zstandard.ZstdCompressor(write_content_size=False).compress(blob),
    }
    real_tag = disk_format.key_tag(key)
    t = Tally("fuzz/disk-headers", "examples_run", "wrong_data", "wrong_data_from_store", "bad_files_kept",
              "crashes", "hangs", examples=EXAMPLES)

    @FUZZ
    @given(
        payload=st.sampled_from(list(payloads)), version=st.sampled_from([1, 0, 2, 65535]),
        hsize=st.sampled_from([64, 0, 63, 65, 4096]), flags=st.sampled_from(["natural", 0, 1, 2, 3, 2**31]),
        blob_len=st.sampled_from(["real", "real-1", "real+1", "zero", "64MiB", "512GiB"]) | st.integers(0, 1 << 16),
        stored_len=st.sampled_from(["file", "file-1", "file+1", "zero"]) | st.integers(0, 1 << 20),
        crc=st.sampled_from(["right", "wrong"]), codec_version=st.sampled_from([1, 0, 2]),
        tag=st.sampled_from(["right", "wrong"]), header_crc=st.sampled_from(["right", "wrong"]),
    )
    def run(payload, version, hsize, flags, blob_len, stored_len, crc, codec_version, tag, header_crc):
        t.add("examples_run")
        body = payloads[payload]
        real = len(blob) if payload != "zstd of another item" else len(other_blob)
        if flags == "natural":  # what a writer would set for this payload
            flags = 0 if payload in ("raw", "random", "empty") else disk_format.FLAG_ZSTD
        blob_len = {"real": real, "real-1": real - 1, "real+1": real + 1, "zero": 0, "64MiB": 64 << 20,
                    "512GiB": 512 << 30}.get(blob_len, blob_len)
        stored_len = {"file": len(body), "file-1": len(body) - 1, "file+1": len(body) + 1, "zero": 0}.get(
            stored_len, stored_len)
        head = disk_format.HEADER.pack(
            disk_format.DISK_MAGIC, version, hsize, flags, blob_len, max(0, stored_len),
            zlib.crc32(body) if crc == "right" else 12345, codec_version,
            real_tag if tag == "right" else os.urandom(16), 0, 0,
        )
        hcrc = zlib.crc32(head[:60]) if header_crc == "right" else 54321
        with open(path, "wb") as f:
            f.write(head[:60] + hcrc.to_bytes(4, "little") + body)
        example = f"{payload}: {head[:60].hex()} {hcrc}"
        t0, hangs_before = time.monotonic(), t.figures["hangs"]
        with t.trial(f"read_entry, {example}"), deadline(2 * DECODE_SECONDS):
            try:
                got = read_entry(path)
                t.add("accepted")
                right = deep_equal(got, item) or payload == "zstd of another item"
                t.add("wrong_data", not right)
                t.check(right, f"wrong data accepted: {example}")
            except CorruptEntryError:
                t.add("rejected")
        with t.trial(f"DiskStore.get, {example}"), deadline(2 * DECODE_SECONDS), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = DiskStore(d).get(key)  # the store never raises: MISSING, and the bad file is removed
            right = got is MISSING or deep_equal(got, item) or payload == "zstd of another item"
            t.add("wrong_data_from_store", not right)
            t.check(right, f"DiskStore.get served wrong data: {example}")
            kept = got is MISSING and os.path.exists(path)
            t.add("bad_files_kept", kept)
            t.check(not kept, f"DiskStore.get left a file it could not read: {example}")
        elapsed = time.monotonic() - t0
        if elapsed >= 2 * DECODE_SECONDS and t.figures["hangs"] == hangs_before:  # (not interrupted, but too slow)
            t.add("hangs")
            t.check(False, f"{elapsed:.1f} s for {example}")

    run()
    t.record()
    t.assert_clean("wrong_data", "wrong_data_from_store", "bad_files_kept", "crashes", "hangs")


def _peak_rss_growth(paths: list[str], out: str) -> None:
    """Read every file in a fresh process; write how many were rejected and how much its peak RSS grew."""

    def hwm() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))

    with open("/proc/self/clear_refs", "w") as f:  # reset the peak to the current RSS
        f.write("5")
    before = hwm()
    rejected = 0
    for path in paths:
        try:
            read_entry(path)
        except CorruptEntryError:
            rejected += 1
    growth = hwm() - before
    with open(out, "w") as f:
        json.dump({"rejected": rejected, "growth": growth}, f)
    os._exit(0)


def test_a_tiny_file_claiming_a_huge_blob_allocates_nothing_big(tmp_path):
    """A 100-byte file whose (checksummed) header claims a 1 GiB, 8 GiB or 512 GiB blob: rejected without
    touching that much memory (the peak RSS of the reading process is measured)."""
    import multiprocessing

    import zstandard

    payload = zstandard.ZstdCompressor().compress(b"\0" * 100)
    paths = []
    for claim in (1 << 30, 8 << 30, 512 << 30):
        head = disk_format.pack_header(disk_format.FLAG_ZSTD, claim, len(payload), zlib.crc32(payload), f"k{claim}")
        paths.append(str(tmp_path / f"k{claim}.mcache"))
        with open(paths[-1], "wb") as f:
            f.write(head + payload)
    out = str(tmp_path / "measured.json")
    p = multiprocessing.get_context("fork").Process(target=_peak_rss_growth, args=(paths, out))
    p.start()
    code = join_or_kill(p, 120)
    t = Tally("hostile/huge-claimed-blob", files=len(paths))
    t.add("hangs", code is None)
    t.check(code == 0, f"the reader exited with {code} (None: it hung)")
    measured = {"rejected": 0, "growth": None}
    if os.path.exists(out):
        with open(out) as f:
            measured = json.load(f)
    t.check(measured["rejected"] == len(paths), f"{len(paths) - measured['rejected']} crafted files accepted")
    growth = None if measured["growth"] is None else measured["growth"] / 2**20
    t.check(growth is not None and growth < 256, f"reading {len(paths)} tiny files raised the peak RSS by {growth} MiB")
    t.record(rejected=measured["rejected"], peak_rss_growth_mib=None if growth is None else round(growth, 1))
    t.assert_clean("hangs")


# -------------------------------------------------------------------------------- planted pickles
def _assert_payload_is_live(tmp_path) -> None:
    """The payloads below do run when unpickled: prove it in a throw-away process."""
    import multiprocessing

    marker = str(tmp_path / "LIVE")
    pt = str(tmp_path / "live.pt")
    torch.save({"image": Payload(marker)}, pt)

    def load_both():
        pickle.loads(payload_pickle(marker))
        assert os.path.exists(marker)
        os.unlink(marker)
        torch.load(pt, weights_only=False)
        os._exit(0 if os.path.exists(marker) else 1)

    p = multiprocessing.get_context("fork").Process(target=load_both)
    p.start()
    p.join(60)
    assert p.exitcode == 0, "the test payload does not work: the tests below would prove nothing"
    os.unlink(marker)


def _torch_save_bytes(marker: str, tmp_path) -> bytes:
    pt = str(tmp_path / f"p{time.monotonic_ns()}.pt")
    torch.save({"image": Payload(marker)}, pt)
    with open(pt, "rb") as f:
        return f.read()


def _pickled_blob(marker: str, in_metatensor: bool = False) -> bytes:
    """A codec entry holding a pickled value, as a store with allow_pickle=True writes it."""
    from monai.data import MetaTensor

    value: Any = Payload(marker)
    if in_metatensor:
        mt = MetaTensor(torch.zeros(3))
        mt.meta["evil"] = Payload(marker)
        value = {"image": mt}
    return bytes(encode(value, allow_pickle=True).to_bytes())


def plant_all(cache: str, plants: dict[str, bytes]) -> None:
    for i, (name, content) in enumerate(plants.items()):
        if "<i>.e" in name:
            with open(os.path.join(cache, f"{i}.e"), "wb") as f:
                f.write(content)
            plant_slot(cache, i, STANDALONE, 0, len(content), blob_tag(content, i))
        else:
            plant_slot(cache, i, plant_segment(cache, content, seg=i + 1), 0, len(content), blob_tag(content, i))


class Markers:
    """One marker file per planted payload, in a directory of their own: the payloads that ran are counted by
    listing it (a payload creates its marker when unpickled)."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        os.makedirs(directory)

    def __call__(self, name: str) -> str:
        return os.path.join(self.directory, name)

    def executed(self) -> list[str]:
        return sorted(os.listdir(self.directory))


def shm_plants(marker: Markers, phase: str, tmp_path) -> dict[str, bytes]:
    """The six planted entries of the shared-memory test, each with a marker of its own (``<phase>-<k>``)."""
    return {
        "a pickle as a packed segment": payload_pickle(marker(f"{phase}-0")),
        "a torch.save file as a packed segment": _torch_save_bytes(marker(f"{phase}-1"), tmp_path),
        "a codec entry with a pickled value": _pickled_blob(marker(f"{phase}-2")),
        "a codec entry with a pickle in MetaTensor metadata": _pickled_blob(marker(f"{phase}-3"), in_metatensor=True),
        "a pickle as an entry file <i>.e": payload_pickle(marker(f"{phase}-4")),
        "a torch.save file as an entry file <i>.e": _torch_save_bytes(marker(f"{phase}-5"), tmp_path),
    }


def test_planted_pickles_in_shared_memory_are_never_executed(shm_dir, tmp_path):
    _assert_payload_is_live(tmp_path)
    marker = Markers(str(tmp_path / "PWNED"))
    t = Tally("hostile/planted-pickles-shm", "planted_entries", "planted_served", "items_right", "crashes")
    # 1) entries planted in a live cache, with index slots that point at them (checksums right)
    plants = shm_plants(marker, "live", tmp_path)
    n = len(plants)
    store = SharedMemoryStore("planted", n, shm_dir=shm_dir)
    plant_all(store.path, plants)
    t.add("planted_entries", n)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i in range(n):
            with t.trial(f"live cache, entry {i}"):
                served = store[i] is not None
                t.add("planted_served", served)
                t.check(not served, f"planted entry {i} served")
                right = item_problem(store.get_or_compute(i, lambda i=i: make_item(i, 64)), i, 64) is None
                t.add("items_right", right)
                t.check(right, f"entry {i} recomputed wrong")
    corrupt = store.stats()["total"]["corrupt"]
    t.check(corrupt == n, f"{corrupt} of {n} planted entries reported corrupt")
    store.release()

    # 2) a whole fake cache directory under our naming, kept (so it is not wiped), read by DataLoader workers
    def build():
        return CacheDataset(data_list(n, 64), MakeItem(), runtime_cache=True, cache_key="planted-dir",
                            progress=False, shm_dir=shm_dir)

    ds = build()
    path = ds._cache.path
    ds.release()
    assert not os.path.exists(path)
    os.makedirs(path, 0o700)
    for name in ("keep", "lease"):
        open(os.path.join(path, name), "w").close()
    plant_all(path, shm_plants(marker, "kept", tmp_path))
    t.add("planted_entries", n)
    from monai.data import DataLoader

    ds = build()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with t.trial("kept cache, DataLoader"):
            seen = sorted(int(b["i"]) for b in DataLoader(ds, batch_size=1, num_workers=2))
            t.check(seen == list(range(n)), f"the workers loaded {seen}")
        for i in range(n):
            with t.trial(f"kept cache, entry {i}"):
                right = item_problem(ds[i], i, 64) is None
                t.add("items_right", right)
                t.check(right, f"kept cache: entry {i} wrong")
    ds.release()
    from monai_cache.shm import remove_cache

    remove_cache(os.path.basename(path), shm_dir)
    executed = marker.executed()
    t.check(not executed, f"planted payloads were executed: {executed}")
    t.record(executed=len(executed), corrupt_in_live_cache=corrupt)
    t.assert_clean("planted_served", "executed", "crashes")


def test_planted_pickles_in_the_disk_cache_are_never_executed(tmp_path):
    from monai.data import DataLoader

    _assert_payload_is_live(tmp_path)
    marker = Markers(str(tmp_path / "PWNED"))
    t = Tally("hostile/planted-pickles-disk", "planted_files", "planted_records", "items_right", "crashes")
    cache = str(tmp_path / "cache")
    n = 5
    ds = PersistentDataset(data_list(n, 64), MakeItem(), cache_dir=cache)

    def disk_entry(key: str, content: bytes) -> bytes:
        """A well-formed disk file (right key tag and checksums) around an arbitrary blob."""
        head = disk_format.pack_header(0, len(content), len(content), zlib.crc32(content), key)
        return head + content

    def plant(path: str, content: bytes) -> None:
        with open(path, "wb") as f:
            f.write(content)
        t.add("planted_files")

    keys = [ds._entry_key(ds.data[i]) for i in range(n)]
    # nothing stored yet
    assert [ds.entry_path(i).name for i in range(n)] == [k + disk_format.ENTRY_SUFFIX for k in keys]
    plants = [
        payload_pickle(marker("entry-0")),
        _torch_save_bytes(marker("entry-1"), tmp_path),
        disk_entry(keys[2], _pickled_blob(marker("entry-2"))),
        disk_entry(keys[3], _pickled_blob(marker("entry-3"), in_metatensor=True)),
        disk_entry(keys[4], payload_pickle(marker("entry-4"))),
    ]
    for i, content in enumerate(plants):
        plant(ds.entry_path(i), content)
    for i in range(n):  # and MONAI's own cache file names, as MONAI's PersistentDataset would write them
        plant(os.path.join(cache, f"{keys[i].split('-')[0]}.pt"), _torch_save_bytes(marker(f"pt-{i}"), tmp_path))
    # and a planted pack: well-formed records (right key tags, checksums, index) holding pickles, indexed as
    # written in the far future so that they outrank whatever real record is appended later
    planted = os.path.join(cache, f"pack.{runtime.HOST_TAG}.{2**22 + 1}.0")
    records, index = b"", disk_format.index_header()
    contents = [  # what the entries 2, 3, 4 hold, then a codec entry with a pickled value, twice
        _pickled_blob(marker("record-0")), _pickled_blob(marker("record-1"), in_metatensor=True),
        payload_pickle(marker("record-2")), _pickled_blob(marker("record-3")), _pickled_blob(marker("record-4")),
    ]
    for i, content in enumerate(contents):
        key = keys[(i + 2) % n]
        record_bytes = disk_entry(key, content)
        index += disk_format.index_record(disk_format.key_tag(key), len(records), len(record_bytes), 2**63)
        records += record_bytes
        t.add("planted_records")
    plant(planted + disk_format.PACK_SUFFIX, records)
    plant(planted + disk_format.INDEX_SUFFIX, index)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with t.trial("DataLoader"):
            seen = sorted(int(b["i"]) for b in DataLoader(ds, batch_size=1, num_workers=2))
            t.check(seen == list(range(n)), f"the workers loaded {seen}")
        for i in range(n):
            with t.trial(f"entry {i}"):
                right = item_problem(ds[i], i, 64) is None
                t.add("items_right", right)
                t.check(right, f"entry {i} wrong")
        ds.flush()
    fresh = DiskStore(cache)
    for i in range(n):  # the planted files were replaced by real entries
        replaced = not os.path.exists(os.path.join(cache, keys[i] + disk_format.ENTRY_SUFFIX))
        t.check(replaced, f"the planted file of entry {i} is still there")
        with t.trial(f"fresh reader, entry {i}"), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a new reader meets the planted records first: reported, skipped
            got = fresh.get(keys[i])
            t.check(got is not MISSING and item_problem(got, i, 64) is None, f"fresh reader: entry {i} wrong")
    refused = fresh.stats()["process"]["corrupt"]
    t.check(refused == n, f"{refused} of {n} planted records met and refused")
    executed = marker.executed()
    t.check(not executed, f"planted payloads were executed: {executed}")
    t.record(executed=len(executed), records_refused_by_a_fresh_reader=refused)
    t.assert_clean("executed", "crashes")


def test_codec_never_unpickles_without_opt_in(tmp_path):
    marker = str(tmp_path / "PWNED")
    blob = _pickled_blob(marker)
    with pytest.raises(CorruptEntryError, match="allow_pickle"):
        decode(bytearray(blob))
    assert not os.path.exists(marker)
