"""Under ``mpiexec``: a rank that catches the DistError of a failed collective and ends its program
counts as failed when it leaves the job (tests/mpi_scripts/caught_fault_worker.py, 3 ranks).

Its exit waits in MPI_Finalize for every rank's; with a peer stuck for good, the job would wait
forever. So, as for an uncaught exception (tests/test_mpi_fail_fast.py), it waits
DISTCOMM_MPI_EXIT_GRACE for the others to leave and then ends the job with MPI_Abort; and when the
others do leave within the grace (ending their program, or destroying their process group first),
nothing is aborted and the job exits 0.

Every job runs with a hard deadline (the whole session is killed at it), and no process of a job
may outlive it. Skipped, with the reason, where mpi4py or mpiexec is missing.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import time

import pytest

from harness import processes_with
from mpi_harness import private_shm_unavailable, run_mpiexec, skip_reason

pytestmark = [pytest.mark.slow, pytest.mark.skipif(skip_reason() is not None, reason=skip_reason() or "")]

DEADLINE = 60.0  # seconds for a whole job: a stuck one ends in about 6 (a 2 s timeout, a 2 s grace)
WORKER = "caught_fault_worker.py"


def _run(backend: str, scenario: str, late: int, tmp_path):
    token = f"mpi-caught-fault-{secrets.token_hex(6)}"
    # MPICH leaves its shared memory behind when a job is aborted: as root the job gets a private
    # /dev/shm of its own (mpi_harness), which goes with it
    listing = None if private_shm_unavailable() else str(tmp_path / "shm-left")
    try:
        done = run_mpiexec(3, WORKER, [backend, scenario, late, token], timeout=DEADLINE,
                           env={"DISTCOMM_MPI_EXIT_GRACE": "2"}, shm_listing=listing)
    finally:
        deadline = time.monotonic() + 5
        while processes_with(token) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = processes_with(token)
        for pid in left:
            os.kill(pid, signal.SIGKILL)
    assert not left, f"processes of the job outlived it: {left}"
    events = {}
    for line in done.stdout.splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            events[record["rank"]] = record["event"]
    return done, events


@pytest.mark.parametrize("late", [1, 0], ids=["rank1", "rank0_store_host"])
@pytest.mark.parametrize("backend", ["mpi", "default"])
def test_a_caught_error_and_sys_exit_still_end_the_job(backend, late, tmp_path):
    done, events = _run(backend, "stuck", late, tmp_path)
    assert done.returncode != 0
    others = {0, 1, 2} - {late}
    assert events == {r: "caught" for r in others}, done.stdout
    assert f"rank {late} had not left 2 s later (DISTCOMM_MPI_EXIT_GRACE): ending the MPI job with MPI_Abort" \
        in done.stderr, done.stderr[-3000:]
    # its own timeout, or (shared memory) the other one's giving up on the call first
    assert re.search(rf"distcomm: rank [{''.join(map(str, others))}] left after a (DistTimeoutError|PeerLostError) "
                     rf"in all_reduce #3, and rank {late} had not left", done.stderr), done.stderr[-3000:]


@pytest.mark.parametrize("scenario, late, backend", [
    ("late", 1, "mpi"), ("late", 1, "default"),
    ("late_destroy", 1, "mpi"), ("late_destroy", 0, "mpi"), ("late_destroy", 1, "default"),
    ("late_destroy", 0, "default"),
])
def test_a_caught_error_aborts_nothing_when_every_rank_leaves(scenario, late, backend, tmp_path):
    """The late rank ends its program (or destroys its group, then ends) within the grace."""
    done, events = _run(backend, scenario, late, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert events == {r: "woke" if r == late else "caught" for r in range(3)}, done.stdout
    assert "MPI_Abort" not in done.stderr and "distcomm:" not in done.stderr, done.stderr[-3000:]
