"""Against a real one-node Slurm on 127.0.0.1 (tests/slurm_cluster.py): srun's tasks, scancel of a batch job
(SIGTERM, then SIGKILL after KillWait), and which processes a step's end kills under proctrack/cgroup and under
proctrack/linuxproc. Skipped where Slurm and munge are not installed (``apt-get install slurm-wlm munge``; .ci/run
installs them) or cannot run here (not root, no cgroup v1 freezer); MONAI_CACHE_REQUIRE_SLURM=1 makes that a
failure instead (.ci/run sets it wherever Slurm is installed). The daemons start once per module for each proctrack
plugin (well under a second here)."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest
from slurm_cluster import missing_commands, sbatch, temporary_cluster

MISSING = missing_commands()
REQUIRED = os.environ.get("MONAI_CACHE_REQUIRE_SLURM") == "1"
KILL_WAIT = 2  # slurm.conf's KillWait; a cancelled job's SIGKILL still comes 5 s after its SIGTERM (below)

pytestmark = [
    pytest.mark.slurm,
    pytest.mark.skipif(
        bool(MISSING) and not REQUIRED,
        reason=f"Slurm not installed (no {', '.join(MISSING)}): apt-get install slurm-wlm munge",
    ),
]


def _cluster(proctrack: str):
    with temporary_cluster(proctrack, kill_wait=KILL_WAIT) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def slurm():
    """A cluster with proctrack/cgroup (cgroup/v1: the freezer hierarchy)."""
    yield from _cluster("cgroup")


@pytest.fixture(scope="module")
def slurm_linuxproc():
    yield from _cluster("linuxproc")


def _wait_for(predicate, timeout: float, what: str, cluster=None):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            logs = f"\n{cluster.logs()}" if cluster is not None else ""
            raise AssertionError(f"timed out after {timeout} s: {what}{logs}")
        time.sleep(0.05)


def _alive(pid: int, marker: str) -> bool:
    """Whether ``pid`` is a live process (not a zombie) whose command line holds ``marker``."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read().decode(errors="replace")
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return marker in cmdline and state not in ("Z", "X")


def test_srun_two_tasks(slurm):
    out = slurm.run("srun", "-n", "2", sys.executable, "-c", "import os; print(os.environ['SLURM_PROCID'])", timeout=60)
    assert sorted(out.stdout.split()) == ["0", "1"], out


def test_scancel_sleeping_batch_job(slurm, tmp_path):
    """A cancelled job does not reach its end: the file it writes there never appears; squeue forgets it at once."""
    started, finished = tmp_path / "started", tmp_path / "finished"
    job = sbatch(
        slurm,
        tmp_path,
        "sleeper",
        f"""
        #!/bin/bash
        touch {started}
        sleep 120
        touch {finished}
    """,
        "-D",
        str(tmp_path),
    )
    _wait_for(started.exists, 30, f"job {job} running", slurm)
    t0 = time.monotonic()
    slurm.run("scancel", job)
    assert slurm.wait_jobs_gone([job], timeout=5), (slurm.run("squeue").stdout, slurm.logs())
    gone_after = time.monotonic() - t0
    time.sleep(0.5)
    assert not finished.exists()
    assert gone_after < 5
    state = slurm.run("scontrol", "show", "job", job).stdout
    assert "JobState=CANCELLED" in state, state


def test_scancel_sigterm_then_sigkill_after_killwait(slurm, tmp_path):
    """scancel: SIGCONT and SIGTERM to every process of the job at once, then SIGKILL to what is left (here a job
    that catches SIGTERM and keeps beating) after max(KillWait, 5) seconds: slurmd's REQUEST_TERMINATE_JOB waits
    ``MAX(conf->kill_wait, 5)`` (Slurm 22.05, src/slurmd/slurmd/req.c), so a KillWait under 5 s does not shorten it
    (seen: 4.7 s for KillWait=0, 2 and 5; 7.7 s for KillWait=8)."""
    events, beat = tmp_path / "events", tmp_path / "beat"
    job = sbatch(
        slurm,
        tmp_path,
        "stubborn",
        f"""
        #!{sys.executable}
        import signal, time
        def term(*_):
            with open({str(events)!r}, "a") as f:
                f.write(f"TERM {{time.time()}}\\n")
        signal.signal(signal.SIGTERM, term)
        with open({str(events)!r}, "a") as f:
            f.write(f"START {{time.time()}}\\n")
        while True:
            with open({str(beat)!r} + ".tmp", "w") as f:
                f.write(str(time.time()))
            __import__("os").replace({str(beat)!r} + ".tmp", {str(beat)!r})
            time.sleep(0.05)
    """,
        "-D",
        str(tmp_path),
    )
    _wait_for(beat.exists, 30, f"job {job} beating", slurm)
    cancelled = time.time()
    slurm.run("scancel", job)
    assert slurm.wait_jobs_gone([job], timeout=KILL_WAIT + 10), slurm.logs()
    time.sleep(0.3)
    lines = events.read_text().split()
    terms = [float(t) for kind, t in zip(lines[::2], lines[1::2]) if kind == "TERM"]
    last_beat = float(beat.read_text())
    assert len(terms) == 1, lines  # one SIGTERM, caught
    assert terms[0] - cancelled < 1.0, (cancelled, terms)
    # then killed (SIGKILL cannot be caught) the grace period after the SIGTERM
    grace = max(KILL_WAIT, 5)
    assert grace - 1.0 < last_beat - terms[0] < grace + 2, (terms[0], last_beat)
    state = slurm.run("scontrol", "show", "job", job).stdout
    assert "JobState=CANCELLED" in state, state


STEP_WITH_DETACHED_CHILD = """\
setsid {python} -c 'import os, sys, time; open(sys.argv[2], "w").write(str(os.getpid())); time.sleep(60)' \
    {marker} {pidfile} >/dev/null 2>&1 < /dev/null &
while [ ! -s {pidfile} ]; do sleep 0.02; done
exit 0
"""


def _step_with_detached_child(cluster, tmp_path, marker: str) -> int:
    """Run a step whose one task starts a grandchild in a session of its own (``setsid ... &``) and exits at once;
    the grandchild's pid."""
    pidfile = tmp_path / "detached.pid"
    script = STEP_WITH_DETACHED_CHILD.format(python=sys.executable, marker=marker, pidfile=pidfile)
    out = cluster.run("srun", "-n", "1", "bash", "-c", script, timeout=60, check=False)
    assert out.returncode == 0, (out, cluster.logs())
    return int(pidfile.read_text())


def test_cgroup_kills_detached_grandchild_at_step_end(slurm, tmp_path):
    """proctrack/cgroup: the step's end SIGKILLs every process of its cgroup, one that left the process tree with
    setsid too."""
    marker = f"mc-detached-cgroup-{os.getpid()}-{time.monotonic_ns()}"
    pid = _step_with_detached_child(slurm, tmp_path, marker)
    try:
        _wait_for(lambda: not _alive(pid, marker), 10, f"detached pid {pid} killed at the step's end", slurm)
    finally:
        if _alive(pid, marker):
            os.kill(pid, signal.SIGKILL)


def test_linuxproc_lets_detached_grandchild_survive(slurm_linuxproc, tmp_path):
    """proctrack/linuxproc follows the process tree: a grandchild reparented away (setsid, its parent gone)
    escapes the step's end and lives on. This is why a cache's own processes must not rely on Slurm to end them
    under linuxproc (and do under cgroup)."""
    marker = f"mc-detached-linuxproc-{os.getpid()}-{time.monotonic_ns()}"
    pid = _step_with_detached_child(slurm_linuxproc, tmp_path, marker)
    try:
        assert slurm_linuxproc.wait_jobs_gone(timeout=10)
        time.sleep(1.0)  # the step and its job have ended; still alive a while later
        assert _alive(pid, marker)
    finally:
        if _alive(pid, marker):
            os.kill(pid, signal.SIGKILL)
