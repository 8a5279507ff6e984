"""The latency path's all_reduce round in C, where the round steps in C are built.

The direct all_reduce (``allreduce_direct.one_round``) is one round: write, post, wait, reduce the p
copies in rank order, consume. GroupShm's ``native`` (transport/_shm_round.c) does the whole round
in one call for the common dtypes and ops; this module chooses that call, and finishes in Python
whatever it hands back: ringing a sleeping peer, the long wait (yield, sleep, peer health, the
deadline), the mismatch error, then the reduction and the consume as the Python reference does
them. A rank taking this path and one taking ``allreduce_direct.one_round`` meet in the same rounds.
"""

from __future__ import annotations

import numpy as np

from ...transport import shm_group
from ...types import RedOpType
from . import allreduce_direct

# _shm_round.c's kinds: dtype index * 8 + op index
_DTYPES = {np.dtype(t): i for i, t in enumerate((np.float32, np.float64, np.int8, np.int16, np.int32, np.int64,
                                                 np.uint8))}
_FLOATS = 2  # the first two dtypes: no bitwise ops
_OPS = {RedOpType.SUM: 0, RedOpType.AVG: 0, RedOpType.PRODUCT: 1, RedOpType.MIN: 2, RedOpType.MAX: 3,
        RedOpType.BAND: 4, RedOpType.BOR: 5, RedOpType.BXOR: 6}  # AVG: the sum, divided after the round


def kind(op, np_dtype: np.dtype) -> int | None:
    """The C round's code for reducing ``np_dtype`` with ``op`` (a RedOpType), or None where the Python
    round must run (other dtypes: bool, float16, bfloat16's storage, complex, unsigned beyond uint8;
    PREMUL_SUM; bitwise ops on floats, which the general path rejects)."""
    t, o = _DTYPES.get(np_dtype), _OPS.get(op)
    if t is None or o is None or (t < _FLOATS and o > 3):
        return None
    return t * 8 + o


def all_reduce_in_c(ctx):
    """The direct all_reduce's round on GroupShm ``ctx`` in one C call where it can be, as a function
    ``(seq, sig, channel, flat, reduce_all, code)``: ``flat`` (C-contiguous, writable, at most a slot)
    reduced across the group with the op and dtype of ``code`` (``kind``); ``reduce_all`` is the
    Python reducer for a round handed back. None where the round steps run in Python. A closure, as
    GroupShm's own steps are: the latency path calls it on every small all_reduce."""
    if ctx.native is None:
        return None
    open_round, all_reduce = ctx.open_round, ctx.native.all_reduce
    RING_CONSUMED = shm_group.RING_CONSUMED

    def run(seq: int, sig: int, channel, flat: np.ndarray, reduce_all, code: int) -> None:
        k = open_round(seq, sig, channel)
        status = all_reduce(k, seq, sig, flat, code)
        if status & RING_CONSUMED:
            ctx.ring_consumed()
        elif status:  # posted, and the rest is Python's: a ring, the wait or the mismatch, then the reduction
            ctx.settle(status, k, seq, sig, flat.nbytes, channel)
            allreduce_direct.finish(ctx, k, flat, reduce_all)

    return run
