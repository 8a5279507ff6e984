"""Starting a benchmark world: host its store, spawn N ranks, stream their messages back.

Why the tool has its own launcher: it must work from an installed package (the test harness is not
installed) and it must turn every way a world can go wrong — a rank raising, a rank dying, a rank
hanging — into one exception in the parent that says which rank and what it was doing, after
killing every process it started. A benchmark never leaves stray processes behind.

Each rank runs ``target(rank, send, *args)``; ``send(message)`` pickles any message to the parent,
which yields ``(rank, message)`` as they arrive. The parent hosts the store the ranks rendezvous
through (distcomm's TCPStore, or torch's for a torch.distributed world), so nothing but the spawned
processes is needed.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import multiprocessing.connection
import os
import signal
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, Iterator, Sequence

from ..multiprocessing.spawn import _set_pdeathsig

_CTX = mp.get_context("spawn")
_EXIT = "__exit__"
_ERROR = "__error__"


class WorldFailed(RuntimeError):
    """A benchmark world could not finish: a rank raised, died or stopped reporting."""


def host_store(library: str, timeout: float):
    """A TCPStore master on a free loopback port, in this process: distcomm's or torch's."""
    if library == "torch":
        from torch.distributed import TCPStore
    else:
        from ..store import TCPStore
    return TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=timeout), wait_for_workers=False)


def connect_store(library: str, port: int, timeout: float):
    """A rank's client of the store the parent hosts."""
    if library == "torch":
        from torch.distributed import TCPStore
    else:
        from ..store import TCPStore
    return TCPStore("127.0.0.1", port, None, False, timedelta(seconds=timeout))


@contextlib.contextmanager
def _environment(env: dict[str, str]):
    """``os.environ`` updated while children start (spawned children copy it at start)."""
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _child(target: Callable, rank: int, args: tuple, conn, parent_pid: int) -> None:
    _set_pdeathsig(signal.SIGKILL)  # a parent killed outright (SIGKILL) takes its world with it
    if os.getppid() != parent_pid:  # it died before that took effect
        os._exit(1)
    # Each rank its own session, as mpiexec's ranks are (--compare mpi): with the kernel's
    # autogroup scheduling (sched_autogroup_enabled) every session gets an equal share of a busy
    # machine's CPUs, so ranks sharing one session ran at about half the speed of MPI's under load.
    with contextlib.suppress(OSError):
        os.setsid()
    try:
        target(rank, conn.send, *args)
        conn.send((_EXIT, None))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which decides
        conn.send((_ERROR, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        conn.close()


def run_world(
    target: Callable[..., None],
    world_size: int,
    args: Sequence[Any] = (),
    env: dict[str, str] | None = None,
    idle_timeout: float = 300.0,
    describe: Callable[[Any], str] = repr,
) -> Iterator[tuple[int, Any]]:
    """Run ``target(rank, send, *args)`` on ``world_size`` spawned processes; yield ``(rank, message)``.

    Raises WorldFailed when a rank raises or exits without finishing, or when no rank sent anything
    for ``idle_timeout`` seconds; the message names the ranks and, through ``describe``, the last
    message each of them sent. Every process is killed on the way out, however the caller stops
    (close the generator, or let an exception such as SystemExit from a SIGTERM handler through);
    a parent killed with SIGKILL takes them with it (PR_SET_PDEATHSIG, Linux).
    """
    procs, conns = [], []
    finished = False
    try:
        with _environment(env or {}):
            for rank in range(world_size):
                parent_conn, child_conn = _CTX.Pipe(duplex=False)
                proc = _CTX.Process(target=_child, args=(target, rank, tuple(args), child_conn, os.getpid()),
                                    daemon=True, name=f"distcomm-bench-rank{rank}")
                proc.start()
                child_conn.close()
                procs.append(proc)
                conns.append(parent_conn)
        last: dict[int, Any] = {}
        running = set(range(world_size))
        while running:
            ready = mp.connection.wait([conns[r] for r in running], timeout=idle_timeout)
            if not ready:
                doing = "; ".join(
                    f"rank {r}: {describe(last[r]) if r in last else 'starting'}" for r in sorted(running))
                raise WorldFailed(f"no rank reported for {idle_timeout:g} s; killed the world ({doing})")
            for conn in ready:
                rank = conns.index(conn)
                try:
                    kind, *rest = message = conn.recv()
                except EOFError:
                    procs[rank].join(1)
                    where = describe(last[rank]) if rank in last else "starting"
                    raise WorldFailed(
                        f"rank {rank} exited with code {procs[rank].exitcode} without finishing (was: {where})"
                    ) from None
                if kind == _EXIT:
                    running.discard(rank)
                elif kind == _ERROR:
                    raise WorldFailed(f"rank {rank} failed: {rest[0]}")
                else:
                    last[rank] = message
                    yield rank, message
        finished = True
    finally:
        deadline = time.monotonic() + (5.0 if finished else 0.0)  # finished ranks are exiting: let them
        for proc in procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        for proc in procs:
            proc.join(5)
        for conn in conns:
            conn.close()
