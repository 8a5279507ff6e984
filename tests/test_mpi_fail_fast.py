"""Under ``mpiexec``: fail-fast when a rank's program ends in the middle of the job, and collectives
of the "mpi" engine whose input and output are the same memory.

Fail-fast (tests/mpi_scripts/fail_fast_worker.py, 3 ranks, a 10-minute timeout that nobody may
wait out). Outside MPI a rank that dies of an exception is seen to die (its process ends, its
connections close) and its peers fail at once, with its cause (tests/test_fail_fast.py). Under
mpiexec its exit waits in MPI_Finalize for the others', so nothing of it ends; it must tell its
peers itself (_api/leaving.py; the MPI engine's notices, transport/mpi.py). Checked, on
the MPI engine and on the default one (shared memory): the peers raise within seconds, naming the
failed rank and its exception; the job then ends with nobody aborted (every rank left); the same
for ``sys.exit(3)`` and for ``try: ... finally: destroy_process_group()``; a peer busy elsewhere (not
in a collective) does not keep the job alive: MPI_Abort ends it once DISTCOMM_MPI_EXIT_GRACE has
passed; and a job whose ranks all end without destroy_process_group still exits 0, unaborted.

Aliasing (tests/mpi_scripts/alias_worker.py): all_to_all_single(t, t) (default, even and uneven
splits, an output overlapping the input), all_to_all on shared tensors, all_gather_into_tensor in
place, all_gather and gather with the input among the outputs, reduce_scatter_tensor into a
view of its input, reduce_scatter into its own input, scatter into one of the root's inputs, each
at a latency-path size and past MPI's eager limit, against a reference computed from the inputs.

Every job runs with a hard deadline (mpi_harness.run_mpiexec kills the whole session at it), and
no process of a job may outlive it. Skipped, with the reason, where mpi4py or mpiexec is missing.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import time

import pytest

from distcomm.transport.shm_segment import PREFIX

from harness import processes_with
from mpi_harness import SCRIPTS, private_shm_unavailable, run_mpiexec, skip_reason

pytestmark = [pytest.mark.slow, pytest.mark.skipif(skip_reason() is not None, reason=skip_reason() or "")]

BACKENDS = ["mpi", "default"]
DEADLINE = 90.0  # seconds for a whole job; a fail-fast job takes about 2 s, a busy-peer one about 4
PROMPT = 10.0  # seconds within which a peer must fail (the timeout is 10 minutes)
WORKER = "fail_fast_worker.py"
RAISE_LINE = next(i for i, line in enumerate((SCRIPTS / WORKER).read_text().splitlines(), 1) if "# RAISE" in line)


def _run(script: str, args: list, env: dict | None = None, shm_listing: str | None = None):
    """Run ``script`` on 3 ranks; check that no process of the job is left; (result, seconds)."""
    token = f"mpi-fail-fast-{secrets.token_hex(6)}"
    started = time.monotonic()
    try:
        done = run_mpiexec(3, script, [*args, token], timeout=DEADLINE, env=env, shm_listing=shm_listing)
    finally:
        deadline = time.monotonic() + 5
        while processes_with(token) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = processes_with(token)
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
    assert not left, f"processes of the job outlived it: {left}"
    return done, time.monotonic() - started


def _reports(done) -> dict[int, dict]:
    """{rank: its JSON line} of fail_fast_worker."""
    out = {}
    for line in done.stdout.splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            out[record["rank"]] = record
    return out


def _fails_fast(done, rank: int, pattern: str) -> dict:
    reports = _reports(done)
    assert rank in reports, f"rank {rank} reported nothing\nstdout:\n{done.stdout}\nstderr:\n{done.stderr[-4000:]}"
    res = reports[rank]
    assert res["event"] == "error" and res["type"] == "PeerLostError", res
    assert re.search(pattern, res["error"]), res["error"]
    assert res["elapsed"] < PROMPT, res
    return res


@pytest.mark.parametrize("culprit", [1, 0], ids=["rank1", "rank0_store_host"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_peers_fail_at_once_with_the_failed_ranks_exception(backend, culprit):
    done, seconds = _run(WORKER, [backend, "raise", culprit])
    assert done.returncode != 0
    assert "ValueError: bad batch 57" in done.stderr  # the failed rank's own traceback
    assert "MPI_Abort" not in done.stderr, done.stderr[-3000:]  # every rank left: no abort needed
    for rank in {0, 1, 2} - {culprit}:
        res = _fails_fast(done, rank, re.escape(f"rank {culprit} failed: ValueError: bad batch 57 "
                                                f"({WORKER}:{RAISE_LINE})"))
        assert f"line {RAISE_LINE}, in load_batch" in res["error"]  # the last lines of its traceback
    assert seconds < 30, seconds


@pytest.mark.parametrize("backend", BACKENDS)
def test_sys_exit_mid_job_fails_the_peers_at_once(backend):
    done, _ = _run(WORKER, [backend, "exit", 1])
    assert done.returncode != 0
    for rank in (0, 2):
        # a peer may hear first of rank 0, which failed of rank 1's exit: then it says so too
        _fails_fast(done, rank, r"rank 1 (ended its program without destroy_process_group|closed its transport)")


@pytest.mark.parametrize("backend", BACKENDS)
def test_destroy_in_finally_fails_the_peers_at_once(backend):
    done, _ = _run(WORKER, [backend, "finally", 1])
    assert done.returncode != 0
    for rank in (0, 2):
        _fails_fast(done, rank, r"rank [01] closed its transport")


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_busy_peer_does_not_keep_the_job_alive(backend, tmp_path):
    """Rank 2 sleeps 10 minutes outside any collective: rank 0 still fails at once, and the ranks
    that failed end the job with MPI_Abort once the grace has passed. MPICH leaves its own shared
    memory behind when a job is aborted: as root the job gets a private /dev/shm, which goes with
    it, and must hold nothing of distcomm's."""
    listing = None if private_shm_unavailable() else str(tmp_path / "shm-left")
    done, seconds = _run(WORKER, [backend, "busy", 1], env={"DISTCOMM_MPI_EXIT_GRACE": "2"}, shm_listing=listing)
    assert done.returncode != 0
    _fails_fast(done, 0, re.escape("rank 1 failed: ValueError: bad batch 57"))
    assert "woke" not in done.stdout
    assert re.search(r"distcomm: rank [01] failed, and rank 2 had not left 2 s later", done.stderr), done.stderr[-3000:]
    assert "MPI_Abort" in done.stderr
    assert seconds < 30, seconds
    if listing is not None:
        left = open(listing).read().split()
        assert not [name for name in left if name.startswith(PREFIX)], left


@pytest.mark.parametrize("backend", BACKENDS)
def test_ranks_ending_without_destroy_exit_cleanly(backend):
    done, seconds = _run(WORKER, [backend, "clean", -1])
    assert done.returncode == 0, done.stderr[-3000:]
    reports = _reports(done)
    assert sorted(reports) == [0, 1, 2], done.stdout
    assert all(r["event"] == "done" and r["value"] == 9.0 for r in reports.values()), reports
    assert "MPI_Abort" not in done.stderr and "distcomm:" not in done.stderr, done.stderr[-3000:]
    assert seconds < 30, seconds


PATTERNS = ["a2as_same_array", "a2as_same_array_even_splits", "a2as_same_array_uneven", "a2as_output_overlaps_input",
            "a2a_same_list", "a2a_same_tensors", "agit_in_place", "ag_input_among_outputs",
            "rst_output_is_block_own", "rst_output_is_block_next", "rst_avg_output_is_own_block",
            "rs_output_is_own_input", "scatter_output_among_inputs"]
ROOT_ONLY = ["gather_input_among_outputs"]  # checked on the root (rank 1)
SIZES = [2, 100_000]


def test_mpi_collectives_with_aliased_input_and_output():
    done, _ = _run("alias_worker.py", ["mpi"])
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    verdicts = {}
    for line in done.stdout.splitlines():
        rank, name, verdict = (line.split(" ", 2) + ["", ""])[:3]
        if rank.isdigit():
            verdicts[(int(rank), name)] = verdict
    expected = [(r, f"{p}/{n}") for r in range(3) for p in PATTERNS for n in SIZES]
    expected += [(1, f"{p}/{n}") for p in ROOT_ONLY for n in SIZES]
    missing = [key for key in expected if key not in verdicts]
    assert not missing, f"not run: {missing}\n{done.stdout[-3000:]}"
    wrong = [f"rank {r} {name}: {verdicts[(r, name)]}" for r, name in expected if verdicts[(r, name)] != "ok"]
    assert not wrong, "\n".join(wrong)
    assert all(verdicts.get((r, "finished")) == "" for r in range(3))
