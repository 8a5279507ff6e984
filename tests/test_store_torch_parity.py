"""What torch 2.13's stores do at their edges — keywords, repr, error types and texts, a
user's Store subclass, a FileStore opened twice, PrefixStore(prefix, None), tcp:// rendezvous edges.

Each test runs the same thing on torch's class and on distcomm's and compares. Where distcomm's
message adds advice, it adds it after torch's text, so a regex written against torch still matches.
"""

from __future__ import annotations

import os
import re
import socket
from datetime import timedelta

import pytest

import distcomm.store as ours
from distcomm.errors import DistNetworkError, DistStoreError

torch_dist = pytest.importorskip("torch.distributed")


def outcome(call):
    """(names of the exception's classes, most derived first; message) of ``call()``, or ("ok", result)."""
    try:
        return "ok", call()
    except Exception as exc:  # noqa: BLE001 - the point is to record whatever it raises
        return tuple(c.__name__ for c in type(exc).__mro__), str(exc)


def torch_regex(text: str) -> str:
    """A regex a user would write against torch's message: the text, digits generalised. Of torch's
    internal-assert messages only the last sentence ("Not implemented.") is the message; the rest
    locates torch's C++ source and asks to report a bug, which no user matches on."""
    text = re.sub(r"^fn INTERNAL ASSERT FAILED at .*please report a bug to PyTorch\. ", "", text)
    return re.sub(r"\\?\d+", r"\\d+", re.escape(text))


def assert_like(theirs, mine):
    """``mine`` raises the type ``theirs`` does, or a subclass of it (by name: distcomm's are its own
    classes), so ``except``/``pytest.raises`` written for torch catch it; and its message matches a
    regex written on torch's."""
    their_types, their_text = theirs
    my_types, my_text = mine
    assert their_types != "ok" and their_types[0] in my_types, (mine, theirs)
    assert re.search(torch_regex(their_text), my_text), (my_text, their_text)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# -- 3: a user's Store subclass ----------------------------------------------------------------------


def _user_store(base):
    class UserStore(base):
        """A store written the torch way: public set/get only."""

        def __init__(self):
            super().__init__()
            self.data = {}

        def set(self, key, value):
            self.data[key] = value.encode() if isinstance(value, str) else value

        def get(self, key):
            return self.data[key]

    return UserStore()


EXTENDED_CALLS = [
    ("has_extended_api", ()),
    ("append", ("k", "v")),
    ("compare_set", ("k", "a", "b")),
    ("multi_set", (["k1", "k2"], ["v1", "v2"])),
    ("multi_get", (["k1", "k2"],)),
    ("multi_get", (["k1", "absent"],)),
    ("list_keys", ()),
    ("add", ("n", 1)),
    ("wait", (["k"],)),
    ("check", (["k"],)),
    ("num_keys", ()),
    ("delete_key", ("k",)),
    ("barrier", ("b", 1)),
    ("clone", ()),
    ("queue_len", ("q",)),
]


@pytest.mark.parametrize("name,args", EXTENDED_CALLS, ids=[f"{n}-{i}" for i, (n, _) in enumerate(EXTENDED_CALLS)])
def test_a_user_subclass_gets_torch_s_base_store_behaviour(name, args):
    theirs = outcome(lambda: getattr(_user_store(torch_dist.Store), name)(*args))
    mine = outcome(lambda: getattr(_user_store(ours.Store), name)(*args))
    if theirs[0] == "ok":
        assert mine == theirs
    else:
        assert_like(theirs, mine)


def test_a_user_subclass_falls_back_like_torch_and_prefix_store_forwards_has_extended_api():
    theirs, mine = _user_store(torch_dist.Store), _user_store(ours.Store)
    for store in (theirs, mine):
        store.multi_set(["a", "b"], ["1", "2"])
    assert theirs.multi_get(["a", "b"]) == mine.multi_get(["a", "b"]) == [b"1", b"2"]
    for wrapped in (torch_dist.PrefixStore("p", theirs), ours.PrefixStore("p", mine)):
        assert wrapped.has_extended_api() is False
    for wrapped in (torch_dist.PrefixStore("p", torch_dist.HashStore()), ours.PrefixStore("p", ours.HashStore())):
        assert wrapped.has_extended_api() is True
    assert torch_dist.Store().has_extended_api() is ours.Store().has_extended_api() is False
    assert_like(outcome(lambda: torch_dist.Store().set("x", "y")), outcome(lambda: ours.Store().set("x", "y")))


# -- 5: PrefixStore(prefix, None) -------------------------------------------------------------------


def test_prefix_store_over_none_raises_like_torch():
    theirs = outcome(lambda: torch_dist.PrefixStore("p", None))
    assert (theirs[0][0], theirs[1]) == ("ValueError", "store argument cannot be None")
    assert outcome(lambda: ours.PrefixStore("p", None)) == theirs


# -- 6, 7: tcp:// rendezvous -----------------------------------------------------------------------


@pytest.mark.slow  # waits out a timeout
def test_tcp_rendezvous_to_a_host_that_does_not_resolve_raises_like_torch():
    from torch.distributed import rendezvous as torch_rendezvous

    from distcomm.rendezvous import rendezvous

    url = f"tcp://nonexistent.invalid:{free_port()}?rank=1&world_size=2"  # a worker: it connects
    theirs = outcome(lambda: next(torch_rendezvous(url, timeout=timedelta(milliseconds=300))))
    mine = outcome(lambda: next(rendezvous(url, timeout=timedelta(milliseconds=300))))
    assert_like(theirs, mine)
    assert "does not resolve" in mine[1]
    # rank 0 fails at once (torch's master waits out the timeout first), with torch's type
    url0 = f"tcp://nonexistent.invalid:{free_port()}?rank=0&world_size=2"
    with pytest.raises(DistNetworkError, match=r"cannot be retrieved \(gai error"):
        next(rendezvous(url0, timeout=timedelta(seconds=30)))


def test_rank_in_the_url_and_the_arguments_raises_like_torch():
    from torch.distributed import rendezvous as torch_rendezvous

    from distcomm.rendezvous import rendezvous

    url = "tcp://127.0.0.1:29515?rank=0&world_size=2"
    theirs = outcome(lambda: torch_rendezvous(url, rank=0, world_size=2))
    assert theirs[0][0] == "AssertionError"
    assert_like(theirs, outcome(lambda: rendezvous(url, rank=0, world_size=2)))
    with pytest.raises(ValueError):  # what distcomm raised before: still caught by such code
        rendezvous(url, rank=0, world_size=2)


@pytest.mark.slow  # waits out a timeout
def test_connect_timeout_raises_like_torch():
    port = free_port()
    theirs = outcome(lambda: torch_dist.TCPStore("127.0.0.1", port, None, False, timedelta(milliseconds=300)))
    mine = outcome(lambda: ours.TCPStore("127.0.0.1", port, None, False, timedelta(milliseconds=300)))
    assert_like(theirs, mine)


# -- 1, 2: TCPStore's keywords, repr and messages ---------------------------------------------------


def test_tcp_store_takes_torch_s_keywords_in_torch_s_order():
    import inspect

    theirs = re.search(r"__init__\(self: [^,]+, (.*)\) -> None", torch_dist.TCPStore.__init__.__doc__).group(1)
    their_names = [part.split(":")[0].strip() for part in re.split(r", (?=\w+:)", theirs)]
    assert their_names[-2:] == ["master_listen_fd", "use_libuv"]
    assert list(inspect.signature(ours.TCPStore).parameters)[: len(their_names)] == their_names


@pytest.mark.parametrize("use_libuv", [True, False, None])
def test_libuv_backend_reports_what_torch_reports(use_libuv):
    kwargs = {} if use_libuv is None else {"use_libuv": use_libuv}
    stores = [cls.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=10), **kwargs) for cls in (torch_dist, ours)]
    assert stores[0].libuvBackend == stores[1].libuvBackend == (use_libuv is not False)
    assert stores[1].clone().libuvBackend == stores[1].libuvBackend
    stores[1].close()


@pytest.mark.parametrize("listening", [True, False])
def test_master_listen_fd_is_adopted_like_torch(listening):
    import os

    for cls in (torch_dist, ours):
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        if listening:
            sock.listen()
        port = sock.getsockname()[1]
        fd = sock.detach()  # the store owns it from here, as in torch
        master = cls.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=10), master_listen_fd=fd)
        assert master.port == port
        client = cls.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=10))
        master.set("k", "v")
        assert client.get("k") == b"v"
        del client, master
        import gc

        gc.collect()
        with pytest.raises(OSError):
            os.fstat(fd)  # closed with the store


def test_master_listen_fd_errors_like_torch():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        other = port + 1 if port < 65535 else port - 1
        theirs = outcome(lambda: torch_dist.TCPStore("127.0.0.1", other, 1, True, master_listen_fd=sock.fileno()))
        mine = outcome(lambda: ours.TCPStore("127.0.0.1", other, 1, True, master_listen_fd=sock.fileno()))
        assert_like(theirs, mine)
        sock.getsockname()  # still the caller's, still open
    theirs = outcome(lambda: torch_dist.TCPStore("127.0.0.1", 0, 1, True, master_listen_fd=9999))
    assert_like(theirs, outcome(lambda: ours.TCPStore("127.0.0.1", 0, 1, True, master_listen_fd=9999)))


def test_repr_has_torch_s_shape():
    shape = r"^TCPStore\(client=TCPClient\(.*\), server=(TCPServer\(port={port}\)|<nullptr>)\)$"
    for cls in (torch_dist, ours):
        master = cls.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=10))
        client = cls.TCPStore("127.0.0.1", master.port, None, False, timedelta(seconds=10))
        assert re.match(shape.format(port=master.port), repr(master)) and f"TCPServer(port={master.port})" in repr(master)
        assert re.match(shape.format(port=master.port), repr(client)) and repr(client).endswith("server=<nullptr>)")


def test_world_size_zero_and_port_in_use_raise_like_torch():
    assert_like(
        outcome(lambda: torch_dist.TCPStore("127.0.0.1", 0, 0, True)), outcome(lambda: ours.TCPStore("127.0.0.1", 0, 0, True))
    )
    taken = torch_dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=10))
    theirs = outcome(lambda: torch_dist.TCPStore("127.0.0.1", taken.port, None, True, timedelta(seconds=2)))
    mine = outcome(lambda: ours.TCPStore("127.0.0.1", taken.port, None, True, timedelta(seconds=2)))
    assert_like(theirs, mine)


def _timeouts(module, kind, tmp_path):
    short = timedelta(milliseconds=100)
    if kind == "tcp":
        store = module.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=10))
    elif kind == "hash":
        store = module.HashStore()
    elif kind == "prefix-tcp":
        store = module.PrefixStore("pre", module.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=10)))
    else:
        store = module.FileStore(str(tmp_path / f"{module.__name__}.store"), 1)
    store.set_timeout(short)
    calls = {
        "get": lambda: store.get("k"),
        "wait": lambda: store.wait(["k", "j"], short),
        "multi_get": lambda: store.multi_get(["k"]),
        "barrier": lambda: store.barrier("b", 2, short),
    }
    if kind != "file":  # torch's FileStore has no queues
        calls["queue_pop"] = lambda: store.queue_pop("q")
    return {name: outcome(call) for name, call in calls.items()}


@pytest.mark.slow  # waits out a timeout
@pytest.mark.parametrize("kind", ["tcp", "hash", "file", "prefix-tcp"])
def test_timeouts_raise_like_torch(kind, tmp_path):
    theirs, mine = _timeouts(torch_dist, kind, tmp_path), _timeouts(ours, kind, tmp_path)
    for name in theirs:
        assert_like(theirs[name], mine[name])


@pytest.mark.slow  # waits out a timeout
def test_waiting_for_workers_times_out_like_torch():
    theirs = outcome(lambda: torch_dist.TCPStore("127.0.0.1", 0, 3, True, timedelta(milliseconds=500)))
    mine = outcome(lambda: ours.TCPStore("127.0.0.1", 0, 3, True, timedelta(milliseconds=500)))
    assert_like(theirs, mine)


# -- 4: one FileStore path opened twice -------------------------------------------------------------


def test_a_file_store_opened_twice_in_one_process_works_like_torch(tmp_path):
    for module in (torch_dist, ours):
        path = str(tmp_path / f"{module.__name__}.store")
        first = module.FileStore(path, 1)
        second = module.FileStore(path, 1)  # distcomm said "left over from an earlier run"
        first.set("k", "v")
        assert second.get("k") == b"v"
        second.add("n", 2)
        assert first.add("n", 1) == 3
    first.close()  # distcomm's: the other user still has it open, so the file stays
    assert second.get("k") == b"v" and os.path.exists(path)
    second.close()
    assert not os.path.exists(path)


def test_a_file_whose_users_all_closed_is_still_a_leftover(tmp_path):
    path = str(tmp_path / "fs")
    first, second = ours.FileStore(path, 1), ours.FileStore(path, 1)
    os.link(path, str(tmp_path / "keep"))  # the file outlives its removal under another name
    first.close()
    second.close()
    os.rename(str(tmp_path / "keep"), path)
    with pytest.raises(DistStoreError, match="left over from an earlier run"):
        ours.FileStore(path, 1)
