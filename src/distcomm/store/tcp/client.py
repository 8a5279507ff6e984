"""TCPStoreClient: one connection to a TCPStore server, used synchronously from the caller's thread.

Why synchronous: a store request is tiny and the caller waits for its answer anyway, so the fastest
path is the caller's own thread doing one ``send`` and one ``recv`` (TCP_NODELAY, no hand-off to a
background thread, which would cost tens of microseconds per request). A lock makes one client
safe to share between threads; a process that wants concurrent requests uses ``TCPStore.clone()``.
The "socket" may also be a LocalSocket (local.py): the master's client calling its server directly.

Deadlines without per-call overhead: the socket stays in blocking mode and the kernel enforces the
receive deadline (SO_RCVTIMEO: no byte for that long), which is only re-set when it changes;
Python's socket timeouts would add a poll() before every recv. Except on the server's Unix socket:
there a reader asleep in recv() is also woken whenever the server reads what the client sent (the
kernel wakes every sleeper on a Unix socket when its send buffer frees), an empty wake-up per
request that costs more than it saves, so the client waits for replies in poll() (``_readable``),
which wakes only for what it waits for (bytes to read, the end of the stream, an error).

A blocking request sends its timeout to the server, which answers TIMED_OUT itself; the client
waits that long plus a grace period, and if even then nothing came it gives up on its own — the
late answer, carrying an old request id, is dropped when it arrives, so the connection stays usable.

Which server: a connection starts with torch_wire.PROBE (torch's VALIDATE and a PING). torch's
servers echo the PING at once, distcomm's answers PROBE_ANSWER and then takes the hello: one round
trip tells them apart, and ``open_client`` returns a TCPStoreClient or a TorchWireClient
(torch_client.py) accordingly. Sending distcomm's hello first would not do: torch's libuv server
ignores a first query that is not VALIDATE and stays silent, so only a timeout would tell. A peer
that answers anything else, or nothing within PROBE_TIMEOUT (5 s), is not a store:
StoreProtocolError at once, showing what it sent, instead of retrying until the store timeout.

Connecting retries with exponential backoff and jitter until the store timeout: the master may not
be listening yet when workers start, and a thousand workers must not retry in lockstep. A client on
the server's host then moves to the server's Unix socket if the handshake offers one (handshake.py).

With ``auth_key`` the client demands mutual authentication (handshake.py): it proves it holds the
key, and sends no request until the server has proven it too — on the Unix socket again, as on
TCP. A server that cannot (no key, another key, an older distcomm) is refused with
DistStoreAuthError at once, without retrying: waiting does not change a key.
"""

from __future__ import annotations

import errno
import math
import random
import select
import socket
import threading
import time

from ...errors import DistNetworkError, DistStoreError, StoreProtocolError
from .. import rules
from . import frames, handshake, torch_wire
from .auth import AUTH_KEY_ENV, AUTH_KEY_FILE_ENV, DistStoreAuthError
from .connection import NEED_DATA, ClientConnection
from .deadlines import set_deadlines, timeval
from .listeners import local_socket_enabled
from .local import LocalSocket

_RECV_SIZE = 1 << 16
# add()'s inline round trip (see TCPStoreClient.add and frames.ADD_HEAD)
_ADD_HEAD_PACK, _ADD_LENGTH, _ADD = frames.ADD_HEAD.pack, frames.ADD_LENGTH, frames.Add.OPCODE
_INTEGER_REPLY_UNPACK, _INTEGER_REPLY_SIZE = frames.INTEGER_REPLY.unpack, frames.INTEGER_REPLY.size
_INTEGER_LENGTH, _INTEGER = frames.INTEGER_LENGTH, frames.Integer.OPCODE
try:  # and the same round trip in C, on a socket (_add_trip.c), where it is built for this layout
    from . import _add_trip
except ImportError:
    _add_trip = None
_add_round_trip = None if _add_trip is None or (
    _add_trip.ADD_OPCODE, _add_trip.ADD_LENGTH, _add_trip.INTEGER_OPCODE, _add_trip.INTEGER_LENGTH, _add_trip.REPLY_SIZE
) != (_ADD, _ADD_LENGTH, _INTEGER, _INTEGER_LENGTH, _INTEGER_REPLY_SIZE) else _add_trip.round_trip
#: whether add()'s round trip on a socket runs in C here (else in Python, as on the master's own connection)
ADD_IN_C = _add_round_trip is not None
# How long a peer that accepted the connection may take to answer the probe: a distcomm or torch
# server answers at once (its event loop only echoes), so a silent peer is something else.
PROBE_TIMEOUT = 5.0
_SHOW_MORE_WAIT = 0.2  # after a wrong answer, how long to collect more of it for the message
_FIRST_RETRY_DELAY = 0.01
_MAX_RETRY_DELAY = 1.0
_MAX_POLL_MS = 2**31 - 1  # the most one poll() takes


def reply_grace(timeout: float) -> float:
    """How long past its timeout a client waits for the server's own TIMED_OUT answer."""
    return min(max(1.0, 0.1 * timeout), 30.0)


def _readable(poller, wait: float) -> bool:
    """Whether the socket ``poller`` polls for POLLIN has something to read (bytes, the end of the
    stream, an error) within ``wait`` seconds (a negative one is 0)."""
    if poller.poll(min(math.ceil(max(wait, 0.0) * 1000), _MAX_POLL_MS)):
        return True
    if wait * 1000 <= _MAX_POLL_MS:
        return False
    deadline = time.monotonic() + wait - _MAX_POLL_MS / 1000  # poll() waits 24.8 days at most at a time
    while (left := deadline - time.monotonic()) > 0:
        if poller.poll(min(math.ceil(left * 1000), _MAX_POLL_MS)):
            return True
    return False


def _address(address: tuple) -> str:
    """An IP socket address as torch prints one: ``1.2.3.4:80``, ``[::1]:80``."""
    host, port = address[0], address[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class _Refused(Exception):
    """The peer answered, but not as a compatible distcomm TCPStore server; retrying will not help."""


class _NotAStore(Exception):
    """The peer speaks neither distcomm's nor torch's TCPStore protocol; retrying will not help."""


def _probe(sock, where: str, timeout: float) -> tuple[str, bytes]:
    """Send torch_wire.PROBE; (DISTCOMM or TORCH, bytes received after the answer).

    _NotAStore for any other answer or none within ``timeout`` (with what came, printable);
    ConnectionResetError if the peer closed without a byte (a server still starting: retried).
    """
    sock.settimeout(timeout)
    sock.sendall(torch_wire.PROBE)
    got = b""
    try:
        while len(got) < torch_wire.PROBE_ANSWER_SIZE:
            data = sock.recv(4096)
            if not data:
                if not got:
                    raise ConnectionResetError(errno.ECONNRESET, "the server closed the connection at once")
                break
            got += data
    except socket.timeout:
        if not got:
            raise _NotAStore(
                f"the peer at {where} accepted the connection but answered nothing within "
                f"{rules.format_seconds(timeout)}: it speaks neither distcomm's nor torch's TCPStore protocol. "
                f"Is {where} the store's address (MASTER_ADDR/MASTER_PORT, tcp://), and not another service's?"
            ) from None
    answer, rest = got[: torch_wire.PROBE_ANSWER_SIZE], got[torch_wire.PROBE_ANSWER_SIZE :]
    if answer == torch_wire.PROBE_ANSWER:
        return torch_wire.DISTCOMM, rest
    if answer == torch_wire.PROBE_NONCE:
        return torch_wire.TORCH, rest
    try:  # collect a little more of whatever it is, to show it
        sock.settimeout(_SHOW_MORE_WAIT)
        while len(got) < 64:
            data = sock.recv(4096)
            if not data:
                break
            got += data
    except OSError:
        pass
    raise _NotAStore(
        f"the peer at {where} answered {torch_wire.printable(got)}, which is neither distcomm's nor torch's "
        f"TCPStore protocol. Is {where} the store's address (MASTER_ADDR/MASTER_PORT, tcp://), and not "
        f"another service's?"
    )


def _handshake(sock, proto: ClientConnection, where: str, auth_key: bytes | None = None):
    """Hello (and, with ``auth_key``, the mutual proof); the server's final reply, which holds its local address."""
    if auth_key is None:
        sock.sendall(proto.send(handshake.Hello(handshake.VERSION)))
        reply = _handshake_reply(sock, proto, where)
        if reply.__class__ is not handshake.HelloReply or reply.status != handshake.HELLO_STATUS_OK:
            raise _refusal(reply, where, False)
        return reply
    auth = handshake.ClientAuth(auth_key)
    sock.sendall(proto.send(auth.hello()))
    challenge = _handshake_reply(sock, proto, where)
    if challenge.__class__ is not handshake.AuthChallenge:
        raise _refusal(challenge, where, True)
    sock.sendall(proto.send(auth.proof(challenge)))
    accepted = _handshake_reply(sock, proto, where)
    if accepted.__class__ is not handshake.AuthAccepted:
        raise _refusal(accepted, where, True)
    if not auth.server_proved(accepted):
        raise _authentication_failed(where)
    return accepted


def _handshake_reply(sock, proto: ClientConnection, where: str):
    while True:
        try:
            event = proto.next_event()
        except frames.ProtocolError as exc:
            raise _Refused(f"{where} is not a distcomm TCPStore server ({exc})") from None
        if event is not NEED_DATA:
            return event
        data = sock.recv(4096)
        if not data:
            raise ConnectionResetError(errno.ECONNRESET, "server closed the connection during the handshake")
        proto.receive_data(data)


_KEY_VARIABLES = f"{AUTH_KEY_FILE_ENV} / {AUTH_KEY_ENV}"


def _authentication_failed(where: str) -> DistStoreAuthError:
    return DistStoreAuthError(
        f"authentication failed with the TCPStore server at {where}: this process and the server hold different "
        f"keys. {_KEY_VARIABLES} must give every process of the job the same key."
    )


def _refusal(event, where: str, authenticating: bool) -> Exception:
    """The error for a handshake reply that is not the one this client needed."""
    status = getattr(event, "status", None)
    if status == handshake.HELLO_STATUS_UNSUPPORTED_VERSION:
        return _Refused(
            f"the TCPStore server at {where} speaks protocol version {event.version} and refused this client's "
            f"version {handshake.VERSION}; run the same distcomm version on every rank"
        )
    if status == handshake.HELLO_STATUS_AUTH_REQUIRED:
        return DistStoreAuthError(
            f"the TCPStore server at {where} requires authentication, and this process has no key: set "
            f"{_KEY_VARIABLES} for it as the job's other processes do."
        )
    if status == handshake.HELLO_STATUS_AUTH_FAILED:
        return _authentication_failed(where)
    if authenticating and status in (handshake.HELLO_STATUS_AUTH_UNAVAILABLE, handshake.HELLO_STATUS_OK):
        return DistStoreAuthError(
            f"this process has an authentication key (from {_KEY_VARIABLES}), so it demands that the TCPStore "
            f"server at {where} authenticate too, but that server does not (it was started without a key, or by "
            f"an older distcomm); refusing to use it. Give the process that hosts the store the same key, or "
            f"unset the key here."
        )
    return _Refused(f"{where} answered the handshake with {event!r}, which this client did not ask for")


def _move_to_local_socket(address: bytes, timeout: float, max_frame_size: int, auth_key: bytes | None):
    """Connect to the server's same-host Unix socket; None if it cannot be reached from here.

    The connection authenticates again (same key, fresh nonces): the server treats it like any other.
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect(address)
        proto = ClientConnection(max_frame_size)
        _handshake(sock, proto, "the server's local socket", auth_key)
    except (OSError, _Refused, DistStoreAuthError):  # stay on the TCP connection, authenticated already
        sock.close()
        return None
    sock.settimeout(None)
    return sock, proto


def connect(
    host: str, port: int, timeout: float, max_frame_size: int, auth_key: bytes | None = None
) -> tuple[socket.socket, ClientConnection | None]:
    """A handshaken connection to ``host``:``port``, retrying until ``timeout`` seconds have passed.

    The protocol of the connection is None when the server is torch's (see torch_wire.py): the
    socket is then validated and ready for torch's queries.
    """
    where = f"{host}:{port}"
    deadline = time.monotonic() + timeout
    delay = _FIRST_RETRY_DELAY
    attempts = 0
    while True:
        attempts += 1
        remaining = deadline - time.monotonic()
        sock = None
        try:
            sock = socket.create_connection((host, port), timeout=max(remaining, 0.01))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            wire, early = _probe(sock, where, min(PROBE_TIMEOUT, max(remaining, 0.01)))
            if wire is torch_wire.TORCH:
                if auth_key is not None:
                    raise DistStoreAuthError(
                        f"the TCPStore server at {where} is torch's, which cannot authenticate, and this process "
                        f"has an authentication key (from {_KEY_VARIABLES}), so it demands that the server "
                        f"prove it holds the key; refusing to use it. Unset the key to use torch's store."
                    )
                sock.settimeout(None)
                return sock, None
            if early:
                raise _Refused(f"{where} sent {torch_wire.printable(early)} after its probe answer, before the hello")
            sock.settimeout(max(deadline - time.monotonic(), 0.01))
            proto = ClientConnection(max_frame_size)
            reply = _handshake(sock, proto, where, auth_key)
            if reply.local_address and local_socket_enabled():
                timeout_local = min(max(remaining, 0.01), 5.0)
                local = _move_to_local_socket(reply.local_address, timeout_local, max_frame_size, auth_key)
                if local is not None:
                    sock.close()
                    return local
            sock.settimeout(None)
            return sock, proto
        except _Refused as exc:
            sock.close()
            raise DistNetworkError(str(exc)) from None
        except _NotAStore as exc:
            sock.close()
            raise StoreProtocolError(str(exc)) from None
        except DistStoreAuthError:
            sock.close()
            raise
        except OSError as exc:
            if sock is not None:
                sock.close()
            last_error = exc
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            if isinstance(last_error, socket.gaierror):
                hint = f"the host name {host!r} does not resolve: check the master's address (MASTER_ADDR, tcp://)"
            elif isinstance(last_error, (socket.timeout, ConnectionResetError)):
                hint = (
                    "connected, but the server did not complete the handshake (is it overloaded, or out of file "
                    "descriptors?)"
                )
            else:
                hint = "is the master (is_master=True) running, and are host and port right?"
            # torch's sentence first (a DNS failure too is retried until the timeout there), then ours
            raise DistNetworkError(
                f"The client socket has timed out after {rules.torch_milliseconds(timeout)} while trying to "
                f"connect to ({host}, {port}). Could not connect to the TCPStore server at {where} within "
                f"{rules.format_seconds(timeout)} ({attempts} attempts; last error: {last_error}); {hint}"
            ) from None
        time.sleep(min(remaining, random.uniform(delay / 2, delay)))
        delay = min(delay * 2, _MAX_RETRY_DELAY)


def open_client(host: str, port: int, timeout: float, max_frame_size: int = frames.DEFAULT_MAX_FRAME_SIZE, *,
                local=None, auth_key: bytes | None = None):
    """A client of the server at ``host``:``port``: a TCPStoreClient for distcomm's server (or for
    ``local``, a server's connect_local()), a TorchWireClient for torch's."""
    if local is not None:
        return TCPStoreClient(host, port, timeout, max_frame_size, local=local, auth_key=auth_key)
    sock, proto = connect(host, port, timeout, max_frame_size, auth_key)
    if proto is None:
        from .torch_client import TorchWireClient

        return TorchWireClient(host, port, sock, timeout, max_frame_size)
    return TCPStoreClient(host, port, timeout, max_frame_size, connected=(sock, proto))


class TCPStoreClient:
    """A connection to a TCPStore server; every method is one request and its response."""

    speaks_torch = False

    def __init__(
        self,
        host: str,
        port: int,
        timeout: float,
        max_frame_size: int = frames.DEFAULT_MAX_FRAME_SIZE,
        *,
        local=None,
        auth_key: bytes | None = None,
        connected=None,
    ):
        """Connect to ``host``:``port``; or, with ``local`` (a server's ``connect_local()``), use that;
        or, with ``connected``, use that (socket, ClientConnection) pair from ``connect()``.

        With ``auth_key``, server and client prove to each other that they hold that key.
        """
        self.host, self.port = host, port
        self.where = f"{host}:{port}"
        if connected is not None:
            self._sock, self._proto = connected
        elif local is None:
            self._sock, self._proto = connect(host, port, timeout, max_frame_size, auth_key)
            if self._proto is None:
                self._sock.close()
                raise DistNetworkError(f"{self.where} is torch's TCPStore server: use open_client() for it")
        else:
            self._sock, self._proto = local, ClientConnection(max_frame_size)
            try:
                _handshake(local, self._proto, self.where, auth_key)
            except _Refused as exc:
                local.close()
                raise DistNetworkError(str(exc)) from None
            except BaseException:
                local.close()
                raise
        self._lock = threading.Lock()
        self._next_id = 0
        self._rcvtimeo = -1.0
        self._add_inline = False  # see _update_add_inline: the first add() goes through _exchange
        # the file descriptor add()'s inline round trip runs on, in C; -1 where it runs in Python (the
        # master's in-process LocalSocket, or no C built here)
        self._add_fd = self._sock.fileno() if _add_round_trip is not None and isinstance(self._sock, socket.socket) \
            else -1
        # on the server's Unix socket, replies are waited for in poll() (see the module's docstring)
        self._poller = None
        if not isinstance(self._sock, LocalSocket) and self._sock.family == socket.AF_UNIX:
            self._poller = select.poll()
            self._poller.register(self._sock, select.POLLIN)
        self.set_timeout(timeout)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval(self.reply_timeout))

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None
            self._add_inline = False

    @property
    def closed(self) -> bool:
        return self._sock is None

    def describe(self) -> str:
        """This connection as torch's TCPStore repr shows its client:
        ``TCPClient(SocketImpl(fd=.., addr=.., remote=..))``. The master's in-process connection has
        no socket, and the Unix socket's name is not shown (knowing it is what lets a client in)."""
        sock = self._sock
        if sock is None:
            return "TCPClient(closed)"
        if not isinstance(sock, socket.socket):
            return f"TCPClient(in-process, remote={self.where})"
        try:
            fd, local, remote = sock.fileno(), sock.getsockname(), sock.getpeername()
        except OSError:
            return "TCPClient(closed)"
        if sock.family == socket.AF_UNIX:
            return f"TCPClient(SocketImpl(fd={fd}, addr=unix, remote=unix:{self.where}))"
        return f"TCPClient(SocketImpl(fd={fd}, addr={_address(local)}, remote={_address(remote)}))"

    # -- the round trip -----------------------------------------------------------------------------

    def _exchange(self, operation: str, frame: bytes, request_id: int, wait: float, integer: bool = False):
        """Send ``frame``; return the response with ``request_id``, or None if none came within ``wait`` s.
        With ``integer`` (add), an Integer response is returned as its int, decoded without an event.

        The caller holds ``self._lock``. Responses with another id answer requests this client gave
        up on earlier; they are dropped.
        """
        sock = self._sock
        if sock is None:
            raise DistNetworkError(f"{operation}: this TCPStore client's connection to {self.where} is closed")
        if wait != self._rcvtimeo:
            set_deadlines(sock, wait)
            self._rcvtimeo = wait
        try:
            sock.sendall(frame)
        except OSError as exc:
            self._broken(operation, str(exc) or type(exc).__name__)
        except BaseException:  # a signal handler raised inside sendall (see _drop_connection)
            self._drop_connection()
            raise
        return self._receive(operation, sock, request_id, integer)

    def _drop_connection(self) -> None:
        """Close the connection: the next call raises that it is closed. Also what follows an
        exception a signal handler raised inside sendall (KeyboardInterrupt, ...): how much of the
        frame went out is unknown, and the server would read the next request as that one's rest."""
        sock, self._sock = self._sock, None
        self._add_inline = False
        if sock is not None:
            sock.close()

    def _update_add_inline(self) -> None:
        """Whether add() may take its inline round trip, as far as the connection goes: it is open,
        and no bytes of an earlier response are buffered (so the next bytes received start a frame).
        Called, under the lock, wherever either may change; add() also checks that the socket's
        receive deadline is the reply timeout (set_timeout changes that from any thread)."""
        self._add_inline = self._sock is not None and self._proto.at_frame_boundary()

    def _receive(self, operation: str, sock, request_id: int, integer: bool, data: bytes | None = None):
        """The rest of ``_exchange`` once the frame is sent; ``data``: what was already received for it.
        Whatever it leaves buffered, add()'s inline round trip is then re-decided."""
        proto, poller = self._proto, self._poller
        try:
            while True:
                if data is None:
                    if poller is not None and not _readable(poller, self._rcvtimeo):
                        return None
                    try:
                        data = sock.recv(_RECV_SIZE)
                    except BlockingIOError:  # SO_RCVTIMEO: ``wait`` seconds without a byte
                        return None
                if not data:
                    raise ConnectionResetError(errno.ECONNRESET, "the server closed the connection")
                if integer:
                    value = proto.receive_integer(data, request_id)
                    if value is not None:
                        return value
                event = proto.receive_reply(data, request_id)
                if event is not None:
                    return event
                data = None
        except frames.ProtocolError as exc:
            self._broken(operation, f"the server sent bytes that are not this protocol ({exc})")
        except OSError as exc:
            self._broken(operation, str(exc) or type(exc).__name__)
        finally:
            self._update_add_inline()

    def _broken(self, operation: str, reason: str):
        self._drop_connection()
        raise DistNetworkError(
            f"{operation}: lost the connection to the TCPStore server at {self.where}: {reason}. The master process "
            f"(is_master=True) may have exited; this store cannot be used any more."
        ) from None

    def _call(self, operation: str, request):
        """One non-blocking request (an event without its id yet); its response, errors raised."""
        with self._lock:
            self._next_id = request.request_id = (self._next_id + 1) & 0xFFFFFFFF
            response = self._exchange(operation, frames.encode(request), request.request_id, self.reply_timeout)
        return self._checked(operation, response)

    def _checked(self, operation: str, response):
        if response is None:
            raise DistNetworkError(
                f"{operation}: the TCPStore server at {self.where} did not answer within "
                f"{rules.format_seconds(self.reply_timeout)}; it may be hung or overloaded"
            )
        if response.__class__ is frames.Error:
            message = response.message.decode("utf-8", "replace")
            if response.code == frames.ERROR_NOT_AN_INTEGER:
                raise ValueError(message)
            raise DistStoreError(f"{operation}: the TCPStore server at {self.where} refused the request: {message}")
        return response

    def _blocking_call(self, operation: str, keys: list[str], timeout: float, request):
        """A GET/WAIT/MULTI_GET: the server answers by ``timeout``; the client waits a grace period more."""
        with self._lock:
            self._next_id = request.request_id = (self._next_id + 1) & 0xFFFFFFFF
            wait = timeout + reply_grace(timeout)
            response = self._exchange(operation, frames.encode(request), request.request_id, wait)
        if response is None or response.__class__ is frames.TimedOut:
            missing = None if response is None else [k.decode("utf-8", "replace") for k in response.missing_keys]
            raise rules.timeout_error(
                operation, keys, timeout, missing, f"TCPStore {self.where}", rules.tcp_wait_lead(keys, timeout)
            )
        return response

    # -- requests (set, get and add skip building an event: they are the hot path) ----------------

    def set(self, key: bytes, value: bytes) -> None:
        """One send and no reply (see frames.py); the next request on this connection comes after it."""
        with self._lock:
            self._next_id = request_id = (self._next_id + 1) & 0xFFFFFFFF
            sock = self._sock
            if sock is None:
                raise DistNetworkError(f"set: this TCPStore client's connection to {self.where} is closed")
            try:
                sock.sendall(frames.encode_set(request_id, key, value))
            except OSError as exc:
                self._broken("set", str(exc) or type(exc).__name__)

    def get(self, key: str, timeout: float) -> bytes:
        if timeout == self._timeout_cached:
            wait, ms = self._wait_cached, self._ms_cached
        else:
            wait, ms = timeout + reply_grace(timeout), _milliseconds(timeout)
        with self._lock:
            self._next_id = request_id = (self._next_id + 1) & 0xFFFFFFFF
            response = self._exchange("get", frames.encode_get(request_id, key.encode(), ms), request_id, wait)
        if response.__class__ is frames.Value:
            return response.value
        if response is None or response.__class__ is frames.TimedOut:
            missing = None if response is None else [key]
            raise rules.timeout_error(
                "get", [key], timeout, missing, f"TCPStore {self.where}", rules.tcp_wait_lead([key], timeout)
            )
        return self._checked("get", response).value

    def add(self, key: bytes, amount: int) -> int:
        with self._lock:
            self._next_id = request_id = (self._next_id + 1) & 0xFFFFFFFF
            if not self._add_inline or self._rcvtimeo != self.reply_timeout:
                response = self._exchange("add", frames.encode_add(request_id, key, amount), request_id,
                                          self.reply_timeout, True)
            elif self._add_fd >= 0:  # the round trip below, in C: no Python of its own at all
                try:
                    response = _add_round_trip(self._add_fd, key, request_id, amount,
                                               None if self._poller is None else self._rcvtimeo)
                except OSError as exc:
                    self._broken("add", str(exc) or type(exc).__name__)
                if response.__class__ is int:
                    return response
                if response is not None:
                    response = self._receive("add", self._sock, request_id, True, response)
            else:
                # _exchange()'s common case, inline and without a function call of Python's own: one
                # send, one recv holding exactly the reply. With many clients per CPU each add() comes
                # back to cold caches, where every call frame costs (docs/performance-notes.md)
                sock = self._sock
                try:
                    sock.sendall(_ADD_HEAD_PACK(_ADD_LENGTH + len(key), _ADD, request_id, amount) + key)
                except OSError as exc:
                    self._broken("add", str(exc) or type(exc).__name__)
                except BaseException:  # a signal handler raised inside sendall (see _drop_connection)
                    self._drop_connection()
                    raise
                poller = self._poller
                try:
                    if poller is None or _readable(poller, self._rcvtimeo):
                        data = sock.recv(_RECV_SIZE)
                    else:
                        data = None  # no byte within the reply timeout
                except BlockingIOError:  # SO_RCVTIMEO: the same
                    data = None
                except OSError as exc:
                    self._broken("add", str(exc) or type(exc).__name__)
                if data is None:
                    response = None
                else:
                    if len(data) == _INTEGER_REPLY_SIZE:
                        length, opcode, got_id, value = _INTEGER_REPLY_UNPACK(data)
                        if got_id == request_id and opcode == _INTEGER and length == _INTEGER_LENGTH:
                            return value
                    response = self._receive("add", sock, request_id, True, data)  # b"", an Error, a late answer
        if response.__class__ is int:
            return response
        if response.__class__ is frames.Integer:
            return response.value
        return self._checked("add", response).value

    def compare_set(self, key: bytes, expected: bytes, desired: bytes) -> bytes:
        return self._call("compare_set", frames.CompareSet(0, key, expected, desired)).value

    def wait(self, keys: list[str], timeout: float) -> None:
        request = frames.Wait(0, [k.encode() for k in keys], _milliseconds(timeout))
        self._blocking_call("wait", keys, timeout, request)

    def check(self, keys: list[bytes]) -> bool:
        return self._call("check", frames.Check(0, keys)).value

    def num_keys(self) -> int:
        return self._call("num_keys", frames.NumKeys(0)).value

    def delete_key(self, key: bytes) -> bool:
        return self._call("delete_key", frames.DeleteKey(0, key)).value

    def append(self, key: bytes, value: bytes) -> None:
        self._call("append", frames.Append(0, key, value))

    def multi_get(self, keys: list[str], timeout: float) -> list[bytes]:
        request = frames.MultiGet(0, [k.encode() for k in keys], _milliseconds(timeout))
        return self._blocking_call("multi_get", keys, timeout, request).values

    def multi_set(self, keys: list[bytes], values: list[bytes]) -> None:
        self._call("multi_set", frames.MultiSet(0, keys, values))

    def list_keys(self) -> list[bytes]:
        return self._call("list_keys", frames.ListKeys(0)).values

    def queue_push(self, key: bytes, value: bytes) -> None:
        """One send and no reply, like set()."""
        with self._lock:
            self._next_id = request_id = (self._next_id + 1) & 0xFFFFFFFF
            sock = self._sock
            if sock is None:
                raise DistNetworkError(f"queue_push: this TCPStore client's connection to {self.where} is closed")
            try:
                sock.sendall(frames.encode(frames.QueuePush(request_id, key, value)))
            except OSError as exc:
                self._broken("queue_push", str(exc) or type(exc).__name__)

    def queue_pop(self, key: str, block: bool, timeout: float) -> bytes:
        """The server takes the item for us (parked until one is pushed); timeout 0 on the wire = do not wait."""
        wait = timeout if block else 0.0
        request = frames.QueuePop(0, key.encode(), _milliseconds(wait))
        with self._lock:
            self._next_id = request.request_id = (self._next_id + 1) & 0xFFFFFFFF
            response = self._exchange("queue_pop", frames.encode(request), request.request_id, wait + reply_grace(wait))
        if response.__class__ is frames.Value:
            return response.value
        if response.__class__ is frames.TimedOut and not block:
            raise rules.queue_empty_error()
        if response is None or response.__class__ is frames.TimedOut:
            raise rules.queue_timeout_error(key, timeout, f"TCPStore {self.where}", rules.tcp_wait_lead([key], timeout))
        return self._checked("queue_pop", response).value

    def queue_len(self, key: bytes) -> int:
        return self._call("queue_len", frames.QueueLen(0, key)).value

    def barrier(self, key: str, world_size: int, timeout: float) -> None:
        request = frames.Barrier(0, key.encode(), world_size, _milliseconds(timeout))
        with self._lock:
            self._next_id = request.request_id = (self._next_id + 1) & 0xFFFFFFFF
            wait = timeout + reply_grace(timeout)
            response = self._exchange("barrier", frames.encode(request), request.request_id, wait)
        if response is None or response.__class__ is frames.TimedOut:
            try:  # how many arrived, for the message
                arrived = int(self.get(key, 0.0))
            except (DistStoreError, ValueError):
                arrived = None
            raise rules.barrier_timeout_error(
                key, world_size, timeout, arrived, f"TCPStore {self.where}", rules.tcp_barrier_lead(key, timeout)
            )
        self._checked("barrier", response)

    def join(self) -> int:
        return self._call("join", frames.Join(0)).value

    def set_timeout(self, timeout: float) -> None:
        """The store's default timeout: bounds every reply, and get()'s wait."""
        self.reply_timeout = timeout + reply_grace(timeout)
        self._timeout_cached, self._wait_cached, self._ms_cached = timeout, self.reply_timeout, _milliseconds(timeout)


def _milliseconds(seconds: float) -> int:
    return min(int(seconds * 1000), 0xFFFFFFFFFFFFFFFF)
