"""Turns the monai_cache switch on at interpreter start-up, then runs the ``sitecustomize`` it shadows.

``monai-cache run`` (and ``monai_cache.install()``, for its children) put this directory on ``PYTHONPATH`` and set
``MONAI_CACHE_SWITCH``. Only :mod:`monai_cache.switch` is imported here (no torch, no MONAI): it patches when the
process imports MONAI, if ever. Errors never stop the interpreter: the process runs without the switch.
"""

import os
import sys


def _switch_on() -> None:
    if os.environ.get("MONAI_CACHE_SWITCH", "").strip().lower() in ("", "0", "false", "off", "no"):
        return
    try:
        from monai_cache import switch

        switch.install()
    except Exception as e:  # start-up must go on
        # e.g. this interpreter finds another monai_cache (an older one) than the one that set up the switch
        print(f"monai_cache switch: not turned on in this process ({sys.executable}): {e!r}", file=sys.stderr)


def _chain() -> None:
    """Run the next ``sitecustomize`` on the path after this one's directory (a distribution's, a virtual
    environment's), as if this one were not there.

    Only the entries after ours are searched, and only they are on ``sys.path`` while it runs: one before ours
    (a launcher prepended it) ran first, and ran this one by chaining to what follows it; found again, it would
    run twice. Ours not on the path at all (loaded some other way): every entry but ours.
    """
    here = os.path.dirname(os.path.abspath(__file__))
    entries = [os.path.abspath(p or os.curdir) for p in sys.path]
    after = entries.index(here) + 1 if here in entries else 0
    this = sys.modules.pop("sitecustomize", None)
    saved = list(sys.path)
    sys.path[:] = [p for p, e in zip(saved[after:], entries[after:]) if e != here]
    try:
        import sitecustomize  # noqa: F401 - the shadowed one
    except ImportError as e:
        if e.name != "sitecustomize":
            raise
    finally:
        sys.path[:] = saved
        if "sitecustomize" not in sys.modules and this is not None:
            sys.modules["sitecustomize"] = this


_switch_on()
_chain()
