"""A simulated two-node run: 4 gloo ranks, 2 per "node", each node with its own shared-memory directory.

The ranks are started as ``srun --ntasks-per-node=2`` starts them for Lightning: Slurm's variables only
(``SLURM_PROCID``, ``SLURM_LOCALID``, ``SLURM_NODEID``, ``SLURM_NTASKS``, ``SLURM_TASKS_PER_NODE=2(x2)``...) and the
``MASTER_ADDR`` / ``MASTER_PORT`` that Lightning's ``SLURMEnvironment`` exports, none of torchrun's. The 4 processes
share one host and no ``MONAI_CACHE_NODE_ID`` tells them apart, so the two nodes can only come from Slurm's
variables (gathering host names would find one node of 4). (Gathering machine identities:
tests/test_sampler_distributed.py.)

With ShardedDistributedSampler(shard_by="node") each node's cache ends up holding only its node's shard,
and from the second epoch on every read is a hit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from helpers import free_port, slurm_task, without_launcher

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_scripts", "node_rank.py")


def test_two_nodes_each_cache_holds_its_shard_and_hits_from_epoch_two(tmp_path):
    n, epochs, nodes, per_node = 22, 3, 2, 2
    (tmp_path / "data.json").write_text(json.dumps([{"x": i} for i in range(n)]))
    node_dirs = [f"/dev/shm/mc-test-node{k}-{os.getpid()}" for k in range(nodes)]
    for d in node_dirs:
        os.makedirs(d, exist_ok=True)
    port, procs = free_port(), []
    try:
        for rank in range(nodes * per_node):
            node = rank // per_node
            env = {**without_launcher(os.environ), **slurm_task(rank, rank % per_node, node, f"{per_node}(x{nodes})")}
            env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), MONAI_CACHE_SHM_DIR=node_dirs[node],
                       OMP_NUM_THREADS="1")
            procs.append(subprocess.Popen([sys.executable, SCRIPT, str(tmp_path / "data.json"), str(epochs)], env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        results = []
        for p in procs:
            out, err = p.communicate(timeout=300)
            assert p.returncode == 0, err[-3000:]
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            p.kill()
        for d in node_dirs:
            subprocess.run(["rm", "-rf", d], check=False)
    results.sort(key=lambda r: r["rank"])
    # the layout is Slurm's: 2 nodes of 2 (the host names, all one, would give 1 node of 4)
    assert [r["layout"] for r in results] == [[per_node, r // per_node, r % per_node] for r in range(nodes * per_node)]
    node_items = []
    for node in range(nodes):
        ranks = results[node * per_node : (node + 1) * per_node]
        epoch_reads = [{i for r in ranks for i in r["seen"][e]} for e in range(epochs)]
        # the node reads the same shard every epoch, and its cache holds exactly that shard
        assert epoch_reads[0] == epoch_reads[1] == epoch_reads[2]
        assert set(ranks[0]["entries"]) == epoch_reads[0]
        node_items.append(epoch_reads[0])
        stats = [r["stats"] for r in ranks]
        # misses only in epoch 1: every read from epoch 2 on is a hit in the node's cache
        assert stats[0][0]["misses"] == len(epoch_reads[0]) == stats[0][-1]["misses"]
        reads_after_first = sum(len(r["seen"][e]) for r in ranks for e in range(1, epochs))
        assert stats[0][-1]["hits"] - stats[0][0]["hits"] == reads_after_first
        # ranks of one node are re-dealt the node's shard: a rank does not read the same set every epoch
        assert any(set(ranks[0]["seen"][e]) != set(ranks[0]["seen"][0]) for e in range(1, epochs))
    # the two nodes split the data, and together see all of it every epoch
    assert not node_items[0] & node_items[1] and node_items[0] | node_items[1] == set(range(n))
