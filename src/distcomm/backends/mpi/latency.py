"""The MPI engine's latency path: a small synchronous all_reduce or barrier, straight to MPI.

The general path (``ProcessGroup.allreduce`` -> executor -> Channel -> ``MpiCollectives``) costs
tens of Python calls around a 3 µs MPI call; this one checks the call, claims the group
(``executor.enter_inline``), takes the sequence number and runs the same nonblocking MPI call,
tested to the group's deadline. It takes only a C-contiguous writeable numpy array or a contiguous
CPU torch tensor (not bfloat16) of at most ``LIMIT`` bytes, with a plain ReduceOp that MPI computes
natively (``native``); anything else returns False having done nothing, and the general path runs
it (or raises its error). A busy or broken group, and torch's profiler recording, go the general
way too.
"""

from __future__ import annotations

import sys
from time import monotonic as _monotonic

import numpy as np

from ...buffers import tensor_memory
from ...dtypes import from_numpy
from ...errors import DistBackendError
from ...profiling import profiling
from ...reduction import check_supported, finish
from ...signatures import signature
from ...transport.base import TransportError
from ...transport.mpi import mpi_error, wait_request
from ...types import RedOpType
from ..engine import FastPath

LIMIT = 64 * 1024  # bytes: past this the call's own cost is MPI's, and the general path adds nothing to it

_ndarray = np.ndarray
_storage: dict = {}  # torch dtype -> numpy dtype of its elements


def _torch_flat(t):
    torch = sys.modules["torch"]
    if t.layout is not torch.strided or not t.is_cpu or t.dtype is torch.bfloat16 or t.is_conj() \
            or not t.is_contiguous():
        return None
    storage = _storage.get(t.dtype)
    if storage is None:
        storage = _storage[t.dtype] = torch.empty(0, dtype=t.dtype).numpy().dtype
    return tensor_memory(t, storage)


def build(pg, collectives) -> FastPath:
    """The latency paths of process group ``pg`` over its MpiCollectives ``collectives``."""
    MPI = collectives.MPI
    comm = collectives.comm
    closed = collectives.transport.is_closed
    executor = pg.executor
    enter, leave = executor.enter_inline, executor.leave_inline
    next_seq = pg.next_seq
    size = len(pg.spec.ranks)
    IN_PLACE = MPI.IN_PLACE
    # op -> {numpy dtype number: (MPI datatype, MPI op, DType) or None}: two cheap lookups, where a
    # (op, np.dtype) key would hash a dtype object on every call
    plans: dict = {op: {} for op in RedOpType}

    def plan(op, np_dtype):
        try:
            dtype = from_numpy(np_dtype)
            check_supported(op, dtype)
        except (TypeError, ValueError, DistBackendError):
            entry = None
        else:
            native = collectives.reduction(op, dtype)
            entry = None if native is None else (native[0], native[1], dtype)
        plans[op][np_dtype.num] = entry
        return entry

    def fail(exc, op: str, seq: int, sig: int, req, buf):
        if isinstance(exc, TransportError):
            if exc.reason == "timeout":
                collectives.broken = f"{op} #{seq} timed out inside MPI"
                collectives.abandoned.append((req, (buf,)))
            raise pg.channel(op, seq, sig).translate(exc, None) from None
        raise pg.channel(op, seq, sig).translate(mpi_error(MPI, exc, None, "MPI collective"), None) from None

    def small_all_reduce(tensor, op) -> bool:
        if tensor.__class__ is _ndarray:
            flags = tensor.flags
            if not (flags.c_contiguous and flags.writeable):
                return False
            flat = tensor if tensor.ndim == 1 else tensor.reshape(-1)
        elif "torch" in sys.modules and isinstance(tensor, sys.modules["torch"].Tensor):
            flat = _torch_flat(tensor)
            if flat is None:
                return False
        else:
            return False
        if op.__class__ is not RedOpType or not 0 < flat.nbytes <= LIMIT or collectives.broken is not None:
            return False
        np_dtype = flat.dtype
        by_dtype = plans[op]
        num = np_dtype.num
        entry = by_dtype[num] if num in by_dtype else plan(op, np_dtype)
        if entry is None or profiling() is not None or not enter():
            return False
        mtype, mop, dtype = entry
        seq = next_seq()
        req = None
        try:
            req = comm.Iallreduce(IN_PLACE, [flat, mtype], mop)
            if not req.Test():  # the deadline is computed only for a call that has to wait
                wait_request(MPI, req, _monotonic() + pg.timeout.total_seconds(), None, closed)
        except (TransportError, MPI.Exception) as exc:
            fail(exc, "all_reduce", seq, signature("all_reduce", dtype.code, int(op)), req, flat)
        finally:
            leave()
        if op is RedOpType.AVG:
            finish(op, flat, size, dtype)
        return True

    def small_barrier() -> bool:
        if collectives.broken is not None or profiling() is not None or not enter():
            return False
        seq = next_seq()
        req = None
        try:
            req = comm.Ibarrier()
            if not req.Test():
                wait_request(MPI, req, _monotonic() + pg.timeout.total_seconds(), None, closed)
        except (TransportError, MPI.Exception) as exc:
            fail(exc, "barrier", seq, signature("barrier"), req, None)
        finally:
            leave()
        return True

    return FastPath(small_all_reduce, small_barrier)
