"""Collectives that autograd can differentiate (torch.distributed.nn.functional).

Each function returns new tensors (the inputs are not modified) and has a backward made of the
adjoint collective: the gradient of a broadcast is a reduce to the source, of a gather a scatter,
of an all_gather a reduce_scatter, of an all_to_all the reverse all_to_all, and so on. Every rank
must run the backward too (it communicates), as it ran the forward.

``src``/``dst`` are global ranks, as in the tensor API. ``group=None`` is the world.

Differences from torch: ``all_reduce``'s backward is exact for every op (torch re-applies the
forward op to the gradients, which is right only for SUM and AVG): for MAX/MIN the gradient goes
to the ranks holding the extreme value (split evenly on ties), for PRODUCT it is
``sum of grads * product / x``.
"""

from __future__ import annotations

import torch
from torch.autograd import Function

from .._api import collectives, groups
from ..types import RedOpType, normalize_op

__all__ = [
    "all_gather", "all_reduce", "all_to_all", "all_to_all_single", "broadcast", "gather", "reduce",
    "reduce_scatter", "scatter",
]


def _my_global_rank(group) -> int:
    return groups.get_global_rank(group, groups.get_rank(group)) if group is not None else groups.get_rank()


def _fill_output(output: torch.Tensor | None, result: torch.Tensor) -> None:
    """Also write ``result`` into the caller's output tensor, as the in-place API would."""
    if output is not None and not output.requires_grad:
        with torch.no_grad():
            output.copy_(result)


class _Broadcast(Function):
    @staticmethod
    def forward(ctx, src, group, tensor):
        ctx.src, ctx.group = src, group
        out = tensor.detach().clone(memory_format=torch.contiguous_format)
        collectives.broadcast(out, src=src, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        # d(out_r)/d(x_src) = I for every r: the source's gradient is the sum of all gradients.
        gx = _Reduce.apply(ctx.src, RedOpType.SUM, ctx.group, grad)
        if _my_global_rank(ctx.group) != ctx.src:
            gx = torch.zeros_like(gx)
        return None, None, gx


class _Reduce(Function):
    @staticmethod
    def forward(ctx, dst, op, group, tensor):
        if normalize_op(op) != RedOpType.SUM:
            raise ValueError(f"distcomm.nn.reduce differentiates SUM only, got {op}")
        ctx.dst, ctx.group = dst, group
        out = tensor.detach().clone(memory_format=torch.contiguous_format)
        collectives.reduce(out, dst=dst, op=op, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return None, None, None, _Broadcast.apply(ctx.dst, ctx.group, grad)


class _Gather(Function):
    @staticmethod
    def forward(ctx, dst, group, tensor):
        ctx.dst, ctx.group = dst, group
        tensor = tensor.detach().contiguous()
        outs = [torch.zeros_like(tensor) for _ in range(groups.get_world_size(group))]
        is_dst = _my_global_rank(group) == dst
        collectives.gather(tensor, outs if is_dst else None, dst=dst, group=group)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        grads = [g.contiguous() if g is not None else torch.zeros_like(grads[0]) for g in grads]
        return None, None, _Scatter.apply(ctx.dst, ctx.group, *grads)


class _Scatter(Function):
    @staticmethod
    def forward(ctx, src, group, *tensors):
        ctx.src, ctx.group = src, group
        if any(t.shape != tensors[0].shape for t in tensors):
            raise ValueError("distcomm.nn.scatter: the tensors to scatter must all have the same shape")
        out = torch.zeros_like(tensors[0], memory_format=torch.contiguous_format)
        is_src = _my_global_rank(group) == src
        chunks = [t.detach().contiguous() for t in tensors] if is_src else None
        collectives.scatter(out, chunks, src=src, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return (None, None) + _Gather.apply(ctx.src, ctx.group, grad.contiguous())


class _AllGather(Function):
    @staticmethod
    def forward(ctx, group, tensor):
        ctx.group = group
        tensor = tensor.detach().contiguous()
        outs = [torch.empty_like(tensor) for _ in range(groups.get_world_size(group))]
        collectives.all_gather(outs, tensor, group=group)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        # x_r appears in every rank's output r: its gradient is the sum over ranks of their grad[r].
        grads = [g if g is not None else torch.zeros(()) for g in grads]
        like = grads[groups.get_rank(ctx.group)]
        return None, _ReduceScatter.apply(RedOpType.SUM, ctx.group, torch.empty_like(like), *grads)


class _ReduceScatter(Function):
    @staticmethod
    def forward(ctx, op, group, output, *inputs):
        if normalize_op(op) != RedOpType.SUM:
            raise ValueError(f"distcomm.nn.reduce_scatter differentiates SUM only, got {op}")
        ctx.group = group
        out = torch.empty_like(output, memory_format=torch.contiguous_format)
        collectives.reduce_scatter(out, [t.detach().contiguous() for t in inputs], op=op, group=group)
        _fill_output(output, out)
        return out

    @staticmethod
    def backward(ctx, grad):
        return (None, None, None) + _AllGather.apply(ctx.group, grad.contiguous())


class _AllToAll(Function):
    @staticmethod
    def forward(ctx, group, outputs, *tensors):
        ctx.group = group
        ctx.input_shapes = [t.shape for t in tensors]
        results = [torch.empty_like(o, memory_format=torch.contiguous_format) for o in outputs]
        collectives.all_to_all(results, [t.detach().contiguous() for t in tensors], group=group)
        for o, r in zip(outputs, results):
            _fill_output(o, r)
        return tuple(results)

    @staticmethod
    def backward(ctx, *grads):
        like = next(g for g in grads if g is not None)
        back = [torch.empty(s, dtype=like.dtype) for s in ctx.input_shapes]
        grads = [g.contiguous() if g is not None else torch.zeros_like(b) for g, b in zip(grads, back)]
        return (None, None) + _AllToAll.apply(ctx.group, back, *grads)


class _AllToAllSingle(Function):
    @staticmethod
    def forward(ctx, group, output, output_split_sizes, input_split_sizes, tensor):
        ctx.group = group
        ctx.input_shape = tensor.shape
        ctx.splits = (output_split_sizes, input_split_sizes)
        out = torch.empty_like(output, memory_format=torch.contiguous_format)
        collectives.all_to_all_single(out, tensor.detach().contiguous(), output_split_sizes, input_split_sizes,
                                      group=group)
        _fill_output(output, out)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        back = torch.empty(ctx.input_shape, dtype=grad.dtype)
        gx = _AllToAllSingle.apply(ctx.group, back, in_splits, out_splits, grad.contiguous())
        return None, None, None, None, gx


class _AllReduce(Function):
    @staticmethod
    def forward(ctx, op, group, tensor):
        ctx.op, ctx.group = normalize_op(op), group
        out = tensor.detach().clone(memory_format=torch.contiguous_format)
        collectives.all_reduce(out, op=op, group=group)
        if ctx.op in (RedOpType.MAX, RedOpType.MIN, RedOpType.PRODUCT):
            ctx.save_for_backward(tensor.detach(), out)
        return out

    @staticmethod
    def backward(ctx, grad):
        op = ctx.op
        if op in (RedOpType.SUM, RedOpType.AVG):
            return None, None, _AllReduce.apply(op, ctx.group, grad)
        total = _AllReduce.apply(RedOpType.SUM, ctx.group, grad)
        x, out = ctx.saved_tensors
        if op == RedOpType.PRODUCT:
            return None, None, total * out / x
        holders = (x == out).to(grad.dtype)
        ties = holders.clone()
        collectives.all_reduce(ties, group=ctx.group)
        return None, None, total * holders / ties.clamp(min=1)


def broadcast(tensor, src, group=None):
    """``tensor`` of rank ``src``, on every rank. Backward: the gradients are summed onto ``src``."""
    return _Broadcast.apply(src, group, tensor)


def gather(tensor, dst=0, group=None):
    """Tuple of every rank's ``tensor`` on rank ``dst`` (zeros elsewhere). Backward: scatter."""
    return _Gather.apply(dst, group, tensor)


def scatter(tensors, src=0, group=None):
    """``tensors[rank]`` of rank ``src`` on each rank. Every rank passes a list of tensors of the
    right shape (only the source's values are sent). Backward: gather to ``src``."""
    if tensors is None:
        raise ValueError(
            "distcomm.nn.scatter needs a list of tensors on every rank (their shape gives the output's); "
            "only the source rank's values are sent"
        )
    return _Scatter.apply(src, group, *tensors)


def reduce(tensor, dst, op=RedOpType.SUM, group=None):
    """Sum of every rank's ``tensor`` on rank ``dst``. Backward: broadcast from ``dst``."""
    return _Reduce.apply(dst, op, group, tensor)


def reduce_scatter(output, input_list, op=RedOpType.SUM, group=None):
    """Sum over ranks of ``input_list[rank]``, returned (and written into ``output``). Backward: all_gather."""
    return _ReduceScatter.apply(op, group, output, *input_list)


def all_gather(tensor, group=None):
    """Tuple of every rank's ``tensor``. Backward: reduce_scatter of the gradients."""
    return _AllGather.apply(group, tensor)


def all_to_all(output_tensor_list, input_tensor_list, group=None):
    """Tuple whose entry i is rank i's ``input_tensor_list[rank]`` (shapes of ``output_tensor_list``).
    Backward: the reverse all_to_all."""
    return _AllToAll.apply(group, output_tensor_list, *input_tensor_list)


def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None):  # noqa: A002
    """``input`` split along dim 0 and exchanged, concatenated into a tensor shaped like ``output``.
    Backward: the exchange with the split sizes swapped."""
    return _AllToAllSingle.apply(group, output, output_split_sizes, input_split_sizes, input)


def all_reduce(tensor, op=RedOpType.SUM, group=None):
    """The reduction of every rank's ``tensor``, on every rank. Backward: the gradients' sum (SUM),
    mean (AVG), or the exact MAX/MIN/PRODUCT gradient."""
    return _AllReduce.apply(op, group, tensor)
