"""``python -m benchmarks report``: runs the suites through the entry point and writes the report (on a stub package
of suites here)."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import subprocess
import sys
import textwrap

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.path.join(REPO, "benchmarks") not in sys.path:
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))  # report imports the harness, as the entry point lets it


def _load_report():
    spec = importlib.util.spec_from_file_location("benchmarks_report", os.path.join(REPO, "benchmarks", "report.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


report_module = _load_report()


def run_report(*args: str, check: int | None = 0) -> subprocess.CompletedProcess:
    """``python -m benchmarks report ARGS`` in this process (no interpreter start-up)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = report_module.main(list(args))
    p = subprocess.CompletedProcess(args, rc, out.getvalue(), err.getvalue())
    if check is not None:
        assert rc == check, (rc, p.stdout, p.stderr)
    return p


_STUBS = {
    "cache": """
        import json, os, sys
        out = sys.argv[sys.argv.index("--out") + 1]
        os.makedirs(out, exist_ok=True)
        rec = lambda cfg, label, e: {"config": cfg, "label": label, "ranks": 1, "workers": 1, "epoch_s": e,
                                      "mem_peak": 300 << 20, "mem_mean": 200 << 20}
        json.dump({"records": [rec("monai", "MONAI", [3, 1, 1]), rec("monai-cache", "ours", [2, 0.5, 0.5])]},
                  open(os.path.join(out, "cache.json"), "w"))
        open(os.path.join(out, "cache.md"), "w").write("### 1 rank(s)\\n\\n| a | b |\\n|---|---|\\n| 1 | 2 |\\n")
        print("cache table")
    """,
    "persistent": """
        import json, os, sys
        out = sys.argv[sys.argv.index("--out") + 1]
        os.makedirs(out, exist_ok=True)
        json.dump({"bytes": {"nii.gz": 100000, "monai": 400000, "ours_default": 90000,
                   "variants": [{"variant": "zstd-3", "bytes": 80000}]}},
                  open(os.path.join(out, "persistent.json"), "w"))
        open(os.path.join(out, "persistent.md"), "w").write("### Bytes on disk per item\\n")
    """,
    "sampler": """
        import os, sys
        out = sys.argv[sys.argv.index("--out") + 1]
        os.makedirs(out, exist_ok=True)
        open(os.path.join(out, "sampler.md"), "w").write("### sampler benchmark\\n\\n| kind | hit rate |\\n")
    """,
    "scale": """
        import json, os, sys
        out = sys.argv[sys.argv.index("--out") + 1]
        os.makedirs(out, exist_ok=True)
        json.dump({"rows": [], "large": []}, open(os.path.join(out, "scale.json"), "w"))
        open(os.path.join(out, "scale.md"), "w").write("| dataset | items |\\n|---|---:|\\n| ours-cache | 2,000 |\\n")
        import matplotlib; matplotlib.use("Agg"); import matplotlib.pyplot as plt
        plt.plot([1, 2]); plt.savefig(os.path.join(out, "bench_scale.png"))
    """,
    "smartcache": """
        import os, sys
        out = sys.argv[sys.argv.index("--out") + 1]
        os.makedirs(out, exist_ok=True)
        open(os.path.join(out, "smartcache.md"), "w").write("| smart | epoch |\\n|---|---:|\\n| ours | 1 |\\n")
    """,
    "tiers": """
        import os, sys
        out = sys.argv[sys.argv.index("--out") + 1]
        os.makedirs(out, exist_ok=True)
        open(os.path.join(out, "tiers.md"), "w").write("### restart\\n\\n| tier | first batch |\\n")
    """,
    "restart": """
        import os, sys
        out = sys.argv[sys.argv.index("--out") + 1]
        os.makedirs(out, exist_ok=True)
        table = "8 volumes\\n| | crash -> first batch after the restart, s |\\n|---|---:|\\n| monai_cache | 2.00 |\\n"
        open(os.path.join(out, "restart.md"), "w").write(table)
    """,
    "switch": """
        import os, sys
        out = sys.argv[sys.argv.index("--out") + 1]
        os.makedirs(out, exist_ok=True)
        table = "| | stock | switch |\\n|---|---:|---:|\\n| warm | 1 |\\n"
        open(os.path.join(out, "switch.md"), "w").write(table)
    """,
    "warm": """
        import os, sys
        if "--quick" not in sys.argv:
            sys.exit("the report's --quick must run warm --quick")
        out = sys.argv[sys.argv.index("--out") + 1]
        os.makedirs(out, exist_ok=True)
        table = "### volumes, 1 rank(s) x 2 worker(s)\\n\\n```text\\nmode  dataset + loader  epoch 1\\n```\\n"
        open(os.path.join(out, "warm.md"), "w").write(table)
    """,
}


def test_bench_runs_the_scripts_and_writes_the_report(tmp_path):
    pytest.importorskip("matplotlib")
    stubs = tmp_path / "benchmarks"  # a package like benchmarks/: its entry point runs the suite named first
    stubs.mkdir()
    (stubs / "__init__.py").write_text("")
    (stubs / "__main__.py").write_text(textwrap.dedent("""
        import runpy, sys, os
        suite = sys.argv.pop(1)
        assert os.getcwd() == os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "run from the root"
        runpy.run_path(os.path.join(os.path.dirname(__file__), "suite_" + suite + ".py"), run_name="__main__")
    """))
    for name, code in _STUBS.items():
        (stubs / f"suite_{name}.py").write_text(textwrap.dedent(code))
    docs = tmp_path / "docs"
    p = run_report("--quick", "--benchmarks-dir", str(stubs), "--docs-dir", str(docs), "--json")
    summary = json.loads(p.stdout)  # --json: nothing else on stdout
    assert summary["failed"] == []
    assert set(summary["benchmarks"]) == {
        "cache", "persistent", "sampler", "scale", "warm", "smartcache", "tiers", "restart", "switch"
    }
    assert summary["machine"]["cpus"] and summary["machine"]["ram_bytes"]
    report = (docs / "benchmarks.md").read_text()
    assert "**Machine:**" in report and "load average" in report and "CPU cores" in report
    assert "| 1 | 2 |" in report and "### sampler benchmark" in report and "Bytes on disk per item" in report
    assert "| ours-cache | 2,000 |" in report and "| ours | 1 |" in report and "### restart" in report
    assert "| monai_cache | 2.00 |" in report and "`python -m benchmarks restart`" in report
    assert "Command: `python -m benchmarks warm --quick --settings 1x2`" in report  # no temporary --out
    assert "### volumes, 1 rank(s) x 2 worker(s)" in report and "mode  dataset + loader  epoch 1" in report
    assert "segresnet" in report and "| | stock | switch |" in report
    for png in ("bench_epochs.png", "bench_memory.png", "bench_disk.png", "bench_scale.png"):
        assert (docs / "img" / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"img/{png}" in report


def test_bench_without_scripts_exits_2(tmp_path):
    p = run_report("--benchmarks-dir", str(tmp_path), check=2)
    assert "--benchmarks-dir" in p.stderr and "no benchmarks package" in p.stderr
    assert run_report("--only", "nonsense", check=2).stderr.startswith("report.py: unknown")


def test_bench_finds_its_own_scripts():
    assert report_module.find_benchmarks() == __import__("pathlib").Path(REPO, "benchmarks").resolve()
