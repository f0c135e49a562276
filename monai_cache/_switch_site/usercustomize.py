"""Turns the monai_cache switch on where a ``sitecustomize`` earlier on the path ran in place of ours, then runs the
``usercustomize`` it shadows.

A launcher that puts a directory of its own before ours on ``PYTHONPATH``, with a ``sitecustomize.py`` that does not run
the next one, would leave the switch off without a word where the package is not installed (installed, its
``monai_cache_switch.pth`` turned the switch on before any ``sitecustomize``, and this one says nothing). Python imports
``usercustomize`` right after ``sitecustomize`` where the user site is on (not in a virtual environment made without the
system's site packages, nor under ``python -s`` or ``PYTHONNOUSERSITE``): this one then turns the switch on, and says so
on standard error.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from types import ModuleType


def _ours() -> tuple[ModuleType, bool]:
    """``sitecustomize.py`` of this directory, as run at start-up (``sys.modules[NAME]``), or loaded now under that
    name (its start-up part does not run then); and whether it had run."""
    name = "_monai_cache_switch_site"
    module = sys.modules.get(name)
    ran = module is not None
    if module is None or not hasattr(module, "_chain"):
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sitecustomize.py")
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return module, ran


_site, _ran = _ours()
if not _ran:
    _site._switch_on(shadowed_by=getattr(sys.modules.get("sitecustomize"), "__file__", None) or "a sitecustomize")
_site._chain("usercustomize")
