"""Collectives through shared memory: reduce and copy straight from peers' memory, in rounds.

The generic collectives (``generic.py``) are algorithms over point-to-point messages: fine over
TCP, wasteful within a host, where every message is a copy into a ring and a copy out of it, and
every rank forwards data it does not need. Here each rank reads what it needs directly from its
peers' slots of the group's shared memory (``transport/shm_group.py``: rounds of slots with
``posted``/``consumed`` counters), or, for large messages where the OS allows it, straight from
their buffers (process_vm_readv). Data moves in chunks of one slot (1 MiB by default), so a chunk
written by one core is read by another from cache, and memory use does not grow with the message.

Algorithms (bytes are per rank, n the message, p the group size):

* all_reduce, "direct": every rank copies its chunk into its slot, then reduces all p slots into
  its own buffer. One round per chunk: the latency path (8 bytes: one write, one flag, p reads).
  Reads p·n, reduces (p-1)·n: used up to ``DISTCOMM_SHM_THRESHOLD_ALLREDUCE_DIRECT_BYTES`` (by default 256 KiB,
  and one slot at world size 2; measured, see DIRECT_ALLREDUCE_BYTES).
* all_reduce, "slices": each rank publishes the parts of the chunk others own, reduces the part it
  owns from all p copies into its next slot, then every rank copies all results out. One round
  per chunk (a round carries one chunk's inputs and the previous chunk's results); each rank
  reduces only n/p: the bandwidth path.
* all_reduce, "readv" (single copy, where process_vm_readv is allowed): each rank reduces its
  slice reading the peers' copies of it straight from their buffers, then copies the other
  slices' results straight from their owners' buffers. No staging copies (~2.5 n bytes through
  memory per rank instead of ~4.5 n) and no lockstep: after one round that publishes addresses, a
  rank does all its reduction without waiting; it waits once for the peers' last chunks. Used
  from ``DISTCOMM_SHM_THRESHOLD_ALLREDUCE_READV_BYTES`` (16 MiB) on; "slices" between.
* Through slots: reduce ("direct" with only the root reading); broadcast (the root writes, the
  others copy); all_gather / gather (each writes its block, the others or the root copy); scatter
  (the root writes every destination's piece); reduce_scatter (each writes the blocks others own
  and reduces its own); all_to_all (one piece per destination, with its length, checked by the
  reader); barrier (one round with no data).
* Single copy, from ``DISTCOMM_SHM_THRESHOLD_READV_BYTES`` (4 MiB) on, where allowed: broadcast in groups of
  three or more (each rank reads the root's buffer), all_gather (each reads the peers' blocks), reduce (each rank reduces a
  share of every chunk from all buffers, the root collects the shares), reduce_scatter (each reduces its block from every input), all_to_all (each
  reads its pieces from the senders' buffers). One round to publish addresses, one wait at the
  end so that no buffer changes before every reader is done.

Reductions run in rank order, ((x0 ⊕ x1) ⊕ x2) ..., like the reference, so every rank gets the same
bits. ``DISTCOMM_SHM_ALGO_ALLREDUCE=direct|slices|readv`` forces an all_reduce algorithm and
``DISTCOMM_SHM_ALGO_<BROADCAST|ALLGATHER|REDUCE|REDUCESCATTER|ALLTOALL>=slots|readv`` the others
(benchmarks). Groups with a member on another host (the default engine across hosts) and groups of one use the
generic collectives; so does everything when ``DISTCOMM_SHM_COLLECTIVES=0``.
"""

from __future__ import annotations


import numpy as np

from ..errors import DistBackendError
from ..reduction import finish, premultiply, reducer
from ..transport import shm_direct
from ..transport.base import Channel, TransportError
from ..types import RedOpType
from . import shm_latency
from ..tuning import DEFAULT, Tuning
from .engine import GroupCollectives
from .generic import GenericCollectives

# The direct all_reduce (one round, every rank reduces all p copies) against slices (each rank
# reduces 1/p, then all copy the results), interleaved runs: direct wins up to 256 KiB at world
# sizes 3, 4 and 8 (at 128 KiB 134-162 µs against 206-213 at world 4, 900-980 against 1280-1550 at
# world 8), is even at 512 KiB and loses at 1 MiB; at world size 2 it wins up to its one slot
# (1 MiB: 253-303 µs against 356-370).
DIRECT_ALLREDUCE_BYTES = 256 * 1024
TWO_RANK_DIRECT_ALLREDUCE_BYTES = 1 << 20
# Single-copy reads pay a system call and page pinning per chunk (process_vm_readv copies at about
# a third of memcpy's speed here), and win by copying once and by not running in lockstep: from
# 4 MiB for the copy-only collectives, from 16 MiB for all_reduce (measured, world 2 and 4).
READV_BYTES = 4 << 20
ALLREDUCE_READV_BYTES = 16 << 20


def _forced(tuning: Tuning, op: str, valid: tuple[str, ...]) -> str | None:
    """The algorithm DISTCOMM_SHM_ALGO_<OP> forces for ``op``, checked, or None."""
    value = tuning.shm_algorithm(op)
    if value is not None and value not in valid:
        raise ValueError(f"DISTCOMM_SHM_ALGO_{op.upper()}={value!r}: valid: {', '.join(valid)}")
    return value


def _view(raw: np.ndarray, dtype, count: int, start: int = 0) -> np.ndarray:
    """``count`` elements of ``dtype`` at byte ``start`` of a uint8 slot."""
    item = np.dtype(dtype).itemsize
    return raw[start : start + count * item].view(dtype)


def _split_mismatch(ch: Channel, q: int, sent: int, expected: int) -> TransportError:
    """Group rank q sends this rank ``sent`` elements of an all_to_all where it expects ``expected``."""
    who = "this rank sends itself" if q == ch.rank else f"rank {ch.ranks[q]} sends this rank"
    return TransportError(
        f"all_to_all: {who} {sent} elements, this rank expects {expected} (input_split_sizes and "
        "output_split_sizes disagree)",
        peer=ch.ranks[q],
        reason="mismatch",
    )


def _offsets(counts) -> list[int]:
    out = [0]
    for c in counts:
        out.append(out[-1] + c)
    return out


# -- the algorithms (ctx: shm_group.GroupShm, ch: Channel) --------------------------------------
def reduce_direct(ctx, ch: Channel, flat: np.ndarray, red, root: int | None) -> None:
    """Every rank posts its chunk; the root (every rank if None) reduces all of them in rank order."""
    p, r = ctx.size, ctx.rank
    dt = flat.dtype
    per = max(1, ctx.slot_bytes // dt.itemsize)
    count, nbytes = flat.size, flat.nbytes
    reads = root is None or r == root
    lo = 0
    while True:
        hi = min(lo + per, count)
        m = hi - lo
        k = ctx.next_round()
        mine = flat[lo:hi]
        _view(ctx.acquire(k, ch), dt, m)[...] = mine
        ctx.post(k, ch, nbytes)
        if reads:
            ctx.wait_posted(k, ch, nbytes)
            if m:
                if r != 0:
                    mine[...] = _view(ctx.data(0, k), dt, m)
                for q in range(1, p):
                    red(mine, _view(ctx.data(q, k), dt, m))
        ctx.consume(k)
        lo = hi
        if lo >= count:
            return


def allreduce_small(ctx, ch: Channel, flat: np.ndarray, red) -> None:
    """The latency path: the whole message in one slot; every rank reduces all p copies."""
    k = ctx.round = ctx.round + 1
    n = flat.nbytes
    views = ctx.views(k, flat.dtype, flat.size)  # cached typed views: no slicing per call
    ctx.acquire(k, ch)
    views[ctx.rank][...] = flat
    ctx.post(k, ch, n)
    ctx.wait_posted(k, ch, n)
    if ctx.rank:
        flat[...] = views[0]
    for v in views[1:]:
        red(flat, v)
    ctx.consume(k)


def allreduce_slices(ctx, ch: Channel, flat: np.ndarray, red) -> None:
    """Reduce-scatter by part owners, then all-gather of the parts, one round per chunk.

    Round j carries the inputs of chunk j (the parts others own) *and* this rank's reduced part
    of chunk j-1, so the all-gather of one chunk shares its synchronization with the reduce-scatter
    of the next: chunks + 1 rounds in all.
    """
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
        ctx.consume(k)
        if j + 1 < chunks:
            publish(slot, j + 1)
        ctx.post(k + 1, ch, nbytes)


def allreduce_readv(ctx, ch: Channel, flat: np.ndarray, red) -> None:
    """Each rank reduces its slice reading the peers' copies of it straight from their buffers
    (process_vm_readv), then copies every other slice's result straight from its owner's buffer.

    Single copies: per rank about 2.5 n bytes cross memory (its slice and the peers' copies of it
    read, its slice written, the other results read and written), against ~4.5 n through slots.
    And no lockstep: after the first round (which publishes each buffer's address) a rank reduces
    its whole slice without waiting for anyone, picking up the peers' finished chunks as they
    come (the ``posted`` counter of round k0 + 1 + j says "chunk j of my slice is final"; by then
    its owner has read all it needed from the others' buffers). A last wait keeps every buffer
    unchanged until the peers have read it. Only round k0 uses a slot.
    """
    p, r = ctx.size, ctx.rank
    dt = flat.dtype
    item = dt.itemsize
    count, nbytes = flat.size, flat.nbytes
    edges = [count * q // p for q in range(p + 1)]
    per = max(1, ctx.slot_bytes // item)
    chunks = max(1, max(-(-(edges[q + 1] - edges[q]) // per) for q in range(p)))
    pids = [ctx.transport.pid_of(g) for g in ctx.ranks]
    read = shm_direct.read
    k0 = ctx.next_round()
    ctx.round += chunks
    ctx.acquire(k0, ch)
    ctx.post(k0, ch, nbytes, extra=flat.ctypes.data)
    ctx.wait_posted(k0, ch, nbytes)
    base = [ctx.extra(q, k0) for q in range(p)]
    acc = np.empty(min(per, edges[r + 1] - edges[r]), dt)
    tmp = np.empty_like(acc)
    copied = [chunks if q == r else 0 for q in range(p)]  # peers' final chunks copied so far

    def fetch(q: int) -> None:
        j = copied[q]
        lo = edges[q] + j * per
        hi = min(lo + per, edges[q + 1])
        if hi > lo:
            read(pids[q], base[q] + lo * item, flat[lo:hi])
        copied[q] = j + 1

    for j in range(chunks):
        lo = edges[r] + j * per
        hi = min(lo + per, edges[r + 1])
        if hi > lo:  # my slice's chunk j, reduced in rank order
            mine, a, t = flat[lo:hi], acc[: hi - lo], tmp[: hi - lo]
            for q in range(p):
                if q == r:
                    x = mine
                else:
                    read(pids[q], base[q] + lo * item, t)
                    x = t
                if q == 0:
                    a[...] = x
                else:
                    red(a, x)
            mine[...] = a
        ctx.advance(k0 + 1 + j, wake=j == chunks - 1)
        for q in range(p):  # whatever the peers have finished meanwhile
            while copied[q] < chunks and ctx.posted(q) > k0 + copied[q]:
                fetch(q)
    # One wait for everything still missing: under contention every sleep costs a trip through the
    # scheduler's queue, so peers only wake us for their last chunk.
    ctx.wait_posted_counter(k0 + chunks, ch)
    for q in range(p):
        while copied[q] < chunks:
            fetch(q)
    ctx.consume(k0 + chunks)
    ctx.wait_consumed(k0 + chunks, ch)


def broadcast(ctx, ch: Channel, flat: np.ndarray, root: int) -> None:
    raw = flat.view(np.uint8)
    n, step = raw.size, ctx.slot_bytes
    lo = 0
    while True:
        hi = min(lo + step, n)
        k = ctx.next_round()
        if ctx.rank == root:
            ctx.acquire(k, ch)[: hi - lo] = raw[lo:hi]
            ctx.post(k, ch, n)
        else:
            ctx.wait_posted(k, ch, n, [root])
            raw[lo:hi] = ctx.data(root, k)[: hi - lo]
        ctx.consume(k)
        lo = hi
        if lo >= n:
            return


def broadcast_readv(ctx, ch: Channel, flat: np.ndarray, root: int) -> None:
    """Every rank copies the root's buffer straight from the root's memory (one copy, no slots);
    the root waits until all have read it."""
    k = ctx.next_round()
    if ctx.rank == root:
        ctx.acquire(k, ch)
        ctx.post(k, ch, flat.nbytes, extra=flat.ctypes.data)
        ctx.consume(k)
        ctx.wait_consumed(k, ch)
    else:
        ctx.wait_posted(k, ch, flat.nbytes, [root])
        shm_direct.read(ctx.transport.pid_of(ctx.ranks[root]), ctx.extra(root, k), flat)
        ctx.consume(k)


def allgather_readv(ctx, ch: Channel, out: np.ndarray, count: int) -> None:
    """Every rank copies each peer's block straight from the peer's output buffer."""
    r = ctx.rank
    raw = out.view(np.uint8)
    bb = raw.size // ctx.size
    k = ctx.next_round()
    ctx.acquire(k, ch)
    ctx.post(k, ch, raw.size, extra=out.ctypes.data)
    ctx.wait_posted(k, ch, raw.size)
    for q in range(ctx.size):
        if q != r and bb:
            shm_direct.read(ctx.transport.pid_of(ctx.ranks[q]), ctx.extra(q, k) + q * bb, raw[q * bb : (q + 1) * bb])
    ctx.consume(k)
    ctx.wait_consumed(k, ch)


def _reduce_from_peers(ctx, out: np.ndarray, lo: int, own: np.ndarray | None, base: list[int], red, tmp) -> None:
    """out = x0 ⊕ x1 ⊕ ... (rank order), x_q read at element ``lo`` of member q's buffer (``base``)
    straight from its memory, ours from ``own``; ``out`` must not alias ``own``."""
    item = out.dtype.itemsize
    t = tmp[: out.size]
    for q in range(ctx.size):
        if q == ctx.rank:
            x = own
        else:
            x = out if q == 0 else t
            shm_direct.read(ctx.transport.pid_of(ctx.ranks[q]), base[q] + lo * item, x)
        if q == 0:
            if x is not out:
                out[...] = x
        else:
            red(out, x)


def reduce_readv(ctx, ch: Channel, flat: np.ndarray, red, root: int) -> None:
    """Every rank reduces a share of each chunk straight from all members' buffers into its slot;
    the root copies the shares into its buffer. The work is spread over the group: the root alone
    reading and reducing every buffer ran at half gloo's speed with 4 ranks on 2 cores. Memory stays
    bounded by the slots; non-root buffers are never written."""
    p, r = ctx.size, ctx.rank
    dt, nbytes = flat.dtype, flat.nbytes
    share = max(1, ctx.slot_bytes // dt.itemsize)  # elements one rank reduces per chunk
    k = ctx.next_round()
    ctx.acquire(k, ch)
    ctx.post(k, ch, nbytes, extra=flat.ctypes.data)
    ctx.wait_posted(k, ch, nbytes)
    base = [ctx.extra(q, k) for q in range(p)]
    ctx.consume(k)
    tmp = np.empty(min(share, flat.size), dt)
    for lo in range(0, flat.size, share * p):
        hi = min(lo + share * p, flat.size)
        k = ctx.next_round()
        slot = ctx.acquire(k, ch)
        a, b = min(lo + r * share, hi), min(lo + (r + 1) * share, hi)
        if b > a:
            _reduce_from_peers(ctx, _view(slot, dt, b - a), a, flat[a:b], base, red, tmp)
        ctx.post(k, ch, nbytes)
        if r == root:
            # Every member has posted this chunk, so nobody reads our part of it any more.
            ctx.wait_posted(k, ch, nbytes)
            for q in range(p):
                qa, qb = min(lo + q * share, hi), min(lo + (q + 1) * share, hi)
                if qb > qa:
                    flat[qa:qb] = _view(ctx.data(q, k), dt, qb - qa)
        ctx.consume(k)
    ctx.wait_consumed(k, ch)  # every member has read every buffer: they may change now


def reduce_scatter_readv(ctx, ch: Channel, scratch: np.ndarray, out: np.ndarray, counts, red) -> None:
    """Each rank reduces its own block straight from every member's input, into its output."""
    r = ctx.rank
    offs = _offsets(counts)
    k = ctx.next_round()
    ctx.acquire(k, ch)
    ctx.post(k, ch, scratch.nbytes, extra=scratch.ctypes.data)
    ctx.wait_posted(k, ch, scratch.nbytes)
    base = [ctx.extra(q, k) for q in range(ctx.size)]
    per = max(1, ctx.slot_bytes // scratch.itemsize)
    tmp = np.empty(min(per, counts[r]), scratch.dtype)
    for lo in range(0, counts[r], per):
        n = min(per, counts[r] - lo)
        _reduce_from_peers(ctx, out[lo : lo + n], offs[r] + lo, scratch[offs[r] + lo : offs[r] + lo + n], base, red, tmp)
    ctx.consume(k)
    ctx.wait_consumed(k, ch)


def gather_blocks(ctx, ch: Channel, send: np.ndarray, out: np.ndarray, root: int | None) -> None:
    """Rank q's ``send`` into block q of ``out`` on the root (every rank if None: all_gather).

    For all_gather ``send`` is this rank's block of ``out`` itself.
    """
    r = ctx.rank
    src = send.view(np.uint8)
    raw = None if out is None else out.view(np.uint8)
    bb, step = src.size, ctx.slot_bytes
    peers = [q for q in range(ctx.size) if q != r]
    reads = root is None or r == root
    lo = 0
    while True:
        hi = min(lo + step, bb)
        k = ctx.next_round()
        if root is None or r != root:
            ctx.acquire(k, ch)[: hi - lo] = src[lo:hi]
            ctx.post(k, ch, bb)
        if reads:
            ctx.wait_posted(k, ch, bb, None if root is None else peers)
            for q in peers:
                raw[q * bb + lo : q * bb + hi] = ctx.data(q, k)[: hi - lo]
            if root is not None:
                raw[r * bb + lo : r * bb + hi] = src[lo:hi]
        ctx.consume(k)
        lo = hi
        if lo >= bb:
            return


def scatter(ctx, ch: Channel, chunks: np.ndarray | None, out: np.ndarray, root: int) -> None:
    p, r = ctx.size, ctx.rank
    raw = out.view(np.uint8)
    src = None if chunks is None else chunks.view(np.uint8)
    bb = raw.size
    step = max(64, ctx.slot_bytes // p // 64 * 64)
    lo = 0
    while True:
        hi = min(lo + step, bb)
        k = ctx.next_round()
        if r == root:
            slot = ctx.acquire(k, ch)
            for q in range(p):
                if q != r:
                    slot[q * step : q * step + hi - lo] = src[q * bb + lo : q * bb + hi]
            ctx.post(k, ch, bb)
            raw[lo:hi] = src[r * bb + lo : r * bb + hi]
        else:
            ctx.wait_posted(k, ch, bb, [root])
            raw[lo:hi] = ctx.data(root, k)[r * step : r * step + hi - lo]
        ctx.consume(k)
        lo = hi
        if lo >= bb:
            return


def reduce_scatter(ctx, ch: Channel, scratch: np.ndarray, out: np.ndarray, counts, red) -> None:
    """Each rank posts the pieces of the blocks others own; each reduces its own block."""
    p, r = ctx.size, ctx.rank
    dt = scratch.dtype
    item = dt.itemsize
    per = max(1, ctx.slot_bytes // p // item)
    offs = _offsets(counts)
    longest = max(counts) if counts else 0
    lo = 0
    while True:
        k = ctx.next_round()
        slot = ctx.acquire(k, ch)
        for q in range(p):
            n = min(per, max(0, counts[q] - lo))
            if q != r and n:
                _view(slot, dt, n, q * per * item)[...] = scratch[offs[q] + lo : offs[q] + lo + n]
        ctx.post(k, ch, scratch.nbytes)
        ctx.wait_posted(k, ch, scratch.nbytes)
        n = min(per, max(0, counts[r] - lo))
        if n:
            mine = scratch[offs[r] + lo : offs[r] + lo + n]
            acc = out[lo : lo + n]
            acc[...] = mine if r == 0 else _view(ctx.data(0, k), dt, n, r * per * item)
            for q in range(1, p):
                red(acc, mine if q == r else _view(ctx.data(q, k), dt, n, r * per * item))
        ctx.consume(k)
        lo += per
        if lo >= longest:
            return


def _a2a_head(p: int) -> int:
    """Bytes before the data in an all_to_all slot: p lengths, then (round 0 only) p offsets, p
    counts, and the sender's rounds needed, single-copy vote and buffer address."""
    return (8 * (3 * p + 3) + 63) // 64 * 64


def a2a_fits(slot_bytes: int, p: int, item: int) -> bool:
    """Whether an all_to_all of ``item``-byte elements fits a slot (one element per destination)."""
    return _a2a_head(p) + p * item <= slot_bytes


def all_to_all(ctx, ch: Channel, send: np.ndarray, send_counts, recv: np.ndarray, recv_counts,
               single_copy: bool = False) -> None:
    """Each round, one piece per destination (its length first, checked by the reader); or, when
    any rank asks for it (``single_copy``), every rank copies what each peer sends it straight from
    the peer's send buffer.

    With uneven splits ranks send different amounts, so they can disagree on whether the message is
    large enough for single-copy reads. Round 0 therefore carries every rank's vote along with its
    offsets, counts and buffer address: all ranks see all votes and switch (or not) together.

    Slots are read and written through cached memoryviews (``ctx.raw``/``ctx.words``): a small
    all_to_all is p tiny copies each way, where numpy's per-call overhead would dominate.
    """
    p, r = ctx.size, ctx.rank
    item = send.itemsize
    head = _a2a_head(p)
    per = max(1, (ctx.slot_bytes - head) // p // item)
    so, ro = _offsets(send_counts), _offsets(recv_counts)
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
                _all_to_all_read_peers(ctx, ch, tables, send, so[r], recv, ro, recv_counts)
                ctx.consume(k)
                ctx.wait_consumed(k, ch)  # no send buffer may change before every reader is done
                return
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
                raise _split_mismatch(ch, q, j * per + sent, j * per + n)
            if n:
                dst, at = (ro[q] + lo) * item, head + r * per * item
                rb[dst : dst + n * item] = ctx.raw(q, k)[at : at + n * item]
        ctx.consume(k)
        j += 1
        if j >= rounds:
            return


def _all_to_all_read_peers(ctx, ch: Channel, tables, send, my_offset: int, recv, ro, recv_counts) -> None:
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
            raise _split_mismatch(ch, q, sent, n)
        if n:
            address = int(t[3 * p + 2]) + int(t[p + r]) * item
            shm_direct.read(ctx.transport.pid_of(ch.ranks[q]), address, recv[ro[q] : ro[q] + n])


def barrier(ctx, ch: Channel) -> None:
    k = ctx.next_round()
    ctx.acquire(k, ch)
    ctx.post(k, ch, 0)
    ctx.wait_posted(k, ch, 0)
    ctx.consume(k)


# -- the engine's collectives object -----------------------------------------------------------
class ShmCollectives(GroupCollectives):
    """The collectives of groups whose members all share this host, through shared memory.

    One instance serves every such group of an engine (each call finds its group's GroupShm by the
    channel's group id). A group of one runs the generic collectives.
    """

    def __init__(self, transport, tuning: Tuning = DEFAULT):
        self.transport = transport
        self.generic = GenericCollectives(tuning)  # groups of one
        self._group_shm = transport.group_shm  # gid -> GroupShm or None, for the latency path
        self.allreduce_algo = _forced(tuning, "allreduce", ("direct", "slices", "readv"))
        forced = tuning.shm_thresholds.get("allreduce_direct_bytes")
        self.direct_bytes = DIRECT_ALLREDUCE_BYTES if forced is None else forced
        self.two_rank_direct_bytes = TWO_RANK_DIRECT_ALLREDUCE_BYTES if forced is None else forced
        self._reducers: dict = {}
        self.broadcast_algo = _forced(tuning, "broadcast", ("slots", "readv"))
        self.allgather_algo = _forced(tuning, "allgather", ("slots", "readv"))
        self.reduce_algo = _forced(tuning, "reduce", ("slots", "readv"))
        self.reduce_scatter_algo = _forced(tuning, "reducescatter", ("slots", "readv"))
        self.alltoall_algo = _forced(tuning, "alltoall", ("slots", "readv"))
        self.readv_bytes = tuning.shm_thresholds.get("readv_bytes", READV_BYTES)
        self.allreduce_readv_bytes = tuning.shm_thresholds.get("allreduce_readv_bytes", ALLREDUCE_READV_BYTES)

    def direct_limit(self, size: int) -> int:
        """The largest all_reduce (bytes) the direct algorithm takes in a group of ``size``."""
        return self.two_rank_direct_bytes if size == 2 else self.direct_bytes

    def _readv(self, ch: Channel, nbytes: int, forced: str | None) -> bool:
        """Use single-copy reads? Forced by DISTCOMM_SHM_ALGO_<OP>, else for large messages, and
        only where every member may read every other's memory (the same answer on all ranks)."""
        want = forced == "readv" if forced else nbytes >= self.readv_bytes
        return want and self.transport.direct_reads_ok(ch.ranks)

    def _reducer(self, op, dtype):
        """reduce.reducer(op, dtype), cached for the plain ops (building one costs microseconds)."""
        if type(op) is not RedOpType:
            return reducer(op, dtype)
        key = (op, dtype.name)
        red = self._reducers.get(key)
        if red is None:
            red = self._reducers[key] = reducer(op, dtype)
        return red

    def _context(self, ch: Channel):
        """The group's shared memory, or None (a group of one, or a member on another host)."""
        if ch.size == 1:
            return None
        try:
            ctx = self.transport.group_context(ch.key.group, ch.ranks, ch.rank, ch.deadline)
        except TransportError as exc:
            raise ch.translate(exc, None) from None
        if ctx is not None and ctx.broken:
            raise DistBackendError(
                f"{ch.op} (sequence number {ch.key.seq}) on rank {ch.rank}: this group's shared memory is "
                f"unusable after an earlier failure ({ctx.broken}); destroy the process group and create it again"
            )
        return ctx

    @staticmethod
    def _run(ctx, ch: Channel, algorithm, *args) -> None:
        try:
            algorithm(ctx, ch, *args)
        except TransportError as exc:
            ctx.broken = str(exc)
            raise ch.translate(exc, None) from None
        except BaseException as exc:
            ctx.broken = f"{type(exc).__name__}: {exc}"
            raise

    def latency_paths(self, pg):
        """The latency paths of process group ``pg`` (shm_latency.py; see
        ProcessGroup._install_latency_paths): None until the group's shared memory exists, False
        if they will never be used (a group of one, a member on another host, an algorithm forced)."""
        group = pg.spec
        if len(group.ranks) == 1 or self.allreduce_algo is not None or not self.transport.all_local(group.ranks):
            return False
        ctx = self._group_shm(group.group_id)
        return None if ctx is None else shm_latency.build(pg, ctx, self)

    # The signatures below are those of engine.GroupCollectives.
    def all_reduce(self, ch: Channel, flat: np.ndarray, dtype, op) -> None:
        # The latency path first: a group already set up and healthy, a plain op, one slot.
        ctx = self._group_shm(ch.key.group)
        plain = type(op) is RedOpType  # no factor to apply first; only AVG needs finishing
        if ctx is not None and not ctx.broken and plain and self.allreduce_algo is None:
            n = flat.nbytes
            if n <= (self.two_rank_direct_bytes if ch.size == 2 else self.direct_bytes) and n <= ctx.slot_bytes:
                red = self._reducers.get((op, dtype.name)) or self._reducer(op, dtype)
                self._run(ctx, ch, allreduce_small, flat, red)
                if op is RedOpType.AVG:
                    finish(op, flat, ch.size, dtype)
                return
        ctx = self._context(ch)
        if ctx is None:
            return self.generic.all_reduce(ch, flat, dtype, op)
        if not plain:
            premultiply(op, flat, dtype)
        red = self._reducer(op, dtype)
        algo = self.allreduce_algo
        if algo is None:
            n = flat.nbytes
            algo = "direct" if n <= self.direct_limit(ch.size) else "readv" if n >= self.allreduce_readv_bytes else "slices"
        if algo == "readv" and not self.transport.direct_reads_ok(ch.ranks):
            algo = "slices"
        if algo == "slices":
            self._run(ctx, ch, allreduce_slices, flat, red)
        elif algo == "readv":
            self._run(ctx, ch, allreduce_readv, flat, red)
        elif flat.nbytes <= ctx.slot_bytes:
            self._run(ctx, ch, allreduce_small, flat, red)
        else:
            self._run(ctx, ch, reduce_direct, flat, red, None)
        if not plain or op is RedOpType.AVG:
            finish(op, flat, ch.size, dtype)

    def reduce(self, ch: Channel, flat: np.ndarray, dtype, op, root: int) -> None:
        ctx = self._context(ch)
        if ctx is None:
            return self.generic.reduce(ch, flat, dtype, op, root)
        if ch.rank != root and getattr(op, "factor", None) is not None:
            flat = flat.copy()  # PREMUL_SUM scales the input; a non-root keeps its own unscaled
        premultiply(op, flat, dtype)
        red = self._reducer(op, dtype)
        if self._readv(ch, flat.nbytes, self.reduce_algo):
            self._run(ctx, ch, reduce_readv, flat, red, root)
        else:
            self._run(ctx, ch, reduce_direct, flat, red, root)
        if ch.rank == root:
            finish(op, flat, ch.size, dtype)

    def broadcast(self, ch: Channel, flat: np.ndarray, root: int) -> None:
        ctx = self._context(ch)
        if ctx is None:
            return self.generic.broadcast(ch, flat, root)
        # Two ranks: the slots' pipeline (the root writes a chunk while the reader copies the one
        # before, both at memcpy speed) beats one process_vm_readv copy at every size, 6.4 against
        # 5.2 GB/s at 64 MiB (measured). At four ranks the two are about even from 4 MiB on.
        if (ch.size > 2 or self.broadcast_algo) and self._readv(ch, flat.nbytes, self.broadcast_algo):
            self._run(ctx, ch, broadcast_readv, flat, root)
        else:
            self._run(ctx, ch, broadcast, flat, root)

    def all_gather(self, ch: Channel, out: np.ndarray, count: int) -> None:
        ctx = self._context(ch)
        if ctx is None:
            return self.generic.all_gather(ch, out, count)
        if self._readv(ch, out.nbytes, self.allgather_algo):
            self._run(ctx, ch, allgather_readv, out, count)
        else:
            self._run(ctx, ch, gather_blocks, out[ch.rank * count : (ch.rank + 1) * count], out, None)

    def gather(self, ch: Channel, send: np.ndarray, out: np.ndarray | None, root: int) -> None:
        ctx = self._context(ch)
        if ctx is None:
            return self.generic.gather(ch, send, out, root)
        self._run(ctx, ch, gather_blocks, send, out, root)

    def scatter(self, ch: Channel, chunks: np.ndarray | None, out: np.ndarray, root: int) -> None:
        ctx = self._context(ch)
        if ctx is None:
            return self.generic.scatter(ch, chunks, out, root)
        self._run(ctx, ch, scatter, chunks, out, root)

    def reduce_scatter(self, ch: Channel, scratch: np.ndarray, out: np.ndarray, counts, dtype, op) -> None:
        ctx = self._context(ch)
        if ctx is None:
            return self.generic.reduce_scatter(ch, scratch, out, counts, dtype, op)
        premultiply(op, scratch, dtype)
        red = self._reducer(op, dtype)
        if self._readv(ch, scratch.nbytes, self.reduce_scatter_algo):
            self._run(ctx, ch, reduce_scatter_readv, scratch, out, list(counts), red)
        else:
            self._run(ctx, ch, reduce_scatter, scratch, out, list(counts), red)
        finish(op, out, ch.size, dtype)

    def all_to_all(self, ch: Channel, send: np.ndarray, send_counts, recv: np.ndarray, recv_counts) -> None:
        ctx = self._context(ch)
        if ctx is None:
            return self.generic.all_to_all(ch, send, send_counts, recv, recv_counts)
        if send_counts[ch.rank] != recv_counts[ch.rank]:
            raise ch.translate(_split_mismatch(ch, ch.rank, send_counts[ch.rank], recv_counts[ch.rank]), None)
        if not a2a_fits(ctx.slot_bytes, ch.size, send.itemsize):
            return self.generic.all_to_all(ch, send, send_counts, recv, recv_counts)
        # Ranks may disagree on this vote (uneven splits); all_to_all settles it in its first round.
        single_copy = self._readv(ch, send.nbytes, self.alltoall_algo)
        self._run(ctx, ch, all_to_all, send, list(send_counts), recv, list(recv_counts), single_copy)

    def barrier(self, ch: Channel) -> None:
        ctx = self._context(ch)
        if ctx is None:
            return self.generic.barrier(ch)
        self._run(ctx, ch, barrier)
