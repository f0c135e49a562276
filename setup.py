"""Packaging: the metadata is in setup.cfg. This adds ``monai_cache_switch.pth`` to site-packages, beside the package.

Python runs the ``import`` lines of the ``.pth`` files in site-packages at every start, before any
``sitecustomize``, whatever ``PYTHONPATH`` holds: the switch stays on where a launcher puts a ``sitecustomize`` of its
own in front of ours (docs/migrating.md). setuptools puts only packages and modules into a wheel, so:

* a wheel (``pip install .``, ``pip wheel .``): ``build_py`` copies the file to the root of ``build_lib``, which
  becomes the root of the wheel, i.e. site-packages;
* an editable install (``pip install -e .``, PEP 660): setuptools builds the editable wheel from its own ``.pth``
  and import finder only, leaving out what ``build_py`` made; ``editable_wheel`` then adds the file to that wheel,
  and its line to the wheel's ``RECORD`` (so that ``pip uninstall`` removes it).

Needs setuptools 64 or later (PEP 660; pyproject.toml asks for it). An install that does not run this file's
commands (``pip install --target``, whose ``.pth`` files Python does not read, or a repackaging) leaves the switch to
its ``sitecustomize.py`` on ``PYTHONPATH``.
"""

from __future__ import annotations

import base64
import hashlib
import os
import zipfile

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

PTH = "monai_cache_switch.pth"
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), PTH)


class BuildPyWithPth(build_py):
    """``build_py``, and the ``.pth`` at the root of ``build_lib`` (not in editable mode: see
    :class:`EditableWheelWithPth`)."""

    def run(self) -> None:
        super().run()
        if not self.editable_mode:
            self.copy_file(SOURCE, os.path.join(self.build_lib, PTH), preserve_mode=False)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        outputs = list(super().get_outputs(include_bytecode))
        return outputs if self.editable_mode else [*outputs, os.path.join(self.build_lib, PTH)]


class EditableWheelWithPth(editable_wheel):
    """``editable_wheel``, then the ``.pth`` added to the wheel it wrote, with its line in ``RECORD``."""

    def run(self) -> None:
        super().run()
        wheels = [os.path.join(self.dist_dir, n) for n in os.listdir(self.dist_dir) if n.endswith(".whl")]
        if not wheels:
            raise RuntimeError(f"no editable wheel in {self.dist_dir} to add {PTH} to")
        _add_to_wheel(max(wheels, key=os.path.getmtime), PTH, _read(SOURCE))


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _add_to_wheel(wheel: str, name: str, data: bytes) -> None:
    """Rewrite ``wheel`` with ``name`` at its root, listed in its ``RECORD`` (PEP 376/427: urlsafe base64 sha256
    without padding, and the size)."""
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    record_line = f"{name},sha256={digest},{len(data)}\n".encode()
    tmp = wheel + ".tmp"
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
        items = [i for i in src.infolist() if i.filename != name]
        records = [i for i in items if i.filename.endswith(".dist-info/RECORD")]
        if len(records) != 1:
            raise RuntimeError(f"{wheel}: expected one .dist-info/RECORD, found {len(records)}")
        for item in items:
            if item is records[0]:
                continue
            dst.writestr(item, src.read(item))
        dst.writestr(name, data)
        record = b"".join(
            line + b"\n"
            for line in src.read(records[0]).splitlines()
            if line and not line.startswith(name.encode() + b",")
        )
        dst.writestr(records[0], record + record_line)  # RECORD last, as wheels have it
    os.replace(tmp, wheel)


setup(cmdclass={"build_py": BuildPyWithPth, "editable_wheel": EditableWheelWithPth})
