"""One process group's collectives on the MPI engine.

Each collective MPI has is one nonblocking MPI call on the group's communicator (``Iallreduce``,
``Ireduce``, ``Ibcast``, ``Iallgather``, ``Igather``, ``Iscatter``, ``Ireduce_scatter_block``,
``Ialltoallv``, ``Ibarrier``; a barrier, and an all_reduce of a small message, start a persistent
request instead: persistent.py), tested against the call's deadline: nonblocking so that a timeout
is honoured (MPI's blocking calls cannot be interrupted). What MPI lacks (``native``) runs
``GenericCollectives``, distcomm's algorithms, over ``MpiTransport`` on the same communicator.

**Agreement.** MPI checks neither sizes nor dtypes nor ops (agreement.py: what MPICH returns when
they differ), so every call but a barrier and an all_reduce on a kept persistent request first
compares the ranks' rows (agreement.py: sequence number, signature, root, size, splits, all_to_all's
pairs) in one persistent ``Allgather`` of 8 int64 per rank (``checked``). It is started together
with the MPI call itself and waited for first: a mismatch is found before the call's result is
used (the result is then dropped, and the call is waited for ``SETTLE_S`` at most, the group
broken if it does not complete), every rank raises it (they all see the same rows), and the call
costs one small exchange more in parallel with its own rather than after it. Started together, a
rank that times out leaves both calls to MPI and a late rank still completes them. distcomm's
algorithms run after the agreement (they do not start until it is in). All ranks' choice between
native and distcomm's algorithms then depends on what the agreement checked alike (op, dtype, the
split of reduce_scatter), never on one rank's own counts alone (all_to_all is always
``Ialltoallv``). An all_reduce on a persistent request is checked when the request is made
(``first_all_reduce``); later ones start the request with no exchange (persistent.py says why ranks
that start the same request agree); ranks that start different ones, or one and another call, are
never matched by MPI and wait: every wait longer than ``transport.mpi.TELL_AFTER_S`` tells the
others its row and reads theirs (``watch``), so such ranks raise the mismatch too, instead of
waiting out the timeout.

MPI forbids a send buffer that overlaps the receive buffer of the same call (MPI_IN_PLACE aside).
Where a caller's input and output can be one memory (``all_to_all_single(t, t)``), the call sends
a copy of the input, or receives into a temporary, whichever is smaller; MPI_IN_PLACE is no
answer there, as MPI requires it of every rank or none, and each rank sees only its own buffers.

A native call that times out, or whose wait ends because a member left the job (transport/mpi.py,
"Lost peers") or in a mismatch found by the long-wait check, cannot be cancelled (MPI has no cancel
for collectives): MPI may still write into its buffers, so they are kept alive, and the group is
marked broken; every later call on it raises at once (as torch's NCCL aborts a communicator after
a timeout). Destroy the group, or end the job.
"""

from __future__ import annotations

from time import monotonic
from typing import Any, Callable

import numpy as np

from ... import reduction
from ...dtypes import DType
from ...errors import DistBackendError, describe_op
from ...transport.base import KIND_COLLECTIVE, Channel, MessageKey, TransportError
from ...transport.mpi import TELL_AFTER_S, WAITING_WORDS, GroupComm, MpiTransport, mpi_error, wait_request
from ...tuning import Tuning
from ...types import RedOpType
from ..engine import GroupCollectives, GroupSpec
from ..generic import GenericCollectives
from . import agreement
from .agreement import NONE, WORDS, Weights, describe, differs, judge, row
from .native import equal, native_reduction
from .persistent import LIMIT, PersistentRequests

#: seconds a call whose ranks disagree is waited for, once the agreement found it, before the
#: group is given up (MPICH completes such calls at once, with the wrong bytes)
SETTLE_S = 1.0
#: XORed into the call's signature for the messages of the second exchange: its tag's signature
#: bits (transport/mpi.py's fold_signature) then differ from any of the call's own messages'
DETAILS_SIGNATURE = 0x5A


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


def in_mpi(exc: TransportError) -> TransportError:
    """A wait's timeout in the words of a native call's."""
    if exc.reason == "timeout":
        return TransportError(f"{exc} in MPI (MPI does not say which rank has not joined)", reason="timeout")
    return exc


class MpiCollectives(GroupCollectives):
    """The collectives of one group (``group``: its communicator) on the MPI engine."""

    def __init__(self, transport: MpiTransport, group: GroupComm, spec: GroupSpec, tuning: Tuning):
        self.MPI = transport.MPI
        self.transport = transport
        self.comm = group.comm
        self.check = group.check  # for waits: the transport closed, a member left the job
        self.size = len(spec.ranks)
        self.rank = spec.rank
        self.ranks = list(spec.ranks)  # group rank -> engine rank
        self.group_rank = {r: q for q, r in enumerate(self.ranks)}
        self.group_id = spec.group_id
        self.generic = GenericCollectives(tuning)
        self.broken: str | None = None  # why the group can no longer be used
        self.abandoned: list = []  # (request, buffers) of timed-out native calls: MPI may still use them
        self._reductions: dict = {}  # (op, dtype name) -> (MPI datatype, MPI op) or None
        self._weights: Weights | None = None
        # every barrier and native all_reduce of at most persistent.LIMIT bytes, on either path
        self.persistent = PersistentRequests(self.comm, self.MPI)
        # the rows of the agreement, one per rank; its persistent request is made now, on every member
        self.table = np.zeros((self.size, WORDS), np.int64)
        if self.size > 1:
            self.persistent.agreement(self.table)
        # the long-wait check (``watch``): the row of the call waited in, and since when it is watched
        self.waiting_in: tuple | None = None
        self._watched: tuple | None = None
        self._since = 0.0
        self._told = False
        self.watching = self._watching  # bound once: a wait passes it to wait_request as it is

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

    def weights(self) -> Weights:
        """The agreement's weights for this rank (agreement.py), made on first use."""
        if self._weights is None:
            self._weights = Weights(self.size, self.rank)
        return self._weights

    def check_usable(self, ch: Channel) -> None:
        """Raise if an earlier native call timed out (see the module docstring)."""
        if self.broken is not None:
            raise DistBackendError(f"{describe_op(ch.op, ch.key.seq, ch.rank)}: the group cannot be used any "
                                   f"more: {self.broken}; destroy it (or end the job)")

    def give_up(self, call: str, exc: BaseException, req, buffers) -> None:
        """A native call's wait ended with ``exc`` while MPI still has it (a timeout, a member that
        left, a mismatch found while waiting): the group is broken, the request(s) and buffers are
        MPI's (module docstring)."""
        if getattr(exc, "reason", None) == "timeout":
            self.broken = f"{call} timed out inside MPI"
        else:
            self.broken = f"{call} failed: {exc}"
        self.abandoned.append((req, buffers))

    def watch(self, mine) -> Callable[[], TransportError | None]:
        """``wait_request``'s check for a wait in the call of row ``mine`` (``watching``; the group's
        calls run one at a time, so one row is watched at a time)."""
        self.waiting_in = mine
        return self.watching

    def _watching(self) -> TransportError | None:
        """The transport's health, and, once the wait in the call of row ``waiting_in`` is older
        than TELL_AFTER_S, this rank's row told to the group's other members and theirs read: a
        member waiting in the same call (sequence number) with another row is a mismatch (see the
        module docstring)."""
        problem = self.check()
        mine = self.waiting_in
        if problem is not None or mine is None:
            return problem
        if mine is not self._watched:  # a new call: watched from now (its wait has spun already)
            self._watched, self._since, self._told = mine, monotonic(), False
            return None
        if not self._told:
            if monotonic() - self._since < TELL_AFTER_S:
                return None
            self._told = True
            self.transport.tell_waiting(self.group_id, self.ranks, mine[:WAITING_WORDS])
        for peer, theirs in self.transport.waiting_calls(self.group_id).items():
            if theirs[agreement.SEQ] == mine[agreement.SEQ] and differs(mine, theirs) and peer in self.group_rank:
                q = self.group_rank[peer]
                return TransportError(
                    f"{describe(mine, theirs, q)} (found while both waited: MPI matched neither call with the "
                    "other)", peer=peer, reason="mismatch")
        return None

    def wait(self, req, deadline: float | None, mine) -> None:
        """Test ``req`` to ``deadline``, watched (``watch``) as the call of row ``mine``."""
        if not req.Test():
            self.waiting_in = mine
            wait_request(self.MPI, req, deadline, None, self.watching)

    def checked(self, op: str, mine, deadline: float | None, start: Callable[[], Any] | None = None,
                buffers: tuple = (), details: Callable[[], np.ndarray] | None = None,
                discard: Callable[[], None] | None = None):
        """The call ``op`` of row ``mine`` (the two name it in the group's broken message): the
        agreement started, then ``start()`` (the MPI call: its request; None: the agreement alone),
        the agreement waited for and judged, then the call waited for; returns its request.

        A disagreement raises TransportError("mismatch") naming the peer on every rank, once the
        call has settled (SETTLE_S; then ``discard()``, where given) or been given up; ``details()``
        gives this rank's row of the second exchange the splits and pairs need (agreement.py). A
        wait that fails gives the requests up (the group is broken) and raises."""
        MPI = self.MPI
        table = self.table
        table[self.rank] = mine
        agreement_request = self.persistent.agreement(table)
        if agreement_request is None:
            agreement_request = self.comm.Iallgather(MPI.IN_PLACE, [table, MPI.INT64_T])
        else:
            agreement_request.Start()
        req = None
        try:
            if start is not None:
                req = start()
            self.wait(agreement_request, deadline, mine)
        except BaseException as exc:
            self.give_up(f"{op} #{mine[0]}", exc, (agreement_request, req), buffers + (table,))
            raise
        verdict = judge(table, self.rank)
        if verdict is None:
            if req is not None:
                try:
                    self.wait(req, deadline, mine)
                except BaseException as exc:
                    self.give_up(f"{op} #{mine[0]}", exc, req, buffers)
                    raise
            return req
        call = f"{op} #{mine[0]}"
        rows = table.copy()
        peer, more = verdict.peer, None
        if verdict.needs_details:
            try:
                more = self.exchange_details(mine, details, deadline)
            except BaseException as exc:
                if req is not None:
                    self.give_up(call, exc, req, buffers)
                raise
            if rows[self.rank, agreement.SPLITS] == rows[peer, agreement.SPLITS]:  # the pairs of an all_to_all
                peer = agreement.peer_of_pair(more, self.rank, peer)
        mismatch = TransportError(describe(rows[self.rank], rows[peer], peer, more, self.rank),
                                  peer=self.ranks[peer], reason="mismatch")
        if req is not None:
            if self.settle(req, deadline):
                if discard is not None:
                    discard()
            else:
                self.give_up(call, mismatch, req, buffers)
        raise mismatch

    def exchange_details(self, mine, details, deadline: float | None) -> np.ndarray:
        """Every rank's row of the second exchange (agreement.py), made by every rank of a call whose
        splits or pairs disagree (they all know it from the same rows). Point-to-point, on the
        call's key with a signature of its own: a collective here could be matched by MPI with the
        call of a rank that started one where this rank did not (an even reduce_scatter split
        against an uneven one: MPI's Ireduce_scatter_block, distcomm's algorithm)."""
        n, rank = self.size, self.rank
        table = np.zeros((n, 2 * n), np.int64)
        if details is not None:
            table[rank] = details()
        key = MessageKey(self.group_id, KIND_COLLECTIVE, int(mine[agreement.SEQ]))
        sig = int(mine[agreement.SIG]) ^ DETAILS_SIGNATURE
        peers = [q for q in range(n) if q != rank]
        requests = [self.transport.irecv(self.ranks[q], table[q], key, sig) for q in peers]
        requests += [self.transport.isend(self.ranks[q], table[rank], key, sig) for q in peers]
        for req in requests:
            req.wait(deadline)
        return table

    def settle(self, req, deadline: float | None) -> bool:
        """Wait up to SETTLE_S (and the deadline) for a call whose ranks disagree: whether it completed
        without an MPI error."""
        end = monotonic() + SETTLE_S
        if deadline is not None:
            end = min(end, deadline)
        try:
            wait_request(self.MPI, req, end, None, self.check)
        except (TransportError, self.MPI.Exception):
            return False
        return True

    def first_all_reduce(self, mine, flat: np.ndarray, mtype, mop, sig: int, deadline: float | None) -> bool:
        """The all_reduce of ``flat`` (at most LIMIT bytes, not empty) in place, as the first of its
        size and signature: its persistent request made, the agreement started with it, the request
        kept only if every rank agreed (freed otherwise). False where MPI has no persistent
        collectives (then nothing was done: the caller runs a checked ``Iallreduce``)."""
        staged = self.persistent.make(flat.size, flat.dtype, mtype, mop)
        if staged is None:
            return False
        staging, request, _ = staged

        def start():
            staging[...] = flat
            request.Start()
            return request

        self.checked("all_reduce", mine, deadline, start, (flat, staging), discard=request.Free)
        self.persistent.keep(staged, mtype, mop, sig)
        flat[...] = staging
        return True

    def native(self, ch: Channel, start: Callable[[], Any] | None, *buffers: np.ndarray, checked: bool = True,
               size: int = NONE, root: int = NONE, splits: int = 0, sent: int = 0, expected: int = 0,
               details: Callable[[], np.ndarray] | None = None) -> None:
        """Start one nonblocking MPI collective (``start``; None: nothing but the agreement) and test
        it to the call's deadline, after the agreement on its row (``checked``; see the module
        docstring), or watched only (a barrier, a kept persistent request)."""
        self.check_usable(ch)
        MPI = self.MPI
        seq = ch.key.seq
        mine = row(seq, ch.signature, size, root, splits, sent, expected)
        try:
            if checked:
                self.checked(ch.op, mine, ch.deadline, start, buffers, details)
                return
            req = None
            try:
                req = start()
                self.wait(req, ch.deadline, mine)
            except BaseException as exc:
                if req is not None:
                    self.give_up(f"{ch.op} #{seq}", exc, req, buffers)
                raise
        except TransportError as exc:
            raise ch.translate(in_mpi(exc), None) from None
        except MPI.Exception as exc:
            raise ch.translate(mpi_error(MPI, exc, None, "MPI collective"), None) from None

    def agree(self, ch: Channel, **fields) -> None:
        """The agreement alone (before distcomm's algorithms, which start after it)."""
        self.native(ch, None, **fields)

    def check_root(self, ch: Channel, root: int, what: str) -> None:
        """Nothing here: the root is in every rooted call's agreement row (``native``), which ranks
        that both believe they are the root exchange too."""

    # -- GroupCollectives ------------------------------------------------------------------------
    def all_reduce(self, ch: Channel, flat: np.ndarray, dtype: DType, op) -> None:
        if ch.size == 1:
            self.check_usable(ch)
            return self.generic.all_reduce(ch, flat, dtype, op)
        plan = self.reduction(op, dtype)
        size = flat.nbytes
        if plan is None:
            self.agree(ch, size=size)
            return self.generic.all_reduce(ch, flat, dtype, op)
        mtype, mop = plan
        MPI = self.MPI
        sig = ch.signature

        def run(buf: np.ndarray) -> None:
            if buf.size and buf.nbytes <= LIMIT:
                staged = self.persistent.made(mtype, mop, sig).get(buf.size)
                if staged is not None:  # agreed on when it was made (module docstring)
                    staging, request, _ = staged

                    def start():
                        staging[...] = buf
                        request.Start()
                        return request

                    self.native(ch, start, buf, staging, checked=False, size=size)
                    buf[...] = staging
                    return
                self.check_usable(ch)
                seq = ch.key.seq
                try:
                    if self.first_all_reduce(row(seq, sig, size), buf, mtype, mop, sig, ch.deadline):
                        return
                except TransportError as exc:
                    raise ch.translate(in_mpi(exc), None) from None
                except MPI.Exception as exc:
                    raise ch.translate(mpi_error(MPI, exc, None, "MPI collective"), None) from None
            start = (lambda: self.comm.Iallreduce(MPI.IN_PLACE, [buf, mtype], mop)) if buf.size else None
            self.native(ch, start, buf, size=size)

        reduction.with_op_arithmetic(op, dtype, ch.size, flat, run)

    def reduce(self, ch: Channel, flat: np.ndarray, dtype: DType, op, root: int) -> None:
        if ch.size == 1:
            self.check_usable(ch)
            return self.generic.reduce(ch, flat, dtype, op, root)
        plan = self.reduction(op, dtype)
        size = flat.nbytes
        if plan is None:
            self.agree(ch, size=size, root=root)
            return self.generic.reduce(ch, flat, dtype, op, root)
        mtype, mop = plan
        MPI = self.MPI
        is_root = ch.rank == root

        def run(buf: np.ndarray) -> None:
            if not buf.size:
                start = None
            elif is_root:
                start = lambda: self.comm.Ireduce(MPI.IN_PLACE, [buf, mtype], mop, root)  # noqa: E731
            else:
                start = lambda: self.comm.Ireduce([buf, mtype], None, mop, root)  # noqa: E731
            self.native(ch, start, buf, size=size, root=root)

        reduction.with_op_arithmetic(op, dtype, ch.size, flat, run, keep=not is_root, finishes=is_root)

    def broadcast(self, ch: Channel, flat: np.ndarray, root: int) -> None:
        if ch.size > 1:
            b = _bytes(flat)
            start = (lambda: self.comm.Ibcast([b, self.MPI.BYTE], root)) if flat.size else None
            self.native(ch, start, flat, size=flat.nbytes, root=root)

    def all_gather(self, ch: Channel, out: np.ndarray, count: int) -> None:
        if ch.size > 1:
            b = _bytes(out)
            start = (lambda: self.comm.Iallgather(self.MPI.IN_PLACE, [b, self.MPI.BYTE])) if count else None
            self.native(ch, start, out, size=count * out.itemsize)

    def gather(self, ch: Channel, send: np.ndarray, out: np.ndarray | None, root: int) -> None:
        if ch.size == 1:
            return self.generic.gather(ch, send, out, root)
        if not send.size:
            return self.agree(ch, size=0, root=root)
        BYTE = self.MPI.BYTE
        s = _bytes(send)
        if ch.rank == root and _overlap(s, out):
            s = s.copy()  # the smaller side (module docstring)
        r = [_bytes(out)[: s.nbytes * ch.size], BYTE] if ch.rank == root else None
        self.native(ch, lambda: self.comm.Igather([s, BYTE], r, root), s, out, size=send.nbytes, root=root)

    def scatter(self, ch: Channel, chunks: np.ndarray | None, out: np.ndarray, root: int) -> None:
        if ch.size == 1:
            return self.generic.scatter(ch, chunks, out, root)
        if not out.size:
            return self.agree(ch, size=0, root=root)
        BYTE = self.MPI.BYTE
        r = target = _bytes(out)
        if ch.rank == root and _overlap(r, chunks):
            r = np.empty_like(target)  # the smaller side (module docstring)
        s = [_bytes(chunks)[: r.nbytes * ch.size], BYTE] if ch.rank == root else None
        self.native(ch, lambda: self.comm.Iscatter(s, [r, BYTE], root), chunks, r, size=out.nbytes, root=root)
        if r is not target:
            target[...] = r

    def reduce_scatter(self, ch: Channel, scratch: np.ndarray, out: np.ndarray, counts, dtype: DType, op) -> None:
        if ch.size == 1:
            self.check_usable(ch)
            return self.generic.reduce_scatter(ch, scratch, out, counts, dtype, op)
        item = out.itemsize
        fields = dict(size=sum(counts) * item, splits=self.weights().splits(counts),
                      details=lambda: agreement.details(ch.size, splits=[c * item for c in counts]))
        plan = self.reduction(op, dtype) if equal(counts) else None
        if plan is None:
            self.agree(ch, **fields)
            return self.generic.reduce_scatter(ch, scratch, out, counts, dtype, op)
        mtype, mop = plan
        n = counts[0]

        def run(buf: np.ndarray) -> None:
            if not n:
                return self.native(ch, None, **fields)
            send = buf[: n * ch.size]
            recv = np.empty_like(out) if _overlap(send, out) else out  # the smaller side
            self.native(ch, lambda: self.comm.Ireduce_scatter_block([send, mtype], [recv, mtype], mop), buf, recv,
                        **fields)
            if recv is not out:
                out[...] = recv

        reduction.with_op_arithmetic(op, dtype, ch.size, scratch, run, result=out)

    def all_to_all(self, ch: Channel, send: np.ndarray, send_counts, recv: np.ndarray, recv_counts) -> None:
        # Ialltoallv for every split, even or not: whether a rank's own counts are even says nothing
        # about the others' (rank 0 may send [1, 1] while rank 1 sends [1, 2]), and every rank must make
        # the same MPI call. The agreement checks every pair (agreement.py: SENT, EXPECTED): MPICH
        # reports neither a block longer than its receive nor a shorter one.
        if ch.size == 1:
            return self.generic.all_to_all(ch, send, send_counts, recv, recv_counts)
        BYTE = self.MPI.BYTE
        item = send.itemsize
        s, r = _bytes(send), _bytes(recv)
        if _overlap(s, r):  # all_to_all_single(t, t)
            s = s.copy()
        sc, rc = [c * item for c in send_counts], [c * item for c in recv_counts]
        sd, rd = _offsets(sc), _offsets(rc)
        sent, expected = self.weights().pairs(send_counts, recv_counts)
        self.native(ch, lambda: self.comm.Ialltoallv([s, (sc, sd), BYTE], [r, (rc, rd), BYTE]), s, recv,
                    sent=sent, expected=expected,
                    details=lambda: agreement.details(ch.size, send_counts=sc, recv_counts=rc))

    def barrier(self, ch: Channel) -> None:
        if ch.size > 1:
            self.native(ch, self.start_barrier, checked=False, size=0)

    def start_barrier(self):
        """Start the group's barrier: its persistent request (persistent.py), else an Ibarrier."""
        request = self.persistent.barrier()
        if request is None:
            return self.comm.Ibarrier()
        request.Start()
        return request
