"""Shared test helpers: small real NIfTI data, a MONAI chain, and a transform that counts its calls
across processes (by appending to a file), so tests can tell how often deterministic work ran."""

from __future__ import annotations

import contextlib
import ctypes
import inspect
import math
import os
import select
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Hashable, Mapping, Sequence

import nibabel as nib
import numpy as np
import pytest
import torch
from monai.transforms import (
    Compose,
    EnsureChannelFirstd,
    LoadImaged,
    MapTransform,
    Orientationd,
    RandomizableTrait,
    RandSpatialCropd,
    ScaleIntensityRanged,
    Spacingd,
)

KEYS = ("image", "label")
SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_scripts")


def python_c(code: str) -> list[str]:
    """The command line of ``python -c code``, with MONAI as a plain install gives it, as the suite's scripts import it
    (tests/_scripts/_minimal_monai.py): half the CPU of an interpreter that imports MONAI."""
    prelude = f"import sys; sys.path.insert(0, {SCRIPTS!r}); import _minimal_monai; del sys.path[0]\n"
    return [sys.executable, "-c", prelude + code]


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor, so that -0.0 != 0.0 and NaN == NaN when comparing."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def sharing(x, path: str = "item", seen: dict | None = None, out: list | None = None) -> list[tuple[str, str]]:
    """Where one object (a dict, list, tensor or array) stands twice in ``x``: ``(path, path where it stood first)``
    in walking order. Pickling (torch's DataLoader) keeps one object; so must what claims the same batches."""
    from monai.data import MetaTensor

    seen = {} if seen is None else seen
    out = [] if out is None else out
    if isinstance(x, (dict, list, torch.Tensor, np.ndarray)):
        if id(x) in seen:
            out.append((path, seen[id(x)]))
            return out
        seen[id(x)] = path
    if isinstance(x, dict):
        for k, v in x.items():
            sharing(v, f"{path}[{k!r}]", seen, out)
    elif isinstance(x, (list, tuple)):
        for i, v in enumerate(x):
            sharing(v, f"{path}[{i}]", seen, out)
    elif isinstance(x, MetaTensor):
        sharing(x.__dict__, f"{path}.__dict__", seen, out)
    return out


def assert_same(
    a, b, path: str = "item", strides: bool = True, skip_keys: Sequence = (), key_order: bool = True
) -> None:
    """Exact equality: types (keys too), dtypes, shapes, values (NaN-aware), MetaTensor attributes (``meta``,
    ``applied_operations``, ``is_batch``), strides unless ``strides=False``, and the order of dict keys unless
    ``key_order=False``. Dict entries whose key is in ``skip_keys`` are not compared (e.g. TraceKeys.ID, an
    object's address in the process that made it)."""
    from monai.data import MetaTensor

    assert type(a) is type(b), f"{path}: {type(a)} != {type(b)}"
    if isinstance(a, dict):
        assert list(a) == list(b) if key_order else a.keys() == b.keys(), path
        assert {k: type(k) for k in a} == {k: type(k) for k in b}, path
        for k in a:
            if k not in skip_keys:
                assert_same(a[k], b[k], f"{path}[{k!r}]", strides, skip_keys, key_order)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]", strides, skip_keys, key_order)
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert not strides or a.stride() == b.stride(), path
        x = a.as_tensor() if isinstance(a, MetaTensor) else a
        y = b.as_tensor() if isinstance(b, MetaTensor) else b
        assert torch.equal(bits(x), bits(y)), path
        if isinstance(a, MetaTensor):
            assert a.is_batch == b.is_batch, path
            assert_same(a.__dict__, b.__dict__, f"{path}.__dict__", strides, skip_keys, key_order)
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert not strides or a.strides == b.strides, path
        assert a.tobytes() == b.tobytes(), path
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), path
    elif isinstance(a, np.generic):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), path
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def write_volumes(directory: str, n: int, shape: tuple[int, int, int] = (24, 20, 16), seed: int = 0) -> list[dict]:
    """Write ``n`` CT-like int16 images (air -1000, a bright box) and uint8 labels; return MONAI data dicts."""
    rng = np.random.default_rng(seed)
    os.makedirs(directory, exist_ok=True)
    data = []
    for i in range(n):
        img = np.full(shape, -1000, np.int16)
        lab = np.zeros(shape, np.uint8)
        lo = [int(rng.integers(1, s // 2)) for s in shape]
        hi = [lo[d] + int(rng.integers(2, shape[d] // 2)) for d in range(3)]
        box = tuple(slice(a, b) for a, b in zip(lo, hi))
        img[box] = rng.integers(0, 200, size=[b - a for a, b in zip(lo, hi)], dtype=np.int16)
        lab[box] = 1
        affine = np.diag([0.9 + 0.1 * (i % 3), 1.0, 2.0, 1.0])
        ip, lp = os.path.join(directory, f"img{i}.nii.gz"), os.path.join(directory, f"lab{i}.nii.gz")
        nib.save(nib.Nifti1Image(img, affine), ip)
        nib.save(nib.Nifti1Image(lab, affine), lp)
        data.append({"image": ip, "label": lp, "case": i})
    return data


class CountCalls(MapTransform):
    """Deterministic: appends ``<pid> <case>`` to ``log_path`` for every item it transforms."""

    def __init__(self, log_path: str, keys: Sequence[Hashable] = ("image",)) -> None:
        super().__init__(keys)
        self.log_path = log_path

    def __call__(self, data: Mapping) -> dict:
        fd = os.open(self.log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, f"{os.getpid()} {data.get('case', -1)}\n".encode())
        finally:
            os.close(fd)
        return dict(data)


def read_calls(log_path: str) -> list[tuple[int, int]]:
    if not os.path.exists(log_path):
        return []
    with open(log_path) as f:
        return [tuple(int(x) for x in line.split()) for line in f if line.strip()]  # type: ignore[misc]


def chain(log_path: str | None = None, crop: int | None = 8) -> Compose:
    """The tutorial chain (small): load, channel first, RAS, resample, scale; then a random crop."""
    ts = []
    if log_path is not None:
        ts.append(CountCalls(log_path))
    ts += [
        LoadImaged(keys=KEYS),
        EnsureChannelFirstd(keys=KEYS),
        Orientationd(keys=KEYS, axcodes="RAS", labels=None),
        Spacingd(keys=KEYS, pixdim=(1.5, 1.5, 2.0), mode=("bilinear", "nearest")),
        ScaleIntensityRanged(keys=["image"], a_min=-57, a_max=164, b_min=0.0, b_max=1.0, clip=True),
    ]
    if crop:
        ts.append(RandSpatialCropd(keys=KEYS, roi_size=(crop, crop, crop), random_size=False))
    return Compose(ts)


def open_for_writing(pid: int, directory) -> int:
    """How many files of ``directory`` process ``pid`` holds open for writing (a writer is inside a write)."""
    n = 0
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if not target.startswith(str(directory) + "/"):
                    continue
                with open(f"/proc/{pid}/fdinfo/{fd}") as f:
                    flags = next(int(line.split()[1], 8) for line in f if line.startswith("flags:"))
                n += (flags & os.O_ACCMODE) in (os.O_WRONLY, os.O_RDWR)
    return n


def watcher_pid(cache_path: str, timeout: float = 30.0) -> int:
    """The pid of the watcher of the shared-memory cache at ``cache_path`` (the process holding its ``watcher`` file
    open), once it runs: a join starts it without waiting for it."""
    from monai_cache import keeper

    target = os.path.join(cache_path, "watcher")
    deadline = time.monotonic() + timeout
    while True:
        if keeper.watching(cache_path):
            for pid in filter(str.isdigit, os.listdir("/proc")):
                with contextlib.suppress(OSError):
                    if any(os.readlink(f"/proc/{pid}/fd/{fd}") == target for fd in os.listdir(f"/proc/{pid}/fd")):
                        return int(pid)
        assert time.monotonic() < deadline, f"no watcher of {cache_path}"
        time.sleep(0.01)


def freeze_watcher(cache_path: str) -> int:
    """SIGSTOP the watcher of the cache at ``cache_path``; returns its pid. Stopped, it still holds its mark (no other
    watcher is started for the cache) but removes nothing, until it is killed: :func:`kill_watcher` in two steps, for a
    test whose processes keep joining the cache until they are all killed."""
    pid = watcher_pid(cache_path)
    os.kill(pid, signal.SIGSTOP)
    return pid


def kill_watcher(cache_path: str, timeout: float = 30.0) -> None:
    """SIGKILL the watcher of the cache at ``cache_path``, as a kill of every process at once (a Slurm step's cgroup)
    does: its users killed next leave the cache stale, for the next process that joins a cache to reclaim."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(watcher_pid(cache_path, timeout), signal.SIGKILL)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def slurm_task(procid: int, localid: int, nodeid: int, tasks_per_node: str) -> dict[str, str]:
    """The variables of a task that ``srun`` started without torchrun, as Slurm 22.05 sets them (the step's and the
    job's, equal here; ``SLURM_NTASKS_PER_NODE`` where every node has the same count, as with
    ``--ntasks-per-node``, which Lightning asks for). Lightning's ``SLURMEnvironment`` reads these and exports none
    of torchrun's variables: a test starts a rank with these, its ``MASTER_ADDR`` / ``MASTER_PORT``, and no other
    launcher variable (``without_launcher``)."""
    from monai_cache.launcher import parse_tasks_per_node

    runs = parse_tasks_per_node(tasks_per_node)
    ntasks, nnodes = sum(c * n for c, n in runs), sum(n for _c, n in runs)
    env = {
        "SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": str(procid), "SLURM_LOCALID": str(localid),
        "SLURM_NODEID": str(nodeid), "SLURM_NTASKS": str(ntasks), "SLURM_STEP_NUM_TASKS": str(ntasks),
        "SLURM_NNODES": str(nnodes), "SLURM_TASKS_PER_NODE": tasks_per_node,
        "SLURM_STEP_TASKS_PER_NODE": tasks_per_node,
    }  # fmt: skip
    if len(runs) == 1:
        env["SLURM_NTASKS_PER_NODE"] = str(runs[0][0])
    return env


def without_launcher(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` without any variable of a launcher (torchrun's, Slurm's) or the machine identity override."""
    from monai_cache.launcher import LAUNCHER_VARIABLES

    drop = {*LAUNCHER_VARIABLES, "NODE_RANK", "MONAI_CACHE_NODE_ID"}
    return {k: v for k, v in environ.items() if k not in drop and not k.startswith("SLURM_")}


def as_slurm_task(monkeypatch, procid: int, localid: int, nodeid: int, tasks_per_node: str) -> None:
    """This process as a task that srun started (``slurm_task``), with no other launcher variable."""
    for name in os.environ.keys() - without_launcher(os.environ).keys():
        monkeypatch.delenv(name)
    for name, value in slurm_task(procid, localid, nodeid, tasks_per_node).items():
        monkeypatch.setenv(name, value)


class Times10(MapTransform):
    """Deterministic: x -> 10 x (for hash_as_key tests on plain numbers)."""

    def __call__(self, data: Mapping) -> dict:
        d = dict(data)
        for k in self.key_iterator(d):
            d[k] = d[k] * 10
        return d


class RandZeroInPlace(MapTransform, RandomizableTrait):
    """A random-position transform that writes into its input in place (the worst case for a shared cache)."""

    def __call__(self, data: Mapping) -> dict:
        d = dict(data)
        for k in self.key_iterator(d):
            d[k].mul_(0)
        return d


PR_SET_CHILD_SUBREAPER = 36  # <linux/prctl.h>
REAPERS = {"prompt": 0.0, "slow": 1.0}
"""How long after an orphan exits its reaper reaps it: at once (tini, ``docker --init``), or a second late (an init
busy elsewhere, as on the machine that wrote these tests)."""


def under_reaper(kind: str, body: Callable[[], None], guard_s: float = 120.0) -> None:
    """Run ``body`` in a forked child T of a reaper R (a fork of this interpreter: no interpreter start): R is a
    child subreaper (``prctl(PR_SET_CHILD_SUBREAPER)``), so the processes T's children leave behind (a keeper, which
    detaches with a double fork) are R's once orphaned, and R reaps each ``REAPERS[kind]`` seconds after it exits,
    as init does in a container. T's own children are T's to reap. A failure in ``body`` fails the test with T's
    traceback."""
    delay = REAPERS[kind]
    r, w = os.pipe()  # close-on-exec: the processes the body starts do not hold it open
    reaper = os.fork()
    if reaper == 0:  # R
        try:
            os.close(r)
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
                os.write(w, f"prctl(PR_SET_CHILD_SUBREAPER): errno {ctypes.get_errno()}".encode())
                os._exit(1)
            test = os.fork()
            if test == 0:  # T
                try:
                    body()
                    os.write(w, b"ok")
                except BaseException:
                    os.write(w, traceback.format_exc().encode())
                finally:
                    os._exit(0)
            os.write(w, f"{test}\n".encode())
            os.close(w)  # the pipe ends when T does
            while True:  # reap every child of R (T and the orphans it adopted)
                info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOWAIT)  # blocks until one has exited
                if info is None:
                    continue
                if info.si_pid != test and delay:
                    time.sleep(delay)
                os.waitpid(info.si_pid, 0)
                if info.si_pid == test:
                    break
        finally:
            os._exit(0)
    os.close(w)
    out = b""
    deadline = time.monotonic() + guard_s
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([r], [], [], max(0.0, deadline - time.monotonic()))
            chunk = os.read(r, 65536) if ready else b""
            if not chunk:
                break
            out += chunk
    finally:
        os.close(r)
        head, _, result = out.partition(b"\n")
        if time.monotonic() >= deadline and head.isdigit():  # T hangs
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(head), signal.SIGKILL)
        # T is done; R may still be letting an orphan wait: the test is over, init takes what R leaves
        os.kill(reaper, signal.SIGKILL)
        os.waitpid(reaper, 0)
    if result != b"ok":
        pytest.fail(f"under a {kind} reaper:\n{(result or out).decode(errors='replace')}", pytrace=False)


@contextlib.contextmanager
def mounted_tmpfs(path: str, options: str):
    """A size-limited tmpfs mounted at ``path`` for the block (skips the test where mounting is not allowed)."""
    os.makedirs(path, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", path], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.decode().strip()}); needs root/CAP_SYS_ADMIN")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", path], check=False)


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Small tensors on a shared 2-core machine: OpenMP hand-offs cost more than the work. Autouse in the
    modules that import it."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# Parameters a later MONAI added to a class: ours takes them, in that version's place, with an older MONAI too.
LATER_MONAI_PARAMETERS = {"PersistentDataset": ("track_meta", "weights_only")}  # MONAI 1.6.0


def assert_signature_extends(ours: type, theirs: type) -> list[str]:
    """``ours.__init__`` takes every parameter of ``theirs.__init__`` in the same order, kind and default, and
    adds only keyword-only ones (or ``**options``), after the parameters a later MONAI added to the class (with an
    older MONAI installed); returns the keyword-only additions."""
    params, monai_params = inspect.signature(ours.__init__).parameters, inspect.signature(theirs.__init__).parameters
    assert list(params)[: len(monai_params)] == list(monai_params)
    for name, p in monai_params.items():
        assert params[name].default == p.default and params[name].kind == p.kind, name
    extras = list(params)[len(monai_params) :]
    later = [n for n in LATER_MONAI_PARAMETERS.get(theirs.__name__, ()) if n not in monai_params]
    assert extras[: len(later)] == later, extras
    assert all(params[n].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for n in later)
    extras = extras[len(later) :]
    added = (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.VAR_KEYWORD)
    assert extras and all(params[n].kind in added for n in extras), extras
    assert issubclass(ours, theirs)
    return extras
