"""Fixtures of the reliability suite (the project-wide ones, ``shm_dir`` among them, are in tests/conftest.py)."""

from __future__ import annotations

import os

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Forked ranks, workers and writers compute with one thread: OpenMP pools do not survive fork, and the
    items here are small (thread hand-offs would cost more than the work on a shared 2-core machine)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def public_shm_dir(shm_dir):
    """``shm_dir`` with /dev/shm's own mode (1777: everyone may create entries, only owners may remove them)."""
    os.chmod(shm_dir, 0o1777)
    return shm_dir
