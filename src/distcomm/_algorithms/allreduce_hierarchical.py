"""Hierarchical all_reduce for a group spread over hosts: reduce-scatter inside each host, all_reduce
of each slice across hosts, all-gather inside each host (the two-level scheme of NCCL's trees'
intra/inter split and of Horovod's hierarchical allreduce).

With H hosts each holding L of the group's ranks, local rank i of every host owns the same slice
(1/L of the buffer). Three phases, each an existing algorithm on a ``Channel.subset``:

1. ring reduce-scatter among the L ranks of a host: local rank i ends with its host's sum of slice
   (i+1) mod L;
2. all_reduce of that slice among the H ranks with local index i (one per host): ``cross``, by
   default ``select.choose``'s algorithm for the slice's size and H;
3. ring all-gather among the L ranks of a host.

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

from ..transport.base import Channel
from ._blocks import Reducer, even_counts, offsets, ring_allgather, ring_reduce_scatter


def layout(hosts: Sequence) -> tuple[list[list[int]], bool]:
    """The group's ranks per host (hosts in order of first appearance, ranks in group order), and
    whether every host holds the same number of them."""
    by_host: dict = {}
    for rank, host in enumerate(hosts):
        by_host.setdefault(host, []).append(rank)
    groups = list(by_host.values())
    return groups, len({len(g) for g in groups}) == 1


def allreduce_hierarchical(ch: Channel, buf: np.ndarray, reduce: Reducer, hosts: Sequence,
                           cross: Callable[[Channel, np.ndarray, Reducer], None]) -> None:
    """Reduce ``buf`` across the group in place; ``hosts[r]`` is group rank r's host (any hashable).
    ``cross(channel, slice, reduce)`` all-reduces a slice among one rank per host."""
    groups, uniform = layout(hosts)
    if not uniform:
        raise ValueError(f"hierarchical all_reduce needs the same number of ranks on every host, got {groups}")
    mine = next(g for g in groups if ch.rank in g)
    i = mine.index(ch.rank)
    local = ch.subset(mine) if len(mine) > 1 else None
    across = ch.subset([g[i] for g in groups]) if len(groups) > 1 else None
    L = len(mine)
    bounds = offsets(even_counts(buf.size, L))
    done = i
    if local is not None:
        tmp = np.empty(2 * (bounds[1] - bounds[0]), dtype=buf.dtype)
        done = ring_reduce_scatter(local, buf, bounds, i, reduce, tmp)
    if across is not None:
        cross(across, buf[bounds[done]: bounds[done + 1]], reduce)
    if local is not None:
        ring_allgather(local, buf, bounds, done)
