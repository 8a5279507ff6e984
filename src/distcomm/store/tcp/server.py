"""TCPStoreServer: the TCPStore master's key table, served by one event loop in one background thread.

Why one loop and no thread per client: a job of N ranks opens N connections (more with process
groups and clones), most of them idle and many parked in a blocking get()/wait(). One event loop
(epoll; see poller.py) serves them all with one thread: every request is handled to completion in
arrival order, which is also what makes add() and compare_set() atomic. The replies to one read go
out with one send, once the loop has handled every ready connection of its batch (see ``_send``).
One lock guards the table; the loop takes it once per batch of ready connections, and only the
master's own in-process client (``connect_local``, local.py) ever competes for it.

What the loop does, and what it leaves to others: it accepts connections on its listeners
(listeners.py), reads each one, lets the connection's ServerConnection (connection.py) cut the
bytes into events, gives every event to its handler (handlers.py), and sends what the handlers
answer. Requests that must wait are the handlers' business and Parking's (parking.py); the loop
only wakes up when the earliest of them is due, and answers what is due then.

What protects the server: each connection has its own ServerConnection (which checks every length
before buffering for it); a protocol error closes only that connection. A connection that has not
finished its hello, or has part of a frame buffered, for longer than ``idle_timeout`` seconds is
closed (slowloris, a peer that connects and never speaks); a connection idle *between* frames is
legitimate and kept. A client that does not read its responses stops being read from (its output
buffer must drain first), so it cannot make the server buffer without bound. When accept() fails
because the process is out of file descriptors, the server says so (a warning naming the limit)
and retries shortly instead of spinning.

Authentication (``auth_key``; TCPStore passes the key from DISTCOMM_AUTH_KEY_FILE/DISTCOMM_AUTH_KEY,
see auth.py): every connection — TCP, the Unix socket, and the master's in-process one alike, so
there is no path around it — must prove it holds the key before any request is parsed (handshake.py
holds the handshake and refuses everything else), and the Unix socket's name is revealed only in
the answer to a correct proof. Until then the server reads at most AUTH_HELLO_SIZE bytes at a time
from the connection, a wrong proof or a refused hello gets its refusal and the connection closed,
and a handshake not finished within ``idle_timeout`` (the handshake timeout) is closed like any
unfinished hello. ``stats["auth_refused"]`` counts connections refused for authentication.

torch's clients (torch_wire.py): a new connection's first bytes say what it speaks (``classify``).
distcomm's hello goes on as above; a distcomm client's probe is answered and its hello follows; a
torch client's connection gets a TorchServerConnection, whose queries are distcomm's request events
for the same handlers, and whose replies are translated back into torch's shapes (``answer`` does
it for parked requests too). A server with a key refuses torch's clients, which cannot authenticate.
The classification needs at most torch_wire.PROBE_SIZE bytes, so it adds nothing to what an
unauthenticated connection can make the server hold.

Threads: the loop runs in its own thread. The public methods that take bytes or connections
(``connect_local``, ``handle``, ``disconnect``, ``adopt``, ``expire``) may be called from any
thread: they take the lock. ``answer`` and ``count_join`` are for handlers, which already run
under it.
"""

from __future__ import annotations

import errno
import itertools
import logging
import socket
import threading
import time
import warnings

from ..table import KeyTable
from .connection import ServerConnection
from .frames import DEFAULT_MAX_FRAME_SIZE, REQUEST_PARSERS, ProtocolError
from .handlers import FAST_HANDLERS, HANDLERS, TORCH_FAST_HANDLERS, deadline_reply, single_add
from .handshake import AUTH_HELLO_SIZE
from .listeners import DEFAULT_BACKLOG, Listeners, accept_pending, raise_open_file_limit
from .local import LocalSocket
from .parking import Parked, Parking
from .poller import Poller
from .torch_wire import (
    DISTCOMM,
    PROBE_ANSWER,
    PROBE_FROM_DISTCOMM,
    PROBE_SIZE,
    TORCH,
    CancelWait,
    Ping,
    TorchServerConnection,
    Validate,
    classify,
    printable,
)

log = logging.getLogger(__name__)

DEFAULT_IDLE_TIMEOUT = 60.0
_ACCEPT_PAUSE_ON_EMFILE = 0.2
_MAX_POLL_TIMEOUT = 3600.0  # a client may send any timeout; epoll cannot take every float
_RECV_SIZE = 1 << 16


class Peer:
    """One client's connection, as the server holds it: its socket, its ServerConnection, and what
    the socket has not taken yet."""

    __slots__ = ("sock", "fd", "connection", "out", "partial_deadline", "closing", "name", "local", "recv_size", "wire",
                 "first")

    def __init__(self, sock, name, max_frame_size: int, local: bool, fd: int | None = None,
                 auth_key: bytes | None = None):
        self.sock = sock
        self.fd = sock.fileno() if fd is None else fd
        self.connection = ServerConnection(max_frame_size, auth_key)
        # until it has authenticated, a connection is read no more than its handshake's fixed size
        self.recv_size = _RECV_SIZE if auth_key is None else AUTH_HELLO_SIZE
        self.out = bytearray()  # responses the socket did not take yet
        self.partial_deadline: float | None = None
        self.closing = False  # close once the output is flushed (after a refused hello)
        self.name = name  # the peer's address, for the log
        self.local = local  # came in through the Unix socket, or from this process (connect_local)
        self.wire = None  # DISTCOMM or TORCH (torch_wire.py) once its first bytes said which
        self.first = b""  # those first bytes, until they say it

    def lift_read_limit(self) -> None:
        """The client proved it holds the key: read as much as it sends from now on."""
        self.recv_size = _RECV_SIZE


class TCPStoreServer:
    """The key-value server of a TCPStore master. ``start()`` runs its loop in a daemon thread."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        idle_timeout: float = DEFAULT_IDLE_TIMEOUT,
        max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
        backlog: int = DEFAULT_BACKLOG,
        local_socket: bool | None = None,
        auth_key: bytes | None = None,
        listen_fd: int | None = None,
    ):
        self.auth_key = bytes(auth_key) if auth_key else None
        self.open_file_limit = raise_open_file_limit()[0]
        self.listeners = Listeners(host, port, backlog, local_socket, listen_fd)
        self.host = host
        self.port = self.listeners.port
        self.local_address = self.listeners.local_address
        self.idle_timeout = idle_timeout
        self.max_frame_size = max_frame_size
        self.table = KeyTable()
        self.parking = Parking()
        self.joined = 0
        self.stats = {
            "accepted": 0, "protocol_errors": 0, "idle_closed": 0, "accept_fd_exhausted": 0, "auth_refused": 0,
        }
        self._joined_changed = threading.Condition()
        self._peers: dict[int, Peer] = {}
        self._partial: dict[Peer, float] = {}
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
        self._replying_to: Peer | None = None  # the connection _process() is answering
        self._replies: list[bytes] = []
        self._deferred: list | None = None  # the loop's batch's replies, sent at its end (see _send)

    def __repr__(self) -> str:
        return f"TCPStoreServer({self.host}:{self.port}, {len(self._peers)} clients)"

    # -- lifetime ---------------------------------------------------------------------------------

    def start(self) -> "TCPStoreServer":
        for listener in self.listeners.sockets:
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
        return len(self._peers)

    def wait_for_joins(self, count: int, timeout: float) -> int:
        """Block (in the caller's thread) until ``count`` stores sent JOIN, or ``timeout``; return the count."""
        with self._joined_changed:
            self._joined_changed.wait_for(lambda: self.joined >= count or self._stopping, timeout)
            return self.joined

    def count_join(self) -> int:
        """One more store sent JOIN (wakes wait_for_joins); the count so far."""
        with self._joined_changed:
            self.joined += 1
            self._joined_changed.notify_all()
            return self.joined

    # -- connections from outside the loop --------------------------------------------------------

    def connect_local(self) -> LocalSocket:
        """A connection for a client in this process: its requests run in its own thread, no socket.

        The master's own TCPStore uses this: no system calls and no hand-off to the loop thread per
        request, only this server's lock. A request that parks is answered like any other, by the
        write that completes it or at its deadline.
        """
        local = LocalSocket(self)
        peer = Peer(local, "local", self.max_frame_size, True, fd=next(self._local_ids), auth_key=self.auth_key)
        local.peer = peer
        with self._lock:
            self._peers[peer.fd] = peer
        return local

    def adopt(self, sock: socket.socket, name, local: bool = False) -> Peer:
        """Serve ``sock``, a connected non-blocking socket, as if the loop had accepted it (``local``:
        it came through the Unix socket, so it is not told that socket's name). The loop's accept
        does this; tests use it to drive a server whose loop is not running."""
        with self._lock:
            return self._adopt(sock, name, local)

    def handle(self, peer: Peer, data: bytes) -> None:
        """``data`` received from ``peer``: handled now, in the caller's thread (a local client's)."""
        with self._lock:
            if peer.fd not in self._peers:
                raise ConnectionResetError(errno.ECONNRESET, "the TCPStore server has stopped")
            parking = self.parking
            had_deadline = parking.next_deadline
            self._process(peer, data)
            if parking.next_deadline != had_deadline:
                self._wake()  # the loop must recompute its poll timeout for the new deadline

    def disconnect(self, peer: Peer) -> None:
        """Close ``peer``'s connection, as when its client hangs up: its parked requests are dropped."""
        with self._lock:
            self._close(peer)

    def expire(self, now: float) -> None:
        """Do what is due by ``now``: answer the parked requests whose deadline passed, close the
        connections stuck in a handshake or a frame for longer than ``idle_timeout``."""
        with self._lock:
            self._expire(now)

    def answer(self, parked: Parked, reply: bytes) -> None:
        """Send ``reply`` to the client that parked ``parked``, which is released (for handlers)."""
        self.parking.release(parked)
        peer = parked.owner
        if peer.wire is TORCH:
            reply = peer.connection.reply(reply)
        if peer is self._replying_to:
            self._replies.append(reply)
        elif peer.fd in self._peers:
            self._send(peer, reply)

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass

    # -- the loop -----------------------------------------------------------------------------------

    def _run(self) -> None:
        poll = self._poller.poll
        readable, writable = self._poller.READ, self._poller.WRITE
        peers = self._peers
        listeners = {listener.fileno(): listener for listener in self.listeners.sockets}
        wake_fd = self._wake_r.fileno()
        lock = self._lock
        process = self._process
        parking, monotonic = self.parking, time.monotonic
        try:
            while not self._stopping:
                events = poll(self._poll_timeout())
                with lock:  # shared with in-process clients (connect_local), taken once per batch
                    deferred = self._deferred = []
                    for fd, mask in events:
                        peer = peers.get(fd)
                        if peer is not None:
                            if mask & readable:  # _read(), inline: once per ready connection
                                try:
                                    data = peer.sock.recv(peer.recv_size)
                                except (BlockingIOError, InterruptedError):
                                    data = None
                                except OSError:
                                    data = b""
                                if data:
                                    process(peer, data)
                                elif data is not None:
                                    self._close(peer)
                            if mask & writable and peer.fd in peers:
                                self._flush(peer)
                        elif fd in listeners:
                            self._accept(listeners[fd])
                        elif fd == wake_fd:
                            self._drain_wake()
                    # only a parked request's deadline that is due, an idle timer or paused accepting
                    # sends the batch to _expire: a job keeps requests parked for minutes
                    next_deadline = parking.next_deadline
                    if self._partial or self._accept_paused_until or (
                        next_deadline is not None and next_deadline <= monotonic()
                    ):
                        self._expire(monotonic())
                    self._deferred = None
                    for peer, data in deferred:  # the batch's replies, now that every request in it is handled
                        if peers.get(peer.fd) is peer:
                            if peer.out or peer.closing:
                                self._send(peer, data)
                                continue
                            try:  # _send()'s common case, inline: the socket takes the whole reply
                                sent = peer.sock.send(data)
                            except (BlockingIOError, InterruptedError):
                                sent = 0
                            except OSError:
                                self._close(peer)
                                continue
                            if sent < len(data):
                                peer.out += data[sent:]
                                self._poller.modify(peer.fd, writable=True)
        except Exception:  # pragma: no cover - a bug; make it loud rather than a silent dead server
            log.exception("TCPStoreServer on port %d crashed", self.port)
            raise
        finally:
            self._close_everything()

    def _poll_timeout(self) -> float | None:
        timeout = self.parking.next_deadline
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
        local = listener is self.listeners.local
        accepted, exhausted = accept_pending(listener)
        for sock, name in accepted:
            self._adopt(sock, name, local)
        if exhausted is not None:
            self._pause_accepting(listener, exhausted)

    def _adopt(self, sock, name, local: bool) -> Peer:
        peer = Peer(sock, name, self.max_frame_size, local, auth_key=self.auth_key)
        self._peers[peer.fd] = peer
        self._poller.register(peer.fd)
        self._mark_partial(peer, time.monotonic())
        self.stats["accepted"] += 1
        return peer

    def _pause_accepting(self, listener: socket.socket, exc: OSError) -> None:
        """Out of file descriptors: stop polling the listener briefly instead of spinning on it."""
        self.stats["accept_fd_exhausted"] += 1
        if self.stats["accept_fd_exhausted"] == 1:
            warnings.warn(
                f"TCPStore server on port {self.port} cannot accept more clients: {exc.strerror} "
                f"({errno.errorcode.get(exc.errno, exc.errno)}) with {len(self._peers)} clients connected and an "
                f"open-file limit (RLIMIT_NOFILE) of {self.open_file_limit}. Raise the limit (ulimit -n) to serve more "
                f"clients; pending clients wait in the listen backlog until a descriptor frees up.",
                RuntimeWarning,
                stacklevel=1,
            )
        self._poller.unregister(listener.fileno())
        self._paused_listeners.append(listener)
        self._accept_paused_until = time.monotonic() + _ACCEPT_PAUSE_ON_EMFILE

    def _process(self, peer: Peer, data: bytes) -> None:
        """Handle every complete request in ``data`` and send the replies, in order, with one send."""
        if peer.wire is not DISTCOMM:
            if peer.wire is TORCH:
                self._process_torch(peer, data)
                return
            data = self._first_bytes(peer, data)
            if not data:
                return
        connection = peer.connection
        at_boundary = connection.at_frame_boundary()
        if at_boundary and peer.partial_deadline is None:
            reply = single_add(self, data, self.max_frame_size)  # the hottest read: one add(), no event
            if reply is not None:
                self._send(peer, reply)  # at the batch's end
                return
        handlers = HANDLERS
        # a request in this batch may complete one this connection parked earlier: answer() puts
        # that reply in line here too, so the hello reply always goes first
        self._replying_to = peer
        replies = self._replies = []
        try:
            if data and at_boundary:
                # the common case, cut without building events; the hottest requests go to their
                # handler with the frame's bytes (handlers.FAST_HANDLERS), the others are parsed
                fast = FAST_HANDLERS
                for opcode, request_id, start, end in connection.cut_frames(data):
                    handle = fast.get(opcode)
                    if handle is not None:
                        answer = handle(self, peer, data, start, end, request_id)
                    else:
                        event = REQUEST_PARSERS[opcode](data, start, end, request_id)
                        answer = handlers[event.__class__](self, peer, event)
                    if answer is not None:
                        replies.append(answer)
                if peer.partial_deadline is None and connection.at_frame_boundary():
                    # _finish()'s common case, inline: no idle timer to touch, the replies queued
                    # for the batch's end (see _send)
                    if replies:
                        reply = replies[0] if len(replies) == 1 else b"".join(replies)
                        deferred = self._deferred
                        if deferred is not None and peer.fd >= 0:
                            deferred.append((peer, reply))
                        else:
                            self._send(peer, reply)
                    return
            else:
                for event in connection.receive_events(data):
                    answer = handlers[event.__class__](self, peer, event)
                    if answer is not None:
                        replies.append(answer)
                    if peer.closing:
                        break
        except ProtocolError as exc:
            self.stats["protocol_errors"] += 1
            log.info("TCPStore server: closing %s: %s", peer.name, exc)
            self._close(peer)
            return
        finally:
            self._replying_to = None
        self._finish(peer, replies)

    def _finish(self, peer: Peer, replies: list) -> None:
        """After a batch: restart or stop the idle timer, and send the batch's replies with one send."""
        connection = peer.connection
        if connection.has_partial_data:
            if peer.partial_deadline is None:
                self._mark_partial(peer, time.monotonic())
        elif peer.partial_deadline is not None:
            peer.partial_deadline = None
            del self._partial[peer]
        if replies:
            self._send(peer, replies[0] if len(replies) == 1 else b"".join(replies))

    # -- which protocol a connection speaks (torch_wire.py) -----------------------------------------------

    def _first_bytes(self, peer: Peer, data: bytes) -> bytes:
        """A new connection's first bytes: settle its protocol; what is left for that protocol's parser."""
        first = peer.first = peer.first + data
        try:
            wire = classify(first)
        except ProtocolError as exc:
            self.stats["protocol_errors"] += 1
            log.info("TCPStore server: closing %s: %s", peer.name, exc)
            self._close(peer)
            return b""
        if wire is None:
            return b""
        peer.first = b""
        if wire is DISTCOMM:
            peer.wire = DISTCOMM
            return first
        if wire is PROBE_FROM_DISTCOMM:  # a distcomm client asking who we are; its hello comes next
            peer.wire = DISTCOMM
            self._send(peer, PROBE_ANSWER)
            return first[PROBE_SIZE:]
        if self.auth_key is not None:
            # torch's TCPStore cannot authenticate: serving it would open the job to anyone
            self.stats["auth_refused"] += 1
            log.warning(
                "TCPStore server on port %d: refused a torch.distributed TCPStore client from %s: this server "
                "requires authentication (DISTCOMM_AUTH_KEY_FILE / DISTCOMM_AUTH_KEY), which torch's TCPStore "
                "client cannot do. Unset the key for a job that mixes torch and distcomm stores.", self.port,
                peer.name,
            )
            self._close(peer)
            return b""
        peer.wire = TORCH
        peer.connection = TorchServerConnection(self.max_frame_size)
        self._process_torch(peer, first)
        return b""

    def _process_torch(self, peer: Peer, data: bytes) -> None:
        """``_process`` for a torch client: its queries become distcomm's requests, for the same handlers
        (one SET, GET, WAIT or ADD in a read takes handlers.TORCH_FAST_HANDLERS instead)."""
        connection = peer.connection
        handlers = HANDLERS
        self._replying_to, self._replies = peer, []
        replies = self._replies
        try:
            single = connection.single_query(data) if peer.partial_deadline is None else None
            if single is not None:
                query, key, rest = single
                answer = TORCH_FAST_HANDLERS[query](self, key, rest)
                if answer is not None:
                    if answer:
                        replies.append(answer)
                    if replies:
                        self._send(peer, replies[0] if len(replies) == 1 else b"".join(replies))
                    return
            for event in connection.receive_events(data):
                kind = event.__class__
                if kind is Ping:
                    replies.append(event.nonce.to_bytes(4, "little"))
                elif kind is CancelWait:
                    self.parking.cancel(peer)
                    connection.forget()
                    replies.append(b"\x01")  # WAIT_CANCELED
                elif kind is not Validate:
                    answer = handlers[kind](self, peer, event)
                    if answer is not None:
                        replies.append(connection.reply(answer))
        except ProtocolError as exc:
            self.stats["protocol_errors"] += 1
            log.info("TCPStore server: closing torch client %s: %s (first bytes %s)", peer.name, exc, printable(data))
            self._close(peer)
            return
        finally:
            self._replying_to = None
        self._finish(peer, replies)

    def _mark_partial(self, peer: Peer, now: float) -> None:
        peer.partial_deadline = now + self.idle_timeout
        if not self._partial:
            self._next_sweep = now + min(self.idle_timeout / 4, 1.0)
        self._partial[peer] = peer.partial_deadline

    def _send(self, peer: Peer, data: bytes) -> None:
        """Send now what the socket takes; keep the rest and poll for writability. Inside the loop's
        batch, only at the batch's end: a send wakes the client, whose process may then take this
        CPU from the loop; sending after the whole batch is handled lets the loop finish it first,
        and the woken clients' next requests then come in the next batch together."""
        deferred = self._deferred
        if deferred is not None and peer.fd >= 0:
            deferred.append((peer, data))
            return
        if peer.out:
            peer.out += data
            return
        try:
            sent = peer.sock.send(data)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            self._close(peer)
            return
        if sent < len(data):
            peer.out += data[sent:]
            # and stop reading it: a client that does not read its answers cannot grow our buffer
            self._poller.modify(peer.fd, writable=True)
        elif peer.closing:
            self._close(peer)

    def _flush(self, peer: Peer) -> None:
        out = peer.out
        try:
            sent = peer.sock.send(out)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(peer)
            return
        del out[:sent]
        if not out:
            if peer.closing:
                self._close(peer)
                return
            self._poller.modify(peer.fd, writable=False)

    def _expire(self, now: float) -> None:
        table = self.table
        for parked in self.parking.expired(now):
            self.answer(parked, deadline_reply(table, parked))
        if self._partial and now >= self._next_sweep:
            self._next_sweep = now + min(self.idle_timeout / 4, 1.0)
            expired = [peer for peer, deadline in self._partial.items() if deadline <= now]
            for peer in expired:
                self.stats["idle_closed"] += 1
                log.info("TCPStore server: closing %s: no complete hello or frame in %.3g s", peer.name,
                         self.idle_timeout)
                self._close(peer)
        if self._accept_paused_until and now >= self._accept_paused_until:
            self._accept_paused_until = 0.0
            for listener in self._paused_listeners:
                self._poller.register(listener.fileno())
            self._paused_listeners.clear()

    def _close(self, peer: Peer) -> None:
        if self._peers.pop(peer.fd, None) is None:
            return
        self._partial.pop(peer, None)
        self.parking.cancel(peer)
        if peer.fd < 0:  # a LocalSocket
            peer.sock.shutdown_from_server()
            return
        try:
            self._poller.unregister(peer.fd)
        except (KeyError, ValueError, OSError):
            pass
        peer.sock.close()

    def _close_everything(self) -> None:
        for peer in list(self._peers.values()):
            self._close(peer)
        self.listeners.close()
        for sock in (self._wake_r, self._wake_w):
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
