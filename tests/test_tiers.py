"""Two tiers: a node-wide shared-memory cache in front of a disk cache, from either entry point.

``PersistentDataset(..., shm_cache=True)`` keeps a shared-memory copy in front of its disk cache;
``CacheDataset(..., cache_dir=DIR)`` keeps its shared-memory entries on disk too. Real /dev/shm, real files,
independent processes; a "node" of a cluster is simulated by a process group with a shared-memory directory and a
machine identity of its own (``MONAI_CACHE_NODE_ID``, which names the files a machine writes).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from collections import Counter

import pytest
import torch
from helpers import chain, one_torch_thread, python_c, read_calls  # noqa: F401 (an autouse fixture)

import monai_cache
from monai_cache import disk_format, runtime, shm_directory

TESTS = os.path.dirname(os.path.abspath(__file__))
NODE_SCRIPT = os.path.join(TESTS, "_scripts", "tier_node.py")


def same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert type(a[k]) is type(b[k]) and a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


def run_independent(code: str) -> str:
    """Run ``code`` in a fresh, independently started interpreter (as another rank or a later run would)."""
    r = subprocess.run(python_c(textwrap.dedent(code)), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def test_warm_restart_fills_shared_memory_from_disk_and_never_reads_the_disk_again(shm_dir, volumes, tmp_path):
    # Both entry points (pd: PersistentDataset(shm_cache=True), cd: CacheDataset(cache_dir=...)), each with a cache
    # directory and a compute log of its own, side by side in the same two runs (an interpreter start is seconds).
    kinds = ("pd", "cd")
    logs = {kind: str(tmp_path / f"calls-{kind}") for kind in kinds}
    cache_dirs = {kind: str(tmp_path / f"cache-{kind}") for kind in kinds}
    build = f"""
        import json, os, sys
        sys.path.insert(0, {TESTS!r})
        import monai_cache
        from helpers import chain
        data, logs, cache_dirs = {volumes!r}, {logs!r}, {cache_dirs!r}
        datasets = {{
            "pd": monai_cache.PersistentDataset(data, chain(logs["pd"], crop=False), cache_dirs["pd"], shm_cache=True),
            "cd": monai_cache.CacheDataset(data, chain(logs["cd"], crop=False), runtime_cache=True, progress=False,
                                           cache_dir=cache_dirs["cd"]),
        }}
        out = {{}}
    """
    first = run_independent(build + """
        for kind, ds in datasets.items():
            out[kind] = [float(ds[i]["image"].sum()) for i in range(len(data))]
            ds.flush()
        print(json.dumps(out))
    """)
    for kind in kinds:
        assert len(read_calls(logs[kind])) == len(volumes), kind  # computed once, and written to disk
    # A new run (the first one's shared memory is gone with it, as after a reboot): everything comes from disk.
    assert os.listdir(os.path.join(shm_dir, f"monai_cache-{os.getuid()}")) == [".lock"]
    second = run_independent(build + """
        for kind, ds in datasets.items():
            first = [float(ds[i]["image"].sum()) for i in range(len(data))]
            disk_reads = ds.cache_stats()["disk"]["total"]["bytes_read"]
            for name in os.listdir(cache_dirs[kind]):  # the disk is not needed any more on this machine
                os.unlink(os.path.join(cache_dirs[kind], name))
            again = [float(ds[i]["image"].sum()) for _ in range(2) for i in range(len(data))]
            stats = ds.cache_stats()
            out[kind] = [first, again, disk_reads, stats["disk"]["total"]["bytes_read"], stats["total"]["hits"],
                         stats["disk"]["total"]["hits"]]
        print(json.dumps(out))
    """)
    first_sums, results = json.loads(first.splitlines()[-1]), json.loads(second.splitlines()[-1])
    for kind in kinds:
        restart, again, disk_reads, disk_reads_after, memory_hits, disk_hits = results[kind]
        assert restart == first_sums[kind] and again == first_sums[kind] * 2, kind
        assert len(read_calls(logs[kind])) == len(volumes), kind  # the restart computed nothing
        assert disk_hits == len(volumes) and disk_reads > 0, kind  # each item read from disk once...
        assert disk_reads_after == disk_reads, kind  # ...and never again: every later read came from shared memory
        assert memory_hits >= 2 * len(volumes), kind


def test_both_entry_points_write_what_the_single_tier_stores_write(shm_dir, volumes, tmp_path):
    """A tiered PersistentDataset leaves the disk entries a plain one reads (and vice versa); its shared-memory
    entries are a SharedMemoryStore's, checked by `monai-cache verify` like any."""
    cache_dir = str(tmp_path / "cache")
    tiered = monai_cache.PersistentDataset(volumes, chain(crop=False), cache_dir, shm_cache=True, keep_warm=True)
    items = [tiered[i] for i in range(len(volumes))]
    tiered.flush()
    plain = monai_cache.PersistentDataset(volumes, chain(crop=False), cache_dir)
    for i, item in enumerate(items):
        same(plain[i], item)
    assert plain.cache_stats()["process"]["hits"] == len(volumes)
    assert disk_format.verify(cache_dir)["ok"] == len(volumes)
    (front,) = shm_directory.caches_in_front_of(cache_dir)
    assert front["entries"] == len(volumes)
    assert shm_directory.verify(front["path"])["ok"] == len(volumes)
    tiered.release()
    assert shm_directory.remove_cache(front["key"])  # kept: removed on request only


def _fill_forever(volumes: list, cache_dir: str, large: int) -> None:
    torch.set_num_threads(1)
    from monai.transforms import Compose, MapTransform

    class Big(MapTransform):  # a 1.2 MB noise volume besides the image: entries of both kinds in both tiers
        def __call__(self, d):
            d = dict(d)
            d["noise"] = torch.rand(large, generator=torch.Generator().manual_seed(int(d["case"])))
            return d

    data = [dict(v, case=k) for k, v in enumerate(volumes * 8)]
    ds = monai_cache.CacheDataset(data, Compose([*chain(crop=False).transforms, Big(keys="image")]),
                                  runtime_cache=True, progress=False, keep_warm=True, cache_dir=cache_dir,
                                  cache_key="tiers-killed")
    while True:
        for i in range(len(data)):
            ds[i]
        ds._cache.clear()  # write the shared-memory tier again, and again


def test_sigkill_during_either_tiers_writes_leaves_nothing_a_reader_accepts_wrongly(shm_dir, volumes, tmp_path):
    import multiprocessing

    cache_dir, large = str(tmp_path / "cache"), 300_000
    rng = random.Random(5)

    def writing(pid: int) -> int:  # temporary files of ``pid`` in either tier: entries it is writing
        return sum(
            runtime.temp_owner(name) == (runtime.HOST_TAG, pid)
            for root in (cache_dir, shm_dir)
            for _, _, names in os.walk(root)
            for name in names
        )

    mid_write = 0
    for _ in range(6):
        p = multiprocessing.get_context("fork").Process(target=_fill_forever, args=(volumes, cache_dir, large))
        p.start()
        time.sleep(rng.uniform(0.2, 1.2))
        until = time.monotonic() + 0.5  # then kill as soon as it is seen inside a write (or 0.5 s later)
        while not writing(p.pid) and time.monotonic() < until:
            time.sleep(0.001)
        os.kill(p.pid, signal.SIGSTOP)  # what it holds at the moment it dies
        mid_write += writing(p.pid) > 0
        os.kill(p.pid, signal.SIGKILL)
        p.join(30)
    print(f"\n{mid_write} of 6 kills inside a write")
    assert mid_write >= 1, "no kill landed inside a write (the test did not exercise the hazard)"
    # every disk entry a reader accepts is complete (a crash cannot leave another kind: no partial name)
    checked = disk_format.verify(cache_dir)
    assert checked["bad"] == [] and checked["ok"] >= 1, checked
    # the kept shared-memory tier: every published entry is complete and right
    (front,) = shm_directory.caches_in_front_of(cache_dir)
    memory = shm_directory.verify(front["path"])
    assert memory["bad"] == [], memory
    data = [dict(v, case=k) for k, v in enumerate(volumes * 8)]
    store = monai_cache.SharedMemoryStore(front["key"], len(data), keep_warm=True)
    for i in range(len(data)):
        got = store[i]
        if got is not None:
            expected = torch.rand(large, generator=torch.Generator().manual_seed(i))
            assert torch.equal(got["noise"], expected)
    store.release()
    assert shm_directory.remove_cache(front["key"], force=True)


KINDS = ("cd", "pd")


@pytest.fixture(scope="module")
def two_nodes(volumes, tmp_path_factory):
    """2 simulated machines x 2 processes, each machine with its own /dev/shm directory and identity, read every
    item at once from one shared cache_dir, first through CacheDataset ("cd"), then PersistentDataset ("pd"): one
    interpreter per process serves both. Returns the work directory, {kind: each process's JSON line}, and the
    node's shared-memory directories once every process has exited."""
    work = tmp_path_factory.mktemp("two-nodes")
    data_path = work / "data.json"
    data_path.write_text(json.dumps(volumes))
    procs, shm_dirs = [], []
    try:
        for node in range(2):
            shm_dir = f"/dev/shm/mc-tiers-{os.getpid()}-{node}"
            os.makedirs(shm_dir)
            shm_dirs.append(shm_dir)
            env = dict(os.environ, MONAI_CACHE_SHM_DIR=shm_dir, MONAI_CACHE_NODE_ID=f"node{node}")
            for rank in range(2):
                seed = str(10 * node + rank)
                argv = [sys.executable, NODE_SCRIPT, str(data_path), str(work), ",".join(KINDS), seed, "4"]
                procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        results: dict[str, list[dict]] = {kind: [] for kind in KINDS}
        for p in procs:
            out, err = p.communicate(timeout=300)
            assert p.returncode == 0, err[-3000:]
            for line in out.strip().splitlines():
                r = json.loads(line)
                results[r["kind"]].append(r)
        left = [os.listdir(os.path.join(d, f"monai_cache-{os.getuid()}")) for d in shm_dirs]
        yield work, results, left
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for shm_dir in shm_dirs:
            subprocess.run(["rm", "-rf", shm_dir], check=False)


@pytest.mark.parametrize("kind", KINDS)
def test_two_nodes_sharing_one_cache_dir_compute_each_item_once_in_total(volumes, two_nodes, kind):
    """2 simulated machines x 2 processes, each with its own /dev/shm directory and machine identity, read every
    item at once from one shared cache_dir: each item is computed once in all, every read is right."""
    work, all_results, left = two_nodes
    results, cache_dir = all_results[kind], str(work / f"shared-{kind}")
    assert len(results) == 4
    calls = read_calls(str(work / f"calls-{kind}"))
    assert Counter(case for _, case in calls) == Counter(range(len(volumes))), calls  # once in all
    reference = results[0]["sums"]
    assert all(r["sums"] == reference for r in results)
    # a node that did not compute an item read it from disk once, and its other process from its memory
    assert sum(r["disk"]["hits"] for r in results) >= len(volumes)
    packs = {n.split(".")[1] for n in os.listdir(cache_dir) if disk_format.is_pack_file(n)}
    assert len(packs) <= 2  # the files of each machine carry its identity
    assert left == [[".lock"], [".lock"]]  # each node's caches (of both kinds) went with its last process
