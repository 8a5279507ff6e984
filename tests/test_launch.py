"""python -m distcomm.launch, the legacy launcher, as the seed's "Launch utility" describes it.

Tiers: the launches are slow; the fast tier (``pytest -m "not slow"``) keeps the option parsing.
"""

from __future__ import annotations

import os

import pytest

from launcher_scripts.support import SCRIPTS, free_port, run_launcher

from distcomm.launch import parse_args

LEGACY_WORKER = os.path.join(SCRIPTS, "legacy_worker.py")


def _lines(stdout: str) -> dict[int, str]:
    return {int(line[len("[rank"):line.index("]")]): line for line in stdout.splitlines() if "local_rank_arg" in line}


@pytest.mark.slow
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
        assert f"argv=['--local-rank={rank}', 'a']" in lines[rank]  # torch >= 2.0's spelling
    # torch's deprecation FutureWarning (was a distcomm note naming --local_rank)
    assert "FutureWarning: The module distcomm.launch is deprecated" in r.stderr
    assert "If your script expects `--local-rank` argument to be set" in r.stderr


@pytest.mark.slow
def test_use_env_sets_only_the_variable(tmp_path):
    r = run_launcher(["--nproc_per_node", "2", "--master_port", "0", "--use_env", LEGACY_WORKER], tmp_path,
                     module="distcomm.launch")
    assert r.returncode == 0, r.stderr
    lines = _lines(r.stdout)
    assert "local_rank_arg=None LOCAL_RANK=0" in lines[0] and "local_rank_arg=None LOCAL_RANK=1" in lines[1]
    assert "--local_rank" not in r.stderr


def test_use_env_spellings():
    assert parse_args(["--use_env=True", "s.py", "--use_env=False"]).use_env is True
    args = parse_args(["--use-env=false", "--master_port", "1", "s.py", "--use_env=True"])
    assert args.use_env is False and args.training_script_args == ["--use_env=True"]  # the script's own
    assert parse_args(["--use_env", "s.py"]).use_env is True
