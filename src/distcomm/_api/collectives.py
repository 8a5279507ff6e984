"""The collectives, with torch.distributed's names, signatures and docstrings.

Each function resolves the group (non-members return None without communicating), turns tensors
into Buffers and checks them (before any communication, so a bad call fails alike on every rank),
then makes one call of the group's method of the same collective (process_group.py), which runs it
in issue order, inline or on its worker thread when ``async_op=True``.
"""

from __future__ import annotations

import warnings
from datetime import timedelta
from typing import NoReturn

import numpy as np

from .. import diagnostics, reduction, world
from ..buffers import SparseBuffer, is_buffer_like, is_sparse, is_tensor
from ..types import RedOpType, normalize_op
from . import args


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
    pg = world.default_pg if group is None else None  # resolve_group's commonest case, folded in
    if pg is None:
        pg = args.resolve_group(group, "broadcast")
        if pg is None:
            return None
    root = args.group_root(pg, "broadcast", src, group_src, "src")
    if not async_op and not diagnostics.check_shapes and pg.tensor_paths.broadcast(tensor, root):
        return None
    if pg.rank() != root and args.read_only(tensor):
        _take_part_then_refuse(lambda scratch: pg.broadcast(scratch, root), tensor, "broadcast")
    buf = args.tensor(tensor, "broadcast", writes=pg.rank() != root, in_place=True)
    return pg.broadcast(buf, root, async_op, [tensor])


def all_reduce(tensor, op=RedOpType.SUM, group=None, async_op: bool = False):
    """Reduce ``tensor`` across all ranks so that every rank ends with the result, in place.

    ``op`` is a ReduceOp (SUM by default). Returns a Work when ``async_op``, else None.
    """
    # resolve_group's commonest case, folded in: the default group (this is the latency path's door)
    pg = world.default_pg if group is None else None
    if pg is None:
        pg = args.resolve_group(group, "all_reduce")
        if pg is None:
            return None
    if not async_op and not diagnostics.check_shapes and pg.fast_all_reduce(tensor, op):
        return None  # the engine's fast path did the whole call (it declines sparse tensors)
    if is_sparse(tensor):
        return _all_reduce_sparse(pg, tensor, op, async_op)
    buf = args.tensor(tensor, "all_reduce", writes=True, in_place=True)
    op = _check_op(op, buf.dtype, "all_reduce")
    return pg.allreduce(buf, op, async_op, [tensor])


def _all_reduce_sparse(pg, tensor, op, async_op: bool):
    op = normalize_op(op)
    if op is not RedOpType.SUM:
        raise args.ArgumentError(
            f"all_reduce on rank {pg.rank()}: unsupported reduction operation (allreduce of sparse tensors only "
            f"works with ReduceOp.SUM, as in torch's gloo); got {op!r}: use ReduceOp.SUM or a "
            "dense tensor"
        )
    return pg.allreduce_sparse(SparseBuffer(tensor), async_op, [tensor])


def _deprecated(name: str) -> None:
    # torch's @deprecated text and category, warned on every call from the caller's line
    warnings.warn(
        f"`torch.distributed.{name}` will be deprecated. If you must use it, please revisit our documentation "
        "later at https://pytorch.org/docs/main/distributed.html#collective-functions",
        FutureWarning,
        stacklevel=3,
    )


def _future_of(work):
    """What torch's coalesced collectives return: the Work's future when async, else None."""
    return None if work is None else work.get_future()


def all_reduce_coalesced(tensors, op=RedOpType.SUM, group=None, async_op: bool = False):
    """Reduce every tensor of ``tensors`` (one dtype) across all ranks, in place, as one collective.

    Shapes are not checked across ranks (as in torch): every rank must pass the same sizes.
    Returns the Work's future when ``async_op`` (torch's return value), else None.
    """
    _deprecated("all_reduce_coalesced")
    if is_buffer_like(tensors):
        tensors = [tensors]
    return _future_of(all_reduce_list(tensors, op, group, async_op))


def all_reduce_list(tensors, op=RedOpType.SUM, group=None, async_op: bool = False):
    """all_reduce_coalesced without torch's deprecation warning, returning the Work (when
    ``async_op``) as all_reduce does: what distcomm's own callers use (DistributedDataParallel
    reduces a bucket's gradients where they are with it)."""
    bufs = args.tensor_list(tensors, "all_reduce_coalesced", "tensor", writes=True)
    pg = args.resolve_group(group, "all_reduce_coalesced")
    if pg is None:
        return None
    if not bufs:
        raise args.ArgumentError("all_reduce_coalesced: tensors must not be empty")
    op = _check_op(op, bufs[0].dtype, "all_reduce")
    return pg.allreduce_coalesced(bufs, op, async_op, list(tensors))


def all_gather_coalesced(output_tensor_lists, input_tensor_list, group=None, async_op: bool = False):
    """Gather each tensor of ``input_tensor_list`` from every rank: ``output_tensor_lists[r][i]``
    receives rank r's ``input_tensor_list[i]``, as one collective.

    Returns the Work's future when ``async_op`` (torch's return value), else None.
    """
    _deprecated("all_gather_coalesced")
    pg = args.resolve_group(group, "all_gather_coalesced")
    if pg is None:
        return None
    ins = args.tensor_list(input_tensor_list, "all_gather_coalesced", "input_tensor_list")
    if not isinstance(output_tensor_lists, list):
        raise TypeError("Invalid function argument: output_tensor_lists should be a list")
    if not ins:
        raise args.ArgumentError("all_gather_coalesced: input_tensor_list must not be empty")
    out_lists = args.gathered_lists(output_tensor_lists, ins, pg.size(), "all_gather_coalesced")
    # torch's future: output_tensor_lists itself (a list per rank)
    return _future_of(pg.allgather_coalesced(out_lists, ins, async_op, output_tensor_lists))


def reduce(tensor, dst: int | None = None, op=RedOpType.SUM, group=None, async_op: bool = False,
           group_dst: int | None = None):
    """Reduce ``tensor`` across all ranks; only rank ``dst`` receives the result (in place).

    Other ranks' tensors are left unchanged.
    """
    pg = world.default_pg if group is None else None
    if pg is None:
        pg = args.resolve_group(group, "reduce")
        if pg is None:
            return None
    root = args.group_root(pg, "reduce", dst, group_dst, "dst")
    if (not async_op and op.__class__ is RedOpType and not diagnostics.check_shapes
            and pg.tensor_paths.reduce(tensor, op, root)):
        return None
    if pg.rank() == root and args.read_only(tensor):
        op = _check_op(op, args.tensor(tensor, "reduce").dtype, "reduce")
        _take_part_then_refuse(lambda scratch: pg.reduce(scratch, op, root), tensor, "reduce")
    buf = args.tensor(tensor, "reduce", writes=pg.rank() == root, in_place=True)
    op = _check_op(op, buf.dtype, "reduce")
    return pg.reduce(buf, op, root, async_op, [tensor])


def _take_part_then_refuse(run, array: np.ndarray, op: str) -> NoReturn:
    """A read-only numpy array on the rank a rooted call writes (a broadcast's receiver, a reduce's
    root): its peers, which only read theirs, cannot see this rank refuse it, so this rank still
    takes part, ``run(buffer)`` into a writable copy it then drops, and raises after: the group
    stays in step, and the call's mistake is reported where it was made."""
    run(args.tensor(np.array(array), op))
    args.refuse_read_only(op, "tensor")


def _per_rank_views(output, size: int) -> list:
    """``output`` split along its first dimension into ``size`` views (torch's future value)."""
    if isinstance(output, np.ndarray):
        return np.array_split(output, size) if output.ndim else [output]
    return list(output.chunk(size)) if output.dim() else [output]


def all_gather(tensor_list, tensor, group=None, async_op: bool = False):
    """Gather ``tensor`` from every rank into ``tensor_list`` (one tensor per rank, in rank order)."""
    pg = world.default_pg if group is None else None
    if pg is None:
        pg = args.resolve_group(group, "all_gather")
        if pg is None:
            return None
    if not async_op and not diagnostics.check_shapes and pg.tensor_paths.all_gather(tensor_list, tensor):
        return None
    inp = args.tensor(tensor, "all_gather")
    outs = args.tensor_list(tensor_list, "all_gather", "tensor_list", pg.size(), like=inp, writes=True)
    return pg.allgather(outs, inp, async_op, list(tensor_list))  # torch's future: the outputs, flat


def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op: bool = False):
    """Gather ``input_tensor`` from every rank into one ``output_tensor`` of world_size times its
    size (concatenated along the first dimension, or stacked), in rank order."""
    pg = world.default_pg if group is None else None
    if pg is None:
        pg = args.resolve_group(group, "all_gather_into_tensor")
        if pg is None:
            return None
    if (not async_op and not diagnostics.check_shapes
            and pg.tensor_paths.all_gather_into_tensor(output_tensor, input_tensor)):
        return None
    out = args.tensor(output_tensor, "all_gather_into_tensor", "output_tensor", writes=True)
    inp = args.tensor(input_tensor, "all_gather_into_tensor", "input_tensor")
    args.gathered_into(out, inp, pg.size(), "all_gather_into_tensor")
    # torch's future holds the output split into one view per rank; a synchronous call has no
    # future, and splitting a torch tensor costs about 3 µs of CPU: split only for a Work
    views = _per_rank_views(output_tensor, pg.size()) if async_op else None
    return pg.allgather_into_tensor(out, inp, async_op, views)


def gather(tensor, gather_list=None, dst: int | None = None, group=None, async_op: bool = False,
           group_dst: int | None = None):
    """Gather ``tensor`` from every rank into ``gather_list`` on rank ``dst``.

    ``gather_list`` (one tensor per rank) is given on ``dst`` only; other ranks pass None.
    """
    pg = world.default_pg if group is None else None
    if pg is None:
        pg = args.resolve_group(group, "gather")
        if pg is None:
            return None
    root = args.group_root(pg, "gather", dst, group_dst, "dst")
    if not async_op and not diagnostics.check_shapes and pg.tensor_paths.gather(tensor, gather_list, root):
        return None
    inp = args.tensor(tensor, "gather")
    if pg.rank() == root:
        if not gather_list:
            raise ValueError("Argument ``gather_list`` must be specified on destination rank.")
        outs = args.tensor_list(gather_list, "gather", "gather_list", pg.size(), like=inp, writes=True)
    else:
        if gather_list:
            raise ValueError("Argument ``gather_list`` must NOT be specified on non-destination ranks.")
        outs = None
    # torch's future: the gathered tensors on dst, [] elsewhere
    return pg.gather(outs, inp, root, async_op, list(gather_list or []))


def scatter(tensor, scatter_list=None, src: int | None = None, group=None, async_op: bool = False,
            group_src: int | None = None):
    """Scatter ``scatter_list`` (given on ``src`` only, one tensor per rank) so that rank i's
    ``tensor`` receives ``scatter_list[i]``."""
    pg = world.default_pg if group is None else None
    if pg is None:
        pg = args.resolve_group(group, "scatter")
        if pg is None:
            return None
    root = args.group_root(pg, "scatter", src, group_src, "src")
    if not async_op and not diagnostics.check_shapes and pg.tensor_paths.scatter(tensor, scatter_list, root):
        return None
    out = args.tensor(tensor, "scatter", writes=True)
    if pg.rank() == root:
        if not scatter_list:
            raise ValueError("Argument ``scatter_list`` must be specified on source rank.")
        ins = args.tensor_list(scatter_list, "scatter", "scatter_list", pg.size(), like=out)
    else:
        if scatter_list:
            raise ValueError("Argument ``scatter_list`` must NOT be specified on non-source ranks.")
        ins = None
    return pg.scatter(out, ins, root, async_op, [tensor])


def reduce_scatter(output, input_list, op=RedOpType.SUM, group=None, async_op: bool = False):
    """Reduce ``input_list[i]`` across all ranks into rank i's ``output``."""
    pg = args.resolve_group(group, "reduce_scatter")
    if pg is None:
        return None
    out = args.tensor(output, "reduce_scatter", "output", writes=True)
    ins = args.tensor_list(input_list, "reduce_scatter", "input_list", pg.size())
    args.reduce_scatter_list(out, ins, pg.rank(), "reduce_scatter")
    op = _check_op(op, out.dtype, "reduce_scatter")
    return pg.reduce_scatter(out, ins, op, async_op, [output])


def reduce_scatter_tensor(output, input, op=RedOpType.SUM, group=None, async_op: bool = False):  # noqa: A002
    """Reduce ``input`` (world_size blocks, concatenated or stacked) across ranks; rank i's
    ``output`` receives the reduction of block i."""
    pg = world.default_pg if group is None else None
    if pg is None:
        pg = args.resolve_group(group, "reduce_scatter_tensor")
        if pg is None:
            return None
    if (not async_op and op.__class__ is RedOpType and not diagnostics.check_shapes
            and pg.tensor_paths.reduce_scatter_tensor(output, input, op)):
        return None
    out = args.tensor(output, "reduce_scatter_tensor", "output", writes=True)
    inp = args.tensor(input, "reduce_scatter_tensor", "input")
    args.scattered_from(out, inp, pg.size(), "reduce_scatter_tensor")
    op = _check_op(op, out.dtype, "reduce_scatter_tensor")
    return pg.reduce_scatter_tensor(out, inp, op, async_op, [output])


def all_to_all(output_tensor_list, input_tensor_list, group=None, async_op: bool = False):
    """Send ``input_tensor_list[i]`` to rank i and receive rank i's tensor into
    ``output_tensor_list[i]``; sizes may differ per pair."""
    pg = args.resolve_group(group, "all_to_all")
    if pg is None:
        return None
    outs = args.tensor_list(output_tensor_list, "all_to_all", "output_tensor_list", pg.size(), writes=True)
    ins = args.tensor_list(input_tensor_list, "all_to_all", "input_tensor_list", pg.size())
    args.same_dtype(outs + ins, "all_to_all")
    return pg.alltoall(outs, ins, async_op, list(output_tensor_list))  # torch's future: the outputs, flat


def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None,  # noqa: A002
                      async_op: bool = False):
    """Split ``input`` along its first dimension (equally, or by ``input_split_sizes``), send part
    i to rank i, and concatenate what each rank sends into ``output`` (split by
    ``output_split_sizes``)."""
    pg = world.default_pg if group is None else None
    if pg is None:
        pg = args.resolve_group(group, "all_to_all_single")
        if pg is None:
            return None
    if (not async_op and output_split_sizes is None and input_split_sizes is None and not diagnostics.check_shapes
            and pg.tensor_paths.all_to_all_single(output, input)):
        return None
    out = args.tensor(output, "all_to_all_single", "output", writes=True)
    inp = args.tensor(input, "all_to_all_single", "input")
    if is_tensor(input) and not input.is_contiguous():
        # torch's c10d refuses a non-contiguous input (a ValueError) before gloo sees it
        raise args.ArgumentError(
            f"all_to_all_single on rank {pg.rank()}: Tensors must be contiguous: the input tensor is not; "
            "pass input.contiguous()"
        )
    args.same_dtype([out, inp], "all_to_all_single")
    size = pg.size()
    in_dim0 = inp.shape[0] if inp.shape else 1
    out_dim0 = out.shape[0] if out.shape else 1
    in_row = inp.count // in_dim0 if in_dim0 else 0
    out_row = out.count // out_dim0 if out_dim0 else 0
    send_counts = [s * in_row for s in args.split_sizes(input_split_sizes, in_dim0, size, "all_to_all_single", "input")]
    recv_counts = [s * out_row for s in args.split_sizes(output_split_sizes, out_dim0, size, "all_to_all_single", "output")]
    return pg.alltoall_base(out, inp, recv_counts, send_counts, async_op, [output])


def barrier(group=None, async_op: bool = False, device_ids=None, timeout: timedelta | None = None):
    """Block until every rank of the group has entered the barrier (within ``timeout``, default
    the group's)."""
    pg = world.default_pg if group is None else None  # resolve_group's commonest case, folded in
    if pg is None:
        pg = args.resolve_group(group, "barrier")
        if pg is None:
            return None
    if timeout is not None and not isinstance(timeout, timedelta):
        raise TypeError(f"barrier: timeout must be a datetime.timedelta, got {type(timeout).__name__}")
    if not async_op and timeout is None and pg.fast_barrier():  # (a barrier has no shape to check)
        return None  # the engine's fast path did the whole call
    return pg.barrier(async_op, [], timeout)  # torch's future value: []


def monitored_barrier(group=None, timeout=None, wait_all_ranks: bool = False):
    """A barrier that names the ranks that did not arrive within ``timeout``.

    Rank 0 waits for every other rank, then releases them. A rank missing at the deadline makes
    rank 0 raise "Rank k failed to pass monitoredBarrier in T ms" (with ``wait_all_ranks``, every
    missing rank is listed); the other ranks then fail too instead of waiting forever. ``timeout``
    is a timedelta, or seconds (a number, with torch's warning).
    """
    if isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        # torch takes seconds too, with this warning
        warnings.warn(
            "Please specify timeout arg as a timedelta. "
            f"Converting current value of {timeout} assuming it represents seconds",
            stacklevel=2,
        )
        timeout = timedelta(seconds=timeout)
    elif timeout is not None and not isinstance(timeout, timedelta):
        raise TypeError(f"Expected timeout argument to be of type datetime.timedelta, got {type(timeout).__name__}")
    pg = args.resolve_group(group, "monitored_barrier")
    if pg is None:
        return None
    pg.monitored_barrier(timeout, wait_all_ranks)
