"""Shard-local distributed sampler: every rank (or node) reads a fixed shard, so per-rank caches hit.

With :class:`torch.utils.data.DistributedSampler` every epoch deals every item to a random rank, so a
cache that lives in one process (or one machine) holds the right item only ``1 / world`` of the time.
:class:`ShardedDistributedSampler` keeps each rank's (or each node's) set of items fixed for the whole
run and only reorders it from epoch to epoch, so from the second epoch on every read is a cache hit.

The order of an epoch is a pure function of the seed, the epoch, the dataset length and the layout (world size,
ranks per node), so a state saved mid-epoch tells every rank what the others had read: an epoch resumes exactly
on the same layout, or with its remaining items re-dealt over another one (``_segment_plan``). With
``canonical_shards`` the global order does not depend on the world size at all.
"""

from __future__ import annotations

import math
import numbers
import os
import weakref
from collections.abc import Iterator, Mapping, Sequence, Sized
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.utils.data import Dataset, DistributedSampler

from monai_cache.errors import MonaiCacheWarning, warn
from monai_cache.runtime import node_identity

__all__ = ["ShardedDistributedSampler"]


_SHARD_BY = ("rank", "node")
_MASK64 = (1 << 64) - 1
_STATE_VERSION = 2  # 1: no "version" key, one layout per state; 2: "rank", "consumed_by_rank", "resumed_from"
# keys of ``state_dict()`` a mid-epoch resume needs unchanged (the order of the epoch depends on them)
_ORDER_KEYS = ("shuffle", "drop_last", "even_divisible", "canonical_shards")
# keys of the layout a state was saved with; another layout re-deals the rest of the epoch
_LAYOUT_KEYS = ("num_replicas", "shard_by", "local_world_size")
_PER_RANK_KEYS = ("consumed", "rank", "consumed_by_rank")


def _is_int(value: object) -> bool:
    """An integer, Python's or numpy's (as torch's DistributedSampler accepts), but not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _mix_seed(*values: int) -> int:
    """Mix integers into one 63-bit seed (splitmix64 finaliser), identical in every process.

    ``seed + epoch`` (what torch uses) would give shard ``g`` in epoch ``e`` the same generator as shard
    ``g + 1`` in epoch ``e - 1``; mixing keeps the per-shard permutations unrelated.
    """
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = (h ^ (v & _MASK64)) & _MASK64
        h = (h + 0x9E3779B97F4A7C15) & _MASK64
        h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & _MASK64
        h ^= h >> 31
    return h >> 1


def _strided_shard(n: int, world: int, first: int, count: int) -> torch.Tensor:
    """Items ``x`` in ``[0, n)`` with ``first <= x % world < first + count``, ascending.

    With ``count == 1`` this is rank ``first``'s shard ``first, first + world, ...``; with ``count ==
    local_world_size`` it is the union of the shards of one node's ranks.
    """
    starts = torch.arange(0, n, world, dtype=torch.int64)
    idx = (starts[:, None] + torch.arange(first, first + count, dtype=torch.int64)[None, :]).reshape(-1)
    return idx[idx < n]


def _fit_to_length(shard: torch.Tensor, length: int, epoch: int, n: int, group: int) -> torch.Tensor:
    """Return exactly ``length`` items drawn from ``shard`` for ``epoch``: all of it, minus or plus a window.

    Too many items: a window of ``d = len(shard) - length`` consecutive positions is left out, and the window
    moves by ``d`` each epoch. Too few: the ``p = length - len(shard)`` missing reads are filled with a window
    of the shard's own items that moves by ``p`` each epoch. Over any ``len(shard)`` consecutive epochs each
    position is therefore left out exactly ``d`` times (so seen ``len(shard) - d >= 1`` times) or padded
    exactly ``p`` times (so not duplicated in at least one epoch when ``p < len(shard)``). The window starts
    at an offset given by the shard number ``group``, so shards do not all pick their first item together.

    An empty shard (only when ``len(dataset) < num_replicas``) borrows a rotating window of the whole dataset.
    """
    size = int(shard.numel())
    if size == 0:
        return (torch.arange(length, dtype=torch.int64) + (group + epoch) * length) % n
    if length <= size:
        drop = size - length
        if drop == 0:
            return shard
        keep = torch.ones(size, dtype=torch.bool)
        keep[(torch.arange(drop, dtype=torch.int64) + (epoch + group) * drop) % size] = False
        return shard[keep]
    pad = length - size
    return torch.cat([shard, shard[(torch.arange(pad, dtype=torch.int64) + (epoch + group) * pad) % size]])


_CANONICAL_TAG = 1 << 40  # seeds of canonical shards, unrelated to the default order's (seed, epoch, node)
_RESUME_TAG = 1 << 41  # seeds of the re-dealt remainder of an epoch resumed on another layout


@dataclass(frozen=True)
class _EpochSpec:
    """What an epoch's order depends on, apart from the layout: the same for every segment of one epoch."""

    n: int
    seed: int
    epoch: int
    shuffle: bool
    drop_last: bool
    even_divisible: bool
    canonical: int | None


def _order_group(local_world_size: int, shard_by: str, shuffle: bool, canonical: int | None) -> int:
    """Ranks that share one shuffled shard: the node's in node mode with ``shuffle``, else 1 (a rank's own)."""
    return local_world_size if shard_by == "node" and shuffle and canonical is None else 1


def _rank_length(spec: _EpochSpec, world: int, rank: int) -> int:
    """Indices rank ``rank`` yields in a full epoch: torch's ``ceil`` / ``floor``, or its whole shard."""
    if not spec.even_divisible:
        return len(range(rank, spec.n, world))
    return spec.n // world if spec.drop_last else math.ceil(spec.n / world)


def _canonical_sequence(n: int, canonical: int, seed: int, epoch: int, shuffle: bool) -> torch.Tensor:
    """The epoch's global order with ``canonical`` shards: a function of ``n``, the seed and the epoch alone.

    Canonical shard ``c`` holds the items ``x`` with ``x % canonical == c``; each is permuted on its own, and
    position ``j * canonical + c`` of the global order holds shard ``c``'s ``j``-th item. So item ``x`` always
    sits at a position congruent to ``x`` modulo ``canonical``: dealt round-robin to ``W`` ranks (``W`` divides
    ``canonical``), position ``p`` goes to rank ``p % W``, which owns ``x % W`` (its default shard).
    """
    rounds = math.ceil(n / canonical)
    grid = torch.full((canonical, rounds), -1, dtype=torch.int64)
    for c in range(min(canonical, n)):
        shard = torch.arange(c, n, canonical, dtype=torch.int64)
        if shuffle and shard.numel() > 1:
            gen = torch.Generator()
            gen.manual_seed(_mix_seed(seed, epoch, c, _CANONICAL_TAG))
            shard = shard[torch.randperm(int(shard.numel()), generator=gen)]
        grid[c, : shard.numel()] = shard
    seq = grid.t().reshape(-1)
    return seq[seq >= 0]


def _rank_epoch_indices(spec: _EpochSpec, world: int, group: int, rank: int) -> list[int]:
    """All indices rank ``rank`` yields in a full epoch: a pure function of the spec and the layout."""
    n = spec.n
    length = _rank_length(spec, world, rank)
    if spec.canonical is not None:
        own = _canonical_sequence(n, spec.canonical, spec.seed, spec.epoch, spec.shuffle)[rank::world]
        size = int(own.numel())
        if length <= size:
            return cast(list[int], own[:length].tolist())
        if size == 0:  # fewer items than ranks: borrow a rotating window, as the default order does
            return cast(list[int], ((torch.arange(length) + (rank + spec.epoch) * length) % n).tolist())
        return cast(list[int], torch.cat([own, own[torch.arange(length - size) % size]]).tolist())
    node, local = divmod(rank, group)
    shard = _strided_shard(n, world, node * group, group)
    if spec.even_divisible:
        seq = _fit_to_length(shard, group * length, spec.epoch, n, node)
        lo = local * length
        hi = lo + length
    else:
        seq = shard
        sizes = [len(range(node * group + j, n, world)) for j in range(group)]
        lo = sum(sizes[:local])
        hi = lo + sizes[local]
    if spec.shuffle:
        gen = torch.Generator()
        gen.manual_seed(_mix_seed(spec.seed, spec.epoch, node))
        seq = seq[torch.randperm(int(seq.numel()), generator=gen)]
    return cast(list[int], seq[lo:hi].tolist())


def _rank_targets(spec: _EpochSpec, remaining: int, world: int, group: int, have: Sequence[int]) -> list[int]:
    """Indices each new rank yields in the rest of a resumed epoch, with torch's semantics for the remainder.

    ``even_divisible=True``: every rank the same number, ``ceil(remaining / world)`` (short ranks pad) or with
    ``drop_last`` ``floor`` (at most ``world - 1`` items left out). ``False``: every item once, ranks differ by
    at most one; the longer ranks are those whose owners (``have``: items per owner) hold the most items.
    """
    if spec.even_divisible:
        return [remaining // world if spec.drop_last else math.ceil(remaining / world)] * world
    base, extra = divmod(remaining, world)
    extras = [0] * len(have)
    for o in sorted(range(len(have)), key=lambda o: -(have[o] - group * base)):
        extras[o] = min(group, extra, max(0, have[o] - group * base))
        extra -= extras[o]
    for o in range(len(have)):  # what is left goes wherever there is room
        more = min(group - extras[o], extra)
        extras[o] += more
        extra -= more
    return [base + (1 if r % group < extras[r // group] else 0) for r in range(world)]


def _redeal(spec: _EpochSpec, remaining: Sequence[int], world: int, group: int, segment: int) -> list[list[int]]:
    """Deal the items an interrupted epoch had not given (``remaining``, in order) over a new layout.

    Each item goes to its owner in the new layout (the rank, or node, whose shard holds it, where the next
    epochs read it too), so the reads fill the caches that keep it. Owners are balanced with the fewest moves:
    an owner with more items than its ranks' share hands its last ones to owners with fewer. What is still
    short is padded with the owner's own items (``drop_last=False``); what is over is left out
    (``drop_last=True``). ``remaining`` is ascending, or in canonical order (kept, so the global order goes on).
    """
    owners = world // group
    by_owner: list[list[int]] = [[] for _ in range(owners)]
    for x in remaining:
        by_owner[(x % world) // group].append(x)
    if spec.shuffle and spec.canonical is None:
        for o, items in enumerate(by_owner):
            if len(items) > 1:
                gen = torch.Generator()
                gen.manual_seed(_mix_seed(spec.seed, spec.epoch, o, _RESUME_TAG, segment))
                by_owner[o] = [items[i] for i in torch.randperm(len(items), generator=gen).tolist()]
    targets = _rank_targets(spec, len(remaining), world, group, [len(items) for items in by_owner])
    owner_targets = [sum(targets[o * group : (o + 1) * group]) for o in range(owners)]
    kept = [items[:t] for items, t in zip(by_owner, owner_targets)]
    pool = [x for items, t in zip(by_owner, owner_targets) for x in items[t:]]
    taken = 0
    for o in range(owners):
        need = max(0, owner_targets[o] - len(kept[o]))
        kept[o] += pool[taken : taken + need]
        taken += len(pool[taken : taken + need])
    if not spec.shuffle or spec.canonical is not None:
        order = {x: i for i, x in enumerate(remaining)}
        kept = [sorted(items, key=order.__getitem__) for items in kept]
    for o in range(owners):
        need = owner_targets[o] - len(kept[o])
        source = by_owner[o] or list(remaining)
        kept[o] += [source[i % len(source)] for i in range(need)]
    plan = []
    for r in range(world):
        o = r // group
        lo = sum(targets[o * group : r])
        plan.append(kept[o][lo : lo + targets[r]])
    return plan


def _segment_plan(
    spec: _EpochSpec, segments: Sequence[tuple[int, int, Sequence[int]]], world: int, group: int
) -> list[list[int]]:
    """Every rank's indices for a layout ``(world, group)`` that resumes an epoch after ``segments``.

    ``segments`` are the earlier parts of the epoch, each ``(world, group, consumed_by_rank)``: the first one
    ran the full epoch of its layout; each later one the remainder re-dealt by :func:`_redeal`. With no
    segments this is the full epoch. A pure function of its arguments.

    Raises:
        ValueError: a consumed count is outside ``[0, length of that rank's indices]``.
    """
    if not segments:
        return [_rank_epoch_indices(spec, world, group, r) for r in range(world)]
    position: dict[int, int] = {}
    if spec.canonical is not None:  # the remainder keeps the canonical order, so the global order goes on
        sequence = _canonical_sequence(spec.n, spec.canonical, spec.seed, spec.epoch, spec.shuffle).tolist()
        position = {x: p for p, x in enumerate(sequence)}
    remaining: list[int] = []
    for i, (world_i, group_i, consumed) in enumerate(segments):
        if i == 0:
            plan_i = [_rank_epoch_indices(spec, world_i, group_i, r) for r in range(world_i)]
        else:
            plan_i = _redeal(spec, remaining, world_i, group_i, i)
        given: set[int] = set()
        for r, (indices, c) in enumerate(zip(plan_i, consumed)):
            if not 0 <= c <= len(indices):
                raise ValueError(
                    f"rank {r} of the saved layout (num_replicas={world_i}) consumed {c} indices, but yields "
                    f"{len(indices)} in this part of epoch {spec.epoch}"
                )
            given.update(indices[:c])
        left = {x for indices in plan_i for x in indices} - given
        remaining = sorted(left, key=position.__getitem__) if position else sorted(left)
    return _redeal(spec, remaining, world, group, len(segments))


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


def _local_world_size_of_process_group(num_replicas: int, rank: int) -> int:
    """Ranks per node found by gathering every rank's machine identity over the default process group.

    Only gathers when the process group describes the sampler's layout (same world size and rank), so that
    every rank takes part: a collective started on a subset of the ranks would wait forever.
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
        reason = "torch.distributed is not initialised and LOCAL_WORLD_SIZE is not set"
    raise ValueError(
        f"shard_by='node' needs the number of ranks per node, but {reason}. Pass local_world_size=..., "
        "build the sampler on every rank after torch.distributed.init_process_group(), with num_replicas "
        "and rank left out or equal to the group's (the ranks of each machine are then found by one all-gather "
        "of host names), or run under torchrun, which sets LOCAL_WORLD_SIZE."
    )


def _is_mid_epoch(state: Mapping[str, Any]) -> bool:
    counts = state.get("consumed_by_rank") or []
    return bool(state.get("consumed", 0) or state.get("resumed_from") or any(counts))


def _check_layout(where: str, layout: Mapping[str, Any], counts_key: str | None) -> None:
    """Check one saved layout (the state's, or one of ``resumed_from``) is well formed; else a ValueError."""
    for key in _LAYOUT_KEYS + ((counts_key,) if counts_key else ()):
        if key not in layout:
            raise ValueError(
                f"{where} has no {key!r} (keys: {sorted(layout)}): the checkpoint is corrupt or not from "
                "ShardedDistributedSampler.state_dict(); save sampler.state_dict() again, or start the epoch over "
                "(load a state with consumed=0)."
            )
    world, shard_by, local = layout["num_replicas"], layout["shard_by"], layout["local_world_size"]
    bad = None
    if not _is_int(world) or world < 1:
        bad = f"num_replicas={world!r} is not a positive int"
    elif shard_by not in _SHARD_BY:
        bad = f"shard_by={shard_by!r} is not 'rank' or 'node'"
    elif not _is_int(local) or local < 1 or world % local:
        bad = f"local_world_size={local!r} does not divide num_replicas={world}"
    elif counts_key is not None:
        counts = layout[counts_key]
        if not isinstance(counts, Sequence) or len(counts) != world or not all(_is_int(c) and c >= 0 for c in counts):
            bad = f"{counts_key}={counts!r} is not {world} counts >= 0 (one per rank)"
    if bad:
        raise ValueError(
            f"{where}: {bad}. The checkpoint is corrupt; save sampler.state_dict() again, or start the epoch over "
            "(load a state with consumed=0)."
        )


def _saved_order_group(layout: Mapping[str, Any], sampler: ShardedDistributedSampler) -> int:
    return _order_group(
        layout["local_world_size"],
        layout["shard_by"],
        sampler.shuffle,
        sampler.canonical_shards,
    )


def _check_state(sampler: ShardedDistributedSampler, state: Mapping[str, Any]) -> None:
    """Refuse a state this sampler cannot resume exactly, naming the field and what to do (issue: nothing is
    silently re-dealt when the dataset, the seed or the order's options differ)."""
    if not isinstance(state, Mapping):
        raise ValueError(f"a sampler state is the dict from sampler.state_dict(), got {type(state).__name__}.")
    if "epoch" not in state:
        raise ValueError(f"state_dict has no 'epoch' key (keys: {sorted(state)}); pass sampler.state_dict().")
    version = state.get("version", 1)
    if not _is_int(version) or not 1 <= version <= _STATE_VERSION:
        raise ValueError(
            f"state_dict['version']={version!r}: this monai_cache reads sampler states of versions 1 to "
            f"{_STATE_VERSION}; the state was saved by a newer monai_cache (upgrade this one) or is corrupt."
        )
    for key in ("epoch", "seed", "consumed"):
        if key in state and not _is_int(state[key]):
            raise ValueError(f"state_dict[{key!r}] must be an int, got {state[key]!r}.")
    for key in ("epoch", "consumed"):
        if state.get(key, 0) < 0:
            raise ValueError(f"state_dict[{key!r}] must be >= 0, got {state[key]}.")
    if "dataset_len" in state and state["dataset_len"] != sampler._dataset_len:
        raise ValueError(
            f"the state was saved for a dataset of {state['dataset_len']!r} items, this sampler's has "
            f"{sampler._dataset_len} (dataset_len differs): the order of every epoch depends on the length, so "
            "the state cannot be resumed. Load it with the same data list, or start this dataset from epoch 0 "
            "without loading the sampler state."
        )
    if "seed" in state and state["seed"] != sampler.seed:
        raise ValueError(
            f"the state was saved with seed={state['seed']}, this sampler has seed={sampler.seed} (seed differs): "
            f"every epoch's order depends on it. Build the sampler with seed={state['seed']} to resume that "
            "run, or do not load the state to start a new order."
        )
    if not _is_mid_epoch(state):
        return
    current = {
        "shuffle": sampler.shuffle,
        "drop_last": sampler.drop_last,
        "even_divisible": sampler.even_divisible,
        "canonical_shards": sampler.canonical_shards,
    }
    for key in _ORDER_KEYS:
        saved = state.get(key, None if key == "canonical_shards" else current[key])
        if saved != current[key]:
            raise ValueError(
                f"cannot resume in the middle of epoch {state['epoch']}: the state was saved with {key}={saved!r}, "
                f"this sampler has {key}={current[key]!r} ({key} differs) and the order of the epoch depends on it. "
                f"Build the sampler with {key}={saved!r} to finish this epoch, or resume from an epoch boundary "
                "(a state with consumed=0, e.g. the next epoch's)."
            )
    if "dataset_len" not in state:
        raise ValueError(
            f"state_dict has no 'dataset_len' (keys: {sorted(state)}): the checkpoint is corrupt or not from "
            "ShardedDistributedSampler.state_dict(); save sampler.state_dict() again."
        )
    _check_layout("state_dict", state, "consumed_by_rank" if "consumed_by_rank" in state else None)
    history = state.get("resumed_from", [])
    if not isinstance(history, Sequence) or not all(isinstance(h, Mapping) for h in history):
        raise ValueError(
            f"state_dict['resumed_from'] must be a list of layouts, got {history!r}; the checkpoint is corrupt."
        )
    for i, layout in enumerate(history):
        _check_layout(f"state_dict['resumed_from'][{i}]", layout, "consumed_by_rank")
    same = (state["num_replicas"], _saved_order_group(state, sampler)) == (
        sampler.num_replicas,
        sampler._group_size_for_order(),
    )
    if not same and not sampler.even_divisible and "consumed_by_rank" not in state:
        raise ValueError(
            f"with even_divisible=False ranks differ in length, so one rank's count (consumed={state['consumed']}) "
            f"does not tell what the other ranks of the saved layout (num_replicas={state['num_replicas']}) had "
            "read; a resume on another layout needs every rank's count: save state_dict(gather=True) on every "
            "rank, or merge_states() of every rank's state_dict()."
        )


def _segments_of_state(
    sampler: ShardedDistributedSampler, state: Mapping[str, Any]
) -> list[tuple[int, int, list[int]]]:
    """The parts of the saved epoch, oldest first, as ``(world, order group, consumed_by_rank)``; none at a
    boundary. One count for all ranks (lockstep) when the state has no ``consumed_by_rank``."""
    if not _is_mid_epoch(state):
        return []
    segments = [
        (int(h["num_replicas"]), _saved_order_group(h, sampler), [int(c) for c in h["consumed_by_rank"]])
        for h in state.get("resumed_from", [])
    ]
    counts = state.get("consumed_by_rank") or [state.get("consumed", 0)] * state["num_replicas"]
    segments.append((int(state["num_replicas"]), _saved_order_group(state, sampler), [int(c) for c in counts]))
    return segments


def _history_entry(layout: Mapping[str, Any], counts: Sequence[int]) -> dict[str, Any]:
    return {**{k: layout[k] for k in _LAYOUT_KEYS}, "consumed_by_rank": [int(c) for c in counts]}


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
            above). Otherwise, when ``torch.distributed`` is initialised with this sampler's world size and
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
        if not _is_int(num_replicas) or num_replicas < 1:
            raise ValueError(f"num_replicas must be a positive int (the world size), got {num_replicas!r}.")
        if not _is_int(rank) or not 0 <= rank < num_replicas:
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
        if shard_by not in _SHARD_BY:
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
            if not _is_int(canonical_shards) or canonical_shards < 1:
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
        if local_world_size is None:
            env = os.environ.get("LOCAL_WORLD_SIZE")
            if env is not None:
                try:
                    local_world_size = int(env)
                except ValueError:
                    raise ValueError(f"LOCAL_WORLD_SIZE={env!r} is not an int; pass local_world_size=...") from None
            else:
                return _local_world_size_of_process_group(num_replicas, rank)
        if not _is_int(local_world_size) or local_world_size < 1:
            raise ValueError(f"local_world_size must be a positive int, got {local_world_size!r}.")
        local_world_size = int(local_world_size)
        if num_replicas % local_world_size != 0:
            raise ValueError(
                f"local_world_size={local_world_size} does not divide num_replicas={num_replicas}: "
                "shard_by='node' needs the same number of ranks on every node (torchrun --nproc-per-node)."
            )
        # torchrun numbers ranks contiguously per node; check it when the environment describes this process.
        env_rank, env_local, env_group = (os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "GROUP_RANK"))
        if env_rank == str(rank) and env_local is not None:
            expected = (rank // local_world_size, rank % local_world_size)
            got_node = int(env_group) if env_group is not None and env_group.lstrip("-").isdigit() else expected[0]
            got_local = int(env_local) if env_local.lstrip("-").isdigit() else expected[1]
            if (got_node, got_local) != expected:
                warn(
                    f"rank {rank} has LOCAL_RANK={env_local}, GROUP_RANK={env_group}, but shard_by='node' "
                    f"assumes node {expected[0]}, local rank {expected[1]} (rank // local_world_size, "
                    f"local_world_size={local_world_size}). Sampling stays correct, but a node's shard will not "
                    "match the machine, so a per-node cache will miss; check local_world_size / the launcher.",
                    MonaiCacheWarning,
                    stacklevel=4,
                )
        return local_world_size

    # ------------------------------------------------------------------ indices

    def _spec(self, epoch: int) -> _EpochSpec:
        return _EpochSpec(
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
        return _order_group(self.local_world_size, self.shard_by, self.shuffle, self.canonical_shards)

    def shard_indices(self) -> list[int]:
        """The fixed, ascending dataset indices owned by this rank (``shard_by="rank"``) or node (``"node"``).

        Every index this process yields, in every epoch, comes from this list (the exceptions: ranks without a
        shard when ``len(dataset) < num_replicas``, which borrow items, and the few items an epoch resumed on
        another layout moves between shards to balance the ranks). Use it, e.g., to warm only this process's
        part of a cache.
        """
        group = self.local_world_size
        node = self.rank // group
        return _strided_shard(self._dataset_len, self.num_replicas, node * group, group).tolist()

    def indices_for_epoch(self, epoch: int) -> list[int]:
        """All indices this rank yields in a full ``epoch`` (from its start), without changing state."""
        return _rank_epoch_indices(self._spec(epoch), self.num_replicas, self._group_size_for_order(), self.rank)

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
        if not _is_int(start_index) or not 0 <= start_index <= length:
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
        elif not _is_int(consumed) or not 0 <= consumed <= length:
            raise ValueError(f"consumed must be an int in [0, {length}], got {consumed!r}.")
        consumed = int(consumed)
        state: dict[str, Any] = {
            "version": _STATE_VERSION,
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
            if not _is_int(rank) or rank in by_rank:
                raise ValueError(
                    f"merge_states() needs one state per rank, each with its 'rank'; got rank {rank!r} "
                    f"{'twice' if rank in by_rank else 'in a state'} (ranks so far: {sorted(by_rank)})."
                )
            by_rank[int(rank)] = state
        first = by_rank[min(by_rank)]
        world = first.get("num_replicas")
        if not _is_int(world) or sorted(by_rank) != list(range(int(cast(int, world)))):
            raise ValueError(
                f"merge_states() needs the state of every rank 0..{world}-1 of the saved layout "
                f"(num_replicas={world!r}), got ranks {sorted(by_rank)}."
            )
        for rank, state in by_rank.items():
            keys = (set(first) | set(state)) - set(_PER_RANK_KEYS)
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
        _check_state(self, state_dict)
        epoch, seed = int(state_dict["epoch"]), int(state_dict.get("seed", self.seed))
        segments = _segments_of_state(self, state_dict)
        spec = self._spec(epoch)
        group = self._group_size_for_order()
        plan: list[int] | None = None
        history: list[dict[str, Any]] = []
        start = 0
        try:
            if segments and segments[-1][:2] == (self.num_replicas, group):  # the saved layout: go on exactly
                *earlier, (_, _, counts) = segments
                if earlier:
                    plan = _segment_plan(spec, earlier, self.num_replicas, group)[self.rank]
                    history = [_history_entry(h, h["consumed_by_rank"]) for h in state_dict["resumed_from"]]
                start = counts[self.rank]
                bound = len(plan) if plan is not None else _rank_length(spec, self.num_replicas, self.rank)
                if start > bound:
                    raise ValueError(
                        f"state_dict['consumed']={start} exceeds this rank's epoch length {bound}; with "
                        "even_divisible=False ranks differ in length, so save and load each rank's own state, "
                        "or a state with every rank's count (state_dict(gather=True) or merge_states())"
                    )
            elif segments:
                plan = _segment_plan(spec, segments, self.num_replicas, group)[self.rank]
                saved = state_dict.get("resumed_from", [])
                history = [_history_entry(h, h["consumed_by_rank"]) for h in saved]
                history.append(_history_entry(state_dict, segments[-1][2]))
        except ValueError as e:
            raise ValueError(f"cannot resume epoch {epoch} from this sampler state: {e}.") from None
        self.seed = seed
        self.epoch = epoch
        self._resume_plan, self._history, self._resume_done = plan, history, False
        self._start_index = self._consumed = start
