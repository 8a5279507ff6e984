"""The in-process transport: N ranks as threads of one process, sharing one "world" object.

``InprocTransport.create_world(n)`` returns one transport per rank. It implements the Transport
contract exactly as the socket transport does, so algorithms tested on it behave the same over TCP:

* Matching. Each rank has a Matcher (matching.py, the rules every transport shares) of *posted
  receives* and *unexpected messages* (sent before a matching receive was posted). A message
  matches the oldest posted receive with the same MessageKey whose source is the sender or
  ANY_SOURCE; a receive matches the oldest unexpected message with its key from its source (any
  source for ANY_SOURCE). So messages from one source with one key are received in the order they
  were sent (MPI's non-overtaking rule).
* Checks. A matched pair whose signatures or byte counts differ completes the receive with
  ``TransportError(reason="mismatch")`` naming the sender; nothing is truncated or copied. A
  rendezvous send (see below) that is matched that way fails the same way, since here both sides
  can know.
* Copies. The receiver always gets a copy: once a send completes, the sender may reuse its buffer.
  Messages of at most ``eager_limit`` bytes are copied at ``isend`` and the send completes at once
  (as small TCP sends do); larger ones complete only when a receive takes them (rendezvous), and are
  copied straight from the sender's buffer into the receiver's. ``eager_limit=0`` makes every send
  synchronous, which exposes algorithms that only work because sends are buffered (both ranks
  sending before either receives): the algorithm tests use it.
* Deadlines. ``wait(deadline)`` past the deadline raises ``TransportError(reason="timeout")`` naming
  the peer, and withdraws the request (a late message can no longer land in the buffer).
* Loss. ``close()`` fails this rank's pending requests and every other rank's requests that need
  this rank with ``reason="lost"``; later requests involving a closed rank fail at once (eager
  messages it sent before closing are still delivered).

One lock per world guards every rank's Matcher; the copies themselves run outside it. Waiting blocks on a
per-request event (no spinning: two cores are shared by all ranks of a test).
"""

from __future__ import annotations

import threading
import time

import numpy as np

from .base import ANY_SOURCE, MessageKey, Request, Transport, TransportError
from .buffers import as_bytes
from .matching import Matcher, Unexpected

DEFAULT_EAGER_LIMIT = 64 * 1024


class _InprocRequest(Request):
    __slots__ = ("_done", "_error", "_world", "kind", "peer", "owner", "buf", "key", "signature", "source", "nbytes",
                 "order", "msg")

    def __init__(self, world: "_World", kind: str, owner: int, peer: int, buf, key, signature):
        self._done = threading.Event()
        self._error: TransportError | None = None
        self._world = world
        self.kind = kind  # "send" or "recv"
        self.owner = owner  # the rank that posted it
        self.peer = peer  # dst for sends, src (or ANY_SOURCE) for receives
        self.buf = buf
        self.key = key
        self.signature = signature
        self.source = -1
        self.nbytes = 0
        self.order = 0  # receives: post number (the Matcher's)
        self.msg: Unexpected | None = None  # rendezvous sends: the message waiting for a receive

    def _complete(self, error: TransportError | None = None) -> None:
        self._error = error
        self.buf = None  # drop the reference to the user's buffer
        self._done.set()

    def wait(self, deadline: float | None = None) -> None:
        if not self._done.is_set():
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not self._done.wait(timeout) and not self._world.withdraw(self):
                self._done.wait()  # matched while timing out: the copy is under way, let it finish
        if self._error is not None:
            raise self._error

    def test(self) -> bool:
        return self._done.is_set()


class _World:
    def __init__(self, size: int, eager_limit: int):
        self.size = size
        self.eager_limit = eager_limit
        self.lock = threading.Lock()
        self.matchers = [Matcher(rank, size) for rank in range(size)]  # under self.lock
        self.closed = [False] * size

    # -- the two entry points -------------------------------------------------------------------
    def isend(self, src: int, dst: int, data: np.ndarray, key: MessageKey, signature: int) -> _InprocRequest:
        flat = as_bytes(data)
        req = _InprocRequest(self, "send", src, dst, flat, key, signature)
        req.nbytes = flat.nbytes
        matcher = self.matchers[dst]
        with self.lock:
            if self.closed[src] or self.closed[dst]:
                req._complete(self._lost(dst if self.closed[dst] else src, "send to", dst))
                return req
            recv, msg = matcher.offer(src, key, signature, flat.nbytes)
            if recv is None:  # kept as unexpected: an eager copy, or the sender's buffer (rendezvous)
                eager = flat.nbytes <= self.eager_limit
                msg.data, msg.complete = (flat.copy() if eager else flat), True
                if eager:
                    req._complete()
                else:
                    msg.sender, req.msg = req, msg
                return req
        _deliver(matcher, src, signature, flat, req, recv)
        return req

    def irecv(self, dst: int, src: int, out: np.ndarray, key: MessageKey, signature: int) -> _InprocRequest:
        req = _InprocRequest(self, "recv", dst, src, as_bytes(out), key, signature)
        matcher = self.matchers[dst]
        with self.lock:
            if self.closed[dst] or (src != ANY_SOURCE and self.closed[src]):
                msg = matcher.take(src, key)  # eager messages sent before the close still arrive
                if msg is None:
                    req._complete(self._lost(src if src != ANY_SOURCE and self.closed[src] else dst, "receive from", src))
                    return req
            else:
                msg = matcher.post(req)
                if msg is None:
                    return req
        _deliver(matcher, msg.src, msg.signature, msg.data, msg.sender, req)
        return req

    def withdraw(self, req: _InprocRequest) -> bool:
        """Take a timed-out request out of the queues; False if it was matched meanwhile."""
        with self.lock:
            if req._done.is_set():
                return True
            if req.kind == "recv":
                if not self.matchers[req.owner].withdraw(req):
                    return False
            elif req.msg is None or not self.matchers[req.peer].discard(req.msg):
                return False
            peer = None if req.peer == ANY_SOURCE else req.peer
            what = "send to" if req.kind == "send" else "receive from"
            who = "any rank" if peer is None else f"rank {peer}"
            req._complete(TransportError(f"Timed out waiting to {what} {who}", peer=peer, reason="timeout"))
            return True

    def close(self, rank: int) -> None:
        failed: list[tuple[_InprocRequest, TransportError]] = []
        with self.lock:
            if self.closed[rank]:
                return
            self.closed[rank] = True
            recvs, msgs = self.matchers[rank].clear()
            failed += [(req, self._lost(rank, "receive from", req.peer)) for req in recvs]
            failed += [(msg.sender, self._lost(rank, "send to", rank)) for msg in msgs if msg.sender is not None]
            for dst, matcher in enumerate(self.matchers):
                if dst == rank:
                    continue
                failed += [(req, self._lost(rank, "receive from", req.peer)) for req in matcher.lose(rank, False)]
                # An eager message from the closing rank was sent and stays deliverable (as bytes
                # already in a socket would); a rendezvous send from it is lost.
                for msg in matcher.unexpected(rank):
                    if msg.sender is not None:
                        matcher.discard(msg)
                        failed.append((msg.sender, self._lost(rank, "send to", dst)))
        for req, err in failed:
            req._complete(err)

    @staticmethod
    def _lost(rank: int, what: str, peer: int) -> TransportError:
        who = "any rank" if peer == ANY_SOURCE else f"rank {peer}"
        return TransportError(f"cannot {what} {who}: rank {rank}'s transport is closed", peer=rank, reason="lost")


def _deliver(matcher: Matcher, src: int, signature: int, data: np.ndarray, send: _InprocRequest | None,
             recv: _InprocRequest) -> None:
    """Copy a matched message into its receive (outside the lock) and complete both sides.

    ``send`` is the sender's request while it waits for this copy (rendezvous), else None.
    """
    out = recv.buf
    err = matcher.mismatch(recv.key, src, signature, data.nbytes, recv.signature, out.nbytes)
    if err is not None:
        recv._complete(err)
        if send is not None:
            send._complete(
                TransportError(
                    f"rank {recv.owner} expected {out.nbytes} bytes with signature {recv.signature:#x}, "
                    f"this rank sent {data.nbytes} bytes with signature {signature:#x}",
                    peer=recv.owner,
                    reason="mismatch",
                )
            )
        return
    if out.nbytes:
        np.copyto(out, data)
    recv.source = src
    recv.nbytes = out.nbytes
    recv._complete()
    if send is not None:
        send._complete()


class InprocTransport(Transport):
    """One rank's end of an in-process world (see the module docstring)."""

    def __init__(self, world: _World, rank: int):
        self._world = world
        self.rank = rank
        self.size = world.size

    @classmethod
    def create_world(cls, n: int, eager_limit: int = DEFAULT_EAGER_LIMIT) -> list["InprocTransport"]:
        """``n`` connected transports, one per rank; hand each to the thread playing that rank."""
        if n < 1:
            raise ValueError(f"an in-process world needs at least one rank, got {n}")
        world = _World(n, eager_limit)
        return [cls(world, r) for r in range(n)]

    def _check_rank(self, peer: int, allow_any: bool) -> None:
        if allow_any and peer == ANY_SOURCE:
            return
        if not 0 <= peer < self.size:
            raise ValueError(f"rank {peer} is not in this world of {self.size}")

    def isend(self, dst: int, data: np.ndarray, key: MessageKey, signature: int = 0) -> Request:
        self._check_rank(dst, allow_any=False)
        return self._world.isend(self.rank, dst, data, key, signature)

    def irecv(self, src: int, out: np.ndarray, key: MessageKey, signature: int = 0) -> Request:
        self._check_rank(src, allow_any=True)
        return self._world.irecv(self.rank, src, out, key, signature)

    def close(self) -> None:
        self._world.close(self.rank)

    def __repr__(self) -> str:
        return f"InprocTransport(rank={self.rank}, size={self.size})"

