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


def pytest_terminal_summary(terminalreporter) -> None:
    if _torch_files_removed:
        terminalreporter.write_line(
            f"removed {len(_torch_files_removed)} torch_<pid>_* file(s) that processes killed by the tests left in "
            "/dev/shm"
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
