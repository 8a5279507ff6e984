"""spawn / start_processes: run ``fn(i, *args)`` in ``nprocs`` processes; a failure comes back as an exception.

The shape of ``torch.multiprocessing.spawn`` (same names, arguments, exception classes and
messages) in the standard library only:

- each child writes the traceback of an exception escaping ``fn`` to its own error file and exits
  with code 1; the parent raises ``ProcessRaisedException`` with that traceback, the child's index
  (``error_index``) and pid (``error_pid``);
- a child that exits non-zero without an exception (``sys.exit(3)``, a signal) gives
  ``ProcessExitedException`` with ``exit_code`` and ``signal_name``;
- when one child fails the others are stopped: SIGTERM, then SIGKILL after a grace period;
- each child gets PR_SET_PDEATHSIG=SIGKILL (Linux), so children die with a parent that is killed.
  As with torch's (which uses SIGINT), the "parent" is the *thread* that started them: call
  ``spawn`` from a thread that outlives the children (the main thread, typically).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import sys
import tempfile
import time
import traceback
import warnings
from typing import Any, Callable, Sequence

DEFAULT_GRACE_PERIOD = 30.0  # seconds between SIGTERM and SIGKILL when stopping the others


class ProcessException(Exception):
    __slots__ = ["error_index", "error_pid"]

    def __init__(self, msg: str, error_index: int, error_pid: int):
        super().__init__(msg)
        self.msg = msg
        self.error_index = error_index
        self.error_pid = error_pid

    def __reduce__(self):
        return type(self), (self.msg, self.error_index, self.error_pid)


class ProcessRaisedException(ProcessException):
    """A child process failed with an exception raised by ``fn``; the message has its traceback."""


class ProcessExitedException(ProcessException):
    """A child process exited with a non-zero code or was killed by a signal."""

    __slots__ = ["exit_code", "signal_name"]

    def __init__(self, msg: str, error_index: int, error_pid: int, exit_code: int, signal_name: str | None = None):
        super().__init__(msg, error_index, error_pid)
        self.exit_code = exit_code
        self.signal_name = signal_name

    def __reduce__(self):
        return type(self), (self.msg, self.error_index, self.error_pid, self.exit_code, self.signal_name)


def _set_pdeathsig(sig: int) -> None:
    """Ask Linux to send ``sig`` to this process when its parent dies (no-op elsewhere)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(sig))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _wrap(fn: Callable[..., Any], i: int, args: Sequence[Any], error_file: str) -> None:
    _set_pdeathsig(signal.SIGKILL)
    try:
        fn(i, *args)
    except KeyboardInterrupt:
        pass  # SIGINT: the parent is stopping us
    except Exception:
        with open(error_file, "wb") as f:
            pickle.dump(traceback.format_exc(), f)
        sys.exit(1)


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"<Unknown signal {signum}>"


class ProcessContext:
    """The processes started by ``start_processes(join=False)``; ``join()`` them until it returns True."""

    def __init__(self, processes: list, error_files: list[str]):
        self.processes = processes
        self.error_files = error_files
        self.sentinels = {p.sentinel: i for i, p in enumerate(processes)}

    def pids(self) -> list[int]:
        return [int(p.pid) for p in self.processes]

    def join(self, timeout: float | None = None, grace_period: float | None = None) -> bool:
        """Wait up to ``timeout`` s for the processes; True once all exited successfully.

        If one exits with a non-zero status, the others are stopped (after ``grace_period`` s to
        finish on their own, if given; then SIGTERM; SIGKILL after another grace period, 30 s by
        default) and the first failure is raised as ProcessRaisedException (``fn`` raised) or
        ProcessExitedException (exit code or signal).
        """
        if not self.sentinels:
            return True
        failed = None
        for sentinel in multiprocessing.connection.wait(list(self.sentinels), timeout=timeout):
            index = self.sentinels.pop(sentinel)
            self.processes[index].join()
            if self.processes[index].exitcode != 0:
                failed = index
                break
        if failed is None:
            return not self.sentinels
        self._stop_others(grace_period)
        raise self._exception(failed)

    def _wait_all(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        for p in self.processes:
            p.join(max(0.0, deadline - time.monotonic()))

    def _stop_others(self, grace_period: float | None) -> None:
        if grace_period is not None:
            self._wait_all(grace_period)
        for p in self.processes:
            if p.is_alive():
                p.terminate()
        self._wait_all(DEFAULT_GRACE_PERIOD if grace_period is None else grace_period)
        for p in self.processes:
            if p.is_alive():
                p.kill()
            p.join()
        self.sentinels.clear()

    def _exception(self, index: int) -> ProcessException:
        process = self.processes[index]
        try:
            with open(self.error_files[index], "rb") as f:
                original_trace = pickle.load(f)
        except OSError:
            original_trace = None
        for path in self.error_files:
            try:
                os.unlink(path)
            except OSError:
                pass
        if original_trace is not None:
            msg = f"\n\n-- Process {index:d} terminated with the following error:\n{original_trace}"
            return ProcessRaisedException(msg, index, process.pid)
        code = process.exitcode
        if code < 0:
            name = _signal_name(-code)
            return ProcessExitedException(
                f"process {index:d} terminated with signal {name}", index, process.pid, code, name
            )
        return ProcessExitedException(f"process {index:d} terminated with exit code {code:d}", index, process.pid, code)


class SpawnContext(ProcessContext):
    def __init__(self, processes: list, error_files: list[str]):
        warnings.warn("SpawnContext is renamed to ProcessContext since 1.4 release.", stacklevel=2)
        super().__init__(processes, error_files)


def start_processes(
    fn: Callable[..., Any],
    args: Sequence[Any] = (),
    nprocs: int = 1,
    join: bool = True,
    daemon: bool = False,
    start_method: str = "spawn",
) -> ProcessContext | None:
    """Start ``nprocs`` processes running ``fn(i, *args)`` with any start method; see ``spawn``."""
    ctx = multiprocessing.get_context(start_method)
    processes, error_files = [], []
    for i in range(nprocs):
        # The child creates the file only when fn raises: its existence means "an exception".
        fd, path = tempfile.mkstemp(prefix="distcomm-spawn-error-", suffix=".pickle")
        os.close(fd)
        os.unlink(path)
        process = ctx.Process(target=_wrap, args=(fn, i, tuple(args), path), daemon=daemon)
        process.start()
        processes.append(process)
        error_files.append(path)
    context = ProcessContext(processes, error_files)
    if not join:
        return context
    while not context.join():
        pass
    return None


def spawn(
    fn: Callable[..., Any],
    args: Sequence[Any] = (),
    nprocs: int = 1,
    join: bool = True,
    daemon: bool = False,
    start_method: str = "spawn",
) -> ProcessContext | None:
    r"""Spawns ``nprocs`` processes that run ``fn`` with ``args``.

    If one of the processes exits with a non-zero exit status, the remaining processes are killed
    and an exception is raised with the cause of termination. In the case an exception was caught
    in the child process, it is forwarded and its traceback is included in the exception raised in
    the parent process.

    Args:
        fn (function): called as the entrypoint of each spawned process as ``fn(i, *args)``, where
            ``i`` is the process index. It must be defined at the top level of a module so it can
            be pickled (a requirement of the spawn start method).
        args (tuple): arguments passed to ``fn``.
        nprocs (int): number of processes to spawn.
        join (bool): perform a blocking join on all processes.
        daemon (bool): the spawned processes' daemon flag.
        start_method (str): (deprecated) always ``spawn``; use ``start_processes()`` for another.

    Returns:
        None if ``join`` is ``True``, a :class:`ProcessContext` if ``join`` is ``False``.
    """
    if start_method != "spawn":
        warnings.warn(
            f"This method only supports start_method=spawn (got: {start_method}).\n"
            "To use a different start_method use:\n\t\t distcomm.multiprocessing.start_processes(...)",
            FutureWarning,
            stacklevel=2,
        )
    return start_processes(fn, args, nprocs, join, daemon, start_method="spawn")
