"""Which reductions MPI computes as torch does: a pure function of (ReduceOp, dtype).

MPI's predefined ops on its predefined types cover the integer dtypes (every op) and float32/float64
(SUM and PRODUCT). AVG and PREMUL_SUM are SUMs with distcomm's arithmetic around them
(``reduction.with_op_arithmetic``). The rest run distcomm's own algorithms over MPI point-to-point:

* float16, bfloat16 (no MPI type; distcomm widens bfloat16 to float32 for the arithmetic),
  complex (kept out for one rule everywhere: torch's view-as-real arithmetic), bool (torch's
  logical rules for SUM/PRODUCT/MIN/MAX);
* MIN and MAX on floats: torch propagates NaN (``np.minimum``); MPI's MIN/MAX are plain compares,
  whose result with a NaN depends on the order the ranks are combined in.
"""

from __future__ import annotations

from ...dtypes import DType
from ...reduction import op_type
from ...types import RedOpType

# DType name -> the MPI datatype's name in mpi4py
MPI_TYPES = {
    "int8": "INT8_T", "int16": "INT16_T", "int32": "INT32_T", "int64": "INT64_T",
    "uint8": "UINT8_T", "uint16": "UINT16_T", "uint32": "UINT32_T", "uint64": "UINT64_T",
    "float32": "FLOAT", "float64": "DOUBLE",
}
_INT_OPS = {
    RedOpType.SUM: "SUM", RedOpType.AVG: "SUM", RedOpType.PREMUL_SUM: "SUM", RedOpType.PRODUCT: "PROD",
    RedOpType.MIN: "MIN", RedOpType.MAX: "MAX", RedOpType.BAND: "BAND", RedOpType.BOR: "BOR",
    RedOpType.BXOR: "BXOR",
}
_FLOAT_OPS = {RedOpType.SUM: "SUM", RedOpType.AVG: "SUM", RedOpType.PREMUL_SUM: "SUM", RedOpType.PRODUCT: "PROD"}


def native_reduction(op, dtype: DType) -> tuple[str, str] | None:
    """(MPI datatype name, MPI op name) when MPI computes ``op`` on ``dtype`` as torch does, else
    None (distcomm's algorithms then run it)."""
    type_name = MPI_TYPES.get(dtype.name)
    if type_name is None:
        return None
    ops = _FLOAT_OPS if dtype.kind == "float" else _INT_OPS
    op_name = ops.get(op_type(op))
    return None if op_name is None else (type_name, op_name)


def equal(counts) -> bool:
    """All counts the same (MPI's block calls); an uneven reduce_scatter runs distcomm's algorithms.
    (Its counts are the same on every rank, so every rank decides alike.)"""
    return len(set(counts)) <= 1
