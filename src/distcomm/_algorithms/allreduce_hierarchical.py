"""Hierarchical all_reduce for a group spread over hosts: reduce-scatter inside each host, all_reduce
of each slice across hosts, all-gather inside each host (the two-level scheme of NCCL's trees'
intra/inter split and of Horovod's hierarchical allreduce).

With H hosts each holding L of the group's ranks, local rank i of every host owns the same slice
(1/L of the buffer). Three phases, each an existing algorithm on a ``Channel.subset``:

1. reduce-scatter among the L ranks of a host: local rank i ends with its host's sum of slice i;
2. all_reduce of that slice among the H ranks with local index i (one per host): ``cross``, by
   default ``select.choose``'s algorithm for the slice's size and H;
3. all-gather among the L ranks of a host.

The phases inside a host are a ``HostPhases``: by default a ring over point-to-point (the last
reduce-scatter send is waited for only before the all-gather, see ``_reduce_scatter``); an engine
may pass collectives it has among the ranks of a host (backends/hierarchical.py: shared memory).

Why: on a hybrid transport the links inside a host are shared memory and those between hosts TCP.
A flat ring over all H·L ranks sends 2(HL-1)/(HL)·n bytes over each of its TCP hops and runs at the
speed of its slowest hop at every one of its 2(HL-1) steps; here each rank sends 2(H-1)/H·n/L bytes
over TCP, L connections per host pair carry the cross-host traffic side by side, and the intra-host
phases run at memory speed. Below some size the extra latency of three phases loses
(``THRESHOLDS["allreduce_hierarchical_bytes"]``; docs/performance-notes.md, "Across hosts").

Requires the same number of ranks on every host (the caller falls back to a flat algorithm
otherwise). The result is bit-identical on every rank: each slice is reduced across hosts by an
algorithm whose result is identical on its ranks, then only copied.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from ..transport.base import Channel, ChannelRequest
from ._blocks import Reducer, even_counts, offsets, ring_allgather, ring_reduce_scatter_pending


def layout(hosts: Sequence) -> tuple[list[list[int]], bool]:
    """The group's ranks per host (hosts in order of first appearance, ranks in group order), and
    whether every host holds the same number of them."""
    by_host: dict = {}
    for rank, host in enumerate(hosts):
        by_host.setdefault(host, []).append(rank)
    groups = list(by_host.values())
    return groups, len({len(g) for g in groups}) == 1


class HostPhases:
    """The two phases inside a host, over the host's sub-channel (sub-rank = local index i). This
    class runs them point to point (ring reduce-scatter, ring all-gather); an engine with a faster
    way among the ranks of a host (shared-memory collectives) passes its own."""

    def __init__(self, reduce: Reducer):
        self.reduce = reduce
        self._sending: ChannelRequest | None = None

    def reduce_scatter(self, sub: Channel, buf: np.ndarray, bounds: Sequence[int]) -> None:
        """Reduce each block ``buf[bounds[b]:bounds[b+1]]`` among the host's ranks, in place:
        block i ends on local rank i (so the all-gather may be another implementation's)."""
        tmp = np.empty(2 * (bounds[1] - bounds[0]), dtype=buf.dtype)
        # the ring from block i - 1 ends on block i
        # the last step's send is waited for only before the all-gather, after the cross-host phase:
        # on shared memory a large send completes when the peer has read it, and waiting here would
        # often cost one more sleep and wake-up per call for nothing
        _, self._sending = ring_reduce_scatter_pending(sub, buf, bounds, sub.rank - 1, self.reduce, tmp)

    def all_gather(self, sub: Channel, buf: np.ndarray, bounds: Sequence[int], block: int) -> None:
        """Every rank of the host gets every block; this rank holds ``block`` (its local index)."""
        self.finish_sends()
        ring_allgather(sub, buf, bounds, block)

    def finish_sends(self) -> None:
        """Wait for the reduce-scatter's last send: before the all-gather, which receives into
        the block it sent."""
        if self._sending is not None:
            self._sending.wait()
            self._sending = None


def allreduce_hierarchical(ch: Channel, buf: np.ndarray, reduce: Reducer, hosts: Sequence,
                           cross: Callable[[Channel, np.ndarray, Reducer], None],
                           phase_done: Callable[[str], None] | None = None,
                           host_phases: HostPhases | None = None) -> None:
    """Reduce ``buf`` across the group in place; ``hosts[r]`` is group rank r's host (any hashable).
    ``cross(channel, slice, reduce)`` all-reduces a slice among one rank per host. ``host_phases``:
    how the phases inside a host run (by default ``HostPhases(reduce)``, point to point).
    ``phase_done(name)``, if given, is called as each phase ends ("reduce_scatter", "cross",
    "allgather"): what the benchmark times the phases by."""
    groups, uniform = layout(hosts)
    if not uniform:
        raise ValueError(f"hierarchical all_reduce needs the same number of ranks on every host, got {groups}")
    mine = next(g for g in groups if ch.rank in g)
    i = mine.index(ch.rank)
    local = ch.subset(mine) if len(mine) > 1 else None
    across = ch.subset([g[i] for g in groups]) if len(groups) > 1 else None
    bounds = offsets(even_counts(buf.size, len(mine)))
    phases = host_phases if host_phases is not None else HostPhases(reduce)
    if local is not None:
        phases.reduce_scatter(local, buf, bounds)
    if phase_done is not None:
        phase_done("reduce_scatter")
    if across is not None:
        cross(across, buf[bounds[i]: bounds[i + 1]], reduce)
    if phase_done is not None:
        phase_done("cross")
    if local is not None:
        phases.all_gather(local, buf, bounds, i)
    if phase_done is not None:
        phase_done("allgather")
