"""The latency paths: a small synchronous collective, from the call to its result in one function.

An 8-byte collective moves nothing worth measuring; its cost is Python. The general path
(``ProcessGroup.<method>`` → ``OrderedExecutor.run`` → a ``Channel`` → ``ShmCollectives``, which
finds the group's memory, builds Capabilities and asks ``choose`` → the algorithm → ``GroupShm``)
makes about 90 Python calls for an all_reduce, and with 4 ranks on 2 CPUs every microsecond of a
rank's CPU is paid twice in wall time (docs/performance-notes.md). These paths skip everything but
the round.

Each runs the very round(s) of the algorithm the general path would choose for the call, so a
member running the same call through the general path (async, or declined here) meets it in the
same rounds: ``ROUNDS`` maps each path's observer name to that algorithm. They are:

* all_reduce (on the tensor, before any Buffer is made): ``allreduce_direct.one_round``, or the
  same round in one C call for the common dtypes and ops where it is built (``native.py``);
* barrier: the three steps of ``barrier_slots.one_round``, without its frame;
* on the ProcessGroup method's Buffers: broadcast (``broadcast_slots.one_round``), reduce
  (``reduce_direct.one_round``), all_gather into a list or a tensor and gather
  (``gather_slots.one_round``, writing each output in place), scatter (``scatter_slots.one_round``),
  reduce_scatter of a list or a tensor (``reduce_scatter_slots.one_round``, reading the blocks in
  place), all_to_all of lists or one tensor (``alltoall_slots.alltoall_rounds``, pieces in place).

Each over GroupShm's round API (whose exchange and consume run in C where built). Where the round
steps in C are built, broadcast, reduce, gather, all_gather, scatter and reduce_scatter run their
round as a plan of copies in one C call (``round_plan.py``: the same bytes as the algorithm's
``one_round``), and broadcast, reduce, gather, scatter, all_gather (list and tensor),
reduce_scatter_tensor and all_to_all_single (even splits, its first round a plan too) take the call
on the user's own arrays and tensors, before any Buffer is made (``FastPath.tensor_<op>``, through
``ProcessGroup.tensor_paths``). Where the whole calls in C are built too (``Calls``,
transport/_shm_calls.c), those calls, all_reduce and barrier run in C from the API function on, for
numpy arrays and plain CPU torch tensors: each function here is then the fallback of its ``Calls``
method, which hands it the calls it does not take (the last part of ``build``). The Channel a
wait would need to sleep is made only then (``ProcessGroup.channel``). What does not change from
call to call is looked up once, when the group's shared memory exists: the executor, the
reducers, the signatures, and ``Limits``: the sizes for which ``choose`` picks the algorithm above
and it takes one round (all_to_all: any number of rounds, as long as this rank votes against
single copies).

Each takes only an ordinary call, and leaves anything else to the general path (returning False
without having done anything), which then runs it or raises its error:

* a busy group (async work queued or running), a destroyed one, broken shared memory;
* torch's profiler recording (the general path records the call);
* a message past its limit; for reductions, an op other than a plain ReduceOp the dtype supports;
* all_reduce only: anything but a C-contiguous, aligned, writeable numpy array or a contiguous CPU torch
  tensor (not bfloat16), an empty message;
* all_to_all only: a split this rank does not agree with itself on, an element too large for a
  slot's piece, pieces whose addresses no single base can describe (separate tensors).

Once it has taken a sequence number it completes the call or raises, as the general path does:
a mismatch, a timeout or a lost peer names the operation, sequence number, rank and peer, and
marks the group's shared memory broken. Each call it takes is reported to the observer
(observe.py) as "latency_<op>", with the general path's op names ("latency_all_reduce",
"latency_barrier", "latency_broadcast", ..., "latency_all_to_all_single").
"""

from __future__ import annotations

import sys
import time
from functools import partial
from typing import NamedTuple, NoReturn

import numpy as np

from ... import diagnostics
from ... import flight_recorder as fr
from ...buffers import plain_tensor_memory
from ...dtypes import from_numpy
from ...errors import DistBackendError
from ...profiling import profiler_check, profiler_flag
from ...reduction import check_supported, finish, reducer, sequence_reducer
from ...signatures import signature, without_root
from ...transport import shm_group
from ...transport.base import TransportError
from ...types import RedOpType
from ..engine import FastPath, late_root_mismatch, root_mismatch
from . import (allreduce_direct, alltoall_slots, broadcast_slots, gather_slots, native, observe, reduce_direct,
               reduce_scatter_slots, round_plan, scatter_slots)
from .choose import Capabilities, choose

_ndarray = np.ndarray
RED_OP_VALUES = frozenset(int(op) for op in RedOpType)
_may_share = np.may_share_memory

#: each latency path's observer name -> the algorithm (choose's name) whose rounds it runs
ROUNDS = {
    "latency_all_reduce": "allreduce_direct",
    "latency_barrier": "barrier_slots",
    "latency_broadcast": "broadcast_slots",
    "latency_reduce": "reduce_direct",
    "latency_all_gather": "allgather_slots",
    "latency_all_gather_into_tensor": "allgather_slots",
    "latency_gather": "gather_slots",
    "latency_scatter": "scatter_slots",
    "latency_reduce_scatter": "reduce_scatter_slots",
    "latency_reduce_scatter_tensor": "reduce_scatter_slots",
    "latency_all_to_all": "alltoall_slots",
    "latency_all_to_all_single": "alltoall_slots",
}


def _largest(fits, cap: int) -> int:
    """The largest n in [0, cap] with ``fits(n)``, -1 if none; ``fits`` holds up to some size and
    not past it (``choose`` leaves its slots algorithms once, as messages grow)."""
    if not fits(0):
        return -1
    if fits(cap):
        return cap
    lo, hi = 0, cap
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


class Limits(NamedTuple):
    """The largest messages (bytes) each latency path takes: those for which ``choose`` picks the
    slots algorithm whose round the path runs (so a member running the same call through the
    general path exchanges exactly the same rounds), within one round; -1 for none."""

    broadcast: int  # the buffer's bytes
    reduce: int  # the buffer's bytes
    all_gather: int  # one rank's block
    gather: int  # one rank's block
    scatter: int  # one rank's block
    reduce_scatter: int  # every block's bytes together (each must also fit one piece)
    reduce_scatter_piece: int  # one block's bytes
    all_to_all: int  # what one rank sends, in all

    @classmethod
    def of(cls, size: int, slot_bytes: int, direct_reads: bool, tuning) -> "Limits":
        caps = Capabilities(direct_reads, slot_bytes)

        def picks(op: str, name: str, scale: int = 1):
            return lambda n: choose(op, n * scale, size, caps, tuning) == name

        piece = reduce_scatter_slots.piece_count(slot_bytes, size, 1)  # bytes: a multiple of any itemsize
        piece -= piece % 16
        return cls(
            broadcast=_largest(picks("broadcast", "broadcast_slots"), slot_bytes),
            reduce=_largest(picks("reduce", "reduce_direct"), slot_bytes),
            all_gather=_largest(picks("allgather", "allgather_slots", size), slot_bytes),
            gather=_largest(picks("gather", "gather_slots", size), slot_bytes),
            scatter=_largest(picks("scatter", "scatter_slots", size), scatter_slots.piece_bytes(slot_bytes, size)),
            reduce_scatter=_largest(picks("reducescatter", "reduce_scatter_slots"), size * piece),
            reduce_scatter_piece=piece,
            all_to_all=_largest(picks("alltoall", "alltoall_slots"), 4 * slot_bytes),
        )


def build(pg, ctx, limit: int, tuning, direct_reads: bool) -> FastPath:
    """The latency paths of process group ``pg``, whose shared memory is ``ctx`` (a GroupShm), for
    all_reduces of at most ``limit`` bytes, and every other collective within ``Limits``;
    ``direct_reads``: whether its members may read each other's memory (the shared-memory
    transport's answer: ``pg.transport`` may be another, the hybrid engine's)."""
    executor = pg.executor
    enter, leave = executor.enter_inline, executor.leave_inline
    profiler_on = profiler_check()
    next_seq = pg.next_seq
    size = ctx.size
    all_reduce_round = allreduce_direct.one_round
    open_round, exchange, consume = ctx.open_round, ctx.exchange, ctx.consume
    all_reduce_channel, barrier_channel = partial(pg.channel, "all_reduce"), partial(pg.channel, "barrier")
    # op -> {numpy dtype number: (signature, reduce_all, DType, the C round's kind)}, once checked: two
    # cheap lookups, where an (op, numpy dtype) key hashes a dtype object on every call
    plans: dict = {op: {} for op in RedOpType}
    all_reduce_in_c = native.all_reduce_in_c(ctx)  # None: the round in Python
    barrier_sig = signature("barrier")
    # for the flight recorder: its fields and states, and the clock, bound once
    group, COMPLETED, STATE, T_COMPLETED, now = pg.group_name, fr.COMPLETED, fr.STATE, fr.T_COMPLETED, time.time
    # The last torch tensor taken, its data pointer and its memory as numpy: a loop that reduces
    # the same tensor call after call skips the conversion (2.5 µs; the check costs 0.35). It keeps
    # that one small tensor alive until another takes its place. One tuple, read and replaced
    # whole: threads sharing the group never pair one tensor with another's view.
    last_tensor: list = [(None, 0, None)]

    def tensor_flat(t) -> np.ndarray | None:
        known, address, flat = last_tensor[0]
        if t is known and t.data_ptr() == address and t.numel() == flat.size and t.is_contiguous():
            return flat
        flat = plain_tensor_memory(t)
        if flat is not None and flat.nbytes <= limit:
            last_tensor[0] = (t, t.data_ptr(), flat)
        return flat

    def plan(op, np_dtype):
        try:
            dtype = from_numpy(np_dtype)
            check_supported(op, dtype)
        except (TypeError, ValueError, DistBackendError):
            return None  # the general path raises the error
        entry = (signature("all_reduce", dtype.code, int(op)), sequence_reducer(op, dtype), dtype,
                 None if all_reduce_in_c is None else native.kind(op, np_dtype))
        plans[op][np_dtype.num] = entry
        return entry

    def fail(exc: BaseException, op: str, seq: int, sig: int, entry: list | None) -> NoReturn:
        """After a failure within a round the group's shared memory is unusable: mark it, and raise
        the error (a transport's in the words of the operation, as ShmCollectives does), told to the
        flight recorder and the other ranks as the general path tells its errors."""
        translated = isinstance(exc, TransportError)
        if translated:
            ctx.give_up(str(exc), seq, withdraw=exc.reason != "mismatch")
            exc = pg.channel(op, seq, sig).translate(exc, None)
        else:
            ctx.give_up(f"{type(exc).__name__}: {exc}", seq)
        diagnostics.record_fault(pg, exc, op, seq, entry)
        if translated:
            raise exc from None
        raise exc

    # -- the calls ------------------------------------------------------------------------------
    def small_all_reduce(tensor, op) -> bool:
        if tensor.__class__ is _ndarray:
            if not tensor.flags.carray:  # C-contiguous, aligned and writeable: one attribute
                return False
            flat = tensor if tensor.ndim == 1 else tensor.reshape(-1)  # no new view when none is needed
        elif "torch" in sys.modules and isinstance(tensor, sys.modules["torch"].Tensor):
            flat = tensor_flat(tensor)
            if flat is None:
                return False
        else:
            return False
        n = flat.nbytes
        if op.__class__ is not RedOpType or not 0 < n <= limit or ctx.broken is not None:
            return False
        np_dtype = flat.dtype
        entry = plans[op].get(np_dtype.num) or plan(op, np_dtype)
        if entry is None or profiler_on() or not enter():
            return False
        sig, reduce_all, dtype, code = entry
        seq = next_seq()
        # the user's frame is above started, this function and its caller (FastPath's: the API
        # function, or torch's c10d adapter, whose caller is torch's and the walk goes on)
        record = None if fr.recorder is None else fr.recorder.started(group, seq, "all_reduce", n, dtype.name, None, 3)
        try:
            observe.current is None or observe.current("latency_all_reduce")  # one check when unobserved
            if code is None:
                all_reduce_round(ctx, seq, sig, all_reduce_channel, flat, reduce_all)
            else:
                all_reduce_in_c(seq, sig, all_reduce_channel, flat, reduce_all, code)
        except BaseException as exc:
            fail(exc, "all_reduce", seq, sig, record)
        finally:
            leave()
        if record is not None:
            record[T_COMPLETED], record[STATE] = now(), COMPLETED
        if op is RedOpType.AVG:
            finish(op, flat, size, dtype)
        return True

    def small_barrier() -> bool:
        if ctx.broken is not None or profiler_on() or not enter():
            return False
        seq = next_seq()
        record = None if fr.recorder is None else fr.recorder.started(group, seq, "barrier", 0, None, None, 3)
        try:
            observe.current is None or observe.current("latency_barrier")
            # barrier_slots.one_round's three steps, without its frame: a barrier is nothing else
            k = open_round(seq, barrier_sig, barrier_channel)
            exchange(k, seq, barrier_sig, 0, barrier_channel)
            consume(k)
        except BaseException as exc:
            fail(exc, "barrier", seq, barrier_sig, record)
        finally:
            leave()
        if record is not None:
            record[T_COMPLETED], record[STATE] = now(), COMPLETED
        return True

    # -- every other collective, on the ProcessGroup method's Buffers ---------------------------
    rank = ctx.rank
    limits = Limits.of(size, ctx.slot_bytes, direct_reads, tuning)
    channels = {op: partial(pg.channel, op) for op in (
        "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "gather", "scatter", "reduce_scatter",
        "reduce_scatter_tensor", "all_to_all", "all_to_all_single")}
    sigs: dict = {}  # (op, dtype code, reduce op code, root) -> signature
    reducers: dict = {}  # (op, dtype name) -> pairwise reducer, or None where the general path raises

    def sig_of(op: str, code: int, red: int = 0, root: int | None = None) -> int:
        key = (op, code, red, root)
        sig = sigs.get(key)
        if sig is None:
            sig = sigs[key] = signature(op, code, red, root)
        return sig

    def reducer_of(op, dtype):
        """The pairwise reducer of a plain ReduceOp (None for anything else: the general path runs
        PREMUL_SUM, and raises for an op the dtype lacks)."""
        if op.__class__ is not RedOpType:
            return None
        key = (op, dtype.name)
        if key not in reducers:
            try:
                reducers[key] = reducer(op, dtype)
            except (TypeError, ValueError, DistBackendError):
                reducers[key] = None
        return reducers[key]

    def claim() -> bool:
        """The group is ours for this call (then run() must follow), or the general path's."""
        return ctx.broken is None and not profiler_on() and enter()

    def run(op: str, sig: int, buf, root: int | None, one_round, *args) -> bool:
        """One claimed call on ``buf`` (the Buffer the flight recorder describes): its sequence
        number, then the algorithm's round(s); a rooted collective's one round carries its root
        check (``root_check.exchange``, as on the general path)."""
        # the user's frame is above started, run_round, run, the path (or its helper) and the path
        # or ProcessGroup._fast: the walk goes on from the frame after them
        return run_round(op, sig, buf.flat.nbytes, buf.dtype.name, 5, root, one_round, *args)

    def run_round(op: str, sig: int, nbytes: int, dtype_name: str, frames: int, root: int | None, one_round,
                  *args) -> bool:
        """``run`` for a call of ``nbytes`` of ``dtype_name``: ``frames`` is ``FlightRecorder.started``'s
        skip (the user's frame or a distcomm frame below it: fewer only costs a longer walk, more
        would pass the user's frame)."""
        seq = next_seq()
        channel = channels[op]
        record = None if fr.recorder is None else fr.recorder.started(group, seq, op, nbytes, dtype_name, root,
                                                                      frames)
        try:
            observe.current is None or observe.current("latency_" + op)
            ran = one_round(ctx, seq, sig, channel, *args)
        except BaseException as exc:
            fail(exc, op, seq, sig, record)
        finally:
            leave()
        # a rooted op's round carries its root check (root_check.exchange) and returns its result
        disagreeing = ran if root is not None else None
        if disagreeing is not None:
            refuse(op, seq, sig, root, disagreeing, record)
        if record is not None:
            record[T_COMPLETED], record[STATE] = now(), COMPLETED
        return True

    def refuse(op: str, seq: int, sig: int, root: int, disagreeing: tuple[int, int], record) -> NoReturn:
        """Raise the root mismatch of a rooted call whose round found (peer, its root) differing.
        The round itself completed, so the group's memory stays usable (as on the general path)."""
        exc = root_mismatch(pg.channel(op, seq, sig), root, disagreeing[0], disagreeing[1],
                            "src" if op in ("broadcast", "scatter") else "dst")
        if record is not None:
            fr.fail(record, exc)
        diagnostics.on_fault(pg, exc, op, seq)
        raise exc

    def refuse_late(late, op: str, seq: int, sig: int) -> NoReturn:
        """Raise an earlier rooted call's root mismatch (``late``: GroupShm.settle_deferred's), which
        call ``op`` #``seq`` found when it settled that call's deferred round and has now completed."""
        exc = late_root_mismatch(pg.channel(op, seq, sig), late)
        ctx.reported(late)
        diagnostics.on_fault(pg, exc, late.op, late.seq)
        raise exc

    # -- each one_round as a plan of copies, run in one C call (round_plan.py), where it is built ---
    move = round_plan.runner(ctx)
    address = round_plan.address
    scatter_step = scatter_slots.piece_bytes(ctx.slot_bytes, size)
    kinds: dict = {}  # (op, numpy dtype) -> the C fold's kind, or None

    def kind_of(op, np_dtype) -> int | None:
        key = (op, np_dtype)
        if key not in kinds:
            kinds[key] = native.kind(op, np_dtype)
        return kinds[key]

    # Plans of rounds whose writes and reads take a loop over the ranks to build (gather, scatter,
    # reduce_scatter_tensor, all_to_all_single), kept while the same arrays come back (a loop's
    # tensors; torch tensors' views are kept by flat_of). A key holds the ids of its arrays and the
    # entry holds the arrays, so no other object can take those ids while the entry lives; sizes,
    # offsets and addresses the plan depends on are in the key too. A handful, cleared when full.
    kept_plans: dict = {}

    def keep_plan(key, plan, arrays):
        if len(kept_plans) >= 16:
            kept_plans.clear()
        kept_plans[key] = (plan, arrays)
        return plan

    def broadcast_round(_, seq, sig, channel, flat, root):
        n = flat.nbytes
        if rank == root:
            return move(seq, sig, without_root(sig), channel, n, root, True, ((flat, 0, 0, n),), ())
        return move(seq, sig, without_root(sig), channel, n, root, True, (), ((root, 0, flat, 0, n),))

    def reduce_round(_, seq, sig, channel, flat, red, root, code):
        n = flat.nbytes
        reads = tuple((q, 0, flat, 0, n) for q in range(size)) if rank == root else ()
        return move(seq, sig, without_root(sig), channel, n, root, True, ((flat, 0, 0, n),), reads, code, red,
                    flat.dtype)

    def gather_round(_, seq, sig, channel, send, outs, root):
        """gather_slots.one_round's plan; ``outs``: a list of arrays, or (array, block bytes) for
        blocks of one output (all_gather_into_tensor)."""
        n = send.nbytes
        if outs is None:
            reads = ()
        elif outs.__class__ is tuple:
            out, step = outs
            key = ("gather", id(send), n, id(out), out.nbytes, step)
            kept = kept_plans.get(key)
            reads = kept[0] if kept is not None else keep_plan(
                key, tuple((send if q == rank else q, 0, out, q * step, n) for q in range(size)), (send, out))
        else:
            reads = tuple((send if q == rank else q, 0, outs[q], 0, n) for q in range(size))
        writes = ((send, 0, 0, n),) if root != rank else ()
        if root is None:
            return move(seq, sig, sig, channel, n, 0, False, writes, reads)
        return move(seq, sig, without_root(sig), channel, n, root, True, writes, reads)

    def scatter_round(_, seq, sig, channel, ins, out, root):
        n = out.nbytes
        if rank == root:
            writes = tuple((ins[q], 0, q * scatter_step, n) for q in range(size) if q != root)
            reads = ((ins[root], 0, out, 0, n),)
        else:
            writes, reads = (), ((root, rank * scatter_step, out, 0, n),)
        return move(seq, sig, without_root(sig), channel, n, root, True, writes, reads)

    def reduce_scatter_round(_, seq, sig, channel, blocks, out, total, red, code):
        """reduce_scatter_slots.one_round's plan; ``blocks``: a list of arrays, or (array, block
        bytes) for blocks of one input (reduce_scatter_tensor)."""
        n = out.nbytes
        if blocks.__class__ is tuple:
            inp, step = blocks
            key = ("reduce_scatter", id(inp), inp.nbytes, step, id(out), n, out.itemsize)
            kept = kept_plans.get(key)
            writes, reads = kept[0] if kept is not None else keep_plan(
                key, reduce_scatter_plan(inp, step, out, n), (inp, out))
        else:
            stride = reduce_scatter_slots.piece_count(ctx.slot_bytes, size, out.itemsize) * out.itemsize
            writes = tuple((b, 0, q * stride, b.nbytes) for q, b in enumerate(blocks) if q != rank and b.nbytes)
            reads = tuple((blocks[rank], 0, out, 0, n) if q == rank else (q, rank * stride, out, 0, n)
                          for q in range(size)) if n else ()
        move(seq, sig, sig, channel, total, 0, False, writes, reads, code, red, out.dtype)

    def reduce_scatter_plan(inp, step, out, n):
        """reduce_scatter_round's (writes, reads) for blocks of ``step`` bytes of one input."""
        stride = reduce_scatter_slots.piece_count(ctx.slot_bytes, size, out.itemsize) * out.itemsize
        writes = tuple((inp, q * step, q * stride, n) for q in range(size) if q != rank and n)
        reads = tuple((inp, rank * step, out, 0, n) if q == rank else (q, rank * stride, out, 0, n)
                      for q in range(size)) if n else ()
        return writes, reads

    def broadcast(buf, root) -> bool:
        if buf.flat.nbytes > limits.broadcast or not claim():
            return False
        run("broadcast", sig_of("broadcast", buf.dtype.code, root=root), buf, root,
            broadcast_slots.one_round if move is None else broadcast_round, buf.flat, root)
        buf.commit()
        return True

    def reduce(buf, op, root) -> bool:
        red = reducer_of(op, buf.dtype)
        if red is None or buf.flat.nbytes > limits.reduce or not claim():
            return False
        flat = buf.flat
        sig = sig_of("reduce", buf.dtype.code, int(op), root)
        code = None if move is None else kind_of(op, flat.dtype)
        if code is None:
            run("reduce", sig, buf, root, reduce_direct.one_round, flat, red, root)
        else:
            run("reduce", sig, buf, root, reduce_round, flat, red, root, code)
        if rank == root:
            finish(op, flat, size, buf.dtype)
            buf.commit()
        return True

    def allgather(outs, inp) -> bool:
        if inp.flat.nbytes > limits.all_gather or not claim():
            return False
        run("all_gather", sig_of("all_gather", inp.dtype.code), inp, None,
            gather_slots.one_round if move is None else gather_round, inp.flat, [b.flat for b in outs], None)
        for b in outs:
            b.commit()
        return True

    def allgather_into_tensor(out, inp) -> bool:
        if inp.flat.nbytes > limits.all_gather or not claim():
            return False
        n, flat = inp.count, out.flat
        sig = sig_of("all_gather_into_tensor", inp.dtype.code)
        if move is None:
            run("all_gather_into_tensor", sig, inp, None, gather_slots.one_round, inp.flat,
                [flat[q * n:(q + 1) * n] for q in range(size)], None)
        else:
            run("all_gather_into_tensor", sig, inp, None, gather_round, inp.flat, (flat, inp.flat.nbytes), None)
        out.commit()
        return True

    def gather(outs, inp, root) -> bool:
        if inp.flat.nbytes > limits.gather or not claim():
            return False
        run("gather", sig_of("gather", inp.dtype.code, root=root), inp, root,
            gather_slots.one_round if move is None else gather_round, inp.flat,
            None if outs is None else [b.flat for b in outs], root)
        for b in outs or ():
            b.commit()
        return True

    def scatter(out, ins, root) -> bool:
        if out.flat.nbytes > limits.scatter or not claim():
            return False
        run("scatter", sig_of("scatter", out.dtype.code, root=root), out, root,
            scatter_slots.one_round if move is None else scatter_round,
            None if ins is None else [b.flat for b in ins], out.flat, root)
        out.commit()
        return True

    def reduce_scatter_blocks(op_name: str, out, blocks, op) -> bool:
        """``blocks``: this rank's block for each rank, a list of arrays, or (array, block bytes) for
        the blocks of one input (reduce_scatter_tensor)."""
        red = reducer_of(op, out.dtype)
        if red is None:
            return False
        flat = out.flat
        if blocks.__class__ is tuple:
            piece = blocks[1]
            total = size * piece
            overlapping = _may_share(flat, blocks[0])
        else:
            piece = max(b.nbytes for b in blocks)
            total = sum(b.nbytes for b in blocks)
            overlapping = any(_may_share(flat, b) for b in blocks)
        # an output in its own input (in place, as FSDP reduces) would be overwritten by the fold
        # before its own block is read: the general path reduces a copy
        if overlapping or piece > limits.reduce_scatter_piece or total > limits.reduce_scatter or not claim():
            return False
        sig = sig_of(op_name, out.dtype.code, int(op))
        code = None if move is None else kind_of(op, out.flat.dtype)
        if code is None:
            if blocks.__class__ is tuple:
                flat, count = blocks[0], out.count
                blocks = [flat[q * count:(q + 1) * count] for q in range(size)]
            run(op_name, sig, out, None, reduce_scatter_slots.one_round, blocks, out.flat, total, red)
        else:
            run(op_name, sig, out, None, reduce_scatter_round, blocks, out.flat, total, red, code)
        finish(op, out.flat, size, out.dtype)
        out.commit()
        return True

    def reduce_scatter(out, ins, op) -> bool:
        return reduce_scatter_blocks("reduce_scatter", out, [b.flat for b in ins], op)

    def reduce_scatter_tensor(out, inp, op) -> bool:
        return reduce_scatter_blocks("reduce_scatter_tensor", out, (inp.flat, out.flat.nbytes), op)

    def all_to_all(op_name: str, buf, sends, recvs, base: int, offsets) -> bool:
        """Claim and run one all_to_all of these pieces (checked by the caller); ``buf``: the
        output Buffer (or the first), for its dtype."""
        if not claim():
            return False
        run(op_name, sig_of(op_name, buf.dtype.code), buf, None, alltoall_slots.alltoall_rounds, sends, recvs, base,
            offsets)
        return True

    def a2a_fits(sends, recvs) -> bool:
        """The general path's checks, which it would raise or route elsewhere: this rank's piece to
        itself the size it expects, every piece's element fitting a slot, the slots algorithm chosen."""
        if sends[rank].size != recvs[rank].size or not alltoall_slots.fits(ctx.slot_bytes, size, recvs[rank].itemsize):
            return False
        return sum(s.nbytes for s in sends) <= limits.all_to_all

    def alltoall(outs, ins) -> bool:
        sends, recvs = [b.flat for b in ins], [b.flat for b in outs]
        if not a2a_fits(sends, recvs):
            return False
        base, offsets = 0, [0] * size
        if direct_reads:  # a peer voting for single copies reads each piece from its address
            item = sends[0].itemsize
            addresses = [s.ctypes.data for s in sends]
            base = min(addresses)
            offsets = [(a - base) // item for a in addresses]
            if any((a - base) % item for a in addresses):
                return False
        if not all_to_all("all_to_all", outs[0], sends, recvs, base, offsets):
            return False
        for b in outs:
            b.commit()
        return True

    def alltoall_base(out, inp, recv_counts, send_counts) -> bool:
        so, ro = [0], [0]
        for c in send_counts:
            so.append(so[-1] + c)
        for c in recv_counts:
            ro.append(ro[-1] + c)
        send, recv = inp.flat, out.flat
        sends = [send[so[q]:so[q + 1]] for q in range(size)]
        recvs = [recv[ro[q]:ro[q + 1]] for q in range(size)]
        if not a2a_fits(sends, recvs):
            return False
        if not all_to_all("all_to_all_single", out, sends, recvs, send.ctypes.data if direct_reads else 0, so):
            return False
        out.commit()
        return True

    paths = FastPath(all_reduce=small_all_reduce, barrier=small_barrier, broadcast=broadcast, reduce=reduce,
                     allgather=allgather, allgather_into_tensor=allgather_into_tensor, gather=gather, scatter=scatter,
                     reduce_scatter=reduce_scatter, reduce_scatter_tensor=reduce_scatter_tensor, alltoall=alltoall,
                     alltoall_base=alltoall_base)
    if move is None:
        return paths

    # -- on the user's tensors, before any Buffer is made (where the plans run in C) ---------------
    # Torch tensors taken lately, each with its data pointer and its memory as numpy (the
    # conversion costs 2.5 µs, the check 0.35); a handful, so a loop over an input and an output
    # finds both. An entry is one tuple, read and replaced whole (threads sharing the group never
    # pair one tensor with another's memory); it keeps its small tensor alive until the next clear.
    known_tensors: dict = {}
    known_dtypes: dict = {}  # numpy dtype -> DType, or None where the general path decides

    def flat_of(t) -> np.ndarray | None:
        """``t``'s memory as a flat numpy array when it is a C-contiguous, aligned, writeable numpy
        array or a contiguous CPU torch tensor (not bfloat16); else None (the general path)."""
        if t.__class__ is _ndarray:
            if not t.flags.carray:
                return None
            return t if t.ndim == 1 else t.reshape(-1)
        torch = sys.modules.get("torch")
        if torch is None or not isinstance(t, torch.Tensor):
            return None
        entry = known_tensors.get(id(t))
        if entry is not None:
            known, address, flat = entry
            if t is known and t.data_ptr() == address and t.numel() == flat.size and t.is_contiguous():
                return flat
        flat = plain_tensor_memory(t)
        if flat is not None and flat.nbytes <= ctx.slot_bytes:
            if len(known_tensors) >= 8:
                known_tensors.clear()
            known_tensors[id(t)] = (t, t.data_ptr(), flat)
        return flat

    def dtype_of(flat):
        try:
            return known_dtypes[flat.dtype]
        except KeyError:
            return dtype_of_numpy(flat.dtype)

    def dtype_of_numpy(np_dtype):
        try:
            return known_dtypes[np_dtype]
        except KeyError:
            try:
                dtype = from_numpy(np_dtype)
            except (TypeError, ValueError):
                dtype = None
            known_dtypes[np_dtype] = dtype
            return dtype

    folds: dict = {}  # (op, numpy dtype) -> (DType, pairwise reducer, the C fold's kind), or None

    def fold_of(op, np_dtype):
        """What a reduction of ``np_dtype`` with ``op`` needs on a plan (None: the general path's)."""
        try:
            return folds[(op, np_dtype)]
        except KeyError:
            dtype = dtype_of_numpy(np_dtype)
            red = None if dtype is None else reducer_of(op, dtype)
            code = None if red is None else kind_of(op, np_dtype)
            entry = folds[(op, np_dtype)] = None if code is None else (dtype, red, code)
            return entry

    def flats_like(tensors, like: np.ndarray) -> list | None:
        """A gather's or scatter's list as flat arrays each like ``like`` (size and dtype), or None."""
        if tensors.__class__ is not list or len(tensors) != size:
            return None
        flats = [flat_of(t) for t in tensors]
        for f in flats:
            if f is None or f.dtype != like.dtype or f.size != like.size:
                return None
        return flats

    # the recorder's skip: run_round, the path and the API function (which calls the path through
    # ProcessGroup.tensor_paths, or through Calls, which adds no frame) are distcomm's; the user's frame
    # is next (a distcomm caller there, as torch's adapter, costs a walk)
    frames = 4

    def tensor_broadcast(tensor, root) -> bool:
        flat = flat_of(tensor)
        if flat is None or not 0 < flat.nbytes <= limits.broadcast:
            return False
        dtype = dtype_of(flat)
        if dtype is None or not claim():
            return False
        run_round("broadcast", sig_of("broadcast", dtype.code, root=root), flat.nbytes, dtype.name, frames, root,
                  broadcast_round, flat, root)
        return True

    def tensor_reduce(tensor, op, root) -> bool:
        flat = flat_of(tensor)
        if flat is None or not 0 < flat.nbytes <= limits.reduce:
            return False
        fold = fold_of(op, flat.dtype)
        if fold is None or not claim():
            return False
        dtype, red, code = fold
        run_round("reduce", sig_of("reduce", dtype.code, int(op), root), flat.nbytes, dtype.name, frames, root,
                  reduce_round, flat, red, root, code)
        if rank == root:
            finish(op, flat, size, dtype)
        return True

    def tensor_all_gather_into_tensor(output, inp) -> bool:
        out, send = flat_of(output), flat_of(inp)
        if out is None or send is None or out.dtype != send.dtype or out.size != send.size * size:
            return False
        n = send.nbytes
        dtype = dtype_of(send)
        if not 0 < n <= limits.all_gather or dtype is None or not claim():
            return False
        run_round("all_gather_into_tensor", sig_of("all_gather_into_tensor", dtype.code), n, dtype.name, frames, None,
                  gather_round, send, (out, n), None)
        return True

    def tensor_all_gather(tensor_list, inp) -> bool:
        send = flat_of(inp)
        if send is None or not 0 < send.nbytes <= limits.all_gather:
            return False
        outs = flats_like(tensor_list, send)
        dtype = dtype_of(send)
        if outs is None or dtype is None or not claim():
            return False
        run_round("all_gather", sig_of("all_gather", dtype.code), send.nbytes, dtype.name, frames, None, gather_round,
                  send, outs, None)
        return True

    def tensor_reduce_scatter_tensor(output, inp, op) -> bool:
        out, flat = flat_of(output), flat_of(inp)
        if out is None or flat is None or out.dtype != flat.dtype or flat.size != out.size * size:
            return False
        n = out.nbytes
        if not 0 < n <= limits.reduce_scatter_piece or n * size > limits.reduce_scatter:
            return False
        at, start = address(out), address(flat)
        if at < start + flat.nbytes and start < at + n:  # in place: the general path reduces a copy
            return False
        fold = fold_of(op, out.dtype)
        if fold is None or not claim():
            return False
        dtype, red, code = fold
        run_round("reduce_scatter_tensor", sig_of("reduce_scatter_tensor", dtype.code, int(op)), n, dtype.name, frames,
                  None, reduce_scatter_round, (flat, n), out, n * size, red, code)
        finish(op, out, size, dtype)
        return True

    def root_list(tensors, like: np.ndarray, root: int):
        """A gather's or scatter's list: on the root, its tensors as flat arrays each like ``like``;
        elsewhere None (the list must be empty there); False where the general path must decide."""
        if rank == root:
            flats = flats_like(tensors, like) if tensors else None
            return False if flats is None else flats
        return False if tensors else None

    def tensor_gather(tensor, gather_list, root) -> bool:
        send = flat_of(tensor)
        if send is None or not 0 < send.nbytes <= limits.gather:
            return False
        outs, dtype = root_list(gather_list, send, root), dtype_of(send)
        if outs is False or dtype is None or not claim():
            return False
        run_round("gather", sig_of("gather", dtype.code, root=root), send.nbytes, dtype.name, frames, root,
                  gather_round, send, outs, root)
        return True

    def tensor_scatter(tensor, scatter_list, root) -> bool:
        out = flat_of(tensor)
        if out is None or not 0 < out.nbytes <= limits.scatter:
            return False
        ins, dtype = root_list(scatter_list, out, root), dtype_of(out)
        if ins is False or dtype is None or not claim():
            return False
        run_round("scatter", sig_of("scatter", dtype.code, root=root), out.nbytes, dtype.name, frames, root,
                  scatter_round, ins, out, root)
        return True

    a2a_layouts: dict = {}  # item size -> (elements a region, offset of our piece in each peer's slot, ours for each)
    a2a_tables: dict = {}  # (elements per piece, send address) -> round 0's table of words (alltoall_slots)
    a2a_expects: dict = {}  # elements per piece -> what every peer's table must say

    def a2a_round(_, seq, sig, channel, inp, out, count):
        """alltoall_slots.alltoall_rounds's one round as a plan, for ``count`` elements to and from
        every rank: this rank's table of words and pieces into its slot; each peer's table must say
        it sends ``count``, in one round, with no single-copy vote, else the algorithm resumes."""
        item = inp.itemsize
        layout = a2a_layouts.get(item)
        if layout is None:
            per = alltoall_slots.piece_capacity(ctx.slot_bytes, size, item)
            layout = a2a_layouts[item] = (per, [alltoall_slots.piece_at(q, rank, per, item, size) for q in range(size)],
                                          [alltoall_slots.piece_at(rank, q, per, item, size) for q in range(size)])
        _, ours_in, ours_out = layout
        nb = count * item
        base = address(inp) if direct_reads else 0
        key = ("all_to_all", id(inp), base, count, nb, id(out), out.nbytes)
        kept = kept_plans.get(key)
        if kept is not None:
            writes, reads = kept[0]
        else:
            table = a2a_tables.get((count, base))
            if table is None:
                if len(a2a_tables) >= 8:
                    a2a_tables.clear()
                table = a2a_tables[(count, base)] = np.array(
                    [count] * size + [q * count for q in range(size)] + [count] * size + [1, 0, base], np.int64)
            writes = ((table, 0, 0, table.nbytes),) + tuple(
                (inp, q * nb, ours_out[q], nb) for q in range(size) if q != rank)
            reads = tuple((q, ours_in[q], out, q * nb, nb) if q != rank else (inp, q * nb, out, q * nb, nb)
                          for q in range(size))
            keep_plan(key, (writes, reads), (inp, out))
        expect = a2a_expects.get(count)
        if expect is None:
            if len(a2a_expects) >= 8:
                a2a_expects.clear()
            expect = a2a_expects[count] = tuple(e for q in range(size) if q != rank for e in (
                (q, rank, count), (q, 3 * size, 1), (q, 3 * size + 1, 0)))

        def resume(k):
            sends = [inp[q * count:(q + 1) * count] for q in range(size)]
            recvs = [out[q * count:(q + 1) * count] for q in range(size)]
            alltoall_slots.alltoall_rounds(ctx, seq, sig, channel, sends, recvs, base,
                                           [q * count for q in range(size)], False, k)

        move(seq, sig, sig, channel, 0, 0, False, writes, reads, -1, None, None, expect, resume)

    def tensor_all_to_all_single(output, inp) -> bool:
        """Equal splits (the API passes no split sizes), each piece within one round."""
        out, send = flat_of(output), flat_of(inp)
        if out is None or send is None or out.dtype != send.dtype or out.size != send.size:
            return False
        if address(out) != address(send) and np.may_share_memory(out, send):
            return False  # the output over part of the input: pieces would land over unsent ones
        shape_in, shape_out = inp.shape, output.shape
        if not shape_in or not shape_out or shape_in[0] % size or shape_out[0] % size:
            return False
        count = send.size // size
        item = send.itemsize
        if (not count or count > alltoall_slots.piece_capacity(ctx.slot_bytes, size, item)
                or send.nbytes > limits.all_to_all):
            return False
        dtype = dtype_of(send)
        if dtype is None or not claim():
            return False
        run_round("all_to_all_single", sig_of("all_to_all_single", dtype.code), send.nbytes, dtype.name, frames, None,
                  a2a_round, send, out, count)
        return True

    paths = paths._replace(tensor_broadcast=tensor_broadcast, tensor_reduce=tensor_reduce,
                           tensor_all_to_all_single=tensor_all_to_all_single, tensor_all_gather=tensor_all_gather,
                           tensor_all_gather_into_tensor=tensor_all_gather_into_tensor,
                           tensor_reduce_scatter_tensor=tensor_reduce_scatter_tensor, tensor_gather=tensor_gather,
                           tensor_scatter=tensor_scatter)
    if shm_group.Calls is None or size > shm_group.Calls.MAX_MEMBERS:
        return paths

    # -- on numpy arrays, the whole call in C (transport/_shm_calls.c), the paths above its fallback --
    def describe(op: str, np_dtype: np.dtype, red: int, root: int):
        """What a call of ``op`` on ``np_dtype`` with reduce op ``red`` (-1: none) and ``root`` (-1:
        none) needs in C, or None where the Python path above decides (AVG and PREMUL_SUM among them)."""
        if op == "barrier":
            return (barrier_sig, barrier_sig, None, -1, 1, 0, None, None, 0)
        dtype = dtype_of_numpy(np_dtype)
        if dtype is None:
            return None
        at = None if root < 0 else root
        kind, red_fn = -1, None
        if red >= 0:
            fold = fold_of(RedOpType(red), np_dtype) if red in RED_OP_VALUES else None
            if fold is None or red == RedOpType.AVG:
                return None
            _, red_fn, kind = fold
        sig = sig_of(op, dtype.code, max(red, 0), at)
        item = np_dtype.itemsize
        stride = head = 0  # bytes between a slot's blocks (reduce_scatter, all_to_all), before the first
        if op == "reduce_scatter_tensor":
            stride = reduce_scatter_slots.piece_count(ctx.slot_bytes, size, item) * item
        elif op == "all_to_all_single":
            if not alltoall_slots.fits(ctx.slot_bytes, size, item):
                return None
            stride = alltoall_slots.piece_capacity(ctx.slot_bytes, size, item) * item
            head = alltoall_slots.slot_head(size)
        return (sig, sig if at is None else without_root(sig), dtype.name, kind, item, stride, red_fn, np_dtype, head)

    def resume_all_to_all(status: int, k: int, seq: int, sig: int, channel, output, inp) -> None:
        """An all_to_all_single whose first round C handed back: the algorithm goes on from it."""
        if status != shm_group.DIFFERS:
            ctx.settle(status, k, seq, sig, 0, channel)
        count = inp.size // size
        send, recv = inp.reshape(-1), output.reshape(-1)
        alltoall_slots.alltoall_rounds(ctx, seq, sig, channel, [send[q * count:(q + 1) * count] for q in range(size)],
                                       [recv[q * count:(q + 1) * count] for q in range(size)],
                                       address(send) if direct_reads else 0, [q * count for q in range(size)], False,
                                       k)

    def small_tensor_memory(t) -> np.ndarray | None:
        """A plain CPU torch tensor's memory, for Calls to keep with the tensor: only a message a
        slot can hold (Calls keeps a few, and must not keep a large tensor alive)."""
        flat = plain_tensor_memory(t)
        return flat if flat is not None and flat.nbytes <= ctx.slot_bytes else None

    ops = shm_group.Calls.OPS
    python_paths = {"broadcast": tensor_broadcast, "reduce": tensor_reduce, "all_gather": tensor_all_gather,
                    "all_gather_into_tensor": tensor_all_gather_into_tensor, "gather": tensor_gather,
                    "scatter": tensor_scatter, "reduce_scatter_tensor": tensor_reduce_scatter_tensor,
                    "all_reduce": small_all_reduce, "barrier": small_barrier,
                    "all_to_all_single": tensor_all_to_all_single}
    limit_of = {"broadcast": limits.broadcast, "reduce": limits.reduce, "all_gather": limits.all_gather,
                "all_gather_into_tensor": limits.all_gather, "gather": limits.gather, "scatter": limits.scatter,
                "reduce_scatter_tensor": limits.reduce_scatter_piece, "all_reduce": limit, "barrier": 0,
                "all_to_all_single": limits.all_to_all}
    channels.update(all_reduce=all_reduce_channel, barrier=barrier_channel)
    calls = shm_group.Calls(
        rounds=ctx.native, ndarray=_ndarray, redop=RedOpType, ctx=ctx, profiler_flag=profiler_flag, executor=executor,
        leave=leave, next_seq=next_seq, open_round=ctx.open_round, ring_consumed=ctx.ring_consumed,
        describe=describe, handback=partial(round_plan.handed_back, ctx), fail=fail, refuse=refuse,
        channels=tuple(channels[op] for op in ops), fallbacks=tuple(python_paths[op] for op in ops),
        recorder_module=fr, observe_module=observe, group=group, resume_all_to_all=resume_all_to_all,
        limits=tuple(max(limit_of[op], 0) for op in ops), rs_total=max(limits.reduce_scatter, 0),
        scatter_step=scatter_step, t_completed=T_COMPLETED, state=STATE, completed=COMPLETED, direct_reads=direct_reads,
        tensor_memory=small_tensor_memory, settle=ctx.settle_deferred, refuse_late=refuse_late,
        ring_posted=ctx.ring_posted, defer=ctx.transport.tuning.shm_defer)
    return paths._replace(all_reduce=calls.all_reduce, barrier=calls.barrier,
                          tensor_broadcast=calls.broadcast, tensor_reduce=calls.reduce,
                          tensor_all_gather=calls.all_gather,
                          tensor_all_gather_into_tensor=calls.all_gather_into_tensor,
                          tensor_gather=calls.gather, tensor_scatter=calls.scatter,
                          tensor_reduce_scatter_tensor=calls.reduce_scatter_tensor,
                          tensor_all_to_all_single=calls.all_to_all_single)
