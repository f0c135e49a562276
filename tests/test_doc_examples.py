"""Every Python example in README.md and docs/*.md runs, so a documented example that does not work fails CI.

Each fenced ```` ```python ```` block is an example. By default it is a complete program: it runs in a namespace
of its own (as ``__main__``) and a fresh temporary working directory, and must finish without an exception.
Examples that need data make small synthetic CT-like volumes with ``monai_cache.synthetic.make_dataset`` under
the working directory. All plain examples run one after another in one subprocess (importing torch and MONAI
once), with a private shared-memory directory.

An HTML comment on the line before the fence (invisible on the rendered site) changes how the block is run:

- ``<!-- example: run as: COMMAND -->``: the block is a script, written to the ``.py`` file that ``COMMAND``
  names and run with that command in a fresh directory: ``python train.py`` (a script that starts its own
  processes, e.g. Lightning's launcher) or ``torchrun --nproc-per-node=2 train.py`` (run as
  ``python -m torch.distributed.run``, on CPU with gloo). The launcher variables of the test's own environment
  are removed first, so the script sees only what its launcher sets.
- ``<!-- example: continues -->``: the block goes on from the block before it in the same file (same namespace
  and directory). Prefer complete examples.
- ``<!-- example: skip, REASON -->``: not run here; REASON (required) says why, e.g. it needs several machines
  or a GPU.

A failing example fails the test named after its file and line (``docs/x.md:12``); tracebacks name the Markdown
file and line, also for scripts (their leading blank lines keep the line numbers of the Markdown file).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import free_port

REPO = Path(__file__).resolve().parents[1]
RUNNER = REPO / "tests" / "_scripts" / "run_doc_examples.py"
DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
TIMEOUT_S = 600
# set by launchers (and by this package for node identity); a documented script must get only its launcher's
_LAUNCHER_VARS = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT",
    "MONAI_CACHE_NODE_ID", "TORCHELASTIC_RUN_ID",
)  # fmt: skip

_FENCE = re.compile(r"^(\s*)```python\s*$")
_MARK = re.compile(r"^\s*<!--\s*example:\s*(.*?)\s*-->\s*$")

pytestmark = pytest.mark.slow


@dataclass
class Example:
    file: str  # relative to the repository
    fence_line: int  # 1-based line of the opening fence; the code starts on the next line
    code: str
    mode: str = "run"  # "run", "continues", "command" or "skip"
    command: str = ""
    reason: str = ""
    error: str = ""  # a malformed marker

    @property
    def id(self) -> str:
        return f"{self.file}:{self.fence_line}"


def _parse_marker(text: str, example: Example) -> None:
    if text == "continues":
        example.mode = "continues"
    elif text.startswith("skip"):
        example.mode, example.reason = "skip", text[len("skip") :].lstrip(" ,:").strip()
        if not example.reason:
            example.error = "a skipped example needs a reason: <!-- example: skip, REASON -->"
    elif text.startswith("run as:"):
        example.mode, example.command = "command", text[len("run as:") :].strip()
        argv = shlex.split(example.command)
        if not argv or argv[0] not in ("python", "torchrun") or not any(a.endswith(".py") for a in argv):
            example.error = f"'run as:' takes `python FILE.py ...` or `torchrun ... FILE.py`, got {example.command!r}"
    else:
        example.error = f"unknown example marker {text!r} (use 'skip, REASON', 'continues' or 'run as: COMMAND')"


def extract_examples(path: Path) -> list[Example]:
    """The ```` ```python ```` blocks of a Markdown file, with the marker of the line before each, in order."""
    lines = path.read_text().splitlines()
    rel = str(path.relative_to(REPO)) if path.is_relative_to(REPO) else path.name
    examples = []
    marked_at: dict[int, str] = {}  # line index of a marker -> its text
    for i, line in enumerate(lines):
        if m := _MARK.match(line):
            marked_at[i] = m.group(1)
            nxt = next((j for j in range(i + 1, len(lines)) if lines[j].strip()), None)
            if nxt is None or not _FENCE.match(lines[nxt]):
                examples.append(Example(rel, i + 1, "", error="an example marker must come right before a ```python"))
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, end = m.group(1), i + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        body = [ln[len(indent) :] if ln.startswith(indent) else ln.lstrip() for ln in lines[i + 1 : end]]
        example = Example(rel, i + 1, "\n".join(body) + "\n")
        if end == len(lines):
            example.error = "the ```python block is not closed"
        prev = next((j for j in range(i - 1, -1, -1) if lines[j].strip()), None)
        if prev in marked_at:
            _parse_marker(marked_at[prev], example)
        examples.append(example)
        i = end + 1
    return examples


EXAMPLES = [e for doc in DOCUMENTS for e in extract_examples(doc)]


def test_examples_were_found():
    # the README and the pages with code: a parser that finds nothing would make every other test vacuous
    files = {e.file for e in EXAMPLES}
    assert {"README.md", "docs/index.md", "docs/distributed.md", "docs/sampler.md"} <= files, files
    assert any(e.mode == "command" and e.command.startswith("torchrun") for e in EXAMPLES)


def _runner_input(examples: list[Example]) -> str:
    """The examples as tests/_scripts/run_doc_examples.py reads them."""
    return json.dumps([{"id": e.id, "file": e.file, "fence_line": e.fence_line, "code": e.code,
                        "continues": e.mode == "continues"} for e in examples])  # fmt: skip


def test_markers_and_failures_name_the_file_and_line(tmp_path):
    """The conventions above, on a small Markdown file: markers, continuing blocks, a failure's file and line."""
    doc = tmp_path / "page.md"
    doc.write_text(
        "Text.\n\n```python\nx = 1\n```\n\n<!-- example: continues -->\n```python\ny = x + 1\nassert y == 3\n```\n"
        "- item\n\n    <!-- example: run as: torchrun --nproc-per-node=2 train.py -->\n"
        "    ```python\n    import os\n    ```\n"
        "<!-- example: skip -->\n```python\npass\n```\n<!-- example: maybe -->\n```python\npass\n```\n"
        "<!-- example: continues -->\ntext\n"
    )  # fmt: skip
    found = extract_examples(doc)
    assert [(e.fence_line, e.mode, e.command) for e in found] == [
        (26, "run", ""), (3, "run", ""), (8, "continues", ""),
        (15, "command", "torchrun --nproc-per-node=2 train.py"), (19, "skip", ""), (23, "run", ""),
    ]  # fmt: skip
    assert found[3].code == "import os\n"  # an indented block loses its indentation
    assert "must come right before" in found[0].error and "needs a reason" in found[4].error
    assert "unknown example marker 'maybe'" in found[5].error
    (tmp_path / "examples.json").write_text(_runner_input(found[1:3]))
    subprocess.run([sys.executable, str(RUNNER), "examples.json", "results.json"], cwd=tmp_path, check=True,
                   capture_output=True)  # fmt: skip
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["page.md:3"] is None  # the continuing block saw x, and failed on its own line
    assert 'File "page.md", line 10' in results["page.md:8"] and "AssertionError" in results["page.md:8"]


def _environment(shm_dir: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS}
    env.update(
        OMP_NUM_THREADS="1",
        MONAI_CACHE_SHM_DIR=shm_dir,
        PET_MASTER_PORT=str(free_port()),  # torchrun's --master-port (default 29500 may be taken)
        PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        PYTHONWARNINGS="ignore::FutureWarning,ignore::DeprecationWarning",
    )
    return env


@dataclass
class Run:
    """A started example run: its process and the files its output goes to (pipes could fill and stall it)."""

    process: subprocess.Popen
    log: Path
    workdir: Path

    def wait(self) -> tuple[int, str]:
        try:
            code = self.process.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            code = self.process.wait()
        return code, self.log.read_text(errors="replace")


def _start(argv: list[str], workdir: Path, shm_dir: str) -> Run:
    log = workdir / "output.log"
    with open(log, "w") as out:
        process = subprocess.Popen(argv, cwd=workdir, env=_environment(shm_dir), stdout=out, stderr=subprocess.STDOUT)
    return Run(process, log, workdir)


@dataclass
class Runs:
    """Every run, started at once: one process for all plain examples, one launch per ``run as:`` example, in a
    temporary directory and a shared-memory directory of their own. ``started`` maps an example id, or "plain",
    to its run."""

    work: Path
    shm_dir: str
    started: dict[str, Run]

    @classmethod
    def start(cls) -> Runs:
        work = Path(tempfile.mkdtemp(prefix="mc-test-doc-"))
        shm_dir = f"/dev/shm/mc-test-doc-{uuid.uuid4().hex[:12]}"
        os.makedirs(shm_dir)
        runs = cls(work, shm_dir, {})
        plain = [e for e in EXAMPLES if e.mode in ("run", "continues") and not e.error]
        (work / "plain").mkdir()
        (work / "plain" / "examples.json").write_text(_runner_input(plain))
        runs.started["plain"] = _start([sys.executable, str(RUNNER), "examples.json", "results.json"], work / "plain",
                                       shm_dir)  # fmt: skip
        for number, example in enumerate(EXAMPLES):
            if example.mode != "command" or example.error:
                continue
            script_dir = work / f"script{number}"
            script_dir.mkdir()
            argv = shlex.split(example.command)
            script = next(a for a in argv if a.endswith(".py"))
            (script_dir / script).write_text("\n" * example.fence_line + example.code)  # lines of the Markdown file
            launcher = [sys.executable] if argv[0] == "python" else [sys.executable, "-m", "torch.distributed.run"]
            runs.started[example.id] = _start(launcher + argv[1:], script_dir, shm_dir)
        return runs

    def stop(self) -> None:
        """Kill what still runs, remove the directories."""
        for run in self.started.values():
            if run.process.poll() is None:
                run.process.kill()
            run.process.wait()
        shutil.rmtree(self.work, ignore_errors=True)
        shutil.rmtree(self.shm_dir, ignore_errors=True)


# Started by tests/conftest.py as soon as the tests of this file are collected, so that they run beside the tests
# before this file (most of which leave a core idle) rather than after them; else by the fixture below.
EARLY: Runs | None = None


@pytest.fixture(scope="module")
def runs():
    """{example id or "plain": Run}. The runs overlap (most of their time is spent importing torch, MONAI and
    Lightning in separate processes), so the whole file takes about as long as its longest example."""
    global EARLY
    started, EARLY = EARLY or Runs.start(), None
    yield started.started
    started.stop()


@pytest.fixture(scope="module")
def plain_results(runs) -> tuple[dict[str, str | None], str]:
    """{id: None or traceback} of the plain examples, and the tail of the runner's output."""
    code, log = runs["plain"].wait()
    results_file = runs["plain"].workdir / "results.json"
    if code != 0 or not results_file.exists():
        pytest.fail(f"the example runner itself failed (exit {code}):\n{log[-5000:]}")
    return json.loads(results_file.read_text()), log[-3000:]


@pytest.mark.parametrize("example", EXAMPLES, ids=[e.id for e in EXAMPLES])
def test_documented_example_runs(example: Example, runs, plain_results):
    if example.error:
        pytest.fail(f"{example.id}: {example.error}")
    if example.mode == "skip":
        pytest.skip(f"{example.id}: marked in the docs: {example.reason}")
    if re.search(r"^\s*(import|from) lightning\b", example.code, re.M) and not importlib.util.find_spec("lightning"):
        pytest.skip("lightning is not installed (it is in the test extras: pip install -e '.[test]')")
    if example.mode == "command":
        code, log = runs[example.id].wait()
        assert code == 0, (
            f"{example.id}: the example, run as `{example.command}`, exited with {code} (line numbers in the "
            f"script are those of {example.file}):\n{log[-6000:]}"
        )
        return
    results, log = plain_results
    error = results.get(example.id, "the runner did not report it")
    assert error is None, f"{example.id}: the example failed:\n{error}\nrunner output (tail):\n{log}"


def test_lightning_example_shares_one_cache_between_two_ddp_ranks(runs):
    """The Lightning example of docs/distributed.md, started with ``python train.py`` as written: Lightning
    starts the second rank (without LOCAL_WORLD_SIZE), and ``shard_by="node"`` finds both ranks on this machine."""
    if not importlib.util.find_spec("lightning"):
        pytest.skip("lightning is not installed (it is in the test extras: pip install -e '.[test]')")
    (example,) = [e for e in EXAMPLES if e.file == "docs/distributed.md" and e.command == "python train.py"]
    assert 'strategy="ddp", accelerator="cpu", devices=2' in example.code
    code, out = runs[example.id].wait()
    assert code == 0, out[-5000:]
    assert "GLOBAL_RANK: 1, MEMBER: 2/2" in out  # Lightning's launcher started the second process
    epochs = re.findall(r"epoch (\d+): cache hits (\d+), misses (\d+)", out)
    assert [int(e) for e, _, _ in epochs] == [0, 1, 2], out[-3000:]
    # both ranks' reads of the last two epochs (2 x 8 items) hit the cache the first epoch filled, each item
    # computed once on the machine: the two ranks shared one node shard and one cache
    assert epochs[-1][1:] == ("16", "8"), out[-3000:]
