"""Debug level (torch's DebugLevel, get/set_debug_level, set_debug_level_from_env) and breakpoint.

The level is read from TORCH_DISTRIBUTED_DEBUG (torch programs already set it) or DISTCOMM_DEBUG
(which wins when both are set: it is distcomm's own) when distcomm is imported, as torch reads it
when torch.distributed is imported.
"""

from __future__ import annotations

import enum
import os
import sys
from datetime import timedelta

from .. import diagnostics, world
from .. import flight_recorder as fr
from .args import default_group


class DebugLevel(int, enum.Enum):
    """How much torch.distributed checks and logs: OFF, INFO or DETAIL."""

    OFF = 0
    INFO = 1
    DETAIL = 2


_level = DebugLevel.OFF
ENV_VARS = ("DISTCOMM_DEBUG", "TORCH_DISTRIBUTED_DEBUG")  # first set one wins


def get_debug_level() -> DebugLevel:
    """Gets the debug level of the torch.distributed package."""
    return _level


def set_debug_level(level: DebugLevel) -> None:
    """Sets the debug level of the torch.distributed package."""
    global _level
    if not isinstance(level, DebugLevel):
        # torch's binding refuses anything but a DebugLevel (an int too) with a TypeError
        raise TypeError(f"set_debug_level(): expected a DebugLevel (OFF, INFO or DETAIL), got {level!r}")
    _level = level
    diagnostics.check_shapes = level == DebugLevel.DETAIL  # ProcessGroup.run reads it on every call


def set_debug_level_from_env() -> None:
    """Sets the debug level from DISTCOMM_DEBUG or TORCH_DISTRIBUTED_DEBUG (OFF, INFO or DETAIL, in
    any case); OFF when neither is set."""
    for var in ENV_VARS:
        value = os.environ.get(var)
        if value is not None:
            break
    else:
        set_debug_level(DebugLevel.OFF)
        return
    try:
        set_debug_level(DebugLevel[value.strip().upper()])
    except KeyError:
        raise ValueError(f"The value of {var} must be OFF, INFO, or DETAIL.") from None


def dump_flight_recorder(directory: str | None = None, all_ranks: bool = False) -> str | None:
    """Write this rank's flight recorder (its last DISTCOMM_TRACE_BUFFER_SIZE operations) to
    ``directory`` (default: DISTCOMM_TRACE_DIR) as ``distcomm_trace_rank_<rank>.jsonl``; returns the
    path, or None when no directory is given or set, or the recorder is off.

    ``all_ranks=True`` also asks every other rank to dump to its own DISTCOMM_TRACE_DIR (through the
    store: each does within about a second, from its watchdog thread, whatever it is doing).
    ``python -m distcomm.trace DIR`` then says who is behind and where.
    """
    if all_ranks and diagnostics.monitor is not None:
        diagnostics.monitor.request_dump(f"dump_flight_recorder(all_ranks=True) on rank {diagnostics.monitor.rank}")
    if fr.recorder is None:
        return None
    return fr.recorder.dump(directory, reason="dump_flight_recorder()")


_breakpoint_cache: dict[int, int] = {}


def _terminal_pdb_class():
    import pdb

    class TerminalPdb(pdb.Pdb):
        """A worker started by a launcher (or multiprocessing) has stdin closed or redirected: the
        debugger reads the terminal while it interacts, then gives stdin back."""

        def interaction(self, *args, **kwargs):
            saved = sys.stdin
            try:
                with open("/dev/stdin") as sys.stdin:
                    pdb.Pdb.interaction(self, *args, **kwargs)
            finally:
                sys.stdin = saved

    return TerminalPdb


def breakpoint(rank: int = 0, skip: int = 0, timeout_s=3600):  # noqa: A001 - torch's name
    """Set a breakpoint, but only on a single rank. All other ranks wait (in a barrier) for you to be
    done with the breakpoint before continuing.

    ``skip``: skip the first ``skip`` calls from the same place. ``timeout_s`` (when not None)
    becomes every group's timeout, so the default one does not interrupt the debugging session.
    """
    import traceback

    if skip > 0:
        key = hash("".join(traceback.format_stack()[:-1]))
        counter = _breakpoint_cache.get(key, 0) + 1
        _breakpoint_cache[key] = counter
        if counter <= skip:
            return
    pg = default_group()
    if timeout_s is not None:
        for group in list(world.groups.values()):
            group.timeout = timedelta(seconds=timeout_s)
    if pg.rank() == rank:
        debugger = _terminal_pdb_class()()
        debugger.message(
            "\n!!! ATTENTION !!!\n\n"
            f"Type 'up' to get to the frame that called dist.breakpoint(rank={rank})\n"
        )
        debugger.set_trace()  # stops here, before the barrier; "up" shows the caller
    from .collectives import barrier

    barrier()
