"""Helpers of the reliability suite: deterministic items, forked ranks with real DataLoader workers,
safe kills, real tmpfs mounts, and a record of the figures each test produced.

Everything forks from the test process, which has already imported torch and MONAI: a forked rank or
writer starts in milliseconds, where a fresh interpreter would spend seconds importing.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import select
import signal
import subprocess
import tempfile
import time
import traceback
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from monai.transforms import MapTransform

# ------------------------------------------------------------------------------------------- figures
FIGURES_ENV = "MONAI_CACHE_RELIABILITY_FIGURES"


def figures_path() -> str:
    """Where :func:`record` appends its JSON lines (``$MONAI_CACHE_RELIABILITY_FIGURES`` or a temp file)."""
    return os.environ.get(FIGURES_ENV) or os.path.join(tempfile.gettempdir(), "monai_cache_reliability.jsonl")


def record(test: str, **figures: Any) -> None:
    """Append the figures of one test run (trials, failures, entries checked, bytes leaked...) for the report."""
    line = {"test": test, "time": time.strftime("%Y-%m-%d %H:%M:%S"), **figures}
    with open(figures_path(), "a") as f:
        f.write(json.dumps(line, default=str) + "\n")
    print("FIGURES", json.dumps(line, default=str))


class Tally:
    """The figures of one test, counted while it runs, recorded, and only then asserted on.

    A figure is never written in: ``counters`` start at 0 and grow by :meth:`add` when their outcome is seen
    (a crash, a hang, a wrong read, a leftover file...); :meth:`check` counts a check of the test and, when it
    fails, a failure (``failures``) together with what it said; :meth:`trial` turns an exception escaping its body
    into a counted crash (and failed check) instead of ending the test. The test then calls :meth:`record` (so a
    failing run records its figures too) and :meth:`assert_clean`, which fails it if any check failed or any
    named figure is not 0.

    Args:
        test: the name the figures are recorded under.
        counters: names of figures counted from 0.
        given: what the test was asked to run (examples, trials, items): set, not counted.
    """

    def __init__(self, test: str, *counters: str, **given: Any) -> None:
        self.test = test
        self.figures: dict[str, Any] = {**given, **dict.fromkeys(counters, 0), "checks": 0, "failures": 0}
        self.problems: list[str] = []

    def add(self, name: str, n: int = 1) -> None:
        """Count ``n`` more of the outcome ``name``."""
        self.figures[name] = self.figures.get(name, 0) + int(n)

    def check(self, ok: Any, problem: Any = "") -> bool:
        """Count one check; if ``ok`` is false, count a failure and keep ``problem`` (what went wrong)."""
        self.figures["checks"] += 1
        if not ok:
            self.figures["failures"] += 1
            text = str(problem)
            # keep the start and the end of a long problem: a traceback's last line names the exception
            self.problems.append(text if len(text) <= 2000 else text[:500] + " ... " + text[-1500:])
        return bool(ok)

    @contextlib.contextmanager
    def trial(self, what: Any = "") -> Iterator[None]:
        """Run the body as one trial: an exception escaping it counts as a crash (``crashes``) and a failed check.

        A :class:`Hang` raised in it counts as a hang (``hangs``) and a failed check."""
        try:
            yield
        except Hang as e:
            self.add("hangs")
            self.check(False, f"{what}: {e}")
        except Exception as e:
            self.add("crashes")
            self.check(False, f"{what}: {type(e).__name__}: {e}")

    def record(self, **figures: Any) -> dict:
        """Add ``figures`` (counted by the caller) and :func:`record` them all; returns them."""
        self.figures.update(figures)
        record(self.test, **self.figures)
        return self.figures

    def assert_clean(self, *zero: str) -> None:
        """Fail unless no check failed and every figure named in ``zero`` is 0."""
        bad = {name: self.figures[name] for name in ("failures", *zero) if self.figures[name]}
        assert not bad, f"{self.test}: {bad}; first problems: {self.problems[:5]}"


class Hang(BaseException):
    """Raised by :func:`deadline` when its body overruns. A ``BaseException``, so that code under test that turns
    every ``Exception`` into an error of its own cannot hide a hang."""


@contextlib.contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Interrupt the body with :class:`Hang` after ``seconds`` (SIGALRM: the main thread only). Python code is
    interrupted at once, a long call into C when it returns."""

    def on_alarm(signum: int, frame: Any) -> None:
        raise Hang(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def join_or_kill(proc: Any, timeout: float) -> int | None:
    """Wait for a forked process; one still running after ``timeout`` seconds is SIGKILLed and counts as hung
    (``None``). Otherwise its exit code (negative: killed by that signal)."""
    proc.join(timeout)
    if proc.is_alive():
        os.kill(proc.pid, signal.SIGKILL)
        proc.join()
        return None
    return int(proc.exitcode)


def env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value else default


# --------------------------------------------------------------------------------------------- items
def item_size(i: int) -> int:
    """Number of float32 values of item ``i``: every fourth is 1.2 MB (a standalone shared-memory file),
    the others 16 KiB (packed into a shared segment)."""
    return 300_000 if i % 4 == 0 else 4096


def make_item(i: int, n: int | None = None) -> dict:
    n = item_size(i) if n is None else n
    g = torch.Generator().manual_seed(10_007 + i)
    return {"i": i, "image": torch.randn(n, generator=g), "name": f"case{i}", "spacing": [1.0, 1.0, 2.0 + i]}


def data_list(n: int, size: int | None = None) -> list[dict]:
    return [{"i": i, "n": item_size(i) if size is None else size} for i in range(n)]


class MakeItem(MapTransform):
    """Deterministic and cheap: ``{"i", "n"}`` -> the item :func:`make_item` describes."""

    def __init__(self) -> None:
        super().__init__(keys=("i",))

    def __call__(self, data: Mapping) -> dict:
        return make_item(int(data["i"]), int(data["n"]))


def item_problem(got: Any, i: int, n: int | None = None) -> str | None:
    """``None`` if ``got`` (a single item, not a batch) is item ``i`` exactly, else what differs."""
    want = make_item(i, n)
    if not isinstance(got, Mapping):
        return f"item {i}: got {type(got).__name__}"
    if int(got.get("i", -1)) != i:
        return f"item {i}: index {got.get('i')!r}"
    image = got.get("image")
    if not isinstance(image, torch.Tensor) or image.dtype != torch.float32 or not torch.equal(image, want["image"]):
        return f"item {i}: wrong image"
    if got.get("name") != want["name"] or [float(v) for v in got.get("spacing", [])] != want["spacing"]:
        return f"item {i}: wrong metadata {got.get('name')!r} {got.get('spacing')!r}"
    return None


def batch_problem(batch: Mapping, sizes: Mapping[int, int] | None = None) -> str | None:
    """Check every item of a collated batch against :func:`make_item`."""
    for k, i in enumerate(batch["i"].tolist()):
        n = None if sizes is None else sizes[i]
        item = {
            "i": i,
            "image": batch["image"][k],
            "name": batch["name"][k],
            "spacing": [float(s[k]) for s in batch["spacing"]],
        }
        problem = item_problem(item, i, n)
        if problem:
            return problem
    return None


# --------------------------------------------------------------------------------------- processes
def pid_parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("PPid:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def gone(pid: int) -> bool:
    """Whether ``pid`` has exited: no such process, or a zombie (dead, not yet reaped by its parent or init)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return True


def kill_child_of(parent: int, pid: int, sig: int = signal.SIGKILL) -> bool:
    """SIGKILL ``pid`` (or send it ``sig``) if (and only if) it is still a child of ``parent``, a process this test
    started.

    A pidfd pins the process first, so a recycled pid can never make us signal somebody else's process.
    """
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return False
    try:
        if pid_parent(pid) != parent:
            return False
        signal.pidfd_send_signal(pidfd, sig)
        return True
    except ProcessLookupError:
        return False
    finally:
        os.close(pidfd)


@dataclass
class Rank:
    """A forked 'rank': builds the dataset, runs DataLoader epochs with 2 workers, checks every item, and
    reports on a pipe: ``P <worker pids>``, ``E <epoch> <items checked>``, ``W`` (a worker died, the
    loader was rebuilt), ``F <problem>`` (wrong item: the rank exits 3), ``X <error>`` (exits 4)."""

    proc: Any
    rfd: int
    name: str
    buf: bytes = b""
    epochs: int = 0
    checked: int = 0
    worker_deaths: int = 0
    workers: list[int] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return int(self.proc.pid)

    def pump(self) -> None:
        """Read whatever the rank reported so far (non-blocking)."""
        while select.select([self.rfd], [], [], 0)[0]:
            chunk = os.read(self.rfd, 65536)
            if not chunk:
                break
            self.buf += chunk
        *lines, self.buf = self.buf.split(b"\n")
        for raw in lines:
            line = raw.decode(errors="replace")
            kind, _, rest = line.partition(" ")
            if kind == "P":
                self.workers = [int(p) for p in rest.split()]
            elif kind == "E":
                self.epochs += 1
                self.checked += int(rest.split()[1])
            elif kind == "W":
                self.worker_deaths += 1
            elif kind in ("F", "X"):
                self.failures.append(line)

    def wait_epochs(self, count: int, timeout: float) -> bool:
        """Wait until the rank has completed ``count`` epochs in all; False on timeout or if it died."""
        deadline = time.monotonic() + timeout
        while True:
            self.pump()
            if self.failures or self.epochs >= count:
                return not self.failures
            if not self.proc.is_alive() or time.monotonic() > deadline:
                self.pump()
                return self.epochs >= count and not self.failures
            select.select([self.rfd], [], [], 0.05)

    def kill_group(self) -> None:
        """SIGKILL the whole rank: itself and its DataLoader workers (its process group)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)
        self.proc.join(30)
        if self.proc.is_alive():  # (never seen: the pgid is set on both sides of the fork)
            os.kill(self.pid, signal.SIGKILL)
            self.proc.join(30)
            raise AssertionError(f"{self.name} (pid {self.pid}) survived killpg")
        self.pump()
        os.close(self.rfd)

    def stop(self) -> None:
        self.kill_group()


def _worker_death(e: BaseException, it: Any = None) -> bool:
    """Whether ``e`` is how a DataLoader reports a worker that died: torch's SIGCHLD handler (RuntimeError),
    a connection reset / EOF / failed handshake while a batch's tensors were being passed from the dead worker
    (torch's ``rebuild_storage_fd`` asks the worker's resource sharer for each descriptor), or any error of
    ``it`` raised in that hand-over once one of its workers is dead.

    A killed process closes its sockets before it becomes a zombie, so the hand-over can fail (for instance
    with multiprocessing's plain ``OSError("got end of file during message")``) a moment before the worker
    shows as dead: that is waited for, up to 15 s."""
    if (isinstance(e, RuntimeError) and "DataLoader worker" in str(e)) or isinstance(
        e, (ConnectionError, EOFError, multiprocessing.AuthenticationError)
    ):
        return True
    in_handover = any(f.name in ("rebuild_storage_fd", "detach", "get_connection")
                      for f in traceback.extract_tb(e.__traceback__))
    if not in_handover:
        return False
    workers = getattr(it, "_workers", None) or []
    deadline = time.monotonic() + 15.0  # a hang guard: on a loaded machine the kill can take a while to show
    while not any(not w.is_alive() for w in workers):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _shutdown(it: Any) -> None:
    """Stop a loader iterator's workers; torch's SIGCHLD handler may report the dead worker again meanwhile."""
    for _ in range(10):
        try:
            if it is not None:
                it._shutdown_workers()
            return
        except RuntimeError as e:
            if not _worker_death(e):
                raise


def stacks(pid: int) -> str:
    """The Python stacks of ``pid`` and its children (``py-spy dump``), for the report of a process that hangs;
    a line saying why not where py-spy is missing or refused."""
    out = []
    for p in [pid, *(c for c in _children_of(pid))]:
        try:
            r = subprocess.run(["py-spy", "dump", "--pid", str(p)], capture_output=True, text=True, timeout=30)
            out.append(f"--- pid {p}:\n{r.stdout or r.stderr}")
        except (OSError, subprocess.SubprocessError) as e:
            out.append(f"--- pid {p}: no stack ({e})")
    return "\n".join(out)


def _children_of(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(c) for c in f.read().split()]
    except OSError:
        return []


class _ReportDeathsWhileLoading:
    """Let torch's SIGCHLD handler raise only while the rank is reading batches.

    torch's handler raises the dead worker's ``RuntimeError`` from whatever Python line runs when the signal comes.
    A killed worker's sockets close before it becomes a zombie, so a batch's hand-over often fails first (a
    connection reset) and the signal then lands in the rank's recovery, which it would break (seen once in 40
    runs under load). Outside the reading the death is already known; inside it, torch reports it as ever."""

    def __init__(self) -> None:
        self.loading = False
        self._torch_handler: Any = None

    def wrap(self) -> None:
        """Call once torch has installed its handler (at the first iterator with workers)."""
        current = signal.getsignal(signal.SIGCHLD)
        if self._torch_handler is None and callable(current):
            self._torch_handler = current
            signal.signal(signal.SIGCHLD, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.loading:
            self._torch_handler(signum, frame)


def _rank_main(build: Any, wfd: int, seed: int, persistent: bool, batch_size: int, sizes: Any) -> None:
    """Body of a forked rank (see :class:`Rank`)."""
    os.setpgid(0, 0)
    torch.set_num_threads(1)

    def say(msg: str) -> None:
        line = msg.replace("\n", " | ")
        if len(line) > 3000:  # keep the end of a traceback: the exception itself
            line = line[:500] + " ... " + line[-2500:]
        os.write(wfd, (line + "\n").encode())

    try:
        from monai.data import DataLoader

        ds = build()
        g = torch.Generator().manual_seed(seed)
        loader = None
        epoch = 0
        deaths = _ReportDeathsWhileLoading()
        while True:
            if loader is None:
                loader = DataLoader(ds, batch_size=batch_size, shuffle=True, generator=g, num_workers=2,
                                    persistent_workers=persistent)
            it = None
            try:
                deaths.loading = True
                it = iter(loader)
                deaths.wrap()
                say("P " + " ".join(str(w.pid) for w in it._workers))
                checked = 0
                for batch in it:
                    problem = batch_problem(batch, sizes)
                    if problem:
                        say(f"F {problem}")
                        os._exit(3)
                    checked += len(batch["i"])
                deaths.loading = False
                epoch += 1
                say(f"E {epoch} {checked}")
            except Exception as e:
                deaths.loading = False
                if not _worker_death(e, it):
                    raise
                _shutdown(it)
                say("W")
                it = loader = None  # persistent workers or not: a new loader with fresh workers
    except BaseException:
        try:
            say("X " + traceback.format_exc())
        finally:
            os._exit(4)


def start_rank(ctx: Any, build: Any, name: str, seed: int, persistent: bool, batch_size: int = 1,
               sizes: Any = None) -> Rank:
    rfd, wfd = os.pipe()
    proc = ctx.Process(target=_rank_main, args=(build, wfd, seed, persistent, batch_size, sizes), daemon=False)
    proc.start()
    # The rank makes itself a process group leader, but a kill may come before it gets there: do it from
    # this side too (the classic race-free pair of setpgid calls), so that killpg always reaches it.
    with contextlib.suppress(OSError):
        os.setpgid(proc.pid, proc.pid)
    os.close(wfd)
    return Rank(proc, rfd, name)


# ------------------------------------------------------------------------------------------ mounts
@contextlib.contextmanager
def tmpfs(path: str, options: str) -> Iterator[str]:
    """A real tmpfs mounted at ``path`` (we run as root in CI); the test is skipped where mounting is refused."""
    os.makedirs(path, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", path], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip()}); needs root or CAP_SYS_ADMIN")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", path], check=False, capture_output=True)


def remount(path: str, options: str, attempts: int = 200) -> None:
    """``mount -o remount,<options>``; retried while files are open for writing (EBUSY)."""
    err = ""
    for _ in range(attempts):
        r = subprocess.run(["mount", "-o", f"remount,{options}", path], capture_output=True, text=True)
        if r.returncode == 0:
            return
        err = r.stderr
        time.sleep(0.01)
    raise RuntimeError(f"remount,{options} of {path} failed: {err}")


def fill(path: str, leave: int = 0) -> str:
    """Fill the file system holding ``path`` with a file, leaving about ``leave`` bytes free; returns it."""
    filler = os.path.join(path, f"filler.{os.getpid()}.{time.monotonic_ns()}")
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        st = os.statvfs(path)
        want = max(0, st.f_bavail * st.f_frsize - leave)
        with contextlib.suppress(OSError):
            os.posix_fallocate(fd, 0, want)
        if leave == 0:  # top up to the last page
            chunk = b"\0" * 4096
            with contextlib.suppress(OSError):
                while True:
                    os.write(fd, chunk)
    finally:
        os.close(fd)
    return filler


def tree_bytes(path: str) -> int:
    """Bytes allocated (st_blocks) by every file under ``path``."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(FileNotFoundError):
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
    return total


def tree_files(path: str) -> list[str]:
    out = []
    for root, _dirs, files in os.walk(path):
        out += [os.path.relpath(os.path.join(root, n), path) for n in files]
    return sorted(out)


def temp_files(directory: str) -> list[str]:
    """Temporary files (``runtime.temp_name``: being written, or left by a killed writer) in ``directory``."""
    from monai_cache import runtime

    return sorted(n for n in os.listdir(directory) if runtime.temp_owner(n) is not None or n.endswith(".tmp"))


def tree_state(path: str) -> dict[str, tuple[int, int, int, int]]:
    """``{relative path: (size, mtime_ns, mode, uid)}`` of every file and directory under ``path``: compare two
    to count what was added, removed or changed in between."""
    out = {}
    for root, dirs, files in os.walk(path):
        for name in [*dirs, *files]:
            full = os.path.join(root, name)
            with contextlib.suppress(FileNotFoundError):
                st = os.lstat(full)
                out[os.path.relpath(full, path)] = (st.st_size, st.st_mtime_ns, st.st_mode, st.st_uid)
    return out


def tree_changes(before: Mapping[str, Any], after: Mapping[str, Any]) -> list[str]:
    """Paths added, removed or changed between two :func:`tree_state` snapshots."""
    return sorted(p for p in before.keys() | after.keys() if before.get(p) != after.get(p))
