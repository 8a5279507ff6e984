"""Choosing an algorithm for a collective by message size and group size.

``choose(op_name, nbytes, world_size, algo=None)`` returns the function to call. The choice, in
order of precedence:

1. ``algo=`` (the benchmark and tests pass it);
2. the environment variable ``DISTCOMM_ALGO_<OP>``, e.g. ``DISTCOMM_ALGO_ALLREDUCE=ring``
   (``<OP>`` is the op name upper-cased, with or without underscores: ALLREDUCE or ALL_REDUCE);
3. the default rule below.

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

The thresholds are guesses to be tuned by ``distcomm-bench`` on the real transports (timing the
in-process transport says nothing): change them in ``THRESHOLDS`` or with the environment variable
``DISTCOMM_THRESHOLD_<NAME>`` (e.g. ``DISTCOMM_THRESHOLD_ALLREDUCE_SMALL_BYTES=262144``).
"""

from __future__ import annotations

import os
from typing import Callable

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

THRESHOLDS: dict[str, int] = {
    "allreduce_small_bytes": 64 * 1024,
    # Two ranks, tcp engine, loopback (distcomm-bench --algo all_reduce=..., two runs each, shared
    # 2-vCPU machine; µs, recursive doubling / halving-doubling):
    #   64 KiB 293/396, 215/331   128 KiB 303/388, 268/370   256 KiB 358/492, 363/475
    #   512 KiB 792/661, 784/668   1 MiB 1833/1143, 1790/1044   2 MiB 4004/2759, 3842/3802
    # Recursive doubling wins to 256 KiB, halving-doubling from 512 KiB.
    "allreduce_small_bytes_2ranks": 256 * 1024,
    # Two ranks above this: the pipelined ring (allreduce_ring_pipelined; at p = 2 it is
    # halving-doubling cut into segments). distcomm-bench --backend tcp --world 2 -b 4M -e 64M -f 4
    # --compare torch, speedup = gloo time / ours, one row per run, shared 2-vCPU machine:
    #   quiet (load ~1), 64 MiB: halving-doubling 1.27 1.23 1.12 1.24; pipelined 1 MiB/4: 0.97 0.57
    #     1.06 1.03, 2 MiB/4: 1.11 1.12 1.04 1.14, 4 MiB/2: 1.10 1.04 1.45 0.98
    #   loaded (load 3.5-4.6), halving-doubling (receives of the all-gather posted early) /
    #     pipelined 4 MiB, window 4 / window 2 / 2 MiB, 4 / 8 MiB, 4:
    #     64 MiB  0.52 0.80 0.54 / 0.94 1.03 0.85 / 0.90 0.87 1.26 / 0.86 0.78 0.58 / 0.78 0.75 0.68
    #     16 MiB  0.67 0.56 0.59 / 0.93 0.93 0.39 / 0.78 1.03 1.02 / 0.78 0.73 0.81 / 0.85 1.07 0.77
    #     4 MiB   0.86 0.69 0.98 / 0.62 0.96 0.63 / 0.84 1.14 2.10 / 0.75 0.60 0.85 / 1.10 1.06 0.68
    # Under load the pipeline holds up better (a descheduled rank stalls one segment, not a 32 MiB
    # phase); segments under 2 MiB pay more in per-message overhead than they gain. At 4 MiB each
    # block is one segment, so the threshold sits above it. World 3 (ring / pipelined, 64 MiB):
    # 0.58 0.92 / 0.93 0.71, 4 MiB 1.51 0.47 / 0.70 0.73: no clear winner on two shared cores, so
    # the ring stays the default there (DISTCOMM_ALGO_ALLREDUCE=ring_pipelined selects it).
    "allreduce_pipelined_bytes_2ranks": 8 << 20,
    "allreduce_segment_bytes": 4 << 20,
    "allreduce_segment_window": 4,
    "broadcast_large_bytes": 512 * 1024,
    "allgather_small_bytes": 64 * 1024,
}

_ALIASES = {"alltoallv": "alltoall", "alltoallsingle": "alltoall", "allgatherintotensor": "allgather"}


def _op_key(op_name: str) -> str:
    key = op_name.lower().replace("_", "")
    key = _ALIASES.get(key, key)
    if key not in ALGORITHMS:
        raise ValueError(f"no algorithms for collective {op_name!r}; known: {', '.join(sorted(ALGORITHMS))}")
    return key


# Reading the environment: choose() runs once per collective call, and os.environ.get costs ~1 µs
# (encode the name, look up, decode) — three of them were a visible part of an 8-byte all_reduce.
# os.environ keeps its contents in a plain dict (``_data``, encoded names) that every change through
# os.environ (including pytest's monkeypatch.setenv) writes through, so looking names up there,
# pre-encoded, is exact and ~30 ns. Where that detail is missing, fall back to os.environ.get.
_ENVIRON = os.environ
_ENV_DATA = getattr(os.environ, "_data", None)
_ENV_ENCODE = getattr(os.environ, "encodekey", None)
_ENV_DECODE = getattr(os.environ, "decodevalue", None)
if not (isinstance(_ENV_DATA, dict) and callable(_ENV_ENCODE) and callable(_ENV_DECODE)):
    _ENV_DATA = None


class _Var:
    """One environment variable, looked up fast (see above)."""

    __slots__ = ("name", "encoded")

    def __init__(self, name: str):
        self.name = name
        self.encoded = _ENV_ENCODE(name) if _ENV_DATA is not None else None

    def get(self) -> str | None:
        if _ENV_DATA is None or os.environ is not _ENVIRON:  # (a test may swap os.environ itself)
            return os.environ.get(self.name)
        value = _ENV_DATA.get(self.encoded)
        return None if value is None else _ENV_DECODE(value)


_THRESHOLD_VARS: dict[str, _Var] = {}
_PLANS: dict[str, tuple] = {}  # op_name as called -> (key, its DISTCOMM_ALGO_* variables)


def threshold(name: str) -> int:
    """A size threshold in bytes: ``DISTCOMM_THRESHOLD_<NAME>`` if set, else ``THRESHOLDS[name]``."""
    var = _THRESHOLD_VARS.get(name)
    if var is None:
        var = _THRESHOLD_VARS[name] = _Var(f"DISTCOMM_THRESHOLD_{name.upper()}")
    value = var.get()
    if value is None:
        return THRESHOLDS[name]
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{var.name}={value!r} is not a number of bytes") from None


def _plan(op_name: str) -> tuple:
    plan = _PLANS.get(op_name)
    if plan is None:
        key = _op_key(op_name)
        names = dict.fromkeys((f"DISTCOMM_ALGO_{key.upper()}", f"DISTCOMM_ALGO_{op_name.upper()}"))
        plan = _PLANS[op_name] = (key, tuple(_Var(n) for n in names))
    return plan


def _requested(key: str, op_name: str) -> str | None:
    for var in _plan(op_name)[1]:
        value = var.get()
        if value:
            return value
    return None


def _default(key: str, nbytes: int, world_size: int) -> str:
    if key == "allreduce":
        if nbytes <= threshold("allreduce_small_bytes_2ranks" if world_size == 2 else "allreduce_small_bytes"):
            return "recursive_doubling"
        if world_size == 2 and nbytes > threshold("allreduce_pipelined_bytes_2ranks"):
            return "ring_pipelined"
        return "halving_doubling" if world_size & (world_size - 1) == 0 else "ring"
    if key == "broadcast":
        if world_size >= 3 and nbytes > threshold("broadcast_large_bytes"):
            return "scatter_allgather"
        return "binomial"
    if key == "allgather":
        return "bruck" if nbytes <= threshold("allgather_small_bytes") else "ring"
    return next(iter(ALGORITHMS[key]))  # the only real one


def choose(op_name: str, nbytes: int, world_size: int, algo: str | None = None) -> Callable:
    """The algorithm function for ``op_name`` ("allreduce", "all_reduce", "broadcast", ...)."""
    key, variables = _PLANS.get(op_name) or _plan(op_name)
    name = algo
    if name is None:
        for var in variables:
            name = var.get()
            if name:
                break
        else:
            name = _default(key, nbytes, world_size)
    table = ALGORITHMS[key]
    try:
        return table[name.lower()]
    except KeyError:
        source = "algo=" if algo else f"DISTCOMM_ALGO_{key.upper()}"
        raise ValueError(
            f"unknown {key} algorithm {name!r} (from {source}); valid: {', '.join(table)}"
        ) from None
