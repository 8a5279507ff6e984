"""The mesh's socket tuning: ranks on one host get the smaller loopback kernel buffers.

Why the sizes differ is in ``mesh.tune_socket``'s docstring (measured in docs/performance-notes.md).
What the kernel reports is compared with a reference socket given the same request, since Linux
doubles (and caps) whatever is asked for.
"""

from __future__ import annotations

import socket
import sys
import threading

import pytest

from distcomm.store import HashStore
from distcomm.transport import mesh


def _kernel_size(requested: int, family=socket.AF_INET) -> tuple[int, int]:
    """SO_SNDBUF and SO_RCVBUF the kernel grants a fresh stream socket that asks for ``requested``."""
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, requested)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, requested)
        return (s.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF), s.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF))


def _buffers(sock: socket.socket) -> tuple[int, int]:
    return (sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF), sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF))


def _mesh_of_two(store=None) -> dict:
    store = store if store is not None else HashStore()
    socks, errors = {}, []

    def rank(r):
        try:
            socks[r] = mesh.connect_mesh(store, r, 2, timeout=20, host="127.0.0.1")
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    return socks


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="abstract Unix sockets are Linux's")
def test_ranks_of_one_host_connect_by_a_unix_socket_with_the_loopback_buffers(monkeypatch):
    monkeypatch.delenv("DISTCOMM_TCP_LOCAL_SOCKET", raising=False)
    store = HashStore()
    socks = _mesh_of_two(store)
    try:
        pair = (socks[0][1], socks[1][0])
        assert [s.family for s in pair] == [socket.AF_UNIX] * 2
        expected = _kernel_size(mesh.LOOPBACK_SOCKET_BUFFER, socket.AF_UNIX)
        assert [_buffers(s) for s in pair] == [expected] * 2
        pair[0].sendall(b"ping")  # and it is the pair: what one end sends, the other receives
        assert pair[1].recv(4) == b"ping"
        for r in (0, 1):  # the listeners are closed once the mesh is connected: nobody can come in later
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as late, \
                    pytest.raises(ConnectionRefusedError):
                late.connect(bytes(store.get(f"tcp/local/{r}")))
    finally:
        for s in list(socks[0].values()) + list(socks[1].values()):
            s.close()


def test_a_mesh_on_one_host_uses_the_loopback_buffers(monkeypatch):
    monkeypatch.setenv("DISTCOMM_TCP_LOCAL_SOCKET", "0")  # TCP, not the Unix socket
    assert mesh.LOOPBACK_SOCKET_BUFFER < mesh.SOCKET_BUFFER
    expected = _kernel_size(mesh.LOOPBACK_SOCKET_BUFFER)
    assert expected != _kernel_size(mesh.SOCKET_BUFFER), "this kernel caps both sizes alike: nothing to check"
    socks = _mesh_of_two()
    try:
        assert _buffers(socks[0][1]) == expected
        assert _buffers(socks[1][0]) == expected
        assert socks[0][1].getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
    finally:
        for s in list(socks[0].values()) + list(socks[1].values()):
            s.close()


def test_tune_socket_gives_a_loopback_connection_the_loopback_buffers():
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname())
        server, _ = listener.accept()
        with client, server:
            mesh.tune_socket(client)
            assert _buffers(client) == _kernel_size(mesh.LOOPBACK_SOCKET_BUFFER)
