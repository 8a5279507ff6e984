"""The harness's own promise: a command run with a deadline is killed whole at it, its output kept."""

from __future__ import annotations

import os
import sys
import time

import pytest

from harness import SessionTimeout, run_in_session


def _gone(pid: int, within: float = 5.0) -> bool:
    """Whether ``pid`` has exited (gone, or a zombie its new parent has not reaped yet)."""
    end = time.monotonic() + within
    while time.monotonic() < end:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def test_a_command_past_its_deadline_is_killed_with_every_process_it_started():
    # a parent that starts a child and waits on it: both must go, and what they wrote is kept
    script = "import subprocess, sys, time\n" \
             "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n" \
             "print(child.pid, flush=True)\n" \
             "child.wait()\n"
    start = time.monotonic()
    with pytest.raises(SessionTimeout) as caught:
        run_in_session([sys.executable, "-c", script], timeout=2.0)
    assert time.monotonic() - start < 30
    assert "killed at its 2.0 s deadline" in str(caught.value)
    child = int(caught.value.stdout.split()[0])
    assert _gone(child), f"the command's child {child} outlived the deadline"


def test_a_command_that_finishes_returns_its_output_and_code():
    done = run_in_session([sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"],
                          timeout=30.0, env=dict(os.environ))
    assert (done.returncode, done.stdout, done.stderr) == (3, "out\n", "err\n")
