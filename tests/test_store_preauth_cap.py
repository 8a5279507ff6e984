"""Before a client has authenticated, a keyed TCPStore server holds no more of its bytes than the
handshake's size (issue 16: "a client without the key can make the server buffer a partial frame of
up to 1 GiB until the idle timeout"). On bytes: a keyed ServerConnection fed a 1 GiB frame's head
and a MiB of its body, in pieces, never holds more than the authenticating hello and the proof, and
either refuses (dropping the rest unread) or fails the connection. With a real socket: the server
drops such a connection at once, not at the idle timeout, and keeps serving.
"""

from __future__ import annotations

import socket
import struct
import time
from datetime import timedelta

import pytest

from distcomm.store import TCPStore
from distcomm.store.tcp import TCPStoreServer
from distcomm.store.tcp import connection as c, frames as f, handshake as h
from distcomm.store.tcp.frames import ProtocolError

KEY = b"an authentication key for the tests"
CAP = h.AUTH_HELLO_SIZE + h.PROOF_SIZE  # the most a client sends before the server has judged it
BIG_FRAME_HEAD = struct.pack("<QBI", 1 << 30, f.Set.OPCODE, 1)  # a 1 GiB SET, as a keyless client might start it
JUNK = BIG_FRAME_HEAD + b"x" * (1 << 16)
BIG_JUNK = BIG_FRAME_HEAD + b"x" * (1 << 20)


def _feed_in_pieces(conn, data: bytes, piece: int) -> str:
    """Feed ``data`` piece by piece; how it ended. Asserts the cap after every piece."""
    for i in range(0, len(data), piece):
        try:
            conn.receive_data(data[i : i + piece])
            while conn.next_event() is not c.NEED_DATA:
                pass
        except ProtocolError:
            return "protocol error"
        assert conn.buffered <= CAP
    return conn.phase


@pytest.mark.parametrize("piece", [1, 40, 4096, 1 << 16])
def test_a_plain_hello_then_a_big_frame_is_refused_and_dropped_unread(piece):
    conn = c.ServerConnection(auth_key=KEY)
    assert _feed_in_pieces(conn, c.ClientConnection.send(h.Hello()) + JUNK, piece) == h.REFUSED
    assert conn.buffered == 0


@pytest.mark.parametrize("piece", [1, 40, 4096, 1 << 16])
def test_an_authenticating_hello_then_a_big_frame_instead_of_the_proof_fails(piece):
    conn = c.ServerConnection(auth_key=KEY)
    hello = c.ClientConnection.send(h.ClientAuth(b"some other key").hello())
    assert _feed_in_pieces(conn, hello + JUNK, piece) == "protocol error"


def test_a_keyless_server_still_takes_frames_up_to_its_maximum():
    """The cap is for unauthenticated clients of a keyed server; a keyless server's limit is max_frame_size."""
    conn = c.ServerConnection(max_frame_size=1 << 30)
    conn.receive_data(c.ClientConnection.send(h.Hello()))
    assert conn.next_event().__class__ is h.Hello
    conn.receive_data(JUNK)
    assert conn.next_event() is c.NEED_DATA and conn.buffered == len(JUNK)


def _closed_within(sock: socket.socket, seconds: float) -> float:
    """Seconds until the server closed ``sock`` (reading and discarding what it sent)."""
    start = time.monotonic()
    sock.settimeout(seconds)
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        pass
    return time.monotonic() - start


@pytest.mark.parametrize("authenticating", [False, True], ids=["plain hello", "authenticating hello"])
def test_the_server_drops_such_a_connection_at_once(monkeypatch, authenticating):
    monkeypatch.setenv("DISTCOMM_AUTH_KEY", KEY.decode())
    monkeypatch.delenv("DISTCOMM_AUTH_KEY_FILE", raising=False)
    server = TCPStoreServer("127.0.0.1", 0, auth_key=KEY, idle_timeout=60.0, local_socket=False).start()
    try:
        sock = socket.create_connection(("127.0.0.1", server.port))
        hello = h.ClientAuth(b"some other key").hello() if authenticating else h.Hello()
        try:
            sock.sendall(c.ClientConnection.send(hello) + BIG_JUNK)
        except (BrokenPipeError, ConnectionResetError):
            pass  # closed while we were still sending: what we want
        assert _closed_within(sock, 10.0) < 5.0  # long before the 60 s idle timeout
        sock.close()
        assert server.num_clients == 0
        good = TCPStore("127.0.0.1", server.port, None, False, timedelta(seconds=10))  # still serving
        good.set("k", b"v")
        assert good.get("k") == b"v"
        good.close()
    finally:
        server.stop()
