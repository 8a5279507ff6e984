"""The semantics every store shares, in one place: argument types, counters, compare_set, timeouts.

Why: HashStore, FileStore and the TCPStore server each keep their own table, but add() on a key
written by set(), compare_set() on a missing key, int64 overflow, or what a timeout of zero means
must not differ between them. Each rule below was checked against torch 2.13's stores:

* keys are ``str``; values are ``bytes`` (a ``str`` value is encoded UTF-8; anything else is a
  TypeError, as torch's bindings reject it).
* ``add`` keeps a decimal int64 counter as the key's value. A missing key starts at 0; an empty
  value counts as 0 (HashStore does this); a value that is not a decimal integer raises ValueError
  (torch raises ``ValueError: stoll``, though its stoll takes a numeric prefix such as "5x" as 5,
  which distcomm refuses); the sum wraps around at int64 like torch's C++ ``int64_t``.
* ``compare_set(key, expected, desired)``: if the key is missing, it is created with ``desired``
  only when ``expected`` is empty, and the call returns ``desired``; otherwise it returns
  ``expected`` unchanged. If the key exists and holds ``expected``, it is replaced by ``desired``
  which is returned; otherwise the current value is returned.
* timeouts are ``timedelta`` at the API; a timeout of zero means "check once, do not wait" (as
  TCPStore does; torch's HashStore instead waits forever, which no caller wants by accident), and a
  negative timeout is a ValueError.
* queues (``queue_push/queue_pop/queue_len``) live beside the keys, not among them: a queue is not
  listed, counted, deleted or read by get() (torch's HashStore agrees; its TCPStore's get() of a
  queue name returns b"" — an accident of its server). check() and wait() do see a non-empty queue
  as a present key (torch documents this). ``queue_pop(block=False)`` on an empty queue raises
  QueueEmptyError("queue is empty"); a blocking pop waits up to the store timeout and then raises
  DistStoreTimeoutError (torch: DistStoreError "wait timeout").
* ``barrier(key, world_size)``: ``world_size`` must be at least 1 (torch's stores disagree on 0 and
  negatives: its TCPStore returns at once, its HashStore times out); a barrier key is used once —
  a later call with the same key returns at once, in every torch store and here.
"""

from __future__ import annotations

import operator
import re
from datetime import timedelta
from typing import Iterable

from ..errors import DistStoreTimeoutError, QueueEmptyError

INT64_MIN = -(1 << 63)
INT64_MAX = (1 << 63) - 1
_DECIMAL = re.compile(rb"\s*[+-]?[0-9]+\s*")

DEFAULT_TIMEOUT = timedelta(seconds=300)


def as_key(key) -> str:
    if not isinstance(key, str):
        raise TypeError(f"store keys are str, got {type(key).__name__}: {key!r}")
    return key


def as_keys(keys) -> list[str]:
    if isinstance(keys, (str, bytes)):
        raise TypeError(f"expected a list of str keys, got a single {type(keys).__name__}: {keys!r}")
    return [as_key(k) for k in keys]


def as_value(value) -> bytes:
    """Store values are bytes; str is encoded UTF-8 (torch's bindings accept both)."""
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    raise TypeError(f"store values are str or bytes, got {type(value).__name__}: {value!r}")


def as_amount(amount) -> int:
    try:
        amount = operator.index(amount)
    except TypeError:
        raise TypeError(f"add() amount is an int, got {type(amount).__name__}: {amount!r}") from None
    if not INT64_MIN <= amount <= INT64_MAX:
        raise OverflowError(f"add() amount {amount} does not fit in a signed 64-bit integer")
    return amount


def as_block(block) -> bool:
    """queue_pop's ``block``: a bool (or an int, or None meaning False, as torch's binding converts)."""
    if block is None:
        return False
    if isinstance(block, bool):
        return block
    try:
        return bool(operator.index(block))
    except TypeError:
        raise TypeError(f"queue_pop() block is a bool, got {type(block).__name__}: {block!r}") from None


def as_world_size(world_size) -> int:
    try:
        world_size = operator.index(world_size)
    except TypeError:
        raise TypeError(f"barrier() world_size is an int, got {type(world_size).__name__}: {world_size!r}") from None
    if world_size < 1:
        raise ValueError(f"barrier() world_size must be at least 1, got {world_size}")
    if world_size > INT64_MAX:
        raise OverflowError(f"barrier() world_size {world_size} does not fit in a signed 64-bit integer")
    return world_size


def wrap_int64(value: int) -> int:
    return ((value - INT64_MIN) & 0xFFFFFFFFFFFFFFFF) + INT64_MIN


def counter_value(key: str | bytes, current: bytes | None) -> int:
    """The integer a counter key holds (0 when missing or empty); ValueError if it is not one."""
    if not current:
        return 0
    if _DECIMAL.fullmatch(current) is None:
        if isinstance(key, bytes):
            key = key.decode("utf-8", "replace")
        raise ValueError(
            f"add(): key {key!r} holds {current[:64]!r}, which is not a decimal integer; add() works on keys "
            f"created by add() or set() to a decimal integer string"
        )
    return wrap_int64(int(current))


def added(key: str | bytes, current: bytes | None, amount: int) -> tuple[bytes, int]:
    """The new stored bytes and the returned int of ``add(key, amount)`` on ``current``."""
    if current is not None and current.isdigit():  # the hot case: a non-negative counter add() wrote
        total = int(current) + amount
    else:
        try:  # a plain decimal that int() takes as it is
            total = int(current) + amount if current and b"_" not in current else counter_value(key, current) + amount
        except ValueError:
            total = counter_value(key, current) + amount  # raises the store's ValueError
    if not INT64_MIN <= total <= INT64_MAX:
        total = wrap_int64(total)
    return b"%d" % total, total


def compare_set_outcome(current: bytes | None, expected: bytes, desired: bytes) -> tuple[bytes | None, bytes]:
    """(value to store, or None to leave the key alone; value to return) for compare_set."""
    if current is None:
        if expected == b"":
            return desired, desired
        return None, expected
    if current == expected:
        return desired, desired
    return None, current


def checked_multi_set(keys, values) -> tuple[list[str], list[bytes]]:
    keys = as_keys(keys)
    values = [as_value(v) for v in values]
    if len(keys) != len(values):
        raise ValueError(f"multi_set(): {len(keys)} keys but {len(values)} values; pass one value per key")
    return keys, values


def timeout_seconds(timeout) -> float:
    """A public timeout (timedelta, or seconds as a number) as non-negative float seconds."""
    if isinstance(timeout, timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise TypeError(f"timeout is a datetime.timedelta, got {type(timeout).__name__}: {timeout!r}")
    if seconds < 0:
        raise ValueError(f"timeout must not be negative, got {timeout!r}")
    return seconds


def format_seconds(seconds: float) -> str:
    """A duration for distcomm's own words: "2 seconds", "1.5 seconds", "100 ms"."""
    if seconds >= 1 and seconds == int(seconds):
        return f"{int(seconds)} second{'s' if seconds != 1 else ''}"
    if seconds >= 1:
        return f"{seconds:.3g} seconds"
    return f"{seconds * 1000:.0f} ms"


def torch_milliseconds(seconds: float) -> str:
    """A duration as torch's C++ messages print one: whole milliseconds, no space ("100ms")."""
    return f"{int(round(seconds * 1000))}ms"


# Timeout errors begin with torch's own sentence for that store and call (``lead``), so a regex
# written against torch matches; distcomm's account of what was missing, where, and what to do
# follows it. torch's sentences: HashStore "Wait timeout" for everything; FileStore
# file_get_lead() for get, "Wait timeout" otherwise; TCPStore tcp_wait_lead() for get/wait/
# multi_get/queue_pop and tcp_barrier_lead() for barrier.
TORCH_WAIT_TIMEOUT = "Wait timeout"


def _timeout(lead: str, text: str) -> DistStoreTimeoutError:
    """``lead`` (torch's sentence), then distcomm's ``text``. The error keeps ``lead`` as
    ``torch_message``: a store that builds one operation on another (the default barrier on wait)
    raises with the sentence torch's store would have raised."""
    error = DistStoreTimeoutError(f"{lead}. {text}")
    error.torch_message = lead
    return error


def tcp_wait_lead(keys: Iterable[str], seconds: float) -> str:
    """torch's TCPStore: its keys carry a "/" of their own on the wire, and its message shows them so."""
    return f"wait timeout after {torch_milliseconds(seconds)}, keys: " + ", ".join("/" + k for k in keys)


def tcp_barrier_lead(key: str, seconds: float) -> str:
    return f"barrier timeout after {torch_milliseconds(seconds)}, key: {key}"


def file_get_lead(key: str, seconds: float) -> str:
    return f"Timeout waiting for key: {key} after {int(round(seconds * 1000))} ms"


def timeout_error(
    operation: str,
    keys: Iterable[str],
    seconds: float,
    missing: Iterable[str] | None = None,
    where: str = "",
    lead: str = TORCH_WAIT_TIMEOUT,
) -> DistStoreTimeoutError:
    """The error of a get/wait that did not see its keys in time; names the keys and the timeout."""
    keys = list(keys)
    text = f"{operation}: timed out after {format_seconds(seconds)} waiting for keys {keys}"
    if missing is not None:
        missing = list(missing)
        if missing != keys:
            text += f" (still missing: {missing})"
    if where:
        text += f" in {where}"
    text += "; the process that sets them may have failed or be slow (raise the store timeout if it is only slow)"
    return _timeout(lead, text)


def queue_empty_error() -> QueueEmptyError:
    return QueueEmptyError("queue is empty")  # torch's text, word for word


def queue_timeout_error(
    key: str, seconds: float, where: str = "", lead: str = TORCH_WAIT_TIMEOUT
) -> DistStoreTimeoutError:
    """The error of a blocking queue_pop() that found nothing in time."""
    text = f"queue_pop: timed out after {format_seconds(seconds)} waiting for an item in queue {key!r}"
    if where:
        text += f" in {where}"
    text += (
        "; nothing was pushed meanwhile (or other poppers took every item). "
        "Raise the store timeout, or pop with block=False"
    )
    return _timeout(lead, text)


def barrier_timeout_error(
    key: str,
    world_size: int,
    seconds: float,
    arrived: int | None = None,
    where: str = "",
    lead: str = TORCH_WAIT_TIMEOUT,
) -> DistStoreTimeoutError:
    """The error of a barrier() that not enough workers reached in time."""
    text = f"barrier: timed out after {format_seconds(seconds)} at key {key!r}"
    text += f" waiting for world_size={world_size} workers"
    if arrived is not None:
        text += f" ({arrived} arrived)"
    if where:
        text += f" in {where}"
    text += "; a worker may have failed, be slow, or use another key or world_size"
    return _timeout(lead, text)
