"""The benchmarks' harness (``benchmarks/harness.py``): ranks started like torchrun, memory and CPU of process
trees, and one run of ``benchmarks/bench_cache.py`` on tiny data."""

from __future__ import annotations

import hashlib
import importlib
import json
import mmap
import os
import shutil
import sys
import tempfile

import pytest

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
if BENCHMARKS not in sys.path:
    sys.path.insert(0, BENCHMARKS)  # the scripts import their neighbours, as when run from benchmarks/

harness = importlib.import_module("harness")

ITEMS, RANKS, EPOCHS = 4, 2, 2
_ENV_KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS")


def test_run_ranks_sets_torchrun_env_and_reports_a_failed_rank(tmp_path):
    show = f"import json, os; print(json.dumps({{k: os.environ.get(k) for k in {_ENV_KEYS!r}}}))"
    started: list[list[int]] = []
    harness.run_ranks(["-c", show], 2, str(tmp_path), on_start=started.append)
    envs = [json.loads((tmp_path / f"rank{r}.log").read_text()) for r in range(2)]
    assert [(e["RANK"], e["LOCAL_RANK"], e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"]) for e in envs] == [
        ("0", "0", "2", "2"),
        ("1", "1", "2", "2"),
    ]
    assert envs[0]["MASTER_PORT"] == envs[1]["MASTER_PORT"] and envs[0]["MASTER_ADDR"] == "127.0.0.1"
    assert all(e["OMP_NUM_THREADS"] == (os.environ.get("OMP_NUM_THREADS") or "1") for e in envs)
    assert len(started) == 1 and len(started[0]) == 2

    fail = "import os, sys; print('rank', os.environ['RANK'], 'failing'); sys.exit(3 * int(os.environ['RANK']))"
    with pytest.raises(RuntimeError, match=r"rank 1 exited with 3[\s\S]*rank 1 failing"):
        harness.run_ranks(["-c", fail], 2, str(tmp_path / "fail"))


def test_memory_sampler_counts_shm_files_once():
    """An unmapped tmpfs file adds its size; once mapped (and touched) its pages are in PSS, not added twice."""
    shm = tempfile.mkdtemp(prefix="monai_cache-bench-test-", dir="/dev/shm")
    try:
        path = os.path.join(shm, "entry.e")
        size = 16 << 20
        block, written = os.urandom(1 << 20), hashlib.sha256()
        with open(path, "wb") as f:
            for _ in range(16):
                f.write(block)
                written.update(block)
        sampler = harness.MemorySampler([os.getpid()], shm)
        before = sampler.sample()
        assert before["shm_files"] >= size and before["shm_mapped"] == 0
        with open(path, "rb") as f:
            mm = mmap.mmap(f.fileno(), size, mmap.MAP_PRIVATE, mmap.PROT_READ)
        try:
            assert hashlib.sha256(mm).digest() == written.digest()  # reads every page (no copy): all now mapped
            mapped = sampler.sample()
            assert mapped["shm_mapped"] == size
            assert mapped["pss"] - before["pss"] > size // 2  # the mapped pages now count in our PSS
            # ... and the total does not count them twice
            assert abs(mapped["total"] - before["total"]) < size // 2
        finally:
            mm.close()
        assert sampler.summary()["mem_samples"] == 2
    finally:
        shutil.rmtree(shm, ignore_errors=True)


@pytest.mark.slow
def test_bench_cache_launch_two_ranks(tmp_path):
    """One configuration of the CacheDataset benchmark: 2 ranks like torchrun, memory sampled from outside."""
    bench_cache = importlib.import_module("bench_cache")
    from monai_cache.synthetic import crop_size_for

    data_list = bench_cache.prepare_data(str(tmp_path), ITEMS, (32, 32, 24), seed=0)
    shm_dir = bench_cache.private_shm_dir()
    events: list[str] = []
    try:
        spec = bench_cache.RunSpec(
            config="monai-cache", data_list=data_list, run_dir=str(tmp_path / "run"), shm_dir=shm_dir, ranks=RANKS,
            workers=1, epochs=EPOCHS, spatial_size=crop_size_for((32, 32, 24)), step="sum",
        )  # fmt: skip
        r = bench_cache.launch(spec, events.append)
    finally:
        shutil.rmtree(shm_dir, ignore_errors=True)
    reads = EPOCHS * ITEMS  # DistributedSampler: ceil(4 / 2) per rank and epoch
    # each item computed once on the machine (ranks split the fill, before the first batch), every read a hit
    assert r["misses"] == ITEMS and r["computes"] == r["computes_setup"] == ITEMS and r["computes_epoch"] == 0
    assert r["reads"] == reads and r["hits"] == reads
    assert r["mem_samples"] >= 1 and r["mem_peak"] >= r["mem_mean"] > 50 << 20  # several Python processes
    # the ranks and, when a sample fell while they lived, their DataLoader workers (tiny epochs can fall
    # between two samples on a fast machine)
    assert RANKS <= r["mem_processes_max"] <= RANKS * 2
    assert 0 < r["ttfb_s"] <= r["train_s"] and len(r["epoch_s"]) == EPOCHS and r["ttfb_cpu_s"] > 0
    assert r["one_copy_bytes"] > 0 and r["sampler"] == "DistributedSampler"
    # rank 0's progress: its dataset built, then each of its batches
    batches = bench_cache.batches_per_epoch(ITEMS, RANKS, spec.batch_size)
    assert events == ["S"] + [f"B{e}" for e in range(EPOCHS) for _ in range(batches)]
    assert not os.path.exists(shm_dir)


def test_profile_miss_names_each_sample_by_the_outermost_part_below_the_miss_path(tmp_path):
    # py-spy's raw format: frames outermost first, joined by ';', then the sample count
    profile_miss = importlib.import_module("profile_miss")
    top = ("<module> (loop.py:1);SharedMemoryStore.get_or_compute (monai_cache/shm.py:544);"
           "SharedMemoryStore._get_or_compute (monai_cache/shm.py:570)")
    write = (f"{top};SharedMemoryStore._write_computed (monai_cache/shm.py:428);"
             "SharedMemoryStore._write (monai_cache/shm.py:372)")
    raw = tmp_path / "samples.txt"
    raw.write_text("\n".join([
        f"{write};encode (monai_cache/codec.py:436);JSONEncoder.encode (json/encoder.py:200) 5",
        f"{write};SharedMemoryStore._reserve_space (monai_cache/shm.py:441);SharedCounters.add (x.py:1) 3",
        # the segment write calls fallocate: counted once, as the write, not as anything inside it
        f"{write};CacheDirectory.append (monai_cache/shm_directory.py:403);fallocate (monai_cache/runtime.py:702) 2",
        f"{top};OFDLock.__enter__ (monai_cache/runtime.py:275) 4",
        f"{top} 1",  # the store's own line
        "<module> (loop.py:1);make (bench_scale.py:70) 50",  # outside the miss path: not counted
    ]) + "\n")
    counts, total = profile_miss.parts_of(str(raw))
    assert total == 15
    assert counts == {"encode": 5, "shared counters and room": 3, "write into the segment": 2, "entry lock": 4,
                      "the rest": 1}


def test_first_pass_times_both_passes_of_every_configuration_and_the_random_transform_inside():
    first_pass = importlib.import_module("first_pass")
    results = first_pass.measure(items=24, repeats=2)
    assert set(results) == set(first_pass.CONFIGS)
    for config, repeats in results.items():
        assert len(repeats) == 2 and all(len(passes) == len(first_pass.PASSES) for passes in repeats), config
        for whole, random_part in (p for passes in repeats for p in passes):
            assert 0 < random_part < whole, (config, whole, random_part)  # the flip ran, inside the timed read
    lines = first_pass.table(results).splitlines()
    # header and rule, then per pass and configuration: the whole read, the random transform, the rest
    assert len(lines) == 2 + len(first_pass.PASSES) * len(first_pass.CONFIGS) * 3
    for line in lines[2:]:
        cells = line.split()
        reference = "uncached" if cells[0] == "first" else "monai"  # what the difference is taken from
        assert (cells[1] == reference) == (cells[-1][0] not in "+-"), line
