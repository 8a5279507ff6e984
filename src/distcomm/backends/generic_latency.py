"""The generic engine's latency path (the TCP engine's): a small synchronous all_reduce straight to
its algorithm.

The general path of an 8-byte all_reduce (the API's Buffer, ``ProcessGroup.allreduce`` and ``run``,
the executor, the Channel, ``GenericCollectives.all_reduce``, ``select.choose``) costs several times
the transport's own send and receive. This path does what that one does, with everything that can
be looked up once per group, dtype, op and size looked up once: it checks the call, claims the group (``executor.enter_inline``),
takes the sequence number, records the call in the flight recorder, makes the call's Channel and runs
the very algorithm ``select.choose`` picks for the general path at that size, with the same reducer,
then AVG's division (``reduction.finish``, as ``with_op_arithmetic`` applies it). The messages are
therefore the general path's, key for key: a member running the same call through the general path
(asynchronously, or behind queued work) meets it.

It takes a C-contiguous, aligned, writeable numpy array, or a contiguous CPU torch tensor (not
bfloat16), of at most ``LIMIT`` bytes, with a plain ReduceOp the dtype supports; anything else, a
busy group and torch's profiler recording return False having done nothing (the general path runs
the call, or raises its error). Once it has taken a sequence number it completes the call or raises
as the general path does: the Channel's errors name the operation, sequence number, rank and peer,
and are told to the flight recorder and ``diagnostics.on_fault``.
"""

from __future__ import annotations

import sys
import time

import numpy as np

from .. import diagnostics, reduction
from .. import flight_recorder as fr
from .._algorithms import select
from ..buffers import plain_tensor_memory
from ..dtypes import from_numpy
from ..errors import DistBackendError
from ..profiling import profiler_check
from ..signatures import signature
from ..types import RedOpType
from .engine import FastPath

#: bytes: past this an all_reduce's own cost is its transfer, and the general path adds little to it
LIMIT = 64 * 1024

_ndarray = np.ndarray


def build(pg, collectives) -> FastPath:
    """The latency path of process group ``pg`` (of two or more members) over GenericCollectives
    ``collectives``."""
    executor = pg.executor
    enter, leave = executor.enter_inline, executor.leave_inline
    next_seq, channel = pg.next_seq, pg.channel
    size = pg.size()
    tuning = collectives.tuning
    profiler_on = profiler_check()
    group, COMPLETED, STATE, T_COMPLETED, now = pg.group_name, fr.COMPLETED, fr.STATE, fr.T_COMPLETED, time.time
    # op -> {numpy dtype number: (DType, reducer, signature) or None}, once checked
    plans: dict = {op: {} for op in RedOpType}
    algorithms: dict = {}  # message bytes -> select.choose's all_reduce for them

    def plan(op, np_dtype):
        try:
            dtype = from_numpy(np_dtype)
            reduction.check_supported(op, dtype)
            entry = (dtype, reduction.reducer(op, dtype), signature("all_reduce", dtype.code, int(op)))
        except (TypeError, ValueError, DistBackendError):
            entry = None  # the general path raises the error
        plans[op][np_dtype.num] = entry
        return entry

    def small_all_reduce(tensor, op) -> bool:
        if tensor.__class__ is _ndarray:
            if not tensor.flags.carray:
                return False
            flat = tensor if tensor.ndim == 1 else tensor.reshape(-1)
        elif "torch" in sys.modules and isinstance(tensor, sys.modules["torch"].Tensor):
            flat = plain_tensor_memory(tensor)
            if flat is None:
                return False
        else:
            return False
        nbytes = flat.nbytes
        if op.__class__ is not RedOpType or not 0 < nbytes <= LIMIT:
            return False
        entry = plans[op].get(flat.dtype.num) or plan(op, flat.dtype)
        if entry is None or ("torch" in sys.modules and profiler_on()) or not enter():
            return False
        dtype, reduce, sig = entry
        algorithm = algorithms.get(nbytes)
        if algorithm is None:
            algorithm = algorithms[nbytes] = select.choose("allreduce", nbytes, size, tuning)
        seq = next_seq()
        # the user's frame is above started, this function and its caller (the API function)
        record = None if fr.recorder is None else fr.recorder.started(group, seq, "all_reduce", nbytes, dtype.name,
                                                                      None, 3)
        try:
            algorithm(channel("all_reduce", seq, sig), flat, reduce)
        except BaseException as exc:
            try:
                diagnostics.record_fault(pg, exc, "all_reduce", seq, record)
            finally:
                pg.give_up(seq, exc)  # the group is unusable here now, and its members are told
            raise
        finally:
            leave()
        if record is not None:
            record[T_COMPLETED], record[STATE] = now(), COMPLETED
        if op is RedOpType.AVG:
            reduction.finish(op, flat, size, dtype)
        return True

    return FastPath(small_all_reduce, None)
