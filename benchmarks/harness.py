"""What the benchmarks share: starting ranks the way ``torchrun`` does, and measuring process trees.

``torchrun --nproc-per-node N script args`` starts N independent interpreters with ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``ROLE_RANK``, ``ROLE_WORLD_SIZE``, ``MASTER_ADDR`` and
``MASTER_PORT`` set, and ``OMP_NUM_THREADS=1`` when there is more than one process per node;
:func:`run_ranks` does the same without torchrun's rendezvous (its start-up would count in every run), and
waits for all of them.

Measuring, from outside the measured processes:

* :func:`tree_cpu_seconds`: CPU of a process, its living descendants and the children they reaped.
* :class:`MemorySampler`: memory of process trees together (PSS), plus the shared-memory files no process
  has mapped, sampled in a background thread.
* :class:`Events`: progress events a rank appends to a file and the launcher polls.

Reporting, the one format of the suites:

* :class:`Report`: what a suite prints is what it saves: headings, lines and aligned tables on stdout as they come,
  and the same text in ``<out>/<suite>.md`` (each block as printed, in a fenced block under its heading, ready to
  paste into the docs) with the raw measurements in ``<out>/<suite>.json``.
* :func:`machine_info` and :func:`describe_machine`: cores, memory, CPU model, load average, versions.
* :func:`rotated`, :func:`ratios` and :func:`median`: configurations in a rotating order per repeat, per-repeat
  ratios against a reference of the same repeat, and their median.

This module ships with the repository's benchmarks, not with the package; scripts next to it import it as
``import harness`` (a script's own directory is first on ``sys.path``).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

__all__ = [
    "Events",
    "MemorySampler",
    "Report",
    "describe_machine",
    "free_port",
    "machine_info",
    "median",
    "own_cpu_seconds",
    "process_tree",
    "ratios",
    "rotated",
    "run_ranks",
    "torchrun_env",
    "tree_cpu_seconds",
]


# ---------------------------------------------------------------------------------------------------------
# Starting ranks
# ---------------------------------------------------------------------------------------------------------

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
"""The repository's root (the checkout whose monai_cache the benchmarks measure)."""


def free_port() -> int:
    """A TCP port free on localhost right now (for ``MASTER_PORT``)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def torchrun_env(rank: int, world: int, port: int, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment torchrun gives rank ``rank`` of ``world`` processes on one node, with this checkout first on
    ``PYTHONPATH`` (a rank measures the code its launcher runs, whatever ``pip install`` points at)."""
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        GROUP_RANK="0",
        ROLE_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        ROLE_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    if world > 1:
        env.setdefault("OMP_NUM_THREADS", "1")
    return env


def run_ranks(
    argv: Sequence[str],
    world: int,
    log_dir: str,
    env: dict[str, str] | None = None,
    timeout: float = 1800.0,
    on_start: Callable[[list[int]], object] | None = None,
    on_poll: Callable[[], object] | None = None,
) -> None:
    """Run ``python argv...`` as ``world`` ranks; return when all exited with 0.

    Args:
        argv: the script and its arguments (run with this interpreter).
        world: number of ranks.
        log_dir: where ``rank<r>.log`` (stdout and stderr of each rank) goes.
        env: environment to start from (default: this process's).
        timeout: seconds after which the ranks are killed.
        on_start: called with the ranks' pids once all are started (e.g. ``MemorySampler.start``).
        on_poll: called every 0.1 s while the ranks run, and once after they exited.

    Raises:
        RuntimeError: a rank failed or the run timed out; the message holds the end of its log.
    """
    os.makedirs(log_dir, exist_ok=True)
    port = free_port()
    procs: list[subprocess.Popen] = []
    logs = [os.path.join(log_dir, f"rank{r}.log") for r in range(world)]
    try:
        for rank in range(world):
            with open(logs[rank], "wb") as log:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, *argv],
                        env=torchrun_env(rank, world, port, env),
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                    )
                )
        if on_start is not None:
            on_start([p.pid for p in procs])
        deadline = time.monotonic() + timeout
        while True:
            codes = [p.poll() for p in procs]
            if on_poll is not None:
                on_poll()
            failed = next((r for r, c in enumerate(codes) if c not in (None, 0)), None)
            if failed is not None or time.monotonic() > deadline:
                what = f"rank {failed} exited with {codes[failed]}" if failed is not None else "timed out"
                with open(logs[failed or 0], errors="replace") as f:
                    tail = "".join(f.readlines()[-30:])
                raise RuntimeError(f"{' '.join(argv)}: {what}. End of {logs[failed or 0]}:\n{tail}")
            if all(c == 0 for c in codes):
                return
            time.sleep(0.1)
    finally:
        for p in procs:  # only our own ranks, by pid; their DataLoader workers exit with them
            if p.poll() is None:
                p.kill()
                p.wait()


class Events:
    """Progress events of one rank, appended to a file (one ``O_APPEND`` write each) that the launcher polls.

    Args:
        path: the file; ``None`` for a rank that reports nothing.
    """

    def __init__(self, path: str | None) -> None:
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600) if path else -1
        self._seen = 0

    def emit(self, event: str) -> None:
        """Append ``event`` (no whitespace in it); in the rank."""
        if self._fd >= 0:
            os.write(self._fd, f"{event}\n".encode())

    def close(self) -> None:
        """Close the file; in the rank."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def poll(self, progress: Callable[[str], object] | None) -> None:
        """Call ``progress`` with each event appended since the last poll; in the launcher."""
        try:
            with open(str(self.path), "rb") as f:
                f.seek(self._seen)
                chunk = f.read()
        except OSError:
            return
        end = chunk.rfind(b"\n") + 1
        self._seen += end
        if progress is not None:
            for event in chunk[:end].decode().split():
                progress(event)


# ---------------------------------------------------------------------------------------------------------
# Process trees: CPU
# ---------------------------------------------------------------------------------------------------------


def _children(pid: int) -> list[int]:
    """Direct children of ``pid`` (from ``/proc/<pid>/task/*/children``)."""
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                out.extend(int(x) for x in f.read().split())
        except OSError:
            continue
    return out


def process_tree(roots: Iterable[int]) -> list[int]:
    """``roots`` and all their living descendants."""
    seen: list[int] = []
    todo = [int(p) for p in roots]
    while todo:
        pid = todo.pop()
        if pid not in seen and os.path.exists(f"/proc/{pid}"):
            seen.append(pid)
            todo.extend(_children(pid))
    return seen


def own_cpu_seconds() -> float:
    """CPU seconds of this process (all threads) and of the children it reaped (e.g. the DataLoader workers of
    past epochs), measured from inside a rank."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds used so far by ``pid``, its living descendants, and the children they have reaped."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for p in process_tree([pid]):
        try:
            with open(f"/proc/{p}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        total += sum(int(v) for v in fields[11:15]) / tick  # utime, stime, cutime, cstime
    return total


# ---------------------------------------------------------------------------------------------------------
# Process trees: memory
# ---------------------------------------------------------------------------------------------------------

_PSS = re.compile(rb"^Pss:\s+(\d+) kB", re.M)


def _pss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            m = _PSS.search(f.read())
    except OSError:  # the process just exited
        return 0
    return int(m.group(1)) * 1024 if m else 0


def tree_pss_bytes(pid: int) -> int:
    """PSS bytes of ``pid`` and its living descendants (each shared page counted once over them)."""
    return sum(_pss_bytes(p) for p in process_tree([pid]))


def _tmpfs_files(root: str) -> dict[int, int]:
    """``{inode: allocated bytes}`` of the files under ``root``."""
    out: dict[int, int] = {}
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            with contextlib.suppress(OSError):
                st = os.lstat(os.path.join(dirpath, name))
                out[st.st_ino] = st.st_blocks * 512
    return out


def _mapped_ranges(pid: int, prefix: str) -> list[tuple[int, int, int]]:
    """``(inode, start offset, end offset)`` of the mappings of files under ``prefix`` (``/proc/<pid>/maps``)."""
    out: list[tuple[int, int, int]] = []
    try:
        with open(f"/proc/{pid}/maps") as f:
            lines = f.readlines()
    except OSError:
        return out
    for line in lines:
        parts = line.split(None, 5)
        if len(parts) < 6 or not parts[5].startswith(prefix):
            continue
        lo, hi = (int(v, 16) for v in parts[0].split("-"))
        off = int(parts[2], 16)
        out.append((int(parts[4]), off, off + hi - lo))
    return out


def _union_length(ranges: list[tuple[int, int]], cap: int) -> int:
    total, end = 0, 0
    for lo, hi in sorted(ranges):
        hi = min(hi, cap)
        if hi <= end:
            continue
        total += hi - max(lo, end)
        end = hi
    return total


class MemorySampler:
    """Samples the memory of process trees together, from outside, in a background thread.

    ``total = sum of PSS of every process + bytes of the files under shm_dir - the part of them mapped``.

    PSS (proportional set size) charges each resident page to the processes mapping it in equal parts, so
    the sum over a group of processes counts every page they use once: MONAI's cache inherited by
    forked workers, shared libraries, torch's shared-memory batches, and the pages of monai_cache's
    tmpfs files that are mapped. tmpfs pages that no process maps are in no PSS, so the allocated bytes of
    the files under ``shm_dir`` are added, minus the mapped byte ranges of those files (counted already).
    That correction assumes mapped pages have been touched, which holds for decoded cache entries (the
    transforms read them whole); between samples, short-lived batches can be missed, so peaks are lower
    bounds.

    Args:
        roots: pids whose trees are measured (the ranks); descendants are found at every sample. More can be
            given to :meth:`start`.
        shm_dir: tmpfs directory whose files count as well (monai_cache's cache of this run).
        interval: seconds between samples.
    """

    def __init__(self, roots: Sequence[int], shm_dir: str | None, interval: float = 0.5) -> None:
        self.roots = list(roots)
        self.shm_dir = shm_dir
        self.interval = interval
        self.samples: list[dict[str, float]] = []
        self.cpu_s = 0.0  # CPU seconds the sampling itself took (kernel time walking page tables, mostly)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="memory-sampler", daemon=True)

    def sample(self) -> dict[str, float]:
        """Take one sample now: ``{"t", "total", "pss", "shm_files", "shm_mapped", "processes"}`` (bytes)."""
        t = time.time()
        pids = process_tree(self.roots)
        pss = sum(_pss_bytes(p) for p in pids)
        files: dict[int, int] = {}
        mapped = 0
        if self.shm_dir and os.path.isdir(self.shm_dir):
            files = _tmpfs_files(self.shm_dir)
            prefix = os.path.realpath(self.shm_dir) + "/"
            by_inode: dict[int, list[tuple[int, int]]] = {}
            for p in pids:
                for ino, lo, hi in _mapped_ranges(p, prefix):
                    if ino in files:
                        by_inode.setdefault(ino, []).append((lo, hi))
            mapped = sum(_union_length(r, files[ino]) for ino, r in by_inode.items())
        shm = sum(files.values())
        s = {
            "t": t,
            "total": pss + shm - mapped,
            "pss": pss,
            "shm_files": shm,
            "shm_mapped": mapped,
            "processes": len(pids),
        }
        self.samples.append(s)
        return s

    def _loop(self) -> None:
        cpu0 = time.thread_time()
        while not self._stop.is_set():
            started = time.monotonic()
            self.sample()
            self.cpu_s = time.thread_time() - cpu0
            self._stop.wait(max(0.0, self.interval - (time.monotonic() - started)))

    def start(self, roots: Sequence[int] = ()) -> MemorySampler:
        """Start sampling in the background, adding ``roots`` to the trees measured."""
        self.roots.extend(roots)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop sampling (waits for the sample in progress); nothing to do if it never started."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def summary(self, window: tuple[float, float] | None = None) -> dict[str, float | None]:
        """Peak and mean of ``total`` over all samples, and the mean within ``window`` (wall-clock times)."""
        totals = [s["total"] for s in self.samples if s["processes"] > 0]
        inside = [s["total"] for s in self.samples if window and window[0] <= s["t"] <= window[1] and s["processes"]]
        return {
            "mem_peak": max(totals) if totals else None,
            "mem_mean": sum(totals) / len(totals) if totals else None,
            "mem_warm": sum(inside) / len(inside) if inside else None,
            "mem_samples": len(totals),
            "mem_processes_max": max((int(s["processes"]) for s in self.samples), default=0),
            "mem_sampler_cpu_s": self.cpu_s,
        }


# ---------------------------------------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------------------------------------


def parse_settings(text: str) -> list[tuple[int, int]]:
    """``--settings`` of the benchmarks: ``"1x2,2x1"`` -> ``[(1, 2), (2, 1)]`` (ranks x DataLoader workers)."""
    out = []
    for part in text.split(","):
        r, _, w = part.strip().partition("x")
        if not (r.isdigit() and w.isdigit() and int(r) >= 1):
            raise argparse.ArgumentTypeError(f"settings look like 1x2,2x1 (ranks x workers); got {text!r}")
        out.append((int(r), int(w)))
    return out


def median(values: Iterable[float | None]) -> float | None:
    """Median of the values that are not ``None`` (``None`` if there are none)."""
    vals = [float(v) for v in values if v is not None]
    return statistics.median(vals) if vals else None


def rotated(items: Sequence[Any], repeat: int) -> list[Any]:
    """``items`` starting at position ``repeat`` (mod its length): each repeat runs the configurations in another
    order, so that drift on a shared machine spreads over all of them."""
    k = repeat % len(items) if items else 0
    return [*items[k:], *items[:k]]


def ratios(values: Sequence[float | None], references: Sequence[float | None]) -> list[float]:
    """``value / reference`` of each repeat that has both (runs of one repeat are minutes apart, not hours)."""
    return [v / r for v, r in zip(values, references) if v is not None and r]


# ---------------------------------------------------------------------------------------------------------
# The machine, and the report format
# ---------------------------------------------------------------------------------------------------------


def machine_info() -> dict[str, Any]:
    """Cores, memory, CPU model, load average, and the software versions of this machine."""
    info: dict[str, Any] = {
        "cpus": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "cpu_model": platform.processor() or platform.machine(),
        "ram_bytes": None,
        "loadavg": list(os.getloadavg()),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                info["cpu_model"] = line.split(":", 1)[1].strip()
                break
    with contextlib.suppress(OSError), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                info["ram_bytes"] = int(line.split()[1]) * 1024
                break
    for module in ("torch", "monai", "monai_cache"):
        try:
            info[module] = __import__(module).__version__
        except Exception:  # pragma: no cover - reported as unknown
            info[module] = None
    return info


def describe_machine(m: dict[str, Any]) -> str:
    """One sentence about the machine of :func:`machine_info` (and ``loadavg_end`` if set)."""
    ram = f"{m['ram_bytes'] / (1 << 30):.0f} GiB RAM" if m.get("ram_bytes") else "RAM unknown"
    load = m.get("loadavg") or [0.0, 0.0, 0.0]
    end = m.get("loadavg_end")
    load_end = f"; at the end {end[0]:.1f}" if end else ""
    return (
        f"{m['cpus_usable']} usable of {m['cpus']} CPU cores ({m['cpu_model']}), {ram}; load average at the start "
        f"{load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} (1 / 5 / 15 min){load_end}. Python {m['python']}, "
        f"torch {m.get('torch')}, MONAI {m.get('monai')}, monai_cache {m.get('monai_cache')}; {m['platform']}."
    )


def format_table(rows: Sequence[Sequence[str]], left: int = 1) -> str:
    """Rows of cells as aligned text with a rule under the header (the first row); the first ``left`` columns are
    aligned left, the others right."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(line.rstrip() for line in lines)


class Report:
    """The suites' one report format: printed as it comes, saved as printed.

    ``heading``, ``line`` and ``table`` print to stdout at once (a long run shows its results as they come);
    :meth:`save` writes ``<out>/<suite>.md``, in which each heading is a Markdown heading and what was printed under
    it is one fenced text block, exactly as printed, and ``<out>/<suite>.json`` with the measurements given. The docs
    paste those blocks, so a table in the docs is a table a suite printed.

    Args:
        suite: the suite's name (``python -m benchmarks <suite>``), which names the files.
        level: the Markdown level of the headings (3: ``###``, to sit under a page's own sections).
    """

    def __init__(self, suite: str, level: int = 3) -> None:
        self.suite = suite
        self.level = level
        self._blocks: list[tuple[str | None, list[str]]] = [(None, [])]

    def heading(self, text: str) -> None:
        """Start a section titled ``text``."""
        print(f"\n{text}\n{'=' * min(len(text), 120)}", flush=True)
        self._blocks.append((text, []))

    def line(self, text: str = "") -> None:
        """Print ``text`` (one or more lines) in the current section."""
        print(text, flush=True)
        self._blocks[-1][1].append(text)

    def table(self, rows: Sequence[Sequence[str]], left: int = 1, title: str | None = None) -> None:
        """Print rows of cells (the first is the header) as an aligned table, under ``title`` if given."""
        text = format_table(rows, left)
        self.line(f"{title}\n{text}" if title else text)

    def machine(self, info: dict[str, Any], at_end: bool = False) -> None:
        """Print :func:`describe_machine` of ``info`` (from :func:`machine_info` at the start of the run); ``at_end``:
        with the load average now as the one at the end (also set in ``info``)."""
        if at_end:
            info["loadavg_end"] = list(os.getloadavg())
        self.line(describe_machine(info))

    def targets(self, checks: Iterable[tuple[bool, str]]) -> list[tuple[bool, str]]:
        """Print ``[ok]`` or ``[missed]`` before each check's text; returns the checks."""
        checks = list(checks)
        self.line("\n".join(f"[{'ok' if ok else 'missed'}] {text}" for ok, text in checks) or "(no target applies)")
        return checks

    def markdown(self) -> str:
        """The report as Markdown: headings, and under each what was printed, in a fenced text block."""
        out: list[str] = []
        for title, lines in self._blocks:
            if title is not None:
                out += ["#" * self.level + " " + title, ""]
            text = "\n".join(lines).strip("\n")
            if text:
                out += ["```text", text, "```", ""]
        return "\n".join(out)

    def save(self, out: str, data: Any = None) -> str:
        """Write ``<out>/<suite>.md`` (and ``<out>/<suite>.json`` with ``data`` if given); returns the .md path."""
        os.makedirs(out, exist_ok=True)
        path = os.path.join(out, f"{self.suite}.md")
        with open(path, "w") as f:
            f.write(self.markdown())
        if data is not None:
            with open(os.path.join(out, f"{self.suite}.json"), "w") as f:
                json.dump(data, f, indent=1)
        return path
