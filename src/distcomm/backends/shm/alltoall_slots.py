"""all_to_all through slots ("alltoall_slots"), or single copy ("alltoall_readv"), which share
their first round.

Through slots: each round carries one piece per destination, its length first (checked by the
reader against what it expects); cost per rank: (p-1)/p of its input written and of its output
read through slots, one round per 1/(p-1) slot of the longest piece; each round's share of this
rank's own piece is copied between publishing the round and waiting for the peers'. Single copy: every rank copies
what each peer sends it straight from the peer's send buffer (one system call per piece), after
the first round and before one last wait.
"""

from __future__ import annotations

import numpy as np

from ...transport import shm_direct
from ...transport.base import Channel
from .common import offsets, same_channel, split_mismatch


def slot_head(p: int) -> int:
    """Bytes before the data in an all_to_all slot: p lengths, then (round 0 only) p offsets, p
    counts, and the sender's rounds needed, single-copy vote and buffer address."""
    return (8 * (3 * p + 3) + 63) // 64 * 64


def piece_capacity(slot_bytes: int, p: int, item: int) -> int:
    """Elements of one piece a round carries: a slot holds one region per peer (p - 1; a rank's
    piece to itself never goes through its slot), so at p = 2 a round carries half the slot's
    data area more than p regions would, and a 1 MiB all_to_all fits one 1 MiB slot."""
    return max(1, (slot_bytes - slot_head(p)) // max(1, p - 1) // item)


def piece_at(writer: int, reader: int, per: int, item: int, p: int) -> int:
    """Byte offset, in ``writer``'s slot, of its piece for ``reader`` (``per`` elements a region)."""
    return slot_head(p) + (reader - (reader > writer)) * per * item


def fits(slot_bytes: int, p: int, item: int) -> bool:
    """Whether an all_to_all of ``item``-byte elements fits a slot (one element per destination)."""
    return slot_head(p) + p * item <= slot_bytes


def alltoall_slots(ctx, ch: Channel, send: np.ndarray, send_counts, recv: np.ndarray, recv_counts,
                   single_copy: bool = False) -> str:
    """all_to_all of one send and one receive buffer, split by counts (see ``alltoall_rounds``)."""
    so, ro = offsets(send_counts), offsets(recv_counts)
    p = ctx.size
    sends = [send[so[q] : so[q + 1]] for q in range(p)]
    recvs = [recv[ro[q] : ro[q + 1]] for q in range(p)]
    base = send.ctypes.data if ctx.transport.direct_reads_ok(ch.ranks) else 0
    return alltoall_rounds(ctx, ch.key.seq, ch.signature, same_channel(ch), sends, recvs, base, so, single_copy)


def alltoall_pieces(ctx, ch: Channel, sends, recvs, base: int, send_offsets, single_copy: bool = False) -> str:
    """all_to_all of separate pieces each way (lists of tensors), each written in place (see
    ``alltoall_rounds`` for ``base`` and ``send_offsets``)."""
    return alltoall_rounds(ctx, ch.key.seq, ch.signature, same_channel(ch), sends, recvs, base, send_offsets,
                           single_copy)


def alltoall_rounds(ctx, seq: int, sig: int, channel, sends, recvs, base: int, send_offsets,
                    single_copy: bool = False, first_round: int | None = None) -> str:
    """Each round, one piece per destination (its length first, checked by the reader); or, when
    any rank asks for it (``single_copy``), every rank copies what each peer sends it straight from
    the peer's send buffer. Returns which of the two ran: "alltoall_slots" or "alltoall_readv".

    ``sends[q]`` holds what this rank sends rank q and ``recvs[q]`` receives what rank q sends
    (1-D arrays of one dtype: slices of one buffer, or separate tensors, written in place);
    ``send_offsets[q]`` is where ``sends[q]`` starts, in elements from address ``base`` (what a
    single-copy reader reads; ``base`` 0 when direct reads are not allowed, so nobody reads it).
    ``channel(seq, sig)`` makes the call's Channel if a wait must sleep, or for an error. The
    caller has checked that this rank sends itself what it expects from itself.

    With uneven splits ranks send different amounts, so they can disagree on whether the message is
    large enough for single-copy reads. Round 0 therefore carries every rank's vote along with its
    offsets, counts and buffer address: all ranks see all votes and switch (or not) together.

    Slots are read and written through cached memoryviews (``ctx.raw``/``ctx.words``): a small
    all_to_all is p tiny copies each way, where numpy's per-call overhead would dominate.

    ``first_round``: round 0 is already open, written and published as here (without a vote),
    and every peer's post is in and checked: a plan run in C handed it back (latency.py); the
    call goes on from reading the tables.
    """
    p, r = ctx.size, ctx.rank
    item = recvs[r].itemsize
    per = piece_capacity(ctx.slot_bytes, p, item)
    head = slot_head(p)
    send_counts = [s.size for s in sends]
    recv_counts = [x.size for x in recvs]
    need = max(1, -(-max(send_counts + recv_counts + [0]) // per))
    # bytes views: memoryview's cast costs half of numpy's view(uint8) and a memoryview around it
    sb = [memoryview(s).cast("B") for s in sends]
    rb = [memoryview(x).cast("B") for x in recvs]
    rounds = None
    j = 0
    while True:
        lo = j * per
        own_round = False  # this round's share of our own piece already copied
        if j == 0 and first_round is not None:
            k, own_copied = first_round, False
        else:
            k = ctx.open_round(seq, sig, channel)
            words, out = ctx.words(r, k), ctx.raw(r, k)
            for q in range(p):
                n = min(per, max(0, send_counts[q] - lo))
                words[q] = n
                if q != r and n and not single_copy:  # a single-copy voter knows the pieces go unread
                    at = head + (q - (q > r)) * per * item  # piece_at(r, q, ...), inline: p per round
                    out[at : at + n * item] = sb[q][lo * item : (lo + n) * item]
            if j == 0:
                for q in range(p):
                    words[p + q] = send_offsets[q]
                    words[2 * p + q] = send_counts[q]
                words[3 * p] = need
                words[3 * p + 1] = int(single_copy)
                words[3 * p + 2] = base
            ctx.publish(k, seq, sig, 0)
            own_copied = j == 0 and single_copy and recvs[r].size == sends[r].size
            if own_copied:  # our vote makes it single copy: our own piece moves while the peers publish
                recvs[r][...] = sends[r]
            elif not single_copy:  # this round's share of our own piece moves while the peers publish
                n = min(per, max(0, recv_counts[r] - lo))
                if n:
                    rb[r][lo * item : (lo + n) * item] = sb[r][lo * item : (lo + n) * item]
                own_round = True
            ctx.collect(k, seq, sig, None, channel, [q for q in range(p) if q != r])
        if rounds is None:
            tables = [ctx.words(q, k) for q in range(p)]
            if any(t[3 * p + 1] for t in tables):
                _read_from_senders(ctx, channel(seq, sig), tables, sends[r], recvs, own_copied)
                ctx.consume(k)
                ctx.wait_consumed(k, channel(seq, sig))  # no send buffer may change before every reader is done
                return "alltoall_readv"
            rounds = max(t[3 * p] for t in tables)
        for q in range(p):
            n = min(per, max(0, recv_counts[q] - lo))
            if q == r:
                if n and not own_round:
                    rb[r][lo * item : (lo + n) * item] = sb[r][lo * item : (lo + n) * item]
                continue
            sent = ctx.words(q, k)[r]
            if sent != n:
                raise split_mismatch(channel(seq, sig), q, j * per + sent, j * per + n)
            if n:
                at = head + (r - (r > q)) * per * item  # piece_at(q, r, ...)
                rb[q][lo * item : (lo + n) * item] = ctx.raw(q, k)[at : at + n * item]
        ctx.consume(k)
        j += 1
        if j >= rounds:
            return "alltoall_slots"


def _read_from_senders(ctx, ch: Channel, tables, mine: np.ndarray, recvs, own_copied: bool = False) -> None:
    """all_to_all's single-copy path: rank q's piece for this rank, from q's send buffer (our own
    piece too unless ``own_copied``)."""
    p, r = ctx.size, ctx.rank
    item = mine.itemsize
    for q in range(p):
        n = recvs[q].size
        if q == r:
            if not own_copied:
                recvs[r][...] = mine
            continue
        t = tables[q]
        sent = int(t[2 * p + r])
        if sent != n:
            raise split_mismatch(ch, q, sent, n)
        if n:
            address = int(t[3 * p + 2]) + int(t[p + r]) * item
            shm_direct.read(ctx.transport.pid_of(ch.ranks[q]), address, recvs[q])
