"""TCPStore authentication (DISTCOMM_AUTH_KEY_FILE / DISTCOMM_AUTH_KEY): the right key works for every
kind of request and transport; no key, a wrong key, and a key only on the client are refused with
messages that say what to do; a key-holding server parses nothing from a connection that has not
authenticated (checked on its handlers, without a loop) and keeps serving the others; key files
that others can read are refused; and a 2-process job initialises through env:// with a key.

The exact bytes of the handshake are in test_store_protocol.py. The 2-process job is slow; the fast
tier (``pytest -m "not slow"``) keeps the rest.
"""

from __future__ import annotations

import os
import socket
import threading
from datetime import timedelta

import pytest

from distcomm.errors import DistStoreError
from distcomm.rendezvous import rendezvous
from distcomm.store import TCPStore
from distcomm.store.tcp import TCPStoreServer
from distcomm.store.tcp import connection as c, frames as f, handshake as h
from distcomm.store.tcp.auth import DistStoreAuthError, key_from_environment
from harness import free_port, run_world

KEY = "3f6c0b2d9a8e4f71c5d2e6a9b0f1c3d4"  # what `secrets.token_hex(16)` looks like
TIMEOUT = timedelta(seconds=20)


@pytest.fixture
def no_key_env(monkeypatch):
    monkeypatch.delenv("DISTCOMM_AUTH_KEY", raising=False)
    monkeypatch.delenv("DISTCOMM_AUTH_KEY_FILE", raising=False)
    return monkeypatch


@pytest.fixture
def key_file(tmp_path):
    path = tmp_path / "store.key"
    path.write_text(KEY + "\n")  # a trailing newline, as `echo` writes it, is not part of the key
    path.chmod(0o600)
    return str(path)


@pytest.fixture
def keyed(no_key_env, key_file):
    """DISTCOMM_AUTH_KEY_FILE set for this process (the way the docs recommend)."""
    no_key_env.setenv("DISTCOMM_AUTH_KEY_FILE", key_file)
    return no_key_env


@pytest.fixture
def master(keyed):
    store = TCPStore("127.0.0.1", 0, None, True, TIMEOUT)
    yield store
    store.close()


def _client(port: int) -> TCPStore:
    return TCPStore("127.0.0.1", port, None, False, TIMEOUT)


# -- the right key ------------------------------------------------------------------------------------


@pytest.mark.parametrize("local_socket", ["1", "0"], ids=["unix socket", "tcp"])
def test_the_right_key_serves_every_request(master, keyed, local_socket):
    keyed.setenv("DISTCOMM_STORE_LOCAL_SOCKET", local_socket)
    client = _client(master.port)
    assert client._client._sock.family == (socket.AF_UNIX if local_socket == "1" else socket.AF_INET)
    other = client.clone()
    try:
        client.set("k", "v")
        assert master.get("k") == b"v" and other.get("k") == b"v"
        assert client.add("n", 2) == 2 and master.add("n", 1) == 3
        assert client.compare_set("k", "v", "w") == b"w"
        client.multi_set(["a", "b"], ["1", "2"])
        assert other.multi_get(["a", "b"]) == [b"1", b"2"]
        # blocking requests, released by a write from another connection
        got = {}
        waiter = threading.Thread(
            target=lambda: got.update(get=other.get("later"), wait=other.wait(["later"]), pop=other.queue_pop("q"))
        )
        waiter.start()
        client.set("later", "here")
        client.queue_push("q", "item")
        waiter.join(30)
        assert got == {"get": b"here", "wait": None, "pop": b"item"}
        client.queue_push("q", "x")
        assert client.queue_len("q") == 1 and client.queue_pop("q", block=False) == b"x"  # same connection: ordered
        barrier = threading.Thread(target=lambda: other.barrier("b", 2))
        barrier.start()
        client.barrier("b", 2)
        barrier.join(30)
        assert not barrier.is_alive()
        assert master._server.stats["auth_refused"] == 0
    finally:
        other.close()
        client.close()


def test_the_key_may_come_from_the_variable(no_key_env):
    no_key_env.setenv("DISTCOMM_AUTH_KEY", KEY)
    master = TCPStore("127.0.0.1", 0, None, True, TIMEOUT)
    client = _client(master.port)
    client.set("k", "v")
    assert master.get("k") == b"v"
    client.close()
    master.close()


def test_key_file_and_variable_holding_the_same_key_interoperate(keyed, master):
    keyed.delenv("DISTCOMM_AUTH_KEY_FILE")
    keyed.setenv("DISTCOMM_AUTH_KEY", KEY)  # the file's content without its newline
    client = _client(master.port)
    assert client.add("n", 1) == 1
    client.close()


def test_a_master_waits_for_authenticated_workers(keyed):
    port = free_port()
    result = {}
    worker = threading.Thread(target=lambda: result.update(store=TCPStore("127.0.0.1", port, 2, False, TIMEOUT)))
    worker.start()
    master = TCPStore("127.0.0.1", port, 2, True, TIMEOUT)  # returns once both stores joined
    worker.join(30)
    result["store"].set("k", "v")
    assert master.get("k") == b"v"
    result["store"].close()
    master.close()


# -- refusals, with the message that says what to do ----------------------------------------------------


def test_a_client_without_the_key_is_refused(master, keyed):
    keyed.delenv("DISTCOMM_AUTH_KEY_FILE")
    with pytest.raises(DistStoreError, match="requires authentication") as info:
        _client(master.port)
    assert isinstance(info.value, DistStoreAuthError)
    assert "set DISTCOMM_AUTH_KEY_FILE / DISTCOMM_AUTH_KEY" in str(info.value)
    assert "as the job's other processes do" in str(info.value)
    assert master._server.stats["auth_refused"] == 1


def test_a_client_with_another_key_is_refused(master, keyed):
    keyed.delenv("DISTCOMM_AUTH_KEY_FILE")
    keyed.setenv("DISTCOMM_AUTH_KEY", "not the job's key")
    with pytest.raises(DistStoreAuthError, match="^authentication failed with the TCPStore server at 127.0.0.1:"):
        _client(master.port)
    assert master._server.stats["auth_refused"] == 1


def test_a_client_with_a_key_refuses_a_server_without_one(no_key_env):
    plain = TCPStore("127.0.0.1", 0, None, True, TIMEOUT)
    no_key_env.setenv("DISTCOMM_AUTH_KEY", KEY)
    with pytest.raises(DistStoreAuthError, match="demands that the TCPStore server .* authenticate too") as info:
        _client(plain.port)
    assert "refusing to use it" in str(info.value)
    plain.close()


def test_a_client_with_a_key_refuses_a_server_that_skips_the_proof(no_key_env, monkeypatch):
    """A server from before authentication ignores the flag and answers OK: still refused."""
    plain = TCPStoreServer("127.0.0.1", 0, local_socket=False).start()
    monkeypatch.setattr(c.ServerConnection, "hello_status", lambda self, hello: h.HELLO_STATUS_OK)
    no_key_env.setenv("DISTCOMM_AUTH_KEY", KEY)
    with pytest.raises(DistStoreAuthError, match="authenticate too"):
        _client(plain.port)
    plain.stop()


def test_a_server_that_cannot_prove_the_key_gets_no_request(no_key_env, monkeypatch):
    """A server accepting any proof (an impostor) is caught by the client's check of its proof."""
    server = TCPStoreServer("127.0.0.1", 0, local_socket=False, auth_key=b"the impostor's key").start()
    monkeypatch.setattr(c.ServerConnection, "proof_is_right", lambda self, proof: True)  # accepts anything
    no_key_env.setenv("DISTCOMM_AUTH_KEY", KEY)
    with pytest.raises(DistStoreAuthError, match="authentication failed"):
        _client(server.port)
    assert server.table.values == {}
    server.stop()


def test_the_server_keeps_serving_while_bad_clients_are_refused(master, keyed):
    good = _client(master.port)
    good.set("before", "1")
    keyed.delenv("DISTCOMM_AUTH_KEY_FILE")
    for bad_key in (None, "wrong", None, "also wrong"):
        if bad_key is None:
            keyed.delenv("DISTCOMM_AUTH_KEY", raising=False)
        else:
            keyed.setenv("DISTCOMM_AUTH_KEY", bad_key)
        with pytest.raises(DistStoreAuthError):
            _client(master.port)
    # raw connections: requests after a plain hello, and instead of a proof (more bytes than a proof)
    stolen = f.encode_set(1, b"stolen", b"x" * 64)
    for hello in (h.Hello(), h.ClientAuth(b"k").hello()):
        junk = c.ClientConnection.send(hello) + stolen
        sock = socket.create_connection(("127.0.0.1", master.port), timeout=10)
        sock.sendall(junk)
        assert _closed(sock)
    assert good.get("before") == b"1" and good.add("served", 1) == 1
    keyed.setenv("DISTCOMM_AUTH_KEY", KEY)
    fresh = _client(master.port)  # and a new good client still gets in
    assert fresh.get("before") == b"1"
    assert not good.check(["stolen"])
    assert master._server.stats["auth_refused"] >= 5
    fresh.close()
    good.close()


# -- a key-holding server's handlers, driven by hand: nothing is processed before a right proof ---------


from test_store_tcp_server import _ByHand  # noqa: E402 - a connection to a server whose loop is not running
from test_store_tcp_server import _closed_by_server as _closed  # noqa: E402 - EOF or reset within 10 s


SERVER_KEY = b"server key"


@pytest.fixture
def bare_server():
    server = TCPStoreServer("127.0.0.1", 0, local_socket=True, auth_key=SERVER_KEY)
    yield server
    server.stop()  # never started: closes its sockets in this thread


REQUESTS = f.encode_set(1, b"stolen", b"x") + f.encode(f.QueuePush(2, b"q", b"x")) + f.encode_add(3, b"n", 1)


def _nothing_processed(server) -> None:
    assert server.table.values == {} and server.table.queue_len(b"q") == 0
    assert len(server.parking) == 0 and server.parking.next_deadline is None  # nothing parked, ever


def test_requests_with_a_plain_hello_are_dropped_unread(bare_server):
    peer = _ByHand(bare_server, hello=False)
    assert peer.server_side.recv_size == h.AUTH_HELLO_SIZE  # the server reads no more than a handshake at a time
    peer.feed(c.ClientConnection.send(h.Hello()) + REQUESTS + f.encode_get(4, b"k", 3_600_000))
    assert peer.replies() == [h.HelloReply(h.VERSION, h.HELLO_STATUS_AUTH_REQUIRED)]
    assert not peer.open
    _nothing_processed(bare_server)


def test_requests_after_a_wrong_proof_are_not_processed(bare_server):
    peer = _ByHand(bare_server, hello=False)
    auth = h.ClientAuth(b"wrong key")
    peer.feed(c.ClientConnection.send(auth.hello()))
    (challenge,) = peer.replies()
    assert challenge.__class__ is h.AuthChallenge
    peer.feed(c.ClientConnection.send(auth.proof(challenge)))
    assert peer.replies() == [h.HelloReply(h.VERSION, h.HELLO_STATUS_AUTH_FAILED)]
    assert not peer.open
    assert bare_server.stats["auth_refused"] == 1
    _nothing_processed(bare_server)


@pytest.mark.parametrize("proof", ["wrong", "right"])
def test_requests_sent_with_the_proof_close_the_connection_unprocessed(bare_server, proof):
    peer = _ByHand(bare_server, hello=False)
    auth = h.ClientAuth(SERVER_KEY if proof == "right" else b"wrong key")
    peer.feed(c.ClientConnection.send(auth.hello()))
    (challenge,) = peer.replies()
    peer.feed(c.ClientConnection.send(auth.proof(challenge)) + REQUESTS)  # not waiting for the server's proof
    assert peer.replies() == [] and not peer.open
    assert bare_server.stats["protocol_errors"] == 1
    _nothing_processed(bare_server)


def test_the_local_address_is_revealed_only_to_an_authenticated_client(bare_server):
    address = bare_server.local_address
    assert address  # this server offers a Unix socket
    refused, wrong, right = (_ByHand(bare_server, hello=False) for _ in range(3))
    refused.feed(c.ClientConnection.send(h.Hello()))
    auth_wrong, auth_right = h.ClientAuth(b"wrong key"), h.ClientAuth(SERVER_KEY)
    wrong.feed(c.ClientConnection.send(auth_wrong.hello()))
    right.feed(c.ClientConnection.send(auth_right.hello()))
    (challenge,) = wrong.replies()
    wrong.feed(c.ClientConnection.send(auth_wrong.proof(challenge)))
    (challenge,) = right.replies()
    assert address not in refused.received() and address not in wrong.received() and address not in right.received()
    right.feed(c.ClientConnection.send(auth_right.proof(challenge)))
    (accepted,) = right.replies()
    assert accepted.__class__ is h.AuthAccepted and accepted.local_address == address
    assert auth_right.server_proved(accepted)
    assert right.server_side.recv_size > h.AUTH_HELLO_SIZE
    right.feed(REQUESTS + f.encode_get(4, b"stolen", 0))
    assert right.replies() == [f.Integer(3, 1), f.Value(4, b"x")]  # now it is served


def test_an_unfinished_handshake_is_closed_at_the_handshake_timeout(bare_server):
    import time

    peer = _ByHand(bare_server, hello=False)  # adopted as the loop adopts what it accepts: the idle timer runs
    auth = h.ClientAuth(SERVER_KEY)
    peer.feed(c.ClientConnection.send(auth.hello()))
    assert peer.replies()[0].__class__ is h.AuthChallenge
    bare_server.expire(time.monotonic() + 2 * bare_server.idle_timeout)  # never sends its proof
    assert not peer.open and bare_server.stats["idle_closed"] == 1


def test_the_masters_in_process_client_authenticates_too(bare_server):
    from distcomm.store.tcp.client import TCPStoreClient

    with pytest.raises(DistStoreAuthError, match="requires authentication"):
        TCPStoreClient("127.0.0.1", bare_server.port, 5, local=bare_server.connect_local())
    with pytest.raises(DistStoreAuthError, match="authentication failed"):
        TCPStoreClient("127.0.0.1", bare_server.port, 5, local=bare_server.connect_local(), auth_key=b"wrong")
    client = TCPStoreClient("127.0.0.1", bare_server.port, 5, local=bare_server.connect_local(), auth_key=SERVER_KEY)
    assert client.add(b"n", 1) == 1
    client.close()


# -- where the key comes from ------------------------------------------------------------------------------


def test_a_key_file_others_can_read_is_refused(keyed, key_file):
    os.chmod(key_file, 0o644)
    with pytest.raises(DistStoreAuthError, match=r"accessible by group or others \(mode 0644\).*chmod 600"):
        TCPStore("127.0.0.1", 0, None, True, TIMEOUT)
    os.chmod(key_file, 0o640)
    with pytest.raises(DistStoreAuthError, match="chmod 600"):
        key_from_environment()
    os.chmod(key_file, 0o600)
    assert key_from_environment() == KEY.encode()


def test_bad_key_settings_are_refused_with_what_to_do(no_key_env, tmp_path, key_file):
    assert key_from_environment() is None
    empty = tmp_path / "empty"
    empty.write_text("\n")
    empty.chmod(0o600)
    big = tmp_path / "big"
    big.write_bytes(b"k" * 5000)
    big.chmod(0o600)
    cases = [
        ({"DISTCOMM_AUTH_KEY": ""}, "set but empty"),
        ({"DISTCOMM_AUTH_KEY_FILE": ""}, "set but empty"),
        ({"DISTCOMM_AUTH_KEY_FILE": str(tmp_path / "missing")}, "cannot open the key file"),
        ({"DISTCOMM_AUTH_KEY_FILE": str(tmp_path)}, "not a regular file"),
        ({"DISTCOMM_AUTH_KEY_FILE": str(empty)}, "is empty"),
        ({"DISTCOMM_AUTH_KEY_FILE": str(big)}, "at most 4096"),
        ({"DISTCOMM_AUTH_KEY_FILE": key_file, "DISTCOMM_AUTH_KEY": KEY}, "set only one"),
    ]
    for environ, message in cases:
        with pytest.raises(DistStoreAuthError, match=message):
            key_from_environment(environ)


# -- rendezvous: tcp:// in this process, env:// across two processes ---------------------------------------


def test_tcp_rendezvous_hosts_an_authenticating_store(keyed):
    port = free_port()
    store, rank, world_size = next(rendezvous(f"tcp://127.0.0.1:{port}?rank=0&world_size=1", timeout=TIMEOUT))
    assert store._server.auth_key == KEY.encode()
    keyed.delenv("DISTCOMM_AUTH_KEY_FILE")
    with pytest.raises(DistStoreAuthError, match="requires authentication"):
        _client(port)
    store.close()


def _gather_objects(rank: int, world_size: int) -> list:
    import distcomm as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    try:
        gathered = [None] * world_size
        dist.all_gather_object(gathered, {"rank": rank, "payload": ("x" * rank, rank)})
        refused = None
        if rank == 1:  # a process of the same job without the key, reaching rank 0's store
            key_file = os.environ.pop("DISTCOMM_AUTH_KEY_FILE")
            try:
                TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), None, False,
                         timedelta(seconds=10))
            except DistStoreAuthError as exc:
                refused = str(exc)
            os.environ["DISTCOMM_AUTH_KEY_FILE"] = key_file
        dist.barrier()
        return gathered, refused
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_processes_init_process_group_and_all_gather_object_with_a_key(key_file, no_key_env):
    results = run_world(_gather_objects, 2, env={"DISTCOMM_AUTH_KEY_FILE": key_file}, timeout=120)
    expected = [{"rank": 0, "payload": ("", 0)}, {"rank": 1, "payload": ("x", 1)}]
    assert [gathered for gathered, _ in results] == [expected, expected]
    assert results[0][1] is None and "requires authentication" in results[1][1]


def test_the_unix_socket_requires_authentication_too(master):
    address = master._server.local_address
    assert address  # offered (to authenticated clients) on this host
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(address)
    sock.sendall(c.ClientConnection.send(h.Hello()) + f.encode_set(1, b"stolen", b"x"))
    proto = c.ClientConnection()
    while (event := proto.next_event()) is c.NEED_DATA:
        proto.receive_data(sock.recv(4096))
    assert event == h.HelloReply(h.VERSION, h.HELLO_STATUS_AUTH_REQUIRED)
    assert _closed(sock)
    assert not master.check(["stolen"])
