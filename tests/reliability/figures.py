"""Print the figures of the last reliability run as a Markdown table (for docs/reliability.md).

Each test of the suite appends a JSON line (test name, time, figures) to ``$MONAI_CACHE_RELIABILITY_FIGURES``
(default: ``<tmp>/monai_cache_reliability.jsonl``); this keeps the latest line per test::

    python tests/reliability/figures.py [figures.jsonl]
"""

from __future__ import annotations

import json
import os
import sys
import tempfile


def main() -> None:
    default = os.environ.get("MONAI_CACHE_RELIABILITY_FIGURES") or os.path.join(
        tempfile.gettempdir(), "monai_cache_reliability.jsonl"
    )
    path = sys.argv[1] if len(sys.argv) > 1 else default
    latest: dict[str, dict] = {}
    with open(path) as f:
        for line in f:
            if line.strip():
                rec = json.loads(line)
                latest[rec["test"]] = rec
    print("| test | run at | figures |")
    print("|---|---|---|")
    for name in sorted(latest):
        rec = dict(latest[name])
        when = rec.pop("time")
        rec.pop("test")
        figures = ", ".join(f"{k}: {json.dumps(v) if isinstance(v, (dict, list)) else v}" for k, v in rec.items())
        figures = " ".join(figures.split()).replace("|", "\\|")  # one table row: no line breaks, no bare pipes
        print(f"| {name} | {when} | {figures} |")


if __name__ == "__main__":
    main()
