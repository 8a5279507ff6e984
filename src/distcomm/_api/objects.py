"""Object collectives: picklable Python objects instead of tensors (values returned, not in place).

Objects are pickled with protocol 5 into bytes and moved as uint8 buffers. Each call is one
collective (one sequence number) made of two phases on the same channel — the sizes, then the
payload — which is safe because messages between a pair of ranks match in order. Where a rank
learns the sizes it receives (gather, scatter), payloads then move point-to-point unpadded.

Unpickling runs code chosen by the sender: use these only with peers you trust, as with torch.
"""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np

from ..backends import collectives as engine
from ..process_group import signature
from . import args
from ..transport.base import wait_all
from .p2p import _post

# p2p tag of send/recv_object_list: out of the range user tags are in practice
OBJECT_TAG = -(2**62)

_PROTOCOL = 5


def _dumps(obj: Any) -> np.ndarray:
    return np.frombuffer(pickle.dumps(obj, protocol=_PROTOCOL), dtype=np.uint8)


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
    n = len(object_list)

    def body(ch):
        sizes = np.zeros(n, dtype=np.int64)
        if ch.rank == root:
            payloads = [_dumps(o) for o in object_list]
            sizes[:] = [p.size for p in payloads]
            data = np.concatenate(payloads) if payloads else np.empty(0, np.uint8)
        engine.broadcast(ch, sizes, root)
        if ch.rank != root:
            data = np.empty(int(sizes.sum()), dtype=np.uint8)
        engine.broadcast(ch, data, root)
        if ch.rank != root:
            offset = 0
            for i, size in enumerate(sizes.tolist()):
                object_list[i] = _loads(data[offset:offset + size])
                offset += size

    pg.collective("broadcast_object_list", body, False, signature("broadcast_object_list", n & 0xFF))


def _all_gather_bytes(ch, payload: np.ndarray) -> list[np.ndarray]:
    """Every rank's payload, padded to the largest and gathered in one all_gather."""
    sizes = np.zeros(ch.size, dtype=np.int64)
    sizes[ch.rank] = payload.size
    engine.all_gather(ch, sizes, 1)
    width = int(sizes.max()) if ch.size else 0
    flat = np.zeros(width * ch.size, dtype=np.uint8)
    flat[ch.rank * width:ch.rank * width + payload.size] = payload
    engine.all_gather(ch, flat, width)
    return [flat[i * width:i * width + int(sizes[i])] for i in range(ch.size)]


def all_gather_object(object_list: list, obj: Any, group=None) -> None:
    """Gather the picklable ``obj`` from every rank into ``object_list`` (length world_size)."""
    pg = args.resolve_group(group, "all_gather_object")
    if pg is None:
        return
    if len(object_list) != pg.size():
        raise ValueError(
            f"all_gather_object: object_list must have one entry per rank: expected length {pg.size()}, got {len(object_list)}"
        )

    def body(ch):
        for i, data in enumerate(_all_gather_bytes(ch, _dumps(obj))):
            object_list[i] = _loads(data)

    pg.collective("all_gather_object", body, False)


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

    def body(ch):
        payload = _dumps(obj)
        sizes = np.zeros(ch.size, dtype=np.int64) if ch.rank == root else None
        engine.gather(ch, np.array([payload.size], dtype=np.int64), sizes, root)
        if ch.rank != root:
            ch.send(root, payload)
            return
        datas = [payload if i == root else np.empty(int(sizes[i]), np.uint8) for i in range(ch.size)]
        requests = [ch.irecv(i, datas[i]) for i in range(ch.size) if i != root]
        wait_all(requests)
        for i, data in enumerate(datas):
            object_gather_list[i] = _loads(data)

    pg.collective("gather_object", body, False)


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

    def body(ch):
        my_size = np.zeros(1, dtype=np.int64)
        if ch.rank != root:
            engine.scatter(ch, None, my_size, root)
            data = np.empty(int(my_size[0]), np.uint8)
            ch.recv(root, data)
        else:
            payloads = [_dumps(o) for o in scatter_object_input_list]
            engine.scatter(ch, np.array([p.size for p in payloads], dtype=np.int64), my_size, root)
            wait_all([ch.isend(i, p) for i, p in enumerate(payloads) if i != root])
            data = payloads[root]
        scatter_object_output_list[0] = _loads(data)

    pg.collective("scatter_object_list", body, False)


def send_object_list(object_list: list, dst: int | None = None, group=None, device=None,
                     group_dst: int | None = None) -> None:
    """Send the picklable objects in ``object_list`` to global rank ``dst`` (blocking)."""
    payloads = [_dumps(o) for o in object_list]
    sizes = np.array([p.size for p in payloads], dtype=np.int64)
    data = np.concatenate(payloads) if payloads else np.empty(0, np.uint8)
    works = [_post("send_object_list", sizes, dst, group, OBJECT_TAG, group_dst, True),
             _post("send_object_list", data, dst, group, OBJECT_TAG, group_dst, True)]
    for w in works:
        if w is not None:
            w.wait()


def recv_object_list(object_list: list, src: int | None = None, group=None, device=None,
                     group_src: int | None = None) -> int:
    """Receive objects into ``object_list`` (same length as the sender's) from ``src`` (any when
    None); returns the sender's global rank."""
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
