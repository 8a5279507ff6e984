"""Hang reports and dumps on every rank: a rank times out in a collective and its error says what
each other rank of the group was doing; every rank writes its flight recorder; distcomm.trace reads
them. Real processes, a 2 s timeout."""

from __future__ import annotations

import os
import time
from datetime import timedelta

import numpy as np
import pytest

from harness import run_world

TIMEOUT = 2.0


def _laggard(rank, world_size, engine, trace_dir):
    import distcomm as dist
    from distcomm import trace

    dist.init_process_group(engine, timeout=timedelta(seconds=TIMEOUT))
    x = np.ones(4, dtype=np.float32)
    for _ in range(5):
        dist.all_reduce(x)  # LINE-LOOP
    if rank == world_size - 1:
        time.sleep(TIMEOUT + 1.0)  # busy outside distcomm: its watchdog still answers
        return {"dumped": os.path.exists(os.path.join(trace_dir, f"distcomm_trace_rank_{rank}.jsonl"))}
    t0 = time.monotonic()
    try:
        dist.all_reduce(x)  # LINE-HANG
    except dist.DistTimeoutError as exc:
        elapsed = time.monotonic() - t0
        time.sleep(0.5)  # the straggler's watchdog dumps within a tick
        return {"error": str(exc), "elapsed": elapsed, "report": trace.analyze(trace.load(trace_dir))}
    return {"error": None}


def _line_of(marker: str) -> int:
    with open(__file__) as f:
        for i, line in enumerate(f, 1):
            if marker in line and "def " not in line and "_line_of" not in line:
                return i
    raise AssertionError(marker)


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["tcp", "gloo"])
def test_timeout_error_says_what_every_rank_was_doing(engine, tmp_path):
    loop, hang = _line_of("# LINE-LOOP"), _line_of("# LINE-HANG")
    results = run_world(_laggard, 3, args=(engine, str(tmp_path)), timeout=40,
                        env={"DISTCOMM_TRACE_DIR": str(tmp_path)})
    for rank in (0, 1):
        res = results[rank]
        print(res["error"])
        assert res["error"] is not None
        other = 1 - rank
        msg = res["error"]
        assert f"all_reduce #6 on rank {rank}" in msg
        assert "what the other ranks of group '0' were doing:" in msg
        # the other waiting rank is still waiting, or has just timed out itself
        assert (f"rank {other}: in all_reduce #6 (test_hang_report.py:{hang}) for " in msg
                or f"rank {other}: all_reduce #6 (test_hang_report.py:{hang}) failed: DistTimeoutError" in msg)
        assert f"rank 2: not in an operation of this group; last completed all_reduce #5 (test_hang_report.py:{loop})" in msg
        assert f"python -m distcomm.trace {tmp_path}" in msg
        assert res["elapsed"] < TIMEOUT + 2.0
    assert results[2]["dumped"]
    report = results[0]["report"]
    print("\n".join(report))
    assert f"  ranks 0,1 failed in all_reduce #6 (test_hang_report.py:{hang}): DistTimeoutError" in report
    assert f"  rank 2 last completed all_reduce #5 (test_hang_report.py:{loop}) and has not started #6" in report


def _torch_laggard(rank, world_size):
    import torch
    import torch.distributed as tdist

    import distcomm.torch_backend  # noqa: F401 - registers the "distcomm" backend

    tdist.init_process_group("distcomm", timeout=timedelta(seconds=TIMEOUT))
    t = torch.ones(3)
    tdist.all_reduce(t)  # TORCH-LAST
    if rank == 1:
        time.sleep(TIMEOUT + 1.0)
        return None
    try:
        tdist.all_reduce(t)
    except RuntimeError as exc:
        return str(exc)
    return None


@pytest.mark.slow
def test_hang_report_through_torchs_own_api():
    error = run_world(_torch_laggard, 2, timeout=60)[0]
    assert error is not None and "all_reduce #2 on rank 0" in error
    assert (f"rank 1: not in an operation of this group; last completed all_reduce #1 "
            f"(test_hang_report.py:{_line_of('# TORCH-LAST')})") in error


# -- the report's lines, from published states (no processes) -------------------------------------
def _state(t, started=None, completed=None):
    return {"rank": 1, "time": t, "groups": {"0": {"last_started": started, "last_completed": completed}}}


def _rec(seq, state, t=100.0, line=41, error=None):
    return {"op": "all_reduce", "seq": seq, "state": state, "time_created": t,
            "site": {"file": "/x/train.py", "line": line}, "error": error}


def test_describe_state_lines():
    from distcomm.diagnostics import describe_state

    waiting = _state(103.0, _rec(6, "started"), _rec(5, "completed"))
    assert describe_state(1, waiting, "0", now=103.5) == (
        "rank 1: in all_reduce #6 (train.py:41) for 3.0 s; last completed all_reduce #5 (train.py:41)")
    # a state not refreshed for long: the rank stopped answering (SIGSTOP, a GIL held in C)
    assert describe_state(1, waiting, "0", now=110.0, stale_after=2.0).endswith("(last heard from 7.0 s ago)")
    idle = _state(103.0, _rec(5, "completed"), _rec(5, "completed"))
    assert describe_state(1, idle, "0", now=103.1) == (
        "rank 1: not in an operation of this group; last completed all_reduce #5 (train.py:41)")
    failed = _state(103.0, _rec(6, "failed", error="PeerLostError: gone"), _rec(5, "completed"))
    assert describe_state(1, failed, "0", now=103.1) == "rank 1: all_reduce #6 (train.py:41) failed: PeerLostError: gone"
    assert describe_state(2, None, "0", now=0).startswith("rank 2: no report")
    assert describe_state(1, {"time": 1.0, "groups": {}}, "0", now=1.0) == (
        "rank 1: has not started any operation of this group")


def test_failure_summary_names_the_users_line():
    from distcomm.diagnostics import describe_failure, failure_summary

    def load_batch():
        raise ValueError("bad batch 7")  # FAIL-HERE

    try:
        load_batch()
    except ValueError as exc:
        summary = failure_summary(exc)
    line = _line_of("# FAIL-HERE")
    assert summary["type"] == "ValueError" and summary["message"] == "bad batch 7"
    assert summary["site"] == f"test_hang_report.py:{line}"
    text = describe_failure(2, summary)
    assert text.startswith(f"rank 2 failed: ValueError: bad batch 7 (test_hang_report.py:{line})\n")
    assert text.splitlines()[-1] == "    | ValueError: bad batch 7"
