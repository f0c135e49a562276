"""monai_cache under a real one-node Slurm (tests/slurm_cluster.py): however a job ends, nothing is left in its
shared-memory directory; a requeued job with keep_alive computes nothing again; ``srun monai-cache run --`` swaps
MONAI's classes in every task. Each job counts the computations of its items (tests/_scripts/slurm_train.py) and the
directory is listed after it. The cluster runs proctrack/cgroup with ``Epilog=monai-cache-epilog``; the scancel case
runs under proctrack/linuxproc too. Skipped where Slurm cannot run (tests/test_slurm.py says why)."""

from __future__ import annotations

import os
import shlex
import shutil
import sys
import tempfile
import textwrap
import time

import pytest
from slurm_cluster import missing_commands, temporary_cluster

MISSING = missing_commands()
REQUIRED = os.environ.get("MONAI_CACHE_REQUIRE_SLURM") == "1"
SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_scripts")
TRAIN = os.path.join(SCRIPTS, "slurm_train.py")
ITEMS = 8

pytestmark = [
    pytest.mark.slurm,
    pytest.mark.skipif(bool(MISSING) and not REQUIRED, reason=f"Slurm not installed (no {', '.join(MISSING)})"),
]


def _cluster(proctrack: str):
    """A cluster whose jobs keep their caches in a directory of its own, with monai_cache's epilog."""
    shm = tempfile.mkdtemp(prefix="mc-test-slurm-", dir="/dev/shm")
    epilog_dir = tempfile.mkdtemp(prefix="mcsc-", dir="/tmp")
    # Slurm runs it as root with an environment of its own: name the directory, and the package under test (the
    # console script beside this interpreter, not a shim on PATH; PYTHONPATH, not whatever is installed)
    epilog = os.path.join(epilog_dir, "epilog.sh")
    program = os.path.join(os.path.dirname(sys.executable), "monai-cache-epilog")
    program = program if os.path.exists(program) else shutil.which("monai-cache-epilog")
    with open(epilog, "w") as f:
        f.write(
            f"#!/bin/sh\nMONAI_CACHE_SHM_DIR={shm} PYTHONPATH={shlex.quote(os.pathsep.join(sys.path))} "
            f"exec {program} >>{epilog_dir}/epilog.log 2>&1\n"
        )
    os.chmod(epilog, 0o755)
    try:
        with temporary_cluster(proctrack, kill_wait=2, epilog=epilog) as cluster:
            cluster.env.update({"MONAI_CACHE_SHM_DIR": shm, "PYTHONPATH": os.pathsep.join(sys.path)})
            cluster.shm = shm  # type: ignore[attr-defined]
            yield cluster
    finally:
        shutil.rmtree(epilog_dir, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)


@pytest.fixture(scope="module")
def slurm():
    yield from _cluster("cgroup")


@pytest.fixture(scope="module")
def slurm_linuxproc():
    yield from _cluster("linuxproc")


def left(cluster) -> list[str]:
    """What the jobs left in their shared-memory directory (not the per-user root and its lock file)."""
    root = f"monai_cache-{os.getuid()}"
    out = []
    for d, dirs, files in os.walk(cluster.shm):
        out += [os.path.relpath(os.path.join(d, n), cluster.shm) for n in dirs + files]
    return sorted(p for p in out if p not in (root, os.path.join(root, ".lock")))


def wait_until(predicate, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout  # a hang guard, not a timing assertion
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def calls(log: str) -> list[int]:
    return sorted(int(x) for x in open(log).read().split()) if os.path.exists(log) else []


def sbatch(cluster, tmp_path, name: str, body: str, *options: str) -> str:
    script = tmp_path / f"{name}.sh"
    script.write_text("#!/bin/bash\n" + textwrap.dedent(body))
    out = cluster.run("sbatch", "--parsable", "-J", name, "-o", str(tmp_path / f"{name}.out"), *options, str(script))
    return out.stdout.strip().split(";")[0]


def test_srun_tasks_end_normally_and_leave_nothing(slurm, tmp_path):
    log = str(tmp_path / "calls")
    out = slurm.run("srun", "-n", "2", sys.executable, TRAIN, log, "once", timeout=180, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    assert calls(log) == list(range(ITEMS))  # 2 tasks, 8 computations: one cache for the node
    assert left(slurm) == []


@pytest.mark.parametrize("signal_name", ["TERM", "KILL"])
def test_scancel_leaves_nothing(slurm, tmp_path, signal_name):
    """scancel (what a time limit does too: SIGTERM, then SIGKILL): the watcher removes the cache once the tasks are
    dead. ``scancel --signal=KILL --full``: every process of the job at once, the watcher too: Slurm's Epilog runs
    monai-cache-epilog, which removes the job's cache."""
    log = str(tmp_path / "calls")
    job = sbatch(slurm, tmp_path, "train", f"srun -n 2 {sys.executable} {TRAIN} {log} forever\n", "-n", "2")
    wait_until(lambda: os.path.exists(f"{log}.ready.0") and os.path.exists(f"{log}.ready.1"), "the job trained")
    assert [p for p in left(slurm) if p.endswith("/lease")], left(slurm)
    args = ["--full", "--signal=KILL"] if signal_name == "KILL" else []
    slurm.run("scancel", *args, job)
    assert slurm.wait_jobs_gone([job], timeout=30), slurm.logs()
    wait_until(lambda: left(slurm) == [], f"left after scancel: {left(slurm)}", timeout=15)
    assert calls(log) == list(range(ITEMS))


def test_scancel_under_linuxproc_leaves_nothing(slurm_linuxproc, tmp_path):
    log = str(tmp_path / "calls")
    job = sbatch(slurm_linuxproc, tmp_path, "train", f"srun -n 2 {sys.executable} {TRAIN} {log} forever\n", "-n", "2")
    wait_until(lambda: os.path.exists(f"{log}.ready.0") and os.path.exists(f"{log}.ready.1"), "the job trained")
    slurm_linuxproc.run("scancel", job)
    assert slurm_linuxproc.wait_jobs_gone([job], timeout=30), slurm_linuxproc.logs()
    wait_until(lambda: left(slurm_linuxproc) == [], f"left: {left(slurm_linuxproc)}", timeout=15)


def test_torchrun_inside_srun_leaves_nothing(slurm, tmp_path):
    """srun -n 1 torchrun --nproc-per-node=2: the keeper holds the cache while torchrun's agent lives; the step's end
    kills it under proctrack/cgroup, and the epilog removes what it held."""
    log = str(tmp_path / "calls")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    out = slurm.run("srun", "-n", "1", *torchrun, TRAIN, log, "once", timeout=240, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    assert calls(log) == list(range(ITEMS))
    wait_until(lambda: slurm.wait_jobs_gone(timeout=1) and left(slurm) == [], f"left: {left(slurm)}", timeout=20)


def test_torchrun_restart_inside_srun_finds_the_cache(slurm, tmp_path):
    """srun -n 1 torchrun --max-restarts=1: rank 0 fails after its first epoch, torchrun restarts both ranks, and they
    find every entry (8 computations over both attempts): the keeper, in the step's cgroup, outlives the restart."""
    log = str(tmp_path / "calls")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=1"]
    out = slurm.run("srun", "-n", "1", *torchrun, TRAIN, log, "crash-once", timeout=240, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    assert sorted(open(f"{log}.starts").read().split("\n")[:-1]) == ["0 0", "0 1", "1 0", "1 1"]  # two attempts
    assert calls(log) == list(range(ITEMS))
    wait_until(lambda: slurm.wait_jobs_gone(timeout=1) and left(slurm) == [], f"left: {left(slurm)}", timeout=20)


def test_requeued_job_with_keep_alive_computes_nothing_again(slurm, tmp_path):
    """keep_alive=60: the first job ends (its keeper killed with its step); the epilog keeps the cache for the window;
    the next job on the node, within it, computes nothing."""
    log = str(tmp_path / "calls")
    body = f"MONAI_CACHE_KEEP_ALIVE=60 srun -n 2 {sys.executable} {TRAIN} {log} once\n"
    for attempt in range(2):
        job = sbatch(slurm, tmp_path, f"attempt{attempt}", body, "-n", "2")
        assert slurm.wait_jobs_gone([job], timeout=180), slurm.logs()
        assert calls(log) == list(range(ITEMS)), attempt  # the second job computed nothing
        assert [p for p in left(slurm) if p.endswith("/keep_alive")], left(slurm)  # kept for the window
    from monai_cache.shm import list_caches, remove_cache

    for cache in list_caches(slurm.shm):  # the window outlasts the test: clear it
        remove_cache(cache["key"], slurm.shm, force=True)
    wait_until(lambda: left(slurm) == [], f"left: {left(slurm)}", timeout=15)


def test_srun_monai_cache_run_swaps_the_classes_in_every_task(slurm, tmp_path):
    """srun -n 2 monai-cache run -- python stock.py: a stock script (monai.data.CacheDataset) computes each item once
    for the node. Each task waits for the other to hold the cache before reading it, as a process group's first
    collective would: otherwise a loaded machine may start one task after the other left, and the cache with it."""
    log = tmp_path / "calls"
    stock = tmp_path / "stock.py"
    stock.write_text(
        textwrap.dedent(f"""
        import os, time
        import monai.data, monai.transforms as mt, numpy as np
        class Counted(mt.MapTransform):
            def __call__(self, d):
                open({str(log)!r}, "a").write(f"{{int(d['case'])}}\\n")
                return dict(d)
        data = [{{"image": np.full((4, 8, 8), i, np.float32), "case": i}} for i in range({ITEMS})]
        ds = monai.data.CacheDataset(data, mt.Compose([Counted(keys="image"), mt.RandFlipd(keys="image", prob=0.5)]),
                                     runtime_cache=True, progress=False)
        assert type(ds).__module__.startswith("monai_cache"), type(ds)
        open({str(log)!r} + ".joined." + os.environ["SLURM_PROCID"], "w").close()
        while not all(os.path.exists({str(log)!r} + f".joined.{{task}}") for task in range(2)):
            time.sleep(0.05)
        for _ in monai.data.DataLoader(ds, batch_size=2, num_workers=1):
            pass
    """)
    )
    out = slurm.run("srun", "-n", "2", "monai-cache", "run", "--", sys.executable, str(stock), timeout=180, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    assert calls(str(log)) == list(range(ITEMS))  # stock MONAI: 16
    wait_until(lambda: left(slurm) == [], f"left: {left(slurm)}", timeout=15)
