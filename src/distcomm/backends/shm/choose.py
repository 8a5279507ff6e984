"""Which shared-memory algorithm runs a call: ``choose(op, nbytes, size, capabilities, tuning)``,
a pure function of the call's size, the group and the engine's Tuning.

Rules (n: the message's bytes per rank, p: the group size; docs/performance-notes.md has the
measurements behind each threshold):

* all_reduce: "allreduce_direct" (one round, every rank reduces all p copies) up to
  ``allreduce_direct_bytes`` (256 KiB; ``allreduce_direct_bytes_2ranks``, 1 MiB, at p = 2): the
  rounds and copies of slices cost more than the extra reductions up to there. Past one slot the
  direct algorithm runs as "reduce_direct" with every rank reading, a round per slot. From
  ``allreduce_readv_bytes`` (4 MiB; ``allreduce_readv_bytes_2ranks``, past 1 MiB, at p = 2, where
  each rank folds into its own copy) "allreduce_readv", else "allreduce_slices".
* the copy-only collectives (scatter by its whole input), and reduce: single copy ("<op>_readv")
  from ``readv_bytes`` (4 MiB),
  where a system call and page pinning per chunk are paid back by copying once and not running in
  lockstep; below, through slots. scatter also from where a rank's block no longer fits its piece
  of one slot (a slot / p): the slots would take two rounds or more. broadcast at p = 2 as soon as
  the message needs more than one slot: "broadcast_split" (the reader reads the head while the root
  writes the tail: both CPUs copy), where the slots' later rounds cost 2-3x more.
* gather: from ``readv_bytes`` "gather_writev" (every peer writes its block into the root's output,
  all at once); below, through slots. "gather_readv" (the root alone reads every block) only when
  forced: the slots' pipeline matched it at every size. barrier: through slots only.
* Single copy needs every member allowed to read (and so write: the same ptrace permission) every
  other's memory (``direct_reads``); without it every single-copy choice, forced ones included,
  falls back to its slots form.

``DISTCOMM_SHM_ALGO_ALLREDUCE=direct|slices|readv`` and
``DISTCOMM_SHM_ALGO_<BROADCAST|ALLGATHER|REDUCE|REDUCESCATTER|ALLTOALL|SCATTER|GATHER>=slots|readv``,
``DISTCOMM_SHM_ALGO_BROADCAST=split`` and ``DISTCOMM_SHM_ALGO_GATHER=writev`` force a
choice (``check_forced`` refuses other values when the engine is set up);
``DISTCOMM_SHM_THRESHOLD_<NAME>`` replaces a threshold (``allreduce_direct_bytes`` replaces
both direct limits, ``allreduce_readv_bytes`` both all_reduce single-copy thresholds).
"""

from __future__ import annotations

from typing import NamedTuple

from ...tuning import Tuning
from .scatter_slots import piece_bytes

THRESHOLDS = {
    "allreduce_direct_bytes": 256 * 1024,
    "allreduce_direct_bytes_2ranks": 1 << 20,
    "readv_bytes": 4 << 20,
    "allreduce_readv_bytes": 4 << 20,
    "allreduce_readv_bytes_2ranks": (1 << 20) + 1,
}

#: op -> the values DISTCOMM_SHM_ALGO_<OP> may take
FORCEABLE = {
    "allreduce": ("direct", "slices", "readv"),
    "broadcast": ("slots", "readv", "split"),
    "allgather": ("slots", "readv"),
    "reduce": ("slots", "readv"),
    "reducescatter": ("slots", "readv"),
    "alltoall": ("slots", "readv"),
    "scatter": ("slots", "readv"),
    "gather": ("slots", "readv", "writev"),
}


class Capabilities(NamedTuple):
    """What a group's shared memory can do (the same on every member)."""

    direct_reads: bool  # every member may read every other's memory (process_vm_readv)
    slot_bytes: int  # one slot's capacity


def check_forced(tuning: Tuning) -> None:
    """Raise ValueError for a DISTCOMM_SHM_ALGO_<OP> value that names no algorithm of ``op``."""
    for op, valid in FORCEABLE.items():
        value = tuning.shm_algorithm(op)
        if value is not None and value not in valid:
            raise ValueError(f"DISTCOMM_SHM_ALGO_{op.upper()}={value!r}: valid: {', '.join(valid)}")


def _threshold(tuning: Tuning, name: str) -> int:
    value = tuning.shm_thresholds.get(name)
    return THRESHOLDS[name] if value is None else value


def direct_limit(size: int, tuning: Tuning) -> int:
    """The largest all_reduce (bytes) the direct algorithm takes by size in a group of ``size``."""
    forced = tuning.shm_thresholds.get("allreduce_direct_bytes")
    if forced is not None:
        return forced
    return THRESHOLDS["allreduce_direct_bytes_2ranks" if size == 2 else "allreduce_direct_bytes"]


def readv_threshold(size: int, tuning: Tuning) -> int:
    """The smallest all_reduce (bytes) the single-copy algorithm takes by size in a group of ``size``."""
    forced = tuning.shm_thresholds.get("allreduce_readv_bytes")
    if forced is not None:
        return forced
    return THRESHOLDS["allreduce_readv_bytes_2ranks" if size == 2 else "allreduce_readv_bytes"]


def latency_limit(size: int, slot_bytes: int, tuning: Tuning) -> int:
    """The largest all_reduce (bytes) the latency path may take: what ``choose`` sends to
    "allreduce_direct" by size; 0 (no latency path) when an all_reduce algorithm is forced."""
    if tuning.shm_algorithm("allreduce") is not None:
        return 0
    return min(direct_limit(size, tuning), slot_bytes)


def choose(op: str, nbytes: int, size: int, caps: Capabilities, tuning: Tuning) -> str:
    """The algorithm (a module name of this package) for ``op`` ("allreduce", "reduce",
    "broadcast", "allgather", "gather", "scatter", "reducescatter", "alltoall", "barrier") of
    ``nbytes`` per rank in a group of ``size``."""
    forced = tuning.shm_algorithm(op)
    if op == "allreduce":
        if forced is None:
            if nbytes <= direct_limit(size, tuning):
                forced = "direct"
            else:
                forced = "readv" if nbytes >= readv_threshold(size, tuning) else "slices"
        if forced == "readv" and not caps.direct_reads:
            forced = "slices"
        if forced == "direct":
            return "allreduce_direct" if nbytes <= caps.slot_bytes else "reduce_direct"
        return "allreduce_" + forced
    if op == "barrier":
        return "barrier_slots"
    large = nbytes >= _threshold(tuning, "readv_bytes")
    if op == "scatter" and nbytes > size * piece_bytes(caps.slot_bytes, size):
        large = True  # a block of more than one round's piece
    if op == "gather":
        if forced is None:
            forced = "writev" if large else "slots"
        return f"gather_{forced}" if forced != "slots" and caps.direct_reads else "gather_slots"
    if op == "broadcast" and (forced == "split" or (forced is None and size <= 2 and (large or nbytes > caps.slot_bytes))):
        return "broadcast_split" if caps.direct_reads else "broadcast_slots"
    readv = forced == "readv" if forced else large
    if op == "reduce":
        return "reduce_readv" if readv and caps.direct_reads else "reduce_direct"
    names = {"reducescatter": "reduce_scatter"}
    return names.get(op, op) + ("_readv" if readv and caps.direct_reads else "_slots")
