"""Work: the handle an ``async_op=True`` call returns, and the future behind it.

A Work completes exactly once, with a result or an exception. ``wait()`` re-raises the exception in
the caller (as torch's Work does). ``get_future()`` returns a ``torch.futures.Future`` when torch is
loaded (so ``fut.then(...)`` chains work in DDP comm hooks) and a small ``Future`` of ours otherwise.
"""

from __future__ import annotations

import sys
import threading
from datetime import timedelta
from typing import Any, Callable

from .errors import DistTimeoutError


class Future:
    """A minimal torch.futures.Future work-alike for programs without torch."""

    def __init__(self):
        self._done = threading.Event()
        self._value: Any = None
        self._exc: BaseException | None = None
        self._callbacks: list[Callable[["Future"], None]] = []
        self._lock = threading.Lock()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self) -> Any:
        self._done.wait()
        if self._exc is not None:
            raise self._exc
        return self._value

    value = wait

    def result(self, timeout: float | None = None) -> Any:
        if not self._done.wait(timeout):
            raise TimeoutError("future did not complete in time")
        return self.wait()

    def set_result(self, value: Any) -> None:
        self._complete(value, None)

    def set_exception(self, exc: BaseException) -> None:
        self._complete(None, exc)

    def _complete(self, value, exc) -> None:
        with self._lock:
            if self._done.is_set():
                raise RuntimeError("Future can only be marked completed once")
            self._value, self._exc = value, exc
            self._done.set()
            callbacks, self._callbacks = self._callbacks, []
        for cb in callbacks:
            cb(self)

    def add_done_callback(self, fn: Callable[["Future"], None]) -> None:
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(fn)
                return
        fn(self)

    def then(self, fn: Callable[["Future"], Any]) -> "Future":
        chained = Future()

        def run(fut: "Future") -> None:
            try:
                chained.set_result(fn(fut))
            except BaseException as exc:  # noqa: BLE001 - carried by the future
                chained.set_exception(exc)

        self.add_done_callback(run)
        return chained


def _new_future():
    torch = sys.modules.get("torch")
    if torch is not None:
        return torch.futures.Future()
    return Future()


class Work:
    """A pending collective or point-to-point operation (torch.distributed.Work).

    ``description``: the operation as errors name it ("all_reduce #7 on rank 1 of group '0'"), for
    the message of a ``wait(timeout)`` that times out; ``op`` when not given."""

    def __init__(self, op: str = "", result: Any = None, description: str | None = None):
        self.op = op
        self.description = description or op
        self._event = threading.Event()
        self._exc: BaseException | None = None
        self._result = result
        self._sender = -1
        self._future = None
        self._lock = threading.Lock()

    # -- completion (called by the engine) ----------------------------------------------------
    def _finish(self, exc: BaseException | None = None, source_rank: int | None = None) -> None:
        with self._lock:
            self._exc = exc
            if source_rank is not None:
                self._sender = source_rank
            self._event.set()
            future = self._future
        if future is not None:
            self._settle(future)

    def _settle(self, future) -> None:
        if self._exc is not None:
            future.set_exception(self._exc)
        else:
            future.set_result(self._result)

    # -- torch's Work interface ---------------------------------------------------------------
    def wait(self, timeout: timedelta | float | None = None) -> bool:
        """Block until the operation completes; re-raise its error. Returns True.

        ``timeout`` bounds this wait only, as torch's does: past it DistTimeoutError is raised and
        the operation goes on (it still completes, or fails at its group's timeout)."""
        seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
        if seconds is not None and seconds <= 0:
            seconds = None
        if not self._event.wait(seconds):
            raise DistTimeoutError(
                f"{self.description}: Timed out in Work.wait after {seconds:g} s; the operation itself goes on "
                "(it completes when every rank has joined it, or fails at its group's timeout): call wait() "
                "again to keep waiting, or poll is_completed()"
            )
        if self._exc is not None:
            raise self._exc
        return True

    def is_completed(self) -> bool:
        return self._event.is_set()

    def is_success(self) -> bool:
        """False once the operation has failed; True otherwise, even before it completes (torch's
        Work::isSuccess, deprecated there: "no error yet"). ``is_completed`` says whether it is done."""
        return self._exc is None

    def exception(self) -> BaseException | None:
        return self._exc

    def source_rank(self) -> int:
        """The sender's rank of a completed receive (meaningful for recv from any source)."""
        if not self._event.is_set():
            raise RuntimeError("source_rank() needs a completed receive; call wait() first")
        if self._sender < 0:
            raise RuntimeError("source_rank() is only available for receives")
        return self._sender

    def _source_rank(self) -> int:
        """torch's name: ``Work._source_rank()`` after an irecv from any source."""
        return self.source_rank()

    def result(self) -> Any:
        self.wait()
        return self._result

    def get_future(self):
        """A future completed with the operation's result (its output tensors) or error."""
        with self._lock:
            if self._future is None:
                self._future = _new_future()
                if self._event.is_set():
                    self._settle(self._future)
            return self._future

    def synchronize(self) -> None:
        pass

    def __repr__(self) -> str:
        state = "completed" if self.is_completed() else "pending"
        return f"<distcomm.Work {self.description} {state}>"


def completed_work(op: str, result: Any = None, exc: BaseException | None = None) -> Work:
    work = Work(op, result)
    work._finish(exc)
    return work
