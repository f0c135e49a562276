"""A simulated two-node run: 4 gloo ranks, 2 per "node", each node with its own shared-memory directory.

The ranks are started without LOCAL_WORLD_SIZE, as Lightning or srun start them; each "node" has its own
machine identity (``MONAI_CACHE_NODE_ID``), so the sampler finds the two nodes by gathering identities.

With ShardedDistributedSampler(shard_by="node") each node's cache ends up holding only its node's shard,
and from the second epoch on every read is a hit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from helpers import free_port

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
            # a launcher that does not set LOCAL_WORLD_SIZE (Lightning, srun): the sampler finds each node's
            # ranks by gathering their machine identities, here simulated machines named by MONAI_CACHE_NODE_ID
            env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_WORLD_SIZE", "GROUP_RANK")}
            env.update(RANK=str(rank), WORLD_SIZE=str(nodes * per_node), LOCAL_RANK=str(rank % per_node),
                       NODE_RANK=str(node), MONAI_CACHE_NODE_ID=f"node{node}", MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port), MONAI_CACHE_SHM_DIR=node_dirs[node], OMP_NUM_THREADS="1")
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
