"""A training script written the way Auto3DSeg's segresnet template writes one (``scripts/segmenter.py``): a
``CacheDataset`` whose ``runtime_cache`` is a Manager list that rank 0 makes and broadcasts to the ranks of its node,
``copy_cache=False``, DataLoader workers kept across epochs. Run under ``torchrun --nproc_per_node=2`` (gloo, CPU).

It imports MONAI's ``CacheDataset``: the test starts it with or without the switch that makes that name ours.
argv: data.json log_path epochs. Writes ``log_path.rank<N>.json`` per rank (the ranks share torchrun's stdout, where
two long lines can interleave): the losses, what the Manager's list holds, (when the dataset has it)
``cache_stats()`` read in this rank's main process after the last epoch, the pids of the rank's children, the
loader's class, and each batch's digest and whether it came as one block (``batch_digest.py``).
"""

import json
import multiprocessing as mp
import os
import sys

import numpy as np
import torch
import torch.distributed as dist
from batch_digest import batch_digest, takes_block_path
from monai.data import CacheDataset, DataLoader
from monai.losses import DiceCELoss
from monai.transforms import (
    Compose,
    EnsureChannelFirstd,
    LoadImaged,
    Orientationd,
    RandFlipd,
    RandSpatialCropd,
    ScaleIntensityRanged,
    Spacingd,
)
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DistributedSampler

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from helpers import CountCalls  # the test's counter of deterministic work: one line per call

KEYS = ["image", "label"]


def get_shared_memory_list(length: int) -> list:
    """The template's list shared by the ranks of a node (single node here): rank 0's Manager list, broadcast."""
    mp.current_process().authkey = np.arange(32, dtype=np.uint8).tobytes()  # the same key in every rank
    shl = [mp.Manager().list([None] * length) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(shl, src=0)
    return shl[0]


def children() -> list[int]:
    """Pids of this process's children: its DataLoader workers (persistent: alive until the loader goes), and in
    rank 0 the Manager's server."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == os.getpid():
                    found.append(int(pid))
        except (OSError, ValueError, IndexError):  # gone meanwhile
            continue
    return found


def main() -> None:
    data_path, log_path, epochs = sys.argv[1], sys.argv[2], int(sys.argv[3])
    with open(data_path) as f:
        data = json.load(f)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)

    transform = Compose(
        [
            CountCalls(log_path),
            LoadImaged(keys=KEYS),
            EnsureChannelFirstd(keys=KEYS),
            Orientationd(keys=KEYS, axcodes="RAS", labels=None),
            Spacingd(keys=KEYS, pixdim=(1.5, 1.5, 2.0), mode=("bilinear", "nearest")),
            ScaleIntensityRanged(keys=["image"], a_min=-57, a_max=164, b_min=0.0, b_max=1.0, clip=True),
            RandSpatialCropd(keys=KEYS, roi_size=(8, 8, 8), random_size=False),
            RandFlipd(keys=KEYS, prob=0.5, spatial_axis=0),
        ]
    )
    runtime_cache = get_shared_memory_list(length=len(data))
    train_ds = CacheDataset(
        data=data, transform=transform, copy_cache=False, cache_rate=1.0, runtime_cache=runtime_cache
    )
    sampler = DistributedSampler(train_ds, shuffle=True)
    loader = DataLoader(train_ds, batch_size=2, sampler=sampler, num_workers=2, persistent_workers=True)

    model = DistributedDataParallel(torch.nn.Conv3d(1, 2, 3, padding=1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss_function = DiceCELoss(to_onehot_y=True, softmax=True)
    losses, digests, blocks = [], [], []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        dist.barrier()
        for batch in loader:
            digests.append(batch_digest(batch))
            blocks.append(takes_block_path(batch))
            optimizer.zero_grad()
            loss = loss_function(model(batch["image"]), batch["label"])
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    workers = children()  # the test tells by them which rank's workers computed which item
    dist.barrier()
    stats = train_ds.cache_stats()["total"] if hasattr(train_ds, "cache_stats") else None
    held = sum(item is not None for item in runtime_cache)  # what the Manager's server process holds
    dist.barrier()  # rank 0's Manager stays up until every rank has read its list
    with open(f"{log_path}.rank{rank}.json", "w") as f:
        loader_class = f"{type(loader).__module__}.{type(loader).__qualname__}"
        json.dump(
            {"rank": rank, "losses": losses, "digests": digests, "blocks": blocks, "loader": loader_class,
             "manager_items": held, "stats": stats, "children": workers},
            f,
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
