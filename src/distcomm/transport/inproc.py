"""The in-process transport: N ranks as threads of one process, sharing one "world" object.

``InprocTransport.create_world(n)`` returns one transport per rank. It implements the Transport
contract exactly as the socket transport does, so algorithms tested on it behave the same over TCP:

* Matching. Each rank has a queue of *posted receives* and a queue of *unexpected messages* (sent
  before a matching receive was posted). A message matches the oldest posted receive with the same
  MessageKey whose source is the sender or ANY_SOURCE; a receive matches the oldest unexpected
  message with its key from its source (any source for ANY_SOURCE). So messages from one source with
  one key are received in the order they were sent (MPI's non-overtaking rule).
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

One lock per world guards the queues; the copies themselves run outside it. Waiting blocks on a
per-request event (no spinning: two cores are shared by all ranks of a test).
"""

from __future__ import annotations

import threading
import time
from collections import deque

import numpy as np

from .base import ANY_SOURCE, MessageKey, Request, Transport, TransportError

DEFAULT_EAGER_LIMIT = 64 * 1024


def _bytes(buf: np.ndarray) -> np.ndarray:
    """A flat uint8 view of a contiguous array (0-d and empty arrays included)."""
    if not buf.flags.c_contiguous:
        raise ValueError("point-to-point buffers must be C-contiguous")
    return buf.reshape(-1).view(np.uint8)


class _InprocRequest(Request):
    __slots__ = ("_done", "_error", "_world", "kind", "peer", "owner", "buf", "key", "signature", "source", "nbytes")

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


class _Message:
    """A send waiting in the receiver's unexpected queue: an eager copy or a rendezvous send."""

    __slots__ = ("src", "key", "signature", "data", "send")

    def __init__(self, src: int, key: MessageKey, signature: int, data: np.ndarray, send: _InprocRequest | None):
        self.src = src
        self.key = key
        self.signature = signature
        self.data = data  # flat uint8
        self.send = send  # None for eager messages (already complete)


class _World:
    def __init__(self, size: int, eager_limit: int):
        self.size = size
        self.eager_limit = eager_limit
        self.lock = threading.Lock()
        self.posted: list[deque[_InprocRequest]] = [deque() for _ in range(size)]
        self.unexpected: list[deque[_Message]] = [deque() for _ in range(size)]
        self.closed = [False] * size

    # -- matching (all under self.lock) ---------------------------------------------------------
    def _take_posted(self, dst: int, src: int, key: MessageKey) -> _InprocRequest | None:
        queue = self.posted[dst]
        for req in queue:
            if req.key == key and req.peer in (src, ANY_SOURCE):
                queue.remove(req)
                return req
        return None

    def _take_unexpected(self, dst: int, src: int, key: MessageKey) -> _Message | None:
        queue = self.unexpected[dst]
        for msg in queue:
            if msg.key == key and (src == ANY_SOURCE or msg.src == src):
                queue.remove(msg)
                return msg
        return None

    # -- the two entry points -------------------------------------------------------------------
    def isend(self, src: int, dst: int, data: np.ndarray, key: MessageKey, signature: int) -> _InprocRequest:
        flat = _bytes(data)
        req = _InprocRequest(self, "send", src, dst, flat, key, signature)
        req.nbytes = flat.nbytes
        with self.lock:
            if self.closed[src] or self.closed[dst]:
                req._complete(self._lost(dst if self.closed[dst] else src, "send to", dst))
                return req
            recv = self._take_posted(dst, src, key)
            if recv is None:
                eager = flat.nbytes <= self.eager_limit
                msg = _Message(src, key, signature, flat.copy() if eager else flat, None if eager else req)
                self.unexpected[dst].append(msg)
                if eager:
                    req._complete()
                return req
        _deliver(_Message(src, key, signature, flat, req), recv)
        return req

    def irecv(self, dst: int, src: int, out: np.ndarray, key: MessageKey, signature: int) -> _InprocRequest:
        req = _InprocRequest(self, "recv", dst, src, _bytes(out), key, signature)
        with self.lock:
            msg = self._take_unexpected(dst, src, key)
            if msg is None:
                if self.closed[dst] or (src != ANY_SOURCE and self.closed[src]):
                    req._complete(self._lost(src if src != ANY_SOURCE and self.closed[src] else dst, "receive from", src))
                else:
                    self.posted[dst].append(req)
                return req
        _deliver(msg, req)
        return req

    def withdraw(self, req: _InprocRequest) -> bool:
        """Take a timed-out request out of the queues; False if it was matched meanwhile."""
        with self.lock:
            if req._done.is_set():
                return True
            if req.kind == "recv":
                queue = self.posted[req.owner]
                if req not in queue:
                    return False
                queue.remove(req)
            else:
                queue = self.unexpected[req.peer]
                msg = next((m for m in queue if m.send is req), None)
                if msg is None:
                    return False
                queue.remove(msg)
            peer = None if req.peer == ANY_SOURCE else req.peer
            what = "send to" if req.kind == "send" else "receive from"
            who = "any rank" if peer is None else f"rank {peer}"
            req._complete(TransportError(f"timed out waiting to {what} {who}", peer=peer, reason="timeout"))
            return True

    def close(self, rank: int) -> None:
        failed: list[tuple[_InprocRequest, TransportError]] = []
        with self.lock:
            if self.closed[rank]:
                return
            self.closed[rank] = True
            for dst in range(self.size):
                keep_posted = deque()
                for req in self.posted[dst]:
                    if dst == rank or req.peer == rank:
                        failed.append((req, self._lost(rank, "receive from", req.peer)))
                    else:
                        keep_posted.append(req)
                self.posted[dst] = keep_posted
                keep_msgs = deque()
                for msg in self.unexpected[dst]:
                    # An eager message from the closing rank was sent and stays deliverable (as bytes
                    # already in a socket would); a rendezvous send from it, or anything to it, is lost.
                    if dst == rank or (msg.src == rank and msg.send is not None):
                        if msg.send is not None:
                            failed.append((msg.send, self._lost(rank, "send to", dst)))
                    else:
                        keep_msgs.append(msg)
                self.unexpected[dst] = keep_msgs
        for req, err in failed:
            req._complete(err)

    @staticmethod
    def _lost(rank: int, what: str, peer: int) -> TransportError:
        who = "any rank" if peer == ANY_SOURCE else f"rank {peer}"
        return TransportError(f"cannot {what} {who}: rank {rank}'s transport is closed", peer=rank, reason="lost")


def _deliver(msg: _Message, recv: _InprocRequest) -> None:
    """Copy a matched message into its receive (outside the lock) and complete both sides."""
    out = recv.buf
    if msg.signature != recv.signature or msg.data.nbytes != out.nbytes:
        err = TransportError(
            f"message from rank {msg.src} does not match the receive posted on rank {recv.owner}: "
            f"{msg.data.nbytes} bytes with signature {msg.signature:#x} arrived, "
            f"{out.nbytes} bytes with signature {recv.signature:#x} expected (the ranks called "
            "different collectives, or the same one with different sizes, dtypes or ops)",
            peer=msg.src,
            reason="mismatch",
        )
        recv._complete(err)
        if msg.send is not None:
            msg.send._complete(
                TransportError(
                    f"rank {recv.owner} expected {out.nbytes} bytes with signature {recv.signature:#x}, "
                    f"this rank sent {msg.data.nbytes} bytes with signature {msg.signature:#x}",
                    peer=recv.owner,
                    reason="mismatch",
                )
            )
        return
    if out.nbytes:
        np.copyto(out, msg.data)
    recv.source = msg.src
    recv.nbytes = out.nbytes
    recv._complete()
    if msg.send is not None:
        msg.send._complete()


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

