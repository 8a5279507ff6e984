"""End to end: a torchrun-style script (init_process_group("gloo"), then all_reduce) under
distcomm-run, through a restart that must rendezvous afresh on the launcher's long-lived store.

Tiers: slow (each test starts the launcher); test_run's fast tier launches workers, and the key file
checks are in test_store_auth's.
"""

from __future__ import annotations

import os

import pytest

from launcher_scripts.support import SCRIPTS, launcher_env, run_launcher

pytestmark = pytest.mark.slow

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


AUTH_WORKER = '''
import os
from datetime import timedelta

import distcomm as dist
from distcomm.store import TCPStore
from distcomm.store.tcp.auth import DistStoreAuthError

dist.init_process_group("gloo")  # env://, a client of the launcher's store, with the inherited key
rank, world = dist.get_rank(), dist.get_world_size()
gathered = [None] * world
dist.all_gather_object(gathered, {"rank": rank})
print(f"rank {rank} gathered {gathered}", flush=True)
if rank == 0:  # processes without the job's key, reaching the job's store
    inherited = {k: os.environ.pop(k) for k in ("DISTCOMM_AUTH_KEY_FILE", "DISTCOMM_AUTH_KEY") if k in os.environ}
    for name, key in (("no key", None), ("wrong key", "not the job's key")):
        if key is not None:
            os.environ["DISTCOMM_AUTH_KEY"] = key
        try:
            TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), None, False, timedelta(seconds=10))
            print(f"{name}: NOT REFUSED", flush=True)
        except DistStoreAuthError as exc:
            print(f"{name}: refused: {exc}", flush=True)
        os.environ.pop("DISTCOMM_AUTH_KEY", None)
    os.environ.update(inherited)
dist.barrier()
dist.destroy_process_group()
'''


def test_a_key_set_for_the_launcher_authenticates_the_whole_job(tmp_path):
    key = tmp_path / "job.key"
    key.write_text("a0b1c2d3e4f5a6b7c8d9e0f1a2b3c4d5\n")
    key.chmod(0o600)
    script = tmp_path / "auth_worker.py"
    script.write_text(AUTH_WORKER)
    env = launcher_env(tmp_path, DISTCOMM_AUTH_KEY_FILE=str(key))
    env.pop("DISTCOMM_AUTH_KEY", None)
    r = run_launcher(["--standalone", "--nproc-per-node", "2", str(script)], env=env)
    assert r.returncode == 0, r.stderr
    expected = [{"rank": 0}, {"rank": 1}]
    for rank in (0, 1):
        assert f"[rank{rank}]: rank {rank} gathered {expected}" in r.stdout
    assert "NOT REFUSED" not in r.stdout
    assert "[rank0]: no key: refused: the TCPStore server at" in r.stdout
    assert "requires authentication" in r.stdout
    assert "[rank0]: wrong key: refused: authentication failed" in r.stdout


def test_a_key_file_others_can_read_stops_the_launcher_before_any_worker(tmp_path):
    key = tmp_path / "job.key"
    key.write_text("a0b1c2d3e4f5a6b7c8d9e0f1a2b3c4d5\n")
    key.chmod(0o644)
    env = launcher_env(tmp_path, DISTCOMM_AUTH_KEY_FILE=str(key))
    env.pop("DISTCOMM_AUTH_KEY", None)
    r = run_launcher(["--standalone", "--nproc-per-node", "2", SCRIPT], env=env)
    assert r.returncode == 1
    assert "chmod 600" in r.stderr and "[rank" not in r.stdout
