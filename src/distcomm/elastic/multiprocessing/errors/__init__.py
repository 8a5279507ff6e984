"""``@record``, as ``torch.distributed.elastic.multiprocessing.errors.record``.

Most torchrun scripts decorate ``main`` with ``@record``. Under distcomm-run the decorator is not
needed (the launcher takes the traceback from the failed worker's stderr), but it does what
torch's does, because the file it writes is the exact traceback even when stderr went elsewhere:
an exception escaping the function is written as JSON to ``TORCHELASTIC_ERROR_FILE`` (torch's
format: ``{"message": {"message": "<Type>: <text>", "extraInfo": {"py_callstack": <traceback>,
"timestamp": "<unix seconds>"}}}``) and re-raised; ``SystemExit(0)`` returns None; without the
variable nothing is written. distcomm-run sets the variable for every worker and prefers that file
in its failure summary (``distcomm._launcher.failure.read_error_file``); torch's own ``@record``
writes the same file, so either works.

Not provided: ``ChildFailedError``/``ProcessFailure`` (raised by torch's in-process launcher API,
which distcomm does not have).
"""

from __future__ import annotations

import faulthandler
import functools
import json
import os
import time
import traceback
import warnings
from typing import Callable, TypeVar

__all__ = ["record", "ErrorHandler", "get_error_handler"]

_R = TypeVar("_R")


class ErrorHandler:
    """Writes an exception to ``TORCHELASTIC_ERROR_FILE`` in torch's JSON format (subclassable)."""

    def _get_error_file_path(self) -> str | None:
        return os.environ.get("TORCHELASTIC_ERROR_FILE", None)

    def initialize(self) -> None:
        """Dump every thread's stack on a fatal signal (SIGSEGV...), where no exception is raised."""
        try:
            faulthandler.enable(all_threads=True)
        except Exception as e:  # e.g. stderr is not a real file
            warnings.warn(f"Unable to enable fault handler. {type(e).__name__}: {e}", stacklevel=2)

    def record_exception(self, e: BaseException) -> None:
        """Write ``e`` (being handled: its traceback is the current one) to the error file."""
        path = self._get_error_file_path()
        if not path:
            return
        data = {
            "message": {
                "message": f"{type(e).__name__}: {e}",
                "extraInfo": {
                    "py_callstack": traceback.format_exc(),
                    "timestamp": str(int(time.time())),
                },
            }
        }
        with open(path, "w") as fp:
            json.dump(data, fp)


def get_error_handler() -> ErrorHandler:
    return ErrorHandler()


def record(fn: Callable[..., _R], error_handler: ErrorHandler | None = None) -> Callable[..., _R | None]:
    """Record an exception escaping ``fn`` (see the module docstring), then re-raise it.

    Use it once per process, on the top-level function::

        @record
        def main(): ...
    """
    handler = error_handler or get_error_handler()

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        handler.initialize()
        try:
            return fn(*args, **kwargs)
        except SystemExit as se:
            if se.code == 0:  # sys.exit(0) is a success, as in torch
                return None
            raise
        except Exception as e:
            handler.record_exception(e)
            raise

    return wrapper
