"""Store: the key-value interface every store implements (torch.distributed.Store).

Why a base class with two layers: the public methods (``set``, ``get``, ...) keep torch's names,
signatures and docstrings and do the argument checks once — keys must be str, values become bytes,
timeouts are timedeltas turned into seconds — then call one ``_``-prefixed method that a store
implements on already-checked arguments. A store therefore never repeats validation, and every
store rejects a bad argument with the same error.

A subclass implements ``_set _get _add _compare_set _wait _check _num_keys _delete_key _append
_multi_get _multi_set _list_keys``, and for queues ``_queue_push _queue_pop _queue_len``. A user's
subclass may instead override the public methods, as it would torch's Store: what it leaves out
fails (or falls back) as on torch's base Store, and ``has_extended_api()`` is False for it. ``timeout`` is in
seconds in those methods. ``barrier`` has a default built on ``_add _set _wait`` (torch's own
default, with its key names); TCPStore replaces it with one request. ``clone`` is per store.
"""

from __future__ import annotations

from datetime import timedelta

from ..errors import DistStoreTimeoutError
from . import rules


class Store:
    """Base class for all store implementations, such as TCPStore, FileStore and HashStore."""

    def __init__(self, timeout: timedelta = rules.DEFAULT_TIMEOUT):
        self._timeout_s = rules.timeout_seconds(timeout)

    # -- timeout --------------------------------------------------------------------------------

    @property
    def timeout(self) -> timedelta:
        """The store's default timeout, used by get(), wait() and multi_get()."""
        return timedelta(seconds=self._timeout_s)

    def set_timeout(self, timeout: timedelta) -> None:
        """Sets the store's default timeout. This timeout is used during initialization and in wait() and get()."""
        self._timeout_s = rules.timeout_seconds(timeout)

    # -- the torch.distributed.Store API ----------------------------------------------------------

    def set(self, key: str, value) -> None:
        """Inserts the key-value pair into the store; an existing key is overwritten."""
        self._set(rules.as_key(key), rules.as_value(value))

    def get(self, key: str) -> bytes:
        """Retrieves the value of ``key``, waiting up to the store timeout for it to be set."""
        return self._get(rules.as_key(key), self._timeout_s)

    def add(self, key: str, amount: int) -> int:
        """Adds ``amount`` to the counter at ``key`` (created at 0) and returns the new value.

        Calling add() with a key that has been set by set() to something other than a decimal
        integer raises ValueError.
        """
        return self._add(rules.as_key(key), rules.as_amount(amount))

    def compare_set(self, key: str, expected_value, desired_value) -> bytes:
        """Sets ``key`` to ``desired_value`` if it holds ``expected_value`` (or is missing and
        ``expected_value`` is empty); returns the value the key holds afterwards (``expected_value``
        when the key is missing and was not created)."""
        return self._compare_set(rules.as_key(key), rules.as_value(expected_value), rules.as_value(desired_value))

    def wait(self, keys, timeout: timedelta | None = None) -> None:
        """Waits for each key in ``keys`` to be set, up to ``timeout`` (default: the store timeout)."""
        seconds = self._timeout_s if timeout is None else rules.timeout_seconds(timeout)
        keys = rules.as_keys(keys)
        if keys:
            self._wait(keys, seconds)

    def check(self, keys) -> bool:
        """True if every key in ``keys`` is set (does not wait)."""
        keys = rules.as_keys(keys)
        return self._check(keys) if keys else True

    def num_keys(self) -> int:
        """The number of keys in the store (TCPStore and FileStore count one key of their own, as torch does)."""
        return self._num_keys()

    def delete_key(self, key: str) -> bool:
        """Deletes ``key``; True if it existed."""
        return self._delete_key(rules.as_key(key))

    def append(self, key: str, value) -> None:
        """Appends ``value`` to the value of ``key`` (creating it if missing)."""
        self._append(rules.as_key(key), rules.as_value(value))

    def multi_get(self, keys) -> list[bytes]:
        """The values of all ``keys``, waiting up to the store timeout for all of them."""
        keys = rules.as_keys(keys)
        return self._multi_get(keys, self._timeout_s) if keys else []

    def multi_set(self, keys, values) -> None:
        """Sets every key in ``keys`` to the value at the same position in ``values``, atomically."""
        keys, values = rules.checked_multi_set(keys, values)
        if keys:
            self._multi_set(keys, values)

    def list_keys(self) -> list[str]:
        """Every key in the store (the store's own coordination key excluded)."""
        return self._list_keys()

    def has_extended_api(self) -> bool:
        """Whether append, multi_get, multi_set and list_keys are implemented natively.

        False here, as for torch's base Store (a user's subclass gets the fallbacks below unless it
        says otherwise); distcomm's HashStore, FileStore and TCPStore say True, and a PrefixStore
        answers for the store it wraps.
        """
        return False

    # -- queues -----------------------------------------------------------------------------------

    def queue_push(self, key: str, value) -> None:
        """Pushes a value into the specified queue.

        Using the same key for queues and set/get operations may result in unexpected behavior:
        a queue is kept apart from the keys (get(), list_keys(), num_keys() and delete_key() do not
        see it), but check() and wait() see a non-empty queue as a present key. wait() with queues
        will only wake one waiting worker rather than all: each push releases at most one wait()
        blocked on that queue, after any blocked queue_pop(), which takes the item first.
        """
        self._queue_push(rules.as_key(key), rules.as_value(value))

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        """Pops a value from the specified queue or waits until timeout if the queue is empty.

        Items come out in the order they were pushed, each to exactly one caller. If block is
        False, a QueueEmptyError is raised if the queue is empty; otherwise the call waits up to
        the store timeout and then raises DistStoreTimeoutError.
        """
        return self._queue_pop(rules.as_key(key), rules.as_block(block), self._timeout_s)

    def queue_len(self, key: str) -> int:
        """Returns the length of the specified queue (0 if the queue doesn't exist)."""
        return self._queue_len(rules.as_key(key))

    # -- barrier, clone -----------------------------------------------------------------------------

    def barrier(self, key: str, world_size: int, timeout: timedelta | None = None) -> None:
        """Blocks until ``world_size`` workers have called barrier with the same ``key``.

        If ``timeout`` is not specified, the store's default timeout is used. A key serves one
        barrier: once ``world_size`` workers have arrived, later calls with it return at once.
        """
        seconds = self._timeout_s if timeout is None else rules.timeout_seconds(timeout)
        self._barrier(rules.as_key(key), rules.as_world_size(world_size), seconds)

    def clone(self) -> "Store":
        """Clones the store and returns a new object that points to the same underlying store.

        The returned store can be used concurrently with the original object, e.g. one per thread.
        """
        raise _pure_virtual("clone")  # torch's base Store

    # -- lifetime -------------------------------------------------------------------------------

    def close(self) -> None:
        """Release what this store holds (a connection, a file); idempotent."""

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # -- what a store implements -----------------------------------------------------------------
    # What a store lacks fails as it does on torch's base Store, so that a user's subclass written
    # for torch (overriding the public set/get/... directly) behaves the same here: set, get and
    # compare_set raise RuntimeError "... Not implemented." (torch's Python trampoline), add, wait,
    # check, num_keys and delete_key raise RuntimeError "Tried to call pure virtual function ..."
    # (torch's C++ pure virtuals, text kept so a regex written against torch matches), and
    # append/multi_get/multi_set fall back to compare_set/get/set as torch's C++ Store does. The
    # fallbacks call the *public* methods: those are what such a subclass overrides.

    def _set(self, key: str, value: bytes) -> None:
        raise _not_implemented("set")

    def _get(self, key: str, timeout: float) -> bytes:
        raise _not_implemented("get")

    def _add(self, key: str, amount: int) -> int:
        raise _pure_virtual("add")

    def _compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        raise _not_implemented("compare_set")

    def _wait(self, keys: list[str], timeout: float) -> None:
        raise _pure_virtual("wait")

    def _check(self, keys: list[str]) -> bool:
        raise _pure_virtual("check")

    def _num_keys(self) -> int:
        raise _pure_virtual("getNumKeys")

    def _delete_key(self, key: str) -> bool:
        raise _pure_virtual("deleteKey")

    def _append(self, key: str, value: bytes) -> None:
        """torch's Store::append: a compare_set loop (never get(), which could block on a missing key)."""
        expected = value
        current = self.compare_set(key, b"", expected)
        while current != expected:
            expected = current + value
            current = self.compare_set(key, current, expected)

    def _multi_get(self, keys: list[str], timeout: float) -> list[bytes]:
        return [self.get(key) for key in keys]  # torch's Store::multiGet: one get() per key

    def _multi_set(self, keys: list[str], values: list[bytes]) -> None:
        for key, value in zip(keys, values):  # torch's Store::multiSet: one set() per key
            self.set(key, value)

    def _list_keys(self) -> list[str]:
        raise NotImplementedError("listKeys support is not implemented.")  # torch's text

    def _queue_push(self, key: str, value: bytes) -> None:
        raise NotImplementedError("queue support is not implemented.")  # torch's text

    def _queue_pop(self, key: str, block: bool, timeout: float) -> bytes:
        raise NotImplementedError("queue support is not implemented.")

    def _queue_len(self, key: str) -> int:
        raise NotImplementedError("queue support is not implemented.")

    def _barrier(self, key: str, world_size: int, timeout: float) -> None:
        """torch's default barrier: count arrivals at ``<key>/num_members``; the last to arrive sets
        ``<key>/last_member``, which everyone waits for. Kept key for key, so a job mixing torch and
        distcomm stores' helpers sees the same keys."""
        # the public add/set/wait, as torch's virtual calls: a user's subclass overrides those
        arrived_key, released_key = key + "/num_members", key + "/last_member"
        if self.add(arrived_key, 1) == world_size:
            self.set(released_key, b"1")
        try:
            self.wait([released_key], timedelta(seconds=timeout))
        except DistStoreTimeoutError as exc:
            lead = getattr(exc, "torch_message", rules.TORCH_WAIT_TIMEOUT)  # torch's store fails in its wait()
            try:
                arrived = int(self._get(arrived_key, 0))
            except (RuntimeError, ValueError):  # a timeout, or a subclass without _get
                arrived = None
            raise rules.barrier_timeout_error(key, world_size, timeout, arrived, repr(self), lead) from None


def _not_implemented(method: str) -> RuntimeError:
    """torch's base Store, for a method its Python subclass did not override: RuntimeError ending
    "Not implemented." (torch prefixes an internal-assert location; the method is named here instead)."""
    return RuntimeError(f"Store.{method}() is not overridden by this Store subclass: Not implemented.")


def _pure_virtual(method: str) -> RuntimeError:
    """torch's text for a C++ pure virtual method its Python subclass did not override."""
    return RuntimeError(f'Tried to call pure virtual function "::c10d::Store::{method}"')
