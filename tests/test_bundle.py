"""The example MONAI bundle in ``configs/`` runs one epoch through ``python -m monai.bundle run``."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

# the drop-in tests: CI runs them on the oldest supported MONAI and on monai-weekly too (.ci/run)
pytestmark = pytest.mark.dropin

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(REPO, "configs")


def _targets(node: object) -> list[str]:
    if isinstance(node, dict):
        found = [node["_target_"]] if "_target_" in node else []
        return found + [t for v in node.values() for t in _targets(v)]
    if isinstance(node, list):
        return [t for v in node for t in _targets(v)]
    return []


def test_bundle_uses_our_classes_by_full_dotted_path():
    with open(os.path.join(CONFIGS, "train.json")) as f:
        config = json.load(f)
    targets = _targets(config)
    # "CacheDataset" alone would resolve to MONAI's class (docs/migrating.md): the dotted path is required.
    assert "monai_cache.CacheDataset" in targets and "monai_cache.ShardedDistributedSampler" in targets
    assert not {"CacheDataset", "PersistentDataset"} & set(targets)
    with open(os.path.join(CONFIGS, "metadata.json")) as f:
        assert json.load(f)["version"]


def test_bundle_trains_one_epoch(shm_dir, tmp_path):
    pytest.importorskip("fire", reason="monai.bundle's command line needs 'fire' (in the test extras)")
    pytest.importorskip("ignite", reason="SupervisedTrainer needs 'pytorch-ignite' (in the test extras)")
    cmd = [
        sys.executable, "-m", "monai.bundle", "run",
        "--config_file", os.path.join(CONFIGS, "train.json"),
        "--meta_file", os.path.join(CONFIGS, "metadata.json"),
        "--bundle_root", str(tmp_path),
        "--epochs", "1",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=str(tmp_path))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    out = p.stdout + p.stderr
    assert "Epoch: 1/1" in out and "monai_cache bundle: trained 1 epoch(s)" in out
    assert "'entries': 4" in out  # the shared-memory cache held the four volumes
    assert "epoch 1 cache: entries 4" in out  # monai_cache.handlers.CacheStatsHandler logged the cache's counters
    assert len([n for n in os.listdir(tmp_path / "output" / "data") if n.startswith("img_")]) == 4
    # the cache is gone once the run released it (nothing left in the private shared-memory directory)
    root = os.path.join(shm_dir, f"monai_cache-{os.getuid()}")
    assert not os.path.isdir(root) or not [n for n in os.listdir(root) if not n.startswith(".")]
