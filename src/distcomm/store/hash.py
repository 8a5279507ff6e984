"""HashStore: an in-process, thread-safe store (torch.distributed.HashStore).

Why it looks like this: one lock guards the table and one Condition on that lock wakes blocked
get()/wait() callers whenever any key is written. Waking every waiter on every write is wasteful in
theory but the waiters of an in-process store are a handful of threads, and it keeps the store
obviously correct: a waiter re-checks its own keys after each wake-up, until its deadline.
"""

from __future__ import annotations

import threading
import time

from . import rules
from .base import Store
from .table import KeyTable


class HashStore(Store):
    """A thread-safe store based on a hash map; usable from threads of one process, not across processes."""

    def __init__(self):
        super().__init__()
        self._table = KeyTable()
        self._changed = threading.Condition(threading.Lock())

    def __repr__(self) -> str:
        return f"HashStore({len(self._table)} keys)"

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
            self._wait_until_set("wait", keys, timeout)

    def _check(self, keys):
        with self._changed:
            return not self._table.missing(keys)

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
