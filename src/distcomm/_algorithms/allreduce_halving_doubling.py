"""Halving-doubling all_reduce (Rabenseifner): a reduce-scatter by recursive vector halving, then an
all-gather by recursive vector doubling (Gloo's allreduce_halving_doubling; Thakur et al. 2005).

Among p2 (a power of two) ranks with virtual rank v, the buffer is cut into p2 blocks. Reduce-
scatter: with distance d = p2/2, p2/4, ..., 1 each rank exchanges with v XOR d, sends the half of
its current block range that the partner keeps and reduces the half it keeps; after log2(p2) rounds
rank v holds reduced block v. All-gather: the same exchanges in reverse order, each rank sending the
range it holds and receiving the partner's (adjacent) range straight into place. Non-powers of two
fold in and out as in recursive doubling (``_blocks.Fold``).

Cost: 2·log2(p2) rounds (+2 when p is not a power of two); 2(p2-1)/p2 · n bytes sent per rank and
(p2-1)/p2 · n reduced (+2n moved on folded ranks). The bandwidth of the ring with logarithmic
latency: select.py uses it for large messages on power-of-two groups; on other sizes the fold's
whole-buffer messages make the ring the better choice. Two ranks with large messages use
``allreduce_ring_pipelined`` (the same exchange cut into segments, reduction overlapping transfer).
The all-gather's receives are posted with each reduce-scatter exchange's, so a peer that gets
there first sends into place rather than into a transport buffer copied again; and exchanges of
``ready_exchange_bytes`` or more send their data only after the peer's zero-byte "receives posted"
token (``_blocks.send_when_ready``), so no large message of the call arrives unexpected.

Every block is reduced on one rank only and then copied, so all ranks end bit-identical.
"""

from __future__ import annotations

import numpy as np

from ..transport.base import Channel
from ._blocks import (
    Fold, Reducer, even_counts, offsets, post_ready_token, scratch, send_when_ready, uses_scratch, wants_ready,
)


@uses_scratch
def allreduce_halving_doubling(ch: Channel, buf: np.ndarray, reduce: Reducer) -> None:
    """Reduce ``buf`` across the group in place; every rank ends with the same result."""
    p, r = ch.size, ch.rank
    if p == 1:
        return
    fold = Fold(r, p)
    if fold.vrank is None:
        ch.send(r + 1, buf)
        ch.recv(r + 1, buf)
        return
    bounds = offsets(even_counts(buf.size, fold.p2))
    if fold.has_spectator(r):
        tmp = scratch(buf.size, buf.dtype)
        ch.recv(r - 1, tmp)
        reduce(buf, tmp)
    else:
        tmp = scratch(bounds[fold.p2 // 2], buf.dtype)  # the largest half (leading blocks are larger)
    v = fold.vrank
    lo, hi = 0, fold.p2  # the block range this rank is responsible for
    steps = []
    d = fold.p2 // 2
    while d >= 1:
        peer = fold.real(v ^ d)
        mid = (lo + hi) // 2
        keep, give = ((lo, mid), (mid, hi)) if v & d == 0 else ((mid, hi), (lo, mid))
        k0, k1 = bounds[keep[0]], bounds[keep[1]]
        incoming = tmp[: k1 - k0]
        outgoing = buf[bounds[give[0]] : bounds[give[1]]]
        # The all-gather's receive from this peer is posted with this exchange's, into the range
        # this rank sends now: the peer sends it only after receiving all of that range, so the
        # bytes have left it by then; a peer that reaches the all-gather first then lands its bytes
        # in place instead of in a buffer the transport allocates and copies from (measured on the
        # tcp engine, 2 ranks, 64 MiB: 32 MiB arrived that way in most calls).
        if wants_ready(incoming.nbytes):  # and this exchange's data only once both are posted
            token = post_ready_token(ch, peer)
            recv = ch.irecv(peer, incoming)
            gather = ch.irecv(peer, outgoing)
            send = send_when_ready(ch, peer, token, outgoing)
        else:
            recv = ch.irecv(peer, incoming)
            gather = ch.irecv(peer, outgoing)
            send = ch.isend(peer, outgoing)
        recv.wait()
        send.wait()
        reduce(buf[k0:k1], incoming)
        steps.append((peer, keep, gather))
        lo, hi = keep
        d //= 2
    for peer, keep, gather in reversed(steps):
        send = ch.isend(peer, buf[bounds[keep[0]] : bounds[keep[1]]])
        gather.wait()
        send.wait()
    if fold.has_spectator(r):
        ch.send(r - 1, buf)
