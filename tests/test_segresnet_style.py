"""Auto3DSeg's segresnet pattern, unmodified, under torchrun: a Manager list passed as ``runtime_cache`` and broadcast
to the ranks of the node gets the node-wide shared-memory cache; the Manager holds nothing; the losses are MONAI's.

One torchrun job with monai_cache and one without (stock MONAI), started together: they share the CPU's idle time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter

import pytest
from helpers import read_calls

from monai_cache.keeper import wait_for_keepers
from monai_cache.shm import list_caches

SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_scripts")
SCRIPT = os.path.join(SCRIPTS, "segresnet_train.py")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
EPOCHS = 3


def launcher(ours: bool) -> list[str]:
    """The command line that starts the user's unmodified script: with ``ours``, under the switch
    (``python -m monai_cache run --``, the same as ``monai-cache run --``), which reaches torchrun's ranks and their
    DataLoader workers."""
    return [sys.executable, "-m", "monai_cache", "run", "--", *TORCHRUN, SCRIPT] if ours else [*TORCHRUN, SCRIPT]


def ranks_of(proc: subprocess.Popen, log_path: str) -> dict[int, dict]:
    try:
        _out, err = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    assert proc.returncode == 0, err[-4000:]
    ranks = {}
    for rank in (0, 1):
        with open(f"{log_path}.rank{rank}.json") as f:
            ranks[rank] = {**json.load(f), "stderr": err}
    return ranks


@pytest.fixture(scope="module")
def runs(tmp_path_factory, volumes):
    tmp = tmp_path_factory.mktemp("segresnet")
    shm = f"/dev/shm/mc-test-segresnet-{os.getpid()}"
    os.makedirs(shm)
    data_path = tmp / "data.json"
    data_path.write_text(json.dumps(volumes))
    env = dict(os.environ, MONAI_CACHE_SHM_DIR=shm, OMP_NUM_THREADS="1")
    logs = {"ours": str(tmp / "ours.calls"), "stock": str(tmp / "stock.calls")}
    procs = {
        name: subprocess.Popen([*launcher(name == "ours"), str(data_path), logs[name], str(EPOCHS)], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for name in ("ours", "stock")
    }
    try:
        results = {name: ranks_of(proc, logs[name]) for name, proc in procs.items()}
        assert wait_for_keepers(shm)  # the node's keeper removes the cache a moment after torchrun's agent exits
        yield {**results, "calls": {k: read_calls(v) for k, v in logs.items()}, "n": len(volumes), "shm": shm}
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
        import shutil

        shutil.rmtree(shm, ignore_errors=True)


def test_manager_list_gets_the_node_cache_and_the_same_losses(runs):
    ours, stock, n = runs["ours"], runs["stock"], runs["n"]
    assert sorted(ours) == sorted(stock) == [0, 1]
    # each item computed once on the machine, whichever rank or worker read it first
    assert Counter(case for _, case in runs["calls"]["ours"]) == Counter(range(n))
    # by the workers of both ranks (each its own shard), and by workers only
    computed_by = {pid for pid, _ in runs["calls"]["ours"]}
    workers = {rank: set(ours[rank]["children"]) for rank in (0, 1)}
    assert computed_by <= workers[0] | workers[1] and all(computed_by & workers[rank] for rank in (0, 1))
    # the Manager's server holds no item (MONAI fills it: the stock run shows the list is the one the ranks read)
    assert [ours[r]["manager_items"] for r in (0, 1)] == [0, 0]
    assert stock[0]["manager_items"] == stock[1]["manager_items"] == n
    # the same training, to the bit: the same items, crops, order, batches and losses; the switch's DataLoader is
    # ours, and its batches came as blocks (MONAI's list_data_collate: the same batches)
    for rank in (0, 1):
        assert len(ours[rank]["losses"]) == EPOCHS * n // 2 // 2
        assert ours[rank]["losses"] == stock[rank]["losses"]
        assert ours[rank]["digests"] == stock[rank]["digests"]
        assert ours[rank]["loader"] == "monai_cache.loader.DataLoader" and all(ours[rank]["blocks"])
        assert stock[rank]["loader"] == "monai.data.dataloader.DataLoader" and not any(stock[rank]["blocks"])
    # one log line in each rank (torchrun's stderr holds both ranks'), none in the workers; none without monai_cache
    assert ours[0]["stderr"].count("runtime_cache is a ListProxy") == 2
    assert "runtime_cache is a ListProxy" not in stock[0]["stderr"]
    # the switch says it is on once, in local rank 0 only; never without it
    assert ours[0]["stderr"].count("monai_cache switch on (MONAI ") == 1
    assert "monai_cache switch on" not in stock[0]["stderr"]


def test_cache_stats_in_the_main_process_counts_every_worker_and_rank(runs):
    n = runs["n"]
    for rank in (0, 1):  # read after the last epoch in each rank's main process, which read nothing itself
        total = runs["ours"][rank]["stats"]
        assert total["misses"] == n
        assert total["hits"] == (EPOCHS - 1) * n
        assert total["writes"] == n


def test_no_shared_memory_left(runs):
    assert list_caches(runs["shm"]) == []
    leftovers = [os.path.join(d, f) for d, _, files in os.walk(runs["shm"]) for f in files if f != ".lock"]
    assert leftovers == []
