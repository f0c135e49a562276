"""The documentation site builds with ``mkdocs build --strict`` (broken links, missing pages, bad API references)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_mkdocs_build_strict(tmp_path):
    pytest.importorskip("mkdocs", reason="mkdocs is not installed (it is in the test extras: pip install -e '.[test]')")
    pytest.importorskip("mkdocstrings", reason="mkdocstrings[python] is not installed (in the test extras)")
    site = tmp_path / "site"
    p = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    for page in ("index.html", "api/index.html", "distributed/index.html", "cli/index.html", "benchmarks/index.html"):
        assert (site / page).is_file(), page
    api = (site / "api" / "index.html").read_text()
    for name in ("CacheDataset", "PersistentDataset", "ShardedDistributedSampler", "SharedMemoryStore", "list_caches"):
        assert name in api
