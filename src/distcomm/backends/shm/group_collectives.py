"""Collectives through shared memory: reduce and copy straight from peers' memory, in rounds.

The generic collectives (``generic.py``) are algorithms over point-to-point messages: fine over
TCP, wasteful within a host, where every message is a copy into a ring and a copy out of it, and
every rank forwards data it does not need. Here each rank reads what it needs directly from its
peers' slots of the group's shared memory (``transport/shm_group.GroupShm``: rounds of slots with
``posted``/``consumed`` counters, its round API documented there), or, for large messages where
the OS allows it, straight from their buffers (process_vm_readv). Data moves in chunks of one slot
(1 MiB by default), so a chunk written by one core is read by another from cache, and memory use
does not grow with the message.

``ShmCollectives`` asks ``choose.choose`` which algorithm runs each call and runs it: one module
of this package per algorithm (``ALGORITHMS`` below; each module's docstring says what it does and
what it costs). Reductions run in rank order, ((x0 ⊕ x1) ⊕ x2) ..., like the reference, so every
rank gets the same bits; PREMUL_SUM and AVG are applied around them by
``reduction.with_op_arithmetic``, as in the generic collectives. Groups with a member on another
host (the default engine across hosts) and groups of one use the generic collectives; so does
everything when ``DISTCOMM_SHM_COLLECTIVES=0`` (the engine then builds no ShmCollectives).
"""

from __future__ import annotations

import time

import numpy as np

from ...errors import DistBackendError
from ...reduction import commutes, finish, op_type, reducer, sequence_reducer, with_op_arithmetic
from ...transport import shm_direct
from ...transport.base import Channel, TransportError
from ...tuning import DEFAULT, Tuning
from ...types import RedOpType
from ..engine import GroupCollectives, late_root_mismatch, root_mismatch
from ..generic import GenericCollectives
from . import alltoall_slots as alltoall, latency, observe, root_check
from .allgather_readv import allgather_readv
from .allreduce_direct import allreduce_direct
from .allreduce_pieces_readv import allreduce_pieces_readv, table_fits
from .allreduce_readv import allreduce_readv
from .allreduce_slices import allreduce_slices
from .barrier_slots import barrier_slots
from .broadcast_readv import broadcast_readv
from .broadcast_slots import broadcast_slots
from .broadcast_split import broadcast_split
from .choose import Capabilities, check_forced, choose, direct_limit, latency_limit
from .common import offsets, same_channel, split_mismatch
from .gather_readv import gather_readv
from .gather_slots import gather_slots
from .gather_writev import gather_writev
from .reduce_direct import reduce_direct
from .reduce_readv import reduce_readv
from .reduce_scatter_readv import reduce_scatter_readv
from .reduce_scatter_slots import reduce_scatter_slots
from .scatter_readv import scatter_readv
from .scatter_slots import piece_bytes, scatter_slots


def _allgather_slots(ctx, ch: Channel, out: np.ndarray, count: int) -> None:
    """all_gather through slots: gather_slots with every rank reading."""
    gather_slots(ctx, ch, out[ch.rank * count : (ch.rank + 1) * count],
                 [out[q * count : (q + 1) * count] for q in range(ch.size)], None)


def _direct_read_failure(ctx, ch: Channel, exc: "shm_direct.DirectReadError") -> TransportError:
    """A failed read of a peer's memory, naming the rank at fault. A member known to have crashed
    is the cause even when the read failed on another one: a member that noticed the crash first
    left the collective, and the buffer we were reading went with it (EFAULT)."""
    transport = ctx.transport
    # A failed read is a sign of a death in progress: a killed process loses its memory before
    # its pidfd says it exited, so give the news up to a second to arrive (this also marks the
    # crash for the other ranks of the host).
    give_up = time.monotonic() + 1.0
    while True:
        lost = transport.lost_peers(ch.ranks)
        if lost:
            return transport.lost_error(lost)
        if time.monotonic() >= give_up:
            break
        time.sleep(0.01)
    peer = next((g for g in ch.ranks if g != ch.ranks[ch.rank] and transport.pid_of(g) == exc.pid), None)
    who = f"rank {peer}" if peer is not None else f"pid {exc.pid}"
    if exc.reason == "lost":
        text = f"{who} exited while this rank was reading its memory (process_vm_readv: pid {exc.pid} is gone)"
    else:
        text = f"reading the memory of {who} failed: {exc}"
    return TransportError(text, peer=peer, reason=exc.reason)


def _root_round(ctx, ch: Channel, root: int, nbytes: int) -> tuple[int, int] | None:
    """The root check's round of its own on this call's Channel (its header carrying the call's size
    ``nbytes``): the first (peer, its root) that differs, or None."""
    return root_check.one_round(ctx, ch.key.seq, ch.signature, same_channel(ch), root, nbytes)


#: per rooted op: its argument's name in a root mismatch's words
_ROOT_NAME = {"broadcast": "src", "scatter": "src", "reduce": "dst", "gather": "dst"}


#: every name ``choose`` returns -> the function that runs it, ``(ctx, ch, ...)``
ALGORITHMS = {
    "allreduce_direct": allreduce_direct,
    "allreduce_slices": allreduce_slices,
    "allreduce_readv": allreduce_readv,
    "allreduce_pieces_readv": allreduce_pieces_readv,
    "reduce_direct": reduce_direct,
    "reduce_readv": reduce_readv,
    "broadcast_slots": broadcast_slots,
    "broadcast_readv": broadcast_readv,
    "broadcast_split": broadcast_split,
    "allgather_slots": _allgather_slots,
    "allgather_readv": allgather_readv,
    "gather_slots": gather_slots,
    "gather_readv": gather_readv,
    "gather_writev": gather_writev,
    "scatter_slots": scatter_slots,
    "scatter_readv": scatter_readv,
    "reduce_scatter_slots": reduce_scatter_slots,
    "reduce_scatter_readv": reduce_scatter_readv,
    "alltoall_slots": alltoall.alltoall_slots,
    "alltoall_readv": alltoall.alltoall_slots,  # a vote for single copies (all_to_all runs it directly)
    "barrier_slots": barrier_slots,
}


class ShmCollectives(GroupCollectives):
    """The collectives of groups whose members all share this host, through shared memory.

    One instance serves every such group of an engine (each call finds its group's GroupShm by the
    channel's group id). A group of one runs the generic collectives.
    """

    def __init__(self, transport, tuning: Tuning = DEFAULT):
        check_forced(tuning)
        self.transport = transport
        self.tuning = tuning
        self.generic = GenericCollectives(tuning)  # groups of one, members on other hosts
        self._reducers: dict = {}
        self._choices: dict = {}  # (group id, op, bytes) -> algorithm name (see _choose)

    def direct_limit(self, size: int) -> int:
        """The largest all_reduce (bytes) the direct algorithm takes by size in a group of ``size``."""
        return direct_limit(size, self.tuning)

    def latency_paths(self, pg):
        """The latency paths of process group ``pg`` (latency.py; see ProcessGroup's fast path):
        None until the group's shared memory exists, False if they will never be used (a group of
        one, a member on another host). Each path takes only the calls whose algorithm ``choose``
        would pick for it (an all_reduce algorithm forced: no all_reduce there)."""
        group = pg.spec
        ranks = group.ranks
        if len(ranks) == 1 or not self.transport.all_local(ranks):
            return False
        ctx = self.transport.group_shm(group.group_id)
        if ctx is None:
            return None
        return latency.build(pg, ctx, latency_limit(len(ranks), ctx.slot_bytes, self.tuning), self.tuning,
                             self.transport.direct_reads_ok(ranks))

    def forget_group(self, group_id: int) -> None:
        """Group ``group_id`` was destroyed (its id may be used again for other members)."""
        self._choices.clear()

    # -- helpers ---------------------------------------------------------------------------------
    def _choose(self, op: str, nbytes: int, ctx, ch: Channel) -> str:
        """``choose``'s answer for this group, remembered per (group, op, size): it depends on
        nothing else, and asking costs a Capabilities and a look-up of the group's direct reads."""
        key = (ch.key.group, op, nbytes)
        name = self._choices.get(key)
        if name is None:
            if len(self._choices) >= 4096:
                self._choices.clear()
            caps = Capabilities(self.transport.direct_reads_ok(ch.ranks), ctx.slot_bytes)
            name = self._choices[key] = choose(op, nbytes, ch.size, caps, self.tuning)
        return name

    def _reducer(self, op, dtype, sequence: bool = False):
        """reduction.reducer (or sequence_reducer) for (op, dtype), cached for the plain ops
        (building one costs microseconds)."""
        make = sequence_reducer if sequence else reducer
        if type(op) is not RedOpType:
            return make(op, dtype)
        key = (op, dtype.name, sequence)
        red = self._reducers.get(key)
        if red is None:
            red = self._reducers[key] = make(op, dtype)
        return red

    def _context(self, ch: Channel):
        """The group's shared memory, or None (a group of one, or a member on another host)."""
        if ch.size == 1:
            return None
        try:
            ctx = self.transport.group_context(ch.key.group, ch.ranks, ch.rank, ch.deadline)
        except TransportError as exc:
            raise ch.translate(exc, None) from None
        if ctx is not None and ctx.broken:
            lost = self.transport.lost_peers(ch.ranks)
            if lost:  # the earlier failure was (or is now known to be) a crashed or closed member
                earlier = f" (this group's shared memory was already unusable after an earlier failure: {ctx.broken})"
                raise ch.translate(self.transport.lost_error(lost, earlier), None)
            raise DistBackendError(
                f"{ch.op} (sequence number {ch.key.seq}) on rank {ch.rank}: this group's shared memory is "
                f"unusable after an earlier failure ({ctx.broken}); destroy the process group and create it again"
            )
        return ctx

    @staticmethod
    def _run(ctx, ch: Channel, name: str, *args):
        """Run algorithm ``name``, reported to the observer first."""
        observer = observe.current
        if observer is not None:
            observer(name)
        return ShmCollectives._guarded(ctx, ch, ALGORITHMS[name], *args)

    @staticmethod
    def _guarded(ctx, ch: Channel, algorithm, *args):
        """``algorithm(ctx, ch, *args)``; a failure leaves the group's memory unusable (mid-round,
        its counters no longer agree with the peers'), and a transport's error is raised in the
        words of the operation. A round this member deferred (an earlier small rooted call in C) is
        settled first; a root disagreement found there is raised once this call has completed, so
        every member still runs the same rounds."""
        try:
            late = ctx.settle_deferred(ch.key.seq, ch.signature, same_channel(ch)) if ctx.deferred else None
            result = algorithm(ctx, ch, *args)
        except TransportError as exc:
            if isinstance(exc, shm_direct.DirectReadError):
                exc = _direct_read_failure(ctx, ch, exc)
            ctx.give_up(str(exc), ch.key.seq, withdraw=exc.reason != "mismatch")
            raise ch.translate(exc, None) from None
        except BaseException as exc:
            ctx.give_up(f"{type(exc).__name__}: {exc}", ch.key.seq)
            raise
        if late is not None:
            ctx.reported(late)
            raise late_root_mismatch(ch, late)
        return result

    # -- the collectives (signatures: engine.GroupCollectives) -----------------------------------
    def all_reduce(self, ch: Channel, flat: np.ndarray, dtype, op) -> None:
        ctx = self._context(ch)
        if ctx is None:
            return self.generic.all_reduce(ch, flat, dtype, op)
        name = self._choose("allreduce", flat.nbytes, ctx, ch)
        if name == "allreduce_direct":  # the latency path's round: all p copies folded at once
            red = self._reducer(op, dtype, sequence=True)
            run = lambda buf: self._run(ctx, ch, name, buf, red)  # noqa: E731
        elif name == "reduce_direct":  # direct past one slot: every rank is a root
            red = self._reducer(op, dtype)
            run = lambda buf: self._run(ctx, ch, name, buf, red, None)  # noqa: E731
        else:  # readv or slices
            red = self._reducer(op, dtype)
            size = ch.size
            # AVG: readv and slices divide each reduced part before publishing it, while it is in cache
            avg = (op if op.__class__ is RedOpType else op_type(op)) is RedOpType.AVG
            divide = (lambda part: finish(op, part, size, dtype)) if avg else None
            swap = (commutes(op, dtype),) if name == "allreduce_readv" else ()
            run = lambda buf: self._run(ctx, ch, name, buf, red, divide, *swap)  # noqa: E731
            return with_op_arithmetic(op, dtype, size, flat, run, finishes=not avg)
        with_op_arithmetic(op, dtype, ch.size, flat, run)

    def all_reduce_coalesced(self, ch: Channel, flats, dtype, op) -> None:
        """Where ``choose`` picks single-copy reads for the total size (and the op needs no
        premultiplication): reduced in place, reading the peers' arrays where they are
        ("allreduce_pieces_readv"); else one all_reduce of their concatenation."""
        ctx = self._context(ch)
        nbytes = sum(f.nbytes for f in flats)
        if (ctx is None or op.__class__ is not RedOpType or len(flats) < 2 or not table_fits(len(flats), ctx.slot_bytes)
                or self._choose("allreduce", nbytes, ctx, ch) != "allreduce_readv"):
            return super().all_reduce_coalesced(ch, flats, dtype, op)
        red = self._reducer(op, dtype)
        size = ch.size
        divide = (lambda part: finish(op, part, size, dtype)) if op is RedOpType.AVG else None  # noqa: E731
        self._run(ctx, ch, "allreduce_pieces_readv", list(flats), red, divide, commutes(op, dtype))

    # -- rooted collectives: the root check runs inside a collective of one round (the latency
    # paths' rounds, so both paths meet in the same rounds), in a round of its own before a longer one
    def _check_root_first(self, ctx, ch: Channel, one_round: bool, root: int, nbytes: int) -> None:
        """Before a rooted collective of several rounds (``one_round`` False): the root check's round,
        carrying ``nbytes``, the byte count the one-round form's header would carry."""
        if not one_round:
            self._raise_disagreement(ch, root, self._guarded(ctx, ch, _root_round, root, nbytes))

    @staticmethod
    def _raise_disagreement(ch: Channel, root: int, disagreeing) -> None:
        # raised here, not in the round: the round itself completed, so the group's memory stays usable
        if disagreeing is not None:
            raise root_mismatch(ch, root, disagreeing[0], disagreeing[1], _ROOT_NAME[ch.op])

    def reduce(self, ch: Channel, flat: np.ndarray, dtype, op, root: int) -> None:
        ctx = self._context(ch)
        if ctx is None:
            return self.generic.reduce(ch, flat, dtype, op, root)
        name = self._choose("reduce", flat.nbytes, ctx, ch)
        self._check_root_first(ctx, ch, name == "reduce_direct" and flat.nbytes <= ctx.slot_bytes, root, flat.nbytes)
        red = self._reducer(op, dtype)

        def run(buf):
            self._raise_disagreement(ch, root, self._run(ctx, ch, name, buf, red, root))

        with_op_arithmetic(op, dtype, ch.size, flat, run, keep=ch.rank != root, finishes=ch.rank == root)

    def broadcast(self, ch: Channel, flat: np.ndarray, root: int) -> None:
        ctx = self._context(ch)
        if ctx is None:
            return self.generic.broadcast(ch, flat, root)
        name = self._choose("broadcast", flat.nbytes, ctx, ch)
        self._check_root_first(ctx, ch, name == "broadcast_slots" and flat.nbytes <= ctx.slot_bytes, root, flat.nbytes)
        self._raise_disagreement(ch, root, self._run(ctx, ch, name, flat, root))

    def all_gather(self, ch: Channel, out: np.ndarray, count: int) -> None:
        ctx = self._context(ch)
        if ctx is None:
            return self.generic.all_gather(ch, out, count)
        name = self._choose("allgather", out.nbytes, ctx, ch)
        if name == "allgather_readv":
            blocks = [out[q * count:(q + 1) * count] for q in range(ch.size)]
            return self._run(ctx, ch, name, blocks, blocks[ch.rank])
        self._run(ctx, ch, name, out, count)

    def all_gather_list(self, ch: Channel, outs, send: np.ndarray) -> None:
        """Single copy straight into each output when ``choose`` picks it; else (and when an output
        for a peer overlaps ``send``, which peers read meanwhile) staged like the default."""
        ctx = self._context(ch)
        if ctx is not None and self._choose("allgather", send.nbytes * ch.size, ctx, ch) == "allgather_readv" \
                and not any(q != ch.rank and np.may_share_memory(o, send) for q, o in enumerate(outs)):
            return self._run(ctx, ch, "allgather_readv", list(outs), send)
        super().all_gather_list(ch, outs, send)

    def gather(self, ch: Channel, send: np.ndarray, out: np.ndarray | None, root: int) -> None:
        n = send.size
        self.gather_list(ch, send, None if out is None else [out[q * n:(q + 1) * n] for q in range(ch.size)], root)

    def gather_list(self, ch: Channel, send: np.ndarray, outs, root: int) -> None:
        """Straight into each output, through slots or (when ``choose`` picks it) single copy."""
        ctx = self._context(ch)
        if ctx is None:
            return self.generic.gather_list(ch, send, outs, root)
        name = self._choose("gather", send.nbytes * ch.size, ctx, ch)
        self._check_root_first(ctx, ch, name == "gather_slots" and send.nbytes <= ctx.slot_bytes, root, send.nbytes)
        self._raise_disagreement(ch, root, self._run(ctx, ch, name, send, outs, root))

    def scatter(self, ch: Channel, chunks: np.ndarray | None, out: np.ndarray, root: int) -> None:
        n = out.size
        self.scatter_list(ch, None if chunks is None else [chunks[q * n:(q + 1) * n] for q in range(ch.size)],
                          out, root)

    def scatter_list(self, ch: Channel, ins, out: np.ndarray, root: int) -> None:
        """Single copy straight from each input when ``choose`` picks it (no staging either way:
        the slots copy each input's pieces into the root's slot)."""
        ctx = self._context(ch)
        if ctx is None:
            return self.generic.scatter_list(ch, ins, out, root)
        name = self._choose("scatter", out.nbytes * ch.size, ctx, ch)
        one_round = name == "scatter_slots" and out.nbytes <= piece_bytes(ctx.slot_bytes, ch.size)
        self._check_root_first(ctx, ch, one_round, root, out.nbytes)
        self._raise_disagreement(ch, root, self._run(ctx, ch, name, ins, out, root))

    def reduce_scatter(self, ch: Channel, scratch: np.ndarray, out: np.ndarray, counts, dtype, op) -> None:
        ctx = self._context(ch)
        if ctx is None:
            return self.generic.reduce_scatter(ch, scratch, out, counts, dtype, op)
        offs = offsets(counts)
        self._reduce_scatter(ctx, ch, [scratch[offs[q]:offs[q + 1]] for q in range(ch.size)], out, dtype, op, scratch)

    def reduce_scatter_list(self, ch: Channel, ins, out: np.ndarray, dtype, op) -> None:
        """Reduced straight from each input (views of one tensor, or separate tensors), which stay as
        they were; staged like the default when PREMUL_SUM must scale them first, or when ``out``
        overlaps an input (peers read the inputs while this rank writes ``out``)."""
        ctx = self._context(ch)
        if ctx is None:
            return super().reduce_scatter_list(ch, ins, out, dtype, op)
        if type(op) is not RedOpType or any(np.may_share_memory(out, x) for x in ins):
            observer = observe.current
            if observer is not None:
                observer("reduce_scatter_staged")
            return super().reduce_scatter_list(ch, ins, out, dtype, op)
        self._reduce_scatter(ctx, ch, list(ins), out, dtype, op)

    def _reduce_scatter(self, ctx, ch: Channel, ins, out: np.ndarray, dtype, op, scratch=None) -> None:
        """``ins``: this rank's block for each rank; ``scratch``: the buffer they are views of when
        the caller staged them (PREMUL_SUM scales it in place first), else None (a plain op)."""
        name = self._choose("reducescatter", sum(x.nbytes for x in ins), ctx, ch)
        red = self._reducer(op, dtype)
        swap = (commutes(op, dtype),) if name == "reduce_scatter_readv" else ()
        with_op_arithmetic(op, dtype, ch.size, out if scratch is None else scratch,
                           lambda buf: self._run(ctx, ch, name, ins, out, red, *swap), result=out)

    def all_to_all(self, ch: Channel, send: np.ndarray, send_counts, recv: np.ndarray, recv_counts) -> None:
        ctx = self._context(ch)
        if ctx is None:
            return self.generic.all_to_all(ch, send, send_counts, recv, recv_counts)
        if send_counts[ch.rank] != recv_counts[ch.rank]:
            raise ch.translate(split_mismatch(ch, ch.rank, send_counts[ch.rank], recv_counts[ch.rank]), None)
        if not alltoall.fits(ctx.slot_bytes, ch.size, send.itemsize):
            return self.generic.all_to_all(ch, send, send_counts, recv, recv_counts)
        # Ranks may disagree on this vote (uneven splits); the first round settles it, so the
        # observer hears what ran once it is known.
        vote = self._choose("alltoall", send.nbytes, ctx, ch) == "alltoall_readv"
        ran = self._guarded(ctx, ch, alltoall.alltoall_slots, send, list(send_counts), recv, list(recv_counts), vote)
        observer = observe.current
        if observer is not None:
            observer(ran)

    def all_to_all_list(self, ch: Channel, sends, recvs) -> None:
        """Each piece moved in place (through slots, or single copy from the sender's tensor); staged
        like the default for a group of one, members on other hosts, elements too large for a slot,
        or pieces a single-copy reader could not address (misaligned)."""
        ctx = self._context(ch)
        r = ch.rank
        if ctx is None or not alltoall.fits(ctx.slot_bytes, ch.size, sends[r].itemsize):
            return super().all_to_all_list(ch, sends, recvs)
        if sends[r].size != recvs[r].size:
            raise ch.translate(split_mismatch(ch, r, sends[r].size, recvs[r].size), None)
        base, offsets = 0, [0] * ch.size
        if self.transport.direct_reads_ok(ch.ranks):
            # alltoall_rounds publishes one base address and element offsets from it
            item = sends[r].itemsize
            addresses = [s.ctypes.data for s in sends]
            base = min(addresses)
            offsets = [(a - base) // item for a in addresses]
            if any((a - base) % item for a in addresses):
                return super().all_to_all_list(ch, sends, recvs)
        vote = self._choose("alltoall", sum(s.nbytes for s in sends), ctx, ch) == "alltoall_readv"
        ran = self._guarded(ctx, ch, alltoall.alltoall_pieces, list(sends), list(recvs), base, offsets, vote)
        observer = observe.current
        if observer is not None:
            observer(ran)

    def barrier(self, ch: Channel) -> None:
        ctx = self._context(ch)
        if ctx is None:
            return self.generic.barrier(ch)
        self._run(ctx, ch, "barrier_slots")

    def check_root(self, ch: Channel, root: int, what: str) -> None:
        """Nothing on shared memory: each rooted collective (``broadcast``, ``reduce``, ``gather``,
        ``scatter`` above) checks its root itself, in its own round when it has one round (as its
        latency path does), else in a round before its own (GroupCollectives.check_root's contract
        holds for the pair). Groups of one and members on other hosts: the generic check."""
        if self._context(ch) is None:
            self.generic.check_root(ch, root, what)
