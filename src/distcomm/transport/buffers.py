"""The bytes of a point-to-point buffer: one contiguity rule, one error, for every transport.

Transports move bytes, not elements, so each needs a flat byte view of the caller's array. Two
shapes are offered because their consumers differ in what is fast: numpy copies (shm rings, the
in-process transport) want a uint8 array, while socket calls and slice assignment between
memoryviews (TCP) are several times cheaper on a memoryview than on an ndarray.
"""

from __future__ import annotations

import numpy as np

NOT_CONTIGUOUS = "point-to-point buffers must be C-contiguous"


def contiguous(buf: np.ndarray) -> np.ndarray:
    """``buf`` itself, after checking that it is C-contiguous (ValueError otherwise)."""
    if not buf.flags.c_contiguous:
        raise ValueError(NOT_CONTIGUOUS)
    return buf


def as_bytes(buf: np.ndarray) -> np.ndarray:
    """A flat uint8 view of a C-contiguous array (0-d and empty arrays included), no copy."""
    if not buf.flags.c_contiguous:
        raise ValueError(NOT_CONTIGUOUS)
    return buf.reshape(-1).view(np.uint8)


def as_memoryview(buf, writable: bool = False) -> memoryview:
    """A flat byte memoryview of a C-contiguous buffer (a numpy array of any dtype or shape, or
    any object with the buffer protocol), no copy; ValueError for a read-only one if ``writable``."""
    if isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous:
            raise ValueError(NOT_CONTIGUOUS)
        try:
            view = memoryview(buf).cast("B")
        except (TypeError, ValueError):  # formats memoryview cannot cast (complex, 0-d)
            view = memoryview(buf.reshape(-1).view(np.uint8))
    else:
        view = memoryview(buf)
        if not view.c_contiguous:
            raise ValueError(NOT_CONTIGUOUS)
        view = view.cast("B")
    if writable and view.readonly:
        raise ValueError("receive buffer is read-only")
    return view
