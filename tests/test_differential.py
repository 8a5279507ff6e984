"""Differential tests: the same scripted cases through torch.distributed (gloo) and distcomm.

For each world size (2, 3, 4) one world of processes runs every case of tests/diff_cases.py
several times in a row — torch.distributed on gloo (the oracle, torch==2.13.0), then distcomm with
backend "gloo" (its default engine), with backend "tcp", and with "tcp" forced onto its other
algorithms (diff_cases.ENGINE_VARIANTS) — so torch is imported once per process. The
parent compares the outputs case by case and rank by rank; each (world size, engine, case) is its
own test item, so a failure names the case, the rank and the first differing element.

Where torch's gloo cannot run a case, distcomm is compared with a reference computed here from the
same deterministic inputs (torch's elementwise operators, not distcomm's code):

* all_reduce with AVG on integer dtypes (sum, then truncating division, as NCCL does), PREMUL_SUM
  (factor converted to the dtype — truncated for integers — then multiplied in, then summed),
  and any op on int16 (gloo: "Invalid scalar type");
* all_gather_into_tensor / reduce_scatter_tensor with the stacked (world_size, ...) layout (gloo
  accepts only the concatenated one);
* all_to_all with different sizes per pair (gloo's list form wants equal sizes).

Deliberate differences checked as distcomm's own semantics:

* reduce: gloo leaves partial results in non-root tensors (the docs do not promise their content);
  distcomm leaves them exactly as they were. Roots are compared with torch.
* When torch raises, distcomm must raise the same kind of error (ValueError, TypeError or
  RuntimeError — every DistError is a RuntimeError, as torch's are).
"""

from __future__ import annotations

import functools
import os
import pickle
import re

import numpy as np
import pytest
import torch

import diff_cases as dc
from harness import free_port, run_world

WORLD_SIZES = [2, 3, 4]
ENGINES = list(dc.ENGINE_VARIANTS)  # distcomm backends (and forced algorithms) compared with gloo
WORLD_TIMEOUT = 420  # seconds for a whole world (every case, three frameworks); generous: shared machine

# (world size, engine, case) -> reason, for distcomm bugs owned by others (see the report);
# strict, so a fix makes the test fail until the entry is removed.
XFAIL: dict[tuple, str] = {}


@functools.lru_cache(maxsize=None)
def world_results(ws: int):
    plans = [("torch", "gloo", free_port())] + [("distcomm", e, free_port()) for e in ENGINES]
    try:
        per_rank = run_world(dc.run_plans, ws, args=(plans,), timeout=WORLD_TIMEOUT)
    except Exception as exc:  # noqa: BLE001 - every case of this world reports it
        return exc
    if os.environ.get("DIFF_DUMP"):  # for a post-mortem: DIFF_DUMP=/tmp/dir pytest ...
        with open(os.path.join(os.environ["DIFF_DUMP"], f"world{ws}.pkl"), "wb") as f:
            pickle.dump(per_rank, f)
    return per_rank


def _items():
    for ws in WORLD_SIZES:
        for case in dc.cases(ws):
            names = [case.name] + ([case.name + "@np"] if case.numpy else [])
            for engine in ENGINES:
                for name in names:
                    marks = []
                    reason = XFAIL.get((ws, engine, name)) or XFAIL.get((None, engine, name)) or XFAIL.get(
                        (None, None, name))
                    if reason:
                        marks.append(pytest.mark.xfail(strict=True, reason=reason))
                    yield pytest.param(ws, engine, name, case, id=f"ws{ws}-{engine}-{name}", marks=marks)


@pytest.mark.parametrize("ws,engine,name,case", list(_items()))
def test_differential(ws, engine, name, case):
    results = world_results(ws)
    if isinstance(results, Exception):
        raise AssertionError(f"the world of {ws} failed: {results}")
    problems = []
    for rank in range(ws):
        torch_side = results[rank]["torch:gloo"]
        ours_side = results[rank][f"distcomm:{engine}"]
        if isinstance(torch_side, str):
            raise AssertionError(f"torch's run failed on rank {rank}: {torch_side}")
        if isinstance(ours_side, str):
            raise AssertionError(f"distcomm's run ({engine}) failed on rank {rank}: {ours_side}")
        expected = torch_side[case.name]
        got = ours_side[name]
        problem = compare(case, ws, rank, expected, got)
        if problem:
            problems.append(f"rank {rank}: {problem}")
    assert not problems, f"{name} at world size {ws} on distcomm:{engine}:\n" + "\n".join(problems)


@pytest.mark.parametrize("ws", WORLD_SIZES)
def test_oracle_stayed_in_step(ws):
    """torch's own run had no timeouts or lost connections: otherwise every case after the first
    would differ for a reason that is not distcomm's (this names the first)."""
    results = world_results(ws)
    if isinstance(results, Exception):
        raise AssertionError(f"the world of {ws} failed: {results}")
    for rank in range(ws):
        side = results[rank]["torch:gloo"]
        assert not isinstance(side, str), side
        broken = [(name, v[3]) for name, v in side.items() if not name.startswith("__") and v[0] == "error"
                  and re.search(r"[Tt]imeout|[Tt]imed out|[Cc]losed|closure|#barrier", v[3] + name)]
        assert not broken, f"rank {rank}: torch's run went out of step at {broken[0]}"


# -- comparison --------------------------------------------------------------------------------------
def compare(case: dc.Case, ws: int, rank: int, expected, got) -> str | None:
    meta = case.meta or {}
    if meta.get("kind") == "reduce":
        return compare_reduce(expected, got)
    if expected[0] == "error":
        reference = reference_for(case, ws, rank)
        if reference is not None:  # distcomm does what gloo refuses
            if got[0] != "ok":
                return f"expected a result (gloo refuses it: {expected[3]!r}), got {got[1]} {got[3]!r}"
            return dc.diff(dc.plain(reference), got[1])
        if got[0] != "error":
            return f"torch raised {expected[2]} ({expected[3]!r}), distcomm returned {dc._short(got[1])}"
        if got[1] != expected[1]:
            return (f"torch raised a {expected[1]} ({expected[2]}: {expected[3]!r}), distcomm a {got[1]} "
                    f"({got[2]}: {got[3]!r})")
        return None
    if got[0] != "ok":
        return f"distcomm raised {got[2]}: {got[3]}"
    return dc.diff(expected[1], got[1])


def compare_reduce(expected, got) -> str | None:
    if expected[0] != "ok":
        return f"torch raised {expected[2]}: {expected[3]}"
    if got[0] != "ok":
        return f"distcomm raised {got[2]}: {got[3]}"
    e, g = expected[1], got[1]
    if g["ret"] is not None:
        return f"reduce returned {g['ret']!r}, expected None"
    if e["root"]:
        return dc.diff(e["t"], g["t"], "root result")
    # Not the root: gloo leaves partial sums there; distcomm leaves the input untouched.
    return dc.diff(g["before"], g["t"], "non-root tensor (must be unchanged)")


# -- references for what gloo refuses ------------------------------------------------------------------
def _tensor(a: np.ndarray, dtype: str) -> torch.Tensor:
    return torch.from_numpy(np.array(a, dtype=dc.np_dtype(dtype))).to(getattr(torch, dtype))


def reduction_defined(op: str, dtype: str) -> bool:
    fam = dc.family(dtype)
    if fam == "complex" and op in dc.BITWISE | {"PRODUCT", "MIN", "MAX"}:
        return False
    if fam == "float" and op in dc.BITWISE:
        return False
    if fam == "bool" and op in ("AVG", "PREMUL_SUM"):
        return False
    return True


def reduce_reference(op: str, dtype: str, xs: list[torch.Tensor], ws: int) -> torch.Tensor:
    """The documented result of reducing ``xs`` with ``op`` (torch elementwise ops, in rank order)."""
    fam = dc.family(dtype)
    tdtype = getattr(torch, dtype)
    if op == "PREMUL_SUM":
        if fam == "int":
            factor = torch.tensor(int(dc.PREMUL_FACTOR_INT), dtype=tdtype)  # truncated to the dtype
        elif fam == "complex":
            factor = dc.PREMUL_FACTOR_FLOAT  # a real factor scales both components
        else:
            factor = torch.tensor(dc.PREMUL_FACTOR_FLOAT, dtype=tdtype)
        xs = [x * factor for x in xs]
    fn = {
        "SUM": torch.add, "AVG": torch.add, "PREMUL_SUM": torch.add, "PRODUCT": torch.mul,
        "MIN": torch.minimum, "MAX": torch.maximum, "BAND": torch.bitwise_and, "BOR": torch.bitwise_or,
        "BXOR": torch.bitwise_xor,
    }[op]
    if fam == "bool":
        fn = {"SUM": torch.logical_or, "PRODUCT": torch.logical_and, "MIN": torch.logical_and,
              "MAX": torch.logical_or, "BAND": torch.logical_and, "BOR": torch.logical_or,
              "BXOR": torch.logical_xor}[op]
    acc = xs[0].clone()
    for x in xs[1:]:
        acc = fn(acc, x).to(tdtype)
    if op == "AVG":
        if fam == "int":
            acc = torch.div(acc, ws, rounding_mode="trunc").to(tdtype)
        elif fam == "complex":
            acc = torch.view_as_complex(torch.view_as_real(acc) / ws)
        else:
            acc = acc / ws
    return acc


def reference_for(case: dc.Case, ws: int, rank: int):
    """distcomm's documented result where gloo raises, or None when distcomm must raise too."""
    name, key = case.name, case.key
    meta = case.meta or {}
    if name.startswith("all_reduce/") and "op" in meta:
        op, dtype = meta["op"], meta["dtype"]
        if not reduction_defined(op, dtype):
            return None
        xs = [_tensor(dc.gen(key, r, meta["shape"], dtype, dc.kind_for(op)), dtype) for r in range(ws)]
        return {"ret": None, "t": reduce_reference(op, dtype, xs, ws)}
    if name.startswith(("all_gather_into_tensor/stack/", "all_gather_single/stack/")):
        dtype = name.rsplit("/", 1)[1]
        out = torch.stack([_tensor(dc.gen(key, r, (2, 3), dtype), dtype) for r in range(ws)])
        return {"ret": None, "out": out}
    if name.startswith(("reduce_scatter_tensor/stack/", "reduce_scatter_single/stack/")):
        op, dtype = name.split("/")[2:4]
        xs = [_tensor(dc.gen(key, r, (ws, 2, 3), dtype, dc.kind_for(op)), dtype)[rank] for r in range(ws)]
        inp = _tensor(dc.gen(key, rank, (ws, 2, 3), dtype, dc.kind_for(op)), dtype)
        return {"ret": None, "out": reduce_reference(op, dtype, xs, ws), "inp": inp}
    if name == "all_to_all/uneven":
        return [_tensor(dc.gen(key + str(rank), j, dc._a2a_split(j, rank), "float32"), "float32")
                for j in range(ws)]
    return None
