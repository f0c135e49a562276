"""The soak run (benchmarks/soak.py) in its short form: 2 ranks x 2 DataLoader workers, a few epochs of tiny
items through both caches; nothing may grow after the first epoch and nothing may be left behind.

The CI form runs fork with persistent workers on and off, and spawn with persistent workers (spawn without
persistent workers starts two fresh interpreters per rank per epoch, each importing torch and MONAI: that
configuration is in the long form). ``MONAI_CACHE_SOAK_ARGS`` replaces the arguments, e.g. the long form::

    MONAI_CACHE_SOAK_ARGS="--epochs 20 --items 64 --item-kb 1024" pytest tests/reliability/test_soak.py
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

from ._harness import Tally

SOAK = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "soak.py")
SHORT = "--epochs 3 --items 16 --item-kb 16 --configs fork/on,fork/off,spawn/on"


def test_soak_short_form(tmp_path):
    out = str(tmp_path / "soak.json")
    args = shlex.split(os.environ.get("MONAI_CACHE_SOAK_ARGS") or SHORT)
    cmd = [sys.executable, SOAK, *args, "--private-shm", "--json", out, "--timeout", "3000"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    summary: dict = {}
    if os.path.exists(out):  # written at the end of the run, also when it failed
        with open(out) as f:
            summary = json.load(f)["summary"]
    t = Tally("soak")
    t.check(r.returncode == 0, (r.stdout[-6000:], r.stderr[-6000:]))
    t.check(summary.get("ok") and summary["failures"] == [], summary.get("failures"))
    t.check(summary.get("items_checked", 0) > 0 and summary.get("wrong_items") == 0, summary)
    t.check(summary.get("shm_bytes_left") == 0 and summary.get("temp_files_left") == 0, summary)
    growth = summary.get("max_growth", {})
    t.check(growth.get("fds", 1) <= 0 and growth.get("threads", 1) <= 0, growth)
    t.record(**{k: summary.get(k) for k in (
        "epochs", "items", "item_kb", "ranks", "workers", "configs", "private_shm", "items_checked", "wrong_items",
        "max_growth", "shm_bytes_left", "shm_files_left", "new_in_dev_shm", "temp_files_left", "seconds")},
        soak_failures=len(summary.get("failures", [])), exit_code=r.returncode)
    t.assert_clean()
