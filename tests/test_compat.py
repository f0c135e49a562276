"""The MONAI version check (``monai_cache/compat.py``) and the declared range.

The check runs when monai_cache's datasets are imported: before 1.3 it stops with an error that names the range
and the command to run; after 1.7 it warns; without MONAI it says how to install it. Each case imports
``monai_cache.compat`` in a fresh interpreter whose ``monai`` is a one-line package giving only a version: the
check reads nothing else. (The drop-in tests run the real thing on MONAI 1.3.0, the current release and
monai-weekly: ``.ci/run``.)
"""

from __future__ import annotations

import configparser
import os
import subprocess
import sys

import pytest

import monai_cache
from monai_cache import compat

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize(
    "text, expected",
    [("1.3.0", (1, 3)), ("1.7.dev2643", (1, 7)), ("1.6.1+3.gabcdef", (1, 6)), ("1.10rc1", (1, 10)), ("dev", (0, 0))],
)
def test_version_tuple(text, expected):
    assert compat.version_tuple(text) == expected


def import_compat_with_monai(tmp_path, version: str | None) -> subprocess.CompletedProcess:
    if version is not None:
        package = tmp_path / "monai"
        package.mkdir()
        (package / "__init__.py").write_text(f"__version__ = {version!r}\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), REPO])}
    code = "import warnings; warnings.simplefilter('always'); import monai_cache.compat as c; print(c.MONAI_VERSION)"
    # -S: no site-packages, so the installed MONAI is not found (the package is found through PYTHONPATH)
    return subprocess.run([sys.executable, "-S", "-c", code], env=env, capture_output=True, text=True, timeout=60)


def test_an_older_monai_is_refused_with_the_range_and_the_command(tmp_path):
    result = import_compat_with_monai(tmp_path, "1.2.0")
    assert result.returncode != 0
    assert "ImportError: monai_cache needs MONAI 1.3 or newer; this environment has MONAI 1.2.0" in result.stderr
    assert "pip install 'monai>=1.3,<1.8'" in result.stderr


def test_a_newer_monai_is_used_with_a_warning(tmp_path):
    result = import_compat_with_monai(tmp_path, "1.8.0")
    assert result.returncode == 0 and result.stdout.strip() == "(1, 8)"
    assert "monai_cache is tested with MONAI 1.3 to 1.7; this environment has MONAI 1.8.0" in result.stderr


def test_no_monai_says_how_to_install_it(tmp_path):
    result = import_compat_with_monai(tmp_path, None)
    assert result.returncode != 0
    assert "monai_cache needs MONAI 1.3 to 1.7, which is not installed" in result.stderr
    assert "monai_cache[monai]" in result.stderr


def test_the_declared_range_is_the_checked_one_and_monai_is_not_an_install_requirement():
    """pip must leave the user's MONAI alone (monai-weekly is another distribution holding the same package), and
    the ``monai`` extra must name the range that compat checks."""
    config = configparser.ConfigParser()
    config.read(os.path.join(REPO, "setup.cfg"))
    requires = [line.strip() for line in config["options"]["install_requires"].splitlines() if line.strip()]
    assert not [r for r in requires if r.split(">")[0].split("=")[0].split("<")[0].strip() == "monai"]
    extra = [line.strip() for line in config["options.extras_require"]["monai"].splitlines() if line.strip()]
    (low, high) = compat.SUPPORTED
    assert extra == [f"monai>={low[0]}.{low[1]},<{high[0]}.{high[1] + 1}"]
    assert compat.SUPPORTED[0] <= compat.MONAI_VERSION  # this environment is in it
    assert monai_cache.__version__
