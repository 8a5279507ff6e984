"""TcpTransport: point-to-point messages over a full mesh of persistent TCP connections.

What it does (the contract is in ``base.py``): frames every message with a 32-byte header
(``framing.py``), matches arriving messages to posted receives by ``(source, MessageKey)`` in
arrival order (the rules are in ``matching.py``), and checks size and signature. The mesh itself
is built by ``mesh.py``; this module is the sockets and the progress engine.

**Copies.** A send goes from the caller's buffer to the kernel (``sendmsg`` of header + payload
memoryview, no join). A receive that is posted before its message arrives gets the payload read
straight into its buffer with ``recv_into``; only what came in with the header in one read (at
most ``_STAGE`` bytes) passes through a small per-peer staging buffer, which is what lets one
``recv`` syscall deliver many small messages. A message that arrives before its receive is posted
("unexpected") is read into a buffer of exactly its size and copied once when the receive comes;
if the receive comes while that message is still arriving, the rest is redirected into the
receive's buffer.

**Progress: the waiting thread drives the sockets.** Measured on this 2-vCPU machine, a ping-pong
whose completions are handed from a progress thread to the waiting thread (Condition) costs
~150-190 µs per round trip, spinning on a flag is worse (the spinner steals the core the peer
needs), while the waiting thread blocking in epoll on the sockets itself costs ~30-35 µs
(prototypes, measured side by side; a blocking-socket ping-pong took ~18 µs then). So:

* a thread in ``Request.wait`` takes the *driver* role and runs the event loop (``_fg`` epoll)
  until its request is done; other waiting threads sleep on a Condition and one of them takes
  over when the driver leaves;
* one background thread (per transport, never per message or peer) runs the same loop on its own
  epoll (``_bg``) only while *no* thread is waiting: it keeps async requests moving while the
  caller computes, drains unexpected messages so a peer's large send never stalls (both ranks
  sending 64 MiB to each other at once works), and notices a dead peer. While anyone waits it
  parks, rechecking every ``_PARK_S`` so a request left pending when the last waiter returns
  gets going again within that time. It never handles events while a driver exists: the driver
  sleeps in epoll and would not notice a completion made by someone else.
* It also parks for one more ``_PARK_S`` after any thread drove, unless a *bulk* transfer is
  pending (a send the kernel did not take at once, or a posted receive of at least ``_BULK``
  bytes): a caller running small collectives back to back is between two waits for only
  microseconds, and its next message, read here, would cost two thread hand-offs (measured,
  2 ranks, 8-byte all_reduce: ~5% of messages used to be read by this thread, and the caller's
  own sendmsg then waited for the GIL). Bulk transfers are what it is worth waking up for: it is
  notified when the last waiter leaves one pending, or when one of ``_BULK`` bytes or more is
  posted while nobody waits, and moves it while the caller computes.

Sends first try a non-blocking ``sendmsg`` from the caller when the peer's queue is empty (lowest
latency; a small message is complete before ``isend`` returns); whatever the kernel does not take
is queued and written by whichever thread drives, at most ``_SEND_CHUNK`` per syscall. Sends are
eager: they complete once in the kernel.

**Errors.** ``wait`` past its deadline withdraws the request (a late message then waits as
unexpected for the next matching receive; a frame already partly on the wire is finished from the
buffer so the stream stays in step) and raises ``reason="timeout"`` naming the peer. A size or
signature mismatch fails that receive and discards the payload, keeping the stream in step. A
connection that closes or resets fails every request involving that peer at once with
``reason="lost"`` (and any-source receives, unless the peer said GOODBYE first); messages it
completed before dying are still delivered. A connection lost *without* a GOODBYE (the peer
crashed or was killed) also dooms every group that peer belongs to (``watch_group`` tells the
transport the groups): their pending collective requests fail at once naming it, whoever they
wait for, and so does every later one. Every rank holds a connection to every other, so each
learns of a death from its own kernel (EOF or reset) within milliseconds.

**A rank that gives up on a group.** A collective call that fails on this rank (its timeout, a lost
or failed peer, any error partway) leaves the group's message sequence broken here; the engine
then calls ``give_up``: the group's pending collective requests are withdrawn, later ones fail at
once saying why, and each live member gets a GAVE_UP control frame (``framing.py``) after
whatever this rank had already put on that connection. A member receiving it records it in its
matcher (``Matcher.give_up``): its receives of the group's calls from that sequence number on from
this rank fail with reason "gave up" (PeerFailedError), posted ones at once, and messages of
those calls that came before the notice are dropped (such a receive names instead a member of the
group known to be gone, the likely reason the peer gave up). That is what keeps a rank arriving late at
a call its peers timed out on from completing it with the messages they sent before their
timeout. ``unwatch_group`` (a group destroyed normally) sends nothing.

One lock guards all state; socket reads and writes happen under it, non-blocking, so no thread
ever blocks in a socket call.
"""

from __future__ import annotations

import os
import select
import socket
import threading
import time
import weakref
from collections import deque
from multiprocessing.util import Finalize

import numpy as np

from . import framing, mesh
from .base import ANY_SOURCE, KIND_COLLECTIVE, MessageKey, Request, Transport, TransportError, describe_key
from .buffers import as_memoryview
from .matching import Matcher, Unexpected

_STAGE = 16 << 10  # per-peer read buffer for headers and small payloads
_SCRATCH = 256 << 10  # where discarded payloads (mismatch, withdrawn receive) are read to
# At most this much per sendmsg: the driving thread then alternates between a peer's outgoing and
# incoming streams in finer steps, so both directions of an exchange keep moving and the bytes are
# still in cache when the peer copies them out. Measured (64 MiB both ways at once, loopback):
# ~3.2 GB/s total with 2 MiB steps, ~3.0 with 1 MiB, ~2.5 uncapped (noisy, shared machine).
_SEND_CHUNK = 2 << 20
_PARK_S = 0.002  # background thread's recheck period while a thread drives (see module doc)
# A receive at least this large (or any send the kernel did not take at once) is a "bulk" transfer
# that the background thread moves while the caller is busy elsewhere (see _background); posting
# one this large (send or receive) also wakes it at once. Larger than _STAGE, so the small-message
# paths in _read never complete one. A wake-up costs a thread hand-off, worth it only for long
# transfers: measured (2 ranks, median µs, 3 runs each) all_reduce with 64 KiB: 249-312 at 64 KiB
# and 322-407 at 256 KiB, with 1 MiB: 125-170 and 167-250; all_to_all of 2 MiB (1 MiB messages)
# with 1 MiB: 1.5-1.9 ms, never: 1.1-1.5 ms; 16 MiB all_reduce and all_to_all the same either way.
_BULK = 4 << 20
_IN = select.EPOLLIN
_OUT = select.EPOLLOUT
_NOSIGNAL = getattr(socket, "MSG_NOSIGNAL", 0)
_HDR = framing.HEADER_SIZE
_decode_header = framing.decode_header
_encode_header = framing.encode_header
_unpack_header = framing._HEADER_UNPACK  # the hot path checks fields inline (same rules as decode_header)
_MAGIC, _VERSION, _MAX_NBYTES = framing.FRAME_MAGIC, framing.VERSION, framing.MAX_NBYTES
_new_tuple = tuple.__new__
_KIND_CONTROL = framing.KIND_CONTROL
_ndarray = np.ndarray
_get_ident = threading.get_ident
_monotonic = time.monotonic


# Transports still open when the interpreter exits are closed then, so their peers get a GOODBYE
# and tell a process that ended (destroy_process_group or not) from one that crashed. A
# multiprocessing finalizer, not atexit: it also runs in multiprocessing children, which skip atexit.
_OPEN: "weakref.WeakSet[TcpTransport]" = weakref.WeakSet()


def _close_open_transports() -> None:
    for transport in list(_OPEN):
        if transport._pid != os.getpid():  # a forked child's copy: the sockets are its parent's
            continue
        try:
            transport.close()
        except Exception:  # noqa: BLE001 - exiting: nothing more to do
            pass


Finalize(None, _close_open_transports, exitpriority=20)


def _flat(view) -> memoryview:
    """``view`` (a contiguous numpy array or a byte memoryview) as a byte memoryview, for slicing."""
    return view if type(view) is memoryview else as_memoryview(view)  # noqa: E721


def _first(parts: list, n: int) -> list:
    """The first ``n`` bytes of ``parts`` (views, no copy)."""
    head = parts[0]
    return [head[:n]] if len(head) >= n else [head, parts[1][: n - len(head)]]


def _advance(parts: list, n: int) -> list:
    """What is left of ``parts`` (buffers sent with one sendmsg) after the kernel took ``n`` bytes."""
    left = []
    for part in parts:
        if n >= len(part):
            n -= len(part)
        else:
            left.append(part[n:] if n else part)
            n = 0
    return left


class TcpRequest(Request):
    """A posted send or receive. The transport fills it in under its lock.

    Rarely changed fields are class-level defaults: a request is created per message, and every
    attribute set in ``__init__`` is paid on the small-message path.
    """

    done = False
    error: TransportError | None = None
    order = 0  # post order, for matching posted any-source vs specific receives
    incoming = None  # receives: the _Incoming frame writing into view, once matched
    parts = None  # sends: what is left to write (header, payload views)
    offset = 0  # sends: bytes of the frame already written
    total = 0  # sends: header + payload bytes
    bulk = False  # counted in TcpTransport._bulk until done

    def __init__(self, transport: "TcpTransport", is_send: bool, peer: int, key: MessageKey, signature: int, view):
        self._t = transport
        self.is_send = is_send
        self.peer = peer  # dst, src or ANY_SOURCE
        self.key = key
        self.signature = signature
        self.view = view  # the user's bytes; dropped on completion

    def wait(self, deadline: float | None = None) -> None:
        if not self.done:
            self._t._wait(self, deadline)
        if self.error is not None:
            raise self.error

    def test(self) -> bool:
        if not self.done:
            self._t._poke()
        return self.done

    def __repr__(self) -> str:
        state = "done" if self.done else "pending"
        return f"<TcpRequest {'send to' if self.is_send else 'recv from'} {self.peer} {describe_key(self.key)} {state}>"


class _Incoming:
    """The frame whose payload is being read from a peer: into a request, a message, nowhere, or
    (``notice``: (peer, group) of a GAVE_UP control frame) a buffer read when the frame ends."""

    __slots__ = ("nbytes", "got", "dest", "req", "msg", "notice")

    def __init__(self, nbytes, dest, req=None, msg=None, notice=None):
        self.nbytes, self.got, self.dest, self.req, self.msg, self.notice = nbytes, 0, dest, req, msg, notice


class _Peer:
    __slots__ = ("rank", "sock", "fd", "where", "sendq", "stage", "sview", "lo", "hi", "cur", "lost", "goodbye",
                 "out")

    def __init__(self, rank: int, sock: socket.socket):
        self.rank, self.sock, self.fd = rank, sock, sock.fileno()
        try:  # the peer's host, for errors: which machine went away
            self.where = f" at {sock.getpeername()[0]}" if sock.family in (socket.AF_INET, socket.AF_INET6) else ""
        except OSError:
            self.where = ""
        self.sendq: deque[TcpRequest] = deque()
        self.stage = bytearray(_STAGE)
        self.sview = memoryview(self.stage)
        self.lo = self.hi = 0  # unparsed bytes are stage[lo:hi]
        self.cur: _Incoming | None = None
        self.lost: TransportError | None = None
        self.goodbye = False  # the peer announced an orderly close
        self.out = False  # EPOLLOUT registered


class TcpTransport(Transport):
    """Point-to-point over one TCP connection per pair of ranks. Thread-safe."""

    @classmethod
    def connect(cls, store, rank: int, size: int, timeout: float, host: str | None = None,
                prefix: str = "tcp") -> "TcpTransport":
        """Build the mesh through ``store`` (see mesh.py) and start the transport."""
        return cls(rank, size, mesh.connect_mesh(store, rank, size, timeout, host, prefix))

    def __init__(self, rank: int, size: int, sockets: dict[int, socket.socket]):
        """Run over already connected sockets, one per other rank (tests use socketpairs)."""
        if sorted(sockets) != [q for q in range(size) if q != rank]:
            raise ValueError(f"rank {rank} of {size} needs one socket per other rank, got {sorted(sockets)}")
        self.rank, self.size = rank, size
        self._lock = threading.Lock()
        self._done_cond = threading.Condition(self._lock)  # non-driving waiters sleep here
        self._bg_cond = threading.Condition(self._lock)  # the background thread parks here
        self._peers: list[_Peer | None] = [None] * size
        self._by_fd: dict[int, _Peer] = {}
        self._fg, self._bg = select.epoll(), select.epoll()
        self._fg_wake_r, self._fg_wake_w = os.pipe()  # kicks the driver out of epoll
        self._bg_wake_r, self._bg_wake_w = os.pipe()  # written once, by close()
        self._kicked = False  # a byte is in the fg pipe and not yet drained
        for fd in (self._fg_wake_r, self._fg_wake_w):
            os.set_blocking(fd, False)
        self._fg.register(self._fg_wake_r, _IN)
        self._bg.register(self._bg_wake_r, _IN)
        for q, sock in sockets.items():
            sock.setblocking(False)
            p = _Peer(q, sock)
            self._peers[q] = p
            self._by_fd[p.fd] = p
            self._fg.register(p.fd, _IN)
            self._bg.register(p.fd, _IN)
        # Public for inspection (tests, debugging); only this transport changes it, under _lock.
        self.matcher = Matcher(rank, size)
        self._any_lost: TransportError | None = None  # why any-source receives can no longer work
        self._groups: dict[int, frozenset] = {}  # group id -> its members (watch_group)
        self._crashed: dict[int, TransportError] = {}  # peers lost without a GOODBYE
        self._doomed: dict[int, TransportError] = {}  # group id -> why its collectives fail (crash, give_up)
        if size == 1:
            self._any_lost = TransportError(f"rank {rank} is alone in its world: nobody can send to it")
        self._scratch = memoryview(bytearray(_SCRATCH))
        self._waiters = 0  # threads inside _wait
        self._drives = 0  # calls of _wait so far: the background thread keeps off while it grows
        self._bulk = 0  # pending large transfers (queued sends, posted receives >= _BULK bytes)
        self._cond_waiters = 0  # of which sleeping on _done_cond
        self._driver: int | None = None  # thread ident that owns the _fg loop
        self._closed = False
        self._pollers_closed = False
        self._thread = threading.Thread(target=self._background, name=f"distcomm-tcp-{rank}", daemon=True)
        self._thread.start()
        self._pid = os.getpid()
        _OPEN.add(self)

    def __repr__(self) -> str:
        return f"TcpTransport(rank={self.rank}, size={self.size}{', closed' if self._closed else ''})"

    def connections(self) -> dict[int, tuple[tuple, tuple]]:
        """``{peer: (local address, peer's address)}`` of each live connection (socket names, e.g.
        ``("10.0.0.1", 40123)``; a peer on this host connected by a Unix socket has the listener's
        abstract name on one end and ``""`` on the other): which interface the mesh really runs over
        (tests, debugging)."""
        out = {}
        with self._lock:
            for p in self._peers:
                if p is not None and p.lost is None and not self._closed:
                    out[p.rank] = (p.sock.getsockname(), p.sock.getpeername())
        return out

    # -- posting ---------------------------------------------------------------------------------
    def _peer(self, q: int, what: str) -> _Peer:
        if type(q) is int and q != self.rank and 0 <= q < self.size:  # noqa: E721 - the fast path
            return self._peers[q]
        if not isinstance(q, (int, np.integer)) or not 0 <= q < self.size or q == self.rank:
            raise ValueError(f"rank {self.rank} cannot {what} rank {q!r} (world of {self.size})")
        return self._peers[int(q)]

    def isend(self, dst: int, data, key: MessageKey, signature: int = 0) -> TcpRequest:
        if type(data) is _ndarray and data.flags.c_contiguous:  # noqa: E721 - the common case first
            view = data  # sendmsg takes the array itself; a byte view is made only if it is queued
            nbytes = data.nbytes
        else:
            view = as_memoryview(data)
            nbytes = view.nbytes
        header = _encode_header(key, signature, nbytes)
        req = TcpRequest(self, True, dst, key, signature, view)
        total = req.total = _HDR + nbytes
        with self._lock:
            p = self._peers[dst] if type(dst) is int and 0 <= dst < self.size else None  # noqa: E721
            if p is None:
                p = self._peer(dst, "send to")
            if self._closed or p.lost is not None:
                self._finish(req, self._lost_error(p))
                return req
            if self._doomed and key[1] == KIND_COLLECTIVE and key[0] in self._doomed:
                self._finish(req, self._doomed[key[0]])
                return req
            if not p.sendq:  # the direct attempt: a small message completes right here
                try:
                    if total <= _SEND_CHUNK:
                        n = p.sock.sendmsg((header, view) if nbytes else (header,), (), _NOSIGNAL)
                    else:
                        n = p.sock.sendmsg((header, _flat(view)[: _SEND_CHUNK - _HDR]), (), _NOSIGNAL)
                except (BlockingIOError, InterruptedError):
                    n = 0
                except OSError as exc:
                    self._lose(p, f"sending to rank {p.rank} failed: {exc}")
                    self._finish(req, p.lost)
                    return req
                if n == total:
                    req.done, req.view = True, None  # nobody can be waiting on it yet
                    return req
                req.offset, req.parts = n, _advance([header, _flat(view)] if nbytes else [header], n)
                self._set_out(p, True)
            else:
                req.parts = [header, _flat(view)] if nbytes else [header]
            p.sendq.append(req)
            self._add_bulk(req, total >= _BULK)
        return req

    def irecv(self, src: int, out, key: MessageKey, signature: int = 0) -> TcpRequest:
        view = as_memoryview(out, writable=True)
        req = TcpRequest(self, False, src, key, signature, view)
        with self._lock:
            if src != ANY_SOURCE:
                p = self._peers[src] if type(src) is int and 0 <= src < self.size else None  # noqa: E721
                if p is None:
                    p = self._peer(src, "receive from")
                lost = p.lost
            else:
                lost = self._any_lost
            if lost is None and self._doomed and key[1] == KIND_COLLECTIVE and key[0] in self._doomed:
                lost = self._doomed[key[0]]
            try:
                if self._closed:
                    self._finish(req, self._lost_error(None))
                elif lost is None:
                    msg = self.matcher.post(req)
                    if msg is not None:
                        self._deliver_unexpected(req, msg)
                    elif view.nbytes >= _BULK:
                        self._add_bulk(req, True)
                else:  # messages completed before the peer (or the group) was lost are still delivered
                    msg = self.matcher.take(src, key)
                    if msg is not None:
                        self._deliver_unexpected(req, msg)
                    else:
                        self._finish(req, lost)
            except TransportError as exc:  # the peer gave up on this call (Matcher.give_up)
                self._finish(req, lost or self._gone_member(key[0]) or exc)  # a known cause first
        return req

    def _deliver_unexpected(self, req: TcpRequest, msg: Unexpected) -> None:
        """A new receive (nobody waits on it yet) takes a message that came before it."""
        req.source = msg.src
        if msg.nbytes == req.view.nbytes and msg.signature == req.signature:
            err = None
        else:
            err = self.matcher.mismatch(req.key, msg.src, msg.signature, msg.nbytes, req.signature, req.view.nbytes)
        if not msg.complete:  # still arriving: redirect the rest of the payload
            cur = self._peers[msg.src].cur
            cur.msg = None
            if err is None:
                req.view[: cur.got] = memoryview(msg.data)[: cur.got]
                cur.dest, cur.req, req.incoming = req.view, req, cur
                return
            cur.dest = None
        elif err is None:
            req.view[:] = msg.data
            # _finish inlined: the request is new, so nobody waits on it and it is not counted bulk
            req.nbytes, req.done, req.view = msg.nbytes, True, None
            return
        self._finish(req, err)

    # -- completion, waiting ---------------------------------------------------------------------
    def _add_bulk(self, req: TcpRequest, wake: bool) -> None:
        """A large transfer is pending: the background thread moves it whenever nobody waits.

        ``wake``: start at once rather than at the next park period's end (or when the caller
        stops waiting); only for transfers long enough to pay for the thread hand-off.
        """
        req.bulk = True
        self._bulk += 1
        if wake and not self._waiters:
            self._bg_cond.notify()

    def _finish(self, req: TcpRequest, error: TransportError | None = None) -> None:
        if req.done:
            return
        req.error, req.done, req.view, req.incoming = error, True, None, None
        if req.bulk:
            self._bulk -= 1
        if self._cond_waiters:
            self._done_cond.notify_all()
        if self._driver is not None and not self._kicked and self._driver != threading.get_ident():
            self._kicked = True  # the driver sleeps in epoll and would not notice: make it look
            os.write(self._fg_wake_w, b"x")

    def _wait(self, req: TcpRequest, deadline: float | None) -> None:
        """Drive the event loop until ``req`` is done (or sleep while another thread drives).

        The lock is held throughout except inside epoll and Condition.wait: this is the hot path
        of every small message, so it takes the lock twice per loop turn, not more.
        """
        me = _get_ident()
        lock = self._lock
        lock.acquire()
        self._waiters += 1
        self._drives += 1
        try:
            if self._driver is None and not self._closed:
                # the common case (nobody else drives) without the general loop's bookkeeping; a
                # deadline that runs out or a close() leaves the rest to the general loop below
                self._driver = me
                poll, handle = self._fg.poll, self._handle
                timeout = -1
                while not req.done:
                    if deadline is not None:
                        timeout = deadline - _monotonic()
                        if timeout <= 0:
                            break
                    lock.release()
                    try:
                        events = poll(timeout)
                    finally:
                        lock.acquire()
                    if self._closed:
                        break
                    handle(events)
            while not req.done:
                left = None if deadline is None else deadline - time.monotonic()
                if self._driver is None:
                    self._driver = me
                elif self._driver != me:
                    if left is not None and left <= 0:
                        self._withdraw(req)
                        break
                    self._cond_waiters += 1
                    self._done_cond.wait(left)
                    self._cond_waiters -= 1
                    continue
                if self._closed:  # close() failed every request; this is a safety net
                    self._finish(req, self._lost_error(None))
                    break
                lock.release()
                try:
                    events = self._fg.poll(-1 if left is None else max(0.0, left))
                finally:
                    lock.acquire()
                if not self._closed:
                    self._handle(events)
                if left is not None and left <= 0:
                    self._withdraw(req)
        finally:
            self._waiters -= 1
            if self._driver == me:
                self._release(me)
            if self._bulk and not self._waiters:  # large transfers left pending: keep them moving
                self._bg_cond.notify()
            lock.release()

    def _release(self, me: int) -> None:
        """Give up the driver role (if ours); hand it to a sleeping waiter; finish a deferred close."""
        if self._driver == me:
            self._driver = None
            if self._cond_waiters:
                self._done_cond.notify_all()
            elif self._closed and not self._waiters and not self._thread.is_alive():
                self._close_pollers()

    def _poke(self) -> None:
        """test(): one non-blocking pass of the event loop if nobody else is driving."""
        me = threading.get_ident()
        with self._lock:
            if self._driver is not None or self._waiters or self._closed:
                return
            self._driver = me
        try:
            events = self._fg.poll(0)
            with self._lock:
                if not self._closed:
                    self._handle(events)
        finally:
            with self._lock:
                self._release(me)

    def _withdraw(self, req: TcpRequest, error: TransportError | None = None) -> None:
        """A wait ran out (or ``error``: its group is doomed): take the request back so nothing
        lands in (or leaves) its buffer later."""
        if req.done:
            return
        if req.is_send:
            if req.offset == 0:  # nothing on the wire yet: drop it (else finish the frame, in step)
                try:
                    self._peers[req.peer].sendq.remove(req)
                except ValueError:
                    pass
            what = f"send {req.total - _HDR} bytes to"
        else:
            if req.incoming is not None:  # matched and arriving: read the rest to nowhere
                req.incoming.dest, req.incoming.req = None, None
            else:
                self.matcher.withdraw(req)
            what = f"receive {req.view.nbytes} bytes from"
        if error is not None:
            self._finish(req, error)
            return
        who = "any rank" if req.peer == ANY_SOURCE else f"rank {req.peer}"
        self._finish(req, TransportError(
            f"Timed out on rank {self.rank} waiting to {what} {who} ({describe_key(req.key)}); the request was "
            "withdrawn", peer=None if req.peer == ANY_SOURCE else req.peer, reason="timeout"))

    # -- the event loop --------------------------------------------------------------------------
    def _handle(self, events) -> None:
        """Act on epoll events (lock held)."""
        for fd, ev in events:
            p = self._by_fd.get(fd)
            if p is None:
                if fd == self._fg_wake_r and self._kicked:
                    self._kicked = False
                    try:
                        os.read(fd, 4096)
                    except BlockingIOError:
                        pass
                continue
            if ev & _OUT and p.lost is None:
                self._write(p)
            if ev & ~_OUT and p.lost is None:
                self._read(p)

    def _background(self) -> None:
        lock = self._lock
        seen = -1
        while True:
            with lock:
                # Park while a thread drives, and for one more period after any thread drove
                # unless a large transfer is pending: a caller running small collectives back to
                # back waits again within microseconds, and taking its messages here would cost two
                # thread hand-offs per message; a large transfer left pending while the caller
                # computes (e.g. reduces the previous block) should move meanwhile.
                while not self._closed and (self._waiters or (self._drives != seen and not self._bulk)):
                    seen = self._drives
                    self._bg_cond.wait(_PARK_S)
                if self._closed:
                    return
            events = self._bg.poll(-1)
            with lock:
                if self._closed:
                    return
                if not self._waiters and (self._drives == seen or self._bulk):  # else leave them to the caller
                    self._handle(events)

    def _write(self, p: _Peer) -> None:
        q = p.sendq
        while q:
            req = q[0]
            try:
                parts = req.parts
                n = p.sock.sendmsg(_first(parts, _SEND_CHUNK) if req.total - req.offset > _SEND_CHUNK else parts,
                                   (), _NOSIGNAL)
            except (BlockingIOError, InterruptedError):
                n = 0
            except OSError as exc:
                return self._lose(p, f"sending to rank {p.rank} failed: {exc}")
            req.offset += n
            if req.offset < req.total:  # the kernel is full: keep the rest for EPOLLOUT
                req.parts = _advance(req.parts, n)
                if not p.out:
                    self._set_out(p, True)
                return
            q.popleft()
            req.parts = None
            self._finish(req)
        if p.out:
            self._set_out(p, False)

    def _set_out(self, p: _Peer, on: bool) -> None:
        p.out = on
        for poller in (self._fg, self._bg):
            poller.modify(p.fd, _IN | _OUT if on else _IN)

    def _read(self, p: _Peer) -> None:
        """Read and dispatch everything available from ``p`` (non-blocking).

        Written for the small-message hot path: one ``recv_into`` of up to ``_STAGE`` bytes brings
        headers and small payloads, which are parsed from the staging buffer; a payload larger than
        what is staged is read straight into its destination. A recv that returns less than asked
        means the socket is drained; we stop there instead of paying for one more syscall that
        would only raise EAGAIN (epoll is level-triggered, so nothing is missed).
        """
        stage, sview, sock, src = p.stage, p.sview, p.sock, p.rank
        offer = self.matcher.offer
        lo, hi = p.lo, p.hi
        drained = False
        try:
            while True:
                cur = p.cur
                if cur is None:
                    if hi - lo >= _HDR:
                        magic, version, kind, group, seq, signature, reserved, nbytes = _unpack_header(stage, lo)
                        if magic != _MAGIC or version != _VERSION or reserved or nbytes > _MAX_NBYTES:
                            try:  # framing says what is wrong with it
                                _decode_header(stage, lo)
                            except framing.FramingError as exc:
                                return self._lose(p, f"protocol error from rank {p.rank}: {exc}")
                        key = _new_tuple(MessageKey, (group, kind, seq))
                        lo += _HDR
                        if nbytes <= hi - lo and kind != _KIND_CONTROL:
                            # the common small-message cases inline: the whole payload is staged
                            req, msg = offer(src, key, signature, nbytes)
                            if req is None:  # unexpected: keep a copy of its bytes
                                msg.data, msg.complete = sview[lo: lo + nbytes].tobytes(), True
                                lo += nbytes
                                continue
                            req.source = src
                            if nbytes == req.view.nbytes and signature == req.signature:
                                req.view[:] = sview[lo: lo + nbytes]
                                lo += nbytes
                                # _finish inlined: whoever runs _read drives (or nobody waits), so
                                # there is no driver to kick; a receive this small is not bulk
                                req.nbytes, req.done, req.view = nbytes, True, None
                                if self._cond_waiters:
                                    self._done_cond.notify_all()
                                continue
                            self._finish(req, self.matcher.mismatch(key, src, signature, nbytes, req.signature,
                                                                    req.view.nbytes))
                            lo += nbytes  # the payload is discarded
                            continue
                        cur = self._begin_frame(p, key, signature, nbytes)
                        if cur is None:
                            if p.lost is not None:  # a malformed control frame dropped the peer
                                return
                            continue
                    else:
                        if lo == hi:
                            lo = hi = 0
                        elif lo:  # move the partial header to the front
                            stage[: hi - lo] = sview[lo:hi]
                            lo, hi = 0, hi - lo
                        if drained:
                            return
                        try:  # _recv inlined
                            n = sock.recv_into(sview[hi:])
                        except (BlockingIOError, InterruptedError):
                            return
                        except OSError as exc:
                            return self._lose(p, f"connection to rank {src} failed: {exc}")
                        if n == 0:
                            return self._lose(p, None)
                        drained = n < _STAGE - hi
                        hi += n
                        continue
                # the payload of cur: from the stage first, then straight from the socket
                need = cur.nbytes - cur.got
                if hi > lo:
                    n = need if need < hi - lo else hi - lo
                    if cur.dest is not None:
                        cur.dest[cur.got: cur.got + n] = sview[lo: lo + n]
                    lo += n
                else:
                    if drained:
                        return
                    target = cur.dest[cur.got:] if cur.dest is not None else self._scratch[: min(need, _SCRATCH)]
                    n = self._recv(p, target)
                    if n <= 0:
                        return
                    drained = n < len(target)
                cur.got += n
                if cur.got == cur.nbytes:
                    p.cur = None
                    self._end_frame(cur)
        finally:
            p.lo, p.hi = lo, hi

    def _recv(self, p: _Peer, target) -> int:
        """recv_into ``target``: the bytes read, 0 when none are there now, -1 when ``p`` is lost."""
        try:
            n = p.sock.recv_into(target)
        except (BlockingIOError, InterruptedError):
            return 0
        except OSError as exc:
            self._lose(p, f"connection to rank {p.rank} failed: {exc}")
            return -1
        if n == 0:
            self._lose(p, None)
            return -1
        return n

    def _begin_frame(self, p: _Peer, key, signature: int, nbytes: int) -> _Incoming | None:
        """A header arrived: decide where its payload goes. Returns p.cur (None: nothing to read)."""
        src = p.rank
        if key[1] == framing.KIND_CONTROL:
            if key[2] == framing.CONTROL_GOODBYE:
                p.goodbye = True
                cur = _Incoming(nbytes, None)
            elif key[2] == framing.CONTROL_GAVE_UP:
                if nbytes != framing.GAVE_UP_NBYTES:
                    self._lose(p, f"protocol error from rank {src}: a gave-up notice of {nbytes} bytes, expected "
                                  f"{framing.GAVE_UP_NBYTES}")
                    return None
                cur = _Incoming(nbytes, memoryview(bytearray(nbytes)), notice=(src, key[0]))
            else:  # a later version's control frame: skipped
                cur = _Incoming(nbytes, None)
        else:
            req, msg = self.matcher.offer(src, key, signature, nbytes)
            if req is not None:
                req.source = src
                err = self.matcher.mismatch(key, src, signature, nbytes, req.signature, req.view.nbytes)
                if err is not None:
                    self._finish(req, err)
                    cur = _Incoming(nbytes, None)
                else:
                    cur = req.incoming = _Incoming(nbytes, req.view, req)
            else:  # read into a buffer of exactly its size
                msg.data = np.empty(nbytes, np.uint8)
                msg.complete = nbytes == 0
                cur = _Incoming(nbytes, memoryview(msg.data), None, msg)
        if nbytes:
            p.cur = cur
            return cur
        self._end_frame(cur)
        return None

    def _end_frame(self, cur: _Incoming) -> None:
        if cur.req is not None:
            cur.req.nbytes = cur.nbytes
            self._finish(cur.req)
        elif cur.msg is not None:
            cur.msg.complete = True
        elif cur.notice is not None:
            src, group = cur.notice
            self._peer_gave_up(src, group, framing.decode_gave_up(cur.dest))

    # -- failures --------------------------------------------------------------------------------
    def _lost_error(self, p: _Peer | None) -> TransportError:
        if p is not None and p.lost is not None:
            return p.lost
        return TransportError(f"the TCP transport of rank {self.rank} is closed", peer=None if p is None else p.rank,
                              reason="lost")

    def _lose(self, p: _Peer, why: str | None) -> None:
        """The connection to ``p`` is gone: fail everything that needs it, now."""
        if p.lost is not None:
            return
        if why is None:
            why = (f"rank {p.rank} closed its connection to rank {self.rank} (it closed its transport)" if p.goodbye
                   else f"lost the connection to rank {p.rank}{p.where} (its process exited or crashed, or the "
                        "network failed)")
        err = p.lost = TransportError(why, peer=p.rank, reason="lost")
        for poller in (self._fg, self._bg):
            try:
                poller.unregister(p.fd)
            except (OSError, ValueError):
                pass
        del self._by_fd[p.fd]
        try:
            p.sock.close()
        except OSError:
            pass
        pending = list(p.sendq)
        p.sendq.clear()
        if p.cur is not None:
            if p.cur.req is not None:
                pending.append(p.cur.req)
            if p.cur.msg is not None:  # half-arrived: it can never be delivered
                self.matcher.discard(p.cur.msg)
            p.cur = None
        any_source = not p.goodbye or all(q is None or q.lost is not None for q in self._peers)
        if any_source:
            self._any_lost = self._any_lost or err
        pending += self.matcher.lose(p.rank, any_source)
        for req in pending:
            self._finish(req, err)
        if not p.goodbye:
            self._crashed[p.rank] = err
            for gid, members in self._groups.items():
                if p.rank in members:
                    self._doom(gid, p.rank, err)

    # -- groups ----------------------------------------------------------------------------------
    def watch_group(self, group_id: int, ranks) -> None:
        """Group ``group_id`` has these members (global ranks): when one of them is lost without a
        GOODBYE, its collectives fail at once (see the module docstring)."""
        with self._lock:
            members = self._groups[group_id] = frozenset(ranks)
            crashed = [q for q in sorted(members) if q in self._crashed]
            if crashed:
                self._doom(group_id, crashed[0], self._crashed[crashed[0]])

    def unwatch_group(self, group_id: int) -> None:
        """Group ``group_id`` was destroyed: forget it. No notice goes to its members."""
        with self._lock:
            self._groups.pop(group_id, None)
            self._doomed.pop(group_id, None)
            self.matcher.forget_group(group_id)

    def give_up(self, group_id: int, seq: int, why: str) -> None:
        """Collective call ``seq`` of group ``group_id`` failed on this rank (``why``): withdraw the
        group's pending collective requests, fail its later ones at once, and send each live member
        a GAVE_UP notice (once per group; not for a group already doomed by a crashed member, which
        every member learns of from its own kernel). See the module docstring."""
        with self._lock:
            if self._closed or group_id in self._doomed:
                return
            self._fail_group(group_id, TransportError(
                f"this group is unusable on rank {self.rank} after an earlier failure in its call #{seq} ({why}); "
                "destroy the process group and create it again", reason="error"))
            frame = framing.encode_gave_up(group_id, seq)
            for q in sorted(self._groups.get(group_id, ())):
                p = self._peers[q] if 0 <= q < self.size and q != self.rank else None
                if p is not None and p.lost is None:
                    self._send_control(p, MessageKey(group_id, _KIND_CONTROL, framing.CONTROL_GAVE_UP), frame)

    def _send_control(self, p: _Peer, key: MessageKey, frame: bytes) -> None:
        """Send a control frame to ``p`` after whatever is queued for it (lock held); nobody waits
        for it: a part the kernel does not take at once is written by whichever thread drives."""
        req = TcpRequest(self, True, p.rank, key, 0, None)
        req.total = len(frame)
        n = 0
        if not p.sendq:
            try:
                n = p.sock.sendmsg((frame,), (), _NOSIGNAL)
            except (BlockingIOError, InterruptedError):
                n = 0
            except OSError as exc:
                self._lose(p, f"sending to rank {p.rank} failed: {exc}")
                return
            if n == len(frame):
                return
            self._set_out(p, True)
        req.offset, req.parts = n, [memoryview(frame)[n:]]
        p.sendq.append(req)
        self._add_bulk(req, True)  # moved by the background thread if nobody drives

    def _peer_gave_up(self, src: int, group: int, seq: int) -> None:
        """Rank ``src`` told us it gave up on ``group`` at call ``seq`` (lock held): the matcher
        refuses those calls' receives from it from now on; fail the posted ones."""
        recvs, _dropped = self.matcher.give_up(src, group, seq)
        gone = self._gone_member(group)
        for req in recvs:
            self._finish(req, gone or self.matcher.gave_up_error(src, req.key))

    def _gone_member(self, group: int) -> TransportError | None:
        """Why a member of ``group`` is gone (it closed its transport without destroying the group,
        or crashed), if one is: the likely reason a peer gave up on the group, so a receive refused
        because of that peer names the gone member, as its own receive from it would (lock held)."""
        for q in sorted(self._groups.get(group, ())):
            p = self._peers[q] if 0 <= q < self.size else None
            if p is not None and p.lost is not None:
                return p.lost
        return None

    def _doom(self, gid: int, dead: int, cause: TransportError) -> None:
        """Member ``dead`` of group ``gid`` crashed: fail the group's pending collective requests
        (whichever peer they wait for) and every later one, naming it (lock held)."""
        if gid in self._doomed:
            return
        self._fail_group(gid, TransportError(
            f"rank {dead} of this group is gone ({cause}); no collective of the group can complete. Find why "
            f"rank {dead} died (its output or exit code), then restart the job", peer=dead, reason="lost"))

    def _fail_group(self, gid: int, err: TransportError) -> None:
        """Group ``gid``'s collectives fail with ``err`` from now on: its pending requests (withdrawn,
        a frame already partly on the wire still finished in step) and its later ones (lock held)."""
        self._doomed[gid] = err

        def ours(req) -> bool:
            return req.key[1] == KIND_COLLECTIVE and req.key[0] == gid

        victims = [r for r in self.matcher.posted() if ours(r)]
        for q in self._peers:
            if q is None or q.lost is not None:
                continue
            victims += [r for r in q.sendq if ours(r)]
            if q.cur is not None and q.cur.req is not None and ours(q.cur.req):
                victims.append(q.cur.req)
        for req in victims:
            self._withdraw(req, err)

    def close(self) -> None:
        """Fail pending requests (reason "lost"), say GOODBYE to peers, stop the background thread."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            err = self._lost_error(None)
            pending, _ = self.matcher.clear()
            for p in self._peers:
                if p is None or p.lost is not None:
                    continue
                pending.extend(p.sendq)
                if p.cur is not None and p.cur.req is not None:
                    pending.append(p.cur.req)
                if not p.sendq or p.sendq[0].offset == 0:  # not mid-frame: the peer can parse it
                    try:
                        p.sock.send(framing.encode_goodbye(), _NOSIGNAL)
                    except OSError:
                        pass
                p.sendq.clear()
            for req in pending:
                self._finish(req, err)
            os.write(self._bg_wake_w, b"x")
            try:
                os.write(self._fg_wake_w, b"x")
            except BlockingIOError:  # already full of wake-ups
                pass
            self._bg_cond.notify_all()
            self._done_cond.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join(10)
        with self._lock:
            for p in self._peers:
                if p is not None and p.lost is None:
                    try:
                        p.sock.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
                    p.sock.close()
            # Never close the pollers under a thread still inside epoll_wait on them: closing the
            # wake pipe can swallow its wake-up and leave that thread asleep for good. The driver
            # closes them when it leaves (_release); a background thread that did not stop in 10 s
            # keeps them (a leak, not a hang).
            if self._driver is None and not self._thread.is_alive():
                self._close_pollers()

    def _close_pollers(self) -> None:
        if self._pollers_closed:
            return
        self._pollers_closed = True
        self._fg.close()
        self._bg.close()
        for fd in (self._fg_wake_r, self._fg_wake_w, self._bg_wake_r, self._bg_wake_w):
            os.close(fd)
