"""TCPStoreServer: the TCPStore master's key table, served by one event loop in one background thread.

Why one loop and no thread per client: a job of N ranks opens N connections (more with process
groups and clones), most of them idle and many parked in a blocking get()/wait(). One event loop
(epoll; see poller.py) serves them all with one thread: every request is handled to completion in
arrival order, which is also what makes add() and compare_set() atomic. Responses are sent as soon
as a batch of requests from one connection is handled, with one send. One lock guards the table; the
loop takes it once per batch of ready connections, and only the master's own in-process client
(``connect_local``, local.py) ever competes for it.

How blocking requests work: GET/WAIT/MULTI_GET whose keys are missing are *parked* — recorded under
each missing key and in a deadline heap — and answered by the write that completes them, or with
TIMED_OUT when the deadline the client sent passes. Nothing polls. Responses carry the request id,
so a client that gave up early just ignores a late answer.

Queues and barriers park the same way, in a line per name, oldest first. A QUEUE_PUSH hands its
item straight to the oldest parked QUEUE_POP (so an item is never in the queue while a pop waits,
and never goes to two pops); with no pop waiting it stays in the queue and releases at most one
WAIT parked on that queue name (torch: "wait with queues will only wake one waiting worker"). A
WAIT whose deadline finds its keys present (a queue filled while another WAIT got the wake-up) is
answered OK, not TIMED_OUT. A BARRIER counts its arrival in the key's value, like ADD; the arrival
that reaches the world size answers every BARRIER parked on that key. A connection that closes
takes its parked requests out of every line, so a push never goes to a pop nobody will read.

What protects the server: each connection has its own ServerConnection (which checks every length
before buffering for it); a protocol error closes only that connection. A connection that has not
finished its hello, or has part of a frame buffered, for longer than ``idle_timeout`` seconds is
closed (slowloris, a peer that connects and never speaks); a connection idle *between* frames is
legitimate and kept. A client that does not read its responses stops being read from (its output
buffer must drain first), so it cannot make the server buffer without bound. When accept() fails
because the process is out of file descriptors, the server says so (a warning naming the limit)
and retries shortly instead of spinning.

Where it listens: on exactly the host and port it was given (port 0: a free one). On Linux it also
listens on an abstract-namespace Unix socket whose name carries a random token, and tells clients
that name in the TCP handshake (see handshake.py): clients on the same host move there, which costs
the kernel about a third less per request than loopback TCP. The socket is reachable only from this
host's network namespace, by a client that was already accepted over TCP. ``local_socket=False``
(or DISTCOMM_STORE_LOCAL_SOCKET=0) turns it off.

Authentication (``auth_key``; TCPStore passes the key from DISTCOMM_AUTH_KEY_FILE/DISTCOMM_AUTH_KEY,
see auth.py): every connection — TCP, the Unix socket, and the master's in-process one alike, so
there is no path around it — must prove it holds the key before any request is parsed (handshake.py
holds the handshake and refuses everything else), and the Unix socket's name is revealed only in
the answer to a correct proof. Until then the server reads at most AUTH_HELLO_SIZE bytes at a time
from the connection, a wrong proof or a refused hello gets its refusal and the connection closed,
and a handshake not finished within ``idle_timeout`` (the handshake timeout) is closed like any
unfinished hello. ``stats["auth_refused"]`` counts connections refused for authentication.
"""

from __future__ import annotations

import errno
import heapq
import itertools
import logging
import os
import socket
import sys
import threading
import time
import warnings

from ...errors import DistNetworkError
from ..table import KeyTable
from . import frames, handshake
from .connection import ServerConnection
from .local import LocalSocket
from .poller import Poller

log = logging.getLogger(__name__)

DEFAULT_IDLE_TIMEOUT = 60.0
DEFAULT_BACKLOG = 4096  # the kernel caps this at net.core.somaxconn
_ACCEPT_PAUSE_ON_EMFILE = 0.2
_MAX_POLL_TIMEOUT = 3600.0  # a client may send any timeout; epoll cannot take every float
_RECV_SIZE = 1 << 16


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
        raise DistNetworkError(f"TCPStore server cannot resolve host {host!r} to listen on {where}: {exc}") from None
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
            raise DistNetworkError(
                f"TCPStore server cannot listen on {where}: the address is already in use (EADDRINUSE). Another "
                f"process, or another TCPStore master in this process, holds that port: choose another port, pass "
                f"port=0 to take a free one, or pass multi_tenant=True to share one server within a process."
            ) from None
        name = errno.errorcode.get(exc.errno or 0, "error")
        raise DistNetworkError(f"TCPStore server cannot listen on {where}: {exc.strerror} ({name})") from None
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


class _Connection:
    __slots__ = ("sock", "fd", "proto", "out", "partial_deadline", "parked", "closing", "peer", "local", "recv_size")

    def __init__(self, sock, peer, max_frame_size: int, local: bool, fd: int | None = None,
                 auth_key: bytes | None = None):
        self.sock = sock
        self.fd = sock.fileno() if fd is None else fd
        self.proto = ServerConnection(max_frame_size, auth_key)
        # until it has authenticated, a connection is read no more than its handshake's fixed size
        self.recv_size = _RECV_SIZE if auth_key is None else handshake.AUTH_HELLO_SIZE
        self.out = bytearray()  # responses the socket did not take yet
        self.partial_deadline: float | None = None
        self.parked: set = set()
        self.closing = False  # close once the output is flushed (after a refused hello)
        self.peer = peer
        self.local = local  # came in through the Unix socket, or from this process (connect_local)


class _Parked:
    """A blocking request waiting for keys (GET/WAIT/MULTI_GET), or in a line (QUEUE_POP, BARRIER)."""

    __slots__ = ("conn", "request", "keys", "missing", "deadline", "done", "line")

    def __init__(self, conn, request, keys, missing, deadline, line=None):
        self.conn, self.request, self.keys, self.missing, self.deadline = conn, request, keys, missing, deadline
        self.done = False
        self.line = line  # (registry, key): the line this request waits in, if any

    def __lt__(self, other):  # heap ties
        return id(self) < id(other)


class TCPStoreServer:
    """The key-value server of a TCPStore master. ``start()`` runs its loop in a daemon thread."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        idle_timeout: float = DEFAULT_IDLE_TIMEOUT,
        max_frame_size: int = frames.DEFAULT_MAX_FRAME_SIZE,
        backlog: int = DEFAULT_BACKLOG,
        local_socket: bool | None = None,
        auth_key: bytes | None = None,
    ):
        self.auth_key = bytes(auth_key) if auth_key else None
        self.open_file_limit = raise_open_file_limit()[0]
        self._listener = open_listener(host, port, backlog)
        self.host = host
        self.port = self._listener.getsockname()[1]
        if local_socket is None:
            local_socket = local_socket_enabled()
        self._local_listener = open_local_listener(self.port, backlog) if local_socket else None
        self.local_address = self._local_listener.getsockname() if self._local_listener else b""
        self._listeners = [s for s in (self._listener, self._local_listener) if s is not None]
        self.idle_timeout = idle_timeout
        self.max_frame_size = max_frame_size
        self.table = KeyTable()
        self.joined = 0
        self.stats = {
            "accepted": 0, "protocol_errors": 0, "idle_closed": 0, "accept_fd_exhausted": 0, "auth_refused": 0,
        }
        self._joined_changed = threading.Condition()
        self._waiting: dict[bytes, list[_Parked]] = {}
        self._poppers: dict[bytes, list[_Parked]] = {}  # parked QUEUE_POPs per queue, oldest first
        self._barriers: dict[bytes, list[_Parked]] = {}  # parked BARRIERs per key
        self._deadlines: list = []
        self._conns: dict[int, _Connection] = {}
        self._partial: dict[_Connection, float] = {}
        self._poller = Poller()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._stopping = False
        self._accept_paused_until = 0.0
        self._paused_listeners: list[socket.socket] = []
        self._next_sweep = 0.0
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # the table and connections: the loop's batch, or one local request
        self._local_ids = itertools.count(-1, -1)  # local connections have no fd: negative keys
        self._replying_to: _Connection | None = None  # the connection _process() is answering
        self._replies: list[bytes] = []
        self._handlers = {
            handshake.Hello: self._on_hello,
            handshake.AuthProof: self._on_auth_proof,
            frames.Set: self._on_set,
            frames.Get: self._on_get,
            frames.Add: self._on_add,
            frames.CompareSet: self._on_compare_set,
            frames.Wait: self._on_wait,
            frames.Check: self._on_check,
            frames.NumKeys: self._on_num_keys,
            frames.DeleteKey: self._on_delete_key,
            frames.Append: self._on_append,
            frames.MultiGet: self._on_multi_get,
            frames.MultiSet: self._on_multi_set,
            frames.ListKeys: self._on_list_keys,
            frames.Join: self._on_join,
            frames.QueuePush: self._on_queue_push,
            frames.QueuePop: self._on_queue_pop,
            frames.QueueLen: self._on_queue_len,
            frames.Barrier: self._on_barrier,
        }

    def __repr__(self) -> str:
        return f"TCPStoreServer({self.host}:{self.port}, {len(self._conns)} clients)"

    # -- lifetime ---------------------------------------------------------------------------------

    def start(self) -> "TCPStoreServer":
        for listener in self._listeners:
            self._poller.register(listener.fileno())
        self._poller.register(self._wake_r.fileno())
        self._thread = threading.Thread(target=self._run, name=f"TCPStoreServer:{self.port}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the loop and close every connection; idempotent."""
        if self._stopping:
            return
        self._stopping = True
        self._wake()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(10)
        if self._thread is None:
            self._close_everything()

    @property
    def num_clients(self) -> int:
        return len(self._conns)

    def wait_for_joins(self, count: int, timeout: float) -> int:
        """Block (in the caller's thread) until ``count`` stores sent JOIN, or ``timeout``; return the count."""
        with self._joined_changed:
            self._joined_changed.wait_for(lambda: self.joined >= count or self._stopping, timeout)
            return self.joined

    def connect_local(self) -> LocalSocket:
        """A connection for a client in this process: its requests run in its own thread, no socket.

        The master's own TCPStore uses this: no system calls and no hand-off to the loop thread per
        request, only this server's lock. A request that parks is answered like any other, by the
        write that completes it or at its deadline.
        """
        local = LocalSocket(self)
        conn = _Connection(local, "local", self.max_frame_size, True, fd=next(self._local_ids), auth_key=self.auth_key)
        local.conn = conn
        with self._lock:
            self._conns[conn.fd] = conn
        return local

    def handle_local(self, conn: _Connection, data: bytes) -> None:
        """``data`` sent by a local client: handled now, in the caller's thread."""
        with self._lock:
            if conn.fd not in self._conns:
                raise ConnectionResetError(errno.ECONNRESET, "the TCPStore server has stopped")
            had_deadline = self._deadlines[0][0] if self._deadlines else None
            self._process(conn, data)
            if self._deadlines and self._deadlines[0][0] != had_deadline:
                self._wake()  # the loop must recompute its poll timeout for the new deadline

    def close_local(self, conn: _Connection) -> None:
        with self._lock:
            self._close(conn)

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass

    # -- the loop -----------------------------------------------------------------------------------

    def _run(self) -> None:
        poll = self._poller.poll
        readable, writable = self._poller.READ, self._poller.WRITE
        conns = self._conns
        listeners = {listener.fileno(): listener for listener in self._listeners}
        wake_fd = self._wake_r.fileno()
        lock = self._lock
        try:
            while not self._stopping:
                events = poll(self._poll_timeout())
                with lock:  # shared with in-process clients (connect_local), taken once per batch
                    for fd, mask in events:
                        conn = conns.get(fd)
                        if conn is not None:
                            if mask & readable:
                                self._read(conn)
                            if mask & writable and conn.fd in conns:
                                self._flush(conn)
                        elif fd in listeners:
                            self._accept(listeners[fd])
                        elif fd == wake_fd:
                            self._drain_wake()
                    if self._deadlines or self._partial or self._accept_paused_until:
                        self._expire(time.monotonic())
        except Exception:  # pragma: no cover - a bug; make it loud rather than a silent dead server
            log.exception("TCPStoreServer on port %d crashed", self.port)
            raise
        finally:
            self._close_everything()

    def _poll_timeout(self) -> float | None:
        timeout = None
        if self._deadlines:
            timeout = self._deadlines[0][0]
        if self._partial:
            timeout = self._next_sweep if timeout is None else min(timeout, self._next_sweep)
        if self._accept_paused_until:
            timeout = self._accept_paused_until if timeout is None else min(timeout, self._accept_paused_until)
        if timeout is None:
            return None
        return min(max(0.0, timeout - time.monotonic()), _MAX_POLL_TIMEOUT)

    def _drain_wake(self) -> None:
        try:
            self._wake_r.recv(4096)
        except OSError:
            pass

    def _accept(self, listener: socket.socket) -> None:
        local = listener is self._local_listener
        for _ in range(512):
            try:
                sock, peer = listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    self._pause_accepting(listener, exc)
                    return
                if exc.errno in (errno.ECONNABORTED, errno.EPROTO, errno.EPERM):
                    continue
                raise
            sock.setblocking(False)
            if not local:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Connection(sock, peer, self.max_frame_size, local, auth_key=self.auth_key)
            self._conns[conn.fd] = conn
            self._poller.register(conn.fd)
            self._mark_partial(conn, time.monotonic())
            self.stats["accepted"] += 1

    def _pause_accepting(self, listener: socket.socket, exc: OSError) -> None:
        """Out of file descriptors: stop polling the listener briefly instead of spinning on it."""
        self.stats["accept_fd_exhausted"] += 1
        if self.stats["accept_fd_exhausted"] == 1:
            warnings.warn(
                f"TCPStore server on port {self.port} cannot accept more clients: {exc.strerror} "
                f"({errno.errorcode.get(exc.errno, exc.errno)}) with {len(self._conns)} clients connected and an "
                f"open-file limit (RLIMIT_NOFILE) of {self.open_file_limit}. Raise the limit (ulimit -n) to serve more "
                f"clients; pending clients wait in the listen backlog until a descriptor frees up.",
                RuntimeWarning,
                stacklevel=1,
            )
        self._poller.unregister(listener.fileno())
        self._paused_listeners.append(listener)
        self._accept_paused_until = time.monotonic() + _ACCEPT_PAUSE_ON_EMFILE

    def _read(self, conn: _Connection) -> None:
        try:
            data = conn.sock.recv(conn.recv_size)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(conn)
            return
        if not data:
            self._close(conn)
            return
        self._process(conn, data)

    def _process(self, conn: _Connection, data: bytes) -> None:
        """Handle every complete request in ``data`` and send the replies, in order, with one send."""
        proto = conn.proto
        handlers = self._handlers
        # a request in this batch may complete one this connection parked earlier: _finish() puts
        # that reply in line here too, so the hello reply always goes first
        self._replying_to, self._replies = conn, []
        replies = self._replies
        try:
            for event in proto.receive_events(data):
                answer = handlers[event.__class__](conn, event)
                if answer is not None:
                    replies.append(answer)
                if conn.closing:
                    break
        except frames.ProtocolError as exc:
            self.stats["protocol_errors"] += 1
            log.info("TCPStore server: closing %s: %s", conn.peer, exc)
            self._close(conn)
            return
        finally:
            self._replying_to = None
        if proto.has_partial_data:
            if conn.partial_deadline is None:
                self._mark_partial(conn, time.monotonic())
        elif conn.partial_deadline is not None:
            conn.partial_deadline = None
            del self._partial[conn]
        if replies:
            self._send(conn, replies[0] if len(replies) == 1 else b"".join(replies))

    def _mark_partial(self, conn: _Connection, now: float) -> None:
        conn.partial_deadline = now + self.idle_timeout
        if not self._partial:
            self._next_sweep = now + min(self.idle_timeout / 4, 1.0)
        self._partial[conn] = conn.partial_deadline

    def _send(self, conn: _Connection, data: bytes) -> None:
        """Send now what the socket takes; keep the rest and poll for writability."""
        if conn.out:
            conn.out += data
            return
        try:
            sent = conn.sock.send(data)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            self._close(conn)
            return
        if sent < len(data):
            conn.out += data[sent:]
            # and stop reading it: a client that does not read its answers cannot grow our buffer
            self._poller.modify(conn.fd, writable=True)
        elif conn.closing:
            self._close(conn)

    def _flush(self, conn: _Connection) -> None:
        out = conn.out
        try:
            sent = conn.sock.send(out)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(conn)
            return
        del out[:sent]
        if not out:
            if conn.closing:
                self._close(conn)
                return
            self._poller.modify(conn.fd, writable=False)

    def _expire(self, now: float) -> None:
        deadlines = self._deadlines
        while deadlines and deadlines[0][0] <= now:
            _, parked = heapq.heappop(deadlines)
            if not parked.done:
                self._finish(parked, self._at_deadline(parked))
        if self._partial and now >= self._next_sweep:
            self._next_sweep = now + min(self.idle_timeout / 4, 1.0)
            expired = [conn for conn, deadline in self._partial.items() if deadline <= now]
            for conn in expired:
                self.stats["idle_closed"] += 1
                log.info("TCPStore server: closing %s: no complete hello or frame in %.3g s", conn.peer, self.idle_timeout)
                self._close(conn)
        if self._accept_paused_until and now >= self._accept_paused_until:
            self._accept_paused_until = 0.0
            for listener in self._paused_listeners:
                self._poller.register(listener.fileno())
            self._paused_listeners.clear()

    def _close(self, conn: _Connection) -> None:
        if self._conns.pop(conn.fd, None) is None:
            return
        self._partial.pop(conn, None)
        for parked in list(conn.parked):
            self._unpark(parked)
        if conn.fd < 0:  # a LocalSocket
            conn.sock.shutdown_from_server()
            return
        try:
            self._poller.unregister(conn.fd)
        except (KeyError, ValueError, OSError):
            pass
        conn.sock.close()

    def _close_everything(self) -> None:
        for conn in list(self._conns.values()):
            self._close(conn)
        for sock in (*self._listeners, self._wake_r, self._wake_w):
            try:
                sock.close()
            except OSError:
                pass
        try:
            self._poller.close()
        except (OSError, RuntimeError):
            pass
        with self._joined_changed:
            self._joined_changed.notify_all()

    # -- parking ------------------------------------------------------------------------------------

    def _park(self, conn: _Connection, request, keys: list, missing: list, timeout_ms: int, line=None):
        """Answer later: when every key in ``missing`` is written, or (in ``line``, a (registry, key)
        pair) when its turn comes; or at the deadline."""
        if timeout_ms == 0:
            return frames.encode(frames.TimedOut(request.request_id, missing or keys))
        parked = _Parked(conn, request, keys, set(missing), time.monotonic() + timeout_ms / 1000.0, line)
        for key in parked.missing:
            self._waiting.setdefault(key, []).append(parked)
        if line is not None:
            registry, key = line
            registry.setdefault(key, []).append(parked)
        heapq.heappush(self._deadlines, (parked.deadline, parked))
        conn.parked.add(parked)
        return None

    def _unpark(self, parked: _Parked) -> None:
        parked.done = True
        parked.conn.parked.discard(parked)
        if parked.line is not None:
            registry, key = parked.line
            line = registry.get(key)
            if line is not None:
                try:
                    line.remove(parked)
                except ValueError:
                    pass
                if not line:
                    del registry[key]
        for key in parked.missing:
            waiters = self._waiting.get(key)
            if waiters is not None:
                try:
                    waiters.remove(parked)
                except ValueError:
                    pass
                if not waiters:
                    del self._waiting[key]

    def _finish(self, parked: _Parked, reply: bytes) -> None:
        self._unpark(parked)
        conn = parked.conn
        if conn is self._replying_to:
            self._replies.append(reply)
        elif conn.fd in self._conns:
            self._send(conn, reply)

    def _written(self, key: bytes) -> None:
        """``key`` now exists: answer the parked requests it completes."""
        waiters = self._waiting.pop(key, None)
        if not waiters:
            return
        for parked in waiters:
            parked.missing.discard(key)
            if parked.missing or parked.done:
                continue
            still_missing = self._still_missing(parked)  # a key may have been deleted meanwhile
            if still_missing:
                parked.missing.update(still_missing)
                for k in still_missing:
                    self._waiting.setdefault(k, []).append(parked)
                continue
            self._finish(parked, self._completed(parked.request))

    def _still_missing(self, parked: _Parked) -> list:
        """The keys ``parked`` still lacks; a WAIT (not GET/MULTI_GET) takes a non-empty queue as present."""
        if parked.request.__class__ is frames.Wait:
            return self.table.absent(parked.keys)
        return self.table.missing(parked.keys)

    def _at_deadline(self, parked: _Parked) -> bytes:
        request = parked.request
        kind = request.__class__
        if kind is frames.QueuePop or kind is frames.Barrier:
            return frames.encode(frames.TimedOut(request.request_id, [request.key]))
        missing = self._still_missing(parked)
        if not missing:  # a WAIT on a queue another WAIT was woken for: its condition holds
            return self._completed(request)
        return frames.encode(frames.TimedOut(request.request_id, missing))

    def _completed(self, request) -> bytes:
        values = self.table.values
        kind = type(request)
        if kind is frames.Get:
            return frames.encode_value(request.request_id, values[request.key])
        if kind is frames.MultiGet:
            return frames.encode(frames.Values(request.request_id, [values[k] for k in request.keys]))
        return frames.encode_ok(request.request_id)

    # -- requests: each returns the reply's bytes, or None (parked, or SET, which has no reply) -----

    def _on_hello(self, conn, hello):
        reply = conn.proto.reply_to_hello(hello)  # decides version and authentication
        if reply.__class__ is handshake.HelloReply:
            if reply.status != handshake.HELLO_STATUS_OK:
                conn.closing = True  # after the reply, which tells the client why
                if reply.status != handshake.HELLO_STATUS_UNSUPPORTED_VERSION:
                    self._auth_refused(conn, reply.status)
            elif not conn.local:
                reply.local_address = self.local_address
        return conn.proto.send(reply)

    def _on_auth_proof(self, conn, proof):
        reply = conn.proto.reply_to_proof(proof, b"" if conn.local else self.local_address)
        if reply.__class__ is handshake.AuthAccepted:
            conn.recv_size = _RECV_SIZE
        else:
            conn.closing = True
            self._auth_refused(conn, reply.status)
        return conn.proto.send(reply)

    def _auth_refused(self, conn, status: int) -> None:
        self.stats["auth_refused"] += 1
        reason = {
            handshake.HELLO_STATUS_AUTH_REQUIRED: "offered no authentication",
            handshake.HELLO_STATUS_AUTH_FAILED: "failed authentication (wrong key)",
            handshake.HELLO_STATUS_AUTH_UNAVAILABLE: "asked for authentication, which this server has no key for",
        }.get(status, f"refused with status {status}")
        log.info("TCPStore server on port %d: refused %s: it %s", self.port, conn.peer, reason)

    def _on_set(self, conn, req):  # no reply: see frames.py
        self.table.values[req.key] = req.value
        if self._waiting:
            self._written(req.key)

    def _on_get(self, conn, req):
        value = self.table.values.get(req.key)
        if value is not None:
            return frames.encode_value(req.request_id, value)
        return self._park(conn, req, [req.key], [req.key], req.timeout_ms)

    def _on_add(self, conn, req):
        try:
            total = self.table.add(req.key, req.amount)
        except ValueError as exc:
            return frames.encode(frames.Error(req.request_id, frames.ERROR_NOT_AN_INTEGER, str(exc).encode("utf-8")))
        if self._waiting:
            self._written(req.key)
        return frames.encode_integer(req.request_id, total)

    def _on_compare_set(self, conn, req):
        returned, changed = self.table.compare_set(req.key, req.expected, req.desired)
        if changed and self._waiting:
            self._written(req.key)
        return frames.encode_value(req.request_id, returned)

    def _on_wait(self, conn, req):
        missing = self.table.absent(req.keys)
        if not missing:
            return frames.encode_ok(req.request_id)
        return self._park(conn, req, req.keys, missing, req.timeout_ms)

    def _on_check(self, conn, req):
        return frames.encode_bool(req.request_id, not self.table.absent(req.keys))

    def _on_num_keys(self, conn, req):
        return frames.encode_integer(req.request_id, len(self.table) + (1 if self.joined else 0))

    def _on_delete_key(self, conn, req):
        return frames.encode_bool(req.request_id, self.table.delete(req.key))

    def _on_append(self, conn, req):
        self.table.append(req.key, req.value)
        if self._waiting:
            self._written(req.key)
        return frames.encode_ok(req.request_id)

    def _on_multi_get(self, conn, req):
        missing = self.table.missing(req.keys)
        if not missing:
            values = self.table.values
            return frames.encode(frames.Values(req.request_id, [values[k] for k in req.keys]))
        return self._park(conn, req, req.keys, missing, req.timeout_ms)

    def _on_multi_set(self, conn, req):
        if len(req.keys) != len(req.values):
            message = f"multi_set(): {len(req.keys)} keys but {len(req.values)} values"
            return frames.encode(frames.Error(req.request_id, frames.ERROR_BAD_REQUEST, message.encode()))
        self.table.multi_set(req.keys, req.values)
        if self._waiting:
            for key in req.keys:
                self._written(key)
        return frames.encode_ok(req.request_id)

    def _on_list_keys(self, conn, req):
        return frames.encode(frames.Values(req.request_id, list(self.table.values)))

    def _on_join(self, conn, req):
        with self._joined_changed:
            self.joined += 1
            self._joined_changed.notify_all()
        return frames.encode_integer(req.request_id, self.joined)

    def _on_queue_push(self, conn, req):  # no reply, like SET
        poppers = self._poppers.get(req.key)
        if poppers:
            parked = poppers[0]  # the oldest parked pop takes the item; _finish() takes it out of line
            self._finish(parked, frames.encode_value(parked.request.request_id, req.value))
            return None
        self.table.queue_push(req.key, req.value)
        if self._waiting:
            self._wake_one_wait(req.key)
        return None

    def _wake_one_wait(self, key: bytes) -> None:
        """The queue ``key`` has an item now: release the oldest WAIT parked on it, only that one."""
        waiters = self._waiting.get(key)
        if not waiters:
            return
        for parked in waiters:
            if parked.request.__class__ is frames.Wait and not parked.done:
                break
        else:
            return  # only GET/MULTI_GET, which wait for the key to be set, not for a queue
        waiters.remove(parked)
        if not waiters:
            del self._waiting[key]
        parked.missing.discard(key)
        if parked.missing:
            return
        still_missing = self._still_missing(parked)
        if still_missing:
            parked.missing.update(still_missing)
            for k in still_missing:
                self._waiting.setdefault(k, []).append(parked)
            return
        self._finish(parked, frames.encode_ok(parked.request.request_id))

    def _on_queue_pop(self, conn, req):
        value = self.table.queue_pop(req.key)
        if value is not None:
            return frames.encode_value(req.request_id, value)
        return self._park(conn, req, [req.key], [], req.timeout_ms, line=(self._poppers, req.key))

    def _on_queue_len(self, conn, req):
        return frames.encode_integer(req.request_id, self.table.queue_len(req.key))

    def _on_barrier(self, conn, req):
        try:
            arrived = self.table.add(req.key, 1)
        except ValueError as exc:
            return frames.encode(frames.Error(req.request_id, frames.ERROR_NOT_AN_INTEGER, str(exc).encode("utf-8")))
        if self._waiting:
            self._written(req.key)  # the counter is a key: a get/wait on it sees the count
        if arrived < req.world_size:
            return self._park(conn, req, [req.key], [], req.timeout_ms, line=(self._barriers, req.key))
        for parked in list(self._barriers.get(req.key, ())):
            self._finish(parked, frames.encode_ok(parked.request.request_id))
        return frames.encode_ok(req.request_id)
