"""Point-to-point: send, recv, isend, irecv, P2POp, batch_isend_irecv.

Messages travel under the key (group, "p2p", tag), so different tags and different groups never
match each other, and collectives (keyed by sequence number) never see them. An isend/irecv is
posted on the transport at once and its Work waits on the transport's request directly: no queue,
no thread hand-off. Only ``get_future()`` borrows the group's worker thread to complete the future.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from ..errors import describe_op
from ..process_group import signature
from ..transport.base import ANY_SOURCE, KIND_P2P, MessageKey, TransportError
from ..work import Work
from . import args


class P2PWork(Work):
    """A Work backed by one transport request."""

    def __init__(self, op: str, pg, request, buf, peer_group_rank: int, tag: int, receiving: bool = False):
        super().__init__(op, [buf.obj])
        self._receiving = receiving  # by flag, not by op name: recv_object_list receives too
        self._pg = pg
        self._request = request
        self._buf = buf
        self._peer = peer_group_rank
        self._tag = tag
        self._deadline = time.monotonic() + pg.timeout.total_seconds()

    def _complete(self) -> None:
        if self._event.is_set():
            return
        try:
            self._request.wait(self._deadline)
        except TransportError as exc:
            peer = self._peer
            if exc.peer is not None:
                peer = self._pg.group_rank(exc.peer)
            err = self._translate(exc, peer)
            self._finish(err)
            raise err from None
        source = None
        if self._receiving:
            self._buf.commit()
            source = self._request.source
        self._finish(None, source)

    def _translate(self, exc: TransportError, peer: int):
        from ..errors import CollectiveMismatchError, DistBackendError, DistTimeoutError, PeerLostError

        cls = {"timeout": DistTimeoutError, "lost": PeerLostError, "mismatch": CollectiveMismatchError}.get(
            exc.reason, DistBackendError)
        where = describe_op(self.op, None, self._pg.rank(), peer if peer >= 0 else None)
        return cls(f"{where} (tag {self._tag}): {exc}")

    def wait(self, timeout=None) -> bool:
        if not self._event.is_set():
            self._complete()
        return super().wait(timeout)

    def is_completed(self) -> bool:
        if not self._event.is_set() and self._request.test():
            try:
                self._complete()
            except Exception:  # noqa: BLE001 - recorded in the Work, raised by wait()
                pass
        return self._event.is_set()

    def get_future(self):
        future = super().get_future()
        if not self._event.is_set():
            self._pg.executor.submit_waiter(Work("future"), self._complete_quietly)
        return future

    def _complete_quietly(self) -> None:
        try:
            self._complete()
        except Exception:  # noqa: BLE001 - delivered through the future
            pass


def _post(op: str, tensor, peer: int | None, group, tag: int, group_peer: int | None, sending: bool):
    pg = args.resolve_group(group, op)
    if pg is None:
        return None
    buf = args.tensor(tensor, op, writes=not sending)
    if not isinstance(tag, int):
        raise TypeError(f"{op}: tag must be an int, got {type(tag).__name__}")
    role = "dst" if sending else "src"
    if not sending and peer is None and group_peer is None:
        peer_rank = ANY_SOURCE
    else:
        peer_rank = args.group_peer(pg, op, peer, group_peer, role)
        if peer_rank == pg.rank():
            # torch: send() says ValueError, isend/recv/irecv a RuntimeError from gloo: both.
            if sending:
                raise args.ArgumentError(
                    "Invalid destination rank: destination rank should not be the same as the rank of the current process."
                )
            raise args.ArgumentError(
                "Invalid source rank: source rank should not be the same as the rank of the current process.")
    key = MessageKey(pg.group_id, KIND_P2P, tag)
    sig = signature("send", buf.dtype.code)
    if sending:
        request = pg.transport.isend(pg.ranks[peer_rank], buf.flat, key, sig)
    else:
        src = ANY_SOURCE if peer_rank == ANY_SOURCE else pg.ranks[peer_rank]
        request = pg.transport.irecv(src, buf.flat, key, sig)
    return P2PWork(op, pg, request, buf, peer_rank, tag, receiving=not sending)


def isend(tensor, dst: int | None = None, group=None, tag: int = 0, group_dst: int | None = None):
    """Send ``tensor`` to global rank ``dst`` asynchronously; returns a Work.

    ``tensor`` must not be modified before the Work completes.
    """
    return _post("isend", tensor, dst, group, tag, group_dst, True)


def irecv(tensor, src: int | None = None, group=None, tag: int = 0, group_src: int | None = None):
    """Receive into ``tensor`` from global rank ``src`` (any rank when None) asynchronously.

    Returns a Work; after ``wait()``, ``work.source_rank()`` tells the sender.
    """
    return _post("irecv", tensor, src, group, tag, group_src, False)


def send(tensor, dst: int | None = None, group=None, tag: int = 0, group_dst: int | None = None) -> None:
    """Send ``tensor`` to global rank ``dst``, blocking until it has been handed to the peer."""
    work = _post("send", tensor, dst, group, tag, group_dst, True)
    if work is not None:
        work.wait()


def recv(tensor, src: int | None = None, group=None, tag: int = 0, group_src: int | None = None) -> int:
    """Receive into ``tensor`` from global rank ``src`` (any rank when None).

    Returns the sender's global rank (-1 when this process is not in ``group``).
    """
    work = _post("recv", tensor, src, group, tag, group_src, False)
    if work is None:
        return -1
    work.wait()
    return work.source_rank()  # transports report global ranks


class P2POp:
    """A point-to-point operation for batch_isend_irecv: ``P2POp(dist.isend, tensor, peer)``."""

    def __init__(self, op: Callable, tensor, peer: int | None = None, group=None, tag: int = 0,
                 group_peer: int | None = None):
        if op not in (isend, irecv):
            name = getattr(op, "__name__", repr(op))
            if name in ("isend", "irecv"):  # torch.distributed.isend/irecv: use ours
                op = isend if name == "isend" else irecv
            else:
                raise ValueError(
                    "Invalid ``op``. Expected ``op`` to be of type ``torch.distributed.isend`` or "
                    "``torch.distributed.irecv``."
                )
        self.op = op
        self.tensor = tensor
        self.peer = peer
        self.group = group
        self.tag = tag
        self.group_peer = group_peer

    def __repr__(self) -> str:
        return f"P2POp({self.op.__name__}, peer={self.peer}, tag={self.tag})"


def batch_isend_irecv(p2p_op_list: list[P2POp]) -> list[Any]:
    """Post every send and receive in ``p2p_op_list`` at once; returns their Works.

    All are posted before any is waited on, so a ring of isend/irecv pairs cannot deadlock.
    """
    if not isinstance(p2p_op_list, list) or not all(isinstance(p, P2POp) for p in p2p_op_list):
        raise ValueError("Invalid ``p2p_op_list``. Each op is expected to to be of type ``torch.distributed.P2POp``.")
    works = []
    for p in p2p_op_list:
        if p.op is isend:
            works.append(isend(p.tensor, p.peer, p.group, p.tag, p.group_peer))
        else:
            works.append(irecv(p.tensor, p.peer, p.group, p.tag, p.group_peer))
    return [w for w in works if w is not None]
