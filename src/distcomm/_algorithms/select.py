"""Choosing an algorithm for a collective by message size and group size.

``choose(op_name, nbytes, world_size, tuning=DEFAULT, algo=None)`` returns the function to call;
it is pure: the same arguments always give the same function. The choice, in order of precedence:

1. ``algo=`` (the benchmark and tests pass it);
2. ``tuning.algorithms`` (``DISTCOMM_ALGO_<OP>``, e.g. ``DISTCOMM_ALGO_ALLREDUCE=ring``, read once
   into a ``Tuning`` when the engine is connected; see tuning.py);
3. the default rule below, with ``tuning.thresholds`` over ``THRESHOLDS``.

An unknown name raises ValueError listing the valid ones; every op also accepts "reference" (the
naive oracle). ``nbytes`` is the whole message: the buffer for all_reduce/broadcast/reduce, the
whole output for all_gather/gather, the whole input for scatter/reduce_scatter/all_to_all.

Default rule, and why (α ≈ 10-20 µs per message for Python over loopback TCP, β ≈ 0.3 ns/B at
~3.5 GB/s, plus the reduction at a few GB/s; see the cost in each module's docstring):

* all_reduce: recursive doubling up to ``allreduce_small_bytes`` (64 KiB; 256 KiB for two ranks,
  ``allreduce_small_bytes_2ranks``, measured, see THRESHOLDS). It has the fewest
  rounds (log2 p) but moves n per round; the ring / halving-doubling move 2n(p-1)/p in total and
  reduce only n(p-1)/p. At p = 2 recursive doubling costs α + nβ + nγ against 2α + nβ + nγ/2 for
  halving-doubling, a crossover near n = 2α/γ ≈ 64-150 KiB; at larger p it comes earlier in rounds
  but later in bytes, so 64 KiB is a sound single number. Above it: halving-doubling on powers of
  two (2 log2 p rounds), the ring otherwise (halving-doubling's fold would add two full-buffer
  messages on the folded ranks). Two ranks above ``allreduce_pipelined_bytes_2ranks`` (8 MiB):
  the pipelined ring, segments of ``allreduce_segment_bytes`` (4 MiB), ``allreduce_segment_window``
  (4) of them in scratch (measured, see THRESHOLDS).
* broadcast: binomial tree, except scatter-allgather above ``broadcast_large_bytes`` (512 KiB) when
  p ≥ 3 (≈2n bytes per rank instead of n log2 p; at p = 2 both move n and the tree is simpler).
* all_gather: Bruck up to ``allgather_small_bytes`` (64 KiB of output; log2 p rounds), the ring
  above (no extra copy, neighbour traffic).
* reduce: binomial tree; gather/scatter: direct; reduce_scatter: ring; all_to_all: pairwise;
  barrier: dissemination — one algorithm each.

The thresholds are tuned with ``distcomm-bench`` on the real transports (timing the in-process
transport says nothing): change them in ``thresholds.THRESHOLDS`` or with the environment variable
``DISTCOMM_THRESHOLD_<NAME>`` (e.g. ``DISTCOMM_THRESHOLD_ALLREDUCE_SMALL_BYTES=262144``).
"""

from __future__ import annotations

import functools
from typing import Callable

from ..tuning import DEFAULT, Tuning

from . import reference
from .allgather_bruck import allgather_bruck
from .allgather_ring import allgather_ring
from .allreduce_halving_doubling import allreduce_halving_doubling
from .allreduce_recursive_doubling import allreduce_recursive_doubling
from .allreduce_ring import allreduce_ring
from .allreduce_ring_pipelined import allreduce_ring_pipelined
from .alltoall_pairwise import alltoallv_pairwise
from .barrier_dissemination import barrier_dissemination
from .broadcast_binomial import broadcast_binomial
from .broadcast_scatter_allgather import broadcast_scatter_allgather
from .gather import gather_direct
from .reduce_binomial import reduce_binomial
from .reduce_scatter_ring import reduce_scatter_ring
from .scatter import scatter_direct
from .thresholds import THRESHOLDS

ALGORITHMS: dict[str, dict[str, Callable]] = {
    "allreduce": {
        "ring": allreduce_ring,
        "recursive_doubling": allreduce_recursive_doubling,
        "halving_doubling": allreduce_halving_doubling,
        "ring_pipelined": allreduce_ring_pipelined,
        "reference": reference.allreduce,
    },
    "broadcast": {
        "binomial": broadcast_binomial,
        "scatter_allgather": broadcast_scatter_allgather,
        "reference": reference.broadcast,
    },
    "reduce": {"binomial": reduce_binomial, "reference": reference.reduce},
    "allgather": {"ring": allgather_ring, "bruck": allgather_bruck, "reference": reference.allgather},
    "gather": {"direct": gather_direct, "reference": reference.gather},
    "scatter": {"direct": scatter_direct, "reference": reference.scatter},
    "reducescatter": {"ring": reduce_scatter_ring, "reference": reference.reduce_scatter},
    "alltoall": {"pairwise": alltoallv_pairwise, "reference": reference.alltoallv},
    "barrier": {"dissemination": barrier_dissemination, "reference": reference.barrier},
}

_ALIASES = {"alltoallv": "alltoall", "alltoallsingle": "alltoall", "allgatherintotensor": "allgather"}


def _op_key(op_name: str) -> str:
    key = op_name.lower().replace("_", "")
    key = _ALIASES.get(key, key)
    if key not in ALGORITHMS:
        raise ValueError(f"no algorithms for collective {op_name!r}; known: {', '.join(sorted(ALGORITHMS))}")
    return key


def threshold(name: str, tuning: Tuning = DEFAULT) -> int:
    """A size threshold in bytes: ``tuning``'s (DISTCOMM_THRESHOLD_<NAME>) or ``THRESHOLDS[name]``."""
    if name not in THRESHOLDS:
        raise ValueError(f"no threshold {name!r}; known: {', '.join(THRESHOLDS)}")
    return tuning.thresholds.get(name, THRESHOLDS[name])


_KEYS: dict[str, str] = {}  # op name as called -> its key in ALGORITHMS


def _default(key: str, nbytes: int, world_size: int, tuning: Tuning) -> str:
    if key == "allreduce":
        small = "allreduce_small_bytes_2ranks" if world_size == 2 else "allreduce_small_bytes"
        if nbytes <= threshold(small, tuning):
            return "recursive_doubling"
        if world_size == 2 and nbytes > threshold("allreduce_pipelined_bytes_2ranks", tuning):
            return "ring_pipelined"
        return "halving_doubling" if world_size & (world_size - 1) == 0 else "ring"
    if key == "broadcast":
        if world_size >= 3 and nbytes > threshold("broadcast_large_bytes", tuning):
            return "scatter_allgather"
        return "binomial"
    if key == "allgather":
        return "bruck" if nbytes <= threshold("allgather_small_bytes", tuning) else "ring"
    return next(iter(ALGORITHMS[key]))  # the only real one


@functools.lru_cache(maxsize=None)
def _pipelined(segment_bytes: int, window: int) -> Callable:
    return functools.partial(allreduce_ring_pipelined, segment_bytes=segment_bytes, window=window)


def choose(op_name: str, nbytes: int, world_size: int, tuning: Tuning = DEFAULT, algo: str | None = None) -> Callable:
    """The algorithm function for ``op_name`` ("allreduce", "all_reduce", "broadcast", ...)."""
    key = _KEYS.get(op_name)
    if key is None:
        key = _KEYS[op_name] = _op_key(op_name)
    name = algo or tuning.algorithms.get(key) or _default(key, nbytes, world_size, tuning)
    table = ALGORITHMS[key]
    try:
        fn = table[name.lower()]
    except KeyError:
        source = "algo=" if algo else f"DISTCOMM_ALGO_{key.upper()}"
        raise ValueError(
            f"unknown {key} algorithm {name!r} (from {source}); valid: {', '.join(table)}"
        ) from None
    if fn is allreduce_ring_pipelined and tuning.thresholds:
        segment_bytes = threshold("allreduce_segment_bytes", tuning)
        window = threshold("allreduce_segment_window", tuning)
        if (segment_bytes, window) != (THRESHOLDS["allreduce_segment_bytes"], THRESHOLDS["allreduce_segment_window"]):
            return _pipelined(segment_bytes, window)
    return fn
