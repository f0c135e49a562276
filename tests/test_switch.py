"""The switch (monai_cache/switch.py): MONAI's caching datasets become ours wherever they are looked up.

In this process: off, nothing is patched; on, every name is ours, results equal MONAI's, a bundle's short
``_target_`` finds ours, a module imported before gets one warning naming it; ``run --dry-run``. One subprocess:
a bundle with short names under ``monai-cache run -- python -m monai.bundle run``, a spawned DataLoader worker
and a plain child inside it (with a worker forked from it), ``monai-cache top``, the exit status, the sitecustomize
chain, the log line (once, though both workers import MONAI), the bundle's DataLoader. Two more: a chaining
sitecustomize on either side of ours, each run once; one before ours that does not chain (the switch on all the same
where monai_cache_switch.pth is installed). The .pth line itself, in this process: off, it imports nothing.
The notebook with ``%load_ext monai_cache``: tests/test_notebook.py (the tutorial's kernel, one interpreter less).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import warnings

import monai.apps
import monai.data
import pytest
from helpers import as_slurm_task, chain, slurm_task
from test_codec import assert_same

import monai_cache
from monai_cache import switch

# the drop-in tests: CI runs them on the oldest supported MONAI and on monai-weekly too (.ci/run)
pytestmark = pytest.mark.dropin

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(REPO, "tests", "_scripts")
MONAI_MODULES = {"monai.data.dataset", "monai.data", "monai.data.dataloader", "monai.apps.datasets", "monai.apps"}


def _bound() -> dict[tuple[str, str], type]:
    """What each MONAI module holds under each name the switch may replace (DataLoader included)."""
    return {(m, n): getattr(sys.modules[m], n) for n, (ms, _o) in switch.swapped_names(True).items() for m in ms}


@pytest.fixture
def switched():
    """The switch on in this process (not for children), and off again afterwards whatever the test did."""
    before = _bound()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", monai_cache.SwitchWarning)  # other test modules bound MONAI's classes
        switch.install(children=False, announce=False)
    yield before
    switch.uninstall()
    assert _bound() == before


def _bundle_chain():
    from monai.transforms import Compose, EnsureChannelFirstd, LoadImaged

    return Compose([LoadImaged(keys=["image", "label"]), EnsureChannelFirstd(keys=["image", "label"])])


def _short_name_module(name: str) -> str | list[str]:
    """The module(s) a bundle's short ``_target_`` is found in (with several, MONAI warns and takes the first)."""
    from monai.bundle.config_item import ComponentLocator

    return ComponentLocator().get_component_module_name(name)


def test_switch_off_leaves_every_monai_class_as_monai(shm_dir):
    import monai_cache.apps  # importing ours patches nothing
    import monai_cache.loader  # noqa: F401

    assert not switch.installed() and os.environ.get(switch.ENV_VAR) is None
    for (module, name), cls in _bound().items():
        assert cls.__module__.split(".")[0] == "monai", (module, name, cls)
    found = _short_name_module("CacheDataset")  # MONAI's first, and ours once imported
    assert found == "monai.data.dataset" or found[0] == "monai.data.dataset"


def test_install_swaps_every_name_and_gives_monai_results(switched, shm_dir, volumes, tmp_path):
    originals = switched
    import monai_cache.loader

    assert monai_cache.loader._SAME_BATCHES_ONLY  # the switch's loader: MONAI's batches exactly
    for (module, name), cls in _bound().items():
        assert cls.__module__.startswith("monai_cache.") and cls.__name__ == name, (module, name)
        assert issubclass(cls, originals[(module, name)])
        assert _short_name_module(name) == cls.__module__  # a bundle's short _target_: ours only
    monai_cache.install()  # idempotent
    assert monai.data.CacheDataset is monai_cache.CacheDataset

    class After(monai.data.CacheDataset):  # a subclass defined afterwards
        pass

    ours = After(volumes[:4], transform=chain(), progress=False)
    theirs = originals[("monai.data", "CacheDataset")](volumes[:4], transform=chain(), progress=False)
    assert isinstance(ours, monai_cache.CacheDataset) and isinstance(ours, originals[("monai.data", "CacheDataset")])
    for ds in (ours, theirs):
        ds.transform.set_random_state(7)
    for i in range(4):
        assert_same(theirs[i], ours[i], skip_keys=("id",))  # id(transform): two equal chains
    assert ours.cache_stats()["stored"]["entries"] == 4
    ours.release()

    # MONAI's code that bound its classes at import keeps working with ours
    smart = monai.data.SmartCacheDataset(volumes[:4], transform=chain(crop=None), replace_rate=0.5, cache_num=2)
    assert isinstance(smart, originals[("monai.data.dataset", "SmartCacheDataset")])
    from monai.handlers import SmartCacheHandler  # isinstance(x, monai.data.SmartCacheDataset) inside

    SmartCacheHandler(smart)
    smart.shutdown()

    from monai.bundle import ConfigParser

    parser = ConfigParser(
        {
            "ds": {
                "_target_": "PersistentDataset",
                "data": volumes[:2],
                "transform": "$monai.transforms.LoadImaged(keys=['image'])",
                "cache_dir": str(tmp_path / "pd"),
            }
        }
    )
    persistent = parser.get_parsed_content("ds")
    stock = originals[("monai.data", "PersistentDataset")](
        volumes[:2], transform=monai.transforms.LoadImaged(keys=["image"]), cache_dir=str(tmp_path / "stock")
    )
    assert type(persistent) is monai_cache.PersistentDataset
    for i in range(2):  # MONAI's miss is a MetaTensor, its hit a Tensor; ours a Tensor on both (persistent.md)
        stock[i], persistent[i]
        assert_same(stock[i], persistent[i], skip_keys=("id",))


def test_module_imported_before_gets_one_warning_naming_it(tmp_path, monkeypatch):
    (tmp_path / "switch_user_module.py").write_text(
        "from monai.data import CacheDataset\nfrom monai.apps import DecathlonDataset as Decathlon\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    import switch_user_module  # noqa: F401 - bound MONAI's classes before the switch

    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            switch.install(children=True, announce=False)
        ours = [w for w in caught if issubclass(w.category, monai_cache.SwitchWarning)]
        assert len(ours) == 1, [str(w.message) for w in caught]
        message = str(ours[0].message)
        assert "switch_user_module (CacheDataset, DecathlonDataset)" in message
        assert "test_switch" not in message  # this module only looks the classes up at call time
        assert ours[0].filename == __file__  # points at the install() call
        # children=True: what the processes this one starts inherit
        assert os.environ[switch.ENV_VAR] == "1"
        assert os.environ["PYTHONPATH"].split(os.pathsep)[0] == switch.site_dir()
    finally:
        sys.modules.pop("switch_user_module", None)
        pythonpath = os.environ.get("PYTHONPATH")
        switch.uninstall()
    assert switch.ENV_VAR not in os.environ and os.environ.get("PYTHONPATH") != pythonpath


@pytest.mark.parametrize(
    "environ, main",
    [({}, True), ({"RANK": "0"}, True), ({"LOCAL_RANK": "0", "RANK": "3"}, True), ({"LOCAL_RANK": "1"}, False),
     (slurm_task(2, 0, 1, "2(x2)"), True), (slurm_task(3, 1, 1, "2(x2)"), False)],
)  # fmt: skip
def test_log_line_only_in_the_main_process(environ, main):
    assert switch._is_main_process(environ) is main


@pytest.mark.parametrize("local_id", [0, 1])
def test_log_line_once_per_node_in_a_slurm_task_without_torchrun(monkeypatch, local_id):
    """A rank that srun started, as Lightning's SLURMEnvironment leaves it (Slurm's variables only): the switch,
    turned on in it, logs its line in the node's first task only."""
    as_slurm_task(monkeypatch, 2 + local_id, local_id, 1, "2(x2)")
    logger, lines = logging.getLogger("monai_cache.switch"), []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    monkeypatch.setattr(logger, "handlers", [handler])  # _announce adds its stderr handler only to a bare logger
    monkeypatch.setattr(logger, "level", logging.INFO)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", monai_cache.SwitchWarning)  # other test modules bound MONAI's classes
        switch.install(children=False, announce=True)
    switch.uninstall()
    assert len(lines) == (1 - local_id) and all(line.startswith("monai_cache switch on (MONAI") for line in lines)


def test_run_dry_run_lists_the_classes_and_runs_nothing(capsys, tmp_path):
    from monai_cache.cli import main

    marker = tmp_path / "ran"
    assert main(["run", "--dry-run", "--", sys.executable, "-c", f"open({str(marker)!r}, 'w')"]) == 0
    out = capsys.readouterr().out
    assert f"MONAI {monai.__version__}" in out and not marker.exists()
    for name in switch.SWAPPED:
        assert f"monai.data.{name} -> monai_cache." in out or f"monai.apps.{name} -> monai_cache." in out
    assert "monai.data.DataLoader -> monai_cache.loader.DataLoader" in out and f"{switch.ENV_VAR}=1 " in out
    assert not switch.installed() and monai.data.CacheDataset.__module__ == "monai.data.dataset"  # left off
    assert main(["run", "--dry-run", "--no-dataloader", "--", "true"]) == 0
    out = capsys.readouterr().out
    assert "DataLoader" not in out.split("would run")[0] and f"{switch.ENV_VAR}={switch.DATASETS_ONLY} " in out
    said = out.splitlines()[-1]  # how CMD's processes turn it on: the .pth where installed (setup.py)
    pth = switch.pth_file()
    assert said.startswith(f"turned on at start-up by {pth}," if pth else "turned on at start-up by the sitecustomize")


_CHAIN_AFTER_OWN_DIRECTORY = """\
import importlib.machinery, importlib.util, os, sys
print("{name} ran", flush=True)
here = os.path.dirname(os.path.abspath(__file__))
after = sys.path[[os.path.abspath(p) for p in sys.path].index(here) + 1 :]
spec = importlib.machinery.PathFinder.find_spec("sitecustomize", after)
if spec is not None:
    sys.modules["sitecustomize"] = module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
"""
_CHAIN_WHOLE_PATH_LESS_OWN = """\
import os, sys
print("{name} ran", flush=True)
here = os.path.dirname(os.path.abspath(__file__))
saved = list(sys.path)
sys.path[:] = [p for p in sys.path if os.path.abspath(p) != here]
del sys.modules["sitecustomize"]
try:
    import sitecustomize
except ImportError:
    pass
sys.path[:] = saved
"""


_SWITCH_STATE = (
    "import site, sys; from monai_cache import switch; "
    "hooks = sum(type(f).__name__ == '_PatchOnImport' for f in sys.meta_path); "
    "print('switch on' if switch.installed() else 'switch off', hooks, 'user site' if site.ENABLE_USER_SITE else '')"
)


def test_sitecustomize_chain_runs_each_once(tmp_path):
    """A chaining ``sitecustomize`` before ours (a launcher prepended its directory) and one after: each runs once,
    and the switch is on, once (one import hook), whether ``monai_cache_switch.pth`` turned it on first or ours.
    ``before`` chains to the entries after its own directory, leaving the path whole (ours found it again and ran it
    twice); ``after`` chains to the whole path less its own directory, which finds ``before`` again unless ours hides
    the entries before it. A ``usercustomize`` after ours runs once too."""
    for name, text in (("before", _CHAIN_AFTER_OWN_DIRECTORY), ("after", _CHAIN_WHOLE_PATH_LESS_OWN)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "sitecustomize.py").write_text(text.format(name=name))
    (tmp_path / "after" / "usercustomize.py").write_text("print('user ran', flush=True)\n")
    path = [str(tmp_path / "before"), switch.site_dir(), str(tmp_path / "after"), REPO]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), switch.ENV_VAR: "1"}
    p = subprocess.run([sys.executable, "-c", _SWITCH_STATE], capture_output=True, text=True, timeout=60, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = p.stdout.splitlines()
    user_site = lines[-1].endswith("user site")
    assert lines == ["before ran", "after ran", *(["user ran"] if user_site else []), lines[-1]], lines
    assert lines[-1].startswith("switch on 1 ") and "monai_cache switch:" not in p.stderr, p.stderr[-3000:]


def test_switch_on_though_a_sitecustomize_before_ours_does_not_chain(tmp_path):
    """A launcher's directory in front of ours holding a ``sitecustomize.py`` that does not run the next one
    (MONAI Label's, a cluster's): Python imports only that one. ``monai_cache_switch.pth``, installed with the
    package, turns the switch on before it, once, whatever the path holds, and nothing is said. Without it (the
    package on ``PYTHONPATH`` only), ours turns it on from ``usercustomize`` where Python imports that (the user
    site on) and says so, naming the file; elsewhere the switch stays off in that process."""
    (tmp_path / "shadow").mkdir()
    (tmp_path / "shadow" / "sitecustomize.py").write_text("print('shadow ran', flush=True)\n")
    path = [str(tmp_path / "shadow"), switch.site_dir(), REPO]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), switch.ENV_VAR: "1"}
    p = subprocess.run([sys.executable, "-c", _SWITCH_STATE], capture_output=True, text=True, timeout=60, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    lines, said = p.stdout.splitlines(), [x for x in p.stderr.splitlines() if x.startswith("monai_cache switch:")]
    if switch.pth_file() is not None:
        assert lines == ["shadow ran", lines[-1]] and lines[-1].startswith("switch on 1 "), lines
        assert not said, p.stderr[-3000:]
    elif lines[-1].endswith("user site"):
        assert lines == ["shadow ran", lines[-1]] and lines[-1].startswith("switch on 1 "), lines
        assert len(said) == 1 and str(tmp_path / "shadow" / "sitecustomize.py") in said[0], p.stderr[-3000:]
    else:  # a virtual environment without the system's site packages: nothing of ours runs
        assert lines == ["shadow ran", lines[-1]] and lines[-1].startswith("switch off 0 "), lines


def test_pth_line_with_the_switch_off_imports_and_changes_nothing(monkeypatch, capsys):
    """The line ``site.py`` runs at every start of every interpreter of the environment: with the switch off (unset,
    empty, ``0``) it imports nothing and changes nothing; on, where the package cannot be imported, it says so and
    does not raise (a ``.pth`` line that raises prints a traceback at every start). The copy installed in this
    interpreter's site-packages, if any, is this one."""
    text = open(os.path.join(REPO, switch.PTH)).read()
    lines = [x for x in text.splitlines() if x and not x.startswith("#")]
    assert len(lines) == 1 and lines[0].startswith("import "), lines
    installed = switch.pth_file()
    if installed is not None:
        assert open(installed).read() == text, f"{installed} is not {switch.PTH} of this tree: pip install -e . again"
    for value in (None, "", "0", "off"):
        if value is None:
            monkeypatch.delenv(switch.ENV_VAR, raising=False)
        else:
            monkeypatch.setenv(switch.ENV_VAR, value)
        before = (set(sys.modules), list(sys.path), list(sys.meta_path), dict(os.environ))
        exec(lines[0], {})
        assert (set(sys.modules), list(sys.path), list(sys.meta_path), dict(os.environ)) == before, value
    monkeypatch.setenv(switch.ENV_VAR, "1")
    monkeypatch.setitem(sys.modules, "monai_cache", None)  # import monai_cache raises ImportError
    exec(lines[0], {})
    assert not switch.installed()
    err = capsys.readouterr().err
    said = f"monai_cache switch: not turned on in this process ({sys.executable}) by {switch.PTH}: "
    assert err.startswith(said), err


@pytest.fixture(scope="module")
def bundle_run(tmp_path_factory, volumes):
    """One process tree: monai-cache run -> python -m monai.bundle run -> a spawned DataLoader worker, ``monai-cache
    top``, and a plain child with a worker forked from it. Yields the probe's facts, stderr and the cache root."""
    pytest.importorskip("fire", reason="monai.bundle's command line needs 'fire' (in the test extras)")
    tmp_path = tmp_path_factory.mktemp("bundle")
    shm = f"/dev/shm/mc-test-switch-{os.getpid()}"
    os.makedirs(shm)
    config = {
        "imports": ["$import switch_probe"],
        "datalist": volumes[:3],
        "transform": {
            "_target_": "Compose",
            "transforms": [
                {"_target_": "LoadImaged", "keys": ["image", "label"]},
                {"_target_": "EnsureChannelFirstd", "keys": ["image", "label"]},
            ],
        },
        "dataset": {"_target_": "CacheDataset", "data": "@datalist", "transform": "@transform", "progress": False},
        "persistent": {
            "_target_": "PersistentDataset",
            "data": "@datalist",
            "transform": "@transform",
            "cache_dir": str(tmp_path / "pd"),
        },
        "loader": {"_target_": "DataLoader", "dataset": "@dataset", "batch_size": 2, "num_workers": 2},
        "run": ["$switch_probe.report(@dataset, @persistent, @loader)"],
    }
    (tmp_path / "bundle.json").write_text(json.dumps(config))
    other = tmp_path / "other_site"  # a sitecustomize the switch's own must run too
    other.mkdir()
    (other / "sitecustomize.py").write_text("import os\nos.environ['SWITCH_PROBE_CHAINED'] = 'yes'\n")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(other), REPO, SCRIPTS]),
        "OMP_NUM_THREADS": "1",
        "MONAI_CACHE_SHM_DIR": shm,
    }
    cmd = [
        sys.executable, "-m", "monai_cache", "run", "--",
        sys.executable, "-m", "monai.bundle", "run", "--config_file", str(tmp_path / "bundle.json"),
    ]  # fmt: skip
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=str(tmp_path))
        assert p.returncode == 3, p.stdout[-3000:] + p.stderr[-3000:]  # the probe's exit status, passed through
        line = next(x for x in p.stdout.splitlines() if x.startswith("SWITCH_PROBE "))
        yield json.loads(line.split(" ", 1)[1]), p.stderr, os.path.join(shm, f"monai_cache-{os.getuid()}")
    finally:
        shutil.rmtree(shm, ignore_errors=True)


@pytest.mark.slow
def test_bundle_with_short_names_under_monai_cache_run(bundle_run, volumes, monkeypatch):
    facts, _stderr, root = bundle_run
    # the bundle's short names built ours; the disk cache gives MONAI's keys
    assert facts["dataset"] == "monai_cache.dataset.CacheDataset"
    assert facts["persistent"] == "monai_cache.persistent.PersistentDataset"
    keys = facts["persistent_items"]
    assert (
        facts["entries"] == 3 and len(keys) == 3 and keys[0] == keys[2] and {"image", "label", "case"} <= set(keys[0])
    )
    # the short name DataLoader is ours (MONAI's list_data_collate): every batch a block, byte-identical to stock's
    monkeypatch.syspath_prepend(SCRIPTS)
    from batch_digest import batch_digest

    stock_ds = monai.data.CacheDataset(volumes[:3], transform=_bundle_chain(), progress=False)
    stock = [batch_digest(b) for b in monai.data.DataLoader(stock_ds, batch_size=2, num_workers=2)]
    assert facts["loader"] == "monai_cache.loader.DataLoader" and facts["blocks"] == [True, True]
    assert facts["digests"] == stock
    # monai-cache top, a child of the bundle's process, lists the cache the switch made
    assert 3 in facts["top"]
    # a spawned DataLoader worker: a fresh interpreter, with the switch on
    assert facts["worker_pid"] != facts["pid"]
    assert facts["worker_dataset"] == "monai_cache.dataset" and facts["worker_apps"] == "monai_cache.apps.datasets"
    assert facts["worker_switch"] == "1" and facts["worker_chained"] == "yes" and facts["chained"] == "yes"
    # a child that never imports MONAI: the switch waits for it, importing neither torch nor MONAI
    assert facts["child_modules"] == ["monai_cache.switch"]
    assert not os.path.isdir(root) or not [n for n in os.listdir(root) if not n.startswith(".")]


@pytest.mark.slow
def test_log_line_once_though_a_forked_and_a_spawned_worker_import_monai(bundle_run):
    """The worker rule: the bundle's process logs the line; a spawned DataLoader worker and a worker forked from a
    process without MONAI each import MONAI with the switch on (it patches there too), and log nothing."""
    facts, stderr, _root = bundle_run
    assert facts["worker_dataset"] == "monai_cache.dataset" and facts["worker_pid"] != facts["pid"]
    assert facts["forked_dataset"] == "monai_cache.dataset" and facts["forked_exitcode"] == 0
    log = [x for x in stderr.splitlines() if "monai_cache switch on" in x]
    assert len(log) == 1 and f"MONAI {monai.__version__}" in log[0] and "CacheDataset" in log[0], stderr[-3000:]
