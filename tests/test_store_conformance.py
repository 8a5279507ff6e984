"""One conformance suite, run against every store kind (HashStore, FileStore, TCPStore master and
client, and PrefixStore over each): torch.distributed.Store semantics, return values, errors and
timeouts. The expected values were taken from torch 2.13's own stores (see test_store_torch_oracle)."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest

from distcomm.errors import DistStoreError, DistStoreTimeoutError
from store_kinds import KINDS

SHORT = timedelta(milliseconds=50)


@pytest.fixture(params=sorted(KINDS))
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
