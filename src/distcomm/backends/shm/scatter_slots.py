"""scatter through slots: each round the root writes every destination's next piece (1/p of a
slot each), and each rank copies its own out.

Cost: the root writes (p-1)/p·(p·n) bytes, each rank reads its n; one round per 1/p slot of a
rank's block.

A block of at most one piece (``piece_bytes``) is one round (``one_round``), which the latency path
runs too, reading the root's inputs from a list: separate input tensors need no staging buffer. It
carries the root check (``root_check.exchange``)."""

from __future__ import annotations

import numpy as np

from ...transport.base import Channel
from . import root_check
from .common import same_channel


def piece_bytes(slot_bytes: int, p: int) -> int:
    """The bytes of each destination's piece in one round's slot."""
    return max(64, slot_bytes // p // 64 * 64)


def one_round(ctx, seq: int, sig: int, channel, ins, out: np.ndarray, root: int) -> tuple[int, int] | None:
    """The whole scatter (``out.nbytes`` at most one piece), with its root check: ``ins[q]`` on the
    root (None elsewhere) lands in rank q's ``out``. Returns the first (peer, its root) that
    disagrees (nothing copied then), or None."""
    p, r = ctx.size, ctx.rank
    k = ctx.open_round(seq, sig, channel)
    step = piece_bytes(ctx.slot_bytes, p)
    nbytes = out.nbytes
    if r == root:
        slot = ctx.data(r, k)
        for q in range(p):
            if q != r:
                slot[q * step : q * step + nbytes].view(out.dtype)[...] = ins[q]
    disagreeing = root_check.exchange(ctx, k, seq, sig, nbytes, channel, root)
    if disagreeing is None:
        if r == root:
            out[...] = ins[r]
        else:
            out[...] = ctx.data(root, k)[r * step : r * step + nbytes].view(out.dtype)
    ctx.consume(k)
    return disagreeing


def scatter_slots(ctx, ch: Channel, ins, out: np.ndarray, root: int) -> tuple[int, int] | None:
    """``ins[q]`` on the root (contiguous arrays of ``out``'s size; None elsewhere) lands in rank
    q's ``out``. A block of one piece is ``one_round`` (its root check's result); otherwise the
    caller has checked the root."""
    p, r = ctx.size, ctx.rank
    step = piece_bytes(ctx.slot_bytes, p)
    if out.nbytes <= step:
        return one_round(ctx, ch.key.seq, ch.signature, same_channel(ch), ins, out, root)
    raw = out.view(np.uint8)
    src = None if ins is None else [x.view(np.uint8) for x in ins]
    bb = raw.size
    lo = 0
    while True:
        hi = min(lo + step, bb)
        k = ctx.next_round()
        if r == root:
            slot = ctx.acquire(k, ch)
            for q in range(p):
                if q != r:
                    slot[q * step : q * step + hi - lo] = src[q][lo:hi]
            ctx.post(k, ch, bb)
            raw[lo:hi] = src[r][lo:hi]
        else:
            ctx.wait_posted(k, ch, bb, [root])
            raw[lo:hi] = ctx.data(root, k)[r * step : r * step + hi - lo]
        ctx.consume(k)
        lo = hi
        if lo >= bb:
            return
