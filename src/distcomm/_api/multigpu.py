"""The seed's multi-tensor collectives (``*_multigpu``): a list of tensors per process.

Written for GPUs in torch (one tensor per device); here the tensors are CPU tensors or arrays and
the list is reduced or copied locally, around one collective across processes. Semantics follow
the documentation: every tensor of every process takes part.
"""

from __future__ import annotations

import numpy as np

from .. import reduction
from ..types import RedOpType, normalize_op
from . import args
from .collectives import all_gather_into_tensor, all_reduce, broadcast, reduce, reduce_scatter_tensor


def _list(tensor_list, op: str):
    if not isinstance(tensor_list, (list, tuple)) or not tensor_list:
        raise ValueError(f"{op}: tensor_list must be a non-empty list of tensors")
    bufs = args.tensor_list(list(tensor_list), op, "tensor_list")
    for i, b in enumerate(bufs):
        if b.count != bufs[0].count:
            raise ValueError(f"{op}: tensor_list[{i}] has {b.count} elements, expected {bufs[0].count}")
    return bufs


def _local_reduce(bufs, op) -> np.ndarray:
    acc = bufs[0].flat.copy()
    if len(bufs) > 1:
        fn = reduction.reducer(op, bufs[0].dtype)
        for b in bufs[1:]:
            fn(acc, b.flat)
    return acc


def _fan_out(result: np.ndarray, bufs) -> None:
    for b in bufs:
        b.flat[...] = result
        b.commit()


def _then(work, fn):
    """Run ``fn`` after ``work`` (None for synchronous calls), returning an equivalent handle."""
    if work is None:
        fn()
        return None
    work.wait()
    fn()
    return work


def broadcast_multigpu(tensor_list, src, group=None, async_op=False, src_tensor=0):
    """Broadcast ``tensor_list[src_tensor]`` of process ``src`` into every tensor of every process."""
    bufs = _list(tensor_list, "broadcast_multigpu")
    pg = args.resolve_group(group, "broadcast_multigpu")
    if pg is None:
        return None
    if not 0 <= src_tensor < len(bufs):
        raise ValueError(f"broadcast_multigpu: src_tensor {src_tensor} out of range for {len(bufs)} tensors")
    carrier = bufs[src_tensor].flat.copy() if args.get_global_rank_of(pg) == src else np.empty_like(bufs[0].flat)
    work = broadcast(carrier, src, group, async_op)
    return _then(work, lambda: _fan_out(carrier, bufs))


def all_reduce_multigpu(tensor_list, op=RedOpType.SUM, group=None, async_op=False):
    """Reduce every tensor of every process; each tensor ends with the result."""
    bufs = _list(tensor_list, "all_reduce_multigpu")
    op = normalize_op(op)
    reduction.check_supported(op, bufs[0].dtype, "all_reduce_multigpu")
    if args.resolve_group(group, "all_reduce_multigpu") is None:
        return None
    kind = getattr(op, "op", op)
    scaled = kind in (RedOpType.AVG, RedOpType.PREMUL_SUM)
    acc = _local_reduce(bufs, RedOpType.SUM if scaled else op)
    if kind is RedOpType.PREMUL_SUM:
        reduction.premultiply(op, acc, bufs[0].dtype)
    work = all_reduce(acc, RedOpType.SUM if scaled else op, group, async_op)
    world = args.resolve_group(group, "all_reduce_multigpu").size()

    def finish():
        if kind is RedOpType.AVG:
            reduction.finish(RedOpType.AVG, acc, len(bufs) * world, bufs[0].dtype)
        _fan_out(acc, bufs)

    return _then(work, finish)


def reduce_multigpu(tensor_list, dst, op=RedOpType.SUM, group=None, async_op=False, dst_tensor=0):
    """Reduce every tensor of every process into ``tensor_list[dst_tensor]`` of process ``dst``."""
    bufs = _list(tensor_list, "reduce_multigpu")
    op = normalize_op(op)
    reduction.check_supported(op, bufs[0].dtype, "reduce_multigpu")
    pg = args.resolve_group(group, "reduce_multigpu")
    if pg is None:
        return None
    if op is RedOpType.AVG or getattr(op, "op", None) is RedOpType.PREMUL_SUM:
        raise ValueError("reduce_multigpu: AVG and PREMUL_SUM are not supported; use SUM and scale")
    acc = _local_reduce(bufs, op)
    work = reduce(acc, dst, op, group, async_op)

    def finish():
        if args.get_global_rank_of(pg) == dst:
            target = bufs[dst_tensor]
            target.flat[...] = acc
            target.commit()

    return _then(work, finish)


def all_gather_multigpu(output_tensor_lists, input_tensor_list, group=None, async_op=False):
    """``output_tensor_lists[i][k * L + j]`` receives ``input_tensor_list[j]`` of rank k (L = the
    input list's length), for every i."""
    ins = _list(input_tensor_list, "all_gather_multigpu")
    pg = args.resolve_group(group, "all_gather_multigpu")
    if pg is None:
        return None
    L, count = len(ins), ins[0].count
    outs = [args.tensor_list(o, "all_gather_multigpu", f"output_tensor_lists[{i}]", pg.size() * L, like=ins[0])
            for i, o in enumerate(output_tensor_lists)]
    send = np.concatenate([b.flat for b in ins])
    gathered = np.empty(send.size * pg.size(), dtype=send.dtype)
    work = all_gather_into_tensor(gathered, send, group, async_op)

    def finish():
        for lst in outs:
            for idx, b in enumerate(lst):
                b.flat[...] = gathered[idx * count:(idx + 1) * count]
                b.commit()

    return _then(work, finish)


def reduce_scatter_multigpu(output_tensor_list, input_tensor_lists, op=RedOpType.SUM, group=None, async_op=False):
    """Reduce every process's ``input_tensor_lists[i]`` (world_size * L tensors each, L =
    len(output_tensor_list)) over all i and all processes; ``output_tensor_list[j]`` of rank k
    receives the reduction of element ``k * L + j``."""
    outs = _list(output_tensor_list, "reduce_scatter_multigpu")
    op = normalize_op(op)
    reduction.check_supported(op, outs[0].dtype, "reduce_scatter_multigpu")
    pg = args.resolve_group(group, "reduce_scatter_multigpu")
    if pg is None:
        return None
    if op is RedOpType.AVG or getattr(op, "op", None) is RedOpType.PREMUL_SUM:
        raise ValueError("reduce_scatter_multigpu: AVG and PREMUL_SUM are not supported; use SUM and scale")
    L, count = len(outs), outs[0].count
    lists = [args.tensor_list(lst, "reduce_scatter_multigpu", f"input_tensor_lists[{i}]", pg.size() * L, like=outs[0])
             for i, lst in enumerate(input_tensor_lists)]
    if len(lists) != L:
        raise ValueError(f"reduce_scatter_multigpu: input_tensor_lists must have {L} lists (one per output tensor)")
    fn = reduction.reducer(op, outs[0].dtype)
    acc = np.concatenate([b.flat for b in lists[0]])
    for lst in lists[1:]:
        fn(acc, np.concatenate([b.flat for b in lst]))
    mine = np.empty(L * count, dtype=acc.dtype)
    work = reduce_scatter_tensor(mine, acc, op, group, async_op)

    def finish():
        for j, b in enumerate(outs):
            b.flat[...] = mine[j * count:(j + 1) * count]
            b.commit()

    return _then(work, finish)
