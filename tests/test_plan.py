"""``monai-cache plan`` and its Python API against the truth, ``monai-cache top`` watching a cache fill, and
``CacheStatsHandler`` in an ignite run: real NIfTI files written with nibabel, real shared memory and disk caches,
the command line run as people run it (in a pseudo-terminal), real TensorBoard event files read back.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pty
import select
import signal
import sys
import threading
import time

import monai.data
import nibabel as nib
import numpy as np
import pytest
import torch
from helpers import as_slurm_task, mounted_tmpfs, one_torch_thread  # noqa: F401 (an autouse fixture)
from monai.transforms import Transform

import monai_cache
from monai_cache import cli
from monai_cache.handlers import CacheStatsHandler
from monai_cache.plan import plan_dataset
from monai_cache.synthetic import make_dataset, tutorial_transforms

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CROP = (16, 16, 16)


@pytest.fixture(scope="module")
def ct(tmp_path_factory) -> list[dict]:
    """The synthetic CT data of the demo and the benchmarks: 12 volumes of one shape."""
    return make_dataset(str(tmp_path_factory.mktemp("ct")), items=12, shape=(56, 48, 40))


@pytest.fixture(scope="module")
def varied(tmp_path_factory) -> list[dict]:
    """16 image/label pairs of varying shapes (24 to 80 voxels a side) and spacings (0.8 to 2.5 mm)."""
    root = tmp_path_factory.mktemp("varied")
    rng = np.random.default_rng(3)
    data = []
    for i in range(16):
        shape = tuple(int(x) for x in rng.integers(24, 80, 3))
        affine = np.diag([*(float(x) for x in rng.uniform(0.8, 2.5, 3)), 1.0])
        image = rng.integers(-1000, 400, shape).astype(np.int16)
        nib.save(nib.Nifti1Image(image, affine), str(root / f"img{i}.nii.gz"))
        nib.save(nib.Nifti1Image((image > 0).astype(np.uint8), affine), str(root / f"lab{i}.nii.gz"))
        data.append({"image": str(root / f"img{i}.nii.gz"), "label": str(root / f"lab{i}.nii.gz")})
    return data


def within(projected: float, truth: float, tolerance: float = 0.10) -> bool:
    return abs(projected - truth) <= tolerance * truth


@pytest.mark.parametrize("data_name", ["ct", "varied"])
def test_plan_projects_what_the_caches_then_hold(shm_dir, tmp_path, request, data_name):
    """From 4 items computed, the projected bytes are within 10% of what the full caches then hold: in shared memory
    (CacheDataset, the tutorial's chain) and on disk (PersistentDataset, downcast and zstd)."""
    data = request.getfixturevalue(data_name)
    chain = tutorial_transforms(spatial_size=CROP)
    lazy = monai_cache.CacheDataset(data, chain, runtime_cache=True, progress=False)  # computes nothing yet
    memory_plan = plan_dataset(lazy, samples=4)
    assert len(memory_plan.sampled) == 4 and memory_plan.cached_items == len(data)
    filled = monai_cache.CacheDataset(data, chain, progress=False)
    truth = filled.cache_stats()["stored"]["bytes"]
    assert within(memory_plan.memory.total, truth), (memory_plan.memory, truth, memory_plan.models)
    assert memory_plan.fit is not None and memory_plan.fit.fits
    filled.release()
    lazy.release()

    disk = monai_cache.PersistentDataset(data, chain, cache_dir=tmp_path / "disk")
    disk_plan = plan_dataset(disk, samples=4)
    for i in range(len(data)):
        disk[i]
    assert disk.flush(60)
    truth = disk.cache_stats()["stored"]["bytes"]
    assert within(disk_plan.disk.total, truth), (disk_plan.disk, truth, disk_plan.models)
    assert disk_plan.memory is None and disk_plan.cache_dir_free and disk_plan.cache_dir == str(tmp_path / "disk")


def test_plan_of_a_partial_cache_and_of_monais_class(shm_dir, ct, monkeypatch):
    chain = tutorial_transforms(spatial_size=CROP)
    part = monai_cache.CacheDataset(ct, chain, cache_rate=0.5, runtime_cache=True, progress=False)
    # planned in a task that srun started without torchrun (Lightning's SLURMEnvironment leaves Slurm's variables
    # only): its ranks on this machine are Slurm's tasks on this node, the second of 4,3,3
    as_slurm_task(monkeypatch, 5, 1, 1, "4,3(x2)")
    half = plan_dataset(part, samples=3)
    assert half.ranks == 3 and "3 (one shared copy)" in half.format()
    assert half.cached_items == 6 and all(i < 6 for i in half.sampled)  # MONAI caches the first cache_num items
    # MONAI's CacheDataset keeps a copy in every rank: the plan counts them
    theirs = plan_dataset(monai.data.CacheDataset(ct, chain, runtime_cache=True, progress=False), samples=3, ranks=4)
    assert theirs.in_process and theirs.fit is not None
    assert theirs.fit.needed == pytest.approx(4 * (theirs.memory.high or theirs.memory.total), rel=1e-6)
    assert any("holds a copy in each of the 4 ranks" in line for line in theirs.advice)
    doc = json.loads(json.dumps(theirs.as_dict()))
    assert doc["ranks"] == 4 and doc["memory_bytes"]["total"] == theirs.memory.total
    part.release()


def test_plan_says_what_does_not_fit_and_what_would(tmp_path, ct):
    """On a real 4 MiB tmpfs the cache of 12 volumes does not fit: the plan gives the cache_rate that does and the
    Docker and Kubernetes settings that would give room for all of it."""
    with mounted_tmpfs(str(tmp_path / "tmpfs"), "size=4m") as mount:
        lazy = monai_cache.CacheDataset(ct, tutorial_transforms(spatial_size=CROP), runtime_cache=True,
                                        progress=False, shm_dir=mount)  # fmt: skip
        plan = plan_dataset(lazy, samples=3, shm_dir=mount)
        lazy.release()
    assert plan.fit is not None and not plan.fit.fits and 0 <= plan.fit.cache_rate < 1
    assert plan.fit.limit == "the free space of the tmpfs"
    text = plan.format()
    assert "does NOT fit" in text and f"cache_rate={plan.fit.cache_rate:.2f}" in text
    assert "--shm-size=" in text and "sizeLimit:" in text


# ------------------------------------------------------------------------------------------ the command line
def run_in_pty(cmd: list[str], cwd: str, env: dict, timeout: float = 180, until: str | None = None,
               stop: float | None = None) -> tuple[int, str]:  # fmt: skip
    """Run ``cmd`` with a pseudo-terminal as its standard input, output and error, as in a terminal; return its
    exit status and everything it printed. With ``until``, send SIGINT (^C) once that text appeared and ``stop``
    seconds passed."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: exec the command in the terminal
        os.chdir(cwd)
        os.execvpe(cmd[0], cmd, env)
    out = b""
    deadline = time.monotonic() + timeout
    seen_at = None
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([fd], [], [], 0.2)
            if ready:
                try:
                    chunk = os.read(fd, 65536)
                except OSError:  # EIO: the child closed the terminal
                    break
                if not chunk:
                    break
                out += chunk
            if until is not None and seen_at is None and until.encode() in out:
                seen_at = time.monotonic()
            if seen_at is not None and time.monotonic() - seen_at >= (stop or 0):
                os.kill(pid, signal.SIGINT)
                seen_at = float("inf")
        _, status = os.waitpid(pid, 0)
    finally:
        os.close(fd)
    return os.waitstatus_to_exitcode(status), out.decode(errors="replace")


def test_plan_command_on_a_bundle_config_in_a_terminal(shm_dir, tmp_path):
    cmd = [sys.executable, "-m", "monai_cache", "plan", "--config_file", os.path.join(REPO, "configs", "train.json"),
           "--num_items", "6", "--samples", "3"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
    status, out = run_in_pty(cmd, str(tmp_path), env)
    assert status == 0, out[-3000:]
    assert "plan train#dataset: computing item" in out  # the progress, while it samples
    assert "train#dataset (monai_cache.dataset.CacheDataset): 6 items, 6 cached; 3 computed" in out
    assert "shared memory" in out and "fits: all 6 items" in out and "memory cgroup" in out
    # --json for scripts; the bundle's override syntax; a tmpfs too small for it: exit status 1 (in this process:
    # the terminal run above showed the command as people run it)
    with mounted_tmpfs(str(tmp_path / "tmpfs"), "size=1m") as mount:
        argv = [*cmd[3:-2], "--samples", "2", "--json", "--shm-dir", mount, "--num_items", "4",
                "--bundle_root", str(tmp_path)]  # fmt: skip
        with contextlib.redirect_stdout(io.StringIO()) as printed:
            status = cli.main(argv)
    assert status == 1
    (doc,) = json.loads(printed.getvalue())
    assert doc["name"] == "train#dataset" and doc["items"] == 4 and doc["fit"]["fits"] is False
    assert doc["memory_bytes"]["total"] > 1 << 20 and doc["machine"]["tmpfs_total"] == 1 << 20


class Slow(Transform):
    """Deterministic, 1 MiB, a tenth of a second each."""

    def __call__(self, i: int) -> dict:
        time.sleep(0.1)
        return {"x": torch.full((1 << 18,), float(i))}


def test_top_shows_a_cache_filling_in_another_process(shm_dir, tmp_path):
    """``monai-cache top`` watches a cache that this process fills meanwhile (in a thread; top is the other
    process): no interpreter of its own for the filler."""
    ds = monai_cache.CacheDataset(list(range(60)), Slow(), runtime_cache=True, progress=False)
    key, stop = ds._store.key, threading.Event()
    filler = threading.Thread(target=lambda: [ds[i] for i in range(60) if not stop.is_set()], daemon=True)
    filler.start()
    try:
        env = {**os.environ, "PYTHONPATH": REPO, "MONAI_CACHE_SHM_DIR": shm_dir}
        cmd = [sys.executable, "-m", "monai_cache", "top", "--interval", "0.5", "--shm-dir", shm_dir]
        status, out = run_in_pty(cmd, str(tmp_path), env, timeout=60, until=f"{key}", stop=3.0)
    finally:
        stop.set()
        filler.join()
        ds.release()
    assert status == 0, out[-3000:]  # ^C ends it quietly
    assert "\x1b[2J" in out  # it redraws the terminal
    rows = [row.split() for row in out.replace("\x1b[H\x1b[2J", "\n").splitlines() if row.startswith(key)]
    assert len(rows) >= 3, out[-3000:]
    filled = [int(row[2].split("/")[0]) for row in rows]
    assert all(row[2].endswith("/60") for row in rows) and filled[-1] > filled[0]  # the cache fills as top watches
    # KEY STATE FILLED SIZE (2 words) HIT RATE HITS MISSES PROCS FILL RATE TIME LEFT ("12 s" or "full")
    later = rows[-1]
    assert later[1] == "live" and later[4] in ("KiB", "MiB") and int(later[8]) >= 1  # the filler holds it
    assert later[9].endswith("/s") and float(later[9][:-2]) > 0  # the fill rate
    assert later[10:] == ["full"] or (later[11:] == ["s"] and float(later[10]) >= 0)  # the time left


# ------------------------------------------------------------------------------------------ the handler
def test_cache_stats_handler_logs_and_writes_tensorboard(shm_dir, tmp_path, ct, caplog):
    from ignite.engine import Engine
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ds = monai_cache.CacheDataset(ct[:4], tutorial_transforms(spatial_size=CROP), runtime_cache=True, progress=False)
    loader = monai.data.DataLoader(ds, batch_size=2, num_workers=2)
    engine = Engine(lambda _engine, batch: float(batch["image"].sum()))
    handler = CacheStatsHandler(ds, log_dir=str(tmp_path / "tb"))
    handler.attach(engine)
    handler.logger.addHandler(caplog.handler)  # MONAI's loggers do not propagate to the root
    engine.run(loader, max_epochs=3)
    assert engine.state.cache_stats["entries"] == 4 and engine.state.cache_stats["hit_rate"] == pytest.approx(2 / 3)
    logged = [r.getMessage() for r in caplog.records if r.name == "monai_cache.CacheStatsHandler"]
    assert logged[0].startswith("epoch 1 cache: entries 4") and "hits 0" in logged[0]
    assert len(logged) == 3 and "hit_rate 0.667" in logged[2]
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    rates = [(e.step, round(e.value, 3)) for e in events.Scalars("cache/hit_rate")]
    assert rates == [(1, 0.0), (2, 0.5), (3, 0.667)]  # the workers' hits, counted machine-wide
    assert [e.value for e in events.Scalars("cache/entries")] == [4.0, 4.0, 4.0]
    with pytest.raises(TypeError, match="needs a dataset of monai_cache"):
        CacheStatsHandler(monai.data.Dataset(ct, None))
    torch.set_num_threads(1)
    ds.release()
