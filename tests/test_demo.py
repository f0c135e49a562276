"""Smoke test of ``monai-cache demo`` (2 ranks started by torchrun), its table, the synthetic data and the CLI."""

from __future__ import annotations

import json
import os
import tempfile

import numpy as np
import pytest

from monai_cache import cli, demo
from monai_cache.synthetic import crop_size_for, make_dataset, synthetic_volume

ITEMS, RANKS, EPOCHS = 4, 2, 2


@pytest.mark.slow
def test_demo_two_ranks(tmp_path, capsys):
    """The demo end to end: ranks started by torchrun, memory sampled from this process."""
    out = tmp_path / "out"
    argv = [
        "--items", str(ITEMS), "--shape", "32x32x24", "--epochs", str(EPOCHS), "--ranks", str(RANKS),
        "--workers", "1", "--no-progress", "--out", str(out),
    ]  # fmt: skip
    status = demo.main(argv)
    stdout, stderr = capsys.readouterr()
    assert status == 0, stdout + stderr

    rows = {}
    for line in stdout.splitlines():
        for title, _key, _fmt in demo.ROWS:
            if line.startswith(title + "  "):
                rows[title.strip()] = line[len(title) :].split()
    assert set(rows) == {title.strip() for title, _k, _f in demo.ROWS}, stdout
    # columns: monai, then monai-cache with its ratio against monai
    assert rows["deterministic transform runs"] == [str(ITEMS * RANKS), str(ITEMS), "(0.50x)"]
    assert rows["cache misses"][:2] == [str(ITEMS * RANKS), str(ITEMS)]

    results = {r["config"]: r for r in json.loads((out / "results.json").read_text())["results"]}
    reads = EPOCHS * ITEMS  # DistributedSampler: ceil(4 / 2) per rank and epoch
    mc, mo = results["monai-cache"], results["monai"]
    # monai_cache: each item computed once on the machine (ranks split the fill), every read a hit
    assert mc["misses"] == ITEMS and mc["computes"] == ITEMS and mc["computes_in_workers"] == 0
    assert mc["reads"] == reads and mc["hits"] == reads
    # MONAI: each rank computes every item for its own cache, before the first batch
    assert mo["computes"] == mo["computes_in_ranks"] == ITEMS * RANKS
    assert mo["reads"] == reads and mo["hits"] == reads
    for r in (mc, mo):
        assert r["mem_samples"] >= 1 and r["mem_peak_mib"] >= r["mem_mean_mib"] > 50  # several Python processes
        # the ranks and, when a sample fell while they lived, their DataLoader workers (not torchrun's agent)
        assert RANKS <= r["mem_processes_max"] <= RANKS * 2
        assert 0 < r["ttfb_s"] <= r["train_s"] and len(r["epoch_s"]) == EPOCHS
        assert r["one_copy_bytes"] > 0
    # the same items: monai_cache's entries hold the tensors plus a small header (a few KiB per item)
    assert mo["one_copy_bytes"] < mc["one_copy_bytes"] < mo["one_copy_bytes"] + ITEMS * (64 << 10)
    assert (out / "table.md").read_text().count("\n") == len(demo.ROWS) + 2
    assert not any(name.startswith("monai_cache-demo-") for name in os.listdir("/dev/shm"))  # cleaned up


def test_format_table_ratios():
    base = {"config": "monai", "ttfb_s": 10.0, "computes": 8, "hits": 0, "mem_peak_mib": 2.0}
    other = {"config": "monai-cache", "ttfb_s": 5.0, "computes": 4, "hits": 3, "mem_peak_mib": 1.0}
    text = demo.format_table([base, other])
    lines = {line.split("  ")[0]: line for line in text.splitlines()}
    assert "5.0 (0.50x)" in lines["time to first batch (s)"]
    assert "4 (0.50x)" in lines["deterministic transform runs"]
    assert lines["cache hits"].split()[-1] == "3"  # no ratio against zero
    assert "1 (0.50x)" in lines["memory peak, all processes (MiB)"]
    assert demo.format_table([base, other], markdown=True).startswith("|  | monai | monai-cache |")


def test_synthetic_volume_is_ct_like_and_deterministic(tmp_path):
    image, label, affine = synthetic_volume(3, (40, 36, 20), seed=1)
    again = synthetic_volume(3, (40, 36, 20), seed=1)
    assert np.array_equal(image, again[0]) and np.array_equal(label, again[1])
    assert image.dtype == np.int16 and label.dtype == np.uint8 and image.shape == label.shape == (40, 36, 20)
    assert image[0, 0, 0] < -900 and image.max() > 300  # air outside, bone inside
    assert set(np.unique(label)) <= {0, 1, 2, 3} and (label > 0).any()
    assert affine[0, 0] < 0 and affine[1, 1] < 0 and affine[2, 2] > 0  # LPS
    assert not np.array_equal(image, synthetic_volume(4, (40, 36, 20), seed=1)[0])
    files = make_dataset(str(tmp_path), items=2, shape=(16, 16, 12))
    stamp = os.path.getmtime(files[0]["image"])
    assert make_dataset(str(tmp_path), items=2, shape=(16, 16, 12)) == files  # reused, not rewritten
    assert os.path.getmtime(files[0]["image"]) == stamp
    assert crop_size_for((32, 32, 24)) == (25, 25, 19) and crop_size_for((160, 160, 96)) == (96, 96, 64)


def test_cli_ls_and_clear(tmp_path, capsys):
    from monai_cache.shm import SharedMemoryStore

    shm = tempfile.mkdtemp(prefix="monai_cache-demo-test-", dir="/dev/shm")
    try:
        foreign = os.path.join(shm, "not-ours")
        os.mkdir(foreign)
        store = SharedMemoryStore("cli-test", 2, shm_dir=shm, keep_warm=True)
        store[0] = {"x": np.arange(10)}
        store.release()  # kept: outlives its users
        assert cli.main(["ls", "--shm-dir", shm, "--json"]) == 0
        listed = json.loads(capsys.readouterr().out)
        assert [(c["key"], c["state"], c["entries"]) for c in listed] == [("cli-test", "kept", 1)]
        assert cli.main(["clear", "--shm-dir", shm, "--json"]) == 0  # only stale ones by default
        assert json.loads(capsys.readouterr().out)["removed"] == []
        assert cli.main(["clear", "--shm-dir", shm, "--all"]) == 0
        assert "removed 1 cache(s)" in capsys.readouterr().out
        assert cli.main(["ls", "--shm-dir", shm]) == 0
        assert "no monai_cache" in capsys.readouterr().out
        assert os.path.isdir(foreign)  # nothing that is not ours is touched
    finally:
        import shutil

        shutil.rmtree(shm, ignore_errors=True)


def test_cli_without_command_prints_help(capsys):
    assert cli.main([]) == 2
    assert "demo" in capsys.readouterr().err
