"""torch's profiler, when it is loaded and recording: every operation is recorded as "<backend>:<op>"
(``get_backend()``'s name: "gloo:all_reduce"), as torch names its events.

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
        # the C++ state: on for every profiler, also one started without torch.profiler's Python
        # front end (whose own flag, autograd.profiler._is_profiler_enabled, would miss it)
        if not torch._C._autograd._profiler_enabled():
            return None
    except AttributeError:
        if not getattr(torch.autograd.profiler, "_is_profiler_enabled", True):
            return None
    return torch


def profiler_scope(name: str):
    """A torch.profiler record_function scope when torch is loaded and a profiler is on."""
    torch = profiling()
    return nullcontext() if torch is None else torch.profiler.record_function(name)


def profiler_flag():
    """Once torch is loaded: the zero-argument function saying whether its profiler is on, for a
    path that asks on every call: torch's own C function, one call (``profiling()`` costs five
    lookups and two calls more, about 0.3 µs), or the general test on a torch without it."""
    try:
        return sys.modules["torch"]._C._autograd._profiler_enabled
    except AttributeError:
        return lambda: profiling() is not None


def profiler_check():
    """A zero-argument function saying whether torch's profiler is on (``profiling() is not None``)
    for a path that asks on every call: while torch is not loaded it looks in ``sys.modules`` (no
    profiler can be on); once torch is loaded, ``profiler_flag()``'s function."""
    modules = sys.modules
    found = []

    def check() -> bool:
        if found:
            return found[0]()
        if modules.get("torch") is None:
            return False
        found.append(profiler_flag())
        return found[0]()

    return check
