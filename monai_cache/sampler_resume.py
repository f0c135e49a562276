"""Resuming an epoch of :class:`~monai_cache.sampler.ShardedDistributedSampler`: pure arithmetic on saved states.

A state saved mid-epoch names the layout it was saved on and what each rank had consumed; the order of the epoch
being a pure function (:mod:`monai_cache.sampler_order`), that tells what every rank had read. On the same layout
the epoch goes on exactly; on another one the items it had not given are re-dealt over the new ranks
(:func:`redeal`), each to the rank or node whose shard holds it, and an epoch resumed several times is replayed
part by part (:func:`segment_plan`). :func:`check_state` refuses a state that cannot be resumed exactly, naming
the field and what to do.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from monai_cache.sampler_order import (
    SHARD_BY,
    EpochSpec,
    canonical_sequence,
    is_int,
    mix_seed,
    order_group,
    rank_epoch_indices,
)

__all__ = [
    "PER_RANK_KEYS",
    "STATE_VERSION",
    "check_state",
    "history_entry",
    "redeal",
    "segment_plan",
    "segments_of_state",
]

STATE_VERSION = 2  # 1: no "version" key, one layout per state; 2: "rank", "consumed_by_rank", "resumed_from"
# keys of ``state_dict()`` a mid-epoch resume needs unchanged (the order of the epoch depends on them)
_ORDER_KEYS = ("shuffle", "drop_last", "even_divisible", "canonical_shards")
# keys of the layout a state was saved with; another layout re-deals the rest of the epoch
_LAYOUT_KEYS = ("num_replicas", "shard_by", "local_world_size")
PER_RANK_KEYS = ("consumed", "rank", "consumed_by_rank")
# seeds of the re-dealt remainder of an epoch resumed on another layout (sampler_order's canonical shards: 1 << 40)
_RESUME_TAG = 1 << 41


def _rank_targets(spec: EpochSpec, remaining: int, world: int, group: int, have: Sequence[int]) -> list[int]:
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


def redeal(spec: EpochSpec, remaining: Sequence[int], world: int, group: int, segment: int) -> list[list[int]]:
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
                gen.manual_seed(mix_seed(spec.seed, spec.epoch, o, _RESUME_TAG, segment))
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


def segment_plan(
    spec: EpochSpec, segments: Sequence[tuple[int, int, Sequence[int]]], world: int, group: int
) -> list[list[int]]:
    """Every rank's indices for a layout ``(world, group)`` that resumes an epoch after ``segments``.

    ``segments`` are the earlier parts of the epoch, each ``(world, group, consumed_by_rank)``: the first one
    ran the full epoch of its layout; each later one the remainder re-dealt by :func:`redeal`. With no
    segments this is the full epoch. A pure function of its arguments.

    Raises:
        ValueError: a consumed count is outside ``[0, length of that rank's indices]``.
    """
    if not segments:
        return [rank_epoch_indices(spec, world, group, r) for r in range(world)]
    position: dict[int, int] = {}
    if spec.canonical is not None:  # the remainder keeps the canonical order, so the global order goes on
        sequence = canonical_sequence(spec.n, spec.canonical, spec.seed, spec.epoch, spec.shuffle).tolist()
        position = {x: p for p, x in enumerate(sequence)}
    remaining: list[int] = []
    for i, (world_i, group_i, consumed) in enumerate(segments):
        if i == 0:
            plan_i = [rank_epoch_indices(spec, world_i, group_i, r) for r in range(world_i)]
        else:
            plan_i = redeal(spec, remaining, world_i, group_i, i)
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
    return redeal(spec, remaining, world, group, len(segments))


def _is_mid_epoch(state: Mapping[str, Any]) -> bool:
    """Whether the state is inside an epoch (a state that carries per-rank counts or earlier layouts is checked as
    one, so a corrupt one is refused rather than read as an epoch boundary)."""
    return bool(state.get("consumed", 0)) or "consumed_by_rank" in state or "resumed_from" in state


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
    if not is_int(world) or world < 1:
        bad = f"num_replicas={world!r} is not a positive int"
    elif shard_by not in SHARD_BY:
        bad = f"shard_by={shard_by!r} is not 'rank' or 'node'"
    elif not is_int(local) or local < 1 or world % local:
        bad = f"local_world_size={local!r} does not divide num_replicas={world}"
    elif counts_key is not None:
        counts = layout[counts_key]
        if not isinstance(counts, Sequence) or len(counts) != world or not all(is_int(c) and c >= 0 for c in counts):
            bad = f"{counts_key}={counts!r} is not {world} counts >= 0 (one per rank)"
    if bad:
        raise ValueError(
            f"{where}: {bad}. The checkpoint is corrupt; save sampler.state_dict() again, or start the epoch over "
            "(load a state with consumed=0)."
        )


def _saved_order_group(layout: Mapping[str, Any], spec: EpochSpec) -> int:
    return order_group(layout["local_world_size"], layout["shard_by"], spec.shuffle, spec.canonical)


def check_state(state: Mapping[str, Any], spec: EpochSpec, world: int, group: int) -> None:
    """Refuse a state the sampler of ``spec`` (its dataset length, seed and order options; the epoch is not looked
    at) on layout ``(world, group)`` cannot resume exactly, naming the field and what to do (nothing is silently
    re-dealt when the dataset, the seed or the order's options differ)."""
    if not isinstance(state, Mapping):
        raise ValueError(f"a sampler state is the dict from sampler.state_dict(), got {type(state).__name__}.")
    if "epoch" not in state:
        raise ValueError(f"state_dict has no 'epoch' key (keys: {sorted(state)}); pass sampler.state_dict().")
    version = state.get("version", 1)
    if not is_int(version) or not 1 <= version <= STATE_VERSION:
        raise ValueError(
            f"state_dict['version']={version!r}: this monai_cache reads sampler states of versions 1 to "
            f"{STATE_VERSION}; the state was saved by a newer monai_cache (upgrade this one) or is corrupt."
        )
    for key in ("epoch", "seed", "consumed"):
        if key in state and not is_int(state[key]):
            raise ValueError(f"state_dict[{key!r}] must be an int, got {state[key]!r}.")
    for key in ("epoch", "consumed"):
        if state.get(key, 0) < 0:
            raise ValueError(f"state_dict[{key!r}] must be >= 0, got {state[key]}.")
    if "dataset_len" in state and state["dataset_len"] != spec.n:
        raise ValueError(
            f"the state was saved for a dataset of {state['dataset_len']!r} items, this sampler's has "
            f"{spec.n} (dataset_len differs): the order of every epoch depends on the length, so "
            "the state cannot be resumed. Load it with the same data list, or start this dataset from epoch 0 "
            "without loading the sampler state."
        )
    if "seed" in state and state["seed"] != spec.seed:
        raise ValueError(
            f"the state was saved with seed={state['seed']}, this sampler has seed={spec.seed} (seed differs): "
            f"every epoch's order depends on it. Build the sampler with seed={state['seed']} to resume that "
            "run, or do not load the state to start a new order."
        )
    if not _is_mid_epoch(state):
        return
    current = {
        "shuffle": spec.shuffle,
        "drop_last": spec.drop_last,
        "even_divisible": spec.even_divisible,
        "canonical_shards": spec.canonical,
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
    same = (state["num_replicas"], _saved_order_group(state, spec)) == (world, group)
    if not same and not spec.even_divisible and "consumed_by_rank" not in state:
        raise ValueError(
            f"with even_divisible=False ranks differ in length, so one rank's count (consumed={state['consumed']}) "
            f"does not tell what the other ranks of the saved layout (num_replicas={state['num_replicas']}) had "
            "read; a resume on another layout needs every rank's count: save state_dict(gather=True) on every "
            "rank, or merge_states() of every rank's state_dict()."
        )


def segments_of_state(state: Mapping[str, Any], spec: EpochSpec) -> list[tuple[int, int, list[int]]]:
    """The parts of the saved epoch, oldest first, as ``(world, order group, consumed_by_rank)``; none at a
    boundary. One count for all ranks (lockstep) when the state has no ``consumed_by_rank``."""
    if not _is_mid_epoch(state):
        return []
    segments = [
        (int(h["num_replicas"]), _saved_order_group(h, spec), [int(c) for c in h["consumed_by_rank"]])
        for h in state.get("resumed_from", [])
    ]
    counts = state.get("consumed_by_rank") or [state.get("consumed", 0)] * state["num_replicas"]
    if not segments and not any(counts):  # nothing read yet: an epoch boundary, the full epoch of the new layout
        return []
    segments.append((int(state["num_replicas"]), _saved_order_group(state, spec), [int(c) for c in counts]))
    return segments


def history_entry(layout: Mapping[str, Any], counts: Sequence[int]) -> dict[str, Any]:
    """One earlier part of a resumed epoch, as ``state_dict()["resumed_from"]`` keeps it: its layout and counts."""
    return {**{k: layout[k] for k in _LAYOUT_KEYS}, "consumed_by_rank": [int(c) for c in counts]}
