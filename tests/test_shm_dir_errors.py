"""A DISTCOMM_SHM_DIR the shared-memory engine cannot use (missing, a regular file, under a file,
not writable) fails init_process_group with distcomm's error (a DistBackendError), saying what is
wrong with the path and what to do: never a bare OSError, never "does not exist" for a file that
does. Real processes: a world of 1 on the shared-memory engine, and a world of 2 on the default one.
"""

from __future__ import annotations

import os

import pytest

from harness import run_world

TODO = "point DISTCOMM_SHM_DIR at one, or unset it (the default, /dev/shm, is one); or use backend=\"tcp\""


def _init(rank, world_size, backend):
    import distcomm as dist

    try:
        dist.init_process_group(backend)
    except Exception as exc:  # noqa: BLE001 - the test looks at what it is
        return {"classes": [c.__name__ for c in type(exc).__mro__], "message": str(exc)}
    dist.destroy_process_group()
    return None


def _failures(shm_dir, backend="shm", world_size=1):
    return run_world(_init, world_size, args=(backend,), timeout=60, env={"DISTCOMM_SHM_DIR": str(shm_dir)})


def _check(results, path, why, every_rank=True):
    """Each rank's error is the one for ``path``; with ``every_rank=False``, at least one rank's: a
    rank whose init fails ends the store's host, rank 0, and a rank still reading the store then
    fails of that, with a DistError of its own."""
    told = []
    for rank, res in enumerate(results):
        assert res is not None, f"rank {rank} initialised with DISTCOMM_SHM_DIR={path}"
        assert "DistError" in res["classes"] and "RuntimeError" in res["classes"], res
        if res["message"].startswith(f"init_process_group on rank {rank}: the shared-memory engine cannot use "
                                     f"DISTCOMM_SHM_DIR={path}: {why}"):
            assert "DistBackendError" in res["classes"], res
            assert TODO in res["message"]
            told.append(rank)
    assert told == list(range(len(results))) if every_rank else told, results


def test_a_path_that_does_not_exist(tmp_path):
    path = tmp_path / "missing"
    _check(_failures(path), path, "it does not exist")


def test_the_default_engine_says_so_too(tmp_path):
    path = tmp_path / "missing"
    _check(_failures(path, "gloo", world_size=2), path, "it does not exist", every_rank=False)


def test_a_regular_file(tmp_path):
    path = tmp_path / "a-file"
    path.write_text("not a directory\n")
    _check(_failures(path), path, "it is a regular file, not a directory")


def test_a_path_under_a_regular_file(tmp_path):
    (tmp_path / "a-file").write_text("not a directory\n")
    path = tmp_path / "a-file" / "shm"
    _check(_failures(path), path, "a part of the path before its last name is a file, not a directory")


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write into any directory")
def test_a_directory_this_user_may_not_write_into(tmp_path):
    path = tmp_path / "read-only"
    path.mkdir(mode=0o555)
    try:
        _check(_failures(path), path, f"this user (uid {os.getuid()}) may not create files in it (mode 555")
    finally:
        path.chmod(0o755)
