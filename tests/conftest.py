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
