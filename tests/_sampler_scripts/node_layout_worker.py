"""One rank of a gloo job started without LOCAL_WORLD_SIZE (as Lightning, srun or mpirun start ranks).

Usage: python node_layout_worker.py OUT_DIR. ``shard_by="node"`` then has to find the ranks of each machine
by gathering their identities (the host name, or ``MONAI_CACHE_NODE_ID`` when the test simulates machines).
Writes ``OUT_DIR/rank{RANK}.json``: the layout found and the indices of a few epochs, or the error raised. With
4 ranks it goes on with ``world_size_worker.run_world_sizes`` (the order and the resume on other world sizes).
``check_layout`` is also run by gloo_worker.py after its own checks, with LOCAL_WORLD_SIZE removed from its
environment (one launch of 2 ranks serves both).
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta

import torch.distributed as dist

from monai_cache.sampler import ShardedDistributedSampler

N_ITEMS = 23
EPOCHS = 3


def check_layout(world: int, rank: int) -> dict:
    """The node-layout checks, on an initialised default group of ``world`` ranks; returns this rank's result."""
    assert "LOCAL_WORLD_SIZE" not in os.environ, "this worker checks the launchers that do not set it"
    result: dict = {"rank": rank, "world": world}
    # num_replicas / rank that differ from the process group's: no gather may start (rank 0 alone tries)
    if rank == 0:
        try:
            ShardedDistributedSampler(range(10), num_replicas=world + 1, rank=0, shard_by="node")
            result["mismatch_error"] = None
        except ValueError as e:
            result["mismatch_error"] = str(e)
    dist.barrier()
    try:
        sampler = ShardedDistributedSampler(range(N_ITEMS), seed=1, shard_by="node")  # every rank: one all-gather
    except ValueError as e:
        result["error"] = str(e)
    else:
        result["layout"] = [sampler.local_world_size, sampler.node_rank, sampler.local_rank]
        result["epochs"] = [sampler.indices_for_epoch(e) for e in range(EPOCHS)]
        # later samplers reuse the gathered layout: the last rank alone builds one (a second all-gather,
        # started by one rank only, would time out)
        if rank == world - 1:
            second = ShardedDistributedSampler(range(7), shuffle=False, shard_by="node")
            result["second_layout"] = second.local_world_size
    dist.barrier()
    return result


def main() -> None:
    out_dir = sys.argv[1]
    # a short timeout: a collective that only some ranks start fails the test instead of hanging it
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    world, rank = dist.get_world_size(), dist.get_rank()
    result = check_layout(world, rank)
    if world == 4:  # the same 4 processes also play 1, 2 and 4 ranks (one launch instead of two)
        from world_size_worker import run_world_sizes

        result["world_sizes"] = run_world_sizes(out_dir)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
