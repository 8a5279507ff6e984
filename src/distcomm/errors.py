"""One error hierarchy, shaped like torch.distributed's DistError family.

Every class is a RuntimeError, so code written for torch (``except RuntimeError``) keeps working, and
the four torch names (DistError, DistBackendError, DistNetworkError, DistStoreError) exist with the
same parentage. The finer classes below them let callers and tests tell a timeout from a dead peer
from a collective that ranks disagree on.

Messages follow one rule: say the operation, its sequence number, this rank and the peer at fault,
and what to do next when we know it. ``describe_op`` builds that prefix so every raiser says it
the same way.
"""

from __future__ import annotations


class DistError(RuntimeError):
    """Base of every error raised by distcomm (torch.distributed.DistError)."""


class DistBackendError(DistError):
    """A collective or point-to-point operation failed inside a backend."""


class DistNetworkError(DistError):
    """A connection could not be made, or was lost."""


class DistStoreError(DistError):
    """A key-value store operation failed or timed out."""


class StoreProtocolError(DistNetworkError):
    """The peer at a TCPStore address speaks neither distcomm's nor torch's TCPStore protocol (an HTTP
    server, another program on that port, or one that accepted and said nothing)."""


class DistStoreTimeoutError(DistStoreError):
    """A store get/wait did not see its keys before the timeout."""


class DistStoreAuthError(DistStoreError):
    """TCPStore authentication failed or is misconfigured (a key missing on one side, different keys,
    or a key file that others can read). Retrying does not help; the message says what to change.
    distcomm's own: torch's TCPStore has no authentication."""


class QueueEmptyError(DistStoreError):
    """``Store.queue_pop(key, block=False)`` found the queue empty (torch.distributed.QueueEmptyError)."""


class DistTimeoutError(DistBackendError):
    """A collective or point-to-point operation did not finish before the group's timeout."""


class CollectiveMismatchError(DistBackendError):
    """Ranks called different collectives, or the same one with different sizes, dtypes or ops."""


class PeerFailedError(DistBackendError):
    """A peer gave up on the group after an error of its own (a timeout, a lost rank) while this rank
    needed it: the operation cannot complete here either. The message names the peer and its call."""


class PeerLostError(DistNetworkError):
    """A peer process died or closed its connection while an operation needed it."""


def describe_op(op: str, seq: int | None = None, rank: int | None = None, peer: int | None = None) -> str:
    """The common prefix of operation errors: ``all_reduce #12 on rank 1 (peer rank 3)``."""
    text = op
    if seq is not None:
        text += f" #{seq}"
    if rank is not None:
        text += f" on rank {rank}"
    if peer is not None:
        text += f" (peer rank {peer})"
    return text


__all__ = [
    "DistError",
    "DistBackendError",
    "DistNetworkError",
    "DistStoreError",
    "DistStoreTimeoutError",
    "QueueEmptyError",
    "DistTimeoutError",
    "CollectiveMismatchError",
    "PeerLostError",
    "describe_op",
]
