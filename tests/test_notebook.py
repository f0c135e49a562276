"""The tutorial notebook runs from top to bottom (so it cannot rot)."""

from __future__ import annotations

import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(REPO, "tests", "_scripts")
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
        # the tutorial's training with 2 DataLoader workers: MONAI's dataset and loader (bound before the switch),
        # then the same names looked up again under the switch: our loader, the same batches and losses
        nbformat.v4.new_code_cell(
            f"import sys\nsys.path.insert(0, {SCRIPTS!r})\n"
            "from batch_digest import batch_digest, takes_block_path\n"
            "def train_with_workers(dataset_class, loader_class):\n"
            "    set_determinism(seed=0)\n"
            "    ds = dataset_class(data=files, transform=transforms, progress=False)\n"
            "    loader = loader_class(ds, batch_size=2, shuffle=True, num_workers=2)\n"
            "    model = UNet(spatial_dims=3, in_channels=1, out_channels=4, channels=(8, 16, 32), strides=(2, 2))\n"
            "    loss_function = DiceCELoss(to_onehot_y=True, softmax=True)\n"
            "    optimizer = torch.optim.Adam(model.parameters(), 1e-3)\n"
            "    losses, digests, blocks = [], [], []\n"
            "    for batch in loader:\n"
            "        digests.append(batch_digest(batch))\n"
            "        blocks.append(takes_block_path(batch))\n"
            "        optimizer.zero_grad()\n"
            "        loss = loss_function(model(batch['image']), batch['label'])\n"
            "        loss.backward()\n"
            "        optimizer.step()\n"
            "        losses.append(loss.item())\n"
            "    return type(loader).__module__, losses, digests, blocks\n"
            "stock = train_with_workers(StockCacheDataset, DataLoader)\n"
            "from monai.data import DataLoader as SwitchedDataLoader\n"
            "switched = train_with_workers(CacheDataset, SwitchedDataLoader)\n"
            "print('loaders:', stock[0], switched[0], '| same losses:', stock[1] == switched[1], len(stock[1]),\n"
            "      '| same batches:', stock[2] == switched[2], '| blocks:', sum(stock[3]), sum(switched[3]))"
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
    assert "SwitchWarning" in switch_text and "__main__ (CacheDataset, DataLoader)" in switch_text, switch_text
    assert (
        "loaders: monai.data.dataloader monai_cache.loader | same losses: True 4 | same batches: True | blocks: 0 4"
        in switch_text
    ), switch_text
    assert "monai_cache.CacheDataset   first batch" in joined and "MONAI CacheDataset" in joined
    assert "'entries': 8" in joined  # our cache held every volume
    # the notebook only changes the import between the two runs
    sources = [c.source for c in nb.cells[:tutorial_cells] if c.cell_type == "code"]
    assert "from monai.data import CacheDataset" in "\n".join(sources)
    assert "from monai_cache import CacheDataset" in "\n".join(sources)
