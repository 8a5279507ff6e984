"""all_reduce "slices": a reduce-scatter by part owners, then an all-gather of the parts.

Each rank publishes the parts of a chunk that others own, reduces the part it owns from all p
copies into its next slot, then every rank copies all the results out. Round j carries the inputs
of chunk j *and* this rank's reduced part of chunk j-1, so the all-gather of one chunk shares its
synchronization with the reduce-scatter of the next: chunks + 1 rounds in all.

Cost per rank: each rank reduces only n/p (the bandwidth path between the direct algorithm's
limit and single-copy reads), at about 4.5 n bytes through memory (staging copies in and out).

``finish_part`` (AVG's division, or None) is applied to each reduced part in its slot, before the
others copy it out: no pass over the whole result afterwards.
"""

from __future__ import annotations

import numpy as np

from ...transport.base import Channel


def allreduce_slices(ctx, ch: Channel, flat: np.ndarray, red, finish_part=None) -> None:
    p, r = ctx.size, ctx.rank
    dt = flat.dtype
    item = dt.itemsize
    per = max(p, (ctx.slot_bytes // item - p) * p // (p + 1) // 16 * 16)  # inputs + a 1/p share fit a slot
    res_at = per * item  # where a slot's reduced part starts
    count, nbytes = flat.size, flat.nbytes
    chunks = -(-count // per)
    k0 = ctx.round + 1
    ctx.round += chunks + 1

    def bounds(j):
        lo = j * per
        m = min(per, count - lo)
        return lo, [m * q // p for q in range(p + 1)]

    def publish(slot, j):
        lo, b = bounds(j)
        a0, a1 = b[r], b[r + 1]
        out = slot[: b[p] * item].view(dt)
        out[:a0] = flat[lo : lo + a0]
        out[a1:] = flat[lo + a1 : lo + b[p]]

    slot = ctx.acquire(k0, ch)
    publish(slot, 0)
    ctx.post(k0, ch, nbytes)
    for j in range(chunks + 1):
        k = k0 + j
        ctx.wait_posted(k, ch, nbytes)
        if j > 0:  # every owner's reduced part of chunk j-1 (ours included) into place
            lo, b = bounds(j - 1)
            for q in range(p):
                n = b[q + 1] - b[q]
                flat[lo + b[q] : lo + b[q + 1]] = ctx.data(q, k)[res_at : res_at + n * item].view(dt)
        if j == chunks:
            ctx.consume(k)
            return
        lo, b = bounds(j)
        a0, a1 = b[r], b[r + 1]
        slot = ctx.acquire(k + 1, ch)
        res = slot[res_at : res_at + (a1 - a0) * item].view(dt)
        mine = flat[lo + a0 : lo + a1]
        res[...] = mine if r == 0 else ctx.data(0, k)[a0 * item : a1 * item].view(dt)
        for q in range(1, p):
            red(res, mine if q == r else ctx.data(q, k)[a0 * item : a1 * item].view(dt))
        if finish_part is not None:
            finish_part(res)
        ctx.consume(k)
        if j + 1 < chunks:
            publish(slot, j + 1)
        ctx.post(k + 1, ch, nbytes)
