"""A rank that receives SIGTERM while a process group is initialised writes its flight recorder
first, then dies of the signal as before (or runs the handler the program had installed): a
launcher stops the ranks it did not see fail with SIGTERM, and the straggler, whose dump says why
the job hung, is one of them.

Real processes and real signals; every process runs in a session of its own, killed whole at a
hard deadline, and none may be left afterwards.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness import free_port, processes_with, run_in_session

from distcomm import trace

DEADLINE = 30.0  # seconds for any one process to reach a line, or to die once signalled

# argv: mode ("default", "user_handler", "destroyed", "wait"), marker file, token (in the command
# line, to find leftovers). "wait": rank 1 of 2 waits in an all_reduce rank 0 does not join.
RANK = r'''
import os, signal, sys, time
from datetime import timedelta
import numpy as np
import distcomm as dist

mode, marker = sys.argv[1], sys.argv[2]
if mode == "user_handler":
    def handler(signum, frame):
        with open(marker, "w") as f:
            f.write("user handler ran\n")
        sys.exit(3)
    signal.signal(signal.SIGTERM, handler)
dist.init_process_group("gloo", timeout=timedelta(seconds=60))
x = np.ones(4, dtype=np.float32)
dist.all_reduce(x)  # all_reduce #1, completed everywhere
if mode == "destroyed":
    dist.destroy_process_group()
if mode == "wait" and dist.get_rank() == 1:
    print("waiting", flush=True)
    dist.all_reduce(x)  # all_reduce #2: rank 0 never joins
print("ready", flush=True)
time.sleep(120)
'''


def _start(mode: str, tmp_path: Path, rank: int, world_size: int, port: int, token: str) -> subprocess.Popen:
    env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
               LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               DISTCOMM_TRACE_DIR=str(tmp_path / "trace"), OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-c", RANK, mode, str(tmp_path / "marker"), token], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def _read_until(proc: subprocess.Popen, line: str) -> None:
    """Read ``proc``'s stdout until ``line`` (a readline per line: the ranks print a few lines)."""
    deadline = time.monotonic() + DEADLINE
    while time.monotonic() < deadline:
        got = proc.stdout.readline()
        if got.strip() == line:
            return
        if not got and proc.poll() is not None:
            raise AssertionError(f"the rank exited ({proc.returncode}) before printing {line!r}: {proc.stderr.read()}")
    raise AssertionError(f"no {line!r} within {DEADLINE} s")


@pytest.fixture
def ranks():
    """Start ranks with ``start(mode, tmp_path, rank, world_size, port)``; kill whatever is left at
    the end, and fail if a process of the test outlived it."""
    token = f"sigterm-dump-{secrets.token_hex(6)}"
    procs: list[subprocess.Popen] = []

    def start(*args) -> subprocess.Popen:
        proc = _start(*args, token)
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(DEADLINE)
        proc.stdout.close()
        proc.stderr.close()
    deadline = time.monotonic() + 5
    while processes_with(token) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not processes_with(token), "processes of the test outlived it"


def _dump(tmp_path: Path, rank: int):
    path = tmp_path / "trace" / f"distcomm_trace_rank_{rank}.jsonl"
    if not path.exists():
        return None
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return lines[0], lines[1:]


def _terminate(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGTERM)
    return proc.wait(DEADLINE)


def test_sigterm_dumps_then_dies_of_the_signal(ranks, tmp_path):
    proc = ranks("default", tmp_path, 0, 1, free_port())
    _read_until(proc, "ready")
    assert _terminate(proc) == -signal.SIGTERM  # the exit status is the signal's, as without distcomm
    header, records = _dump(tmp_path, 0)
    assert header["reason"] == "rank 0 received SIGTERM" and header["rank"] == 0
    assert [(r["op"], r["seq"], r["state"]) for r in records] == [("all_reduce", 1, "completed")]


def test_a_rank_waiting_in_a_collective_dumps_it_as_not_completed(ranks, tmp_path):
    port = free_port()
    rank0, rank1 = ranks("wait", tmp_path, 0, 2, port), ranks("wait", tmp_path, 1, 2, port)
    _read_until(rank0, "ready")
    _read_until(rank1, "waiting")
    time.sleep(0.5)  # inside the all_reduce's wait by now
    assert _terminate(rank1) == -signal.SIGTERM
    header, records = _dump(tmp_path, 1)
    assert header["reason"] == "rank 1 received SIGTERM"
    assert [(r["op"], r["seq"]) for r in records] == [("all_reduce", 1), ("all_reduce", 2)]
    assert records[0]["state"] == "completed" and records[1]["state"] in ("scheduled", "started")
    # what distcomm.trace makes of it: rank 0's dump is missing (it was not signalled)
    report = trace.analyze(trace.load(str(tmp_path / "trace")))
    assert any(line.startswith("  rank 1 in all_reduce #2 (<string>:") for line in report), report


def test_the_programs_own_handler_still_runs(ranks, tmp_path):
    proc = ranks("user_handler", tmp_path, 0, 1, free_port())
    _read_until(proc, "ready")
    assert _terminate(proc) == 3  # its handler's sys.exit(3)
    assert (tmp_path / "marker").read_text() == "user handler ran\n"
    assert _dump(tmp_path, 0)[0]["reason"] == "rank 0 received SIGTERM"  # dumped first


def test_no_dump_once_the_process_group_is_destroyed(ranks, tmp_path):
    proc = ranks("destroyed", tmp_path, 0, 1, free_port())
    _read_until(proc, "ready")
    assert _terminate(proc) == -signal.SIGTERM
    assert _dump(tmp_path, 0) is None


STRAGGLER = r'''
import os, time
from datetime import timedelta
import numpy as np
import distcomm as dist

dist.init_process_group("gloo", timeout=timedelta(seconds=3))
rank = dist.get_rank()
grad = np.ones(4, dtype=np.float32)
for step in range(4):
    if rank == 2 and step == 2:
        time.sleep(120)  # a straggler, stopped by the launcher long before it wakes
    dist.all_reduce(grad)  # STEP
dist.destroy_process_group()
'''


@pytest.mark.slow
def test_the_straggler_stopped_by_the_launcher_has_its_dump(tmp_path):
    token = f"sigterm-straggler-{secrets.token_hex(6)}"
    script = tmp_path / f"{token}.py"
    script.write_text(STRAGGLER)
    line = next(i for i, text in enumerate(STRAGGLER.splitlines(), 1) if "# STEP" in text)
    env = dict(os.environ, DISTCOMM_TRACE_DIR=str(tmp_path / "trace"), PET_RANK_PREFIX="1")
    env.pop("OMP_NUM_THREADS", None)
    try:
        done = run_in_session([sys.executable, "-m", "distcomm.run", "--standalone", "--nproc-per-node", "3",
                               str(script)], timeout=90, env=env)
    finally:
        deadline = time.monotonic() + 5
        while processes_with(token) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = processes_with(token)
        for pid in left:
            os.kill(pid, signal.SIGKILL)
    assert not left, f"processes of the job outlived it: {left}"
    assert done.returncode == 1, done.stderr[-3000:]
    assert _dump(tmp_path, 2)[0]["reason"] == "rank 2 received SIGTERM"
    report = trace.analyze(trace.load(str(tmp_path / "trace")))
    print("\n".join(report))
    assert f"  rank 2 last completed all_reduce #2 ({script.name}:{line}) and has not started #3" in report
    assert not any("no dump" in text for text in report), report
