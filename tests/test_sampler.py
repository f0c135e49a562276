"""Property and unit tests of ShardedDistributedSampler (single process; ranks simulated by argument)."""

from __future__ import annotations

import functools
import math
import os
import socket
from collections import Counter

import pytest
import torch
from helpers import as_slurm_task, without_launcher
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, DistributedSampler

from monai_cache.runtime import node_identity as _node_identity
from monai_cache.sampler import ShardedDistributedSampler, _local_world_size_from_identities

FAST = settings(max_examples=100, deadline=None)


@st.composite
def layouts(draw, min_per_rank: int = 0, max_len: int = 48):
    """(n, world, mode, local_world_size) with local_world_size dividing world; n >= min_per_rank * world."""
    world = draw(st.integers(1, 8))
    mode = draw(st.sampled_from(["rank", "node"]))
    lws = draw(st.sampled_from([d for d in range(1, world + 1) if world % d == 0])) if mode == "node" else 1
    n = draw(st.integers(max(1, min_per_rank * world), max(max_len, min_per_rank * world)))
    return n, world, mode, lws


def samplers(n, world, mode, lws, **kw):
    return [
        ShardedDistributedSampler(range(n), world, r, shard_by=mode, local_world_size=lws, **kw) for r in range(world)
    ]


def epoch_reads(ss, epoch):
    out = []
    for s in ss:
        s.set_epoch(epoch)
        out.append(list(s))
    return out


def owner_groups(world, lws):
    """Groups of ranks that share a shard: single ranks, or the ranks of one node."""
    return [list(range(g, g + lws)) for g in range(0, world, lws)]


# ----------------------------------------------------------------------------- lengths / coverage


@FAST
@given(layouts(), st.integers(0, 10_000), st.booleans(), st.booleans())
def test_equal_lengths_match_torch(layout, epoch, drop_last, shuffle):
    n, world, mode, lws = layout
    assume(not (drop_last and n < world))
    ss = samplers(n, world, mode, lws, drop_last=drop_last, shuffle=shuffle)
    reads = epoch_reads(ss, epoch)
    expected = n // world if drop_last else math.ceil(n / world)
    assert {len(r) for r in reads} == {expected}
    assert all(len(s) == expected for s in ss)
    # same per-rank length as torch's sampler, so it is a drop-in for the number of steps
    assert expected == len(DistributedSampler(range(n), world, 0, drop_last=drop_last))
    assert all(0 <= i < n for r in reads for i in r)


@FAST
@given(layouts(), st.integers(0, 10_000), st.booleans(), st.booleans())
def test_every_epoch_covers_the_dataset(layout, epoch, drop_last, shuffle):
    n, world, mode, lws = layout
    assume(not (drop_last and n < world))
    reads = epoch_reads(samplers(n, world, mode, lws, drop_last=drop_last, shuffle=shuffle), epoch)
    counts = Counter(i for r in reads for i in r)
    if drop_last:
        # nothing is read twice; exactly n % world items are left out this epoch
        assert max(counts.values()) == 1
        assert len(counts) == n - n % world
    else:
        # every item is read; the extra reads are the padding
        assert set(counts) == set(range(n))
        assert sum(counts.values()) - n == world * math.ceil(n / world) - n


@FAST
@given(layouts(), st.integers(0, 10_000), st.booleans())
def test_even_divisible_false_reads_each_item_once(layout, epoch, shuffle):
    n, world, mode, lws = layout
    assume(n >= world)
    ss = samplers(n, world, mode, lws, shuffle=shuffle, even_divisible=False)
    reads = epoch_reads(ss, epoch)
    assert sorted(i for r in reads for i in r) == list(range(n))
    lengths = [len(r) for r in reads]
    assert lengths == [len(s) for s in ss]
    # MONAI's meaning: the first n % world ranks get one more item
    assert lengths == [n // world + (r < n % world) for r in range(world)]


def test_even_divisible_false_matches_monai():
    from monai.data import DistributedSampler as MonaiDistributedSampler

    # MONAI's docstring example: 5 items on 2 ranks -> [1, 3, 5] and [2, 4] (1-based)
    got = [list(ShardedDistributedSampler(range(5), 2, r, shuffle=False, even_divisible=False)) for r in range(2)]
    assert got == [[0, 2, 4], [1, 3]]
    for n, world in [(5, 2), (10, 3), (7, 7), (23, 4)]:
        for r in range(world):
            ours = ShardedDistributedSampler(range(n), world, r, shuffle=False, even_divisible=False)
            theirs = MonaiDistributedSampler(range(n), even_divisible=False, num_replicas=world, rank=r, shuffle=False)
            assert list(ours) == list(theirs)
            assert len(ours) == len(theirs)


# ----------------------------------------------------------------------------- fixed shards


@FAST
@given(layouts(), st.integers(0, 10_000), st.booleans(), st.booleans())
def test_shards_are_fixed_and_disjoint(layout, epoch, drop_last, shuffle):
    """Whatever an owner (rank, or node) reads over several epochs stays in its shard; shards partition the data."""
    n, world, mode, lws = layout
    assume(n >= world)
    ss = samplers(n, world, mode, lws, drop_last=drop_last, shuffle=shuffle)
    shards = [set(ss[grp[0]].shard_indices()) for grp in owner_groups(world, lws)]
    assert sum(len(s) for s in shards) == n
    assert set().union(*shards) == set(range(n))
    for grp in owner_groups(world, lws):
        assert all(ss[r].shard_indices() == ss[grp[0]].shard_indices() for r in grp)
    for e in range(epoch, epoch + 4):
        reads = epoch_reads(ss, e)
        for grp, shard in zip(owner_groups(world, lws), shards):
            assert {i for r in grp for i in reads[r]} <= shard, "a read left the owner's shard"


@FAST
@given(layouts(min_per_rank=2), st.integers(0, 10_000), st.booleans(), st.booleans())
def test_pads_and_drops_rotate(layout, start, drop_last, shuffle):
    """Over enough epochs every item is seen, and no item is duplicated in every epoch.

    "Enough" is the size of the largest shard (the pad / drop window moves one shard length per that many epochs).
    """
    n, world, mode, lws = layout
    ss = samplers(n, world, mode, lws, drop_last=drop_last, shuffle=shuffle)
    window = max(len(ss[grp[0]].shard_indices()) for grp in owner_groups(world, lws))
    seen: set[int] = set()
    duplicated_every_epoch = set(range(n))
    for e in range(start, start + window):
        counts = Counter(i for r in epoch_reads(ss, e) for i in r)
        seen |= set(counts)
        duplicated_every_epoch &= {i for i, c in counts.items() if c > 1}
    assert seen == set(range(n))
    assert not duplicated_every_epoch


@pytest.mark.parametrize("drop_last", [False, True])
def test_rotation_is_exact_per_rank(drop_last):
    """Rank mode, shard size s: within any s consecutive epochs each item is padded / left out exactly once."""
    n, world = 23, 4  # shards of 6, 6, 6, 5
    ss = samplers(n, world, "rank", 1, drop_last=drop_last)
    for r, s in enumerate(ss):
        shard = s.shard_indices()
        per_item = Counter()
        for e in range(7, 7 + len(shard)):
            s.set_epoch(e)
            c = Counter(s)
            for i in shard:
                per_item[i] += (c[i] == 2) if not drop_last else (c[i] == 0)
        odd_one = (len(shard) == 5) if not drop_last else (len(shard) == 6)
        assert set(per_item.values()) == ({1} if odd_one else {0}), (r, per_item)


def test_pads_stay_in_the_shard_and_change_between_epochs():
    n, world = 10, 4  # shards of 3, 3, 2, 2: two pads per epoch
    ours = samplers(n, world, "rank", 1)
    for e in range(6):
        for s in ours:
            s.set_epoch(e)
            assert set(s) <= set(s.shard_indices())
    pads = []
    for e in range(6):
        counts = Counter(i for r in epoch_reads(ours, e) for i in r)
        pads.append(frozenset(i for i, c in counts.items() if c > 1))
    assert len(set(pads)) > 1


# ----------------------------------------------------------------------------- shuffle=False, determinism


@FAST
@given(layouts(), st.integers(0, 10_000), st.booleans(), st.integers(0, 2**31))
def test_shuffle_false_reads_the_training_shard_in_order(layout, epoch, drop_last, seed):
    n, world, mode, lws = layout
    assume(n >= world and not (drop_last and n < world))
    train = samplers(n, world, mode, lws, drop_last=drop_last, seed=seed)
    val = samplers(n, world, mode, lws, drop_last=drop_last, shuffle=False)
    for r in range(world):
        val[r].set_epoch(epoch)
        seq = list(val[r])
        distinct = len(set(seq))
        head, tail = seq[:distinct], seq[distinct:]
        assert head == sorted(set(seq)), "shuffle=False must yield the shard in ascending order"
        assert set(tail) <= set(head), "padding must repeat items of the rank's own shard"
        # the rank's validation items belong to the shard it trains on (its own, or its node's)
        assert set(seq) <= set(train[r].shard_indices())
        # and are exactly its rank-mode shard (minus this epoch's left-out item, if any)
        own = set(range(r, n, world))
        assert set(seq) <= own and len(own - set(seq)) <= 1


@FAST
@given(st.integers(1, 12), st.integers(1, 6), st.booleans())
def test_shuffle_false_equals_torch_when_divisible(per_rank, world, drop_last):
    n = per_rank * world
    for r in range(world):
        ours = ShardedDistributedSampler(range(n), world, r, shuffle=False, drop_last=drop_last)
        theirs = DistributedSampler(range(n), world, r, shuffle=False, drop_last=drop_last)
        assert list(ours) == list(theirs)


def test_rank_mode_training_shard_equals_validation_shard():
    n, world = 37, 3
    for r in range(world):
        train = ShardedDistributedSampler(range(n), world, r, seed=5)
        val = ShardedDistributedSampler(range(n), world, r, shuffle=False)
        seen = set()
        for e in range(20):
            train.set_epoch(e)
            seen |= set(train)
        assert seen == set(val) == set(train.shard_indices())


@FAST
@given(layouts(), st.integers(0, 10_000), st.booleans(), st.integers(0, 2**40))
def test_pure_function_of_seed_epoch_rank(layout, epoch, drop_last, seed):
    n, world, mode, lws = layout
    assume(not (drop_last and n < world))
    state = torch.get_rng_state()
    torch.manual_seed(1)
    a = epoch_reads(samplers(n, world, mode, lws, drop_last=drop_last, seed=seed), epoch)
    torch.manual_seed(2)  # the global RNG must not matter ...
    b = epoch_reads(samplers(n, world, mode, lws, drop_last=drop_last, seed=seed), epoch)
    assert a == b
    rng_after = torch.get_rng_state()
    torch.manual_seed(2)
    assert torch.equal(rng_after, torch.get_rng_state())  # ... nor be consumed
    torch.set_rng_state(state)
    # and the instance's history does not matter either
    s = ShardedDistributedSampler(range(n), world, world - 1, seed=seed, drop_last=drop_last, shard_by=mode,
                                  local_world_size=lws)  # fmt: skip
    s.set_epoch(epoch + 3)
    list(s)
    s.set_epoch(epoch)
    assert list(s) == a[world - 1] == s.indices_for_epoch(epoch)


def test_order_changes_with_epoch_and_seed():
    s = ShardedDistributedSampler(range(200), 2, 1, seed=3)
    orders = {tuple(s.indices_for_epoch(e)) for e in range(6)}
    assert len(orders) == 6
    assert len({frozenset(o) for o in orders}) == 1  # same items, new order
    other = ShardedDistributedSampler(range(200), 2, 1, seed=4)
    assert other.indices_for_epoch(0) != s.indices_for_epoch(0)
    # different shards get unrelated orders, not the same permutation shifted
    r0 = ShardedDistributedSampler(range(200), 2, 0, seed=3).indices_for_epoch(0)
    assert [i // 2 for i in r0] != [i // 2 for i in s.indices_for_epoch(0)]


# ----------------------------------------------------------------------------- node mode


def test_node_mode_redeals_within_the_node():
    n, world, lws = 64, 4, 2
    ss = samplers(n, world, "node", lws)
    node_shards = [set(ss[0].shard_indices()), set(ss[2].shard_indices())]
    assert node_shards[0] == set(range(0, n, 4)) | set(range(1, n, 4))  # union of ranks 0 and 1's shards
    rank_sets = set()
    for e in range(5):
        reads = epoch_reads(ss, e)
        assert set(reads[0]) | set(reads[1]) == node_shards[0]
        assert set(reads[2]) | set(reads[3]) == node_shards[1]
        rank_sets.add(frozenset(reads[0]))
    assert len(rank_sets) == 5, "a rank of a node must get a different part of the node shard each epoch"


def test_node_mode_with_one_rank_per_node_is_rank_mode():
    for r in range(3):
        a = ShardedDistributedSampler(range(29), 3, r, seed=7, shard_by="node", local_world_size=1)
        b = ShardedDistributedSampler(range(29), 3, r, seed=7)
        for e in range(4):
            assert a.indices_for_epoch(e) == b.indices_for_epoch(e)


def _no_launcher(monkeypatch) -> None:
    for name in set(os.environ) - set(without_launcher(os.environ)):
        monkeypatch.delenv(name)


def test_node_mode_reads_local_world_size_from_env(monkeypatch):
    _no_launcher(monkeypatch)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    s = ShardedDistributedSampler(range(20), 4, 3, shard_by="node")
    assert (s.local_world_size, s.node_rank, s.local_rank) == (2, 1, 1)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    with pytest.raises(ValueError, match="local_world_size"):
        ShardedDistributedSampler(range(20), 4, 3, shard_by="node")


def test_node_mode_without_local_world_size_names_every_way_to_give_it(monkeypatch):
    _no_launcher(monkeypatch)
    with pytest.raises(ValueError) as info:  # the reproduction: no launcher variable, no process group
        ShardedDistributedSampler(range(8), num_replicas=2, rank=0, shard_by="node")
    message = str(info.value)
    assert "local_world_size=" in message and "init_process_group" in message and "torchrun" in message


def test_layout_from_machine_identities():
    assert _local_world_size_from_identities(["a"] * 3) == 3  # one machine
    assert _local_world_size_from_identities(["a", "a", "b", "b", "c", "c"]) == 2
    assert _local_world_size_from_identities(["a", "b", "c"]) == 1  # one rank per machine
    with pytest.raises(ValueError, match=r"same number of ranks on every machine, but found a: ranks \[0, 1\]; b: "):
        _local_world_size_from_identities(["a", "a", "b"])
    with pytest.raises(ValueError, match=r"numbered contiguously \(node = rank // 2\), but found b: ranks \[0, 3\]; "):
        _local_world_size_from_identities(["b", "a", "a", "b"])


def test_machine_identity_is_the_host_unless_overridden(monkeypatch):
    monkeypatch.delenv("MONAI_CACHE_NODE_ID", raising=False)
    assert _node_identity().startswith(socket.gethostname())
    monkeypatch.setenv("MONAI_CACHE_NODE_ID", "rack3-node7")
    assert _node_identity() == "rack3-node7"


def test_node_mode_checks_torchrun_layout(monkeypatch, recwarn):
    _no_launcher(monkeypatch)
    # torchrun, 2 nodes x 2: rank 3 is node (GROUP_RANK) 1, LOCAL_RANK 1 -> consistent, no warning
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("GROUP_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    ShardedDistributedSampler(range(20), 4, 3, shard_by="node")
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]
    monkeypatch.setenv("GROUP_RANK", "0")  # a launcher that does not number ranks per node
    with pytest.warns(RuntimeWarning, match="GROUP_RANK=0"):
        ShardedDistributedSampler(range(20), 4, 3, shard_by="node")


def test_node_mode_from_slurm_without_torchrun_and_before_the_process_group(monkeypatch, recwarn):
    """A task that srun started, as Lightning's SLURMEnvironment leaves it (Slurm's variables only), building its
    sampler before init_process_group: the layout is Slurm's, and equal to the one given explicitly."""
    for rank in range(6):
        as_slurm_task(monkeypatch, rank, rank % 2, rank // 2, "2(x3)")
        s = ShardedDistributedSampler(range(29), 6, rank, seed=5, shard_by="node")
        assert (s.local_world_size, s.node_rank, s.local_rank) == (2, rank // 2, rank % 2)
        given = ShardedDistributedSampler(range(29), 6, rank, seed=5, shard_by="node", local_world_size=2)
        assert all(s.indices_for_epoch(e) == given.indices_for_epoch(e) for e in range(3))
    # SLURM_TASKS_PER_NODE alone (no step variables, no SLURM_NTASKS_PER_NODE): 4 nodes of 2
    as_slurm_task(monkeypatch, 5, 1, 2, "2(x4)")
    for name in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS_PER_NODE"):
        monkeypatch.delenv(name)
    assert ShardedDistributedSampler(range(29), 8, 5, shard_by="node").local_world_size == 2
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]


def test_node_mode_from_slurm_refuses_or_warns_where_it_cannot_hold(monkeypatch):
    # Slurm's tasks are not the sampler's ranks (another world size): the process group is asked, which is not there
    as_slurm_task(monkeypatch, 3, 1, 1, "2(x2)")
    with pytest.raises(ValueError, match="Slurm's variables describe task 3 of 4, not rank 3 of 8"):
        ShardedDistributedSampler(range(20), 8, 3, shard_by="node")
    # a different number of tasks on each node: node mode cannot hold, on every rank alike
    as_slurm_task(monkeypatch, 5, 1, 2, "4,2(x2)")
    with pytest.raises(ValueError, match=r"same number of ranks on every node, but SLURM_STEP_TASKS_PER_NODE='4,2"):
        ShardedDistributedSampler(range(20), 8, 5, shard_by="node")
    # a value that cannot be read: named
    monkeypatch.setenv("SLURM_STEP_TASKS_PER_NODE", "4;4")
    with pytest.raises(ValueError, match="SLURM_STEP_TASKS_PER_NODE='4;4' is not Slurm's tasks per node"):
        ShardedDistributedSampler(range(20), 8, 5, shard_by="node")
    # srun --distribution=cyclic: rank 1 is the first task of node 1, not rank // 2
    as_slurm_task(monkeypatch, 1, 0, 1, "2(x2)")
    with pytest.warns(RuntimeWarning, match="rank 1 has SLURM_LOCALID=0, SLURM_NODEID=1, but shard_by='node' assumes"):
        ShardedDistributedSampler(range(20), 4, 1, shard_by="node")


# ----------------------------------------------------------------------------- resume


@FAST
@given(layouts(), st.integers(0, 100), st.booleans(), st.booleans(), st.data())
def test_resume_mid_epoch(layout, epoch, drop_last, shuffle, data):
    n, world, mode, lws = layout
    assume(not (drop_last and n < world))
    rank = data.draw(st.integers(0, world - 1))
    kw = dict(shuffle=shuffle, drop_last=drop_last, shard_by=mode, local_world_size=lws, seed=11)
    first = ShardedDistributedSampler(range(n), world, rank, **kw)
    first.set_epoch(epoch)
    full = first.indices_for_epoch(epoch)
    k = data.draw(st.integers(0, len(full)))
    it = iter(first)
    got = [next(it) for _ in range(k)]
    state = first.state_dict()
    assert state["consumed"] == k and state["epoch"] == epoch

    resumed = ShardedDistributedSampler(range(n), world, rank, **kw)
    resumed.load_state_dict(state)
    resumed.set_epoch(epoch)  # the usual loop calls set_epoch again: must keep the position
    assert len(resumed) == len(full) - k
    rest = list(resumed)
    assert got + rest == full
    assert resumed.state_dict()["consumed"] == len(full)
    assert list(resumed) == full  # the next pass of the same epoch is a full one again
    resumed.load_state_dict(state)
    resumed.set_epoch(epoch + 1)  # moving on to another epoch drops the resume position
    assert list(resumed) == resumed.indices_for_epoch(epoch + 1)


def test_resume_through_dataloader():
    n, world, bs = 50, 2, 4
    ref = ShardedDistributedSampler(range(n), world, 1, seed=2)
    ref.set_epoch(3)
    expected = torch.cat(list(DataLoader(range(n), batch_size=bs, sampler=ref))).tolist()

    s = ShardedDistributedSampler(range(n), world, 1, seed=2)
    s.set_epoch(3)
    loader = DataLoader(range(n), batch_size=bs, sampler=s)
    seen = []
    for b, batch in enumerate(loader):
        seen += batch.tolist()
        if b == 2:
            state = s.state_dict()  # num_workers=0: the yielded count is exactly what was consumed
            break
    assert state["consumed"] == 3 * bs
    s2 = ShardedDistributedSampler(range(n), world, 1, seed=2)
    s2.load_state_dict(state)
    loader2 = DataLoader(range(n), batch_size=bs, sampler=s2)
    assert len(loader2) == math.ceil((25 - 12) / bs)
    seen += torch.cat(list(loader2)).tolist()
    assert seen == expected


def test_state_dict_explicit_consumed_and_set_start_index():
    s = ShardedDistributedSampler(range(30), 3, 0)
    s.set_epoch(2)
    it = iter(s)
    for _ in range(7):  # e.g. a DataLoader with workers fetched ahead ...
        next(it)
    state = s.state_dict(consumed=4)  # ... but only 4 samples were trained on
    assert state["consumed"] == 4
    t = ShardedDistributedSampler(range(30), 3, 0)
    t.set_epoch(2)
    t.set_start_index(4)
    assert list(t) == s.indices_for_epoch(2)[4:]
    with pytest.raises(ValueError, match=r"\[0, 10\]"):
        t.set_start_index(11)
    with pytest.raises(ValueError, match=r"\[0, 10\]"):
        s.state_dict(consumed=-1)


def test_load_state_dict_at_an_epoch_boundary_and_out_of_range():
    s = ShardedDistributedSampler(range(30), 3, 0)
    s.set_epoch(1)
    state = s.state_dict(consumed=5)
    other = ShardedDistributedSampler(range(30), 2, 0)
    other.load_state_dict({**state, "consumed": 0})  # an epoch boundary: the full epoch of this layout
    assert other.epoch == 1 and len(other) == 15
    with pytest.raises(ValueError, match="'epoch'"):
        other.load_state_dict({"consumed": 0})
    with pytest.raises(ValueError, match="exceeds"):
        ShardedDistributedSampler(range(30), 3, 0).load_state_dict({**state, "consumed": 11})


# ----------------------------------------------------------------------------- errors and compatibility


def test_errors_say_what_was_given():
    with pytest.raises(ValueError, match=r"rank=4 is out of range for num_replicas=4.*\[0, 3\]"):
        ShardedDistributedSampler(range(10), 4, 4)
    with pytest.raises(ValueError, match="rank=-1"):
        ShardedDistributedSampler(range(10), 4, -1)
    with pytest.raises(ValueError, match="empty"):
        ShardedDistributedSampler([], 2, 0)
    with pytest.raises(ValueError, match=r"len\(dataset\)=3 < num_replicas=4.*drop_last=False"):
        ShardedDistributedSampler(range(3), 4, 0, drop_last=True)
    with pytest.raises(ValueError, match="drop_last=True has no meaning"):
        ShardedDistributedSampler(range(10), 2, 0, drop_last=True, even_divisible=False)
    with pytest.raises(ValueError, match="without data"):
        ShardedDistributedSampler(range(3), 4, 0, even_divisible=False)
    with pytest.raises(ValueError, match="shard_by"):
        ShardedDistributedSampler(range(10), 2, 0, shard_by="gpu")
    with pytest.raises(ValueError, match="local_world_size=3 does not divide num_replicas=4"):
        ShardedDistributedSampler(range(10), 4, 0, shard_by="node", local_world_size=3)
    with pytest.raises(ValueError, match="num_replicas"):
        ShardedDistributedSampler(range(10), 0, 0)
    with pytest.raises(TypeError, match="length"):
        ShardedDistributedSampler(iter(range(10)), 2, 0)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        ShardedDistributedSampler(range(10), 2, 0, True, 0, False, True)  # type: ignore[misc]  # keyword only


def test_numpy_integers_are_accepted_as_torch_accepts_them():
    import numpy as np

    ours = ShardedDistributedSampler(range(10), np.int64(2), np.int64(1), shard_by="node", local_world_size=np.int32(2))
    assert list(ours) == list(ShardedDistributedSampler(range(10), 2, 1, shard_by="node", local_world_size=2))
    assert list(DistributedSampler(range(10), np.int64(2), np.int64(1)))  # torch's own accepts them too
    state = ours.state_dict(consumed=np.int64(2))
    assert type(state["consumed"]) is int and type(state["num_replicas"]) is int
    ours.load_state_dict({**state, "epoch": np.int64(0)})
    assert type(ours.epoch) is int
    with pytest.raises(ValueError, match="num_replicas"):
        ShardedDistributedSampler(range(10), True, 0)  # a bool is not a world size


def test_without_process_group_raises_like_torch():
    assert not torch.distributed.is_initialized()
    with pytest.raises(Exception) as theirs:
        DistributedSampler(range(10))
    with pytest.raises(type(theirs.value)) as ours:
        ShardedDistributedSampler(range(10))
    assert str(ours.value) == str(theirs.value)


def test_dataset_length_change_is_an_error():
    data = list(range(10))
    s = ShardedDistributedSampler(data, 2, 0)
    data.append(10)
    with pytest.raises(RuntimeError, match="changed from 10 to 11"):
        iter(s)


@pytest.mark.parametrize("canonical", [None, 5], ids=["default", "canonical"])
def test_tiny_dataset_fewer_items_than_ranks(canonical):
    make = functools.partial(samplers, 3, 5, "rank", 1, canonical_shards=canonical, shuffle=canonical is None)
    reads = epoch_reads(make(), 0)
    assert [len(r) for r in reads] == [1] * 5
    assert reads[:3] == [[0], [1], [2]]
    # the two ranks without a shard borrow items, and which ones rotates
    borrowed = {tuple(map(tuple, epoch_reads(make(), e)[3:])) for e in range(3)}
    assert len(borrowed) == 3


def test_is_a_torch_distributed_sampler_and_works_with_dataloaders():
    from monai.data import DataLoader as MonaiDataLoader

    s = ShardedDistributedSampler(range(21), 2, 1, drop_last=False)
    # Lightning keeps a sampler that is a DistributedSampler instead of wrapping it
    assert isinstance(s, DistributedSampler)
    assert (s.num_samples, s.total_size, s.num_replicas, s.rank) == (11, 22, 2, 1)
    for loader_cls in (DataLoader, MonaiDataLoader):
        loader = loader_cls(list(range(21)), batch_size=4, sampler=s, num_workers=0)
        assert len(loader) == 3
        got = torch.cat([torch.as_tensor(b) for b in loader]).tolist()
        assert sorted(set(got)) == s.shard_indices()
