"""End to end: a torchrun-style script (init_process_group("gloo"), then all_reduce) under
distcomm-run, through a restart that must rendezvous afresh on the launcher's long-lived store."""

from __future__ import annotations

import os

import pytest

from launcher_scripts.support import SCRIPTS, launcher_env, run_launcher

SCRIPT = os.path.join(SCRIPTS, "allreduce_worker.py")


def _run_with_one_restart(tmp_path, *script_args):
    r = run_launcher(
        ["--standalone", "--nproc-per-node", "2", "--max-restarts", "1", SCRIPT, *script_args],
        env=launcher_env(tmp_path, TEST_FAIL_UNTIL_RESTART="1"),
    )
    assert r.returncode == 0, r.stderr
    assert "restart 1 of 1" in r.stderr
    for restart in (0, 1):
        for rank in (0, 1):
            assert f"[rank{rank}]: rank {rank}/2 restart {restart} sum [3.0, 3.0, 3.0, 3.0]" in r.stdout


def test_store_built_from_the_env_contract(tmp_path):
    _run_with_one_restart(tmp_path, "--explicit-store")


def test_init_process_group_with_no_arguments(tmp_path):
    _run_with_one_restart(tmp_path)
