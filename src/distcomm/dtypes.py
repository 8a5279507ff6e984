"""The dtype table: every CPU dtype torch has, its numpy storage, and a one-byte wire code.

bfloat16 has no numpy dtype: it is stored as uint16 and carried by name, so reductions know to
widen it to float32 (see reduction.py). Everything that needs to know "what dtype is this buffer" asks
this module, never torch or numpy directly.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class DType(NamedTuple):
    name: str  # torch's name without the "torch." prefix
    code: int  # stable wire code (message signatures)
    storage: np.dtype  # the numpy dtype holding the bits
    kind: str  # "bool", "int", "uint", "float", "complex"


_TABLE = [
    DType("bool", 1, np.dtype(np.bool_), "bool"),
    DType("uint8", 2, np.dtype(np.uint8), "uint"),
    DType("int8", 3, np.dtype(np.int8), "int"),
    DType("int16", 4, np.dtype(np.int16), "int"),
    DType("int32", 5, np.dtype(np.int32), "int"),
    DType("int64", 6, np.dtype(np.int64), "int"),
    DType("float16", 7, np.dtype(np.float16), "float"),
    DType("bfloat16", 8, np.dtype(np.uint16), "float"),
    DType("float32", 9, np.dtype(np.float32), "float"),
    DType("float64", 10, np.dtype(np.float64), "float"),
    DType("complex64", 11, np.dtype(np.complex64), "complex"),
    DType("complex128", 12, np.dtype(np.complex128), "complex"),
    # numpy-only types a numpy user may pass; torch has uint16/32/64 as limited types too.
    DType("uint16", 13, np.dtype(np.uint16), "uint"),
    DType("uint32", 14, np.dtype(np.uint32), "uint"),
    DType("uint64", 15, np.dtype(np.uint64), "uint"),
]

BY_NAME = {d.name: d for d in _TABLE}
BY_CODE = {d.code: d for d in _TABLE}
# numpy dtype -> DType; uint16 maps to the real uint16, never to bfloat16.
BY_NUMPY = {d.storage: d for d in _TABLE if d.name != "bfloat16"}


def from_numpy(dtype: np.dtype) -> DType:
    try:
        return BY_NUMPY[np.dtype(dtype)]
    except KeyError:
        raise TypeError(
            f"dtype {np.dtype(dtype)} is not supported by distcomm; use one of "
            f"{', '.join(sorted(BY_NAME))}"
        ) from None


def from_name(name: str) -> DType:
    try:
        return BY_NAME[name]
    except KeyError:
        raise TypeError(
            f"dtype {name} is not supported by distcomm; convert the tensor to one of "
            f"{', '.join(sorted(BY_NAME))} (e.g. tensor.to(torch.bfloat16)), and back after the call"
        ) from None
