"""Worker processes of one round, and the launcher's single event loop over them.

Each worker is started

- in its own session (``start_new_session``), so the launcher can signal the worker together with
  every process it started (``killpg``), and a Ctrl-C in the terminal reaches only the launcher,
  which forwards it;
- through a tiny exec shim that sets PR_SET_PDEATHSIG=SIGKILL (Linux) and then ``execvp``s the real
  command (the pid stays the worker's), so a launcher killed with SIGKILL does not leave orphan
  workers. The shim runs before any user code, unlike a ``preexec_fn``, which is unsafe in a
  launcher that has threads (the store server);
- with stdout and stderr as non-blocking pipes.

``WorkerGroup.pump`` is the one loop: a selector over every pipe and every worker's pidfd (Linux
>= 5.3; elsewhere exits are polled), so output is forwarded and exits are seen as they happen,
without a thread per worker.
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

from .output import OutputRouter, StreamSink
from .watchdog import Watchdog

_SHIM = r"""
import os, signal, sys
try:
    import ctypes
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
except Exception:
    pass
if os.getppid() != int(sys.argv[1]):
    os._exit(137)  # the launcher died before the death signal was armed
try:
    os.execvp(sys.argv[2], sys.argv[2:])
except OSError as exc:
    sys.stderr.write("distcomm-run: cannot execute %r: %s\n" % (sys.argv[2], exc))
    os._exit(127)
"""

STOP_KILL_WAIT = 10.0  # seconds to wait for SIGKILLed workers to be reaped
DRAIN_READS = 64       # reads of up to 64 KiB from each pipe of a worker that just exited


@dataclass
class WorkerSpec:
    local_rank: int
    rank: int
    argv: list[str]
    env: dict[str, str]


@dataclass(eq=False)
class Worker:
    spec: WorkerSpec
    proc: subprocess.Popen
    out: StreamSink
    err: StreamSink
    pidfd: int | None = None
    returncode: int | None = None
    exit_time: float | None = None      # time.time() when the launcher saw the exit
    signalled: int | None = None        # the last signal the launcher sent it
    open_pipes: dict = field(default_factory=dict)  # fd -> the Popen file object

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def rank(self) -> int:
        return self.spec.rank

    @property
    def local_rank(self) -> int:
        return self.spec.local_rank

    @property
    def running(self) -> bool:
        return self.returncode is None


def signal_process_group(pid: int, sig: int) -> bool:
    """Send ``sig`` to the worker's session (its process group); False if nothing is left in it."""
    try:
        os.killpg(pid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def handles_signal(pid: int, sig: int) -> bool:
    """Does process ``pid`` catch ``sig`` (a handler installed, per /proc/<pid>/status SigCgt)?
    False where /proc is unreadable: the caller then must not send a signal whose default kills."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


class WorkerGroup:
    """The workers of one round: started together, watched by one selector, stopped together."""

    def __init__(self, router: OutputRouter, attempt_dir: str | None, watchdog: Watchdog | None = None):
        self.router = router
        self.watchdog = watchdog  # told of every worker session, to kill them if the launcher dies
        self.attempt_dir = attempt_dir
        self.workers: list[Worker] = []
        self.escalate = False  # set by a second launcher signal: skip the SIGTERM grace period
        self._sel = selectors.DefaultSelector()
        self._use_pidfd = hasattr(os, "pidfd_open")

    # -- starting -----------------------------------------------------------------------------
    def start(self, specs: list[WorkerSpec]) -> None:
        for spec in specs:
            self.workers.append(self._start_one(spec))

    def _start_one(self, spec: WorkerSpec) -> Worker:
        out, err = self.router.sinks(spec.local_rank, spec.rank, self.attempt_dir)
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _SHIM, str(os.getpid()), *spec.argv],
            env=spec.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        worker = Worker(spec, proc, out, err)
        if self.watchdog is not None:
            self.watchdog.session_started(proc.pid)
        for pipe, sink in ((proc.stdout, out), (proc.stderr, err)):
            fd = pipe.fileno()
            os.set_blocking(fd, False)
            worker.open_pipes[fd] = pipe
            self._sel.register(fd, selectors.EVENT_READ, ("pipe", worker, sink))
        if self._use_pidfd:
            try:
                worker.pidfd = os.pidfd_open(proc.pid)
                self._sel.register(worker.pidfd, selectors.EVENT_READ, ("exit", worker, None))
            except OSError:  # kernel without pidfd: poll instead
                self._use_pidfd = False
        return worker

    # -- the event loop -----------------------------------------------------------------------
    @property
    def running(self) -> list[Worker]:
        return [w for w in self.workers if w.running]

    def pump(self, timeout: float | None) -> list[Worker]:
        """Forward output and collect exits for up to ``timeout`` s; return workers that just exited."""
        exited: list[Worker] = []
        if not self._sel.get_map():
            time.sleep(timeout or 0)
        else:
            if not self._use_pidfd and timeout is not None:
                timeout = min(timeout, 0.05)
            for key, _ in self._sel.select(timeout):
                kind, worker, sink = key.data
                if kind == "pipe":
                    self._read(key.fd, worker, sink)
                elif worker.running:
                    self._reap(worker, exited)
        if not self._use_pidfd:
            for worker in self.running:
                if worker.proc.poll() is not None:
                    self._reap(worker, exited)
        self.router.flush()
        return exited

    def _read(self, fd: int, worker: Worker, sink: StreamSink) -> bool:
        """Read what one pipe has; False when it is drained for now."""
        try:
            data = os.read(fd, 65536)
        except BlockingIOError:
            return False
        except OSError:
            data = b""
        if data:
            sink.feed(data)
            return True
        self._close_pipe(fd, worker, sink)
        return False

    def _close_pipe(self, fd: int, worker: Worker, sink: StreamSink) -> None:
        self._sel.unregister(fd)
        worker.open_pipes.pop(fd).close()
        sink.close()

    def _drain(self, worker: Worker) -> None:
        """Read everything a worker has written so far (its traceback arrives before its exit)."""
        for fd in list(worker.open_pipes):
            sink = self._sel.get_key(fd).data[2]
            for _ in range(DRAIN_READS):  # bounded: a surviving child may keep writing to the pipe
                if not self._read(fd, worker, sink):
                    break

    def _reap(self, worker: Worker, exited: list[Worker]) -> None:
        worker.returncode = worker.proc.wait()
        worker.exit_time = time.time()
        if worker.pidfd is not None:
            self._sel.unregister(worker.pidfd)
            os.close(worker.pidfd)
            worker.pidfd = None
        self._drain(worker)
        exited.append(worker)

    def dump_stacks(self) -> list[int]:
        """Forward SIGUSR1 to every running worker that handles it (a distcomm worker prints its
        stacks: distcomm/stacks.py); the ranks that do not, which are left alone (SIGUSR1's
        default action would kill them)."""
        skipped = []
        for worker in self.running:
            if handles_signal(worker.pid, signal.SIGUSR1):
                try:
                    os.kill(worker.pid, signal.SIGUSR1)
                except ProcessLookupError:
                    pass
            else:
                skipped.append(worker.rank)
        return skipped

    # -- stopping -----------------------------------------------------------------------------
    def stop(self, sig: int, grace: float) -> None:
        """Send ``sig`` to every running worker, SIGKILL whoever is still there after ``grace`` s."""
        for worker in self.running:
            worker.signalled = sig
            signal_process_group(worker.pid, sig)
        deadline = time.monotonic() + grace
        while self.running and not self.escalate and time.monotonic() < deadline:
            self.pump(min(0.1, max(0.0, deadline - time.monotonic())))
        for worker in self.running:
            worker.signalled = signal.SIGKILL
            signal_process_group(worker.pid, signal.SIGKILL)
        deadline = time.monotonic() + STOP_KILL_WAIT
        while self.running and time.monotonic() < deadline:
            self.pump(0.1)

    def close(self, pipe_grace: float = 1.0) -> None:
        """After every worker exited: kill what they left in their sessions, finish the output."""
        stragglers = [w for w in self.workers if signal_process_group(w.pid, 0)]
        for worker in stragglers:
            signal_process_group(worker.pid, signal.SIGTERM)
        deadline = time.monotonic() + pipe_grace
        while stragglers and time.monotonic() < deadline:
            stragglers = [w for w in stragglers if signal_process_group(w.pid, 0)]
            self.pump(0.05)
        for worker in stragglers:
            signal_process_group(worker.pid, signal.SIGKILL)
        deadline = time.monotonic() + pipe_grace
        while any(w.open_pipes for w in self.workers) and time.monotonic() < deadline:
            self.pump(0.05)
        for worker in self.workers:
            for fd in list(worker.open_pipes):
                self._close_pipe(fd, worker, self._sel.get_key(fd).data[2])
            if worker.running:  # only if SIGKILL did not take effect in STOP_KILL_WAIT
                worker.proc.kill()
            if self.watchdog is not None and not signal_process_group(worker.pid, 0):
                self.watchdog.session_ended(worker.pid)
        self.router.flush()
        self._sel.close()
