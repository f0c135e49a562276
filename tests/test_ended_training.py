"""However a training ends, its shared-memory cache goes within seconds: the cache's watcher (monai_cache.keeper).

Real trainings (monai_cache.CacheDataset through monai.data.DataLoader with forked workers) in process groups of their
own, ended by real signals, and real caches left by processes killed outright (a Slurm step's cgroup killed) for
``monai-cache epilog``. The trainings share one interpreter (tests/_scripts/ended_training.py forks them).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from helpers import kill_watcher, watcher_pid

from monai_cache import keeper
from monai_cache.shm_directory import cache_root

SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_scripts")
ENDINGS = ("kill-main", "kill-group", "kill-worker", "sigterm", "sigterm-handler")
PY = sys.executable


@pytest.fixture(scope="module")
def ended(tmp_path_factory):
    path = f"/dev/shm/mc-test-ended-{os.getpid()}"
    os.makedirs(path, exist_ok=True)
    try:
        r = subprocess.run(
            [PY, os.path.join(SCRIPTS, "ended_training.py"), path, ",".join(ENDINGS)],
            capture_output=True, text=True, timeout=240,
        )  # fmt: skip
        assert r.returncode == 0, r.stderr[-3000:]
        yield json.loads(r.stdout.strip().splitlines()[-1])
    finally:
        subprocess.run(["rm", "-rf", path], check=False)


@pytest.mark.parametrize("ending", ["kill-main", "kill-group", "kill-worker"])
def test_a_killed_training_leaves_nothing_within_seconds(ended, ending):
    """MONAI Label's stop button (SIGKILL of the training), its process group, one of its DataLoader workers."""
    out = ended[ending]
    assert out["before"], out  # it had a cache
    assert out["exit"] == (1 if ending == "kill-worker" else -signal.SIGKILL), out
    assert out["gone_after"] is not None and out["gone_after"] <= 5 * keeper.WATCH_SECONDS + 5.0, out
    assert out["left"] == [], out


def test_sigterm_ends_the_training_as_before_and_leaves_nothing(ended):
    """scancel, a time limit, docker stop, a server stopped by SIGTERM: the process dies by the signal as without us
    (no handler of ours), its own handler runs and keeps its effect, and the cache goes."""
    plain, chained = ended["sigterm"], ended["sigterm-handler"]
    assert plain["exit"] == chained["exit"] == -signal.SIGTERM, (plain, chained)
    assert chained["handler_ran"] and not plain["handler_ran"]
    for out in (plain, chained):
        assert out["before"] and out["gone_after"] is not None and out["left"] == [], out


# a user of a cache that reports its path, then waits; killed with its watcher it leaves a stale cache
USER = textwrap.dedent(
    """
    import sys, time, torch
    from monai_cache.shm import SharedMemoryStore
    s = SharedMemoryStore(sys.argv[1], 2, keep_warm=sys.argv[2:] == ["keep"])
    s[0] = {"x": torch.ones(1000)}
    print(s.path, flush=True)
    time.sleep(120)
    """
)


def _users(
    shm_dir: str, jobs: dict[str, str | None], keep_warm: bool = False
) -> dict[str, tuple[subprocess.Popen, str]]:
    """Start a user per cache key (with ``SLURM_JOB_ID`` as given) at once; each once its cache exists."""
    procs = {}
    for key, job in jobs.items():
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        env.update({"MONAI_CACHE_SHM_DIR": shm_dir, **({"SLURM_JOB_ID": job} if job else {})})
        argv = [PY, "-c", USER, key, *(["keep"] if keep_warm else [])]
        procs[key] = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env)
    return {key: (p, p.stdout.readline().strip()) for key, p in procs.items()}  # type: ignore[union-attr]


def test_the_watcher_outlives_sigterm_and_goes_with_its_cache(shm_dir):
    users = _users(shm_dir, {"watched": None})
    proc, path = users["watched"]
    try:
        watcher = watcher_pid(path)
        os.kill(watcher, signal.SIGTERM)  # the signal that ends a job reaches the watcher too: it stays
        time.sleep(2 * keeper.WATCH_SECONDS)
        assert keeper.watching(path) and os.path.isdir(path)
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 10
    while (os.path.exists(path) or keeper.watching(path) or os.path.exists(f"/proc/{watcher}")) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.05)
    assert not os.path.exists(path)
    with contextlib.suppress(FileNotFoundError):
        assert open(f"/proc/{watcher}/stat").read().split(") ")[1][0] == "Z"  # exited (not reaped by init yet)


def test_epilog_removes_exactly_the_ended_jobs_caches(shm_dir):
    """A Slurm step's cgroup killed with SIGKILL: every process dies at once, the watcher too. `monai-cache epilog`
    (Slurm's Epilog, as root, or TaskEpilog) removes that job's caches nobody uses, and nothing else: not another job's
    stale cache, not a cache of the job still in use by another job's process, not another user's."""
    users = _users(shm_dir, {"ended-job": "41", "other-job": "42", "shared": "41"})
    paths = {key: path for key, (_p, path) in users.items()}
    # the shared cache is used by a process of job 43 as well, which lives on
    live = _users(shm_dir, {"shared": "43"})["shared"][0]
    try:
        for key in ("ended-job", "other-job", "shared"):  # the step's cgroup killed: the watcher with the rest
            kill_watcher(paths[key])
            users[key][0].kill()
            users[key][0].wait()
        assert all(os.path.isdir(p) for p in paths.values())
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        # as Slurm's Epilog runs it: root, with the job's user; another user's job touches nothing of ours
        r = subprocess.run(
            ["monai-cache-epilog"], capture_output=True, text=True, timeout=60,
            env={**env, "SLURM_JOB_ID": "41", "SLURM_JOB_UID": "65534", "MONAI_CACHE_SHM_DIR": shm_dir},
        )  # fmt: skip
        assert r.returncode == 0, r.stderr
        assert all(os.path.isdir(p) for p in paths.values())
        r = subprocess.run(
            [PY, "-m", "monai_cache", "epilog", "--job", "41", "--shm-dir", shm_dir],
            capture_output=True, text=True, timeout=60, env=env,
        )  # fmt: skip
        assert r.returncode == 0, r.stderr
        assert "ended-job" in r.stdout and "other-job" not in r.stdout, r.stdout
        assert not os.path.exists(paths["ended-job"])
        assert os.path.isdir(paths["other-job"]) and os.path.isdir(paths["shared"])
        assert sorted(os.listdir(cache_root(shm_dir))) == sorted([".lock", "other-job", "shared"])
        # no job id: nothing to do, and never a failing exit status (a failing Epilog drains the node)
        r = subprocess.run([PY, "-m", "monai_cache", "epilog"], capture_output=True, text=True, timeout=60, env=env)
        assert r.returncode == 0 and "no Slurm job id" in r.stderr
    finally:
        live.kill()
        live.wait()


def test_a_kept_cache_outlives_its_killed_user_its_watcher_and_the_epilog(shm_dir):
    """A cache that a second user joined with ``keep_warm``: both users killed, the watcher its first user started
    leaves the cache and exits; the job's epilog leaves it too."""
    from monai_cache.shm import remove_cache

    first, path = _users(shm_dir, {"kept": "61"})["kept"]
    watcher = watcher_pid(path)
    second, _ = _users(shm_dir, {"kept": "61"}, keep_warm=True)["kept"]
    for proc in (first, second):
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 10  # the watcher's next look finds the cache kept: nothing to watch
    while os.path.exists(f"/proc/{watcher}/fd") and time.monotonic() < deadline:  # (a zombie has no fds)
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{watcher}/fd") and os.path.isdir(path)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    r = subprocess.run(
        [PY, "-m", "monai_cache", "epilog", "--job", "61", "--shm-dir", shm_dir],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    assert r.returncode == 0 and "kept" not in r.stdout, (r.stdout, r.stderr)
    assert os.path.isdir(path)
    assert remove_cache("kept", shm_dir, force=True)


def test_a_server_training_in_process_gives_the_cache_back_when_idle():
    """MONAI Label's run_sync=true: the server trains in its own process twice; each training leaves its dataset in a
    reference cycle (ignite's engines do). Idle, the server collects once and the cache goes between the trainings;
    with the idle collector off (MONAI_CACHE_IDLE_COLLECT=0) it would stay for as long as the server idles."""
    runs = {}
    for setting, wait in (("1", 8.0), ("0", 4.0)):  # both at once: the second only needs to idle as long
        path = f"/dev/shm/mc-test-server-{setting}-{os.getpid()}"
        os.makedirs(path, exist_ok=True)
        env = {**os.environ, "MONAI_CACHE_IDLE_COLLECT": setting}
        argv = [PY, os.path.join(SCRIPTS, "server_trains_twice.py"), path, str(wait)]
        runs[setting] = (
            path,
            subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env),
        )
    out = {}
    for setting, (path, proc) in runs.items():
        stdout, stderr = proc.communicate(timeout=240)
        subprocess.run(["rm", "-rf", path], check=False)
        assert proc.returncode == 0, stderr[-3000:]
        out[setting] = json.loads(stdout.strip().splitlines()[-1])
    for training in out["1"]:
        assert training["held_after"] > 0 and training["released_after"] is not None, out
    for training in out["0"]:
        assert training["held_after"] > 0 and training["released_after"] is None, out


def test_keep_alive_outlives_a_job_killed_outright_then_goes(shm_dir):
    """keep_alive under Slurm: the job's step killed with its cgroup (keeper and watcher too). The epilog keeps the
    cache for its window, counted from the job's end, with a watcher of its own; a requeued job within the window
    finds every entry; once the window ends after its last user, nothing is left."""
    from monai_cache.shm import SharedMemoryStore

    window = 2.0
    os.environ["MONAI_CACHE_KEEP_ALIVE"] = str(window)
    try:
        users = _users(shm_dir, {"requeued": "51"})
    finally:
        del os.environ["MONAI_CACHE_KEEP_ALIVE"]
    proc, path = users["requeued"]
    kill_watcher(path)
    proc.kill()
    proc.wait()
    time.sleep(window)  # longer than the window counted from the cache's creation: the epilog counts from now
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    r = subprocess.run(
        [PY, "-m", "monai_cache", "epilog", "--job", "51", "--shm-dir", shm_dir],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    assert r.returncode == 0 and "requeued kept for its keep_alive window" in r.stdout, (r.stdout, r.stderr)
    watcher = watcher_pid(path)  # started by the epilog
    other = SharedMemoryStore("another-job", 1, shm_dir=shm_dir)  # joining a cache reclaims the stale ones...
    other.release()
    assert os.path.isdir(path)  # ... not one within its window
    again = SharedMemoryStore("requeued", 2, shm_dir=shm_dir)  # the requeued job, within the window: warm
    assert again[0] is not None and float(again[0]["x"].sum()) == 1000.0
    again.release()  # its last user leaves: the window runs again from now, then the cache goes
    left = time.time()
    deadline = time.monotonic() + 30  # a hang guard
    while os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(path) and time.time() >= left + window - 0.1
    while os.path.exists(f"/proc/{watcher}/fd") and time.monotonic() < deadline:  # exited (a zombie has no fds)
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{watcher}/fd")
