"""HashStore: an in-process, thread-safe store (torch.distributed.HashStore).

Why it looks like this: one lock guards the table and one Condition on that lock wakes blocked
get()/wait() callers whenever any key is written. Waking every waiter on every write is wasteful in
theory but the waiters of an in-process store are a handful of threads, and it keeps the store
obviously correct: a waiter re-checks its own keys after each wake-up, until its deadline.

Queues need more than "re-check after each wake-up", because an item must go to exactly one
caller and a push wakes only one wait() (torch's rule). So a blocked queue_pop() or a wait() that
needs a queue leaves a ticket in a line per queue name, oldest first: a push hands its item straight
to the oldest blocked pop's ticket (the queue never holds it), or, when no pop is blocked, keeps the
item and marks the oldest wait() ticket as woken for that queue. Everyone still sleeps on the one
Condition and looks at their own ticket when woken. This is the TCPStore server's parking, with
threads instead of connections.
"""

from __future__ import annotations

import threading
import time
from collections import deque

from . import rules
from .base import Store
from .table import KeyTable


class _PopTicket:
    __slots__ = ("value",)

    def __init__(self):
        self.value: bytes | None = None  # set by the push that hands this pop its item


class _WaitTicket:
    __slots__ = ("woken",)

    def __init__(self):
        self.woken: set[str] = set()  # queues whose push chose this wait() to wake


class HashStore(Store):
    """A thread-safe store based on a hash map; usable from threads of one process, not across processes."""

    def __init__(self):
        super().__init__()
        self._table = KeyTable()
        self._changed = threading.Condition(threading.Lock())
        self._poppers: dict[str, deque[_PopTicket]] = {}  # blocked queue_pop() calls per queue
        self._queue_waiters: dict[str, deque[_WaitTicket]] = {}  # blocked wait() calls per queue they need

    def __repr__(self) -> str:
        return f"HashStore({len(self._table)} keys)"

    def has_extended_api(self) -> bool:
        return True  # append, multi_get, multi_set and list_keys are native

    def clone(self) -> "HashStore":
        """This store itself, as torch's HashStore.clone() returns: it is already safe to share between threads."""
        return self

    def _wait_until_set(self, operation: str, keys: list[str], timeout: float) -> None:
        """With the lock held: block until every key exists, or raise the timeout error."""
        missing = self._table.missing(keys)
        if not missing:
            return
        deadline = time.monotonic() + timeout
        while missing:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise rules.timeout_error(operation, keys, timeout, missing, where=repr(self))
            self._changed.wait(remaining)
            missing = self._table.missing(missing)

    def _set(self, key, value):
        with self._changed:
            self._table.set(key, value)
            self._changed.notify_all()

    def _get(self, key, timeout):
        with self._changed:
            self._wait_until_set("get", [key], timeout)
            return self._table.values[key]

    def _add(self, key, amount):
        with self._changed:
            total = self._table.add(key, amount)
            self._changed.notify_all()
            return total

    def _compare_set(self, key, expected, desired):
        with self._changed:
            returned, changed = self._table.compare_set(key, expected, desired)
            if changed:
                self._changed.notify_all()
            return returned

    def _wait(self, keys, timeout):
        with self._changed:
            absent = self._table.absent(keys)
            if not absent:
                return
            deadline = time.monotonic() + timeout
            ticket = _WaitTicket()
            pending = set(absent)
            self._enqueue_waiter(ticket, pending)
            try:
                while True:
                    values = self._table.values
                    pending = {k for k in pending if k not in values and k not in ticket.woken}
                    if not pending:
                        absent = self._table.absent(keys)  # a woken queue may have been emptied since
                        if not absent:
                            return
                        ticket.woken.clear()
                        pending = set(absent)
                        self._enqueue_waiter(ticket, pending)
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        # not woken, but its keys may be present now (a queue filled while another
                        # wait() got the wake-up): the condition holds, so this is no timeout
                        absent = self._table.absent(keys)
                        if not absent:
                            return
                        raise rules.timeout_error("wait", keys, timeout, absent, where=repr(self))
                    self._changed.wait(remaining)
            finally:
                self._dequeue_waiter(ticket, keys)

    def _enqueue_waiter(self, ticket: _WaitTicket, keys) -> None:
        for key in keys:
            line = self._queue_waiters.setdefault(key, deque())
            if ticket not in line:
                line.append(ticket)

    def _dequeue_waiter(self, ticket: _WaitTicket, keys) -> None:
        for key in keys:
            line = self._queue_waiters.get(key)
            if line is not None and ticket in line:
                line.remove(ticket)
                if not line:
                    del self._queue_waiters[key]

    def _check(self, keys):
        with self._changed:
            return not self._table.absent(keys)

    def _num_keys(self):
        with self._changed:
            return len(self._table)

    def _delete_key(self, key):
        with self._changed:
            return self._table.delete(key)

    def _append(self, key, value):
        with self._changed:
            self._table.append(key, value)
            self._changed.notify_all()

    def _multi_get(self, keys, timeout):
        with self._changed:
            self._wait_until_set("multi_get", keys, timeout)
            return [self._table.values[k] for k in keys]

    def _multi_set(self, keys, values):
        with self._changed:
            self._table.multi_set(keys, values)
            self._changed.notify_all()

    def _list_keys(self):
        with self._changed:
            return list(self._table.values)

    # -- queues ---------------------------------------------------------------------------------------

    def _queue_push(self, key, value):
        with self._changed:
            poppers = self._poppers.get(key)
            if poppers:
                poppers.popleft().value = value  # straight to the oldest blocked pop
                if not poppers:
                    del self._poppers[key]
                self._changed.notify_all()
                return
            self._table.queue_push(key, value)
            waiters = self._queue_waiters.get(key)
            if waiters:
                waiters.popleft().woken.add(key)  # one wait(), as torch documents
                if not waiters:
                    del self._queue_waiters[key]
                self._changed.notify_all()

    def _queue_pop(self, key, block, timeout):
        with self._changed:
            value = self._table.queue_pop(key)
            if value is not None:
                return value
            if not block:
                raise rules.queue_empty_error()
            ticket = _PopTicket()
            line = self._poppers.setdefault(key, deque())
            line.append(ticket)
            deadline = time.monotonic() + timeout
            while ticket.value is None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    line.remove(ticket)
                    if not line and self._poppers.get(key) is line:
                        del self._poppers[key]
                    raise rules.queue_timeout_error(key, timeout, where=repr(self))
                self._changed.wait(remaining)
            return ticket.value

    def _queue_len(self, key):
        with self._changed:
            return self._table.queue_len(key)
