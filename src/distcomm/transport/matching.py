"""Message matching: which posted receive gets an arriving message, and what waits for whom.

Why a module of its own: the rules are the subtle part of a point-to-point transport and have no
I/O in them, so they are easier to read (and to test) apart from the socket code. The caller holds
its own lock around every call; nothing here is thread-safe by itself.

The rules (MPI's, which torch.distributed's send/recv/tags follow):

* A message from ``src`` with key ``k`` goes to the *earliest posted* receive that names ``src`` or
  ANY_SOURCE with key ``k`` (posted receives carry a post number, ``order``).
* A message nobody has asked for yet is *unexpected*; a receive posted later takes the oldest
  unexpected message from its source with its key (for ANY_SOURCE: the oldest arrival of all).
* So messages from one source with one key are received in the order they were sent.

Invariant that keeps this cheap: a message is only left unexpected when no posted receive matched
it, so a new receive needs to look at the unexpected messages only, and a new message at the posted
receives only.

Tables are dicts of deques keyed by ``(src, key)`` (or ``key`` for any-source receives); an emptied
deque is deleted at once, since collective keys carry ever-growing sequence numbers.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from .base import ANY_SOURCE


class Unexpected:
    """A message that arrived before its receive was posted: its bytes, complete or still arriving."""

    __slots__ = ("src", "key", "signature", "nbytes", "data", "complete", "arrival")

    def __init__(self, src: int, key, signature: int, nbytes: int, arrival: int, data=None):
        self.src, self.key, self.signature, self.nbytes, self.arrival = src, key, signature, nbytes, arrival
        if data is None:  # still to arrive: a buffer of exactly its size, once the header is known
            self.data = np.empty(nbytes, np.uint8)
            self.complete = nbytes == 0
        else:  # it came whole (a small message): its bytes as they are
            self.data = data
            self.complete = True


class Matcher:
    """The posted-receive and unexpected-message tables of one rank.

    Posted receives are any objects with ``peer`` (source or ANY_SOURCE), ``key`` and a writable
    ``order`` attribute.
    """

    def __init__(self, size: int):
        self.size = size
        self.posted: dict[tuple, deque] = {}  # (src, key) -> receives naming src
        self.posted_any: dict[tuple, deque] = {}  # key -> ANY_SOURCE receives
        self.unexpected: dict[tuple, deque[Unexpected]] = {}  # (src, key) -> messages
        self._counter = 0  # post order and arrival order share one clock

    # -- a receive is posted ------------------------------------------------------------------------
    def take_unexpected(self, src: int, key) -> Unexpected | None:
        """The message a new receive from ``src`` (or ANY_SOURCE) gets, removed; None: post it."""
        if not self.unexpected:
            return None
        if src != ANY_SOURCE:
            q = self.unexpected.get((src, key))
        else:
            q = None
            for s in range(self.size):
                cand = self.unexpected.get((s, key))
                if cand and (q is None or cand[0].arrival < q[0].arrival):
                    q = cand
        if not q:
            return None
        msg = q.popleft()
        if not q:
            del self.unexpected[(msg.src, key)]
        return msg

    def post(self, req) -> None:
        self._counter += 1
        req.order = self._counter
        table, k = (self.posted_any, req.key) if req.peer == ANY_SOURCE else (self.posted, (req.peer, req.key))
        q = table.get(k)
        if q is None:
            table[k] = q = deque()
        q.append(req)

    def post_from(self, req, k: tuple) -> None:
        """``post`` for a receive naming its source, ``k == (req.peer, req.key)`` (the hot path)."""
        self._counter += 1
        req.order = self._counter
        q = self.posted.get(k)
        if q is None:
            self.posted[k] = deque((req,))
        else:
            q.append(req)

    def withdraw(self, req) -> bool:
        """Remove a posted receive that has not matched yet; False if it is not posted."""
        table, k = (self.posted_any, req.key) if req.peer == ANY_SOURCE else (self.posted, (req.peer, req.key))
        q = table.get(k)
        if q is None or req not in q:
            return False
        q.remove(req)
        if not q:
            del table[k]
        return True

    # -- a message arrives ----------------------------------------------------------------------------
    def take_posted(self, src: int, key):
        """The earliest posted receive (naming ``src`` or any source) for this message, removed."""
        q = self.posted.get((src, key))
        qa = self.posted_any.get(key) if self.posted_any else None
        if qa and (not q or qa[0].order < q[0].order):
            q, k, table = qa, key, self.posted_any
        elif q:
            k, table = (src, key), self.posted
        else:
            return None
        req = q.popleft()
        if not q:
            del table[k]
        return req

    def add_unexpected(self, src: int, key, signature: int, nbytes: int, data=None) -> Unexpected:
        """Keep a message nobody has asked for: still arriving, or (``data``) already whole."""
        self._counter += 1
        msg = Unexpected(src, key, signature, nbytes, self._counter, data)
        q = self.unexpected.get((src, key))
        if q is None:
            self.unexpected[(src, key)] = q = deque()
        q.append(msg)
        return msg

    def drop_unexpected(self, msg: Unexpected) -> None:
        """Forget a message that can no longer be delivered (its sender died mid-payload)."""
        q = self.unexpected.get((msg.src, msg.key))
        if q is not None and msg in q:
            q.remove(msg)
            if not q:
                del self.unexpected[(msg.src, msg.key)]

    # -- failures -------------------------------------------------------------------------------------
    def pop_from(self, src: int) -> list:
        """Every posted receive naming ``src``, removed (its sender is gone)."""
        out = []
        for k in [k for k in self.posted if k[0] == src]:
            out.extend(self.posted.pop(k))
        return out

    def pop_any(self) -> list:
        """Every posted ANY_SOURCE receive, removed."""
        out = [r for q in self.posted_any.values() for r in q]
        self.posted_any.clear()
        return out

    def pop_all(self) -> list:
        out = [r for q in self.posted.values() for r in q] + self.pop_any()
        self.posted.clear()
        return out
