"""Drop-in subclasses of MONAI's caching datasets. Thin glue: storage lives in :mod:`monai_cache.shm`
(and :mod:`monai_cache.disk`), encoding in :mod:`monai_cache.codec`."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings
from collections.abc import Callable, Sequence
from copy import deepcopy
from functools import partial
from multiprocessing.managers import BaseProxy
from multiprocessing.pool import ThreadPool
from typing import Any

import numpy as np
from monai.data import CacheDataset as _MonaiCacheDataset
from monai.data import Dataset as _MonaiDataset
from monai.data.meta_obj import get_track_meta
from monai.data.utils import pickle_hashing
from monai.transforms import Compose

from monai_cache import __version__, codec, loader
from monai_cache.disk import DiskStore
from monai_cache.disk_format import DISK_FORMAT_VERSION, entry_key
from monai_cache.fingerprint import (
    chain_fingerprint,
    fingerprint,
    first_random_index,
    library_versions,
    relative_paths_base,
)
from monai_cache.keeper import keep_alive_seconds
from monai_cache.process_tier import ProcessTier
from monai_cache.runtime import COUNTERS, SharedCounters, cache_stats, release_freed_memory
from monai_cache.sharing import immutable_leaves, make_private, with_new_containers
from monai_cache.shm import SharedMemoryStore

try:  # MONAI shows a progress bar with tqdm when it is installed; so do we
    from tqdm import tqdm

    _has_tqdm = True
except ImportError:  # pragma: no cover
    _has_tqdm = False

__all__ = ["CacheDataset"]


# What MONAI's CacheDataset.__init__ sets before it calls set_data: fingerprinted on their own, or not content at all.
_MONAI_ATTRIBUTES = frozenset(
    ("data", "transform", "set_num", "set_rate", "progress", "copy_cache", "as_contiguous", "hash_as_key", "hash_func",
     "num_workers", "runtime_cache", "cache_num", "_cache", "_hash_keys")
)


_log = logging.getLogger("monai_cache")
_proxy_noted = False


def _note_proxy(proxy: BaseProxy) -> None:
    """Say once per process that a cross-process ``runtime_cache`` gets the shared-memory cache (INFO, on stderr
    unless logging is configured)."""
    global _proxy_noted
    if _proxy_noted:
        return
    _proxy_noted = True
    if not _log.hasHandlers():  # nothing configured: the line would be dropped, and the user never told
        _log.addHandler(logging.StreamHandler())
        _log.setLevel(logging.INFO)
    _log.info(
        "monai_cache: runtime_cache is a %s (a cross-process list): CacheDataset keeps its items in the node-wide "
        "shared-memory cache instead, as runtime_cache=True does, shared by every DataLoader worker and rank of this "
        "machine; nothing is put in the list",
        type(proxy).__name__,
    )


class _EntryName:
    """Names a cache entry in warnings by its data index (picklable, for spawned workers)."""

    def __init__(self, data_indices: np.ndarray) -> None:
        self.data_indices = data_indices

    def __call__(self, cache_index: int) -> str:
        return f"data item {int(self.data_indices[cache_index])} (cache entry {cache_index})"


class _FirstRandom:
    """A chain's transforms (the tuple of its ``Compose``) and the index of its first random transform.

    Slots only, no ``__dict__``: MONAI's ``set_rnd`` (which its DataLoader runs on the dataset when it is made with
    ``num_workers=0``, and in every worker) seeds every random transform it finds in the dataset's attributes, tuples
    included. Found here, the chain's random transforms would be seeded a second time, after ``transform``, with
    the next seed: other random values than MONAI's.
    """

    __slots__ = ("index", "transforms")

    def __init__(self, transforms: tuple, index: int | None) -> None:
        self.transforms = transforms
        self.index = index


class _FromDisk:
    """A missing shared-memory entry's filler with a disk tier: its entry on disk, read, or computed and written
    there; remembers which (:meth:`private`)."""

    __slots__ = ("_compute", "_disk", "_key", "computed")

    def __init__(self, disk: DiskStore, key: str, compute: Callable[[], Any]) -> None:
        self._disk, self._key, self._compute = disk, key, compute
        self.computed = False

    def __call__(self) -> Any:
        return self._disk.get_or_compute(self._key, self._computed)

    def _computed(self) -> Any:
        self.computed = True
        return self._compute()

    def private(self, item: Any) -> Any | None:
        """``item``, returned by this filler, made safe to hand on as it is: as it is when decoded from the disk
        entry (nothing else holds it), else as :func:`~monai_cache.sharing.make_private` makes it (None: it cannot)."""
        return make_private(item) if self.computed else item


class CacheDataset(_MonaiCacheDataset):
    """MONAI's ``CacheDataset`` with one cache per machine, in shared memory.

    Every argument of :class:`monai.data.CacheDataset` keeps its meaning; the cache just lives in
    ``/dev/shm`` instead of this process's heap, so that every DataLoader worker and every DDP rank on the
    machine shares one copy, reads it without copying, and fills it on the fly:

    * ``runtime_cache=False`` (MONAI's default): the cache is filled before the first epoch, as in MONAI,
      with a progress bar; processes that build the same dataset at the same time (the ranks of a
      ``torchrun`` job) split the work, so no item is computed twice on the machine, and a process that
      finds the cache already filled starts at once.
    * ``runtime_cache=True``, ``"threads"`` or ``"processes"``: entries are computed by whichever worker or
      rank first needs them, and published for all the others.
    * a cross-process list passed as ``runtime_cache`` (a ``multiprocessing`` Manager's ``ListProxy``, or any
      ``BaseProxy``: Auto3DSeg's segresnet broadcasts one to the ranks of a node): the shared-memory cache, as
      ``runtime_cache=True``, shared by every worker and rank of the machine whichever proxy each holds; nothing is
      put in the list (its server process holds no item), and one log line says so.
    * another list-like object passed as ``runtime_cache`` (a plain list): used as the cache, with MONAI's meaning
      (private to whoever holds it); ``shared_memory=False`` gives MONAI's in-process cache back altogether.

    Processes find the same cache by a fingerprint of the data, the deterministic transforms (your own
    functions and classes by value: code, constants, closures and the globals they read) and the options;
    the cache is removed when the last process using it exits (or this dataset is garbage
    collected, or :meth:`set_data` replaces the data), and reclaimed if its users crashed.

    Differences from MONAI, all fixes:

    * ``hash_as_key=True`` with ``runtime_cache`` returns the right item (MONAI computes the entry from
      the data item at the *cache* position, so duplicates shift later items) and looks keys up in O(1).
    * ``runtime_cache=True`` with DataLoader worker processes caches across workers and epochs (MONAI's
      per-worker list is thrown away with each worker).
    * A random transform that writes into its input never changes the cached copy, whether ``copy_cache``
      is True or False (reads are copy-on-write mappings, so ``copy_cache=True`` needs no deep copy).
      Likewise an item returned without random transforms is a private copy: changing it does not change
      the cache (MONAI hands out the cached object itself).
    * With ``copy_cache=False`` the items carry only their own read's records in ``applied_operations``, as with
      ``copy_cache=True`` (MONAI hands the random transforms its cached object, where a random transform that does
      not run records itself, epoch after epoch).
    * A negative index with a partial cache (``cache_num < len(data)``) returns ``data[index]``'s item (MONAI
      takes the cache entry counted from the end of the *cache*).
    * An item holding a value the codec cannot store (without ``allow_pickle``) is served uncached, with one
      warning (MONAI's in-process list holds any object).

    Args:
        data: input data to load and transform to generate dataset for model.
        transform: transforms to execute operations on input data.
        cache_num: number of items to be cached. Default is `sys.maxsize`.
            will take the minimum of (cache_num, data_length x cache_rate, data_length).
        cache_rate: percentage of cached data in total, default is 1.0 (cache all).
            will take the minimum of (cache_num, data_length x cache_rate, data_length).
        num_workers: the number of worker threads if computing cache in the initialization.
            If num_workers is None then the number returned by os.cpu_count() is used.
            If a value less than 1 is specified, 1 will be used instead.
        progress: whether to display a progress bar.
        copy_cache: whether to `deepcopy` the cache content before applying the random transforms.
            With the shared-memory cache every read is already a private copy-on-write view, so no deep copy
            is made and the cache is protected either way; kept for MONAI's private-cache modes and the items a
            process keeps (``process_cache``), which with False go to the random transforms in new containers over
            their tensors (a transform writing into its input changes them, as in MONAI; its records do not).
        as_contiguous: whether to convert the cached NumPy array or PyTorch tensor to be contiguous.
        hash_as_key: whether to compute hash value of input data as the key to save cache,
            if key exists, avoid saving duplicated content.
        hash_func: if `hash_as_key`, a callable to compute hash from data items to be cached.
            defaults to `monai.data.utils.pickle_hashing`.
        runtime_cache: ``False`` to fill the cache during initialization; ``True``, ``"threads"`` or
            ``"processes"`` to fill it on the fly (in shared memory); a cross-process list (a Manager's
            ``ListProxy``) fills the shared-memory cache on the fly too, and stays empty; another list-like
            container is used as the cache with MONAI's semantics.
        shared_memory: keep the cache in shared memory (default). ``False`` restores MONAI's in-process
            cache (with the ``hash_as_key`` fix).
        shm_dir: tmpfs directory for the cache; default ``$MONAI_CACHE_SHM_DIR`` or ``/dev/shm``.
        shm_budget: most bytes this dataset's cache may take in shared memory, as an int or a string such
            as ``"8GiB"``; ``None`` for no limit other than the free space of ``shm_dir``. Items that do not
            fit are served uncached, with one warning.
        keep_warm: keep the cache in shared memory after the last process using it exits, so the next run
            on this machine starts warm (remove it with ``monai-cache clear --all``).
        keep_alive: seconds to keep the cache after the last process using it leaves, for a script or notebook
            run again within that time; ``None`` reads ``$MONAI_CACHE_KEEP_ALIVE`` (which every dataset class
            honours), else 0: removed at once, as before. Under torchrun the cache lives while the node's agent
            does (restarted ranks find it), then this many seconds more. See docs/shared-memory.md.
        allow_pickle: cache values that the codec cannot store natively (arbitrary objects) with pickle.
            Off by default: loading a cache never unpickles.
        cache_key: name the cache explicitly instead of fingerprinting data, transforms and options (for
            transforms that cannot be fingerprinted consistently across processes). Datasets with the same
            key share entries, so it must change whenever the data or deterministic transforms change.
        cache_dir: a directory where the cached items are also kept on disk (a second tier behind shared
            memory): an item missing from shared memory is read from there, and one computed is written there
            in the background, so the next run (after a reboot, or on another machine reading the same
            directory) starts warm. The files are those of ``monai_cache.PersistentDataset`` (format, packing,
            checks, compression); items are named by ``hash_func`` of the data item and a fingerprint of the
            cached transforms. Needs the shared-memory cache.
        shared_dir: ``cache_dir`` is shared by several machines (or by processes that may miss the same item at
            once): an item missing everywhere is computed by one process in all (see
            ``monai_cache.PersistentDataset``).
        process_cache: keep the items this process reads, decoded, in this process, in front of the shared-memory
            cache. None (default): only items whose tensors are on an accelerator, which a cached chain ending with
            ``ToDeviced`` makes (MONAI's fast-training recipe): each process copies an item to its device once and
            keeps it there, as MONAI's ``CacheDataset`` does, instead of copying it from shared memory at every
            read. True: every item (on the CPU, a private copy per process: MONAI's memory, and its speed of
            reads). False: none. Items kept are copied before the random transforms as MONAI copies its cache
            (``copy_cache``).
    """

    _pack_entries = True
    """Whether the store packs small entries into segments (``SharedMemoryStore(pack=...)``)."""
    _first_random: _FirstRandom | None = None
    """The index of the chain's first random transform, computed once per chain, not per read."""

    def __init__(
        self,
        data: Sequence,
        transform: Sequence[Callable] | Callable | None = None,
        cache_num: int = sys.maxsize,
        cache_rate: float = 1.0,
        num_workers: int | None = 1,
        progress: bool = True,
        copy_cache: bool = True,
        as_contiguous: bool = True,
        hash_as_key: bool = False,
        hash_func: Callable[..., bytes] = pickle_hashing,
        runtime_cache: Any = False,
        *,
        shared_memory: bool = True,
        shm_dir: str | None = None,
        shm_budget: int | str | None = None,
        keep_warm: bool = False,
        allow_pickle: bool = False,
        cache_key: str | None = None,
        cache_dir: str | os.PathLike | None = None,
        shared_dir: bool = False,
        process_cache: bool | None = None,
        keep_alive: float | None = None,
    ) -> None:
        self._init_shared_memory(
            shared_memory, shm_dir, shm_budget, keep_warm, allow_pickle, cache_key, cache_dir, shared_dir,
            process_cache, keep_alive=keep_alive,
        )
        # By name, as MONAI's own subclasses call it: in the apps datasets' MRO (ours, then MONAI's app class) a
        # user's ``super(DecathlonDataset, self).__init__(data, transform, ...)`` lands here, and must go on to
        # MONAI's CacheDataset, not back to the app class.
        _MonaiCacheDataset.__init__(
            self,
            data=data,
            transform=transform,
            cache_num=cache_num,
            cache_rate=cache_rate,
            num_workers=num_workers,
            progress=progress,
            copy_cache=copy_cache,
            as_contiguous=as_contiguous,
            hash_as_key=hash_as_key,
            hash_func=hash_func,
            runtime_cache=runtime_cache,
        )

    # -- setting up the cache --
    def _init_shared_memory(
        self,
        shared_memory: bool,
        shm_dir: str | None,
        shm_budget: int | str | None,
        keep_warm: bool,
        allow_pickle: bool,
        cache_key: str | None,
        cache_dir: str | os.PathLike | None = None,
        shared_dir: bool = False,
        process_cache: bool | None = None,
        keep_alive: float | None = None,
    ) -> None:
        """Our options, set before MONAI's ``CacheDataset.__init__`` (which calls :meth:`set_data`). Subclasses
        whose MONAI counterpart calls ``monai.data.CacheDataset.__init__`` by name (MONAI's apps datasets) call
        this first themselves."""
        # Attributes a subclass set before this may change what _load_cache_item computes: they are part of the
        # cache's fingerprint (MONAI's own are there already, when MONAI's __init__ ran first: see set_data).
        own = () if type(self) is CacheDataset else vars(self)
        self._subclass_attributes = tuple(name for name in own if name not in _MONAI_ATTRIBUTES)
        # None of these is randomizable, so MONAI's worker seeding (set_rnd walks __dict__ in order) gives the
        # transforms the same seeds as in MONAI.
        # Made here, not on first use: MONAI's worker_init_fn walks this object's __dict__ in every worker, and
        # thread workers (ThreadDataLoader(use_thread_workers=True)) read while others walk it: a key added by a
        # first read raised "dictionary changed size during iteration" in a worker, and the epoch yielded nothing.
        self._first_random = None
        self._disk_variant_key: str | None = None
        self.shared_memory = shared_memory
        self.shm_dir = shm_dir
        self.shm_budget = shm_budget
        self.keep_warm = keep_warm
        self.keep_alive = keep_alive_seconds(keep_alive)
        self.allow_pickle = allow_pickle
        self.cache_key = cache_key
        self.cache_dir = None if cache_dir is None else os.fspath(cache_dir)
        self.shared_dir = shared_dir
        self._store: SharedMemoryStore | None = None  # the shared-memory cache (MONAI's ``_cache`` shows it)
        self.process_cache = process_cache
        self._process_tier = ProcessTier(process_cache)  # items kept in this process (on an accelerator)
        self._disk: DiskStore | None = None  # the disk tier (cache_dir)
        self._disk_keys: dict[int, str] = {}  # data index -> entry key on disk (a dict: set_rnd skips it)
        self._hash_index: dict[bytes, int] = {}
        self._cache_data_index = np.zeros(0, dtype=np.int64)
        self._counts = {"hits": 0, "misses": 0}
        # a private cache's counters, also counted by the DataLoader workers forked from this process: made by set_data
        self._private_counters: SharedCounters | None = None

    def _in_shared_memory(self) -> bool:
        if not self.shared_memory:
            return False
        if isinstance(self.runtime_cache, BaseProxy):
            # A cross-process list (a Manager's ListProxy: Auto3DSeg's segresnet broadcasts one to the ranks of a
            # node) asks for one cache shared by processes: the node-wide cache is that, without a server process
            # that every read goes through. Its name never depends on the proxy, so every rank finds the same one.
            _note_proxy(self.runtime_cache)
            return True
        return self.runtime_cache in (False, None, True) or isinstance(self.runtime_cache, str)

    def _plan(self, data: Sequence) -> list[int]:
        """MONAI's choice of cached items; returns the data index of each cache entry."""
        if self.hash_as_key:
            # only the unique items are cached; the last data index of each duplicate is used (as in MONAI)
            mapping = {self.hash_func(v): i for i, v in enumerate(data)}
            self.cache_num = min(int(self.set_num), int(len(mapping) * self.set_rate), len(mapping))
            self._hash_keys = list(mapping)[: self.cache_num]
            indices = list(mapping.values())[: self.cache_num]
        else:
            self.cache_num = min(int(self.set_num), int(len(data) * self.set_rate), len(data))
            self._hash_keys = []
            indices = list(range(self.cache_num))
        self._hash_index = {k: i for i, k in enumerate(self._hash_keys)}
        self._cache_data_index = np.asarray(indices, dtype=np.int64)
        return indices

    def _store_length(self) -> int:
        """Entries of the shared-memory store: one per cache position (a negative cache_num / cache_rate caches
        nothing, as in MONAI)."""
        return max(0, self.cache_num)

    def _fingerprint(self) -> str:
        generation = (self._generation,) if self._generation else ()  # generation 0 keeps the plain key
        if self.cache_key is not None:
            return "key-" + fingerprint(self.cache_key, *generation)[:40]
        return "cd-" + fingerprint(
            type(self),  # a subclass by value: its methods' code
            {name: getattr(self, name, None) for name in self._subclass_attributes},
            __version__,
            codec.FORMAT_VERSION,
            library_versions(),
            fingerprint(self.data),
            relative_paths_base(self.data),  # relative paths read other files in another directory
            chain_fingerprint(self.transform),
            self.cache_num,
            self.hash_as_key,
            self.hash_func if self.hash_as_key else None,
            self.as_contiguous,
            self.allow_pickle,
            get_track_meta(),
            *generation,
        )[:40]

    def set_data(self, data: Sequence) -> None:
        """Set the input data and compute the cache for it, releasing the old entries.

        As in MONAI, call it between epochs with ``persistent_workers=False`` in the DataLoader, because
        the workers must be re-created to see the new data.
        """
        if "_store" not in self.__dict__:  # MONAI's CacheDataset.__init__ called by name, before ours: our defaults
            self._init_shared_memory(True, None, None, False, False, None)
        self._release_cache()
        self._store = None
        # Each call starts a new cache: set_data(the same list) recomputes (e.g. files changed on disk) even
        # while other processes still use the old one. Ranks calling it alike share each generation.
        self._generation = getattr(self, "_generation", -1) + 1
        if self.cache_dir is not None and not self._in_shared_memory():
            raise ValueError(
                "cache_dir keeps the shared-memory cache on disk too, so it needs the shared-memory cache: leave "
                "shared_memory=True and runtime_cache a bool or a string, or use monai_cache.PersistentDataset"
            )
        if not self._in_shared_memory():
            self._counts = {"hits": 0, "misses": 0}
            self._private_counters = SharedCounters(("hits", "misses"))
            super().set_data(data)  # MONAI's containers; our _transform applies the hash_as_key fix
            if self.hash_as_key:
                self._hash_index = {k: i for i, k in enumerate(self._hash_keys)}
                mapping = {self.hash_func(v): i for i, v in enumerate(self.data)}
                self._cache_data_index = np.asarray([mapping[k] for k in self._hash_keys], dtype=np.int64)
            return
        self.data = data
        indices = self._plan(data)
        store = SharedMemoryStore(
            self._fingerprint(),
            self._store_length(),
            shm_dir=self.shm_dir,
            budget=self.shm_budget,
            keep_warm=self.keep_warm,
            keep_alive=self.keep_alive,
            allow_pickle=self.allow_pickle,
            describe=_EntryName(self._cache_data_index),
            disk_tier=self.cache_dir,
            pack=self._pack_entries,
        )
        # the store gives its entries back when it is collected with this dataset (the last process using them
        # removes them); it is also MONAI's ``_cache``: a list-like of cache_num entries (SmartCacheDataset shows
        # its window there instead)
        self._store = store
        self._cache = store  # type: ignore[assignment]
        self._disk_keys = {}
        if self.cache_dir is not None:
            self._disk = DiskStore.open(self.cache_dir, allow_pickle=self.allow_pickle, shared=self.shared_dir)
        if self.runtime_cache in (False, None):
            filled = self._fill_cache(indices)
            if filled is not store:  # a subclass's _fill_cache made a cache of its own: use it, as MONAI does
                store.release()
                self._store = None
                self._cache = filled

    def _release_cache(self) -> None:
        store = self.__dict__.get("_store")
        if store is not None:
            store.release()
        tier = self.__dict__.get("_process_tier")
        if tier is not None:
            tier.clear()

    def _fill_cache(self, indices: Sequence[int] | None = None) -> Any:
        """Compute the cache before the first epoch (``runtime_cache=False``).

        In shared memory the work is split with the other processes filling the same cache: an entry that
        another process is computing is skipped and waited for at the end, so none is computed twice.
        """
        store = self._store
        if store is None:
            return super()._fill_cache(indices)
        if self.cache_num <= 0:
            return store
        if indices is None:
            indices = list(range(self.cache_num))
        if self.progress and not _has_tqdm:  # pragma: no cover
            warnings.warn("tqdm is not installed, will not show the caching progress bar.", stacklevel=2)

        # Only the entries not cached yet: a process joining a filled cache starts at once.
        self._fill_entries(store, self._fill_jobs(store, indices), self.num_workers, self.progress and _has_tqdm)
        release_freed_memory(force=True)  # what filling freed (glibc keeps ~100 MiB per filling process)
        return store

    def _fill_entries(
        self,
        store: SharedMemoryStore,
        jobs: Sequence[tuple[int, int]],
        threads: int | None,
        progress: bool = False,
        load: Callable[[int], Any] | None = None,
    ) -> None:
        """Compute and publish entries with ``threads`` threads, split with the other processes filling them: an
        entry another process is computing is skipped and waited for at the end, so none is computed twice.

        Args:
            store: the shared-memory store.
            jobs: ``(entry, data index)`` pairs.
            threads: worker threads (``None``: one per CPU).
            progress: show a progress bar.
            load: computes the item of a data index (default: :meth:`_load_cache_item`, through the disk tier if
                there is one).
        """
        def make(data_index: int) -> Callable[[], Any]:
            return self._computer(data_index) if load is None else partial(load, data_index)

        def fill(job: tuple[int, int]) -> tuple[int, int] | None:
            entry, data_index = job
            return None if store.fill(entry, make(data_index)) else job

        # One thread (MONAI's default num_workers=1): this one. A pool thread's items are freed into its own malloc
        # arena, whose top (up to one item: 20 MiB of CT after the fill, measured) malloc_trim does not give back.
        with contextlib.nullcontext() if threads == 1 else ThreadPool(threads) as pool:
            # Hand the threads jobs in chunks once there are many: one job at a time costs a thread hand-over
            # per item (about 45 us, a fifth of what a 16 KiB item costs to make and store), while 64 chunks or
            # more per thread still keep them evenly busy with items that take long.
            chunk = max(1, len(jobs) // (64 * (threads or os.cpu_count() or 1)))
            results = map(fill, jobs) if pool is None else pool.imap(fill, jobs, chunksize=chunk)
            if progress:
                results = tqdm(results, total=len(jobs), desc="Loading dataset")
            deferred = [job for job in results if job is not None]
        for entry, data_index in deferred:  # entries other processes were computing: wait, then make sure
            while not store.fill(entry, make(data_index)):
                store.wait_for(entry)

    def _fill_jobs(self, store: SharedMemoryStore, indices: Sequence[int]) -> list[tuple[int, int]]:
        """``(entry, data index)`` of the entries to fill that no process has published yet: entry ``k`` holds
        ``indices[k]`` (a subclass whose entries are keyed otherwise overrides this)."""
        return [(slot, indices[slot]) for slot in store.missing()]

    def _computes_private(self, data_index: int, compute: Callable[[], Any]) -> Callable[[Any], Any] | bool:
        """Whether what ``compute`` (:meth:`_computer`) returns for ``data_index`` may be returned as it is on a miss
        (rather than a decode of what was just stored), without MONAI's deep copy before the random transforms.

        It shares nothing with the data when the data item is dicts, lists and tuples of strings, numbers and paths
        (a file list's item, which ``as_contiguous`` rebuilds); then an item read from the disk tier is this
        process's alone, and a computed one is checked for what the transforms may keep, and given copies of
        memory that cannot be vouched for (:func:`~monai_cache.sharing.make_private`)."""
        if self.as_contiguous is not True or not immutable_leaves(self.data[data_index]):
            return False
        return compute.private if type(compute) is _FromDisk else make_private

    def _computer(self, data_index: int) -> Callable[[], Any]:
        """What fills a missing shared-memory entry: the cached transforms, or, with a disk tier, its entry on
        disk (read, or computed and written there)."""
        compute = partial(self._load_cache_item, data_index)
        if self._disk is None:
            return compute
        key = self._disk_keys.get(data_index)
        if key is None:
            key = self._disk_keys[data_index] = entry_key(
                self.hash_func(self.data[data_index]).decode("utf-8"), self._disk_variant()
            )
        return _FromDisk(self._disk, key, compute)

    def _disk_variant(self) -> str:
        """What the disk tier's entries hold beyond the data item: the cached transforms and the options that change
        them (taken once; the shared-memory cache's name covers the same)."""
        variant = getattr(self, "_disk_variant_key", None)
        if variant is None:
            variant = self._disk_variant_key = fingerprint(
                "monai_cache.CacheDataset",
                type(self),
                {name: getattr(self, name, None) for name in self._subclass_attributes},
                DISK_FORMAT_VERSION,
                codec.FORMAT_VERSION,
                library_versions(),
                chain_fingerprint(self.transform),
                self.as_contiguous,
                self.allow_pickle,
                get_track_meta(),
            )[:16]
        return str(variant)

    # -- reading --
    def _cache_index_of(self, index: int) -> int | None:
        if self.hash_as_key:
            return self._hash_index.get(self.hash_func(self.data[index]))
        n = len(self)
        if not -n <= index < n:  # as MONAI's list does: iteration (``for item in ds``) relies on it
            raise IndexError(f"index {index} is out of range for a dataset of {n} items")
        if index % n < self.cache_num:  # a negative index counts from the end of the data, as in MONAI
            return index % n
        return None

    def __getitem__(self, index: Any) -> Any:
        if type(index) is int:  # a DataLoader's read: MONAI's checks for a slice or a sequence cost more than a hit
            return self._transform(index)
        return super().__getitem__(index)

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """A DataLoader batch's items (torch's fetchers call this with the batch's indices), each as ``self[index]``
        gives it: first every item's cached part (hits read, misses computed and published together when that is
        done: :meth:`SharedMemoryStore.publishing_batch`), then every item's random transforms, in the batch's
        order, so that they draw the same random numbers as item by item. Nothing writes into a computed item before
        it is published, so it is encoded from the item itself, not from a copy; and the batch's loads, encodings and
        random transforms each run in a row (see ``publishing_batch``). Computed items are held a few MiB at a
        time (large ones one at a time, as item by item). An error in an item's cached transforms reaches the
        caller before the random transforms of the items before it have run (those items are published all the
        same); the batch is lost either way. A subclass that reads items its own way (its own ``__getitem__`` or
        ``_transform``) gets them item by item, published together all the same."""
        store = self._store
        if store is None:
            return [self[index] for index in indices]
        cls = type(self)
        if (
            cls.__getitem__ is not CacheDataset.__getitem__
            or cls._transform is not CacheDataset._transform
            or any(type(index) is not int for index in indices)
        ):
            with store.publishing_batch():
                return [self[index] for index in indices]
        if not loader._meta_blocks_checked:  # first read in this process: in another loader's worker?
            loader.send_meta_tensors_as_blocks()
        items: list[Any] = []
        while len(items) < len(indices):
            group = indices[len(items) :]
            cached = []
            with store.publishing_batch(untouched=True) as batch:
                for index in group:
                    cached.append(self._cached_part(index))
                    if batch.full:  # large items: each one's random transforms before the next is computed
                        break
            for k, index in enumerate(group[: len(cached)]):
                part, cached[k] = cached[k], None  # not held past its random transforms (a view maps an entry)
                items.append(self._random_part(index, part))
        return items

    def _transform(self, index: int) -> Any:
        if not loader._meta_blocks_checked:  # first read in this process: in another loader's worker?
            loader.send_meta_tensors_as_blocks()
        return self._random_part(index, self._cached_part(index))

    def _cached_part(self, index: int) -> tuple[Any, bool] | None:
        """Item ``index`` through the cached transforms, and whether it is this read's alone (a fresh view of the
        shared copy, or a computed item no one else holds: the random transforms need no copy of it); None for an
        index the cache does not hold."""
        cache_index = self._cache_index_of(index)
        if cache_index is None:
            return None
        if self._cache is None:
            raise RuntimeError("cache buffer is not initialized, please call `set_data()` first.")
        data_index = int(self._cache_data_index[cache_index]) if self.hash_as_key else cache_index
        store = self._store
        if store is not None:
            data = self._process_tier.get(cache_index)  # kept in this process (an item on an accelerator)
            private = data is None
            if private:
                # every read is a fresh copy-on-write view: random transforms cannot reach the shared copy,
                # so no deep copy is needed whatever copy_cache says
                data = store[cache_index]  # a hit costs one read; what a miss needs is worked out on a miss
                if data is None:
                    compute = self._computer(data_index)
                    data = store.get_or_compute(
                        cache_index, compute, reuse_computed=self._computes_private(data_index, compute), missing=True
                    )
                private = not self._process_tier.offer(cache_index, data)
            return data, private
        data = self._cache[cache_index]
        counters = self._private_counters
        if data is None:  # runtime cache computation, from the right data item (MONAI bug fix)
            self._counts["misses"] += 1
            if counters is not None:
                counters.add({"misses": 1})
            data = self._cache[cache_index] = self._load_cache_item(data_index)
        else:
            self._counts["hits"] += 1
            if counters is not None:
                counters.count_read(0)  # this process's own slot: no lock
        return data, False

    def _random_part(self, index: int, cached: tuple[Any, bool] | None) -> Any:
        """The rest of item ``index``'s transforms, from what :meth:`_cached_part` gave for it."""
        if cached is None:
            # no cache for this index, execute all the transforms directly
            return _MonaiDataset._transform(self, index)
        data, private = cached
        if not isinstance(self.transform, Compose):  # e.g. reassigned to a plain callable; MONAI's message
            raise ValueError("transform must be an instance of monai.transforms.Compose.")
        transforms = self.transform.transforms
        memo = self._first_random
        if memo is not None and memo.transforms is transforms:
            first_random = memo.index
        else:  # MONAI's Compose holds a tuple: a changed chain is a new tuple, so the index is kept with its tuple
            first_random = first_random_index(self.transform)
            self._first_random = _FirstRandom(transforms, first_random) if type(transforms) is tuple else None
        if first_random is not None:
            if not private:  # kept in this process, or a private cache: MONAI's object itself
                # copy_cache=False: new containers, so that the records of the random transforms stay with this
                # read (MONAI bug: they pile up in its cached item), its tensors still the kept ones, as in MONAI
                data = deepcopy(data) if self.copy_cache is True else with_new_containers(data)
            data = self.transform(data, start=first_random)
        elif not private and self._store is not None and self.copy_cache is True:
            data = deepcopy(data)  # kept in this process: what we hand out is a copy, as every other read
        return data

    # -- bookkeeping --
    def cache_stats(self) -> dict[str, dict[str, Any]]:
        """Cache counters: ``{"process": {...}, "total": {...}, "stored": {"entries", "bytes"}}``, the shape every
        dataset of monai_cache returns (keys documented in :func:`monai_cache.runtime.cache_stats`).

        ``process`` counts this process (in a DataLoader worker: the worker); ``total`` is shared by every process
        of the machine using the same shared-memory cache (DataLoader workers and ranks: called in the main process,
        ``total`` shows what its workers read); ``stored`` is what the cache holds. With a private cache
        (``shared_memory=False``, or a plain list passed as ``runtime_cache``), ``process`` holds this process's
        ``hits`` and ``misses``, ``total`` those of this process and the DataLoader workers forked from it (each with
        a private cache of its own, as in MONAI), and ``stored`` this process's entries and their tensor bytes. With a
        ``cache_dir``, ``"disk"`` holds the disk tier's counters (``misses`` above then counts items read from
        disk or computed). Once this process keeps items of its own (``process_cache``: items on an accelerator),
        ``"process_cache"`` holds ``entries``, ``bytes``, ``hits`` (reads served from them, not counted above) and
        ``device``.
        """
        if self._store is not None:
            stats: dict[str, Any] = self._store.stats()
            if self._disk is not None:
                stats["disk"] = self._disk.stats()
            tier = self._process_tier
            if len(tier) or tier.hits:
                stats["process_cache"] = tier.stats()
            return stats
        counts = dict.fromkeys(COUNTERS, 0)
        counts.update(self._counts)
        total = dict(counts)
        if self._private_counters is not None:
            total.update(self._private_counters.snapshot())
        held = [self._cache[i] for i in range(len(self._cache))]
        held = [item for item in held if item is not None]
        return cache_stats(counts, total, len(held), sum(codec.item_nbytes(item) for item in held))

    def release(self) -> None:
        """Stop using the shared-memory cache now (it is removed if this was its last user). A disk tier's
        pending writes go on in the background (see :meth:`flush`)."""
        self._release_cache()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until this process's pending writes to the disk tier (``cache_dir``) are on disk.

        Args:
            timeout: seconds to wait at most; None waits as long as needed.

        Returns:
            False if the timeout passed with writes still pending (True without a ``cache_dir``).
        """
        return True if self._disk is None else self._disk.flush(timeout)
