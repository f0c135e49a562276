"""The ``monai-cache`` command line, run as ``python -m monai_cache`` on real shared-memory and disk caches."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from monai_cache import cli

PY = sys.executable
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def mc(*args: str, check: int | None = 0, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run ``python -m monai_cache ARGS`` (environment inherited: MONAI_CACHE_SHM_DIR from the fixture)."""
    p = subprocess.run([PY, "-m", "monai_cache", *args], capture_output=True, text=True, timeout=timeout, cwd=REPO)
    if check is not None:
        assert p.returncode == check, (p.returncode, p.stdout, p.stderr)
    return p


def cl(*args: str, check: int | None = 0) -> subprocess.CompletedProcess:
    """``monai-cache ARGS`` in this process (no interpreter start-up: the machine is shared and slow)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main(list(args))
    p = subprocess.CompletedProcess(args, rc, out.getvalue(), err.getvalue())
    if check is not None:
        assert rc == check, (rc, p.stdout, p.stderr)
    return p


@pytest.mark.parametrize("command", [c.name for c in cli.COMMANDS])
def test_help_of_every_command(command, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main([command, "--help"])
    assert e.value.code == 0
    assert "usage: monai-cache " + command in capsys.readouterr().out


def test_no_command_prints_help_and_exits_2(capsys):
    assert cli.main([]) == 2
    assert "COMMAND" in capsys.readouterr().err


# ------------------------------------------------------------------------------------ shared memory
def test_ls_info_clear_shared_memory(shm_dir):
    # a live one, used by this process (made first: joining a cache reclaims stale ones)
    import torch

    from monai_cache.shm import SharedMemoryStore, cache_root

    live = SharedMemoryStore("live", 2)
    live[0] = {"x": torch.zeros(1000)}
    live[1] = {"x": torch.ones(10)}
    # a stale cache: its only user was killed
    crash = textwrap.dedent(
        """
        import os, signal, torch
        from helpers import kill_watcher
        from monai_cache.shm import SharedMemoryStore
        s = SharedMemoryStore("crashed", 2)
        s[0] = {"x": torch.ones(1000)}
        print(s.path, flush=True)
        kill_watcher(s.path)  # every process killed at once, the cache's watcher too
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    tests = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([tests, *sys.path])}
    p = subprocess.run([PY, "-c", crash], capture_output=True, text=True, timeout=60, env=env)
    assert p.returncode == -signal.SIGKILL
    stale_path = p.stdout.strip()
    # things that are not ours: a file next to the root, a file and a directory inside the root
    root = cache_root()
    foreign = [os.path.join(shm_dir, "someone-elses"), os.path.join(root, "notes.txt")]
    for path in foreign:
        with open(path, "w") as f:
            f.write("not a cache")
    foreign_dir = os.path.join(root, "mine-not-yours")
    os.mkdir(foreign_dir)
    with open(os.path.join(foreign_dir, "data"), "w") as f:
        f.write("keep me")
    try:
        caches = {c["key"]: c for c in json.loads(mc("ls", "--json").stdout)}
        assert caches["crashed"]["state"] == "stale" and caches["crashed"]["processes"] == []
        assert caches["live"]["state"] == "live" and os.getpid() in caches["live"]["processes"]
        assert caches["live"]["entries"] == 2 and caches["live"]["bytes"] > 0
        table = cl("ls").stdout
        assert "crashed" in table and "live" in table and "PROCESSES" in table
        # the process that holds a cache is named, with its command line (a server keeping one after its training)
        assert f"live is held by {os.getpid()} (" in table and "pytest" in caches["live"]["commands"][str(os.getpid())]
        assert "crashed is held" not in table
        assert cl("info").stdout == table  # info without a directory: the shared-memory caches

        out = json.loads(mc("clear", "--json").stdout)
        assert [c["key"] for c in out["removed"]] == ["crashed"]
        assert not os.path.exists(stale_path)
        assert os.path.isdir(live.path) and live[1]["x"].sum() == 10  # live cache untouched without --all

        out = json.loads(cl("clear", "--all", "--json").stdout)
        assert [c["key"] for c in out["removed"]] == ["live"]
        assert not os.path.exists(live.path)
        for path in foreign:
            assert open(path).read() == "not a cache"
        assert open(os.path.join(foreign_dir, "data")).read() == "keep me"
        assert "removed 0 cache(s)" in cl("clear").stdout
    finally:
        live.release()


def test_ls_missing_shm_dir_exits_2(tmp_path):
    p = cl("ls", "--shm-dir", str(tmp_path / "nope"), check=2)
    assert "does not exist" in p.stderr


# ------------------------------------------------------------------------------------------- disk
@pytest.fixture
def disk_cache(tmp_path):
    """A real PersistentDataset cache of 4 tiny items, written by this process and let go of before the commands
    run (as a finished training run leaves it; no interpreter of its own)."""
    import gc

    import numpy as np
    from monai.transforms import Compose, ToTensord

    from monai_cache import PersistentDataset

    cache_dir = tmp_path / "cache"
    data = [{"x": np.full((8, 8, 4), i, np.float32), "y": i} for i in range(4)]
    ds = PersistentDataset(data, Compose([ToTensord(keys=["x"])]), cache_dir=str(cache_dir))
    for i in range(len(ds)):
        ds[i]
    assert ds.flush(60)
    del ds
    gc.collect()
    return cache_dir


def test_info_verify_clear_disk_cache(disk_cache):
    from monai_cache.disk_format import stored_entries

    entries = list(stored_entries(str(disk_cache)))
    assert len(entries) == 4 and all(e.packed for e in entries)  # tiny items: records in one pack
    (disk_cache / "model.pt").write_bytes(b"MONAI's own file")  # not ours: never opened, never removed
    (disk_cache / "fake.mcache").write_bytes(b"no magic here")  # our suffix, not our magic

    info = json.loads(cl("info", str(disk_cache), "--json").stdout)
    assert info["entries"] == 4 and info["bad_headers"] == 1 and info["other_files"] == 1
    assert info["packed"] == 4 and info["packs"] == 1
    assert info["format_versions"] == {"2": 4} and info["bytes"] > 0 and info["compression_ratio"] > 0
    assert info["hits"] is None
    assert "entries         4" in cl("info", str(disk_cache)).stdout

    os.unlink(disk_cache / "fake.mcache")
    assert json.loads(cl("verify", str(disk_cache), "--json").stdout)["ok"] == 4

    bad = entries[1]
    name = f"{os.path.basename(bad.path)}@{bad.offset}"
    with open(bad.path, "r+b") as f:  # flip a byte of the payload of the second record
        f.seek(bad.offset + bad.length - 3)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    p = mc("verify", str(disk_cache), check=1)
    assert f"BAD  {name}" in p.stdout and "checksum" in p.stdout and "3 ok, 1 bad" in p.stdout
    result = json.loads(cl("verify", str(disk_cache), "--json", check=1).stdout)
    assert [b["file"] for b in result["bad"]] == [name] and not result["bad"][0]["removed"]
    cl("verify", str(disk_cache), "--remove", check=1)  # marks the record removed in the pack's index
    assert len(list(stored_entries(str(disk_cache)))) == 3
    cl("verify", str(disk_cache), check=0)

    out = json.loads(cl("clear", "--cache-dir", str(disk_cache), "--json").stdout)
    assert out["removed"] == 2 and out["kept"] == 1 and not out["removed_dir"]  # the pack and its index
    assert os.listdir(disk_cache) == ["model.pt"]


def test_disk_commands_on_missing_dir_exit_2(tmp_path):
    for args in (["info", str(tmp_path / "nope")], ["verify", str(tmp_path / "nope")]):
        assert "not a directory" in cl(*args, check=2).stderr
    assert "not a directory" in cl("clear", "--cache-dir", str(tmp_path / "nope"), check=2).stderr


def test_clear_cache_dir_leaves_a_live_shared_memory_copy_in_front_of_it_unless_all(shm_dir, tmp_path, capsys):
    """``clear --cache-dir DIR`` also removes the shared-memory copies in front of DIR (``shm_cache=True``); one that a
    training reads stays, unless ``--all``."""
    import numpy as np
    from monai.transforms import Compose, ToTensord

    from monai_cache import PersistentDataset
    from monai_cache.shm import list_caches

    cache_dir = str(tmp_path / "cache")
    data = [{"x": np.full((8, 8, 4), i, np.float32), "y": i} for i in range(4)]
    live = PersistentDataset(data, Compose([ToTensord(keys=["x"])]), cache_dir=cache_dir, shm_cache=True,
                             shm_dir=shm_dir)  # fmt: skip
    for i in range(len(live)):
        live[i]
    assert live.flush(60)
    (tmp_path / "cache" / "model.pt").write_bytes(b"not ours")  # keeps the directory after the first clear
    [tier] = [c["key"] for c in list_caches(shm_dir)]
    clear = ["clear", "--cache-dir", cache_dir, "--shm-dir", shm_dir, "--json"]
    assert cli.main(clear) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["removed"] >= 1 and out["shared_memory_tiers_removed"] == []  # the disk files went, the live copy not
    assert [c["key"] for c in list_caches(shm_dir)] == [tier]
    assert cli.main([*clear, "--all"]) == 0
    assert json.loads(capsys.readouterr().out)["shared_memory_tiers_removed"] == [tier]
    assert list_caches(shm_dir) == []
    del live


def test_clear_removes_an_emptied_cache_dir(tmp_path, capsys):
    from monai_cache.disk_format import DISK_MAGIC

    d = tmp_path / "c"
    d.mkdir()
    (d / "k.mcache").write_bytes(DISK_MAGIC + bytes(100))
    (d / ".k.abcd1234.123.w0.tmp").write_bytes(b"partial")
    assert cli.main(["clear", "--cache-dir", str(d), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["removed"] == 2 and out["removed_dir"] and not d.exists()


def test_bench_is_not_a_command_of_the_package():
    """The benchmarks ship with the repository (python -m benchmarks, from its root), not in the installed package."""
    assert "bench" not in {c.name for c in cli.COMMANDS}
    with pytest.raises(SystemExit) as exit_info:  # argparse: an unknown command
        cl("bench")
    assert exit_info.value.code == 2


# ------------------------------------------------------------------------------- half-removed caches
def _remover(mode: str) -> tuple[int, int]:
    """Fork a process (no interpreter start) that fills a cache of 24 entry files and leaves it as its last user: the
    removal renames it ``.trash.<pid>.<n>`` and removes it under the root lock, here one file at a time. It writes
    ``half`` to the pipe returned when half the files are gone, then stops there (``stop``: to be killed) or goes
    on (``finish``, 20 ms a file); a file it removes that someone else removed first fails it (traceback, exit 1)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(r)
            import shutil
            import time
            import traceback

            from monai_cache.shm import SharedMemoryStore

            store = SharedMemoryStore("removed", 24, pack=False)
            for i in range(24):
                store[i] = {"x": i}

            def one_by_one(path: str, ignore_errors: bool = False) -> None:
                names = sorted(os.listdir(path))
                for k, name in enumerate(names):
                    os.unlink(os.path.join(path, name))  # FileNotFoundError: another process removed it under us
                    if k == len(names) // 2:
                        os.write(w, b"half\n")
                        if mode == "stop":
                            time.sleep(600)
                    time.sleep(0.02)
                os.rmdir(path)

            shutil.rmtree = one_by_one  # this fork's, which shm_lifetime.remove_dir calls
            try:
                store.release()  # the last user leaves: the cache is removed
                code = 0
            except BaseException:
                os.write(w, traceback.format_exc().encode())
        finally:
            os._exit(code)
    os.close(w)
    return pid, r


def _read_line(fd: int) -> bytes:
    import select

    ready, _, _ = select.select([fd], [], [], 60)  # a hang guard
    assert ready, "the remover never got half-way"
    return os.read(fd, 4096)


def test_a_cache_half_removed_by_a_killed_process_is_listed_and_cleared(shm_dir):
    from monai_cache.shm import cache_root

    root = cache_root()
    pid, pipe = _remover("stop")
    try:
        assert _read_line(pipe) == b"half\n"
        (trash,) = [n for n in os.listdir(root) if n.startswith(f".trash.{pid}.")]  # the removal's own name
        left = len(os.listdir(os.path.join(root, trash)))
        assert 0 < left < 24
    finally:
        os.kill(pid, signal.SIGKILL)  # in the middle of the removal, the root lock held
        os.waitpid(pid, 0)  # reaped: a dead pid
        os.close(pipe)
    # a removal of another pid namespace, or whose pid is another process's now (ours: alive), also abandoned
    reused = f".trash.{os.getpid()}.999999"
    os.mkdir(os.path.join(root, reused))
    with open(os.path.join(root, reused, "s.0"), "wb") as f:
        f.write(bytes(8192))

    listed = {c["key"]: c for c in json.loads(cl("ls", "--json").stdout)}
    assert set(listed) == {trash, reused}
    assert listed[trash]["state"] == "half-removed" and listed[trash]["bytes"] > 0
    assert (listed[trash]["remover"], listed[trash]["remover_alive"]) == (pid, False)
    assert (listed[reused]["remover"], listed[reused]["remover_alive"]) == (os.getpid(), True)
    table = cl("ls").stdout
    assert f"half-removed by pid {pid} (dead)" in table and f"half-removed by pid {os.getpid()} (alive)" in table

    out = cl("clear").stdout  # no --all: nobody holds either
    assert "removed 2 cache(s) (2 half-removed)" in out, out
    assert [n for n in os.listdir(root) if not n.startswith(".lock")] == []
    assert "no monai_cache shared-memory caches" in cl("ls").stdout


def test_clear_all_never_touches_a_removal_under_way(shm_dir):
    from monai_cache.shm import cache_root

    root = cache_root()
    pid, pipe = _remover("finish")
    try:
        assert _read_line(pipe) == b"half\n"
        assert [n for n in os.listdir(root) if n.startswith(f".trash.{pid}.")]  # being removed now
        out = json.loads(cl("clear", "--all", "--json").stdout)  # waits for the removal to end
        assert out == {"removed": [], "kept": []}
        failure = b""
        while chunk := os.read(pipe, 65536):
            failure += chunk
    finally:
        _, status = os.waitpid(pid, 0)
        os.close(pipe)
    assert os.waitstatus_to_exitcode(status) == 0, failure.decode()  # every file it removed was still there
    assert [n for n in os.listdir(root) if not n.startswith(".lock")] == []
