"""distcomm.multiprocessing: the standard ``multiprocessing`` module plus torch's ``spawn``.

Like ``torch.multiprocessing``, everything of the standard library's ``multiprocessing`` is
re-exported, and ``spawn``/``start_processes`` start ``nprocs`` processes running ``fn(i, *args)``,
re-raising a child's failure in the parent. No torch needed.
"""

from multiprocessing import *  # noqa: F401,F403 - a drop-in replacement, as torch.multiprocessing
from multiprocessing import __all__ as _mp_all

from .spawn import (
    ProcessContext,
    ProcessException,
    ProcessExitedException,
    ProcessRaisedException,
    SpawnContext,
    spawn,
    start_processes,
)

__all__ = list(_mp_all) + [
    "ProcessContext",
    "ProcessException",
    "ProcessExitedException",
    "ProcessRaisedException",
    "SpawnContext",
    "spawn",
    "start_processes",
]
