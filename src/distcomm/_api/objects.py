"""Object collectives: picklable Python objects instead of tensors (values returned, not in place).

Objects are pickled with protocol 5 into bytes and moved as uint8 buffers through the group's own
buffer collectives (ProcessGroup methods, so on the group's engine: shared memory on one host), as
torch does: first the sizes, then the payloads, padded to the largest where the collective needs
equal blocks.

Unpickling runs code chosen by the sender: use these only with peers you trust, as with torch.
"""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np

from ..buffers import as_buffer
from ..errors import DistBackendError
from . import args
from .p2p import _post

# p2p tag of send/recv_object_list: out of the range user tags are in practice
OBJECT_TAG = -(2**62)

_PROTOCOL = 5


def _dumps(obj: Any) -> np.ndarray:
    return np.frombuffer(pickle.dumps(obj, protocol=_PROTOCOL), dtype=np.uint8)


#: the size a rank sends in place of its payload's when it could not pickle its object: every rank
#: sees it in the sizes' exchange, so all skip the payloads' and raise, and the group stays in step
#: (torch's gloo leaves the other ranks waiting for payloads that never come)
UNPICKLABLE = -1


def _dumps_all(objs) -> tuple[list[np.ndarray] | None, BaseException | None]:
    """The payloads of ``objs``, or (None, the error) when one of them cannot be pickled."""
    try:
        return [_dumps(o) for o in objs], None
    except Exception as exc:  # noqa: BLE001 - pickling raises many kinds; re-raised after the exchange
        return None, exc


def _refuse_unpicklable(pg, op: str, sizes: np.ndarray, by, error: BaseException | None) -> None:
    """After the sizes' exchange: if a rank sent UNPICKLABLE (``by(i)``: the group rank that sent
    size i), raise (this rank's own pickling error, if it is the one) before any payload moves."""
    bad = sorted({by(i) for i in np.flatnonzero(sizes == UNPICKLABLE).tolist()})
    if not bad:
        return
    if error is not None:
        raise error
    names = ", ".join(str(pg.ranks[r]) for r in bad)
    raise DistBackendError(
        f"{op} on rank {pg.global_rank}: rank {names} could not pickle its object (its own error says "
        "why), so nothing was exchanged; the group is still usable")


def _loads(data: np.ndarray) -> Any:
    return pickle.loads(data.tobytes())


def broadcast_object_list(object_list: list, src: int | None = None, group=None, device=None,
                          group_src: int | None = None) -> None:
    """Broadcast the picklable objects in ``object_list`` from ``src``; every other rank's list
    (of the same length) is filled in place."""
    pg = args.resolve_group(group, "broadcast_object_list")
    if pg is None:
        return
    root = args.group_peer(pg, "broadcast_object_list", src, group_src, "src")
    sizes = np.zeros(len(object_list), dtype=np.int64)
    error = None
    if pg.rank() == root:
        payloads, error = _dumps_all(object_list)
        sizes[:] = UNPICKLABLE if error is not None else [p.size for p in payloads]
    pg.broadcast(as_buffer(sizes), root)
    _refuse_unpicklable(pg, "broadcast_object_list", sizes, lambda i: root, error)
    if pg.rank() == root:
        data = np.concatenate(payloads) if payloads else np.empty(0, np.uint8)
    else:
        data = np.empty(int(sizes.sum()), dtype=np.uint8)
    pg.broadcast(as_buffer(data), root)
    if pg.rank() != root:
        offset = 0
        for i, size in enumerate(sizes.tolist()):
            object_list[i] = _loads(data[offset:offset + size])
            offset += size


def _all_sizes(pg, payload: np.ndarray, error: BaseException | None = None) -> np.ndarray:
    """Every rank's payload size, in rank order (UNPICKLABLE from a rank whose pickling failed)."""
    sizes = np.zeros(pg.size(), dtype=np.int64)
    mine = UNPICKLABLE if error is not None else payload.size
    pg.allgather_into_tensor(as_buffer(sizes), as_buffer(np.array([mine], dtype=np.int64)))
    return sizes


def _padded(payload: np.ndarray, width: int) -> np.ndarray:
    block = np.zeros(width, dtype=np.uint8)
    block[:payload.size] = payload
    return block


def all_gather_object(object_list: list, obj: Any, group=None) -> None:
    """Gather the picklable ``obj`` from every rank into ``object_list`` (length world_size)."""
    pg = args.resolve_group(group, "all_gather_object")
    if pg is None:
        return
    if len(object_list) != pg.size():
        raise ValueError(
            f"all_gather_object: object_list must have one entry per rank: expected length {pg.size()}, got {len(object_list)}"
        )

    payloads, error = _dumps_all([obj])
    payload = np.empty(0, np.uint8) if error is not None else payloads[0]
    sizes = _all_sizes(pg, payload, error)
    _refuse_unpicklable(pg, "all_gather_object", sizes, int, error)
    width = int(sizes.max())
    flat = np.empty(width * pg.size(), dtype=np.uint8)
    pg.allgather_into_tensor(as_buffer(flat), as_buffer(_padded(payload, width)))
    for i, size in enumerate(sizes.tolist()):
        object_list[i] = _loads(flat[i * width:i * width + size])


def gather_object(obj: Any, object_gather_list: list | None = None, dst: int | None = None, group=None,
                  group_dst: int | None = None) -> None:
    """Gather the picklable ``obj`` from every rank into ``object_gather_list`` on ``dst``."""
    pg = args.resolve_group(group, "gather_object")
    if pg is None:
        return
    root = args.group_peer(pg, "gather_object", dst, group_dst, "dst")
    if pg.rank() == root:
        if object_gather_list is None or len(object_gather_list) != pg.size():
            raise ValueError(
                f"gather_object: on the destination rank object_gather_list must be a list of length {pg.size()}"
            )
    elif object_gather_list:
        raise ValueError("Argument ``object_gather_list`` must NOT be specified on non-destination ranks.")

    payloads, error = _dumps_all([obj])
    payload = np.empty(0, np.uint8) if error is not None else payloads[0]
    sizes = _all_sizes(pg, payload, error)
    _refuse_unpicklable(pg, "gather_object", sizes, int, error)
    width = int(sizes.max())
    mine = as_buffer(_padded(payload, width))
    if pg.rank() != root:
        pg.gather(None, mine, root)
        return
    blocks = [np.empty(width, dtype=np.uint8) for _ in range(pg.size())]
    pg.gather([as_buffer(b) for b in blocks], mine, root)
    for i, (block, size) in enumerate(zip(blocks, sizes.tolist())):
        object_gather_list[i] = _loads(block[:size])


def scatter_object_list(scatter_object_output_list: list, scatter_object_input_list: list | None = None,
                        src: int | None = None, group=None, group_src: int | None = None) -> None:
    """Scatter the picklable objects of ``scatter_object_input_list`` (on ``src``): rank i gets
    element i in ``scatter_object_output_list[0]``."""
    pg = args.resolve_group(group, "scatter_object_list")
    if pg is None:
        return
    root = args.group_peer(pg, "scatter_object_list", src, group_src, "src")
    if not isinstance(scatter_object_output_list, list) or len(scatter_object_output_list) < 1:
        raise ValueError("Expected argument scatter_object_output_list to be a list of size at least 1.")
    if pg.rank() == root and (scatter_object_input_list is None or len(scatter_object_input_list) != pg.size()):
        raise ValueError(f"scatter_object_list: the source rank must pass {pg.size()} objects")

    # The width of the blocks first, then one block per rank: its payload's length (8 bytes), then
    # the payload, padded.
    width = np.zeros(1, dtype=np.int64)
    error = None
    if pg.rank() == root:
        payloads, error = _dumps_all(scatter_object_input_list)
        width[0] = UNPICKLABLE if error is not None else 8 + max(p.size for p in payloads)
    pg.broadcast(as_buffer(width), root)
    _refuse_unpicklable(pg, "scatter_object_list", width, lambda i: root, error)
    mine = np.empty(int(width[0]), dtype=np.uint8)
    blocks = None
    if pg.rank() == root:
        blocks = []
        for p in payloads:
            block = np.zeros(int(width[0]), dtype=np.uint8)
            block[:8] = np.frombuffer(np.int64(p.size).tobytes(), np.uint8)
            block[8:8 + p.size] = p
            blocks.append(as_buffer(block))
    pg.scatter(as_buffer(mine), blocks, root)
    size = int(mine[:8].view(np.int64)[0])
    scatter_object_output_list[0] = _loads(mine[8:8 + size])


def send_object_list(object_list: list, dst: int | None = None, group=None, device=None,
                     group_dst: int | None = None, use_batch: bool = False) -> None:
    """Send the picklable objects in ``object_list`` to global rank ``dst`` (blocking).

    ``use_batch`` (torch: send through batch_isend_irecv) changes nothing here: distcomm's sends
    are already posted without blocking each other."""
    payloads = [_dumps(o) for o in object_list]
    sizes = np.array([p.size for p in payloads], dtype=np.int64)
    data = np.concatenate(payloads) if payloads else np.empty(0, np.uint8)
    works = [_post("send_object_list", sizes, dst, group, OBJECT_TAG, group_dst, True),
             _post("send_object_list", data, dst, group, OBJECT_TAG, group_dst, True)]
    for w in works:
        if w is not None:
            w.wait()


def recv_object_list(object_list: list, src: int | None = None, group=None, device=None,
                     group_src: int | None = None, use_batch: bool = False) -> int:
    """Receive objects into ``object_list`` (same length as the sender's) from ``src`` (any when
    None); returns the sender's global rank. ``use_batch``: as in send_object_list."""
    sizes = np.zeros(len(object_list), dtype=np.int64)
    work = _post("recv_object_list", sizes, src, group, OBJECT_TAG, group_src, False)
    if work is None:
        return -1
    work.wait()
    sender = work.source_rank()
    data = np.empty(int(sizes.sum()), dtype=np.uint8)
    # The payload must come from the same sender as the sizes, even when src was "any".
    _post("recv_object_list", data, sender, group, OBJECT_TAG, None, False).wait()
    offset = 0
    for i, size in enumerate(sizes.tolist()):
        object_list[i] = _loads(data[offset:offset + size])
        offset += size
    return sender
