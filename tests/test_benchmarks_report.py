"""``python benchmarks/report.py``: runs the benchmark scripts and writes the report (on stub scripts here)."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import subprocess
import textwrap

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load_report():
    spec = importlib.util.spec_from_file_location("benchmarks_report", os.path.join(REPO, "benchmarks", "report.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


report_module = _load_report()


def run_report(*args: str, check: int | None = 0) -> subprocess.CompletedProcess:
    """``python benchmarks/report.py ARGS`` in this process (no interpreter start-up)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = report_module.main(list(args))
    p = subprocess.CompletedProcess(args, rc, out.getvalue(), err.getvalue())
    if check is not None:
        assert rc == check, (rc, p.stdout, p.stderr)
    return p


_STUBS = {
    "bench_cache.py": """
        import json, os, sys
        out = sys.argv[sys.argv.index("--out") + 1]
        os.makedirs(out, exist_ok=True)
        rec = lambda cfg, label, e: {"config": cfg, "label": label, "ranks": 1, "workers": 1, "epoch_s": e,
                                      "mem_peak": 300 << 20, "mem_mean": 200 << 20}
        json.dump({"records": [rec("monai", "MONAI", [3, 1, 1]), rec("monai-cache", "ours", [2, 0.5, 0.5])]},
                  open(os.path.join(out, "bench.json"), "w"))
        open(os.path.join(out, "bench.md"), "w").write("### 1 rank(s)\\n\\n| a | b |\\n|---|---|\\n| 1 | 2 |\\n")
        print("cache table")
    """,
    "bench_persistent.py": """
        import json, sys
        json.dump({"bytes": {"nii.gz": 100000, "monai": 400000, "ours_default": 90000,
                   "variants": [{"variant": "zstd-3", "bytes": 80000}]}},
                  open(sys.argv[sys.argv.index("--json") + 1], "w"))
        print("## Bytes on disk per item")
    """,
    "bench_sampler.py": """
        print("# sampler benchmark")
        print("| kind | hit rate |")
        print("|---|---|")
        print("| ours | 100% |")
    """,
    "bench_scale.py": """
        import json, os, sys
        out = sys.argv[sys.argv.index("--out") + 1]
        os.makedirs(out, exist_ok=True)
        json.dump({"rows": [], "large": []}, open(os.path.join(out, "bench_scale.json"), "w"))
        open(os.path.join(out, "report.md"), "w").write("| dataset | items |\\n|---|---:|\\n| ours-cache | 2,000 |\\n")
        import matplotlib; matplotlib.use("Agg"); import matplotlib.pyplot as plt
        plt.plot([1, 2]); plt.savefig(os.path.join(out, "bench_scale.png"))
    """,
    "bench_smartcache.py": """
        import os, sys
        out = sys.argv[sys.argv.index("--out") + 1]
        os.makedirs(out, exist_ok=True)
        open(os.path.join(out, "bench_smartcache.md"), "w").write("| smart | epoch |\\n|---|---:|\\n| ours | 1 |\\n")
    """,
    "bench_tiers.py": """
        import os, sys
        out = sys.argv[sys.argv.index("--out") + 1]
        os.makedirs(out, exist_ok=True)
        open(os.path.join(out, "bench_tiers.md"), "w").write("# restart\\n\\n| tier | first batch |\\n")
    """,
    "bench_restart.py": """
        print("# 8 volumes")
        print("| | crash -> first batch after the restart, s |")
        print("|---|---:|")
        print("| monai_cache | 2.00 |")
    """,
    "bench_switch.py": """
        import os, sys
        out = sys.argv[sys.argv.index("--out") + 1]
        os.makedirs(out, exist_ok=True)
        table = "| | stock | switch |\\n|---|---:|---:|\\n| warm | 1 |\\n"
        open(os.path.join(out, "bench_switch.md"), "w").write(table)
    """,
    "bench_loader.py": """
        import json, os, sys
        if "--quick" not in sys.argv:
            sys.exit("the report's --quick must run bench_loader.py --quick")
        out = sys.argv[sys.argv.index("--out") + 1]
        os.makedirs(out, exist_ok=True)
        json.dump({"summary": {}, "records": []}, open(os.path.join(out, "bench_loader.json"), "w"))
        table = "### 2 rank(s) x 1 worker(s)\\n\\n| | monai | ours+ours |\\n"
        open(os.path.join(out, "bench_loader.md"), "w").write(table)
        import matplotlib; matplotlib.use("Agg"); import matplotlib.pyplot as plt
        plt.plot([1, 2]); plt.savefig(os.path.join(out, "bench_loader.png"))
    """,
}


def test_bench_runs_the_scripts_and_writes_the_report(tmp_path):
    pytest.importorskip("matplotlib")
    stubs = tmp_path / "benchmarks"
    stubs.mkdir()
    for name, code in _STUBS.items():
        (stubs / name).write_text(textwrap.dedent(code))
    docs = tmp_path / "docs"
    p = run_report("--quick", "--benchmarks-dir", str(stubs), "--docs-dir", str(docs), "--json")
    summary = json.loads(p.stdout)  # --json: nothing else on stdout
    assert summary["failed"] == []
    assert set(summary["benchmarks"]) == {
        "cache", "persistent", "sampler", "scale", "loader", "smartcache", "tiers", "restart", "switch"
    }
    assert summary["machine"]["cpus"] and summary["machine"]["ram_bytes"]
    report = (docs / "benchmarks.md").read_text()
    assert "**Machine:**" in report and "load average" in report and "CPU cores" in report
    assert "| 1 | 2 |" in report and "### sampler benchmark" in report and "Bytes on disk per item" in report
    assert "| ours-cache | 2,000 |" in report and "| ours | 1 |" in report and "### restart" in report
    assert "| monai_cache | 2.00 |" in report and "bench_restart.py" in report
    assert "## DataLoader" in report and "| | monai | ours+ours |" in report
    assert "segresnet" in report and "| | stock | switch |" in report
    for png in ("bench_epochs.png", "bench_memory.png", "bench_disk.png", "bench_scale.png", "bench_loader.png"):
        assert (docs / "img" / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"img/{png}" in report


def test_bench_without_scripts_exits_2(tmp_path):
    p = run_report("--benchmarks-dir", str(tmp_path), check=2)
    assert "--benchmarks-dir" in p.stderr and "not" in p.stderr
    assert run_report("--only", "nonsense", check=2).stderr.startswith("report.py: unknown")


def test_bench_finds_its_own_scripts():
    assert report_module.find_benchmarks() == __import__("pathlib").Path(REPO, "benchmarks").resolve()
