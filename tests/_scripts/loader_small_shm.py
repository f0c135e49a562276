"""Run under a 64 MB /dev/shm (Docker's default): batches of 2 x 40 MB through monai's and our DataLoader.

Prints ``{"monai.data.DataLoader": "ok" or the error, "monai_cache.DataLoader": ...}``.
"""

import json

import monai.data
import torch

from monai_cache.loader import DataLoader


class Big(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> dict:
        return {"image": torch.full((10 << 20,), float(i))}  # 40 MiB of float32


def main() -> None:
    out = {}
    for name, loader_class in (
        ("monai.data.DataLoader", monai.data.DataLoader),
        ("monai_cache.DataLoader", DataLoader),
    ):
        try:
            sums = [float(b["image"].sum()) for b in loader_class(Big(), batch_size=2, num_workers=2)]
            out[name] = "ok" if sums == [float(10 << 20), float(5 * (10 << 20))] else f"wrong values {sums}"
        except Exception as e:  # what torch raises in the main process when /dev/shm is full
            out[name] = f"{type(e).__name__}: {e}"[:300]
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
