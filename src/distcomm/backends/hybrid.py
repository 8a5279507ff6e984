"""The default CPU engine ("gloo", or backend=None): shared memory within a host, TCP between hosts.

Every rank learns every rank's host id (transport/hostid.py). When the whole world is on one host,
the common case, the engine *is* the shared-memory engine: no sockets at all. Otherwise each rank
connects a ShmTransport among the ranks of its host and a TcpTransport to the world, and
``transport.hybrid.HybridTransport`` sends each message over the right one. A group entirely on
this host runs the shared-memory collectives; a group that spans hosts runs the generic
algorithms over the hybrid transport, except that when each of its hosts holds the same number
(more than one) of its ranks, large all_reduces run hierarchically (backends/hierarchical.py), their
phases inside a host on the shared-memory engine's collectives for the group's ranks here. In such
a world the shared-memory waiters sleep at once (``blocking_waits``).
"""

from __future__ import annotations

import dataclasses

from .._algorithms.allreduce_hierarchical import layout
from ..transport import hostid
from ..transport.base import unwatch_group, watch_group
from ..transport.hybrid import HybridTransport
from ..transport.shm import ShmTransport
from ..tuning import DEFAULT, Tuning
from .engine import Engine, FastPath, GroupCollectives, GroupSpec
from .generic import GenericCollectives
from .hierarchical import HierarchicalCollectives
from .shm import ShmEngine


class HybridEngine(Engine):
    """Shared memory among this host's ranks (``shm``, None when this rank is alone on its host)
    and TCP to the rest, through one HybridTransport. ``hosts[r]``: rank r's host id."""

    def __init__(self, transport: HybridTransport, shm: ShmEngine | None, tuning: Tuning = DEFAULT,
                 hosts: list[str] | None = None):
        self.transport = transport
        self._shm = shm
        self._tuning = tuning
        self._hosts = hosts
        self._generic = GenericCollectives(tuning)

    def collectives(self, group: GroupSpec) -> GroupCollectives:
        if self._shm is not None and self._shm.local(group.ranks):
            return self._shm.collectives(group)
        watch_group(self.transport, group.group_id, group.ranks)
        if self._hosts is not None:
            hosts = [self._hosts[r] for r in group.ranks]
            by_host, uniform = layout(hosts)
            if uniform and len(by_host) > 1 and len(by_host[0]) > 1:
                return HierarchicalCollectives(hosts, self._tuning, self._host_collectives(group, by_host))
        return self._generic

    def _host_collectives(self, group: GroupSpec, by_host: list[list[int]]) -> GroupCollectives | None:
        """The shared-memory engine's collectives for the group's members on this host (the
        hierarchy's phases inside a host run on them). Their segment is the group's id on this
        host's shared memory, which the group itself never uses: it spans hosts."""
        if self._shm is None:
            return None
        mine = next(g for g in by_host if group.rank in g)
        return self._shm.collectives(GroupSpec(group.group_id, [group.ranks[r] for r in mine], mine.index(group.rank)))

    def fast_path(self, pg) -> FastPath | bool | None:
        if self._shm is None or not self._shm.local(pg.spec.ranks):
            return False
        return self._shm.fast_path(pg)

    def release_group(self, group_id: int) -> None:
        unwatch_group(self.transport, group_id)
        if self._shm is not None:
            self._shm.release_group(group_id)

    def __repr__(self) -> str:
        return f"HybridEngine({self.transport!r})"


def blocking_waits(tuning: Tuning) -> Tuning:
    """``tuning`` with the shared-memory waiters' spin and yield phases off, unless set
    (DISTCOMM_SHM_SPIN_US, DISTCOMM_SHM_YIELD_US, DISTCOMM_SHM_SHARED_YIELD_US): when the world spans
    hosts, a rank waiting on shared memory mostly waits for a host mate whose phase is bound by TCP
    (the hierarchical all_reduce's all-gather waits for its cross-host phase), for milliseconds;
    spinning or yielding meanwhile only takes CPU from the ranks doing the work, so it sleeps at
    once (measured across namespaced hosts sharing a loaded machine's CPUs: docs/performance-notes.md,
    "Across hosts")."""
    return dataclasses.replace(
        tuning,
        shm_spin_s=0.0 if tuning.shm_spin_s is None else tuning.shm_spin_s,
        shm_yield_s=0.0 if tuning.shm_yield_s is None else tuning.shm_yield_s,
        shm_shared_yield_s=0.0 if tuning.shm_shared_yield_s is None else tuning.shm_shared_yield_s,
    )


def connect(store, rank: int, size: int, timeout: float, tuning: Tuning = DEFAULT, options=None) -> Engine:
    """The default CPU engine: shared memory between ranks of a host, TCP between hosts."""
    hosts = hostid.exchange(store, rank, size)
    local = [q for q in range(size) if hosts[q] == hosts[rank]]
    if len(local) == size:
        return ShmEngine(ShmTransport.connect(store, rank, size, timeout, tuning=tuning), tuning)
    from ..transport.tcp import TcpTransport

    shm = ShmTransport.connect(store, rank, size, timeout, local, blocking_waits(tuning)) if len(local) > 1 else None
    try:
        tcp = TcpTransport.connect(store, rank, size, timeout)
    except BaseException:
        if shm is not None:
            shm.close()
        raise
    shm_engine = None if shm is None else ShmEngine(shm, tuning)
    return HybridEngine(HybridTransport(rank, size, shm, tcp), shm_engine, tuning, hosts)
