"""End to end: a torchrun-style script (init_process_group("gloo") with no other argument, then
all_reduce) under distcomm-run, including a restart that must rendezvous afresh on the same store."""

from __future__ import annotations

import importlib.util
import os

import pytest

from launcher_scripts.support import SCRIPTS, launcher_env, run_launcher

SCRIPT = os.path.join(SCRIPTS, "allreduce_worker.py")

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("distcomm.transport.tcp") is None,
    reason="the tcp transport (the gloo backend's data path) is not there yet",
)


def test_init_process_group_and_all_reduce_under_the_launcher(tmp_path):
    r = run_launcher(["--standalone", "--nproc-per-node", "2", SCRIPT], tmp_path)
    assert r.returncode == 0, r.stderr
    for rank in (0, 1):
        assert f"[rank{rank}]: rank {rank}/2 restart 0 sum [3.0, 3.0, 3.0, 3.0]" in r.stdout


def test_restarted_round_rendezvous_afresh(tmp_path):
    # Round 0 completes an all_reduce, then rank 1 exits 5; round 1 reuses the launcher's store,
    # and must not see round 0's keys (DISTCOMM_STORE_PREFIX).
    r = run_launcher(
        ["--standalone", "--nproc-per-node", "2", "--max-restarts", "1", SCRIPT],
        env=launcher_env(tmp_path, TEST_FAIL_UNTIL_RESTART="1"),
    )
    assert r.returncode == 0, r.stderr
    assert "restart 1 of 1" in r.stderr
    for rank in (0, 1):
        assert f"[rank{rank}]: rank {rank}/2 restart 1 sum [3.0, 3.0, 3.0, 3.0]" in r.stdout
