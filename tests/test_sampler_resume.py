"""Resuming an epoch on another layout, the world-size-independent order, and refused states (in process).

Ranks are simulated by argument: the resume arithmetic is a pure function of the state and the new layout, so
hypothesis can try any dataset length, old and new layout and step. The same paths with real gloo ranks are in
tests/test_sampler_distributed.py.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from monai_cache.sampler import ShardedDistributedSampler

PROPERTY = settings(max_examples=100, deadline=None)


@st.composite
def layout(draw, n: int, nodes: bool = False) -> tuple[int, str, int]:
    """(world, shard_by, local_world_size) for a dataset of ``n`` items; ``nodes``: two or more nodes of two or
    more ranks each (with shuffle, where a node's items are not any one rank's: locality by node shows)."""
    if nodes:
        world = draw(st.sampled_from([4, 6, 8]))
        return world, "node", draw(st.sampled_from([d for d in range(2, world) if world % d == 0]))
    world = draw(st.integers(1, 8))
    shard_by = draw(st.sampled_from(["rank", "node"]))
    lws = draw(st.sampled_from([d for d in range(1, world + 1) if world % d == 0])) if shard_by == "node" else 1
    return world, shard_by, lws


def make(n, lay, **kw) -> list[ShardedDistributedSampler]:
    world, shard_by, lws = lay
    return [
        ShardedDistributedSampler(range(n), world, r, shard_by=shard_by, local_world_size=lws, **kw)
        for r in range(world)
    ]


def owners(new: list[ShardedDistributedSampler], epoch: int) -> tuple[dict[int, int], int]:
    """Each item's owner in ``new``'s layout (the rank, or node, whose cache keeps it), and the ranks per owner.

    The owner's ranks are those that read the item in a full epoch of the layout (the next one, not the resumed
    one), read without pads or drops so that each item is read once: over one item per rank at least, as an
    item's owner does not depend on how many items follow it."""
    s, n = new[0], new[0]._dataset_len
    group = s._group_size_for_order()  # ranks that share one shard: a node's with shuffle, else one
    plain = make(max(n, s.num_replicas), (s.num_replicas, s.shard_by, s.local_world_size), seed=s.seed,
                 shuffle=s.shuffle, canonical_shards=s.canonical_shards, even_divisible=False)  # fmt: skip
    found = {x: r // group for r, p in enumerate(plain) for x in p.indices_for_epoch(epoch) if x < n}
    assert sorted(found) == list(range(n))
    return found, group


def read(samplers, counts) -> list[list[int]]:
    """Each sampler yields its first ``counts[r]`` indices (a pass cut short by a crash)."""
    out = []
    for s, c in zip(samplers, counts):
        it = iter(s)
        out.append([next(it) for _ in range(c)])
    return out


def check_rest(
    before: list[int], epoch_set: set[int], new: list[ShardedDistributedSampler], kw: dict, epoch: int
) -> list[int]:
    """The rest of the epoch on ``new``: each remaining item once (plus torch's pad / drop), balanced, local."""
    remaining = epoch_set - set(before)
    rest = [list(s) for s in new]
    flat = [x for r in rest for x in r]
    world, R = len(new), len(remaining)
    assert not set(flat) & set(before), "an item read before the crash was read again"
    if kw["even_divisible"]:
        m = R // world if kw["drop_last"] else math.ceil(R / world)
        assert [len(r) for r in rest] == [m] * world  # balanced: per-step collectives never wait
        if kw["drop_last"]:
            assert set(flat) <= remaining and len(set(flat)) == len(flat) == world * m  # < world left out
        else:
            assert set(flat) == remaining  # every remaining item, each once plus world * m - R pads
            assert len(flat) - len(set(flat)) == world * m - R
    else:
        assert sorted(flat) == sorted(remaining)  # exactly once, no pad
        assert max(map(len, rest)) - min(map(len, rest)) <= 1
    # locality: an item leaves its owner (the rank / node whose cache keeps it from now on) only to balance the
    # ranks, and no more of them than the imbalance forces
    owner, group = owners(new, epoch + 1)
    have, share = Counter(owner[x] for x in remaining), Counter()
    for r, lst in enumerate(rest):
        share[r // group] += len(lst)
    surplus = sum(max(0, have[o] - share[o]) for o in range(world // group))
    deficit = sum(max(0, share[o] - have[o]) for o in range(world // group))
    moved = {x for r, lst in enumerate(rest) for x in lst if owner[x] != r // group} - {
        x for r, lst in enumerate(rest) for x in lst if owner[x] == r // group
    }
    assert len(moved) == min(surplus, deficit)
    return flat


def same_layout(a: ShardedDistributedSampler, b: ShardedDistributedSampler) -> bool:
    return (a.num_replicas, a._group_size_for_order()) == (b.num_replicas, b._group_size_for_order())


def saved(samplers: list[ShardedDistributedSampler]) -> dict:
    """What the usual code saves: rank 0's state (lockstep), or every rank's count where the lengths differ."""
    if samplers[0].even_divisible:
        return samplers[0].state_dict()
    return ShardedDistributedSampler.merge_states([s.state_dict() for s in reversed(samplers)])


def resume(state, prev, prev_rest, counts, new, before, epoch_set, kw) -> list[int]:
    """Load ``state`` (saved on ``prev`` after ``counts``) into ``new``; check the rest; return its reads."""
    epoch = state["epoch"]
    for s in new:
        s.load_state_dict(state)
        s.set_epoch(epoch)  # the usual loop sets the epoch again: the resume position is kept
    if same_layout(prev[0], new[0]):  # the same layout: exactly on from each rank's position (pads included)
        rest = [list(s) for s in new]
        assert rest == [r[c:] for r, c in zip(prev_rest, counts)]
        flat = [x for r in rest for x in r]
    else:
        flat = check_rest(before, epoch_set, new, kw, epoch)
    for s in new:  # ready to be read again
        s.load_state_dict(state)
        s.set_epoch(epoch)
    return flat


@PROPERTY
@given(st.data())
def test_resume_on_any_layout_finishes_the_epoch_exactly_once(data):
    n = data.draw(st.integers(1, 60), "n")
    # most draws resume onto two or more nodes, shuffled, in the shard-local order: where an item's node shows
    nodes = data.draw(st.sampled_from([True, True, True, False]), "onto_nodes")
    old_l, new_l, third_l = (data.draw(layout(n, nodes and name == "new"), name) for name in ("old", "new", "third"))
    even = data.draw(st.booleans(), "even_divisible") or n < max(old_l[0], new_l[0], third_l[0])
    drop_last = even and data.draw(st.booleans(), "drop_last") and n >= max(old_l[0], new_l[0], third_l[0])
    # 840: every world size 1..8 divides it (the canonical order's own tests use small ones)
    canonical = None if nodes else data.draw(st.sampled_from([None, None, 840]), "canonical_shards")
    kw = dict(shuffle=nodes or data.draw(st.booleans(), "shuffle"), drop_last=drop_last, even_divisible=even, seed=5,
              canonical_shards=canonical)  # fmt: skip
    epoch = data.draw(st.integers(0, 50), "epoch")
    old = make(n, old_l, **kw)
    for s in old:
        s.set_epoch(epoch)
    full = [s.indices_for_epoch(epoch) for s in old]
    epoch_set = {x for r in full for x in r}
    k = data.draw(st.integers(1, max(map(len, full))), "k")  # k = 0 is an epoch boundary: the new layout's epoch
    counts = [min(k, len(r)) for r in full]  # ranks in lockstep; a short rank (even_divisible=False) has ended
    before = [x for r in read(old, counts) for x in r]
    state = saved(old)
    new = make(n, new_l, **kw)
    flat = resume(state, old, full, counts, new, before, epoch_set, kw)
    assert set(before) | set(flat) == epoch_set or drop_last  # drop_last: < new world items left out
    # the next epoch is the normal epoch of the new layout
    for s in new:
        s.set_epoch(epoch + 1)
        assert list(s) == s.indices_for_epoch(epoch + 1)
        s.load_state_dict(state)
        s.set_epoch(epoch)

    # crash again in the resumed epoch, and resume on a third layout
    plans = [list(s) for s in new]
    for s in new:
        s.load_state_dict(state)
    k2 = data.draw(st.integers(0, max(map(len, plans))), "k2")
    counts2 = [min(k2, len(p)) for p in plans]
    before += [x for r in read(new, counts2) for x in r]
    epoch_set = epoch_set if not drop_last else set(before) | set(flat)
    if same_layout(old[0], new[0]):  # the positions go on counting from the start of the epoch
        plans, counts2 = full, [c + c2 for c, c2 in zip(counts, counts2)]
    flat3 = resume(saved(new), new, plans, counts2, make(n, third_l, **kw), before, epoch_set, kw)
    assert set(before) | set(flat3) == epoch_set or drop_last


@pytest.mark.parametrize(
    "old_l, new_l",
    [
        ((4, "rank", 1), (6, "node", 2)),  # 4 ranks -> 3 nodes of 2
        ((6, "node", 3), (8, "node", 4)),  # 2 nodes of 3 -> 2 nodes of 4
        ((2, "node", 2), (8, "node", 2)),  # 1 node -> 4 nodes of 2
        ((8, "node", 4), (6, "node", 2)),  # 2 nodes of 4 -> 3 nodes of 2
        ((8, "node", 2), (4, "node", 2)),  # 4 nodes of 2 -> 2 nodes of 2: nested
    ],
)
@pytest.mark.parametrize("even, drop_last", [(True, False), (True, True), (False, False)])
def test_resume_onto_several_nodes_gives_each_node_its_own_items(old_l, new_l, even, drop_last):
    """Explicit examples of what the property test above draws most: resumed onto two or more nodes of two or more
    ranks, shuffled, an item leaves its node only to balance the ranks (``check_rest``)."""
    n, epoch, steps = 47, 2, 3
    kw = dict(shuffle=True, drop_last=drop_last, even_divisible=even, seed=3, canonical_shards=None)
    old = make(n, old_l, **kw)
    full = [s.indices_for_epoch(epoch) for s in old]
    for s in old:
        s.set_epoch(epoch)
    counts = [min(steps, len(r)) for r in full]
    before = [x for r in read(old, counts) for x in r]
    epoch_set = {x for r in full for x in r}
    flat = resume(saved(old), old, full, counts, make(n, new_l, **kw), before, epoch_set, kw)
    assert set(before) | set(flat) == epoch_set or drop_last


def test_a_node_keeps_its_items_when_the_layouts_nest():
    # 4 nodes of 2 ranks; nodes 2 and 3 are lost after 3 steps, the job comes back as 2 nodes of 2 ranks. Old
    # nodes 0 and 2 hold what new node 0 owns, 1 and 3 what node 1 owns, and they read alike: no item moves.
    n, kw = 40, dict(shuffle=True, seed=3, shard_by="node", local_world_size=2)
    old = [ShardedDistributedSampler(range(n), 8, r, **kw) for r in range(8)]
    before = read(old, [3] * 8)
    state = old[0].state_dict()
    new = [ShardedDistributedSampler(range(n), 4, r, **kw) for r in range(4)]
    for s in new:
        s.load_state_dict(state)
    rest = [list(s) for s in new]
    assert sorted(x for lst in before + rest for x in lst) == list(range(n))
    assert [len(r) for r in rest] == [4] * 4
    owner, group = owners(new, 1)
    assert group == 2 and all(owner[x] == r // 2 for r, lst in enumerate(rest) for x in lst)
    # 4 ranks -> 2 ranks by rank: old ranks 0 and 2 become new rank 0 (x % 2 == 0): no item moves
    old = [ShardedDistributedSampler(range(n), 4, r, seed=3) for r in range(4)]
    read(old, [4] * 4)
    new = [ShardedDistributedSampler(range(n), 2, r, seed=3) for r in range(2)]
    for s in new:
        s.load_state_dict(old[0].state_dict())
    rest = [list(s) for s in new]
    owner, _ = owners(new, 1)
    assert all(owner[x] == r for r, lst in enumerate(rest) for x in lst) and [len(r) for r in rest] == [12, 12]


def test_explicit_consumed_and_the_state_round_trip():
    old = [ShardedDistributedSampler(range(50), 3, r, seed=1) for r in range(3)]
    for s in old:
        s.set_epoch(2)
    state = old[0].state_dict(consumed=8)  # e.g. batches_done * batch_size with DataLoader workers
    assert state["version"] == 2 and state["rank"] == 0 and "resumed_from" not in state
    new = [ShardedDistributedSampler(range(50), 2, r, seed=1) for r in range(2)]
    for s in new:
        s.load_state_dict(state)
        assert s.epoch == 2 and len(s) == 13  # ceil((50 - 3 * 8) / 2)
    rest = [list(s) for s in new]
    assert {x for lst in rest for x in lst} == set(range(50)) - {x for s in old for x in s.indices_for_epoch(2)[:8]}
    # the state of a resumed epoch records the layouts before it, in plain data
    assert list(new[1]) == new[1].indices_for_epoch(2)  # a pass after the resumed one is a full epoch again
    new[1].load_state_dict(state)
    it = iter(new[1])
    next(it)
    resumed = new[1].state_dict()
    assert resumed["resumed_from"] == [
        {"num_replicas": 3, "shard_by": "rank", "local_world_size": 1, "consumed_by_rank": [8, 8, 8]}
    ]
    again = ShardedDistributedSampler(range(50), 2, 1, seed=1)
    again.load_state_dict(resumed)
    assert list(again) == rest[1][1:]


# ----------------------------------------------------------------------------- the world-size-independent order


def global_order(samplers) -> list[int]:
    """The epoch as one sequence: step j of rank r is global position ``j * world + r`` (torch's dealing)."""
    world = len(samplers)
    lists = [list(s) for s in samplers]
    out = []
    for j in range(max(map(len, lists))):
        out += [lists[r][j] for r in range(world) if j < len(lists[r])]
    return out


@PROPERTY
@given(
    st.integers(2, 80), st.sampled_from([2, 4, 6, 8, 12, 24]), st.integers(0, 20), st.booleans(), st.booleans(),
    st.booleans(),
)  # fmt: skip
def test_canonical_order_is_the_same_on_every_world_size(n, canonical, epoch, shuffle, drop_last, even):
    drop_last = drop_last and even
    orders = {}
    # world 1 and at least world 2 (canonical is even, n >= 2): never world 1 compared with itself alone
    worlds = [w for w in (1, 2, 3, 4, 6, 8) if canonical % w == 0 and (n >= w or (even and not drop_last))]
    assert len(worlds) > 1
    for world in worlds:
        ss = [
            ShardedDistributedSampler(range(n), world, r, seed=9, shuffle=shuffle, drop_last=drop_last,
                                      even_divisible=even, canonical_shards=canonical)
            for r in range(world)
        ]  # fmt: skip
        for s in ss:
            s.set_epoch(epoch)
        order = global_order(ss)
        cut = n - n % world if drop_last else n
        orders[world] = order[:cut]
        assert sorted(order[:n]) == list(range(n)) or drop_last  # the first n positions are the epoch
        if n >= world:  # every rank reads its default rank shard only: its cache hits from epoch 1
            assert all(x % world == r for r, s in enumerate(ss) for x in s)
    reference = orders[1]
    for world, order in orders.items():
        assert order == reference[: len(order)], f"world {world} reads another order than world 1"


def test_canonical_order_changes_with_epoch_and_seed_and_resumes_in_order():
    def sampler(world, rank, seed=0):
        return ShardedDistributedSampler(range(96), world, rank, seed=seed, canonical_shards=8)

    one = sampler(1, 0)
    assert one.indices_for_epoch(0) != one.indices_for_epoch(1) != sampler(1, 0, seed=1).indices_for_epoch(1)
    # 4 ranks, 5 steps of 2 per rank, then the job comes back on 2 ranks: the global order goes on unchanged
    old = [sampler(4, r) for r in range(4)]
    before = [[next(it) for _ in range(10)] for it in map(iter, old)]
    new = [sampler(2, r) for r in range(2)]
    for s in new:
        s.load_state_dict(old[0].state_dict())
    interleaved = [before[r][j] for j in range(10) for r in range(4)] + global_order(new)
    assert interleaved == one.indices_for_epoch(0)


# ----------------------------------------------------------------------------- refused states


def test_states_from_another_run_or_corrupt_are_refused_with_the_field():
    s = ShardedDistributedSampler(range(30), 3, 0, seed=4)
    s.set_epoch(2)
    state = s.state_dict(consumed=5)
    fresh = ShardedDistributedSampler(range(30), 2, 0, seed=4)

    def refused(bad, *patterns):
        with pytest.raises(ValueError) as e:
            fresh.load_state_dict(bad)
        for pattern in patterns:
            assert pattern in str(e.value), str(e.value)
        assert fresh.epoch == 0 and len(fresh) == 15  # nothing was loaded

    refused({**state, "dataset_len": 31}, "31 items", "dataset_len differs", "same data list")
    refused({**state, "seed": 7}, "seed=7", "seed differs", "Build the sampler with seed=7")
    refused({**state, "consumed": 0, "seed": 7}, "seed differs")  # an epoch boundary too: the order depends on it
    refused({**state, "shuffle": False}, "shuffle=False", "shuffle differs", "epoch boundary")
    refused({**state, "canonical_shards": 6}, "canonical_shards differs")
    refused({**state, "consumed": "5"}, "state_dict['consumed'] must be an int")
    refused({**state, "consumed": 11}, "consumed 11 indices, but yields 10")
    refused({**state, "version": 3}, "newer monai_cache")
    refused({k: v for k, v in state.items() if k != "num_replicas"}, "no 'num_replicas'", "corrupt")
    refused({**state, "local_world_size": 2}, "local_world_size=2 does not divide num_replicas=3")
    refused({**state, "consumed_by_rank": [5, 5]}, "consumed_by_rank=[5, 5] is not 3 counts")
    refused({**state, "consumed": 0, "consumed_by_rank": 5}, "consumed_by_rank=5 is not 3 counts")
    refused({**state, "resumed_from": [{"num_replicas": 2}]}, "resumed_from'][0] has no 'shard_by'")
    refused([1, 2], "got list")
    # even_divisible=False: one rank's count does not tell what the others had read
    short = ShardedDistributedSampler(range(31), 3, 0, seed=4, even_divisible=False)
    with pytest.raises(ValueError, match=r"gather=True.*merge_states"):
        ShardedDistributedSampler(range(31), 2, 0, seed=4, even_divisible=False).load_state_dict(
            short.state_dict(consumed=3)
        )


def test_merge_states_and_gather_errors():
    ss = [ShardedDistributedSampler(range(30), 3, r, seed=4) for r in range(3)]
    boundary = ShardedDistributedSampler.merge_states([s.state_dict() for s in ss])  # nothing read yet
    other = ShardedDistributedSampler(range(30), 2, 1, seed=4)
    other.load_state_dict(boundary)
    assert list(other) == other.indices_for_epoch(0)  # the full epoch of the new layout
    states = [s.state_dict(consumed=c) for s, c in zip(ss, (4, 5, 4))]
    merged = ShardedDistributedSampler.merge_states(states[::-1])
    assert merged["consumed_by_rank"] == [4, 5, 4] and merged["rank"] == 0
    with pytest.raises(ValueError, match=r"every rank 0..3-1.*got ranks \[0, 2\]"):
        ShardedDistributedSampler.merge_states([states[0], states[2]])
    with pytest.raises(ValueError, match="twice"):
        ShardedDistributedSampler.merge_states([states[0], states[0]])
    ss[1].set_epoch(1)
    with pytest.raises(ValueError, match=r"ranks 0 and 1 differ in \['epoch'\]"):
        ShardedDistributedSampler.merge_states([states[0], ss[1].state_dict(), states[2]])
    with pytest.raises(ValueError, match="process group"):
        ss[0].state_dict(gather=True)
    with pytest.raises(ValueError, match=r"num_replicas=3 does not divide canonical_shards=8"):
        ShardedDistributedSampler(range(30), 3, 0, canonical_shards=8)
