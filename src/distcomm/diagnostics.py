"""What ranks tell each other about a fault: hang reports, failure causes, dumps on every rank, and
the cross-rank shape check of TORCH_DISTRIBUTED_DEBUG=DETAIL.

Nothing here runs on the fast path of a healthy job. The ranks share news through the world's store,
under ``trace/`` in its namespace for this init:

``trace/alert`` (a counter)
    Bumped by a rank whose operation has waited a quarter of its group's timeout, and by a rank that
    hit a fault. Every rank's watchdog thread reads it (one ``add(key, 0)`` per tick: a tick is an
    eighth of the smallest group timeout, at least 50 ms and at most 1 s); once it moved, the rank
    publishes its state whenever it changes.
``trace/state/<rank>``
    A rank's state, JSON: per group, its last operation started and last completed (op, sequence
    number, call site, times), as its flight recorder says. A timing-out rank reads the other
    members' states into its DistTimeoutError: the hang report.
``trace/dump`` (a counter)
    Bumped (with the alert) by a rank that hit a fault, or by ``dump_flight_recorder(all_ranks=True)``:
    each rank's watchdog then writes its flight recorder to ``DISTCOMM_TRACE_DIR``.
``trace/failed/<rank>`` and the counter ``trace/failures``
    Written by the hook that ``init_process_group`` adds to ``sys.excepthook`` when an exception
    escapes a rank's program: its type, message, call site and the last lines of its traceback.
    A rank whose collective then fails (its peer closed the connection, or time ran out) reads it
    into its error: "rank 2 failed: ValueError: bad batch (train.py:57)".
``trace/left/<rank>`` and ``trace/left_seen/<rank>``
    In an MPI job (mpiexec), written at exit by a rank whose program ended without
    destroy_process_group: once its output is flushed, and once it is done with the store
    (``wait_for_leavers``; _api/leaving.py says why); both at once by a rank that destroys its
    default group (``uninstall``): it is done with the store, and a rank leaving after a failure
    must not wait for it.

Every store call here is guarded: a store that is gone (the rank hosting it died) costs the report,
never the error it decorates; the report then says the store is gone rather than blame the ranks
whose reports it could not read.

A rank dumps its flight recorder on SIGTERM too (``install`` sets the handler; see "SIGTERM" below):
a launcher stops the ranks it did not see fail with SIGTERM, and the straggler whose dump says most
is one of them.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import sys
import threading
import time
import traceback
from typing import Any, Sequence

import numpy as np

from . import flight_recorder as fr
from .errors import CollectiveMismatchError, DistError, DistTimeoutError, PeerFailedError

ALERT_FRACTION = 0.25  # a wait this fraction of its timeout long makes the rank raise the alert
PUBLISH_WINDOW = 5.0  # seconds past the largest group timeout that ranks keep publishing after an alert
TRACEBACK_LINES = 6  # of the failed rank's traceback, in the peers' errors
FINGERPRINT_BYTES = 1024
# how long a leaving rank gives its last look at the store for a dump request: the store's host may
# be alive but unable to answer (rank 0 in a blocking MPI call that holds the GIL, its store server
# a Python thread), and leaving must not wait on it
LEAVE_ANSWER_SECONDS = 1.0
# The signature of the DETAIL shape check's messages: an opcode no collective has (signatures.py
# numbers them from 1 up), so these never match a collective's own messages.
FINGERPRINT_SIGNATURE = 0x7FFF << 16

# TORCH_DISTRIBUTED_DEBUG=DETAIL: set by _api/debug.set_debug_level, read by ProcessGroup.run.
check_shapes = False


class Monitor:
    """This process's side of the sharing: a watchdog thread and the store it talks through."""

    def __init__(self, store: Any, rank: int, world_size: int, answer_on_leave: bool = True):
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.answer_on_leave = answer_on_leave
        self.pid = os.getpid()
        self.store_lost = False
        self.store_error: str | None = None  # the first line of the error that lost it
        self._seen_alert = self._counter("trace/alert")
        self._seen_dump = self._counter("trace/dump")
        self._alerted: set[int] = set()  # records this rank raised the alert for
        self._publish_until = 0.0  # time.time() until which the state is published on every tick
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="distcomm-watchdog", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(2)

    # -- store helpers: never raise; after one failure, never try again ---------------------------
    # A store that failed once is gone (its host, rank 0 or the agent, has exited): trying again
    # would only repeat the error (torch's C++ store prints a backtrace for each).
    def lost(self, exc: BaseException) -> None:
        """The store failed with ``exc``: it is gone; the first error is kept for the report."""
        if not self.store_lost:
            text = str(exc).splitlines()[0] if str(exc) else ""
            self.store_error = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
        self.store_lost = True

    def _counter(self, key: str, bump: int = 0) -> int:
        if self.store_lost:
            return 0
        try:
            return int(self.store.add(key, bump))
        except Exception as exc:  # noqa: BLE001 - the report is best effort
            self.lost(exc)
            return 0

    def _get_if_set(self, key: str) -> bytes | None:
        if self.store_lost:
            return None
        try:
            if self.store.check([key]):
                return self.store.get(key)
        except Exception as exc:  # noqa: BLE001
            self.lost(exc)
        return None

    def _set(self, key: str, value: str) -> None:
        if self.store_lost:
            return
        try:
            self.store.set(key, value)
        except Exception as exc:  # noqa: BLE001
            self.lost(exc)

    # -- the watchdog ---------------------------------------------------------------------------
    def interval(self) -> float:
        rec = fr.recorder
        timeouts = [g["timeout"] for g in rec.groups.values()] if rec is not None else []
        smallest = min(timeouts) if timeouts else 8.0
        return min(1.0, max(0.05, smallest / 8))

    def _loop(self) -> None:
        while not self._stop.wait(self.interval()) and not self.store_lost:
            try:
                self.tick()
            except Exception:  # noqa: BLE001 - a watchdog must not die of a store hiccup
                pass

    def tick(self) -> None:
        rec = fr.recorder
        if rec is None:
            return
        now = time.time()
        for entry in rec.recent(64):
            if entry[fr.STATE] in (fr.SCHEDULED, fr.STARTED) and entry[fr.ID] not in self._alerted:
                group = rec.groups.get(entry[fr.GROUP])
                limit = (group["timeout"] if group else 1800.0) * ALERT_FRACTION
                if now - entry[fr.T_CREATED] > limit:
                    self._alerted.add(entry[fr.ID])
                    self.alert()
        alert = self._counter("trace/alert")
        if alert != self._seen_alert:
            self._seen_alert = alert
            self._publish_until = now + PUBLISH_WINDOW + max(
                (g["timeout"] for g in rec.groups.values()), default=0.0)
            self.answer_dump_request()
        if now < self._publish_until:
            self.publish()

    def publish(self) -> None:
        """Write this rank's state under ``trace/state/<rank>``, stamped with the time: on every
        tick of an alert's window, so a reader can tell a live rank's state from a stale one."""
        rec = fr.recorder
        if rec is None:
            return
        groups = rec.snapshot()
        self._set(f"trace/state/{self.rank}", json.dumps({"rank": self.rank, "time": time.time(), "groups": groups}))

    def alert(self) -> None:
        """A wait got long here: publish this rank's state and ask every rank to publish theirs."""
        self._publish_until = max(self._publish_until, time.time() + PUBLISH_WINDOW)
        self.publish()
        self._counter("trace/alert", 1)

    def answer_dump_request(self) -> None:
        """Dump if another rank asked since the last tick (a rank leaving between two ticks)."""
        rec = fr.recorder
        if rec is not None and self._counter("trace/dump") != self._seen_dump:
            self._seen_dump = self._counter("trace/dump")
            reason = self._get_if_set("trace/dump_reason")
            rec.dump(reason=(reason or b"requested by another rank").decode(errors="replace"))

    def request_dump(self, reason: str) -> None:
        self._set("trace/dump_reason", reason)
        # this rank dumps itself (the caller does): its watchdog need not answer its own request
        self._seen_dump = self._counter("trace/dump", 1)
        self._counter("trace/alert", 1)

    # -- reading what the others published ------------------------------------------------------
    def states(self, ranks: Sequence[int], settle: float) -> dict[int, dict]:
        """The published states of ``ranks``; waits up to ``settle`` seconds for missing ones after
        raising the alert (a rank that had no reason to publish yet does so on its next tick)."""
        self.alert()
        found: dict[int, dict] = {}
        deadline = time.monotonic() + settle
        while True:
            for r in ranks:
                if r not in found:
                    raw = self._get_if_set(f"trace/state/{r}")
                    if raw is not None:
                        try:
                            found[r] = json.loads(raw)
                        except ValueError:
                            pass
            if len(found) == len(ranks) or time.monotonic() >= deadline:
                return found
            time.sleep(0.05)

    def failures(self, ranks: Sequence[int]) -> dict[int, dict]:
        """The failure summaries published by any of ``ranks``."""
        if self._counter("trace/failures") == 0:
            return {}
        out = {}
        for r in ranks:
            raw = self._get_if_set(f"trace/failed/{r}")
            if raw is not None:
                try:
                    out[r] = json.loads(raw)
                except ValueError:
                    pass
        return out

    def publish_failure(self, summary: dict) -> None:
        self._set(f"trace/failed/{self.rank}", json.dumps(summary))
        self._counter("trace/failures", 1)


monitor: Monitor | None = None
_previous_excepthook = None
_failed = False  # this process published its failure (report_failure): read when it leaves an MPI job
# (pid, "DistTimeoutError in all_reduce #7") of the last operation of this process that failed with a
# DistError (on_fault), caught or not: read when it leaves an MPI job (fault())
_fault: tuple[int, str] | None = None


def install(store: Any, rank: int, world_size: int, answer_on_leave: bool = True) -> None:
    """Called by init_process_group: start the watchdog, hook uncaught exceptions and SIGTERM.

    ``answer_on_leave``: look at the store once more when leaving (uninstall), for a dump request
    made since the watchdog's last tick. False for a store whose host commonly leaves first and
    whose client prints a backtrace for the call that finds it gone: torch's TCPStore, hosted by
    rank 0 of an env:// job, under the torch backend."""
    global monitor, _previous_excepthook
    uninstall()
    if fr.recorder is not None:
        fr.recorder.rank, fr.recorder.world_size = rank, world_size
    monitor = Monitor(store, rank, world_size, answer_on_leave)
    if _previous_excepthook is None:
        _previous_excepthook = sys.excepthook
        sys.excepthook = _excepthook
    _hook_sigterm()


def uninstall() -> None:
    """Called by destroy_process_group (and at exit): answer a dump request the watchdog has not
    seen yet, then stop the watchdog and give SIGTERM back to the handler it had (the excepthook
    stays, and is idle)."""
    global monitor
    if monitor is not None:
        mon, monitor = monitor, None
        if mon.pid != os.getpid():
            return  # a forked child: the thread and the rank are its parent's
        _unhook_sigterm()
        mon.close()
        if not mon.answer_on_leave:
            return
        in_mpi_job = _in_mpi_job()

        def answer() -> None:
            if in_mpi_job:  # done with the job's store: ranks leaving the MPI job need not wait for it
                mon._set(f"trace/left/{mon.rank}", "1")
                mon._set(f"trace/left_seen/{mon.rank}", "1")
            mon.answer_dump_request()

        answering = threading.Thread(target=answer, name="distcomm-dump-answer", daemon=True)
        answering.start()
        answering.join(LEAVE_ANSWER_SECONDS)


atexit.register(uninstall)


# -- SIGTERM: dump, then die as before ----------------------------------------------------------
# A launcher stops the ranks it did not see fail with SIGTERM, and SIGKILL 30 s later (torchrun's
# shutdown, distcomm-run's alike): when rank 0 times out waiting for a straggler, the straggler is
# SIGTERMed before its watchdog's next tick, and its dump, the one that says why the job hung, was
# never written. So while a process group is initialised, SIGTERM first writes this rank's flight
# recorder (to DISTCOMM_TRACE_DIR; nothing without it), then does what it did before: the handler
# it replaced (a user's, installed before init_process_group), or the default action, re-raised, so
# the process still dies of SIGTERM (exit status -15 / 143). No store call: the store's host may be
# gone, and a call could wait past the launcher's SIGKILL.
#
# Python runs a signal handler in the main thread, between two bytecodes: a rank waiting in a
# distcomm collective runs it within one wait slice (every wait returns to Python at least every
# 0.1 s); a rank inside a long C call (a big numpy operation) runs it, and dies, when the call
# returns. Only the main thread can install it: init_process_group from another thread leaves
# SIGTERM alone, as does a handler installed from C (signal.getsignal returns None: nothing to chain
# to). A handler the program installs after init_process_group replaces this one: its choice.
_sigterm_previous: Any = None  # the handler ours replaced, while ours is installed
_sigterm_dumping = False  # a second SIGTERM during the dump goes straight on (no second dump)


def _hook_sigterm() -> None:
    global _sigterm_previous
    if not hasattr(signal, "SIGTERM") or threading.current_thread() is not threading.main_thread():
        return
    # Only where a dump has somewhere to go: a Python handler runs only between bytecodes of the
    # main thread, so a main thread blocked in a C wait would never act on SIGTERM, and a harness
    # that stops its processes with SIGTERM alone (torch's test runner) would wait on it forever.
    if not os.environ.get("DISTCOMM_TRACE_DIR"):
        return
    current = signal.getsignal(signal.SIGTERM)
    if current is _on_sigterm or current is None:
        return
    _sigterm_previous = current
    signal.signal(signal.SIGTERM, _on_sigterm)


def _unhook_sigterm() -> None:
    """Put back the handler ours replaced, unless the program has installed one of its own since
    (then ours, if that one chains to it, dumps nothing more: no monitor)."""
    global _sigterm_previous
    if threading.current_thread() is not threading.main_thread():
        return  # stays installed and idle: it only chains while no process group is initialised
    if signal.getsignal(signal.SIGTERM) is _on_sigterm:
        signal.signal(signal.SIGTERM, _sigterm_previous)
        _sigterm_previous = None


def _on_sigterm(signum: int, frame: Any) -> None:
    global _sigterm_dumping
    mon, rec = monitor, fr.recorder
    # not in a forked child (a data loader worker inherits the handler, not the rank), nor again in
    # a second SIGTERM that interrupts this one's dump
    if mon is not None and mon.pid == os.getpid() and rec is not None and not _sigterm_dumping:
        _sigterm_dumping = True
        try:
            rec.dump(reason=f"rank {mon.rank} received SIGTERM")
        except Exception:  # noqa: BLE001 - a dump that fails must not keep the process alive
            pass
        finally:
            _sigterm_dumping = False
    previous = _sigterm_previous
    if callable(previous):
        previous(signum, frame)
    elif previous != signal.SIG_IGN:  # SIG_DFL: die of the signal, as without this handler
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


# -- failures -----------------------------------------------------------------------------------
def _user_site(tb) -> tuple[str, int] | None:
    """The innermost frame of a traceback that is not distcomm's (where the user's code raised)."""
    site = None
    for frame, line in traceback.walk_tb(tb):
        name = frame.f_code.co_filename
        if not fr.is_library_file(name):
            site = (name, line)
    return site


def failure_summary(exc: BaseException) -> dict:
    """What a failed rank tells the others: its exception's type, first line, site and traceback tail."""
    message = str(exc).splitlines()[0] if str(exc) else ""
    lines = traceback.format_exception(type(exc), exc, exc.__traceback__)
    tail = "".join(lines).rstrip().splitlines()[-TRACEBACK_LINES:]
    return {
        "type": type(exc).__name__,
        "message": message,
        "site": fr.format_site(_user_site(exc.__traceback__)),
        "traceback": tail,
        "pid": os.getpid(),
    }


def report_failure(exc: BaseException) -> None:
    """Publish ``exc`` as this rank's cause of failure, for its peers' errors (the excepthook does
    this for exceptions that end the program; call it where a framework catches them first)."""
    global _failed
    mon = monitor
    if mon is None:
        return
    if mon.pid == os.getpid():
        _failed = True
    mon.publish_failure(failure_summary(exc))
    reason = f"rank {mon.rank} failed: {type(exc).__name__}"
    if fr.recorder is not None:
        fr.recorder.dump(reason=reason)
    mon.request_dump(reason)


def _excepthook(tp, value, tb) -> None:
    try:
        # a forked child (a data loader worker) inherits the monitor but is not the rank
        if monitor is not None and monitor.pid == os.getpid() and not issubclass(tp, KeyboardInterrupt):
            report_failure(value)
    finally:
        (_previous_excepthook or sys.__excepthook__)(tp, value, tb)


# -- leaving a job whose processes outlive their program (MPI) -----------------------------------
# The store side of _api/leaving.py (which says why): every rank that leaves writes
# ``trace/left/<rank>``; a failed one waits for every rank's, and rank 0, whose process hosts the
# store under mpiexec, waits for ``trace/left_seen/<rank>`` of every rank that left before taking
# the store away.
def failed() -> bool:
    """Whether this process published its failure (report_failure: its excepthook did)."""
    return _failed


def _in_mpi_job() -> bool:
    """Whether MPI is initialised (by mpi4py) and not finalised in this process: its exit will
    wait in MPI_Finalize. Looked up, never imported: a process without MPI pays nothing."""
    MPI = sys.modules.get("mpi4py.MPI")
    try:
        return MPI is not None and bool(MPI.Is_initialized()) and not MPI.Is_finalized()
    except Exception:  # noqa: BLE001 - an MPI in a state we cannot ask about
        return False


def fault() -> str | None:
    """The last operation of this process that failed with a DistError ("DistTimeoutError in
    all_reduce #7"), whether the program caught the error or not; None if none did."""
    return _fault[1] if _fault is not None and _fault[0] == os.getpid() else None


def wait_for_leavers(grace: float, wait: bool) -> list[int] | None:
    """Write this rank's ``trace/left`` key and, if ``wait`` (or on rank 0), wait up to ``grace``
    seconds for every rank's: the ranks still missing then, or None if the store stopped answering
    (or ``wait`` is False, or nothing is installed). Then this rank writes ``trace/left_seen/<rank>``
    (done with the store), and rank 0 waits (as long again at most) for that key of every rank that
    left. Store calls run on a thread of their own: a store whose host is stuck in MPI_Finalize may
    never answer."""
    mon = monitor
    if mon is None:
        return None
    left = [f"trace/left/{r}" for r in range(mon.world_size)]
    seen = [f"trace/left_seen/{r}" for r in range(mon.world_size)]
    found: list = [None]

    def wait_for(keys: list[str], deadline: float) -> list[int] | None:
        while True:
            try:
                if mon.store.check(keys):
                    return []
            except Exception as exc:  # noqa: BLE001 - the store is gone
                mon.lost(exc)
                return None
            if time.monotonic() >= deadline:
                missing = [r for r, key in enumerate(keys) if mon._get_if_set(key) is None]
                return None if mon.store_lost else missing
            time.sleep(0.05)

    def run() -> None:
        mon._set(left[mon.rank], "1")
        if not (wait or mon.rank == 0):
            mon._set(seen[mon.rank], "1")  # done with the store
            return
        found[0] = missing = wait_for(left, time.monotonic() + grace)
        if missing is None:
            return
        mon._set(seen[mon.rank], "1")
        if mon.rank == 0 and not mon.store_lost:
            wait_for([key for r, key in enumerate(seen) if r not in missing], time.monotonic() + grace)

    waiter = threading.Thread(target=run, name="distcomm-leaving", daemon=True)
    waiter.start()
    waiter.join(2 * grace + LEAVE_ANSWER_SECONDS)
    return found[0] if wait else None


def describe_failure(rank: int, summary: dict) -> str:
    text = f"rank {rank} failed: {summary.get('type')}: {summary.get('message')} ({summary.get('site')})"
    tail = summary.get("traceback") or []
    if tail:
        text += "\n" + "\n".join("    | " + line for line in tail)
    return text


# -- the report added to an operation's error ---------------------------------------------------
def _describe_record(rec: dict | None) -> str:
    if not rec:
        return "nothing"
    return f"{rec['op']} #{rec['seq']} ({fr.format_site(_site_tuple(rec.get('site')))})"


def _site_tuple(site):
    return None if not site else (site["file"], site["line"])


def describe_state(rank: int, state: dict | None, group: str, now: float, stale_after: float = 2.0,
                   store_lost: bool = False) -> str:
    """One line of a hang report: what ``rank`` was doing in ``group`` when it last published.
    ``store_lost``: the store stopped answering, so a missing state says nothing about the rank."""
    if state is None:
        if store_lost:
            return f"rank {rank}: no report (the store is unreachable: this says nothing about rank {rank})"
        return (f"rank {rank}: no report (its watchdog did not answer: the process may be dead, stopped, "
                "or holding the GIL)")
    g = state.get("groups", {}).get(group)
    published = state.get("time", now)
    # a live rank republishes every tick of the alert: an old state means a rank that stopped
    stale = f" (last heard from {now - published:.1f} s ago)" if now - published > stale_after else ""
    if not g:
        return f"rank {rank}: has not started any operation of this group{stale}"
    started, completed = g.get("last_started"), g.get("last_completed")
    if started and started.get("state") in (fr.SCHEDULED, fr.STARTED):
        waited = published - started["time_created"]
        return (f"rank {rank}: in {_describe_record(started)} for {waited:.1f} s; last completed "
                f"{_describe_record(completed)}{stale}")
    if started and started.get("state") == fr.FAILED:
        return f"rank {rank}: {_describe_record(started)} failed: {started.get('error')}{stale}"
    return f"rank {rank}: not in an operation of this group; last completed {_describe_record(completed)}{stale}"


def store_gone(error: str | None) -> str:
    """The hang report's line for a store that stopped answering: whose reports are missing, and why."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
        host = "the launcher's agent"
    else:  # env:// and tcp://: rank 0's process serves the store
        host = "rank 0's, under env:// and tcp://"
    return (f"no report could be read: the store stopped answering ({error or 'no answer'}); the process serving "
            f"it ({host}) has most likely exited: finished, or failed first (its own output says which)")


def record_fault(pg: Any, exc: BaseException, op: str, seq: int | None, entry: list | None) -> None:
    """A call of ``pg`` failed with ``exc``: its flight recorder ``entry`` (if any) says so, and a
    DistError gets what the other ranks report (``on_fault``). Every path that runs a call (the
    general path, p2p, the engines' latency paths) tells its failures through here."""
    if entry is not None:
        fr.fail(entry, exc)
    if isinstance(exc, DistError):
        on_fault(pg, exc, op, seq)


def on_fault(pg: Any, exc: DistError, op: str, seq: int | None) -> None:
    """An operation of ``pg`` failed with ``exc``: add what the other ranks report to its message,
    dump this rank's flight recorder and ask every rank to dump theirs. Changes ``exc`` in place
    (its type and traceback stay what they were). Remembers the failure (``fault``): a process that
    caught the error and leaves an MPI job counts as failed there (_api/leaving.py)."""
    global _fault
    _fault = (os.getpid(), f"{type(exc).__name__} in {op}{'' if seq is None else f' #{seq}'}")
    if getattr(exc, "_distcomm_diagnosed", False):
        return
    exc._distcomm_diagnosed = True  # noqa: SLF001 - a marker on our own exception: report once
    extra: list[str] = []
    mon = monitor
    others = [r for r in pg.ranks if r != pg.global_rank]
    if mon is not None and others:
        failed = mon.failures(others)
        for r, summary in sorted(failed.items()):
            extra.append(describe_failure(r, summary))
        if isinstance(exc, (DistTimeoutError, PeerFailedError)):  # what the peer at fault was doing says why
            states = mon.states(others, settle=min(1.0, 2 * mon.interval()))
            now = time.time()
            stale_after = 3 * mon.interval() + 0.5
            lost = mon.store_lost
            lines = [describe_state(r, states.get(r), pg.group_name, now, stale_after, lost) for r in others]
            if lost and len(states) < len(others):
                lines.append(store_gone(mon.store_error))
            extra.append(f"what the other ranks of group {pg.group_name!r} were doing:\n  " + "\n  ".join(lines))
        mon.request_dump(f"rank {pg.global_rank}: {type(exc).__name__} in {op} #{seq}")
    rec = fr.recorder
    path = None
    if rec is not None:
        try:
            path = rec.dump(reason=f"{type(exc).__name__} in {op} #{seq}")
        except OSError as err:
            extra.append(f"flight recorder dump failed: {err}")
    if path is not None:
        who = ("this rank dumped (the others could not be asked: the store is gone)"
               if mon is not None and mon.store_lost else "every rank dumps")
        extra.append(f"flight recorder: {who} to {os.path.dirname(path)}; "
                     f"run `python -m distcomm.trace {os.path.dirname(path)}`")
    if extra:
        exc.args = (str(exc) + "\n" + "\n".join(extra),) + exc.args[1:]


# -- TORCH_DISTRIBUTED_DEBUG=DETAIL -------------------------------------------------------------
def fingerprint(op: str, dtype: str | None, shape: Sequence[int] | None, peer: int | None) -> dict:
    return {"op": op, "dtype": dtype, "shape": None if shape is None else list(shape), "root": peer}


def _encode(fp: dict) -> np.ndarray:
    raw = json.dumps(fp).encode()
    if len(raw) > FINGERPRINT_BYTES:  # an absurd shape: compare its digest instead
        import hashlib

        fp = dict(fp, shape=hashlib.sha256(repr(fp["shape"]).encode()).hexdigest())
        raw = json.dumps(fp).encode()
    out = np.zeros(FINGERPRINT_BYTES, dtype=np.uint8)
    out[:len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    return out


def _decode(buf: np.ndarray) -> dict:
    return json.loads(bytes(buf).rstrip(b"\0").decode())


def _describe_fingerprint(fp: dict) -> str:
    text = f"{fp['op']} of {fp['dtype']} shape {tuple(fp['shape']) if isinstance(fp['shape'], list) else fp['shape']}"
    if fp.get("root") is not None:
        text += f" root {fp['root']}"
    return text


def fingerprint_mismatch(ch: Any, fp: dict, seq: int) -> CollectiveMismatchError | None:
    """Exchange ``fp`` with every member over ``ch`` (a Channel of the call's key, with
    FINGERPRINT_SIGNATURE): the CollectiveMismatchError every rank raises if any differ, else None.
    Returned, not raised: a failure of the exchange itself raises, but a mismatch found after it
    leaves every rank in step (the caller keeps the group usable)."""
    mine = _encode(fp)
    bufs = [np.empty(FINGERPRINT_BYTES, dtype=np.uint8) for _ in range(ch.size)]
    peers = [p for p in range(ch.size) if p != ch.rank]
    recvs = [ch.irecv(p, bufs[p]) for p in peers]
    sends = [ch.isend(p, mine) for p in peers]
    for r in recvs + sends:
        r.wait()
    prints = [fp if p == ch.rank else _decode(bufs[p]) for p in range(ch.size)]
    if all(p == prints[0] for p in prints):
        return None
    groups: dict[str, list[int]] = {}
    for p, f in enumerate(prints):
        groups.setdefault(_describe_fingerprint(f), []).append(p)
    described = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {','.join(map(str, rs))}: {d}"
                          for d, rs in groups.items())
    return CollectiveMismatchError(
        f"{fp['op']} #{seq} on rank {ch.rank}: ranks called it with different tensors "
        f"(TORCH_DISTRIBUTED_DEBUG=DETAIL checks shapes): {described}. Every rank must pass tensors "
        "of the same shape and dtype, in the same order"
    )


__all__ = ["install", "uninstall", "report_failure", "record_fault", "on_fault", "fingerprint_mismatch", "fingerprint"]
