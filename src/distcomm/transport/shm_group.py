"""One process group's shared memory for collectives: rounds of slots and two counters per member.

Every member of a group has its own segment for that group (created at the group's first
collective, found by peers through the owner's directory in its world segment): a header with two
counters, ``posted`` and ``consumed``, and ``nslots`` slots of ``slot_bytes`` each. A collective is
a sequence of *rounds*, numbered alike on every member (one counter per group, advanced by the same
collectives with the same sizes). In round k a member may write its slot ``k % nslots`` and set
``posted = k``; read peers' slots of round k once their ``posted >= k``; and set ``consumed = k``
when it is done reading round k. Before writing its slot for round k it waits until every peer has
``consumed >= k - nslots``: the slot's previous contents have been read. That is all the
synchronization there is; every algorithm in ``backends/shm/`` is a loop of rounds (the round API is
documented on ``GroupShm``).

Each slot starts with a header (round, sequence number, signature, byte count, one extra word) that
readers check, so members running different collectives, or the same one with different sizes,
fail with a mismatch naming the peer and saying what differs (``describe_mismatch``) instead of
exchanging the wrong bytes.

Every post also goes into the member's header history (its last HISTORY posts' headers, after the
counters), which outlives the slot's reuse. A member that reads only some peers' slots in a round
(a small rooted collective run whole in C: the root of a broadcast or scatter reads none, their
other members only the root; a reduce's or gather's non-roots none) may *defer* its checks of the
others: it waits for, checks and reads the peers it reads, consumes and returns, and a later call
checks the other members' history entries of that round once they have posted it
(``settle_deferred``; in C, _shm_round.c's shm_settle), at the latest before this member opens a
round HISTORY - nslots later, after which a peer could overwrite them. Peers cannot tell. A
disagreement found then is reported by that later call (``LateDisagreement``).

Two groups on the same ranks have different segments, so concurrent collectives on them (async
work on both) never touch each other's memory.

Where ``_shm_round.c`` is built (and DISTCOMM_SHM_NATIVE is not 0), ``exchange`` and ``consume`` post,
poll, check and consume in one C call each, over the same memory, and the calls in C open their
rounds there too (``Rounds.open_round``: the round number and the consumed floor then live in the C
object, ``GroupShm.round`` reads them); the Python steps remain the reference, and take over
whatever the C call hands back (a sleeping peer to ring, a wait past the poll budget, a mismatch to
report). Ranks with and without them meet in the same rounds.
"""

from __future__ import annotations

import os
import time
from typing import NamedTuple

import numpy as np

from ..signatures import decode, differences
from ..tuning import DEFAULT, Tuning
from .base import TransportError
from .shm_wait import fence

try:
    from . import _shm_round
except ImportError as exc:  # not built here: every round step runs in Python
    _shm_round = None
    #: why the round steps in C are not available here, or None (setup.py builds them; see _shm_round.c)
    C_UNAVAILABLE: str | None = (f"the round steps in C are not built ({exc}): reinstall where a C compiler and "
                                 "Python's headers exist")
else:
    C_UNAVAILABLE = None

#: the C calls' result bits that Python acts on (_shm_round.c); without it there is no C call, so no bits
RING_POSTED, RING_CONSUMED, DIFFERS = (0, 0, 0) if _shm_round is None else (
    _shm_round.RING_POSTED, _shm_round.RING_CONSUMED, _shm_round.DIFFERS)
#: buffer_address(buffer) -> where a C-contiguous buffer's bytes start (None without the C module)
buffer_address = None if _shm_round is None else _shm_round.address
#: whole small collectives on numpy arrays in C (_shm_calls.c), where built with numpy's headers; else None
Calls = _shm_round.Calls if _shm_round is not None and _shm_round.CALLS else None


def rounds_consumed_in_c() -> int:
    """How many rounds this process has consumed through the C steps (0 where they are not built)."""
    return 0 if _shm_round is None else _shm_round.completed()


def rounds_streamed_in_c() -> int:
    """How many rounds this process has written into its slot with streaming stores (_shm_round.c's
    copy_to_slot; 0 where the C steps are not built)."""
    return 0 if _shm_round is None else _shm_round.streamed()

MAGIC = 0x64636F6D6D677270  # "dcommgrp"

# u64 indexes into a group segment's header
_H_MAGIC, _H_GID, _H_SIZE, _H_SLOT_BYTES, _H_NSLOTS = 0, 1, 2, 3, 4
POSTED = 8  # byte 64: own cache line
GAVE_UP = 12  # byte 96: 1 + the sequence number of the call in which this member gave up on the group (else 0)
CONSUMED = 16  # byte 128
REUSING = 20  # byte 160: k while this member waits for every peer's CONSUMED >= k (else 0)
AWAITING = 21  # byte 168: k while this member waits for peers' POSTED >= k (else 0)
AWAIT_FROM = 22  # byte 176: which peers AWAITING means: 0 all others, q + 1 member q, AWAIT_ANY some
AWAIT_ANY = 1 << 63
DEFERRED = 23  # byte 184: the oldest round whose checks this member left to later (settle_deferred), else 0
_OPENED_AT = 192  # one byte per member: "I have mapped this segment"
SLOT_HEADER = 64
# u64 indexes into a slot header
S_ROUND, S_SEQ, S_SIG, S_NBYTES, S_EXTRA = 0, 1, 2, 3, 4
#: each member's last HISTORY posts' headers (the same words, 64 bytes each), after the counters' page
#: start: what deferred checks read once the slots may have been reused (settle_deferred)
HISTORY = 64
H_DEFERRED = 5  # in a member's own history entry: the call (Calls.OPS index + 1) that deferred its checks
#: in a header's byte count, with the call's size: a rooted collective's root check in a round of its
#: own (backends/shm/root_check.one_round). A member running the call's one-round form posts the size
#: alone, so ranks that chose different forms for one call still differ.
ROOT_ROUND = 1 << 62

_clock, _sched_yield = time.perf_counter, os.sched_yield

DEFAULT_SLOT_BYTES = 1 << 20
DEFAULT_NSLOTS = 4
#: slots at most: a deferred check must come due (HISTORY - nslots - 2 rounds on) well before a peer
#: can overwrite the history entry it reads
MAX_NSLOTS = HISTORY // 2


def _align(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def history_offset(size: int) -> int:
    """Where a member's header history starts in its segment of a group of ``size`` members."""
    return _align(_OPENED_AT + size, 64)


def layout(size: int, slot_bytes: int, nslots: int) -> tuple[int, int]:
    """(offset of the first slot, total segment bytes) for a group of ``size`` members."""
    first = _align(history_offset(size) + HISTORY * SLOT_HEADER, 4096)
    return first, first + nslots * _align(SLOT_HEADER + slot_bytes, 4096)


def slot_config(tuning: Tuning = DEFAULT) -> tuple[int, int]:
    """(slot_bytes, nslots): DISTCOMM_SHM_SLOT_BYTES / DISTCOMM_SHM_SLOTS (through ``tuning``) or the defaults."""
    slot = DEFAULT_SLOT_BYTES if tuning.shm_slot_bytes is None else tuning.shm_slot_bytes
    nslots = DEFAULT_NSLOTS if tuning.shm_slots is None else tuning.shm_slots
    if slot < 4096 or slot % 64 or not 2 <= nslots <= MAX_NSLOTS:
        raise ValueError(
            f"DISTCOMM_SHM_SLOT_BYTES={slot} / DISTCOMM_SHM_SLOTS={nslots}: need a multiple of 64 of "
            f"at least 4096 bytes and from 2 to {MAX_NSLOTS} slots"
        )
    return slot, nslots


def init_segment(buf: np.ndarray, gid: int, size: int, slot_bytes: int, nslots: int) -> None:
    words = memoryview(buf[:64]).cast("Q")
    words[_H_GID] = gid
    words[_H_SIZE] = size
    words[_H_SLOT_BYTES] = slot_bytes
    words[_H_NSLOTS] = nslots
    words[_H_MAGIC] = MAGIC


class LateDisagreement(NamedTuple):
    """A deferred round's root check failed when this member settled it (``settle_deferred``): the
    call ``op`` #``seq`` (its name: one of Calls.OPS) had ``root`` here and ``theirs`` at group rank
    ``peer``. The round itself completed, so the group's memory stays usable."""

    op: str
    seq: int
    root: int
    peer: int
    theirs: int
    round: int  # its round: GroupShm.reported(late) once raised

    def describe(self) -> str:
        what = "src" if self.op in ("broadcast", "scatter") else "dst"
        return (f"{self.op} (sequence number {self.seq}, an earlier call whose round this rank checked in full only "
                f"now): this rank called it with {what}={self.root} but group rank {self.peer} with "
                f"{what}={self.theirs}; every rank of the group must pass the same {what}")


class _Numbering:
    """A group's round number and consumed floor where no Rounds in C keeps them (GroupShm._numbering)."""

    __slots__ = ("round", "consumed_floor")

    def __init__(self) -> None:
        self.round = 0
        self.consumed_floor = 0


ROUND_STEPS = ("open_round", "publish", "check_posts", "exchange", "await_posts", "collect", "consume")  # see _build_round_steps


class GroupShm:
    """This rank's view of one group's segments (its own and every member's): the round API.

    A round, as every algorithm of ``backends/shm/`` runs it (``k`` numbers the round alike on
    every member; ``seq``/``sig`` are the call's sequence number and signature, which every post
    carries so that a member running something else fails with a mismatch naming it):

    1. **open**: ``k = open_round(seq, sig, channel)`` numbers the next round and waits until
       every peer has read our slot's previous use; ``slot(k)`` is then ours to write (or
       ``next_round()`` and ``acquire(k, ch)``, which does both for a round numbered earlier);
    2. **write** our slot (``slot(k)``, or typed views of every member's slot: ``views``);
    3. **post**: ``post(k, ch, nbytes, extra)`` publishes the header (round, seq, sig, nbytes,
       one extra word, e.g. a buffer's address; the same words into this member's header
       history) and then ``posted = k``, waking a peer whose wait this completes;
    4. **wait** for the peers' posts of round k and check their headers: ``wait_posted(k, ch,
       nbytes, peers)``. ``exchange(k, seq, sig, nbytes, channel)`` is steps 3 and 4 for the
       common case (post, then wait for every peer), spinning or yielding first without
       publishing anything, so the peers' posts need not look for us (``await_posts`` is its
       step 4 alone, after a ``publish``); ``collect(k, seq, sig,
       nbytes, channel, among)`` is step 4 alone for some members (a root waiting for the others,
       or the others for the root), waiting the same way;
    5. **read** the peers' slots of round k (``data``, ``raw``, ``words``, ``views``, ``extra``);
    6. **consume**: ``consume(k)`` says we are done reading round k (and so every round before
       it), letting peers reuse their slots of round k; ``wait_consumed(k, ch)`` waits until
       every peer has said so (a buffer they read directly may change after that).

    A small rooted call in C may leave its checks of the members it did not read to a later call
    (the module docstring): ``settle_deferred`` makes them; ``deferred`` says whether any are left.

    ``advance(k)``, ``posted(q)`` and ``wait_posted_counter(k, ch)`` move and watch ``posted``
    without a slot: progress within a collective whose data does not pass through slots.

    The waits take the call's Channel for its deadline (``ch``); ``open_round`` and ``exchange``
    take ``channel(seq, sig) -> Channel`` instead, called only if they must sleep, so the latency
    path builds no Channel on its way (its deadline then counts from the start of that sleep).
    A TransportError from any of them (a timeout, a lost peer, a mismatch) leaves the group's
    memory unusable: the caller calls ``give_up``, which sets ``broken`` and tells the peers: a wait
    held up only by members that gave up fails at its next health check, not at its timeout.
    """

    def __init__(self, transport, gid: int, ranks: list[int], rank: int, segments: list, slot_bytes: int, nslots: int):
        self.transport = transport
        self.gid = gid
        self.ranks = list(ranks)  # group rank -> global rank
        self.rank = rank
        self.size = len(ranks)
        self.segments = segments  # by group rank; segments[rank] is ours
        self.slot_bytes = slot_bytes
        self.nslots = nslots
        #: open no round this far past a deferred one before checking it (see settle_deferred)
        self.deferred_due = HISTORY - nslots - 2
        first, _ = layout(self.size, slot_bytes, nslots)
        stride = _align(SLOT_HEADER + slot_bytes, 4096)
        self.ctl = [memoryview(s.buf[:_OPENED_AT]).cast("Q") for s in segments]
        self.headers = [
            [memoryview(s.buf[first + k * stride : first + k * stride + SLOT_HEADER]).cast("Q") for k in range(nslots)]
            for s in segments
        ]
        at = history_offset(self.size)
        self.history = [  # [member][round % HISTORY]: that post's header words
            [memoryview(s.buf[at + j * SLOT_HEADER : at + (j + 1) * SLOT_HEADER]).cast("Q") for j in range(HISTORY)]
            for s in segments
        ]
        self.slots = [
            [s.buf[first + k * stride + SLOT_HEADER : first + k * stride + SLOT_HEADER + slot_bytes] for k in range(nslots)]
            for s in segments
        ]
        self.broken: str | None = None
        self.released = False  # close() was called (destroy_process_group, or the transport closed)
        self._peers = [q for q in range(self.size) if q != rank]
        self._peer_bells = [transport.bell_of(ranks[q]) for q in self._peers]
        self._peer_ctl = [self.ctl[q] for q in self._peers]
        self._peer_info = [(q, self.ctl[q], bell) for q, bell in zip(self._peers, self._peer_bells)]
        self._others = [[x for x in range(self.size) if x != q] for q in range(self.size)]
        self._mine = self.ctl[rank]
        self._my_headers = self.headers[rank]
        self._my_slots = self.slots[rank]
        self._raw = [[memoryview(b) for b in per] for per in self.slots]
        self._words = [[m.cast("q") for m in per] for per in self._raw]
        self._views: dict = {}
        self._views_dtype = self._views_count = self._views_last = None
        #: the round steps in C over this group's memory (None: Python's; see the module docstring)
        self.native = None
        if _shm_round is not None and transport.tuning.shm_native:
            policy = transport.policy
            yields = policy.spin_s == 0  # more ranks than cores: yield while polling, as _poll_posted does
            budget = policy.yield_s if yields else policy.spin_s
            self.native = _shm_round.Rounds(**self.native_layout(), budget_ns=int(budget * 1e9), yields=yields)
        # the last round opened and a lower bound of every peer's CONSUMED (acquire's cache): in C
        # where the round steps are (the calls in C open rounds there too), else here
        self._numbering = self.native if self.native is not None else _Numbering()
        self._build_round_steps()
        for q in self._peers:  # tell each owner we have mapped its segment
            segments[q].buf[_OPENED_AT + rank] = 1
            transport.bell_of(ranks[q]).ring()

    def _build_round_steps(self) -> None:
        """The steps every round takes, as closures over this group's memory, set as instance
        attributes: ``open_round``, ``publish``, ``check_posts``, ``exchange``, ``collect``, ``consume``. Every
        algorithm and the latency path call these same functions; closures because the latency
        path takes three of them per call, and a bound method's lookups of ``self`` attributes cost
        it a measurable part of a small barrier (docs/performance-notes.md)."""
        nslots = self.nslots
        mine, my_headers, headers, ctl = self._mine, self._my_headers, self.headers, self.ctl
        my_history = self.history[self.rank]
        due = self.deferred_due
        peers, peer_ctl = self._peers, self._peer_ctl
        poll_posted, wait_posts, mismatch = self._poll_posted, self._wait_posts, self._mismatch
        ring_posted, ring_consumed, reserve = self.ring_posted, self.ring_consumed, self._reserve

        news, check_members, members = self.transport.crash_news, self.transport.check_members, self.ranks
        numbering = self._numbering

        def open_round(seq: int, sig: int, channel) -> int:
            """The next round's number, once every peer has read our slot's previous use (step 1).
            ``channel(seq, sig)`` makes the call's Channel if we must sleep. A rank of this host
            known to have crashed (one word to read) fails the round at once if it is a member.
            (The calls in C take the common case themselves: Rounds.open_round.)"""
            if news[0]:
                check_members(members)
            deferred = mine[DEFERRED]
            if deferred and numbering.round - deferred >= due:
                # due now (the calls in C and ShmCollectives check earlier, and can raise a root that
                # differs once their call has completed; here it can only fail the round)
                late = self.settle_deferred(seq, sig, channel)
                if late is not None:
                    raise TransportError(late.describe(), peer=self.ranks[late.peer], reason="mismatch")
            k = numbering.round = numbering.round + 1
            need = k - nslots
            if need > numbering.consumed_floor:  # the floor only rises: most rounds read no counter at all
                reserve(need, seq, sig, channel)
            return k

        def publish(k: int, seq: int, sig: int, nbytes: int, extra: int = 0) -> None:
            """Step 3 with the call's numbers: the header of my slot of round k, then ``posted = k``,
            then a ring for each peer whose wait this completes (see _wake_posted)."""
            h = my_headers[k % nslots]
            h[S_SEQ] = seq
            h[S_SIG] = sig
            h[S_NBYTES] = nbytes
            h[S_EXTRA] = extra
            h[S_ROUND] = k
            h = my_history[k % HISTORY]
            h[S_SEQ] = seq
            h[S_SIG] = sig
            h[S_NBYTES] = nbytes
            h[S_EXTRA] = extra
            h[H_DEFERRED] = 0
            h[S_ROUND] = k
            mine[POSTED] = k
            fence()
            for c in peer_ctl:
                if c[AWAITING]:  # someone asleep: see whom this post completes
                    ring_posted()
                    break

        def check_posts(k: int, seq: int, sig: int, nbytes: int | None, among=peers) -> None:
            """Raise a mismatch naming the first of ``among`` whose header of round k is not ours."""
            slot = k % nslots
            for q in among:
                h = headers[q][slot]
                if h[S_ROUND] != k or h[S_SEQ] != seq or h[S_SIG] != sig or (nbytes is not None and h[S_NBYTES] != nbytes):
                    raise mismatch(q, k, h, seq, sig, nbytes)

        def exchange(k: int, seq: int, sig: int, nbytes: int, channel, extra: int = 0) -> None:
            """Post round k (our slot holds ``nbytes``), wait until every peer has, check their
            headers (steps 3 and 4: ``publish`` then ``await_posts``)."""
            publish(k, seq, sig, nbytes, extra)
            await_posts(k, seq, sig, nbytes, channel)

        def await_posts(k: int, seq: int, sig: int, nbytes: int, channel, polled: bool = False) -> None:
            """Step 4 after our post of round k: wait until every peer has posted it, check their
            headers. The wait begins by spinning (a core per rank) or yielding (more ranks than
            cores) for the wait policy's spin or yield time without publishing anything (not again
            if the caller has just ``polled`` that long); past that it sleeps as ``wait_posted``
            does, with the Channel ``channel(seq, sig)`` makes."""
            for c in peer_ctl:
                if c[POSTED] < k:
                    if polled or not poll_posted(k):
                        wait_posts(k, channel(seq, sig), peers, 0, True)
                    break
            slot = k % nslots  # check_posts, inline: this is the latency path's step
            for q in peers:
                h = headers[q][slot]
                if h[S_ROUND] != k or h[S_SEQ] != seq or h[S_SIG] != sig or h[S_NBYTES] != nbytes:
                    raise mismatch(q, k, h, seq, sig, nbytes)

        size = self.size

        def collect(k: int, seq: int, sig: int, nbytes: int | None, channel, among) -> None:
            """Step 4 without posting: wait until every member of ``among`` (a sequence of group
            ranks, not this one) has posted round k, polling first as ``exchange`` does, and check
            their headers (``nbytes`` None: any size)."""
            for q in among:
                if ctl[q][POSTED] < k:
                    if not poll_posted(k, among):
                        src = among[0] + 1 if len(among) == 1 else 0 if len(among) == size - 1 else AWAIT_ANY
                        wait_posts(k, channel(seq, sig), among, src, True)
                    break
            check_posts(k, seq, sig, nbytes, among)

        def consume(k: int) -> None:
            """Done reading round k (step 6): peers may reuse their slots of round k."""
            mine[CONSUMED] = k
            fence()
            for c in peer_ctl:
                if c[REUSING]:  # someone waits to reuse a slot: see whom this completes
                    ring_consumed()
                    break

        native = self.native
        if native is not None:  # the same two steps in C: exchange's post and poll, and consume
            c_exchange, c_consume, settle = native.exchange, native.consume, self.settle

            def exchange_in_c(k: int, seq: int, sig: int, nbytes: int, channel, extra: int = 0) -> None:
                status = c_exchange(k, seq, sig, nbytes, extra)
                if status:
                    settle(status, k, seq, sig, nbytes, channel)

            def consume_in_c(k: int) -> None:
                if c_consume(k):
                    ring_consumed()

        self.open_round, self.publish, self.check_posts = open_round, publish, check_posts
        if native is not None:
            self.exchange, self.consume = exchange_in_c, consume_in_c
        else:
            self.exchange, self.consume = exchange, consume
        self.await_posts, self.collect = await_posts, collect
        assert tuple(name for name in ROUND_STEPS if name in self.__dict__) == ROUND_STEPS

    # -- rounds -------------------------------------------------------------------------------
    def settle(self, status: int, k: int, seq: int, sig: int, nbytes: int, channel) -> None:
        """After a C call posted round k and handed it back (``status``, not DONE): ring a peer
        that sleeps, then wait for the posts and check them as ``await_posts`` does (a mismatch
        raises, naming the peer). The round is then ready to read, as after ``exchange``."""
        ring = status & RING_POSTED
        if ring:
            self.ring_posted()
        if self._mine[DEFERRED]:  # before waiting: a member that found a mismatch there posts nothing more
            self.settle_deferred(seq, sig, channel)
        self.await_posts(k, seq, sig, nbytes, channel, not ring)  # without a ring, C polled the whole budget

    @property
    def deferred(self) -> int:
        """The oldest round whose checks this member left to later (see ``settle_deferred``), or 0."""
        return self._mine[DEFERRED]

    def settle_deferred(self, seq: int, sig: int, channel) -> LateDisagreement | None:
        """Every check this member deferred (a small rooted call in C read only the peers it needed:
        the module docstring), now: from the oldest (``DEFERRED``) to its last post, each round whose
        own history entry says it deferred, once every peer has posted it (polling, then sleeping
        with the Channel ``channel(seq, sig)`` of the call settling it), every peer's history entry
        of it against ours (a mismatch raises, naming the peer, as ``exchange`` does). Stops at the
        first peer whose extra word (its root) differs from ours, and returns it as a
        LateDisagreement; that round stays the oldest unchecked one until ``reported(late)``, so a
        later call raises it if this one does not get to. Else None, every check made.

        Called by the calls that can raise a disagreement once they have completed (the calls in C,
        ShmCollectives), and before any wait that may sleep (``settle``, the slot reuse wait), so a
        member whose peer stopped at a mismatch found here stops too instead of waiting for it."""
        mine, history = self._mine, self.history
        for j in range(mine[DEFERRED] or mine[POSTED] + 1, mine[POSTED] + 1):
            h = history[self.rank][j % HISTORY]
            if h[S_ROUND] != j or not h[H_DEFERRED]:
                continue
            for c in self._peer_ctl:
                if c[POSTED] < j:
                    if not self._poll_posted(j):
                        self._wait_posts(j, channel(seq, sig), self._peers, 0, True)
                    break
            for q in self._peers:
                theirs = history[q][j % HISTORY]
                if theirs[S_ROUND] != j or theirs[S_SEQ] != h[S_SEQ] or theirs[S_SIG] != h[S_SIG] or (
                        theirs[S_NBYTES] != h[S_NBYTES]):
                    mine[DEFERRED] = j
                    raise self._mismatch(q, j, theirs, h[S_SEQ], h[S_SIG], h[S_NBYTES])
            for q in self._peers:
                theirs = history[q][j % HISTORY][S_EXTRA]
                if theirs != h[S_EXTRA]:
                    mine[DEFERRED] = j
                    code = h[H_DEFERRED]
                    op = Calls.OPS[code - 1] if Calls is not None and code <= len(Calls.OPS) else "a rooted collective"
                    return LateDisagreement(op, h[S_SEQ], h[S_EXTRA], q, theirs, j)
        mine[DEFERRED] = 0
        return None

    def reported(self, late: LateDisagreement) -> None:
        """``late`` (settle_deferred's) has been raised: the checks go on after its round."""
        if self._mine[DEFERRED] == late.round:
            self._mine[DEFERRED] = late.round + 1

    @property
    def round(self) -> int:
        """The last round this member opened (algorithms that take several rounds at once add to it)."""
        return self._numbering.round

    @round.setter
    def round(self, k: int) -> None:
        self._numbering.round = k

    def next_round(self) -> int:
        numbering = self._numbering
        k = numbering.round = numbering.round + 1
        return k

    def acquire(self, k: int, ch) -> np.ndarray:
        """My slot for round k (uint8, slot_bytes), once every peer has read its previous use."""
        need = k - self.nslots
        if need > self._numbering.consumed_floor:
            self._reserve(need, ch.key.seq, ch.signature, lambda seq, sig: ch)
        return self._my_slots[k % self.nslots]

    def slot(self, k: int) -> np.ndarray:
        """My slot of round k (uint8, slot_bytes): write it between opening and posting round k."""
        return self._my_slots[k % self.nslots]

    def _reserve(self, need: int, seq: int, sig: int, channel) -> None:
        """Wait until every peer's ``consumed >= need``, and raise the cached floor."""
        floor = min([c[CONSUMED] for c in self._peer_ctl])
        if floor < need:
            if self.native is None or not self.native.poll_consumed(need):
                if self._mine[DEFERRED]:  # before waiting (as in settle)
                    self.settle_deferred(seq, sig, channel)
                self._wait_reuse(need, channel(seq, sig))
            floor = min([c[CONSUMED] for c in self._peer_ctl])
        self._numbering.consumed_floor = floor

    def wait_consumed(self, k: int, ch) -> None:
        """Wait until every peer has finished reading round k (and so everything before it)."""
        for c in self._peer_ctl:
            if c[CONSUMED] < k:
                self._wait_reuse(k, ch)
                return

    def _wait_reuse(self, need: int, ch) -> None:
        ctl, peers = self.ctl, self._peers
        mine = self._mine

        def arm() -> None:  # before sleeping: the consumer that completes this rings us (see consume)
            mine[REUSING] = need
            fence()

        try:
            self._wait(lambda: all(ctl[q][CONSUMED] >= need for q in peers), ch, CONSUMED, need, arm=arm)
        finally:
            mine[REUSING] = 0

    def post(self, k: int, ch, nbytes: int, extra: int = 0) -> None:
        """Publish my slot of round k (its header first, then the counter), and wake the peers
        whose wait this completes (see _wake_posters)."""
        self.publish(k, ch.key.seq, ch.signature, nbytes, extra)

    def _poll_posted(self, k: int, among=None) -> bool:
        """Spin or yield until every peer (or every member of ``among``) has posted round k
        (True), at most the policy's budget."""
        policy = self.transport.policy
        yields = policy.spin_s == 0  # more ranks than cores: give the CPU away while waiting
        end = _clock() + (policy.yield_s if yields else policy.spin_s)
        peer_ctl = self._peer_ctl if among is None else [self.ctl[q] for q in among]
        while True:
            if yields:
                _sched_yield()
            for c in peer_ctl:
                if c[POSTED] < k:
                    break
            else:
                return True
            if _clock() >= end:
                return False

    def _wake_posted(self) -> None:
        """After moving my ``posted``: ring the bell of every peer whose wait for posts (its
        ``AWAITING``/``AWAIT_FROM``) is now complete; nobody else is disturbed.

        No lost wake-ups (Dekker's pattern): a waiter about to sleep stores its flag, fences, then
        checks the counters; a poster stores its counter, fences, then reads the flags. Whichever
        fences last sees the other's store: either the waiter finds the counter moved, or the
        poster finds the flag and rings (bumping the bell first, so a waiter between its last
        check and its futex sleep returns at once). With p ranks waiting on each other, only the
        last poster rings anyone; a waiter still spinning or yielding has published nothing and
        costs the poster one read.
        """
        fence()
        self.ring_posted()

    def ring_posted(self) -> None:
        """_wake_posted after its fence: ring the peers whose wait for posts is now complete."""
        ctl = self.ctl
        for q, c, bell in self._peer_info:
            want = c[AWAITING]
            if want:
                src = c[AWAIT_FROM]
                if src == 0:
                    if all(ctl[x][POSTED] >= want for x in self._others[q]):
                        bell.ring()
                elif src == AWAIT_ANY or ctl[src - 1][POSTED] >= want:
                    bell.ring()

    def advance(self, k: int, wake: bool = True) -> None:
        """Set ``posted = k`` without a slot: progress within a collective (see allreduce_readv).
        ``wake=False``: no peer waits for ``k`` itself (they poll ``posted``, and wait only for a
        later value), so nobody needs a look."""
        self._mine[POSTED] = k
        if wake:
            self._wake_posted()

    def posted(self, q: int) -> int:
        return self.ctl[q][POSTED]

    def wait_posted_counter(self, k: int, ch) -> None:
        """Wait until every peer's ``posted >= k`` (no slot header to check)."""
        for c in self._peer_ctl:
            if c[POSTED] < k:
                self._wait_posts(k, ch, self._peers, 0)
                return

    def wait_posted(self, k: int, ch, nbytes: int | None, peers=None) -> None:
        """Wait until ``peers`` (default: all others) have posted round k; check their headers."""
        ctl = self.ctl
        if peers is None:
            peers = self._peers
            for c in self._peer_ctl:
                if c[POSTED] < k:
                    self._wait_posts(k, ch, peers, 0)
                    break
        else:
            for q in peers:
                if ctl[q][POSTED] < k:
                    src = peers[0] + 1 if len(peers) == 1 else 0 if len(peers) == self.size - 1 else AWAIT_ANY
                    self._wait_posts(k, ch, peers, src)
                    break
        self.check_posts(k, ch.key.seq, ch.signature, nbytes, peers)

    def _wait_posts(self, k: int, ch, peers, src: int, polled: bool = False) -> None:
        """Wait until every member of ``peers`` has ``posted >= k``; ``src`` says whom to a poster
        (0: all others, q + 1: member q alone, AWAIT_ANY: some others; see _wake_posted); ``polled``:
        the caller has just polled (``_poll_posted``), so the wait does not spin again."""
        ctl = self.ctl
        mine = self._mine

        def arm() -> None:  # before sleeping: the poster that completes this rings us
            mine[AWAIT_FROM] = src
            mine[AWAITING] = k  # after AWAIT_FROM: a poster that sees this flag sees whom it names
            fence()

        try:
            self._wait(lambda: all(ctl[q][POSTED] >= k for q in peers), ch, POSTED, k, peers, arm, polled)
        finally:
            mine[AWAITING] = 0

    def _mismatch(self, q: int, k: int, h, seq: int, sig: int, nbytes: int | None) -> TransportError:
        peer = self.ranks[q]
        # read once: the peer may be writing its next post
        theirs = (int(h[S_ROUND]), int(h[S_SEQ]), int(h[S_SIG]), int(h[S_NBYTES]))
        return TransportError(describe_mismatch(peer, k, seq, sig, nbytes, *theirs), peer=peer, reason="mismatch")

    def views(self, k: int, dtype: np.dtype, count: int) -> list[np.ndarray]:
        """Every member's slot of round k as ``count`` elements of ``dtype`` (cached: the latency
        path reuses the same few views call after call; the last dtype and count are looked up
        without hashing anything)."""
        if dtype is self._views_dtype and count == self._views_count:
            return self._views_last[k % self.nslots]
        key = (dtype, count)
        per_slot = self._views.get(key)
        if per_slot is None:
            if len(self._views) >= 64:
                self._views.clear()
            nbytes = count * dtype.itemsize
            per_slot = self._views[key] = [
                [self.slots[q][s][:nbytes].view(dtype) for q in range(self.size)] for s in range(self.nslots)
            ]
        self._views_dtype, self._views_count, self._views_last = dtype, count, per_slot
        return per_slot[k % self.nslots]

    def native_layout(self) -> dict:
        """Where this group's memory lies in this process, for the round in C (backends/shm/native.py):
        every member's counters, slot headers and slots by address, and the word indexes defined
        above, so that this module stays their only definition. The segments' arrays are passed
        along: while they live, a segment's close leaves its mapping in place (Segment.close), so
        the addresses stay valid for as long as the C object holding them."""
        first, _ = layout(self.size, self.slot_bytes, self.nslots)
        stride = _align(SLOT_HEADER + self.slot_bytes, 4096)
        bases = [s.address for s in self.segments]
        headers = [b + first + k * stride for b in bases for k in range(self.nslots)]
        news = self.transport.crash_news
        return dict(rank=self.rank, size=self.size, nslots=self.nslots, slot_bytes=self.slot_bytes, ctl=bases,
                    headers=headers, slots=[h + SLOT_HEADER for h in headers], posted=POSTED, consumed=CONSUMED,
                    reusing=REUSING, awaiting=AWAITING, deferred=DEFERRED, s_round=S_ROUND, s_seq=S_SEQ, s_sig=S_SIG,
                    s_nbytes=S_NBYTES, history=[b + history_offset(self.size) for b in bases], history_len=HISTORY,
                    h_deferred=H_DEFERRED, due=self.deferred_due, news=_shm_round.address(news), s_extra=S_EXTRA,
                    keepalive=tuple(s.buf for s in self.segments) + (news,))

    def raw(self, q: int, k: int) -> memoryview:
        """Member q's slot of round k as a memoryview of bytes (cached: slicing and copying a
        memoryview costs a fraction of numpy's per-call overhead on small pieces)."""
        return self._raw[q][k % self.nslots]

    def words(self, q: int, k: int) -> memoryview:
        """Member q's slot of round k as signed 64-bit words (cached memoryview)."""
        return self._words[q][k % self.nslots]

    def extra(self, q: int, k: int) -> int:
        return self.headers[q][k % self.nslots][S_EXTRA]

    def data(self, q: int, k: int) -> np.ndarray:
        """Member q's slot of round k (uint8)."""
        return self.slots[q][k % self.nslots]

    def ring_consumed(self) -> None:
        """After ``consumed`` moved (and a fence): ring each peer waiting to reuse a slot (its
        ``REUSING``) whose wait is now complete (Dekker's pattern, as in _wake_posted)."""
        ctl = self.ctl
        for q, c, bell in self._peer_info:
            need = c[REUSING]
            if need and all(ctl[x][CONSUMED] >= need for x in self._others[q]):
                bell.ring()

    # -- giving up ----------------------------------------------------------------------------
    def give_up(self, reason: str, seq: int, withdraw: bool = True) -> None:
        """This member's call ``seq`` failed mid-collective (``reason``): the group's memory is
        unusable. Say so in this member's header (peers waiting only for members that gave up fail
        at their next health check, naming one), and, with ``withdraw``, take back the post of the round it did not
        finish (``posted`` back to ``consumed``): a late peer must not complete the call with this
        member's data (or read its buffer) while this member reports the call failed. A peer that
        read the round before this point completes it: the failure came at the deadline's edge.
        A mismatch keeps its post (``withdraw`` False), so the peer reads the header and reports
        what differs, as this member did."""
        self.broken = reason
        mine = self._mine
        if not mine[GAVE_UP]:
            mine[GAVE_UP] = seq + 1
        if withdraw and mine[POSTED] > mine[CONSUMED]:
            mine[POSTED] = mine[CONSUMED]
        fence()
        for bell in self._peer_bells:  # a peer asleep on this member wakes, and checks sooner
            bell.ring()

    def _gave_up(self, peers, counter: int, value: int) -> None:
        """Raise if every member of ``peers`` whose ``counter`` is still below ``value`` gave up on
        the group (``give_up``): what this member waits for never comes. While one of them has not,
        the wait goes on, and its timeout names that one: the rank that is late, not the one that
        gave up on it first."""
        if self.released:
            raise released_error()
        ctl = self.ctl
        pending = [q for q in peers if ctl[q][counter] < value]
        if pending and all(ctl[q][GAVE_UP] for q in pending):
            q = pending[0]
            raise TransportError(
                f"rank {self.ranks[q]} gave up on this group after an error in its call "
                f"#{int(ctl[q][GAVE_UP]) - 1} (its error and output say why), so this call cannot complete; "
                "destroy the process group and create it again", peer=self.ranks[q], reason="gave up")

    # -- waiting and health -------------------------------------------------------------------
    def _wait(self, ready, ch, counter: int, value: int, peers=None, arm=None, polled: bool = False) -> None:
        peers = self._peers if peers is None else peers
        globals_ = [self.ranks[q] for q in self._peers]

        def laggard() -> int:  # a member that is late, before one that gave up on the late one
            ctl = self.ctl
            pending = [q for q in peers if ctl[q][counter] < value] or list(peers)
            return next((q for q in pending if not ctl[q][GAVE_UP]), pending[0])

        def on_timeout() -> TransportError:
            q = laggard()
            what = "post its data" if counter == POSTED else "finish reading earlier data"
            return TransportError(
                f"Timed out waiting for rank {self.ranks[q]} to {what} (round {value})",
                peer=self.ranks[q],
                reason="timeout",
            )

        self.transport.wait_for(ready, ch.deadline, globals_, on_timeout, arm, polled,
                                also=lambda: self._gave_up(peers, counter, value))

    def unlink_when_mapped(self, deadline: float | None, gave_up=None) -> None:
        """Wait until every member has mapped our segment, then let go of its name (setup's last
        step: from here on no process can open it; the memory goes with the last mapping).
        ``gave_up(members)``, run with the peers' health checks, raises if one of ``members`` (group
        ranks that have not mapped it yet) gave up setting the group up: it never will."""
        buf = self.segments[self.rank].buf
        peers = self._peers

        def ready() -> bool:
            return all(buf[_OPENED_AT + q] for q in peers)

        def on_timeout() -> TransportError:
            q = next((q for q in peers if not buf[_OPENED_AT + q]), peers[0])
            return TransportError(
                f"Timed out waiting for rank {self.ranks[q]} to map this group's shared memory",
                peer=self.ranks[q],
                reason="timeout",
            )

        also = None if gave_up is None else (lambda: gave_up([q for q in peers if not buf[_OPENED_AT + q]]))
        self.transport.wait_for(ready, deadline, [self.ranks[q] for q in peers], on_timeout, also=also)
        self.segments[self.rank].unlink()

    def close(self) -> None:
        """Unlink our segment (if still named) and let go of every member's mapping.

        A thread of this process may still be in a call on the group (destroy_process_group from
        another thread): its wait fails at its next health check, and a round step it takes from
        here on raises, both with the TransportError ``released_error`` makes, never a stray
        exception. The mappings stay while that call holds this object's views of them."""
        self.broken = self.broken or "the transport was closed"
        self.released = True
        self.native = None
        # The round steps are closures over this object: without them it is freed (and its views
        # of the mappings with it) as soon as the last caller lets go, not at the next gc pass. In
        # their place, steps that raise (they hold nothing of this object).
        for step in ROUND_STEPS:
            self.__dict__[step] = _released_step
        for seg in self.segments:
            seg.close()
        self.transport.bell.ring()  # a thread of ours asleep in a wait on this group checks now


def released_error() -> TransportError:
    """The error of a call still running on a group whose shared memory was let go of."""
    return TransportError(
        "the process group was destroyed (destroy_process_group, from another thread) while this call was in "
        "progress on it; a group must not be destroyed while a thread still uses it: wait for its calls first",
        reason="error")


def _released_step(*args, **kwargs):
    """A round step of a group whose shared memory was let go of (see GroupShm.close)."""
    raise released_error()


_SAME_CALLS = "every rank of the group must make the same collective calls, in the same order"
_FIELD_WORDS = {"dtype": "dtype", "reduce_op": "reduce op", "size": "size"}


def describe_mismatch(peer: int, k: int, seq: int, sig: int, nbytes: int | None, their_round: int, their_seq: int,
                      their_sig: int, their_nbytes: int) -> str:
    """What differs between this rank's round k (call ``seq``, ``sig``, ``nbytes``; None: any size)
    and global rank ``peer``'s header for it, in words: which call, which collective, which dtype,
    reduce op, root or size, each with both ranks' values, and what to do."""
    mine, theirs = decode(sig), decode(their_sig)
    if their_round != k:
        return (f"rank {peer} is out of step with this rank on this group's shared memory: its slot of round {k} "
                f"holds round {their_round} (call #{their_seq}, {theirs.describe()}) where this rank is in call "
                f"#{seq}, {mine.describe()}; an earlier call took a different number of rounds on the two ranks "
                f"(they called different collectives, or one with different sizes): {_SAME_CALLS}, with the "
                "same sizes")
    if their_seq != seq:
        return (f"rank {peer} is at call #{their_seq} of this group ({theirs.describe()}) where this rank is at "
                f"call #{seq} ({mine.describe()}): one of them skipped a collective call or made an extra one; "
                f"{_SAME_CALLS}")
    fields = differences(sig, their_sig)
    if fields == ["op"]:
        return (f"at call #{seq} of this group this rank called {mine.describe()} but rank {peer} called "
                f"{theirs.describe()}; {_SAME_CALLS}")
    if nbytes is not None:
        size, their_size = nbytes & ~ROOT_ROUND, their_nbytes & ~ROOT_ROUND
        if size != their_size:
            fields.append("size")
        elif not fields and nbytes != their_nbytes:
            own, other = ("this rank", f"rank {peer}") if nbytes & ROOT_ROUND else (f"rank {peer}", "this rank")
            return (f"in {mine.op} #{seq} ({mine.describe()}, {size} bytes) {own} checked the root in a round of "
                    f"its own and {other} in the call's only round: the ranks chose different algorithms for the "
                    "same call; set the DISTCOMM_SHM_* variables alike on every rank")
    if not fields:  # nothing in the header differs now: it changed while we read it
        return (f"rank {peer}'s header of round {k} changed while this rank checked it (call #{their_seq}, "
                f"{theirs.describe()}, {their_nbytes & ~ROOT_ROUND} bytes; this rank: call #{seq}, "
                f"{mine.describe()}): {_SAME_CALLS}")

    def values(d, n: int) -> str:
        return " and ".join(f"{n & ~ROOT_ROUND} bytes" if f == "size" else d.argument(f) for f in fields)

    what = " and ".join(_FIELD_WORDS.get(f) or mine.argument(f).split("=")[0] for f in fields)
    return (f"in {mine.op} #{seq} this rank passed {values(mine, nbytes or 0)} but rank {peer} passed "
            f"{values(theirs, their_nbytes)}; every rank of the group must pass the same {what}")
