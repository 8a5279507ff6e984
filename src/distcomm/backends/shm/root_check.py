"""The root check of a rooted collective (broadcast, reduce, gather, scatter) on shared memory.

The root is in the call's signature, but that is not enough: when two ranks each believe they are
the root of a broadcast, neither reads anything, so no header is ever compared. So every rank posts
its whole root (the header's extra word) in a round that every rank waits for in full, and reads
every peer's: every rank sees any disagreement (``GroupCollectives.check_root``).

* A collective of one round (the one-slot rounds of broadcast_slots, reduce_direct, gather_slots
  and scatter_slots: what the latency paths run) carries the check in that round: ``exchange``,
  in place of the round's post or wait, costs no round of its own.
* A longer one runs ``one_round`` first: a round of its own, a barrier's cost. Its header carries
  the call's size (what the one-round form's header holds, the byte count each rank passed) marked
  ``ROOT_ROUND``, so a rank whose size sends it down the other form meets a mismatch that names
  both sizes, and the two forms of one size never pass for each other.

Either way the headers carry the signature without its root bits, so ranks that disagree on the
root alone reach the comparison that says so (a CollectiveMismatchError naming the root on every
rank, raised by the caller once the round is complete: the group's memory stays usable).
"""

from __future__ import annotations

from ...signatures import without_root
from ...transport.shm_group import ROOT_ROUND


def exchange(ctx, k: int, seq: int, sig: int, nbytes: int, channel, root: int) -> tuple[int, int] | None:
    """Round k's post and wait for a rooted collective's one round: post our slot (``nbytes``, and
    ``root`` as the extra word) under ``sig`` less its root bits, wait for every peer's post and check
    its header; the first (peer, its root) that differs from ``root``, or None when all agree."""
    ctx.exchange(k, seq, without_root(sig), nbytes, channel, root)
    extra = ctx.extra
    for q in range(ctx.size):
        if q != ctx.rank:
            theirs = extra(q, k)
            if theirs != root:
                return q, theirs
    return None


def one_round(ctx, seq: int, sig: int, channel, root: int, nbytes: int) -> tuple[int, int] | None:
    """The check as a round of its own, before a collective of several rounds: ``exchange`` with
    nothing in the slot, its header carrying the call's size ``nbytes`` (as its one-round form's
    does: the bytes this rank passed)."""
    k = ctx.open_round(seq, sig, channel)
    disagreeing = exchange(ctx, k, seq, sig, nbytes | ROOT_ROUND, channel, root)
    ctx.consume(k)
    return disagreeing
