"""Issue 26 point 1: the shared-memory cache outlives a restart of the ranks (torchrun ``--max-restarts``) and goes
when the job ends; ``keep_alive`` keeps a cache for a while after its last user outside torchrun.

One real torchrun job (gloo, 2 ranks with 2 DataLoader workers each; one rank ends with ``os._exit``, the other is
killed with SIGKILL; the restart reads without workers) asserts everything about restarts: the suite pays for one.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import REAPERS, free_port, under_reaper

SCRIPTS = Path(__file__).parent / "_scripts"
N_ITEMS, EPOCHS, WORLD = 8, 2, 2
HANG_GUARD_S = 600
KEEP_ALIVE_S = 1.5
CLOCK_TICK_S = 0.05  # tmpfs stamps mtimes with the kernel's coarse clock: up to a tick behind time.time()


def _keepers_of(shm_dir: str) -> list[int]:
    """Pids of keeper processes whose cache lies under ``shm_dir`` (not its watchers: ``watch`` in their argv)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if b"watch" in argv:
            continue
        if any(b"monai_cache.keeper" in a for a in argv) and any(a.startswith(shm_dir.encode()) for a in argv):
            found.append(int(pid))
    return found


def _wait_until(condition, what: str, limit: float = 60.0) -> None:
    deadline = time.monotonic() + limit  # a hang guard, not a timing assertion
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_torchrun_restarts_find_the_cache_and_resume_each_item_once(tmp_path, shm_dir):
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[1]), env.get("PYTHONPATH", "")])
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={WORLD}",
        "--max-restarts=1",
        f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        str(SCRIPTS / "restart_rank.py"),
        str(out),
    ]
    with open(tmp_path / "torchrun.log", "wb") as log:
        code = subprocess.run(argv, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=HANG_GUARD_S).returncode
    text = (tmp_path / "torchrun.log").read_text(errors="replace")
    assert code == 0, text[-4000:]
    # both attempts ran, under one agent
    runs = {(a, r): json.loads((out / f"attempt{a}.rank{r}.json").read_text()) for a in range(2) for r in range(WORLD)}
    assert len({run["agent"] for run in runs.values()}) == 1 and runs[0, 0]["agent"]
    # the deterministic chain ran once per item in the whole job: the restarted ranks found every entry
    calls = sorted(int(line) for line in (out / "calls.log").read_text().split())
    assert calls == list(range(N_ITEMS)), calls
    for r in range(WORLD):  # after the restart the first step was a hit, and nothing was computed again
        stats = runs[1, r]["stats"]
        assert stats["misses"] == N_ITEMS and stats["hits"] >= 1, (r, stats)
    # with the sampler's state committed at each step, every epoch (the two interrupted ones included) trained on
    # each item exactly once across the attempts
    ckpts = [json.loads((out / f"ckpt.rank{r}.json").read_text()) for r in range(WORLD)]
    for epoch in range(EPOCHS):
        seen = sorted(i for c in ckpts for i in c["seen"][str(epoch)])
        assert seen == list(range(N_ITEMS)), (epoch, [c["seen"][str(epoch)] for c in ckpts])
    # the job is over: its agent gone, the keeper removes the cache and exits
    root = os.path.join(shm_dir, f"monai_cache-{os.getuid()}")
    _wait_until(lambda: not [n for n in os.listdir(root) if not n.startswith(".")], f"left in {root}")
    _wait_until(lambda: not _keepers_of(shm_dir), "a keeper outlived its job")


def test_keep_alive_keeps_a_cache_for_the_next_run_then_removes_it(shm_dir):
    """The keeper, once orphaned, is reaped the moment it exits (``under_reaper``: tini, ``docker --init``); the
    zombie-agent test below runs under a slow reaper too."""
    under_reaper("prompt", functools.partial(_keep_alive, shm_dir))


def _keep_alive(shm_dir: str) -> None:
    from monai_cache.shm import SharedMemoryStore

    store = SharedMemoryStore("plain", 2)  # the default: removed when its last user leaves, as before
    path = store.path
    store.release()
    assert not os.path.exists(path) and not _keepers_of(shm_dir)

    os.environ["MONAI_CACHE_KEEP_ALIVE"] = str(KEEP_ALIVE_S)  # the environment reaches every dataset class
    first = SharedMemoryStore("notebook", 2)
    first[0] = {"x": 7}
    path = first.path
    lease = os.path.join(path, "lease")  # its mtime: when the last user left, from which the deadline counts
    first.release()  # the last user leaves: a keeper holds the cache
    assert os.path.isdir(path) and len(_keepers_of(shm_dir)) == 1
    for _ in range(2):  # users come and go; each finds the cache warm and moves the deadline as it leaves
        again = SharedMemoryStore("notebook", 2)  # the script run again: warm
        assert again[0] == {"x": 7}
        # as if the previous user had left half a keep_alive ago: unless this one's leaving moves the deadline,
        # the cache goes half a keep_alive after it (not at once: the keeper is not deciding as it leaves)
        earlier = time.time() - KEEP_ALIVE_S / 2
        os.utime(lease, (earlier, earlier))
        before = time.time()
        again.release()
        left = os.stat(lease).st_mtime
        assert left >= before - CLOCK_TICK_S, f"leaving left the deadline {before - left:.2f} s early"
        assert len(_keepers_of(shm_dir)) == 1  # the same keeper holds on
    _wait_until(lambda: not os.path.exists(path), "the kept cache was never removed")
    gone = time.time()  # read after the removal was seen: the removal was no later
    # the keeper waited keep_alive after the last user left (a lower bound: a busy machine only adds to it)
    assert gone >= left + KEEP_ALIVE_S, f"removed {left + KEEP_ALIVE_S - gone:.2f} s before the deadline"
    _wait_until(lambda: not _keepers_of(shm_dir), "the keeper did not exit")

    os.environ["MONAI_CACHE_KEEP_ALIVE"] = "soon"
    with pytest.raises(ValueError, match="MONAI_CACHE_KEEP_ALIVE"):
        SharedMemoryStore("bad", 2)
    with pytest.raises(ValueError, match="keep_alive"):
        SharedMemoryStore("bad", 2, keep_alive=-1)


def _stat(pid: int) -> list[str]:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()  # state, ppid, ...


def _cpu_seconds(pid: int, start_time: int) -> float | None:
    """CPU seconds process ``pid`` (started at ``start_time``) has used, None once it is gone: reaped, which a
    prompt reaper (tini, ``docker --init``) does the moment it exits."""
    try:
        fields = _stat(pid)
    except FileNotFoundError:
        return None
    if int(fields[19]) != start_time:  # gone, its pid reused
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


@pytest.mark.parametrize("reaper", sorted(REAPERS))
def test_under_reaper_adopts_orphans_and_reaps_them_at_once_or_late(reaper):
    """The harness of the keeper tests: an orphan (``sleep``, left by ``sh``) is the reaper's, reaped at once by the
    prompt one, still a zombie half a second after its exit under the slow one."""
    under_reaper(reaper, functools.partial(_orphan_reaped, reaper))


def _orphan_reaped(reaper: str) -> None:
    out = subprocess.run(
        ["sh", "-c", "sleep 0.3 >/dev/null 2>&1 & echo $!"], capture_output=True, text=True, check=True
    ).stdout
    orphan = int(out)
    assert _stat(orphan)[1] == str(os.getppid())  # adopted by the subreaper, not by init
    _wait_until(lambda: not os.path.exists(f"/proc/{orphan}") or _stat(orphan)[0] == "Z", "sleep did not exit")
    time.sleep(0.5)
    try:
        state = _stat(orphan)[0]
    except FileNotFoundError:
        state = "reaped"
    assert state == {"prompt": "reaped", "slow": "Z"}[reaper], state


@pytest.mark.parametrize("reaper", sorted(REAPERS))
def test_keeper_takes_an_agent_that_exited_unreaped_for_gone(shm_dir, reaper):
    """torchrun's agent has exited, but whatever started it has not reaped it yet (a zombie: a launcher waiting on
    something else first, as the doc-example tests did): the keeper removes the cache and exits, as for an agent
    gone altogether. It used to take the zombie for the agent alive and wait on its pidfd, readable since the exit,
    so it spun on a full CPU until the zombie was reaped. The keeper, once orphaned, is reaped at once or a second
    late (``under_reaper``)."""
    under_reaper(reaper, functools.partial(_zombie_agent, shm_dir))


def _zombie_agent(shm_dir: str) -> None:
    from monai_cache import keeper
    from monai_cache.shm import SharedMemoryStore

    agent = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        # what a rank's spawned DataLoader worker finds in its environment: the node's agent
        os.environ[keeper.ENV_AGENT] = f"{agent.pid}:{keeper._start_time(agent.pid)}"
        store = SharedMemoryStore("zombie-agent", 2)
        store[0] = {"x": 1}
        path = store.path
        (kept_by,) = _keepers_of(shm_dir)
        began = keeper._start_time(kept_by)
        assert began is not None  # the keeper runs: it holds the cache
        store.release()
        assert os.path.isdir(path)  # held by the keeper while the agent runs
        assert agent.stdin is not None
        agent.stdin.close()  # the agent exits; nobody reaps it (no wait() until the end)
        _wait_until(lambda: _stat(agent.pid)[0] == "Z", "the agent did not exit")
        cpu_then = _cpu_seconds(kept_by, began)  # None: the keeper is done already, and was reaped at once

        def spent() -> float:  # CPU seconds the keeper used since; one gone uses no more
            now = _cpu_seconds(kept_by, began)
            return 0.0 if now is None or cpu_then is None else now - cpu_then

        _wait_until(lambda: not os.path.exists(path) or spent() > 3.0, "")
        assert not os.path.exists(path), (
            f"the keeper kept the cache of an agent that exited, and used {spent():.1f} CPU s meanwhile"
        )
        _wait_until(lambda: not _keepers_of(shm_dir), "the keeper did not exit")
    finally:
        agent.kill()
        agent.wait()


def _lock_waiters(path: str) -> set[int]:
    """Pids waiting for an flock on ``path`` (/proc/locks: ``N: -> FLOCK ADVISORY WRITE pid maj:min:ino ...``)."""
    st = os.stat(path)
    waiters = set()
    with open("/proc/locks") as f:
        for fields in (line.split() for line in f):
            if fields[1] == "->" and fields[2] == "FLOCK":
                major, minor, ino = fields[6].split(":")
                if (int(major, 16), int(minor, 16), int(ino)) == (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino):
                    waiters.add(int(fields[5]))
    return waiters


def _voluntary_sleeps(pid: int) -> int | None:
    """How many times process ``pid`` has gone to sleep (blocked), or None once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches:"))
    except (OSError, StopIteration):
        return None


def _orphan_keeps_the_cache_until_it_exits(agent: subprocess.Popen, orphan: int, shm_dir: str) -> None:
    """Kill a node's agent, not its rank (``orphan``: parked, in a session of its own): the node's keeper sees the
    agent gone, yet keeps the cache while the rank holds it, and removes it once the rank is killed in turn.

    The keeper decides under the root lock. The test holds that lock while the agent dies, until the keeper waits
    for it; once let go, the keeper decides without sleeping, and keeping the cache ends in a sleep (the pause
    before it asks again): the test looks after that sleep, or after the keeper exited."""
    import fcntl
    import signal

    root = os.path.join(shm_dir, f"monai_cache-{os.getuid()}")
    lock = os.path.join(root, ".lock")
    (keeper,) = _keepers_of(shm_dir)
    cached = [n for n in os.listdir(root) if not n.startswith(".")]
    assert cached
    fd = os.open(lock, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.killpg(agent.pid, signal.SIGKILL)  # the node is lost: its agent; the rank runs on, held at the gate
        agent.wait(60)
        _wait_until(lambda: keeper in _lock_waiters(lock), "the keeper never saw its agent gone")
        slept = _voluntary_sleeps(keeper)  # it sleeps on the lock now: nothing else wakes it
        assert slept is not None
        fcntl.flock(fd, fcntl.LOCK_UN)
        _wait_until(lambda: (n := _voluntary_sleeps(keeper)) is None or n > slept, "the keeper never decided")
        os.kill(orphan, 0)  # the rank is alive...
        assert [n for n in os.listdir(root) if not n.startswith(".")] == cached  # ...so its cache stays,
        assert keeper in _keepers_of(shm_dir)  # held by the keeper, which waits for the rank
    finally:
        os.close(fd)
        with contextlib.suppress(ProcessLookupError):
            os.kill(orphan, signal.SIGKILL)  # the gate opens: the rank goes, and its cache right after
    _wait_until(lambda: not [n for n in os.listdir(root) if not n.startswith(".")], f"left in {root}")
    _wait_until(lambda: keeper not in _keepers_of(shm_dir), "the keeper did not exit")


def test_elastic_node_loss_survivor_finishes_the_epoch_once_on_its_warm_cache(tmp_path):
    """Two torchrun agents as two nodes (``--nnodes=1:2``, c10d on 127.0.0.1, a shared-memory directory each);
    node B is lost mid-epoch: its agent first, its rank (orphaned, holding the node's cache) only once the keeper was
    seen to keep the cache for it; node A finishes the epoch alone, each item once, on its cache."""
    import signal

    import torch.distributed as dist

    out = tmp_path / "out"
    out.mkdir()
    port = free_port()
    # The test hosts the rendezvous store (is_host=0 for both agents), so that either node can be lost.
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    shm = {node: f"/dev/shm/mc-test-elastic-{node}-{os.getpid()}" for node in "AB"}
    agents: dict[str, subprocess.Popen] = {}
    try:
        for node in "AB":
            os.makedirs(shm[node])
            env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "NODE": node}
            env["MONAI_CACHE_SHM_DIR"] = shm[node]
            env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[1]), env.get("PYTHONPATH", "")])
            argv = [
                sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc-per-node=1",
                "--max-restarts=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=elastic",
                "--rdzv-conf=is_host=0,last_call_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=2",
                str(SCRIPTS / "elastic_rank.py"), str(out),
            ]  # fmt: skip
            with open(tmp_path / f"{node}.log", "wb") as log:
                agents[node] = subprocess.Popen(
                    argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
        _wait_until(lambda: (out / "B.parked").exists() or agents["A"].poll() is not None, "B never parked", 300)
        assert (out / "B.parked").exists(), (tmp_path / "A.log").read_text(errors="replace")[-3000:]
        _orphan_keeps_the_cache_until_it_exits(agents["B"], int((out / "B.parked").read_text()), shm["B"])
        code = agents["A"].wait(HANG_GUARD_S)
        assert code == 0, (tmp_path / "A.log").read_text(errors="replace")[-4000:]
        first, second = (json.loads((out / f"A.attempt{a}.json").read_text()) for a in (0, 1))
        assert first["world"] == 2 and second["world"] == 1  # the survivor went on alone
        ckpts = [json.loads((out / f"ckpt.{node}.json").read_text()) for node in "AB"]
        for epoch in range(EPOCHS):  # each item of each epoch trained on once, the interrupted one included
            seen = sorted(i for c in ckpts for i in c["seen"].get(str(epoch), []))
            assert seen == list(range(N_ITEMS)), (epoch, [c["seen"] for c in ckpts])
        calls_a = [int(x) for x in (out / "calls.A.log").read_text().split()]
        assert len(calls_a) == len(set(calls_a))  # node A never computed an item twice: its cache kept every entry
        assert second["entries"] == N_ITEMS // 2  # its shard, cached in epoch 0, found by the restarted rank
        for root in (os.path.join(shm[node], f"monai_cache-{os.getuid()}") for node in "AB"):
            # both agents are gone: their keepers removed the caches
            _wait_until(lambda r=root: not [n for n in os.listdir(r) if not n.startswith(".")], f"left in {root}")
    finally:
        for p in agents.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for path in shm.values():
            shutil.rmtree(path, ignore_errors=True)
        del store
