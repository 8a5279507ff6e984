"""Small pieces the shared-memory algorithms share: typed views of slots, buffer addresses posted in a
slot, block offsets, the rank-order reduction read straight from peers' buffers, and all_to_all's
split mismatch."""

from __future__ import annotations

import numpy as np

from ...transport import shm_direct
from ...transport.base import Channel, TransportError


def view(raw: np.ndarray, dtype, count: int, start: int = 0) -> np.ndarray:
    """``count`` elements of ``dtype`` at byte ``start`` of a uint8 slot."""
    item = np.dtype(dtype).itemsize
    return raw[start : start + count * item].view(dtype)


def write_addresses(slot: np.ndarray, arrays) -> None:
    """Each of ``arrays``' address, in member order, at the start of our slot (uint8): member q
    finds the one for it with ``address_for``."""
    slot[: 8 * len(arrays)].view(np.uint64)[...] = [x.ctypes.data for x in arrays]


def address_for(ctx, q: int, k: int, r: int) -> int:
    """The address member ``q`` wrote for member ``r`` in its slot of round k (``write_addresses``)."""
    return int(ctx.data(q, k)[8 * r : 8 * r + 8].view(np.uint64)[0])


def offsets(counts) -> list[int]:
    """Where each block starts, and the total at the end: [0, c0, c0 + c1, ...]."""
    out = [0]
    for c in counts:
        out.append(out[-1] + c)
    return out


def reduce_from_peers(ctx, out: np.ndarray, lo: int, own: np.ndarray | None, base: list[int], red, tmp) -> None:
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



#: slots' worth of data in one chunk of the single-copy all_reduces' slices: the unit a rank reduces,
#: then publishes (a chunk never passes through a slot, but scaling it with the slot lets a small
#: slot make many chunks, as the tests' do); docs/performance-notes.md has the measurements
CHUNK_SLOTS = 2


def chunked_slices(ctx, count: int, itemsize: int) -> tuple[int, list[int], int, int]:
    """The single-copy all_reduces' layout of ``count`` elements of ``itemsize`` bytes in group
    memory ``ctx``, and their rounds: ``(k0, edges, per, chunks)``. Member q reduces elements
    [edges[q], edges[q + 1]) in chunks of ``per``; round k0 publishes the addresses and round
    k0 + 1 + j says "chunk j of my slice is final", for the ``chunks`` of the largest slice (every
    member takes the same rounds)."""
    p = ctx.size
    edges = [count * q // p for q in range(p + 1)]
    per = max(1, CHUNK_SLOTS * ctx.slot_bytes // itemsize)
    chunks = max(1, max(-(-(edges[q + 1] - edges[q]) // per) for q in range(p)))
    k0 = ctx.next_round()
    ctx.round += chunks
    return k0, edges, per, chunks


def fetch_finished(ctx, k0: int, copied: list[int], chunks: int, fetch) -> None:
    """The single-copy all_reduces' catch-up: ``fetch(q)`` every chunk peer q has already
    published (round ``k0 + 1 + j`` posted for chunk j), without waiting."""
    for q in range(ctx.size):
        while copied[q] < chunks and ctx.posted(q) > k0 + copied[q]:
            fetch(q)


def fetch_rest(ctx, ch: Channel, k0: int, copied: list[int], chunks: int, fetch) -> None:
    """The single-copy all_reduces' end: one wait for every chunk still missing (under contention
    every sleep costs a trip through the scheduler's queue, so peers only wake us for their last
    chunk), the remaining fetches, then the consume and the wait that no peer still reads us."""
    ctx.wait_posted_counter(k0 + chunks, ch)
    for q in range(ctx.size):
        while copied[q] < chunks:
            fetch(q)
    ctx.consume(k0 + chunks)
    ctx.wait_consumed(k0 + chunks, ch)

def split_mismatch(ch: Channel, q: int, sent: int, expected: int) -> TransportError:
    """Group rank q sends this rank ``sent`` elements of an all_to_all where it expects ``expected``."""
    who = "this rank sends itself" if q == ch.rank else f"rank {ch.ranks[q]} sends this rank"
    return TransportError(
        f"all_to_all: {who} {sent} elements, this rank expects {expected} (input_split_sizes and "
        "output_split_sizes disagree)",
        peer=ch.ranks[q],
        reason="mismatch",
    )


def same_channel(ch: Channel):
    """``channel(seq, sig)`` for GroupShm.open_round/exchange when the call's Channel exists."""
    return lambda seq, sig: ch
