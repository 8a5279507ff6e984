"""The sockets a TCPStore server listens on: TCP on exactly the host and port it was given, and on
Linux a Unix socket for clients on the same host.

Why the Unix socket: a loopback TCP request costs the kernel about a third more than the same
request over a Unix socket. The server listens on an abstract-namespace name that carries a random
token, and tells that name only to clients it has accepted over TCP (in the hello reply, see
handshake.py); clients on the same host move there. The name is reachable only from this host's
network namespace. ``local_socket=False`` or DISTCOMM_STORE_LOCAL_SOCKET=0 turns it off, for the
server and for the client alike (local_socket_enabled).

Why the port is exact: a TCPStore master names a port every rank was told; listening anywhere else
would leave them knocking at nothing, so a port in use fails at once (DistNetworkError naming the
address and what to do), and port 0 means "a free one", read back as ``Listeners.port``.

Accepting: ``accept_pending`` takes what is waiting on a listener, a bounded number at a time so one
burst of connects cannot starve the clients already served. When the process is out of file
descriptors it says so, and the event loop pauses that listener briefly instead of spinning on it
(the pending clients wait in the listen backlog).
"""

from __future__ import annotations

import errno
import os
import socket
import sys

from ...errors import DistNetworkError, DistStoreError

DEFAULT_BACKLOG = 4096  # the kernel caps this at net.core.somaxconn
_FD_EXHAUSTED = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
_ACCEPT_BATCH = 512


def raise_open_file_limit() -> tuple[int, int]:
    """Raise this process's RLIMIT_NOFILE soft limit to its hard limit; return (soft, hard) after."""
    try:
        import resource
    except ImportError:  # not POSIX
        return (-1, -1)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft, hard


def open_listener(host: str, port: int, backlog: int = DEFAULT_BACKLOG) -> socket.socket:
    """A listening socket on exactly ``host``:``port`` (port 0: a free one). DistNetworkError at once if taken."""
    where = f"{host}:{port}"
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        # torch words the cause this way (its master only finds out through its own client, after
        # the whole timeout); here it fails at once, since no wait makes a name resolve
        raise DistNetworkError(
            f"The network addresses of ({host}, {port}) cannot be retrieved (gai error: {exc.errno} - "
            f"{exc.strerror}). TCPStore server cannot resolve host {host!r} to listen on {where}: check the "
            f"master's address (MASTER_ADDR, tcp://)"
        ) from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # allows TIME_WAIT, not a live listener
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(address)
        sock.listen(backlog)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            # torch's text first (its default, libuv, server's), then which address and what to do
            raise DistNetworkError(
                f"The server socket has failed to listen on any local network address. port: {port}, useIpv6: "
                f"false, code: -{errno.EADDRINUSE}, name: EADDRINUSE, message: address already in use. "
                f"TCPStore server cannot listen on {where}: the address is already in use (EADDRINUSE). Another "
                f"process, or another TCPStore master in this process, holds that port: choose another port, pass "
                f"port=0 to take a free one, or pass multi_tenant=True to share one server within a process."
            ) from None
        name = errno.errorcode.get(exc.errno or 0, "error")
        raise DistNetworkError(f"TCPStore server cannot listen on {where}: {exc.strerror} ({name})") from None
    sock.setblocking(False)
    return sock


def adopt_listener(fd: int, port: int, backlog: int = DEFAULT_BACKLOG) -> socket.socket:
    """The socket a caller already bound (torch's ``master_listen_fd``), listening, as open_listener's.

    The server owns it from here and closes it when it stops, as torch's does. ``port`` is the port
    the caller promised the ranks; 0 means "whatever the socket is bound to". Errors are torch's
    (type and text), the fd left to the caller.
    """
    try:
        sock = socket.socket(fileno=fd)
    except OSError as exc:
        code = exc.errno or 0
        raise DistNetworkError(
            f"Failed to open existing socket. socket: {fd}, code: {-code}, name: {errno.errorcode.get(code, '?')}, "
            f"message: {(exc.strerror or str(exc)).lower()}"
        ) from None
    bound = sock.getsockname()[1] if sock.family in (socket.AF_INET, socket.AF_INET6) else None
    if bound is None or (port != 0 and bound != port):
        sock.detach()  # the fd stays the caller's: nothing was adopted
        if bound is None:
            raise DistNetworkError(f"listen fd {fd} is not a TCP socket (family {sock.family!r})")
        raise DistStoreError(f"listen fd {fd} is bound to port {bound}, expected to be bound to port {port}")
    try:
        sock.listen(backlog)  # torch accepts a socket that is only bound; on a listening one this is harmless
    except OSError as exc:
        sock.detach()
        raise DistNetworkError(f"TCPStore server cannot listen on fd {fd} (port {bound}): {exc.strerror}") from None
    sock.setblocking(False)
    return sock


def local_socket_enabled() -> bool:
    """Whether same-host clients may use the server's Unix socket (DISTCOMM_STORE_LOCAL_SOCKET=0: no)."""
    return sys.platform.startswith("linux") and os.environ.get("DISTCOMM_STORE_LOCAL_SOCKET", "1") != "0"


def open_local_listener(port: int, backlog: int) -> socket.socket | None:
    """An abstract-namespace Unix listener with an unguessable name, or None where there is none."""
    name = b"\0distcomm-store-%d-%s" % (port, os.urandom(12).hex().encode())
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(name)
        sock.listen(backlog)
    except OSError:
        sock.close()
        return None
    sock.setblocking(False)
    return sock


def accept_pending(listener: socket.socket) -> tuple[list, OSError | None]:
    """The connections waiting on ``listener``, at most a batch of them, as (socket, peer address)
    pairs; and the OSError that stopped accepting if the process is out of file descriptors.

    Each socket is non-blocking, with TCP_NODELAY if it is TCP (a store request is one small write
    its client waits on). Any other accept error but a client's own is raised.
    """
    tcp = listener.family != socket.AF_UNIX
    accepted = []
    for _ in range(_ACCEPT_BATCH):
        try:
            sock, peer = listener.accept()
        except BlockingIOError:
            break
        except OSError as exc:
            if exc.errno in _FD_EXHAUSTED:
                return accepted, exc
            if exc.errno in (errno.ECONNABORTED, errno.EPROTO, errno.EPERM):
                continue  # that client gave up, or a firewall or a protocol error stopped it: not the next one
            raise
        sock.setblocking(False)
        if tcp:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        accepted.append((sock, peer))
    return accepted, None


class Listeners:
    """One server's listening sockets: ``tcp``, and ``local`` (the Unix socket, or None)."""

    def __init__(
        self,
        host: str,
        port: int,
        backlog: int = DEFAULT_BACKLOG,
        local_socket: bool | None = None,
        listen_fd: int | None = None,
    ):
        self.tcp = open_listener(host, port, backlog) if listen_fd is None else adopt_listener(listen_fd, port, backlog)
        self.port = self.tcp.getsockname()[1]
        if local_socket is None:
            local_socket = local_socket_enabled()
        self.local = open_local_listener(self.port, backlog) if local_socket else None
        self.local_address = self.local.getsockname() if self.local is not None else b""
        self.sockets = [sock for sock in (self.tcp, self.local) if sock is not None]

    def close(self) -> None:
        for sock in self.sockets:
            try:
                sock.close()
            except OSError:
                pass
