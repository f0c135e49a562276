"""Datasets that compute different values never share a cache, whatever makes them differ.

The shared-memory cache is found by a fingerprint of the data, the cached transforms and the options, so
that ranks and jobs computing the same items share one copy. Anything that changes the values must change
the fingerprint: these cases once served another dataset's items.
"""

from __future__ import annotations

import os
import subprocess
import sys

import monai.data
import pytest
import torch
from monai.transforms import Compose, Lambdad, MapTransform

import monai_cache
from monai_cache.fingerprint import chain_fingerprint, fingerprint, relative_paths_base

DATA = [{"x": torch.tensor(float(i))} for i in range(3)]


def values(ds) -> list[float]:
    return [float(ds[i]["x"]) for i in range(len(ds))]


def both(data, transform, **kw):
    """MONAI's values and ours for the same arguments (ours kept alive: its cache must not be reused)."""
    ours = monai_cache.CacheDataset(data, transform, progress=False, **kw)
    return values(monai.data.CacheDataset(data, transform, progress=False, **kw)), values(ours), ours


def make_adder(amount):
    return lambda x: x + amount


SCALE = 2


def scaled(x):
    return x * SCALE


@pytest.mark.parametrize(
    "first, second",
    [
        (lambda: Lambdad("x", lambda v: v * 2), lambda: Lambdad("x", lambda v: v * 3)),  # a constant
        (lambda: Lambdad("x", make_adder(100)), lambda: Lambdad("x", make_adder(1000))),  # a closure value
    ],
    ids=["lambda-constant", "closure"],
)
def test_transforms_that_differ_only_in_code_or_captured_values_get_their_own_cache(shm_dir, first, second):
    ref_a, ours_a, keep_a = both(DATA, Compose([first()]))
    ref_b, ours_b, keep_b = both(DATA, Compose([second()]))
    assert ours_a == ref_a and ours_b == ref_b and ref_a != ref_b
    assert keep_a._cache.path != keep_b._cache.path


def test_a_module_global_read_by_a_transform_is_part_of_the_fingerprint(shm_dir):
    """Two jobs of a sweep that differ in a global: the second must not read the first one's cache."""
    global SCALE
    chain = Compose([Lambdad("x", scaled)])
    try:
        SCALE = 2
        ref_a, ours_a, _keep_a = both(DATA, chain)
        SCALE = 3
        ref_b, ours_b, _keep_b = both(DATA, chain)
    finally:
        SCALE = 2
    assert (ours_a, ours_b) == (ref_a, ref_b) == ([0.0, 2.0, 4.0], [0.0, 3.0, 6.0])


def test_an_edited_function_body_gets_a_new_fingerprint():
    def body(x):
        return x + 1

    before = fingerprint(Compose([Lambdad("x", body)]))

    def body(x):  # the same name, edited
        return x + 2

    assert fingerprint(Compose([Lambdad("x", body)])) != before


class Doubler(MapTransform):
    def __call__(self, data):
        d = dict(data)
        for k in self.key_iterator(d):
            d[k] = d[k] * 2
        return d


def test_a_user_transform_class_is_taken_by_value():
    before = fingerprint(Doubler("x"))

    class Tripler(Doubler):
        pass

    body = {"__call__": lambda self, d: {k: v * 3 for k, v in d.items()}, "__module__": Doubler.__module__,
            "__qualname__": "Doubler"}
    edited = type("Doubler", (MapTransform,), body)
    assert fingerprint(edited("x")) != before  # the same name, another body
    assert fingerprint(Doubler("x")) == before and fingerprint(Tripler("x")) != before


def test_compose_settings_that_change_the_values_are_part_of_the_fingerprint(shm_dir, volumes):
    from helpers import chain

    eager, lazy = chain(crop=None), chain(crop=None)
    lazy.lazy = True
    ours_eager = monai_cache.CacheDataset(volumes[:2], eager, progress=False)
    ours_lazy = monai_cache.CacheDataset(volumes[:2], lazy, progress=False)
    ref_lazy = monai.data.CacheDataset(volumes[:2], lazy, progress=False)
    assert ours_eager._cache.path != ours_lazy._cache.path
    assert torch.equal(ours_lazy[0]["image"], ref_lazy[0]["image"])


class ScaledDataset(monai_cache.CacheDataset):
    """A subclass whose own state changes what the cache holds."""

    def __init__(self, data, scale, **kw):
        self.scale = scale
        super().__init__(data, **kw)

    def _load_cache_item(self, idx):
        return {"x": self.data[idx]["x"] * self.scale}


def test_a_subclass_state_set_before_init_is_part_of_the_fingerprint(shm_dir):
    ten = ScaledDataset(DATA, 10, progress=False)
    hundred = ScaledDataset(DATA, 100, progress=False)
    assert values(ten) == [0.0, 10.0, 20.0] and values(hundred) == [0.0, 100.0, 200.0]


def test_hash_as_key_with_different_hash_functions(shm_dir):
    """Two lambdas that group the items differently (same number of groups): each gets MONAI's items."""
    data = [{"x": torch.tensor(float(i)), "a": i % 2, "b": i // 2} for i in range(4)]
    by_a = lambda d: str(d["a"]).encode()  # noqa: E731
    by_b = lambda d: str(d["b"]).encode()  # noqa: E731
    kw = dict(transform=None, progress=False, hash_as_key=True)
    a = monai_cache.CacheDataset(data, hash_func=by_a, **kw)
    b = monai_cache.CacheDataset(data, hash_func=by_b, **kw)
    for ours, func in ((a, by_a), (b, by_b)):
        ref = monai.data.CacheDataset(data, hash_func=func, **kw)
        assert values(ours) == values(ref)
    assert values(a) != values(b) and a._cache.path != b._cache.path


def test_data_that_is_not_a_list_is_fingerprinted_by_its_values(shm_dir):
    class Items:  # a Sequence-like container: MONAI only uses len() and [i]
        def __init__(self, offset):
            self.offset = offset

        def __len__(self):
            return 3

        def __getitem__(self, i):
            if not 0 <= i < 3:
                raise KeyError(i)  # not IndexError: walking it with list() would fail
            return {"x": torch.tensor(float(i + self.offset))}

    a = monai_cache.CacheDataset(Items(0), progress=False)
    b = monai_cache.CacheDataset(Items(10), progress=False)
    assert values(a) == [0.0, 1.0, 2.0] and values(b) == [10.0, 11.0, 12.0]


TRAINING_SCRIPT = """
from monai.transforms import Compose, Lambdad, MapTransform

SCALE = 2
KEYS = {"image", "label", "mask", "weights", "extra"}  # a set: its order depends on the process's hash seed


class Scale(MapTransform):
    def __call__(self, data):
        return {k: v * SCALE for k, v in data.items()}


def chain():
    return Compose([Scale("x"), Lambdad("x", lambda v: sorted(KEYS) and v + SCALE)])


def data():  # tensors in the data list: a tensor's own pickle goes through torch.save (a random id in its archive)
    import torch
    from monai.data import MetaTensor

    return [{"x": torch.arange(6.0).reshape(2, 3), "y": MetaTensor(torch.ones(2), meta={"spacing": 1.5})}]


if __name__ == "__main__":
    from monai_cache.fingerprint import chain_fingerprint, fingerprint

    print(list(KEYS))
    print(chain_fingerprint(chain()))
    print(fingerprint(data()))
"""


@pytest.fixture(scope="module")
def script_runs(tmp_path_factory) -> tuple[str, dict[int, list[str]]]:
    """``python train_script.py`` run as ranks run it, twice at once, under two hash seeds. Returns the script's
    directory and {hash seed: [the set's order, the fingerprint]}."""
    work = tmp_path_factory.mktemp("script")
    (work / "train_script.py").write_text(TRAINING_SCRIPT)
    procs = {
        seed: subprocess.Popen(
            [sys.executable, "train_script.py"], cwd=work, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "PYTHONHASHSEED": str(seed)},
        )
        for seed in (0, 1)  # these two seeds order the set's strings differently (asserted below)
    }  # fmt: skip
    outs = {}
    for seed, p in procs.items():
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-3000:]
        outs[seed] = out.strip().splitlines()
    return str(work), outs


def test_fingerprints_agree_between_processes_whatever_their_hash_seed(script_runs):
    """Ranks must find the same cache: sets (hash-ordered) and user code must not depend on the process."""
    _work, outs = script_runs
    assert outs[0][0] != outs[1][0]  # the set came in two orders
    assert outs[0][1] == outs[1][1] and len(outs[0][1]) == 64


def test_the_same_code_run_as_a_script_or_imported_has_one_fingerprint(script_runs):
    """Ranks run the script as __main__; a tool that imports it (this process) must find the same cache."""
    work, outs = script_runs
    sys.path.insert(0, work)
    try:
        import train_script  # type: ignore[import-not-found]

        imported = chain_fingerprint(train_script.chain())
        data = train_script.data()
    finally:
        sys.path.remove(work)
        sys.modules.pop("train_script", None)
    assert imported == outs[0][1] and len(imported) == 64
    # data holding tensors: one cache for every rank, and for the next run
    assert outs[0][2] == outs[1][2] == fingerprint(data)
    assert fingerprint([{**data[0], "x": data[0]["x"] + 1}]) != fingerprint(data)
    other_meta = type(data[0]["y"])(data[0]["y"].as_tensor(), meta={"spacing": 2.0})
    assert fingerprint([{**data[0], "y": other_meta}]) != fingerprint(data)


def test_relative_paths_resolved_in_another_directory_get_their_own_cache(tmp_path, monkeypatch, shm_dir):
    """Two jobs started in two directories with the same relative paths read different files: one cache each.
    Absolute paths, or strings that name no file, keep one cache wherever the job starts."""
    for sub in ("a", "b"):
        (tmp_path / sub / "ct").mkdir(parents=True)
        (tmp_path / sub / "ct" / "img.nii.gz").write_bytes(sub.encode())
    relative = [{"image": "ct/img.nii.gz", "label": 1}]
    absolute = [{"image": str(tmp_path / "a" / "ct" / "img.nii.gz")}]
    names = {}
    for sub in ("a", "b"):
        monkeypatch.chdir(tmp_path / sub)
        assert relative_paths_base(relative) == str(tmp_path / sub)
        assert relative_paths_base(absolute) is None and relative_paths_base([{"image": "no/such/file"}]) is None
        names[sub] = [monai_cache.CacheDataset(d, transform=None, runtime_cache=True, progress=False)._fingerprint()
                      for d in (relative, absolute)]  # fmt: skip
    assert names["a"][0] != names["b"][0]
    assert names["a"][1] == names["b"][1]
