"""Shard-local distributed sampler: every rank (or node) reads a fixed shard, so per-rank caches hit.

With :class:`torch.utils.data.DistributedSampler` every epoch deals every item to a random rank, so a
cache that lives in one process (or one machine) holds the right item only ``1 / world`` of the time.
:class:`ShardedDistributedSampler` keeps each rank's (or each node's) set of items fixed for the whole
run and only reorders it from epoch to epoch, so from the second epoch on every read is a cache hit.

The order of an epoch is a pure function of the seed, the epoch, the dataset length and the layout (world size,
ranks per node: :mod:`monai_cache.sampler_order`), so a state saved mid-epoch tells every rank what the others had
read: an epoch resumes exactly on the same layout, or with its remaining items re-dealt over another one
(:mod:`monai_cache.sampler_resume`). With ``canonical_shards`` the global order does not depend on the world size
at all. This module holds the sampler itself and how it finds the ranks of each node.
"""

from __future__ import annotations

import math
import os
import weakref
from collections.abc import Iterator, Mapping, Sequence, Sized
from typing import Any, cast

import torch.distributed as dist
from torch.utils.data import Dataset, DistributedSampler

from monai_cache.errors import MonaiCacheWarning, warn
from monai_cache.launcher import Launch, launch_view, parse_tasks_per_node
from monai_cache.runtime import node_identity
from monai_cache.sampler_order import (
    SHARD_BY,
    EpochSpec,
    is_int,
    order_group,
    rank_epoch_indices,
    rank_length,
    strided_shard,
)
from monai_cache.sampler_resume import (
    PER_RANK_KEYS,
    STATE_VERSION,
    check_state,
    history_entry,
    segment_plan,
    segments_of_state,
)

__all__ = ["ShardedDistributedSampler"]


# identities of the ranks of a process group, gathered once per group (and process)
_gathered_identities: weakref.WeakKeyDictionary[Any, list[str]] = weakref.WeakKeyDictionary()


def _identities_of_process_group() -> list[str]:
    """``node_identity()`` of every rank of the default process group, by rank; one all-gather per group."""
    group = dist.group.WORLD
    identities = _gathered_identities.get(group)
    if identities is None:
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, node_identity())
        identities = _gathered_identities[group] = [str(x) for x in gathered]
    return identities


def _local_world_size_from_identities(identities: Sequence[str]) -> int:
    """Ranks per node given each rank's machine identity (by rank), checked against node mode's layout.

    Node mode assumes every node has the same number of ranks ``L`` and numbers them contiguously: node
    ``k`` holds ranks ``k * L ... k * L + L - 1`` (``node = rank // L``).

    Args:
        identities: ``identities[r]`` names the machine of rank ``r`` (see ``monai_cache.runtime.node_identity``).

    Returns:
        ``L``, the number of ranks per node.

    Raises:
        ValueError: the nodes have different numbers of ranks, or their ranks are not contiguous; the message
            lists the ranks found on each machine.
    """
    ranks_of: dict[str, list[int]] = {}
    for r, identity in enumerate(identities):
        ranks_of.setdefault(identity, []).append(r)

    def found() -> str:
        shown = [f"{identity}: ranks {_format_ranks(ranks)}" for identity, ranks in list(ranks_of.items())[:8]]
        more = f"; ... ({len(ranks_of) - 8} more machines)" if len(ranks_of) > 8 else ""
        return "; ".join(shown) + more

    sizes = {len(ranks) for ranks in ranks_of.values()}
    if len(sizes) != 1:
        raise ValueError(
            f"shard_by='node' needs the same number of ranks on every machine, but found {found()}. "
            "Launch the same number of processes per machine, or use shard_by='rank'."
        )
    local = sizes.pop()
    if any(ranks != list(range(ranks[0], ranks[0] + local)) for ranks in ranks_of.values()):
        raise ValueError(
            f"shard_by='node' needs the ranks of each machine numbered contiguously (node = rank // "
            f"{local}), but found {found()}. Launch with ranks numbered by machine (torchrun does; with srun "
            "use --distribution=block, with mpirun --map-by slot), or use shard_by='rank'; passing "
            f"local_world_size={local} would use this layout anyway, with node shards that do not match the "
            "machines (a per-machine cache then misses)."
        )
    return local


def _format_ranks(ranks: Sequence[int]) -> str:
    return "[" + ", ".join(map(str, ranks[:6])) + (", ...]" if len(ranks) > 6 else "]")


def _local_world_size_of_process_group(num_replicas: int, rank: int, launcher: str) -> int:
    """Ranks per node found by gathering every rank's machine identity over the default process group.

    Only gathers when the process group describes the sampler's layout (same world size and rank), so that
    every rank takes part: a collective started on a subset of the ranks would wait forever. ``launcher``: why the
    launcher's variables gave no layout, for the error.
    """
    initialized = dist.is_available() and dist.is_initialized()
    if initialized and (dist.get_world_size(), dist.get_rank()) == (num_replicas, rank):
        return _local_world_size_from_identities(_identities_of_process_group())
    if initialized:
        reason = (
            f"num_replicas={num_replicas}, rank={rank} differ from the process group's (world size "
            f"{dist.get_world_size()}, rank {dist.get_rank()}), so the ranks of each machine cannot be gathered"
        )
    else:
        reason = f"torch.distributed is not initialised and {launcher}"
    raise ValueError(
        f"shard_by='node' needs the number of ranks per node, but {reason}. Pass local_world_size=..., "
        "build the sampler on every rank after torch.distributed.init_process_group(), with num_replicas "
        "and rank left out or equal to the group's (the ranks of each machine are then found by one all-gather "
        "of host names), or run under torchrun, which sets LOCAL_WORLD_SIZE, or srun, which sets SLURM_PROCID "
        "and SLURM_TASKS_PER_NODE."
    )


def _local_world_size_of_launcher(view: Launch, num_replicas: int, rank: int) -> tuple[int | None, str]:
    """Ranks per node as the launcher's variables give them (``view``): torchrun's ``LOCAL_WORLD_SIZE``, else
    Slurm's tasks on this node where Slurm's rank and task count are the sampler's; with where it came from (for
    messages), or ``None`` and why not (the process group is asked then).

    Raises:
        ValueError: the variable cannot be read, or Slurm's tasks per node differ between nodes.
    """
    name = view.source.get("local_world_size")
    problem = view.problems.get("local_world_size")
    if problem is not None:
        raise ValueError(f"{problem}; pass local_world_size=... (the ranks on each node)")
    if name is None:
        return None, "LOCAL_WORLD_SIZE is not set (nor Slurm's tasks per node, in a Slurm task)"
    if not name.startswith("SLURM_"):
        return view.local_world_size, f" (from {name})"
    # Slurm's tasks of this step, which may not be the sampler's ranks (a process group of its own): used only when
    # Slurm's rank and task count are the sampler's
    if (view.world_size, view.rank) != (num_replicas, rank):
        return None, (
            f"Slurm's variables describe task {view.rank} of {view.world_size}, not rank {rank} of {num_replicas}"
        )
    counts = {count for count, _nodes in parse_tasks_per_node(os.environ[name], name)}
    if len(counts) > 1:
        raise ValueError(
            f"shard_by='node' needs the same number of ranks on every node, but {name}={os.environ[name]!r}. "
            "Start the same number of tasks on every node (srun --ntasks-per-node), or use shard_by='rank'."
        )
    return view.local_world_size, f" (from {name}={os.environ[name]!r})"


class ShardedDistributedSampler(DistributedSampler):
    """Distributed sampler that gives each rank (or each node) a fixed shard and shuffles only within it.

    A drop-in replacement for :class:`torch.utils.data.DistributedSampler` and
    :class:`monai.data.DistributedSampler` for cached datasets: each process reads the same items in every
    epoch, so a per-process cache (``shard_by="rank"``) or a per-machine cache such as the shared-memory
    ``monai_cache.CacheDataset`` (``shard_by="node"``) hits on every read from the second epoch on, and only
    needs to hold ``1 / num_replicas`` (or ``1 / num_nodes``) of the dataset.

    Design:

    - **Shards.** Rank ``r`` owns the items ``r, r + W, r + 2W, ...`` (``W = num_replicas``), the same
      assignment as torch's ``shuffle=False`` and MONAI's ``even_divisible=False`` (for 5 items and 2 ranks:
      ``[0, 2, 4]`` and ``[1, 3]``). Shard sizes differ by at most one; the first ``len(dataset) % W`` ranks
      own one item more. The assignment depends on nothing but the dataset length and the world size, so it
      is the same in every epoch, for every ``seed``, with and without ``shuffle``. A strided split also
      spreads a sorted dataset (by site, label, size...) evenly over the ranks.
    - **Nodes.** With ``shard_by="node"`` node ``n`` owns the union of the shards of its ranks
      ``n * L ... n * L + L - 1`` (``L = local_world_size``); every epoch that node shard is shuffled and dealt
      afresh among the node's ranks in contiguous chunks. A rank's batches can then mix ``L`` times more
      items than with per-rank shards, and every read still comes from the node's cache.
    - **Order.** The epoch order is ``torch.randperm`` of the (node or rank) shard with a private
      :class:`torch.Generator` seeded from ``(seed, epoch, shard)``: a pure function of ``seed``, ``epoch``
      and ``rank``, never the global RNG. ``shuffle=False`` yields the rank's own shard in ascending order (in
      both modes), so validation reads the same items as training and hits the same cache.
    - **Equal lengths.** By default every rank yields ``ceil(len / W)`` indices (``floor`` with
      ``drop_last=True``), exactly like torch, so collectives in the training step never wait for a rank that
      has run out of data.
    - **Padding and dropping rotate, and stay in the shard.** A shard one item short pads with one of its
      *own* items (a cache hit), and a shard one item long leaves one of its own items out. The chosen items
      move along the shard from epoch to epoch: within any ``s`` consecutive epochs (``s`` = shard size) each
      item is padded, or left out, exactly once (node shards: exactly ``p`` / ``d`` times, for ``p`` pads /
      ``d`` drops per epoch). So no item is left out forever and,
      once each shard holds at least two items (``len(dataset) >= 2 * W``), no item is duplicated in every
      epoch. Torch pads with the head of a fresh global permutation (items leave the shard, so padded reads
      miss the cache); VisCy's ``ShardedDistributedSampler`` overlaps the last two shards and drops the
      tail, i.e. the same items are duplicated, or never seen, in every epoch.
    - **Tiny datasets.** A one-item shard (``W < len(dataset) < 2W``) has nothing but that item to pad with,
      so it is read twice per epoch. With ``len(dataset) < W`` and ``drop_last=False`` the ranks without a
      shard borrow a rotating window of the whole dataset (the only reads that leave a shard).

    The state for a mid-epoch resume (``epoch``, ``seed``, number of indices of this epoch already
    consumed, the layout) is saved by :meth:`state_dict` and restored by :meth:`load_state_dict`, on the same
    layout (exactly where it stopped) or on another world size, ranks per node or ``shard_by`` (the rest of
    the epoch, each item once, dealt over the new ranks).

    Example::

        sampler = ShardedDistributedSampler(train_ds, shuffle=True, seed=0)          # under torchrun
        loader = monai.data.DataLoader(train_ds, batch_size=2, sampler=sampler, num_workers=4)
        for epoch in range(start_epoch, max_epochs):
            sampler.set_epoch(epoch)
            for batch in loader:
                ...

    Args:
        dataset: dataset to sample from; only ``len(dataset)`` is used. Its length must not change afterwards.
        num_replicas: number of processes taking part (the world size). By default it is read from the
            default process group (``torch.distributed.get_world_size()``), which must be initialised.
        rank: rank of this process in ``[0, num_replicas - 1]``. By default ``torch.distributed.get_rank()``.
        shuffle: if ``True`` (default), shuffle the shard every epoch; if ``False``, yield this rank's shard in
            ascending order, e.g. for validation, so it reads the same items, and hits the same cache, as
            training.
        seed: seed of the shuffle; must be the same on all ranks. Default ``0``.
        drop_last: with the default ``even_divisible=True``, when the length does not divide by the world
            size: ``False`` (default) pads every rank to ``ceil(len / num_replicas)`` indices with items of
            its own shard, ``True`` cuts every rank to ``floor(len / num_replicas)``, leaving out items of its
            own shard. Either way the padded or left-out items change every epoch.
        even_divisible: keyword only, as in :class:`monai.data.DistributedSampler`. ``True`` (default): all
            ranks yield the same number of indices (see ``drop_last``). ``False``: each rank yields its
            whole shard once per epoch, no padding and nothing left out, so ranks yield different numbers of
            indices (for 5 items on 2 ranks: 3 and 2). Use it for exact evaluation; any collective run per
            batch (DDP's gradient all-reduce, ``SyncBatchNorm``, per-step metric gathering) would then wait
            forever on the rank with more batches, so only gather after the loop. Cannot be combined with
            ``drop_last=True`` and needs ``len(dataset) >= num_replicas``.
        shard_by: keyword only. ``"rank"`` (default): each rank owns a fixed shard, for caches private to one
            process. ``"node"``: each node (machine) owns a fixed shard that is re-dealt among its ranks every
            epoch, for caches shared by the processes of a machine; better-mixed batches, same cache hits.
        local_world_size: keyword only; number of ranks per node, used with ``shard_by="node"``. Must divide
            ``num_replicas``; the node of a rank is ``rank // local_world_size``, i.e. the ranks of a node are
            numbered contiguously, as torchrun does (``RANK = GROUP_RANK * LOCAL_WORLD_SIZE + LOCAL_RANK``).
            ``None`` (default): the ``LOCAL_WORLD_SIZE`` environment variable when set (torchrun sets it; when
            ``RANK``, ``LOCAL_RANK`` and ``GROUP_RANK`` describe this process they are checked against the rule
            above). Else, in a task that Slurm's ``srun`` started without torchrun (Lightning's ``SLURMEnvironment``
            included), Slurm's tasks on this node (``SLURM_STEP_TASKS_PER_NODE``, ``SLURM_TASKS_PER_NODE`` or
            ``SLURM_NTASKS_PER_NODE``, by ``SLURM_NODEID``) where ``SLURM_PROCID`` and ``SLURM_NTASKS`` are this
            sampler's ``rank`` and ``num_replicas``; every node must have the same count (else a ``ValueError``),
            and ``SLURM_LOCALID`` / ``SLURM_NODEID`` are checked like torchrun's (:mod:`monai_cache.launcher`).
            Otherwise, when ``torch.distributed`` is initialised with this sampler's world size and
            rank, the ranks of each machine are found by gathering every rank's host name over the default
            process group (any launcher: Lightning, ``srun``, ``mpirun``...): a collective, so build the
            sampler on every rank, as any collective requires (with NCCL, after
            ``torch.cuda.set_device(local_rank)``, as torch's object collectives need). It runs once per
            process group; later samplers reuse its result. The layout found must match node mode: the same
            number of ranks on every machine, numbered contiguously, else a ``ValueError`` names the ranks
            found on each machine. The ``MONAI_CACHE_NODE_ID`` environment variable, when set, replaces the
            host name as a process's machine identity (ranks with equal values form a node).
        canonical_shards: keyword only. ``None`` (default): the shard-local order above. An int ``C``: the
            world-size-independent order. The epoch's global order (step ``j`` of rank ``r`` at position
            ``j * num_replicas + r``, torch's dealing) is then a function of ``seed``, the epoch and
            ``len(dataset)`` alone, the same on every world size that divides ``C``: ``C`` canonical shards
            (``x % C``) are shuffled each on its own and interleaved, and rank ``r`` reads exactly its usual shard
            (``x % num_replicas == r``), so caches hit as with the default order. ``num_replicas`` must divide
            ``C``; choose ``C`` as a multiple of every world size the run may use and, for well-mixed global
            batches, a divisor of the global batch size. Node mode's re-dealing within a node is not used (each
            rank reads its rank shard). The padding (``drop_last=False``) or cut (``True``) of the last
            ``len(dataset) % num_replicas`` positions depends on the world size, as in torch.

    Raises:
        ValueError: the dataset is empty, ``rank`` is outside ``[0, num_replicas - 1]``, ``drop_last=True``
            with fewer items than ranks, ``shard_by`` is unknown, ``local_world_size`` cannot be found (see
            above) or does not divide ``num_replicas``, the machines found have different numbers of ranks or
            ranks not numbered contiguously, or ``even_divisible=False`` is combined with ``drop_last=True`` or
            fewer items than ranks. Also the errors of ``torch.distributed`` when ``num_replicas`` or ``rank``
            is left out and no process group is initialised.
    """

    def __init__(
        self,
        dataset: Dataset | Sized,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        *,
        even_divisible: bool = True,
        shard_by: str = "rank",
        local_world_size: int | None = None,
        canonical_shards: int | None = None,
    ) -> None:
        if not isinstance(dataset, Sized):
            raise TypeError(
                f"dataset must have a length (len(dataset)); got {type(dataset).__name__}. "
                "Iterable-style datasets cannot be sharded by index."
            )
        n = len(dataset)
        if num_replicas is None:
            if not dist.is_available():
                raise RuntimeError("Requires distributed package to be available")
            num_replicas = dist.get_world_size()
        if rank is None:
            if not dist.is_available():
                raise RuntimeError("Requires distributed package to be available")
            rank = dist.get_rank()
        if not is_int(num_replicas) or num_replicas < 1:
            raise ValueError(f"num_replicas must be a positive int (the world size), got {num_replicas!r}.")
        if not is_int(rank) or not 0 <= rank < num_replicas:
            raise ValueError(
                f"rank={rank!r} is out of range for num_replicas={num_replicas}: it must be an int in "
                f"[0, {num_replicas - 1}]. Pass this process's rank, or leave rank=None to read it from "
                "torch.distributed."
            )
        num_replicas, rank = int(num_replicas), int(rank)
        if n == 0:
            raise ValueError(
                "dataset is empty (len(dataset) == 0), so there is nothing to shard; check the data list "
                "before building the sampler."
            )
        if shard_by not in SHARD_BY:
            raise ValueError(f"shard_by must be 'rank' or 'node', got {shard_by!r}.")
        if not even_divisible:
            if drop_last:
                raise ValueError(
                    "even_divisible=False yields every item exactly once (no padding, nothing dropped), so "
                    "drop_last=True has no meaning with it; pass drop_last=False, or even_divisible=True to "
                    "cut all ranks to the same length."
                )
            if n < num_replicas:
                raise ValueError(
                    f"even_divisible=False with len(dataset)={n} < num_replicas={num_replicas} would leave "
                    f"{num_replicas - n} rank(s) without data; use even_divisible=True (pads by repeating "
                    "items) or fewer ranks."
                )
        elif drop_last and n < num_replicas:
            raise ValueError(
                f"drop_last=True with len(dataset)={n} < num_replicas={num_replicas} would give every rank 0 "
                "items; use drop_last=False (pads by repeating items) or fewer ranks."
            )
        if canonical_shards is not None:
            if not is_int(canonical_shards) or canonical_shards < 1:
                raise ValueError(f"canonical_shards must be a positive int or None, got {canonical_shards!r}.")
            canonical_shards = int(canonical_shards)
            if canonical_shards % num_replicas:
                raise ValueError(
                    f"num_replicas={num_replicas} does not divide canonical_shards={canonical_shards}: the "
                    "world-size-independent order deals whole canonical shards to the ranks. Choose "
                    "canonical_shards as a multiple of every world size the run may use (e.g. 24 for 1, 2, 3, 4, "
                    "6, 8 ranks), or run on a world size that divides it."
                )
        group_size = 1
        if shard_by == "node":
            group_size = self._resolve_local_world_size(local_world_size, num_replicas, rank)

        super().__init__(
            cast(Dataset, dataset),
            num_replicas=num_replicas,
            rank=rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
        )
        self.even_divisible = even_divisible
        self.shard_by = shard_by
        self.local_world_size = group_size
        self.node_rank = rank // group_size
        self.local_rank = rank % group_size
        self._dataset_len = n
        if not even_divisible:
            # MONAI's meaning: this rank's whole shard, so lengths differ by at most one between ranks.
            self.num_samples = len(range(rank, n, num_replicas))
            self.total_size = n
        else:
            self.num_samples = n // num_replicas if drop_last else math.ceil(n / num_replicas)
            self.total_size = self.num_samples * num_replicas
        self._start_index = 0  # where the next pass starts (non-zero only to resume an epoch)
        self._consumed = 0  # indices of this epoch handed out so far (counting the skipped ones)
        self.canonical_shards = canonical_shards
        # an epoch resumed on another layout: this rank's part of the rest of it, and the earlier layouts
        self._resume_plan: list[int] | None = None
        self._history: list[dict[str, Any]] = []
        self._resume_done = False  # the resumed pass ran to its end; the next pass is a full epoch

    @staticmethod
    def _resolve_local_world_size(local_world_size: int | None, num_replicas: int, rank: int) -> int:
        view = launch_view(os.environ)
        via = ""
        if local_world_size is None:
            local_world_size, via = _local_world_size_of_launcher(view, num_replicas, rank)
            if local_world_size is None:
                return _local_world_size_of_process_group(num_replicas, rank, via)
        if not is_int(local_world_size) or local_world_size < 1:
            raise ValueError(f"local_world_size must be a positive int, got {local_world_size!r}.")
        local_world_size = int(local_world_size)
        if num_replicas % local_world_size != 0:
            raise ValueError(
                f"local_world_size={local_world_size}{via} does not divide num_replicas={num_replicas}: "
                "shard_by='node' needs the same number of ranks on every node (torchrun --nproc-per-node, "
                "srun --ntasks-per-node)."
            )
        # torchrun and srun (block distribution) number ranks contiguously per node; check it when the launcher's
        # variables describe this process.
        if view.rank == rank and view.world_size in (None, num_replicas) and view.local_rank is not None:
            expected = (rank // local_world_size, rank % local_world_size)
            got = (expected[0] if view.node is None else view.node, view.local_rank)
            if got != expected:
                found = [f"{view.source['local_rank']}={view.local_rank}"]
                if view.node is not None:
                    found.append(f"{view.source['node']}={view.node}")
                warn(
                    f"rank {rank} has {', '.join(found)}, but shard_by='node' "
                    f"assumes node {expected[0]}, local rank {expected[1]} (rank // local_world_size, "
                    f"local_world_size={local_world_size}). Sampling stays correct, but a node's shard will not "
                    "match the machine, so a per-node cache will miss; check local_world_size / the launcher "
                    "(with srun: --distribution=block).",
                    MonaiCacheWarning,
                    stacklevel=4,
                )
        return local_world_size

    # ------------------------------------------------------------------ indices

    def _spec(self, epoch: int) -> EpochSpec:
        return EpochSpec(
            self._dataset_len,
            self.seed,
            epoch,
            self.shuffle,
            self.drop_last,
            self.even_divisible,
            self.canonical_shards,
        )

    def _group_size_for_order(self) -> int:
        # shuffle=False (and the canonical order) yields each rank's own shard, in both modes.
        return order_group(self.local_world_size, self.shard_by, self.shuffle, self.canonical_shards)

    def shard_indices(self) -> list[int]:
        """The fixed, ascending dataset indices owned by this rank (``shard_by="rank"``) or node (``"node"``).

        Every index this process yields, in every epoch, comes from this list (the exceptions: ranks without a
        shard when ``len(dataset) < num_replicas``, which borrow items, and the few items an epoch resumed on
        another layout moves between shards to balance the ranks). Use it, e.g., to warm only this process's
        part of a cache.
        """
        group = self.local_world_size
        node = self.rank // group
        return strided_shard(self._dataset_len, self.num_replicas, node * group, group).tolist()

    def indices_for_epoch(self, epoch: int) -> list[int]:
        """All indices this rank yields in a full ``epoch`` (from its start), without changing state."""
        return rank_epoch_indices(self._spec(epoch), self.num_replicas, self._group_size_for_order(), self.rank)

    def __iter__(self) -> Iterator[int]:
        if len(cast(Sized, self.dataset)) != self._dataset_len:
            raise RuntimeError(
                f"the dataset length changed from {self._dataset_len} to {len(cast(Sized, self.dataset))} "
                "after the sampler was built; build a new sampler for the new dataset."
            )
        if self._resume_done:  # the resumed pass ran to its end: this pass is a full epoch of this layout
            self._resume_plan, self._history, self._resume_done = None, [], False
        indices = self._resume_plan if self._resume_plan is not None else self.indices_for_epoch(self.epoch)
        start = min(self._start_index, len(indices))
        self._consumed = start  # set now, not at the first next(), so state_dict() is right at once
        return self._iterate(indices, start)

    def _iterate(self, indices: list[int], start: int) -> Iterator[int]:
        for pos in range(start, len(indices)):
            self._consumed = pos + 1
            yield indices[pos]
        self._start_index = 0  # a completed pass ends the resume; the next pass is a full one
        self._resume_done = self._resume_plan is not None

    def _pass_length(self) -> int:
        return len(self._resume_plan) if self._resume_plan is not None else self.num_samples

    def __len__(self) -> int:
        """Number of indices the next pass yields: ``num_samples``, less what a resumed epoch already had."""
        if self._resume_done:
            return self.num_samples
        return self._pass_length() - min(self._start_index, self._pass_length())

    # ------------------------------------------------------------------ epoch / resume

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch; call it before each epoch, on every rank, so the shuffle changes between epochs.

        Setting the epoch that was restored by :meth:`load_state_dict` keeps the resume position; setting
        another epoch starts that epoch from its first index.

        Args:
            epoch: epoch number.
        """
        if epoch != self.epoch:
            self._start_index = 0
            self._consumed = 0
            self._resume_plan, self._history, self._resume_done = None, [], False
        self.epoch = epoch

    def set_start_index(self, start_index: int) -> None:
        """Skip the first ``start_index`` indices of the current epoch in the next pass (to resume).

        For callers that keep their own count, e.g. ``sampler.set_epoch(e); sampler.set_start_index(
        batches_done * batch_size)``. Equivalent to loading a state with ``consumed=start_index``.

        Args:
            start_index: number of indices of this epoch already consumed, in ``[0, num_samples]``.
        """
        length = self._pass_length()
        if not is_int(start_index) or not 0 <= start_index <= length:
            raise ValueError(
                f"start_index must be an int in [0, {length}] (this rank's epoch length), got {start_index!r}."
            )
        self._start_index = self._consumed = int(start_index)

    def state_dict(self, consumed: int | None = None, *, gather: bool = False) -> dict[str, Any]:
        """Return the state needed to resume mid-epoch, on this layout or another one.

        The state holds the epoch, the seed, the indices of the epoch consumed, this sampler's layout and,
        for an epoch that was itself resumed on another layout, the earlier layouts and their counts
        (``resumed_from``). It is plain data (ints, strings, lists): ``torch.save`` / JSON keep it as is.

        In the default mode (``even_divisible=True``) all ranks are in lockstep, so one rank's state (rank 0's,
        as usual) describes every rank and is enough to resume on any layout. With ``even_divisible=False``
        ranks differ in length: to resume on another layout, save every rank's count (``gather=True``, or
        :meth:`merge_states` of every rank's state).

        Args:
            consumed: indices of the current epoch whose samples were actually used, e.g.
                ``batches_done * batch_size``. Default: the number of indices this sampler has handed out in
                the current epoch. That count is exact with ``num_workers=0``; with worker processes the
                DataLoader fetches indices ahead of training (up to ``prefetch_factor * num_workers``
                batches), so pass ``consumed`` to avoid skipping the prefetched samples on resume.
            gather: keyword only. ``True``: also record every rank's count (``consumed_by_rank``), gathered
                with one ``all_gather_object`` over the default process group, whose world size and rank must
                be the sampler's. A collective: call it on every rank (then save on one).

        Raises:
            ValueError: ``consumed`` is outside ``[0, this pass's length]``, or ``gather=True`` without a process
                group matching the sampler.
        """
        length = self._pass_length()
        if consumed is None:
            consumed = self._consumed
        elif not is_int(consumed) or not 0 <= consumed <= length:
            raise ValueError(f"consumed must be an int in [0, {length}], got {consumed!r}.")
        consumed = int(consumed)
        state: dict[str, Any] = {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "seed": self.seed,
            "consumed": consumed,
            "rank": self.rank,
            "num_replicas": self.num_replicas,
            "dataset_len": self._dataset_len,
            "shard_by": self.shard_by,
            "local_world_size": self.local_world_size,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "even_divisible": self.even_divisible,
            "canonical_shards": self.canonical_shards,
        }
        if self._history:
            state["resumed_from"] = [dict(h) for h in self._history]
        if gather:
            if not (dist.is_available() and dist.is_initialized()) or (dist.get_world_size(), dist.get_rank()) != (
                self.num_replicas,
                self.rank,
            ):
                raise ValueError(
                    "state_dict(gather=True) gathers every rank's count over the default process group, which "
                    f"must be initialised with this sampler's world size and rank ({self.num_replicas}, "
                    f"{self.rank}); save every rank's state_dict() and combine them with merge_states() instead."
                )
            counts: list[Any] = [None] * self.num_replicas
            dist.all_gather_object(counts, consumed)
            state["consumed_by_rank"] = [int(c) for c in counts]
        return state

    @staticmethod
    def merge_states(states: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        """Combine the states saved by every rank of one layout into one state that records every rank's count.

        Needed only to resume an ``even_divisible=False`` epoch on another layout, or when ranks were not in
        lockstep; ``state_dict(gather=True)`` does the same with one collective.

        Args:
            states: one :meth:`state_dict` of each rank, any order.

        Returns:
            The state of the lowest rank with ``consumed_by_rank`` set.

        Raises:
            ValueError: a rank is missing or repeated, or the states differ in anything but their counts.
        """
        if not states:
            raise ValueError("merge_states() needs the state of every rank, got none.")
        by_rank: dict[int, Mapping[str, Any]] = {}
        for state in states:
            rank = cast(int, state.get("rank"))
            if not is_int(rank) or rank in by_rank:
                raise ValueError(
                    f"merge_states() needs one state per rank, each with its 'rank'; got rank {rank!r} "
                    f"{'twice' if rank in by_rank else 'in a state'} (ranks so far: {sorted(by_rank)})."
                )
            by_rank[int(rank)] = state
        first = by_rank[min(by_rank)]
        world = first.get("num_replicas")
        if not is_int(world) or sorted(by_rank) != list(range(int(cast(int, world)))):
            raise ValueError(
                f"merge_states() needs the state of every rank 0..{world}-1 of the saved layout "
                f"(num_replicas={world!r}), got ranks {sorted(by_rank)}."
            )
        for rank, state in by_rank.items():
            keys = (set(first) | set(state)) - set(PER_RANK_KEYS)
            differ = sorted(k for k in keys if first.get(k) != state.get(k))
            if differ:
                k = differ[0]
                raise ValueError(
                    f"the states of ranks {min(by_rank)} and {rank} differ in {differ} (e.g. {k}: "
                    f"{first.get(k)!r} vs {state.get(k)!r}): they were not saved at the same point of one run. "
                    "Save every rank's state_dict() at the same step."
                )
        return {**first, "consumed_by_rank": [int(by_rank[r]["consumed"]) for r in range(len(by_rank))]}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore the epoch; the next pass yields what that epoch had not given yet, on this layout.

        On the layout the state was saved with, the next pass resumes after the ``consumed`` indices, exactly.
        On another layout (world size, ranks per node, ``shard_by``) the items the interrupted epoch had not
        given are dealt over the ranks of this one: each item once, to the rank (node) whose shard holds it
        where the ranks' share allows (so caches keep hitting), every rank the same number (``drop_last=False``:
        the short ranks pad with their own items; ``True``: at most ``num_replicas - 1`` items are left out),
        as torch's sampler treats a dataset. The epoch after it is the normal epoch of this layout.

        Args:
            state_dict: a dict from :meth:`state_dict` (any rank's in the default mode) or
                :meth:`merge_states`; ``epoch`` is required, ``seed`` and ``consumed`` default to the current
                seed and ``0``.

        Raises:
            ValueError: the state is from another dataset length or seed, a mid-epoch state from another
                ``shuffle``, ``drop_last``, ``even_divisible`` or ``canonical_shards``, or a field is missing,
                of the wrong type or inconsistent (a corrupt checkpoint); the message names the field and
                what to do. Nothing is loaded then.
        """
        check_state(state_dict, self._spec(self.epoch), self.num_replicas, self._group_size_for_order())
        epoch, seed = int(state_dict["epoch"]), int(state_dict.get("seed", self.seed))
        spec = self._spec(epoch)
        segments = segments_of_state(state_dict, spec)
        group = self._group_size_for_order()
        plan: list[int] | None = None
        history: list[dict[str, Any]] = []
        start = 0
        try:
            if segments and segments[-1][:2] == (self.num_replicas, group):  # the saved layout: go on exactly
                *earlier, (_, _, counts) = segments
                if earlier:
                    plan = segment_plan(spec, earlier, self.num_replicas, group)[self.rank]
                    history = [history_entry(h, h["consumed_by_rank"]) for h in state_dict["resumed_from"]]
                start = counts[self.rank]
                bound = len(plan) if plan is not None else rank_length(spec, self.num_replicas, self.rank)
                if start > bound:
                    raise ValueError(
                        f"state_dict['consumed']={start} exceeds this rank's epoch length {bound}; with "
                        "even_divisible=False ranks differ in length, so save and load each rank's own state, "
                        "or a state with every rank's count (state_dict(gather=True) or merge_states())"
                    )
            elif segments:
                plan = segment_plan(spec, segments, self.num_replicas, group)[self.rank]
                saved = state_dict.get("resumed_from", [])
                history = [history_entry(h, h["consumed_by_rank"]) for h in saved]
                history.append(history_entry(state_dict, segments[-1][2]))
        except ValueError as e:
            raise ValueError(f"cannot resume epoch {epoch} from this sampler state: {e}.") from None
        self.seed = seed
        self.epoch = epoch
        self._resume_plan, self._history, self._resume_done = plan, history, False
        self._start_index = self._consumed = start
