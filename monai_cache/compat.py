"""What differs between the MONAI versions monai_cache supports (1.3 to 1.7), in one place.

The datasets ask this module, never ``monai.__version__`` themselves. Everything here was read in the code of each
release (``monai/data/dataset.py``) and checked by the drop-in tests, which CI runs on the oldest supported MONAI and
on monai-weekly as well as on the current release (``docs/compatibility.md`` has the table).
"""

from __future__ import annotations

import re
import warnings
from typing import Any

__all__ = [
    "MONAI_VERSION",
    "PERSISTENT_ACCEPTS_TRACK_META",
    "PERSISTENT_CONVERTS_STORED",
    "PERSISTENT_TRACK_META_DEFAULT",
    "SUPPORTED",
    "persistent_init_kwargs",
    "to_stored_form",
    "version_tuple",
]

SUPPORTED = ((1, 3), (1, 7))
"""The oldest and newest MONAI minor versions monai_cache is tested with (``setup.cfg`` says ``>=1.3,<1.8``)."""


def version_tuple(version: str) -> tuple[int, int]:
    """``"1.7.dev2643"`` -> ``(1, 7)``; ``"1.3.0+12.gabc"`` -> ``(1, 3)``; ``"1.10rc1"`` -> ``(1, 10)``; anything
    else -> ``(0, 0)``."""
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match.group(1)), int(match.group(2))) if match else (0, 0)


def _installed() -> tuple[int, int]:
    try:
        import monai
    except ImportError:
        raise ImportError(
            "monai_cache needs MONAI 1.3 to 1.7, which is not installed: pip install 'monai>=1.3,<1.8' "
            "(or pip install 'monai_cache[monai]'; monai-weekly works too)"
        ) from None
    found = version_tuple(str(monai.__version__))
    if found < SUPPORTED[0]:
        raise ImportError(
            f"monai_cache needs MONAI 1.3 or newer; this environment has MONAI {monai.__version__}. "
            "Upgrade it: pip install 'monai>=1.3,<1.8'"
        )
    if found > SUPPORTED[1]:
        warnings.warn(
            f"monai_cache is tested with MONAI 1.3 to 1.7; this environment has MONAI {monai.__version__}. "
            "If a dataset does not behave as MONAI's, please report it.",
            stacklevel=3,
        )
    return found


MONAI_VERSION = _installed()
"""The installed MONAI's ``(major, minor)``."""

PERSISTENT_ACCEPTS_TRACK_META = MONAI_VERSION >= (1, 6)
"""``PersistentDataset.__init__`` takes ``track_meta`` and ``weights_only`` (MONAI 1.6.0, PR #8566)."""

PERSISTENT_CONVERTS_STORED = MONAI_VERSION >= (1, 5)
"""MONAI's ``PersistentDataset`` stores ``convert_to_tensor(item, convert_numeric=False)``: plain tensors, no metadata,
so a cache hit returns plain tensors (1.5.0). Before, it stored the item as computed (``MetaTensor`` objects with
their metadata, NumPy arrays as they were), and a hit gave that back."""

PERSISTENT_TRACK_META_DEFAULT: bool | None = False if PERSISTENT_CONVERTS_STORED else None
"""Our ``PersistentDataset``'s default ``track_meta``: what the installed MONAI's class stores. ``False`` (plain
tensors) from MONAI 1.5 on; ``None`` (the item as computed) with MONAI 1.3 and 1.4."""


def persistent_init_kwargs(track_meta: bool | None, weights_only: bool) -> dict[str, Any]:
    """The keyword arguments for MONAI's ``PersistentDataset.__init__`` that the installed version accepts."""
    if PERSISTENT_ACCEPTS_TRACK_META:
        return {"track_meta": bool(track_meta), "weights_only": weights_only}
    return {}


def to_stored_form(item: Any, track_meta: bool) -> Any:
    """``convert_to_tensor(item, convert_numeric=False, track_meta=track_meta)``: what MONAI 1.6's
    ``PersistentDataset`` stores. MONAI before 1.5 has no ``convert_numeric`` (its ``convert_to_tensor`` turns Python
    numbers into tensors too), so there the containers are walked here and numbers left as they are."""
    from monai.utils import convert_to_tensor

    if PERSISTENT_CONVERTS_STORED:
        return convert_to_tensor(item, convert_numeric=False, track_meta=track_meta)
    if isinstance(item, (bool, int, float)):
        return item
    if isinstance(item, dict):
        return {k: to_stored_form(v, track_meta) for k, v in item.items()}
    if isinstance(item, (list, tuple)):
        converted = [to_stored_form(v, track_meta) for v in item]
        return converted if isinstance(item, list) else tuple(converted)
    return convert_to_tensor(item, track_meta=track_meta)
