"""Leaving an MPI job at exit without destroy_process_group.

In an MPI job a process's exit waits in MPI_Finalize (which mpi4py calls at exit, after atexit's
functions) until every rank of the job calls it. A rank whose program ends in the middle of the job
(an uncaught exception, sys.exit) therefore stays alive there, and its peers, which learn of a death
from the process ending (shared memory) or its connections closing (TCP), would wait for it until
their timeout. So at exit, before MPI_Finalize, a rank whose world is still initialised does what
its death would do: each of its engines ``leave``s (the MPI engine first sends every peer a notice),
which ends its peers' waits on it within about a second, with an error naming it and the cause its
excepthook published.

Then, its output flushed, it says so in the store (``diagnostics.wait_for_leavers``). A rank that
failed waits up to DISTCOMM_MPI_EXIT_GRACE seconds (default 10) for every rank to have done so, and
if some have not, calls MPI_Abort, as mpi4py does for an uncaught exception (``python -m mpi4py``):
the job ends instead of waiting in MPI_Finalize for ranks that are busy elsewhere, or that caught
their error and went on. Every other rank goes on to MPI_Finalize. None of this runs outside an MPI
job, after destroy_process_group, or in a forked child.

A rank failed if an exception ended its program (its excepthook published it), or if one of its
operations failed with a DistError (``diagnostics.fault``), even one the program caught: a program
that catches the error, logs it and calls ``sys.exit(1)`` is as likely to leave a peer stuck for
good (the one it timed out waiting for) as one that does not catch it. Such a rank aborts nothing
when every rank leaves within the grace (a rank that destroyed its default group has left:
``diagnostics.uninstall`` says so in the store), nor when the store is gone before it could tell
(its host, rank 0, destroyed its group first): only a rank known not to have left ends the job. Its
peers hear that it "ended its program", not that an exception did.
"""

from __future__ import annotations

import atexit
import os
import sys
import time

from .. import diagnostics, world

MPI_EXIT_GRACE = 10.0  # seconds; DISTCOMM_MPI_EXIT_GRACE overrides it

_registered = False


def register() -> None:
    """Called by init_process_group: run ``leave_mpi_job`` at exit (once per process). Registered
    after diagnostics' own exit hook (at its import), so atexit runs it first, with the watchdog
    still up."""
    global _registered
    if not _registered:
        _registered = True
        atexit.register(leave_mpi_job)


def _mpi_job():
    """The mpi4py.MPI module if this process is one of several of an MPI job that MPI will
    finalize at exit, else None."""
    MPI = sys.modules.get("mpi4py.MPI")
    if MPI is None:
        return None
    try:
        if not MPI.Is_initialized() or MPI.Is_finalized() or MPI.COMM_WORLD.Get_size() < 2:
            return None
    except Exception:  # noqa: BLE001 - an MPI in a state we cannot ask about: leave it alone
        return None
    return MPI


def _exit_grace() -> float:
    try:
        return max(0.0, float(os.environ.get("DISTCOMM_MPI_EXIT_GRACE", MPI_EXIT_GRACE)))
    except ValueError:
        return MPI_EXIT_GRACE


def leave_mpi_job() -> None:
    """atexit: leave an MPI job whose world is still initialised (see the module docstring)."""
    mon = diagnostics.monitor
    if world.default_pg is None or mon is None or mon.pid != os.getpid():  # a forked child: its parent's world
        return
    MPI = _mpi_job()
    if MPI is None:
        return
    uncaught = diagnostics.failed()  # what the peers' errors say: an exception ended its program
    fault = diagnostics.fault()  # an operation of its failed, caught or not
    failed = uncaught or fault is not None
    engines = {id(e): e for e in list(world.engines.values()) + [pg.engine for pg in list(world.groups.values())]}
    for engine in engines.values():
        try:
            engine.leave(uncaught)
        except Exception:  # noqa: BLE001 - leaving anyway; the peers' timeouts still hold
            pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
    grace = _exit_grace()
    missing = diagnostics.wait_for_leavers(grace, wait=failed)
    if not failed or missing == []:
        return
    if missing is None and not uncaught:
        # The store is gone: rank 0, its host, destroyed its process group (or ended) first. Nothing
        # then says a rank is stuck, and a job whose ranks have all ended must not end aborted: a
        # rank whose program caught its error goes on to MPI_Finalize, as every rank did before.
        return
    if missing is None:
        who = "the store stopped answering before every rank had left"
    else:
        who = (f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} had not left "
               f"{grace:g} s later (DISTCOMM_MPI_EXIT_GRACE)")
    what = "failed" if uncaught else f"left after a {fault}"
    try:
        sys.stderr.write(f"distcomm: rank {world.global_rank} {what}, and {who}: ending the MPI job with MPI_Abort\n")
        sys.stderr.flush()
    except Exception:  # noqa: BLE001
        pass
    _wait_until_read((1, 2), OUTPUT_DRAIN_LIMIT)
    MPI.COMM_WORLD.Abort(1)


OUTPUT_DRAIN_LIMIT = 1.0  # seconds


def _wait_until_read(fds, limit: float) -> None:
    """Wait (up to ``limit`` seconds) until what this process wrote to the pipes ``fds`` has been
    read. mpiexec's proxy reads a rank's output from a pipe; MPI_Abort has it kill the job, and
    what it had not read yet was lost (the message saying why the job ended, about one run in
    six). A file or a terminal does not wait."""
    import array
    import fcntl
    import termios

    deadline = time.monotonic() + limit
    for fd in fds:
        unread = array.array("i", [0])
        while True:
            try:
                fcntl.ioctl(fd, termios.FIONREAD, unread, True)
            except OSError:  # not a pipe (a file, a terminal) or closed: nothing to wait for
                break
            if unread[0] == 0 or time.monotonic() >= deadline:
                break
            time.sleep(0.005)
