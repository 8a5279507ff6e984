"""The MPI engine (backend "mpi") and launching under mpiexec, for real: every script here runs
under ``mpiexec`` (MPICH's hydra from the ``mpich`` wheel) with a hard deadline that kills the
whole job (mpi_harness.run_mpiexec), and with no torch variables in the environment.

* the differential cases of tests/diff_cases.py at world sizes 2 and 3, on backend "mpi" and on the
  default engine, each initialised by ``init_process_group()`` from mpiexec's variables alone,
  compared case by case with torch's gloo run in the same processes (test_differential.compare:
  gloo's results, or distcomm's documented reference where gloo refuses);
* errors: a collective and a receive that time out name the op, sequence number and rank; messages
  of the wrong size are mismatches naming the peer; a tag past MPI_TAG_UB is refused;
* the latency paths (backends/mpi/latency.py) take small synchronous calls, compute what the
  general path does, meet a member running the same call on the general path, record the calls
  in the flight recorder, decline what they cannot run, and honour a timeout;
* a rank killed in the middle of a job ends the job (MPICH's launcher aborts it) instead of
  leaving the others hanging.

Skipped, with the reason, where mpi4py or mpiexec is missing. All slow: each starts an MPI job.
"""

from __future__ import annotations

import pickle

import pytest

from distcomm.transport.shm_segment import PREFIX

import diff_cases as dc
from harness import free_port, run_world
from mpi_harness import private_shm_unavailable, run_mpiexec, skip_reason

pytestmark = [pytest.mark.slow, pytest.mark.skipif(skip_reason() is not None, reason=skip_reason() or "")]

ENGINES = ["mpi", "default"]
WORLD_SIZES = [2, 3]
DEADLINE = {2: 300, 3: 480}  # seconds for the three runs of every case (about 25 s and 60 s here)


@pytest.fixture(scope="module")
def diff_results(tmp_path_factory):
    """{world size: per-rank results or the exception of the job}, computed on first use."""
    cache: dict = {}

    def get(ws: int):
        if ws not in cache:
            out = tmp_path_factory.mktemp(f"mpi_diff_{ws}")
            try:
                done = run_mpiexec(ws, "diff_worker.py", [out, free_port()], timeout=DEADLINE[ws])
                if done.returncode != 0:
                    raise AssertionError(f"mpiexec exited with {done.returncode}:\n{done.stdout[-3000:]}\n"
                                         f"{done.stderr[-3000:]}")
                cache[ws] = [pickle.loads((out / f"rank{r}.pkl").read_bytes()) for r in range(ws)]
            except AssertionError as exc:
                cache[ws] = exc
        return cache[ws]

    return get


@pytest.mark.parametrize("ws", WORLD_SIZES)
@pytest.mark.parametrize("engine", ENGINES)
def test_differential_under_mpiexec(diff_results, ws, engine):
    from test_differential import compare

    results = diff_results(ws)
    if isinstance(results, Exception):
        raise results
    problems, checked = [], 0
    for case in dc.cases(ws):
        names = (case.name,) + ((case.name + "@np",) if case.numpy else ())
        for name in names:
            for rank in range(ws):
                expected = results[rank]["torch:gloo"][case.name]
                got = results[rank][f"distcomm:{engine}"].get(name)
                if got is None:
                    problems.append(f"{name}, rank {rank}: not run")
                    continue
                checked += 1
                problem = compare(case, ws, rank, expected, got)
                if problem:
                    problems.append(f"{name}, rank {rank}: {problem}")
    assert checked > 100 * ws
    assert not problems, f"{len(problems)} differences on distcomm:{engine} at world size {ws}:\n" + "\n".join(problems[:40])


def _lines(nprocs: int, script: str) -> dict:
    """{(rank, check): rest of the line} of a script that prints ``<rank> <check> <rest>`` lines."""
    done = run_mpiexec(nprocs, script, timeout=120)
    assert done.returncode == 0, f"mpiexec exited with {done.returncode}:\n{done.stdout}\n{done.stderr[-3000:]}"
    lines = {}
    for line in done.stdout.splitlines():
        rank, check, rest = (line.split(" ", 2) + ["", ""])[:3]
        if rank.isdigit():
            lines[(int(rank), check)] = rest
    return lines


@pytest.fixture(scope="module")
def error_lines():
    return _lines(2, "errors_worker.py")


def test_groups_on_the_mpi_engine():
    lines = _lines(3, "groups_worker.py")
    assert [lines[(r, "local_rank")] for r in range(3)] == ["0", "1", "2"]
    # an "mpi" group of ranks [2, 0] in a world on the default engine: its own engine, by Create_group
    for r in (0, 2):
        assert lines[(r, "default+mpi_group")] == "mpi [4.0, 4.0] [2.0, 2.0, 2.0]"
    assert (1, "default+mpi_group") not in lines
    # new_group([1, 2]) on an "mpi" world: MAX of int64, a float16 receive from any member
    assert lines[(1, "group12")] == lines[(2, "group12")] == "[2]"
    assert lines[(2, "recv_any")] == "1 [1.0, 1.0]"
    # subgroups [[0, 2], [1]], AVG
    assert lines[(0, "subgroup")] == lines[(2, "subgroup")] == "2 [2.0, 2.0]"
    assert lines[(1, "subgroup")] == "1 [2.0, 2.0]"
    assert lines[(0, "split")] == "None"
    assert lines[(1, "split")] == lines[(2, "split")] == "[1, 2] [3.0]"
    # the program's own MPI still works after distcomm is done (nothing finalized)
    assert all(lines[(r, "own_mpi")] == "3" for r in range(3))


def test_collective_timeout_names_op_seq_rank_and_breaks_the_group(error_lines):
    assert error_lines[(0, "timeout_all_reduce")].startswith("DistTimeoutError: all_reduce #1 on rank 0: Timed out")
    assert error_lines[(1, "timeout_all_reduce")] == "ok"  # the late rank completes it
    after = error_lines[(0, "after_timeout")]
    assert after.startswith("DistBackendError: all_reduce #2 on rank 0: the group cannot be used any more"), after


def test_receive_timeout_names_the_peer(error_lines):
    text = error_lines[(0, "timeout_recv")]
    assert text.startswith("DistTimeoutError: recv on rank 0 (peer rank 1) (tag 5): Timed out"), text


def _mpi_calls_missing() -> bool:
    from distcomm.backends.mpi import latency

    return not latency.ALL_REDUCE_IN_C


@pytest.mark.parametrize("ws", WORLD_SIZES)
def test_latency_paths(ws):
    lines = _lines(ws, "latency_worker.py")
    n = ws
    total = float(n * (n + 1) // 2)
    summed = [float(n * k + n * (n - 1) // 2) for k in range(2 * n)]  # of arange(2n) + r over the ranks
    for r in range(n):
        got = lambda check: lines.get((r, check))  # noqa: E731
        assert got("all_reduce_numpy") == f"True {[total] * 3}"
        assert got("all_reduce_torch") == f"True True {[total] * 4}"  # AVG then SUM
        assert got("all_reduce_max") == f"True {[n - 1, 0]}"
        assert got("all_gather_into_tensor") == f"True {[v for q in range(n) for v in (q, 10 * q)]}"
        assert got("reduce_scatter_tensor") == f"True {summed[2 * r:2 * r + 2]}"
        assert got("reduce_scatter_tensor_avg") == f"True {[v / n for v in summed[2 * r:2 * r + 2]]}"
        assert got("barrier") == "True"
        assert got("broadcast") == "True [7.0, 7.0, 7.0]"
        expected = [("all_reduce", 1, "completed", 12), ("all_reduce", 2, "completed", 32),
                    ("all_reduce", 3, "completed", 32), ("all_reduce", 4, "completed", 16),
                    ("all_gather_into_tensor", 5, "completed", 8), ("reduce_scatter_tensor", 6, "completed", 8 * n),
                    ("reduce_scatter_tensor", 7, "completed", 8 * n), ("barrier", 8, "completed", 0),
                    ("broadcast", 9, "completed", 24)]
        assert got("records") == str(expected)
        assert got("public_sites") == "ok"
        # the mpich wheel's library is always found (one libmpi mapped), and then used
        assert got("all_reduce_in_c") == ("not built" if _mpi_calls_missing() else "yes direct=True found=True")
        # rank 0 on the latency path, the others on the general one: the same MPI calls
        assert got("mixed_all_reduce") == f"True {[float(n * (n - 1) // 2)] * 2}"
        assert got("mixed_all_gather") == f"True {[q + 5 for q in range(n)]}"
        assert got("mixed_reduce_scatter") == f"True {[float(r * n * (n + 1) // 2)]}"
        assert got("mixed_barrier") == "True"
        assert got("mixed_broadcast") == "True [1.0, 1.0]"
        assert got("declined") == str([False] * 6)
        assert got("persistent_sizes") == "True"
        assert got("finished") == ""
        if r == 1:  # the late rank completes the call the others gave up on
            assert got("timeout") == "ok True"
            assert got("timeout_record") == "all_gather_into_tensor 1 completed"
        else:
            assert got("timeout").startswith(
                f"DistTimeoutError: all_gather_into_tensor #1 on rank {r}: Timed out"), got("timeout")
            assert got("timeout_record") == "all_gather_into_tensor 1 failed"
    after = lines[(0, "after_timeout")]
    assert after.startswith("DistBackendError: barrier #2 on rank 0: the group cannot be used any more: "
                            "all_gather_into_tensor #1 timed out inside MPI"), after


def test_size_mismatches_are_reported_both_ways(error_lines):
    longer = error_lines[(1, "recv_longer_than_sent")]
    assert longer.startswith("CollectiveMismatchError: recv on rank 1 (peer rank 0) (tag 7)"), longer
    assert "expects 16 bytes but rank 0 sent 8 bytes" in longer
    shorter = error_lines[(1, "recv_shorter_than_sent")]
    assert shorter.startswith("CollectiveMismatchError: recv on rank 1 (peer rank 0) (tag 8)"), shorter
    assert "longer than the receive" in shorter


def test_tags_outside_mpi_range_and_object_lists(error_lines):
    assert error_lines[(1, "big_tag")] == "ok"
    assert error_lines[(1, "values")] == "[9.0, 9.0, 9.0] [{'a': 1}, 'two']"
    assert error_lines[(0, "finished")] == "" and error_lines[(1, "finished")] == ""


def test_all_to_all_even_on_one_rank_only(error_lines):
    # rank 0 sends [0] [1] and receives what rank 1 sends it: [10]; rank 1 sends [10] [11, 12]
    assert error_lines[(0, "a2a_mixed")] == "[0.0, 10.0]"
    assert error_lines[(1, "a2a_mixed")] == "[1.0, 11.0, 12.0]"


def _init_mpi_outside_mpiexec(rank, world_size):
    from datetime import timedelta

    import distcomm as dist

    try:
        dist.init_process_group("mpi", timeout=timedelta(seconds=30))
    except RuntimeError as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        # a process finalizes MPI at exit (mpi4py's atexit), which the harness's forked ranks skip:
        # MPICH's singleton would leave its shared memory segment behind
        from mpi4py import MPI

        if MPI.Is_initialized() and not MPI.Is_finalized():
            MPI.Finalize()
    return "started"


def test_processes_not_started_as_one_mpi_job_are_refused_alike():
    """Spawned processes are each an MPI world of one: every rank says so (none of them dies of a
    lost store because rank 0 raised first)."""
    results = run_world(_init_mpi_outside_mpiexec, 2, timeout=90)
    for rank, text in enumerate(results):
        assert text.startswith(f"DistBackendError: backend 'mpi' on rank {rank}: the 2 processes are not one MPI "
                               "job (their ranks in MPI_COMM_WORLD are [0, 0])"), text


def test_mpi_below_thread_multiple():
    lines = _lines(2, "thread_level_worker.py")
    for r in range(2):
        assert lines[(r, "default")] == "[2.0, 2.0]"
        assert lines[(r, "mpi")].startswith("DistBackendError: backend 'mpi': MPI was initialised below thread level "
                                            "MULTIPLE"), lines[(r, "mpi")]
        assert lines[(r, "own_mpi")] == "2 False"


@pytest.mark.parametrize("backend", ["mpi", "gloo"])
def test_a_killed_rank_ends_the_job(backend, tmp_path):
    """MPICH's launcher aborts the job when a rank dies: rank 0, waiting in an all_reduce with a
    10-minute timeout, is ended with it well within the 60 s deadline (run_mpiexec would fail the
    test by killing the job at 60 s). The job runs on a private /dev/shm (as root): the killed
    rank leaves MPICH's own segments there, which go with it, and none of distcomm's."""
    listing = None if private_shm_unavailable() else str(tmp_path / "shm-left")
    done = run_mpiexec(2, "peer_death_worker.py", [backend], timeout=60, shm_listing=listing)
    assert "0 initialised" in done.stdout and "1 initialised" in done.stdout, done.stdout + done.stderr[-2000:]
    assert "survived" not in done.stdout
    assert done.returncode != 0
    if listing is not None:
        left = open(listing).read().split()
        assert not [name for name in left if name.startswith(PREFIX)], left
