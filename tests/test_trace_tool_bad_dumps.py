"""distcomm.trace on a directory where some dump files are not whole dumps (empty, cut short, not
JSON, another program's): each is skipped with one line naming it and what is wrong, and the others
are analysed as if it were not there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from distcomm import trace

SRC = str(Path(__file__).resolve().parents[1] / "src")


def _rec(seq, state="completed"):
    return {"id": seq, "group": "0", "seq": seq, "op": "all_reduce", "nbytes": 16, "dtype": "float32",
            "peer": None, "site": {"file": "/home/u/train.py", "line": 41}, "time_created": 100.0,
            "time_completed": None, "state": state, "error": None, "tag": None}


def _dump_text(rank, last_seq, last_state="completed"):
    head = {"rank": rank, "world_size": 3, "time": 102.0, "reason": "DistTimeoutError in all_reduce #6",
            "groups": {"0": {"id": 0, "ranks": [0, 1, 2], "timeout": 2.0}}}
    recs = [_rec(s) for s in range(1, last_seq)] + [_rec(last_seq, last_state)]
    return "".join(json.dumps(x) + "\n" for x in [head, *recs])


def _directory(tmp_path, rank1_text):
    (tmp_path / "distcomm_trace_rank_0.jsonl").write_text(_dump_text(0, 6, "started"))
    (tmp_path / "distcomm_trace_rank_1.jsonl").write_text(rank1_text)
    (tmp_path / "distcomm_trace_rank_2.jsonl").write_text(_dump_text(2, 5))
    return tmp_path


WHOLE = _dump_text(1, 6, "started")
BROKEN = {
    "empty": ("", "empty file (no header)"),
    "truncated": (WHOLE[:len(WHOLE) - 40], "line 7 is not JSON, cut short (the file ends inside it) ("),
    "not_json": ("<html>not a dump</html>\n", "line 1 is not JSON (column 1: Expecting value)"),
    "a_list": ("[1, 2, 3]\n", "line 1 is not the header of a flight recorder dump"),
    "no_header": (WHOLE.split("\n", 1)[1], "line 1 is not the header of a flight recorder dump"),
    "bad_record": (WHOLE.split("\n", 1)[0] + '\n{"x": 1}\n', "line 2 is not a record of a flight recorder dump"),
    "not_utf8": (None, "line 1 is not JSON (not UTF-8 text: invalid start byte at byte 0)"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_a_broken_dump_is_skipped_with_a_note_and_the_rest_analysed(case, tmp_path, capsys):
    text, why = BROKEN[case]
    directory = _directory(tmp_path, "" if text is None else text)
    if text is None:
        (directory / "distcomm_trace_rank_1.jsonl").write_bytes(b"\xff\xfe\x00garbage\n")
    assert trace.main([str(directory)]) == 0
    captured = capsys.readouterr()
    notes = captured.err.splitlines()
    assert len(notes) == 1, captured.err
    assert notes[0].startswith(f"skipped {directory / 'distcomm_trace_rank_1.jsonl'}: {why}"), notes[0]
    assert "rank 0 in all_reduce #6 (train.py:41)" in captured.out
    assert "rank 2 last completed all_reduce #5 (train.py:41) and has not started #6" in captured.out
    assert "  rank 1: dump unreadable (skipped)" in captured.out.splitlines()


def test_an_unreadable_file_is_skipped_too(tmp_path, capsys):
    directory = _directory(tmp_path, WHOLE)
    os.remove(directory / "distcomm_trace_rank_1.jsonl")
    os.mkdir(directory / "distcomm_trace_rank_1.jsonl")  # a directory where a file should be
    assert trace.main([str(directory)]) == 0
    captured = capsys.readouterr()
    assert captured.err.startswith(f"skipped {directory / 'distcomm_trace_rank_1.jsonl'}: Is a directory")
    assert "rank 2 last completed all_reduce #5" in captured.out


def test_only_broken_dumps(tmp_path, capsys):
    (tmp_path / "distcomm_trace_rank_0.jsonl").write_text("")
    assert trace.main([str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "skipped " in err and f"none of the 1 flight recorder dumps in {tmp_path} could be read" in err


def test_load_lists_what_it_skipped(tmp_path):
    directory = _directory(tmp_path, "")
    skipped = []
    dumps = trace.load(str(directory), skipped)
    assert sorted(dumps) == [0, 2]
    assert skipped == [(str(directory / "distcomm_trace_rank_1.jsonl"), "empty file (no header)", 1)]


@pytest.mark.slow
def test_python_dash_m_distcomm_trace_with_a_truncated_dump(tmp_path):
    directory = _directory(tmp_path, WHOLE[:len(WHOLE) // 2])
    out = subprocess.run([sys.executable, "-m", "distcomm.trace", str(directory)], capture_output=True, text=True,
                         env={"PYTHONPATH": SRC}, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr
    assert out.stderr.startswith(f"skipped {directory / 'distcomm_trace_rank_1.jsonl'}: line ")
    assert "rank 2 last completed all_reduce #5 (train.py:41) and has not started #6" in out.stdout
