"""One process group's shared memory for collectives: rounds of slots and two counters per member.

Every member of a group has its own segment for that group (created at the group's first
collective, found by peers through the owner's directory in its world segment): a header with two
counters, ``posted`` and ``consumed``, and ``nslots`` slots of ``slot_bytes`` each. A collective is
a sequence of *rounds*, numbered alike on every member (one counter per group, advanced by the same
collectives with the same sizes). In round k a member may write its slot ``k % nslots`` and set
``posted = k``; read peers' slots of round k once their ``posted >= k``; and set ``consumed = k``
when it is done reading round k. Before writing its slot for round k it waits until every peer has
``consumed >= k - nslots``: the slot's previous contents have been read. That is all the
synchronization there is; every collective in ``backends/shm_collectives.py`` is a loop of rounds.

Each slot starts with a header (round, sequence number, signature, byte count, one extra word) that
readers check, so members running different collectives, or the same one with different sizes,
fail with a mismatch naming the peer instead of exchanging the wrong bytes.

Two groups on the same ranks have different segments, so concurrent collectives on them (async
work on both) never touch each other's memory.
"""

from __future__ import annotations

import os

import numpy as np

from .base import TransportError
from .shm_wait import fence

MAGIC = 0x64636F6D6D677270  # "dcommgrp"

# u64 indexes into a group segment's header
_H_MAGIC, _H_GID, _H_SIZE, _H_SLOT_BYTES, _H_NSLOTS = 0, 1, 2, 3, 4
POSTED = 8  # byte 64: own cache line
CONSUMED = 16  # byte 128
REUSING = 20  # byte 160: k while this member waits for every peer's CONSUMED >= k (else 0)
AWAITING = 21  # byte 168: k while this member waits for every peer's POSTED >= k (else 0)
_OPENED_AT = 192  # one byte per member: "I have mapped this segment"
SLOT_HEADER = 64
# u64 indexes into a slot header
S_ROUND, S_SEQ, S_SIG, S_NBYTES, S_EXTRA = 0, 1, 2, 3, 4

DEFAULT_SLOT_BYTES = 1 << 20
DEFAULT_NSLOTS = 4


def _align(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def layout(size: int, slot_bytes: int, nslots: int) -> tuple[int, int]:
    """(offset of the first slot, total segment bytes) for a group of ``size`` members."""
    first = _align(_OPENED_AT + size, 4096)
    return first, first + nslots * _align(SLOT_HEADER + slot_bytes, 4096)


def slot_config() -> tuple[int, int]:
    """(slot_bytes, nslots): DISTCOMM_SHM_SLOT_BYTES / DISTCOMM_SHM_SLOTS or the defaults."""
    slot = int(os.environ.get("DISTCOMM_SHM_SLOT_BYTES", DEFAULT_SLOT_BYTES))
    nslots = int(os.environ.get("DISTCOMM_SHM_SLOTS", DEFAULT_NSLOTS))
    if slot < 4096 or slot % 64 or nslots < 2:
        raise ValueError(
            f"DISTCOMM_SHM_SLOT_BYTES={slot} / DISTCOMM_SHM_SLOTS={nslots}: need a multiple of 64 of "
            "at least 4096 bytes and at least 2 slots"
        )
    return slot, nslots


def init_segment(buf: np.ndarray, gid: int, size: int, slot_bytes: int, nslots: int) -> None:
    words = memoryview(buf[:64]).cast("Q")
    words[_H_GID] = gid
    words[_H_SIZE] = size
    words[_H_SLOT_BYTES] = slot_bytes
    words[_H_NSLOTS] = nslots
    words[_H_MAGIC] = MAGIC


class GroupShm:
    """This rank's view of one group's segments (its own and every member's)."""

    def __init__(self, transport, gid: int, ranks: list[int], rank: int, segments: list, slot_bytes: int, nslots: int):
        self.transport = transport
        self.gid = gid
        self.ranks = list(ranks)  # group rank -> global rank
        self.rank = rank
        self.size = len(ranks)
        self.segments = segments  # by group rank; segments[rank] is ours
        self.slot_bytes = slot_bytes
        self.nslots = nslots
        first, _ = layout(self.size, slot_bytes, nslots)
        stride = _align(SLOT_HEADER + slot_bytes, 4096)
        self.ctl = [memoryview(s.buf[:_OPENED_AT]).cast("Q") for s in segments]
        self.headers = [
            [memoryview(s.buf[first + k * stride : first + k * stride + SLOT_HEADER]).cast("Q") for k in range(nslots)]
            for s in segments
        ]
        self.slots = [
            [s.buf[first + k * stride + SLOT_HEADER : first + k * stride + SLOT_HEADER + slot_bytes] for k in range(nslots)]
            for s in segments
        ]
        self.round = 0
        self.broken: str | None = None
        self._peers = [q for q in range(self.size) if q != rank]
        self._peer_bells = [transport.bell_of(ranks[q]) for q in self._peers]
        self._peer_ctl = [self.ctl[q] for q in self._peers]
        self._views: dict = {}
        for q in self._peers:  # tell each owner we have mapped its segment
            segments[q].buf[_OPENED_AT + rank] = 1
            transport.bell_of(ranks[q]).ring()

    # -- rounds -------------------------------------------------------------------------------
    def next_round(self) -> int:
        self.round += 1
        return self.round

    def acquire(self, k: int, ch) -> np.ndarray:
        """My slot for round k (uint8, slot_bytes), once every peer has read its previous use."""
        need = k - self.nslots
        if need > 0:
            for c in self._peer_ctl:
                if c[CONSUMED] < need:
                    self._wait_reuse(need, ch)
                    break
        return self.slots[self.rank][k % self.nslots]

    def wait_consumed(self, k: int, ch) -> None:
        """Wait until every peer has finished reading round k (and so everything before it)."""
        if any(c[CONSUMED] < k for c in self._peer_ctl):
            self._wait_reuse(k, ch)

    def _wait_reuse(self, need: int, ch) -> None:
        ctl, peers = self.ctl, self._peers
        mine = ctl[self.rank]
        mine[REUSING] = need  # consumers wake us when the last of them gets there (see consume)
        fence()
        try:
            self._wait(lambda: all(ctl[q][CONSUMED] >= need for q in peers), ch, CONSUMED, need)
        finally:
            mine[REUSING] = 0

    def post(self, k: int, ch, nbytes: int, extra: int = 0) -> None:
        """Publish my slot of round k (its header first, then the counter), and wake the peers
        that this completes (see _notify)."""
        h = self.headers[self.rank][k % self.nslots]
        h[S_SEQ] = ch.key.seq
        h[S_SIG] = ch.signature
        h[S_NBYTES] = nbytes
        h[S_EXTRA] = extra
        h[S_ROUND] = k
        self.ctl[self.rank][POSTED] = k
        self._notify(AWAITING, POSTED)

    def _notify(self, flag: int, counter: int) -> None:
        """After moving ``counter``: bump every peer's bell, and wake a sleeping peer only if it
        waits for something else (``flag`` 0) or if what it waits for (every other member's
        ``counter`` >= its ``flag``) is now complete. With p ranks waiting on each other, p - 1
        of every p posts would otherwise wake sleepers for nothing: each a system call for the
        poster and a trip through the scheduler for the sleeper.

        Lost wake-ups: the waiter stores its flag, fences, then checks; the poster stores its
        counter, bumps the bell, fences, then reads flags and counters. Whichever fences last sees
        both stores; a waiter that still goes to sleep finds the bell moved and returns at once.
        """
        for bell in self._peer_bells:
            bell.bump()
        fence()
        ctl = self.ctl
        size = self.size
        for q, bell in zip(self._peers, self._peer_bells):
            if not bell.sleeping():
                continue
            want = ctl[q][flag]
            if want and not all(ctl[x][counter] >= want for x in range(size) if x != q):
                continue
            bell.ring()

    def advance(self, k: int, wake: bool = True) -> None:
        """Set ``posted = k`` without a slot: progress within a collective (see allreduce_readv).
        ``wake=False`` only bumps the peers' bells (a peer about to sleep looks again; one asleep
        is left alone)."""
        self.ctl[self.rank][POSTED] = k
        for bell in self._peer_bells:
            if wake:
                bell.ring()
            else:
                bell.bump()

    def posted(self, q: int) -> int:
        return self.ctl[q][POSTED]

    def wait_posted_counter(self, k: int, ch) -> None:
        """Wait until every peer's ``posted >= k`` (no slot header to check)."""
        if any(c[POSTED] < k for c in self._peer_ctl):
            peer_ctl = self._peer_ctl
            self._wait(lambda: all(c[POSTED] >= k for c in peer_ctl), ch, POSTED, k)

    def wait_posted(self, k: int, ch, nbytes: int | None, peers=None) -> None:
        """Wait until ``peers`` (default: all others) have posted round k; check their headers."""
        ctl = self.ctl
        if peers is None:
            peers = self._peers
            if not all(c[POSTED] >= k for c in self._peer_ctl):
                mine = ctl[self.rank]
                mine[AWAITING] = k  # the last poster wakes us (see _notify)
                fence()
                try:
                    self._wait(lambda: all(ctl[q][POSTED] >= k for q in peers), ch, POSTED, k, peers)
                finally:
                    mine[AWAITING] = 0
        elif not all(ctl[q][POSTED] >= k for q in peers):
            self._wait(lambda: all(ctl[q][POSTED] >= k for q in peers), ch, POSTED, k, peers)
        slot = k % self.nslots
        seq, sig = ch.key.seq, ch.signature
        for q in peers:
            h = self.headers[q][slot]
            if h[S_ROUND] != k or h[S_SEQ] != seq or h[S_SIG] != sig or (nbytes is not None and h[S_NBYTES] != nbytes):
                raise self._mismatch(q, k, h, ch, nbytes)

    def _mismatch(self, q: int, k: int, h, ch, nbytes: int | None) -> TransportError:
        return TransportError(
            f"rank {self.ranks[q]} is running another collective: its shared-memory slot holds "
            f"sequence number {h[S_SEQ]}, signature {h[S_SIG]:#x}, {h[S_NBYTES]} bytes (round "
            f"{h[S_ROUND]}); this rank expected sequence number {ch.key.seq}, signature "
            f"{ch.signature:#x}"
            + (f", {nbytes} bytes" if nbytes is not None else "")
            + f" (round {k}): the ranks called different collectives, or the same one with "
            "different sizes, dtypes or ops",
            peer=self.ranks[q],
            reason="mismatch",
        )

    def views(self, k: int, dtype: np.dtype, count: int) -> list[np.ndarray]:
        """Every member's slot of round k as ``count`` elements of ``dtype`` (cached: the latency
        path reuses the same few views call after call)."""
        key = (k % self.nslots, dtype, count)
        views = self._views.get(key)
        if views is None:
            if len(self._views) >= 256:
                self._views.clear()
            nbytes = count * dtype.itemsize
            views = self._views[key] = [self.slots[q][key[0]][:nbytes].view(dtype) for q in range(self.size)]
        return views

    def extra(self, q: int, k: int) -> int:
        return self.headers[q][k % self.nslots][S_EXTRA]

    def data(self, q: int, k: int) -> np.ndarray:
        """Member q's slot of round k (uint8)."""
        return self.slots[q][k % self.nslots]

    def consume(self, k: int) -> None:
        """Done reading round k: peers may reuse their slots of round k (a peer waiting for that
        is woken when the last of us gets there; see _notify)."""
        self.ctl[self.rank][CONSUMED] = k
        self._notify(REUSING, CONSUMED)

    # -- waiting and health -------------------------------------------------------------------
    def _wait(self, ready, ch, counter: int, value: int, peers=None) -> None:
        peers = self._peers if peers is None else peers
        globals_ = [self.ranks[q] for q in self._peers]

        def laggard() -> int:
            return next((q for q in peers if self.ctl[q][counter] < value), peers[0])

        def on_timeout() -> TransportError:
            q = laggard()
            what = "post its data" if counter == POSTED else "finish reading earlier data"
            return TransportError(
                f"timed out waiting for rank {self.ranks[q]} to {what} (round {value})",
                peer=self.ranks[q],
                reason="timeout",
            )

        self.transport.wait_for(ready, ch.deadline, globals_, on_timeout)

    def unlink_when_mapped(self, deadline: float | None) -> None:
        """Wait until every member has mapped our segment, then unlink its name (setup's last step:
        from here on nothing of this group is left in /dev/shm, even if the process is killed)."""
        buf = self.segments[self.rank].buf
        peers = self._peers

        def ready() -> bool:
            return all(buf[_OPENED_AT + q] for q in peers)

        def on_timeout() -> TransportError:
            q = next((q for q in peers if not buf[_OPENED_AT + q]), peers[0])
            return TransportError(
                f"timed out waiting for rank {self.ranks[q]} to map this group's shared memory",
                peer=self.ranks[q],
                reason="timeout",
            )

        self.transport.wait_for(ready, deadline, [self.ranks[q] for q in peers], on_timeout)
        self.segments[self.rank].unlink()

    def close(self) -> None:
        """Unlink our segment (if still named) and let go of every member's mapping."""
        self.broken = self.broken or "the transport was closed"
        for seg in self.segments:
            seg.close()
