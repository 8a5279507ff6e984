"""Fail-fast with the cause: a rank whose program dies of an exception tells its peers why, through
the store, before it exits; peers blocked in a collective with it raise at once, and their error
says "rank 2 failed: ValueError: bad batch (script.py:N)" with the last lines of its traceback.

Real processes started as plain scripts (not the harness, which catches exceptions itself): the
cause is published by the sys.excepthook init_process_group installs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness import free_port

SRC = str(Path(__file__).resolve().parents[1] / "src")

SCRIPT = '''
import json, sys, time
from datetime import timedelta
import numpy as np
import distcomm as dist

def load_batch(i):
    raise ValueError(f"bad batch {i}")  # RAISE

dist.init_process_group(sys.argv[1], timeout=timedelta(seconds=float(sys.argv[2])))
rank = dist.get_rank()
x = np.ones(4, dtype=np.float32)
dist.all_reduce(x)
dist.barrier()
if rank == 2:
    load_batch(57)
t0 = time.monotonic()
try:
    dist.all_reduce(x)
    print(json.dumps({"rank": rank, "error": None}))
except dist.DistError as exc:
    print(json.dumps({"rank": rank, "type": type(exc).__name__, "error": str(exc),
                      "elapsed": time.monotonic() - t0}), flush=True)
time.sleep(1.0)  # rank 0 hosts the store: it must outlive rank 1's reading of it
'''


def _run(tmp_path, engine, timeout_s, world=3):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, PYTHONPATH=SRC, WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, str(script), engine, str(timeout_s)], env=dict(env, RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(world)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout_s + 30))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return procs, outs


def _line(marker: str) -> int:
    return next(i for i, line in enumerate(SCRIPT.splitlines(), 1) if marker in line)


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["tcp", "gloo"])
def test_peers_raise_with_the_failed_ranks_exception(tmp_path, engine):
    timeout_s = 20.0  # the peers must not need it: they hear of the death, not of a timeout
    procs, outs = _run(tmp_path, engine, timeout_s)
    assert procs[2].returncode == 1
    assert "ValueError: bad batch 57" in outs[2][1]  # the failed rank's own traceback still prints
    raise_line = _line("# RAISE")
    for rank in (0, 1):
        lines = [line for line in outs[rank][0].splitlines() if line.startswith("{")]
        assert lines, f"rank {rank} printed nothing; stderr:\n{outs[rank][1]}"
        res = json.loads(lines[-1])
        assert res["error"] is not None, res
        print(res["error"])
        assert f"rank 2 failed: ValueError: bad batch 57 (script.py:{raise_line})" in res["error"]
        assert f'line {raise_line}, in load_batch' in res["error"]  # the traceback's last lines
        assert res["elapsed"] < 2.0, res  # they hear of the death at once (about 0.1-0.3 s here)
