"""The shared-memory cache within a container's memory limit: a real memory cgroup (v1 or v2, as Docker ``--memory``
and Kubernetes pod limits set), real tmpfs pages charged to it, real DataLoader worker processes.

A cache larger than the limit allows: nothing is killed, the items are MONAI's, and one warning says so early,
naming the limit; an explicit ``shm_budget`` above the limit is warned about. Also what ``memory_limits`` reads of a
cgroup, and the early warning's projection on a real small tmpfs.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap
import uuid
import warnings

import pytest
import torch
from helpers import as_slurm_task, mounted_tmpfs

from monai_cache import CacheFullWarning
from monai_cache.memory_limits import cgroup_memory, memory_reserve, read_machine
from monai_cache.shm import SharedMemoryStore

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MB = 1_000_000
MIB = 1 << 20


@contextlib.contextmanager
def memory_cgroup(limit: int):
    """A new memory cgroup limited to ``limit`` bytes: ``(directory, version)``; v2 where the machine has the memory
    controller there, v1 otherwise. Skips the test where none can be made (not root, no memory controller)."""
    name = f"monai-cache-test-{uuid.uuid4().hex[:8]}"
    candidates = [("/sys/fs/cgroup", 2, "memory.max"), ("/sys/fs/cgroup/unified", 2, "memory.max"),
                  ("/sys/fs/cgroup/memory", 1, "memory.limit_in_bytes")]  # fmt: skip
    made = None
    for root, version, limit_file in candidates:
        if version == 2:
            with contextlib.suppress(OSError), open(os.path.join(root, "cgroup.subtree_control")) as f:
                if "memory" not in f.read().split():
                    continue
        if not os.path.isfile(os.path.join(root, "cgroup.procs")) or (version == 1 and not os.path.isfile(
                os.path.join(root, limit_file))):  # fmt: skip
            continue
        try:
            os.mkdir(os.path.join(root, name))
        except OSError:
            continue
        try:
            with open(os.path.join(root, name, limit_file), "w") as f:
                f.write(str(limit))
        except OSError:
            os.rmdir(os.path.join(root, name))
            continue
        made = (os.path.join(root, name), version)
        break
    if made is None:
        pytest.skip("cannot create a memory cgroup with a limit here (needs root and a memory controller)")
    try:
        yield made
    finally:
        with contextlib.suppress(OSError):
            os.rmdir(made[0])


def oom_kills(directory: str, version: int) -> int:
    name, key = ("memory.oom_control", "oom_kill") if version == 1 else ("memory.events", "oom_kill")
    with open(os.path.join(directory, name)) as f:
        for line in f:
            if line.split()[0] == key:
                return int(line.split()[1])
    return 0


def run_in_cgroup(directory: str, code: str, env: dict, timeout: float = 240) -> subprocess.CompletedProcess:
    """Run ``code`` in a new interpreter that first moves itself into the cgroup (as a container's processes are)."""
    script = f'echo $$ > {directory}/cgroup.procs && exec "{sys.executable}" -c "$0"'
    return subprocess.run(["sh", "-c", script, code], env=env, capture_output=True, text=True, timeout=timeout)


ITEMS = 20
ITEM_BYTES = 25 * MIB  # 500 MiB in all, under a 700 MB limit that the interpreter's ~300 MB share

CHILD = textwrap.dedent(
    """
    import hashlib, json, sys, warnings
    sys.path.insert(0, {tests!r})
    import monai.data, torch
    from monai.transforms import Transform
    import monai_cache

    class Volume(Transform):  # deterministic: a 25 MiB item from its number
        def __call__(self, i):
            g = torch.Generator().manual_seed(int(i))
            return {{"image": torch.rand({numel}, generator=g), "case": int(i)}}

    torch.set_num_threads(1)
    warnings.simplefilter("always")  # to stderr, from the main process and the DataLoader workers alike
    ds = monai_cache.CacheDataset(list(range({items})), Volume(), progress=False, runtime_cache={runtime})
    loader = monai.data.DataLoader(ds, batch_size=1, num_workers={workers})
    digests = [hashlib.sha256(batch["image"][0].numpy().tobytes()).hexdigest() for batch in loader]
    stats = ds.cache_stats()
    print(json.dumps({{"digests": digests, "entries": stats["stored"]["entries"]}}))
    ds.release()
    """
)


def monais_digests(numel: int) -> list[str]:
    """The same items from MONAI's Dataset (uncached), outside the cgroup."""
    import hashlib

    import monai.data
    from monai.transforms import Transform

    class Volume(Transform):
        def __call__(self, i):
            g = torch.Generator().manual_seed(int(i))
            return {"image": torch.rand(numel, generator=g), "case": int(i)}

    reference = monai.data.Dataset(list(range(ITEMS)), Volume())
    return [hashlib.sha256(reference[i]["image"].numpy().tobytes()).hexdigest() for i in range(ITEMS)]


@pytest.mark.slow
@pytest.mark.parametrize("runtime_cache, workers", [(False, 0), (True, 2)], ids=["eager", "on-the-fly-2-workers"])
def test_a_cache_larger_than_the_cgroup_limit_is_never_killed(shm_dir, runtime_cache, workers):
    """Before this, 20 items of 25 MiB under a 700 MB limit were OOM-killed (exit 137, the memory cgroup's OOM
    killer) with no warning; MONAI's own CacheDataset is killed too (it holds every item). Uncached, the same job
    peaks at about 430 MB."""
    code = CHILD.format(tests=os.path.join(REPO, "tests"), numel=ITEM_BYTES // 4, items=ITEMS, runtime=runtime_cache,
                        workers=workers)  # fmt: skip
    with memory_cgroup(700 * MB) as (directory, version):
        env = {**os.environ, "MONAI_CACHE_SHM_DIR": shm_dir, "PYTHONPATH": REPO}
        result = run_in_cgroup(directory, code, env)
        kills = oom_kills(directory, version)
        subprocess.run(["rm", "-rf", shm_dir + "/"], check=False)  # uncharge the tmpfs pages before the rmdir
    assert result.returncode == 0 and kills == 0, (result.returncode, kills, result.stderr[-3000:])
    out = json.loads(result.stdout.strip().splitlines()[-1])
    expected = monais_digests(ITEM_BYTES // 4)
    assert out["digests"] == expected  # an epoch: the cached items, then the uncached ones, computed on each read
    assert 0 < out["entries"] < ITEMS  # some cached, not all: the limit, not the tmpfs (GiBs free), stopped it
    warned = [line for line in result.stderr.splitlines() if "CacheFullWarning" in line]
    assert len(warned) == 1, result.stderr[-3000:]  # once, from whichever process of the job saw it first
    assert "memory cgroup limit" in warned[0] and "--memory=" in warned[0]


def test_reading_a_real_cgroup(tmp_path):
    with memory_cgroup(300 * MB) as (directory, _version):
        code = ("from monai_cache.memory_limits import cgroup_memory as c, read_machine as m; g = c(); "
                "print(g.path, g.limit, g.usage, len([n for n, _ in m('/dev/shm').limits() if n == CGROUP]))"
                ).replace("CGROUP", repr(CGROUP_LIMIT))  # fmt: skip
        result = run_in_cgroup(directory, code, {**os.environ, "PYTHONPATH": REPO}, timeout=60)
    assert result.returncode == 0, result.stderr
    path, limit, usage, named = result.stdout.split()
    assert path == directory and int(limit) == 300 * MB - 300 * MB % 4096 and 0 < int(usage) < int(limit)
    assert named == "1"  # the machine's limits name the cgroup's


PAGE_CACHE_CHILD = textwrap.dedent(
    """
    import json, os, sys, warnings
    import torch
    from monai_cache import CacheFullWarning
    from monai_cache.memory_limits import cgroup_memory
    from monai_cache.shm import SharedMemoryStore

    with open({data!r}, "rb") as f:  # the job reads its data: the page cache is charged to its cgroup
        while f.read(1 << 22):
            pass
    page_cache = cgroup_memory().inactive_file
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        store = SharedMemoryStore("page-cache", {items}, shm_dir={shm_dir!r}, reserve=0)
        for i in range({items}):
            store[i] = {{"image": torch.full(({numel},), float(i))}}
        stored = store.stats()["stored"]["entries"]
        right = sum(store[i] is not None and bool((store[i]["image"] == i).all()) for i in range({items}))
        store.release()
    full = [str(w.message) for w in caught if issubclass(w.category, CacheFullWarning)]
    print(json.dumps({{"page_cache": page_cache, "stored": stored, "right": right, "full": full}}))
    """
)


def test_page_cache_the_job_read_leaves_room_for_the_cache(shm_dir, tmp_path):
    """In a container that read its data set, the kernel charges those files' page cache to the container's cgroup,
    and takes it back before it kills anything: it is room for the cache. A job that read 300 MB of files under a
    600 MB limit caches 8 entries of 16 MiB (134 MB) in full, with no warning. (Counted as used, the page cache
    leaves no room: with memory.stat's field misread, no entry was stored and the cache said it was full.)"""
    data = tmp_path / "volumes.bin"
    with open(data, "wb") as f:
        for _ in range(300):
            f.write(os.urandom(MB))
        f.flush()
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)  # dropped: read below, inside the cgroup
    code = PAGE_CACHE_CHILD.format(data=str(data), items=8, numel=16 * MIB // 4, shm_dir=shm_dir)
    with memory_cgroup(600 * MB) as (directory, version):
        result = run_in_cgroup(directory, code, {**os.environ, "PYTHONPATH": REPO}, timeout=120)
        kills = oom_kills(directory, version)
        subprocess.run(["rm", "-rf", shm_dir + "/"], check=False)  # uncharge the tmpfs pages before the rmdir
    assert result.returncode == 0 and kills == 0, (result.returncode, kills, result.stderr[-3000:])
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["page_cache"] > 250 * MB, out  # the files read are charged, as reclaimable page cache
    assert out["stored"] == 8 and out["right"] == 8 and out["full"] == [], out


CGROUP_LIMIT = "the memory cgroup limit"


def tightest_limit_over_this_process() -> int | None:
    """The least memory limit set on this process's memory cgroup or an ancestor, read independently of
    ``memory_limits``: from ``/proc/self/cgroup`` and the usual mount points (``/sys/fs/cgroup/memory`` for v1,
    ``/sys/fs/cgroup`` for v2; a cgroup namespace shows the process's own cgroup at the mount itself)."""
    limits = []
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            if "memory" in controllers.split(","):
                mount, name = "/sys/fs/cgroup/memory", "memory.limit_in_bytes"
            elif controllers == "" and os.path.isfile("/sys/fs/cgroup/cgroup.controllers"):
                mount, name = "/sys/fs/cgroup", "memory.max"
            else:
                continue
            directory = os.path.join(mount, path.lstrip("/"))
            directory = directory if os.path.isdir(directory) else mount
            while True:
                with contextlib.suppress(OSError, ValueError), open(os.path.join(directory, name)) as lf:
                    text = lf.read().strip()
                    if text != "max" and int(text) < 1 << 60:  # v1 writes "no limit" as about 2**63
                        limits.append(int(text))
                if os.path.normpath(directory) == mount:
                    break
                directory = os.path.dirname(directory)
    return min(limits) if limits else None


def test_the_cgroup_limit_is_named_exactly_when_there_is_one():
    """This process's own cgroups, limited or not (a limited one made for the purpose: test_reading_a_real_cgroup)."""
    machine = read_machine("/dev/shm")
    expected = tightest_limit_over_this_process()
    group = cgroup_memory()
    names = [name for name, _room in machine.limits()]
    if expected is None:
        assert group is None and CGROUP_LIMIT not in names, group
    else:
        assert group is not None and group.limit == expected and CGROUP_LIMIT in names, (group, expected)
    assert machine.mem_available and machine.tmpfs_total > 0
    assert names[0] == "the free space of the tmpfs" and "the memory available (MemAvailable)" in names
    assert memory_reserve(600 * MB) == 150 * MB and memory_reserve(16 << 30) == (16 << 30) // 10


def test_explicit_budget_above_the_machine_is_warned_once(shm_dir):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        stores = [SharedMemoryStore("big-budget", 4, budget="64TiB") for _ in range(2)]  # two users of one cache
    messages = [str(w.message) for w in caught if issubclass(w.category, CacheFullWarning)]
    assert len(messages) == 1 and "shm_budget=64.0 TiB is more than the machine offers" in messages[0]
    for store in stores:
        store.release()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a budget within the machine is not warned about
        SharedMemoryStore("small-budget", 4, budget="1MiB").release()


def test_budget_warning_once_per_node_in_slurm_tasks_without_torchrun(shm_dir, monkeypatch):
    """Ranks that srun started, as Lightning's SLURMEnvironment leaves them (Slurm's variables only): the node's
    second task says nothing, its first says it once."""
    said, stores = [], []
    for local_id in (1, 0, 0):  # users of one cache: the second task, the first, the first again
        as_slurm_task(monkeypatch, 2 + local_id, local_id, 1, "2(x2)")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            stores.append(SharedMemoryStore("slurm-budget", 4, budget="64TiB"))
        said.append(len([w for w in caught if issubclass(w.category, CacheFullWarning)]))
    for store in stores:
        store.release()
    assert said == [0, 1, 0]


def test_early_warning_projects_the_whole_cache_from_its_first_entries(tmp_path):
    """On a real 8 MiB tmpfs, 40 entries of 400 KB (16 MB) will not fit: one warning after the 4th entry, with the
    projection and the settings that would give room, and none when the cache is then full."""
    with mounted_tmpfs(str(tmp_path / "tmpfs"), "size=8m") as mount:
        store = SharedMemoryStore("projected", 40, shm_dir=mount, reserve=0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for i in range(40):
                store.get_or_compute(i, lambda i=i: {"x": torch.full((100_000,), float(i))})
                if i == 3:
                    early = [str(w.message) for w in caught]
        messages = [str(w.message) for w in caught if issubclass(w.category, CacheFullWarning)]
        assert len(messages) == 1 and early == messages  # said after the 4th entry, and only then
        assert "will not fit: its 40 entries need about 15.3 MiB (projected from the first 4" in messages[0]
        assert "--shm-size=1g" in messages[0] and "sizeLimit: 1Gi" in messages[0]
        assert 0 < store.stats()["stored"]["entries"] < 40
        store.release()
