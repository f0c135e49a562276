"""MONAI's ``SmartCacheDataset`` on the shared-memory store: one copy per machine, one schedule for every process.

Thin glue, as :mod:`monai_cache.dataset`: MONAI's class keeps its schedule (the running window, the background
replacement thread and its hand-over to ``update_cache()``); entries live in
:class:`~monai_cache.shm.SharedMemoryStore`, keyed by position in the (shuffled) data, and the window each process
reads is published through :class:`~monai_cache.shm_window.SharedWindow`.
"""

from __future__ import annotations

import math
import sys
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from copy import copy, deepcopy
from typing import Any

import numpy as np
from monai.data import SmartCacheDataset as _MonaiSmartCacheDataset
from monai.transforms import Randomizable
from torch.utils.data import get_worker_info

from monai_cache.dataset import CacheDataset
from monai_cache.fingerprint import fingerprint
from monai_cache.shm import SharedMemoryStore
from monai_cache.shm_window import SharedWindow

__all__ = ["SmartCacheDataset"]


class CachedItems:
    """One of MONAI's lists of cached items (``SmartCacheDataset._cache``: the window; ``_replacements``: the next
    replacements), as a view of the shared-memory store.

    Item ``k`` is the entry of data index ``indices()[k]``, decoded at each access (a private copy-on-write view, as
    every read), or None where ``indices()`` holds None (a replacement not computed yet). ``len``, indexing,
    negative indices, slices, iteration and ``copy.deepcopy`` behave as on MONAI's list (a slice, ``copy.copy`` and
    ``copy.deepcopy`` give lists of items); nothing is decoded until it is asked for. An entry missing from shared
    memory (over the budget) is computed, as the dataset's read would.

    Slots only, no ``__dict__``: MONAI's ``set_rnd`` (its DataLoader's worker seeding) walks the dataset's lists, and
    would decode every item of the window to find none random.

    Args:
        store: the dataset's shared-memory store (one entry per data item).
        indices: gives the data indices of the list now (the window's are the owner's list, or the shared window
            file in a DataLoader worker).
        computer: the dataset's ``_computer`` (held weakly: the view must not keep its dataset alive).
    """

    __slots__ = ("_computer", "_indices", "_store")

    def __init__(
        self,
        store: SharedMemoryStore,
        indices: Callable[[], Sequence[int | None]],
        computer: Callable[[int], Callable[[], Any]],
    ) -> None:
        self._store = store
        self._indices = indices
        self._computer = weakref.WeakMethod(computer)  # type: ignore[arg-type]

    def _item(self, data_index: int | None) -> Any:
        if data_index is None:
            return None
        item = self._store[data_index]
        if item is None:
            computer = self._computer()
            if computer is not None:
                item = self._store.get_or_compute(data_index, computer(data_index))
        return item

    def __len__(self) -> int:
        return len(self._indices())

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self._item(i) for i in self._indices()[index]]
        return self._item(self._indices()[index])

    def __iter__(self) -> Iterator[Any]:
        for data_index in list(self._indices()):
            yield self._item(data_index)

    def __copy__(self) -> list:
        return list(self)

    def __deepcopy__(self, memo: dict) -> list:
        return [deepcopy(item, memo) for item in self]

    def __reduce__(self) -> tuple:  # pickled alone (not as part of its dataset, which rebuilds it): MONAI's list
        return list, (list(self),)

    def __repr__(self) -> str:
        return f"CachedItems(data indices {list(self._indices())})"


class SmartCacheDataset(CacheDataset, _MonaiSmartCacheDataset):
    """MONAI's ``SmartCacheDataset`` with one cache per machine, in shared memory, that every process follows.

    Every argument of :class:`monai.data.SmartCacheDataset` keeps its meaning, and so does its schedule: the
    same ``seed`` gives the same items at every ``update_cache()`` (``shuffle`` shuffles a copy of ``data`` with
    it; the cache is a running window of ``cache_num`` items over that copy that moves on by
    ``ceil(cache_num * replace_rate)`` items per update, computed ahead by a background thread). Use it the same
    way: ``start()``, ``update_cache()`` before every epoch after the first, ``shutdown()`` at the end, or
    ``monai.handlers.SmartCacheHandler`` (it accepts this class: it is a ``monai.data.SmartCacheDataset``).

    What changes is where the items live and who sees the updates:

    * The cached items are in ``/dev/shm``, once per machine: every DDP rank and DataLoader worker maps them
      without copying. Ranks that build the same dataset (same data, transforms, ``seed``) share them, compute
      each item once (the first window split among them, each replacement by whichever rank gets to it first),
      and agree on what is cached, since the schedule depends only on the arguments and the number of updates.
    * DataLoader workers follow ``update_cache()`` whatever their start method and lifetime: the window is
      read from a small shared file at every item, so ``persistent_workers=True`` and ``spawn`` work (MONAI's
      class cannot be pickled for spawned workers, and persistent workers keep their first window forever).
    * Entries that left the cache are removed one update later (a rank one update behind still finds its
      items), so shared memory holds at most ``cache_num + 2 * ceil(cache_num * replace_rate)`` items while
      the ranks are within one update of each other: the window, the one before it, and the replacements being
      computed for the next.

    Differences from MONAI, all fixes (``docs/migrating.md`` shows each):

    * ``shutdown()`` then ``start()`` (for example ``trainer.run()`` called again with ``SmartCacheHandler``)
      continues the running window. MONAI resets its position but not its cache, so the next windows hold some
      items twice and miss others (and whether the first update after ``start()`` uses replacements computed
      before the shutdown depends on thread timing).
    * ``set_data()`` starts the schedule afresh for the new data: MONAI keeps the first data's length and
      replacement count (an ``IndexError``, or items never seen, when the length changes) and may put
      replacements computed from the old data into the new cache.
    * An error computing a replacement (a missing file, a failing transform) is raised by ``update_cache()``,
      naming the data item; MONAI's background thread dies and ``update_cache()`` waits forever.
    * The dataset can be pickled (spawned DataLoader workers, ``torch.multiprocessing.spawn``); a copy starts
      without the background thread, and one that calls ``update_cache()`` drives its own schedule.
    * MONAI's ``worker_init_fn`` seeds the random transforms of DataLoader workers as it does for any other
      dataset; MONAI's class keeps them out of it, so all its workers draw the same random numbers, every epoch.

    As in :class:`monai_cache.CacheDataset`, every read is a private copy-on-write view (a random transform
    cannot change the cache, whatever ``copy_cache`` says), and an item the codec cannot store is served
    uncached with one warning.

    Args:
        data: input data to load and transform to generate dataset for model.
        transform: transforms to execute operations on input data.
        replace_rate: percentage of the cached items to be replaced in every epoch (default to 0.1).
        cache_num: number of items to be cached. Default is `sys.maxsize`.
            will take the minimum of (cache_num, data_length x cache_rate, data_length).
        cache_rate: percentage of cached data in total, default is 1.0 (cache all).
            will take the minimum of (cache_num, data_length x cache_rate, data_length).
        num_init_workers: the number of worker threads to initialize the cache for first epoch.
            If num_init_workers is None then the number returned by os.cpu_count() is used.
            If a value less than 1 is specified, 1 will be used instead.
        num_replace_workers: the number of worker threads to prepare the replacement cache for every epoch.
            If num_replace_workers is None then the number returned by os.cpu_count() is used.
            If a value less than 1 is specified, 1 will be used instead.
        progress: whether to display a progress bar when caching for the first epoch.
        shuffle: whether to shuffle the whole data list before preparing the cache content for first epoch.
            it will not modify the original input data sequence in-place.
        seed: random seed if shuffle is `True`, default to `0`.
        copy_cache: whether to `deepcopy` the cache content before applying the random transforms. With the
            shared-memory cache every read is already a private copy-on-write view, so no deep copy is made
            and the cache is protected either way; kept for ``shared_memory=False``.
        as_contiguous: whether to convert the cached NumPy array or PyTorch tensor to be contiguous.
            it may help improve the performance of following logic.
        runtime_cache: Default to `False`, other options are not implemented yet (as in MONAI).
        shared_memory: keep the cache in shared memory (default). ``False`` restores MONAI's in-process cache
            (with the fixes above; workers then see the window of their start only, as with MONAI's class).
        shm_dir: tmpfs directory for the cache; default ``$MONAI_CACHE_SHM_DIR`` or ``/dev/shm``.
        shm_budget: most bytes this dataset's cache may take in shared memory, as an int or a string such as
            ``"8GiB"``; ``None`` for no limit other than the free space of ``shm_dir``. Items that do not fit
            are served uncached, with one warning.
        keep_warm: keep the cache in shared memory after the last process using it exits (remove it with
            ``monai-cache clear --all``).
        allow_pickle: cache values that the codec cannot store natively (arbitrary objects) with pickle.
            Off by default: loading a cache never unpickles.
        cache_key: name the cache explicitly instead of fingerprinting the data, transforms and options (for
            transforms that cannot be fingerprinted consistently across processes). Datasets with the same
            key share entries, so it must change whenever the data or deterministic transforms change (the
            shuffled order is added to it).
        process_cache: keep the items this process reads in this process too (None, the default: items on an
            accelerator, so that a chain ending with ``ToDeviced`` keeps the window on the device as MONAI does; True:
            every item; False: none); items that leave the window leave it too. See
            :class:`monai_cache.CacheDataset`.
    """

    _pack_entries = False  # entries come and go: each in a file of its own, so that removing it frees its memory

    def __init__(
        self,
        data: Sequence,
        transform: Sequence[Callable] | Callable | None = None,
        replace_rate: float = 0.1,
        cache_num: int = sys.maxsize,
        cache_rate: float = 1.0,
        num_init_workers: int | None = 1,
        num_replace_workers: int | None = 1,
        progress: bool = True,
        shuffle: bool = True,
        seed: int = 0,
        copy_cache: bool = True,
        as_contiguous: bool = True,
        runtime_cache: Any = False,
        *,
        shared_memory: bool = True,
        shm_dir: str | None = None,
        shm_budget: int | str | None = None,
        keep_warm: bool = False,
        allow_pickle: bool = False,
        cache_key: str | None = None,
        process_cache: bool | None = None,
    ) -> None:
        if runtime_cache is False and replace_rate <= 0:  # MONAI's check, made before filling the cache
            raise ValueError("replace_rate must be greater than 0, otherwise, please use monai.data.CacheDataset.")
        self._init_shared_memory(
            shared_memory, shm_dir, shm_budget, keep_warm, allow_pickle, cache_key, process_cache=process_cache
        )
        self.replace_rate = replace_rate
        self._shared_window: SharedWindow | None = None  # the window workers read (shared memory only)
        self._window: list[int] = []  # MONAI's list of cached items, as data indices (shared memory only)
        self._replacement_indices: list[int | None] = []  # MONAI's replacements, as data indices (the same)
        self._previous_window: list[int] = []
        self._replace_error: BaseException | None = None
        # MONAI's __init__ reaches MONAI's CacheDataset.__init__ (not ours: this class's MRO puts MONAI's
        # SmartCacheDataset after our CacheDataset), which calls set_data below.
        _MonaiSmartCacheDataset.__init__(
            self,
            data=data,
            transform=transform,
            replace_rate=replace_rate,
            cache_num=cache_num,
            cache_rate=cache_rate,
            num_init_workers=num_init_workers,
            num_replace_workers=num_replace_workers,
            progress=progress,
            shuffle=shuffle,
            seed=seed,
            copy_cache=copy_cache,
            as_contiguous=as_contiguous,
            runtime_cache=runtime_cache,
        )
        self._show_items()  # MONAI's __init__ ends by setting _replacements to a list of its own

    # -- pickling (spawned workers): a lock and a thread do not cross processes; views are made anew --
    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.update(_update_lock=None, _replace_mgr=None, _replace_error=None)
        if self._store is not None:
            state.update(_cache=None, _replacements=None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._update_lock = threading.Lock()
        self._show_items()

    def _show_items(self) -> None:
        """Point MONAI's ``_cache`` and ``_replacements`` at views of the items in shared memory."""
        store, window = self._store, self._shared_window
        if store is None or window is None:
            return
        self._cache = CachedItems(store, window.indices, self._computer)  # type: ignore[assignment]
        replacements = self._replacement_indices
        self._replacements = CachedItems(store, lambda: replacements, self._computer)  # type: ignore[assignment]

    def set_random_state(
        self, seed: int | None = None, state: np.random.RandomState | None = None
    ) -> SmartCacheDataset:
        """Set the random state that shuffles the data (MONAI's). In a DataLoader worker, where MONAI's
        ``worker_init_fn`` calls it with the worker's seed, the random transforms get that seed too, as that
        function gives it to them for every other dataset (MONAI's class leaves them with the state they had when
        the worker started: every worker, every epoch, draws the same random numbers).

        Args:
            seed: set the random state with an integer seed.
            state: set the random state with a ``np.random.RandomState`` object.
        """
        super().set_random_state(seed=seed, state=state)
        transform = getattr(self, "transform", None)  # MONAI's __init__ calls this before setting it
        if seed is not None and get_worker_info() is not None and isinstance(transform, Randomizable):
            transform.set_random_state(seed=seed)
        return self

    # -- setting up the cache --
    def set_data(self, data: Sequence) -> None:
        """Set the input data, shuffle a copy of it (``shuffle=True``) and cache its first window.

        As in MONAI, call :meth:`shutdown` first (it is called for you, with MONAI's warning) and :meth:`start`
        after; the schedule starts again from the first window of the new data.
        """
        if self.is_started():
            warnings.warn("SmartCacheDataset is not shutdown yet, shutdown it directly.", stacklevel=2)
            self.shutdown()
        if self._in_shared_memory() and self.shuffle:  # MONAI's SmartCacheDataset.set_data does it otherwise
            data = copy(data)
            self.randomize(data)
        super().set_data(data)
        self._restart_schedule()

    def _restart_schedule(self) -> None:
        """MONAI's schedule from the first window of the current data (MONAI sets it up in ``__init__`` only)."""
        total = len(self.data)
        self._total_num = total
        self._replace_num = min(math.ceil(self.cache_num * self.replace_rate), total - self.cache_num)
        self._replacements = [None for _ in range(self._replace_num)]
        self._replacement_indices = [None for _ in range(self._replace_num)]
        self._replace_data_idx = list(range(self._replace_num))
        self._start_pos = 0
        self._replace_done = False  # no replacement computed from the old data is used
        self._replace_error = None
        self._compute_data_idx()
        self._previous_window = []
        if self._store is not None:
            self._window = list(range(max(self.cache_num, 0)))
            capacity = max(self.cache_num, self._replace_num, 0)  # MONAI's list grows to replace_num if larger
            self._shared_window = SharedWindow(self._store.path, capacity, self._window)
            self._show_items()
        else:
            self._window, self._shared_window = [], None

    def _plan(self, data: Sequence) -> list[int]:
        window = super()._plan(data)  # MONAI's cache_num; the first window is the first cache_num items
        self._cache_data_index = np.arange(len(data), dtype=np.int64)  # entry i holds data item i
        return window

    def _store_length(self) -> int:
        return len(self.data)  # an entry per data item: items move in and out of the window

    def _fill_jobs(self, store: SharedMemoryStore, indices: Sequence[int]) -> list[tuple[int, int]]:
        missing = set(store.missing())
        return [(i, i) for i in indices if i in missing]

    def _fingerprint(self) -> str:
        key = super()._fingerprint()
        if self.cache_key is None:
            return key  # this class and the shuffled data are part of it
        # entries are keyed by position in the shuffled data: a cache_key names the data, not its order
        return "key-" + fingerprint(key, "SmartCacheDataset", self.data)[:40]

    def _release_cache(self) -> None:
        window = getattr(self, "_shared_window", None)
        if window is not None:
            window.close()
        super()._release_cache()

    # -- reading --
    def _cache_index_of(self, index: int) -> int:
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"index {index} is out of range for a dataset of {n} items")
        if self._shared_window is None:
            return index % n  # a position in MONAI's list of cached items
        return self._shared_window.indices()[index % n]  # the data index, also the entry's

    # -- the schedule: MONAI's, on data indices --
    def _compute_replacements(self) -> None:
        """Compute the replacements of the next window (in the background thread, holding MONAI's update lock).

        In shared memory, an item another rank is computing is skipped and waited for at the end: the ranks split
        the work, and each item is computed once on the machine.
        """
        store = self._store
        if store is None:
            super()._compute_replacements()  # MONAI's: _replace_cache_thread in a pool of threads
            return
        jobs = [(data_index, data_index) for data_index in self._replace_data_idx]
        self._fill_entries(store, jobs, self.num_replace_workers, load=self._load_replacement)
        self._replacement_indices[:] = self._replace_data_idx
        self._replace_done = True

    def _replace_cache_thread(self, index: int) -> None:
        self._replacements[index] = self._load_replacement(self._replace_data_idx[index])

    def _load_replacement(self, data_index: int) -> Any:
        try:
            return self._load_cache_item(data_index)
        except Exception as e:
            root: BaseException = e
            while root.__cause__ is not None:  # MONAI's "applying transform ..." wraps what went wrong
                root = root.__cause__
            why = f"{e}" if root is e else f"{e}: {type(root).__name__}: {root}"
            raise RuntimeError(
                f"SmartCacheDataset could not compute data item {data_index} ({_brief(self.data[data_index])}) for "
                f"the next update_cache(): {why}"
            ) from e

    def manage_replacement(self) -> None:
        """The background thread (MONAI's loop). An error computing a replacement ends it; the next
        :meth:`update_cache` raises that error, and the one after starts the thread again."""
        try:
            super().manage_replacement()
        except Exception as e:
            self._replace_error = e

    def _restart(self) -> None:
        self._replace_error = None
        super()._restart()

    def _try_update_cache(self) -> bool:
        with self._update_lock:
            if self._replace_error is not None:
                raise self._replace_error
            if not self._replace_done:
                return False
            previous = list(self._window)
            # MONAI's list operations and bookkeeping, on data indices in shared memory (on items otherwise)
            shared = self._shared_window is not None
            held: Any = self._window if shared else self._cache
            del held[: self._replace_num]
            held.extend(self._replacement_indices if shared else self._replacements)
            self._start_pos += self._replace_num
            if self._start_pos >= self._total_num:
                self._start_pos -= self._total_num
            self._compute_data_idx()
            self._round += 1
            self._replace_done = False
            if self._shared_window is not None:
                self._shared_window.publish(self._window)
                self._evict(previous)
            return True

    def _evict(self, previous: list[int]) -> None:
        """Remove the entries of the window before ``previous`` that are not in ``previous``, the current window
        or the next replacements: a rank (or worker) one update behind still finds its items."""
        keep = set(previous) | set(self._window) | set(self._replace_data_idx)
        self._process_tier.keep_only(set(self._window) | set(self._replace_data_idx))  # MONAI's cache: its lists
        store = self._store
        if store is not None:
            for data_index in sorted(set(self._previous_window) - keep):
                store.remove(data_index)
        self._previous_window = previous

    def _try_shutdown(self) -> bool:
        with self._update_lock:
            if self._replace_done or self._replace_error is not None:
                self._round = 0  # the thread stops; the window and the replacements computed for it stay
                return True
            return False


def _brief(item: Any, limit: int = 200) -> str:
    text = repr(item)
    return text if len(text) <= limit else text[: limit - 3] + "..."
