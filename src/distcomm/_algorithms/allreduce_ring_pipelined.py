"""Pipelined (segmented) ring all_reduce: the ring's reduce-scatter and all-gather as one stream of
segments, so reducing one segment overlaps the transfer of the next (Gloo's allreduce_ring_chunked
idea; the bandwidth-optimal ring of Patarasuk & Yuan with pipelining).

The buffer is cut into p blocks as in ``allreduce_ring`` and every block into segments of at most
``segment_bytes``. Seen from one rank, the ring is two streams of segments:

* in, from the left: the reduce-scatter blocks r-1, r-2, ..., r+1 (each received into a scratch
  slot and reduced into its place in ``buf``), then the all-gather blocks r, r-1, ..., r+2
  (received straight into place);
* out, to the right: block r as it is, then every incoming segment just after it was processed
  (reduced or received), except the last all-gather block's.

So a segment is forwarded as soon as it is reduced and the transfer of later segments goes on
meanwhile. Receives must be posted in the order the messages are sent (the transport matches
them in arrival order), and scratch is a window of ``window`` slots: the receive of reduce-scatter
segment i is posted once segment i - window is reduced, all-gather receives as soon as every
earlier one is posted. The sender paces itself by the same rule seen from the receiver (it sends
segment j once it has itself processed as far as its right neighbour must have, to have posted
j; the ranks run the same schedule), so segments land in posted buffers instead of being buffered
by the transport as unexpected messages and copied again. A neighbour that starts the call late
can still get the first segments unexpected; a "receives posted" token at the start (as
halving-doubling has) removed those but cost more CPU than it saved (docs/performance-notes.md,
"TCP engine, 1-64 MiB"). Nothing here depends on the pacing
being exact: a segment that arrives early is only copied once more.

Cost: the ring's (2(p-1)/p · n bytes sent per rank, (p-1)/p · n reduced), in about
2(p-1) · n/(p · segment) messages; with the pipeline, the time is about the larger of the
transfer and the reduction instead of their sum, plus one segment's worth of start-up. Scratch:
``window`` segments. select.py uses it for large messages (see THRESHOLDS there).

Every element is reduced in the same order as in ``allreduce_ring`` (acc = own ⊕ incoming along the
ring, on one rank) and then copied, so all ranks end bit-identical. The first message of the stream
is the element count (8 bytes): ranks that disagree about the count fail with a mismatch even when
their segments happen to have equal sizes. Empty blocks are sent as one zero-byte segment.
"""

from __future__ import annotations

import numpy as np

from ..errors import CollectiveMismatchError, describe_op
from ..transport.base import Channel, wait_all
from ._blocks import Reducer, even_counts, offsets, scratch, uses_scratch
from .thresholds import THRESHOLDS


@uses_scratch
def allreduce_ring_pipelined(
    ch: Channel, buf: np.ndarray, reduce: Reducer, segment_bytes: int | None = None, window: int | None = None
) -> None:
    """Reduce ``buf`` across the group in place; every rank ends with the same result.

    ``segment_bytes`` and ``window`` default to thresholds.py's THRESHOLDS ``allreduce_segment_bytes``
    and ``allreduce_segment_window`` (tests pass small segments).
    """
    p, r = ch.size, ch.rank
    if p == 1:
        return
    if segment_bytes is None or window is None:
        segment_bytes = THRESHOLDS["allreduce_segment_bytes"] if segment_bytes is None else segment_bytes
        window = THRESHOLDS["allreduce_segment_window"] if window is None else window
    right, left = (r + 1) % p, (r - 1) % p
    seg = max(1, segment_bytes // max(1, buf.itemsize))
    window = max(1, window)
    bounds = offsets(even_counts(buf.size, p))

    def segments(block: int) -> list[tuple[int, int]]:
        block %= p
        lo, hi = bounds[block], bounds[block + 1]
        if lo == hi:
            return [(lo, lo)]  # a zero-byte message keeps the ranks in step
        return [(s, min(s + seg, hi)) for s in range(lo, hi, seg)]

    # The incoming stream: (lo, hi) of each segment; the first n_rs are reduced, the rest land in place.
    incoming: list[tuple[int, int]] = []
    for s in range(p - 1):
        incoming += segments(r - 1 - s)
    n_rs = len(incoming)
    for s in range(p - 1):
        incoming += segments(r - s)
    # The outgoing stream: block r, then every incoming segment but the last all-gather block's.
    prime = segments(r)
    n_prime = len(prime)
    outgoing = prime + incoming[: len(incoming) - len(segments(r - (p - 2)))]
    # How many of them the right neighbour reduces (its n_rs): blocks r, r-1, ..., r-(p-2).
    n_rs_right = sum(len(segments(r - s)) for s in range(p - 1))
    # it has min(window, n_rs_right) slots; we stay half of them behind, so a neighbour that lags
    # by up to that many segments still has the receive posted when a segment arrives
    lag_right = max(1, min(window, n_rs_right) // 2)

    slot_elems = min(seg, max(hi - lo for lo, hi in incoming[:n_rs]))
    nslots = min(window, n_rs)
    slots = scratch(nslots * slot_elems, buf.dtype)

    # The count first: ranks that disagree about it fail here, whatever their segments look like.
    count_out = np.array([buf.size], dtype=np.int64)
    count_in = np.empty(1, dtype=np.int64)
    count_recv = ch.irecv(left, count_in)
    sends = [ch.isend(right, count_out)]

    recvs: list = [None] * len(incoming)
    posted = 0  # incoming segments with a posted receive
    sent = 0  # outgoing segments handed to the transport
    done = 0  # incoming segments processed (reduced, or arrived in place)

    def pump() -> None:
        nonlocal posted, sent
        # receives, in stream order: a reduce-scatter segment once its slot is free
        while posted < len(incoming) and (posted >= n_rs or posted - nslots < done):
            lo, hi = incoming[posted]
            if posted < n_rs:
                k = (posted % nslots) * slot_elems
                target = slots[k : k + hi - lo]
            else:
                target = buf[lo:hi]
            recvs[posted] = ch.irecv(left, target)
            posted += 1
        # sends: segment j once its data is ready here and the right neighbour has (by the same
        # rule, run at about the same pace) posted its receive
        while sent < len(outgoing):
            j = sent
            if j >= n_prime and j - n_prime >= done:
                break  # not processed yet
            if min(j, n_rs_right - 1) - lag_right >= done:
                break  # the right neighbour has not posted it yet
            lo, hi = outgoing[j]
            sends.append(ch.isend(right, buf[lo:hi]))
            sent += 1

    pump()
    count_recv.wait()
    if int(count_in[0]) != buf.size:
        raise CollectiveMismatchError(
            f"{describe_op(ch.op, ch.key.seq, r, left)}: rank {r} has {buf.size} elements but rank "
            f"{left} has {int(count_in[0])} (the ranks disagree about this operation)"
        )
    for i, (lo, hi) in enumerate(incoming):
        recvs[i].wait()
        recvs[i] = None
        if i < n_rs:
            k = (i % nslots) * slot_elems
            reduce(buf[lo:hi], slots[k : k + hi - lo])
        done = i + 1
        pump()
    wait_all(sends)
