"""MONAI's tutorial subclass patterns on monai_cache's classes, under two real torch.distributed (gloo) ranks.

The pattern comes from Project-MONAI/tutorials ``acceleration/distributed_training/brats_training_ddp.py``
(``BratsCacheDataset(DecathlonDataset)``): the subclass sets the attributes the app class's data listing reads,
overrides ``_generate_data_list`` to keep its rank's partition (``partition_dataset(...)[dist.get_rank()]``) and
calls ``super(DecathlonDataset, self).__init__(data, transform, cache_rate=..., num_workers=...)``, which in MONAI
skips the app class's ``__init__`` (listing, download) and lands in ``CacheDataset.__init__``. Covered: that
subclass on ``DecathlonDataset``, and the same on ``MedNISTDataset`` and ``TciaDataset``; for ``CacheDataset`` and
``SmartCacheDataset``, a subclass that partitions its data per rank with the same call (``shuffle=False`` as for
brats_training_ddp.py's validation set; ``unet_training_smartcache.py``'s partition, ``SmartCacheDataset`` arguments
and ``update_cache()`` every epoch) and calls ``<Base>.__init__(self, ...)`` by name, as MONAI's apps datasets call
``CacheDataset.__init__``.

Each subclass is written once in ``_scripts/subclass_rank.py``, as a function of its base class, and built on
MONAI's class and on ours in each of two ranks: independent processes started as torchrun starts them (env://
rendezvous, gloo on CPU), with real shared memory in ``/dev/shm``. Checked for each class: each rank gets MONAI's
partition and MONAI's items exactly (random transforms seeded alike; for SmartCacheDataset, three windows);
the ranks' partitions are disjoint and together are the whole section (as MONAI's class lists it without the
subclass); our cache is a shared-memory store under this test's directory; and each item was computed once on
the node (a logging transform counts computations across processes). Data: small local files in each class's
layout (``test_apps``'s fixtures: MedNIST JPEGs, a Decathlon task of NIfTI files, TCIA series directories; the
NIfTI volumes of ``conftest.volumes``); nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections import Counter
from collections.abc import Iterator

import monai.apps
import pytest
import test_apps
from monai.transforms import Compose
from test_cache_distributed import launch_ranks

# the drop-in tests: CI runs them on the oldest supported MONAI and on monai-weekly too (.ci/run)
pytestmark = pytest.mark.dropin

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_scripts", "subclass_rank.py")

# test_apps's data, in the layout each app class expects (module-scoped fixtures, made again for this module)
mednist_root = test_apps.mednist_root
decathlon_root = test_apps.decathlon_root
tcia_root = test_apps.tcia_root


def case_arguments(mednist_root: str, decathlon_root: str, tcia_root: str, volumes: list[dict]) -> dict:
    """Each subclass's arguments (besides the transform). Sections hold an even number of items, so that
    ``shuffle=True`` (``even_divisible=True``) splits them without repeating one."""
    return {
        # training as in brats_training_ddp.py (shuffle=True); val_frac leaves 4 of the 6 pairs
        "decathlon": dict(root_dir=decathlon_root, task="Task09_Spleen", section="training", shuffle=True,
                          val_frac=0.34),
        "mednist": dict(root_dir=mednist_root, section="training", shuffle=True),  # 16 of 18 images
        "tcia": dict(root_dir=tcia_root, collection="C4KC-KiTS", section="training", shuffle=True),  # 4 of 5
        "cache": dict(data=volumes, shuffle=False),  # split as brats_training_ddp.py's validation set
        "smartcache": dict(data=volumes, replace_rate=0.5, cache_num=2),  # a window of 2 over each rank's 4
    }  # fmt: skip


def whole_section(case: str, kwargs: dict) -> list[dict]:
    """What the ranks' partitions must add up to: the data list of MONAI's class itself (no partition, nothing
    cached), with the subclass's listing arguments."""
    nothing = dict(transform=Compose(), cache_rate=0.0, progress=False)
    if case == "decathlon":
        return monai.apps.DecathlonDataset(
            kwargs["root_dir"], kwargs["task"], kwargs["section"], val_frac=kwargs["val_frac"], **nothing
        ).data
    if case == "mednist":
        return monai.apps.MedNISTDataset(kwargs["root_dir"], kwargs["section"], **nothing).data
    if case == "tcia":
        return monai.apps.TciaDataset(kwargs["root_dir"], kwargs["collection"], kwargs["section"], **nothing).data
    return kwargs["data"]


@pytest.fixture(scope="module")
def node(
    tmp_path_factory: pytest.TempPathFactory, mednist_root: str, decathlon_root: str, tcia_root: str, volumes: list
) -> Iterator[dict]:
    """Two ranks run every case once: starting a pair of ranks costs about 10 s on 2 cores, too much to do per
    case. Module-scoped, so it makes its own private shared-memory directory as conftest's (function-scoped)
    ``shm_dir`` does, and passes it to the ranks in MONAI_CACHE_SHM_DIR."""
    work = tmp_path_factory.mktemp("subclass-patterns")
    cases = case_arguments(mednist_root, decathlon_root, tcia_root, volumes)
    config = work / "config.json"
    config.write_text(json.dumps({"cases": cases, "logs": str(work)}))
    shm_dir = f"/dev/shm/mc-test-{uuid.uuid4().hex[:12]}"
    os.makedirs(shm_dir)
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("MONAI_CACHE_SHM_DIR", shm_dir)
            ranks = launch_ranks(2, [str(config)], SCRIPT)
        yield {"ranks": ranks, "cases": cases, "logs": str(work), "shm_dir": shm_dir}
    finally:
        shutil.rmtree(shm_dir, ignore_errors=True)


def computed(node: dict, case: str, who: str) -> list[tuple[int, str]]:
    """(pid, image) for every item the logging transform computed, in either rank, for ``who``'s dataset."""
    path = os.path.join(node["logs"], f"{case}.{who}")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [(int(pid), image) for pid, image in (line.rstrip("\n").split("\t") for line in f)]


def rank_results(node: dict, case: str) -> list[dict]:
    """Each rank's report of ``case``, after checking that the rank ran it to the end (else its traceback)."""
    results = [rank["cases"][case] for rank in node["ranks"]]
    for rank, result in enumerate(results):
        assert result["error"] is None, f"rank {rank}:\n{result['error']}"
    return results


def assert_partitions_are_the_section(node: dict, case: str, results: list[dict]) -> None:
    as_text = [[json.dumps(item, sort_keys=True) for item in r["data"]] for r in results]
    assert all(as_text), "a rank got no data"
    assert not set(as_text[0]) & set(as_text[1]), "the ranks' partitions overlap"
    section = whole_section(case, node["cases"][case])
    assert Counter(as_text[0] + as_text[1]) == Counter(json.dumps(item, sort_keys=True) for item in section)


def assert_in_our_shared_memory(node: dict, results: list[dict]) -> None:
    for result in results:
        assert result["store"] == "SharedMemoryStore" and result["live"], result  # a live cache `monai-cache ls` lists
        assert result["path"].startswith(node["shm_dir"] + os.sep), result["path"]
        assert not os.path.exists(result["path"])  # removed when the rank, its last user, exited
    assert results[0]["path"] != results[1]["path"]  # different data, different caches


@pytest.mark.parametrize("case", ["decathlon", "mednist", "tcia", "cache"])
def test_partitioned_subclass_gives_monais_items_each_computed_once(node: dict, case: str) -> None:
    results = rank_results(node, case)  # in each rank: MONAI's partition and items, exactly, two epochs
    assert_partitions_are_the_section(node, case, results)
    assert_in_our_shared_memory(node, results)
    for result in results:
        n = len(result["data"])  # cached whole (cache_rate=1.0), then read twice, from the cache only
        assert result["stored"]["entries"] == n and result["total"]["misses"] == n, result
        assert result["total"]["hits"] == 2 * n, result["total"]
    ours, theirs = computed(node, case, "ours"), computed(node, case, "monai")
    section = [item["image"] for item in whole_section(case, node["cases"][case])]
    assert Counter(image for _, image in ours) == Counter(section)  # each item once on the node
    assert {pid for pid, _ in ours} == {rank["pid"] for rank in node["ranks"]}  # each rank computed its own
    assert sorted(image for _, image in theirs) == sorted(image for _, image in ours)  # MONAI computes the same


def test_partitioned_smartcache_subclass_follows_monais_windows_in_shared_memory(node: dict) -> None:
    results = rank_results(node, "smartcache")  # in each rank: MONAI's items in each of three windows, exactly
    assert_partitions_are_the_section(node, "smartcache", results)
    assert_in_our_shared_memory(node, results)
    for result in results:
        own, windows = {item["image"] for item in result["data"]}, result["windows"]
        assert len(windows) == 3 and windows[0] != windows[1] != windows[2], windows  # update_cache() moved on
        # a window of 2 moving by 1 over 4 items: the three windows read the whole partition, each item once or twice
        assert set().union(*windows) == own, (windows, own)
        n = len(own)  # each computed once (the first window, then a replacement per update), read from the cache
        assert result["stored"]["entries"] == n and result["total"]["misses"] == n, result
        assert result["total"]["hits"] == sum(len(window) for window in windows), result["total"]
    ours = computed(node, "smartcache", "ours")
    section = [item["image"] for item in whole_section("smartcache", node["cases"]["smartcache"])]
    # once on the node, even the first item, which the background thread computes ahead as the next replacement
    # after the last update (MONAI computes it again: its list dropped it at the first update)
    assert Counter(image for _, image in ours) == Counter(section)
    assert {pid for pid, _ in ours} == {rank["pid"] for rank in node["ranks"]}
