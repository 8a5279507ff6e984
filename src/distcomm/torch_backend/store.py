"""torch's c10d Store seen as the store distcomm's engines connect through.

torch hands a backend creator its own C++ store (a PrefixStore per group over the TCPStore, FileStore
or HashStore of init_process_group). distcomm's engines call set, get, add, wait and multi_get on
theirs; torch's Store has the same methods with the same meaning, so this adapter only fixes the
types at the seam (bytes values, lists of keys) and turns torch's store errors into distcomm's, so
a rank that never arrives at connect time is reported as a distcomm DistStoreError like any other.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as tdist

from ..errors import DistStoreError, DistStoreTimeoutError


def _translate(op: str, keys, exc: Exception) -> DistStoreError:
    cls = DistStoreTimeoutError if "timeout" in str(exc).lower() else DistStoreError
    return cls(f"store {op} of {keys!r} through torch's store failed: {exc}")


class TorchStore:
    """distcomm's store interface over a ``torch.distributed.Store``."""

    def __init__(self, store: tdist.Store):
        self.store = store

    def set(self, key: str, value) -> None:
        try:
            self.store.set(key, value)
        except tdist.DistError as exc:
            raise _translate("set", key, exc) from exc

    def get(self, key: str) -> bytes:
        try:
            return self.store.get(key)
        except tdist.DistError as exc:
            raise _translate("get", key, exc) from exc

    def add(self, key: str, amount: int) -> int:
        try:
            return self.store.add(key, amount)
        except tdist.DistError as exc:
            raise _translate("add", key, exc) from exc

    def wait(self, keys, timeout: timedelta | None = None) -> None:
        try:
            if timeout is None:
                self.store.wait(list(keys))
            else:
                self.store.wait(list(keys), timeout)
        except tdist.DistError as exc:
            raise _translate("wait", list(keys), exc) from exc

    def multi_get(self, keys) -> list[bytes]:
        try:
            return self.store.multi_get(list(keys))
        except tdist.DistError as exc:
            raise _translate("multi_get", list(keys), exc) from exc

    def multi_set(self, keys, values) -> None:
        self.store.multi_set(list(keys), list(values))

    def check(self, keys) -> bool:
        return self.store.check(list(keys))

    def delete_key(self, key: str) -> bool:
        return self.store.delete_key(key)
