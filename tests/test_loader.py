"""monai_cache.DataLoader: the same batches as monai.data.DataLoader, moved as one shared-memory block each.

Real worker processes (fork and spawn), real memfd segments, the tutorial chain on real NIfTI files; every
batch is compared value by value and meta by meta with what ``monai.data.DataLoader`` gives.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import json
import logging
import os
import signal
import subprocess
import sys
import time
import warnings

import monai.data
import numpy as np
import pytest
import torch
from helpers import assert_same, sharing
from monai.data import decollate_batch, list_data_collate, pad_list_data_collate
from monai.utils.enums import TraceKeys
from torch.utils.data import default_convert

import monai_cache
from monai_cache.compat import MONAI_VERSION
from monai_cache.errors import BatchFallbackWarning
from monai_cache.loader import MAX_SEGMENTS, DataLoader
from monai_cache.runtime import pid_alive
from monai_cache.sampler import ShardedDistributedSampler
from monai_cache.synthetic import make_dataset, mednist_transforms, tutorial_transforms

# the drop-in tests: CI runs them on the oldest supported MONAI and on monai-weekly too (.ci/run)
pytestmark = pytest.mark.dropin

SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_scripts")
SHAPE = (40, 40, 24)
CROP = (16, 16, 8)
BLOCK = "memfd:monai_cache-batch"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return make_dataset(str(tmp_path_factory.mktemp("ct")), items=6, shape=SHAPE)


@pytest.fixture(scope="module")
def dataset(files):
    """MONAI's CacheDataset over the tutorial chain: the deterministic part cached, then 2 random crops."""
    return monai.data.CacheDataset(files, tutorial_transforms(spatial_size=CROP, num_samples=2), progress=False)


def epochs(loader_class: type, dataset, n: int = 1, **kwargs) -> list[list]:
    """``n`` epochs of a new loader's batches. The seed fixes the random states of the transforms (which MONAI's
    DataLoader sets when it is made with ``num_workers=0``, and in each worker otherwise)."""
    torch.manual_seed(0)
    loader = loader_class(dataset, **kwargs)
    return [list(loader) for _ in range(n)]


def block_ranges(pid: int | str = "self") -> list[tuple[int, int]]:
    """Address ranges of the batch segments mapped by a process."""
    out = []
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            if BLOCK in line and "control" not in line:
                lo, hi = line.split()[0].split("-")
                out.append((int(lo, 16), int(hi, 16)))
    return out


def in_block(t: torch.Tensor) -> bool:
    """Whether a tensor's memory is a batch segment (it came as a block, not torch's way)."""
    p = t.untyped_storage().data_ptr()
    return any(lo <= p < hi for lo, hi in block_ranges())


def memfds(pid: int | str = "self") -> list[str]:
    """Batch segments a process holds open or mapped."""
    out = []
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if "monai_cache-batch" in link:
                    out.append(link)
    with contextlib.suppress(OSError), open(f"/proc/{pid}/maps") as f:
        out += [line.strip() for line in f if "monai_cache-batch" in line]
    return out


def assert_batches_equal(ours: list, theirs: list, key_order: bool = True) -> None:
    """Equal values, dtypes, shapes, strides, MetaTensor attributes, and the same objects shared within each batch
    (MONAI's crops of one image share the dicts of its cached transforms); not TraceKeys.ID, the address of an object
    the random crop makes in the worker (it differs between two runs of monai.data.DataLoader itself)."""
    assert len(ours) == len(theirs) > 0
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert_same(a, b, f"batch{i}", strides=True, skip_keys=(TraceKeys.ID,), key_order=key_order)
        assert sharing(a) == sharing(b), f"batch{i}"


def user_collate(samples: list) -> dict:
    """A user's collate: MONAI's, plus values of other kinds."""
    batch = list_data_collate(samples)
    return {
        "pair": (batch["image"], batch["label"]),
        "n": len(batch["image"]),
        "names": [str(i) for i in range(len(batch["image"]))],
        "grid": np.arange(6, dtype=np.int16).reshape(2, 3),
    }


@pytest.mark.parametrize("collate", [None, pad_list_data_collate, user_collate], ids=["list_data", "pad_list", "user"])
def test_batches_equal_monai_dataloader_and_come_as_blocks(dataset, collate):
    kwargs = {"batch_size": 2, "num_workers": 2, **({"collate_fn": collate} if collate else {})}
    theirs = epochs(monai.data.DataLoader, dataset, **kwargs)[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error", BatchFallbackWarning)  # no batch fell back to torch's path
        ours = epochs(DataLoader, dataset, **kwargs)[0]
    assert_batches_equal(ours, theirs)
    first = ours[0]["pair"][0] if collate is user_collate else ours[0]["image"]
    assert first.is_batch and len(first.applied_operations) == 4  # 2 volumes x 2 crops
    assert all(in_block(b["pair"][0] if collate is user_collate else b["image"]) for b in ours)
    if collate is None:
        for a, b in zip(ours, theirs):
            assert_batches_equal(decollate_batch(a), decollate_batch(b))


def small_items() -> monai.data.Dataset:
    """MedNIST-shaped items: 64x64 images through MONAI's MedNIST random chain. A batch of 64 holds a few tensors and
    some nine thousand Python objects of metadata, which torch's pickling moves faster than the codec."""
    rng = np.random.default_rng(0)
    data = [{"image": rng.random((1, 64, 64), dtype=np.float32), "label": i % 6} for i in range(256)]
    return monai.data.Dataset(data, mednist_transforms(load=False))


def test_batches_of_many_small_items_take_torch_path_where_it_is_cheaper(dataset):
    """The loader estimates both ways per batch: volumes come as blocks (the test above), small items torch's way,
    in every epoch (later workers start from the choice of earlier ones), with the same batches and no warning."""
    kwargs = {"batch_size": 64, "num_workers": 2}
    theirs = epochs(monai.data.DataLoader, small_items(), n=2, **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("error", BatchFallbackWarning)  # a choice, not a fallback
        ours = epochs(DataLoader, small_items(), n=2, **kwargs)
    for a, b in zip(ours, theirs):
        assert_batches_equal(a, b)
    assert not any(in_block(b["image"]) for epoch in ours for b in epoch)
    assert all(b["image"].is_shared() for epoch in ours for b in epoch)  # torch's shared memory, as MONAI's


@pytest.fixture(scope="module")
def our_dataset(files):
    """monai_cache's CacheDataset over the same chain (its cache in shared memory, filled in this process)."""
    ds = monai_cache.CacheDataset(files, tutorial_transforms(spatial_size=CROP, num_samples=2), progress=False)
    yield ds
    ds.release()


@pytest.mark.parametrize("persistent", [False, True], ids=["new-workers", "persistent-workers"])
def test_our_dataset_through_monai_dataloader_sends_each_meta_tensor_as_a_block(dataset, our_dataset, persistent):
    """Read in monai.data.DataLoader's workers, our datasets have each MetaTensor of a batch pickled as one block
    (torch's way: about fifty shared-memory files); the batches are MONAI's, and nothing stays mapped after them."""
    before = len(block_ranges())
    kwargs = {"batch_size": 2, "num_workers": 2, "persistent_workers": persistent}
    theirs = epochs(monai.data.DataLoader, dataset, n=2, **kwargs)
    ours = epochs(monai.data.DataLoader, our_dataset, n=2, **kwargs)
    for a, b in zip(ours, theirs):
        assert_batches_equal(a, b)
    blocks = [in_block(b["image"]) and in_block(b["label"]) for epoch in ours for b in epoch]
    # MONAI 1.3's crops leave garbage in reference cycles that can still hold parts of a batch when it is pickled,
    # and young collections do not always free it in time: such a MetaTensor takes torch's way, the exact one
    assert all(blocks) if MONAI_VERSION >= (1, 4) else any(blocks), blocks
    assert len(block_ranges()) > before
    del ours, a
    gc.collect()
    assert len(block_ranges()) == before  # each MetaTensor mapped its block for as long as it lived


def shares_across(samples: list) -> dict:
    """MONAI's batch, plus what pickling keeps shared between its parts: one tensor in the image's and the label's
    meta, and a plain tensor on the image's memory."""
    batch = list_data_collate(samples)
    batch["label"].meta["same_affine"] = batch["image"].meta["affine"]
    batch["image_data"] = batch["image"].as_tensor()
    return batch


def test_meta_tensors_sharing_with_the_rest_of_the_batch_take_torch_way(dataset, our_dataset):
    kwargs = {"batch_size": 2, "num_workers": 1, "collate_fn": shares_across}
    theirs = epochs(monai.data.DataLoader, dataset, **kwargs)[0]
    ours = epochs(monai.data.DataLoader, our_dataset, **kwargs)[0]
    assert_batches_equal(ours, theirs)  # sharing() included: the affine is one tensor in both MetaTensors
    for b in ours:
        assert not in_block(b["image"]) and not in_block(b["label"])
        assert b["image_data"].untyped_storage().data_ptr() == b["image"].untyped_storage().data_ptr()


def test_held_only_by_counts_every_other_holder():
    """The check behind the test above, object by object: a block is taken only for what nothing else holds."""
    from monai.data import MetaTensor

    from monai_cache.codec import encode
    from monai_cache.loader import _held_only_by

    def fresh() -> MetaTensor:
        t = MetaTensor(torch.zeros(2, 3), affine=torch.eye(4))
        t.meta["grid"] = np.arange(3)
        t.applied_operations = [{"extra_info": {"m": torch.ones(2)}}]
        t.applied_operations.append(t.applied_operations[0])  # twice in the value itself: still its own
        return t

    def alone(t: MetaTensor) -> bool:
        objects = encode(t, exact=True).objects  # the encoding's own references are gone with it
        return _held_only_by(t, objects)

    assert alone(fresh())
    for hold in (
        lambda t: t.meta["affine"],  # a tensor of the value
        lambda t: t.meta,  # a container
        lambda t: t.meta["grid"],  # an array
        lambda t: t.meta["affine"][:2],  # a view of a tensor's memory
        lambda t: t.as_tensor(),  # the MetaTensor's own memory
        lambda t: t.applied_operations[0]["extra_info"]["m"].view(1, 2),
    ):
        t = fresh()
        held = hold(t)
        assert not alone(t)
        del held
        assert alone(t)


INHERITED = ["an object the main process made before forking the workers"]


def collate_noting_collections(samples: list) -> dict:
    """MONAI's batch, plus whether a collection in this worker would examine an object it inherited (a full one
    writes to each object it examines, so the pages the worker shares with the main process get copied)."""
    batch = list_data_collate(samples)
    batch["inherited_collected"] = torch.tensor(any(o is INHERITED for o in gc.get_objects()))
    return batch


@pytest.mark.parametrize(
    ("loader_class", "which"),
    [(DataLoader, "monai"), (DataLoader, "ours"), (monai.data.DataLoader, "ours"), (monai.data.DataLoader, "monai")],
    ids=["our-loader-monai-dataset", "our-loader-our-dataset", "monai-loader-our-dataset", "monai-only"],
)
def test_forked_workers_leave_what_they_inherited_out_of_their_collections(dataset, our_dataset, loader_class, which):
    """Our loader's workers, and any loader's workers reading our datasets, freeze what they hold when they start
    (gc.freeze): no collection there examines an object made in the main process. MONAI alone does not; the main
    process is left as it was."""
    frozen_here = gc.get_freeze_count()
    assert any(o is INHERITED for o in gc.get_objects())
    ds = our_dataset if which == "ours" else dataset
    kwargs = {"batch_size": 2, "num_workers": 2, "collate_fn": collate_noting_collections}
    batches = epochs(loader_class, ds, **kwargs)[0]
    noted = [bool(b["inherited_collected"]) for b in batches]
    assert noted == [loader_class is monai.data.DataLoader and which == "monai"] * len(batches)
    assert gc.get_freeze_count() == frozen_here


def test_spawn_and_persistent_workers_over_epochs(dataset):
    kwargs = {"batch_size": 2, "num_workers": 1, "persistent_workers": True}  # 1: each spawned worker imports MONAI
    theirs = epochs(monai.data.DataLoader, dataset, n=2, **kwargs)
    ours = epochs(DataLoader, dataset, n=2, multiprocessing_context="spawn", **kwargs)
    for a, b in zip(ours, theirs):  # MONAI's collated meta keys come in an order that depends on the hash seed
        assert_batches_equal(a, b, key_order=False)
    assert all(in_block(b["image"]) for b in ours[1])


def test_batch_sampler_sharded_sampler_iterable_and_default_convert(dataset, files):
    batch_sampler = [[4, 0], [1], [5, 3, 2]]
    sampler = ShardedDistributedSampler(dataset, num_replicas=2, rank=0, shuffle=True, seed=1)
    iterable = monai.data.IterableDataset(files[:3], tutorial_transforms(spatial_size=CROP, num_samples=1))
    cases = [
        (dataset, {"batch_sampler": batch_sampler}),
        (dataset, {"batch_size": 2, "sampler": sampler}),
        (iterable, {"batch_size": None, "collate_fn": None}),  # automatic batching off: default_convert
    ]
    for ds, kwargs in cases:
        ours = epochs(DataLoader, ds, num_workers=2, **kwargs)[0]
        assert_batches_equal(ours, epochs(monai.data.DataLoader, ds, num_workers=2, **kwargs)[0])
        tensors = [b["image"] if isinstance(b, dict) else b[0]["image"] for b in ours]
        # an item not collated is a crop: a view of part of its volume's memory, which torch's path keeps as it is
        # (the whole storage, the strides): such batches take torch's path
        assert all(in_block(t) for t in tensors) is (ds is dataset)


def test_same_signature_and_num_workers_zero_passes_through(dataset):
    def params(cls: type) -> list:
        return [(p.name, p.kind, p.default) for p in inspect.signature(cls).parameters.values()]

    assert params(DataLoader) == params(monai.data.DataLoader)
    assert monai_cache.DataLoader is DataLoader
    assert type(iter(DataLoader(dataset, batch_size=2))).__name__ == "_SingleProcessDataLoaderIter"
    ours = epochs(DataLoader, dataset, batch_size=2)[0]
    assert_batches_equal(ours, epochs(monai.data.DataLoader, dataset, batch_size=2)[0])
    assert not any(in_block(b["image"]) for b in ours)


def test_pin_memory_on_cpu(dataset):
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*pin_memory.*")  # torch: no accelerator, nothing to pin
        theirs = epochs(monai.data.DataLoader, dataset, batch_size=2, num_workers=2, pin_memory=True)[0]
        ours = epochs(DataLoader, dataset, batch_size=2, num_workers=2, pin_memory=True)[0]
    assert_batches_equal(ours, theirs)


@pytest.mark.parametrize("persistent", [False, True], ids=["new-workers", "persistent-workers"])
def test_kept_batches_keep_their_values_while_segments_are_reused(dataset, persistent):
    loader = DataLoader(dataset, batch_size=1, num_workers=2, persistent_workers=persistent)
    kept = list(loader)
    copies = [{k: v.clone() for k, v in b.items()} for b in kept]
    assert all(in_block(b["image"]) for b in kept)
    mapped = []
    for _ in range(3):
        for batch in loader:
            batch["image"].fill_(-1)  # scribble over every new batch in place: it must not reach kept ones
        mapped.append(len(block_ranges()))
    for b, c in zip(kept, copies):
        assert_same(b, c, strides=False)
    # released segments are reused: the mappings do not grow by a batch's worth epoch after epoch
    assert max(mapped) <= len(kept) + 2 * (2 + 2), mapped


def test_worker_killed_raises_torch_error_and_leaves_nothing(dataset):
    gc.collect()  # an earlier test's loader left in a reference cycle would close its segments during the test
    before = memfds()
    loader = DataLoader(dataset, batch_size=1, num_workers=2, prefetch_factor=1)
    it = iter(loader)
    first = next(it)  # from worker 0
    copy = first["image"].clone()
    pids = [w.pid for w in it._workers]
    assert memfds(pids[0])
    with pytest.raises(RuntimeError, match=r"DataLoader worker \(pid"):  # torch's SIGCHLD handler may raise at once
        os.kill(pids[0], signal.SIGKILL)
        list(it)
    assert torch.equal(first["image"], copy)  # what the killed worker sent stays valid
    del it, first, loader
    gc.collect()
    assert memfds() == before and not any(memfds(p) for p in pids)
    assert not any(pid_alive(p) for p in pids)


def test_main_process_killed_leaves_nothing(tmp_path, files):
    listing = tmp_path / "files.json"
    listing.write_text(json.dumps(files))
    shm_before = set(os.listdir("/dev/shm"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), *sys.path])}
    proc = subprocess.Popen([sys.executable, os.path.join(SCRIPTS, "loader_main.py"), str(listing)],
                            stdout=subprocess.PIPE, env=env, text=True)  # fmt: skip
    try:
        workers = json.loads(proc.stdout.readline())["workers"]
        assert all(memfds(w) for w in workers) and memfds(proc.pid)  # the blocks were in use
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 30  # torch's watchdog notices the parent's death within 5 s
    while any(pid_alive(w) for w in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(pid_alive(w) for w in workers)
    pids = [str(p) for p in (proc.pid, *workers)]
    assert not [n for n in set(os.listdir("/dev/shm")) - shm_before if any(p in n for p in pids)]


class Views(torch.utils.data.Dataset):
    """Items that are strided views of a larger tensor (what torch's path keeps as they are)."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.arange(16.0)[i::2][:4]


class WithSet(torch.utils.data.Dataset):
    """Items holding a value the codec cannot store (a set), every one."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> dict:
        return {"x": torch.full((3,), float(i)), "tags": {f"t{i}"}}


def keep_tags(samples: list) -> dict:
    return {"x": torch.stack([s["x"] for s in samples]), "tags": [s["tags"] for s in samples]}


class Tiny(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 2 * MAX_SEGMENTS + 8

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((128,), float(i))  # 512 bytes: stored in the block, not inline in its header


def test_batches_the_codec_cannot_store_take_torch_path_with_one_warning():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = list(DataLoader(WithSet(), batch_size=2, num_workers=2, collate_fn=keep_tags))
    assert_batches_equal(
        ours, list(monai.data.DataLoader(WithSet(), batch_size=2, num_workers=0, collate_fn=keep_tags))
    )
    ours_warnings = [str(w.message) for w in caught if issubclass(w.category, BatchFallbackWarning)]
    assert len(ours_warnings) == 1 and "set" in ours_warnings[0], ours_warnings
    # more batches of one worker alive than it has segments for: the rest take torch's path, one warning
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kept = list(DataLoader(Tiny(), batch_size=1, num_workers=2, prefetch_factor=1))
    assert [float(b[0, 0]) for b in kept] == [float(i) for i in range(len(Tiny()))]
    ours_warnings = [str(w.message) for w in caught if issubclass(w.category, BatchFallbackWarning)]
    assert len(ours_warnings) == 1 and f"more than {MAX_SEGMENTS} batches" in ours_warnings[0], ours_warnings
    assert sum(in_block(b) for b in kept) == 2 * MAX_SEGMENTS


def test_the_switch_loader_takes_the_block_path_only_for_collates_that_give_the_same_batches(dataset, caplog):
    """Under the switch (same_batches_only): torch's and MONAI's collate functions come as blocks; any other runs as
    monai.data.DataLoader (its collate may ask get_worker_info(), which the block path hides), with one debug line;
    a batch that takes torch's path says why in a debug line, not a warning."""
    import functools

    import monai_cache.loader as loader_module

    def own_collate(samples: list) -> dict:
        return list_data_collate(samples)

    caplog.set_level(logging.DEBUG, logger="monai_cache.loader")
    loader_module.same_batches_only(True)
    try:
        kinds = {
            "list": list_data_collate,
            "pad": functools.partial(pad_list_data_collate, method="end"),
            "own": own_collate,
        }
        for name, collate in kinds.items():
            ours = epochs(DataLoader, dataset, num_workers=2, batch_size=2, collate_fn=collate)[0]
            assert_batches_equal(ours, epochs(monai.data.DataLoader, dataset, num_workers=2, batch_size=2,
                                              collate_fn=collate)[0])
            assert all(in_block(b["image"]) for b in ours) is (name != "own"), name
        refusals = [r.getMessage() for r in caplog.records if "monai.data.DataLoader's path" in r.getMessage()]
        assert len(refusals) == 1 and "own_collate" in refusals[0], refusals
        # items not collated (batch_size=None, torch's default_convert) that are views of part of their memory
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            views = list(DataLoader(Views(), batch_size=None, num_workers=2, collate_fn=default_convert))
        assert [v.stride() for v in views] == [(2,)] * len(Views()) and not any(in_block(v) for v in views)
        assert not [w for w in caught if issubclass(w.category, BatchFallbackWarning)]
        assert any("part of its memory" in r.getMessage() for r in caplog.records)
    finally:
        loader_module.same_batches_only(False)


@pytest.fixture(scope="module")
def sandboxed() -> dict:
    """``loader_sandbox.py small-shm,no-proc`` in a private mount namespace with a 64 MB /dev/shm (Docker's default
    --shm-size); the script hides /proc itself before the second case. One interpreter for both tests."""
    script = os.path.join(SCRIPTS, "loader_sandbox.py")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), *sys.path])}
    mount = "mount -t tmpfs -o size=64m tmpfs /dev/shm"
    cmd = ["unshare", "-m", "sh", "-c", f"{mount} && echo mounted && exec {sys.executable} {script} small-shm,no-proc"]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    except FileNotFoundError:
        pytest.skip("no unshare command")
    if not r.stdout.startswith("mounted"):
        pytest.skip(f"cannot make a private mount namespace here: {r.stderr.strip()[-300:]}")
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_works_with_a_64mb_dev_shm_where_torch_path_fails(sandboxed):
    """Docker's default --shm-size is 64 MB; memfd segments are not in /dev/shm."""
    out = sandboxed["small-shm"]
    assert out["monai_cache.DataLoader"] == "ok"
    assert out["monai.data.DataLoader"] != "ok"  # torch's own path needs the space in /dev/shm


def test_without_proc_batches_take_torch_path_with_one_warning(sandboxed):
    out = sandboxed["no-proc"]
    assert out["sums"] == [1000.0, 5000.0]
    assert len(out["warnings"]) == 1 and "/proc/<pid>/fd cannot be used" in out["warnings"][0], out["warnings"]
