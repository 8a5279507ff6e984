"""The torch Work a distcomm operation returns to torch.

A subclass of ``torch.distributed.Work`` (torch's pybind trampoline ``PyWork`` lets C++ call its
Python ``wait`` and ``get_future``), not ``_create_work_from_future``: the Work that makes does not
raise from ``wait()`` when its future failed, so DDP's reducer would read a failed all_reduce as a
success (and crash on the value). Here:

* ``wait()`` re-raises distcomm's DistError (naming op, rank and peer) in the caller: Python code
  gets it as is, C++ callers as an exception carrying its text.
* ``get_future()`` returns a future whose failure is a real error to C++: torch's
  ``Future.set_exception`` from Python only stores the exception as the value (C++ sees success),
  whereas a ``then`` callback that raises marks the chained future failed in C++.
"""

from __future__ import annotations

import torch
import torch.distributed as tdist

from ..work import Work


class TorchWork(tdist.Work):
    """distcomm Works (zero or more, run in order on one group) presented as one torch Work.

    ``result``: the output tensors (the future's value); ``error``: an error already known (an
    operation that failed when it ran inline).
    """

    # a completed Work (most of them: an idle group runs its calls inline) sets only its result;
    # these class defaults stand for "nothing pending, no error" (torch.distributed.Work's
    # pybind __init__ is most of what remains: about 1 µs)
    works: "list[Work] | tuple" = ()
    _error: BaseException | None = None

    def __init__(self, result, works=(), error: BaseException | None = None):
        super().__init__()
        self._result = result
        if works:
            self.works = [w for w in works if w is not None]
        if error is not None:
            self._error = error

    @property
    def outputs(self) -> list:
        """The output tensors (or lists of them), whether or not the operations have finished."""
        return list(self._result)

    def wait(self, timeout=None) -> bool:
        if self._error is not None:
            raise self._error
        for w in self.works:
            w.wait(timeout)  # raises the operation's DistError
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)

    def is_success(self) -> bool:
        return self.exception() is None

    def exception(self):
        if self._error is not None:
            return self._error
        for w in self.works:
            if w.is_completed() and w.exception() is not None:
                return w.exception()
        return None

    def source_rank(self) -> int:
        return self.works[0].source_rank()

    def _source_rank(self) -> int:  # torch's recv(src=None) asks this after wait()
        return self.source_rank()

    def synchronize(self) -> None:
        pass

    def result(self):
        self.wait()
        return self._result

    def get_future(self):
        if self._error is None and self.is_completed() and self.exception() is None:
            fut = torch.futures.Future()
            fut.set_result(self._result)
            return fut
        base = torch.futures.Future()
        chained = base.then(self._settled)
        if self.is_completed():
            base.set_result(None)
        else:
            # the last Work completes last (one group runs its operations in order)
            self.works[-1].get_future().add_done_callback(lambda _: base.set_result(None))
        return chained

    def _settled(self, _fut):
        self.wait()  # raising here fails the chained future for C++ too
        return self._result


def completed(result) -> TorchWork:
    return TorchWork(result)
