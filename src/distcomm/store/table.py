"""KeyTable: an in-memory key -> bytes table with every store mutation, and no waiting or locking.

Why: HashStore (threads, a Condition) and the TCPStore server (one event loop, parked requests)
wait in completely different ways but must mutate their tables identically. Each mutation returns
what the caller needs to answer and to wake waiters (the key it changed), so the two stores keep
only their waiting logic. Keys are str in HashStore and bytes in the server; the table does not care.
"""

from __future__ import annotations

from . import rules


class KeyTable:
    __slots__ = ("values",)

    def __init__(self):
        self.values: dict = {}

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

    def __contains__(self, key) -> bool:
        return key in self.values

    def __len__(self) -> int:
        return len(self.values)
