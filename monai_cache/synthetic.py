"""Synthetic CT-like NIfTI volumes and the transform chain of MONAI's 3-D segmentation tutorials.

Nothing is downloaded: :func:`make_dataset` writes ``items`` image/label pairs that look enough like an
abdominal CT (air background at -1000 HU, a body of fat and soft tissue, a few organs, a spine of bone,
scanner noise) for the tutorial transforms to do their usual work, and :func:`tutorial_transforms` builds
that chain (``LoadImaged`` ... ``RandCropByPosNegLabeld``). Every volume is a pure function of ``(seed,
index, shape)``, so two runs (or two machines) get the same bytes.

Example::

    from monai_cache.synthetic import make_dataset, tutorial_transforms

    files = make_dataset("/tmp/ct", items=24, shape=(160, 160, 96))
    ds = monai_cache.CacheDataset(files, tutorial_transforms())
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

__all__ = [
    "CROP_SIZE",
    "PIXDIM",
    "crop_size_for",
    "make_dataset",
    "mednist_transforms",
    "synthetic_volume",
    "tutorial_transforms",
]

#: Voxel spacing the tutorial chain resamples to (``Spacingd(pixdim=...)``), in mm.
PIXDIM = (1.5, 1.5, 2.0)
#: Patch size of ``RandCropByPosNegLabeld`` in the tutorials (shrunk for small volumes by :func:`crop_size_for`).
CROP_SIZE = (96, 96, 64)
_FORMAT = 1  # bump when the generated content changes, so cached files are rewritten

# Hounsfield units of the tissues drawn.
_AIR, _FAT, _MUSCLE, _BONE = -1000, -90, 45, 700
# (label, HU, centre in [-1, 1] voxel coordinates (x, y, z), semi-axes): liver, spleen, two kidneys.
_ORGANS = (
    (1, 60, (-0.35, -0.05, 0.10), (0.32, 0.28, 0.40)),
    (2, 50, (0.40, 0.15, 0.15), (0.14, 0.12, 0.22)),
    (3, 30, (-0.22, 0.32, -0.15), (0.09, 0.08, 0.18)),
    (3, 30, (0.22, 0.32, -0.15), (0.09, 0.08, 0.18)),
)


def synthetic_volume(
    index: int, shape: Sequence[int] = (160, 160, 96), seed: int = 0
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One CT-like volume: ``(image, label, affine)``, a pure function of its arguments.

    Args:
        index: which volume of the data set (changes position, size and spacing of the anatomy).
        shape: voxels along x, y, z.
        seed: data set seed.

    Returns:
        ``image``: int16 Hounsfield units, air -1000 outside the body; ``label``: uint8, 0 background,
        1 liver, 2 spleen, 3 kidneys; ``affine``: a 4x4 voxel-to-world matrix in LPS orientation (as scanners
        write it, so ``Orientationd(axcodes="RAS")`` flips two axes) with a spacing close to :data:`PIXDIM`.
    """
    if len(shape) != 3 or min(shape) < 4:
        raise ValueError(f"shape must be 3 sizes of at least 4 voxels, got {tuple(shape)}")
    rng = np.random.default_rng([int(seed), int(index), _FORMAT])
    nx, ny, nz = (int(s) for s in shape)
    x = np.linspace(-1.0, 1.0, nx, dtype=np.float32)[:, None, None]
    y = np.linspace(-1.0, 1.0, ny, dtype=np.float32)[None, :, None]
    z = np.linspace(-1.0, 1.0, nz, dtype=np.float32)[None, None, :]
    scale = rng.uniform(0.9, 1.05)  # patient size
    shift = rng.uniform(-0.05, 0.05, size=3)

    def inside(centre: Sequence[float], axes: Sequence[float]) -> np.ndarray:
        c = [float(v) + float(s) for v, s in zip(centre, shift)]
        a = [float(v) * scale for v in axes]
        return ((x - c[0]) / a[0]) ** 2 + ((y - c[1]) / a[1]) ** 2 + ((z - c[2]) / a[2]) ** 2 <= 1.0

    image = np.full((nx, ny, nz), _AIR, dtype=np.float32)
    body_r = ((x - shift[0]) / (0.85 * scale)) ** 2 + ((y - shift[1]) / (0.62 * scale)) ** 2  # elliptic cylinder
    body = np.broadcast_to(body_r <= 1.0, image.shape)
    image[body] = _FAT
    image[np.broadcast_to(body_r <= 0.80, image.shape)] = _MUSCLE - 10  # muscle wall and soft tissue inside
    image[np.broadcast_to(body_r <= 0.70, image.shape)] = -20
    label = np.zeros((nx, ny, nz), dtype=np.uint8)
    for value, hu, centre, axes in _ORGANS:
        mask = inside(centre, axes * rng.uniform(0.85, 1.15, size=3))
        image[mask] = hu + rng.uniform(-5, 5)
        label[mask] = value
    spine = np.broadcast_to(((x - shift[0]) / 0.09) ** 2 + ((y - 0.45 - shift[1]) / 0.08) ** 2 <= 1.0, image.shape)
    image[spine] = _BONE + rng.uniform(-100, 100)
    # scanner noise, a bit stronger inside the body; smooth enough to compress like real CT
    noise = rng.normal(0.0, 1.0, size=(nx, ny, nz)).astype(np.float32)
    image += noise * np.where(body, 12.0, 4.0)
    spacing = np.asarray(PIXDIM) * rng.uniform(0.92, 1.08, size=3)
    affine = np.diag([-spacing[0], -spacing[1], spacing[2], 1.0])  # LPS, as DICOM-converted CT usually is
    affine[:3, 3] = [spacing[0] * nx / 2, spacing[1] * ny / 2, -spacing[2] * nz / 2]
    return np.clip(np.rint(image), -1024, 3071).astype(np.int16), label, affine


def make_dataset(
    root: str,
    items: int = 24,
    shape: Sequence[int] = (160, 160, 96),
    seed: int = 0,
    progress: Callable[[int], Any] | None = None,
    depths: Sequence[int] | None = None,
) -> list[dict[str, str]]:
    """Write (or reuse) ``items`` synthetic image/label pairs as ``.nii.gz`` under ``root``.

    Files already written with the same settings are kept (a ``manifest.json`` records them), so repeated
    runs start at once.

    Args:
        root: directory for the files; created if missing.
        items: number of volumes.
        shape: voxels per volume along x, y, z.
        seed: data set seed; the same seed gives the same files.
        progress: called with ``1`` after each pair is ready (e.g. ``tqdm.update``).
        depths: voxels along z of each volume (one per item, in place of ``shape[2]``), as CT series of
            different lengths; None: every volume is ``shape``.

    Returns:
        MONAI's data list: ``[{"image": path, "label": path}, ...]``.
    """
    import nibabel as nib  # local: importing it is only needed to write

    if items < 1:
        raise ValueError(f"items must be at least 1, got {items}")
    if depths is not None and len(depths) != items:
        raise ValueError(f"depths needs one size per item ({items}), got {len(depths)}")
    os.makedirs(root, exist_ok=True)
    settings: dict[str, Any] = {"format": _FORMAT, "shape": [int(s) for s in shape], "seed": int(seed)}
    if depths is not None:
        settings["depths"] = [int(d) for d in depths]
    manifest_path = os.path.join(root, "manifest.json")
    done: set[str] = set()
    try:
        with open(manifest_path) as f:
            manifest = json.load(f)
        if manifest.get("settings") == settings:
            done = set(manifest.get("files", []))
    except (OSError, ValueError):
        pass
    files = []
    for i in range(items):
        pair = {"image": os.path.join(root, f"img_{i:04d}.nii.gz"), "label": os.path.join(root, f"lbl_{i:04d}.nii.gz")}
        if not (pair["image"] in done and all(os.path.exists(p) for p in pair.values())):
            image, label, affine = synthetic_volume(i, shape if depths is None else (*shape[:2], depths[i]), seed)
            for key, arr in (("image", image), ("label", label)):
                img = nib.Nifti1Image(arr, affine)
                img.header.set_xyzt_units("mm", "sec")
                tmp = pair[key] + ".tmp.nii.gz"
                nib.save(img, tmp)
                os.replace(tmp, pair[key])
            done.add(pair["image"])
            _write_manifest(manifest_path, settings, sorted(done))
        files.append(pair)
        if progress is not None:
            progress(1)
    return files


def _write_manifest(path: str, settings: dict[str, Any], files: list[str]) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump({"settings": settings, "files": files}, f)
    os.replace(tmp, path)


def crop_size_for(shape: Sequence[int], crop: Sequence[int] = CROP_SIZE) -> tuple[int, int, int]:
    """The tutorial patch size, shrunk to fit volumes of ``shape`` after resampling (at most 80 % of each side)."""
    return tuple(max(4, min(int(c), int(s * 0.8))) for c, s in zip(crop, shape))  # type: ignore[return-value]


def tutorial_transforms(
    spatial_size: Sequence[int] = CROP_SIZE,
    num_samples: int = 2,
    before: Sequence[Callable] = (),
    after: Sequence[Callable] = (),
) -> Any:
    """The training chain of MONAI's 3-D segmentation tutorials (spleen, BTCV).

    ``LoadImaged``, ``EnsureChannelFirstd``, ``Orientationd("RAS")``, ``Spacingd(1.5, 1.5, 2.0)`` (bilinear
    for the image, nearest for the label), ``ScaleIntensityRanged(-57, 164 -> 0, 1, clip)``: deterministic,
    what a ``CacheDataset`` caches; then ``RandCropByPosNegLabeld(pos=1, neg=1, num_samples)``, which runs on
    every read.

    Args:
        spatial_size: patch size of the random crop.
        num_samples: patches per volume (each item yields a list of that many dicts).
        before: deterministic transforms to run first (e.g. instrumentation).
        after: deterministic transforms to run after the last deterministic one.

    Returns:
        a :class:`monai.transforms.Compose`.
    """
    from monai import transforms as mt

    keys = ["image", "label"]
    return mt.Compose(
        [
            *before,
            mt.LoadImaged(keys=keys),
            mt.EnsureChannelFirstd(keys=keys),
            mt.Orientationd(keys=keys, axcodes="RAS"),
            mt.Spacingd(keys=keys, pixdim=PIXDIM, mode=("bilinear", "nearest")),
            mt.ScaleIntensityRanged(keys=["image"], a_min=-57, a_max=164, b_min=0.0, b_max=1.0, clip=True),
            *after,
            mt.RandCropByPosNegLabeld(
                keys=keys,
                label_key="label",
                spatial_size=tuple(spatial_size),
                pos=1,
                neg=1,
                num_samples=num_samples,
                image_key="image",
                image_threshold=0,
            ),
        ]
    )


def mednist_transforms(load: bool = True) -> Any:
    """The training chain of MONAI's MedNIST tutorial, on dictionaries with an ``"image"`` key.

    ``LoadImaged`` (if ``load``), ``EnsureChannelFirstd`` (if ``load``), ``ScaleIntensityd``: deterministic; then
    ``RandRotated(range_x=pi/12, prob=0.5, keep_size=True)``, ``RandFlipd(spatial_axis=0, prob=0.5)``,
    ``RandZoomd(0.9, 1.1, prob=0.5)``, which run on every read.

    Args:
        load: start from image files (``LoadImaged``, ``EnsureChannelFirstd``); False: from channel-first arrays.

    Returns:
        a :class:`monai.transforms.Compose`.
    """
    from monai import transforms as mt

    loading = [mt.LoadImaged(keys="image"), mt.EnsureChannelFirstd(keys="image")] if load else []
    return mt.Compose([
        *loading,
        mt.ScaleIntensityd(keys="image"),
        mt.RandRotated(keys="image", range_x=np.pi / 12, prob=0.5, keep_size=True),
        mt.RandFlipd(keys="image", spatial_axis=0, prob=0.5),
        mt.RandZoomd(keys="image", min_zoom=0.9, max_zoom=1.1, prob=0.5),
    ])  # fmt: skip
