"""A one-round collective as a plan of copies, run in one C call where the round steps in C are built.

Every small collective of the latency paths is one round of a slots algorithm (broadcast_slots,
reduce_direct, gather_slots, scatter_slots, reduce_scatter_slots: their ``one_round``): copy some
bytes into this member's slot, post the round (its byte count and extra word), wait for every
peer's post and check the headers (a rooted collective also compares every peer's extra word, its
root: root_check.py), copy bytes out of the peers' slots (or fold them, for a reduction), consume.
A plan says which bytes:

* ``writes``: ``(src, src_offset, slot_offset, n)``: n bytes of buffer ``src`` into this member's slot;
* ``reads``: ``(src, src_offset, dst, dst_offset, n)``: n bytes into buffer ``dst``, from member
  ``src``'s slot when ``src`` is an int, else from buffer ``src``; with a reduction ``kind``
  (native.kind) they fold into one destination: the first read copies, each later one reduces
  into it, in the order given (rank order, as the Python algorithms reduce).

``GroupShm.native.move`` (transport/_shm_round.c) runs the whole round. When it hands the round back
(a peer to ring, a wait past the poll, a mismatch, a root that differs), ``finish`` does the rest in
Python, as the algorithm's ``one_round`` would, from the same plan (all_to_all, whose first round
may turn out to need more rounds or single copies, resumes its algorithm instead). The bytes in the slots and the
headers are exactly the ``one_round``'s, so a member running that (the general path, or a rank
without C) meets a member running the plan in the same round: tests/test_round_plan.py runs them
against each other.
"""

from __future__ import annotations

import numpy as np

from ...transport import shm_group


#: address(buffer): where a C-contiguous buffer's bytes start (for a table a peer may read from)
address = shm_group.buffer_address


def _bytes(buf) -> memoryview:
    return memoryview(buf).cast("B")


def finish(ctx, k: int, extra: int, check: bool, reads, kind: int, red, dtype,
           first_copies: bool = True) -> tuple[int, int] | None:
    """The rest of round k after the C call handed it back and every post is in and checked: the
    extra words, then the reads and the consume, in Python. ``first_copies``: a fold's first read
    copies (else every read folds into what its destination holds: the all_reduce's member 0)."""
    disagreeing = None
    if check:
        for q in range(ctx.size):
            if q != ctx.rank and ctx.extra(q, k) != extra:
                disagreeing = (q, ctx.extra(q, k))
                break
    if disagreeing is None:
        _read(ctx, k, reads, kind, red, dtype, first_copies)
    ctx.consume(k)
    return disagreeing


def _read(ctx, k: int, reads, kind: int, red, dtype, first_copies: bool) -> None:
    for i, (src, src_offset, dst, dst_offset, n) in enumerate(reads):
        if not n:
            continue
        source = (ctx.raw(src, k) if isinstance(src, int) else _bytes(src))[src_offset:src_offset + n]
        target = _bytes(dst)[dst_offset:dst_offset + n]
        if kind < 0 or (i == 0 and first_copies):
            target[:] = source
        else:
            red(np.frombuffer(target, dtype), np.frombuffer(source, dtype))


def runner(ctx):
    """The plan runner of GroupShm ``ctx``, or None where its round steps run in Python (the latency
    paths then run the algorithms' own ``one_round``). A closure, as GroupShm's own steps are: every
    small collective but all_reduce and barrier calls it.

    ``run(seq, sig, header_sig, channel, nbytes, extra, check, writes, reads, kind=-1, red=None,
    dtype=None, expect=(), resume=None)`` runs round ``seq`` of signature ``sig`` (its headers carry
    ``header_sig``: a rooted collective's is ``sig`` without its root bits) from the plan; ``red``
    and ``dtype``: the Python pairwise reducer and the element type, for a fold handed back. It
    returns, with ``check``, the first (peer, its extra word) that differs from ``extra`` (nothing
    read then), else None. ``expect``: (member, word, value) that member's slot must hold (64-bit
    words), else the round is handed back; ``resume(k)``, when given, takes a handed-back round k
    once every post is in and checked (it reads, consumes and returns the result), in place of
    ``finish``."""
    if ctx.native is None:
        return None
    open_round, move = ctx.open_round, ctx.native.move
    RING_CONSUMED, DIFFERS = shm_group.RING_CONSUMED, shm_group.DIFFERS

    def run(seq: int, sig: int, header_sig: int, channel, nbytes: int, extra: int, check: bool, writes, reads,
            kind: int = -1, red=None, dtype: np.dtype | None = None, expect=(), resume=None):
        k = open_round(seq, sig, channel)
        status = move(k, seq, header_sig, nbytes, extra, check, writes, reads, kind, expect)
        if not status:
            return None
        if status == RING_CONSUMED:
            ctx.ring_consumed()
            return None
        if resume is not None:
            if status != DIFFERS:
                ctx.settle(status, k, seq, header_sig, nbytes, channel)
            return resume(k)
        return handed_back(ctx, status, k, seq, header_sig, channel, nbytes, extra, check, reads, kind, red, dtype)

    return run


def handed_back(ctx, status: int, k: int, seq: int, header_sig: int, channel, nbytes: int, extra: int, check: bool,
                reads, kind: int, red, dtype, first_copies: bool = True):
    """The rest of round k, which a C call posted and handed back with ``status`` (neither DONE nor
    RING_CONSUMED): the wait and the header check (unless only a word differed), then ``finish``;
    returns what ``finish`` does. The plan runner's, and the whole calls' in C (``Calls``)."""
    if status != shm_group.DIFFERS:
        ctx.settle(status, k, seq, header_sig, nbytes, channel)
    return finish(ctx, k, extra, check, reads, kind, red, dtype, first_copies)
