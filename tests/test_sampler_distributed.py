"""A real 2-rank gloo run of ShardedDistributedSampler, each rank an independent process started like torchrun does.

Each rank keeps a private per-rank cache of what one rank can afford (``ceil(n / world)`` items). With the sharded
sampler every read from the second epoch on is a hit; with torch's ``DistributedSampler`` about ``1 / world`` are.
Ranks started without ``LOCAL_WORLD_SIZE`` (as Lightning, srun and mpirun start them) check that ``shard_by="node"``
finds the ranks of each machine through the process group, and rejects ranks not numbered by machine.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from helpers import without_launcher

from monai_cache.sampler import ShardedDistributedSampler

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "tests" / "_sampler_scripts" / "gloo_worker.py"
LAYOUT_WORKER = REPO / "tests" / "_sampler_scripts" / "node_layout_worker.py"
WORLD = 2
TIMEOUT_S = 120

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(world: int, script: Path, out: Path, env_of_rank) -> list[dict]:
    """Start ``world`` ranks of ``script OUT`` as independent processes; return each rank's ``rank{r}.json``.

    ``env_of_rank(rank)`` gives the launcher's variables of that rank, added to a copy of this environment
    without any launcher's variables, torchrun's or Slurm's (so a launcher that does not set one really leaves it
    unset).
    """
    port = _free_port()
    base = without_launcher(os.environ)
    procs = []
    for rank in range(world):
        env = {
            **base,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
            **env_of_rank(rank),
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script), str(out)],
                env=env,
                cwd=REPO,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=TIMEOUT_S)[0])
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail(f"gloo ranks did not finish within {TIMEOUT_S} s (a collective hung?)")
    for rank, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"rank {rank} exited with {p.returncode}:\n{log[-4000:]}"
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict]:
    """Launch both ranks once: the samplers under torchrun's variables, then the layout checks without them."""

    def torchrun_env(rank: int) -> dict[str, str]:  # what torchrun --nnodes=1 --nproc-per-node=2 sets
        return {"RANK": str(rank), "WORLD_SIZE": str(WORLD), "LOCAL_RANK": str(rank),
                "LOCAL_WORLD_SIZE": str(WORLD), "GROUP_RANK": "0"}  # fmt: skip

    return _launch(WORLD, WORKER, tmp_path_factory.mktemp("gloo"), torchrun_env)


@pytest.fixture(scope="module")
def results(two_ranks) -> dict[str, list[dict]]:
    """{sampler name: [rank 0 result, rank 1 result]}."""
    by_name: dict[str, list[dict]] = {}
    for data in two_ranks:
        assert data["world"] == WORLD
        for res in data["results"]:
            by_name.setdefault(res["name"], []).append(res)
    return by_name


def _hit_rate(res: dict, epoch: int) -> float:
    e = res["epochs"][epoch]
    return e["hits"] / (e["hits"] + e["misses"])


def test_rank_and_world_come_from_the_process_group(results):
    for name in ("sharded", "sharded_node"):
        assert [(r["rank"], r["num_replicas"]) for r in results[name]] == [(0, WORLD), (1, WORLD)]


def test_sharded_sampler_hits_every_read_from_the_second_epoch(results):
    for res in results["sharded"]:
        rates = [_hit_rate(res, e) for e in range(len(res["epochs"]))]
        assert rates[0] < 0.1  # cold cache
        assert rates[1:] == [1.0] * (len(rates) - 1), rates


def test_torch_sampler_hits_about_one_in_world(results):
    for res in results["torch"]:
        rates = [_hit_rate(res, e) for e in range(1, len(res["epochs"]))]
        mean = sum(rates) / len(rates)
        assert 0.25 < mean < 0.75, rates  # about 1 / WORLD = 0.5, far from the sharded sampler's 1.0


@pytest.mark.parametrize("name", ["sharded", "torch", "sharded_node"])
def test_ranks_stay_in_lockstep(results, name):
    for e in range(len(results[name][0]["epochs"])):
        eps = [r["epochs"][e] for r in results[name]]
        assert all(ep["lockstep"] for ep in eps), "a per-step all_reduce saw ranks at different steps"
        assert {ep["steps_min"] for ep in eps} == {ep["steps_max"] for ep in eps} == {13}  # ceil(51 / 4)
        assert len(eps[0]["indices"]) == len(eps[1]["indices"]) == 51  # ceil(101 / 2)


@pytest.mark.parametrize("name", ["sharded", "sharded_node"])
def test_coverage_and_fixed_shards(results, name):
    ranks = results[name]
    n_epochs = len(ranks[0]["epochs"])
    for e in range(n_epochs):
        eps = [r["epochs"][e] for r in ranks]
        counts = Counter(eps[0]["indices"] + eps[1]["indices"])
        assert set(counts) == set(range(101)), f"epoch {e} missed items"
        assert sum(counts.values()) == 102  # exactly one pad
    # one node of two ranks: no launcher-layout warning; node mode re-deals, so a rank's items change
    assert not any(r["warnings"] for r in ranks)
    if name == "sharded":
        for r in ranks:  # the same items every epoch (the pad is one of the rank's own items)
            assert len({frozenset(ep["indices"]) for ep in r["epochs"]}) == 1
    else:
        assert len({frozenset(ep["indices"]) for ep in ranks[0]["epochs"]}) == n_epochs


# ----------------------------------------------------------------------------- launchers without LOCAL_WORLD_SIZE


def test_node_mode_finds_the_ranks_of_the_machine_without_local_world_size(two_ranks):
    # the 2 ranks, after their torchrun-like checks, without LOCAL_WORLD_SIZE and GROUP_RANK (as Lightning's
    # launcher, srun or mpirun start ranks)
    ranks = [r["layout"] for r in two_ranks]
    # both ranks run on this machine: one node of two ranks, as if local_world_size=2 had been passed
    assert [r["layout"] for r in ranks] == [[2, 0, 0], [2, 0, 1]]
    for r in ranks:
        expected = ShardedDistributedSampler(range(23), WORLD, r["rank"], seed=1, shard_by="node", local_world_size=2)
        assert r["epochs"] == [expected.indices_for_epoch(e) for e in range(3)]
    # the second sampler, built by one rank alone, reused the layout instead of starting another all-gather
    assert ranks[-1]["second_layout"] == 2
    # num_replicas / rank other than the process group's: a clear error, and no collective was started
    assert "differ from the process group's (world size 2, rank 0)" in ranks[0]["mismatch_error"]
    assert "local_world_size=" in ranks[0]["mismatch_error"]


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory) -> list[dict]:
    """4 ranks on two simulated machines, dealt round-robin (srun --distribution=cyclic, mpirun --map-by node).

    The same launch then plays 1, 2 and 4 ranks in sub-groups (_sampler_scripts/world_size_worker.py).
    """

    def env(rank: int) -> dict[str, str]:
        machine = "ab"[rank % 2]
        return {"RANK": str(rank), "WORLD_SIZE": "4", "LOCAL_RANK": str(rank // 2), "MONAI_CACHE_NODE_ID": machine}

    return _launch(4, LAYOUT_WORKER, tmp_path_factory.mktemp("four_ranks"), env)


def test_node_mode_rejects_ranks_not_numbered_by_machine(four_ranks):
    for r in four_ranks:
        assert "layout" not in r, r
        assert "numbered contiguously" in r["error"]
        assert "a: ranks [0, 2]; b: ranks [1, 3]" in r["error"]
        assert "shard_by='rank'" in r["error"]


# ----------------------------------------------------------------------------- world sizes: one launch of 4 ranks


@pytest.fixture(scope="module")
def world_sizes(four_ranks) -> dict:
    return four_ranks[0]["world_sizes"]


def _interleaved(steps: list[list[list[int]]]) -> list[int]:
    """The global order of an epoch: step by step, position ``j * world + r`` is rank r's j-th index."""
    order = []
    for batches in steps:
        order += [b[i] for i in range(len(batches[0])) for b in batches]
    return order


def test_canonical_order_is_the_same_on_1_2_and_4_gloo_ranks(world_sizes):
    canonical = world_sizes["canonical"]
    assert sorted(canonical) == ["1", "2", "4"]
    for world, epochs in canonical.items():
        for e, steps in enumerate(epochs):
            # item by item: the same global order as one rank, and the same global batch at every step
            assert _interleaved(steps) == _interleaved(canonical["1"][e]), f"world {world}, epoch {e}"
            assert [sorted(x for batch in b for x in batch) for b in steps] == [
                sorted(x for batch in b for x in batch) for b in canonical["1"][e]
            ]
            # each rank reads its own rank shard, as with the default order, so its cache hits from epoch 1
            assert all(x % int(world) == r for b in steps for r, batch in enumerate(b) for x in batch)
    assert sorted(_interleaved(canonical["1"][0])) == list(range(40))
    assert _interleaved(canonical["1"][0]) != _interleaved(canonical["1"][1])  # a new order every epoch
    # the default (shard-local) order depends on the world size: what canonical_shards is for
    assert _interleaved(world_sizes["default"]["2"][0]) != _interleaved(world_sizes["default"]["4"][0])


def test_an_epoch_started_on_4_ranks_finishes_on_2_exactly_once(world_sizes):
    plain, gathered = world_sizes["plain"], world_sizes["gathered"]
    assert gathered == {**plain, "consumed_by_rank": [6, 6, 6, 6]}  # lockstep: rank 0's state says it all
    resume = world_sizes["resume"]
    before = [x for b in resume["before"] for batch in b for x in batch]
    rest = [x for b in resume["rest"] for batch in b for x in batch]
    assert len(before) == 24 and len(rest) == 16  # 3 steps of 2 on 4 ranks; the other 16 on 2 ranks
    assert sorted(before + rest) == list(range(40))  # every item of epoch 1 once, across both layouts
    # the next epoch is the normal epoch of the new layout (one node of two ranks)
    for r in range(2):
        expected = ShardedDistributedSampler(range(40), 2, r, seed=3, shard_by="node", local_world_size=2)
        assert [x for b in resume["next"] for x in b[r]] == expected.indices_for_epoch(2)
