"""Reductions (distcomm.reduction): which (op, dtype) pairs work, and bit-exactness against torch.

* every op x dtype either works or raises the documented error, with torch's exception type;
* reducer() against torch's own elementwise operators on the same inputs (special values included);
* premultiply / finish against torch's mul / div;
* bfloat16 rounding against torch's conversion on random bit patterns;
* one real 2-process torch.distributed gloo all_reduce for bool, integer overflow, float16 and
  bfloat16 semantics (tests/harness.py run_world), slow: both processes import torch (the fast
  tier, ``pytest -m "not slow"``, meets gloo in test_differential's world of 2 instead).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from distcomm import reduction as R
from distcomm.dtypes import BY_NAME, from_name
from distcomm.errors import DistBackendError
from distcomm.types import ReduceOp, RedOpType
from harness import run_world

OPS = [RedOpType.SUM, RedOpType.AVG, RedOpType.PRODUCT, RedOpType.MIN, RedOpType.MAX,
       RedOpType.BAND, RedOpType.BOR, RedOpType.BXOR, RedOpType.PREMUL_SUM]
BITWISE = {RedOpType.BAND, RedOpType.BOR, RedOpType.BXOR}
ALL_DTYPES = sorted(BY_NAME)
TORCH_OP = {
    RedOpType.SUM: torch.add,
    RedOpType.AVG: torch.add,
    RedOpType.PREMUL_SUM: torch.add,
    RedOpType.PRODUCT: torch.mul,
    RedOpType.MIN: torch.minimum,
    RedOpType.MAX: torch.maximum,
    RedOpType.BAND: torch.bitwise_and,
    RedOpType.BOR: torch.bitwise_or,
    RedOpType.BXOR: torch.bitwise_xor,
}


def as_op(kind: RedOpType):
    return ReduceOp.PREMUL_SUM(2.0) if kind is RedOpType.PREMUL_SUM else kind


def expected_error(kind: RedOpType, dtype_name: str):
    """The documented error for (op, dtype), or None when it is supported."""
    family = from_name(dtype_name).kind
    if family == "complex" and kind in BITWISE | {RedOpType.PRODUCT, RedOpType.MIN, RedOpType.MAX}:
        return ValueError
    if family == "float" and kind in BITWISE:
        return DistBackendError
    if family == "bool" and kind in (RedOpType.AVG, RedOpType.PREMUL_SUM):
        return DistBackendError
    return None


def to_torch(a: np.ndarray, dtype_name: str) -> torch.Tensor:
    """The tensor torch.distributed's gloo reduces: bfloat16 as itself, complex via view_as_real."""
    t = torch.from_numpy(a.copy())
    if t.is_complex():
        return torch.view_as_real(t)
    return t.view(torch.bfloat16) if dtype_name == "bfloat16" else t


def to_numpy(t: torch.Tensor, dtype_name: str) -> np.ndarray:
    if dtype_name.startswith("complex"):
        return torch.view_as_complex(t.contiguous()).numpy()
    return (t.view(torch.uint16) if dtype_name == "bfloat16" else t).numpy()


def sample(dtype_name: str, n: int, seed: int) -> np.ndarray:
    """Random values including the awkward ones: overflow, NaN, inf, -0.0, subnormals."""
    rng = np.random.default_rng(seed)
    dtype = from_name(dtype_name)
    if dtype.kind == "bool":
        return rng.random(n) < 0.5
    if dtype.kind in ("int", "uint"):
        info = np.iinfo(dtype.storage)
        edge = np.array([info.min, info.max, 0, 1, -1 if info.min < 0 else 2], dtype=dtype.storage)
        return np.concatenate([edge, rng.integers(info.min, info.max, n - edge.size, dtype=dtype.storage, endpoint=True)])
    special = [np.nan, np.inf, -np.inf, -0.0, 0.0, 1e-40, 65504.0, 3e38, -3e38, 1.0]
    values = np.concatenate([special, rng.standard_normal(n - len(special)) * 10.0 ** rng.integers(-3, 4, n - len(special))])
    if dtype_name == "bfloat16":
        return R.to_bfloat16_bits(values)
    if dtype.kind == "complex":
        out = np.empty(n, dtype.storage)
        out.real, out.imag = values, rng.permutation(values)
        return out
    with np.errstate(over="ignore"):
        return values.astype(dtype.storage)


def assert_bits_equal(got: np.ndarray, want: np.ndarray, dtype_name: str) -> None:
    """Bit-identical, except that any NaN matches any NaN (payloads are not specified)."""
    assert got.dtype == want.dtype
    kind = from_name(dtype_name).kind
    if kind == "bool":  # compare truth values: gloo's bool SUM leaves the byte 2 for True + True
        got, want = got.view(np.uint8) != 0, want.view(np.uint8) != 0
    if kind in ("float", "complex"):
        g = R.from_bfloat16_bits(got) if dtype_name == "bfloat16" else got
        w = R.from_bfloat16_bits(want) if dtype_name == "bfloat16" else want
        g, w = (g.view(g.real.dtype), w.view(w.real.dtype)) if kind == "complex" else (g, w)
        nan = np.isnan(w)
        np.testing.assert_array_equal(np.isnan(g), nan)
        got, want = g[~nan], w[~nan]
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


# -- which pairs exist -----------------------------------------------------------------------------
@pytest.mark.parametrize("dtype_name", ALL_DTYPES)
@pytest.mark.parametrize("kind", OPS, ids=lambda k: k.name)
def test_every_op_and_dtype_works_or_raises_documented_error(kind, dtype_name):
    dtype = from_name(dtype_name)
    err = expected_error(kind, dtype_name)
    if err is not None:
        with pytest.raises(err, match=kind.name):
            R.check_supported(as_op(kind), dtype)
        with pytest.raises(err):
            R.reducer(as_op(kind), dtype)
        return
    R.check_supported(as_op(kind), dtype)
    acc, x = sample(dtype_name, 64, 1), sample(dtype_name, 64, 2)
    R.reducer(as_op(kind), dtype)(acc, x)  # runs; values checked below


def test_error_types_match_torch_except_clauses():
    # torch raises ValueError (complex, checked in Python) and RuntimeError (gloo, bitwise on floats)
    with pytest.raises(ValueError, match="all_reduce does not support ReduceOp.MAX on complex tensors"):
        R.check_supported(ReduceOp.MAX, from_name("complex64"))
    with pytest.raises(RuntimeError, match="Cannot use ReduceOp.BAND with non-integral dtype float32"):
        R.check_supported(ReduceOp.BAND, from_name("float32"))
    with pytest.raises(RuntimeError, match="ReduceOp.AVG with bool"):
        R.check_supported(ReduceOp.AVG, from_name("bool"))
    with pytest.raises(ValueError, match="reduce_scatter does not support ReduceOp.PRODUCT"):
        R.check_supported("product", from_name("complex128"), collective="reduce_scatter")
    with pytest.raises(ValueError, match="UNUSED"):
        R.check_supported(ReduceOp.UNUSED, from_name("float32"))
    # torch's own enum is accepted
    R.check_supported(torch.distributed.ReduceOp.SUM, from_name("float32"))


# -- values against torch's elementwise operators ----------------------------------------------------
@pytest.mark.parametrize("dtype_name", ALL_DTYPES)
def test_reducer_matches_torch_elementwise(dtype_name):
    dtype = from_name(dtype_name)
    for kind in OPS:
        if expected_error(kind, dtype_name) is not None:
            continue
        a, b = sample(dtype_name, 4099, 3), sample(dtype_name, 4099, 4)
        got = a.copy()
        R.reducer(as_op(kind), dtype)(got, b)
        try:
            want = to_numpy(TORCH_OP[kind](to_torch(a, dtype_name), to_torch(b, dtype_name)), dtype_name)
        except (NotImplementedError, RuntimeError):  # torch's limited uint16/32/64: modular ints
            bits = 8 * dtype.storage.itemsize
            py = {RedOpType.SUM: lambda x, y: x + y, RedOpType.AVG: lambda x, y: x + y,
                  RedOpType.PREMUL_SUM: lambda x, y: x + y, RedOpType.PRODUCT: lambda x, y: x * y,
                  RedOpType.MIN: min, RedOpType.MAX: max}[kind]
            want = np.array([py(int(x), int(y)) % (1 << bits) for x, y in zip(a, b)], dtype=dtype.storage)
        assert_bits_equal(got, want, dtype_name)


def test_bfloat16_reduction_spans_chunks():
    n = 3 * R.CHUNK + 17
    a, b = sample("bfloat16", n, 5), sample("bfloat16", n, 6)
    got = a.copy()
    R.reducer(ReduceOp.SUM, from_name("bfloat16"))(got, b)
    assert_bits_equal(got, to_numpy(to_torch(a, "bfloat16") + to_torch(b, "bfloat16"), "bfloat16"), "bfloat16")


def test_bfloat16_rounding_matches_torch_on_random_bit_patterns():
    bits = np.random.default_rng(7).integers(0, 1 << 32, 1 << 18, dtype=np.uint64).astype(np.uint32)
    bits[:6] = [0x3F808000, 0x3F818000, 0x3F80FFFF, 0x7F7FFFFF, 0x00008000, 0xFFFFFFFF]  # ties, overflow, NaN
    values = bits.view(np.float32)
    got = R.to_bfloat16_bits(values)
    want = torch.from_numpy(values.copy()).bfloat16().view(torch.uint16).numpy()
    assert_bits_equal(got, want, "bfloat16")
    ok = ~np.isnan(values)
    np.testing.assert_array_equal(got[ok], want[ok])
    assert (got[np.isnan(values)] == 0x7FC0).all()  # c10's canonical NaN
    assert_bits_equal(R.from_bfloat16_bits(want), torch.from_numpy(want.copy()).view(torch.bfloat16).float().numpy(), "float32")


def test_bool_semantics():
    a = np.array([True, True, False, False])
    b = np.array([True, False, True, False])
    expect = {"SUM": [1, 1, 1, 0], "PRODUCT": [1, 0, 0, 0], "MIN": [1, 0, 0, 0], "MAX": [1, 1, 1, 0],
              "BAND": [1, 0, 0, 0], "BOR": [1, 1, 1, 0], "BXOR": [0, 1, 1, 0]}
    for name, want in expect.items():
        got = a.copy()
        R.reducer(name, from_name("bool"))(got, b)
        assert got.tolist() == [bool(v) for v in want], name
        assert got.view(np.uint8).max() <= 1  # canonical bytes (gloo's SUM can leave a 2)


def test_integer_overflow_wraps_silently():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        acc = np.array([2**31 - 1, -(2**31)], np.int32)
        R.reducer("sum", from_name("int32"))(acc, np.array([1, -1], np.int32))
        assert acc.tolist() == [-(2**31), 2**31 - 1]
        acc = np.array([3e38], np.float32)
        R.reducer("sum", from_name("float32"))(acc, acc.copy())  # overflow to inf: no warning
        assert np.isinf(acc[0])


def test_reducers_restore_the_callers_error_state():
    """The reducers silence float warnings only while they run (and also when a reduction fails)."""
    with np.errstate(over="raise", invalid="warn"):
        before = np.geterr()
        acc = np.array([3e38], np.float32)
        R.reducer("sum", from_name("float32"))(acc, acc.copy())
        assert np.geterr() == before
        with pytest.raises(ValueError):  # a shape mismatch raises inside the quiet section
            R.reducer("sum", from_name("float64"))(np.zeros(2), np.zeros(3))
        assert np.geterr() == before
        with pytest.raises(FloatingPointError):
            np.multiply(np.float32(3e38), np.float32(10))


# -- PREMUL_SUM and AVG ----------------------------------------------------------------------------
@pytest.mark.parametrize("dtype_name", [d for d in ALL_DTYPES if d != "bool" and not d.startswith("uint") or d == "uint8"])
@pytest.mark.parametrize("factor", [2.5, -0.3, 3])
def test_premultiply_matches_torch(dtype_name, factor):
    buf = sample(dtype_name, 257, 8)
    got = buf.copy()
    R.premultiply(ReduceOp.PREMUL_SUM(factor), got, dtype=from_name(dtype_name))
    t = to_torch(buf, dtype_name)
    scale = torch.tensor(factor, dtype=torch.float64).to(t.dtype)  # the factor is converted to the dtype first, as NCCL does
    want = to_numpy(t * scale, dtype_name)
    assert_bits_equal(got, want, dtype_name)


def test_premultiply_factor_forms():
    for factor in (2.0, torch.tensor([2.0]), torch.tensor(2.0), np.array([2.0]), np.float32(2.0)):
        buf = np.array([1.0, -3.0], np.float32)
        R.premultiply(ReduceOp.PREMUL_SUM(factor), buf)
        assert buf.tolist() == [2.0, -6.0]
    buf = np.array([1.0], np.float32)
    R.premultiply(ReduceOp.SUM, buf)  # not PREMUL_SUM: unchanged
    assert buf.tolist() == [1.0]
    with pytest.raises(ValueError, match="one-element"):
        R.premultiply(ReduceOp.PREMUL_SUM(torch.tensor([1.0, 2.0])), buf)
    with pytest.raises(TypeError, match="complex"):
        R.premultiply(ReduceOp.PREMUL_SUM(1j), buf)
    with pytest.raises(TypeError):
        R.premultiply(ReduceOp.PREMUL_SUM("2"), buf)
    with pytest.raises(RuntimeError, match="bool"):
        R.premultiply(ReduceOp.PREMUL_SUM(2.0), np.array([True]))
    c = np.array([1 + 1j], np.complex64)
    R.premultiply(ReduceOp.PREMUL_SUM(1j), c)
    assert c.tolist() == [-1 + 1j]


@pytest.mark.parametrize("dtype_name", [d for d in ALL_DTYPES if d != "bool"])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 7, 8])
def test_finish_avg_matches_torch_division(dtype_name, world_size):
    buf = sample(dtype_name, 2 * R.CHUNK + 5, 9)
    got = buf.copy()
    R.finish(ReduceOp.AVG, got, world_size, dtype=from_name(dtype_name))
    kind = from_name(dtype_name).kind
    if kind in ("int", "uint"):
        # truncation toward zero, as NCCL (torch's gloo refuses AVG on integers)
        want = np.array([(abs(v) // world_size) * (1 if v >= 0 else -1) for v in buf.tolist()], dtype=buf.dtype)
        if dtype_name in ("int32", "int8", "int16", "uint8"):
            want_t = torch.div(torch.from_numpy(buf.copy()), world_size, rounding_mode="trunc").numpy()
            np.testing.assert_array_equal(got, want_t)
    else:
        want = to_numpy(to_torch(buf, dtype_name).div_(world_size), dtype_name)  # gloo's AVG: sum, then div_
    assert_bits_equal(got, want, dtype_name)
    other = buf.copy()
    R.finish(ReduceOp.SUM, other, world_size, dtype=from_name(dtype_name))
    assert_bits_equal(other, buf, dtype_name)


def test_truncating_average_edge_cases():
    buf = np.array([7, -7, -8, 127, -128, 0, -1], np.int8)
    R.finish("avg", buf, 2)
    assert buf.tolist() == [3, -3, -4, 63, -64, 0, 0]
    buf = np.array([-128, 127, -127], np.int8)
    R.finish("avg", buf, 128)  # world size beyond the dtype's range
    assert buf.tolist() == [-1, 0, 0]
    buf = np.array([-(2**63), 2**63 - 1], np.int64)
    R.finish("avg", buf, 3)
    assert buf.tolist() == [-(2**63) // 3 + 1, (2**63 - 1) // 3]


# -- a real torch.distributed gloo all_reduce ---------------------------------------------------------
def _gloo_rank(rank, world_size):
    import torch.distributed as dist

    dist.init_process_group("gloo")
    cases = {}
    bools = [torch.tensor([True, True, False, False]), torch.tensor([True, False, True, False])]
    for op in ("SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"):
        cases[("bool", op)] = bools[rank].clone()
    cases[("int32", "SUM")] = torch.tensor([2**31 - 1, -(2**31), 5], dtype=torch.int32)
    cases[("int8", "PRODUCT")] = torch.tensor([100, -128, 3], dtype=torch.int8)
    cases[("uint8", "SUM")] = torch.tensor([200, 255, 1], dtype=torch.uint8)
    cases[("int64", "BXOR")] = torch.tensor([-1, 2**62, 12345], dtype=torch.int64) * (rank + 1)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(1000, generator=g) * 100
    x[:3] = torch.tensor([3e38, -3e38, 1e-40])
    cases[("bfloat16", "SUM")] = x.bfloat16()
    cases[("bfloat16", "MAX")] = x.bfloat16()
    cases[("bfloat16", "AVG")] = x.bfloat16()
    cases[("bfloat16", "PRODUCT")] = x.bfloat16()
    cases[("float16", "SUM")] = (x / 10).half()
    cases[("float32", "AVG")] = x.clone()
    inputs = {k: v.clone() for k, v in cases.items()}
    for (_, op), t in cases.items():
        dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
    dist.destroy_process_group()
    return {k: (to_numpy(inputs[k], k[0]), to_numpy(cases[k], k[0])) for k in cases}


@pytest.mark.slow
def test_semantics_match_torch_gloo_all_reduce():
    """bool ops, integer wrap, float16/bfloat16 rounding and AVG against a real 2-process gloo world."""
    results = run_world(_gloo_rank, 2, timeout=120)
    for key in results[0]:
        dtype_name, op = key
        dtype = from_name(dtype_name)
        x0, gloo0 = results[0][key]
        x1, gloo1 = results[1][key]
        assert_bits_equal(gloo0, gloo1, dtype_name)
        got = x0.copy()
        R.reducer(op, dtype)(got, x1)
        R.finish(op, got, 2, dtype=dtype)
        assert_bits_equal(got, gloo0, dtype_name)


# -- which reductions may run in either order ------------------------------------------------------
@pytest.mark.parametrize("dtype_name", ALL_DTYPES)
@pytest.mark.parametrize("kind", OPS, ids=lambda k: k.name)
def test_commutes_only_where_either_order_gives_the_same_bits(kind, dtype_name):
    """``commutes`` lets the two-rank single-copy all_reduce fold each rank's peer into its own
    copy: where it says so, x ⊕ y and y ⊕ x must agree bit for bit on the awkward values (NaN
    payloads aside, as everywhere); float MIN/MAX, which it excludes, really differ (on -0.0 vs 0.0)."""
    if expected_error(kind, dtype_name) is not None:
        return
    dtype = from_name(dtype_name)
    red = R.reducer(as_op(kind), dtype)
    x, y = sample(dtype_name, 257, 1), sample(dtype_name, 257, 2)
    head = x[:10]  # the special values (edges, for integers), then every pair of them
    x, y = np.concatenate([x, np.repeat(head, head.size)]), np.concatenate([y, np.tile(head, head.size)])
    xy, yx = x.copy(), y.copy()
    red(xy, y)
    red(yx, x)
    if R.commutes(as_op(kind), dtype):
        assert_bits_equal(xy, yx, dtype_name)
    else:
        assert dtype.kind == "float" and kind in (RedOpType.MIN, RedOpType.MAX)
        neg, pos = np.zeros(1, dtype.storage), np.zeros(1, dtype.storage)
        neg[...] = R.to_bfloat16_bits([-0.0]) if dtype_name == "bfloat16" else -0.0
        a, b = neg.copy(), pos.copy()
        red(a, pos)
        red(b, neg)
        assert a.view(np.uint8).tobytes() != b.view(np.uint8).tobytes()
