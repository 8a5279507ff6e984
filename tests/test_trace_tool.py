"""distcomm.trace: the analysis on synthetic flight recorder dumps, and the command line on files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from distcomm import trace

SRC = str(Path(__file__).resolve().parents[1] / "src")


def rec(seq, op="all_reduce", state="completed", line=41, nbytes=16, dtype="float32", peer=None, group="0",
        t=100.0, **extra):
    return {"id": seq, "group": group, "seq": seq, "op": op, "nbytes": nbytes, "dtype": dtype, "peer": peer,
            "site": {"file": "/home/u/train.py", "line": line}, "time_created": t, "time_completed": None,
            "state": state, "error": extra.get("error"), "tag": extra.get("tag")}


def header(rank, size=3, time=102.0, reason="DistTimeoutError in all_reduce #6"):
    return {"rank": rank, "world_size": size, "time": time, "reason": reason,
            "groups": {"0": {"id": 0, "ranks": list(range(size)), "timeout": 2.0}}}


def steps(n, last_state="completed"):
    out = [rec(s) for s in range(1, n)]
    out.append(rec(n, state=last_state))
    return out


def test_ranks_that_timed_out_together_are_one_line():
    err = "DistTimeoutError: all_reduce #6 on rank {} (peer rank 2): Timed out"
    dumps = {r: (header(r), steps(5) + [rec(6, state="failed", error=err.format(r))]) for r in (0, 1)}
    dumps[2] = (header(2), steps(5))
    lines = trace.analyze(dumps)
    assert "  ranks 0,1 failed in all_reduce #6 (train.py:41): DistTimeoutError" in lines
    assert "  rank 2 last completed all_reduce #5 (train.py:41) and has not started #6" in lines


def test_who_is_behind_and_where():
    dumps = {
        0: (header(0), steps(6, "started")),
        1: (header(1), steps(6, "started")),
        2: (header(2), steps(5)),
    }
    lines = trace.analyze(dumps)
    assert lines[0] == "group '0' (ranks 0,1,2):"
    assert "  ranks 0,1 in all_reduce #6 (train.py:41) for 2.0 s" in lines
    assert "  rank 2 last completed all_reduce #5 (train.py:41) and has not started #6" in lines
    assert not any("divergence" in line for line in lines)
    assert lines[-1] == "dumped because: DistTimeoutError in all_reduce #6"


def test_all_caught_up():
    dumps = {r: (header(r), steps(4)) for r in range(3)}
    lines = trace.analyze(dumps)
    assert "  ranks 0,1,2 completed all_reduce #4 (train.py:41)" in lines
    assert "  no rank is behind" in lines


def test_first_divergence_names_both_sides_and_sites():
    calls = steps(3)
    other = steps(2) + [rec(3, op="broadcast", peer=1, line=44)]
    dumps = {0: (header(0, 3), calls), 1: (header(1, 3), calls), 2: (header(2, 3), other)}
    lines = trace.analyze(dumps)
    assert ("  first divergence at #3: ranks 0,1 called all_reduce (16 B, float32) at train.py:41; "
            "rank 2 called broadcast (16 B, float32, root 1) at train.py:44") in lines


def test_divergence_in_size_only():
    dumps = {0: (header(0, 2), [rec(1), rec(2, nbytes=32)]), 1: (header(1, 2), [rec(1), rec(2, nbytes=64)])}
    (div,) = [line for line in trace.analyze(dumps) if "divergence" in line]
    assert "#2" in div and "32 B" in div and "64 B" in div


def test_failed_rank_and_missing_dump():
    dumps = {
        0: (header(0), steps(3) + [rec(4, state="failed", error="PeerLostError: rank 2 closed")]),
        1: (header(1), steps(4, "started")),
    }
    lines = trace.analyze(dumps)
    assert "  rank 0 failed in all_reduce #4 (train.py:41): PeerLostError: rank 2 closed" in lines
    assert "  rank 1 in all_reduce #4 (train.py:41) for 2.0 s" in lines
    assert any(line.startswith("  rank 2: no dump") for line in lines)


def test_the_oldest_unfinished_of_queued_calls_is_reported():
    recs = steps(2) + [rec(3, state="started"), rec(4, state="scheduled", line=50)]
    dumps = {0: (header(0, 2), recs), 1: (header(1, 2), steps(2))}
    lines = trace.analyze(dumps)
    assert "  rank 0 in all_reduce #3 (train.py:41) for 2.0 s" in lines
    assert "  rank 1 last completed all_reduce #2 (train.py:41) and has not started #3" in lines


def test_point_to_point_pending_and_groups_apart():
    p2p = rec(None, op="send", state="started", peer=1, line=60, tag=7)
    sub = {"group": "sub"}
    dumps = {
        0: (header(0, 2), steps(2) + [p2p] + [dict(rec(1), **sub)]),
        1: (header(1, 2), steps(2) + [dict(rec(1), **sub)]),
    }
    lines = trace.analyze(dumps)
    assert "  rank 0 send with rank 1 tag 7 (train.py:60) has not completed" in lines
    assert "group 'sub' (ranks 0,1):" in lines  # ranks from the records when no header knows the group
    # the send has no sequence number: it is no divergence
    assert not any("divergence" in line for line in lines)


def _write_dumps(directory, dumps):
    for r, recs in dumps.items():
        with open(directory / f"distcomm_trace_rank_{r}.jsonl", "w") as f:
            f.write(json.dumps(header(r, 2)) + "\n")
            f.writelines(json.dumps(x) + "\n" for x in recs)


def test_main_reads_a_directory(tmp_path, capsys):
    _write_dumps(tmp_path, {0: steps(6, "started"), 1: steps(5)})
    assert trace.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "rank 0 in all_reduce #6 (train.py:41)" in out
    assert "rank 1 last completed all_reduce #5 (train.py:41) and has not started #6" in out


def test_main_on_an_empty_directory(tmp_path, capsys):
    assert trace.main([str(tmp_path)]) == 1
    assert "no flight recorder dumps" in capsys.readouterr().err


@pytest.mark.slow
def test_python_dash_m_distcomm_trace(tmp_path):
    _write_dumps(tmp_path, {0: steps(6, "started"), 1: steps(5)})
    out = subprocess.run([sys.executable, "-m", "distcomm.trace", str(tmp_path)], capture_output=True, text=True,
                         env={"PYTHONPATH": SRC}, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "rank 1 last completed all_reduce #5 (train.py:41) and has not started #6" in out.stdout
