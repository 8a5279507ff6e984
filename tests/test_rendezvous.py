"""rendezvous(url, rank, world_size): env://, tcp://, file://, custom handlers, and their errors.

A world of several processes meeting through env:// is in test_store_multiprocess; here a world of
one, which is its own master, exercises every parsing and error path in-process."""

from __future__ import annotations

from datetime import timedelta

import importlib

import pytest

from distcomm.rendezvous import register_rendezvous_handler, rendezvous
from distcomm.store import FileStore, HashStore, TCPStore
from harness import free_port

ENV = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")
rdzv = importlib.import_module("distcomm.rendezvous")  # the module: distcomm.rendezvous is also the function


@pytest.fixture
def env(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    return monkeypatch


def test_env_world_of_one(env):
    iterator = rendezvous("env://", timeout=timedelta(seconds=10))
    store, rank, world_size = next(iterator)
    assert (rank, world_size) == (0, 1)
    assert isinstance(store, TCPStore)
    store.set("k", "v")
    assert store.get("k") == b"v"
    with pytest.raises(RuntimeError, match="re-rendezvous using env://"):
        next(iterator)
    store.close()


def test_env_rank_and_world_size_from_arguments(env):
    env.delenv("RANK")
    env.delenv("WORLD_SIZE")
    store, rank, world_size = next(rendezvous("env://", rank=0, world_size=1))
    assert (rank, world_size) == (0, 1)
    store.close()


@pytest.mark.parametrize("variable", ENV)
def test_env_missing_variable_is_named_with_the_fix(env, variable):
    env.delenv(variable)
    with pytest.raises(ValueError) as info:
        next(rendezvous("env://"))
    text = str(info.value)
    assert f"environment variable {variable} expected, but not set" in text
    assert "set " + variable in text


def test_env_bad_values(env):
    env.setenv("MASTER_PORT", "http")
    with pytest.raises(ValueError, match="MASTER_PORT='http' is not an integer"):
        next(rendezvous("env://"))
    env.setenv("MASTER_PORT", str(free_port()))
    env.setenv("RANK", "3")
    with pytest.raises(ValueError, match="rank 3 is outside 0..0"):
        next(rendezvous("env://"))


def test_tcp_with_query_and_with_arguments():
    port = free_port()
    store, rank, world_size = next(rendezvous(f"tcp://127.0.0.1:{port}?rank=0&world_size=1"))
    assert (rank, world_size) == (0, 1) and store.port == port
    store.close()
    port = free_port()
    store, rank, world_size = next(rendezvous(f"tcp://127.0.0.1:{port}", rank=0, world_size=1))
    assert (rank, world_size) == (0, 1)
    store.close()


def test_rank_and_world_size_given_twice():
    with pytest.raises(ValueError, match="already"):
        rendezvous("tcp://127.0.0.1:1234?rank=0&world_size=1", rank=0, world_size=1)


@pytest.mark.parametrize(
    "url, message",
    [
        ("tcp://127.0.0.1?rank=0&world_size=1", "port number missing"),
        ("tcp://127.0.0.1:1234?world_size=1", "rank parameter missing"),
        ("tcp://127.0.0.1:1234?rank=0", "world_size parameter missing"),
        ("tcp://127.0.0.1:1234?rank=x&world_size=1", "rank='x' is not an integer"),
        ("tcp://127.0.0.1:1234?rank=2&world_size=2", "rank 2 is outside 0..1"),
        ("file://?rank=0&world_size=1", "path missing"),
        ("file:///tmp/x?rank=0", "world_size parameter missing"),
    ],
)
def test_url_errors(url, message):
    with pytest.raises(ValueError, match=message):
        next(rendezvous(url))


def test_file(tmp_path):
    path = tmp_path / "rdzv"
    iterator = rendezvous(f"file://{path}", rank=0, world_size=1)
    store, rank, world_size = next(iterator)
    assert isinstance(store, FileStore) and (rank, world_size) == (0, 1)
    store.set("k", "v")
    with pytest.raises(RuntimeError, match="re-rendezvous using file://"):
        next(iterator)
    store.close()
    assert not path.exists()


def test_argument_types():
    with pytest.raises(RuntimeError, match="`url` must be a string"):
        rendezvous(42)
    with pytest.raises(RuntimeError, match="`rank` must be an integer"):
        rendezvous("env://", rank="0")
    with pytest.raises(RuntimeError, match="`world_size` must be an integer"):
        rendezvous("env://", world_size=1.5)


def test_unknown_scheme_lists_the_known_ones():
    with pytest.raises(RuntimeError, match=r"No rendezvous handler for nope://.*env://.*file://.*tcp://"):
        rendezvous("nope://x")


def test_custom_handler(monkeypatch):
    monkeypatch.setattr(rdzv, "_handlers", dict(rdzv._handlers))
    shared = HashStore()
    seen = []

    def handler(url, **kwargs):
        seen.append((url, kwargs))
        yield shared, 1, 2

    register_rendezvous_handler("mine", handler)
    assert next(rendezvous("mine://somewhere", rank=1, world_size=2, timeout=5)) == (shared, 1, 2)
    assert seen == [("mine://somewhere?rank=1&world_size=2", {"timeout": 5})]
    with pytest.raises(RuntimeError, match="already registered"):
        register_rendezvous_handler("mine", handler)
