"""One conformance suite, run against every store kind (HashStore, FileStore, TCPStore master and
client, and PrefixStore over each): torch.distributed.Store semantics, return values, errors and
timeouts. The expected values were taken from torch 2.13's own stores (see test_store_torch_oracle).

Tiers: the fast tier (``pytest -m "not slow"``) runs the suite on a HashStore, a FileStore, a
TCPStore client over TCP and a PrefixStore over a HashStore. The other kinds are slow: the master's
own connection and a same-host client (the same protocol over the server's Unix socket), which the
fast tier's multi-process tests use to rendezvous, and the same prefixing over the other stores; so
is the wake-one wait (it sleeps to let two waiters block) except on the TCP client.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest

from distcomm.errors import DistError, DistStoreError, DistStoreTimeoutError, QueueEmptyError
from store_kinds import KINDS

SHORT = timedelta(milliseconds=50)


SLOW_KINDS = {"tcp-master", "tcp-client", "prefix-file", "prefix-tcp-master", "prefix-tcp-client"}


def kinds(fast: set[str] | None = None) -> list:
    """Every store kind as a parameter; those not in ``fast`` (default: all but SLOW_KINDS) marked slow."""
    fast = set(KINDS) - SLOW_KINDS if fast is None else fast
    return [k if k in fast else pytest.param(k, marks=pytest.mark.slow) for k in sorted(KINDS)]


@pytest.fixture(params=kinds())
def opened(request):
    opened = KINDS[request.param]()
    yield opened
    opened.close()


@pytest.fixture
def store(opened):
    return opened.store


def test_set_get_bytes_and_str(store):
    store.set("a", "text")
    store.set("b", b"\x00\xff\x80binary")
    store.set("c", "h\u00e9llo \u2603")
    assert store.get("a") == b"text"
    assert store.get("b") == b"\x00\xff\x80binary"
    assert store.get("c") == "h\u00e9llo \u2603".encode("utf-8")
    assert type(store.get("a")) is bytes
    store.set("a", "overwritten")
    assert store.get("a") == b"overwritten"


def test_empty_key_and_value_and_a_large_value(store):
    store.set("", "empty key")
    store.set("empty", "")
    big = bytes(range(256)) * 4096  # 1 MiB
    store.set("big", big)
    assert store.get("") == b"empty key"
    assert store.get("empty") == b""
    assert store.get("big") == big


def test_add_counts_and_returns_int(store):
    assert store.add("n", 5) == 5
    assert store.add("n", 0) == 5
    assert store.add("n", -7) == -2
    assert store.get("n") == b"-2"
    store.set("decimal", "12")
    assert store.add("decimal", 1) == 13


def test_add_on_a_set_decimal_with_leading_zeros_a_sign_or_a_negative_value(store):
    store.set("padded", "007")
    assert store.add("padded", 1) == 8
    store.set("signed", "+5")
    assert store.add("signed", 1) == 6
    store.set("negative", "-5")
    assert store.add("negative", 2) == -3
    assert store.add("negative", 10) == 7  # the stored "-3" is a counter too


def test_add_wraps_at_int64_like_torch(store):
    assert store.add("big", 2**62) == 2**62
    assert store.add("big", 2**62) == -(2**63)


def test_add_on_a_key_set_to_text_raises_value_error_and_the_store_stays_usable(store):
    store.set("text", "x")
    with pytest.raises(ValueError, match="not a decimal integer"):
        store.add("text", 1)
    assert store.get("text") == b"x"
    assert store.add("other", 2) == 2


def test_add_argument_errors(store):
    with pytest.raises(TypeError):
        store.add("n", "1")
    with pytest.raises(OverflowError):
        store.add("n", 2**63)


@pytest.mark.parametrize(
    "initial, expected, desired, returned, final",
    [
        (None, "", "d", b"d", b"d"),  # missing key, empty expected: created
        (None, "zz", "d", b"zz", None),  # missing key, other expected: returns expected, not created
        (b"x", "x", "y", b"y", b"y"),  # match: replaced
        (b"x", "nope", "y", b"x", b"x"),  # mismatch: returns current
        (b"x", "", "y", b"x", b"x"),  # existing key, empty expected: mismatch
    ],
)
def test_compare_set(store, initial, expected, desired, returned, final):
    if initial is not None:
        store.set("k", initial)
    assert store.compare_set("k", expected, desired) == returned
    assert store.check(["k"]) == (final is not None)
    if final is not None:
        assert store.get("k") == final


def test_delete_key(opened, store):
    store.set("k", "v")
    assert store.delete_key("k") is True
    assert not store.check(["k"])
    # torch: False for a missing key, except FileStore, which returns True regardless
    assert store.delete_key("k") is (opened.kind.endswith("file"))
    store.set_timeout(SHORT)
    with pytest.raises(DistStoreTimeoutError):
        store.get("k")


def test_num_keys_counts_keys(store):
    base = store.num_keys()
    assert base in (0, 1)  # TCPStore with a world_size and FileStore count one key of their own
    store.set("a", "1")
    store.set("b", "2")
    store.add("c", 1)
    assert store.num_keys() == base + 3
    store.set("a", "again")
    assert store.num_keys() == base + 3
    store.delete_key("b")
    assert store.num_keys() == base + 2


def test_check(store):
    assert store.check([]) is True
    store.set("a", "1")
    assert store.check(["a"]) is True
    assert store.check(["a", "missing"]) is False


def test_wait_returns_when_keys_exist(store):
    store.set("a", "1")
    store.add("b", 1)
    store.wait(["a", "b"])
    store.wait(["a"], timedelta(seconds=1))
    store.wait([])


def test_append(store):
    store.append("log", "a")
    store.append("log", b"b")
    assert store.get("log") == b"ab"


def test_multi_set_and_multi_get(store):
    store.multi_set(["x", "y"], ["1", b"2"])
    assert store.multi_get(["y", "x"]) == [b"2", b"1"]
    assert store.multi_get([]) == []
    with pytest.raises(ValueError, match="2 keys but 1 values"):
        store.multi_set(["x", "y"], ["1"])


def test_list_keys(store):
    store.set("a", "1")
    store.add("b", 1)
    assert sorted(store.list_keys()) == ["a", "b"]


def test_has_extended_api(store):
    assert store.has_extended_api() is True


def test_timeout_property(store):
    store.set_timeout(timedelta(seconds=7))
    assert store.timeout == timedelta(seconds=7)
    with pytest.raises(ValueError):
        store.set_timeout(timedelta(seconds=-1))
    with pytest.raises(TypeError):
        store.set_timeout("soon")


def test_argument_types(store):
    with pytest.raises(TypeError):
        store.set(1, "v")
    with pytest.raises(TypeError):
        store.set("k", 3)
    with pytest.raises(TypeError):
        store.get(b"k")
    with pytest.raises(TypeError):
        store.wait("k")  # a str, not a list of keys


# -- timeouts -------------------------------------------------------------------------------------


def _assert_timeout(error: BaseException, *keys: str) -> None:
    assert isinstance(error, DistStoreTimeoutError)
    assert isinstance(error, DistStoreError) and isinstance(error, RuntimeError)
    text = str(error)
    for key in keys:
        assert key in text
    assert "50 ms" in text


def test_get_timeout_names_key_and_timeout_and_store_stays_usable(store):
    store.set_timeout(SHORT)
    with pytest.raises(DistStoreTimeoutError) as info:
        store.get("missing-key")
    _assert_timeout(info.value, "missing-key")
    store.set("after", "ok")
    assert store.get("after") == b"ok"
    assert store.add("counter", 3) == 3


def test_wait_timeout_names_keys(store):
    store.set("present", "1")
    with pytest.raises(DistStoreTimeoutError) as info:
        store.wait(["present", "absent"], SHORT)
    _assert_timeout(info.value, "absent")
    assert "still missing: ['" in str(info.value) and "absent']" in str(info.value)  # PrefixStore names full keys
    store.set("absent", "now")
    store.wait(["present", "absent"], SHORT)


def test_wait_default_timeout_is_the_store_timeout(store):
    store.set_timeout(SHORT)
    with pytest.raises(DistStoreTimeoutError) as info:
        store.wait(["never"])
    _assert_timeout(info.value, "never")


def test_multi_get_timeout(store):
    store.set_timeout(SHORT)
    store.set("a", "1")
    with pytest.raises(DistStoreTimeoutError) as info:
        store.multi_get(["a", "b"])
    _assert_timeout(info.value, "b")
    assert store.multi_get(["a"]) == [b"1"]


def test_zero_timeout_checks_once(store):
    store.set("here", "1")
    store.wait(["here"], timedelta(0))
    with pytest.raises(DistStoreTimeoutError):
        store.wait(["not-here"], timedelta(0))


# -- blocking released by another thread ------------------------------------------------------------


def _set_later(peer, delay, *pairs):
    def run():
        time.sleep(delay)
        for key, value in pairs:
            peer.set(key, value)

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_get_blocks_until_another_thread_sets(opened, store):
    store.set_timeout(timedelta(seconds=20))
    thread = _set_later(opened.peer(), 0.05, ("late", "value"))
    assert store.get("late") == b"value"
    thread.join()


def test_wait_and_multi_get_block_until_all_keys_are_set(opened, store):
    store.set_timeout(timedelta(seconds=20))
    thread = _set_later(opened.peer(), 0.05, ("k1", "1"), ("k2", "2"))
    store.wait(["k1", "k2"])
    assert store.multi_get(["k1", "k2"]) == [b"1", b"2"]
    thread.join()


# -- queues ---------------------------------------------------------------------------------------


def test_queue_is_first_in_first_out_with_bytes_and_str(store):
    assert store.queue_len("q") == 0  # a queue that does not exist is empty
    store.queue_push("q", "text")
    store.queue_push("q", b"\x00\xff")
    store.queue_push("q", "")
    store.queue_push("q", "h\u00e9")
    assert store.queue_len("q") == 4
    popped = [store.queue_pop("q"), store.queue_pop("q", False), store.queue_pop("q", block=True), store.queue_pop("q")]
    assert popped == [b"text", b"\x00\xff", b"", "h\u00e9".encode()]
    assert all(type(v) is bytes for v in popped)
    assert store.queue_len("q") == 0


def test_queue_pop_without_blocking_on_an_empty_queue_raises_queue_empty_error(store):
    import distcomm

    for block in (False, None, 0):  # torch's binding takes None and 0 as False
        with pytest.raises(QueueEmptyError) as info:
            store.queue_pop("never-pushed", block)
        assert str(info.value) == "queue is empty"
    assert isinstance(info.value, DistStoreError) and isinstance(info.value, RuntimeError)
    assert not isinstance(info.value, DistStoreTimeoutError)
    assert distcomm.QueueEmptyError is QueueEmptyError
    store.queue_push("q", "x")
    store.queue_pop("q")
    with pytest.raises(QueueEmptyError):
        store.queue_pop("q", block=False)


def test_blocking_queue_pop_times_out_after_the_store_timeout(store):
    store.set_timeout(SHORT)
    with pytest.raises(DistStoreTimeoutError) as info:
        store.queue_pop("empty-queue")
    assert not isinstance(info.value, QueueEmptyError)
    assert "empty-queue" in str(info.value) and "50 ms" in str(info.value)
    store.set_timeout(timedelta(0))  # zero: look once
    with pytest.raises(DistStoreTimeoutError):
        store.queue_pop("empty-queue")
    store.queue_push("empty-queue", "late")  # the pops that gave up took nothing with them
    assert store.queue_pop("empty-queue") == b"late"


def test_queues_are_kept_apart_from_keys(opened, store):
    base = store.num_keys()
    store.set("k", "value")
    store.queue_push("k", "item")
    store.queue_push("only-a-queue", "item")
    assert store.get("k") == b"value"
    assert store.list_keys() == ["k"]
    assert store.num_keys() == base + 1
    assert store.delete_key("only-a-queue") is opened.kind.endswith("file")  # FileStore: True regardless
    assert store.delete_key("k") is True
    assert store.queue_len("k") == 1 and store.queue_len("only-a-queue") == 1
    store.set_timeout(SHORT)
    with pytest.raises(DistStoreTimeoutError):
        store.get("only-a-queue")  # get() waits for a set, not for a queue
    with pytest.raises(DistStoreTimeoutError):
        store.multi_get(["only-a-queue"])
    assert store.queue_pop("k") == b"item"


def test_check_and_wait_see_a_non_empty_queue(store):
    store.queue_push("q", "x")
    assert store.check(["q"]) is True
    store.wait(["q"], SHORT)
    store.set("k", "1")
    store.wait(["q", "k"], SHORT)
    store.queue_pop("q")
    assert store.check(["q"]) is False
    with pytest.raises(DistStoreTimeoutError):
        store.wait(["q"], SHORT)


def test_queue_argument_types(store):
    with pytest.raises(TypeError):
        store.queue_push("q", 3)
    with pytest.raises(TypeError):
        store.queue_push(b"q", "v")
    with pytest.raises(TypeError):
        store.queue_pop(b"q")
    with pytest.raises(TypeError):
        store.queue_pop("q", "yes")
    with pytest.raises(TypeError):
        store.queue_len(1)


def test_blocking_pop_is_released_by_a_push_from_another_thread(opened, store):
    store.set_timeout(timedelta(seconds=20))
    peer = opened.peer()

    def push_later():
        time.sleep(0.05)
        peer.queue_push("jobs", "job-1")

    thread = threading.Thread(target=push_later)
    thread.start()
    assert store.queue_pop("jobs") == b"job-1"
    thread.join()
    assert store.queue_len("jobs") == 0


def test_concurrent_poppers_get_every_item_exactly_once(opened, store):
    poppers, per_popper = 3, 20
    handles = [opened.peer() for _ in range(poppers)]
    for handle in handles:
        handle.set_timeout(timedelta(seconds=30))
    got: list[list[bytes]] = [[] for _ in range(poppers)]

    def pop_until_stop(i):
        while (item := handles[i].queue_pop("work")) != b"stop":
            got[i].append(item)

    threads = [threading.Thread(target=pop_until_stop, args=(i,)) for i in range(poppers)]
    for thread in threads:
        thread.start()  # most of them block before the first push
    items = [f"item-{n}".encode() for n in range(poppers * per_popper)]
    for item in items:
        store.queue_push("work", item)
    for _ in range(poppers):
        store.queue_push("work", "stop")
    for thread in threads:
        thread.join(60)
        assert not thread.is_alive()
    popped = [item for one in got for item in one]
    assert sorted(popped) == sorted(items)  # none lost, none twice
    for one in got:  # and each popper saw its items in push order
        assert one == sorted(one, key=items.index)
    assert store.queue_len("work") == 0


def _waiters(opened, count, key, timeout):
    """``count`` threads blocked in wait([key]) on their own handles; (threads, finished flags)."""
    finished = [threading.Event() for _ in range(count)]
    handles = [opened.peer() for _ in range(count)]

    def wait(i):
        handles[i].wait([key], timeout)
        finished[i].set()

    threads = [threading.Thread(target=wait, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    return threads, finished


def _first_to_finish(finished, limit=30.0):
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        done = [i for i, event in enumerate(finished) if event.is_set()]
        if done:
            return done
        time.sleep(0.005)
    raise AssertionError("no waiter returned")


@pytest.mark.parametrize("opened", kinds(fast={"tcp-client-over-tcp"}), indirect=True)
def test_a_push_wakes_one_wait_on_the_queue(opened, store):
    """torch: "wait with queues will only wake one waiting worker rather than all"."""
    # on a HashStore, wait() blocks on the same object; everywhere else each waiter has its own handle
    threads, finished = _waiters(opened, 2, "q", timedelta(seconds=60))
    time.sleep(0.5)  # both are blocked before the push (one that starts later would find the item at once)
    store.queue_push("q", "one")
    if opened.kind.endswith("file"):  # a FileStore polls: every wait() sees the queue (see file.py)
        assert all(event.wait(30) for event in finished)
    else:
        woken = _first_to_finish(finished)
        assert len(woken) == 1
        still_waiting = 1 - woken[0]
        assert not finished[still_waiting].wait(0.3)  # a wrong "wake all" would have released it too
        store.queue_push("q", "two")  # the next push wakes the other one
        assert finished[still_waiting].wait(30)
    for thread in threads:
        thread.join(30)
        assert not thread.is_alive()


# -- barrier --------------------------------------------------------------------------------------


def test_barrier_of_one_returns_and_a_used_key_returns_at_once(store):
    store.barrier("b", 1)
    store.barrier("b", 1)
    store.barrier("b", 3, SHORT)  # the key's barrier has been passed: later callers do not wait
    store.barrier("b2", 1, timedelta(seconds=5))


def test_barrier_timeout_names_key_world_size_and_arrivals(store):
    store.set_timeout(SHORT)
    with pytest.raises(DistStoreTimeoutError) as info:
        store.barrier("lonely", 2)
    text = str(info.value)
    assert "lonely" in text and "world_size=2" in text and "(1 arrived)" in text and "50 ms" in text
    with pytest.raises(DistStoreTimeoutError) as info:
        store.barrier("other", 5, timedelta(milliseconds=20))
    assert "20 ms" in str(info.value)


def test_barrier_releases_all_threads_when_the_last_arrives(opened, store):
    world_size = 3
    handles = [store] + [opened.peer() for _ in range(world_size - 1)]
    errors = []

    def arrive(handle):
        try:
            handle.barrier("start", world_size, timedelta(seconds=30))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=arrive, args=(h,)) for h in handles]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
        assert not thread.is_alive()
    assert errors == []


def test_barrier_argument_errors(store):
    with pytest.raises(ValueError, match="at least 1"):
        store.barrier("b", 0)
    with pytest.raises(ValueError):
        store.barrier("b", -1)
    with pytest.raises(TypeError):
        store.barrier("b", "2")
    with pytest.raises(TypeError):
        store.barrier(b"b", 1)
    with pytest.raises(ValueError):
        store.barrier("b", 1, timedelta(seconds=-1))
    assert store.list_keys() == []  # refused before anything was counted


# -- clone ------------------------------------------------------------------------------------------


def test_clone_sees_the_same_keys_and_queues(store):
    twin = store.clone()
    assert type(twin) is type(store)
    assert twin.timeout == store.timeout
    twin.set("from-twin", "1")
    store.queue_push("q", "x")
    assert store.get("from-twin") == b"1"
    assert twin.queue_pop("q") == b"x"
    assert twin.list_keys() == store.list_keys() == ["from-twin"]


def test_a_thread_blocked_on_a_clone_is_released_through_the_original(store):
    twin = store.clone()
    twin.set_timeout(timedelta(seconds=20))
    result = []
    thread = threading.Thread(target=lambda: result.append(twin.get("late")))
    thread.start()
    time.sleep(0.05)
    store.set("late", "v")
    thread.join(30)
    assert result == [b"v"]


def test_closing_a_clone_leaves_the_original_usable(opened, store):
    twin = store.clone()
    twin.close()
    store.set("after", "1")
    assert store.get("after") == b"1"
    if opened.kind in ("file", "tcp-master", "tcp-client"):  # a clone of its own (HashStore returns itself)
        with pytest.raises(DistError, match="closed"):
            twin.set("x", "1")
