"""One rank of a torchrun-style job running MONAI's tutorial subclass patterns: a dataset class that keeps its
rank's partition of the data list and calls its base class's ``__init__`` directly. Each subclass is written once,
as a function of its base class, and built here on MONAI's class and on monai_cache's.

Started as an independent process with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT set, like torchrun
starts ranks. argv: config.json (``cases``: each case's keyword arguments; ``logs``: a directory). Checks in this
rank that ours gives MONAI's partition and items, then prints one JSON line: per case, ``error`` (a traceback,
or None), this rank's partition (``data``) and what our cache reports.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Callable, Mapping

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import _minimal_monai  # noqa: F401  (first: MONAI as a plain install gives it)
import monai.apps
import monai.data
import torch
import torch.distributed as dist
from helpers import assert_same, chain
from monai.data import Dataset, partition_dataset
from monai.transforms import (
    Compose,
    EnsureChannelFirstd,
    LoadImaged,
    MapTransform,
    NormalizeIntensityd,
    RandFlipd,
    RandScaleIntensityd,
    RandSpatialCropd,
    ScaleIntensityd,
)
from monai.utils import TraceKeys
from test_apps import LoadSeriesd

import monai_cache
import monai_cache.apps
from monai_cache.shm_directory import list_caches


def partition_for_this_rank(data: list, shuffle: bool) -> list:
    """The tutorials' split: brats_training_ddp.py's ``_generate_data_list`` (``shuffle=True`` for training,
    ``False`` for validation); unet_training_smartcache.py makes the same call before building its dataset."""
    return partition_dataset(
        data=data,
        num_partitions=dist.get_world_size(),
        shuffle=shuffle,
        seed=0,
        drop_last=False,
        even_divisible=shuffle,
    )[dist.get_rank()]


def decathlon_subclass(base: type) -> type:
    """brats_training_ddp.py's ``BratsCacheDataset(DecathlonDataset)``, the task and ``val_frac`` made arguments."""

    class PartitionedDecathlon(base):
        def __init__(
            self,
            root_dir: str,
            task: str,
            section: str,
            transform: Callable,
            cache_rate: float = 1.0,
            num_workers: int = 0,
            shuffle: bool = False,
            val_frac: float = 0.2,
        ) -> None:
            if not os.path.isdir(root_dir):
                raise ValueError("root directory root_dir must be a directory.")
            self.section = section
            self.shuffle = shuffle
            self.val_frac = val_frac
            self.set_random_state(seed=0)
            dataset_dir = os.path.join(root_dir, task)
            if not os.path.exists(dataset_dir):
                raise RuntimeError(f"cannot find dataset directory: {dataset_dir}")
            data = self._generate_data_list(dataset_dir)
            # past the app class's __init__ (listing, download), straight to CacheDataset.__init__
            super(base, self).__init__(data, transform, cache_rate=cache_rate, num_workers=num_workers)

        def _generate_data_list(self, dataset_dir: str) -> list:
            return partition_for_this_rank(super()._generate_data_list(dataset_dir), self.shuffle)

    return PartitionedDecathlon


def mednist_subclass(base: type) -> type:
    """The same pattern on ``MedNISTDataset``: the attributes its ``_generate_data_list`` reads, set by hand."""

    class PartitionedMedNIST(base):
        def __init__(
            self,
            root_dir: str,
            section: str,
            transform: Callable,
            cache_rate: float = 1.0,
            num_workers: int = 0,
            shuffle: bool = False,
            seed: int = 0,
        ) -> None:
            if not os.path.isdir(root_dir):
                raise ValueError("root directory root_dir must be a directory.")
            self.section = section
            self.shuffle = shuffle
            self.val_frac = 0.1
            self.test_frac = 0.1
            self.num_class = 0
            self.set_random_state(seed=seed)
            data = self._generate_data_list(os.path.join(root_dir, self.dataset_folder_name))
            super(base, self).__init__(data, transform, cache_rate=cache_rate, num_workers=num_workers)

        def _generate_data_list(self, dataset_dir: str) -> list:
            return partition_for_this_rank(super()._generate_data_list(dataset_dir), self.shuffle)

    return PartitionedMedNIST


def tcia_subclass(base: type) -> type:
    """The same pattern on ``TciaDataset`` (whose own ``cache_rate`` default, 0.0, the subclass does not keep)."""

    class PartitionedTcia(base):
        def __init__(
            self,
            root_dir: str,
            collection: str,
            section: str,
            transform: Callable,
            cache_rate: float = 1.0,
            num_workers: int = 0,
            shuffle: bool = False,
            val_frac: float = 0.2,
        ) -> None:
            if not os.path.isdir(root_dir):
                raise ValueError("root directory root_dir must be a directory.")
            self.section = section
            self.shuffle = shuffle
            self.val_frac = val_frac
            self.seg_type = "SEG"
            self.set_random_state(seed=0)
            data = self._generate_data_list(os.path.join(root_dir, collection))
            super(base, self).__init__(data, transform, cache_rate=cache_rate, num_workers=num_workers)

        def _generate_data_list(self, dataset_dir: str) -> list:
            return partition_for_this_rank(super()._generate_data_list(dataset_dir), self.shuffle)

    return PartitionedTcia


def cache_subclass(base: type) -> type:
    """A ``CacheDataset`` that keeps its rank's partition and calls the base's ``__init__`` by name, as MONAI's
    apps datasets call ``CacheDataset.__init__(self, ...)``."""

    class PartitionedCacheDataset(base):
        def __init__(self, data: list, transform: Callable, shuffle: bool = False, num_workers: int = 0) -> None:
            self.shuffle = shuffle
            base.__init__(
                self, data=partition_for_this_rank(data, shuffle), transform=transform, num_workers=num_workers
            )

    return PartitionedCacheDataset


def smartcache_subclass(base: type) -> type:
    """unet_training_smartcache.py's partition and ``SmartCacheDataset`` arguments in a subclass that calls
    ``SmartCacheDataset.__init__(self, ...)`` by name."""

    class PartitionedSmartCache(base):
        def __init__(
            self, data: list, transform: Callable, replace_rate: float, cache_num: int, shuffle: bool = True
        ) -> None:
            base.__init__(
                self,
                partition_for_this_rank(data, shuffle),
                transform,
                replace_rate=replace_rate,
                cache_num=cache_num,
                num_init_workers=2,
                num_replace_workers=2,
            )

    return PartitionedSmartCache


class LogImage(MapTransform):
    """Deterministic, first in every chain: appends ``<pid>\\t<image path>`` to ``log_path`` for each item it
    computes, so the test can count computations on the node."""

    def __init__(self, log_path: str) -> None:
        super().__init__("image")
        self.log_path = log_path

    def __call__(self, data: Mapping) -> dict:
        with open(self.log_path, "a") as f:
            f.write(f"{os.getpid()}\t{data['image']}\n")
        return dict(data)


def mednist_chain(log_path: str) -> Compose:
    return Compose([
        LogImage(log_path), LoadImaged("image"), EnsureChannelFirstd("image"), ScaleIntensityd("image"),
        RandFlipd("image", prob=0.5),
    ])  # fmt: skip


def decathlon_chain(log_path: str) -> Compose:
    keys = ["image", "label"]
    return Compose([
        LogImage(log_path), LoadImaged(keys), EnsureChannelFirstd(keys),
        NormalizeIntensityd("image", nonzero=True, channel_wise=True),
        RandSpatialCropd(keys, (6, 6, 4), random_size=False), RandFlipd(keys, prob=0.5, spatial_axis=0),
        RandScaleIntensityd("image", factors=0.1, prob=1.0),
    ])  # fmt: skip


def tcia_chain(log_path: str) -> Compose:
    return Compose([LogImage(log_path), LoadSeriesd(["image", "seg"]), RandFlipd(["image", "seg"], prob=0.5)])


def volume_chain(log_path: str) -> Compose:
    return Compose([LogImage(log_path), *chain(crop=8).transforms])


# case: (the subclass written once, MONAI's base, our base, the transform chain)
CASES: dict[str, tuple[Callable[[type], type], type, type, Callable[[str], Compose]]] = {
    "decathlon": (decathlon_subclass, monai.apps.DecathlonDataset, monai_cache.apps.DecathlonDataset, decathlon_chain),
    "mednist": (mednist_subclass, monai.apps.MedNISTDataset, monai_cache.apps.MedNISTDataset, mednist_chain),
    "tcia": (tcia_subclass, monai.apps.TciaDataset, monai_cache.apps.TciaDataset, tcia_chain),
    "cache": (cache_subclass, monai.data.CacheDataset, monai_cache.CacheDataset, volume_chain),
    "smartcache": (smartcache_subclass, monai.data.SmartCacheDataset, monai_cache.SmartCacheDataset, volume_chain),
}


def read_alike(theirs: Dataset, ours: Dataset, seed: int, what: str) -> list:
    """Every item of both, random transforms seeded alike, compared exactly; returns ours."""
    theirs.transform.set_random_state(seed)
    ours.transform.set_random_state(seed)
    expected = [theirs[i] for i in range(len(theirs))]
    got = [ours[i] for i in range(len(ours))]
    for i, (a, b) in enumerate(zip(expected, got)):
        # TraceKeys.ID is the address of the transform object: each dataset has its own chain here
        assert_same(a, b, f"{what}[{i}] seed {seed}", skip_keys=(TraceKeys.ID,))
    return got


def run_case(name: str, kwargs: dict, logs: str) -> dict:
    subclass, monai_base, our_base, make_chain = CASES[name]
    try:
        theirs = subclass(monai_base)(transform=make_chain(os.path.join(logs, f"{name}.monai")), **kwargs)
        ours = subclass(our_base)(transform=make_chain(os.path.join(logs, f"{name}.ours")), **kwargs)
        assert isinstance(ours, our_base) and isinstance(ours, monai_base)
        assert ours.data == theirs.data and len(ours) == len(theirs) > 0, "not MONAI's partition"
        windows = []
        if name == "smartcache":
            theirs.start()
            ours.start()
            try:
                for epoch in range(3):
                    if epoch:  # the tutorial's update_cache() before every epoch after the first
                        theirs.update_cache()
                        ours.update_cache()
                    items = read_alike(theirs, ours, epoch, name)
                    windows.append([str(item["image"].meta["filename_or_obj"]) for item in items])
            finally:
                theirs.shutdown()
                ours.shutdown()
        else:
            for epoch in range(2):
                read_alike(theirs, ours, epoch, name)
        # the shared-memory store: MONAI's _cache itself, or (SmartCacheDataset) the store _cache's views read
        store = getattr(ours, "_store", ours._cache)
        live = [c["path"] for c in list_caches() if c["state"] == "live"]  # what `monai-cache ls` shows
        stats = ours.cache_stats()
        return {
            "error": None,
            "data": list(ours.data),
            "windows": windows,
            "store": type(store).__name__,
            "path": getattr(store, "path", None),
            "live": getattr(store, "path", None) in live,
            "total": stats["total"],
            "stored": stats["stored"],
        }
    except Exception:
        return {"error": traceback.format_exc()}


def main() -> None:
    with open(sys.argv[1]) as f:
        config = json.load(f)
    torch.set_num_threads(1)  # two ranks on a shared 2-core machine
    dist.init_process_group("gloo")
    dist.barrier()  # both ranks build their datasets at the same time, as under torchrun
    results = {name: run_case(name, kwargs, config["logs"]) for name, kwargs in config["cases"].items()}
    dist.barrier()
    print(json.dumps({"rank": dist.get_rank(), "pid": os.getpid(), "cases": results}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
