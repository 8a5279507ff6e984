"""KeyTable: an in-memory key -> bytes table with every store mutation, and no waiting or locking.

Why: HashStore (threads, a Condition) and the TCPStore server (one event loop, parked requests)
wait in completely different ways but must mutate their tables identically. Each mutation returns
what the caller needs to answer and to wake waiters (the key it changed), so the two stores keep
only their waiting logic. Keys are str in HashStore and bytes in the server; the table does not care.

Queues sit beside the values in ``queues`` (name -> deque of bytes; an emptied queue is removed, so
"in queues" means "non-empty"). ``missing`` ignores them (what get() waits for); ``absent`` counts a
non-empty queue as present (what check() and wait() see), as torch's stores do.
"""

from __future__ import annotations

from collections import deque

from . import rules


class KeyTable:
    __slots__ = ("values", "queues")

    def __init__(self):
        self.values: dict = {}
        self.queues: dict = {}

    def set(self, key, value: bytes) -> None:
        self.values[key] = value

    def add(self, key, amount: int) -> int:
        stored, total = rules.added(key, self.values.get(key), amount)
        self.values[key] = stored
        return total

    def compare_set(self, key, expected: bytes, desired: bytes) -> tuple[bytes, bool]:
        """(value to return, whether the key changed)."""
        new_value, returned = rules.compare_set_outcome(self.values.get(key), expected, desired)
        if new_value is None:
            return returned, False
        self.values[key] = new_value
        return returned, True

    def append(self, key, value: bytes) -> None:
        self.values[key] = self.values.get(key, b"") + value

    def delete(self, key) -> bool:
        return self.values.pop(key, None) is not None

    def multi_set(self, keys, values) -> None:
        self.values.update(zip(keys, values))

    def missing(self, keys) -> list:
        values = self.values
        return [k for k in keys if k not in values]

    def absent(self, keys) -> list:
        """The keys that are neither set nor a non-empty queue."""
        values, queues = self.values, self.queues
        return [k for k in keys if k not in values and k not in queues]

    def queue_push(self, key, value: bytes) -> None:
        queue = self.queues.get(key)
        if queue is None:
            self.queues[key] = deque((value,))
        else:
            queue.append(value)

    def queue_pop(self, key) -> bytes | None:
        """The oldest item of the queue, removed; None if the queue is empty."""
        queue = self.queues.get(key)
        if queue is None:
            return None
        value = queue.popleft()
        if not queue:
            del self.queues[key]
        return value

    def queue_len(self, key) -> int:
        queue = self.queues.get(key)
        return 0 if queue is None else len(queue)

    def __contains__(self, key) -> bool:
        return key in self.values

    def __len__(self) -> int:
        return len(self.values)
