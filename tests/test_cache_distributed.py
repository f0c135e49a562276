"""Independent processes and real torch.distributed (gloo) ranks sharing one node-wide cache."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import uuid
from collections import Counter

import pytest
from helpers import chain, free_port, python_c, read_calls

import monai_cache

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_scripts", "cache_rank.py")
TESTS = os.path.dirname(os.path.abspath(__file__))


def launch_ranks(world: int, args: list[str], script: str = SCRIPT) -> list[dict]:
    """Start ``world`` ranks of ``script`` as independent processes with torchrun's environment variables."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, script, *args], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    results = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        assert p.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


@pytest.fixture(scope="module")
def two_ranks(volumes, tmp_path_factory):
    """2 gloo ranks reading every item for 2 epochs, with the eager fill (``runtime_cache=0``) and then filling at
    run time (1), in one interpreter each; its own shared-memory directory. Returns the ranks' results, the calls
    log prefix and what is left in the shared-memory directory once they have exited."""
    work = tmp_path_factory.mktemp("two-ranks")
    data_path, log = work / "data.json", str(work / "calls")
    data_path.write_text(json.dumps(volumes))
    shm_dir = f"/dev/shm/mc-test-{uuid.uuid4().hex[:12]}"
    os.makedirs(shm_dir)
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("MONAI_CACHE_SHM_DIR", shm_dir)
            results = launch_ranks(2, [str(data_path), log, "0,1", "2"])
        yield results, log, os.listdir(os.path.join(shm_dir, f"monai_cache-{os.getuid()}"))
    finally:
        shutil.rmtree(shm_dir, ignore_errors=True)


@pytest.mark.parametrize("runtime_cache", [0, 1])
def test_two_gloo_ranks_compute_each_item_once_on_the_machine(volumes, two_ranks, runtime_cache):
    all_results, log, left = two_ranks
    results = [r[str(runtime_cache)] for r in all_results]
    calls = read_calls(f"{log}-{runtime_cache}")
    # the deterministic transforms ran once per item on the machine, whatever rank or worker needed it
    assert Counter(case for _, case in calls) == Counter(range(len(volumes)))
    if runtime_cache:  # each rank's workers compute the items of its own shard in epoch 1: always split
        assert len({pid for pid, _ in calls}) >= 2
    # (the eager fill is shared too, but a rank that starts late finds everything done: timing, not a rule)
    seen = sorted(case for r in results for case in r["seen"])
    assert seen == sorted(list(range(len(volumes))) * 2)  # 2 epochs, every item once per epoch
    assert results[0]["path"] == results[1]["path"]
    assert results[0]["total"]["misses"] == len(volumes)
    assert results[0]["stored"]["entries"] == len(volumes)
    # removed by the last rank to let go of it: released (the eager one, before the second), or exited
    assert not os.path.exists(results[0]["path"])
    assert left == [".lock"]


def test_second_independent_process_computes_nothing_the_first_cached(shm_dir, volumes, tmp_path):
    """The first process is this one (it holds the cache meanwhile); the second a fresh interpreter."""
    log = str(tmp_path / "calls")
    first = monai_cache.CacheDataset(volumes, chain(log), progress=False)
    try:
        build = textwrap.dedent(f"""
            import os, sys
            sys.path.insert(0, {TESTS!r})
            import monai_cache
            from helpers import chain
            ds = monai_cache.CacheDataset({volumes!r}, chain({log!r}), progress=False)
            print(ds._cache.path, flush=True)
        """)
        second = subprocess.run(python_c(build), capture_output=True, text=True, timeout=300)
        assert second.returncode == 0, second.stderr
        assert second.stdout.strip() == first._cache.path
    finally:
        first.release()
    calls = read_calls(log)
    assert {pid for pid, _ in calls} == {os.getpid()}  # the second process computed nothing
    assert sorted(case for _, case in calls) == list(range(len(volumes)))
