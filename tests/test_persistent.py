"""``monai_cache.PersistentDataset`` against MONAI's own, on real NIfTI files, real DataLoader workers, real
processes (forked, SIGKILLed) and real mounts. Nothing is mocked; the only patching holds or slows writes."""

from __future__ import annotations

import contextlib
import inspect
import multiprocessing
import os
import pickle
import random
import signal
import subprocess
import tempfile
import time
import warnings
from collections.abc import Mapping

import nibabel as nib
import numpy as np
import pytest
import torch
from helpers import assert_signature_extends, bits, one_torch_thread, open_for_writing, python_c  # noqa: F401 (autouse)
from monai.data import DataLoader, MetaTensor
from monai.data import PersistentDataset as MonaiPersistentDataset
from monai.data.utils import pickle_hashing
from monai.transforms import (
    Compose,
    EnsureChannelFirstd,
    LoadImaged,
    MapTransform,
    Orientationd,
    RandCropByPosNegLabeld,
    ScaleIntensityRanged,
    Spacingd,
    Transform,
)
from test_disk import GatedWrites

from monai_cache import compat, disk_format, disk_writer
from monai_cache.persistent import PersistentDataset

# the drop-in tests: CI runs them on the oldest supported MONAI and on monai-weekly too (.ci/run)
pytestmark = pytest.mark.dropin

FORK = multiprocessing.get_context("fork")
KEYS = ("image", "label")


@pytest.fixture(scope="module")
def nifti(tmp_path_factory) -> list[dict]:
    """Five real CT-like NIfTI pairs (int16 image, air -1000 and blobs; uint8 label), 32x32x24 voxels."""
    root = tmp_path_factory.mktemp("nifti")
    rng = np.random.default_rng(0)
    zz, yy, xx = np.ogrid[:32, :32, :24]
    data = []
    for i in range(5):
        img = np.full((32, 32, 24), -1000, np.int16)
        lab = np.zeros((32, 32, 24), np.uint8)
        for k in range(3):
            c = rng.integers(6, 20, 3)
            m = (zz - c[0]) ** 2 + (yy - c[1]) ** 2 + (xx - c[2]) ** 2 < int(rng.integers(9, 36))
            img[m] = rng.integers(20, 200)
            lab[m] = k % 2 + 1
        img = img + (rng.normal(0, 8, img.shape) * (img > -1000)).astype(np.int16)
        affine = np.diag([1.2 + 0.1 * i, 1.0, 2.0, 1.0])
        ip, lp = root / f"img{i}.nii.gz", root / f"lab{i}.nii.gz"
        nib.save(nib.Nifti1Image(img, affine), str(ip))
        nib.save(nib.Nifti1Image(lab, affine), str(lp))
        data.append({"image": str(ip), "label": str(lp)})
    return data


def chain(pixdim=(1.5, 1.5, 2.0), crop: bool = True) -> Compose:
    ts = [
        LoadImaged(keys=KEYS),
        EnsureChannelFirstd(keys=KEYS),
        Orientationd(keys=KEYS, axcodes="RAS", labels=None),
        Spacingd(keys=KEYS, pixdim=pixdim, mode=("bilinear", "nearest")),
        ScaleIntensityRanged(keys="image", a_min=-57, a_max=164, b_min=0.0, b_max=1.0, clip=True),
    ]
    if crop:
        ts.append(RandCropByPosNegLabeld(keys=KEYS, label_key="label", spatial_size=(8, 8, 8), num_samples=2))
    return Compose(ts)


def epoch(ds, seed: int = 0) -> list:
    ds.transform.set_random_state(seed)
    return [ds[i] for i in range(len(ds))]


def same(a, b, path: str = "item", meta: bool = True) -> None:
    """Deep equality: types, dtypes, values, and (if ``meta``) MetaTensor metadata."""
    assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{path}: {a.dtype}{tuple(a.shape)} != {b.dtype}{b.shape}"
        assert torch.equal(bits(a.as_subclass(torch.Tensor)), bits(b.as_subclass(torch.Tensor))), path  # NaN == NaN
        if meta and isinstance(a, MetaTensor):
            same(dict(a.meta), dict(b.meta), path + ".meta")
            same(list(a.applied_operations), list(b.applied_operations), path + ".applied_operations")
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"), path
    elif isinstance(a, Mapping):
        assert set(map(str, a)) == set(map(str, b)), f"{path}: keys {sorted(map(str, a))} != {sorted(map(str, b))}"
        bs = {str(k): v for k, v in b.items()}
        for k, v in a.items():
            if str(k) != "id":  # TraceKeys.ID: the address of a transform object, different in every process
                same(v, bs[str(k)], f"{path}[{k!r}]", meta)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{path}[{i}]", meta)
    elif isinstance(a, float) and np.isnan(a):
        assert np.isnan(b), path
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def files(directory, suffix: str = ".mcache") -> list[str]:
    """Names of the files ending with ``suffix``; for ``.mcache``: the stored entries, packed records included
    (named ``<pack>@<offset>``), one per key."""
    if suffix == ".mcache":
        return sorted(
            os.path.basename(e.path) + (f"@{e.offset}" if e.packed else "")
            for e in disk_format.stored_entries(str(directory))
        )
    return sorted(n for n in os.listdir(directory) if n.endswith(suffix))


def our_files(directory) -> list[str]:
    """The files monai_cache wrote: entry files, packs and pack indexes."""
    return sorted(n for n in os.listdir(directory) if n.endswith((".mcache", ".mcpack", ".mcidx")))


def mc_warnings(records) -> list[str]:
    return [str(w.message) for w in records if "monai_cache" in str(w.message)]


@contextlib.contextmanager
def mounted_tmpfs(path, options: str):
    os.makedirs(path, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.decode().strip()}); needs root/CAP_SYS_ADMIN")
    try:
        yield str(path)
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


# ------------------------------------------------------------------------------------------ drop-in
def test_signature_is_monais_plus_keyword_only_extras():
    extras = assert_signature_extends(PersistentDataset, MonaiPersistentDataset)
    kinds = {p.kind for name, p in inspect.signature(PersistentDataset).parameters.items() if name in extras}
    assert kinds == {inspect.Parameter.KEYWORD_ONLY}


# The track_meta values the installed MONAI's class has a meaning for: both from 1.6 on; before, its one way (1.5:
# plain tensors; 1.3 and 1.4: the items as computed, which our default None gives there).
MONAIS_TRACK_META = [False, True] if compat.PERSISTENT_ACCEPTS_TRACK_META else [compat.PERSISTENT_TRACK_META_DEFAULT]


@pytest.mark.parametrize("track_meta", MONAIS_TRACK_META)
def test_same_outputs_as_monai_on_misses_and_hits(nifti, tmp_path, track_meta):
    monai_kw = {"track_meta": track_meta} if compat.PERSISTENT_ACCEPTS_TRACK_META else {}
    monai_ds = MonaiPersistentDataset(nifti, chain(), tmp_path / "monai", **monai_kw)
    ours = PersistentDataset(nifti, chain(), tmp_path / "ours", track_meta=track_meta)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        m_miss, m_hit = epoch(monai_ds), epoch(monai_ds)
    o_miss = epoch(ours)
    assert ours.flush(30)
    o_hit = epoch(ours)
    stats = ours.cache_stats()["process"]
    assert stats["misses"] == len(nifti) and stats["hits"] == len(nifti) and stats["writes"] == len(nifti)
    keeps_meta = track_meta is not False
    for i in range(len(nifti)):
        same(o_miss[i], o_hit[i], f"ours miss/hit {i}")
        same(o_hit[i], m_hit[i], f"ours/monai hit {i}")
        same(o_miss[i], m_miss[i], f"ours/monai miss {i}", meta=keeps_meta)  # values always
    # What the random transforms receive: the same type on both of our paths.
    pre_miss = PersistentDataset(nifti, chain(), tmp_path / "pre", track_meta=track_meta)._cachecheck(nifti[0])
    pre_hit = PersistentDataset(nifti, chain(), tmp_path / "pre", track_meta=track_meta, async_writes=False)
    pre_hit._cachecheck(nifti[0])
    pre_hit = pre_hit._cachecheck(nifti[0])
    expected = MetaTensor if keeps_meta else torch.Tensor
    assert type(pre_miss["image"]) is expected and type(pre_hit["image"]) is expected
    same(pre_miss, pre_hit)
    if track_meta is False:  # MONAI's inconsistency that this fixes: a MetaTensor on a miss, a Tensor on a hit
        m = MonaiPersistentDataset(nifti, chain(), tmp_path / "monai2")
        assert type(m._cachecheck(nifti[0])["image"]) is MetaTensor
        assert type(m._cachecheck(nifti[0])["image"]) is torch.Tensor
    elif track_meta:  # MONAI 1.6 cannot torch.load(weights_only=True) its own MetaTensor files: it recomputes them
        assert any("Corrupt cache file" in str(w.message) for w in rec)


@pytest.mark.parametrize("track_meta", [False, True])
def test_track_meta_keeps_its_meaning_with_every_monai_version(nifti, tmp_path, track_meta):
    """MONAI 1.6's ``track_meta``, also where the installed MONAI's class has no such parameter (before 1.6):
    ``MetaTensor`` objects with their metadata, or plain tensors, on misses and hits alike, with MONAI's values."""
    monai_first = epoch(MonaiPersistentDataset(nifti, chain(), tmp_path / "monai"))  # a miss: computed as is
    ours = PersistentDataset(nifti, chain(), tmp_path / "ours", track_meta=track_meta, async_writes=False)
    assert ours.track_meta is track_meta
    o_miss, o_hit = epoch(ours), epoch(ours)
    assert ours.cache_stats()["process"]["hits"] == len(nifti)
    for i in range(len(nifti)):
        same(o_miss[i], o_hit[i], f"ours miss/hit {i}")
        same(o_hit[i], monai_first[i], f"ours/monai {i}", meta=track_meta)
    expected = MetaTensor if track_meta else torch.Tensor
    assert all(type(ours._cachecheck(item)["image"]) is expected for item in nifti)
    if track_meta:
        assert ours._cachecheck(nifti[0])["image"].meta["filename_or_obj"] == nifti[0]["image"]


def test_dataloader_workers_flush_at_exit_and_match_monai(nifti, tmp_path, monkeypatch):
    original = disk_writer.write_record

    def slow(*args, **kwargs):  # inherited by the forked workers: writes are still pending when they exit
        time.sleep(0.25)
        return original(*args, **kwargs)

    monkeypatch.setattr(disk_writer, "write_record", slow)
    ours = PersistentDataset(nifti, chain(), tmp_path / "ours")
    monai_ds = MonaiPersistentDataset(nifti, chain(), tmp_path / "monai")

    def run(ds):
        torch.manual_seed(0)  # the workers' seeds (and so the random crops) derive from this
        loader = DataLoader(ds, batch_size=1, num_workers=2, shuffle=False)
        return [batch for batch in loader]

    m1, o1 = run(monai_ds), run(ours)
    # the workers exited (os._exit, no atexit): their pending writes were flushed on the way out
    assert len(files(tmp_path / "ours")) == len(nifti)
    total = ours.cache_stats()["total"]
    assert total["misses"] == len(nifti) and total["writes"] == len(nifti) and total["writes_pending"] == 0
    assert ours.cache_stats()["process"]["misses"] == 0  # it all happened in the workers
    m2, o2 = run(monai_ds), run(ours)
    assert ours.cache_stats()["total"]["hits"] == len(nifti)
    for i in range(len(nifti)):
        same(o1[i], o2[i], f"ours epochs {i}")
        same(o2[i], m2[i], f"ours/monai {i}")
        same(o1[i], m1[i], f"ours/monai first epoch {i}", meta=False)
    assert our_files(tmp_path / "ours")
    for name in our_files(tmp_path / "ours"):
        assert oct(os.stat(tmp_path / "ours" / name).st_mode & 0o777) == "0o600"
    assert oct(os.stat(tmp_path / "ours").st_mode & 0o777) == "0o700"


MAIN_PROCESS_EXIT = """
import sys, time
sys.path.insert(0, {tests!r})
import torch
from monai.transforms import Compose, Transform
import monai_cache.disk_writer as disk_writer
from monai_cache import PersistentDataset

original = disk_writer.write_record


def slow(*args, **kwargs):  # a slow store: writes are still pending when the interpreter exits
    time.sleep(0.3)
    return original(*args, **kwargs)


disk_writer.write_record = slow


class Make(Transform):
    def __call__(self, i):
        return {{"v": torch.arange(100_000.0) + i}}  # 400 KB: an entry file each


ds = PersistentDataset(list(range(6)), Compose([Make()]), cache_dir={cache_dir!r})
for i in range(6):
    ds[i]
print(ds.cache_stats()["process"]["writes_pending"])
"""


def test_main_process_flushes_pending_writes_at_normal_exit(tmp_path):
    """num_workers=0, notebooks, validation loops: the exit flush in the process that built the dataset."""
    import subprocess

    script = MAIN_PROCESS_EXIT.format(tests=os.path.dirname(os.path.abspath(__file__)), cache_dir=str(tmp_path))
    r = subprocess.run(python_c(script), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "Traceback" not in r.stderr and "Error" not in r.stderr, r.stderr
    assert int(r.stdout.split()[-1]) >= 2  # writes were pending when the script ended
    assert len(our_files(tmp_path)) == 6
    ds = PersistentDataset(list(range(6)), Compose([_Arange()]), tmp_path, async_writes=False)
    assert [float(ds[i]["v"][0]) for i in range(6)] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]


class _Arange(Transform):
    def __call__(self, i):
        return {"v": torch.arange(100_000.0) + i}


FIFO_READER = """
import os, sys
import torch
from monai.transforms import Compose, Transform
from monai_cache import PersistentDataset


class Make(Transform):
    def __call__(self, i):
        return {{"v": torch.arange(100_000.0) + i}}


ds = PersistentDataset([0, 1], Compose([Make()]), cache_dir={cache_dir!r})
os.mkfifo(ds.entry_path(0))  # under an entry's name
os.mkfifo(os.path.join({cache_dir!r}, "pack.0a7c9cdf.1.1.mcidx"))  # under a pack index's name
print(float(ds[0]["v"][0]), float(ds[1]["v"][1]))
"""


def test_a_fifo_in_the_cache_dir_never_blocks_a_reader(tmp_path):
    import subprocess

    script = FIFO_READER.format(cache_dir=str(tmp_path / "c"))
    r = subprocess.run(python_c(script), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["0.0", "2.0"]


def test_pickle_and_hooks(nifti, tmp_path):
    ds = PersistentDataset(nifti, chain(crop=False), tmp_path, async_writes=False)
    first = ds[0]
    clone = pickle.loads(pickle.dumps(ds))  # what a spawned DataLoader worker gets
    same(clone[0], first)
    assert clone.cache_stats()["process"]["hits"] == 1

    class Doubling(PersistentDataset):
        def _post_transform(self, item_transformed):
            out = dict(item_transformed)
            out["image"] = out["image"] * 2
            return out

    sub = Doubling(nifti, chain(crop=False), tmp_path)
    assert torch.equal(sub[0]["image"], first["image"] * 2)
    assert sub.cache_stats()["process"]["hits"] == 1


# -------------------------------------------------------------------------------------------- async
def test_a_cache_miss_returns_before_its_write_and_a_sync_one_after_it(nifti, tmp_path, monkeypatch):
    gate = GatedWrites(monkeypatch)
    ds = PersistentDataset(nifti, chain(), tmp_path / "async")
    for i in range(2):
        ds[i]
        assert ds.cache_stats()["process"]["writes_pending"] == i + 1  # returned while its write was held
    assert files(tmp_path / "async") == []
    gate.open()
    assert ds.flush(30)
    assert len(files(tmp_path / "async")) == 2
    sync = PersistentDataset(nifti, chain(), tmp_path / "sync", async_writes=False)
    for i in range(2):
        sync[i]
        assert len(files(tmp_path / "sync")) == i + 1  # written before the read returned


# ------------------------------------------------------------------------------------ stale entries
def test_changed_transform_never_serves_old_entries(nifti, tmp_path):
    a = PersistentDataset(nifti[:2], chain(crop=False), tmp_path, async_writes=False)
    out_a = [a[i] for i in range(2)]
    b = PersistentDataset(nifti[:2], chain(pixdim=(2.0, 2.0, 2.0), crop=False), tmp_path, async_writes=False)
    out_b = [b[i] for i in range(2)]
    assert b.cache_stats()["process"]["hits"] == 0 and len(files(tmp_path)) == 4
    assert out_a[0]["image"].shape != out_b[0]["image"].shape
    a2 = PersistentDataset(nifti[:2], chain(crop=False), tmp_path, async_writes=False)
    same(a2[0], out_a[0])
    assert a2.cache_stats()["process"]["hits"] == 1
    # options that change the stored content are part of the names too
    t = PersistentDataset(nifti[:2], chain(crop=False), tmp_path, async_writes=False, track_meta=True)
    assert isinstance(t[0]["image"], MetaTensor) and t.cache_stats()["process"]["hits"] == 0


@pytest.mark.parametrize("setting", ["lossy_dtypes", "reset_ops_id", "allow_pickle", "set_track_meta", "monai"])
def test_every_setting_that_changes_an_entry_names_other_files(nifti, tmp_path, monkeypatch, setting):
    """An entry is never served to a dataset whose settings would store another one: the lossy dtypes,
    ``reset_ops_id``, ``allow_pickle``, MONAI's global ``set_track_meta`` and the MONAI version that computed it
    (its transforms are fingerprinted by name) are part of the file names. The second dataset computes its item
    and gives what it gives on a directory of its own."""
    import monai
    from monai.data import get_track_meta, set_track_meta

    def chain_without_meta_needs() -> Compose:  # runs with MONAI's set_track_meta(False) too
        return Compose([LoadImaged(keys=KEYS), EnsureChannelFirstd(keys=KEYS, channel_dim="no_channel"),
                        ScaleIntensityRanged(keys="image", a_min=-57, a_max=164, b_min=0.0, b_max=1.0, clip=True)])

    PersistentDataset(nifti[:1], chain_without_meta_needs(), tmp_path / "cache", async_writes=False)[0]
    kwargs: dict = {"lossy_dtypes": {"image": "float16"}, "reset_ops_id": False, "allow_pickle": True}
    kwargs = {setting: kwargs[setting]} if setting in kwargs else {}
    if setting == "monai":
        monkeypatch.setattr(monai, "__version__", monai.__version__ + ".post99")
    track_meta = get_track_meta()
    set_track_meta(setting != "set_track_meta")
    try:
        other = PersistentDataset(nifti[:1], chain_without_meta_needs(), tmp_path / "cache", async_writes=False,
                                  **kwargs)
        got = other[0]
        alone = PersistentDataset(nifti[:1], chain_without_meta_needs(), tmp_path / "alone", async_writes=False,
                                  **kwargs)
        same(got, alone[0])
    finally:
        set_track_meta(track_meta)
    assert other.cache_stats()["process"]["hits"] == 0 and len(files(tmp_path / "cache")) == 2


def test_a_changed_lambda_or_captured_value_never_serves_old_entries(nifti, tmp_path):
    """User code is fingerprinted by value: a lambda over another constant or closure value is another chain."""
    from monai.transforms import Lambdad

    def scaled_by(factor):
        return lambda x: x * factor

    outs = []
    for func in (lambda x: x * 2, lambda x: x * 3, scaled_by(5)):
        transform = Compose([*chain(crop=False).transforms, Lambdad("image", func)])
        ds = PersistentDataset(nifti[:1], transform, tmp_path, async_writes=False)
        outs.append((ds[0]["image"], ds.cache_stats()["process"]["hits"]))
    assert [hits for _, hits in outs] == [0, 0, 0]
    assert torch.equal(outs[0][0] * 3, outs[1][0] * 2) and torch.equal(outs[0][0] * 5, outs[2][0] * 2)


def test_explicit_hash_transform_keeps_monais_meaning(nifti, tmp_path):
    def fixed(_transforms) -> bytes:
        return b"v1"

    a = PersistentDataset(nifti[:1], chain(crop=False), tmp_path, hash_transform=fixed, async_writes=False)
    out_a = a[0]
    assert a.transform_hash == "v1" and a._entry_key(nifti[0]).startswith(pickle_hashing(nifti[0]).decode() + "v1-")
    assert len(files(tmp_path)) == 1 and a.entry_location(0) is not None
    # the user's hash says "same transforms": as in MONAI, the entry is served
    b = PersistentDataset(nifti[:1], chain(pixdim=(2.0, 2.0, 2.0), crop=False), tmp_path, hash_transform=fixed)
    same(b[0], out_a)
    assert b.cache_stats()["process"]["hits"] == 1
    b.set_transform_hash(pickle_hashing)  # public method still works and changes the names
    assert b.transform_hash != "v1"
    assert b[0]["image"].shape != out_a["image"].shape and b.cache_stats()["process"]["misses"] == 1


# ------------------------------------------------------------------------ MONAI's files, bad files
class _Evil:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("weights_only", [True, False])
def test_monai_cache_dir_with_planted_pickle_is_never_unpickled(nifti, tmp_path, weights_only):
    monai_ds = MonaiPersistentDataset(nifti, chain(), tmp_path)
    epoch(monai_ds)
    expected = epoch(monai_ds)  # MONAI's cache-hit outputs
    pts = files(tmp_path, ".pt")
    assert len(pts) == len(nifti)
    marker = tmp_path / "executed"
    evil = tmp_path / f"{pickle_hashing(nifti[0]).decode()}.pt"
    assert evil.exists()
    with open(evil, "wb") as f:
        pickle.dump({"image": _Evil(str(marker))}, f)
    before = {n: os.stat(tmp_path / n).st_mtime_ns for n in pts}
    ours = PersistentDataset(nifti, chain(), tmp_path, weights_only=weights_only)
    got = epoch(ours)
    ours.flush(30)
    got2 = epoch(ours)
    for i in range(len(nifti)):
        same(got[i], expected[i])
        same(got2[i], expected[i])
    assert not marker.exists()
    assert {n: os.stat(tmp_path / n).st_mtime_ns for n in files(tmp_path, ".pt")} == before  # left alone
    assert len(files(tmp_path)) == len(nifti)
    # our own entry (a record in a pack) overwritten with a pickle is refused as well
    loc = ours.entry_location(1)
    assert loc is not None and loc.packed
    planted = pickle.dumps({"image": _Evil(str(marker))})[: loc.length]
    with open(loc.path, "r+b") as f:
        f.seek(loc.offset)
        f.write(planted)
    ours.transform.set_random_state(0)
    ours[0]
    with pytest.warns(RuntimeWarning, match="corrupt disk cache record"):
        same(ours[1], expected[1])
    assert not marker.exists()


@pytest.mark.parametrize("kind", ["truncated", "zero-length", "flip-header", "flip-payload", "foreign"])
def test_corrupt_files_are_reported_once_removed_and_recomputed(nifti, tmp_path, kind):
    ds = PersistentDataset(nifti[:2], chain(crop=False), tmp_path, async_writes=False)
    expected = ds[0]
    path = ds.entry_path(0)  # the pack: this item's record is its only one
    loc = ds.entry_location(0)
    assert loc.packed and loc.offset == 0 and loc.length == path.stat().st_size
    raw = bytearray(path.read_bytes())
    if kind == "truncated":
        raw = raw[: len(raw) - 7]
    elif kind == "zero-length":
        raw = bytearray()
    elif kind == "flip-header":
        raw[13] ^= 0x10
    elif kind == "flip-payload":
        raw[-20] ^= 0x01
    else:
        raw = bytearray(b"\x89PNG\r\n\x1a\n" + bytes(200))
    path.write_bytes(raw)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        same(ds[0], expected)
        same(ds[0], expected)
    msgs = mc_warnings(rec)
    assert len(msgs) == 1 and "corrupt disk cache record" in msgs[0], msgs
    rewritten = ds.entry_location(0)
    assert rewritten != loc and rewritten.offset >= loc.length  # appended anew; supersedes the bad record
    same(disk_format.read_packed(rewritten), expected)  # rewritten, valid
    same(PersistentDataset(nifti[:2], chain(crop=False), tmp_path)[0], expected)  # what a new reader gets
    s = ds.cache_stats()["process"]
    assert s["corrupt"] == 1 and s["hits"] == 1 and s["misses"] == 2


# ------------------------------------------------------------------------------------------ errors
def test_cache_dir_that_is_a_file_is_a_clear_error(nifti, tmp_path):
    f = tmp_path / "cache"
    f.write_text("")
    with pytest.raises(ValueError, match=r"exists and is not a directory.*cache_dir=None"):
        PersistentDataset(nifti, chain(), f)


def test_uncreatable_cache_dir_warns_once_and_trains_uncached(nifti, tmp_path):
    (tmp_path / "file").write_text("")
    reference = epoch(PersistentDataset(nifti[:2], chain(), None))
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        ds = PersistentDataset(nifti[:2], chain(), tmp_path / "file" / "cache")
        out = epoch(ds) + epoch(ds)
    msgs = mc_warnings(rec)
    assert len(msgs) == 1 and "cannot create the cache directory" in msgs[0], msgs
    for i, o in enumerate(out):
        same(o, reference[i % 2])
    assert ds.cache_stats()["process"]["writes"] == 0


def test_read_only_cache_dir_warns_once_and_trains_uncached(nifti, tmp_path):
    reference = epoch(PersistentDataset(nifti[:2], chain(), None))
    with mounted_tmpfs(tmp_path / "ro", "size=1m,ro") as ro:
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            ds = PersistentDataset(nifti[:2], chain(), ro)
            torch.manual_seed(0)
            for _ in DataLoader(ds, num_workers=2):
                pass
            out = epoch(ds)
        msgs = mc_warnings(rec)
        assert len(msgs) == 1 and "Read-only file system" in msgs[0], msgs
        for i, o in enumerate(out):
            same(o, reference[i])
        assert os.listdir(ro) == []


class _Noise(MapTransform):
    """Deterministic, incompressible: ``size`` random floats derived from the item's seed."""

    def __init__(self, keys, size: int = 100_000) -> None:
        super().__init__(keys)
        self.size = size

    def __call__(self, data):
        d = dict(data)
        d["image"] = noise(d["seed"], self.size)
        return d


def noise(seed: int, size: int = 100_000) -> torch.Tensor:
    return torch.rand(size, generator=torch.Generator().manual_seed(seed))


def test_full_disk_warns_once_and_trains_uncached(tmp_path):
    data = [{"seed": i} for i in range(6)]
    with mounted_tmpfs(tmp_path / "small", "size=1m") as small:
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            ds = PersistentDataset(data, Compose([_Noise("seed")]), small, compression=None)
            out = [ds[i] for i in range(6)]
            ds.flush(30)
            out += [ds[i] for i in range(6)]
        msgs = mc_warnings(rec)
        assert len(msgs) == 1 and "is full" in msgs[0], msgs
        for i, o in enumerate(out):
            assert torch.equal(o["image"], noise(i % 6))
        s = ds.cache_stats()["process"]
        assert 1 <= s["writes"] < 6 and s["hits"] == s["writes"]
        assert all(n.endswith(".mcache") for n in os.listdir(small))


def test_pickle_module_is_checked_only_where_monai_would_write(tmp_path):
    for cls in (MonaiPersistentDataset, PersistentDataset):  # cache_dir=None never writes: MONAI accepts it
        assert cls([{"x": 1}], None, None, pickle_module="no-such-module")[0] == {"x": 1}
    with pytest.raises(ValueError, match="no-such-module"):
        PersistentDataset([{"x": 1}], None, tmp_path, pickle_module="no-such-module")


def test_cache_dir_none_behaves_as_uncached(nifti, tmp_path):
    ds = PersistentDataset(nifti[:2], chain(), None)
    cached = PersistentDataset(nifti[:2], chain(), tmp_path, async_writes=False)
    for a, b in zip(epoch(ds), epoch(cached)):
        same(a, b)
    assert ds.cache_dir is None and ds.cache_stats()["total"]["misses"] == 0 and ds.flush()


# ------------------------------------------------------------------------------------------ options
def test_set_data_clears_the_directory_and_drops_pending_writes(nifti, tmp_path):
    cache = tmp_path / "c"
    ds = PersistentDataset(nifti[:2], chain(crop=False), cache)
    (tmp_path / "c" / "user-file.pt").write_bytes(b"x")
    ds[0], ds[1]
    ds.set_data(nifti[2:4])
    assert ds.flush(30)
    assert files(cache) == [] and os.listdir(cache) == []  # rmtree'd and recreated, as MONAI does
    assert oct(os.stat(cache).st_mode & 0o777) == "0o700"
    same(ds[0], PersistentDataset(nifti[2:4], chain(crop=False), None)[0])
    assert ds.flush(30) and len(files(cache)) == 1


def test_lossy_dtypes_are_explicit_and_consistent(nifti, tmp_path):
    exact = PersistentDataset(nifti[:1], chain(crop=False), tmp_path / "exact", async_writes=False)
    lossy = PersistentDataset(
        nifti[:1], chain(crop=False), tmp_path / "lossy", async_writes=False, lossy_dtypes={"image": "float16"}
    )
    e, miss, hit = exact[0], lossy[0], lossy[0]
    same(miss, hit)  # a miss returns the value rounded as stored
    assert hit["image"].dtype == torch.float32
    assert torch.equal(hit["image"], e["image"].half().float()) and not torch.equal(hit["image"], e["image"])
    assert torch.equal(hit["label"], e["label"])  # other keys stay lossless
    assert lossy.entry_location(0).length < exact.entry_location(0).length


class _AddObject(MapTransform):
    def __call__(self, data):
        d = dict(data)
        d["obj"] = {1, 2, 3}  # a set: the codec stores it only with pickle
        return d


def test_unsupported_values_warn_once_or_use_explicit_pickle(nifti, tmp_path):
    t = Compose([*chain(crop=False).transforms, _AddObject(keys="image")])
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        ds = PersistentDataset(nifti[:2], t, tmp_path / "a", async_writes=False)
        out = [ds[0], ds[1], ds[0]]
    msgs = mc_warnings(rec)
    assert len(msgs) == 1 and "item['obj']" in msgs[0] and "allow_pickle=True" in msgs[0], msgs
    assert out[0]["obj"] == {1, 2, 3} and files(tmp_path / "a") == []
    ds = PersistentDataset(nifti[:2], t, tmp_path / "b", async_writes=False, allow_pickle=True)
    first = ds[0]
    same(ds[0], first)
    assert ds.cache_stats()["process"]["hits"] == 1 and ds[0]["obj"] == {1, 2, 3}


# ------------------------------------------------------------------------------ processes and kills
def _iterate(data, cache_dir, order_seed: int, q) -> None:
    torch.set_num_threads(1)
    ds = PersistentDataset(data, chain(crop=False), cache_dir)
    order = list(range(len(data)))
    random.Random(order_seed).shuffle(order)
    q.put({i: ds[i]["image"].sum().item() for i in order})


def test_two_processes_filling_one_cache_dir_at_once(nifti, tmp_path):
    q = FORK.Queue()
    procs = [FORK.Process(target=_iterate, args=(nifti, str(tmp_path), s, q)) for s in (1, 2)]
    for p in procs:
        p.start()
    sums = [q.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert sums[0] == sums[1]
    names = files(tmp_path)
    assert len(names) == len(nifti) and not any(n.endswith(".tmp") for n in os.listdir(tmp_path))
    ds = PersistentDataset(nifti, chain(crop=False), tmp_path)
    reference = PersistentDataset(nifti, chain(crop=False), None)
    for i in range(len(nifti)):
        same(ds[i], reference[i])
    assert ds.cache_stats()["process"]["hits"] == len(nifti)


def _iterate_forever(data, cache_dir) -> None:
    torch.set_num_threads(1)
    ds = PersistentDataset(data, Compose([_Noise("seed", 250_000)]), cache_dir, max_pending_writes=2)
    while True:
        for i in range(len(data)):
            ds[i]


def test_sigkill_during_writes_then_every_file_is_valid_or_recomputed(tmp_path):
    data = [{"seed": i} for i in range(200)]
    rng = random.Random(7)
    mid_write = 0

    def writing(pid: int) -> bool:  # it holds a file of the cache dir open for writing: inside a write
        return open_for_writing(pid, tmp_path) > 0

    # After a random time, kill as soon as the process is seen inside a write (a write takes a few ms of each
    # item's time, so random kills alone can keep missing it on a loaded machine), or after 0.3 s more; go on
    # (up to 40 kills) until two kills have landed inside a write.
    for _ in range(40):
        if mid_write >= 2:
            break
        p = FORK.Process(target=_iterate_forever, args=(data, str(tmp_path)))
        p.start()
        time.sleep(rng.uniform(0.05, 0.3))
        deadline = time.monotonic() + 0.3
        while time.monotonic() < deadline and not writing(p.pid):
            time.sleep(0.001)
        os.kill(p.pid, signal.SIGSTOP)  # what it holds at the moment it dies
        mid_write += writing(p.pid)
        os.kill(p.pid, signal.SIGKILL)
        p.join(10)
    assert mid_write > 0, "no kill landed during a write (the test did not exercise the hazard)"
    ds = PersistentDataset(data, Compose([_Noise("seed", 250_000)]), tmp_path, async_writes=False)
    # the entries as the new dataset found them: opening adopts a killed writer's complete temporary file (one
    # killed between its last byte and the rename), so they may be one more than the files listed before
    names = files(tmp_path)
    assert names
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for i in range(len(data)):
            assert torch.equal(ds[i]["image"], noise(i, 250_000))
    assert mc_warnings(rec) == []  # no file under a final name was partial
    s = ds.cache_stats()["process"]
    assert s["hits"] == len(names) and s["corrupt"] == 0
    assert all(n.endswith(".mcache") for n in os.listdir(tmp_path))  # the killed writers' temp files were swept
    seed_of = {ds.entry_path(i).name: i for i in range(len(data))}
    for name in files(tmp_path):
        assert torch.equal(disk_format.read_entry(str(tmp_path / name))["image"], noise(seed_of[name], 250_000))


# ------------------------------------------------------------------------------ removing the cache dir
class _NoiseOfSize(MapTransform):
    """Deterministic, incompressible: an item of ``sizes[seed % len(sizes)]`` random floats."""

    def __init__(self, keys, sizes) -> None:
        super().__init__(keys)
        self.sizes = tuple(sizes)

    def __call__(self, data):
        d = dict(data)
        d["image"] = noise(d["seed"], self.sizes[d["seed"] % len(self.sizes)])
        return d


def test_removing_the_cache_dir_right_after_use_wins(tmp_path):
    """MONAI's own ``test_persistentdataset.py`` (``test_shape``) reads a dataset inside a
    ``tempfile.TemporaryDirectory()`` and leaves the block while writes are still pending: the directory's
    removal must win every time: no error, nothing recreated, no warning, whether the pending entries are
    files of their own or records of a pack."""
    data = [{"seed": i} for i in range(6)]
    transform = Compose([_NoiseOfSize("seed", (400_000, 4_000))])  # 1.6 MB entry files and 16 KB packed records
    rounds, pending_at_removal, errors = 50, 0, []
    for _ in range(rounds):
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            try:
                with tempfile.TemporaryDirectory(dir=tmp_path) as tmp:
                    cache_dir = os.path.join(tmp, "cache", "data")
                    ds = PersistentDataset(data, transform, cache_dir)
                    for i in range(len(data)):
                        ds[i]
                    pending_at_removal += ds.cache_stats()["process"]["writes_pending"] > 0
            except OSError as e:
                errors.append(e)
            assert ds.flush(30)  # the writer finished what it held: into the removed directory, or nowhere
            assert not os.path.lexists(tmp), "the cache directory was recreated"
            del ds
        # (warnings of other tests' datasets, still finishing in the background, may be recorded here too)
        assert [m for m in mc_warnings(rec) if str(tmp_path) in m] == []
    assert errors == []
    assert os.listdir(tmp_path) == []
    # the hazard was there: in most rounds writes were still pending when the directory went
    assert pending_at_removal >= rounds // 2, pending_at_removal
