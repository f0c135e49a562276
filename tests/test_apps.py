"""``monai_cache.apps`` against ``monai.apps``, on small local data written in the layout each class expects
(JPEG files for MedNIST, a Decathlon task of real NIfTI files written with nibabel, TCIA series directories);
nothing is downloaded. Real shared memory and real DataLoader worker processes."""

from __future__ import annotations

import inspect
import json
import os
import pickle
from collections.abc import Mapping

import monai.apps
import monai.data
import nibabel as nib
import numpy as np
import pytest
import torch
from helpers import assert_signature_extends, one_torch_thread  # noqa: F401 (an autouse fixture)
from monai.data import DataLoader
from monai.transforms import (
    Compose,
    EnsureChannelFirstd,
    LoadImaged,
    MapTransform,
    RandFlipd,
    RandSpatialCropd,
    ScaleIntensityd,
)
from PIL import Image
from test_codec import assert_same

import monai_cache
from monai_cache.apps import DecathlonDataset, MedNISTDataset, TciaDataset
from monai_cache.shm import SharedMemoryStore

# the drop-in tests: CI runs them on the oldest supported MONAI and on monai-weekly too (.ci/run)
pytestmark = pytest.mark.dropin

SECTIONS = ("training", "validation", "test")
APPS = [(MedNISTDataset, monai.apps.MedNISTDataset), (DecathlonDataset, monai.apps.DecathlonDataset),
        (TciaDataset, monai.apps.TciaDataset)]  # fmt: skip


@pytest.fixture(scope="module")
def mednist_root(tmp_path_factory) -> str:
    """``root/MedNIST/<class>/<n>.jpeg``: 3 classes of 6 grey 16x16 images."""
    root = tmp_path_factory.mktemp("mednist")
    rng = np.random.default_rng(0)
    for name in ("AbdomenCT", "ChestCT", "Hand"):
        folder = root / "MedNIST" / name
        folder.mkdir(parents=True)
        for i in range(6):
            Image.fromarray(rng.integers(0, 256, (16, 16), dtype=np.uint8)).save(folder / f"{i:06d}.jpeg")
    return str(root)


@pytest.fixture(scope="module")
def decathlon_root(tmp_path_factory) -> str:
    """``root/Task09_Spleen/dataset.json`` with 6 training pairs and 2 test images, NIfTI files written with
    nibabel."""
    root = tmp_path_factory.mktemp("decathlon")
    task = root / "Task09_Spleen"
    for sub in ("imagesTr", "labelsTr", "imagesTs"):
        (task / sub).mkdir(parents=True)
    rng = np.random.default_rng(1)

    def volume(path, dtype, high) -> None:
        nib.save(nib.Nifti1Image(rng.integers(0, high, (12, 10, 8)).astype(dtype), np.diag([0.8, 0.8, 2.5, 1])), path)

    training, test = [], []
    for i in range(6):
        volume(task / "imagesTr" / f"spleen_{i}.nii.gz", np.int16, 400)
        volume(task / "labelsTr" / f"spleen_{i}.nii.gz", np.uint8, 2)
        training.append({"image": f"./imagesTr/spleen_{i}.nii.gz", "label": f"./labelsTr/spleen_{i}.nii.gz"})
    for i in range(6, 8):
        volume(task / "imagesTs" / f"spleen_{i}.nii.gz", np.int16, 400)
        test.append(f"./imagesTs/spleen_{i}.nii.gz")
    properties = {
        "name": "Spleen", "description": "Spleen Segmentation", "reference": "test data", "licence": "CC-BY-SA 4.0",
        "tensorImageSize": "3D", "modality": {"0": "CT"}, "labels": {"0": "background", "1": "spleen"},
        "numTraining": len(training), "numTest": len(test), "training": training, "test": test,
    }  # fmt: skip
    (task / "dataset.json").write_text(json.dumps(properties))
    return str(root)


@pytest.fixture(scope="module")
def tcia_root(tmp_path_factory) -> str:
    """``root/<collection>/<patient>/<series>/{image,seg}`` directories, as TciaDataset downloads them; each
    holds one ``.npy`` file instead of DICOM slices (pydicom is not a dependency)."""
    root = tmp_path_factory.mktemp("tcia")
    rng = np.random.default_rng(2)
    for patient in range(5):
        for kind in ("image", "seg"):
            series = root / "C4KC-KiTS" / f"case_{patient:05d}" / "1" / kind
            series.mkdir(parents=True)
            np.save(series / "slices.npy", rng.integers(0, 100, (1, 6, 6, 4)).astype(np.float32))
    return str(root)


class LoadSeriesd(MapTransform):
    """Stands in for ``LoadImaged(reader="PydicomReader")``: a series directory's ``slices.npy``."""

    def __call__(self, data: Mapping) -> dict:
        d = dict(data)
        for key in self.key_iterator(d):
            d[key] = torch.as_tensor(np.load(os.path.join(d[key], "slices.npy")))
        return d


def outputs(ds, seed: int = 0) -> list:
    ds.transform.set_random_state(seed)
    return [ds[i] for i in range(len(ds))]


def assert_same_as_monai(ours, theirs) -> None:
    assert isinstance(ours._cache, SharedMemoryStore) and ours.cache_num == theirs.cache_num
    assert ours.data == theirs.data and len(ours) == len(theirs)
    for epoch in range(2):
        for i, (expected, got) in enumerate(zip(outputs(theirs, epoch), outputs(ours, epoch))):
            assert_same(expected, got, f"{type(ours).__name__}[{i}] epoch {epoch}")


@pytest.mark.parametrize(("ours", "theirs"), APPS)
def test_signature_is_monais_plus_keyword_only_extras_and_mro(ours, theirs):
    extras = assert_signature_extends(ours, theirs)
    assert extras == list(inspect.signature(monai_cache.CacheDataset.__init__).parameters)[-len(extras) :]
    # MONAI's MRO with our CacheDataset in front of MONAI's app class: a tutorial's super(App, self).__init__(data,
    # ...) reaches our CacheDataset.__init__ (MONAI's reaches MONAI's), and MONAI's app __init__, which calls
    # monai.data.CacheDataset.__init__(self, ...) by name, reaches our set_data
    mro = ours.__mro__
    assert mro[1:3] == (monai_cache.CacheDataset, theirs)
    assert [c for c in mro if c not in (ours, monai_cache.CacheDataset)] == list(theirs.__mro__)
    assert ours.set_data is monai_cache.CacheDataset.set_data


def test_mednist_matches_monai_in_shared_memory(shm_dir, mednist_root):
    transform = Compose([
        LoadImaged("image"), EnsureChannelFirstd("image"), ScaleIntensityd("image"), RandFlipd("image", prob=0.5),
    ])  # fmt: skip
    paths = set()
    for section in SECTIONS:
        kw = dict(section=section, transform=transform, seed=3, val_frac=0.2, test_frac=0.2, progress=False)
        theirs, ours = monai.apps.MedNISTDataset(mednist_root, **kw), MedNISTDataset(mednist_root, **kw)
        assert ours.get_num_classes() == theirs.get_num_classes() == 3
        assert_same_as_monai(ours, theirs)
        paths.add(ours._cache.path)
        # a second dataset object of the section (another rank, say) finds the same cache
        assert MedNISTDataset(mednist_root, **kw)._cache.path == ours._cache.path
    assert len(paths) == 3 and all(p.startswith(shm_dir) for p in paths)  # one cache per section


def test_decathlon_matches_monai_in_shared_memory(shm_dir, decathlon_root):
    keys = ["image", "label"]
    train = Compose([
        LoadImaged(keys), EnsureChannelFirstd(keys), RandSpatialCropd(keys, (6, 6, 4), random_size=False),
    ])  # fmt: skip
    paths = set()
    for section, transform in (("training", train), ("validation", train), ("test", LoadImaged("image"))):
        kw = dict(task="Task09_Spleen", section=section, transform=transform, seed=5, val_frac=0.4, progress=False)
        theirs, ours = monai.apps.DecathlonDataset(decathlon_root, **kw), DecathlonDataset(decathlon_root, **kw)
        assert np.array_equal(ours.get_indices(), theirs.get_indices())
        assert ours.get_properties() == theirs.get_properties() and ours.get_properties("labels")["labels"]
        assert_same_as_monai(ours, theirs)
        paths.add(ours._cache.path)
    assert len(paths) == 3
    # MONAI's cross-validation helper subclasses the class it is given: folds are ours, in shared memory
    folds = {}
    for cls in (monai.apps.DecathlonDataset, DecathlonDataset):
        cv = monai.apps.CrossValidation(
            dataset_cls=cls, nfolds=3, seed=7, root_dir=decathlon_root, task="Task09_Spleen", section="training",
            transform=train, progress=False,
        )  # fmt: skip
        folds[cls] = [cv.get_dataset(folds=[0, 1]), cv.get_dataset(folds=2)]
    for theirs, ours in zip(folds[monai.apps.DecathlonDataset], folds[DecathlonDataset]):
        assert isinstance(ours, DecathlonDataset)
        assert_same_as_monai(ours, theirs)
    assert folds[DecathlonDataset][0]._cache.path != folds[DecathlonDataset][1]._cache.path


def test_tcia_matches_monai_in_shared_memory(shm_dir, tcia_root):
    transform = Compose([LoadSeriesd(["image", "seg"]), RandFlipd(["image", "seg"], prob=0.5, spatial_axis=1)])
    for section in SECTIONS:
        kw = dict(collection="C4KC-KiTS", section=section, transform=transform, cache_rate=1.0, progress=False)
        theirs, ours = monai.apps.TciaDataset(tcia_root, **kw), TciaDataset(tcia_root, **kw)
        assert np.array_equal(ours.get_indices(), theirs.get_indices())
        assert_same_as_monai(ours, theirs)
    # MONAI's default cache_rate=0.0 caches nothing
    assert TciaDataset(tcia_root, "C4KC-KiTS", "test", transform=transform, progress=False).cache_num == 0


def test_dataloader_workers_share_one_cache(shm_dir, mednist_root):
    """runtime_cache=True with two worker processes: each item computed once, then read by both workers."""
    transform = Compose([LoadImaged("image"), EnsureChannelFirstd("image"), RandFlipd("image", prob=0.5)])
    kw = dict(section="training", transform=transform, runtime_cache=True, progress=False)
    theirs, ours = monai.apps.MedNISTDataset(mednist_root, **kw), MedNISTDataset(mednist_root, **kw)

    def epochs(ds) -> list:
        torch.manual_seed(11)  # the workers' seeds, and so the flips, derive from it
        loader = DataLoader(ds, batch_size=4, num_workers=2, shuffle=True)
        return [batch["image"] for _ in range(2) for batch in loader]

    for expected, got in zip(epochs(theirs), epochs(ours)):
        assert_same(expected, got)
    stats = ours.cache_stats()
    n = len(ours)
    assert stats["stored"]["entries"] == n and stats["total"]["misses"] == n and stats["total"]["hits"] == n


def test_our_options_reach_the_cache(shm_dir, mednist_root, tmp_path):
    own_dir = f"{shm_dir}/own"
    os.makedirs(own_dir)
    placed = MedNISTDataset(mednist_root, "test", progress=False, shm_dir=own_dir)
    assert placed._cache.path.startswith(own_dir)
    private = MedNISTDataset(mednist_root, "test", progress=False, shared_memory=False)
    assert isinstance(private._cache, list) and len(private._cache) == private.cache_num > 0
    for a, b in zip(placed, private):
        assert_same(a, b)
    tiered = MedNISTDataset(mednist_root, "validation", progress=False, cache_dir=tmp_path / "disk")
    assert tiered.flush(30) and tiered.cache_stats()["disk"]["stored"]["entries"] == tiered.cache_num > 0
    clone = pickle.loads(pickle.dumps(placed))  # what a spawned DataLoader worker gets: the same cache
    assert clone._cache.path == placed._cache.path and clone.section == "test"
    assert_same(clone[0], placed[0])
    assert clone.cache_stats()["total"]["misses"] == placed.cache_num  # computed once, when it was filled


@pytest.mark.parametrize("section", ["train", "Validation", ""])
def test_unknown_section_is_a_clear_error(shm_dir, mednist_root, decathlon_root, tcia_root, section):
    message = f"Unsupported section: {section!r}, available options are"
    with pytest.raises(ValueError, match=message):
        MedNISTDataset(mednist_root, section)
    with pytest.raises(ValueError, match=message):
        DecathlonDataset(decathlon_root, "Task09_Spleen", section)
    with pytest.raises(ValueError, match=message):
        TciaDataset(tcia_root, "C4KC-KiTS", section)
    # MONAI's DecathlonDataset serves a part of the test list instead
    theirs = monai.apps.DecathlonDataset(decathlon_root, "Task09_Spleen", section, LoadImaged("image"), progress=False)
    assert all("imagesTs" in item["image"] for item in theirs.data)
