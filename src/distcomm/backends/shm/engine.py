"""The shared-memory engine ("shm"): every rank of the world on this host.

Point-to-point runs over ``transport.shm.ShmTransport``'s rings; a group's collectives run through
its own shared memory (``group_collectives.ShmCollectives``: one module per algorithm, chosen by
``choose``), and small synchronous all_reduces and barriers take the latency path (``latency``). ``DISTCOMM_SHM_COLLECTIVES=0`` turns the
shared-memory collectives off: the generic algorithms then run over the rings.
"""

from __future__ import annotations

from datetime import timedelta

from ...errors import DistBackendError
from ...transport import hostid
from ...transport.shm import ShmTransport
from ...tuning import DEFAULT, Tuning
from ..engine import Engine, FastPath, GroupCollectives, GroupSpec
from ..generic import GenericCollectives
from .group_collectives import ShmCollectives


class ShmEngine(Engine):
    """Shared memory among the ranks of one host (``transport.ranks`` of them, global numbering)."""

    def __init__(self, transport: ShmTransport, tuning: Tuning = DEFAULT):
        self.transport = transport
        self._generic = GenericCollectives(tuning)
        self._collectives = ShmCollectives(transport, tuning) if tuning.shm_collectives else None

    def local(self, ranks) -> bool:
        """Are all of these engine ranks on this host (so a group of them can use shared memory)?"""
        return self.transport.all_local(ranks)

    def collectives(self, group: GroupSpec) -> GroupCollectives:
        if self._collectives is None or len(group.ranks) == 1 or not self.local(group.ranks):
            return self._generic
        return self._collectives

    def fast_path(self, pg) -> FastPath | bool | None:
        if self._collectives is None:
            return False
        return self._collectives.latency_paths(pg)

    def release_group(self, group_id: int) -> None:
        if self._collectives is not None:
            self._collectives.forget_group(group_id)
        self.transport.release_group(group_id)

    def __repr__(self) -> str:
        return f"ShmEngine({self.transport!r})"


def connect(store, rank: int, size: int, timeout: float, tuning: Tuning = DEFAULT, options=None) -> ShmEngine:
    """The "shm" engine: every rank must be on this host."""
    hosts = hostid.exchange(store, rank, size)
    if len(set(hosts)) > 1:
        # Every rank raises the same error. Rank 0 (which hosts the store under env://) waits until
        # the others are done with the store, or its exit would turn their error into a lost
        # connection.
        if rank == 0:
            store.wait([f"hostid/refused/{q}" for q in range(1, size)], timedelta(seconds=timeout))
        else:
            store.set(f"hostid/refused/{rank}", "1")
        raise DistBackendError(
            f"backend 'shm' needs every rank on one host, but {hostid.describe(hosts)}. Use backend "
            "'gloo' (the default: shared memory within a host, TCP between hosts) or 'tcp'."
        )
    return ShmEngine(ShmTransport.connect(store, rank, size, timeout, tuning=tuning), tuning)
