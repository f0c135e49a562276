"""The items of ``tests/data/disk-cache-v1`` (a disk cache written by monai_cache before the store redesign)."""

import numpy as np
import torch
from monai.data import MetaTensor


def fixture_items() -> dict:
    """``{key: item}``: a packed MetaTensor item with metadata, a large one in a file of its own (zstd), an
    uncompressed one; integral float images are downcast losslessly by the writer."""
    rng = np.random.default_rng(7)
    affine = torch.tensor([[1.5, 0, 0, -10.0], [0, 1.5, 0, 4.0], [0, 0, 2.0, 0.5], [0, 0, 0, 1]], dtype=torch.float64)
    small = MetaTensor(torch.from_numpy(rng.random((1, 16, 16, 8), dtype=np.float32)), affine=affine,
                       meta={"filename_or_obj": "ct_0.nii.gz", "spatial_shape": np.array([16, 16, 8])})
    large = (torch.arange(64 * 64 * 32, dtype=torch.float32).reshape(1, 64, 64, 32) % 1000) - 500  # 512 KiB
    labels = torch.from_numpy(rng.integers(0, 3, (1, 32, 32, 16)).astype(np.float32))  # downcast to uint8
    return {
        "packed": {"image": small, "name": "ct_0", "spacing": (1.5, 1.5, 2.0)},
        "large": {"image": large, "flag": True},
        "small-raw": {"label": labels, "ids": [1, 2, 3]},
    }
