"""Byte sizes (parsing ``"8GiB"``, printing ``1.5 KiB``) and text tables, for the command line and the demo."""

from __future__ import annotations

import re
from collections.abc import Sequence

__all__ = ["format_bytes", "format_table", "parse_bytes"]

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "t": 1000**4, "tb": 1000**4, "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}


def parse_bytes(value: int | float | str | None, name: str = "size") -> int | None:
    """Parse ``8589934592``, ``"8GiB"``, ``"8 GB"`` or ``"512MiB"`` into bytes; ``None`` stays ``None``.

    Raises:
        ValueError: for negative or unparsable sizes, naming the argument.
    """
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a number of bytes or a string like '8GiB', got {value!r}")
    if isinstance(value, (int, float)):
        if value != value or value in (float("inf"), float("-inf")):
            raise ValueError(f"{name} must be a finite number of bytes or a string like '8GiB', got {value!r}")
        n = int(value)
    else:
        m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([a-zA-Z]*)\s*", str(value))
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(f"{name}={value!r} is not a size: use bytes (int) or a string like '512MiB' or '8GB'")
        n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if n < 0:
        raise ValueError(f"{name} must not be negative, got {value!r}")
    return n


def format_bytes(n: float) -> str:
    """``1536`` -> ``'1.5 KiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def format_table(rows: Sequence[Sequence[str]], left: int = 1, markdown: bool = False, rule: bool = False) -> str:
    """Rows of cells as aligned text, or as a Markdown table; the first row is the header.

    Args:
        rows: the header, then the body; every row has as many cells as the header.
        left: how many leading columns are aligned left (the others are aligned right).
        markdown: a Markdown table instead of aligned text.
        rule: a line of dashes under the header (aligned text only).
    """
    if markdown:
        align = ["---"] * left + ["---:"] * (len(rows[0]) - left)
        lines = ["| " + " | ".join(r) + " |" for r in rows]
        return "\n".join([lines[0], "|" + "|".join(align) + "|", *lines[1:]])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    if rule:
        lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(line.rstrip() for line in lines)
