"""Turns the monai_cache switch on at interpreter start-up, then runs the ``sitecustomize`` it shadows.

``monai-cache run`` (and ``monai_cache.install()``, for its children) put this directory on ``PYTHONPATH`` and set
``MONAI_CACHE_SWITCH``. Where the package is installed, ``monai_cache_switch.pth`` in site-packages turned the switch on
already, before any ``sitecustomize``: this one then only runs the one it shadows. It is what turns the switch on in an
interpreter that finds the package on ``PYTHONPATH`` only. Only :mod:`monai_cache.switch` is imported here (no torch, no
MONAI): it patches when the process imports MONAI, if ever. Errors never stop the interpreter: the process runs without
the switch.

Having run, this module is also ``sys.modules[NAME]``: ``usercustomize.py`` beside it, which Python imports next,
then knows that it ran (else a ``sitecustomize`` earlier on the path took its place), and uses its functions.
"""

from __future__ import annotations

import os
import sys

NAME = "_monai_cache_switch_site"


def _switch_on(shadowed_by: str | None = None) -> None:
    """Turn the switch on if ``MONAI_CACHE_SWITCH`` asks for it; ``shadowed_by``: the ``sitecustomize`` that ran in
    this one's place (said on standard error)."""
    if os.environ.get("MONAI_CACHE_SWITCH", "").strip().lower() in ("", "0", "false", "off", "no"):
        return
    done = sys.modules.get("monai_cache.switch")
    if done is not None and done.installed():  # monai_cache_switch.pth turned it on, before any sitecustomize
        return
    if shadowed_by is not None:
        here = os.path.dirname(os.path.abspath(__file__))
        print(
            f"monai_cache switch: {shadowed_by}, earlier on the path, ran at start-up in place of monai_cache's "
            f"sitecustomize.py and did not run it; the switch is turned on from usercustomize.py instead. Make that "
            f"sitecustomize run the next one on the path, or put {here} before it on PYTHONPATH.",
            file=sys.stderr,
        )
    try:
        from monai_cache import switch

        switch.install()
    except Exception as e:  # start-up must go on
        # e.g. this interpreter finds another monai_cache (an older one) than the one that set up the switch
        print(f"monai_cache switch: not turned on in this process ({sys.executable}): {e!r}", file=sys.stderr)


def _chain(name: str = "sitecustomize") -> None:
    """Run the next module ``name`` (``sitecustomize``: a distribution's, a virtual environment's) on the path after
    this one's directory, as if this one were not there.

    Only the entries after ours are searched, and only they are on ``sys.path`` while it runs: one before ours
    (a launcher prepended it) ran first, and ran this one by chaining to what follows it; found again, it would
    run twice. Ours not on the path at all (loaded some other way): every entry but ours.
    """
    here = os.path.dirname(os.path.abspath(__file__))
    entries = [os.path.abspath(p or os.curdir) for p in sys.path]
    after = entries.index(here) + 1 if here in entries else 0
    this = sys.modules.pop(name, None)
    saved = list(sys.path)
    sys.path[:] = [p for p, e in zip(saved[after:], entries[after:]) if e != here]
    try:
        __import__(name)  # the shadowed one
    except ImportError as e:
        if e.name != name:
            raise
    finally:
        sys.path[:] = saved
        if name not in sys.modules and this is not None:
            sys.modules[name] = this


if __name__ == "sitecustomize":  # the start-up hook (usercustomize.py loads this file under NAME, for its functions)
    if sys.modules.get(__name__) is not None:
        sys.modules[NAME] = sys.modules[__name__]
    _switch_on()
    _chain()
