"""Differential tests: the same scripted cases through torch.distributed (gloo) and distcomm.

For each world size (2, 3, 4) one world of processes runs every case of tests/diff_cases.py
several times in a row — torch.distributed on gloo (the oracle, torch==2.13.0), then distcomm with
backend "gloo" (its default engine: shared memory on one host), with backend "tcp", with "tcp"
forced onto its other algorithms, with backend "shm", and with "shm" forced onto each of its
algorithms (diff_cases.ENGINE_VARIANTS) — so torch is imported once per process. The parent
compares the outputs case by case and rank by rank; each (world size, engine, case) is its own
test item (the case on tensors and on numpy arrays), so a failure names the case, the rank and the
first differing element.

World sizes 5 to 8 (oversubscribed on a small machine) run the shared-memory engines only, on a
reduced set of cases (diff_cases.reduced_cases: rooted cases with the last rank as root,
all_reduce's op table on four dtypes, no aliases), against torch as well; the "shm/direct" variant
runs the all_reduce cases only (diff_cases.VARIANT_CASES). One spawn runs, in turn, every world the
selected tests need, with only the engines they need (diff_cases.run_worlds): 8 processes and
seven worlds for the whole module, so torch is imported once per process.
test_shm_variants_ran checks, from counters kept in every rank, that each forced variant really
ran the algorithms it names (the variables are read at init_process_group, per plan).

The fast tier (``pytest -m "not slow"``) keeps world size 2 on the default engine and on "tcp"
(FAST): every case, against torch, in one spawn of 2 processes. The other worlds and engine
variants are marked slow.

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

import os
import pickle
import random
import re
import socket

import numpy as np
import pytest
import torch

import diff_cases as dc
from harness import CONTEXT, free_port, run_world

WORLD_SIZES = [2, 3, 4]  # every case on every engine variant
ENGINES = list(dc.ENGINE_VARIANTS)  # distcomm backends (and forced algorithms) compared with gloo
LARGE_WORLD_SIZES = [5, 6, 7, 8]  # reduced cases (diff_cases.reduced_cases), no "@np" runs
# the default engine and "shm" by size (direct, slices, slots, single-copy past 4 MiB), and
# single-copy everywhere; the forced slots and small slots stay at 2-4 (hundreds of lockstep rounds
# are slow on 8 ranks sharing 2 cores)
LARGE_ENGINES = ["gloo", "shm", "shm/readv"]
WORLD_TIMEOUT = 420  # seconds for one world (every plan); generous: shared machine
TOTAL_TIMEOUT = 480  # seconds for all the worlds, one after the other in one spawn (about 2 min normally)
# (world size, engine) pairs in the fast tier: the default engine (shared memory on one host) and
# the tcp engine, every case. Starting the ranks and torch's own run are most of their cost, and a
# third engine or world would add to it for little: every other pair is marked slow.
FAST = {(2, "gloo"), (2, "tcp")}

# (world size, engine, case) -> reason, for distcomm bugs owned by others (see the report);
# strict, so a fix makes the test fail until the entry is removed.
XFAIL: dict[tuple, str] = {}


_handed_out: set[int] = set()


def plan_port() -> int:
    """A master port for one plan: free now, and below the kernel's ephemeral range, so that none
    of the thousands of connections made before the plan runs (minutes later, in a long spawn) can
    take it as its local port (free_port's ports are ephemeral ones: a rank 0 that found its port
    taken would leave the other ranks connected to someone else's store, and the worlds out of step)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return free_port()
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(max(1024, low - 12000), low)
        if port in _handed_out:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    return free_port()


def tier(ws: int, engine: str | None = None) -> list:
    """The marks of a test of world size ``ws`` on ``engine`` (None: of torch's run alone): slow
    unless the pair is in FAST (torch's run: unless some engine of that world size is)."""
    fast = any(w == ws and engine in (None, e) for w, e in FAST)
    return [] if fast else [pytest.mark.slow]


@pytest.fixture(scope="module")
def results_by_world(request):
    """{world size: per-rank results} for the worlds and engines this session's selected tests of
    this module need, from one spawn; or the exception of the spawn.

    Derived from the selection so that the fast tier (or a ``-k`` run) pays for its own worlds
    only, not for all seven."""
    wanted: dict[int, set[str]] = {}
    for item in request.session.items:
        params = item.callspec.params if item.module is request.module and hasattr(item, "callspec") else {}
        if "ws" in params:
            wanted.setdefault(params["ws"], set()).update([params["engine"]] if "engine" in params else [])
    return all_world_results(wanted)


def world_results(results_by_world, ws: int):
    """The per-rank results of the world of ``ws`` (a list by rank), or the exception of the run."""
    return results_by_world if isinstance(results_by_world, Exception) else results_by_world[ws]


def all_world_results(wanted: dict[int, set[str]]):
    """{world size: per-rank results} for the worlds in ``wanted`` ({world size: engines}; torch's
    run is always there), or the exception of the spawn.

    One spawn of as many processes as the largest world runs the worlds one after the other
    (diff_cases.run_worlds), the ranks above a world's size waiting: starting processes and
    importing torch is paid once, not once per world (on 2 cores, 8 torch imports take longer than
    running a world)."""
    nprocs = max(wanted)
    worlds = []
    for ws in WORLD_SIZES + LARGE_WORLD_SIZES:
        if ws not in wanted:
            continue
        engines = [e for e in (ENGINES if ws in WORLD_SIZES else LARGE_ENGINES) if e in wanted[ws]]
        plans = [("torch", "gloo", plan_port())] + [("distcomm", e, plan_port()) for e in engines]
        worlds.append((ws, plans, ws in LARGE_WORLD_SIZES, CONTEXT.Barrier(ws)))
    barrier = CONTEXT.Barrier(nprocs)  # the ranks' start method (harness.py)
    try:
        per_rank = run_world(dc.run_worlds, nprocs, args=(worlds, barrier, WORLD_TIMEOUT), timeout=TOTAL_TIMEOUT)
    except Exception as exc:  # noqa: BLE001 - every case reports it
        return exc
    results = {ws: [per_rank[rank][ws] for rank in range(ws)] for ws, *_ in worlds}
    if os.environ.get("DIFF_DUMP"):  # for a post-mortem: DIFF_DUMP=/tmp/dir pytest ...
        for ws, per in results.items():
            with open(os.path.join(os.environ["DIFF_DUMP"], f"world{ws}.pkl"), "wb") as f:
                pickle.dump(per, f)
    return results


def _worlds():
    """(world size, engines, cases, with the "@np" runs) of every world the test runs."""
    for ws in WORLD_SIZES:
        yield ws, ENGINES, dc.cases(ws), True
    for ws in LARGE_WORLD_SIZES:
        only = set(dc.reduced_cases(ws))
        yield ws, LARGE_ENGINES, [c for c in dc.cases(ws) if c.name in only], False


def _items():
    """One item per (world size, engine, case): it checks the case's run on tensors and, where the
    world has them, its "@np" run on numpy arrays."""
    for ws, engines, cases, numpy in _worlds():
        for case in cases:
            names = (case.name,) + ((case.name + "@np",) if case.numpy and numpy else ())
            for engine in engines:
                if not dc.variant_runs(engine, case.name):
                    continue
                reason = next((r for n in names for r in (XFAIL.get((ws, engine, n)), XFAIL.get((None, engine, n)),
                                                          XFAIL.get((None, None, n))) if r), None)
                marks = tier(ws, engine) + ([pytest.mark.xfail(strict=True, reason=reason)] if reason else [])
                yield pytest.param(ws, engine, names, case, id=f"ws{ws}-{engine}-{case.name}", marks=marks)


@pytest.mark.parametrize("ws,engine,names,case", list(_items()))
def test_differential(results_by_world, ws, engine, names, case):
    results = world_results(results_by_world, ws)
    if isinstance(results, Exception):
        raise AssertionError(f"the world of {ws} failed: {results}")
    problems = []
    for name in names:
        for rank in range(ws):
            torch_side = results[rank]["torch:gloo"]
            ours_side = results[rank][f"distcomm:{engine}"]
            expected = torch_side[case.name]
            got = ours_side[name]
            problem = compare(case, ws, rank, expected, got)
            if problem:
                problems.append(f"{name}, rank {rank}: {problem}")
    assert not problems, f"{case.name} at world size {ws} on distcomm:{engine}:\n" + "\n".join(problems)


@pytest.mark.parametrize("ws", [pytest.param(ws, marks=tier(ws)) for ws in WORLD_SIZES + LARGE_WORLD_SIZES])
def test_oracle_stayed_in_step(results_by_world, ws):
    """torch's own run had no timeouts or lost connections: otherwise every case after the first
    would differ for a reason that is not distcomm's (this names the first)."""
    results = world_results(results_by_world, ws)
    if isinstance(results, Exception):
        raise AssertionError(f"the world of {ws} failed: {results}")
    for rank in range(ws):
        side = results[rank]["torch:gloo"]
        broken = [(name, v[3]) for name, v in side.items() if not name.startswith("__") and v[0] == "error"
                  and re.search(r"[Tt]imeout|[Tt]imed out|[Cc]losed|closure", v[3])]
        assert not broken, f"rank {rank}: torch's run went out of step at {broken[0]}"


# Which shared-memory algorithms (the names of backends/shm/choose.py, reported through
# backends/shm/observe.py) each variant must run and must not run, in every rank: a forced choice
# that did not take effect (a variable read at the wrong time, single-copy reads refused by the OS)
# would otherwise quietly compare the default.
SHM_VARIANT_ALGOS: dict[str, tuple[set, set]] = {
    "shm/readv": ({"allreduce_readv", "broadcast_readv", "allgather_readv", "reduce_readv", "reduce_scatter_readv",
                   "alltoall_readv", "gather_readv", "scatter_readv", "barrier_slots"},
                  {"allreduce_direct", "latency_all_reduce", "allreduce_slices", "reduce_direct", "broadcast_slots",
                   "allgather_slots", "reduce_scatter_slots", "scatter_slots", "gather_slots"}),
    "shm/slices": ({"allreduce_slices", "broadcast_slots", "reduce_direct", "allgather_slots", "gather_slots",
                    "scatter_slots", "reduce_scatter_slots", "alltoall_slots", "barrier_slots"},
                   {"allreduce_direct", "latency_all_reduce", "allreduce_readv", "broadcast_readv", "allgather_readv",
                    "reduce_readv", "reduce_scatter_readv", "alltoall_readv", "scatter_readv", "gather_readv"}),
    "shm/direct": ({"allreduce_direct", "reduce_direct"},  # all_reduce cases only (diff_cases.VARIANT_CASES)
                   {"latency_all_reduce", "allreduce_slices", "allreduce_readv", "broadcast_readv", "allgather_readv",
                    "reduce_readv", "reduce_scatter_readv", "alltoall_readv", "scatter_readv", "gather_readv"}),
    # by size: direct and slices for all_reduce (at world size 2 direct and single copy); from world
    # size 4 on the 300k all_gather and reduce_scatter_tensor cases pass 4 MiB and take single-copy
    # reads (both added below)
    # the latency path (latency_all_reduce) takes the synchronous small all_reduces, allreduce_direct
    # the others (async ones, bfloat16, ...)
    "shm": ({"latency_all_reduce", "allreduce_direct", "allreduce_slices", "broadcast_slots", "reduce_direct",
             "allgather_slots", "gather_slots", "scatter_slots", "reduce_scatter_slots", "alltoall_slots",
             "barrier_slots"},
            {"allreduce_readv", "broadcast_readv"}),
}
SHM_VARIANT_ALGOS["gloo"] = SHM_VARIANT_ALGOS["shm"]  # the default engine on one host


@pytest.mark.parametrize("ws,engine", [pytest.param(ws, e, marks=tier(ws, e)) for ws, engines, _, _ in _worlds()
                                       for e in engines])
def test_shm_variants_ran(results_by_world, ws, engine):
    results = world_results(results_by_world, ws)
    if isinstance(results, Exception):
        raise AssertionError(f"the world of {ws} failed: {results}")
    for rank in range(ws):
        side = results[rank][f"distcomm:{engine}"]
        ran = set(side["__algos__"])
        # a latency path runs its algorithm's rounds (latency.ROUNDS): count that algorithm as run
        # (but latency_all_reduce stays itself: the variants say whether it may run)
        from distcomm.backends.shm.latency import ROUNDS

        ran |= {ROUNDS[name] for name in ran if name in ROUNDS and name != "latency_all_reduce"}
        if engine.startswith("tcp"):
            assert not ran, f"rank {rank}: the tcp engine ran shared-memory algorithms: {sorted(ran)}"
            continue
        must, must_not = SHM_VARIANT_ALGOS[engine]
        if engine in ("shm", "gloo") and ws >= 4:
            must = must | {"allgather_readv", "reduce_scatter_readv"}
        if engine in ("shm", "gloo") and ws == 2:  # two ranks: single copy for every all_reduce past direct's
            must, must_not = (must - {"allreduce_slices"}) | {"allreduce_readv"}, must_not - {"allreduce_readv"}
        assert must <= ran and not (must_not & ran), (
            f"rank {rank}, {engine}: missing {sorted(must - ran)}, unexpected {sorted(must_not & ran)} "
            f"(ran: {side['__algos__']}); if single-copy reads are missing, is process_vm_readv allowed here?")


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
