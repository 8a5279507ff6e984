"""all_reduce of a list of arrays, in place ("pieces readv", where process_vm_readv is allowed):
``allreduce_readv`` over the concatenation of the pieces, without ever making it.

Each rank publishes its pieces' addresses in its slot of the first round (the only slot used).
A rank reduces its slice of the concatenation, in rank order, reading the peers' copies of it
straight from their pieces, and writes the result into its own pieces; then it copies every other
slice's result straight from its owner's pieces into its own. Every rank's pieces must have the
same sizes in the same order (all_reduce_coalesced's rule); a different number of pieces is
caught, different sizes of the same total are not.

Cost per rank: allreduce_readv's, about 2.5 n bytes through memory, without the copy of the pieces
into one buffer before and out of it after (2 n bytes each: what the default
``all_reduce_coalesced`` does). A chunk of the slice that spans pieces is gathered into a
chunk-sized scratch buffer, reduced there and scattered back: copies in cache. As in
allreduce_readv, a peer's finished chunk is fetched as soon as it is posted (``posted`` of round
k0 + 1 + j says "chunk j of my slice is final"), and a last wait keeps every rank's pieces
unchanged until the peers have read them. ``finish_part`` (AVG's division, or None) is applied to
each reduced chunk before it is published. At two ranks, with an op that ``commutes``, rank 1
folds rank 0's copy into its own piece in place (allreduce_readv's swap) where a chunk lies within
one piece.
"""

from __future__ import annotations

from bisect import bisect_right

import numpy as np

from ...errors import DistBackendError
from ...transport import shm_direct
from ...transport.base import Channel
from .common import chunked_slices, fetch_finished, fetch_rest


def table_fits(pieces: int, slot_bytes: int) -> bool:
    """Whether the addresses of ``pieces`` arrays fit the slot that publishes them."""
    return 8 * (pieces + 1) <= slot_bytes


def allreduce_pieces_readv(ctx, ch: Channel, pieces: list, red, finish_part=None, commutes: bool = False) -> None:
    p, r = ctx.size, ctx.rank
    dt = pieces[0].dtype
    item = dt.itemsize
    starts = [0]
    for x in pieces:
        starts.append(starts[-1] + x.size)
    count = starts[-1]
    nbytes = count * item
    k0, edges, per, chunks = chunked_slices(ctx, count, item)
    pids = [ctx.transport.pid_of(g) for g in ctx.ranks]
    read = shm_direct.read
    slot = ctx.acquire(k0, ch)
    words = len(pieces) + 1
    table = slot[: 8 * words].view(np.uint64)
    table[0] = len(pieces)
    table[1:] = [x.ctypes.data for x in pieces]
    ctx.post(k0, ch, nbytes)
    ctx.wait_posted(k0, ch, nbytes)
    addrs = []
    for q in range(p):
        theirs = ctx.data(q, k0)[: 8 * words].view(np.uint64)
        if int(theirs[0]) != len(pieces):
            raise DistBackendError(
                f"{ch.op} (sequence number {ch.key.seq}) on rank {ch.rank}: rank {q} of the group passed "
                f"{int(theirs[0])} tensors and this rank {len(pieces)} of the same total size; every rank must "
                "pass tensors of the same sizes in the same order")
        addrs.append([int(a) for a in theirs[1:]])
    swap = commutes and p == 2  # rank 1 folds rank 0's copy into its own piece, as rank 0 does
    acc = np.empty(min(per, max(edges[q + 1] - edges[q] for q in range(p))), dt)
    tmp = np.empty_like(acc)

    def segments(lo: int, hi: int) -> list:
        """(piece, first, end) of the pieces' elements covering [lo, hi) of the concatenation."""
        out = []
        i = bisect_right(starts, lo) - 1
        while lo < hi:
            end = min(starts[i + 1], hi)
            if end > lo:
                out.append((i, lo - starts[i], end - starts[i]))
                lo = end
            i += 1
        return out

    def read_into(q: int, segs: list, dest: np.ndarray) -> None:
        """Member q's elements ``segs`` into the contiguous ``dest``."""
        at = 0
        for i, a, b in segs:
            read(pids[q], addrs[q][i] + a * item, dest[at : at + b - a])
            at += b - a

    def gather(segs: list, dest: np.ndarray) -> None:
        at = 0
        for i, a, b in segs:
            dest[at : at + b - a] = pieces[i][a:b]
            at += b - a

    def scatter(src: np.ndarray, segs: list) -> None:
        at = 0
        for i, a, b in segs:
            pieces[i][a:b] = src[at : at + b - a]
            at += b - a

    copied = [chunks if q == r else 0 for q in range(p)]  # peers' final chunks copied so far

    def fetch(q: int) -> None:
        j = copied[q]
        lo = edges[q] + j * per
        hi = min(lo + per, edges[q + 1])
        for i, a, b in segments(lo, hi):  # straight into our pieces: no scratch
            read(pids[q], addrs[q][i] + a * item, pieces[i][a:b])
        copied[q] = j + 1

    for j in range(chunks):
        lo = edges[r] + j * per
        hi = min(lo + per, edges[r + 1])
        if hi > lo:  # my slice's chunk j, reduced in rank order
            segs = segments(lo, hi)
            m = hi - lo
            t = tmp[:m]
            # within one piece, the piece itself is "mine" (rank 0 reduces into it in place);
            # across pieces, a gathered copy
            mine = pieces[segs[0][0]][segs[0][1] : segs[0][2]] if len(segs) == 1 else None
            if swap and r == 1 and mine is not None:  # mine ⊕= the peer's: the bits of the peer's ⊕ mine
                read_into(0, segs, t)
                red(mine, t)
                a = mine
            else:
                a = mine if r == 0 and mine is not None else acc[:m]
                for q in range(p):
                    if q == 0:
                        if r != 0:
                            read_into(0, segs, a)
                        elif a is not mine:
                            gather(segs, a)
                    elif q == r:
                        if mine is None:
                            gather(segs, t)
                        red(a, t if mine is None else mine)
                    else:
                        read_into(q, segs, t)
                        red(a, t)
            if finish_part is not None:
                finish_part(a)
            if a is not mine:
                if mine is not None:
                    mine[...] = a
                else:
                    scatter(a, segs)
        ctx.advance(k0 + 1 + j, wake=j == chunks - 1)
        fetch_finished(ctx, k0, copied, chunks, fetch)  # whatever the peers have finished meanwhile
    fetch_rest(ctx, ch, k0, copied, chunks, fetch)
