"""The MPI engine's latency paths: small synchronous collectives, straight to MPI.

The general path (``ProcessGroup.<method>`` -> executor -> Work/Channel -> ``MpiCollectives``) costs
tens of Python calls around a 3 µs MPI call; these check the call, claim the group
(``executor.enter_inline``), take the sequence number, record the call in the flight recorder and
run the very nonblocking MPI call the general path would make (a member running the same call
through the general path meets it: MPI matches nonblocking collectives only with nonblocking ones),
tested to the group's deadline. They are:

* all_reduce (on the tensor, before any Buffer is made): the ``Start`` of the group's persistent
  request for its count, datatype, op and signature, on that request's staging array
  (persistent.py), with no agreement (collectives.py: the request's was made with it); the first
  call of its count is ``MpiCollectives.first_all_reduce`` (the request made, the ranks' rows
  compared), or where MPI has no persistent collectives a checked ``Iallreduce`` in place; it
  takes only a C-contiguous, aligned, writeable numpy array or a contiguous CPU torch tensor (not
  bfloat16);
* barrier: the Start of the group's persistent barrier (persistent.py), or ``Ibarrier``;
* on the ProcessGroup method's Buffers, each with the general path's agreement started with it
  (``MpiCollectives.checked``): all_gather_into_tensor: ``Iallgather`` in place, this rank's block
  copied in first;
* reduce_scatter_tensor: ``Ireduce_scatter_block`` from the input (declined when the output
  overlaps it: the general path reduces a copy).

Each takes at most ``LIMIT`` bytes (all_reduce, all_gather's output, reduce_scatter's input) and,
for reductions, a plain ReduceOp that MPI computes natively (``native``); anything else returns
False having done nothing, and the general path runs it (or raises its error). A busy or broken
group, and torch's profiler recording (the general path records the call), go the general way too.
Once a path has taken a sequence number it completes the call or raises as the general path does:
the error names the operation, sequence number and rank, is told to the flight recorder and
``diagnostics.on_fault``, and a timeout inside MPI (or a member leaving the job) marks the group
broken (``MpiCollectives.give_up``).

* broadcast: ``Ibcast`` (its agreement row carries the root: the general path's root check).

Every wait is the general path's (``MpiCollectives.watch``: a wait that lasts tells the others
what it waits in, and a member waiting in another call at the same sequence number is a mismatch).

The Buffer-level paths also decline while DETAIL's shape check is on (``diagnostics.check_shapes``):
the general path then exchanges fingerprints first, which a member on this path would not.
"""

from __future__ import annotations

import sys
import time
from time import monotonic as _monotonic

import numpy as np

from ... import diagnostics
from ... import flight_recorder as fr
from ...buffers import plain_tensor_memory
from ...dtypes import from_numpy
from ...errors import DistBackendError
from ...profiling import profiler_check, profiler_flag
from ...reduction import check_supported, finish
from ...signatures import signature
from ...transport.base import TransportError
from ...transport.mpi import mpi_error, wait_request
from ...types import RedOpType
from ..engine import FastPath
from . import agreement, library

LIMIT = 64 * 1024  # bytes: past this the call's own cost is MPI's, and the general path adds nothing to it

try:  # the small all_reduce on a numpy array, the whole call in C (setup.py builds it where it can)
    from ._mpi_calls import Calls as _CallsInC
except ImportError:
    _CallsInC = None
#: whether the small all_reduce on a numpy array runs in C here (_mpi_calls.c, built by setup.py)
ALL_REDUCE_IN_C = _CallsInC is not None
_RED_OP_VALUES = frozenset(int(op) for op in RedOpType)

_ndarray = np.ndarray
_modules = sys.modules


def build(pg, collectives) -> FastPath:
    """The latency paths of process group ``pg`` over its MpiCollectives ``collectives``."""
    MPI = collectives.MPI
    comm = collectives.comm
    first_all_reduce, checked, watch = collectives.first_all_reduce, collectives.checked, collectives.watch
    row = agreement.row
    start_barrier = collectives.start_barrier
    closed = collectives.check  # the transport closed, a member left the job
    executor = pg.executor
    enter, leave = executor.enter_inline, executor.leave_inline
    next_seq = pg.next_seq
    size = len(pg.spec.ranks)
    rank = pg.rank()
    IN_PLACE, BYTE = MPI.IN_PLACE, MPI.BYTE
    AVG = RedOpType.AVG
    mpi_exception = MPI.Exception
    profiler_on = profiler_check()
    # for the flight recorder: its fields and states, and the clock, bound once
    group, COMPLETED, STATE, T_COMPLETED, now = pg.group_name, fr.COMPLETED, fr.STATE, fr.T_COMPLETED, time.time
    # op -> {numpy dtype number: (MPI datatype, MPI op, DType, its name, signature) or None}: two cheap
    # lookups, where an (op, np.dtype) key would hash a dtype object on every call
    plans: dict = {op: {} for op in RedOpType}
    barrier_sig = signature("barrier")
    # The last torch tensor taken, its data pointer and its memory as numpy: a loop that reduces
    # the same tensor call after call skips the conversion (about 2.5 µs). One tuple, read and
    # replaced whole: threads sharing the group never pair one tensor with another's view.
    # (``t.data = ...`` can swap a tensor's memory and dtype: both are checked.)
    last_tensor: list = [(None, 0, None, None)]

    def tensor_flat(t):
        known, address, dtype, flat = last_tensor[0]
        if t is known and t.data_ptr() == address and t.dtype is dtype and t.numel() == flat.size \
                and t.is_contiguous():
            return flat
        flat = plain_tensor_memory(t)
        if flat is not None and flat.nbytes <= LIMIT:
            last_tensor[0] = (t, t.data_ptr(), t.dtype, flat)
        return flat

    def plan(op, np_dtype):
        try:
            dtype = from_numpy(np_dtype)
            check_supported(op, dtype)
        except (TypeError, ValueError, DistBackendError):
            entry = None  # the general path raises the error
        else:
            native = collectives.reduction(op, dtype)
            sig = signature("all_reduce", dtype.code, int(op))
            entry = None if native is None else (native[0], native[1], dtype, dtype.name, sig,
                                                 collectives.persistent.made(native[0], native[1], sig))
        plans[op][np_dtype.num] = entry
        return entry

    def claim() -> bool:
        """The group is ours for this call (then ``leave()`` must follow), or the general path's."""
        return collectives.broken is None and not profiler_on() and enter()

    def wait(req, seq=None, sig: int = 0, nbytes: int = -1, root: int = -1) -> None:
        """Test ``req`` to the group's deadline, watched as the call (``seq``, ``sig``, ``nbytes``,
        ``root``: its agreement row) that it is (the calls in C pass the first three)."""
        if not req.Test():  # the deadline is computed only for a call that has to wait
            check = closed if seq is None else watch(row(seq, sig, nbytes, root))
            wait_request(MPI, req, _monotonic() + pg.timeout.total_seconds(), None, check)

    def fail(exc, op: str, seq: int, sig: int, req, buffers, record):
        """Raise the failure of a claimed call as the general path would (``MpiCollectives.native``
        and ``ProcessGroup.run``): in the operation's words, told to the flight recorder and to
        ``diagnostics.on_fault``; a timeout inside MPI, or a member leaving, breaks the group."""
        translated = isinstance(exc, (TransportError, mpi_exception))
        if translated:
            if not isinstance(exc, TransportError):
                exc = mpi_error(MPI, exc, None, "MPI collective")
            else:
                if exc.reason == "timeout":
                    exc = TransportError(f"{exc} in MPI (MPI does not say which rank has not joined)", reason="timeout")
                if req is not None:  # a wait failed: MPI still has the request (``req``: None where
                    # MpiCollectives.checked ran the call, which gave its requests up itself)
                    collectives.give_up(f"{op} #{seq}", exc, req, buffers)
            exc = pg.channel(op, seq, sig).translate(exc, None)
        diagnostics.record_fault(pg, exc, op, seq, record)
        if translated:
            raise exc from None
        raise exc

    # -- on the tensor, before any Buffer is made ------------------------------------------------
    def small_all_reduce(tensor, op) -> bool:
        if tensor.__class__ is _ndarray:
            if not tensor.flags.carray:  # C-contiguous, aligned and writeable: one attribute
                return False
            flat = tensor if tensor.ndim == 1 else tensor.reshape(-1)
        elif "torch" in sys.modules and isinstance(tensor, sys.modules["torch"].Tensor):
            flat = tensor_flat(tensor)
            if flat is None:
                return False
        else:
            return False
        nbytes = flat.nbytes
        if op.__class__ is not RedOpType or not 0 < nbytes <= LIMIT:
            return False
        by_dtype = plans[op]
        num = flat.dtype.num
        entry = by_dtype[num] if num in by_dtype else plan(op, flat.dtype)
        # claim(), inlined (this is the path whose every call is counted); no profiler can be on
        # while torch is not loaded
        if entry is None or collectives.broken is not None or (
                "torch" in _modules and profiler_on()) or not enter():
            return False
        mtype, mop, dtype, dtype_name, sig, made = entry
        seq = next_seq()
        req = staged = record = None
        try:
            # the general path's very call (MpiCollectives.all_reduce): a kept persistent request's
            # Start on its staging array; the first of its count and signature, checked
            staged = made.get(flat.size)
            if staged is None:
                if fr.recorder is not None:
                    record = fr.recorder.started(group, seq, "all_reduce", nbytes, dtype_name, None, 3)
                mine = row(seq, sig, nbytes)
                deadline = _monotonic() + pg.timeout.total_seconds()
                if not first_all_reduce(mine, flat, mtype, mop, sig, deadline):
                    checked("all_reduce", mine, deadline, lambda: comm.Iallreduce(IN_PLACE, [flat, mtype], mop),
                            (flat,))
            else:
                staging, req, _ = staged
                staging[...] = flat
                req.Start()
                # recorded once MPI has the call: the record is made while the peers' calls meet
                # this one, not before every rank can start. The user's frame is above started,
                # this function and its caller (FastPath's: the API function, or torch's c10d
                # adapter, whose caller is torch's and the walk goes on).
                if fr.recorder is not None:
                    record = fr.recorder.started(group, seq, "all_reduce", nbytes, dtype_name, None, 3)
                if not req.Test():  # wait(), inlined
                    wait_request(MPI, req, _monotonic() + pg.timeout.total_seconds(), None,
                                 watch(row(seq, sig, nbytes)))
                flat[...] = staging
        except BaseException as exc:
            if record is None and fr.recorder is not None:  # failed before MPI had the call
                record = fr.recorder.started(group, seq, "all_reduce", nbytes, dtype_name, None, 3)
            fail(exc, "all_reduce", seq, sig, req, (flat,) if staged is None else (flat, staged[0]), record)
        finally:
            leave()
        if record is not None:
            record[T_COMPLETED], record[STATE] = now(), COMPLETED
        if op is AVG:
            finish(op, flat, size, dtype)
        return True

    def small_barrier() -> bool:
        if not claim():
            return False
        seq = next_seq()
        record = None if fr.recorder is None else fr.recorder.started(group, seq, "barrier", 0, None, None, 3)
        req = None
        try:
            req = start_barrier()  # the general path's very call (MpiCollectives.barrier)
            wait(req, seq, barrier_sig, 0)
        except BaseException as exc:
            fail(exc, "barrier", seq, barrier_sig, req, (), record)
        finally:
            leave()
        if record is not None:
            record[T_COMPLETED], record[STATE] = now(), COMPLETED
        return True

    # -- on the ProcessGroup method's Buffers ----------------------------------------------------
    sigs: dict = {}  # (op, dtype code, reduce op code, root) -> signature

    def sig_of(op: str, code: int, red: int = 0, root: int | None = None) -> int:
        key = (op, code, red, root)
        sig = sigs.get(key)
        if sig is None:
            sig = sigs[key] = signature(op, code, red, root)
        return sig

    def claim_buffers() -> bool:
        return not diagnostics.check_shapes and claim()

    def run(op: str, sig: int, described, start, buffers, size: int, root: int | None = None,
            **fields) -> None:
        """One claimed call: its sequence number, its record (of ``described``, the Buffer the
        general path describes), then ``start()`` (the MPI call) with the general path's agreement
        on its row (``size``, ``root`` and ``fields``: agreement.row's), tested to the deadline."""
        seq = next_seq()
        # the user's frame is above started, run, the path and ProcessGroup._fast (then ProcessGroup's
        # method, distcomm's own, and whoever called it: the walk goes on from there)
        record = None if fr.recorder is None else fr.recorder.started(
            group, seq, op, described.flat.nbytes, described.dtype.name, root, 4)
        details = fields.pop("details", None)
        try:
            checked(op, row(seq, sig, size, -1 if root is None else root, **fields),
                    _monotonic() + pg.timeout.total_seconds(), start, buffers, details)
        except BaseException as exc:
            fail(exc, op, seq, sig, None, buffers, record)
        finally:
            leave()
        if record is not None:
            record[T_COMPLETED], record[STATE] = now(), COMPLETED

    def small_all_gather_into_tensor(out, inp) -> bool:
        flat_out, send = out.flat, inp.flat
        count = send.size
        if not count or flat_out.nbytes > LIMIT or not claim_buffers():
            return False
        try:  # what ProcessGroup._gather_into does before MpiCollectives.all_gather
            block = flat_out[rank * count:(rank + 1) * count]
            # in place (the input is this rank's block) skips the copy; an input that overlaps the
            # block at another offset is copied (numpy copies overlapping memory correctly)
            if not np.shares_memory(block, send) or \
                    block.__array_interface__["data"][0] != send.__array_interface__["data"][0]:
                block[...] = send
            b = flat_out.reshape(-1).view(np.uint8)
        except BaseException:
            leave()
            raise
        run("all_gather_into_tensor", sig_of("all_gather_into_tensor", inp.dtype.code), inp,
            lambda: comm.Iallgather(IN_PLACE, [b, BYTE]), (flat_out,), count * send.itemsize)
        out.commit()
        return True

    def small_reduce_scatter_tensor(out, inp, op) -> bool:
        flat_out, send = out.flat, inp.flat
        n = flat_out.size
        if op.__class__ is not RedOpType or not n or send.nbytes > LIMIT or np.may_share_memory(flat_out, send):
            return False
        native = collectives.reduction(op, out.dtype)
        if native is None or not claim_buffers():
            return False
        mtype, mop = native
        send = send[: n * size]
        item = flat_out.itemsize  # the general path's splits are [n] * size (ProcessGroup.reduce_scatter_tensor)
        run("reduce_scatter_tensor", sig_of("reduce_scatter_tensor", out.dtype.code, int(op)), inp,
            lambda: comm.Ireduce_scatter_block([send, mtype], [flat_out, mtype], mop), (send, flat_out),
            send.nbytes, splits=collectives.weights().even(n),
            details=lambda: agreement.details(size, splits=[n * item] * size))
        if op is RedOpType.AVG:
            finish(op, flat_out, size, out.dtype)
        out.commit()
        return True

    def small_broadcast(buf, root) -> bool:
        flat = buf.flat
        if not flat.size or flat.nbytes > LIMIT or not claim_buffers():
            return False
        b = flat.reshape(-1).view(np.uint8)
        run("broadcast", sig_of("broadcast", buf.dtype.code, root=root), buf,
            lambda: comm.Ibcast([b, BYTE], root), (flat,), flat.nbytes, root)
        buf.commit()
        return True

    all_reduce = small_all_reduce
    if _CallsInC is not None:
        def describe(red: int, np_dtype: np.dtype):
            """What the all_reduce in C needs for ``red`` (a RedOpType's value) on ``np_dtype``: the
            signature, the dtype's name, its item size and the persistent requests made for its MPI
            datatype and op; None where small_all_reduce decides (AVG divides after, in Python)."""
            if red not in _RED_OP_VALUES or red == AVG:
                return None
            op = RedOpType(red)
            entry = plans[op][np_dtype.num] if np_dtype.num in plans[op] else plan(op, np_dtype)
            if entry is None:
                return None
            _, _, _, dtype_name, sig, made = entry
            return (sig, dtype_name, np_dtype.itemsize, made)

        all_reduce = _CallsInC(
            ndarray=_ndarray, redop=RedOpType, owner=collectives, profiler_flag=profiler_flag, executor=executor,
            leave=leave, next_seq=next_seq, recorder_module=fr, group=group, describe=describe,
            fallback=small_all_reduce, wait=wait, fail=fail, limit=LIMIT, t_completed=T_COMPLETED, state=STATE,
            completed=COMPLETED, **dict(zip(("start", "test"), library.entry_points() or ()))).all_reduce

    return FastPath(all_reduce, small_barrier, allgather_into_tensor=small_all_gather_into_tensor,
                    reduce_scatter_tensor=small_reduce_scatter_tensor, broadcast=small_broadcast)
