"""Drop-in ``PersistentDataset``: compact, checksummed cache files written by a background thread.

Thin glue over :mod:`monai_cache.disk` (files, writer thread) and :mod:`monai_cache.codec` (encoding).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from copy import deepcopy
from functools import partial
from pathlib import Path
from typing import Any

import torch
from monai.data import PersistentDataset as _MonaiPersistentDataset
from monai.data.meta_obj import get_track_meta
from monai.data.utils import SUPPORTED_PICKLE_MOD, pickle_hashing
from monai.utils import look_up_option
from torch.serialization import DEFAULT_PROTOCOL

from monai_cache import codec, compat, loader
from monai_cache.disk import DiskStore
from monai_cache.disk_format import DEFAULT_COMPRESSION_LEVEL, DISK_FORMAT_VERSION, StoredEntry, entry_key
from monai_cache.fingerprint import cacheable_transforms, chain_fingerprint, fingerprint, library_versions
from monai_cache.runtime import COUNTERS, cache_stats
from monai_cache.shm import SharedMemoryStore

__all__ = ["DEFAULT_COMPRESSION_LEVEL", "PersistentDataset"]



def _as_dtype(value: Any, key: str) -> torch.dtype:
    dt = value if isinstance(value, torch.dtype) else getattr(torch, str(value).replace("torch.", ""), None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"lossy_dtypes[{key!r}] must be a torch dtype such as torch.float16, got {value!r}")
    if dt not in codec.STORABLE_DTYPES:
        # float8 and quantized dtypes would pass here and fail on the first item, deep in the writer
        names = ", ".join(sorted(map(str, codec.STORABLE_DTYPES)))
        raise ValueError(f"lossy_dtypes[{key!r}] = {dt} cannot be stored in the cache; use one of: {names}")
    return dt


class PersistentDataset(_MonaiPersistentDataset):
    """MONAI's ``PersistentDataset`` with compact, checksummed cache files written in the background.

    Every argument of :class:`monai.data.PersistentDataset` keeps its meaning, and the hooks
    ``_pre_transform``, ``_post_transform``, ``_cachecheck`` and ``_transform`` can be overridden as in
    MONAI. What changes is how cached items are stored:

    * **Asynchronous writes.** On a cache miss ``__getitem__`` returns as soon as the item is computed; a
      background thread (one per process, DataLoader workers included) encodes and writes it. The queue is
      bounded (``max_pending_writes`` items, ``max_pending_bytes`` bytes): when it is full ``__getitem__``
      waits. Pending writes are flushed when the process exits normally, DataLoader workers included.
      ``async_writes=False`` writes inside ``__getitem__``, as MONAI does.
    * **Compact files.** Items are stored with :mod:`monai_cache.codec` (tensors as raw bytes, metadata as
      JSON), in the smallest dtype that holds each tensor exactly (``downcast=True``, lossless), and
      compressed with zstd (``compression_level``). Optionally, ``lossy_dtypes`` stores chosen keys in a
      smaller dtype *with* loss of precision. Small items (records under :data:`monai_cache.disk.PACK_LIMIT`,
      256 KiB encoded) are appended to a few shared pack files instead of one file each, so that file-system
      blocks and inodes add little (under 10% for 16 KiB items); larger items get their own file.
    * **Safe loading.** Loading never unpickles anything (unless ``allow_pickle=True``). Each file carries a
      format version and CRC-32 checksums; a truncated, damaged or foreign file is reported once, removed
      and recomputed (a damaged packed record is reported once, ignored and superseded by the recomputed
      one). Files are written to a temporary name in the cache directory and renamed, and a packed record is
      indexed only once complete, so a killed process never leaves a partial entry that is read, and two
      processes writing one item leave valid entries. Files are created with mode 0600 and a cache
      directory we create with mode 0700.
    * **No stale entries.** With the default ``hash_transform=None`` the file names include a fingerprint of
      the cached (deterministic) transforms and of the options that change what is stored (``track_meta``,
      ``reset_ops_id``, ``lossy_dtypes``, ``allow_pickle``), so changing, say, ``Spacingd``'s ``pixdim``
      never serves old entries. An explicit ``hash_transform`` keeps MONAI's meaning: its hash is appended
      to the names and the transform fingerprint is left out.
    * **MONAI's own cache files** (``<hash>.pt``) in ``cache_dir`` are ignored: never opened, never
      unpickled, never deleted (except by :meth:`set_data`, which clears the directory as in MONAI). Our
      files are named ``<hash><transform hash>-<variant>.mcache``, so the cache fills again alongside them.
    * **Errors.** A cache directory that cannot be created or written, or a full disk, gives one warning and
      training continues uncached (files already there are still read). A ``cache_dir`` that exists but is a
      file raises a ``ValueError`` saying what to do.
    * **Counters.** :meth:`cache_stats` returns hits, misses, pending writes, bytes written and the
      compression ratio, for this process and summed over the DataLoader workers forked from it.

    Fix of MONAI's behaviour (``track_meta``): MONAI returns the freshly computed item on a miss (a
    ``MetaTensor`` with metadata, since MONAI tracks metadata globally by default) but the stored copy on a
    hit (a plain ``Tensor`` with the default ``track_meta=False``), so the same item changes type and loses
    its metadata from the second epoch on. Here both paths return what MONAI documents for ``track_meta``:
    the output of the cached transforms is passed through
    ``convert_to_tensor(item, convert_numeric=False, track_meta=track_meta)`` before the random transforms,
    on a miss as on a hit (and with ``cache_dir=None``): plain tensors when ``track_meta=False``,
    ``MetaTensor`` objects with their metadata when ``track_meta=True``. Outputs therefore equal MONAI's
    cache-hit outputs. (Random transforms after the cached ones may still wrap their outputs in
    ``MetaTensor`` when ``monai.data.get_track_meta()`` is True, exactly as they do in MONAI.) Also, MONAI
    1.6.1 cannot reload its own ``track_meta=True`` files with ``weights_only=True`` (the metadata holds
    numpy arrays), so it recomputes them on every access with a "corrupt cache file" warning; these files
    load.

    Args:
        data: input data file paths to load and transform to generate dataset for model.
            `PersistentDataset` expects input data to be a list of serializable
            and hashes them as cache keys using `hash_func`.
        transform: transforms to execute operations on input data.
        cache_dir: If specified, this is the location for persistent storage
            of pre-computed transformed data tensors. The cache_dir is computed once, and
            persists on disk until explicitly removed.  Different runs, programs, experiments
            may share a common cache dir provided that the transforms pre-processing is consistent.
            If `cache_dir` doesn't exist, will automatically create it (with mode 0700).
            If `cache_dir` is `None`, there is effectively no caching.
        hash_func: a callable to compute hash from data items to be cached, defaults to
            `monai.data.utils.pickle_hashing` which uses sha256.
        pickle_module: accepted for compatibility and, when ``cache_dir`` is given, checked against
            ``monai.data.utils.SUPPORTED_PICKLE_MOD`` (MONAI's first write would fail on an unsupported one).
            MONAI passes it to ``torch.save``; these files are not pickles, so it is not used.
        pickle_protocol: accepted for compatibility; not used (the files are not pickles).
        hash_transform: a callable to compute hash from the transform information when caching, appended to
            the file names as in MONAI (e.g. `pickle_hashing` or `json_hashing` from `monai.data.utils`).
            Default None: a fingerprint of the cached transforms is used instead, so a changed transform
            never serves old entries.
        reset_ops_id: whether to set `TraceKeys.ID` to ``Tracekys.NONE``, defaults to ``True``.
            When this is enabled, the traced transform instance IDs will be removed from the cached MetaTensors.
            This is useful for skipping the transform instance checks when inverting applied operations
            using the cached content and with re-created transform instances.
        track_meta: whether to track the meta information, defaults to False. If `True`, converts to `MetaTensor`.
            Applied on cache misses and hits alike (see above). MONAI added it in 1.6; it works with every MONAI
            version here. With MONAI 1.3 and 1.4 the default is None: the items are stored as computed, as those
            versions store them (``MetaTensor`` objects keep their metadata on hits too).
        weights_only: accepted for compatibility. MONAI passes it to `torch.load`; these files are never
            unpickled (see ``allow_pickle``), so loading is always restricted to tensors, arrays and plain values.
        async_writes: write cache files in a background thread (default) instead of inside ``__getitem__``.
        compression: ``"zstd"`` (default) or ``None`` to store the encoded items uncompressed.
        compression_level: zstd level, default :data:`DEFAULT_COMPRESSION_LEVEL` (-1, chosen with
            ``benchmarks/bench_persistent.py``). Levels 2-3 write about a third smaller files but compress and
            decompress about twice as slowly; negative levels down to -5 are faster still and larger.
        compression_threads: zstd threads per write; 0 (default) compresses in the writer thread itself,
            -1 uses one thread per CPU.
        downcast: store each tensor in the smallest dtype that holds all of its values exactly (e.g. a float32
            label map as uint8); loading restores the original dtype bit for bit. Lossless; default True.
        lossy_dtypes: ``{key: dtype}``: store the tensor under each top-level key of the item in ``dtype``
            even though this **loses precision** (e.g. ``{"image": torch.float16}``). To keep misses and hits
            identical, a miss returns the value rounded the same way. Default None (lossless).
        allow_pickle: store (and load) values that the codec cannot store natively with pickle. Default False:
            such items are not cached (one warning names the key and type) and loading never unpickles. Only
            enable it for cache directories nobody else can write.
        fsync: ``fsync`` each file and the directory on write, so that entries survive a power loss (slower).
            Without it a file damaged by a crash of the machine fails its checksum and is recomputed.
        max_pending_writes: most items queued for the background writer in each process.
        max_pending_bytes: most bytes of encoded items queued for the background writer in each process (an int or a
            string such as ``"512MiB"``).
        shared_dir: ``cache_dir`` is shared by several machines (a cluster file system) or by processes that may
            miss the same item at once: an item missing everywhere is then computed by one process only, under an
            entry lock in ``cache_dir`` (the others wait, then read it), and written before the lock is released
            (so that write is not in the background). Needs a file system whose POSIX locks its clients share
            (local disks, NFSv4, Lustre, GPFS); see docs/persistent.md.
        shm_cache: keep a node-wide copy of the cached items in shared memory in front of ``cache_dir`` (one copy
            per machine, shared by its ranks and DataLoader workers, as ``monai_cache.CacheDataset`` keeps): after
            the first read on a machine, a read neither touches the disk nor decompresses. The entries on disk are
            the ones written without it.
        shm_dir: with ``shm_cache``: the tmpfs directory (default ``$MONAI_CACHE_SHM_DIR`` or ``/dev/shm``).
        shm_budget: with ``shm_cache``: most bytes the shared-memory copy may take (an int or a string such as
            ``"8GiB"``); items beyond it are read from disk each time.
        keep_warm: with ``shm_cache``: keep the shared-memory copy after the last process using it exits.
    """

    def __init__(
        self,
        data: Sequence,
        transform: Sequence[Callable] | Callable,
        cache_dir: Path | str | None,
        hash_func: Callable[..., bytes] = pickle_hashing,
        pickle_module: str = "pickle",
        pickle_protocol: int = DEFAULT_PROTOCOL,
        hash_transform: Callable[..., bytes] | None = None,
        reset_ops_id: bool = True,
        track_meta: bool | None = compat.PERSISTENT_TRACK_META_DEFAULT,
        weights_only: bool = True,
        *,
        async_writes: bool = True,
        compression: str | None = "zstd",
        compression_level: int = DEFAULT_COMPRESSION_LEVEL,
        compression_threads: int = 0,
        downcast: bool = True,
        lossy_dtypes: Mapping[str, torch.dtype | str] | None = None,
        allow_pickle: bool = False,
        fsync: bool = False,
        max_pending_writes: int = 8,
        max_pending_bytes: int | str = "512MiB",
        shared_dir: bool = False,
        shm_cache: bool = False,
        shm_dir: str | None = None,
        shm_budget: int | str | None = None,
        keep_warm: bool = False,
    ) -> None:
        if cache_dir is not None:  # MONAI would fail on the first write; with no cache_dir it never writes
            look_up_option(pickle_module, SUPPORTED_PICKLE_MOD)
        # Set before MONAI's __init__ (which may call set_transform_hash). None is randomizable, so MONAI's
        # worker seeding (set_rnd walks __dict__) seeds the transforms as it does for MONAI's class.
        self.async_writes = async_writes
        self.compression = compression
        self.compression_level = compression_level
        self.compression_threads = compression_threads
        self.downcast = downcast
        self.lossy_dtypes = {str(k): _as_dtype(v, str(k)) for k, v in (lossy_dtypes or {}).items()}
        self.allow_pickle = allow_pickle
        self.fsync = fsync
        self.max_pending_writes = max_pending_writes
        self.max_pending_bytes = max_pending_bytes
        self.shared_dir = shared_dir
        self.shm_cache = shm_cache
        self.shm_dir = shm_dir
        self.shm_budget = shm_budget
        self.keep_warm = keep_warm
        self._store: DiskStore | None = None
        self._memory: SharedMemoryStore | None = None  # the shared-memory tier (shm_cache=True)
        self._memory_slots: dict[str, int] = {}  # entry key -> its slot in the tier (a dict: set_rnd skips it)
        self._variant_state: dict[str, Any] = {}
        super().__init__(
            data=data,
            transform=transform,
            cache_dir=None,  # created below: mode 0700, and no crash when it cannot be
            hash_func=hash_func,
            pickle_module=pickle_module,
            pickle_protocol=pickle_protocol,
            hash_transform=hash_transform,
            reset_ops_id=reset_ops_id,
            **compat.persistent_init_kwargs(track_meta, weights_only),
        )
        # MONAI < 1.6 has neither parameter; None (the item as computed) is MONAI 1.3/1.4's way, False from 1.5 on
        keep_as_computed = track_meta is None and not compat.PERSISTENT_CONVERTS_STORED
        self.track_meta = None if keep_as_computed else bool(track_meta)  # type: ignore[assignment]
        self.weights_only = weights_only
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        self._variant_key()  # fingerprint the transforms now, before they run
        if self.cache_dir is not None:
            self._open_store()

    # -- the store --
    def _open_store(self) -> DiskStore | None:
        if self.cache_dir is None:
            self._store = None
            return None
        store = DiskStore.open(  # raises ValueError if cache_dir is a file
            self.cache_dir,
            compression=self.compression,
            compression_level=self.compression_level,
            compression_threads=self.compression_threads,
            downcast=self.downcast,
            lossy=self.lossy_dtypes,
            allow_pickle=self.allow_pickle,
            async_writes=self.async_writes,
            fsync=self.fsync,
            max_pending_writes=self.max_pending_writes,
            max_pending_bytes=self.max_pending_bytes,
            shared=self.shared_dir,
        )
        self._store = store
        self._open_memory_tier()
        return store

    def _open_memory_tier(self) -> None:
        """The shared-memory tier in front of the disk store (``shm_cache=True``): one slot per distinct entry
        key of ``self.data``, in one cache per machine named by the directory, the variant and the keys."""
        if self._memory is not None:
            self._memory.release()
            self._memory = None
        if not self.shm_cache or self.cache_dir is None:
            return
        keys = list(dict.fromkeys(self._entry_key(item) for item in self.data))
        self._memory_slots = {key: i for i, key in enumerate(keys)}
        self._generation = getattr(self, "_generation", -1) + 1  # set_data() starts a new one
        self._memory = SharedMemoryStore(
            "pd-" + fingerprint(os.path.abspath(self.cache_dir), self._variant_key(), keys, self._generation)[:40],
            len(keys),
            shm_dir=self.shm_dir,
            budget=self.shm_budget,
            keep_warm=self.keep_warm,
            allow_pickle=self.allow_pickle,
            disk_tier=str(self.cache_dir),
        )

    def _get_store(self) -> DiskStore | None:
        store = self._store
        if self.cache_dir is None:
            return None
        if store is None or store.directory != str(self.cache_dir):  # cache_dir reassigned by the user
            store = self._open_store()
        return store

    def _variant_key(self) -> str:
        """Names what the files hold beyond the data item: the cached transforms (unless an explicit
        ``hash_transform`` is in use) and the options that change the stored content.

        The transform fingerprint is taken once (at construction, before the transforms have run: some keep
        state such as the last file name read) and kept for as long as ``self.transform`` is the same object and
        caches as many transforms, in this process, in forked workers and in pickled copies (spawned workers)
        alike.
        """
        explicit = bool(self.transform_hash)
        sig = (explicit, *self._variant_options())
        cached = self._cached_transforms()
        state = self._variant_state  # a dict: MONAI's worker seeding (set_rnd) does not walk into it
        if state.get("transform") is not self.transform or state.get("cached") != len(cached):
            state["xform"] = chain_fingerprint(self.transform, cached)
            state["transform"], state["cached"] = self.transform, len(cached)
            state.pop("sig", None)
        if state.get("sig") != sig:
            xform = None if explicit else state["xform"]
            state["key"] = fingerprint(
                "monai_cache.PersistentDataset", DISK_FORMAT_VERSION, codec.FORMAT_VERSION, library_versions(), xform,
                *sig,
            )[:16]
            state["sig"] = sig
        return str(state["key"])

    # hooks for subclasses that cache other transforms or store with other options (CacheNTransDataset)
    def _cached_transforms(self) -> Sequence[Callable]:
        """The transforms whose output an entry holds, fingerprinted in its name: MONAI's, up to the first random
        one (or non-``Transform``)."""
        return cacheable_transforms(self.transform)

    def _variant_options(self) -> tuple:
        """The options that change what an entry holds, part of its name."""
        return (
            self.track_meta if self.track_meta is None else bool(self.track_meta),
            bool(self.reset_ops_id),
            bool(self.allow_pickle),
            tuple(sorted((k, str(v)) for k, v in self.lossy_dtypes.items())),
            bool(get_track_meta()),
        )

    def _entry_key(self, item: Any) -> str:
        """The file name (without ``.mcache``) of ``item``'s entry: MONAI's name plus the variant."""
        return entry_key(self.hash_func(item).decode("utf-8") + self.transform_hash, self._variant_key())

    def _as_cached(self, item: Any) -> Any:
        """What both cache paths return: MONAI's stored form, rounded like the stored copy for lossy keys."""
        if self.track_meta is not None:  # None: stored as computed, as MONAI 1.3 and 1.4 store it
            item = compat.to_stored_form(item, self.track_meta)
        if self.lossy_dtypes and isinstance(item, dict):
            for key, dtype in self.lossy_dtypes.items():
                value = item.get(key)
                if isinstance(value, torch.Tensor) and value.dtype != dtype:
                    item[key] = value.to(dtype).to(value.dtype)
        return item

    # -- MONAI's hooks --
    def _cachecheck(self, item_transformed: Any) -> Any:
        """Return the output of the cached (deterministic) transforms for ``item_transformed``.

        Read from the cache directory when a valid entry exists; otherwise computed with
        :meth:`_pre_transform`, handed to the background writer (or written now with ``async_writes=False``)
        and returned. Both paths return the same types and values (see the class docstring).

        Args:
            item_transformed: the data item (e.g. a dict of file names), hashed with ``hash_func``.

        Returns:
            The transformed data item, either from cache, or explicitly computing it.
        """
        if not loader._meta_blocks_checked:  # first read in this process: in another loader's worker?
            loader.send_meta_tensors_as_blocks()
        store = self._get_store()

        def compute() -> Any:
            return self._as_cached(self._pre_transform(deepcopy(item_transformed)))  # keep the original hashed

        if store is None:
            return compute()
        key = self._entry_key(item_transformed)
        memory, slot = self._memory, self._memory_slots.get(key)
        if memory is not None and slot is not None:  # two tiers: a miss in memory reads (or fills) the disk
            return memory.get_or_compute(slot, partial(store.get_or_compute, key, compute))
        return store.get_or_compute(key, compute)

    def set_data(self, data: Sequence) -> None:
        """Set the input data and delete all the out-dated cache content (the whole ``cache_dir``, as in MONAI).

        Writes still queued in this process are dropped first. As in MONAI, DataLoader workers must be
        re-created afterwards (``persistent_workers=False``).

        Args:
            data: the new input data.
        """
        self.data = data
        if self._store is not None:
            self._store.discard_pending()
        if self.cache_dir is not None:
            if self.cache_dir.exists():
                shutil.rmtree(self.cache_dir, ignore_errors=True)
            self._open_store()  # and a new shared-memory tier for the new data

    # -- extras --
    def cache_stats(self) -> dict[str, dict[str, Any]]:
        """Cache counters: ``{"process": {...}, "total": {...}, "stored": {"entries", "bytes"}}``, the shape
        every dataset of monai_cache returns (keys documented in :func:`monai_cache.runtime.cache_stats`).

        ``total`` sums this process and the DataLoader workers forked from it (spawned workers keep their
        own); ``stored`` counts the entries in ``cache_dir`` now. All zero when ``cache_dir`` is None.

        With ``shm_cache=True`` the counters are those of the shared-memory tier (``total``: every process of
        the machine; ``misses``: items it read from disk or computed), and ``"disk"`` holds the disk store's.
        """
        store = self._get_store()
        if store is None:
            zeros = dict.fromkeys(COUNTERS, 0)
            return cache_stats(zeros, zeros, 0, 0)
        if self._memory is not None:
            return {**self._memory.stats(), "disk": store.stats()}
        return store.stats()

    def release(self) -> None:
        """Stop using the shared-memory tier now (``shm_cache=True``; it is removed if this was its last user).
        The disk cache stays."""
        if self._memory is not None:
            self._memory.release()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until this process's pending cache writes are on disk.

        Args:
            timeout: seconds to wait at most; None waits as long as needed.

        Returns:
            False if the timeout passed with writes still pending.
        """
        store = self._store
        return True if store is None else store.flush(timeout)

    def entry_path(self, index: int) -> Path | None:
        """The cache file that holds data item ``index``; None without a ``cache_dir``.

        Small items are packed: for them this is the pack file (``pack.<host>.<pid>.<n>.mcpack``) that holds
        the item's record among others (:meth:`entry_location` gives its offset). Otherwise it is the item's
        own ``.mcache`` file. For an item not stored yet (or still pending) it is the name that file would
        have, which a small item never gets: :meth:`entry_location` (None until stored) tells whether and
        where an item is stored.

        Args:
            index: position in ``self.data``.
        """
        store = self._get_store()
        if store is None:
            return None
        key = self._entry_key(self.data[index])
        loc = store.location(key)
        return Path(loc.path if loc is not None else store.path(key))

    def entry_location(self, index: int) -> StoredEntry | None:
        """Where data item ``index`` is stored: ``(path, offset, length, tag)``, with a key ``tag`` for a
        packed record and ``None`` for an entry file; None if it is not stored (or without a ``cache_dir``).

        Args:
            index: position in ``self.data``.
        """
        store = self._get_store()
        return None if store is None else store.location(self._entry_key(self.data[index]))
