"""ReduceOp and the deprecated reduce_op alias, as torch.distributed spells them."""

from __future__ import annotations

import enum
import warnings


class RedOpType(enum.IntEnum):
    SUM = 0
    AVG = 1
    PRODUCT = 2
    MIN = 3
    MAX = 4
    BAND = 5
    BOR = 6
    BXOR = 7
    PREMUL_SUM = 8
    UNUSED = 9

    # torch's RedOpType prints as "RedOpType.AVG" (str, format, %s); an IntEnum prints its number
    __str__ = enum.Enum.__str__
    __format__ = enum.Enum.__format__

    def __call__(self, factor):
        """``ReduceOp.PREMUL_SUM(factor)``: multiply each input by ``factor``, then sum."""
        if self is not RedOpType.PREMUL_SUM:
            raise TypeError(f"ReduceOp.{self.name} takes no argument; only PREMUL_SUM(factor) does")
        return PremulSum(factor)


class PremulSum:
    """A PREMUL_SUM with its factor (a number, or a one-element tensor/array)."""

    __slots__ = ("factor",)
    op = RedOpType.PREMUL_SUM

    def __init__(self, factor):
        self.factor = factor

    def __repr__(self):
        return f"ReduceOp.PREMUL_SUM({self.factor!r})"

    # torch's ReduceOp compares and hashes by its RedOpType alone (two PREMUL_SUMs are equal
    # whatever their factors): so does this, and a copy, deepcopy or pickle round trip is equal.
    def __eq__(self, other):
        if isinstance(other, (PremulSum, RedOpType)):
            return other == RedOpType.PREMUL_SUM
        return NotImplemented

    def __hash__(self):
        return hash(RedOpType.PREMUL_SUM)

    def __reduce__(self):
        return PremulSum, (self.factor,)


class _ReduceOpMeta(type):
    """torch's ``ReduceOp.SUM`` is an instance of ``ReduceOp`` (its RedOpType members pass the
    isinstance check), and so is a PREMUL_SUM with its factor; so are ours."""

    def __instancecheck__(cls, obj):
        return isinstance(obj, (RedOpType, PremulSum)) or super().__instancecheck__(obj)


class ReduceOp(metaclass=_ReduceOpMeta):
    """An enum-like class of reduction operations: SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR, BXOR,
    PREMUL_SUM.

    BAND, BOR and BXOR are defined for bool and integer dtypes only; MIN, MAX and PRODUCT are not
    defined for complex dtypes. AVG divides the sum by the group's size (integer dtypes truncate, as
    NCCL does). ``ReduceOp.PREMUL_SUM(factor)`` multiplies every input by ``factor`` before summing.
    Unlike torch's gloo backend, distcomm supports AVG on integer dtypes (gloo computes it on floating
    and complex dtypes only; neither does on bool) and PREMUL_SUM.
    """

    SUM = RedOpType.SUM
    AVG = RedOpType.AVG
    PRODUCT = RedOpType.PRODUCT
    MIN = RedOpType.MIN
    MAX = RedOpType.MAX
    BAND = RedOpType.BAND
    BOR = RedOpType.BOR
    BXOR = RedOpType.BXOR
    PREMUL_SUM = RedOpType.PREMUL_SUM
    UNUSED = RedOpType.UNUSED
    RedOpType = RedOpType

    def __new__(cls, op):
        return normalize_op(op)


def normalize_op(op) -> RedOpType | PremulSum:
    """Accept a RedOpType, a PremulSum, a torch ReduceOp / RedOpType, or a name; return ours."""
    if isinstance(op, (RedOpType, PremulSum)):
        return op
    if isinstance(op, str):
        try:
            return RedOpType[op.upper()]
        except KeyError:
            raise ValueError(f"unknown reduce op {op!r}") from None
    # torch's ReduceOp / RedOpType: take it by name, so torch programs can pass their own enum.
    name = getattr(op, "name", None)
    if name is None and hasattr(op, "op"):
        name = getattr(op.op, "name", None)
    if isinstance(name, str) and name in RedOpType.__members__:
        return RedOpType[name]
    if isinstance(op, int):
        return RedOpType(op)
    raise ValueError(f"unknown reduce op {op!r}; use distcomm.ReduceOp.SUM, MAX, ...")


def _make_nccl_premul_sum(factor) -> PremulSum:
    return PremulSum(factor)


class _DeprecatedReduceOp:
    """``reduce_op`` is deprecated in torch.distributed; attribute access warns and forwards."""

    def __getattr__(self, name):
        warnings.warn(
            "torch.distributed.reduce_op is deprecated, please use torch.distributed.ReduceOp instead",
            FutureWarning,
            stacklevel=2,
        )
        return getattr(ReduceOp, name)


reduce_op = _DeprecatedReduceOp()


def supports_complex(reduceOp) -> bool:  # noqa: N803 - torch's parameter name
    """Whether ``reduceOp`` is defined on complex tensors: not MAX, MIN, PRODUCT, BAND, BOR, BXOR."""
    op = normalize_op(reduceOp)
    return op not in (RedOpType.MAX, RedOpType.MIN, RedOpType.PRODUCT, RedOpType.BAND, RedOpType.BOR, RedOpType.BXOR)
