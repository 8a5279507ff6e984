"""Argument plumbing shared by every public function: one place for checks and rank translation.

torch repeats these checks in every function of distributed_c10d.py; here each is written once.
Every check runs before any communication and depends only on the arguments, so a bad call fails
the same way on every rank instead of leaving the others waiting.
"""

from __future__ import annotations

import warnings
from typing import Any, NoReturn, Sequence

import numpy as np

from .. import world
from ..buffers import Buffer, as_buffer, as_buffers
from ..errors import DistBackendError
from ..process_group import ProcessGroup


class ArgumentError(DistBackendError, ValueError):
    """A bad argument that torch's gloo rejects from its C++ checks, with a RuntimeError (wrong list
    length, sizes that do not fit, dtypes that differ between input and output, an op a dtype does
    not have) while the same mistake elsewhere in torch is a ValueError. It is both, so an
    ``except RuntimeError`` written for torch and a natural ``except ValueError`` both catch it.
    """


NOT_INITIALIZED = "Default process group has not been initialized, please make sure to call init_process_group."


def default_group():
    if world.default_pg is None:
        raise ValueError(NOT_INITIALIZED)
    return world.default_pg


def resolve_group(group: Any, op: str):
    """The ProcessGroup to run on, or None when this process is not a member (skip the call).

    A ProcessGroup given explicitly needs no default group: one built around its own engine (as a
    torch backend adapter does) works without init_process_group.
    """
    if isinstance(group, ProcessGroup):
        return group
    if group is None or group is world.GroupMember.WORLD:
        return default_group()
    if is_non_member(group):
        warnings.warn(f"Running {op} on global rank {world.global_rank} which does not belong to the given group.")
        return None
    default_group()  # not initialized: say so before complaining about the argument
    raise TypeError(f"{op}: group must be a distcomm process group (from new_group), got {type(group).__name__}")


def is_non_member(group: Any) -> bool:
    """Whether ``group`` is GroupMember.NON_GROUP_MEMBER: torch's int -100, which torch's
    ``_rank_not_in_group`` compares by value (a program may hold its own -100)."""
    return group.__class__ is int and group == world.GroupMember.NON_GROUP_MEMBER


def group_root(pg, op: str, global_rank: int | None, group_rank: int | None, role: str) -> int:
    """``group_peer``, its commonest case (a member's global rank, an int) one lookup: the API
    functions of rooted collectives call this before their latency path."""
    if group_rank is None and global_rank.__class__ is int:
        rank = pg.group_ranks.get(global_rank)
        if rank is not None:
            return rank
    return group_peer(pg, op, global_rank, group_rank, role)


def group_peer(pg, op: str, global_rank: int | None, group_rank: int | None, role: str) -> int:
    """Translate a src/dst argument (global rank, or group_src/group_dst) into a group rank."""
    if global_rank is not None and group_rank is not None:
        raise ValueError(f"{op}: can't specify both {role} and group_{role}")
    if group_rank is not None:
        if not 0 <= group_rank < pg.size():
            raise ValueError(f"{op}: group_{role} {group_rank} is out of range for a group of size {pg.size()}")
        return group_rank
    if global_rank is None:
        global_rank = 0 if role in ("src", "dst") else None
        if global_rank is None:
            raise ValueError(f"{op}: {role} must be given")
    if not isinstance(global_rank, int) or isinstance(global_rank, bool):
        raise TypeError(f"{op}: {role} must be an int (a global rank), got {type(global_rank).__name__}")
    rank = pg.group_rank(global_rank)
    if rank < 0:
        if pg is world.default_pg:
            raise DistBackendError(
                f"{op}: invalid {role} rank {global_rank}: the world has ranks 0..{pg.size() - 1}"
            )
        raise ValueError(f"Global rank {global_rank} is not part of group {pg.group_name} (ranks {pg.ranks})")
    return rank


def tensor(obj: Any, op: str, name: str = "tensor", writes: bool = False, in_place: bool = False) -> Buffer:
    """``obj`` as a Buffer; ``writes``: the call writes its result into it (so it must be writable).

    ``in_place``: the call computes each element of its result from that element of every rank's
    ``obj`` (all_reduce, reduce, broadcast), so an expanded tensor stays consistent and is taken;
    otherwise a tensor it writes must not have elements sharing memory (_refuse_internal_overlap).
    """
    try:
        buf = as_buffer(obj, name)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{op}: {exc}") from None
    if writes:
        if isinstance(obj, _ndarray) and not obj.flags.writeable:
            refuse_read_only(op, name)
        if not in_place and not buf.aliases_user_memory:  # (a Buffer over the memory itself cannot overlap)
            _refuse_internal_overlap(obj, op, name)
    return buf


def _refuse_internal_overlap(obj: Any, op: str, name: str) -> None:
    """An ArgumentError if several elements of ``obj`` share one memory location (a dimension of
    more than one element with stride 0, as ``expand()`` makes: torch's ``at::has_internal_overlap``),
    where the call would write different values into them. gloo refuses such an output with the
    same words in all_gather(_into_tensor), gather, reduce_scatter(_tensor), all_to_all and the
    coalesced collectives (once it has communicated), aborts in all_to_all_single and writes past
    the tensor's memory in scatter. Whether it is refused here depends only on the arguments, so
    every rank that passes the same call refuses it alike, before any communication."""
    if 0 in obj.shape:  # no elements, none to share a location
        return
    strides = obj.strides if isinstance(obj, _ndarray) else obj.stride()
    for n, stride in zip(obj.shape, strides):
        if stride == 0 and n > 1:
            raise ArgumentError(
                f"{op}: unsupported operation: more than one element of the written-to tensor refers to a single "
                f"memory location ({name} has a dimension of {n} elements with stride 0, as expand() makes); "
                f"pass {name}.clone() (or a numpy copy)"
            )


_ndarray = np.ndarray


def read_only(obj: Any) -> bool:
    """Whether ``obj`` is a numpy array the call may not write (``writeable`` False)."""
    return isinstance(obj, _ndarray) and not obj.flags.writeable


def refuse_read_only(op: str, name: str) -> NoReturn:
    # Checked before any communication: found while writing the result, the same mistake would
    # leave the group's rounds half done.
    raise ArgumentError(
        f"{op}: {name} is a read-only numpy array (writeable=False), and the result is written into "
        "it; pass a writable array (a copy, or one whose flags.writeable is True)"
    )


def tensor_list(
    objs: Any, op: str, name: str, length: int | None = None, like: Buffer | None = None, writes: bool = False
) -> list[Buffer]:
    """A list of buffers; with ``length``/``like``, check its length, dtypes and sizes; ``writes``:
    the call writes its results into them. (Every collective with a list calls this: the checks
    pass first, and only a failing one formats names.)"""
    if objs.__class__ is not list and objs.__class__ is not tuple:
        bufs = _named_buffers(objs, op, name)  # raises its TypeError, or takes a list/tuple subclass
    else:
        try:
            bufs = [as_buffer(o) for o in objs]
        except (TypeError, ValueError):
            bufs = _named_buffers(objs, op, name)  # the same error, naming the element
    if writes:
        for i, obj in enumerate(objs):
            if isinstance(obj, _ndarray) and not obj.flags.writeable:
                refuse_read_only(op, f"{name}[{i}]")
            if not bufs[i].aliases_user_memory:  # (a Buffer over the memory itself cannot overlap)
                _refuse_internal_overlap(obj, op, f"{name}[{i}]")
    if length is not None and len(bufs) != length:
        raise ArgumentError(f"{op}: {name} must have one tensor per rank: expected length {length}, got {len(bufs)}")
    if bufs or like is not None:
        dtype = like.dtype if like is not None else bufs[0].dtype
        for b in bufs:
            if b.dtype is not dtype:
                same_dtype(bufs + ([like] if like is not None else []), op)
    if like is not None:
        count = like.count
        for i, b in enumerate(bufs):
            if b.flat.size != count:
                raise ArgumentError(
                    f"{op}: {name}[{i}] has {b.count} elements, expected {count} (the size of the input)"
                )
    return bufs


def _named_buffers(objs: Any, op: str, name: str) -> list[Buffer]:
    try:
        return as_buffers(objs, name)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{op}: {exc}") from None


def same_dtype(bufs: Sequence[Buffer], op: str) -> None:
    first = bufs[0].dtype if bufs else None
    for b in bufs:
        if b.dtype is not first:  # DTypes are one object per dtype
            names = ", ".join(sorted({b.dtype.name for b in bufs}))
            raise ArgumentError(f"{op}: Invalid usage of tensors with different dtypes: found {names}")


def rank_in_group(rank: Any, size: int, op: str, role: str) -> int:
    """A group rank given as such (a root, a peer), checked against the group's size."""
    if rank.__class__ is not int or not 0 <= rank < size:
        raise ArgumentError(f"{op}: invalid {role} rank {rank!r}: this group has ranks 0..{size - 1}")
    return rank


def gathered_into(out: Buffer, inp: Buffer, size: int, op: str) -> None:
    """all_gather_into_tensor's buffers: one dtype, the output ``size`` times the input."""
    same_dtype([out, inp], op)
    if out.count != inp.count * size:
        raise ArgumentError(
            f"{op}: output tensor has {out.count} elements, expected {inp.count * size} "
            f"(input size {inp.count} x world size {size})"
        )


def gathered_lists(output_tensor_lists: Any, ins: list[Buffer], size: int, op: str) -> list[list[Buffer]]:
    """all_gather_coalesced's outputs as buffers: a list per rank, each shaped as the inputs."""
    out_lists = []
    for r, outs in enumerate(output_tensor_lists):
        out_lists.append(tensor_list(outs, op, f"output_tensor_lists[{r}]", len(ins), like=None, writes=True))
    if len(out_lists) != size:
        raise ArgumentError(
            f"{op}: output_tensor_lists must have one list per rank: expected length {size}, got {len(out_lists)}"
        )
    same_dtype(ins + [b for outs in out_lists for b in outs], op)
    for r, outs in enumerate(out_lists):
        for i, (out, inp) in enumerate(zip(outs, ins)):
            if out.count != inp.count:
                raise ArgumentError(
                    f"{op}: output_tensor_lists[{r}][{i}] has {out.count} elements, expected "
                    f"{inp.count} (the size of input_tensor_list[{i}])"
                )
    return out_lists


def scattered_from(out: Buffer, inp: Buffer, size: int, op: str) -> None:
    """reduce_scatter_tensor's buffers: one dtype, the input ``size`` times the output."""
    same_dtype([out, inp], op)
    if inp.count != out.count * size:
        raise ArgumentError(
            f"{op}: input tensor has {inp.count} elements, expected {out.count * size} "
            f"(output size {out.count} x world size {size})"
        )


def reduce_scatter_list(out: Buffer, ins: Sequence[Buffer], rank: int, op: str) -> None:
    """reduce_scatter's buffers: one dtype, and this rank's input block the output's size."""
    same_dtype(list(ins) + [out], op)
    if ins[rank].count != out.count:
        raise ArgumentError(f"{op}: input_list[{rank}] has {ins[rank].count} elements but output has {out.count}")


def split_sizes(sizes: Sequence[int] | None, dim0: int, size: int, op: str, name: str) -> list[int]:
    if sizes is None or len(sizes) == 0:
        if dim0 % size:
            raise ArgumentError(f"{op}: the {name} tensor's first dimension ({dim0}) must divide by the group size ({size})")
        return [dim0 // size] * size
    sizes = [int(s) for s in sizes]
    if len(sizes) != size:
        raise ArgumentError(f"{op}: {name}_split_sizes must have one entry per rank ({size}), got {len(sizes)}")
    if any(s < 0 for s in sizes) or sum(sizes) != dim0:
        raise ArgumentError(f"{op}: {name}_split_sizes {sizes} must be non-negative and sum to {dim0} (the first dimension)")
    return sizes


def get_global_rank_of(pg) -> int:
    """This process's global rank (for comparisons with src/dst arguments)."""
    return pg.ranks[pg.rank()]
