"""monai_cache under a real one-node Slurm (tests/slurm_cluster.py): however a job ends, nothing is left in its
shared-memory directory; a requeued job with keep_alive computes nothing again; ``srun monai-cache run --`` swaps
MONAI's classes in every task. Each job counts the computations of its items (tests/_scripts/slurm_train.py) and the
directory is listed after it. Two clusters: proctrack/cgroup with ``Epilog=monai-cache-epilog``, and
proctrack/linuxproc with no epilog (there the cache's own processes suffice). Skipped where Slurm cannot run
(tests/test_slurm.py says why)."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass
from typing import Any

import pytest
from slurm_cluster import missing_commands, sbatch, temporary_cluster

MISSING = missing_commands()
REQUIRED = os.environ.get("MONAI_CACHE_REQUIRE_SLURM") == "1"
SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_scripts")
TRAIN = os.path.join(SCRIPTS, "slurm_train.py")
ITEMS = 8

pytestmark = [
    pytest.mark.slurm,
    pytest.mark.skipif(bool(MISSING) and not REQUIRED, reason=f"Slurm not installed (no {', '.join(MISSING)})"),
]


def _cluster(proctrack: str, epilog: bool):
    """A cluster whose jobs keep their caches in a directory of its own (``cluster.shm``; a job that exports
    ``MONAI_CACHE_SHM_DIR=<cluster.jobs_shm>/$SLURM_JOB_ID``, in one of its own), with monai_cache's epilog given the
    job's directory if ``epilog``, and CPUs for the jobs of :func:`test_every_ending_leaves_nothing` to run at once."""
    shm = tempfile.mkdtemp(prefix="mc-test-slurm-", dir="/dev/shm")
    jobs_shm = tempfile.mkdtemp(prefix="mc-test-slurm-jobs-", dir="/dev/shm")
    epilog_dir = tempfile.mkdtemp(prefix="mcsc-", dir="/tmp")
    # Slurm runs it as root with an environment of its own: name the directory, and the package under test (the
    # console script beside this interpreter, not a shim on PATH; PYTHONPATH, not whatever is installed)
    script = os.path.join(epilog_dir, "epilog.sh")
    program = os.path.join(os.path.dirname(sys.executable), "monai-cache-epilog")
    program = program if os.path.exists(program) else shutil.which("monai-cache-epilog")
    with open(script, "w") as f:
        f.write(
            f'#!/bin/sh\nd={jobs_shm}/$SLURM_JOB_ID; [ -d "$d" ] || d={shm}\n'
            f"MONAI_CACHE_SHM_DIR=$d PYTHONPATH={shlex.quote(os.pathsep.join(sys.path))} "
            f"exec {program} >>{epilog_dir}/epilog.log 2>&1\n"
        )
    os.chmod(script, 0o755)
    try:
        with temporary_cluster(proctrack, kill_wait=2, epilog=script if epilog else None, cpus=64) as cluster:
            cluster.env.update({"MONAI_CACHE_SHM_DIR": shm, "PYTHONPATH": os.pathsep.join(sys.path)})
            cluster.shm, cluster.jobs_shm = shm, jobs_shm  # type: ignore[attr-defined]
            yield cluster
    finally:
        shutil.rmtree(epilog_dir, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(jobs_shm, ignore_errors=True)


@pytest.fixture(scope="module")
def slurm():
    yield from _cluster("cgroup", epilog=True)


@pytest.fixture(scope="module")
def slurm_linuxproc():
    yield from _cluster("linuxproc", epilog=False)


def left(cluster, directory: str | None = None) -> list[str]:
    """What the jobs left in a shared-memory directory (default ``cluster.shm``), less the per-user root and its
    lock file."""
    directory = directory or cluster.shm
    root = f"monai_cache-{os.getuid()}"
    out = []
    for d, dirs, files in os.walk(directory):
        out += [os.path.relpath(os.path.join(d, n), directory) for n in dirs + files]
    return sorted(p for p in out if p not in (root, os.path.join(root, ".lock")))


def wait_until(predicate, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout  # a hang guard, not a timing assertion
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def calls(log: str) -> list[int]:
    return sorted(int(x) for x in open(log).read().split()) if os.path.exists(log) else []


def job_states(cluster) -> dict[str, str]:
    """The state of each job slurmctld remembers (those running, and those ended within MinJobAge: 60 s)."""
    out = cluster.run("squeue", "-h", "-t", "all", "-o", "%i %T", timeout=15).stdout
    return dict(line.split() for line in out.splitlines() if line.strip())


JOBS_AT_ONCE = 6  # in training at a time: the machine's CPUs are busy with fewer (each task imports torch and MONAI)
ENDINGS = {  # how a job is ended once its tasks (ranks) trained an epoch -> the state Slurm gives it
    "normal": "COMPLETED",  # the tasks end their epoch and return
    "scancel": "CANCELLED",  # SIGTERM to every process of the job, SIGKILL 5 s later
    "scancel-kill-full": "CANCELLED",  # scancel --full --signal=KILL: every process at once, through the proctrack
    "time-limit": "TIMEOUT",  # Slurm's own time limit: SIGTERM, then SIGKILL
    "one-task-killed": "FAILED",  # SIGKILL to task (rank) 0; srun lets task 1 go on, torchrun's agent stops rank 1
}
ALL = list(range(ITEMS))  # each item computed once
# where the count of tasks (ranks) matters, two: srun's normal end (the last task to leave removes the cache; under
# torchrun the keeper does, whatever the count) and one task killed (the others); one elsewhere
TWO_TASKS = (("srun", "normal"), ("srun", "one-task-killed"), ("torchrun", "one-task-killed"))


@dataclass
class Ending:
    """One job of :func:`test_every_ending_leaves_nothing`: ``srun -n T python train.py`` (launcher "srun") or
    ``srun -n 1 torchrun --nproc-per-node=T train.py`` ("torchrun"), T tasks (ranks) training until it is ended."""

    cluster: Any
    launcher: str
    ending: str
    log: str
    job: str = ""
    ended: bool = False
    held: bool = False  # whether its directory held a cache (a lease) when it was ended

    @property
    def name(self) -> str:
        return f"{self.cluster.proctrack}/{self.launcher}/{self.ending}"

    @property
    def tasks(self) -> int:
        return 2 if (self.launcher, self.ending) in TWO_TASKS else 1

    @property
    def shm(self) -> str:
        return os.path.join(self.cluster.jobs_shm, self.job)

    def submit(self, tmp_path) -> None:
        """sbatch the job; it caches in ``<cluster.jobs_shm>/<job id>``."""
        if self.launcher == "srun":
            srun = f"srun -n {self.tasks} {sys.executable}"
        else:
            srun = f"srun -n 1 {sys.executable} -m torch.distributed.run --standalone --nproc-per-node={self.tasks}"
        # TMPDIR, as sites give each job one: the /tmp/pymp-* directory of a task killed here goes with tmp_path
        body = f"""\
            #!/bin/bash
            export MONAI_CACHE_SHM_DIR={self.cluster.jobs_shm}/$SLURM_JOB_ID TMPDIR={tmp_path}/tmp-$SLURM_JOB_ID
            mkdir -p $MONAI_CACHE_SHM_DIR $TMPDIR
            {srun} {TRAIN} {self.log} until
        """
        cpus = self.tasks if self.launcher == "srun" else 1
        self.job = sbatch(self.cluster, tmp_path, os.path.basename(self.log), body, "-n", str(cpus))

    def ready(self) -> bool:
        return all(os.path.exists(f"{self.log}.ready.{task}") for task in range(self.tasks))

    def end(self) -> None:
        """End the job as ``ending`` says."""
        self.held = any(path.endswith("/lease") for path in left(self.cluster, self.shm))
        if self.ending == "normal":
            open(f"{self.log}.finish", "w").close()
        elif self.ending == "scancel":
            self.cluster.run("scancel", self.job)
        elif self.ending == "scancel-kill-full":
            self.cluster.run("scancel", "--full", "--signal=KILL", self.job)
        elif self.ending == "time-limit":  # a limit already passed: slurmctld times it out at its next look
            self.cluster.run("scontrol", "update", f"JobId={self.job}", "TimeLimit=0")
        else:
            os.kill(int(open(f"{self.log}.ready.0").read()), signal.SIGKILL)
            if self.launcher == "srun":  # KillOnBadExit=0: task 1 goes on; let it end its epoch
                open(f"{self.log}.finish", "w").close()
        self.ended = True


def test_every_ending_leaves_nothing(slurm, slurm_linuxproc, tmp_path):
    """Every way a job ends (ENDINGS), with srun's tasks and with torchrun inside srun, under proctrack/cgroup (with
    the epilog) and proctrack/linuxproc (without): 20 jobs, each with a shared-memory directory of its own, two tasks
    (ranks) where their count matters (TWO_TASKS), one elsewhere. Each computes the 8 items once and holds the cache
    when it is ended; after each, Slurm's record says how it ended and its directory is empty.
    ``time-limit``: the job's limit is set to 0 once it trained, and slurmctld ends it for its time limit (TIMEOUT)
    at its next look (every 30 s, src/slurmctld/controller.c: PERIODIC_TIMEOUT); those jobs go first, and the others
    run meanwhile."""
    runs = [
        Ending(cluster, launcher, ending, str(tmp_path / f"{cluster.proctrack}-{launcher}-{ending}"))
        for ending in sorted(ENDINGS, key=lambda e: e != "time-limit")
        for launcher in ("srun", "torchrun")
        for cluster in (slurm, slurm_linuxproc)
    ]
    waiting, states = list(runs), {}
    deadline = time.monotonic() + 300  # a hang guard
    while len(states) < len(runs):
        assert time.monotonic() < deadline, [run.name for run in runs if run.name not in states]
        while waiting and sum(bool(run.job) and not run.ended for run in runs) < JOBS_AT_ONCE:
            waiting.pop(0).submit(tmp_path)
        for run in runs:
            if run.job and not run.ended and run.ready():
                run.end()
        for cluster in (slurm, slurm_linuxproc):
            watched = [run for run in runs if run.cluster is cluster and run.job and run.name not in states]
            now = job_states(cluster) if watched else {}
            for run in watched:
                if now.get(run.job) not in (None, "PENDING", "RUNNING", "COMPLETING"):
                    states[run.name] = now[run.job]  # ended, its epilog done (or failed before it was ended)
                    run.ended = True
        time.sleep(0.5)
    deadline = time.monotonic() + 15  # a watcher or keeper may still be at work after its job's end
    while any(left(run.cluster, run.shm) for run in runs) and time.monotonic() < deadline:
        time.sleep(0.1)
    outcome = {run.name: (states[run.name], calls(run.log), run.held, left(run.cluster, run.shm)) for run in runs}
    wrong = {run.name: outcome[run.name] for run in runs if outcome[run.name] != (ENDINGS[run.ending], ALL, True, [])}
    assert not wrong, f"(state, computations, held a cache, left) of {len(wrong)} of {len(runs)} jobs: {wrong}"


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
    """keep_alive: a second srun step of the job, then the next job on the node within the window, compute nothing;
    each step's keeper is killed with its step, and the epilog keeps the cache for the window. Once the window has
    passed with the jobs gone, nothing is left."""
    log = str(tmp_path / "calls")
    window = 8  # seconds: long enough for the next job to start within it, short enough to wait out here
    step = f"MONAI_CACHE_KEEP_ALIVE={window} srun -n 2 {sys.executable} {TRAIN} {log} once\n"
    for attempt, steps in enumerate((2, 1)):  # the first job runs two steps in a row
        job = sbatch(slurm, tmp_path, f"attempt{attempt}", "#!/bin/bash\n" + step * steps, "-n", "2")
        assert slurm.wait_jobs_gone([job], timeout=180), slurm.logs()
        assert calls(log) == list(range(ITEMS)), attempt  # the later step and job computed nothing
        assert [p for p in left(slurm) if p.endswith("/keep_alive")], left(slurm)  # kept for the window
    ended = time.monotonic()
    wait_until(lambda: left(slurm) == [], f"left after the window: {left(slurm)}", timeout=window + 20)
    assert time.monotonic() - ended > window / 2  # removed when the window ended, not when the job did


@pytest.mark.skipif(
    os.environ.get("MONAI_CACHE_TEST_SLURM_REQUEUE") != "1",
    reason="Slurm holds a requeued job about 2 minutes before it may start again (set MONAI_CACHE_TEST_SLURM_REQUEUE=1 "
    "to run it: about 3 minutes)",
)
def test_scontrol_requeue_within_keep_alive_computes_nothing_again(slurm, tmp_path):
    """``scontrol requeue`` of a running ``--requeue`` job mid-epoch: the job's step is killed, the epilog keeps the
    cache for the window, and the job, started again on the node once Slurm lets it (its EligibleTime), computes
    nothing."""
    log = str(tmp_path / "calls")
    body = f"#!/bin/bash\nMONAI_CACHE_KEEP_ALIVE=400 srun -n 2 {sys.executable} {TRAIN} {log} until\n"
    job = sbatch(slurm, tmp_path, "requeued", body, "-n", "2", "--requeue")
    ready = [f"{log}.ready.{task}" for task in "01"]
    for attempt in range(2):  # trained an epoch and is in the middle of the next, the first time and the second
        wait_until(lambda: all(os.path.exists(r) for r in ready), f"attempt {attempt} ready", timeout=300)
        assert calls(log) == list(range(ITEMS)), attempt
        for r in ready:
            os.unlink(r)
        if attempt == 0:
            slurm.run("scontrol", "requeue", job)
    assert "Restarts=1" in slurm.run("scontrol", "show", "job", job).stdout  # the same job, run again
    slurm.run("scancel", job)
    assert slurm.wait_jobs_gone([job], timeout=60), slurm.logs()
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
