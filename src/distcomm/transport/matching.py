"""Message matching: which posted receive gets an arriving message, shared by every transport.

Why a module of its own: the rules are the subtle part of a point-to-point transport and have no
I/O in them, so they are easier to read (and to test) apart from the code that moves bytes. The
matcher decides *which* receive a message goes to; the transport moves the bytes its own way (TCP
reads a payload into the matched receive's buffer, shm copies from a ring or reads the sender's
memory, the in-process transport copies between arrays).

The rules (MPI's, which torch.distributed's send/recv/tags follow):

* A message from ``src`` with key ``k`` goes to the *earliest posted* receive that names ``src`` or
  ANY_SOURCE with key ``k``.
* A message nobody has asked for yet is *unexpected*; a receive posted later takes the oldest
  unexpected message from its source with its key (for ANY_SOURCE: the oldest arrival of all).
* So messages from one source with one key are received in the order they were sent.
* A source that *gave up* on a group at call ``seq`` (its own call failed there and it told us,
  ``give_up``) satisfies no receive of that group's collective calls ``seq`` and later: such a
  receive fails (``post`` raises), posted ones are handed back to be failed, and its messages of
  those calls already kept as unexpected are dropped. The late-rank case is exactly that: the
  peer sent its part of the call before its own wait ran out, and a rank arriving late must not
  complete with it a call the peer reported failed. A message matched before the notice came stays
  delivered (the deadline's edge); point-to-point messages are not affected. ``offer`` needs no
  check: a transport that keeps each source's messages in order (TCP) gets no message of those
  calls after the notice, since the source sends none once it gave up.

Invariant that keeps this cheap: a message is only left unexpected when no posted receive matched
it, and a receive is only posted when no unexpected message matched it, so a new receive needs to
look at the unexpected messages only, and a new message at the posted receives only.

**Threads.** A Matcher has no lock: every call must be made under the one lock that already
guards the owning transport's state (TCP's and shm's transport lock, the in-process world's lock,
the hybrid transport's stash lock), so a small message costs no extra lock acquisition.

**Receives** are the transport's own request objects. The matcher reads ``peer`` (the source, or
ANY_SOURCE) and ``key``, and writes ``order`` (its post number); nothing else.

Tables are dicts of deques keyed by ``(src, key)`` (or ``key`` for any-source receives); an emptied
deque is deleted at once, since collective keys carry ever-growing sequence numbers.
"""

from __future__ import annotations

from collections import deque

from ..signatures import decode, describe_receive
from .base import ANY_SOURCE, KIND_COLLECTIVE, TransportError, describe_key


class Unexpected:
    """A message that arrived before its receive was posted.

    The header fields are the matcher's; ``data``, ``complete``, ``error`` and ``sender`` belong to
    the transport, which fills them in as it moves the payload (the matcher never reads them).
    """

    __slots__ = ("src", "key", "signature", "nbytes", "arrival", "data", "complete", "error", "sender")

    def __init__(self, src: int, key, signature: int, nbytes: int, arrival: int):
        self.src, self.key, self.signature, self.nbytes, self.arrival = src, key, signature, nbytes, arrival
        self.data = None  # its payload as the transport keeps it
        self.complete = False  # the whole payload is in ``data``
        self.error: TransportError | None = None  # why the payload cannot be had; its receive fails so
        self.sender = None  # a rendezvous send that completes only when the message is taken

    def __repr__(self) -> str:
        return (f"<Unexpected from rank {self.src} {describe_key(self.key)} {self.nbytes} bytes"
                f"{'' if self.complete else ', arriving'}>")


class Matcher:
    """The posted-receive and unexpected-message tables of one rank (not thread-safe: see above).

    ``post(recv)``                 a new receive: the unexpected message it takes, else posts it
    ``take(src, key)``             the unexpected message such a receive would take, without posting
    ``offer(src, key, sig, n)``    an arrived message: (the receive it matches, None) or (None, kept)
    ``withdraw(recv)``             take back a posted receive (its wait ran out)
    ``discard(msg)``               forget an unexpected message (its payload can never arrive)
    ``posted()``                   the posted receives, for a caller that must fail some
    ``lose(src, any_source)``      remove the receives a lost peer can no longer satisfy
    ``give_up(src, group, seq)``   ``src`` gave up on ``group`` at call ``seq``: what to fail, what to drop
    ``forget_group(group)``        the group was destroyed: drop its gave-up records
    ``clear()``                    remove everything (the transport closes)
    ``mismatch(...)``              the error when a message and its receive disagree, else None
    """

    __slots__ = ("rank", "size", "_posted", "_posted_any", "_unexpected", "_clock", "_gave_up")

    def __init__(self, rank: int, size: int):
        self.rank = rank  # this rank, named in mismatch errors
        self.size = size
        self._posted: dict[tuple, deque] = {}  # (src, key) -> receives naming src
        self._posted_any: dict[tuple, deque] = {}  # key -> ANY_SOURCE receives
        self._unexpected: dict[tuple, deque[Unexpected]] = {}  # (src, key) -> messages
        self._clock = 0  # post order and arrival order share one clock
        # (src, group) -> the first collective call of ``group`` that ``src`` gave up on; empty
        # unless a peer's call failed, so a receive pays one truthiness test for it
        self._gave_up: dict[tuple[int, int], int] = {}

    # -- a receive is posted -------------------------------------------------------------------
    def post(self, recv) -> Unexpected | None:
        """A new receive: the oldest unexpected message it matches, removed (the caller delivers
        it); None when there is none, and then ``recv`` is posted for ``offer`` to find. Raises
        TransportError (reason "gave up") when its source gave up on its call (see ``give_up``)."""
        src, key = recv.peer, recv.key
        if self._gave_up:
            self._refuse(src, key)
        if self._unexpected:
            msg = self.take(src, key)
            if msg is not None:
                return msg
        self._clock += 1
        recv.order = self._clock
        if src == ANY_SOURCE:
            table, k = self._posted_any, key
        else:
            table, k = self._posted, (src, key)
        q = table.get(k)
        if q is None:
            table[k] = deque((recv,))
        else:
            q.append(recv)
        return None

    def take(self, src: int, key) -> Unexpected | None:
        """The oldest unexpected message a receive from ``src`` (or ANY_SOURCE) with ``key`` takes,
        removed; None if there is none. Posts nothing. Raises TransportError (reason "gave up")
        when ``src`` gave up on that call (see ``give_up``)."""
        if self._gave_up:
            self._refuse(src, key)
        unexpected = self._unexpected
        if not unexpected:
            return None
        if src != ANY_SOURCE:
            q = unexpected.get((src, key))
        else:
            q = None
            for s in range(self.size):
                cand = unexpected.get((s, key))
                if cand and (q is None or cand[0].arrival < q[0].arrival):
                    q = cand
        if not q:
            return None
        msg = q.popleft()
        if not q:
            del unexpected[(msg.src, key)]
        return msg

    def withdraw(self, recv) -> bool:
        """Remove a posted receive that has not matched; False if it is not posted (any more)."""
        if recv.peer == ANY_SOURCE:
            table, k = self._posted_any, recv.key
        else:
            table, k = self._posted, (recv.peer, recv.key)
        q = table.get(k)
        if q is None or recv not in q:
            return False
        q.remove(recv)
        if not q:
            del table[k]
        return True

    # -- a message arrives ---------------------------------------------------------------------
    def offer(self, src: int, key, signature: int, nbytes: int) -> tuple:
        """A message's header has arrived: ``(receive, None)`` with the earliest posted receive it
        matches, removed (check it with ``mismatch``, then move the payload into it); or
        ``(None, msg)`` with the new Unexpected entry it is now kept as (the caller fills in
        ``msg.data`` and sets ``msg.complete``)."""
        k = (src, key)
        q = self._posted.get(k)
        if self._posted_any:
            qa = self._posted_any.get(key)
            if qa and (not q or qa[0].order < q[0].order):
                recv = qa.popleft()
                if not qa:
                    del self._posted_any[key]
                return recv, None
        if q:
            recv = q.popleft()
            if not q:
                del self._posted[k]
            return recv, None
        self._clock += 1
        msg = Unexpected(src, key, signature, nbytes, self._clock)
        q = self._unexpected.get(k)
        if q is None:
            self._unexpected[k] = deque((msg,))
        else:
            q.append(msg)
        return None, msg

    def discard(self, msg: Unexpected) -> bool:
        """Forget an unexpected message no receive has taken; False if it is not kept (any more)."""
        k = (msg.src, msg.key)
        q = self._unexpected.get(k)
        if q is None or msg not in q:
            return False
        q.remove(msg)
        if not q:
            del self._unexpected[k]
        return True

    def posted(self) -> list:
        """Every posted receive (nothing removed)."""
        return [r for q in self._posted.values() for r in q] + [r for q in self._posted_any.values() for r in q]

    def has_unexpected(self) -> bool:
        return bool(self._unexpected)

    def unexpected(self, src: int = ANY_SOURCE) -> list[Unexpected]:
        """The unexpected messages (from ``src``, or from anyone), oldest first; nothing removed."""
        msgs = [m for (s, _), q in self._unexpected.items() if src in (ANY_SOURCE, s) for m in q]
        msgs.sort(key=lambda m: m.arrival)
        return msgs

    # -- failures ------------------------------------------------------------------------------
    def lose(self, src: int, any_source: bool) -> list:
        """Every posted receive naming ``src`` (whose sender is gone), and with ``any_source`` every
        ANY_SOURCE receive too, removed. Unexpected messages from ``src`` stay deliverable."""
        out = []
        for k in [k for k in self._posted if k[0] == src]:
            out.extend(self._posted.pop(k))
        if any_source:
            out.extend(r for q in self._posted_any.values() for r in q)
            self._posted_any.clear()
        return out

    def give_up(self, src: int, group: int, seq: int) -> tuple[list, list[Unexpected]]:
        """Rank ``src`` gave up on ``group`` in its collective call ``seq``: from now on no receive
        of that group's collective calls ``seq`` and later is satisfied by ``src`` (``post`` and
        ``take`` raise). Returns ``(receives, messages)``, both removed: the posted receives naming
        ``src`` for those calls (the caller fails them, e.g. with ``gave_up_error``), and the
        unexpected messages of those calls from ``src`` (which can never be taken now: the caller
        lets go of their payloads). Any-source receives and point-to-point keys are left alone.
        A second notice for the group keeps the earlier call."""
        k = (src, group)
        known = self._gave_up.get(k)
        if known is not None and known <= seq:
            seq = known
        self._gave_up[k] = seq

        def hit(key) -> bool:
            return key[0] == group and key[1] == KIND_COLLECTIVE and key[2] >= seq

        recvs = []
        for pk in [pk for pk in self._posted if pk[0] == src and hit(pk[1])]:
            recvs.extend(self._posted.pop(pk))
        msgs = []
        for uk in [uk for uk in self._unexpected if uk[0] == src and hit(uk[1])]:
            msgs.extend(self._unexpected.pop(uk))
        msgs.sort(key=lambda m: m.arrival)
        return recvs, msgs

    def gave_up_at(self, src: int, key) -> int | None:
        """The call at which ``src`` gave up on ``key``'s group, if that covers ``key`` (a collective
        key of that call or a later one); else None."""
        if key[1] != KIND_COLLECTIVE:
            return None
        at = self._gave_up.get((src, key[0]))
        return at if at is not None and key[2] >= at else None

    def gave_up_error(self, src: int, key) -> TransportError:
        """The error of a receive from ``src`` for ``key``, a call that ``src`` gave up on."""
        at = self.gave_up_at(src, key)
        return TransportError(
            f"rank {src} gave up on this group after an error in its call #{at} (its error and output say why), "
            f"so {describe_key(key)} cannot complete on rank {self.rank}; destroy the process group and create it "
            "again", peer=src, reason="gave up")

    def _refuse(self, src: int, key) -> None:
        if self.gave_up_at(src, key) is not None:
            raise self.gave_up_error(src, key)

    def forget_group(self, group: int) -> None:
        """Group ``group`` was destroyed: drop its gave-up records (its ids are not reused, but
        the records need not outlive it)."""
        for k in [k for k in self._gave_up if k[1] == group]:
            del self._gave_up[k]

    def clear(self) -> tuple[list, list[Unexpected]]:
        """(every posted receive, every unexpected message), all removed."""
        recvs = [r for q in self._posted.values() for r in q] + [r for q in self._posted_any.values() for r in q]
        msgs = self.unexpected()
        self._posted.clear()
        self._posted_any.clear()
        self._unexpected.clear()
        self._gave_up.clear()
        return recvs, msgs

    # -- checks --------------------------------------------------------------------------------
    def mismatch(self, key, src: int, signature: int, nbytes: int, want_signature: int,
                 want_nbytes: int) -> TransportError | None:
        """None if a message from ``src`` (``signature``, ``nbytes``) fits the receive expecting
        ``want_signature`` and ``want_nbytes``; else the error to fail that receive with."""
        problems = []
        if nbytes != want_nbytes:
            problems.append(f"rank {self.rank} expects {want_nbytes} bytes but rank {src} sent {nbytes} bytes")
        if signature != want_signature:
            problems.append(f"rank {self.rank} is in {describe_receive(want_signature)} but rank {src} sent a "
                            f"message of {decode(signature).describe()} (signatures {want_signature:#010x} and "
                            f"{signature:#010x})")
        if not problems:
            return None
        return TransportError(
            f"the message from rank {src} does not match the receive posted on rank {self.rank} for "
            f"{describe_key(key)}: " + "; ".join(problems) + " (the ranks called different collectives, or the "
            "same one with different sizes, dtypes or ops)", peer=src, reason="mismatch")
