"""Naive reference versions of every collective: the oracle the tests compare the real ones with.

Same signatures as the real algorithms. Everything goes through rank 0: every rank sends its input
to rank 0, rank 0 computes the result in rank order (for reductions: ((x0 ⊕ x1) ⊕ x2) ⊕ ...),
and sends each rank its part of the result. Obviously correct, and slow: 2 rounds, with rank 0
moving p · n bytes. Never selected unless asked for by name ("reference").
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..transport.base import Channel
from ._blocks import Reducer, offsets


def _collect(ch: Channel, data: np.ndarray) -> list[np.ndarray] | None:
    """Rank 0 gets every rank's ``data`` (same size on every rank), in rank order; others None."""
    if ch.rank != 0:
        ch.send(0, data)
        return None
    parts = [data]
    for r in range(1, ch.size):
        part = np.empty_like(data)
        ch.recv(r, part)
        parts.append(part)
    return parts


def _reduce_at_zero(ch: Channel, buf: np.ndarray, reduce: Reducer) -> np.ndarray | None:
    parts = _collect(ch, buf)
    if parts is None:
        return None
    acc = parts[0].copy()
    for part in parts[1:]:
        reduce(acc, part)
    return acc


def _from_zero_to_all(ch: Channel, result: np.ndarray | None, out: np.ndarray) -> None:
    """Rank 0's ``result`` into ``out`` on every rank."""
    if ch.rank == 0:
        out[...] = result
        for r in range(1, ch.size):
            ch.send(r, out)
    else:
        ch.recv(0, out)


def _from_zero_to_root(ch: Channel, result: np.ndarray | None, out: np.ndarray | None, root: int) -> None:
    """Rank 0's ``result`` into ``out`` on ``root`` (other ranks' ``out`` untouched)."""
    if ch.rank == 0:
        if root == 0:
            out[...] = result
        else:
            ch.send(root, result)
    elif ch.rank == root:
        ch.recv(0, out)


def allreduce(ch: Channel, buf: np.ndarray, reduce: Reducer) -> None:
    _from_zero_to_all(ch, _reduce_at_zero(ch, buf, reduce), buf)


def broadcast(ch: Channel, buf: np.ndarray, root: int) -> None:
    if root != 0:
        if ch.rank == root:
            ch.send(0, buf)
        elif ch.rank == 0:
            ch.recv(root, buf)
    if ch.rank == 0:
        for r in range(1, ch.size):
            if r != root:
                ch.send(r, buf)
    elif ch.rank != root:
        ch.recv(0, buf)


def reduce(ch: Channel, buf: np.ndarray, root: int, reduce: Reducer) -> None:
    _from_zero_to_root(ch, _reduce_at_zero(ch, buf, reduce), buf, root)


def allgather(ch: Channel, out: np.ndarray, count: int) -> None:
    r = ch.rank
    parts = _collect(ch, out[r * count : (r + 1) * count].copy())
    _from_zero_to_all(ch, None if parts is None else np.concatenate(parts), out)


def gather(ch: Channel, send: np.ndarray, out: np.ndarray | None, root: int) -> None:
    parts = _collect(ch, send)
    _from_zero_to_root(ch, None if parts is None else np.concatenate(parts), out, root)


def scatter(ch: Channel, chunks: np.ndarray | None, out: np.ndarray, root: int) -> None:
    count = out.size
    if ch.rank == 0:
        whole = chunks if root == 0 else np.empty(count * ch.size, dtype=out.dtype)
        if root != 0:
            ch.recv(root, whole)
        for r in range(1, ch.size):
            ch.send(r, whole[r * count : (r + 1) * count])
        out[...] = whole[:count]
    else:
        if ch.rank == root:
            ch.send(0, chunks)
        ch.recv(0, out)


def reduce_scatter(ch: Channel, buf: np.ndarray, out: np.ndarray, counts: Sequence[int], reduce: Reducer) -> None:
    bounds = offsets(counts)
    acc = _reduce_at_zero(ch, buf, reduce)
    if ch.rank == 0:
        for r in range(1, ch.size):
            ch.send(r, acc[bounds[r] : bounds[r + 1]])
        out[...] = acc[: bounds[1]]
    else:
        ch.recv(0, out)


def alltoallv(
    ch: Channel, send: np.ndarray, send_counts: Sequence[int], recv: np.ndarray, recv_counts: Sequence[int]
) -> None:
    p = ch.size
    counts = _collect(ch, np.asarray(send_counts, dtype=np.int64))  # who sends how much to whom
    if ch.rank != 0:
        ch.send(0, send)
        ch.recv(0, recv)
        return
    sends = [send]
    for r in range(1, p):
        data = np.empty(int(counts[r].sum()), dtype=send.dtype)
        ch.recv(r, data)
        sends.append(data)
    bounds = [offsets(c) for c in counts]
    for dst in range(p):
        result = np.concatenate([sends[src][bounds[src][dst] : bounds[src][dst + 1]] for src in range(p)])
        if dst == 0:
            recv[...] = result
        else:
            ch.send(dst, result)


def barrier(ch: Channel) -> None:
    token = np.empty(0, np.uint8)
    _collect(ch, token)
    if ch.rank == 0:
        for r in range(1, ch.size):
            ch.send(r, token)
    else:
        ch.recv(0, np.empty(0, np.uint8))
