"""Differential test: the same operations on distcomm's stores and torch 2.13's, same results.

Where torch's stores disagree with each other, distcomm follows the documented rule and the case
is left out here, with the reason: add() on a non-integer over TCP (torch's libuv server drops the
connection), a zero timeout (torch's HashStore waits forever, its TCPStore does not wait), and the
text of error messages.

Tiers: torch's FileStore runs, the queues and barriers through PrefixStore and the wake-one waits
(they sleep to let both waiters block) are slow; the fast tier (``pytest -m "not slow"``) keeps the
other comparisons, on HashStore and TCPStore.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest

import distcomm.store as ours

torch_dist = pytest.importorskip("torch.distributed")

SHORT = timedelta(milliseconds=50)

SCRIPT = [
    ("num_keys",),
    ("set", "a", "x"),
    ("get", "a"),
    ("set", "b", b"\xff\x00"),
    ("get", "b"),
    ("set", "n", "12"),
    ("add", "n", 1),
    ("add", "c", 5),
    ("add", "c", 0),
    ("add", "c", -7),
    ("get", "c"),
    ("add", "big", 2**62),
    ("add", "big", 2**62),
    ("compare_set", "m", "zz", "d"),
    ("check", ["m"]),
    ("compare_set", "m2", "", "d"),
    ("get", "m2"),
    ("compare_set", "a", "nope", "y"),
    ("compare_set", "a", "x", "y"),
    ("compare_set", "a", "", "z"),
    ("get", "a"),
    ("check", ["a", "zz"]),
    ("check", ["a", "c"]),
    ("check", []),
    ("num_keys",),
    ("delete_key", "a"),
    ("delete_key", "a"),
    ("num_keys",),
    ("get", "a"),
    ("wait", ["missing", "c"]),
    ("wait", []),
    ("append", "ap", "1"),
    ("append", "ap", b"2"),
    ("get", "ap"),
    ("multi_set", ["k1", "k2"], ["v1", b"v2"]),
    ("multi_get", ["k1", "k2", "ap"]),
    ("multi_get", ["k1", "nokey"]),
    ("set", "", "empty key"),
    ("get", ""),
    ("set", "ev", ""),
    ("get", "ev"),
    ("num_keys",),
]

NON_INTEGER_ADD = [("set", "text", "x"), ("add", "text", 1), ("get", "text")]


def run(store, script):
    store.set_timeout(SHORT)
    outcomes = []
    for op, *args in script:
        try:
            outcomes.append(getattr(store, op)(*args))
        except ValueError:
            outcomes.append("ValueError")
        except RuntimeError:  # timeouts: torch raises DistStoreError (or RuntimeError for FileStore)
            outcomes.append("RuntimeError")
    return outcomes


def _pair(kind, tmp_path):
    if kind == "hash":
        return ours.HashStore(), torch_dist.HashStore()
    if kind == "file":
        return ours.FileStore(str(tmp_path / "ours"), 1), torch_dist.FileStore(str(tmp_path / "torch"), 1)
    return (ours.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=10)),
            torch_dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=10)))


@pytest.mark.parametrize("kind", ["hash", pytest.param("file", marks=pytest.mark.slow), "tcp"])
def test_same_results_as_torch(kind, tmp_path):
    mine, theirs = _pair(kind, tmp_path)
    assert run(mine, SCRIPT) == run(theirs, SCRIPT)


@pytest.mark.parametrize("kind", ["hash", "file"])
def test_add_on_a_non_integer_raises_value_error_like_torch(kind, tmp_path):
    mine, theirs = _pair(kind, tmp_path)
    assert run(mine, NON_INTEGER_ADD) == run(theirs, NON_INTEGER_ADD) == [None, "ValueError", b"x"]


def test_prefix_store_like_torch():
    mine = ours.PrefixStore("pre", ours.HashStore())
    theirs = torch_dist.PrefixStore("pre", torch_dist.HashStore())
    assert run(mine, SCRIPT) == run(theirs, SCRIPT)
    for store in (mine, theirs):
        store.set_timeout(timedelta(seconds=3))
    assert mine.underlying_store.timeout == theirs.underlying_store.timeout == timedelta(seconds=3)
    assert mine.underlying_store.get("pre/k1") == theirs.underlying_store.get("pre/k1") == b"v1"
    assert sorted(mine.list_keys()) == sorted(theirs.list_keys())


def test_tcp_store_signature_matches_torch():
    import inspect

    params = list(inspect.signature(ours.TCPStore).parameters)[:7]
    assert params == ["host_name", "port", "world_size", "is_master", "timeout", "wait_for_workers", "multi_tenant"]
    assert list(inspect.signature(ours.FileStore).parameters) == ["file_name", "world_size"]
    assert list(inspect.signature(ours.PrefixStore).parameters) == ["prefix", "store"]


# -- queues, barrier, clone (torch 2.13) ------------------------------------------------------------
#
# Left out, with the reason: get()/multi_get() of a name that is only a queue (torch's TCPStore
# returns b"" — its server answers the wait with the queue and then reads a missing key — while its
# HashStore waits for a set, as distcomm's stores all do); queues on FileStore (torch raises
# NotImplementedError, distcomm implements them: test below); barrier() with world_size < 1 (torch's
# TCPStore returns at once, its HashStore times out; distcomm raises ValueError: test below).

QUEUE_SCRIPT = [
    ("queue_len", "q"),
    ("queue_push", "q", "a"),
    ("queue_push", "q", b"\xff\x00"),
    ("queue_push", "q", ""),
    ("queue_len", "q"),
    ("check", ["q"]),
    ("wait", ["q"]),
    ("queue_pop", "q"),
    ("queue_pop", "q", False),
    ("queue_pop", "q", True),
    ("queue_len", "q"),
    ("queue_pop", "q", False),
    ("queue_pop", "q", None),
    ("queue_pop", "q"),  # blocks for the store timeout
    ("check", ["q"]),
    ("wait", ["q"]),
    ("set", "k", "v"),
    ("queue_push", "k", "x"),
    ("get", "k"),
    ("queue_len", "k"),
    ("list_keys",),
    ("num_keys",),
    ("queue_push", "only", "z"),
    ("list_keys",),
    ("num_keys",),
    ("delete_key", "only"),
    ("delete_key", "k"),
    ("queue_len", "only"),
    ("check", ["only", "k"]),
    ("queue_pop", "k"),
    ("queue_pop", "only"),
    ("queue_push", "", "empty name"),
    ("queue_pop", ""),
    ("queue_push", "q", 3),
    ("queue_pop", "q", "yes"),
    ("queue_len", "q"),
]

BARRIER_SCRIPT = [
    ("barrier", "b", 1),
    ("barrier", "b", 1),
    ("barrier", "b", 2, timedelta(seconds=5)),  # passed once: returns at once
    ("list_keys",),
    ("get", "b"),
    ("get", "b/num_members"),
    ("get", "b/last_member"),
    ("barrier", "c", 2),  # nobody else comes: times out
    ("list_keys",),
    ("barrier", "b", "2"),
]

_CLASSES = ("QueueEmptyError", "NotImplementedError", "TypeError", "ValueError", "RuntimeError")


def outcomes(store, script):
    """What each call returned, or the most specific of _CLASSES it raised (list_keys sorted)."""
    store.set_timeout(SHORT)
    results = []
    for op, *args in script:
        try:
            result = getattr(store, op)(*args)
            if op == "list_keys":
                # torch's FileStore lists its reference-count key; distcomm keeps membership out of list_keys
                result = sorted(k for k in result if k != "efcount/")
            results.append(result)
        except Exception as exc:  # noqa: BLE001 - classified
            names = {cls.__name__ for cls in type(exc).__mro__}
            results.append(next(name for name in _CLASSES if name in names))
    return results


def _pairs(kind, tmp_path):
    if kind.startswith("prefix-"):
        mine, theirs = _pairs(kind[len("prefix-") :], tmp_path)
        return ours.PrefixStore("pre", mine), torch_dist.PrefixStore("pre", theirs)
    return _pair(kind, tmp_path)


@pytest.mark.parametrize("kind", ["hash", "tcp", pytest.param("prefix-hash", marks=pytest.mark.slow), pytest.param("prefix-tcp", marks=pytest.mark.slow)])
def test_queues_like_torch(kind, tmp_path):
    mine, theirs = _pairs(kind, tmp_path)
    got, expected = outcomes(mine, QUEUE_SCRIPT), outcomes(theirs, QUEUE_SCRIPT)
    assert got == expected
    assert expected[11:14] == ["QueueEmptyError", "QueueEmptyError", "RuntimeError"]  # the oracle did raise


@pytest.mark.parametrize("kind", ["hash", "tcp", pytest.param("file", marks=pytest.mark.slow), pytest.param("prefix-hash", marks=pytest.mark.slow),
                                  pytest.param("prefix-tcp", marks=pytest.mark.slow)])
def test_barrier_like_torch(kind, tmp_path):
    script = BARRIER_SCRIPT
    if kind.startswith("prefix-"):
        # torch's PrefixStore.barrier() without a timeout waits for the PrefixStore's own default (300 s),
        # not the timeout set_timeout() gave it (which it forwards to the underlying store); distcomm uses
        # the store timeout, as every other call does. So the oracle gets the timeout spelled out.
        script = [step + (SHORT,) if step == ("barrier", "c", 2) else step for step in script]
    mine, theirs = _pairs(kind, tmp_path)
    expected = outcomes(theirs, script)
    assert outcomes(mine, script) == expected
    assert expected[7] == "RuntimeError"  # the oracle's lonely barrier did time out


def test_blocking_pop_timeout_is_a_dist_store_error_like_torch():
    for store in (ours.HashStore(), torch_dist.HashStore()):
        store.set_timeout(SHORT)
        with pytest.raises(RuntimeError) as info:
            store.queue_pop("q")
        assert type(info.value).__name__ != "QueueEmptyError"
        assert "DistStoreError" in {cls.__name__ for cls in type(info.value).__mro__}


def test_queue_empty_error_is_torch_s():
    import distcomm

    mine = [cls.__name__ for cls in distcomm.QueueEmptyError.__mro__]
    theirs = [cls.__name__ for cls in torch_dist.QueueEmptyError.__mro__]
    assert mine[: mine.index("RuntimeError") + 1] == theirs[: theirs.index("RuntimeError") + 1]
    assert "QueueEmptyError" in distcomm.__all__ and hasattr(torch_dist, "QueueEmptyError")


def test_queue_pop_and_barrier_signatures_match_torch():
    import inspect
    import re

    for name in ("queue_pop", "barrier"):
        first_line = getattr(torch_dist.Store, name).__doc__.splitlines()[0]  # "name(self: ..., key: str, ...)"
        theirs = re.findall(r"[(,] (\w+):", first_line)
        mine = [p for p in inspect.signature(getattr(ours.Store, name)).parameters if p != "self"]
        assert mine == theirs, name
    assert inspect.signature(ours.Store.queue_pop).parameters["block"].default is True
    assert inspect.signature(ours.Store.barrier).parameters["timeout"].default is None


def test_file_store_queues_are_a_distcomm_extension(tmp_path):
    mine, theirs = _pair("file", tmp_path)
    for op, args in (("queue_push", ("q", "x")), ("queue_len", ("q",)), ("queue_pop", ("q", False))):
        with pytest.raises(NotImplementedError, match="queue support is not implemented"):
            getattr(theirs, op)(*args)
    mine.queue_push("q", "x")
    assert mine.queue_len("q") == 1 and mine.queue_pop("q", False) == b"x"
    with pytest.raises(NotImplementedError, match="queue support is not implemented"):  # a store without queues
        ours.Store().queue_len("q")


def test_barrier_world_size_below_one_is_refused_where_torch_s_stores_disagree():
    tcp = torch_dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=10))
    tcp.barrier("zero", 0)  # returns at once
    hash_store = torch_dist.HashStore()
    with pytest.raises(RuntimeError):
        hash_store.barrier("zero", 0, SHORT)  # waits for an arrival count that never equals 0
    with pytest.raises(ValueError, match="at least 1"):
        ours.HashStore().barrier("zero", 0)


def test_clone_like_torch(tmp_path):
    mine_hash, theirs_hash = ours.HashStore(), torch_dist.HashStore()
    assert mine_hash.clone() is mine_hash and theirs_hash.clone() is theirs_hash  # one object, shared timeout
    for kind in ("tcp", "file", "prefix-tcp"):
        mine, theirs = _pairs(kind, tmp_path)
        for store in (mine, theirs):
            twin = store.clone()
            assert twin is not store and type(twin).__name__ == type(store).__name__
            twin.set("from-twin", "1")
            assert store.get("from-twin") == b"1"
    mine, theirs = _pair("tcp", tmp_path)
    for store in (mine, theirs):
        store.set_timeout(timedelta(seconds=7))
        assert store.clone().timeout == timedelta(seconds=7)  # TCPStore clones keep the timeout


def _one_push_wakes(store, clones) -> tuple[int, bool]:
    """Two threads wait([q]) on clones; one push. (how many returned, whether a second push freed the other)."""
    finished = [threading.Event(), threading.Event()]

    def wait(i):
        clones[i].wait(["q"], timedelta(seconds=30))
        finished[i].set()

    threads = [threading.Thread(target=wait, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    time.sleep(0.5)  # both are blocked before the push (one that starts later would find the item at once)
    store.queue_push("q", "one")
    deadline = time.monotonic() + 20
    while not any(e.is_set() for e in finished) and time.monotonic() < deadline:
        time.sleep(0.005)
    time.sleep(0.3)
    woken_by_one = sum(e.is_set() for e in finished)
    store.queue_push("q", "two")
    both = all(e.wait(20) for e in finished)
    for thread in threads:
        thread.join(20)
    return woken_by_one, both


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["tcp", "hash"])
def test_a_push_wakes_one_wait_like_torch(kind, tmp_path):
    mine, theirs = _pair(kind, tmp_path)
    results = []
    for store in (mine, theirs):
        clones = [store.clone(), store.clone()]
        results.append(_one_push_wakes(store, clones))
    assert results[0] == results[1] == (1, True)
