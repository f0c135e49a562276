"""How small can a lossless cache of the main job's preprocessed images be? Entropy estimates vs zstd.

Usage::

    python benchmarks/size_floor.py              # 8 items of 160x160x96 (about a minute on 2 cores)
    python benchmarks/size_floor.py --items 24
    python benchmarks/size_floor.py --strong     # also zstd 19 and xz after predictors (several minutes)

For the main job's data (``monai_cache.synthetic``) and the deterministic part of its chain (load, reorient,
resample, window to [0, 1] with clipping), this prints, against the size of the ``.nii.gz`` sources:

1. what zstd stores at a few levels, for the float32 image as it is, byte-shuffled (each float's four
   bytes in four planes, as blosc and HDF5 do) and split into the low 16 bits and the two high bytes;
2. with ``--strong``, what slow, strong coders store (zstd level 19 and xz/LZMA preset 6) after a
   predictor: each float's bit pattern as an integer, as it is, minus the previous voxel's (delta), or minus
   the 3-D Lorenzo prediction (as fpzip predicts), zigzag-coded and byte-shuffled (for the non-negative
   values here, zigzag is a shift left by one bit, which puts the 8 exponent bits into one byte);
3. the empirical entropy of each byte of the voxels inside the intensity window (the clipped ones are
   exactly 0 or 1 and cost almost nothing), alone and given the same byte of the previous voxel, and the
   bytes a coder that reached those entropies would need for the in-range voxels alone.

This is the evidence behind "the size target sits at the information floor" in ``docs/persistent.md``:
the low two bytes of every in-range float are scanner noise, so no general-purpose lossless coder gets far
below what is printed in (3). (A coder that knew the resampling could store the int16 source instead, which
is what the sources are.) The estimates run low (histograms of 65,536 bins for the conditional ones).
Nothing is asserted.
"""

from __future__ import annotations

import argparse
import lzma
import os
import tempfile
import warnings

import numpy as np

warnings.filterwarnings("ignore")

import zstandard  # noqa: E402
from monai.transforms import Compose  # noqa: E402

from monai_cache.synthetic import crop_size_for, make_dataset, tutorial_transforms  # noqa: E402

DETERMINISTIC = 5  # LoadImaged ... ScaleIntensityRanged: the part of the tutorial chain a cache stores


def entropy(values: np.ndarray) -> float:
    """Order-0 entropy in bits per value of a non-negative integer array."""
    counts = np.bincount(values.ravel()).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log2(p)).sum())


def conditional_entropy(values: np.ndarray, context: np.ndarray) -> float:
    """H(values | context) in bits, both byte arrays of the same shape."""
    joint = context.astype(np.int64) * 256 + values
    return entropy(joint) - entropy(context.astype(np.int64))


def byte_planes(image: np.ndarray) -> list[np.ndarray]:
    """The four bytes of each float32 as four contiguous planes (little-endian: plane 0 is the lowest)."""
    u8 = image.reshape(-1).view(np.uint8).reshape(-1, 4)
    return [np.ascontiguousarray(u8[:, k]) for k in range(4)]


def split_16_8_8(image: np.ndarray) -> list[np.ndarray]:
    """The low 16 bits of each float32, then its two high bytes, as three planes."""
    flat = image.reshape(-1)
    u8 = flat.view(np.uint8).reshape(-1, 4)
    return [
        np.ascontiguousarray(flat.view(np.uint16).reshape(-1, 2)[:, 0]),
        np.ascontiguousarray(u8[:, 2]),
        np.ascontiguousarray(u8[:, 3]),
    ]


def predicted_planes(image: np.ndarray, predictor: str) -> bytes:
    """Byte-shuffled zigzag residuals of the float32 bit patterns of a 3-D image after ``predictor``."""
    bits = image.view(np.uint32).astype(np.int64)
    if predictor == "none":
        residual = bits
    elif predictor == "delta":
        residual = np.diff(bits, axis=-1, prepend=0)
    else:  # "lorenzo": the value predicted from the 7 earlier corners of its cube
        p = np.pad(bits, ((1, 0), (1, 0), (1, 0)))
        residual = p[1:, 1:, 1:] - (
            p[:-1, 1:, 1:]
            + p[1:, :-1, 1:]
            + p[1:, 1:, :-1]
            - p[:-1, :-1, 1:]
            - p[:-1, 1:, :-1]
            - p[1:, :-1, :-1]
            + p[:-1, :-1, :-1]
        )
    zigzag = ((residual << 1) ^ (residual >> 63)).astype(np.uint64)
    narrow = zigzag.astype(np.uint32) if int(zigzag.max()) < 2**32 else zigzag
    return narrow.view(np.uint8).reshape(-1, narrow.itemsize).T.tobytes()


STRONG_CODERS = {
    "zstd 19": lambda data: len(zstandard.ZstdCompressor(level=19).compress(data)),
    "xz 6": lambda data: len(lzma.compress(data, preset=6)),
}
PREDICTORS = ("none", "delta", "lorenzo")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--items", type=int, default=8)
    ap.add_argument("--shape", type=int, nargs=3, default=(160, 160, 96))
    ap.add_argument("--strong", action="store_true", help="also try zstd 19 and xz after predictors (slow)")
    ap.add_argument("--data-dir", default=os.path.join(tempfile.gettempdir(), "monai_cache_size_floor"))
    args = ap.parse_args(argv)

    files = make_dataset(args.data_dir, args.items, tuple(args.shape))
    deterministic = Compose(tutorial_transforms(crop_size_for(args.shape)).transforms[:DETERMINISTIC])
    sources = sum(os.path.getsize(f[k]) for f in files for k in ("image", "label"))
    levels = (-1, 1, 3)
    stored = {(layout, level): 0 for layout in ("plain", "shuffled", "16+8+8") for level in levels}
    strong = {(predictor, coder): 0 for predictor in PREDICTORS for coder in STRONG_CODERS}
    floor_h0 = floor_cond = noise_bytes = 0.0
    h0_sum = np.zeros(4)
    cond_sum = np.zeros(4)
    in_range = 0.0
    for f in files:
        item = deterministic(f)
        image = np.ascontiguousarray(item["image"].numpy(), dtype=np.float32)
        label = np.ascontiguousarray(item["label"].numpy()).astype(np.uint8)  # the codec's lossless downcast
        for level in levels:
            cctx = zstandard.ZstdCompressor(level=level)
            label_bytes = len(cctx.compress(label.tobytes()))
            planes_of = {"plain": [image.reshape(-1)], "shuffled": byte_planes(image), "16+8+8": split_16_8_8(image)}
            for layout, planes in planes_of.items():
                stored[(layout, level)] += label_bytes + len(cctx.compress(b"".join(p.tobytes() for p in planes)))
        if args.strong:
            volume = image.reshape(image.shape[-3:])
            for coder, size_of in STRONG_CODERS.items():
                label_bytes = size_of(label.tobytes())
                for predictor in PREDICTORS:
                    strong[(predictor, coder)] += label_bytes + size_of(predicted_planes(volume, predictor))
        mask = (image > 0) & (image < 1)
        u8 = image.view(np.uint8).reshape((*image.shape, 4))
        previous = np.roll(u8, 1, axis=-2)  # the same byte of the previous voxel along the fastest axis
        n = int(mask.sum())
        h0 = np.array([entropy(u8[..., k][mask]) for k in range(4)])
        cond = np.array([conditional_entropy(u8[..., k][mask], previous[..., k][mask]) for k in range(4)])
        h0_sum += h0
        cond_sum += cond
        floor_h0 += n * h0.sum() / 8
        floor_cond += n * cond.sum() / 8
        noise_bytes += n * (h0[0] + h0[1]) / 8
        in_range += n / image.size

    k = len(files)
    print(
        f"{k} items of {tuple(args.shape)}; .nii.gz sources {sources / k / 1e6:.2f} MB per item; "
        f"{in_range / k:.0%} of the resampled voxels inside the intensity window\n"
    )
    print("zstd, image float32 + label uint8, bytes / sources:")
    layouts = ("plain", "shuffled", "16+8+8")
    print(f"  {'level':>5} " + " ".join(f"{layout:>9}" for layout in layouts))
    for level in levels:
        print(f"  {level:>5} " + " ".join(f"{stored[(layout, level)] / sources:>9.3f}" for layout in layouts))
    if args.strong:
        print("\nstrong coders after a predictor (zigzag residuals, byte-shuffled), bytes / sources:")
        print(f"  {'predictor':>9} " + " ".join(f"{coder:>8}" for coder in STRONG_CODERS))
        for predictor in PREDICTORS:
            print(f"  {predictor:>9} " + " ".join(f"{strong[(predictor, c)] / sources:>8.3f}" for c in STRONG_CODERS))
    print("\nentropy of each byte of the in-range voxels (byte 0 lowest), bits:")
    print("  alone:                    " + "  ".join(f"{v:.2f}" for v in h0_sum / k))
    print("  given the previous voxel: " + "  ".join(f"{v:.2f}" for v in cond_sum / k))
    print("\nbytes a coder reaching these entropies needs for the in-range voxels alone, / sources:")
    print(f"  the two low bytes alone:  {noise_bytes / sources:.3f}")
    print(f"  all four bytes, alone:    {floor_h0 / sources:.3f}")
    print(
        f"  given the previous voxel: {floor_cond / sources:.3f}   (the label, the clipped voxels' positions "
        "and the metadata come on top)"
    )


if __name__ == "__main__":
    main()
