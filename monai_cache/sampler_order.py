"""The order of an epoch of :class:`~monai_cache.sampler.ShardedDistributedSampler`: the indices each rank yields.

A pure function of the dataset length, the seed, the epoch and the layout (world size, ranks that share one shuffled
shard), identical in every process and never touching the global RNG: every rank knows what every other rank reads,
which is what a resume on another layout (:mod:`monai_cache.sampler_resume`) relies on. With ``canonical`` shards the
global order does not depend on the world size at all.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import cast

import torch

__all__ = [
    "SHARD_BY",
    "EpochSpec",
    "canonical_sequence",
    "fit_to_length",
    "is_int",
    "mix_seed",
    "order_group",
    "rank_epoch_indices",
    "rank_length",
    "strided_shard",
]

SHARD_BY = ("rank", "node")
_MASK64 = (1 << 64) - 1
_CANONICAL_TAG = 1 << 40  # seeds of canonical shards, unrelated to the default order's (seed, epoch, node)


def is_int(value: object) -> bool:
    """An integer, Python's or numpy's (as torch's DistributedSampler accepts), but not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def mix_seed(*values: int) -> int:
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


def strided_shard(n: int, world: int, first: int, count: int) -> torch.Tensor:
    """Items ``x`` in ``[0, n)`` with ``first <= x % world < first + count``, ascending.

    With ``count == 1`` this is rank ``first``'s shard ``first, first + world, ...``; with ``count ==
    local_world_size`` it is the union of the shards of one node's ranks.
    """
    starts = torch.arange(0, n, world, dtype=torch.int64)
    idx = (starts[:, None] + torch.arange(first, first + count, dtype=torch.int64)[None, :]).reshape(-1)
    return idx[idx < n]


def fit_to_length(shard: torch.Tensor, length: int, epoch: int, n: int, group: int) -> torch.Tensor:
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


@dataclass(frozen=True)
class EpochSpec:
    """What an epoch's order depends on, apart from the layout: the same for every segment of one epoch."""

    n: int
    seed: int
    epoch: int
    shuffle: bool
    drop_last: bool
    even_divisible: bool
    canonical: int | None


def order_group(local_world_size: int, shard_by: str, shuffle: bool, canonical: int | None) -> int:
    """Ranks that share one shuffled shard: the node's in node mode with ``shuffle``, else 1 (a rank's own)."""
    return local_world_size if shard_by == "node" and shuffle and canonical is None else 1


def rank_length(spec: EpochSpec, world: int, rank: int) -> int:
    """Indices rank ``rank`` yields in a full epoch: torch's ``ceil`` / ``floor``, or its whole shard."""
    if not spec.even_divisible:
        return len(range(rank, spec.n, world))
    return spec.n // world if spec.drop_last else math.ceil(spec.n / world)


def canonical_sequence(n: int, canonical: int, seed: int, epoch: int, shuffle: bool) -> torch.Tensor:
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
            gen.manual_seed(mix_seed(seed, epoch, c, _CANONICAL_TAG))
            shard = shard[torch.randperm(int(shard.numel()), generator=gen)]
        grid[c, : shard.numel()] = shard
    seq = grid.t().reshape(-1)
    return seq[seq >= 0]


def rank_epoch_indices(spec: EpochSpec, world: int, group: int, rank: int) -> list[int]:
    """All indices rank ``rank`` yields in a full epoch: a pure function of the spec and the layout."""
    n = spec.n
    length = rank_length(spec, world, rank)
    if spec.canonical is not None:
        own = canonical_sequence(n, spec.canonical, spec.seed, spec.epoch, spec.shuffle)[rank::world]
        size = int(own.numel())
        if length <= size:
            return cast(list[int], own[:length].tolist())
        if size == 0:  # fewer items than ranks: borrow a rotating window, as the default order does
            return cast(list[int], ((torch.arange(length) + (rank + spec.epoch) * length) % n).tolist())
        return cast(list[int], torch.cat([own, own[torch.arange(length - size) % size]]).tolist())
    node, local = divmod(rank, group)
    shard = strided_shard(n, world, node * group, group)
    if spec.even_divisible:
        seq = fit_to_length(shard, group * length, spec.epoch, n, node)
        lo = local * length
        hi = lo + length
    else:
        seq = shard
        sizes = [len(range(node * group + j, n, world)) for j in range(group)]
        lo = sum(sizes[:local])
        hi = lo + sizes[local]
    if spec.shuffle:
        gen = torch.Generator()
        gen.manual_seed(mix_seed(spec.seed, spec.epoch, node))
        seq = seq[torch.randperm(int(seq.numel()), generator=gen)]
    return cast(list[int], seq[lo:hi].tolist())
