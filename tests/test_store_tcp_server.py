"""TCPStore server and client against real sockets: bad input, idle connections, many clients,
late answers, lost connections, port conflicts, and the file-descriptor limit.

Every bad-input case checks two things: the offending connection is closed, and a client that was
connected before keeps being served (and a new one can still connect).

Tiers: the cases that wait on the server's timers or open hundreds of connections are slow; the
fast tier (``pytest -m "not slow"``) keeps the others.
"""

from __future__ import annotations

import os
import random
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time
import weakref
from datetime import timedelta

import pytest

from distcomm.errors import DistNetworkError, DistStoreError, DistStoreTimeoutError
from distcomm.store import TCPStore
from distcomm.store.tcp import TCPStoreServer
from distcomm.store.tcp import connection as c, frames as f, handlers, handshake as h
from distcomm.store.tcp import client as client_module
from distcomm.store.tcp.client import TCPStoreClient
from harness import Interrupted, alarm, answered_while_asleep, free_port, voluntary_sleeps

HELLO = c.ClientConnection.send(h.Hello())
IDLE = 0.4  # the test server's idle timeout, in seconds


def _hello_reply(sock: socket.socket) -> h.HelloReply:
    proto = c.ClientConnection()
    while (event := proto.next_event()) is c.NEED_DATA:
        data = sock.recv(1)  # byte by byte: leave what follows the reply in the socket
        assert data, "the server closed the connection before its hello reply"  # not a silent spin
        proto.receive_data(data)
    return event


@pytest.fixture
def server():
    server = TCPStoreServer("127.0.0.1", 0, idle_timeout=IDLE, max_frame_size=1 << 20).start()
    yield server
    server.stop()


@pytest.fixture
def good_client(server):
    client = TCPStore("127.0.0.1", server.port, timeout=timedelta(seconds=10))
    client.set("before", "1")
    yield client
    client.close()


def _raw(server) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _closed_by_server(sock: socket.socket, within: float = 10.0) -> bool:
    """True if the server closes ``sock`` (EOF or reset) within ``within`` seconds; replies are skipped."""
    sock.settimeout(within)
    try:
        while sock.recv(4096):
            pass
        return True
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False
    finally:
        sock.close()


def _still_served(server, good_client) -> None:
    assert good_client.add("served", 1) >= 1
    assert good_client.get("before") == b"1"
    fresh = TCPStore("127.0.0.1", server.port, timeout=timedelta(seconds=10))
    assert fresh.get("before") == b"1"
    fresh.close()


# -- bad input ------------------------------------------------------------------------------------


def test_random_bytes(server, good_client):
    rng = random.Random(1234)
    for _ in range(5):
        sock = _raw(server)
        sock.sendall(bytes(rng.getrandbits(8) for _ in range(256)))
        assert _closed_by_server(sock)
    _still_served(server, good_client)
    assert server.stats["protocol_errors"] >= 5


def test_random_bytes_after_a_valid_hello(server, good_client):
    rng = random.Random(99)
    sock = _raw(server)
    sock.sendall(HELLO + bytes([0x7F]) * 13 + bytes(rng.getrandbits(8) for _ in range(64)))
    assert _closed_by_server(sock)
    _still_served(server, good_client)


def test_wrong_magic(server, good_client):
    sock = _raw(server)
    sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    assert _closed_by_server(sock)
    _still_served(server, good_client)


def test_wrong_version_gets_a_refusal_naming_our_version_then_close(server, good_client):
    sock = _raw(server)
    sock.sendall(b"DCKV\x63\x00\x00\x00")  # version 99
    assert _hello_reply(sock) == h.HelloReply(h.VERSION, h.HELLO_STATUS_UNSUPPORTED_VERSION)
    assert _closed_by_server(sock)
    _still_served(server, good_client)


def test_wrong_version_client_error_names_both_versions(server, monkeypatch):
    newer_server = staticmethod(lambda hello: h.HelloReply(3, h.HELLO_STATUS_UNSUPPORTED_VERSION))
    monkeypatch.setattr(c.ServerConnection, "reply_to", newer_server)
    with pytest.raises(DistNetworkError, match="speaks protocol version 3 and refused this client's version 2"):
        TCPStoreClient("127.0.0.1", server.port, timeout=5)


def test_length_prefix_of_2_to_the_40(server, good_client):
    sock = _raw(server)
    sock.sendall(HELLO)
    assert _hello_reply(sock).status == h.HELLO_STATUS_OK
    sock.sendall(struct.pack("<Q", 2**40))  # and nothing more: refused on the prefix alone
    assert _closed_by_server(sock)
    _still_served(server, good_client)


def test_a_frame_over_the_server_maximum(server, good_client):
    sock = _raw(server)
    try:
        sock.sendall(HELLO + f.encode_set(1, b"k", b"v" * ((1 << 20) + 1)))
    except (BrokenPipeError, ConnectionResetError):
        pass  # the server refused on the length prefix and closed while the 1 MiB body was still going out
    assert _closed_by_server(sock)
    _still_served(server, good_client)


@pytest.mark.slow
def test_a_connection_that_never_sends(server, good_client):
    sock = _raw(server)
    assert _closed_by_server(sock, within=IDLE + 5)
    _still_served(server, good_client)
    assert server.stats["idle_closed"] >= 1


@pytest.mark.slow
def test_a_client_sending_one_byte_at_a_time_is_closed(server, good_client):
    sock = _raw(server)
    closed = threading.Event()

    def drip():
        # a valid hello and frame, but one byte every IDLE/3 seconds: never completes in time
        for byte in HELLO + f.encode_set(1, b"key", b"value"):
            try:
                sock.send(bytes([byte]))
            except OSError:
                closed.set()
                return
            time.sleep(IDLE / 3)

    thread = threading.Thread(target=drip, daemon=True)
    thread.start()
    time.sleep(IDLE / 2)
    _still_served(server, good_client)  # served while the slow client drips
    sock2 = sock.dup()
    assert _closed_by_server(sock2, within=IDLE * 4 + 5)
    thread.join(IDLE * 30)
    assert server.stats["idle_closed"] >= 1
    _still_served(server, good_client)


@pytest.mark.slow
def test_idle_between_frames_is_not_closed(server):
    client = TCPStore("127.0.0.1", server.port)
    client.set("k", "v")
    time.sleep(IDLE * 2.5)  # several sweeps
    assert client.get("k") == b"v"
    client.close()


def test_a_client_closing_while_parked(server, good_client):
    sock = _raw(server)
    sock.sendall(HELLO + f.encode_get(1, b"never-set-yet", 60_000))
    assert _hello_reply(sock).status == h.HELLO_STATUS_OK
    sock.close()
    time.sleep(0.05)
    good_client.set("never-set-yet", "now")  # wakes nobody, breaks nothing
    _still_served(server, good_client)


# -- many clients -----------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_thousand_concurrent_clients(server):
    count = 1000
    socks = []
    try:
        # a burst of connects (the listen backlog holds what accept() has not taken), each with its
        # hello at once: a hello sent only after all 1000 connects could come later than the server's
        # idle timeout for unfinished hellos (IDLE) on a loaded machine, and be refused for it
        for _ in range(count):
            socks.append(socket.create_connection(("127.0.0.1", server.port), timeout=30))
            socks[-1].sendall(HELLO)
        for sock in socks:
            assert _hello_reply(sock).status == h.HELLO_STATUS_OK
        for i, sock in enumerate(socks):
            sock.sendall(f.encode_add(i, b"joined", 1))
        totals = []
        for i, sock in enumerate(socks):
            proto = c.ClientConnection()
            proto.receive_data(c.ServerConnection.send(h.HelloReply()))
            proto.next_event()
            events = []
            while not events:
                events = proto.receive_events(sock.recv(64))
            assert events[0].request_id == i
            totals.append(events[0].value)
        assert sorted(totals) == list(range(1, count + 1))
        assert server.num_clients >= count
    finally:
        for sock in socks:
            sock.close()


# -- the client's side ------------------------------------------------------------------------------


def test_a_late_answer_to_an_abandoned_get_does_not_desync_the_client(server):
    client = TCPStoreClient("127.0.0.1", server.port, timeout=10)
    setter = TCPStore("127.0.0.1", server.port)
    with client._lock:  # give up on a GET client-side while the server still holds it (60 s)
        assert client._exchange("get", f.encode_get(77, b"late", 60_000), 77, wait=0.05) is None
    setter.set("late", "value")  # the server now answers request 77, which nobody waits for
    time.sleep(0.05)
    assert client.add(b"n", 5) == 5  # request ids tell the late Value from the Integer
    assert client.get("late", 1.0) == b"value"
    client.close()
    setter.close()


class _SocketLike:
    """What a client needs of a socket, and not a socket: the client then takes add()'s round trip
    in Python (as on the master's in-process connection), not in C (_add_trip.c), which needs a
    socket's file descriptor."""

    def __init__(self, sock: socket.socket):
        self._sock = sock

    def __getattr__(self, name):
        return getattr(self._sock, name)


needs_add_in_c = pytest.mark.skipif(not client_module.ADD_IN_C, reason="the C round trip is not built here")
ADD_TRIPS = [pytest.param("c", marks=needs_add_in_c), "python"]


def _client_on_a_socketpair(add_trip: str = "c") -> tuple[TCPStoreClient, socket.socket]:
    """A client whose connection is one end of a socket pair, past its hello; the test is the server
    on the other end, and sends exactly the bytes it wants. ``add_trip``: which of add()'s round
    trips the client takes, "c" (on a socket) or "python" (on a socket-like object)."""
    ours, theirs = socket.socketpair()
    proto = c.ClientConnection()
    proto.receive_data(c.ServerConnection.send(h.HelloReply()))
    proto.next_event()
    connection = ours if add_trip == "c" else _SocketLike(ours)
    return TCPStoreClient("fake", 0, timeout=10, connected=(connection, proto)), theirs


@pytest.mark.parametrize("add_trip", ADD_TRIPS)
def test_add_takes_no_shortcut_while_a_piece_of_a_late_answer_is_buffered(add_trip):
    """add()'s inline round trip reads the next bytes as the start of a frame. After a read that left
    a late answer's first bytes buffered, the next bytes are that answer's rest, which here happen to
    be exactly an Integer reply to the next add(): taken as one, add() would return 666."""
    late_value = f.encode_integer(2, 666)  # a late Value whose payload looks like add #2's reply
    late = f.encode(f.Value(99, late_value))
    head = len(late) - len(late_value)
    client, theirs = _client_on_a_socketpair(add_trip)
    add_frame_size = len(f.encode_add(1, b"n", 1))

    def server():
        theirs.recv(add_frame_size, socket.MSG_WAITALL)
        theirs.sendall(f.encode_integer(1, 10) + late[:head])  # the reply, then a late answer's head
        theirs.recv(add_frame_size, socket.MSG_WAITALL)
        theirs.sendall(late[head:])  # the late answer's rest, read alone ...
        time.sleep(0.2)
        theirs.sendall(f.encode_integer(2, 20))  # ... before the real reply
        theirs.recv(add_frame_size, socket.MSG_WAITALL)
        theirs.sendall(f.encode_integer(3, 30))

    thread = threading.Thread(target=server, daemon=True)
    thread.start()
    try:
        assert client.add(b"n", 1) == 10
        assert client.add(b"n", 1) == 20
        assert client.add(b"n", 1) == 30  # and the stream is in step again
    finally:
        thread.join(10)
        client.close()
        theirs.close()


@needs_add_in_c
def test_on_a_socket_add_round_trips_without_the_socket_objects_methods():
    """The first add() parses its reply the general way; the next ones take the round trip in C,
    on the socket's file descriptor: the socket object's own methods are not called."""

    class Counting(socket.socket):
        calls = 0

        def sendall(self, *args):
            Counting.calls += 1
            return super().sendall(*args)

        def recv(self, *args):
            Counting.calls += 1
            return super().recv(*args)

    ours, theirs = socket.socketpair()
    sock = Counting(fileno=ours.detach())
    proto = c.ClientConnection()
    proto.receive_data(c.ServerConnection.send(h.HelloReply()))
    proto.next_event()
    client = TCPStoreClient("fake", 0, timeout=10, connected=(sock, proto))
    add_frame_size = len(f.encode_add(1, b"n", 1))

    def server():
        for request_id in (1, 2, 3):
            theirs.recv(add_frame_size, socket.MSG_WAITALL)
            theirs.sendall(f.encode_integer(request_id, 10 * request_id))

    thread = threading.Thread(target=server, daemon=True)
    thread.start()
    try:
        assert client.add(b"n", 1) == 10
        first = Counting.calls
        assert first >= 2
        assert client.add(b"n", 1) == 20
        assert client.add(b"n", 1) == 30
        assert Counting.calls == first
    finally:
        thread.join(10)
        client.close()
        theirs.close()


@pytest.mark.parametrize("add_trip", ADD_TRIPS)
def test_add_after_a_late_answer_and_a_split_error_stays_in_step(add_trip):
    """On the inline round trip (the second add(), at the same timeout): a late Integer for another
    request, then this request's Error, arriving in pieces that cut both; the next add() gets its
    own reply."""
    client, theirs = _client_on_a_socketpair(add_trip)
    add_frame_size = len(f.encode_add(1, b"n", 1))
    error = f.encode(f.Error(2, f.ERROR_NOT_AN_INTEGER, b"not a number"))

    def server():
        theirs.recv(add_frame_size, socket.MSG_WAITALL)
        theirs.sendall(f.encode_integer(1, 10))
        theirs.recv(add_frame_size, socket.MSG_WAITALL)
        late = f.encode_integer(99, 666)
        for piece in (late[:10], late[10:] + error[:9], error[9:]):  # every read a piece of a frame
            theirs.sendall(piece)
            time.sleep(0.1)
        theirs.recv(add_frame_size, socket.MSG_WAITALL)
        theirs.sendall(f.encode_integer(3, 30))

    thread = threading.Thread(target=server, daemon=True)
    thread.start()
    try:
        assert client.add(b"n", 1) == 10
        with pytest.raises(ValueError, match="not a number"):
            client.add(b"n", 1)
        assert client.add(b"n", 1) == 30
    finally:
        thread.join(10)
        client.close()
        theirs.close()


@pytest.mark.parametrize("add_trip", ADD_TRIPS)
def test_add_interrupted_while_its_frame_goes_out_never_desyncs(add_trip):
    """A signal handler raises while a large add() frame is going out. In C the rest of the frame
    goes out first, and the next add() gets its own reply (the late one is dropped by its id); in
    Python how much went out is unknown, so the client closes the connection and says so next time.
    Never does the server read a request as another's rest, nor the client return a wrong value."""
    client, theirs = _client_on_a_socketpair(add_trip)
    key = bytes(range(256)) * 16384  # 4 MiB: more than the socket's buffer
    small, large = len(f.encode_add(1, b"n", 1)), len(f.encode_add(2, key, 1))
    received = []

    def first():
        received.append(theirs.recv(small, socket.MSG_WAITALL))
        theirs.sendall(f.encode_integer(1, 10))

    def rest(signalled):  # once the signal came; blocking reads: a closed client ends them (EOF)
        signalled.fired.wait(5)
        try:
            received.append(theirs.recv(large, socket.MSG_WAITALL))
            theirs.sendall(f.encode_integer(2, 20))
            received.append(theirs.recv(small, socket.MSG_WAITALL))
            theirs.sendall(f.encode_integer(3, 30))
        except OSError:  # the Python path closed the connection: the replies fail
            pass

    threads = [threading.Thread(target=first, daemon=True)]
    threads[0].start()
    try:
        assert client.add(b"n", 1) == 10
        with pytest.raises(Interrupted), alarm(0.1, raising=True) as signalled:
            threads.append(threading.Thread(target=rest, args=(signalled,), daemon=True))
            threads[-1].start()
            client.add(key, 1)  # fills the socket's buffer and waits there for the server
        if add_trip == "c":
            assert client.add(b"n", 1) == 30
            threads[-1].join(10)
            assert received == [f.encode_add(1, b"n", 1), f.encode_add(2, key, 1), f.encode_add(3, b"n", 1)]
        else:
            with pytest.raises(DistNetworkError, match="closed"):
                client.add(b"n", 1)
    finally:
        client.close()
        theirs.close()
        for thread in threads:
            thread.join(10)


@pytest.mark.parametrize("set_before", [True, False], ids=["timeout-set-first", "timeout-set-after-two-adds"])
@pytest.mark.parametrize("add_trip", ADD_TRIPS)
def test_add_waits_for_its_reply_as_long_as_the_timeout_set_last(add_trip, set_before):
    """The third add() gets no reply and gives up at the timeout set last (0.2 s, plus the reply
    grace, 1 s), not at the first one (10 s, plus 1). Set before any add(), the round trips after
    the first take the inline path, the unanswered one too; set after two add()s, it is set_timeout
    that must end the inline path's use of the old deadline."""
    client, theirs = _client_on_a_socketpair(add_trip)
    if set_before:
        client.set_timeout(0.2)
    add_frame_size = len(f.encode_add(1, b"n", 1))

    def server():  # answers the first two add()s, never the third
        for request_id in (1, 2):
            theirs.recv(add_frame_size, socket.MSG_WAITALL)
            theirs.sendall(f.encode_integer(request_id, request_id))

    thread = threading.Thread(target=server, daemon=True)
    thread.start()
    try:
        assert client.add(b"n", 1) == 1
        assert client.add(b"n", 1) == 2
        thread.join(10)
        if not set_before:
            client.set_timeout(0.2)
        start = time.monotonic()
        with pytest.raises(DistNetworkError, match="did not answer within"):
            client.add(b"n", 1)
        assert time.monotonic() - start < 5
    finally:
        client.close()
        theirs.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts a thread's sleeps through Linux's /proc")
@pytest.mark.parametrize("call", [pytest.param("add-c", marks=needs_add_in_c), "add-python", "get"])
def test_on_a_unix_socket_a_request_sleeps_once_for_its_reply(call):
    """On the server's Unix socket (a socket pair here) the client waits for replies in poll(): a
    request sleeps once, until its reply, and is not woken a second time when the server reads it
    (see client.py). The first add() takes the general path, and primes the next ones' shortcut. A
    wait for the GIL is a sleep too (pytest-xdist's worker has a thread of its own): the fewest of
    three requests counts."""
    client, theirs = _client_on_a_socketpair("python" if call == "add-python" else "c")
    add_frame_size = len(f.encode_add(1, b"n", 1))
    sleeps = []
    try:
        for request_id in (2, 3, 4):
            if call == "get":
                request_size, reply, expected = (len(f.encode_get(request_id, b"k", 5000)),
                                                 f.encode(f.Value(request_id, b"v")), b"v")
            else:
                request_size, reply, expected = add_frame_size, f.encode_integer(request_id, 7), 7
            first = [(add_frame_size, f.encode_integer(1, 1))] if request_id == 2 else []
            with answered_while_asleep(theirs, request_size, reply, first):
                if first:
                    assert client.add(b"n", 1) == 1
                before = voluntary_sleeps()
                value = client.get("k", 5.0) if call == "get" else client.add(b"n", 1)
                sleeps.append(voluntary_sleeps() - before)
            assert value == expected
    finally:
        client.close()
        theirs.close()
    assert min(sleeps) == 1


def test_server_side_timeout_answer_keeps_the_stream_in_sync(server):
    store = TCPStore("127.0.0.1", server.port)
    store.set_timeout(timedelta(milliseconds=30))
    for _ in range(3):
        with pytest.raises(DistStoreTimeoutError, match="'nothing'"):
            store.get("nothing")
    store.set("x", "1")
    assert store.get("x") == b"1"
    store.close()


def test_lost_server_raises_network_error(server):
    store = TCPStore("127.0.0.1", server.port)
    store.set("k", "v")
    server.stop()
    with pytest.raises(DistNetworkError, match="lost the connection to the TCPStore server"):
        for _ in range(3):  # the first send may still succeed into the socket buffer
            store.get("k")
    with pytest.raises(DistNetworkError):
        store.set("k", "v")


def test_lost_server_raises_network_error_from_add(server):
    store = TCPStore("127.0.0.1", server.port)
    assert store.add("n", 1) == 1
    server.stop()
    with pytest.raises(DistNetworkError, match="add: lost the connection to the TCPStore server"):
        for _ in range(3):
            store.add("n", 1)
    with pytest.raises(DistNetworkError, match="is closed"):
        store.add("n", 1)


@pytest.mark.slow
def test_client_retries_until_the_server_comes_up():
    port = free_port()
    servers = []

    def start_late():
        time.sleep(0.3)
        servers.append(TCPStoreServer("127.0.0.1", port).start())

    thread = threading.Thread(target=start_late)
    thread.start()
    store = TCPStore("127.0.0.1", port, timeout=timedelta(seconds=20))
    store.set("k", "v")
    assert store.get("k") == b"v"
    thread.join()
    store.close()
    servers[0].stop()


def test_client_connect_timeout_names_host_port_and_attempts():
    port = free_port()
    start = time.monotonic()
    with pytest.raises(DistNetworkError, match=rf"127\.0\.0\.1:{port} within 300 ms \(\d+ attempts"):
        TCPStore("127.0.0.1", port, timeout=timedelta(milliseconds=300))
    assert time.monotonic() - start < 10


# -- the master ----------------------------------------------------------------------------------------


def test_port_in_use_raises_at_once_naming_host_and_port():
    first = TCPStore("127.0.0.1", 0, None, True)
    start = time.monotonic()
    with pytest.raises(DistNetworkError, match=rf"127\.0\.0\.1:{first.port}.*already in use"):
        TCPStore("127.0.0.1", first.port, None, True, timeout=timedelta(seconds=30))
    assert time.monotonic() - start < 5
    first.close()


def test_master_listens_only_on_the_host_it_was_given():
    master = TCPStore("127.0.0.1", 0, None, True)
    assert master._server.listeners.tcp.getsockname()[0] == "127.0.0.1"
    master.close()


def test_port_zero_and_host_properties():
    master = TCPStore("localhost", 0, None, True)
    assert master.port > 0 and master.host == "localhost"
    client = TCPStore("localhost", master.port)
    assert client.port == master.port
    client.close()
    master.close()


def test_master_waiting_for_workers_that_never_come():
    with pytest.raises(DistStoreError, match="1/3 clients joined"):
        TCPStore("127.0.0.1", 0, 3, True, timeout=timedelta(milliseconds=300))


def test_master_waits_for_world_size_stores_its_own_included():
    port = free_port()
    workers = []

    def join_later():
        time.sleep(0.1)
        workers.append(TCPStore("127.0.0.1", port, 3, timeout=timedelta(seconds=20)))
        workers.append(TCPStore("127.0.0.1", port, 3, timeout=timedelta(seconds=20)))

    thread = threading.Thread(target=join_later)
    thread.start()
    master = TCPStore("127.0.0.1", port, 3, True, timeout=timedelta(seconds=20))
    thread.join()
    assert master.num_keys() == 1  # the join counter, as torch counts its init key
    for store in [*workers, master]:
        store.close()


def test_multi_tenant_masters_share_one_server():
    first = TCPStore("127.0.0.1", 0, None, True, multi_tenant=True)
    second = TCPStore("127.0.0.1", first.port, None, True, multi_tenant=True)
    assert second._server is first._server
    first.set("shared", "yes")
    assert second.get("shared") == b"yes"
    first.close()
    assert second.get("shared") == b"yes"  # the server lives while one of its masters does
    second.close()
    with pytest.raises(DistNetworkError):
        TCPStore("127.0.0.1", first.port, timeout=timedelta(milliseconds=200))


def test_clone_is_an_independent_connection():
    master = TCPStore("127.0.0.1", 0, None, True)
    clone = master.clone()
    master.set_timeout(timedelta(seconds=20))
    thread = threading.Thread(target=lambda: (time.sleep(0.05), clone.set("k", "v")))
    thread.start()
    assert master.get("k") == b"v"
    thread.join()
    clone.close()
    master.close()


def test_bad_constructor_arguments():
    with pytest.raises(ValueError, match="port"):
        TCPStore("127.0.0.1", 70000, None, True)
    with pytest.raises(ValueError, match="port=0"):
        TCPStore("127.0.0.1", 0)
    with pytest.raises(TypeError):
        TCPStore(None, 1234)


_EMFILE_SERVER = textwrap.dedent(
    """
    import resource, sys, time, warnings
    resource.setrlimit(resource.RLIMIT_NOFILE, (48, 48))
    from distcomm.store.tcp import TCPStoreServer
    warnings.simplefilter("always")
    server = TCPStoreServer("127.0.0.1", 0).start()
    print(server.port, flush=True)
    time.sleep(30)
    """
)


@pytest.mark.slow
def test_running_out_of_file_descriptors_is_reported():
    proc = subprocess.Popen([sys.executable, "-c", _EMFILE_SERVER], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    socks = []
    try:
        port = int(proc.stdout.readline())
        for _ in range(60):  # more than the server process may open
            sock = socket.create_connection(("127.0.0.1", port), timeout=10)
            sock.sendall(HELLO)
            socks.append(sock)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
            os.set_blocking(proc.stderr.fileno(), False)
            text = proc.stderr.read() or ""
            if "RLIMIT_NOFILE" in text:
                break
        assert "cannot accept more clients" in text and "RLIMIT_NOFILE" in text and "ulimit -n" in text
    finally:
        for sock in socks:
            sock.close()
        proc.kill()
        proc.wait()


# -- transports: in-process for the master, Unix socket on the same host, TCP otherwise -----------------


def test_each_store_takes_the_cheapest_transport_it_can(monkeypatch):
    from distcomm.store.tcp.local import LocalSocket

    master = TCPStore("127.0.0.1", 0, None, True)
    same_host = TCPStore("127.0.0.1", master.port)
    assert isinstance(master._client._sock, LocalSocket)
    assert same_host._client._sock.family == socket.AF_UNIX
    monkeypatch.setenv("DISTCOMM_STORE_LOCAL_SOCKET", "0")
    over_tcp = TCPStore("127.0.0.1", master.port)
    assert over_tcp._client._sock.family == socket.AF_INET
    master.set("k", "v")
    assert same_host.get("k") == over_tcp.get("k") == b"v"
    for store in (over_tcp, same_host, master):
        store.close()


def test_the_unix_socket_is_not_offered_when_turned_off():
    server = TCPStoreServer("127.0.0.1", 0, local_socket=False).start()
    sock = _raw(server)
    sock.sendall(HELLO)
    assert _hello_reply(sock).local_address == b""
    sock.close()
    server.stop()


def test_master_in_process_get_parks_until_a_remote_set_and_times_out_cleanly():
    master = TCPStore("127.0.0.1", 0, None, True)
    remote = TCPStore("127.0.0.1", master.port)
    master.set_timeout(timedelta(milliseconds=50))
    with pytest.raises(DistStoreTimeoutError, match="'absent'"):
        master.get("absent")  # answered TIMED_OUT by the loop thread at the deadline
    master.set_timeout(timedelta(seconds=20))
    thread = threading.Thread(target=lambda: (time.sleep(0.05), remote.set("absent", "here")))
    thread.start()
    assert master.get("absent") == b"here"
    thread.join()
    assert master.add("n", 2) == 2 and remote.add("n", 3) == 5
    remote.close()
    master.close()


def test_master_in_process_connection_after_stop():
    master = TCPStore("127.0.0.1", 0, None, True)
    master._server.stop()
    with pytest.raises(DistNetworkError, match="lost the connection"):
        master.add("n", 1)
    master.close()


def test_the_largest_timeout_a_client_can_send(server, good_client):
    sock = _raw(server)
    sock.sendall(HELLO + f.encode_get(1, b"forever", 2**64 - 1) + f.encode(f.Wait(2, [b"forever"], 2**64 - 1)))
    assert _hello_reply(sock).status == h.HELLO_STATUS_OK
    time.sleep(0.05)
    _still_served(server, good_client)  # the loop survived a deadline ~5.8e8 years away
    good_client.set("forever", "now")
    proto = c.ClientConnection()
    proto.receive_data(c.ServerConnection.send(h.HelloReply()))
    proto.next_event()
    events = []
    while len(events) < 2:
        events += proto.receive_events(sock.recv(4096))
    assert events == [f.Value(1, b"now"), f.Ok(2)]
    sock.close()


# -- fuzzing the request handlers: any framed request is answered or refused, the loop never breaks ----

from hypothesis import example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


class _ByHand:
    """A client connection to a server whose loop is not running, driven through the server's public
    seams: ``adopt`` takes one end of a socket pair as if the loop had accepted it, ``feed`` hands the
    server bytes as its loop would after a read, ``replies()`` parses what it wrote back since last
    asked, and ``open`` says whether it has closed the connection. Nothing waits on time."""

    def __init__(self, server, hello: bool = True):
        self.server = server
        self.sock, theirs = socket.socketpair()
        weakref.finalize(self, self.sock.close)  # the server closes its end when it stops or hangs up
        self.sock.setblocking(False)
        theirs.setblocking(False)
        self.server_side = server.adopt(theirs, "by hand")
        self.proto = c.ClientConnection()
        self._received = bytearray()
        self._seen = 0
        self._eof = False
        if hello:
            self.feed(HELLO)
            assert isinstance(self.replies()[0], h.HelloReply)

    def feed(self, data: bytes) -> None:
        self.server.handle(self.server_side, data)

    def send(self, *requests) -> None:
        self.feed(b"".join(f.encode(r) for r in requests))

    def received(self) -> bytes:
        """Every byte the server has sent on this connection."""
        while not self._eof:
            try:
                data = self.sock.recv(1 << 16)
            except BlockingIOError:
                break
            self._received += data
            self._eof = not data
        return bytes(self._received)

    def replies(self) -> list:
        new = self.received()[self._seen :]
        self._seen += len(new)
        return self.proto.receive_events(new)

    @property
    def open(self) -> bool:
        self.received()
        return not self._eof


_requests = st.one_of(
    st.builds(f.Set, st.integers(0, 9), st.binary(max_size=4), st.binary(max_size=8)),
    st.builds(f.Get, st.integers(0, 9), st.binary(max_size=4), st.sampled_from([0, 1, 2**64 - 1])),
    st.builds(f.Add, st.integers(0, 9), st.binary(max_size=4), st.integers(-(2**63), 2**63 - 1)),
    st.builds(f.CompareSet, st.integers(0, 9), st.binary(max_size=4), st.binary(max_size=4), st.binary(max_size=4)),
    st.builds(f.Wait, st.integers(0, 9), st.lists(st.binary(max_size=4), max_size=3), st.sampled_from([0, 5])),
    st.builds(f.MultiGet, st.integers(0, 9), st.lists(st.binary(max_size=4), max_size=3), st.sampled_from([0, 5])),
    st.builds(f.MultiSet, st.integers(0, 9), st.lists(st.binary(max_size=4), max_size=3),
              st.lists(st.binary(max_size=4), max_size=3)),
    st.builds(f.DeleteKey, st.integers(0, 9), st.binary(max_size=4)),
    st.builds(f.Append, st.integers(0, 9), st.binary(max_size=4), st.binary(max_size=4)),
    st.builds(f.Check, st.integers(0, 9), st.lists(st.binary(max_size=4), max_size=3)),
    st.builds(f.NumKeys, st.integers(0, 9)),
    st.builds(f.ListKeys, st.integers(0, 9)),
    st.builds(f.QueuePush, st.integers(0, 9), st.binary(max_size=4), st.binary(max_size=4)),
    st.builds(f.QueuePop, st.integers(0, 9), st.binary(max_size=4), st.sampled_from([0, 5, 2**64 - 1])),
    st.builds(f.QueueLen, st.integers(0, 9), st.binary(max_size=4)),
    st.builds(f.Barrier, st.integers(0, 9), st.binary(max_size=4), st.integers(-(2**63), 2**63 - 1),
              st.sampled_from([0, 5, 2**64 - 1])),
)


def _list(items) -> bytes:
    return struct.pack("<I", len(items)) + b"".join(struct.pack("<I", len(item)) + item for item in items)


def _wire(request) -> bytes:
    if isinstance(request, f.MultiSet) and len(request.keys) != len(request.values):
        payload = _list(request.keys) + _list(request.values)  # a mismatched pair, on purpose
        return struct.pack("<QBI", 5 + len(payload), f.MultiSet.OPCODE, request.request_id) + payload
    return f.encode(request)


@settings(max_examples=60, deadline=None)
@given(st.lists(_requests, max_size=12))
@example([f.Wait(0, [b""], 5), f.Set(0, b"", b"")])  # the set answers the wait in the same batch
@example([f.QueuePop(0, b"q", 5), f.QueuePush(1, b"q", b"x")])  # the push answers the pop in the same batch
@example([f.Set(0, b"b", b"text"), f.Barrier(1, b"b", 2, 5)])  # a barrier on a non-integer key: refused
def test_any_sequence_of_requests_is_handled(requests):
    server = TCPStoreServer("127.0.0.1", 0, local_socket=False)
    try:
        client = _ByHand(server, hello=False)
        client.feed(HELLO + b"".join(_wire(r) for r in requests))
        replies = client.replies()
        assert client.open  # well-formed requests never get a connection closed
        assert isinstance(replies[0], h.HelloReply)
        assert all(isinstance(r, f.RESPONSES) for r in replies[1:])
    finally:
        server.stop()  # never started: closes its sockets in this thread


# -- queues and barriers, on a server driven by hand (no loop, no timing) -----------------------------


@pytest.fixture
def bare_server():
    server = TCPStoreServer("127.0.0.1", 0, local_socket=False)
    yield server
    server.stop()  # never started: closes its sockets in this thread


LONG = 3_600_000  # ms: only expire() (called by hand) ends these waits


def test_a_push_goes_to_the_oldest_parked_pop_then_wakes_one_wait(bare_server):
    pop1, pop2, wait1, wait2, pusher = (_ByHand(bare_server) for _ in range(5))
    pop1.send(f.QueuePop(1, b"q", LONG))
    pop2.send(f.QueuePop(2, b"q", LONG))
    wait1.send(f.Wait(3, [b"q"], LONG))
    wait2.send(f.Wait(4, [b"q"], LONG))
    assert pop1.replies() == pop2.replies() == wait1.replies() == wait2.replies() == []
    pusher.send(f.QueuePush(5, b"q", b"1"), f.QueuePush(6, b"q", b"2"))  # no replies: like SET
    assert pop1.replies() == [f.Value(1, b"1")] and pop2.replies() == [f.Value(2, b"2")]
    assert wait1.replies() == wait2.replies() == []  # the pops took both items: the queue stayed empty
    pusher.send(f.QueuePush(7, b"q", b"3"))
    assert wait1.replies() == [f.Ok(3)]
    assert wait2.replies() == []  # one wait per push
    pusher.send(f.QueueLen(8, b"q"), f.Check(9, [b"q"]))
    assert pusher.replies() == [f.Integer(8, 1), f.Bool(9, True)]
    bare_server.expire(time.monotonic() + 2 * LONG / 1000)
    assert wait2.replies() == [f.Ok(4)]  # its deadline found the queue non-empty: no timeout
    pusher.send(f.QueuePop(10, b"q", 0), f.QueuePop(11, b"q", 0))
    assert pusher.replies() == [f.Value(10, b"3"), f.TimedOut(11, [b"q"])]  # timeout 0: the non-blocking pop


def test_a_set_releases_every_wait_on_the_name_but_no_pop(bare_server):
    waiter, popper, writer = (_ByHand(bare_server) for _ in range(3))
    waiter.send(f.Wait(1, [b"q"], LONG), f.Get(2, b"q", LONG))
    popper.send(f.QueuePop(3, b"q", LONG))
    writer.send(f.Set(4, b"q", b"v"))
    assert waiter.replies() == [f.Ok(1), f.Value(2, b"v")]
    assert popper.replies() == []
    writer.send(f.QueuePush(5, b"q", b"item"))
    assert popper.replies() == [f.Value(3, b"item")]


def test_a_parked_pop_that_times_out_or_disconnects_takes_no_item(bare_server):
    expires, leaves, pusher = (_ByHand(bare_server) for _ in range(3))
    expires.send(f.QueuePop(1, b"q", 5))
    leaves.send(f.QueuePop(2, b"q", LONG))
    bare_server.expire(time.monotonic() + 1)
    assert expires.replies() == [f.TimedOut(1, [b"q"])]
    bare_server.disconnect(leaves.server_side)
    pusher.send(f.QueuePush(3, b"q", b"kept"), f.QueueLen(4, b"q"))
    assert pusher.replies() == [f.Integer(4, 1)]
    assert len(bare_server.parking) == 0 and bare_server.parking.waiting == {}


def test_barrier_counts_in_its_key_and_releases_everyone_at_the_world_size(bare_server):
    a, b, c, late, other = (_ByHand(bare_server) for _ in range(5))
    a.send(f.Barrier(1, b"b", 3, LONG))
    b.send(f.Barrier(2, b"b", 3, LONG))
    assert a.replies() == b.replies() == []
    other.send(f.Get(3, b"b", 0))
    assert other.replies() == [f.Value(3, b"2")]  # the arrivals, as torch's TCPStore keeps them
    c.send(f.Barrier(4, b"b", 3, LONG))
    assert c.replies() == [f.Ok(4)] and a.replies() == [f.Ok(1)] and b.replies() == [f.Ok(2)]
    late.send(f.Barrier(5, b"b", 3, 0))
    assert late.replies() == [f.Ok(5)]  # a passed barrier does not hold later callers
    other.send(f.Barrier(6, b"c", 2, 5))
    bare_server.expire(time.monotonic() + 1)
    assert other.replies() == [f.TimedOut(6, [b"c"])]
    other.send(f.Set(7, b"text", b"x"), f.Barrier(8, b"text", 2, LONG))
    (refused,) = other.replies()
    assert refused.__class__ is f.Error and refused.code == f.ERROR_NOT_AN_INTEGER
    assert len(bare_server.parking) == 0


def test_queue_and_barrier_over_a_real_connection(server):
    store = TCPStore("127.0.0.1", server.port, timeout=timedelta(seconds=10))
    store.queue_push("q", "x")
    assert store.queue_len("q") == 1 and store.queue_pop("q", block=False) == b"x"
    store.barrier("b", 1)
    assert server.table.values[b"b"] == b"1"
    store.close()


def test_a_store_finalized_while_another_master_starts_does_not_deadlock(monkeypatch):
    """The garbage collector can finalize an old master store (its finalizer releases its shared
    server) in the middle of creating another, in the same thread: that must not deadlock."""
    from distcomm.store.tcp import store as store_module

    shared = store_module._SharedServers()
    first = shared.acquire("127.0.0.1", 0, True)
    start = TCPStoreServer.start

    def start_while_collecting(self):
        shared.release(first)  # what a finalizer run by the collector here would do
        return start(self)

    monkeypatch.setattr(TCPStoreServer, "start", start_while_collecting)
    made = []
    thread = threading.Thread(target=lambda: made.append(shared.acquire("127.0.0.1", 0, True)), daemon=True)
    thread.start()
    thread.join(10)
    assert not thread.is_alive(), "acquire deadlocked on a release from the same thread"
    monkeypatch.setattr(TCPStoreServer, "start", start)
    shared.release(made[0])
    assert shared._servers == {}


def test_a_batch_mixing_fast_lane_and_other_requests_is_answered_in_order():
    """One read holding set/get/add (handled from their bytes) among other requests, a parked get the
    batch itself completes, an add() error and a trailing half frame: every answer, in order."""
    server = TCPStoreServer("127.0.0.1", 0, local_socket=False)  # loop not started: handle() drives it
    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    theirs.settimeout(10)
    try:
        peer = server.adopt(ours, "test")
        server.handle(peer, c.ClientConnection.send(h.Hello(h.VERSION)))
        assert _hello_reply(theirs).status == h.HELLO_STATUS_OK
        batch = [
            f.Get(1, b"later", 60_000),  # parks; the set below answers it within this batch
            f.Set(2, b"k", b"v"),
            f.Add(3, b"n", 5),
            f.Get(4, b"k", 1000),
            f.NumKeys(5),
            f.Set(6, b"later", b"x"),
            f.Add(7, b"k", 1),  # "v" is not an integer
            f.Get(8, b"missing", 0),
            f.Add(9, b"n", -2),
        ]
        wire = b"".join(f.encode(event) for event in batch)
        tail = f.encode(f.Add(10, b"n", 10))
        server.handle(peer, wire + tail[:9])
        server.handle(peer, tail[9:])
        client = c.ClientConnection()
        client.phase = h.OPEN
        answers = []
        while len(answers) < 8:
            answers += client.receive_events(theirs.recv(4096))
        assert [(type(a).__name__, a.request_id) for a in answers] == [
            ("Integer", 3), ("Value", 4), ("Integer", 5), ("Value", 1), ("Error", 7), ("TimedOut", 8),
            ("Integer", 9), ("Integer", 10),
        ]
        assert answers[0].value == 5 and answers[1].value == b"v" and answers[2].value == 2
        assert answers[3].value == b"x" and answers[4].code == f.ERROR_NOT_AN_INTEGER
        assert answers[5].missing_keys == [b"missing"] and answers[6].value == 3 and answers[7].value == 13
        assert server.table.values == {b"k": b"v", b"n": b"13", b"later": b"x"}
    finally:
        server.stop()
        theirs.close()


# -- the server's single-add lane (handlers.single_add) against the lane it shortcuts --------------


def _add_reads(max_frame_size):
    """(read, whether it is exactly one Add frame within ``max_frame_size``)."""
    for key in (b"n", b""):
        for amount in (1, -10, 2**63 - 1, -(2**63)):
            yield f.encode_add(7, key, amount), True
    one = f.encode_add(8, b"n", 1)
    for read in (one + one, one + one[:5], one[:-1], f.encode_set(9, b"n", b"1")):  # two, one and a piece, ...
        yield read, False
    yield f.encode_add(10, b"n" * max_frame_size, 1), False  # a frame longer than the max frame size


@pytest.mark.parametrize("stored", [None, b"7", b"0", b"007", b"-3", b"9223372036854775807", b"1" * 20, b"1" * 5000,
                                    b"1_000", b"abc", b" 5", b""], ids=lambda v: repr(v)[:24])
def test_the_single_add_lane_answers_as_the_usual_lane_or_leaves_the_read_to_it(stored):
    max_frame_size = 40
    taken = 0
    for read, single in _add_reads(max_frame_size):
        fast, usual = (TCPStoreServer("127.0.0.1", 0, local_socket=False) for _ in range(2))
        try:
            # the counter, and whatever a read cut in the wrong place would take for its key
            for key in (b"n", b"", read[f.ADD_HEAD.size:]) if stored is not None else ():
                fast.table.values[key] = usual.table.values[key] = stored
            before = dict(fast.table.values)
            reply = handlers.single_add(fast, read, max_frame_size)
            if reply is None:
                assert fast.table.values == before  # nothing changed: the usual lane takes the read
                continue
            assert single, f"single_add answered {read!r}, which is not one Add frame within the max size"
            taken += 1
            request_id = f.ADD_HEAD.unpack_from(read)[2]
            try:
                expected = handlers.add_from_bytes(usual, None, read, f.FRAME_HEAD_SIZE, len(read), request_id)
            except ValueError:
                pytest.fail(f"single_add answered {read!r} on {stored!r}, which add() refuses")
            assert reply == expected and fast.table.values == usual.table.values
        finally:
            fast.stop()
            usual.stop()
    # a counter that add() wrote is the lane's business: it must take those reads
    counter = stored is not None and stored.isdigit() and len(stored) <= 19 and int(stored) < 2**63
    assert taken > 0 if counter else taken == 0


def test_an_add_on_more_digits_than_int_takes_is_refused_and_the_server_goes_on(server):
    store = TCPStore("127.0.0.1", server.port, timeout=timedelta(seconds=10))
    store.set("huge", "1" * 5000)  # int() refuses more than 4300 digits
    with pytest.raises(ValueError):
        store.add("huge", 1)
    assert store.add("n", 1) == 1  # the server's loop is alive
    store.close()


def test_an_add_while_a_request_is_parked_wakes_it_through_the_usual_lane(bare_server):
    waiter, adder = _ByHand(bare_server), _ByHand(bare_server)
    adder.send(f.Add(1, b"n", 5))
    assert adder.replies() == [f.Integer(1, 5)]
    waiter.send(f.Wait(2, [b"n", b"m"], LONG))  # parked: m is missing
    adder.send(f.Add(3, b"n", 2), f.Add(4, b"m", 1))  # one read, two adds: the second completes the wait
    assert adder.replies() == [f.Integer(3, 7), f.Integer(4, 1)]
    assert waiter.replies() == [f.Ok(2)]
    adder.send(f.Add(5, b"n", 1))  # nothing parked any more: one add per read, the single-add lane
    assert adder.replies() == [f.Integer(5, 8)]
