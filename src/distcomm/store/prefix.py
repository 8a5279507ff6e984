"""PrefixStore: a view of another store in which every key is prefixed ``"<prefix>/"``.

Why it only forwards: process groups use PrefixStores to give each group its own key space over one
shared store, so the wrapper must add nothing but the prefix. It calls the underlying store's public
methods (so any Store works underneath, including another PrefixStore) and shares its timeout, as
torch's does: ``set_timeout`` on the prefix store changes the underlying store's timeout.
``num_keys`` counts the whole underlying store, as in torch; ``list_keys`` lists only this prefix.
Queue names are prefixed like keys. ``barrier`` is the base class's (torch's PrefixStore does not
forward it either), so it leaves ``<key>/num_members`` and ``<key>/last_member`` under the prefix
whatever the underlying store. ``clone`` wraps a clone of the underlying store.
"""

from __future__ import annotations

from datetime import timedelta

from . import rules
from .base import Store


class PrefixStore(Store):
    """A wrapper around any store that adds ``prefix + "/"`` to each key."""

    def __init__(self, prefix: str, store: Store):
        if not isinstance(prefix, str):
            raise TypeError(f"PrefixStore prefix is a str, got {type(prefix).__name__}: {prefix!r}")
        if store is None:
            raise ValueError("store argument cannot be None")  # torch's type and text
        if not isinstance(store, Store):
            raise TypeError(f"PrefixStore wraps a Store, got {type(store).__name__}")
        self._prefix = prefix + "/"
        self._store = store

    def __repr__(self) -> str:
        return f"PrefixStore({self._prefix[:-1]!r}, {self._store!r})"

    @property
    def underlying_store(self) -> Store:
        """The store this one wraps (possibly another PrefixStore)."""
        return self._store

    @property
    def _underlying_non_prefix_store(self) -> Store:
        store = self._store
        while isinstance(store, PrefixStore):
            store = store.underlying_store
        return store

    @property
    def timeout(self) -> timedelta:
        return self._store.timeout

    def set_timeout(self, timeout: timedelta) -> None:
        self._store.set_timeout(timeout)

    @property
    def _timeout_s(self) -> float:  # the base class reads the default timeout from here
        return rules.timeout_seconds(self._store.timeout)

    def has_extended_api(self) -> bool:
        return self._store.has_extended_api()  # as torch's: whatever the wrapped store answers

    def clone(self) -> "PrefixStore":
        """A PrefixStore with the same prefix over a clone of the underlying store."""
        return PrefixStore(self._prefix[:-1], self._store.clone())

    def _k(self, key: str) -> str:
        return self._prefix + key

    def _set(self, key, value):
        self._store.set(self._k(key), value)

    def _get(self, key, timeout):
        return self._store.get(self._k(key))

    def _add(self, key, amount):
        return self._store.add(self._k(key), amount)

    def _compare_set(self, key, expected, desired):
        return self._store.compare_set(self._k(key), expected, desired)

    def _wait(self, keys, timeout):
        self._store.wait([self._k(k) for k in keys], timedelta(seconds=timeout))

    def _check(self, keys):
        return self._store.check([self._k(k) for k in keys])

    def _num_keys(self):
        return self._store.num_keys()

    def _delete_key(self, key):
        return self._store.delete_key(self._k(key))

    def _append(self, key, value):
        self._store.append(self._k(key), value)

    def _multi_get(self, keys, timeout):
        return self._store.multi_get([self._k(k) for k in keys])

    def _multi_set(self, keys, values):
        self._store.multi_set([self._k(k) for k in keys], values)

    def _list_keys(self):
        n = len(self._prefix)
        return [k[n:] for k in self._store.list_keys() if k.startswith(self._prefix)]

    def _queue_push(self, key, value):
        self._store.queue_push(self._k(key), value)

    def _queue_pop(self, key, block, timeout):
        return self._store.queue_pop(self._k(key), block)

    def _queue_len(self, key):
        return self._store.queue_len(self._k(key))
