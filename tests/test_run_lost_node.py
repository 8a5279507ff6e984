"""A launcher that vanishes (SIGKILL) while the job is still on: node rank 0's launcher must notice,
name the lost node and exit 1 in bounded time, and nothing may be left behind.

Two real launchers on this machine (``--nnodes 2``: node 0 with two workers, node 1 with one); node
1's launcher gets a real SIGKILL while every worker idles. Node 1's workers die with their launcher
(its watchdog); node 0's launcher learns of it from node 1's missing heartbeats, which the tests
make short (torchrun's ``--rdzv-conf keep_alive_interval=..,keep_alive_max_attempt=..``).

- the workers of node 0 then finish with exit code 0: node 0's launcher must not wait for node 1's
  success forever (it used to), and must still say that the job did not complete;
- the workers of node 0 are still running when the loss is found: node 0 stops them, as it would
  after a failed worker.

Every launcher runs in a session of its own with a hard deadline that kills it (tests/harness.py's
``run_in_session``); a SIGKILLed launcher's watchdog kills its workers, and the test checks that
every worker and every watchdog is gone.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time

import pytest

from harness import SessionTimeout, run_in_session
from launcher_scripts.support import assert_no_leftovers, command, free_port, launcher_env, wait_for_pids

from distcomm._launcher.config import LaunchError
from distcomm.run import config_from_args, parse_args

DEADLINE = 40.0  # hard limit on each launcher; a passing test takes well under half of it

# Records "worker.<pid>" (its launcher's pid inside) in TEST_PID_DIR, then idles until TEST_GO exists.
IDLE_WORKER = r"""
import os, sys, time
with open(os.path.join(os.environ["TEST_PID_DIR"], f"worker.{os.getpid()}"), "w") as f:
    f.write(str(os.getppid()))
deadline = time.monotonic() + 60
while not os.path.exists(os.environ["TEST_GO"]):
    if time.monotonic() > deadline:
        sys.exit(2)
    time.sleep(0.02)
print(f"rank {os.environ['RANK']} done", flush=True)
"""


def _children(parents: set[int]) -> set[int]:
    """The live processes whose parent is one of ``parents`` (a launcher's workers and watchdog)."""
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                parent = int(f.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if parent in parents:
            found.add(int(entry))
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.parametrize("workers", ["finish", "keep-running"])
def test_node_0_launcher_exits_when_another_launcher_is_killed(tmp_path, workers):
    pids = tmp_path / "pids"
    pids.mkdir()
    go = tmp_path / "go"
    script = tmp_path / "idle_worker.py"
    script.write_text(IDLE_WORKER)
    # "finish": node 0's workers exit right after the kill, long before node 1 counts as lost
    interval, attempts = 1, (8 if workers == "finish" else 3)
    env = launcher_env(pids, TEST_GO=str(go))
    common = ["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", free_port(),
              "--rdzv-conf", f"keep_alive_interval={interval},keep_alive_max_attempt={attempts}",
              "--shutdown-timeout", "5"]

    outcome: dict = {}

    def run_node0():
        cmd = command([*common, "--node-rank", "0", "--nproc-per-node", "2", script])
        try:
            outcome["result"] = run_in_session(cmd, DEADLINE, env=env)
        except SessionTimeout as exc:
            outcome["timeout"] = exc

    node0 = threading.Thread(target=run_node0, name="node0-launcher")
    node0.start()
    node1 = subprocess.Popen(command([*common, "--node-rank", "1", "--nproc-per-node", "1", script]), env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    watched: set[int] = set()
    try:
        worker_pids = wait_for_pids(pids, 3, timeout=DEADLINE / 2)
        launchers = {int((pids / f"worker.{p}").read_text()) for p in worker_pids}
        assert node1.pid in launchers and len(launchers) == 2, (launchers, node1.pid)
        watched = set(worker_pids) | _children(launchers)  # the workers and both watchdogs

        node1.kill()  # a real SIGKILL of node 1's launcher, its worker idle
        node1.communicate(timeout=DEADLINE)
        killed = time.monotonic()
        if workers == "finish":
            go.touch()
        node0.join(DEADLINE + 10)
        elapsed = time.monotonic() - killed
    finally:
        if node1.poll() is None:
            os.killpg(node1.pid, 9)
            node1.communicate()
        if node0.is_alive():  # only if run_in_session itself is stuck: its deadline kills the launcher
            node0.join(DEADLINE + 10)

    assert node1.returncode == -9
    if "timeout" in outcome:
        exc = outcome["timeout"]
        pytest.fail(f"node 0's launcher was still running {DEADLINE} s after it started; it never "
                    f"noticed node 1's launcher was gone\nstdout:\n{exc.stdout}\nstderr:\n{exc.stderr}")
    r = outcome["result"]
    assert r.returncode == 1, f"node 0's launcher exited {r.returncode}\n{r.stdout}\n{r.stderr}"
    assert "lost node 1 (rank 2)" in r.stderr and "heartbeat" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    # found within interval * attempts (plus polling and the workers' stop) of node 1's last beat
    assert elapsed < interval * attempts + 8, f"node 0's launcher took {elapsed:.1f} s after the kill\n{r.stderr}"
    if workers == "finish":  # its own workers succeeded: it waited for node 1 and gave up on it
        assert "[rank0]: rank 0 done" in r.stdout and "[rank1]: rank 1 done" in r.stdout, r.stdout
    else:  # stopped, as after a failed worker, without a restart
        assert "done" not in r.stdout, r.stdout
    assert_no_leftovers(pids, 3)
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in watched) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in watched if _alive(p)], f"left behind: {[p for p in watched if _alive(p)]}"


def test_keep_alive_settings_are_torchruns_rdzv_conf_keys():
    def config(conf):
        return config_from_args(parse_args(["--nnodes", "2", "--node-rank", "0", "--rdzv-conf", conf, "x.py"]))

    c = config("")
    assert (c.keep_alive_interval, c.keep_alive_max_attempt) == (5.0, 3)  # torchrun's defaults
    c = config("join_timeout=60,keep_alive_interval=0.5,keep_alive_max_attempt=4")
    assert (c.join_timeout, c.keep_alive_interval, c.keep_alive_max_attempt) == (60.0, 0.5, 4)
    for bad in ("keep_alive_interval=0", "keep_alive_interval=soon", "keep_alive_interval=inf",
                "keep_alive_max_attempt=0", "keep_alive_max_attempt=2.5"):
        with pytest.raises(LaunchError, match=bad.split("=")[0]):
            config(bad)
