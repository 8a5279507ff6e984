"""Parking: the blocking requests a TCPStore server holds until keys are written, their turn in a
line comes, or their deadline passes — a data structure, with no I/O and no clock.

Why a module of its own: who is answered when is the subtle part of the server (a push goes to
exactly one pop, a push wakes one WAIT at a time, a request whose key was deleted meanwhile keeps
waiting, a client that hangs up leaves no request behind), and it is all bookkeeping. Here it is
tested on plain values (tests/test_store_parking.py), like KeyTable; the server's handlers decide
what to answer, and its event loop sends the answers.

A parked request waits in any of:

* ``waiting``, per key: a GET, WAIT or MULTI_GET waiting for its missing keys to be written, oldest
  first. It leaves a key's list when that key is written (``written``, ``wake_oldest``); when its
  last missing key goes, the caller checks it against the table and either answers it or makes it
  ``wait_for`` keys that went missing again.
* a line, named by any hashable: a QUEUE_POP per queue, a BARRIER per key, oldest first.
* the deadline heap, which ``expired`` empties up to a given time.

Each request has an owner (the server's connection), so ``cancel`` drops everything a client that
hung up had parked. Answered, expired and cancelled requests are ``release``d: taken out of the key
lists, their line and their owner's set, and marked done; the heap keeps them until their time
comes and then skips them, because removing from the middle of a heap costs a rebuild. Once such
released entries are most of the heap (and more than a few), it is rebuilt without them: a torch
client's WAIT has no deadline on the wire (it waits until the key exists or its client cancels),
so without this every cancelled WAIT would stay in the heap for good.
"""

from __future__ import annotations

import heapq


class Parked:
    """One parked request: whose it is, the request itself, the keys it waits on, and until when."""

    __slots__ = ("owner", "request", "keys", "missing", "deadline", "line", "done")

    def __init__(self, owner, request, keys, missing, deadline: float, line=None):
        self.owner, self.request, self.keys, self.deadline, self.line = owner, request, keys, deadline, line
        self.missing = set(missing)  # the keys it still waits to be written
        self.done = False

    def __lt__(self, other) -> bool:  # heap ties (equal deadlines): any fixed order will do
        return id(self) < id(other)

    def __repr__(self) -> str:
        return f"Parked({self.request!r}, missing={sorted(self.missing)!r}, line={self.line!r}, done={self.done})"


class Parking:
    """Every parked request of one server, indexed by key, by line, by deadline and by owner."""

    __slots__ = ("waiting", "next_deadline", "_lines", "_deadlines", "_owners", "_stale")

    COMPACT_AFTER = 64  # released entries the deadline heap may hold before it is rebuilt without them

    def __init__(self):
        # key -> the requests waiting for it, oldest first. Public so a write can test "does anyone
        # wait?" with one lookup on the hot path, and call ``written`` only when someone does.
        self.waiting: dict = {}
        # The earliest deadline of a request still parked, or None; the event loop's poll timeout.
        # Released requests' entries stay in the heap behind it (see _drop_released_top).
        self.next_deadline: float | None = None
        self._lines: dict = {}
        self._deadlines: list = []
        self._owners: dict = {}
        self._stale = 0  # heap entries of released requests

    def __len__(self) -> int:
        """How many requests are parked."""
        return sum(len(parked) for parked in self._owners.values())

    def park(self, owner, request, deadline: float, keys=(), missing=(), line=None) -> Parked:
        """Hold ``request`` until every key in ``missing`` is written, or its turn comes in ``line``,
        or ``deadline``. ``keys`` are all the keys it asked for, kept for its answer."""
        parked = Parked(owner, request, keys, missing, deadline, line)
        for key in parked.missing:
            self.waiting.setdefault(key, []).append(parked)
        if line is not None:
            self._lines.setdefault(line, []).append(parked)
        heapq.heappush(self._deadlines, (deadline, parked))
        self.next_deadline = self._deadlines[0][0]
        self._owners.setdefault(owner, set()).add(parked)
        return parked

    def release(self, parked: Parked) -> None:
        """``parked`` is answered (or its owner gone): out of every list; a second release does nothing."""
        if parked.done:
            return
        self._release(parked)
        self._stale += 1
        deadlines = self._deadlines
        if deadlines[0][1] is parked:
            self._drop_released_top()
        if self._stale > self.COMPACT_AFTER and 2 * self._stale > len(deadlines):
            deadlines[:] = [entry for entry in deadlines if not entry[1].done]
            heapq.heapify(deadlines)
            self._stale = 0
            self.next_deadline = deadlines[0][0] if deadlines else None

    @property
    def heap_size(self) -> int:
        """Entries in the deadline heap, released ones included (for tests of its compaction)."""
        return len(self._deadlines)

    def _release(self, parked: Parked) -> None:
        parked.done = True
        owned = self._owners.get(parked.owner)
        if owned is not None:
            owned.discard(parked)
            if not owned:
                del self._owners[parked.owner]
        if parked.line is not None:
            _remove(self._lines, parked.line, parked)
        for key in parked.missing:
            _remove(self.waiting, key, parked)

    def written(self, key) -> list[Parked]:
        """``key`` was written: it is no longer missing for anyone. The requests it was the last
        missing key of, oldest first; they stay parked until the caller releases them or makes them
        ``wait_for`` keys that went missing again meanwhile."""
        waiters = self.waiting.pop(key, None)
        if not waiters:
            return []
        complete = []
        for parked in waiters:
            if parked.done or key not in parked.missing:
                continue  # listed twice for this key (it asked for it twice): already counted
            parked.missing.discard(key)
            if not parked.missing:
                complete.append(parked)
        return complete

    def wake_oldest(self, key, kind) -> Parked | None:
        """Like ``written(key)``, but for the oldest request of class ``kind`` waiting on ``key`` alone
        (a queue's item releases one WAIT, not every one). That request if ``key`` was its last missing key."""
        waiters = self.waiting.get(key)
        if not waiters:
            return None
        for parked in waiters:
            if parked.request.__class__ is kind and not parked.done:
                break
        else:
            return None
        waiters.remove(parked)
        if not waiters:
            del self.waiting[key]
        parked.missing.discard(key)
        return None if parked.missing else parked

    def wait_for(self, parked: Parked, keys) -> None:
        """Keep ``parked`` waiting, now for ``keys`` (found missing again when it was about to be answered)."""
        parked.missing.update(keys)
        for key in keys:
            self.waiting.setdefault(key, []).append(parked)

    def first_in_line(self, line) -> Parked | None:
        """The oldest request in ``line``, or None if nobody waits there."""
        waiting = self._lines.get(line)
        return waiting[0] if waiting else None

    def in_line(self, line) -> list[Parked]:
        """Every request in ``line``, oldest first (a copy: release them while iterating)."""
        return list(self._lines.get(line, ()))

    def expired(self, now: float) -> list[Parked]:
        """The requests whose deadline is ``now`` or earlier, oldest deadline first; released."""
        deadlines, due = self._deadlines, []
        while deadlines and deadlines[0][0] <= now:
            _, parked = heapq.heappop(deadlines)
            if parked.done:
                self._stale -= 1
            else:
                self._release(parked)
                due.append(parked)
        self._drop_released_top()
        return due

    def _drop_released_top(self) -> None:
        """Pop released requests off the top of the deadline heap, so that ``next_deadline`` is a
        parked request's: a get/wait answered early (every rendezvous parks some) must not leave the
        loop a deadline to wake up and check for nothing."""
        deadlines = self._deadlines
        while deadlines and deadlines[0][1].done:
            heapq.heappop(deadlines)
            self._stale -= 1
        self.next_deadline = deadlines[0][0] if deadlines else None

    def cancel(self, owner) -> None:
        """Release every request ``owner`` parked, unanswered (its connection is gone)."""
        for parked in list(self._owners.get(owner, ())):
            self.release(parked)


def _remove(lists: dict, name, parked: Parked) -> None:
    """Take ``parked`` out of ``lists[name]`` (if there), and the list out of ``lists`` once it is empty."""
    waiting = lists.get(name)
    if waiting is None:
        return
    try:
        waiting.remove(parked)
    except ValueError:
        pass
    if not waiting:
        del lists[name]
