"""The latency paths: a small synchronous all_reduce (or a barrier), from the call to its result in
one function.

An 8-byte all_reduce moves nothing worth measuring; its cost is Python. The general path
(``_api/collectives.all_reduce`` → ``ProcessGroup.collective`` → ``OrderedExecutor.run`` → a
``Channel`` → ``ShmCollectives.all_reduce`` → ``allreduce_small`` → ``GroupShm``) makes about 90
Python calls, and with 4 ranks on 2 CPUs every microsecond of a rank's CPU is paid twice in wall
time: it measured about 45 µs of CPU per call and rank, 100 µs per call. This path measured about
20 µs and 40 µs (at world size 2: 7 µs per call instead of 27; docs/performance-notes.md).

It runs the round of ``shm_collectives.allreduce_small``, which stays its reference: every rank copies
its data into its slot, posts, waits for every post, reduces all p copies in rank order into its
buffer and consumes the round. A barrier is the same round without data (``shm_collectives.barrier``). What does not change from call to call is looked up once, when
the group's shared memory exists: the executor, the slots and counters, the reducer and message
signature of each (op, dtype). A wait begins by spinning (a core per rank) or yielding (more ranks
than cores) without publishing anything, so posters need not look for it; one that lasts longer
than the wait policy's spin or yield time continues in ``GroupShm.wait_posted``, which sleeps,
watches the peers' health and times out after the group's timeout (counted from there).

Each takes only an ordinary call, and leaves anything else to the general path (returning False
without having done anything), which then runs it or raises its error (for a barrier, only the
first of these applies):

* a busy group (async work queued or running), a destroyed one, broken shared memory;
* anything but a C-contiguous writeable numpy array or a contiguous CPU torch tensor (not bfloat16);
* an op other than a plain ReduceOp the dtype supports;
* an empty message, or one over the direct algorithm's limit (``ShmCollectives.direct_limit``) or a slot;
* torch's profiler recording (the general path records the call).

Once it has taken a sequence number it completes the call or raises, as the general path does:
a mismatch, a timeout or a lost peer names the operation, sequence number, rank and peer, and
marks the group's shared memory broken.
"""

from __future__ import annotations

import os
import sys
import time
from typing import NoReturn

import numpy as np

from ..dtypes import from_numpy
from ..errors import DistBackendError
from ..profiling import profiling
from ..signatures import signature
from ..reduction import check_supported, finish, sequence_reducer
from ..transport.base import TransportError
from ..transport.shm_group import AWAITING, CONSUMED, POSTED, REUSING, S_NBYTES, S_ROUND, S_SEQ, S_SIG
from ..transport.shm_wait import fence
from ..types import RedOpType
from .engine import FastPath

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
    return t.detach().numpy().reshape(-1)


def build(pg, ctx, collectives) -> FastPath:
    """The latency paths of process group ``pg``, whose shared memory is ``ctx`` (a GroupShm) and
    whose engine's collectives are ``collectives`` (ShmCollectives: thresholds and reducers)."""
    executor = pg.executor
    enter, leave = executor.enter_inline, executor.leave_inline
    next_seq = pg.next_seq
    rank, size, nslots = ctx.rank, ctx.size, ctx.nslots
    limit = min(collectives.direct_limit(size), ctx.slot_bytes)
    # GroupShm's internals, read directly: this function is its fast client (see the module doc).
    mine, my_headers, headers = ctx._mine, ctx._my_headers, ctx.headers
    peer_ctl, peers = ctx._peer_ctl, ctx._peers
    policy = ctx.transport.policy
    yields = policy.spin_s == 0  # more ranks than cores: give the CPU away while waiting
    budget = policy.yield_s if yields else policy.spin_s
    sched_yield, clock = os.sched_yield, time.perf_counter
    plans: dict = {}  # (op, numpy dtype) -> (signature, reduce_all, DType), once checked
    barrier_sig = signature("barrier")
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

    def all_posted(k: int) -> bool:
        """Spin or yield until every peer has posted round k (True), at most ``budget`` seconds."""
        end = clock() + budget
        while True:
            if yields:
                sched_yield()
            for c in peer_ctl:
                if c[POSTED] < k:
                    break
            else:
                return True
            if clock() >= end:
                return False

    # -- one round, as GroupShm's acquire, post, wait_posted and consume do it --------------------
    def open_round(seq: int, sig: int, op: str) -> int:
        """The next round's number, once every peer has read our slot's last use."""
        k = ctx.round = ctx.round + 1
        need = k - nslots
        if need > ctx._consumed_floor:
            floor = min([c[CONSUMED] for c in peer_ctl])
            if floor < need:
                ctx.acquire(k, pg.channel(op, seq, sig))
            else:
                ctx._consumed_floor = floor
        return k

    def exchange(k: int, seq: int, sig: int, n: int, op: str) -> None:
        """Post round k (our slot holds ``n`` bytes), wait until every peer has, check their headers."""
        s = k % nslots
        h = my_headers[s]  # the header, then the counter, then the wake-ups
        h[S_SEQ] = seq
        h[S_SIG] = sig
        h[S_NBYTES] = n
        h[S_ROUND] = k
        mine[POSTED] = k
        fence()
        for c in peer_ctl:
            if c[AWAITING]:  # someone asleep (rare here): let GroupShm see whom to ring
                ctx._ring_posted()
                break
        for c in peer_ctl:
            if c[POSTED] < k:
                if not all_posted(k):
                    ctx.wait_posted(k, pg.channel(op, seq, sig), n)
                break
        for q in peers:
            hq = headers[q][s]
            if hq[S_ROUND] != k or hq[S_SEQ] != seq or hq[S_SIG] != sig or hq[S_NBYTES] != n:
                raise ctx._mismatch(q, k, hq, pg.channel(op, seq, sig), n)

    def close_round(k: int) -> None:
        mine[CONSUMED] = k
        fence()
        for c in peer_ctl:
            if c[REUSING]:
                ctx._ring_consumed()
                break

    def fail(exc: BaseException, op: str, seq: int, sig: int) -> NoReturn:
        """After a failure within a round the group's shared memory is unusable: mark it, and raise
        the error (a transport's in the words of the operation, as ShmCollectives._run does)."""
        if isinstance(exc, TransportError):
            ctx.broken = str(exc)
            raise pg.channel(op, seq, sig).translate(exc, None) from None
        ctx.broken = f"{type(exc).__name__}: {exc}"
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
        try:
            k = open_round(seq, sig, "all_reduce")
            views = ctx.views(k, np_dtype, flat.size)
            views[rank][...] = flat
            exchange(k, seq, sig, n, "all_reduce")
            if rank:
                flat[...] = views[0]
            reduce_all(flat, views[1:])
            close_round(k)
            if op is RedOpType.AVG:
                finish(op, flat, size, dtype)
        except BaseException as exc:
            fail(exc, "all_reduce", seq, sig)
        finally:
            leave()
        return True

    def small_barrier() -> bool:
        if ctx.broken is not None or profiling() is not None or not enter():
            return False
        seq = next_seq()
        try:
            k = open_round(seq, barrier_sig, "barrier")
            exchange(k, seq, barrier_sig, 0, "barrier")
            close_round(k)
        except BaseException as exc:
            fail(exc, "barrier", seq, barrier_sig)
        finally:
            leave()
        return True

    return FastPath(small_all_reduce, small_barrier)
