"""Multi-process test harness: run one function on every rank of a world, with a hard deadline.

``run_world(fn, world_size, args=..., timeout=...)`` starts ``world_size`` processes (the forkserver
start method, below), calls ``fn(rank, world_size, *args)`` in each with RANK/WORLD_SIZE/MASTER_ADDR/
MASTER_PORT set (so ``init_process_group()`` with no arguments works), and returns the list of
results by rank. A rank that raises fails the test with that rank's traceback; a world still
running at the deadline is killed (every process) and the test fails naming the ranks that had not
finished. A hang is a failure, never a stuck CI.

``fn`` must be a module-level function of an importable module (it is pickled by name).

``initialized(framework, backend, port)`` is, inside a rank, torch.distributed ("torch") or distcomm
with its default group made and destroyed around a block: the tests that run one script through both
libraries, one after the other in the same processes, and compare what each rank saw.

``run_in_session(cmd, timeout)`` is the same promise for a command (a launcher, mpiexec): it runs
in a session of its own, and at the deadline the whole session is killed, the command's output
kept in the SessionTimeout it raises.

Ranks start from a fork server that has imported numpy and torch once: a spawned interpreter pays
for ``import torch`` in every rank of every world (seconds of CPU each, most of the suite's time on
two cores). distcomm itself is not preloaded, so each rank reads its DISTCOMM_* variables afresh;
each rank gets the parent's environment as it is when the world starts (as spawn would give it),
plus the world's variables.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import resource
import signal
import socket
import subprocess
import threading
import time
import traceback
from contextlib import contextmanager
from datetime import timedelta
from importlib import import_module
from typing import Any, Callable, Iterator, Sequence

CONTEXT = mp.get_context("forkserver")
# Modules every rank would import; the fork server imports them once (torch with its distcomm
# autoload hook, which registers the backend without importing distcomm). Nothing here may start a
# thread pool: a forked child inherits no threads, and OpenMP would hang in it.
CONTEXT.set_forkserver_preload(["numpy", "torch", "torch.distributed", "pytest"])


class Interrupted(Exception):
    """What ``alarm(..., raising=True)``'s handler raises: a stand-in for the KeyboardInterrupt of a
    Ctrl-C, which would stop pytest itself."""


class Alarm:
    """What ``alarm()`` yields: ``calls``, one entry per time its handler ran, and ``fired``, set
    when it first did (a test's other thread waits on it instead of guessing with a sleep)."""

    def __init__(self):
        self.calls: list = []
        self.fired = threading.Event()


@contextmanager
def alarm(after: float, raising: bool = False) -> Iterator[Alarm]:
    """SIGALRM ``after`` seconds in, to this (main) thread: its handler records the call, or with
    ``raising`` records it and raises Interrupted, as a Ctrl-C lands in a blocking call. The
    previous handler is back, and no alarm pending, on the way out."""
    state = Alarm()

    def handler(*_):
        state.calls.append(True)
        state.fired.set()
        if raising:
            raise Interrupted

    previous = signal.signal(signal.SIGALRM, handler)
    try:
        signal.setitimer(signal.ITIMER_REAL, after)
        yield state
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def voluntary_sleeps() -> int:
    """How many times the calling thread has gone to sleep so far (its voluntary context switches)."""
    return resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw


def _thread_state(pid: int, tid: int) -> str:
    with open(f"/proc/{pid}/task/{tid}/stat") as stat:
        return stat.read().rpartition(")")[2].split()[0]


def _receive_exactly(sock: socket.socket, size: int) -> None:
    got = 0
    while got < size:
        chunk = sock.recv(size - got)
        if not chunk:
            raise ConnectionResetError("the caller closed the connection")
        got += len(chunk)


@contextmanager
def answered_while_asleep(sock: socket.socket, request_size: int, reply: bytes,
                          answered_first: Sequence[tuple[int, bytes]] = ()) -> Iterator[None]:
    """A server on ``sock`` in a forked process, for counting the calling thread's sleeps (Linux).

    It answers the ``answered_first`` exchanges (request size, reply) at once. Then, once the caller
    is asleep, it reads ``request_size`` bytes; waits a little, room for the caller to be woken by
    that read; and once the caller is asleep again, sends ``reply``. Being another process, it
    competes with the caller for no GIL (a wait for the GIL is a sleep too). Each of its steps gives
    up after 10 s; on the way out it is killed if the body raised, else waited for at most 15 s.
    """
    parent, tid = os.getpid(), threading.get_native_id()

    def until_caller_asleep() -> None:
        deadline = time.monotonic() + 10
        while _thread_state(parent, tid) != "S" and time.monotonic() < deadline:
            time.sleep(0.001)

    child = os.fork()
    if child == 0:  # pragma: no cover - the server, in the child
        try:
            sock.settimeout(10)
            for size, answer in answered_first:
                _receive_exactly(sock, size)
                sock.sendall(answer)
            until_caller_asleep()
            _receive_exactly(sock, request_size)
            time.sleep(0.05)
            until_caller_asleep()
            sock.sendall(reply)
        finally:
            os._exit(0)
    try:
        yield
    except BaseException:
        os.kill(child, signal.SIGKILL)
        raise
    finally:
        deadline = time.monotonic() + 15
        while os.waitpid(child, os.WNOHANG) == (0, 0):
            if time.monotonic() > deadline:
                os.kill(child, signal.SIGKILL)
                os.waitpid(child, 0)
                break
            time.sleep(0.005)


def free_port() -> int:
    """A port that was free a moment ago (the kernel picks it; racy only against other binders)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def initialized(framework: str, backend: str | None, port: int, timeout_s: float = 60) -> Iterator[Any]:
    """In a rank: torch.distributed (``framework`` "torch") or distcomm, its default group made on
    ``backend`` (None: no backend named) at MASTER_PORT ``port``, and destroyed when the block ends."""
    lib = import_module("torch.distributed" if framework == "torch" else "distcomm")
    os.environ["MASTER_PORT"] = str(port)
    backend_args = () if backend is None else (backend,)
    lib.init_process_group(*backend_args, timeout=timedelta(seconds=timeout_s))
    try:
        yield lib
    finally:
        lib.destroy_process_group()


class RankFailed(AssertionError):
    pass


class SessionTimeout(AssertionError):
    """A command ``run_in_session`` killed at its deadline; ``stdout`` and ``stderr``: what it wrote."""

    def __init__(self, message: str, stdout: str, stderr: str):
        super().__init__(message)
        self.stdout, self.stderr = stdout, stderr


def processes_with(token: str) -> list[int]:
    """Pids of the processes whose command line holds ``token`` (a test's job: nothing may outlive it)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if token.encode() in f.read():
                        found.append(int(entry))
            except OSError:
                pass
    return found


def run_in_session(cmd: Sequence[str], timeout: float, **popen: Any) -> subprocess.CompletedProcess:
    """Run ``cmd`` to completion in a session of its own, with text output captured; past
    ``timeout`` seconds kill the whole session (the command and every process it started: a
    launcher's workers, mpiexec's ranks) and raise SessionTimeout. ``popen``: more Popen arguments
    (env, cwd)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            **popen)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        raise SessionTimeout(f"{' '.join(map(str, cmd))} killed at its {timeout} s deadline", stdout, stderr) from None
    finally:
        if proc.poll() is None:  # interrupted (KeyboardInterrupt): nothing of the session stays
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def _child(fn, rank, world_size, args, env, conn):
    os.environ.clear()
    os.environ.update(env)
    os.environ["RANK"] = str(rank)
    os.environ["LOCAL_RANK"] = str(rank)
    try:
        result = fn(rank, world_size, *args)
        payload = ("ok", result)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        payload = ("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    try:
        conn.send_bytes(pickle.dumps(payload))
    except Exception as exc:  # unpicklable result
        conn.send_bytes(pickle.dumps(("error", f"result of rank {rank} not picklable: {exc}")))
    conn.close()


def run_world(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    timeout: float = 60.0,
    env: dict[str, str] | None = None,
    expect_failure: Sequence[int] = (),
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes (forked from the server); return results.

    Ranks listed in ``expect_failure`` may raise: their entry in the result list is then the
    exception text (a str starting with the exception class name) instead of a failure of the test.
    """
    base_env = dict(os.environ)
    base_env.update({
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "OMP_NUM_THREADS": "1",
    })
    base_env.update(env or {})
    procs, conns = [], []
    for rank in range(world_size):
        parent_conn, child_conn = CONTEXT.Pipe(duplex=False)
        p = CONTEXT.Process(
            target=_child,
            args=(fn, rank, world_size, tuple(args), base_env, child_conn),
            daemon=True,
            name=f"rank{rank}",
        )
        p.start()
        child_conn.close()
        procs.append(p)
        conns.append(parent_conn)

    deadline = time.monotonic() + timeout
    results: list[Any] = [None] * world_size
    done = [False] * world_size
    errors: dict[int, str] = {}
    try:
        while not all(done):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            ready = mp.connection.wait([c for r, c in enumerate(conns) if not done[r]], timeout=remaining)
            for c in ready:
                rank = conns.index(c)
                try:
                    status, value = pickle.loads(c.recv_bytes())
                except EOFError:
                    procs[rank].join(1)
                    status, value = "error", f"process exited with code {procs[rank].exitcode} before reporting"
                done[rank] = True
                if status == "ok":
                    results[rank] = value
                elif rank in expect_failure:
                    results[rank] = value
                else:
                    errors[rank] = value
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(5)
        for c in conns:
            c.close()
    if errors:
        text = "\n".join(f"--- rank {r} ---\n{e}" for r, e in sorted(errors.items()))
        raise RankFailed(f"{len(errors)} of {world_size} ranks failed:\n{text}")
    if not all(done):
        missing = [r for r in range(world_size) if not done[r]]
        raise RankFailed(f"world of {world_size} killed after {timeout}s deadline; ranks {missing} had not finished")
    return results
