"""python -m distcomm.launch, the legacy launcher, as the seed's "Launch utility" describes it."""

from __future__ import annotations

import os

from launcher_scripts.support import SCRIPTS, free_port, run_launcher, WORKER, assert_no_leftovers, meets

LEGACY_WORKER = os.path.join(SCRIPTS, "legacy_worker.py")


def _lines(stdout: str) -> dict[int, str]:
    return {int(line[len("[rank"):line.index("]")]): line for line in stdout.splitlines() if "local_rank_arg" in line}


def test_passes_local_rank_argument(tmp_path):
    port = free_port()
    r = run_launcher(
        ["--nproc_per_node=2", "--nnodes=1", "--node_rank=0", "--master_addr=127.0.0.1",
         f"--master_port={port}", LEGACY_WORKER, "--", "a"],
        tmp_path,
        module="distcomm.launch",
    )
    assert r.returncode == 0, r.stderr
    lines = _lines(r.stdout)
    for rank in (0, 1):
        assert f"local_rank_arg={rank} LOCAL_RANK={rank} RANK={rank} WORLD_SIZE=2" in lines[rank]
        assert f"MASTER=127.0.0.1:{port}" in lines[rank]
        assert "rest=['a']" in lines[rank]
    assert "--local_rank" in r.stderr  # the one-line note about the legacy convention


def test_use_env_sets_only_the_variable(tmp_path):
    for flag in ("--use_env", "--use_env=True"):
        r = run_launcher(["--nproc_per_node", "2", "--master_port", "0", flag, LEGACY_WORKER], tmp_path,
                         module="distcomm.launch")
        assert r.returncode == 0, r.stderr
        lines = _lines(r.stdout)
        assert "local_rank_arg=None LOCAL_RANK=1" in lines[1]


def test_legacy_launch_runs_the_same_job(tmp_path):
    # Everything distcomm-run does (store, env contract, failure handling) holds for the legacy form.
    r = run_launcher(["--nproc_per_node", "2", "--master_port", "0", "--use_env", WORKER], tmp_path,
                     module="distcomm.launch")
    assert r.returncode == 0, r.stderr
    assert sorted(meets(r.stdout)) == [0, 1]
    assert_no_leftovers(tmp_path, 2)
