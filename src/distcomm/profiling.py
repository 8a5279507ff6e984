"""torch's profiler, when it is loaded and recording: every operation is recorded as "distcomm:<op>".

torch is never imported here: a profiler can only be on if the user's program imported torch.
"""

from __future__ import annotations

import sys
from contextlib import nullcontext


def profiling():
    """torch when it is loaded and a profiler is on (so calls should be recorded), else None."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        if not torch.autograd.profiler._is_profiler_enabled:
            return None
    except AttributeError:
        pass
    return torch


def profiler_scope(name: str):
    """A torch.profiler record_function scope when torch is loaded and a profiler is on."""
    torch = profiling()
    return nullcontext() if torch is None else torch.profiler.record_function(name)
