"""Point-to-point: send, recv, isend, irecv, P2POp, batch_isend_irecv.

Messages travel under the key (group, "p2p", tag), so different tags and different groups never
match each other, and collectives (keyed by sequence number) never see them. An isend/irecv is
posted on the transport at once by ``ProcessGroup.send``/``recv``, whose Work (``P2PWork``) waits
on the transport's request directly: no queue, no thread hand-off.
"""

from __future__ import annotations

from typing import Any, Callable

from ..transport.base import ANY_SOURCE
from . import args


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
    if sending:
        return pg.send(buf, peer_rank, tag, op)
    return pg.recv(buf, peer_rank, tag, op)


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
