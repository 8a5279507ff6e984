"""The collectives, with torch.distributed's names, signatures and docstrings.

Each function: resolve the group (non-members return None without communicating), turn tensors
into Buffers and check them (before any communication), then hand one body to the group, which
runs it in issue order, inline or on its worker thread when ``async_op=True``.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Sequence

import numpy as np

from .. import reduction
from ..errors import DistBackendError, DistTimeoutError, PeerLostError
from ..process_group import signature
from ..types import RedOpType, normalize_op
from . import args


def _op_code(op) -> int:
    return int(getattr(op, "op", op))


def _check_op(op, dtype, name: str):
    op = normalize_op(op)
    try:
        reduction.check_supported(op, dtype, name)
    except ValueError as exc:  # complex MIN/MAX/...: torch's all_reduce says ValueError, the rest RuntimeError
        raise args.ArgumentError(str(exc)) from None
    return op


def broadcast(tensor, src: int | None = None, group=None, async_op: bool = False, group_src: int | None = None):
    """Broadcast ``tensor`` from rank ``src`` to the whole group, in place.

    ``tensor`` must have the same number of elements on every rank: it is the data to send on
    ``src`` and the buffer to receive into elsewhere. ``src`` is a global rank (``group_src`` the
    group rank). Returns a Work when ``async_op``, else None.
    """
    pg = args.resolve_group(group, "broadcast")
    if pg is None:
        return None
    root = args.group_peer(pg, "broadcast", src, group_src, "src")
    buf = args.tensor(tensor, "broadcast", writes=pg.rank() != root)

    def body(ch):
        pg.ops.broadcast(ch, buf.flat, root)
        buf.commit()

    return pg.collective("broadcast", body, async_op, signature("broadcast", buf.dtype.code), [tensor])


def all_reduce(tensor, op=RedOpType.SUM, group=None, async_op: bool = False):
    """Reduce ``tensor`` across all ranks so that every rank ends with the result, in place.

    ``op`` is a ReduceOp (SUM by default). Returns a Work when ``async_op``, else None.
    """
    pg = args.resolve_group(group, "all_reduce")
    if pg is None:
        return None
    if not async_op and pg.small_all_reduce(tensor, op):
        return None  # the engine's latency path did the whole call (backends/shm_latency.py)
    buf = args.tensor(tensor, "all_reduce", writes=True)
    op = _check_op(op, buf.dtype, "all_reduce")

    def body(ch):
        pg.ops.all_reduce(ch, buf.flat, buf.dtype, op)
        buf.commit()

    sig = signature("all_reduce", buf.dtype.code, _op_code(op))
    return pg.collective("all_reduce", body, async_op, sig, [tensor])


def reduce(tensor, dst: int | None = None, op=RedOpType.SUM, group=None, async_op: bool = False,
           group_dst: int | None = None):
    """Reduce ``tensor`` across all ranks; only rank ``dst`` receives the result (in place).

    Other ranks' tensors are left unchanged.
    """
    pg = args.resolve_group(group, "reduce")
    if pg is None:
        return None
    root = args.group_peer(pg, "reduce", dst, group_dst, "dst")
    buf = args.tensor(tensor, "reduce", writes=pg.rank() == root)
    op = _check_op(op, buf.dtype, "reduce")

    def body(ch):
        pg.ops.reduce(ch, buf.flat, buf.dtype, op, root)
        if ch.rank == root:
            buf.commit()

    sig = signature("reduce", buf.dtype.code, _op_code(op))
    return pg.collective("reduce", body, async_op, sig, [tensor])


def _per_rank_views(output, size: int) -> list:
    """``output`` split along its first dimension into ``size`` views (torch's future value)."""
    if isinstance(output, np.ndarray):
        return np.array_split(output, size) if output.ndim else [output]
    return list(output.chunk(size)) if output.dim() else [output]


def _gather_into(pg, ch, flat_out: np.ndarray, send: np.ndarray) -> None:
    count = send.size
    block = flat_out[ch.rank * count:(ch.rank + 1) * count]
    if not np.shares_memory(block, send):
        block[...] = send
    pg.ops.all_gather(ch, flat_out, count)


def all_gather(tensor_list, tensor, group=None, async_op: bool = False):
    """Gather ``tensor`` from every rank into ``tensor_list`` (one tensor per rank, in rank order)."""
    pg = args.resolve_group(group, "all_gather")
    if pg is None:
        return None
    inp = args.tensor(tensor, "all_gather")
    outs = args.tensor_list(tensor_list, "all_gather", "tensor_list", pg.size(), like=inp, writes=True)
    count = inp.count

    def body(ch):
        flat = np.empty(count * ch.size, dtype=inp.flat.dtype)
        _gather_into(pg, ch, flat, inp.flat)
        for i, out in enumerate(outs):
            out.flat[...] = flat[i * count:(i + 1) * count]
            out.commit()

    return pg.collective("all_gather", body, async_op, signature("all_gather", inp.dtype.code),
                         list(tensor_list))  # torch's future holds the output tensors, flat


def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op: bool = False):
    """Gather ``input_tensor`` from every rank into one ``output_tensor`` of world_size times its
    size (concatenated along the first dimension, or stacked), in rank order."""
    pg = args.resolve_group(group, "all_gather_into_tensor")
    if pg is None:
        return None
    out = args.tensor(output_tensor, "all_gather_into_tensor", "output_tensor", writes=True)
    inp = args.tensor(input_tensor, "all_gather_into_tensor", "input_tensor")
    args.same_dtype([out, inp], "all_gather_into_tensor")
    if out.count != inp.count * pg.size():
        raise args.ArgumentError(
            f"all_gather_into_tensor: output tensor has {out.count} elements, expected "
            f"{inp.count * pg.size()} (input size {inp.count} x world size {pg.size()})"
        )

    def body(ch):
        _gather_into(pg, ch, out.flat, inp.flat)
        out.commit()

    sig = signature("all_gather_into_tensor", inp.dtype.code)
    # torch's future holds the output split into one view per rank
    return pg.collective("all_gather_into_tensor", body, async_op, sig, _per_rank_views(output_tensor, pg.size()))


def gather(tensor, gather_list=None, dst: int | None = None, group=None, async_op: bool = False,
           group_dst: int | None = None):
    """Gather ``tensor`` from every rank into ``gather_list`` on rank ``dst``.

    ``gather_list`` (one tensor per rank) is given on ``dst`` only; other ranks pass None.
    """
    pg = args.resolve_group(group, "gather")
    if pg is None:
        return None
    root = args.group_peer(pg, "gather", dst, group_dst, "dst")
    inp = args.tensor(tensor, "gather")
    if pg.rank() == root:
        if not gather_list:
            raise ValueError("Argument ``gather_list`` must be specified on destination rank.")
        outs = args.tensor_list(gather_list, "gather", "gather_list", pg.size(), like=inp, writes=True)
    else:
        if gather_list:
            raise ValueError("Argument ``gather_list`` must NOT be specified on non-destination ranks.")
        outs = None
    count = inp.count

    def body(ch):
        flat = np.empty(count * ch.size, dtype=inp.flat.dtype) if outs is not None else None
        pg.ops.gather(ch, inp.flat, flat, root)
        if outs is not None:
            for i, out in enumerate(outs):
                out.flat[...] = flat[i * count:(i + 1) * count]
                out.commit()

    return pg.collective("gather", body, async_op, signature("gather", inp.dtype.code),
                         list(gather_list or []))  # as torch: the gathered tensors on dst, [] elsewhere


def scatter(tensor, scatter_list=None, src: int | None = None, group=None, async_op: bool = False,
            group_src: int | None = None):
    """Scatter ``scatter_list`` (given on ``src`` only, one tensor per rank) so that rank i's
    ``tensor`` receives ``scatter_list[i]``."""
    pg = args.resolve_group(group, "scatter")
    if pg is None:
        return None
    root = args.group_peer(pg, "scatter", src, group_src, "src")
    out = args.tensor(tensor, "scatter", writes=True)
    if pg.rank() == root:
        if not scatter_list:
            raise ValueError("Argument ``scatter_list`` must be specified on source rank.")
        ins = args.tensor_list(scatter_list, "scatter", "scatter_list", pg.size(), like=out)
    else:
        if scatter_list:
            raise ValueError("Argument ``scatter_list`` must NOT be specified on non-source ranks.")
        ins = None

    def body(ch):
        chunks = np.concatenate([b.flat for b in ins]) if ins is not None else None
        pg.ops.scatter(ch, chunks, out.flat, root)
        out.commit()

    return pg.collective("scatter", body, async_op, signature("scatter", out.dtype.code), [tensor])


def reduce_scatter(output, input_list, op=RedOpType.SUM, group=None, async_op: bool = False):
    """Reduce ``input_list[i]`` across all ranks into rank i's ``output``."""
    pg = args.resolve_group(group, "reduce_scatter")
    if pg is None:
        return None
    out = args.tensor(output, "reduce_scatter", "output", writes=True)
    ins = args.tensor_list(input_list, "reduce_scatter", "input_list", pg.size())
    args.same_dtype(ins + [out], "reduce_scatter")
    if ins[pg.rank()].count != out.count:
        raise args.ArgumentError(
            f"reduce_scatter: input_list[{pg.rank()}] has {ins[pg.rank()].count} elements but output has {out.count}"
        )
    op = _check_op(op, out.dtype, "reduce_scatter")
    counts = [b.count for b in ins]

    def body(ch):
        scratch = np.concatenate([b.flat for b in ins]) if ins else np.empty(0, out.flat.dtype)
        pg.ops.reduce_scatter(ch, scratch, out.flat, counts, out.dtype, op)
        out.commit()

    sig = signature("reduce_scatter", out.dtype.code, _op_code(op))
    return pg.collective("reduce_scatter", body, async_op, sig, [output])


def reduce_scatter_tensor(output, input, op=RedOpType.SUM, group=None, async_op: bool = False):  # noqa: A002
    """Reduce ``input`` (world_size blocks, concatenated or stacked) across ranks; rank i's
    ``output`` receives the reduction of block i."""
    pg = args.resolve_group(group, "reduce_scatter_tensor")
    if pg is None:
        return None
    out = args.tensor(output, "reduce_scatter_tensor", "output", writes=True)
    inp = args.tensor(input, "reduce_scatter_tensor", "input")
    args.same_dtype([out, inp], "reduce_scatter_tensor")
    if inp.count != out.count * pg.size():
        raise args.ArgumentError(
            f"reduce_scatter_tensor: input tensor has {inp.count} elements, expected "
            f"{out.count * pg.size()} (output size {out.count} x world size {pg.size()})"
        )
    op = _check_op(op, out.dtype, "reduce_scatter_tensor")
    counts = [out.count] * pg.size()

    def body(ch):
        pg.ops.reduce_scatter(ch, inp.flat.copy(), out.flat, counts, out.dtype, op)
        out.commit()

    sig = signature("reduce_scatter_tensor", out.dtype.code, _op_code(op))
    return pg.collective("reduce_scatter_tensor", body, async_op, sig, [output])


def all_to_all(output_tensor_list, input_tensor_list, group=None, async_op: bool = False):
    """Send ``input_tensor_list[i]`` to rank i and receive rank i's tensor into
    ``output_tensor_list[i]``; sizes may differ per pair."""
    pg = args.resolve_group(group, "all_to_all")
    if pg is None:
        return None
    outs = args.tensor_list(output_tensor_list, "all_to_all", "output_tensor_list", pg.size(), writes=True)
    ins = args.tensor_list(input_tensor_list, "all_to_all", "input_tensor_list", pg.size())
    args.same_dtype(outs + ins, "all_to_all")
    send_counts = [b.count for b in ins]
    recv_counts = [b.count for b in outs]

    def body(ch):
        send = np.concatenate([b.flat for b in ins])
        recv = np.empty(sum(recv_counts), dtype=send.dtype)
        pg.ops.all_to_all(ch, send, send_counts, recv, recv_counts)
        offset = 0
        for b in outs:
            b.flat[...] = recv[offset:offset + b.count]
            offset += b.count
            b.commit()

    sig = signature("all_to_all", outs[0].dtype.code)
    return pg.collective("all_to_all", body, async_op, sig, list(output_tensor_list))  # flat, as torch


def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None,  # noqa: A002
                      async_op: bool = False):
    """Split ``input`` along its first dimension (equally, or by ``input_split_sizes``), send part
    i to rank i, and concatenate what each rank sends into ``output`` (split by
    ``output_split_sizes``)."""
    pg = args.resolve_group(group, "all_to_all_single")
    if pg is None:
        return None
    out = args.tensor(output, "all_to_all_single", "output", writes=True)
    inp = args.tensor(input, "all_to_all_single", "input")
    args.same_dtype([out, inp], "all_to_all_single")
    size = pg.size()
    in_dim0 = inp.shape[0] if inp.shape else 1
    out_dim0 = out.shape[0] if out.shape else 1
    in_row = inp.count // in_dim0 if in_dim0 else 0
    out_row = out.count // out_dim0 if out_dim0 else 0
    send_counts = [s * in_row for s in args.split_sizes(input_split_sizes, in_dim0, size, "all_to_all_single", "input")]
    recv_counts = [s * out_row for s in args.split_sizes(output_split_sizes, out_dim0, size, "all_to_all_single", "output")]

    def body(ch):
        pg.ops.all_to_all(ch, inp.flat, send_counts, out.flat, recv_counts)
        out.commit()

    sig = signature("all_to_all_single", out.dtype.code)
    return pg.collective("all_to_all_single", body, async_op, sig, [output])


def barrier(group=None, async_op: bool = False, device_ids=None):
    """Block until every rank of the group has entered the barrier."""
    pg = args.resolve_group(group, "barrier")
    if pg is None:
        return None
    if not async_op and pg.small_barrier():
        return None  # the engine's latency path did the whole call (backends/shm_latency.py)
    return pg.collective("barrier", pg.ops.barrier, async_op, result=[])  # torch's future value: []


def monitored_barrier(group=None, timeout: timedelta | None = None, wait_all_ranks: bool = False):
    """A barrier that names the ranks that did not arrive within ``timeout``.

    Rank 0 waits for every other rank, then releases them. A rank missing at the deadline makes
    rank 0 raise "Rank k failed to pass monitoredBarrier in T ms" (with ``wait_all_ranks``, every
    missing rank is listed); the other ranks then fail too instead of waiting forever.
    """
    pg = args.resolve_group(group, "monitored_barrier")
    if pg is None:
        return None
    timeout = pg.timeout if timeout is None else timeout
    millis = int(timeout.total_seconds() * 1000)
    empty = np.empty(0, dtype=np.uint8)

    def body(ch):
        if ch.rank != 0:
            ch.send(0, empty)
            ch.recv(0, empty)
            return
        pending = [(peer, ch.irecv(peer, np.empty(0, np.uint8))) for peer in range(1, ch.size)]
        missing = []
        for peer, req in pending:
            try:
                req.wait()
            except (DistTimeoutError, PeerLostError):
                missing.append(peer)
                if not wait_all_ranks:
                    break
        if missing:
            global_missing = [pg.ranks[m] for m in missing]
            if len(global_missing) == 1:
                raise DistBackendError(
                    f"[Rank 0]: Rank {global_missing[0]} failed to pass monitoredBarrier in {millis} ms"
                )
            raise DistBackendError(
                f"[Rank 0]: Ranks {', '.join(map(str, global_missing))} failed to pass monitoredBarrier in {millis} ms"
            )
        for peer in range(1, ch.size):
            ch.send(peer, empty)

    return pg.collective("monitored_barrier", body, False, timeout=timeout)
