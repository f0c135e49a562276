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
    tutorial_cells = len(nb.cells)
    # then, in the same kernel (one interpreter less): the switch turned on with %load_ext, in a notebook that
    # holds MONAI's class under a name of its own (so install() names __main__ in its one warning)
    nb.cells += [
        nbformat.v4.new_code_cell("from monai.data import CacheDataset as StockCacheDataset\n%load_ext monai_cache"),
        nbformat.v4.new_code_cell(
            "from monai.data import CacheDataset\n"
            "switched = CacheDataset(files[:2], transform=transforms, progress=False)\n"
            "print('switched:', type(switched).__module__, switched.cache_stats()['stored']['entries'])\n"
            "switched.release()"
        ),
    ]
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
    switch_text = "\n".join(
        o.get("text", "") for c in nb.cells[tutorial_cells:] for o in c.get("outputs", []) if "text" in o
    )
    assert "switched: monai_cache.dataset 2" in switch_text, switch_text
    assert switch_text.count("monai_cache switch on") == 1, switch_text  # the one log line
    assert "SwitchWarning" in switch_text and "__main__ (CacheDataset)" in switch_text, switch_text
    assert "monai_cache.CacheDataset   first batch" in joined and "MONAI CacheDataset" in joined
    assert "'entries': 8" in joined  # our cache held every volume
    # the notebook only changes the import between the two runs
    sources = [c.source for c in nb.cells[:tutorial_cells] if c.cell_type == "code"]
    assert "from monai.data import CacheDataset" in "\n".join(sources)
    assert "from monai_cache import CacheDataset" in "\n".join(sources)
