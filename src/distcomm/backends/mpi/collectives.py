"""One process group's collectives on the MPI engine.

Each collective MPI has is one nonblocking MPI call on the group's communicator (``Iallreduce``,
``Ireduce``, ``Ibcast``, ``Iallgather``, ``Igather``, ``Iscatter``, ``Ireduce_scatter_block``,
``Ialltoallv``, ``Ibarrier``; a barrier, and an all_reduce of a small message, start a persistent
request instead: persistent.py), tested against the call's deadline: nonblocking so that a timeout
is honoured (MPI's blocking calls cannot be interrupted). What MPI lacks (``native``) runs
``GenericCollectives``, distcomm's algorithms, over ``MpiTransport`` on the same communicator.

MPI matches native collectives by their order on the communicator and checks no signature: ranks
that call different collectives, or one with different ops, get MPI's behaviour (a hang until the
timeout, or wrong results); a message longer than its receive is MPI's truncation error, reported as
a mismatch. Every rank must therefore make the same MPI call for the same distcomm call: the choice
between native and distcomm's algorithms depends only on what all ranks share (op, dtype, the split
of reduce_scatter), never on one rank's own counts (all_to_all is always ``Ialltoallv``).

MPI forbids a send buffer that overlaps the receive buffer of the same call (MPI_IN_PLACE aside).
Where a caller's input and output can be one memory (``all_to_all_single(t, t)``), the call sends
a copy of the input, or receives into a temporary, whichever is smaller; MPI_IN_PLACE is no
answer there, as MPI requires it of every rank or none, and each rank sees only its own buffers.

A native call that times out, or whose wait ends because a member left the job (transport/mpi.py,
"Lost peers"), cannot be cancelled (MPI has no cancel for collectives): MPI may still write into its
buffers, so they are kept alive, and the group is marked broken; every later call on
it raises at once (as torch's NCCL aborts a communicator after a timeout). Destroy the group, or
end the job.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from ... import reduction
from ...dtypes import DType
from ...errors import DistBackendError, describe_op
from ...transport.base import Channel, TransportError
from ...transport.mpi import GroupComm, MpiTransport, mpi_error, wait_request
from ...tuning import Tuning
from ...types import RedOpType
from ..engine import GroupCollectives, GroupSpec
from ..generic import GenericCollectives
from .native import equal, native_reduction
from .persistent import PersistentRequests


def _bytes(a: np.ndarray) -> np.ndarray:
    return a.reshape(-1).view(np.uint8)


def _overlap(a: np.ndarray, b: np.ndarray | None) -> bool:
    """Whether ``a`` and ``b`` may share memory (bounds only: a cheap test, never wrong in the
    direction that matters: a copy too many, never one too few)."""
    return b is not None and np.may_share_memory(a, b)


def _offsets(counts) -> list[int]:
    out, at = [], 0
    for c in counts:
        out.append(at)
        at += c
    return out


class MpiCollectives(GroupCollectives):
    """The collectives of one group (``group``: its communicator) on the MPI engine."""

    def __init__(self, transport: MpiTransport, group: GroupComm, spec: GroupSpec, tuning: Tuning):
        self.MPI = transport.MPI
        self.transport = transport
        self.comm = group.comm
        self.check = group.check  # for waits: the transport closed, a member left the job
        self.size = len(spec.ranks)
        self.generic = GenericCollectives(tuning)
        self.broken: str | None = None  # why the group can no longer be used
        self.abandoned: list = []  # (request, buffers) of timed-out native calls: MPI may still use them
        self._reductions: dict = {}  # (op, dtype name) -> (MPI datatype, MPI op) or None
        # every barrier and native all_reduce of at most persistent.LIMIT bytes, on either path
        self.persistent = PersistentRequests(self.comm, self.MPI)

    def release(self) -> None:
        """Free what the group holds in MPI, before its communicator is freed. A broken group's
        requests may still be active (MPI cannot cancel a collective): they are left to MPI."""
        if self.broken is None:
            self.persistent.free()

    # -- the plumbing ----------------------------------------------------------------------------
    def reduction(self, op, dtype: DType):
        """(MPI datatype, MPI op) for a native reduction, else None."""
        key = (op if op.__class__ is RedOpType else reduction.op_type(op), dtype.name)
        try:
            return self._reductions[key]
        except KeyError:
            names = native_reduction(op, dtype)
            plan = None if names is None else (getattr(self.MPI, names[0]), getattr(self.MPI, names[1]))
            self._reductions[key] = plan
            return plan

    def check_usable(self, ch: Channel) -> None:
        """Raise if an earlier native call timed out (see the module docstring)."""
        if self.broken is not None:
            raise DistBackendError(f"{describe_op(ch.op, ch.key.seq, ch.rank)}: the group cannot be used any "
                                   f"more: {self.broken}; destroy it (or end the job)")

    def give_up(self, call: str, exc: TransportError, req, buffers) -> None:
        """A native call's wait ended with ``exc`` while MPI still has it (a timeout, a member that
        left): the group is broken, the request and its buffers are MPI's (module docstring)."""
        self.broken = f"{call} timed out inside MPI" if exc.reason == "timeout" else f"{call} failed: {exc}"
        self.abandoned.append((req, buffers))

    def native(self, ch: Channel, start: Callable[[], Any], *buffers: np.ndarray) -> None:
        """Start one nonblocking MPI collective and test it to the call's deadline."""
        self.check_usable(ch)
        MPI = self.MPI
        req = None
        try:
            req = start()
            wait_request(MPI, req, ch.deadline, None, self.check)
        except TransportError as exc:
            if exc.reason == "timeout":
                exc = TransportError(f"{exc} in MPI (MPI does not say which rank has not joined)", reason="timeout")
            if req is not None:
                self.give_up(f"{ch.op} #{ch.key.seq}", exc, req, buffers)
            raise ch.translate(exc, None) from None
        except MPI.Exception as exc:
            raise ch.translate(mpi_error(MPI, exc, None, "MPI collective"), None) from None

    # -- GroupCollectives ------------------------------------------------------------------------
    def all_reduce(self, ch: Channel, flat: np.ndarray, dtype: DType, op) -> None:
        plan = self.reduction(op, dtype) if ch.size > 1 else None
        if plan is None:
            self.check_usable(ch)
            return self.generic.all_reduce(ch, flat, dtype, op)
        mtype, mop = plan
        MPI = self.MPI

        def run(buf: np.ndarray) -> None:
            if not buf.size:
                return
            staged = self.persistent.all_reduce(buf, mtype, mop)
            if staged is None:
                self.native(ch, lambda: self.comm.Iallreduce(MPI.IN_PLACE, [buf, mtype], mop), buf)
                return
            staging, request, _ = staged

            def start():
                staging[...] = buf
                request.Start()
                return request

            self.native(ch, start, buf, staging)
            buf[...] = staging

        reduction.with_op_arithmetic(op, dtype, ch.size, flat, run)

    def reduce(self, ch: Channel, flat: np.ndarray, dtype: DType, op, root: int) -> None:
        plan = self.reduction(op, dtype) if ch.size > 1 else None
        if plan is None:
            self.check_usable(ch)
            return self.generic.reduce(ch, flat, dtype, op, root)
        mtype, mop = plan
        MPI = self.MPI
        is_root = ch.rank == root

        def run(buf: np.ndarray) -> None:
            if not buf.size:
                return
            if is_root:
                self.native(ch, lambda: self.comm.Ireduce(MPI.IN_PLACE, [buf, mtype], mop, root), buf)
            else:
                self.native(ch, lambda: self.comm.Ireduce([buf, mtype], None, mop, root), buf)

        reduction.with_op_arithmetic(op, dtype, ch.size, flat, run, keep=not is_root, finishes=is_root)

    def broadcast(self, ch: Channel, flat: np.ndarray, root: int) -> None:
        if ch.size > 1 and flat.size:
            b = _bytes(flat)
            self.native(ch, lambda: self.comm.Ibcast([b, self.MPI.BYTE], root), flat)

    def all_gather(self, ch: Channel, out: np.ndarray, count: int) -> None:
        if ch.size > 1 and count:
            b = _bytes(out)
            self.native(ch, lambda: self.comm.Iallgather(self.MPI.IN_PLACE, [b, self.MPI.BYTE]), out)

    def gather(self, ch: Channel, send: np.ndarray, out: np.ndarray | None, root: int) -> None:
        if ch.size == 1 or not send.size:
            return self.generic.gather(ch, send, out, root)
        BYTE = self.MPI.BYTE
        s = _bytes(send)
        if ch.rank == root and _overlap(s, out):
            s = s.copy()  # the smaller side (module docstring)
        r = [_bytes(out)[: s.nbytes * ch.size], BYTE] if ch.rank == root else None
        self.native(ch, lambda: self.comm.Igather([s, BYTE], r, root), s, out)

    def scatter(self, ch: Channel, chunks: np.ndarray | None, out: np.ndarray, root: int) -> None:
        if ch.size == 1 or not out.size:
            return self.generic.scatter(ch, chunks, out, root)
        BYTE = self.MPI.BYTE
        r = target = _bytes(out)
        if ch.rank == root and _overlap(r, chunks):
            r = np.empty_like(target)  # the smaller side (module docstring)
        s = [_bytes(chunks)[: r.nbytes * ch.size], BYTE] if ch.rank == root else None
        self.native(ch, lambda: self.comm.Iscatter(s, [r, BYTE], root), chunks, r)
        if r is not target:
            target[...] = r

    def reduce_scatter(self, ch: Channel, scratch: np.ndarray, out: np.ndarray, counts, dtype: DType, op) -> None:
        plan = self.reduction(op, dtype) if ch.size > 1 and equal(counts) else None
        if plan is None:
            self.check_usable(ch)
            return self.generic.reduce_scatter(ch, scratch, out, counts, dtype, op)
        mtype, mop = plan
        n = counts[0]

        def run(buf: np.ndarray) -> None:
            if n:
                send = buf[: n * ch.size]
                recv = np.empty_like(out) if _overlap(send, out) else out  # the smaller side
                self.native(ch, lambda: self.comm.Ireduce_scatter_block([send, mtype], [recv, mtype], mop), buf, recv)
                if recv is not out:
                    out[...] = recv

        reduction.with_op_arithmetic(op, dtype, ch.size, scratch, run, result=out)

    def all_to_all(self, ch: Channel, send: np.ndarray, send_counts, recv: np.ndarray, recv_counts) -> None:
        # Ialltoallv for every split, even or not: whether a rank's own counts are even says nothing
        # about the others' (rank 0 may send [1, 1] while rank 1 sends [1, 2]), and every rank must make
        # the same MPI call. A sender sending more than its receiver expects is MPI's truncation
        # error (a mismatch); sending less is not detected (the rest of the block keeps its bytes).
        if ch.size == 1:
            return self.generic.all_to_all(ch, send, send_counts, recv, recv_counts)
        BYTE = self.MPI.BYTE
        item = send.itemsize
        s, r = _bytes(send), _bytes(recv)
        if _overlap(s, r):  # all_to_all_single(t, t)
            s = s.copy()
        sc, rc = [c * item for c in send_counts], [c * item for c in recv_counts]
        sd, rd = _offsets(sc), _offsets(rc)
        self.native(ch, lambda: self.comm.Ialltoallv([s, (sc, sd), BYTE], [r, (rc, rd), BYTE]), s, recv)

    def barrier(self, ch: Channel) -> None:
        if ch.size > 1:
            self.native(ch, self.start_barrier)

    def start_barrier(self):
        """Start the group's barrier: its persistent request (persistent.py), else an Ibarrier."""
        request = self.persistent.barrier()
        if request is None:
            return self.comm.Ibarrier()
        request.Start()
        return request
