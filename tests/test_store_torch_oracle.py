"""Differential test: the same operations on distcomm's stores and torch 2.13's, same results.

Where torch's stores disagree with each other, distcomm follows the documented rule and the case
is left out here, with the reason: add() on a non-integer over TCP (torch's libuv server drops the
connection), a zero timeout (torch's HashStore waits forever, its TCPStore does not wait), and the
text of error messages.
"""

from __future__ import annotations

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


@pytest.mark.parametrize("kind", ["hash", "file", "tcp"])
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
