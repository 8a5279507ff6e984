"""all_to_all through slots ("alltoall_slots"), or single copy ("alltoall_readv"), which share
their first round.

Through slots: each round carries one piece per destination, its length first (checked by the
reader against what it expects); cost per rank: (p-1)/p of its input written and of its output
read through slots, one round per 1/p slot of the longest piece. Single copy: every rank copies
what each peer sends it straight from the peer's send buffer (one system call per piece), after
the first round and before one last wait.
"""

from __future__ import annotations

import numpy as np

from ...transport import shm_direct
from ...transport.base import Channel
from .common import offsets, split_mismatch


def slot_head(p: int) -> int:
    """Bytes before the data in an all_to_all slot: p lengths, then (round 0 only) p offsets, p
    counts, and the sender's rounds needed, single-copy vote and buffer address."""
    return (8 * (3 * p + 3) + 63) // 64 * 64


def fits(slot_bytes: int, p: int, item: int) -> bool:
    """Whether an all_to_all of ``item``-byte elements fits a slot (one element per destination)."""
    return slot_head(p) + p * item <= slot_bytes


def alltoall_slots(ctx, ch: Channel, send: np.ndarray, send_counts, recv: np.ndarray, recv_counts,
                   single_copy: bool = False) -> str:
    """Each round, one piece per destination (its length first, checked by the reader); or, when
    any rank asks for it (``single_copy``), every rank copies what each peer sends it straight from
    the peer's send buffer. Returns which of the two ran: "alltoall_slots" or "alltoall_readv".

    With uneven splits ranks send different amounts, so they can disagree on whether the message is
    large enough for single-copy reads. Round 0 therefore carries every rank's vote along with its
    offsets, counts and buffer address: all ranks see all votes and switch (or not) together.

    Slots are read and written through cached memoryviews (``ctx.raw``/``ctx.words``): a small
    all_to_all is p tiny copies each way, where numpy's per-call overhead would dominate.
    """
    p, r = ctx.size, ctx.rank
    item = send.itemsize
    head = slot_head(p)
    per = max(1, (ctx.slot_bytes - head) // p // item)
    so, ro = offsets(send_counts), offsets(recv_counts)
    need = max(1, -(-max(list(send_counts) + list(recv_counts) + [0]) // per))
    sb = memoryview(send.view(np.uint8))
    rb = memoryview(recv.view(np.uint8))
    rounds = None
    j = 0
    while True:
        lo = j * per
        k = ctx.next_round()
        ctx.acquire(k, ch)
        words, out = ctx.words(r, k), ctx.raw(r, k)
        for q in range(p):
            n = min(per, max(0, send_counts[q] - lo))
            words[q] = n
            if q != r and n and not single_copy:  # a single-copy voter knows the pieces go unread
                at = head + q * per * item
                src = (so[q] + lo) * item
                out[at : at + n * item] = sb[src : src + n * item]
        if j == 0:
            for q in range(p):
                words[p + q] = so[q]
                words[2 * p + q] = send_counts[q]
            words[3 * p] = need
            words[3 * p + 1] = int(single_copy)
            # The address is only read by single-copy readers, which need direct reads allowed
            # (the same answer on every rank): skip computing it otherwise.
            words[3 * p + 2] = send.ctypes.data if ctx.transport.direct_reads_ok(ch.ranks) else 0
        ctx.post(k, ch, 0)
        ctx.wait_posted(k, ch, None)
        if rounds is None:
            tables = [ctx.words(q, k) for q in range(p)]
            if any(t[3 * p + 1] for t in tables):
                _read_from_senders(ctx, ch, tables, send, so[r], recv, ro, recv_counts)
                ctx.consume(k)
                ctx.wait_consumed(k, ch)  # no send buffer may change before every reader is done
                return "alltoall_readv"
            rounds = max(t[3 * p] for t in tables)
        for q in range(p):
            n = min(per, max(0, recv_counts[q] - lo))
            if q == r:
                if n:
                    dst, src = (ro[r] + lo) * item, (so[r] + lo) * item
                    rb[dst : dst + n * item] = sb[src : src + n * item]
                continue
            sent = ctx.words(q, k)[r]
            if sent != n:
                raise split_mismatch(ch, q, j * per + sent, j * per + n)
            if n:
                dst, at = (ro[q] + lo) * item, head + r * per * item
                rb[dst : dst + n * item] = ctx.raw(q, k)[at : at + n * item]
        ctx.consume(k)
        j += 1
        if j >= rounds:
            return "alltoall_slots"


def _read_from_senders(ctx, ch: Channel, tables, send, my_offset: int, recv, ro, recv_counts) -> None:
    """all_to_all's single-copy path: rank q's piece for this rank, from q's send buffer."""
    p, r = ctx.size, ctx.rank
    item = send.itemsize
    for q in range(p):
        n = recv_counts[q]
        if q == r:
            recv[ro[r] : ro[r] + n] = send[my_offset : my_offset + n]
            continue
        t = tables[q]
        sent = int(t[2 * p + r])
        if sent != n:
            raise split_mismatch(ch, q, sent, n)
        if n:
            address = int(t[3 * p + 2]) + int(t[p + r]) * item
            shm_direct.read(ctx.transport.pid_of(ch.ranks[q]), address, recv[ro[q] : ro[q] + n])
