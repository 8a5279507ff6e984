"""The generic engine: distcomm's point-to-point algorithms over any Transport.

``GenericCollectives`` is the GroupCollectives every engine can fall back on: it chooses an
algorithm of ``distcomm._algorithms`` by size and group size (``select.choose``) and runs it over
the call's Channel, with PREMUL_SUM's factor and AVG's division around a reduction and non-root
inputs untouched where torch keeps them (``reduction.with_op_arithmetic``, shared with the
shared-memory engine). It holds nothing but the engine's Tuning, so one
instance serves every group of an engine. ``GenericEngine`` is an Engine made of a Transport and these collectives: the TCP
engine, a world of one, and any third-party Transport registered with ``Backend.register_backend``.
"""

from __future__ import annotations

import numpy as np

from .. import reduction
from .._algorithms import select
from ..dtypes import DType
from ..transport.base import Channel, Transport, give_up, unwatch_group, watch_group
from ..tuning import DEFAULT, Tuning
from . import generic_latency
from .engine import Engine, FastPath, GroupCollectives, GroupSpec


class GenericCollectives(GroupCollectives):
    """The collectives as point-to-point algorithms over the call's Channel (see the module docstring)."""

    def __init__(self, tuning: Tuning = DEFAULT):
        self.tuning = tuning

    def all_reduce(self, ch: Channel, flat: np.ndarray, dtype: DType, op) -> None:
        def run(buf: np.ndarray) -> None:
            if ch.size > 1:
                algorithm = select.choose("allreduce", buf.nbytes, ch.size, self.tuning)
                algorithm(ch, buf, reduction.reducer(op, dtype))

        reduction.with_op_arithmetic(op, dtype, ch.size, flat, run)

    def reduce(self, ch: Channel, flat: np.ndarray, dtype: DType, op, root: int) -> None:
        """Result in ``flat`` on ``root``; other ranks' ``flat`` is left as it was."""

        def run(buf: np.ndarray) -> None:
            if ch.size > 1:
                algorithm = select.choose("reduce", buf.nbytes, ch.size, self.tuning)
                algorithm(ch, buf, root, reduction.reducer(op, dtype))

        reduction.with_op_arithmetic(op, dtype, ch.size, flat, run, keep=ch.rank != root, finishes=ch.rank == root)

    def broadcast(self, ch: Channel, flat: np.ndarray, root: int) -> None:
        if ch.size > 1:
            select.choose("broadcast", flat.nbytes, ch.size, self.tuning)(ch, flat, root)

    def all_gather(self, ch: Channel, out: np.ndarray, count: int) -> None:
        """``out`` holds size*count elements with this rank's block already in place."""
        if ch.size > 1:
            select.choose("allgather", out.nbytes, ch.size, self.tuning)(ch, out, count)

    def gather(self, ch: Channel, send: np.ndarray, out: np.ndarray | None, root: int) -> None:
        if ch.size == 1:
            out[: send.size] = send
            return
        select.choose("gather", send.nbytes * ch.size, ch.size, self.tuning)(ch, send, out, root)

    def scatter(self, ch: Channel, chunks: np.ndarray | None, out: np.ndarray, root: int) -> None:
        if ch.size == 1:
            out[...] = chunks[: out.size]
            return
        select.choose("scatter", out.nbytes * ch.size, ch.size, self.tuning)(ch, chunks, out, root)

    def reduce_scatter(self, ch: Channel, scratch: np.ndarray, out: np.ndarray, counts: list[int], dtype: DType, op) -> None:
        """``scratch`` is the concatenated input (clobbered); ``out`` gets this rank's reduced block."""

        def run(buf: np.ndarray) -> None:
            if ch.size == 1:
                out[...] = buf[: out.size]
            else:
                algorithm = select.choose("reduce_scatter", buf.nbytes, ch.size, self.tuning)
                algorithm(ch, buf, out, counts, reduction.reducer(op, dtype))

        reduction.with_op_arithmetic(op, dtype, ch.size, scratch, run, result=out)

    def all_to_all(self, ch: Channel, send: np.ndarray, send_counts, recv: np.ndarray, recv_counts) -> None:
        if ch.size == 1:
            recv[...] = send[: recv.size]
            return
        select.choose("alltoall", send.nbytes, ch.size, self.tuning)(ch, send, send_counts, recv, recv_counts)

    def barrier(self, ch: Channel) -> None:
        if ch.size > 1:
            select.choose("barrier", 0, ch.size, self.tuning)(ch)


class GenericEngine(Engine):
    """An Engine made of any Transport and the generic collectives."""

    def __init__(self, transport: Transport, tuning: Tuning = DEFAULT):
        self.transport = transport
        self._collectives = GenericCollectives(tuning)

    def collectives(self, group: GroupSpec) -> GroupCollectives:
        watch_group(self.transport, group.group_id, group.ranks)
        return self._collectives

    def fast_path(self, pg) -> FastPath | bool:
        """A small synchronous all_reduce straight to its algorithm (generic_latency.py)."""
        if len(pg.spec.ranks) == 1:
            return False
        return generic_latency.build(pg, self._collectives)

    def release_group(self, group_id: int) -> None:
        unwatch_group(self.transport, group_id)

    def give_up(self, group_id: int, seq: int, why: str) -> None:
        """A call of the group failed here: the transport refuses the group's later calls and tells
        its members (``Transport.give_up``, where the transport has it)."""
        give_up(self.transport, group_id, seq, why)

    def __repr__(self) -> str:
        return f"GenericEngine({self.transport!r})"
