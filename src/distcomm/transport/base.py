"""The point-to-point interface: the only thing collective algorithms may touch.

Two layers, as in Gloo (a context of pairs, and algorithms written against unbound buffers):

``Transport``
    One per process and engine. Moves bytes between *global* ranks, matches each incoming message to
    a posted receive by ``(source, MessageKey)`` in arrival order (MPI's non-overtaking rule), and
    checks that the two sides agree on the message's signature and size. It decides nothing about
    algorithms. Implementations: ``tcp.TcpTransport`` (sockets), ``inproc.InprocTransport`` (threads
    of one process, for tests).

``Channel``
    One collective call's view of its group: group-relative ranks, the call's key (group id and
    sequence number) and signature stamped on every message, one deadline for the whole call, and
    errors that name the operation, its sequence number, this rank and the peer. An algorithm is a
    function ``algorithm(channel, ...)`` that calls only ``isend``, ``irecv``, ``send``, ``recv`` and
    ``sendrecv`` on it.

Buffers are numpy arrays, C-contiguous. A receive's size must match the send's exactly: a
difference means the ranks disagree about the collective and is reported, never truncated.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from typing import NamedTuple, Sequence

import numpy as np

from ..errors import (
    CollectiveMismatchError,
    DistBackendError,
    DistTimeoutError,
    PeerFailedError,
    PeerLostError,
    describe_op,
)
from .buffers import contiguous

ANY_SOURCE = -1

# MessageKey.kind
KIND_COLLECTIVE = 0
KIND_P2P = 1


class MessageKey(NamedTuple):
    """What a message belongs to. Messages with different keys never match each other."""

    group: int  # the group's id, the same number on every member (world.py allocates it)
    kind: int  # KIND_COLLECTIVE or KIND_P2P
    seq: int  # the collective's sequence number in its group, or the user's tag for p2p


class TransportError(DistBackendError):
    """Raised by a Transport with what it knows; the Channel re-raises it with the op's context.

    ``peer`` is the global rank at fault (or None), ``reason`` one of "timeout", "lost",
    "mismatch", "gave up" (the peer's own call failed), "error".
    """

    def __init__(self, message: str, peer: int | None = None, reason: str = "error"):
        super().__init__(message)
        self.peer = peer
        self.reason = reason


class Request(ABC):
    """A posted isend or irecv."""

    @abstractmethod
    def wait(self, deadline: float | None = None) -> None:
        """Block until done. ``deadline`` is on time.monotonic(); raise TransportError past it."""

    @abstractmethod
    def test(self) -> bool:
        """True when done (successfully or not; wait() then returns or raises at once)."""

    # For receives: who sent it (useful for ANY_SOURCE) and how many bytes arrived.
    source: int = -1
    nbytes: int = 0


class Transport(ABC):
    """Moves bytes between the ranks of one world. Thread-safe.

    A class need not inherit from Transport to be one: any class with ``isend``, ``irecv`` and
    ``close`` counts (``isinstance`` says so), as with ``collections.abc``, so a third-party
    transport written against this contract plugs in as it is.
    """

    rank: int
    size: int

    @classmethod
    def __subclasshook__(cls, other: type):
        if cls is Transport:
            names = ("isend", "irecv", "close")
            if all(any(n in vars(k) for k in other.__mro__) for n in names):
                return True
        return NotImplemented

    @abstractmethod
    def isend(self, dst: int, data: np.ndarray, key: MessageKey, signature: int = 0) -> Request:
        """Start sending ``data`` (contiguous) to global rank ``dst``.

        ``data`` must not change until the request completes. ``signature`` is a 32-bit summary of
        the collective (op, dtype, reduce op) that the receiver compares with its own.
        """

    @abstractmethod
    def irecv(self, src: int, out: np.ndarray, key: MessageKey, signature: int = 0) -> Request:
        """Post a receive into ``out`` (contiguous) from global rank ``src`` or ANY_SOURCE.

        The matching message must carry the same key, the same signature and exactly out.nbytes
        bytes; anything else completes the request with a TransportError(reason="mismatch").
        """

    @abstractmethod
    def close(self) -> None:
        """Release sockets/threads/memory. Pending requests fail with reason="lost"."""

    # Optional (a transport without them works; engines call them through ``watch_group``):
    def watch_group(self, group_id: int, ranks: Sequence[int]) -> None:
        """Group ``group_id`` has these members (global ranks). A transport that can tell a crashed
        peer from a departed one fails the group's pending and later collective requests
        (``MessageKey.kind == KIND_COLLECTIVE``) as lost once a member crashes, whichever peer
        they wait for, so no member sits out the timeout. The default does nothing."""

    def unwatch_group(self, group_id: int) -> None:
        """Group ``group_id`` was destroyed."""

    def give_up(self, group_id: int, seq: int, why: str) -> None:
        """Collective call ``seq`` of group ``group_id`` failed on this rank (``why``): its pending
        and later collective requests of the group fail at once, saying so, and the group's other
        members (``watch_group``) are told, so that their receives of the group's calls ``seq`` and
        later from this rank fail with reason "gave up", even for a message this rank sent before
        it failed (``matching.Matcher.give_up``). Point-to-point is not affected. The default does
        nothing (the shared-memory engine tells its peers through its own memory)."""


def watch_group(transport, group_id: int, ranks: Sequence[int]) -> None:
    """``transport.watch_group`` where the transport has it (a duck-typed Transport may not)."""
    method = getattr(transport, "watch_group", None)
    if method is not None:
        method(group_id, list(ranks))


def unwatch_group(transport, group_id: int) -> None:
    method = getattr(transport, "unwatch_group", None)
    if method is not None:
        method(group_id)


def give_up(transport, group_id: int, seq: int, why: str) -> None:
    """``transport.give_up`` where the transport has it."""
    method = getattr(transport, "give_up", None)
    if method is not None:
        method(group_id, seq, why)


def describe_key(key: MessageKey) -> str:
    """A key in words, for errors: "group 3 collective #7", "group 0 tag 5"."""
    group, kind, seq = key
    what = {KIND_COLLECTIVE: "collective #", KIND_P2P: "tag "}.get(kind, f"kind {kind} #")
    return f"group {group} {what}{seq}"


class Channel:
    """One collective call's point-to-point view of its group (group-relative ranks)."""

    def __init__(
        self,
        transport: Transport,
        ranks: Sequence[int],
        rank: int,
        key: MessageKey,
        op: str,
        signature: int = 0,
        deadline: float | None = None,
    ):
        self.transport = transport
        self.ranks = ranks  # group rank -> global rank
        self.rank = rank
        self.size = len(ranks)
        self.key = key
        self.op = op
        self.signature = signature
        self.deadline = deadline

    # -- the algorithm-facing interface -------------------------------------------------------
    def isend(self, dst: int, data: np.ndarray) -> "ChannelRequest":
        self._check_peer(dst)
        req = self.transport.isend(self.ranks[dst], contiguous(data), self.key, self.signature)
        return ChannelRequest(self, req, dst)

    def irecv(self, src: int, out: np.ndarray) -> "ChannelRequest":
        self._check_peer(src)
        req = self.transport.irecv(self.ranks[src], contiguous(out), self.key, self.signature)
        return ChannelRequest(self, req, src)

    def send(self, dst: int, data: np.ndarray) -> None:
        self.isend(dst, data).wait()

    def recv(self, src: int, out: np.ndarray) -> None:
        self.irecv(src, out).wait()

    def sendrecv(self, dst: int, data: np.ndarray, src: int, out: np.ndarray) -> None:
        """Send to one peer while receiving from another (or the same); both finish."""
        recv = self.irecv(src, out)
        send = self.isend(dst, data)
        recv.wait()
        send.wait()

    def subset(self, members: Sequence[int]) -> "Channel":
        """The same call's channel among ``members`` (group ranks, this one included), numbered
        0..len-1 in that order: for algorithms made of steps over parts of the group (hierarchical
        ones). Same key, signature and deadline; its errors still name group ranks."""
        return _SubChannel(self, list(members))

    # -- errors -------------------------------------------------------------------------------
    def _check_peer(self, peer: int) -> None:
        if not 0 <= peer < self.size or peer == self.rank:
            raise DistBackendError(
                f"{describe_op(self.op, self.key.seq, self.rank)}: algorithm addressed invalid peer "
                f"{peer} in a group of {self.size} (this is a bug in the algorithm)"
            )

    def translate(self, exc: TransportError, peer: int | None) -> DistBackendError:
        """Turn a transport's error into one that names the op, seq, this rank and the peer."""
        if exc.peer is not None and exc.peer in self.ranks:
            peer = list(self.ranks).index(exc.peer)
        where = describe_op(self.op, self.key.seq, self.rank, peer)
        cls = {
            "timeout": DistTimeoutError,
            "lost": PeerLostError,
            "mismatch": CollectiveMismatchError,
            "gave up": PeerFailedError,
        }.get(exc.reason, DistBackendError)
        return cls(f"{where}: {exc}")


class _SubChannel(Channel):
    """``Channel.subset``: sub-ranks on the outside, the parent's group ranks in errors."""

    def __init__(self, parent: Channel, members: list[int]):
        super().__init__(parent.transport, [parent.ranks[m] for m in members], members.index(parent.rank),
                         parent.key, parent.op, parent.signature, parent.deadline)
        self.parent = parent
        self.members = members

    def translate(self, exc: TransportError, peer: int | None) -> DistBackendError:
        return self.parent.translate(exc, None if peer is None else self.members[peer])


class ChannelRequest:
    """A Request seen through a Channel: waits to the channel's deadline, errors in its words."""

    __slots__ = ("channel", "request", "peer")

    def __init__(self, channel: Channel, request: Request, peer: int):
        self.channel = channel
        self.request = request
        self.peer = peer

    def wait(self) -> None:
        try:
            self.request.wait(self.channel.deadline)
        except TransportError as exc:
            raise self.channel.translate(exc, self.peer) from None

    def test(self) -> bool:
        return self.request.test()


def wait_all(requests: Sequence[ChannelRequest]) -> None:
    """Wait for every request in order; the first failure is raised at once.

    Not waiting for the rest after a failure is deliberate: a lost peer would otherwise make the
    caller sit out the whole timeout on requests that can no longer complete.
    """
    for req in requests:
        req.wait()


def deadline_after(seconds: float | None) -> float | None:
    return None if seconds is None else time.monotonic() + seconds
