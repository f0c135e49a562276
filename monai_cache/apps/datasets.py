"""MONAI's apps datasets on the shared-memory cache: thin glue over :class:`monai_cache.CacheDataset`.

Each class subclasses ours and MONAI's (which lists, downloads and splits the data, then calls
``monai.data.CacheDataset.__init__(self, ...)`` by name), in that order, so that the MRO is MONAI's with our
``CacheDataset`` in front of MONAI's app class: ``ours.App, monai_cache.CacheDataset, monai.App, Randomizable, ...,
monai.data.CacheDataset``. Our ``__init__`` sets our options (:meth:`monai_cache.CacheDataset._init_shared_memory`)
and calls MONAI's app ``__init__`` by name; MONAI's call reaches our ``set_data``, which builds the cache in shared
memory. A user's subclass that skips the app's download logic the way MONAI's tutorials do,
``super(DecathlonDataset, self).__init__(data, transform, cache_rate=...)``, reaches our ``CacheDataset.__init__``,
as with MONAI's classes it reaches MONAI's.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from monai.apps import DecathlonDataset as _MonaiDecathlonDataset
from monai.apps import MedNISTDataset as _MonaiMedNISTDataset
from monai.apps import TciaDataset as _MonaiTciaDataset

from monai_cache.dataset import CacheDataset

__all__ = ["DecathlonDataset", "MedNISTDataset", "TciaDataset"]

SECTIONS = ("training", "validation", "test")

_OPTIONS = [p for p in inspect.signature(CacheDataset.__init__).parameters.values() if p.kind is p.KEYWORD_ONLY]
"""Our keyword-only options (``shared_memory``, ``shm_dir``, ...): :class:`monai_cache.CacheDataset`'s."""


def _check_section(section: str) -> None:
    """MONAI's MedNISTDataset rejects an unknown section; its DecathlonDataset and TciaDataset serve another
    section's items for one (``"train"`` gives validation items), so all three check it first."""
    if section not in SECTIONS:
        raise ValueError(f"Unsupported section: {section!r}, available options are {list(SECTIONS)}.")


def _app_init(monai_app: type) -> Callable[..., None]:
    """The ``__init__`` of our counterpart of ``monai_app``: the installed MONAI's parameters, in its order and with its
    defaults (they change between versions: ``TciaDataset`` has ``fname_regex`` from MONAI 1.4 on), then our options,
    keyword-only. It sets our options, then runs MONAI's ``__init__``, which calls ``monai.data.CacheDataset.__init__``
    by name and so reaches our ``set_data``."""
    monai_signature = inspect.signature(monai_app.__init__)  # type: ignore[misc]

    def __init__(self: CacheDataset, *args: Any, **kwargs: Any) -> None:
        options = {p.name: kwargs.pop(p.name, p.default) for p in _OPTIONS}
        bound = monai_signature.bind(self, *args, **kwargs)  # MONAI's TypeError for an argument it does not take
        bound.apply_defaults()
        _check_section(bound.arguments["section"])
        self._init_shared_memory(**options)
        monai_app.__init__(self, *args, **kwargs)  # type: ignore[misc]

    __init__.__signature__ = monai_signature.replace(  # type: ignore[attr-defined]
        parameters=[*monai_signature.parameters.values(), *_OPTIONS]
    )
    __init__.__qualname__ = f"{monai_app.__name__}.__init__"
    return __init__


class MedNISTDataset(CacheDataset, _MonaiMedNISTDataset):
    """MONAI's ``MedNISTDataset`` with its cache in shared memory, one copy per machine.

    Every argument of :class:`monai.apps.MedNISTDataset` keeps its meaning (``download=True`` downloads as MONAI
    does); the items are the same, and the cache is :class:`monai_cache.CacheDataset`'s: one copy in ``/dev/shm``
    shared by every DataLoader worker and DDP rank of the machine (``runtime_cache=True`` fills it on the fly).
    Train, validation and test sections are different caches (their data lists differ). An unknown ``section``
    is an error before the data directory is read.

    Args:
        root_dir: target directory to download and load MedNIST dataset.
        section: expected data section, can be: `training`, `validation` or `test`.
        transform: transforms to execute operations on input data; default ``LoadImaged("image")``.
        download: whether to download and extract the MedNIST from resource link, default is False.
            if expected file already exists, skip downloading even set it to True.
            user can manually copy `MedNIST.tar.gz` file or `MedNIST` folder to root directory.
        seed: random seed to randomly split training, validation and test datasets, default is 0.
        val_frac: percentage of validation fraction in the whole dataset, default is 0.1.
        test_frac: percentage of test fraction in the whole dataset, default is 0.1.
        cache_num: number of items to be cached. Default is `sys.maxsize`.
            will take the minimum of (cache_num, data_length x cache_rate, data_length).
        cache_rate: percentage of cached data in total, default is 1.0 (cache all).
            will take the minimum of (cache_num, data_length x cache_rate, data_length).
        num_workers: the number of worker threads if computing cache in the initialization.
            If num_workers is None then the number returned by os.cpu_count() is used.
            If a value less than 1 is specified, 1 will be used instead.
        progress: whether to display a progress bar when downloading dataset and computing the transform cache
            content.
        copy_cache: whether to `deepcopy` the cache content before applying the random transforms (the
            shared-memory cache never needs it: see :class:`monai_cache.CacheDataset`).
        as_contiguous: whether to convert the cached NumPy array or PyTorch tensor to be contiguous.
        runtime_cache: ``False`` to fill the cache during initialization; ``True``, ``"threads"`` or
            ``"processes"`` to fill it on the fly (in shared memory); or a list-like container, as in
            :class:`monai_cache.CacheDataset`.
        shared_memory: keep the cache in shared memory (default); ``False`` restores MONAI's in-process cache.
        shm_dir: tmpfs directory for the cache; default ``$MONAI_CACHE_SHM_DIR`` or ``/dev/shm``.
        shm_budget: most bytes the cache may take in shared memory (an int or a string such as ``"8GiB"``).
        keep_warm: keep the cache in shared memory after the last process using it exits.
        allow_pickle: cache values that the codec cannot store natively with pickle (off: never unpickles).
        cache_key: name the cache explicitly instead of fingerprinting data, transforms and options; give each
            section its own.
        cache_dir: a directory where the cached items are also kept on disk, a second tier behind shared memory,
            so that the next run starts warm (see :class:`monai_cache.CacheDataset`).
        shared_dir: ``cache_dir`` is shared by several machines: an item missing everywhere is computed once.
        process_cache: keep the items this process reads in this process too (None, the default: items on an
            accelerator; see :class:`monai_cache.CacheDataset`).

    Raises:
        ValueError: When ``root_dir`` is not a directory, or ``section`` is not one of the three.
        RuntimeError: When ``dataset_dir`` doesn't exist and downloading is not selected (``download=False``).
    """

    __init__ = _app_init(_MonaiMedNISTDataset)


class DecathlonDataset(CacheDataset, _MonaiDecathlonDataset):
    """MONAI's ``DecathlonDataset`` (Medical Segmentation Decathlon) with its cache in shared memory.

    Every argument of :class:`monai.apps.DecathlonDataset` keeps its meaning, and ``get_indices()``,
    ``get_properties()`` and ``monai.apps.CrossValidation`` work as in MONAI; the cache is
    :class:`monai_cache.CacheDataset`'s, one copy per machine. Train, validation and test sections (and
    cross-validation folds) are different caches (their data lists differ).

    Difference from MONAI, a fix: an unknown ``section`` is an error (MONAI serves validation items of the test
    list for, say, ``"train"``).

    Args:
        root_dir: user's local directory for caching and loading the MSD datasets.
        task: which task to download and execute: one of list ("Task01_BrainTumour", "Task02_Heart",
            "Task03_Liver", "Task04_Hippocampus", "Task05_Prostate", "Task06_Lung", "Task07_Pancreas",
            "Task08_HepaticVessel", "Task09_Spleen", "Task10_Colon").
        section: expected data section, can be: `training`, `validation` or `test`.
        transform: transforms to execute operations on input data; default ``LoadImaged(["image", "label"])``.
            for further usage, use `EnsureChannelFirstd` to convert the shape to [C, H, W, D].
        download: whether to download and extract the Decathlon from resource link, default is False.
            if expected file already exists, skip downloading even set it to True.
            user can manually copy tar file or dataset folder to the root directory.
        seed: random seed to randomly shuffle the datalist before splitting into training and validation,
            default is 0. note to set same seed for `training` and `validation` sections.
        val_frac: percentage of validation fraction in the whole dataset, default is 0.2.
        cache_num: number of items to be cached. Default is `sys.maxsize`.
            will take the minimum of (cache_num, data_length x cache_rate, data_length).
        cache_rate: percentage of cached data in total, default is 1.0 (cache all).
            will take the minimum of (cache_num, data_length x cache_rate, data_length).
        num_workers: the number of worker threads if computing cache in the initialization.
            If num_workers is None then the number returned by os.cpu_count() is used.
            If a value less than 1 is specified, 1 will be used instead.
        progress: whether to display a progress bar when downloading dataset and computing the transform cache
            content.
        copy_cache: whether to `deepcopy` the cache content before applying the random transforms (the
            shared-memory cache never needs it: see :class:`monai_cache.CacheDataset`).
        as_contiguous: whether to convert the cached NumPy array or PyTorch tensor to be contiguous.
        runtime_cache: ``False`` to fill the cache during initialization; ``True``, ``"threads"`` or
            ``"processes"`` to fill it on the fly (in shared memory); or a list-like container, as in
            :class:`monai_cache.CacheDataset`.
        shared_memory: keep the cache in shared memory (default); ``False`` restores MONAI's in-process cache.
        shm_dir: tmpfs directory for the cache; default ``$MONAI_CACHE_SHM_DIR`` or ``/dev/shm``.
        shm_budget: most bytes the cache may take in shared memory (an int or a string such as ``"8GiB"``).
        keep_warm: keep the cache in shared memory after the last process using it exits.
        allow_pickle: cache values that the codec cannot store natively with pickle (off: never unpickles).
        cache_key: name the cache explicitly instead of fingerprinting data, transforms and options; give each
            section its own.
        cache_dir: a directory where the cached items are also kept on disk, a second tier behind shared memory,
            so that the next run starts warm (see :class:`monai_cache.CacheDataset`).
        shared_dir: ``cache_dir`` is shared by several machines: an item missing everywhere is computed once.
        process_cache: keep the items this process reads in this process too (None, the default: items on an
            accelerator; see :class:`monai_cache.CacheDataset`).

    Raises:
        ValueError: When ``root_dir`` is not a directory, ``section`` is not one of the three, or ``task`` is
            not one of the ten.
        RuntimeError: When ``dataset_dir`` doesn't exist and downloading is not selected (``download=False``).
    """

    __init__ = _app_init(_MonaiDecathlonDataset)


class TciaDataset(CacheDataset, _MonaiTciaDataset):
    """MONAI's ``TciaDataset`` (The Cancer Imaging Archive) with its cache in shared memory.

    Every argument of :class:`monai.apps.TciaDataset` keeps its meaning (as in MONAI, ``cache_rate`` defaults to
    0.0: nothing is cached unless you ask); the cache is :class:`monai_cache.CacheDataset`'s, one copy per
    machine. Difference from MONAI, a fix: an unknown ``section`` is an error (MONAI serves validation items for,
    say, ``"train"``).

    Args:
        root_dir: user's local directory for caching and loading the TCIA dataset.
        collection: name of a TCIA collection.
        section: expected data section, can be: `training`, `validation` or `test`.
        transform: transforms to execute operations on input data; default
            ``LoadImaged(keys=["image"], reader="PydicomReader", fname_regex=fname_regex)``.
        download: whether to download and extract the dataset, default is False.
            if expected file already exists, skip downloading even set it to True.
            user can manually copy tar file or dataset folder to the root directory.
        download_len: number of series that will be downloaded, the value should be larger than 0 or -1, where -1
            means all series will be downloaded. Default is -1.
        seg_type: modality type of segmentation that is used to do the first step download. Default is "SEG".
        modality_tag: tag of modality. Default is (0x0008, 0x0060).
        ref_series_uid_tag: tag of referenced Series Instance UID. Default is (0x0020, 0x000e).
        ref_sop_uid_tag: tag of referenced SOP Instance UID. Default is (0x0008, 0x1155).
        specific_tags: tags that will be loaded for "SEG" series. This argument will be used in
            `monai.data.PydicomReader`. Default is [(0x0008, 0x1115), (0x0008,0x1140), (0x3006, 0x0010),
            (0x0020,0x000D), (0x0010,0x0010), (0x0010,0x0020), (0x0020,0x0011), (0x0020,0x0012)].
        fname_regex: a regular expression to match the file names when the input is a folder.
            If provided, only the matched files will be included. Default to `"^(?!.*LICENSE).*"`, ignoring any
            file name containing `"LICENSE"`. MONAI 1.4 and later (as with MONAI's class, not taken with 1.3).
        seed: random seed to randomly shuffle the datalist before splitting into training and validation,
            default is 0. note to set same seed for `training` and `validation` sections.
        val_frac: percentage of validation fraction in the whole dataset, default is 0.2.
        cache_num: number of items to be cached. Default is `sys.maxsize`.
            will take the minimum of (cache_num, data_length x cache_rate, data_length).
        cache_rate: percentage of cached data in total, default is 0.0 (no cache).
            will take the minimum of (cache_num, data_length x cache_rate, data_length).
        num_workers: the number of worker threads if computing cache in the initialization.
            If num_workers is None then the number returned by os.cpu_count() is used.
            If a value less than 1 is specified, 1 will be used instead.
        progress: whether to display a progress bar when downloading dataset and computing the transform cache
            content.
        copy_cache: whether to `deepcopy` the cache content before applying the random transforms (the
            shared-memory cache never needs it: see :class:`monai_cache.CacheDataset`).
        as_contiguous: whether to convert the cached NumPy array or PyTorch tensor to be contiguous.
        runtime_cache: ``False`` to fill the cache during initialization; ``True``, ``"threads"`` or
            ``"processes"`` to fill it on the fly (in shared memory); or a list-like container, as in
            :class:`monai_cache.CacheDataset`.
        shared_memory: keep the cache in shared memory (default); ``False`` restores MONAI's in-process cache.
        shm_dir: tmpfs directory for the cache; default ``$MONAI_CACHE_SHM_DIR`` or ``/dev/shm``.
        shm_budget: most bytes the cache may take in shared memory (an int or a string such as ``"8GiB"``).
        keep_warm: keep the cache in shared memory after the last process using it exits.
        allow_pickle: cache values that the codec cannot store natively with pickle (off: never unpickles).
        cache_key: name the cache explicitly instead of fingerprinting data, transforms and options; give each
            section its own.
        cache_dir: a directory where the cached items are also kept on disk, a second tier behind shared memory,
            so that the next run starts warm (see :class:`monai_cache.CacheDataset`).
        shared_dir: ``cache_dir`` is shared by several machines: an item missing everywhere is computed once.
        process_cache: keep the items this process reads in this process too (None, the default: items on an
            accelerator; see :class:`monai_cache.CacheDataset`).

    Raises:
        ValueError: When ``root_dir`` is not a directory, or ``section`` is not one of the three.
        RuntimeError: When the collection's directory doesn't exist and downloading is not selected.
    """

    __init__ = _app_init(_MonaiTciaDataset)
