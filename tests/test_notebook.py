"""The tutorial notebook runs from top to bottom (so it cannot rot)."""

from __future__ import annotations

import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(REPO, "notebooks", "tutorial_3d_segmentation.ipynb")


def test_tutorial_notebook_executes(shm_dir, tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat", reason="needs nbformat (in the test extras)")
    nbclient = pytest.importorskip("nbclient", reason="needs nbclient (in the test extras)")
    pytest.importorskip("ipykernel", reason="needs ipykernel, for the python3 kernel (in the test extras)")
    pytest.importorskip("matplotlib", reason="the notebook plots with matplotlib (in the test extras)")
    monkeypatch.setenv("MONAI_CACHE_TUTORIAL_DIR", str(tmp_path))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(
        nb, timeout=180, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()
    text = []
    for cell in nb.cells:
        for out in cell.get("outputs", []) if cell.cell_type == "code" else []:
            assert out.get("output_type") != "error", out
            text.append(out.get("text", "") or out.get("data", {}).get("text/plain", ""))
    joined = "\n".join(text)
    assert "monai_cache.CacheDataset   first batch" in joined and "MONAI CacheDataset" in joined
    assert "'entries': 8" in joined  # our cache held every volume
    # the notebook only changes the import between the two runs
    sources = [c.source for c in nb.cells if c.cell_type == "code"]
    assert "from monai.data import CacheDataset" in "\n".join(sources)
    assert "from monai_cache import CacheDataset" in "\n".join(sources)
