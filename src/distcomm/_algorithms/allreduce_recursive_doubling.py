"""Recursive-doubling all_reduce: log2(p) rounds of whole-buffer exchange between partners
rank XOR 1, 2, 4, ... (Thakur, Rabenseifner & Gropp 2005), each round combining both halves.

Non-powers of two fold in and out (see ``_blocks.Fold``): with p = p2 + extra, the first 2·extra
ranks pair up, each even one hands its buffer to the next odd one before the exchanges and gets the
result back after them.

Cost: log2(p2) rounds (+2 when p is not a power of two); log2(p2) · n bytes sent and
reduced per rank (+n on the folded ranks). Fewest rounds of any all_reduce, but every round moves
the whole buffer, so select.py uses it for small messages (≤ ~64 KiB), where the per-message
latency α dominates n·β.

Determinism: both partners of an exchange compute (lower virtual rank's value) ⊕ (higher's), with
the operands in that order, so they hold bit-identical values after every round even for
operations that are only commutative up to NaN payloads. The result may land in the scratch buffer;
the buffers are swapped instead of copied, with one copy back at the end when needed.
"""

from __future__ import annotations

import numpy as np

from ..transport.base import Channel
from ._blocks import Fold, Reducer, scratch, uses_scratch


@uses_scratch
def allreduce_recursive_doubling(ch: Channel, buf: np.ndarray, reduce: Reducer) -> None:
    """Reduce ``buf`` across the group in place; every rank ends with the same result."""
    p, r = ch.size, ch.rank
    if p == 2:  # one exchange; the general code below does the same with more bookkeeping
        other = scratch(buf.size, buf.dtype)
        ch.sendrecv(1 - r, buf, 1 - r, other)
        if r == 0:
            reduce(buf, other)  # lower rank's value first
        else:
            reduce(other, buf)
            buf[...] = other
        return
    if p == 1:
        return
    fold = Fold(r, p)
    if fold.vrank is None:  # an even rank of a folded pair: hand over, wait for the result
        ch.send(r + 1, buf)
        ch.recv(r + 1, buf)
        return
    cur, other = buf, scratch(buf.size, buf.dtype)
    if fold.has_spectator(r):
        ch.recv(r - 1, other)
        reduce(other, cur)  # lower rank's value first
        cur, other = other, cur
    v = fold.vrank
    mask = 1
    while mask < fold.p2:
        partner = v ^ mask
        ch.sendrecv(fold.real(partner), cur, fold.real(partner), other)
        if partner < v:
            reduce(other, cur)
            cur, other = other, cur
        else:
            reduce(cur, other)
        mask <<= 1
    if fold.has_spectator(r):
        ch.send(r - 1, cur)
    if cur is not buf:
        buf[...] = cur
