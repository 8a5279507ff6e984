"""Helpers shared by the algorithms: block partitions, the ring steps used by several of them,
per-thread scratch (``scratch``, ``uses_scratch``) and the "receives posted" tokens that keep
large messages from arriving before their receive (``post_ready_token``, ``say_ready``,
``send_when_ready``, ``wants_ready``)."""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable, Sequence

import numpy as np

from ..transport.base import Channel, wait_all
from .thresholds import THRESHOLDS

Reducer = Callable[[np.ndarray, np.ndarray], None]


# Scratch this large or smaller is kept by the thread that used it and handed out again: a fresh
# multi-MiB numpy array is fresh memory from the kernel (glibc gives it back on free), so every call
# paid a page fault and a zeroed page per 4 KiB of scratch written (measured, tcp engine, 2 ranks,
# 4 MiB all_reduce: ~340 faults per call, ~10% of the CPU profile). gloo keeps its algorithms'
# buffers between calls the same way. Larger scratch is allocated per call, as before.
SCRATCH_KEEP_BYTES = 64 << 20
# Below this a fresh array is as cheap (malloc's pools, no page faults) and the small-message path
# skips the thread-local lookup.
SCRATCH_FRESH_BELOW = 64 << 10
_kept = threading.local()


def scratch(count: int, dtype) -> np.ndarray:
    """``count`` uninitialised elements of ``dtype`` for one algorithm call's temporary data.

    The memory is this thread's and is reused by its next call of ``scratch``: an algorithm takes
    at most one scratch array per call, drops it before returning, and is decorated with
    ``uses_scratch`` (one thread runs one collective at a time, so nothing else holds it meanwhile).
    """
    dtype = np.dtype(dtype)
    nbytes = count * dtype.itemsize
    if nbytes < SCRATCH_FRESH_BELOW or nbytes > SCRATCH_KEEP_BYTES:
        return np.empty(count, dtype)
    kept = getattr(_kept, "buf", None)
    if kept is None or kept.nbytes < nbytes:
        kept = _kept.buf = np.empty(nbytes, np.uint8)
    return kept[:nbytes].view(dtype)


def uses_scratch(algorithm: Callable) -> Callable:
    """Decorate an algorithm that takes ``scratch``: if it raises, this thread's kept scratch is
    given up, because receives the failed call left posted (a timed-out peer's, say) may still
    write into it; a later call then gets fresh memory instead."""

    @functools.wraps(algorithm)
    def run(*args, **kwargs):
        try:
            return algorithm(*args, **kwargs)
        except BaseException:
            _kept.buf = None
            raise

    return run


def post_ready_token(ch: Channel, peer: int) -> Any:
    """The receive of ``peer``'s "my receive is posted" token (see ``send_when_ready``).

    Post it before the data receives it announces: the peer sends its token first, and a
    transport matches one peer's messages to the receives in the order they were posted.
    """
    return ch.irecv(peer, _EMPTY)


def send_when_ready(ch: Channel, peer: int, token_in: Any, data: np.ndarray) -> Any:
    """Tell ``peer`` our receives from it are posted, wait for its token (``token_in``, from
    ``post_ready_token``), then send ``data``; returns the data's send request, still pending.

    For large exchanges: a message that arrives before its receive is posted is read by the
    transport into a buffer of its own and copied again later (measured, tcp engine, 2 ranks,
    4 MiB halving-doubling: a third of the 2 MiB messages arrived that way, the peer having
    started the call first). A zero-byte message each way costs one round trip, less than that
    copy from a few hundred KiB up.
    """
    say_ready(ch, peer, token_in)
    return ch.isend(peer, data)


def say_ready(ch: Channel, to: int, token_in: Any) -> None:
    """Send our "receives posted" token to ``to`` and wait for the one ``token_in`` receives
    (posted with ``post_ready_token``; in a ring it comes from the other neighbour)."""
    token_out = send_ready_token(ch, to)
    token_in.wait()
    token_out.wait()


def send_ready_token(ch: Channel, to: int) -> Any:
    """Tell ``to`` that our receives from it are posted (a zero-byte message; the send request)."""
    return ch.isend(to, _EMPTY)


def wants_ready(nbytes: int) -> bool:
    """Whether messages of ``nbytes`` (the largest of an exchange; every rank must pass the same
    value) go out only after the receiver's token: thresholds.py's ``ready_exchange_bytes``."""
    return nbytes >= THRESHOLDS["ready_exchange_bytes"]


_EMPTY = np.empty(0, np.uint8)


def even_counts(count: int, parts: int) -> list[int]:
    """Split ``count`` elements into ``parts`` blocks, the first ``count % parts`` one larger."""
    base, extra = divmod(count, parts)
    return [base + 1 if i < extra else base for i in range(parts)]


def offsets(counts: Sequence[int]) -> list[int]:
    """Start of each block, plus the total at the end (len(counts) + 1 entries)."""
    out = [0]
    for c in counts:
        out.append(out[-1] + int(c))
    return out


def pow2_floor(n: int) -> int:
    """The largest power of two <= n (n >= 1)."""
    return 1 << (n.bit_length() - 1)


def ring_reduce_scatter(
    ch: Channel, buf: np.ndarray, bounds: Sequence[int], start: int, reduce: Reducer, tmp: np.ndarray
) -> int:
    """p-1 ring steps over blocks ``buf[bounds[i]:bounds[i+1]]``; returns the block now complete here.

    At step s this rank sends block (start - s) to the right neighbour and reduces block
    (start - s - 1), received from the left, into its own copy. Each block is reduced along the ring
    once, so every element is computed on exactly one rank. ``tmp`` holds two of the largest block:
    the receive for step s+1 is posted before step s's reduction, so a transport can land the bytes
    in place (no unexpected-message copy) while this rank reduces.
    """
    done, last_send = ring_reduce_scatter_pending(ch, buf, bounds, start, reduce, tmp)
    if last_send is not None:
        last_send.wait()
    return done


def ring_reduce_scatter_pending(
    ch: Channel, buf: np.ndarray, bounds: Sequence[int], start: int, reduce: Reducer, tmp: np.ndarray
) -> tuple[int, Any]:
    """``ring_reduce_scatter``, but its last step's send is returned unfinished (None when there
    was no step) instead of waited for: that send's block is not touched again by the ring, so a
    caller with more to do (the hierarchical all_reduce) waits for it later."""
    p, r = ch.size, ch.rank
    right, left = (r + 1) % p, (r - 1) % p
    half = tmp.size // 2
    slots = (tmp[:half], tmp[half:])

    def post(step: int):
        block = (start - step - 1) % p
        return ch.irecv(left, slots[step % 2][: bounds[block + 1] - bounds[block]])

    send = None
    # large blocks: the first step's data goes out after the right neighbour's token (later steps'
    # receives are posted a step ahead); its receive is posted first, see post_ready_token
    token = post_ready_token(ch, right) if p > 1 and wants_ready(_largest(bounds, buf.itemsize)) else None
    recv = post(0) if p > 1 else None
    if token is not None:
        say_ready(ch, left, token)
    for s in range(p - 1):
        out_block = (start - s) % p
        send = ch.isend(right, buf[bounds[out_block] : bounds[out_block + 1]])
        recv.wait()
        incoming = slots[s % 2]
        if s + 1 < p - 1:
            recv = post(s + 1)  # its slot was consumed by step s-1's reduction
        in_block = (start - s - 1) % p
        lo, hi = bounds[in_block], bounds[in_block + 1]
        reduce(buf[lo:hi], incoming[: hi - lo])
        if s + 1 < p - 1:
            send.wait()  # the next step sends the block just reduced; this one must be out first
    return (start - (p - 1)) % p, send


def ring_allgather(ch: Channel, buf: np.ndarray, bounds: Sequence[int], mine: int) -> None:
    """p-1 ring steps that give every rank every block; this rank starts holding block ``mine``.

    Neighbours are ranks r±1, which must hold blocks mine±1 (true for block = rank, block = rank+1,
    and block = rank - root). Every receive is posted up front, straight into its place in ``buf``
    (no copies); step s forwards the block that step s-1 received.
    """
    p, r = ch.size, ch.rank
    right, left = (r + 1) % p, (r - 1) % p

    def block(i: int) -> np.ndarray:
        i %= p
        return buf[bounds[i] : bounds[i + 1]]

    token = post_ready_token(ch, right) if p > 1 and wants_ready(_largest(bounds, buf.itemsize)) else None
    recvs = [ch.irecv(left, block(mine - s - 1)) for s in range(p - 1)]
    if token is not None:  # every receive is posted: large blocks go out once the right one's are
        say_ready(ch, left, token)
    sends = []
    for s in range(p - 1):
        if s:
            recvs[s - 1].wait()
        sends.append(ch.isend(right, block(mine - s)))
    wait_all(recvs[-1:] + sends)


def _largest(bounds: Sequence[int], itemsize: int) -> int:
    """The largest block's bytes."""
    return max((bounds[i + 1] - bounds[i] for i in range(len(bounds) - 1)), default=0) * itemsize


class Fold:
    """Fold a non-power-of-two group onto its largest power of two, MPICH-style.

    With p = p2 + extra, the first 2*extra ranks pair up: each even one hands its data to the odd
    one after it and sits out; the odd one then acts as virtual rank r // 2, and ranks from 2*extra
    on act as r - extra. Costs two extra rounds of n bytes (in and out) on the paired ranks.
    """

    def __init__(self, rank: int, size: int):
        self.p2 = pow2_floor(size)
        self.extra = size - self.p2
        if rank < 2 * self.extra:
            self.vrank = rank // 2 if rank % 2 else None  # None: sits out
        else:
            self.vrank = rank - self.extra

    def real(self, vrank: int) -> int:
        return 2 * vrank + 1 if vrank < self.extra else vrank + self.extra

    def has_spectator(self, rank: int) -> bool:
        """True for the odd ranks that act for themselves and the even rank before them."""
        return rank < 2 * self.extra and rank % 2 == 1
