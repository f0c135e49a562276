"""The switch: MONAI's caching datasets become monai_cache's wherever they are looked up, without editing code.

Three ways to turn it on, one mechanism:

* ``monai_cache.install()`` in code, or ``%load_ext monai_cache`` in a notebook;
* ``monai-cache run -- CMD ...`` (also ``python -m monai_cache run -- ...``): sets :data:`ENV_VAR` and puts
  :func:`site_dir` (a ``sitecustomize.py`` shipped in the package) on ``PYTHONPATH``, then ``exec``\\ s ``CMD``.
  Every Python process of the tree inherits both (torchrun's ranks, spawned DataLoader workers, Auto3DSeg's
  trainings) and calls :func:`install` at start-up. ``install()`` in code sets them for its children too.

At start-up, two hooks call :func:`install` where :data:`ENV_VAR` asks for it, the first one that runs doing it
(``install()`` is idempotent): ``monai_cache_switch.pth``, which ``pip install`` (editable or not) puts into
site-packages (setup.py), and which Python runs before any ``sitecustomize`` whatever ``PYTHONPATH`` holds, so a
launcher's ``sitecustomize`` put in front of ours cannot turn the switch off; and the ``sitecustomize.py`` of
:func:`site_dir`, for an interpreter that finds the package on ``PYTHONPATH`` only (no ``.pth``: not installed, or
installed with ``pip install --target``), which also runs the ``sitecustomize`` it shadows.

:func:`install` imports neither torch nor MONAI: if ``monai`` is not imported yet it adds an import hook that
patches the moment ``import monai`` finishes (``import monai`` imports ``monai.data`` and ``monai.apps``), so a
process that never uses MONAI (``torchrun``'s agent, a shell tool) pays only for this module.

Patching replaces the attributes of :data:`SWAPPED` in the modules that define them and in the packages that
export them (``monai.data.dataset`` and ``monai.data``, ``monai.apps.datasets`` and ``monai.apps``). Ours subclass
MONAI's, so ``isinstance(x, <MONAI's class>)`` holds and MONAI's own code, which bound its classes when it was
imported (``SmartCacheDataset`` subclassing ``CacheDataset``, the apps datasets calling
``CacheDataset.__init__`` by name), is unchanged. A bundle's short ``_target_`` finds ours:
``ComponentLocator`` lists a class under the module whose ``__module__`` it is, and the MONAI modules no longer
hold MONAI's class under that name. Names bound before the switch (``from monai.data import CacheDataset``
before ``install()``) cannot be reached: one :class:`~monai_cache.errors.SwitchWarning` names their modules.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Iterator
from typing import Any

__all__ = [
    "DATASETS_ONLY",
    "ENV_VAR",
    "SWAPPED",
    "describe",
    "install",
    "installed",
    "load_ipython_extension",
    "original",
    "pth_file",
    "site_dir",
    "swapped_names",
    "uninstall",
]

ENV_VAR = "MONAI_CACHE_SWITCH"
"""``1`` turns the switch on in every Python process that starts with it, in an environment where the package is
installed (``monai_cache_switch.pth``) or with :func:`site_dir` on ``PYTHONPATH``, the DataLoader included;
``datasets`` swaps the datasets only (``monai.data.DataLoader`` stays MONAI's). ``dataloader``, the value of earlier
releases, means ``1``."""

DATASETS_ONLY = "datasets"
"""The value of :data:`ENV_VAR` that leaves ``monai.data.DataLoader`` as MONAI's."""

SWAPPED: dict[str, tuple[tuple[str, ...], str]] = {
    # name: (MONAI modules that hold it: the defining module first, then the package exporting it), our module
    "CacheDataset": (("monai.data.dataset", "monai.data"), "monai_cache.dataset"),
    "PersistentDataset": (("monai.data.dataset", "monai.data"), "monai_cache.persistent"),
    "SmartCacheDataset": (("monai.data.dataset", "monai.data"), "monai_cache.smartcache"),
    "CacheNTransDataset": (("monai.data.dataset", "monai.data"), "monai_cache.cache_n_trans"),
    "MedNISTDataset": (("monai.apps.datasets", "monai.apps"), "monai_cache.apps.datasets"),
    "DecathlonDataset": (("monai.apps.datasets", "monai.apps"), "monai_cache.apps.datasets"),
    "TciaDataset": (("monai.apps.datasets", "monai.apps"), "monai_cache.apps.datasets"),
}
"""The datasets the switch replaces; ``DataLoader`` is added unless ``install(dataloader=False)`` (see
docs/migrating.md)."""

_DATALOADER: dict[str, tuple[tuple[str, ...], str]] = {
    "DataLoader": (("monai.data.dataloader", "monai.data"), "monai_cache.loader")
}

_SITE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_switch_site")

PTH = "monai_cache_switch.pth"
"""The file that ``pip install`` puts into site-packages beside the package (setup.py): Python runs it at start-up,
before any ``sitecustomize``, and it calls :func:`install` where :data:`ENV_VAR` asks for it."""


class _State:
    """The switch in this process: what was replaced (to undo it), the hook, the environment before."""

    on = False
    dataloader = False
    patched = False
    hook: _PatchOnImport | None = None
    originals: dict[tuple[str, str], Any] = {}
    environ: dict[str, str | None] = {}
    announce = True


def site_dir() -> str:
    """The directory holding the ``sitecustomize.py`` that turns the switch on in a new interpreter."""
    return _SITE_DIR


def pth_file() -> str | None:
    """:data:`PTH` in a site-packages directory of this interpreter that ``site`` reads at start-up, or ``None``: not
    installed here (the package found on ``PYTHONPATH`` only, or installed without it), where the switch relies on the
    ``sitecustomize.py`` of :func:`site_dir`."""
    import site

    dirs = list(getattr(site, "getsitepackages", list)())
    if site.ENABLE_USER_SITE:
        dirs.append(site.getusersitepackages())
    return next((os.path.join(d, PTH) for d in dirs if os.path.isfile(os.path.join(d, PTH))), None)


def swapped_names(dataloader: bool = False) -> dict[str, tuple[tuple[str, ...], str]]:
    """The names the switch replaces: ``{name: (MONAI modules, our module)}``.

    Args:
        dataloader: include ``monai.data.DataLoader`` (the default of :func:`install`).
    """
    return {**SWAPPED, **_DATALOADER} if dataloader else dict(SWAPPED)


def original(name: str) -> Any:
    """MONAI's own class for a name the switch replaces, whether the switch is on or not (for code that must tell
    MONAI's classes from ours, e.g. ``monai-cache plan``).

    Args:
        name: a key of :func:`swapped_names` (``"CacheDataset"``, ``"DataLoader"``, ...).
    """
    modules, _ours = swapped_names(True)[name]
    saved = _State.originals.get((modules[0], name))
    return saved if saved is not None else getattr(importlib.import_module(modules[0]), name)


def installed() -> bool:
    """Whether the switch is on in this process (it may still wait for ``import monai`` to patch)."""
    return _State.on


def install(dataloader: bool | None = None, children: bool = True, announce: bool = True) -> None:
    """Turn the switch on: MONAI's caching datasets become monai_cache's wherever they are looked up.

    Idempotent. Patches now if ``monai`` is imported, else when ``import monai`` finishes (importing neither
    torch nor MONAI here).

    Args:
        dataloader: also swap ``monai.data.DataLoader`` for :class:`monai_cache.DataLoader`, which then takes its
            block path only where it gives the very batches of MONAI's loader (torch's and MONAI's collate
            functions; :func:`monai_cache.loader.same_batches_only`). ``None`` (default): on, unless
            :data:`ENV_VAR` is ``datasets``. ``False`` keeps MONAI's loader.
        children: set :data:`ENV_VAR` and put :func:`site_dir` on ``PYTHONPATH`` in ``os.environ``, so that the
            Python processes this one starts (spawned DataLoader workers, ``torchrun``, Auto3DSeg's trainings)
            have the switch on too. :func:`uninstall` restores both.
        announce: log one line naming the classes swapped and the MONAI version, in the main process only (not
            in DataLoader workers, nor in ranks other than local rank 0).
    """
    if dataloader is None:
        dataloader = os.environ.get(ENV_VAR, "").strip().lower() != DATASETS_ONLY
    if _State.on:
        if dataloader and not _State.dataloader:
            _State.dataloader = True
            if children and _State.environ:
                os.environ[ENV_VAR] = "1"
            if _State.patched:
                _patch(_DATALOADER)
        return
    _State.on, _State.dataloader, _State.announce = True, dataloader, announce
    if children:
        _export_environment(dataloader)
    if _monai_ready():
        _activate()
    else:
        _State.hook = _PatchOnImport()
        sys.meta_path.insert(0, _State.hook)


def uninstall() -> None:
    """Turn the switch off: MONAI's classes are back where they were, the environment as before ``install()``.

    Objects made while it was on, and classes that subclassed ours meanwhile, stay ours.
    """
    if _State.hook is not None and _State.hook in sys.meta_path:
        sys.meta_path.remove(_State.hook)
    _State.hook = None
    for (module, name), original in _State.originals.items():
        mod = sys.modules.get(module)
        if mod is not None:
            setattr(mod, name, original)
    _State.originals = {}
    loader = sys.modules.get("monai_cache.loader")
    if loader is not None:
        loader.same_batches_only(False)
    for key, value in _State.environ.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    _State.environ = {}
    _State.on = _State.patched = _State.dataloader = False


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext monai_cache``: :func:`install` in a notebook or IPython session.

    Args:
        ipython: the IPython shell (unused: the switch is per process).
    """
    install()


def _export_environment(dataloader: bool) -> None:
    value = "1" if dataloader else DATASETS_ONLY
    _State.environ = {ENV_VAR: os.environ.get(ENV_VAR), "PYTHONPATH": os.environ.get("PYTHONPATH")}
    os.environ[ENV_VAR] = value
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if _SITE_DIR not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([_SITE_DIR, *paths])


def _initializing(name: str) -> bool:
    module = sys.modules.get(name)
    return module is not None and bool(getattr(getattr(module, "__spec__", None), "_initializing", False))


def _monai_ready() -> bool:
    """``monai`` is imported, and neither it nor one of our modules is half-way through its import (ours import
    MONAI; importing ours now would find a partially initialised module)."""
    if "monai" not in sys.modules or _initializing("monai"):
        return False
    return not any(_initializing(n) for n in list(sys.modules) if n == "monai_cache" or n.startswith("monai_cache."))


def _activate() -> None:
    if _State.hook is not None and _State.hook in sys.meta_path:
        sys.meta_path.remove(_State.hook)
    _State.hook = None
    before = _bindings_before()
    names = swapped_names(_State.dataloader)
    _patch(names)
    _State.patched = True
    if before:
        from monai_cache.errors import SwitchWarning, warn

        warn(
            "the switch is on, but these modules bound MONAI's classes before the switch was turned on and keep "
            f"them: {', '.join(before)}. Turn it on before they are imported (monai-cache run -- CMD, or "
            "monai_cache.install() first), or import the classes from monai_cache there.",
            SwitchWarning,
            stacklevel=4,
        )
    if _State.announce and _is_main_process(os.environ):
        _announce(names)


def _patch(names: dict[str, tuple[tuple[str, ...], str]]) -> None:
    names = {n: v for n, v in names.items() if v[0][0] in sys.modules or not v[0][0].startswith("monai.apps")}
    # ours first, all of them: each binds MONAI's originals when imported, which must not be ours already
    ours = {name: getattr(importlib.import_module(module), name) for name, (_modules, module) in names.items()}
    if "DataLoader" in ours:  # batches exactly MONAI's: other collate functions keep MONAI's path
        importlib.import_module("monai_cache.loader").same_batches_only(True)
    for name, (modules, _module) in names.items():
        for module in modules:
            mod = importlib.import_module(module)
            current = getattr(mod, name, None)
            if current is not ours[name]:
                _State.originals.setdefault((module, name), current)
                setattr(mod, name, ours[name])


def _original_classes() -> dict[str, type]:
    """MONAI's classes the switch is about to replace (those still in place: not ours yet)."""
    out = {}
    for name, (modules, _ours) in swapped_names(_State.dataloader).items():
        cls = getattr(sys.modules.get(modules[0]), name, None)
        if isinstance(cls, type) and cls.__module__ == modules[0]:
            out[name] = cls
    return out


def _outside(module_name: str) -> bool:
    return module_name.split(".")[0] not in ("monai", "monai_cache")


def _bindings_before() -> list[str]:
    """Modules outside MONAI and monai_cache that hold one of MONAI's originals at module level, or define a
    subclass of one: what the switch cannot reach (``__main__`` included)."""
    classes = _original_classes()
    if not classes:
        return []
    originals = {id(cls): name for name, cls in classes.items()}
    found: dict[str, set[str]] = {}
    seen: set[int] = set()
    for module_name, module in list(sys.modules.items()):
        if not _outside(module_name) or id(module) in seen:  # __mp_main__ is __main__ once multiprocessing ran
            continue
        seen.add(id(module))
        try:
            values = list(vars(module).values())
        except TypeError:
            continue
        for value in values:
            name = originals.get(id(value))
            if name is not None:
                found.setdefault(module_name, set()).add(name)
    for cls in _subclasses(list(classes.values())):
        if _outside(cls.__module__):
            found.setdefault(cls.__module__, set()).add(cls.__qualname__)
    return [f"{m} ({', '.join(sorted(n))})" for m, n in sorted(found.items())]


def _subclasses(classes: list[type]) -> Iterator[type]:
    seen: set[int] = set()
    stack = list(classes)
    while stack:
        subclasses: list[type] = type.__subclasses__(stack.pop())
        for sub in subclasses:
            if id(sub) not in seen and sub.__module__.split(".")[0] != "monai_cache":  # ours and theirs are ours
                seen.add(id(sub))
                stack.append(sub)
                yield sub


def _is_main_process(environ: Any) -> bool:
    """Not a multiprocessing child (a DataLoader worker, spawned or forked), and local rank 0 (or rank 0): torchrun's
    variables, else Slurm's (:func:`monai_cache.launcher.launch_view`)."""
    process = sys.modules.get("multiprocessing.process")
    if process is not None:
        current = process.current_process()
        if getattr(current, "_inheriting", False) or process.parent_process() is not None:
            return False
        if current.name != "MainProcess":
            return False
    from monai_cache.launcher import launch_view

    return launch_view(environ).node_lead


def _monai_version() -> str:
    monai = sys.modules.get("monai")
    return str(getattr(monai, "__version__", "unknown"))


def describe(dataloader: bool = False) -> str:
    """One line: the classes the switch swaps and the MONAI version (what it logs, and ``run --dry-run`` prints).

    Args:
        dataloader: include ``monai.data.DataLoader``.
    """
    names = swapped_names(dataloader)
    data = [n for n, (m, _o) in names.items() if m[-1] == "monai.data"]
    apps = [n for n, (m, _o) in names.items() if m[-1] == "monai.apps"]
    return (
        f"monai_cache switch on (MONAI {_monai_version()}): monai.data.{{{', '.join(data)}}} and "
        f"monai.apps.{{{', '.join(apps)}}} are monai_cache's"
    )


def _announce(names: dict[str, tuple[tuple[str, ...], str]]) -> None:
    import logging

    logger = logging.getLogger("monai_cache.switch")
    if not logger.handlers:  # visible without any logging set up, and once even when the root logs too
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    logger.info(describe("DataLoader" in names))


class _PatchOnImport:
    """A meta-path finder that patches when ``import monai`` finishes (or, if one of our modules was being
    imported then, when it finishes): it wraps the loader of those modules, and removes itself once done."""

    def __init__(self) -> None:
        self._busy: set[str] = set()

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname in self._busy or not (fullname == "monai" or fullname.split(".")[0] == "monai_cache"):
            return None
        self._busy.add(fullname)
        try:
            spec = None
            for finder in sys.meta_path:
                find = getattr(finder, "find_spec", None)
                if finder is self or find is None:
                    continue
                spec = find(fullname, path, target)
                if spec is not None:
                    break
        finally:
            self._busy.discard(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _ThenPatch(spec.loader)
        return spec


class _ThenPatch:
    """Runs a module's own loader, gives the module its loader back, then patches if MONAI is ready."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        module.__loader__ = self.loader
        if module.__spec__ is not None:
            module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        if _State.on and not _State.patched and _State.hook is not None:
            # the import system marks the module initialised only after this returns: ask again for this one
            module.__spec__._initializing = False
            try:
                if _monai_ready():
                    _activate()
            finally:
                module.__spec__._initializing = True

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)
