"""Coverage-guided fuzzing (atheris / libFuzzer) of everything that parses cache bytes: the codec
(``codec.decode``), the disk file reader (``disk_format.read_blob``) and the shared-memory index slots.

Inputs are interpreted three ways (chosen by the first byte):

0. raw bytes handed to ``codec.decode`` (the prefix checksums stop almost everything: the baseline);
1. header text + data area, reassembled into a blob with *valid* lengths and checksums, so the fuzzer
   explores the JSON header and the decoder behind it (what a crafted entry can reach);
2. a disk file: 64-byte header (checksums recomputed) + payload, read with ``disk_format.read_blob`` from a memfd.

Allowed outcomes: a value, or ``CorruptEntryError``. Anything else is a crash that libFuzzer reports (with
the input saved as ``crash-*``). (Its first runs found two ways to make ``codec.decode`` raise something else,
now regression tests in test_hostile.py.)

Usage::

    pip install atheris
    python tests/reliability/fuzz_codec.py --make-corpus /tmp/corpus     # seed inputs from real items
    python tests/reliability/fuzz_codec.py /tmp/corpus -max_total_time=600 -rss_limit_mb=3072 -timeout=10

``tests/reliability/test_hostile.py::test_atheris_bounded_run`` (part of the suite: the test extras install
atheris on Linux x86-64 with Python 3.11-3.13) runs it for ``$MONAI_CACHE_ATHERIS_RUNS`` (default 100,000)
inputs from ``-seed=1``, about 10 s.
"""

from __future__ import annotations

import os
import struct
import sys
import zlib

import atheris

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

with atheris.instrument_imports(include=["monai_cache"]):
    from monai_cache import codec, disk_format

from _fuzzing import assemble, sample_items, split

MAX_CLAIM = 64 << 20  # disk mode: bigger claimed blobs are rejected by an allocation check, not worth the time


def _check(fn, *args, **kwargs) -> None:
    try:
        fn(*args, **kwargs)
    except codec.CorruptEntryError:
        pass


def _disk(data: bytes) -> None:
    if len(data) < disk_format.HEADER_SIZE:
        return
    head = bytearray(data[: disk_format.HEADER_SIZE])
    payload = data[disk_format.HEADER_SIZE :]
    struct.pack_into("<Q", head, 24, len(payload))  # stored length: what the file holds
    struct.pack_into("<I", head, 32, zlib.crc32(payload))
    if struct.unpack_from("<Q", head, 16)[0] > MAX_CLAIM:
        return
    struct.pack_into("<I", head, 60, zlib.crc32(bytes(head[:60])))
    fd = os.memfd_create("entry")
    try:
        os.write(fd, bytes(head) + payload)
        blob, _ = disk_format.read_blob(fd)
        codec.decode(blob)
    finally:
        os.close(fd)


def test_one_input(data: bytes) -> None:
    if not data:
        return
    mode, body = data[0] % 3, data[1:]
    if mode == 0:
        _check(codec.decode, bytearray(body), verify=bool(data[0] & 4))
    elif mode == 1:
        cut = body.find(b"\0\0\0\0")
        header, area = (body, b"") if cut < 0 else (body[:cut], body[cut + 4 :])
        _check(codec.decode, bytearray(assemble(header, area, fix_data_crc=False)))
    else:
        _check(_disk, body)


def make_corpus(directory: str) -> None:
    """Seed inputs in all three modes from real items (and their disk files)."""
    import zstandard

    os.makedirs(directory, exist_ok=True)
    n = 0
    for item in sample_items():
        for downcast in (False, True):
            blob = bytes(codec.encode(item, downcast=downcast).to_bytes())
            header, area = split(blob)
            payload = zstandard.ZstdCompressor().compress(blob)
            head = disk_format.pack_header(disk_format.FLAG_ZSTD, len(blob), len(payload), zlib.crc32(payload), "k")
            for seed in (b"\0" + blob, b"\1" + header + b"\0\0\0\0" + area, b"\2" + head + payload):
                with open(os.path.join(directory, f"seed{n}"), "wb") as f:
                    f.write(seed)
                n += 1


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--make-corpus":
        make_corpus(sys.argv[2])
        return
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
