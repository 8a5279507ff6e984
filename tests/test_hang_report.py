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
