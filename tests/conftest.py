from __future__ import annotations

import contextlib
import os
import re
import shutil
import sys
import uuid
import warnings

import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)

# MONAI deprecation chatter (Orientationd labels default, etc.) is not what these tests are about.
warnings.filterwarnings("ignore", category=FutureWarning)


def _monai_version() -> tuple[int, int]:
    from monai_cache.compat import MONAI_VERSION

    return MONAI_VERSION


# MONAI 1.3 and 1.4's PersistentDataset reads its cache files with torch.load(path), which torch 2.6 and later
# make weights_only=True: every hit raises UnpicklingError (MetaTensor). The tests compare our classes with MONAI's
# as it runs on the torch it was made for, where torch.load unpickled by default: this variable restores that
# default for calls that do not choose (ours never call torch.load).
if _monai_version() < (1, 5):
    os.environ.setdefault("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")  # its warning is filtered in pyproject.toml


def pytest_sessionstart(session: pytest.Session) -> None:
    # multiprocessing makes a process its /tmp/pymp-* directory (for the sockets that pass torch's file descriptors
    # between processes) the first time it needs one, and removes it at the process's exit: a worker or rank that a
    # test kills leaves its own behind (about 190 a run from tests/reliability/test_kills.py). Made here, it is
    # the one that every process forked from this one uses, and it goes when the suite ends.
    import multiprocessing.util

    multiprocessing.util.get_temp_dir()
    global _shm_at_start
    _shm_at_start = set(os.listdir("/dev/shm"))


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the documented examples' processes now if their tests are to run (tests/test_doc_examples.py): they
    then use the core that the tests before them leave idle, instead of a minute of the suite's own."""
    modules = {m for m in (getattr(item, "module", None) for item in session.items)
               if m is not None and m.__name__ == "test_doc_examples"}
    if modules and not session.config.option.collectonly:
        (module,) = modules
        module.EARLY = module.Runs.start()


def pytest_sessionfinish(session: pytest.Session) -> None:
    module = sys.modules.get("test_doc_examples")
    if module is not None and module.EARLY is not None:  # started, and their tests never ran (-x, -k, a crash)
        module.EARLY.stop()
    _remove_orphaned_semaphores()


# torch moves a tensor between processes through a file it creates in /dev/shm and unlinks at once: a process that
# a test kills in between (tests/reliability/test_kills.py, the Slurm and restart tests, ...) leaves that file
# behind, 1 to 15 per run of the suite. Each test removes the ones that appeared while it ran and whose creator is
# dead, and the summary counts them. Leaks in normal operation are the soak's to catch: it runs in a private
# /dev/shm and fails on anything left there (benchmarks/soak.py, tests/reliability).
_TORCH_SHM_FILE = re.compile(r"torch_(\d+)_\d+_\d+")
_torch_files_removed: list[str] = []


@pytest.fixture(autouse=True)
def _torch_files_of_killed_processes():
    from monai_cache.runtime import pid_alive

    before = set(os.listdir("/dev/shm"))
    yield
    for name in set(os.listdir("/dev/shm")) - before:
        m = _TORCH_SHM_FILE.fullmatch(name)
        if m and not pid_alive(int(m.group(1))):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join("/dev/shm", name))
                _torch_files_removed.append(name)


# A named semaphore is a /dev/shm/sem.* file: glibc's sem_open writes it under a temporary name (sem.XXXXXX) and
# links it to its own name; multiprocessing unlinks its semaphores (sem.mp-*) once made, or once freed where children
# are spawned. A process killed in between leaves the file. One that appeared during the suite and that no
# process maps any longer is such a leftover: at the end, those are removed and counted.
_SEMAPHORE_FILE = re.compile(r"sem\.(?:[A-Za-z0-9]{6}|mp-[a-z0-9_]{8})")
_shm_at_start: set[str] = set()
_semaphores_removed: list[str] = []


def _remove_orphaned_semaphores() -> None:
    import glob
    import time

    candidates = {os.path.join("/dev/shm", name) for name in set(os.listdir("/dev/shm")) - _shm_at_start
                  if _SEMAPHORE_FILE.fullmatch(name)}
    mapped = set()
    for maps in glob.glob("/proc/[0-9]*/maps") if candidates else ():
        with contextlib.suppress(OSError), open(maps) as f:
            mapped.update(path for line in f if (path := line.rstrip("\n").partition("/dev/shm/")[2]))
    for path in candidates:
        with contextlib.suppress(FileNotFoundError):
            if os.path.basename(path) not in mapped and time.time() - os.stat(path).st_mtime > 2:
                os.unlink(path)
                _semaphores_removed.append(path)


def pytest_terminal_summary(terminalreporter) -> None:
    if _torch_files_removed:
        terminalreporter.write_line(
            f"removed {len(_torch_files_removed)} torch_<pid>_* file(s) that processes killed by the tests left in "
            "/dev/shm"
        )
    if _semaphores_removed:
        terminalreporter.write_line(
            f"removed {len(_semaphores_removed)} semaphore file(s) (/dev/shm/sem.*) that processes killed by the "
            "tests left half made"
        )


@pytest.fixture
def shm_dir(monkeypatch):
    """A private, real tmpfs directory under /dev/shm for this test's caches (also for child processes)."""
    path = f"/dev/shm/mc-test-{uuid.uuid4().hex[:12]}"
    os.makedirs(path)
    monkeypatch.setenv("MONAI_CACHE_SHM_DIR", path)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def volumes(tmp_path_factory):
    """Eight small real NIfTI image/label pairs written with nibabel."""
    from helpers import write_volumes

    return write_volumes(str(tmp_path_factory.mktemp("nifti")), 8)


@pytest.fixture
def tiny_tmpfs(tmp_path):
    """A real 4 MiB tmpfs mount (we run as root in CI); skipped where mounting is not permitted."""
    import subprocess

    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    yield str(mnt)
    subprocess.run(["umount", "-l", str(mnt)], check=False)
