"""4 gloo ranks play several world sizes (sub-groups of ranks 0..W-1); run by node_layout_worker.py's 4-rank job.

``run_world_sizes(out_dir)`` runs on every rank of an initialised 4-rank default group (one launch of processes
serves both checks, to keep the suite's interpreter starts down).

1. The world-size-independent order (``canonical_shards=8``): the same dataset read for 2 epochs on 1, 2 and 4
   ranks at the global batch size 8; each group gathers what its ranks read, step by step.
2. The default order on 2 and 4 ranks, for contrast.
3. A resume on another world size: 4 ranks (2 simulated nodes of 2) read 3 steps of epoch 1, save the state
   (``state_dict(gather=True)``, a collective, and rank 0's plain ``state_dict()``, which rank 0 writes with
   ``torch.save`` as a training script does); ranks 0 and 1 (one node) load it and finish the epoch, then read
   epoch 2. Every step runs an all-reduce in its group, so ranks out of lockstep would show.

Returns, on rank 0, what the tests check (``None`` on the others).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from monai_cache.sampler import ShardedDistributedSampler

N_ITEMS = 40
GLOBAL_BATCH = 8


def read_epochs(group, world: int, epochs, make_sampler, batch: int, steps: int | None = None) -> tuple[list, object]:
    """Each epoch: the global batches of every step, ``[[rank 0's batch, rank 1's, ...], ...]``, from every rank."""
    rank = dist.get_rank(group)
    sampler = make_sampler(world, rank)
    loader = DataLoader(range(N_ITEMS), batch_size=batch, sampler=sampler, num_workers=0)
    out = []
    for epoch in epochs:
        sampler.set_epoch(epoch)
        mine = []
        for step, b in enumerate(loader):
            t = torch.tensor([step, 1])
            dist.all_reduce(t, group=group)  # [world * step, world] only if every rank is at this step
            assert t.tolist() == [world * step, world], f"ranks out of lockstep at step {step}"
            mine.append(b.tolist())
            if step + 1 == steps:  # a crash right after this step: no further batch was fetched
                break
        every: list = [None] * world
        dist.all_gather_object(every, mine, group=group)
        out.append([[every[r][s] for r in range(world)] for s in range(len(mine))])
    return out, sampler


def run_world_sizes(out_dir: str) -> dict | None:
    me = dist.get_rank()
    groups = {w: dist.new_group(list(range(w))) for w in (1, 2, 4)}  # every rank takes part in new_group
    result: dict = {"canonical": {}, "default": {}}

    def canonical(world, rank):
        return ShardedDistributedSampler(range(N_ITEMS), world, rank, seed=7, canonical_shards=8)

    def default(world, rank):
        return ShardedDistributedSampler(range(N_ITEMS), world, rank, seed=7)

    for world, group in groups.items():
        if me < world:
            result["canonical"][world] = read_epochs(group, world, (0, 1), canonical, GLOBAL_BATCH // world)[0]
            if world > 1:
                result["default"][world] = read_epochs(group, world, (0,), default, GLOBAL_BATCH // world)[0]
        dist.barrier()

    # 3. resume on another world size: 2 nodes of 2 ranks -> 1 node of 2 ranks
    def node(world, rank):
        return ShardedDistributedSampler(range(N_ITEMS), world, rank, seed=3, shard_by="node", local_world_size=2)

    before, sampler = read_epochs(groups[4], 4, (1,), node, 2, steps=3)
    gathered = sampler.state_dict(gather=True)  # collective: every rank
    ckpt = os.path.join(out_dir, "checkpoint.pt")
    if me == 0:  # the usual code: rank 0 saves
        torch.save({"sampler": sampler.state_dict()}, ckpt)
        result["gathered"], result["plain"] = gathered, sampler.state_dict()
    dist.barrier()
    if me < 2:
        state = torch.load(ckpt, weights_only=True)["sampler"]  # plain data: loads with weights_only

        def resumed(world, rank):
            s = node(world, rank)
            s.load_state_dict(state)
            return s

        rest, _ = read_epochs(groups[2], 2, (1, 2), resumed, 2)
        result["resume"] = {"before": before[0], "rest": rest[0], "next": rest[1]}
    dist.barrier()
    return result if me == 0 else None
