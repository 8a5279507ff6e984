"""Helpers of the launcher tests: run the real commands as subprocesses, check nothing is left behind."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

SCRIPTS = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(SCRIPTS, "worker.py")
TIMEOUT = 60  # hard limit on every launcher subprocess


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launcher_env(pid_dir=None, **extra) -> dict:
    env = dict(os.environ)
    env.pop("OMP_NUM_THREADS", None)
    env.pop("PYTHONUNBUFFERED", None)
    # the tests tell workers' lines apart by rank: ask for distcomm-run's rank prefix (torchrun's
    # default, unprefixed output is checked in test_launcher_parity.py with PET_RANK_PREFIX=0)
    env["PET_RANK_PREFIX"] = "1"
    if pid_dir is not None:
        env["TEST_PID_DIR"] = str(pid_dir)
    env.update(extra)
    return env


def command(args, module="distcomm.run") -> list[str]:
    return [sys.executable, "-m", module, *map(str, args)]


def run_launcher(args, pid_dir=None, module="distcomm.run", cmd=None, timeout=TIMEOUT, **kw):
    """Run a launcher to completion (killed at ``timeout``): CompletedProcess with text output."""
    return subprocess.run(
        cmd or command(args, module),
        env=kw.pop("env", None) or launcher_env(pid_dir),
        capture_output=True,
        text=True,
        timeout=timeout,
        **kw,
    )


def start_launcher(args, pid_dir=None, module="distcomm.run", **kw) -> subprocess.Popen:
    return subprocess.Popen(
        command(args, module),
        env=kw.pop("env", None) or launcher_env(pid_dir),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kw,
    )


def meets(stdout: str) -> dict[int, dict]:
    """The ``meet`` line of each rank, by rank (the last one, after restarts)."""
    found = {}
    for line in stdout.splitlines():
        head, sep, rest = line.partition(": meet ")
        if sep:
            found[int(head[len("[rank"):-1])] = json.loads(rest)
    return found


def recorded_pids(pid_dir, tag=None) -> list[int]:
    return [
        int(name.rsplit(".", 1)[1])
        for name in os.listdir(pid_dir)
        if tag is None or name.startswith(tag + ".")
    ]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def wait_for_pids(pid_dir, count: int, timeout: float = 30.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = recorded_pids(pid_dir)
        if len(pids) >= count:
            return pids
        time.sleep(0.05)
    raise AssertionError(f"only {recorded_pids(pid_dir)} of {count} processes started within {timeout} s")


def assert_no_leftovers(pid_dir, expected_at_least: int = 1, timeout: float = 5.0) -> None:
    """Every process recorded in ``pid_dir`` is gone (a short wait: init reaps reparented ones)."""
    pids = recorded_pids(pid_dir)
    assert len(pids) >= expected_at_least, f"expected at least {expected_at_least} pid files, got {pids}"
    deadline = time.monotonic() + timeout
    while True:
        alive = [p for p in pids if _alive(p)]
        if not alive:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"processes left behind: {alive}")
        time.sleep(0.05)
