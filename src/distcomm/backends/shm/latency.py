"""The latency paths: a small synchronous all_reduce (or a barrier), from the call to its result in
one function.

An 8-byte all_reduce moves nothing worth measuring; its cost is Python. The general path
(``_api/collectives.all_reduce`` → ``ProcessGroup.collective`` → ``OrderedExecutor.run`` → a
``Channel`` → ``ShmCollectives.all_reduce`` → ``allreduce_direct`` → ``GroupShm``) makes about 90
Python calls, and with 4 ranks on 2 CPUs every microsecond of a rank's CPU is paid twice in wall
time (docs/performance-notes.md). This path skips everything but the round.

It runs the very round of the general path: ``allreduce_direct.one_round`` (every rank copies its
data into its slot, posts, waits for every post, reduces all p copies in rank order into its
buffer and consumes the round) and the three steps of ``barrier_slots.one_round`` (the same without data), over
GroupShm's round API; the Channel they would need to sleep is made only then
(``ProcessGroup.channel``). What does not change from call to call is looked up once, when the
group's shared memory exists: the executor, the reducer and message signature of each (op, dtype).

Each takes only an ordinary call, and leaves anything else to the general path (returning False
without having done anything), which then runs it or raises its error (for a barrier, only the
first of these applies):

* a busy group (async work queued or running), a destroyed one, broken shared memory;
* anything but a C-contiguous writeable numpy array or a contiguous CPU torch tensor (not bfloat16);
* an op other than a plain ReduceOp the dtype supports;
* an empty message, or one over ``choose.latency_limit`` (the direct algorithm's limit, or a slot);
* torch's profiler recording (the general path records the call).

Once it has taken a sequence number it completes the call or raises, as the general path does:
a mismatch, a timeout or a lost peer names the operation, sequence number, rank and peer, and
marks the group's shared memory broken. Each call it takes is reported to the observer
(observe.py) as "latency_all_reduce" or "latency_barrier".
"""

from __future__ import annotations

import sys
import time
from functools import partial
from typing import NoReturn

import numpy as np

from ... import diagnostics
from ... import flight_recorder as fr
from ...buffers import tensor_memory
from ...dtypes import from_numpy
from ...errors import DistBackendError, DistError
from ...profiling import profiling
from ...reduction import check_supported, finish, sequence_reducer
from ...signatures import signature
from ...transport.base import TransportError
from ...types import RedOpType
from ..engine import FastPath
from . import allreduce_direct, observe

_ndarray = np.ndarray


def _torch_flat(t) -> np.ndarray | None:
    """A plain CPU torch tensor's memory as a flat numpy array (shared, not copied), else None."""
    torch = sys.modules["torch"]
    if (
        t.layout is not torch.strided
        or not t.is_cpu
        or t.dtype is torch.bfloat16
        or t.is_conj()
        or not t.is_contiguous()
    ):
        return None
    # not Tensor.numpy(), which would make the tensor's storage non-resizable (see tensor_memory)
    storage = _STORAGE.get(t.dtype)
    return tensor_memory(t, storage if storage is not None else _storage_of(t.dtype))


_STORAGE: dict = {}  # torch dtype -> numpy dtype of its elements, learnt once per dtype


def _storage_of(dtype) -> np.dtype:
    torch = sys.modules["torch"]
    _STORAGE[dtype] = storage = torch.empty(0, dtype=dtype).numpy().dtype  # an empty scratch tensor
    return storage


def build(pg, ctx, limit: int) -> FastPath:
    """The latency paths of process group ``pg``, whose shared memory is ``ctx`` (a GroupShm), for
    all_reduces of at most ``limit`` bytes."""
    executor = pg.executor
    enter, leave = executor.enter_inline, executor.leave_inline
    next_seq = pg.next_seq
    size = ctx.size
    all_reduce_round = allreduce_direct.one_round
    open_round, exchange, consume = ctx.open_round, ctx.exchange, ctx.consume
    all_reduce_channel, barrier_channel = partial(pg.channel, "all_reduce"), partial(pg.channel, "barrier")
    plans: dict = {}  # (op, numpy dtype) -> (signature, reduce_all, DType), once checked
    barrier_sig = signature("barrier")
    # for the flight recorder: its fields and states, and the clock, bound once
    group, STARTED, COMPLETED, STATE, T_COMPLETED, now = (pg.group_name, fr.STARTED, fr.COMPLETED, fr.STATE,
                                                          fr.T_COMPLETED, time.time)
    # The last torch tensor taken, its data pointer and its memory as numpy: a loop that reduces
    # the same tensor call after call skips the conversion (2.5 µs; the check costs 0.35). It keeps
    # that one small tensor alive until another takes its place. One tuple, read and replaced
    # whole: threads sharing the group never pair one tensor with another's view.
    last_tensor: list = [(None, 0, None)]

    def tensor_flat(t) -> np.ndarray | None:
        known, address, flat = last_tensor[0]
        if t is known and t.data_ptr() == address and t.numel() == flat.size and t.is_contiguous():
            return flat
        flat = _torch_flat(t)
        if flat is not None and flat.nbytes <= limit:
            last_tensor[0] = (t, t.data_ptr(), flat)
        return flat

    def plan(op, np_dtype):
        try:
            dtype = from_numpy(np_dtype)
            check_supported(op, dtype)
        except (TypeError, ValueError, DistBackendError):
            return None  # the general path raises the error
        entry = (signature("all_reduce", dtype.code, int(op)), sequence_reducer(op, dtype), dtype)
        plans[(op, np_dtype)] = entry
        return entry

    def fail(exc: BaseException, op: str, seq: int, sig: int, entry: list | None) -> NoReturn:
        """After a failure within a round the group's shared memory is unusable: mark it, and raise
        the error (a transport's in the words of the operation, as ShmCollectives does), told to the
        flight recorder and the other ranks as the general path tells its errors."""
        translated = isinstance(exc, TransportError)
        if translated:
            ctx.broken = str(exc)
            exc = pg.channel(op, seq, sig).translate(exc, None)
        else:
            ctx.broken = f"{type(exc).__name__}: {exc}"
        if entry is not None:
            fr.fail(entry, exc)
        if isinstance(exc, DistError):
            diagnostics.on_fault(pg, exc, op, seq)
        if translated:
            raise exc from None
        raise exc

    # -- the calls ------------------------------------------------------------------------------
    def small_all_reduce(tensor, op) -> bool:
        if tensor.__class__ is _ndarray:
            flags = tensor.flags
            if not (flags.c_contiguous and flags.writeable):
                return False
            flat = tensor.reshape(-1)
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
        entry = plans.get((op, np_dtype)) or plan(op, np_dtype)
        if entry is None or profiling() is not None or not enter():
            return False
        sig, reduce_all, dtype = entry
        seq = next_seq()
        # call site depth 3: this function's caller (the API function) and up
        record = None if fr.recorder is None else fr.recorder.record(group, seq, "all_reduce", n, dtype.name, None,
                                                                     STARTED, None, 3)
        try:
            observe.current is None or observe.current("latency_all_reduce")  # one check when unobserved
            all_reduce_round(ctx, seq, sig, all_reduce_channel, flat, reduce_all)
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
        if ctx.broken is not None or profiling() is not None or not enter():
            return False
        seq = next_seq()
        record = None if fr.recorder is None else fr.recorder.record(group, seq, "barrier", 0, None, None, STARTED,
                                                                     None, 3)
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

    return FastPath(small_all_reduce, small_barrier)
