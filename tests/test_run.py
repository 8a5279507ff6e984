"""distcomm-run as a user runs it: the real command in a subprocess, with a hard timeout each.

The workers (launcher_scripts/worker.py) meet through the launcher-hosted store using only the
environment contract, then fail as told. Every test that starts workers checks that none of them
(nor the processes they started) is left behind.

Tiers: every launcher run starts a few Python processes (seconds on 2 shared cores), so the fast
tier (``pytest -m "not slow"``) keeps one, the environment contract, and the in-process tests of
options, failure descriptions and output; the other runs are slow.
"""

from __future__ import annotations

import io
import os
import re
import shutil
import signal
import socket
import sys

import pytest

from launcher_scripts.support import (
    SCRIPTS,
    TIMEOUT,
    WORKER,
    assert_no_leftovers,
    free_port,
    launcher_env,
    meets,
    run_launcher,
    start_launcher,
    wait_for_pids,
)

from distcomm._launcher.config import STD_ERR, STD_OUT, LaunchError
from distcomm._launcher.failure import describe_exit, traceback_tail
from distcomm._launcher.output import MAX_LINE, OutputRouter, StreamSink
from distcomm.run import config_from_args, parse_args


def test_workers_meet_with_the_env_contract(tmp_path):
    r = run_launcher(["--standalone", "--nproc-per-node", "2", WORKER, "a", "b"], tmp_path)
    assert r.returncode == 0, r.stderr
    found = meets(r.stdout)
    assert sorted(found) == [0, 1]
    run_ids = set()
    for rank, m in found.items():
        env = m["env"]
        assert env["RANK"] == env["LOCAL_RANK"] == str(rank)
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "2"
        assert env["GROUP_RANK"] == "0"
        assert env["MASTER_ADDR"] == "127.0.0.1" and int(env["MASTER_PORT"]) > 0
        assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True"
        assert env["TORCHELASTIC_RESTART_COUNT"] == "0"
        assert env["DISTCOMM_STORE_PREFIX"] == "/worker/attempt_0"
        assert env["OMP_NUM_THREADS"] == "1"
        assert m["argv"] == ["a", "b"]
        run_ids.add(env["TORCHELASTIC_RUN_ID"])
    assert len(run_ids) == 1 and run_ids.pop()
    assert "[rank0]: done rank 0" in r.stdout and "[rank1]: done rank 1" in r.stdout
    assert "[rank1]: stderr line of rank 1" in r.stderr  # stderr stays stderr, prefixed
    assert len([l for l in r.stderr.splitlines() if "OMP_NUM_THREADS" in l]) == 1  # one-line notice
    assert_no_leftovers(tmp_path, 2)


@pytest.mark.slow
def test_console_script_with_underscored_options(tmp_path):
    exe = shutil.which("distcomm-run") or os.path.join(os.path.dirname(sys.executable), "distcomm-run")
    args = [exe, "--nproc_per_node", "2", "--master_port", "0", "--monitor_interval", "0.05",
            "--max_restarts", "0", WORKER]
    r = run_launcher(None, tmp_path, cmd=args, env=launcher_env(tmp_path, OMP_NUM_THREADS="3"))
    assert r.returncode == 0, r.stderr
    found = meets(r.stdout)
    assert sorted(found) == [0, 1]
    assert found[0]["env"]["OMP_NUM_THREADS"] == "3"  # the user's value is kept, without a notice
    assert "OMP_NUM_THREADS" not in r.stderr
    assert_no_leftovers(tmp_path, 2)


@pytest.mark.slow
def test_output_lines_never_interleave(tmp_path):
    # Each worker writes 400 long lines in 37-byte fragments; the console must show whole lines.
    r = run_launcher(["--standalone", "--nproc-per-node", "2", WORKER, "--no-meet", "--lines", "400"], tmp_path)
    assert r.returncode == 0, r.stderr
    pattern = re.compile(r"^\[rank(\d)\]: line (\d+) of rank (\d) x+ end$")
    seen = {0: [], 1: []}
    for line in r.stdout.splitlines():
        if "done rank" in line:
            continue
        m = pattern.match(line)
        assert m and m.group(1) == m.group(3), f"mangled line: {line[:120]!r}"
        seen[int(m.group(1))].append(int(m.group(2)))
    assert seen == {0: list(range(400)), 1: list(range(400))}


@pytest.mark.slow
def test_worker_exception_summary_and_cleanup(tmp_path):
    # Rank 1 raises; rank 0 (which started a grandchild process) would hang: it must be stopped.
    r = run_launcher(
        ["--standalone", "--nproc-per-node", "2", WORKER, "--fail-rank", "1", "--others", "hang", "--grandchild"],
        tmp_path,
    )
    assert r.returncode == 1
    summary = r.stderr[r.stderr.index("Root cause"):]
    assert re.search(r"rank\s+: 1 \(local_rank 1 on node 0\)", summary)
    assert re.search(r"exit\s+: exit code 1", summary)
    assert re.search(r"pid\s+: \d+", summary) and re.search(r"host\s+: \S+", summary)
    assert re.search(r"time\s+: \d{4}-\d\d-\d\d \d\d:\d\d:\d\d", summary)
    assert "Traceback (most recent call last):" in summary
    assert 'raise ValueError(f"boom from rank {rank}")' in summary
    assert "    ValueError: boom from rank 1" in summary
    assert "Stopped by the launcher: rank 0" in summary
    assert "[rank0]: got signal 15" in r.stdout  # SIGTERM first: it could clean up
    assert_no_leftovers(tmp_path, 4)  # 2 workers + 2 grandchildren


@pytest.mark.slow
def test_sigkilled_worker_and_sigterm_ignoring_peer(tmp_path):
    pids, shm = tmp_path / "pids", tmp_path / "shm"
    pids.mkdir()
    shm.mkdir()
    (shm / "distcomm-otherrun-0-x").write_bytes(b"")  # another job's segment: must stay
    r = run_launcher(
        ["--standalone", "--nproc-per-node", "2", "--shutdown-timeout", "1", "--rdzv-id", "killed",
         WORKER, "--fail-rank", "0", "--how", "sigkill", "--others", "ignore-term", "--leave-shm"],
        env=launcher_env(pids, DISTCOMM_SHM_DIR=str(shm)),
    )
    assert r.returncode == 1
    assert "SIGKILL (-9) — possibly the out-of-memory killer" in r.stderr
    assert re.search(r"rank\s+: 0 \(local_rank 0", r.stderr)
    assert "did not raise a Python exception" in r.stderr
    assert "stderr line of rank 0" in r.stderr[r.stderr.index("Root cause"):]  # no traceback: stderr tail
    assert "Stopped by the launcher: rank 1" in r.stderr  # SIGKILLed after ignoring SIGTERM
    assert_no_leftovers(pids, 2)
    assert os.listdir(shm) == ["distcomm-otherrun-0-x"]  # the killed workers' segments were unlinked


@pytest.mark.slow
def test_restarts_use_a_fresh_round(tmp_path):
    # Rank 1 fails in rounds 0 and 1; round 2 succeeds. A worker seeing stale keys would raise.
    r = run_launcher(
        ["--standalone", "--nproc-per-node", "2", "--max-restarts", "2", "--shutdown-timeout", "5",
         WORKER, "--fail-rank", "1", "--fail-attempts", "2", "--others", "hang"],
        tmp_path,
    )
    assert r.returncode == 0, r.stderr
    assert "restarting the worker group (restart 1 of 2)" in r.stderr
    assert "restarting the worker group (restart 2 of 2)" in r.stderr
    last = meets(r.stdout)
    assert {m["env"]["TORCHELASTIC_RESTART_COUNT"] for m in last.values()} == {"2"}
    assert {m["env"]["DISTCOMM_STORE_PREFIX"] for m in last.values()} == {"/worker/attempt_2"}
    assert "stale keys" not in r.stdout + r.stderr
    assert_no_leftovers(tmp_path, 6)


@pytest.mark.slow
def test_restarts_exhausted(tmp_path):
    r = run_launcher(
        ["--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
         WORKER, "--no-meet", "--fail-rank", "1", "--how", "exit"],
        tmp_path,
    )
    assert r.returncode == 1
    assert "restart 1 of 1" in r.stderr
    assert "FAILED after 2 attempts" in r.stderr
    assert re.search(r"exit\s+: exit code 3", r.stderr)
    assert_no_leftovers(tmp_path, 4)


@pytest.mark.slow
def test_port_in_use_names_the_port_and_the_fix(tmp_path):
    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = run_launcher(["--nproc-per-node", "2", "--master-port", port, WORKER], tmp_path)
    assert r.returncode == 1
    assert f"127.0.0.1:{port}" in r.stderr
    assert "--standalone" in r.stderr and "--master-port 0" in r.stderr
    assert "Traceback" not in r.stderr
    assert not os.listdir(tmp_path)  # no worker was started


def _two_nodes(tmp_path, worker_args, extra=()):
    port = free_port()
    common = ["--nnodes", "2", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
              "--master-port", port, *extra]
    node0 = start_launcher([*common, "--node-rank", "0", WORKER, *worker_args], tmp_path)
    try:
        node1 = run_launcher([*common, "--node-rank", "1", WORKER, *worker_args], tmp_path)
        out0, err0 = node0.communicate(timeout=TIMEOUT)
    finally:
        if node0.poll() is None:
            node0.kill()
            node0.communicate()
    return (node0.returncode, out0, err0), (node1.returncode, node1.stdout, node1.stderr)


@pytest.mark.slow
def test_two_launchers_form_one_job(tmp_path):
    (rc0, out0, err0), (rc1, out1, err1) = _two_nodes(tmp_path, [])
    assert rc0 == 0, err0
    assert rc1 == 0, err1
    m0, m1 = meets(out0), meets(out1)
    assert sorted(m0) == [0, 1] and sorted(m1) == [2, 3]
    for rank, m in {**m0, **m1}.items():
        env = m["env"]
        assert env["WORLD_SIZE"] == "4" and env["LOCAL_WORLD_SIZE"] == "2"
        assert env["GROUP_RANK"] == str(rank // 2) and env["LOCAL_RANK"] == str(rank % 2)
        assert m["nodes"] == ["0", "0", "1", "1"]  # every rank saw all four in one store
    assert m0[0]["env"]["TORCHELASTIC_RUN_ID"] == m1[3]["env"]["TORCHELASTIC_RUN_ID"]
    assert_no_leftovers(tmp_path, 4)


@pytest.mark.slow
def test_failure_on_one_node_stops_both(tmp_path):
    (rc0, out0, err0), (rc1, out1, err1) = _two_nodes(
        tmp_path, ["--fail-rank", "3", "--others", "hang"], extra=["--shutdown-timeout", "5"]
    )
    assert rc0 == 1 and rc1 == 1
    for err in (err0, err1):  # both launchers name the same root cause, with its traceback
        assert re.search(r"rank\s+: 3 \(local_rank 1 on node 1\)", err), err
        assert "ValueError: boom from rank 3" in err[err.index("Root cause"):]
    assert "[rank0]: got signal 15" in out0
    assert_no_leftovers(tmp_path, 4)


@pytest.mark.slow
def test_losing_node_rank_0_stops_the_other_node(tmp_path):
    # Node rank 0's launcher (the store's host) is SIGKILLed: its workers die with it, and node
    # rank 1's launcher notices the store is gone, stops its workers and exits non-zero.
    port = free_port()
    common = ["--nnodes", "2", "--nproc-per-node", "1", "--master-port", port, "--shutdown-timeout", "5",
              WORKER, "--no-meet", "--fail-rank", "9", "--others", "hang"]
    node0 = start_launcher(["--node-rank", "0", *common], tmp_path)
    node1 = start_launcher(["--node-rank", "1", *common], tmp_path)
    try:
        wait_for_pids(tmp_path, 2)
        node0.kill()
        out, err = node1.communicate(timeout=TIMEOUT)
    finally:
        for launcher in (node0, node1):
            if launcher.poll() is None:
                launcher.kill()
            launcher.communicate()
    assert node1.returncode == 1
    assert f"127.0.0.1:{port}" in err and "the --node-rank 0 launcher is gone" in err
    assert_no_leftovers(tmp_path, 2)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_to_launcher_is_forwarded_and_cleanup_hooks_run(tmp_path, sig):
    pids, hook_log = tmp_path / "pids", tmp_path / "hooks.log"
    pids.mkdir()
    env = launcher_env(
        pids,
        PYTHONPATH=os.pathsep.join([os.path.dirname(SCRIPTS), os.environ.get("PYTHONPATH", "")]),
        DISTCOMM_RUN_CLEANUP_HOOKS="launcher_scripts.cleanup_hook:record",
        TEST_HOOK_LOG=str(hook_log),
    )
    launcher = start_launcher(
        ["--standalone", "--nproc-per-node", "2", "--rdzv-id", "sigjob",
         WORKER, "--no-meet", "--fail-rank", "9", "--others", "hang"],
        env=env,
    )
    try:
        wait_for_pids(pids, 2)
        launcher.send_signal(sig)
        out, err = launcher.communicate(timeout=TIMEOUT)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 128 + sig
    assert f"received {sig.name}" in err
    assert out.count(f"got signal {int(sig)}") == 2  # the launcher forwarded the same signal
    assert hook_log.read_text() == "sigjob 0\n"  # the shared-memory cleanup hook point ran
    assert_no_leftovers(pids, 2)


@pytest.mark.slow
def test_sigkilled_launcher_leaves_no_orphans(tmp_path):
    launcher = start_launcher(
        ["--standalone", "--nproc-per-node", "2", WORKER, "--no-meet", "--fail-rank", "9", "--others", "hang"],
        tmp_path,
    )
    try:
        wait_for_pids(tmp_path, 2)
        launcher.kill()
        launcher.communicate(timeout=TIMEOUT)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert_no_leftovers(tmp_path, 2)


@pytest.mark.slow
def test_redirects_tee_and_log_dir(tmp_path):
    logs, pids = tmp_path / "logs", tmp_path / "pids"
    pids.mkdir()
    r = run_launcher(
        ["--standalone", "--nproc-per-node", "2", "--log-dir", logs, "--redirects", "3", "--tee", "0:2",
         "--rdzv-id", "myjob", WORKER],
        pids,
    )
    assert r.returncode == 0, r.stderr
    assert "meet" not in r.stdout  # stdout redirected to files only
    # rank 0's stderr is teed: torchrun's tee header [<role><local_rank>]: (was "[rank0]: ...")
    assert "[default0]:stderr line of rank 0" in r.stderr
    assert "stderr line of rank 1" not in r.stderr  # rank 1's stderr: redirected only
    (run_dir,) = logs.glob("myjob_*")  # torchrun's <run_id>_<random> (was <log-dir>/myjob)
    attempt = run_dir / "attempt_0"
    assert "meet" in (attempt / "0" / "stdout.log").read_text()
    assert (attempt / "0" / "stderr.log").read_text() == "stderr line of rank 0\n"
    assert "meet" in (attempt / "1" / "stdout.log").read_text()
    assert (attempt / "1" / "stderr.log").read_text() == "stderr line of rank 1\n"
    assert "worker logs in" in r.stderr


@pytest.mark.slow
def test_module_mode_and_nproc_auto(tmp_path):
    r = run_launcher(["--standalone", "--nproc-per-node", "auto", "-m", "worker", "x", "--", "y"], tmp_path, cwd=SCRIPTS)
    assert r.returncode == 0, r.stderr
    found = meets(r.stdout)
    assert len(found) == len(os.sched_getaffinity(0))
    assert found[0]["argv"] == ["x", "--", "y"]


@pytest.mark.slow
def test_no_python(tmp_path):
    script = os.path.join(SCRIPTS, "rank_echo.sh")
    r = run_launcher(["--standalone", "--nproc-per-node", "2", "--no-python", script, "hi"], tmp_path)
    assert r.returncode == 0, r.stderr
    assert "[rank1]: shell rank 1 of 2 local 1 args hi" in r.stdout


@pytest.mark.slow
def test_missing_program_is_a_worker_failure(tmp_path):
    r = run_launcher(["--standalone", "--no-python", str(tmp_path / "nope")], tmp_path)
    assert r.returncode == 1
    assert "cannot execute" in r.stderr and re.search(r"exit\s+: exit code 127", r.stderr)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--nproc-per-node", "0", "x.py"], "at least 1"),
        (["--nproc-per-node", "many", "x.py"], "'auto'"),
        (["--nnodes", "1:4", "x.py"], "elastic"),
        (["--nnodes", "2", "--node-rank", "2", "x.py"], "out of range"),
        (["--standalone", "--nnodes", "2", "x.py"], "single-node"),
        (["--no-python", "-m", "x"], "cannot be used together"),
        (["--redirects", "0:9", "x.py"], "0 (none)"),
        (["--rdzv-backend", "etcd", "x.py"], "static"),
        (["--nnodes", "2", "--node-rank", "1", "--master-port", "0", "x.py"], "node rank 0"),
    ],
)
def test_bad_options(argv, message):
    with pytest.raises(LaunchError, match=re.escape(message)):
        config_from_args(parse_args(argv))


def test_option_spellings_and_defaults(monkeypatch):
    monkeypatch.setenv("PET_MAX_RESTARTS", "4")
    c = config_from_args(parse_args([
        "--nproc_per_node=3", "--nnodes=2:2", "--node_rank=1", "--master_addr=10.0.0.1",
        "--master_port=1234", "-r", "3", "--tee=0:1", "--local_ranks_filter=0,2", "train.py", "--lr", "1",
    ]))
    assert (c.nproc_per_node, c.nnodes, c.node_rank) == (3, 2, 1)
    assert (c.master_addr, c.master_port, c.max_restarts) == ("10.0.0.1", 1234, 4)
    assert c.redirects == {0: 3, 1: 3, 2: 3} and c.tee == {0: 1}
    assert c.local_ranks_filter == {0, 2}
    assert c.entrypoint == [sys.executable, "-u", "train.py"] and c.args == ["--lr", "1"]
    c = config_from_args(parse_args(["--rdzv-endpoint", "host1:555", "--standalone", "t.py"]))
    assert (c.master_addr, c.master_port) == ("127.0.0.1", 0)  # --standalone wins
    c = config_from_args(parse_args(["--rdzv_endpoint", "host1:555", "t.py"]))
    assert (c.master_addr, c.master_port) == ("host1", 555)


def test_exit_descriptions():
    assert describe_exit(1) == "exit code 1"
    assert describe_exit(-9) == "SIGKILL (-9) — possibly the out-of-memory killer (see dmesg)"
    assert describe_exit(-11) == "signal SIGSEGV (-11)"
    assert "128+SIGKILL" in describe_exit(137)


def test_traceback_tail_keeps_the_whole_chain():
    lines = ["noise", "Traceback (most recent call last):", '  File "a.py", line 1', "KeyError: 1", "",
             "During handling of the above exception, another exception occurred:", "",
             "Traceback (most recent call last):", '  File "a.py", line 3', "ValueError: 2", ]
    assert traceback_tail(lines) == lines[1:]
    assert traceback_tail(["just", "output"]) == []
    long = ["Traceback (most recent call last):"] + [f"  frame {i}" for i in range(100)] + ["E: x"]
    tail = traceback_tail(long, max_lines=10)
    assert tail[0] == "  ..." and tail[-1] == "E: x" and len(tail) == 11


def test_stream_sink_and_router(tmp_path):
    out, err = io.BytesIO(), io.BytesIO()
    router = OutputRouter({1: STD_OUT}, {0: STD_ERR}, str(tmp_path), ranks_filter={0, 1}, stdout=out, stderr=err,
                          rank_prefix=True)
    o0, e0 = router.sinks(0, 4, str(tmp_path))
    o1, e1 = router.sinks(1, 5, str(tmp_path))
    o2, _ = OutputRouter({}, {}, None, ranks_filter={0}, stdout=out, stderr=err).sinks(2, 6, None)
    for chunk in (b"ab", b"c\nde", b"f\ng"):
        o0.feed(chunk)
    o0.close()  # the last line has no newline: still a line
    o1.feed(b"to file only\n")
    o2.feed(b"filtered out\n")
    e0.feed(b"teed\n")
    for sink in (o1, e0, e1):
        sink.close()
    assert out.getvalue() == b"[rank4]: abc\n[rank4]: def\n[rank4]: g\n"
    assert err.getvalue() == b"[default0]:teed\n"  # torchrun's tee header (was "[rank4]: teed")
    assert (tmp_path / "1" / "stdout.log").read_bytes() == b"to file only\n"
    assert (tmp_path / "0" / "stderr.log").read_bytes() == b"teed\n"
    assert not (tmp_path / "0" / "stdout.log").exists()
    assert o0.tail_text() == ["abc", "def", "g"]
    big = StreamSink(None, b"", None)
    big.feed(b"x" * (MAX_LINE + 10))  # a line that never ends is cut, not buffered forever
    assert len(big.tail) == 1
