"""Collectives whose input and output are the same memory, or overlap, on the shared-memory and TCP
engines: every pattern of tests/mpi_scripts/alias_worker.py (all_to_all_single(t, t) with even and
uneven splits, an output over part of its input, all_gather_into_tensor in place, gather and
all_gather with the input among the outputs, reduce_scatter into a view of its input, ...), at a
latency-path size and a large one, against a reference computed from the inputs. The MPI engine
runs the same worker under mpiexec (tests/test_mpi_fail_fast.py).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from harness import run_in_session

WORKER = str(Path(__file__).resolve().parent / "mpi_scripts" / "alias_worker.py")


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["gloo", "tcp"])
def test_aliased_buffers_give_what_separate_ones_give(engine):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = run_in_session([sys.executable, "-m", "distcomm.run", "--standalone", "--nproc-per-node", "3",
                             WORKER, engine], 180, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    verdicts = [line for line in lines if line.split()[-1] in ("ok",) or " BAD " in line]
    assert [line for line in verdicts if " BAD " in line] == [], result.stdout
    assert len(verdicts) >= 3 * 20 and sum(line.endswith(" finished") for line in lines) == 3, result.stdout
