"""The default engine's collectives for a group that spans hosts with the same number of its ranks on
each: all_reduce from ``THRESHOLDS["allreduce_hierarchical_bytes"]`` up runs hierarchically
(``_algorithms/allreduce_hierarchical.py``: reduce-scatter inside each host, all_reduce across,
all-gather inside) unless ``DISTCOMM_ALGO_ALLREDUCE`` forces a generic algorithm; every other
collective, and smaller all_reduces, run the generic algorithms over the hybrid transport.

The phases inside a host run on ``host``, the collectives the engine has for the group's members on
this host (the shared-memory engine's: reduce-scatter and all-gather straight through a shared
segment), when the buffer splits evenly among them; otherwise point to point over the channel.
Why: on a loaded machine a point-to-point exchange over shared memory costs a sleep and wake-up at
each end and a send that waits for its reader, where the shared-memory collectives cost one
round; measured across two namespaced hosts, that is what made the hierarchy lose below 16 MiB
(docs/performance-notes.md, "Across hosts").
"""

from __future__ import annotations

import time
from typing import Sequence

import numpy as np

from .. import reduction
from .._algorithms import select
from .._algorithms.allreduce_hierarchical import HostPhases, allreduce_hierarchical
from ..dtypes import DType
from ..transport.base import Channel
from ..tuning import DEFAULT, Tuning
from ..types import RedOpType
from .engine import GroupCollectives
from .generic import GenericCollectives


class CollectiveHostPhases(HostPhases):
    """The phases inside a host on ``host`` (a GroupCollectives for the host's ranks of the group),
    over the host's sub-channel: the all-gather always, the reduce-scatter when ``scatter`` (else
    the point-to-point ring of HostPhases). Needs blocks of equal size (all_gather's). ``op`` is
    the reduction as the blocks need it (``reduce`` applies it): AVG's division and PREMUL_SUM's
    factor are the caller's, once, around the whole all_reduce."""

    def __init__(self, host: GroupCollectives, dtype: DType, op: RedOpType, reduce, scatter: bool):
        super().__init__(reduce)
        self.host, self.dtype, self.op, self.scatter = host, dtype, op, scatter

    def reduce_scatter(self, sub: Channel, buf: np.ndarray, bounds: Sequence[int]) -> None:
        if not self.scatter:
            return super().reduce_scatter(sub, buf, bounds)
        i = sub.rank
        counts = [bounds[b + 1] - bounds[b] for b in range(sub.size)]
        out = np.empty(counts[i], dtype=buf.dtype)
        self.host.reduce_scatter(sub, buf, out, counts, self.dtype, self.op)  # may clobber buf
        buf[bounds[i]: bounds[i + 1]] = out

    def all_gather(self, sub: Channel, buf: np.ndarray, bounds: Sequence[int], block: int) -> None:
        self.finish_sends()
        self.host.all_gather(sub, buf, bounds[1] - bounds[0])


class HierarchicalCollectives(GenericCollectives):
    """GenericCollectives, but all_reduce is hierarchical past a threshold. ``hosts[r]``: the host
    of group rank r; ``host``: the collectives for this host's ranks of the group (None: the phases
    inside a host run point to point)."""

    def __init__(self, hosts: Sequence, tuning: Tuning = DEFAULT, host: GroupCollectives | None = None):
        super().__init__(tuning)
        self.hosts = list(hosts)
        self.host = host
        self._per_host = len(self.hosts) // len(set(self.hosts))
        # A benchmark's window on the phases: when it sets this to a list, each hierarchical
        # all_reduce appends {phase: (wall seconds, this thread's CPU seconds)} for its three phases.
        self.phase_log: list | None = None

    def all_reduce(self, ch: Channel, flat: np.ndarray, dtype: DType, op) -> None:
        # a forced generic algorithm (DISTCOMM_ALGO_ALLREDUCE) runs the whole all_reduce, as it says
        if (self.tuning.algorithm("allreduce") is not None
                or flat.nbytes < select.threshold("allreduce_hierarchical_bytes", self.tuning)):
            return super().all_reduce(ch, flat, dtype, op)

        def cross(sub: Channel, part: np.ndarray, reduce) -> None:
            # Two hosts: one exchange of the whole slice (recursive doubling) up to a size, where
            # the generic choice would take two (halving-doubling) for the same bytes on the wire:
            # across hosts a round costs a wake-up at each end, the extra reduction little.
            algo = ("recursive_doubling" if sub.size == 2 and part.nbytes
                    <= select.threshold("allreduce_hierarchical_cross_exchange_bytes", self.tuning) else None)
            select.choose("allreduce", part.nbytes, sub.size, self.tuning, algo)(sub, part, reduce)

        reduce = reduction.reducer(op, dtype)
        phases = None
        if self.host is not None and flat.size % self._per_host == 0:
            kind = reduction.op_type(op)
            inner = RedOpType.SUM if kind in (RedOpType.AVG, RedOpType.PREMUL_SUM) else kind
            scatter = flat.nbytes <= select.threshold("allreduce_hierarchical_host_scatter_bytes", self.tuning)
            phases = CollectiveHostPhases(self.host, dtype, inner, reduce, scatter)

        log, times, mark = self.phase_log, {}, None
        if log is not None:
            last = [time.perf_counter(), time.thread_time()]

            def mark(phase: str) -> None:
                now = [time.perf_counter(), time.thread_time()]
                times[phase] = (now[0] - last[0], now[1] - last[1])
                last[:] = now

        def run(buf: np.ndarray) -> None:
            allreduce_hierarchical(ch, buf, reduce, self.hosts, cross, mark, phases)

        reduction.with_op_arithmetic(op, dtype, ch.size, flat, run)
        if log is not None:
            log.append(times)
