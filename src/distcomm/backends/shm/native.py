"""The latency path's all_reduce and barrier rounds in C (``_native.c``), where that module is built.

One Python round of shared memory (open, write, post, wait, read, consume: GroupShm's steps) costs
about 50 Python calls; ``_native.Rounds.run`` does the same steps over the same memory in one call,
for the common case where every peer posts within the wait policy's poll budget. Everything else
stays in Python and runs here: numbering the round and waiting for slot reuse (``open_round``,
before the C call), and after it, whatever it reports: ringing a sleeping peer, the long wait
(yield, sleep, peer health, the deadline), the mismatch error, and then the rest of the round as
the Python reference does it. A rank taking this path and one taking the Python steps
(``allreduce_direct.one_round``, the barrier's ``exchange``) meet in the same rounds.

Built by ``pip install`` where a C compiler and Python's headers are present (``setup.py``: an
optional extension); ``DISTCOMM_SHM_NATIVE=0`` turns it off. ``UNAVAILABLE`` says why it is not in
use, or is None.
"""

from __future__ import annotations

import numpy as np

from ...types import RedOpType
from . import allreduce_direct

try:
    from . import _native
except ImportError as exc:  # not built here: the Python rounds run instead
    _native = None
    UNAVAILABLE: str | None = f"the C round is not built ({exc}); reinstall with a C compiler and Python's headers"
else:
    UNAVAILABLE = None

# _native.c's kinds: dtype index * 8 + op index
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


class NativeRounds:
    """One group's rounds in C: ``all_reduce`` and ``barrier``, each a whole round on GroupShm ``ctx``
    (the same round as ``allreduce_direct.one_round`` and the barrier's open/exchange/consume)."""

    def __init__(self, ctx, policy):
        yields = policy.spin_s == 0  # more ranks than cores: yield while polling, as GroupShm does
        budget = policy.yield_s if yields else policy.spin_s
        self._run = _native.Rounds(**ctx.native_layout(), budget_ns=int(budget * 1e9), yields=yields).run
        self._ctx = ctx
        self._open_round = ctx.open_round

    def all_reduce(self, seq: int, sig: int, channel, flat: np.ndarray, reduce_all, code: int) -> None:
        """``flat`` (C-contiguous, writable, at most a slot) reduced across the group with the op and
        dtype of ``code`` (``kind``); ``reduce_all`` is the Python reducer for the rest of a round the
        C call hands back."""
        k = self._open_round(seq, sig, channel)
        status = self._run(k, seq, sig, flat, code)
        if status:
            self._settle(status, k, seq, sig, channel, flat.nbytes)
            if status & _native.PENDING:
                allreduce_direct.finish(self._ctx, k, flat, reduce_all)

    def barrier(self, seq: int, sig: int, channel) -> None:
        k = self._open_round(seq, sig, channel)
        status = self._run(k, seq, sig, None, 0)
        if status:
            self._settle(status, k, seq, sig, channel, 0)
            if status & _native.PENDING:
                self._ctx.consume(k)

    def _settle(self, status: int, k: int, seq: int, sig: int, channel, nbytes: int) -> None:
        """What the C call handed back: a ring it left to Python, the wait past its budget, or a
        header that is not ours (``await_posts`` raises the mismatch naming the peer)."""
        ctx = self._ctx
        if status & _native.RING_POSTED:
            ctx.ring_posted()
        if status & (_native.PENDING | _native.MISMATCH):
            # PENDING without a ring: the C call polled for the whole budget already
            ctx.await_posts(k, seq, sig, nbytes, channel, not status & _native.RING_POSTED)
            if status & _native.MISMATCH:  # pragma: no cover - await_posts raised
                raise AssertionError("a mismatch the Python check did not see")
        elif status & _native.RING_CONSUMED:
            ctx.ring_consumed()


def completed_in_c() -> int:
    """How many rounds this process has completed in C (0 where the C round is not built)."""
    return 0 if _native is None else _native.completed()


def rounds_for(ctx, policy, enabled: bool) -> NativeRounds | None:
    """The C rounds of GroupShm ``ctx`` (None where not built or not ``enabled``)."""
    if _native is None or not enabled:
        return None
    return NativeRounds(ctx, policy)
