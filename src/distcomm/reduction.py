"""Reductions: which (op, dtype) pairs exist, and the in-place kernels the algorithms call.

Four entry points, used around every reducing collective::

    check_supported(op, dtype)        # before any communication, on every rank, even at size 1
    premultiply(op, buf, dtype)       # PREMUL_SUM: buf *= factor        (no-op for other ops)
    algorithm(ch, buf, reducer(op, dtype))   # acc ⊕= x, in place, many times
    finish(op, buf, world_size, dtype)       # AVG: buf /= world_size    (no-op for other ops)

``dtype`` is optional for premultiply and finish (taken from ``buf.dtype``) except for bfloat16,
whose uint16 storage would otherwise be scaled as integers.

Kernels are numpy ufuncs with ``out=acc``: no temporaries on the hot path. bfloat16 (stored as
uint16) is the exception that cannot avoid them: it is widened to float32 in chunks of
``CHUNK`` elements, reduced, and rounded back to nearest-even exactly as torch's c10::BFloat16 does
(NaN becomes 0x7FC0), so the scratch stays at a few hundred KiB whatever the message size.
float16 uses numpy's float16 loops, which compute in float32 and round once; since float32 has
more than 2*11+2 significand bits that double rounding is harmless and the results are bit-exact
with torch's (which also computes half arithmetic in float).

Semantics, checked against torch 2.13's gloo backend (a real multi-process all_reduce, see
tests/test_reduction.py) and against torch's elementwise operators:

* bool: SUM and MAX are logical or, PRODUCT and MIN logical and, BAND/BOR/BXOR the logical
  and/or/xor — what gloo gives. Results are canonical 0/1 bytes (gloo's SUM stores True + True as
  the byte 2, which torch prints as True).
* Integers wrap on overflow (two's complement), as gloo does (int32 max + 1 → min).
* MIN and MAX propagate NaN (torch.minimum / torch.maximum). gloo's own result depends on which
  rank holds the NaN and on the algorithm's order; distcomm's does not, so every algorithm and
  every rank agree.
* Errors, with the exception types torch raises, so the ``except`` clauses written for torch keep
  working:

  - complex with PRODUCT, MIN, MAX, BAND, BOR or BXOR → ``ValueError`` (torch.distributed checks
    this in Python before the call: "all_reduce does not support ... on complex tensors");
  - float dtypes with BAND, BOR or BXOR → ``DistBackendError``, a RuntimeError, as gloo's
    "Cannot use ReduceOp.BAND with non-integral dtype";
  - bool with AVG or PREMUL_SUM → ``DistBackendError`` (gloo: RuntimeError "result type Float can't
    be cast to the desired output type Bool").

* Where distcomm does more than torch's gloo: int16/uint16/uint32/uint64 (gloo: "Invalid scalar
  type"); AVG on integer dtypes, which divides and truncates toward zero as NCCL does (gloo raises
  "result type Float can't be cast ..."); PREMUL_SUM, whose factor is first converted to the buffer's
  dtype (truncated for integers, rounded for floats) and then multiplied in, as NCCL does.
* AVG divides the sum by the world size (true division, ``tensor.div_(world_size)`` as gloo does),
  not a multiplication by its reciprocal, so the bits match torch's.
* Complex tensors behave as torch.distributed makes them behave, by reducing
  ``torch.view_as_real(t)``: SUM adds, and AVG and a real PREMUL_SUM factor scale, the real and
  imaginary parts separately (a NaN in one part does not spread to the other).
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from .dtypes import DType, from_numpy
from .errors import DistBackendError
from .types import PremulSum, RedOpType, normalize_op

Reducer = Callable[[np.ndarray, np.ndarray], None]

CHUNK = 16384  # elements of float32 scratch per bfloat16 step (64 KiB per scratch array)

_BITWISE = frozenset({RedOpType.BAND, RedOpType.BOR, RedOpType.BXOR})
_NOT_COMPLEX = frozenset({RedOpType.PRODUCT, RedOpType.MIN, RedOpType.MAX}) | _BITWISE

# The ufunc each op applies, per dtype family. AVG and PREMUL_SUM reduce as SUM.
_NUMERIC = {
    RedOpType.SUM: np.add,
    RedOpType.AVG: np.add,
    RedOpType.PREMUL_SUM: np.add,
    RedOpType.PRODUCT: np.multiply,
    RedOpType.MIN: np.minimum,
    RedOpType.MAX: np.maximum,
    RedOpType.BAND: np.bitwise_and,
    RedOpType.BOR: np.bitwise_or,
    RedOpType.BXOR: np.bitwise_xor,
}
_BOOL = {
    RedOpType.SUM: np.logical_or,
    RedOpType.PRODUCT: np.logical_and,
    RedOpType.MIN: np.logical_and,
    RedOpType.MAX: np.logical_or,
    RedOpType.BAND: np.logical_and,
    RedOpType.BOR: np.logical_or,
    RedOpType.BXOR: np.logical_xor,
}


def op_type(op) -> RedOpType:
    """The RedOpType of any accepted op spelling (a PremulSum gives PREMUL_SUM)."""
    op = normalize_op(op)
    return op.op if isinstance(op, PremulSum) else op


try:  # numpy >= 2 keeps its error state in a context variable; setting it directly is ~5x cheaper
    from numpy._core._ufunc_config import _extobj_contextvar
    from numpy._core.umath import _make_extobj

    _QUIET_STATE = _make_extobj(all="ignore")
except (ImportError, AttributeError, TypeError):  # pragma: no cover - numpy 1.x
    _extobj_contextvar = None


class _Quiet:
    """``with _quiet():`` float overflow to inf and inf - inf = NaN are results here, not warnings
    (torch is silent). np.errstate costs several microseconds per use, which is most of an 8-byte
    reduction, so on numpy 2 the error state is set directly (reentrant: tokens are per use)."""

    __slots__ = ("_tokens",)

    def __init__(self):
        self._tokens: list = []

    def __enter__(self):
        self._tokens.append(_extobj_contextvar.set(_QUIET_STATE))

    def __exit__(self, *exc_info):
        _extobj_contextvar.reset(self._tokens.pop())


def _quiet():
    if _extobj_contextvar is None:  # pragma: no cover - numpy 1.x
        return np.errstate(over="ignore", invalid="ignore", under="ignore", divide="ignore")
    return _Quiet()


def _real_view(buf: np.ndarray) -> np.ndarray:
    """Complex arrays as their (re, im) floats: scaling by a real number is done per component, as
    torch.distributed does by reducing torch.view_as_real(tensor) (numpy's complex / real would
    multiply by a reciprocal and turn inf components into NaN)."""
    return buf.view(buf.real.dtype) if buf.dtype.kind == "c" else buf


def _is_bfloat16(dtype: DType | None) -> bool:
    return dtype is not None and dtype.name == "bfloat16"


def _dtype_of(buf: np.ndarray, dtype: DType | None) -> DType:
    return dtype if dtype is not None else from_numpy(buf.dtype)


# -- validity -------------------------------------------------------------------------------------
# (op, dtype name) pairs of plain ops (not PREMUL_SUM, whose factor is checked each time) that
# passed check_supported, and their reducers: the checks then cost one dict lookup per call.
_SUPPORTED: set = set()
_REDUCERS: dict = {}


def check_supported(op, dtype: DType, collective: str = "all_reduce") -> None:
    """Raise (before any communication) if ``op`` is not defined for ``dtype``; see the module doc."""
    if op.__class__ is RedOpType and (op, dtype.name) in _SUPPORTED:
        return
    kind = op_type(op)
    name = f"ReduceOp.{kind.name}"
    if kind is RedOpType.UNUSED:
        raise ValueError(f"{name} is not a reduction; use ReduceOp.SUM, AVG, PRODUCT, MIN, MAX, ...")
    if dtype.kind == "complex" and kind in _NOT_COMPLEX:
        raise ValueError(
            f"{collective} does not support {name} on complex tensors ({dtype.name}): complex numbers "
            "are unordered and have no bits to combine; use SUM, AVG or PREMUL_SUM"
        )
    if dtype.kind == "float" and kind in _BITWISE:
        raise DistBackendError(
            f"Cannot use {name} with non-integral dtype {dtype.name}: bitwise ops are defined for bool "
            "and integer dtypes"
        )
    if dtype.kind == "bool" and kind in (RedOpType.AVG, RedOpType.PREMUL_SUM):
        raise DistBackendError(
            f"Cannot use {name} with bool: an average or a scaled sum of booleans is not a boolean; "
            "convert the tensor to an integer or float dtype first"
        )
    if op.__class__ is RedOpType:
        _SUPPORTED.add((op, dtype.name))


# -- bfloat16 <-> float32 -------------------------------------------------------------------------
def _widen(src: np.ndarray, dst: np.ndarray) -> None:
    """bfloat16 bits (uint16) -> float32, exactly: the bits become the float's high half."""
    bits = dst.view(np.uint32)
    bits[...] = src
    np.left_shift(bits, 16, out=bits)


def _narrow(src: np.ndarray, dst: np.ndarray, scratch: np.ndarray, nan: np.ndarray) -> None:
    """float32 -> bfloat16 bits, round to nearest even, NaN -> 0x7FC0 (c10's round_to_nearest_even).

    ``scratch`` (uint32) and ``nan`` (bool) have src's length; src is left unchanged.
    """
    bits = src.view(np.uint32)
    np.right_shift(bits, 16, out=scratch)
    np.bitwise_and(scratch, 1, out=scratch)
    np.add(scratch, 0x7FFF, out=scratch)
    np.add(scratch, bits, out=scratch)
    np.right_shift(scratch, 16, out=scratch)
    dst[...] = scratch
    np.isnan(src, out=nan)
    if nan.any():
        np.copyto(dst, 0x7FC0, where=nan)


def _bf16_apply(fn: Callable[[np.ndarray, np.ndarray | None], None], acc: np.ndarray, x: np.ndarray | None) -> None:
    """Run ``fn(a32, x32)`` over float32 widenings of acc (and x), chunk by chunk; acc = round(a32)."""
    n = acc.size
    m = min(n, CHUNK)
    a32 = np.empty(m, np.float32)
    x32 = np.empty(m, np.float32)
    nan = np.empty(m, np.bool_)
    for start in range(0, n, CHUNK):
        stop = min(start + CHUNK, n)
        k = stop - start
        a, b = a32[:k], x32[:k]
        _widen(acc[start:stop], a)
        if x is not None:
            _widen(x[start:stop], b)
        fn(a, b)
        _narrow(a, acc[start:stop], b.view(np.uint32), nan[:k])


def to_bfloat16_bits(values) -> np.ndarray:
    """float values -> bfloat16 bits (uint16), rounded as torch rounds."""
    f = np.ascontiguousarray(values, dtype=np.float32).reshape(-1)
    out = np.empty(f.size, np.uint16)
    _narrow(f, out, np.empty(f.size, np.uint32), np.empty(f.size, np.bool_))
    return out


def from_bfloat16_bits(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bits (uint16) -> float32 values (exact)."""
    out = np.empty(bits.size, np.float32)
    _widen(np.ascontiguousarray(bits).reshape(-1), out)
    return out


# -- the kernels ----------------------------------------------------------------------------------
def reducer(op, dtype: DType) -> Reducer:
    """``fn(acc, x)``: acc ⊕= x elementwise, in place (both 1-D arrays of dtype's storage)."""
    check_supported(op, dtype)
    kind = op_type(op)
    cached = _REDUCERS.get((kind, dtype.name))
    if cached is None:
        cached = _REDUCERS[(kind, dtype.name)] = _make_reducer(kind, dtype)
    return cached


def _make_reducer(kind: RedOpType, dtype: DType) -> Reducer:
    if dtype.kind == "bool":
        ufunc = _BOOL[kind]
    else:
        ufunc = _NUMERIC[kind]
    if _is_bfloat16(dtype):

        def reduce_bfloat16(acc: np.ndarray, x: np.ndarray) -> None:
            with _quiet():
                _bf16_apply(lambda a, b: ufunc(a, b, out=a), acc, x)

        return reduce_bfloat16
    if dtype.kind in ("float", "complex"):

        if _extobj_contextvar is None:  # pragma: no cover - numpy 1.x

            def reduce_float(acc: np.ndarray, x: np.ndarray) -> None:
                with _quiet():
                    ufunc(acc, x, out=acc)

            return reduce_float

        def reduce_float_fast(acc: np.ndarray, x: np.ndarray, _set=_extobj_contextvar.set,
                              _reset=_extobj_contextvar.reset, _state=_QUIET_STATE) -> None:
            token = _set(_state)  # the body of ``with _quiet():``, inlined: this runs per chunk
            try:
                ufunc(acc, x, out=acc)
            finally:
                _reset(token)

        return reduce_float_fast

    def reduce(acc: np.ndarray, x: np.ndarray) -> None:
        ufunc(acc, x, out=acc)

    return reduce


# The ops whose pairwise step gives the same bits whichever operand comes first, per dtype family:
# every integer and bool op (wrapping arithmetic, bitwise logic, exact MIN/MAX); for floats the
# additions and products (IEEE 754 rounds the exact result, whatever the order: only which of two
# NaNs' payloads comes out may differ), not MIN/MAX (-0.0 against 0.0 gives one operand or the
# other); complex numbers have only the additions.
_ADDITIONS = frozenset({RedOpType.SUM, RedOpType.AVG, RedOpType.PREMUL_SUM})
_COMMUTING = {"float": _ADDITIONS | {RedOpType.PRODUCT}, "complex": _ADDITIONS}


def commutes(op, dtype: DType) -> bool:
    """Whether ``reducer(op, dtype)`` folds x into y to the very bits it folds y into x: then an
    algorithm may reduce two copies in either order (at two ranks, each into its own copy) and stay
    bit for bit the rank-order result."""
    family = _COMMUTING.get(dtype.kind)
    return family is None or op_type(op) in family


def sequence_reducer(op, dtype: DType) -> Callable[[np.ndarray, Sequence[np.ndarray]], None]:
    """``fn(acc, xs)``: ``acc ⊕= x`` for each x of ``xs`` in order, as ``reducer(op, dtype)`` called
    once per x (the naive form beside it), with numpy's error state switched once per call instead
    of once per x: the latency path reduces p tiny copies, where each switch costs as much as an add."""
    red = reducer(op, dtype)
    if _extobj_contextvar is None or dtype.kind not in ("float", "complex") or _is_bfloat16(dtype):

        def reduce_each(acc: np.ndarray, xs: Sequence[np.ndarray]) -> None:
            for x in xs:
                red(acc, x)

        return reduce_each
    ufunc = _NUMERIC[op_type(op)]

    def reduce_all_quietly(acc: np.ndarray, xs: Sequence[np.ndarray], _set=_extobj_contextvar.set,
                           _reset=_extobj_contextvar.reset, _state=_QUIET_STATE) -> None:
        token = _set(_state)
        try:
            for x in xs:
                ufunc(acc, x, out=acc)
        finally:
            _reset(token)

    return reduce_all_quietly


def _factor_value(factor):
    """PREMUL_SUM's factor as a Python number (it may be a number or a one-element tensor/array)."""
    if hasattr(factor, "numel") or isinstance(factor, np.ndarray):
        size = factor.numel() if hasattr(factor, "numel") else factor.size
        if size != 1:
            raise ValueError(f"PREMUL_SUM's factor must be a number or a one-element tensor, got {size} elements")
        return factor.item()
    if isinstance(factor, np.generic):
        return factor.item()
    if isinstance(factor, (bool, int, float, complex)):
        return factor
    raise TypeError(f"PREMUL_SUM's factor must be a number or a one-element tensor, got {type(factor).__name__}")


def premultiply(op, buf: np.ndarray, dtype: DType | None = None) -> None:
    """For PREMUL_SUM, multiply ``buf`` in place by the factor; other ops leave it alone.

    The factor is converted to the buffer's dtype first (integers truncate toward zero, floats
    round), as NCCL does. ``dtype`` must be given for bfloat16 (its storage is uint16).
    """
    if op.__class__ is RedOpType:  # the common case, without normalising
        return
    op = normalize_op(op)
    if not isinstance(op, PremulSum):
        return
    dtype = _dtype_of(buf, dtype)
    check_supported(op, dtype)
    value = _factor_value(op.factor)
    if isinstance(value, complex) and dtype.kind != "complex":
        raise TypeError(f"PREMUL_SUM's factor {value} is complex but the tensor is {dtype.name}")
    with _quiet():
        if _is_bfloat16(dtype):
            scale = from_bfloat16_bits(to_bfloat16_bits([value]))[0]
            _bf16_apply(lambda a, _: np.multiply(a, scale, out=a), buf, None)
        elif isinstance(value, complex):
            np.multiply(buf, np.array(value).astype(buf.dtype)[()], out=buf)
        else:
            real = _real_view(buf)
            np.multiply(real, np.array(value).astype(real.dtype)[()], out=real)


def finish(op, buf: np.ndarray, world_size: int, dtype: DType | None = None) -> None:
    """For AVG, divide the sum in ``buf`` by ``world_size`` in place; other ops leave it alone.

    Floats use true division (bit-identical to torch's ``div_``; a multiply by the exact 1/p when p
    is a power of two); integers truncate toward zero
    (NCCL's rule; -7 / 2 == -3). ``dtype`` must be given for bfloat16 (its storage is uint16).
    """
    if op is not RedOpType.AVG and (op.__class__ is RedOpType or op_type(op) is not RedOpType.AVG):
        return
    if world_size == 1:
        return
    dtype = _dtype_of(buf, dtype)
    check_supported(op, dtype)
    if _is_bfloat16(dtype):
        with _quiet():
            _bf16_apply(lambda a, _: np.divide(a, np.float32(world_size), out=a), buf, None)
    elif dtype.kind in ("float", "complex"):
        with _quiet():
            real = _real_view(buf)
            if world_size & (world_size - 1) == 0:
                # x * 2^-k is x / 2^k rounded the same way (1/2^k is exact), and a multiply is
                # several times cheaper than a divide
                np.multiply(real, 1.0 / world_size, out=real)
            else:
                np.divide(real, world_size, out=real)
    elif dtype.kind == "uint":
        np.floor_divide(buf, world_size, out=buf)
    else:
        _truncating_divide(buf, world_size)


def with_op_arithmetic(op, dtype: DType, size: int, buf: np.ndarray, run: Callable[[np.ndarray], None], *,
                       result: np.ndarray | None = None, keep: bool = False, finishes: bool = True) -> None:
    """Run a reduction, ``run(buf)``, with what ``op`` adds around it: the one place every engine's
    collectives apply PREMUL_SUM and AVG.

    PREMUL_SUM's factor multiplies ``buf`` first (a copy of it when ``keep``: an input the caller
    must find unscaled, like a non-root's in reduce); AVG divides the result by ``size`` afterwards
    (``result``, by default the buffer reduced), when ``finishes`` (not on a reduce's non-roots).
    """
    if op.__class__ is not RedOpType:
        if keep and isinstance(normalize_op(op), PremulSum):
            buf = buf.copy()
        premultiply(op, buf, dtype)
    run(buf)
    if finishes:
        finish(op, buf if result is None else result, size, dtype)


def _truncating_divide(buf: np.ndarray, n: int) -> None:
    """buf //= n rounding toward zero, for signed integers (n > 0), chunk by chunk."""
    if n > np.iinfo(buf.dtype).max:  # only -min // n can be nonzero: compute in int64
        for start in range(0, buf.size, CHUNK):
            part = buf[start : start + CHUNK]
            wide = part.astype(np.int64)
            part[...] = (wide - np.fmod(wide, n)) // n
        return
    for start in range(0, buf.size, CHUNK):
        part = buf[start : start + CHUNK]
        # part - fmod(part, n) is an exact multiple of n lying between 0 and part: no overflow.
        np.subtract(part, np.fmod(part, n), out=part)
        np.floor_divide(part, n, out=part)
