"""A real one-node Slurm on 127.0.0.1 for tests: its own munged, slurmctld and slurmd, every file under one private
working directory, free ports, so that it cannot clash with a Slurm or a munged of the machine's own.

    cluster = start_cluster(workdir, proctrack="cgroup")   # or "linuxproc"
    subprocess.run(["srun", "-n", "2", "hostname"], env=cluster.env)
    cluster.stop()

Needs root (slurmd launches the jobs; proctrack/cgroup creates cgroups) and Debian's ``slurm-wlm`` and ``munge``
(Slurm 22.05 on Debian 12). proctrack/cgroup is run with ``CgroupPlugin=cgroup/v1``, which tracks a step's
processes in the v1 *freezer* hierarchy (``/sys/fs/cgroup/freezer``): ``prepare_cgroup_v1`` mounts it if it is
missing. Any failure to start raises ``SlurmUnavailable``, with the daemons' log tails, so that tests can skip.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("srun", "sbatch", "scancel", "squeue", "sinfo", "scontrol")
SBIN = ("/usr/sbin", "/sbin", "/usr/local/sbin")  # the daemons' home, not on every user's PATH
CGROUP_ROOT = "/sys/fs/cgroup"
SUN_PATH_MAX = 107  # a unix socket's path (munged's, slurmstepd's under SlurmdSpoolDir): longer ones fail


class SlurmUnavailable(RuntimeError):
    """The cluster cannot run here; the message says why."""


def which(name: str) -> str | None:
    """``name`` on PATH, or in an sbin directory (the daemons are there, and not every PATH has them)."""
    return shutil.which(name) or shutil.which(name, path=os.pathsep.join(SBIN))


def missing_commands() -> list[str]:
    """The commands this helper needs that are not installed."""
    return [name for name in (*DAEMONS, *CLIENTS) if which(name) is None]


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports free on 127.0.0.1 now (held together while chosen, so that they differ)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _mounted(path: str) -> str | None:
    """The options of the filesystem mounted exactly at ``path`` (from /proc/mounts), or None."""
    with open("/proc/mounts") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 4 and parts[1] == path:
                return f"{parts[2]} {parts[3]}"
    return None


def prepare_cgroup_v1(controllers: tuple[str, ...] = ("freezer",)) -> list[str]:
    """Make sure the cgroup v1 ``controllers`` are mounted under /sys/fs/cgroup (what proctrack/cgroup with
    cgroup/v1 needs: freezer), mounting any that is missing. Returns what was done, one line each; raises
    SlurmUnavailable if a controller is not in the kernel or cannot be mounted."""
    with open("/proc/cgroups") as f:
        known = {line.split()[0]: line.split()[3] == "1" for line in f if not line.startswith("#")}
    done = []
    for name in controllers:
        if not known.get(name):
            raise SlurmUnavailable(f"the kernel has no enabled cgroup v1 {name} controller (/proc/cgroups)")
        path = f"{CGROUP_ROOT}/{name}"
        options = _mounted(path)
        if options is not None:
            if not options.startswith("cgroup ") or name not in options.split()[1].split(","):
                raise SlurmUnavailable(f"{path} is mounted, but not as the cgroup v1 {name} hierarchy: {options}")
            continue
        try:
            os.makedirs(path, exist_ok=True)
            subprocess.run(
                ["mount", "-t", "cgroup", "-o", name, name, path],
                check=True,
                capture_output=True,
                text=True,
                timeout=30,
            )
        except (OSError, subprocess.SubprocessError) as e:
            detail = getattr(e, "stderr", "") or e
            raise SlurmUnavailable(f"cannot mount the cgroup v1 {name} controller at {path}: {detail}") from e
        done.append(f"mounted: mount -t cgroup -o {name} {name} {path}")
    return done


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the process that started it (the test run) dies, so that a killed
    test run leaves no daemon behind (the daemons run in the foreground, so this holds for them)."""
    os.setsid()
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@dataclass
class SlurmCluster:
    workdir: Path
    proctrack: str
    nodename: str
    partition: str
    kill_wait: int
    env: dict[str, str]  # for srun, sbatch, squeue...: SLURM_CONF, and no SLURM_* of an enclosing job
    conf: Path
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)

    def run(self, *args: str, timeout: float = 60, check: bool = True, **kw) -> subprocess.CompletedProcess:
        """Run a command (a Slurm client) against this cluster; its output as text."""
        return subprocess.run(
            list(args), env=self.env, capture_output=True, text=True, timeout=timeout, check=check, **kw
        )

    def log(self, name: str, tail: int = 40) -> str:
        """The last ``tail`` lines of a daemon's log (``munged``, ``slurmctld``, ``slurmd``): its log file, else
        its stderr (munged's only log in the foreground; the Slurm daemons' errors before their log file opens)."""
        for path in (self.workdir / "log" / f"{name}.log", self.workdir / "log" / f"{name}.stderr"):
            with contextlib.suppress(OSError):
                return "\n".join(path.read_text(errors="replace").splitlines()[-tail:])
        return f"(no log of {name} under {self.workdir / 'log'})"

    def logs(self, tail: int = 25) -> str:
        return "\n".join(f"--- {name}.log ---\n{self.log(name, tail)}" for name in DAEMONS)

    def node_state(self) -> str:
        out = self.run("sinfo", "-h", "-N", "-n", self.nodename, "-o", "%t", check=False, timeout=15)
        return out.stdout.strip() or out.stderr.strip()

    def jobs(self) -> list[str]:
        """The ids of the jobs that squeue shows (pending, running, completing)."""
        out = self.run("squeue", "-h", "-o", "%i", timeout=15)
        return out.stdout.split()

    def wait_jobs_gone(self, job_ids: list[str] | None = None, timeout: float = 30) -> bool:
        """Wait until squeue shows none of ``job_ids`` (all jobs if None); False on timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            shown = self.jobs()
            if not (shown if job_ids is None else set(shown) & set(job_ids)):
                return True
            time.sleep(0.2)
        return False

    def stop(self, remove: bool = True) -> None:
        """Cancel every job (and wait for its processes' end), stop the daemons (SIGTERM, then SIGKILL after 10 s),
        and remove the working directory if ``remove``. Safe to call twice."""
        if self.procs.get("slurmctld") and self.procs["slurmctld"].poll() is None:
            with contextlib.suppress(Exception):
                if self.jobs():
                    self.run("scancel", "-u", "root", check=False, timeout=15)
                    self.wait_jobs_gone(timeout=max(self.kill_wait, 5) + 15)
        for name in reversed(DAEMONS):  # slurmd, slurmctld, then munged that both use
            proc = self.procs.pop(name, None)
            if proc is None or proc.poll() is not None:
                continue
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        if self.proctrack == "cgroup":  # what slurmstepd leaves: empty, unless another cluster of this name runs
            for sub in (f"slurm_{self.nodename}/uid_{os.getuid()}", f"slurm_{self.nodename}"):
                with contextlib.suppress(OSError):
                    os.rmdir(f"{CGROUP_ROOT}/freezer/{sub}")
        if remove:
            shutil.rmtree(self.workdir, ignore_errors=True)


def _write_munge_key(path: Path) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
    with os.fdopen(fd, "wb") as f:
        f.write(os.urandom(1024))


def slurm_conf(
    *,
    nodename: str,
    cpus: int,
    ports: tuple[int, int],
    workdir: Path,
    munge_socket: Path,
    proctrack: str,
    kill_wait: int,
    partition: str,
    first_job_id: int,
    debug: str = "info",
    epilog: str | None = None,
) -> str:
    w = workdir
    epilog_line = f"Epilog={epilog}\n" if epilog else ""
    return f"""\
# A one-node test cluster (tests/slurm_cluster.py): everything under {w}
ClusterName=mctest
SlurmctldHost={nodename}(127.0.0.1)
SlurmctldPort={ports[0]}
SlurmdPort={ports[1]}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket}
StateSaveLocation={w}/state
SlurmdSpoolDir={w}/spool
SlurmctldPidFile={w}/run/slurmctld.pid
SlurmdPidFile={w}/run/slurmd.pid
SlurmctldLogFile={w}/log/slurmctld.log
SlurmdLogFile={w}/log/slurmd.log
SlurmctldDebug={debug}
SlurmdDebug={debug}
ProctrackType=proctrack/{proctrack}
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
KillWait={kill_wait}
MinJobAge=60
InactiveLimit=0
FirstJobId={first_job_id}
MailProg=/bin/true
{epilog_line}NodeName={nodename} NodeAddr=127.0.0.1 NodeHostname={nodename} CPUs={cpus} State=UNKNOWN
PartitionName={partition} Nodes={nodename} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


CGROUP_CONF = f"""\
CgroupPlugin=cgroup/v1
CgroupMountpoint={CGROUP_ROOT}
CgroupAutomount=yes
ConstrainCores=no
ConstrainRAMSpace=no
ConstrainSwapSpace=no
ConstrainDevices=no
"""


def _start(cluster: SlurmCluster, name: str, args: list[str]) -> None:
    out = open(cluster.workdir / "log" / f"{name}.stderr", "ab")
    cluster.procs[name] = subprocess.Popen(
        [which(name) or name, *args],
        stdin=subprocess.DEVNULL,
        stdout=out,
        stderr=subprocess.STDOUT,
        preexec_fn=_die_with_parent,
        close_fds=True,
    )
    out.close()


def _wait(cluster: SlurmCluster, what: str, ready, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        for name, proc in cluster.procs.items():
            if proc.poll() is not None:
                raise SlurmUnavailable(f"{name} exited ({proc.returncode}) while waiting for {what}")
        if ready():
            return
        if time.monotonic() > deadline:
            raise SlurmUnavailable(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.1)


def start_cluster(
    workdir: str | os.PathLike,
    proctrack: str = "cgroup",
    kill_wait: int = 2,
    partition: str = "debug",
    timeout: float = 60,
    debug: str = "info",
    epilog: str | None = None,
    cpus: int | None = None,
) -> SlurmCluster:
    """Start munged, slurmctld and slurmd for a one-node cluster whose files all live under ``workdir`` (made if
    missing; keep its path short: unix sockets are made under it) and wait until sinfo shows the node idle.
    ``proctrack``: "cgroup" (cgroup/v1, freezer) or "linuxproc" (the process tree); ``debug``: the daemons' log
    level (info, verbose, debug, debug2...); ``epilog``: a program for slurm.conf's ``Epilog=``; ``cpus``: the node's
    CPUs as Slurm counts them (default the machine's; more lets that many one-CPU tasks run at once). Raises
    SlurmUnavailable (the daemons then stopped) if it cannot. The caller stops it with ``cluster.stop()``."""
    if proctrack not in ("cgroup", "linuxproc", "pgid"):
        raise ValueError(f"proctrack: {proctrack!r}")
    missing = missing_commands()
    if missing:
        raise SlurmUnavailable(f"not installed: {', '.join(missing)} (apt-get install slurm-wlm munge)")
    if os.geteuid() != 0:
        raise SlurmUnavailable("slurmd must run as root (it starts the jobs; proctrack/cgroup makes cgroups)")
    workdir = Path(workdir).absolute()
    nodename = socket.gethostname().split(".")[0]
    munge_socket = workdir / "munge" / "munge.socket.2"
    if len(str(workdir / "spool" / f"{nodename}_4294967295.4294967295")) > SUN_PATH_MAX:
        raise SlurmUnavailable(f"working directory path too long for unix sockets under it: {workdir}")
    for sub in ("state", "spool", "log", "run", "munge"):
        (workdir / sub).mkdir(parents=True, exist_ok=True)
    os.chmod(workdir, 0o755)  # munged wants its socket's directories searchable by all (the clients' uid)
    os.chmod(workdir / "munge", 0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))}
    env["SLURM_CONF"] = str(workdir / "slurm.conf")
    env["PATH"] = os.pathsep.join([env.get("PATH", os.defpath), *SBIN])
    cluster = SlurmCluster(
        workdir=workdir,
        proctrack=proctrack,
        nodename=nodename,
        partition=partition,
        kill_wait=kill_wait,
        env=env,
        conf=workdir / "slurm.conf",
    )
    t0 = time.monotonic()
    try:
        if proctrack == "cgroup":
            cluster.notes += prepare_cgroup_v1()
            (workdir / "cgroup.conf").write_text(CGROUP_CONF)
        cluster.conf.write_text(
            slurm_conf(
                nodename=nodename,
                cpus=cpus or os.cpu_count() or 1,
                ports=tuple(free_ports(2)),
                workdir=workdir,
                munge_socket=munge_socket,
                proctrack=proctrack,
                kill_wait=kill_wait,
                partition=partition,
                # job ids of two clusters on one machine differ, and so do their cgroups (.../slurm/uid_0/job_<id>)
                first_job_id=random.randrange(100_000, 60_000_000),
                debug=debug,
                epilog=epilog,
            )
        )
        key = workdir / "munge" / "munge.key"
        _write_munge_key(key)
        _start(
            cluster,
            "munged",
            [
                "--foreground",
                "--force",
                f"--socket={munge_socket}",
                f"--key-file={key}",
                f"--pid-file={workdir / 'run' / 'munged.pid'}",
                f"--seed-file={workdir / 'munge' / 'munged.seed'}",
            ],
        )
        _wait(cluster, "munged's socket", munge_socket.exists, timeout)
        cluster.timings["munged"] = time.monotonic() - t0
        _start(cluster, "slurmctld", ["-D", "-i", "-f", str(cluster.conf)])

        def ctld_up() -> bool:
            return cluster.run("scontrol", "ping", check=False, timeout=15).stdout.count("UP") > 0

        _wait(cluster, "slurmctld (scontrol ping)", ctld_up, timeout)
        cluster.timings["slurmctld"] = time.monotonic() - t0
        _start(cluster, "slurmd", ["-D", "-f", str(cluster.conf), "-N", nodename])
        _wait(cluster, f"node {nodename} idle (sinfo)", lambda: cluster.node_state() == "idle", timeout)
        cluster.timings["idle"] = time.monotonic() - t0
    except BaseException as e:
        logs = cluster.logs()
        cluster.stop(remove=False)
        if isinstance(e, (SlurmUnavailable, OSError, subprocess.SubprocessError)):
            raise SlurmUnavailable(f"{e}\n{logs}") from e
        raise
    return cluster


def cluster_or_skip(workdir: str, proctrack: str, **kw) -> SlurmCluster:
    """:func:`start_cluster`, or skip the calling test with the reason it cannot start here (fail it instead when
    ``MONAI_CACHE_REQUIRE_SLURM=1``: CI, which installs Slurm, insists)."""
    import pytest

    try:
        return start_cluster(workdir, proctrack=proctrack, **kw)
    except SlurmUnavailable as e:
        if os.environ.get("MONAI_CACHE_REQUIRE_SLURM") == "1":
            pytest.fail(f"Slurm (proctrack/{proctrack}) cannot start here: {e}")
        pytest.skip(f"Slurm (proctrack/{proctrack}) cannot start here: {str(e).splitlines()[0]}")


@contextlib.contextmanager
def temporary_cluster(proctrack: str, **kw) -> Iterator[SlurmCluster]:
    """A cluster in a fresh working directory under /tmp (short: unix sockets are made under it), stopped and removed
    however the block ends; skips the calling test where it cannot start (:func:`cluster_or_skip`)."""
    workdir = tempfile.mkdtemp(prefix="mcslurm-", dir="/tmp" if os.path.isdir("/tmp") else None)
    try:
        cluster = cluster_or_skip(workdir, proctrack, **kw)
        try:
            yield cluster
        finally:
            cluster.stop()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def sbatch(cluster: SlurmCluster, tmp_path: Path, name: str, script: str, *options: str) -> str:
    """Submit ``script`` (dedented; it starts with its ``#!`` line) as batch job ``name``, its output in
    ``<tmp_path>/<name>.out``; returns the job id.

    Args:
        cluster: the running cluster.
        tmp_path: where the script and its output go.
        name: the job's name.
        script: the batch script.
        options: more ``sbatch`` options, before the script.
    """
    path = tmp_path / f"{name}.sh"
    path.write_text(textwrap.dedent(script).lstrip())
    out = cluster.run("sbatch", "--parsable", "-J", name, "-o", str(tmp_path / f"{name}.out"), *options, str(path))
    return out.stdout.strip().split(";")[0]
