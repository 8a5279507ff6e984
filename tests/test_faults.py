"""The fault suite: real processes, real signals, hard deadlines.

Each test injects one fault and checks what the survivors see: the error's type, its message
(operation, sequence number, this rank, the rank at fault, what to do), how long it took (against a
timeout far longer, so a late detection shows up as a timeout error, not as a flaky timing), and
that no process or shared-memory segment is left behind. The faults:

* a rank SIGKILLed while the others wait on someone else (TCP at 4 KiB and 64 MiB, shared memory),
  and a rank that leaves without destroy_process_group (not a crash);
* a rank SIGKILLed during a 64 MiB shared-memory all_reduce (process_vm_readv of a dying peer);
* a rank SIGKILLed during 64 MiB broadcasts and gathers that write into it (process_vm_writev);
* ranks passing different roots to broadcast, reduce, gather and scatter, on both engines;
* a full shared-memory directory (a 4 MiB tmpfs mounted for the test; skipped unless root);
* monitored_barrier's error; the shm engine refusing ranks on two hosts;
* init: world size disagreement, duplicate rank, a file:// file left by a failed or killed init;
* the launcher: SIGKILLed with workers that started grandchildren; SIGUSR1 for stacks.

Timing: a dead rank must be noticed within about a second; the worlds here use a 60 s timeout and
the tests accept anything under 10 s, so contention on a shared machine does not make them flaky
while waiting out the timeout still fails them. Every test here starts processes: all are slow.
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import tempfile

import pytest

from harness import run_world

TIMEOUT_S = 60  # the worlds' own timeout: never what ends a test here
PROMPT_S = 10  # a dead rank must be noticed well before TIMEOUT_S
INIT_PROMPT_S = 20  # init includes TCPStore clients' connection retries (backoff) while the master starts


def no_children_left():
    """Every process a test started is gone (run_world kills and joins its world)."""
    alive = [p for p in multiprocessing.active_children()]
    assert alive == [], f"processes left running: {alive}"


# -- a rank SIGKILLed while the others wait on someone else ------------------------------------------
def _kill_self_later(delay: float, stamp: str) -> None:
    """Start a thread that SIGKILLs this process after ``delay`` s, first writing the time (CLOCK_MONOTONIC
    is system-wide, so the survivors can measure from it)."""
    import signal
    import threading
    import time

    def kill():
        time.sleep(delay)
        with open(stamp + ".tmp", "w") as f:
            f.write(repr(time.monotonic()))
        os.rename(stamp + ".tmp", stamp)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=kill, daemon=True).start()


def _since_kill(stamp: str) -> float:
    import time

    with open(stamp) as f:
        return time.monotonic() - float(f.read())


def dead_bystander_body(rank, world, backend, nbytes, stamp):
    """Rank 1 is late; rank 2 enters the collective and is SIGKILLed 1 s later, so rank 0 is waiting
    on the live rank 1 (or has nobody left to hear from but rank 1) when rank 2 dies."""
    import time
    from datetime import timedelta

    import numpy as np

    import distcomm as dist

    dist.init_process_group(backend, timeout=timedelta(seconds=TIMEOUT_S))
    dist.barrier()
    x = np.ones(nbytes // 4, dtype=np.float32)
    if rank == 2:
        _kill_self_later(1.0, stamp)
    if rank == 1:
        time.sleep(4.0)
    out = []
    for op in ("all_reduce", "barrier"):  # the first op fails; the next fails at once too
        start = time.monotonic()
        try:
            dist.all_reduce(x) if op == "all_reduce" else dist.barrier()
            out.append((op, "no error", "", 0.0, 0.0))
        except RuntimeError as exc:
            out.append((op, type(exc).__name__, str(exc), time.monotonic() - start, _since_kill(stamp)))
    if rank == 2:
        time.sleep(60)  # the kill comes first
    # stay until the other survivor is done too, so it sees one lost rank, not this one leaving
    open(f"{stamp}.done{rank}", "w").close()
    while not all(os.path.exists(f"{stamp}.done{q}") for q in (0, 1)):
        time.sleep(0.05)
    return out


@pytest.mark.slow
@pytest.mark.parametrize(
    "backend,nbytes",
    [("tcp", 4096), ("tcp", 64 << 20), ("shm", 4096)],
    ids=["tcp-4KiB", "tcp-64MiB", "shm-4KiB"],
)
def test_dead_rank_is_known_to_every_rank_of_its_group(backend, nbytes, seg_dir, tmp_path):
    stamp = str(tmp_path / "killed_at")
    results = run_world(dead_bystander_body, 3, args=(backend, nbytes, stamp), timeout=90,
                        env={"DISTCOMM_SHM_DIR": seg_dir}, expect_failure=[2])
    assert "process exited" in results[2], results[2]  # SIGKILLed before reporting
    for rank in (0, 1):
        (op1, kind1, msg1, _, since1), (op2, kind2, msg2, took2, _) = results[rank]
        assert kind1 == "PeerLostError", (rank, kind1, msg1)
        assert "all_reduce #" in msg1 and f"on rank {rank}" in msg1 and "rank 2" in msg1, msg1
        assert since1 < PROMPT_S, (rank, since1, msg1)  # about 1 s, not the 60 s timeout
        # the next operation on the same group fails at once, naming the same dead rank
        assert kind2 == "PeerLostError", (rank, kind2, msg2)
        assert "barrier #" in msg2 and "rank 2" in msg2, msg2
        assert took2 < PROMPT_S, (rank, took2, msg2)
    no_children_left()


def early_exit_body(rank, world):
    """Rank 2 leaves without destroy_process_group; ranks 0 and 1 go on in a group of their own."""
    import time

    import numpy as np

    import distcomm as dist

    dist.init_process_group("tcp")
    pair = dist.new_group([0, 1])
    dist.barrier()
    if rank == 2:
        return "left"
    time.sleep(1.0)  # rank 2 is gone by now
    x = np.ones(4)
    dist.all_reduce(x, group=pair)  # a group without rank 2 is not affected
    start = time.monotonic()
    try:
        dist.barrier()
    except RuntimeError as exc:
        return float(x[0]), type(exc).__name__, str(exc), time.monotonic() - start
    return float(x[0]), "no error", "", 0.0


@pytest.mark.slow
def test_a_rank_that_exits_without_destroy_is_not_taken_for_a_crash():
    results = run_world(early_exit_body, 3, timeout=60)
    for rank in (0, 1):
        total, kind, msg, took = results[rank]
        assert total == 2.0
        assert kind == "PeerLostError" and "rank 2" in msg, (rank, kind, msg)
        assert "closed" in msg and "is gone" not in msg, msg  # its transport said GOODBYE at exit
        assert took < PROMPT_S
    no_children_left()


# -- a rank SIGKILLed during a 64 MiB shared-memory all_reduce ----------------------------------------
def killed_during_large_shm_body(rank, world, stamp, delay):
    from datetime import timedelta

    import numpy as np

    import distcomm as dist

    dist.init_process_group("shm", timeout=timedelta(seconds=TIMEOUT_S))
    x = np.ones(16 << 20, dtype=np.float32)  # 64 MiB: the single-copy (process_vm_readv) algorithms
    dist.all_reduce(x)
    if rank == world - 1:
        _kill_self_later(delay, stamp)
    try:
        for _ in range(200):
            dist.all_reduce(x)
    except Exception as exc:  # noqa: BLE001 - the type is what is checked
        return type(exc).__name__, str(exc), _since_kill(stamp)
    return "no error", "", 0.0


@pytest.mark.slow
@pytest.mark.parametrize("delay", [0.05, 0.2, 0.5])
def test_rank_killed_during_large_shm_all_reduce(delay, seg_dir, tmp_path):
    stamp = str(tmp_path / "killed_at")
    world = 3
    results = run_world(killed_during_large_shm_body, world, args=(stamp, delay), timeout=120,
                        env={"DISTCOMM_SHM_DIR": seg_dir}, expect_failure=[world - 1])
    for rank in range(world - 1):
        kind, msg, since = results[rank]
        # never a bare ProcessLookupError/OSError from process_vm_readv
        assert kind == "PeerLostError", (rank, kind, msg)
        assert "all_reduce #" in msg and f"on rank {rank}" in msg and f"rank {world - 1}" in msg, msg
        assert since < PROMPT_S, (rank, since, msg)
    no_children_left()


def killed_during_large_writes_body(rank, world, stamp, delay, op):
    """As above, through the algorithms where ranks write into a peer (process_vm_writev): 64 MiB
    broadcasts at two ranks ("broadcast_split": the root writes into the reader) or 64 MiB gathers
    at the last rank, which dies ("gather_writev": every peer writes into it)."""
    from datetime import timedelta

    import numpy as np

    import distcomm as dist

    dist.init_process_group("shm", timeout=timedelta(seconds=TIMEOUT_S))
    n = 16 << 20
    root = world - 1
    if op == "broadcast":
        x = np.ones(n, dtype=np.float32)
        call = lambda: dist.broadcast(x, src=0)  # noqa: E731
    else:
        mine = np.ones(n // world, dtype=np.float32)
        outs = [np.empty_like(mine) for _ in range(world)] if rank == root else None
        call = lambda: dist.gather(mine, outs, dst=root)  # noqa: E731
    call()
    if rank == world - 1:
        _kill_self_later(delay, stamp)
    try:
        for _ in range(400):
            call()
    except Exception as exc:  # noqa: BLE001 - the type is what is checked
        return type(exc).__name__, str(exc), _since_kill(stamp)
    return "no error", "", 0.0


@pytest.mark.slow
@pytest.mark.parametrize("op, world", [("broadcast", 2), ("gather", 3)])
@pytest.mark.parametrize("delay", [0.05, 0.3])
def test_rank_killed_during_large_shm_writes(op, world, delay, seg_dir, tmp_path):
    stamp = str(tmp_path / "killed_at")
    results = run_world(killed_during_large_writes_body, world, args=(stamp, delay, op), timeout=120,
                        env={"DISTCOMM_SHM_DIR": seg_dir}, expect_failure=[world - 1])
    for rank in range(world - 1):
        kind, msg, since = results[rank]
        # never a bare OSError from process_vm_writev, nor an error naming a pid rather than the rank
        assert kind == "PeerLostError", (rank, kind, msg)
        assert f"{op} #" in msg and f"on rank {rank}" in msg and f"rank {world - 1}" in msg, msg
        assert since < PROMPT_S, (rank, since, msg)
    no_children_left()


# -- ranks that disagree on the root ---------------------------------------------------------------
def root_mismatch_body(rank, world, backend, op):
    from datetime import timedelta

    import numpy as np

    import distcomm as dist

    dist.init_process_group(backend, timeout=timedelta(seconds=TIMEOUT_S))
    root = rank  # every rank believes it is the root
    x = np.full(1024, rank, dtype=np.float32)
    try:
        if op == "broadcast":
            dist.broadcast(x, src=root)
        elif op == "reduce":
            dist.reduce(x, dst=root)
        elif op == "gather":
            dist.gather(x, [np.empty_like(x) for _ in range(world)], dst=root)
        else:
            dist.scatter(x, [np.full_like(x, q) for q in range(world)], src=root)
    except RuntimeError as exc:
        return type(exc).__name__, str(exc)
    finally:
        pass
    return "no error", ""


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["tcp", "shm"])
@pytest.mark.parametrize("op", ["broadcast", "reduce", "gather", "scatter"])
def test_different_roots_raise_mismatch_on_both_ranks(backend, op, seg_dir):
    what = "src" if op in ("broadcast", "scatter") else "dst"
    results = run_world(root_mismatch_body, 2, args=(backend, op), timeout=60, env={"DISTCOMM_SHM_DIR": seg_dir})
    for rank, (kind, msg) in enumerate(results):
        assert kind == "CollectiveMismatchError", (rank, kind, msg)
        assert f"{op} #1 on rank {rank}" in msg, msg
        assert f"{what}={rank}" in msg and f"rank {1 - rank} with {what}={1 - rank}" in msg, msg
    no_children_left()


def three_roots_body(rank, world, roots):
    import numpy as np

    import distcomm as dist

    dist.init_process_group("shm")
    try:
        dist.broadcast(np.zeros(8, dtype=np.float32), src=roots[rank])
    except RuntimeError as exc:
        return type(exc).__name__, str(exc)
    return "no error", ""


@pytest.mark.slow
def test_on_shared_memory_every_rank_sees_a_root_disagreement(seg_dir):
    """The shared-memory engine checks roots in one round that every rank reads in full."""
    results = run_world(three_roots_body, 3, args=([0, 0, 1],), timeout=60, env={"DISTCOMM_SHM_DIR": seg_dir})
    for rank, (kind, msg) in enumerate(results):
        assert kind == "CollectiveMismatchError", (rank, kind, msg)
        assert "with src=" in msg and "every rank of the group must pass the same src" in msg, msg
    no_children_left()


def same_root_body(rank, world, backend):
    import numpy as np

    import distcomm as dist

    dist.init_process_group(backend)
    out = []
    for root in range(world):
        x = np.full(8, rank, dtype=np.float32)
        dist.broadcast(x, src=root)
        out.append(float(x[0]))
    return out


@pytest.mark.slow
def test_agreeing_roots_still_work_in_a_world_of_three():
    results = run_world(same_root_body, 3, args=("tcp",), timeout=60)
    assert results == [[0.0, 1.0, 2.0]] * 3


# -- full shared memory ------------------------------------------------------------------------------
def full_shm_body(rank, world):
    from datetime import timedelta

    import numpy as np

    import distcomm as dist

    try:
        dist.init_process_group("shm", timeout=timedelta(seconds=TIMEOUT_S))
        for _ in range(3):
            dist.all_reduce(np.ones(1 << 20, dtype=np.float32))
    except RuntimeError as exc:
        return type(exc).__name__, str(exc)
    return "no error", ""


@pytest.fixture
def small_tmpfs():
    """A 4 MiB tmpfs mounted for the test (root only), unmounted afterwards."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    path = tempfile.mkdtemp(prefix="distcomm-tmpfs-")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m,mode=0700", "tmpfs", path],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        os.rmdir(path)
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield path
        leftovers = os.listdir(path)
        assert leftovers == [], f"segments left behind: {leftovers}"
    finally:
        subprocess.run(["umount", path], check=False)
        os.rmdir(path)


@pytest.mark.slow
def test_full_shared_memory_is_an_error_not_sigbus(small_tmpfs):
    results = run_world(full_shm_body, 2, timeout=60, env={"DISTCOMM_SHM_DIR": small_tmpfs})
    kinds = [r[0] for r in results]
    assert "no error" not in kinds, results
    # the rank that did not run out itself may see the other leave: through shared memory, or, when
    # the one that left hosted the store and this one was waiting on it, as the store's lost connection
    failed = [msg for kind, msg in results if kind not in ("PeerLostError", "DistNetworkError")]
    assert failed, results  # at least one rank ran out of memory itself
    for kind, msg in results:
        if kind == "DistNetworkError":
            assert "lost the connection to the TCPStore server" in msg and "may have exited" in msg, msg
        else:
            assert kind in ("DistBackendError", "PeerLostError"), (kind, msg)
    msg = failed[0]
    assert "out of shared memory" in msg and small_tmpfs in msg, msg
    assert "--shm-size" in msg and "DISTCOMM_SHM_DIR" in msg and 'backend="tcp"' in msg, msg
    assert "bytes" in msg
    no_children_left()


# -- monitored_barrier -------------------------------------------------------------------------------
def monitored_body(rank, world):
    import time
    from datetime import timedelta

    import distcomm as dist

    dist.init_process_group("tcp")
    dist.barrier()
    if rank == 1:
        time.sleep(3)
        return "late", ""
    try:
        dist.monitored_barrier(timeout=timedelta(seconds=1))
    except RuntimeError as exc:
        return type(exc).__name__, str(exc)
    return "no error", ""


@pytest.mark.slow
def test_monitored_barrier_error_carries_the_sequence_number():
    results = run_world(monitored_body, 2, timeout=60)
    kind, msg = results[0]
    assert kind == "DistBackendError", results
    assert "Rank 1 failed to pass monitoredBarrier in 1000 ms" in msg, msg
    assert "monitored_barrier #2" in msg, msg  # barrier was #1
    no_children_left()


# -- shm across hosts (the engine's refusal is a DistError) ------------------------------------------
def hosts_body(rank, world):
    import time

    import distcomm as dist

    os.environ["DISTCOMM_HOST_ID"] = f"node{rank % 2}"
    start = time.monotonic()
    try:
        dist.init_process_group("shm")
    except RuntimeError as exc:
        return type(exc).__name__, str(exc), time.monotonic() - start
    return "no error", "", 0.0


@pytest.mark.slow
def test_shm_across_hosts_is_a_dist_backend_error():
    for kind, msg, took in run_world(hosts_body, 2, timeout=60):
        assert kind == "DistBackendError", (kind, msg)
        assert "needs every rank on one host" in msg and "'gloo'" in msg and "'tcp'" in msg, msg
        assert took < PROMPT_S
    no_children_left()


# -- init faults -----------------------------------------------------------------------------------
def init_body(rank, world, as_rank, as_world, init_method, timeout_s):
    """Initialize as rank ``as_rank`` of ``as_world`` (what a misconfigured job gives this process)."""
    import time
    from datetime import timedelta

    import numpy as np

    import distcomm as dist

    start = time.monotonic()
    try:
        dist.init_process_group("tcp", init_method=init_method, rank=as_rank, world_size=as_world,
                                timeout=timedelta(seconds=timeout_s))
        x = np.ones(4)
        dist.all_reduce(x)
        dist.destroy_process_group()
        return "ok", float(x[0]), time.monotonic() - start
    except Exception as exc:  # noqa: BLE001 - the type is what is checked
        return type(exc).__name__, str(exc), time.monotonic() - start


def _tcp_url():
    from harness import free_port

    return f"tcp://127.0.0.1:{free_port()}"


@pytest.mark.slow
def test_world_size_disagreement_is_named_on_every_rank():
    url = _tcp_url()
    results = run_world(_init_as, 2, args=([(0, 2), (1, 3)], url, TIMEOUT_S), timeout=60)
    for rank, (kind, msg, took) in enumerate(results):
        assert kind == "DistError", (rank, kind, msg)
        assert "disagree on the world size" in msg, msg
        assert "rank 0 was given world_size=2" in msg and "rank 1 was given world_size=3" in msg, msg
        assert "distcomm/" not in msg, msg  # no internal store keys
        assert took < INIT_PROMPT_S, (rank, took)
    no_children_left()


@pytest.mark.slow
def test_duplicate_rank_is_named():
    url = _tcp_url()
    results = run_world(_init_as, 3, args=([(0, 3), (1, 3), (1, 3)], url, TIMEOUT_S), timeout=60)
    for rank, (kind, msg, took) in enumerate(results):
        assert kind == "DistError", (rank, kind, msg)
        assert "rank 1 is taken twice" in msg and "Give every process its own RANK" in msg, msg
        assert "distcomm/" not in msg, msg
        assert took < INIT_PROMPT_S, (rank, took)
    no_children_left()


def _init_as(rank, world, roles, init_method, timeout_s):
    as_rank, as_world = roles[rank]
    return init_body(rank, world, as_rank, as_world, init_method, timeout_s)


def _lone_rank0_killed(rank, world, path):
    """Rank 0 of 2 opens the file and is SIGKILLed while it waits for rank 1."""
    import signal
    import threading
    import time

    def kill_once_waiting():
        while not os.path.exists(path):
            time.sleep(0.01)
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=kill_once_waiting, daemon=True).start()
    init_body(0, 2, 0, 2, f"file://{path}", TIMEOUT_S)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["timed out", "killed"])
def test_a_file_left_by_a_failed_init_does_not_block_the_next_run(tmp_path, how):
    path = str(tmp_path / "init_file")
    if how == "timed out":  # rank 1 never comes: rank 0 gives up and exits normally
        [(kind, msg, _)] = run_world(_init_as, 1, args=([(0, 2)], f"file://{path}", 2), timeout=60)
        assert kind == "DistError" and "rank(s) [1] of world_size=2 did not join" in msg, (kind, msg)
    else:
        [result] = run_world(_lone_rank0_killed, 1, args=(path,), timeout=60, expect_failure=[0])
        assert "process exited with code -9" in result, result
    assert os.path.exists(path)  # what the next run finds
    results = run_world(_init_as, 2, args=([(0, 2), (1, 2)], f"file://{path}", TIMEOUT_S), timeout=60)
    assert [r[:2] for r in results] == [("ok", 2.0), ("ok", 2.0)], results
    assert not os.path.exists(path)  # the run's last user removed it
    no_children_left()


# -- the launcher -----------------------------------------------------------------------------------
def _launcher_support():
    from launcher_scripts import support

    return support


@pytest.mark.slow
def test_sigkilled_launcher_leaves_no_process_temp_dir_or_segment(tmp_path):
    """Workers that started a grandchild, a launcher SIGKILLed: within a few seconds the workers,
    the grandchildren, the launcher's temp dir and the run's segments are all gone (the launcher's
    watchdog; the workers die of PR_SET_PDEATHSIG)."""
    import time

    support = _launcher_support()
    pids, tmp, shm = tmp_path / "pids", tmp_path / "tmp", tmp_path / "shm"
    for d in (pids, tmp, shm):
        d.mkdir()
    env = support.launcher_env(pids, TMPDIR=str(tmp), DISTCOMM_SHM_DIR=str(shm))
    launcher = support.start_launcher(
        ["--standalone", "--nproc-per-node", "2", support.WORKER, "--no-meet", "--grandchild", "--leave-shm",
         "--fail-rank", "9", "--others", "hang"],
        env=env,
    )
    try:
        support.wait_for_pids(pids, 4)  # 2 workers, 2 grandchildren
        deadline = time.monotonic() + 30
        while len(os.listdir(shm)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(os.listdir(shm)) == 2
        assert [n for n in os.listdir(tmp) if n.startswith("distcomm-run-")], os.listdir(tmp)
        launcher.kill()
        launcher.communicate(timeout=support.TIMEOUT)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert len(support.recorded_pids(pids, "grandchild")) == 2
    support.assert_no_leftovers(pids, 4, timeout=10.0)
    deadline = time.monotonic() + 10
    while (os.listdir(tmp) or os.listdir(shm)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert os.listdir(tmp) == [], "the launcher's temp dir stayed"
    assert os.listdir(shm) == [], "the run's segments stayed"


@pytest.mark.slow
def test_sigusr1_to_the_launcher_prints_every_workers_stacks(tmp_path):
    import signal
    import time

    support = _launcher_support()
    script = os.path.join(support.SCRIPTS, "stacks_worker.py")
    out_path, err_path, pids = tmp_path / "out", tmp_path / "err", tmp_path / "pids"
    pids.mkdir()
    stop = tmp_path / "stop"
    env = support.launcher_env(pids, PET_RANK_PREFIX="0", TEST_STOP_FILE=str(stop),
                               PYTHONPATH=os.pathsep.join([os.path.join(os.path.dirname(__file__), "..", "src"),
                                                           os.environ.get("PYTHONPATH", "")]))
    with open(out_path, "w") as out, open(err_path, "w") as err:
        launcher = subprocess.Popen(support.command(["--standalone", "--nproc-per-node", "2", script]),
                                    env=env, stdout=out, stderr=err)
    try:
        support.wait_for_pids(pids, 2)
        time.sleep(1.0)  # rank 1 is in its barrier by now (a later SIGUSR1 would only show it earlier)
        launcher.send_signal(signal.SIGUSR1)
        wanted = ["[rank 0] ", "[rank 1] ", "in blocked_here", "in barrier", "in helper_thread_sleeps"]
        deadline = time.monotonic() + 30
        text = ""
        while time.monotonic() < deadline:
            text = err_path.read_text()
            if all(w in text for w in wanted):
                break
            time.sleep(0.1)
        stop.write_text("")
        launcher.wait(timeout=support.TIMEOUT)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    text = err_path.read_text()
    for w in wanted:
        assert w in text, (w, text[-3000:])
    rank0 = [line for line in text.splitlines() if line.startswith("[rank 0] ")]
    assert any("blocked_here" in line for line in rank0) and not any("in barrier" in line for line in rank0)
    assert launcher.returncode == 0, text[-3000:]  # the job went on and finished
    support.assert_no_leftovers(pids, 2)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
