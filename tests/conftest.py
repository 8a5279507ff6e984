"""Fixtures shared by test files."""

from __future__ import annotations

import os
import secrets
import shutil

import pytest


@pytest.fixture
def seg_dir():
    """A private segment directory on /dev/shm's tmpfs (give it to ranks as DISTCOMM_SHM_DIR); it
    must be empty at the end: no segment left behind."""
    path = os.path.join("/dev/shm", f"distcomm-test-{secrets.token_hex(6)}")
    os.mkdir(path, 0o700)
    yield path
    leftovers = os.listdir(path)
    shutil.rmtree(path, ignore_errors=True)
    assert leftovers == [], f"segments left behind: {leftovers}"


# Files that take minutes on one worker: started first, so that the other worker takes the rest of
# the suite meanwhile and both finish together (`make test` gives files to the workers in collection
# order, --no-loadscope-reorder; these would sort near the end).
LONGEST_FIRST = ("test_torch_suite_gloo.py", "test_torch_suite_mpi.py")


def pytest_collection_modifyitems(config, items):
    def rank(item) -> int:
        name = item.path.name
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: every file keeps its own order
