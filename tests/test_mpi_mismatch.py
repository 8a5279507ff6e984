"""Ranks that disagree on a collective on the MPI engine raise CollectiveMismatchError, every one
of them, naming what differs with both values: never a result that looks fine.

MPI checks none of it: MPICH completes most collectives whose ranks passed different sizes and
returns whatever was in the buffers (backends/mpi/agreement.py). ``mpi_scripts/mismatch_worker.py``
runs every collective the engine has (all_reduce on the C path, the Python latency path, the
general path and distcomm's algorithms; broadcast, reduce, all_gather, all_gather_into_tensor,
gather, scatter, reduce_scatter_tensor, reduce_scatter, all_to_all_single, all_to_all) with the last
rank passing another size, dtype or root, at 4 elements (the latency paths, persistent requests)
and 100,000 (past them), under ``mpiexec -n 2`` and ``-n 3`` with a hard deadline; and the
``kept_*`` cases, where each rank already keeps a persistent request for its size, so the ranks
start different requests that MPI never matches (found by the long-wait check instead of the
timeout: a DistTimeoutError fails these tests). The pure parts of agreement.py are tested on
tables at the end.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from mpi_harness import run_mpiexec, skip_reason

SMALL, LARGE = 4, 100_000
F32 = 4


def _bytes(elements: int) -> int:
    return elements * F32


# case -> (op, sequence number, kind, what each rank passes: fn(rank, odd, n, ws))
SIZES = {
    "all_reduce_numpy": ("all_reduce", 1, lambda r, odd, n, ws: _bytes(2 * n if r == odd else n)),
    "all_reduce_torch": ("all_reduce", 1, lambda r, odd, n, ws: _bytes(2 * n if r == odd else n)),
    "all_reduce_async": ("all_reduce", 1, lambda r, odd, n, ws: _bytes(2 * n if r == odd else n)),
    "all_reduce_generic": ("all_reduce", 1, lambda r, odd, n, ws: 2 * (2 * n if r == odd else n)),
    "all_reduce_empty": ("all_reduce", 1, lambda r, odd, n, ws: 0 if r == 0 else _bytes(n)),
    "kept_numpy": ("all_reduce", 3, lambda r, odd, n, ws: _bytes(2 * n if r == odd else n)),
    "kept_torch": ("all_reduce", 3, lambda r, odd, n, ws: _bytes(2 * n if r == odd else n)),
    "kept_async": ("all_reduce", 3, lambda r, odd, n, ws: _bytes(2 * n if r == odd else n)),
    "kept_vs_large": ("all_reduce", 2, lambda r, odd, n, ws: _bytes(LARGE if r == odd else n)),
    "broadcast": ("broadcast", 1, lambda r, odd, n, ws: _bytes(2 * n if r == odd else n)),
    "broadcast_root_longer": ("broadcast", 1, lambda r, odd, n, ws: _bytes(2 * n if r == 0 else n)),
    "reduce": ("reduce", 1, lambda r, odd, n, ws: _bytes(2 * n if r == odd else n)),
    "all_gather": ("all_gather", 1, lambda r, odd, n, ws: _bytes(2 * n if r == odd else n)),
    "all_gather_into_tensor": ("all_gather_into_tensor", 1, lambda r, odd, n, ws: _bytes(2 * n if r == odd else n)),
    "gather": ("gather", 1, lambda r, odd, n, ws: _bytes(2 * n if r == odd else n)),
    "scatter": ("scatter", 1, lambda r, odd, n, ws: _bytes(2 * n if r == odd else n)),
    "reduce_scatter_tensor": ("reduce_scatter_tensor", 1,
                              lambda r, odd, n, ws: _bytes(ws * (2 * n if r == odd else n))),
}
DTYPES = {  # case -> (op, seq, the odd rank's dtype, the others', whether the sizes differ too)
    "all_reduce_dtype": ("all_reduce", 1, "float64", "float32", True),
    "all_reduce_same_bytes": ("all_reduce", 1, "int32", "float32", False),
    "kept_dtype": ("all_reduce", 3, "float64", "float32", True),
    "broadcast_dtype": ("broadcast", 1, "int32", "float32", False),
}
PAIRS = {"all_to_all_longer": ("all_to_all_single", 2), "all_to_all_shorter": ("all_to_all_single", 0.5),
         "all_to_all_list": ("all_to_all", 2)}  # the odd rank sends this many times n to rank 0
SMALL_ONLY = {"kept_numpy", "kept_torch", "kept_async", "kept_dtype", "kept_vs_large", "barrier_vs_all_reduce"}
ALL = [*SIZES, *DTYPES, *PAIRS, "broadcast_roots", "reduce_scatter_splits", "barrier_vs_all_reduce"]
WAITED = "(found while both waited: MPI matched neither call with the other)"


def _cases():
    for name in ALL:
        for n in (SMALL, LARGE):
            if n == LARGE and name in SMALL_ONLY:
                continue
            yield pytest.param(name, n, id=f"{name}-{n}")


@pytest.fixture(scope="module")
def lines():
    """{world size: {(rank, "case/n"): the rest of its line}}, each job run on first use."""
    cache: dict = {}

    def get(ws: int) -> dict:
        if ws not in cache:
            done = run_mpiexec(ws, "mismatch_worker.py", timeout=420, env={"MISMATCH_TIMEOUT": "20"})
            out = {}
            for line in done.stdout.splitlines():
                rank, check, rest = (line.split(" ", 2) + ["", ""])[:3]
                if rank.isdigit():
                    out[(int(rank), check)] = rest
            out["_job"] = f"mpiexec exited with {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
            cache[ws] = out
        return cache[ws]

    return get


def _line(lines, ws: int, rank: int, case: str) -> str:
    got = lines(ws)
    assert (rank, case) in got, f"rank {rank} printed nothing for {case}: {got['_job']}"
    return got[(rank, case)]


def _error(text: str, op: str, seq: int, rank: int) -> int:
    """The group rank a CollectiveMismatchError of ``op`` #``seq`` on ``rank`` names as its peer."""
    m = re.match(rf"CollectiveMismatchError: {op} #{seq} on rank {rank} \(peer rank (\d+)\): ", text)
    assert m, f"rank {rank}: not a CollectiveMismatchError of {op} #{seq}: {text[:600]}"
    return int(m.group(1))


skip = pytest.mark.skipif(skip_reason() is not None, reason=skip_reason() or "")


@skip
@pytest.mark.slow
@pytest.mark.parametrize("ws", [2, 3])
@pytest.mark.parametrize("case,n", list(_cases()))
def test_every_rank_raises_a_mismatch_naming_both_values(lines, ws, case, n):
    odd = ws - 1
    for rank in range(ws):
        text = _line(lines, ws, rank, f"{case}/{n}")
        if case in SIZES:
            op, seq, passed = SIZES[case]
            peer = _error(text, op, seq, rank)
            mine, theirs = passed(rank, odd, n, ws), passed(peer, odd, n, ws)
            assert mine != theirs, f"rank {rank} names rank {peer}, which passed what it did: {text}"
            assert f"this rank passed {mine} bytes but rank {peer} passed {theirs} bytes; every rank of the group " \
                   "must pass the same size" in text, text
            # MPI never matches the kept cases' calls: only the long wait finds them (the others are
            # found by the agreement, or by the long wait when a rank waited that long for it)
            assert WAITED in text or not case.startswith("kept"), text
        elif case in DTYPES:
            op, seq, odd_dtype, dtype, sizes_differ = DTYPES[case]
            peer = _error(text, op, seq, rank)
            mine, theirs = (odd_dtype if r == odd else dtype for r in (rank, peer))
            assert mine != theirs, text
            if sizes_differ:
                nbytes = {r: (8 if r == odd else 4) * n for r in (rank, peer)}
                assert f"this rank passed {mine} and {nbytes[rank]} bytes but rank {peer} passed {theirs} and " \
                       f"{nbytes[peer]} bytes; every rank of the group must pass the same dtype and size" in text, text
            else:
                assert f"this rank passed {mine} but rank {peer} passed {theirs}; every rank of the group must " \
                       "pass the same dtype" in text, text
        elif case in PAIRS:
            op, factor = PAIRS[case]
            peer = _error(text, op, 1, rank)
            assert peer in ((0,) if rank == odd else (odd,)), text
            assert f"rank {odd} sends {int(_bytes(n) * factor)} bytes to rank 0, which expects {_bytes(n)} bytes " \
                   "from it" in text, text
        elif case == "broadcast_roots":
            peer = _error(text, "broadcast", 1, rank)
            mine, theirs = (odd if r == odd else 0 for r in (rank, peer))
            assert mine != theirs
            assert f"this rank called broadcast with src={mine} but rank {peer} with src={theirs} (group ranks); " \
                   "every rank of the group must pass the same src" in text, text
        elif case == "reduce_scatter_splits":
            peer = _error(text, "reduce_scatter", 1, rank)
            even = [_bytes(n)] * ws
            uneven = [_bytes(n // 2)] + [_bytes(n)] * (ws - 2) + [_bytes(n + n // 2)]
            mine, theirs = (uneven if r == odd else even for r in (rank, peer))
            assert mine != theirs
            assert f"this rank split its input into blocks of {mine} bytes but rank {peer} into blocks of {theirs} " \
                   "bytes; every rank of the group must pass the same block sizes" in text, text
        elif case == "barrier_vs_all_reduce":
            op = "all_reduce" if rank == odd else "barrier"
            peer = _error(text, op, 3, rank)
            calls = {"barrier": "barrier (0 bytes)", "all_reduce": f"all_reduce (float32, op=SUM, {_bytes(n)} bytes)"}
            theirs = "all_reduce" if peer == odd else "barrier"
            assert theirs != op
            assert f"at call #3 of this group this rank called {calls[op]} but rank {peer} called {calls[theirs]}" \
                   in text and WAITED in text, text


@skip
@pytest.mark.slow
@pytest.mark.parametrize("ws", [2, 3])
def test_the_ranks_still_agree_after_the_mismatches(lines, ws):
    """A fresh group computes right and the world group still works, in step, after every case."""
    for rank in range(ws):
        assert _line(lines, ws, rank, "sane") == str([True] * 6)
        assert _line(lines, ws, rank, "finished") == ""


# -- agreement.py, on tables ------------------------------------------------------------------
def _table(rows):
    return np.array(rows, dtype=np.int64)


def _float32() -> int:
    from distcomm.dtypes import from_name

    return from_name("float32").code


def test_judge_finds_the_same_disagreement_on_every_rank():
    from distcomm.backends.mpi import agreement as ag
    from distcomm.signatures import signature

    sig = signature("all_reduce", _float32(), 0)
    same = [ag.row(5, sig, 16)] * 3
    assert all(ag.judge(_table(same), r) is None for r in range(3))
    table = _table([ag.row(5, sig, 16), ag.row(5, sig, 16), ag.row(5, sig, 32)])
    verdicts = [ag.judge(table, r) for r in range(3)]
    assert [v.peer for v in verdicts] == [2, 2, 0] and not any(v.needs_details for v in verdicts)
    # the words: both values, from each side
    assert ag.describe(table[0], table[2], 2) == ("in all_reduce #5 this rank passed 16 bytes but rank 2 passed 32 "
                                                  "bytes; every rank of the group must pass the same size")
    other = signature("broadcast", _float32(), root=1)
    text = ag.describe(ag.row(5, sig, 16), ag.row(5, other, 16, 1), 1)
    assert text.startswith("at call #5 of this group this rank called all_reduce (float32, op=SUM, 16 bytes) but "
                           "rank 1 called broadcast (float32, src=1, 16 bytes)"), text
    assert "one of them skipped" in ag.describe(ag.row(5, sig, 16), ag.row(6, sig, 16), 1)


def test_all_to_all_pairs_are_checked_through_their_digests():
    from distcomm.backends.mpi import agreement as ag
    from distcomm.signatures import signature

    sig = signature("all_to_all_single", _float32())
    n = 3
    sends = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]  # sends[i][j]: rank i to rank j
    recvs = [[sends[i][j] for i in range(n)] for j in range(n)]  # recvs[j][i]: what rank j expects from i

    def table(sends, recvs):
        return _table([ag.row(1, sig, sent=s, expected=e) for s, e in
                       (ag.Weights(n, r).pairs(sends[r], recvs[r]) for r in range(n))])

    assert all(ag.judge(table(sends, recvs), r) is None for r in range(n))
    # the same totals per rank, one pair swapped on the sender only: every rank sees it
    wrong = [row[:] for row in sends]
    wrong[2][0], wrong[2][1] = wrong[2][1], wrong[2][0]
    verdicts = [ag.judge(table(wrong, recvs), r) for r in range(n)]
    assert all(v is not None and v.needs_details for v in verdicts)
    details = np.stack([ag.details(n, send_counts=wrong[r], recv_counts=recvs[r]) for r in range(n)])
    assert ag.peer_of_pair(details, 0, -1) == 2 and ag.peer_of_pair(details, 1, -1) == 2
    text = ag.describe(table(wrong, recvs)[1], table(wrong, recvs)[2], 2, details, 1)
    assert "rank 2 sends 7 bytes to rank 1, which expects 8 bytes from it" in text, text


def test_reduce_scatter_splits_are_compared_whole():
    from distcomm.backends.mpi import agreement as ag
    from distcomm.signatures import signature

    sig = signature("reduce_scatter", _float32(), 0)
    w = ag.Weights(2, 0)
    rows = _table([ag.row(1, sig, 16, splits=w.splits([2, 2])), ag.row(1, sig, 16, splits=w.splits([1, 3]))])
    verdict = ag.judge(rows, 0)
    assert verdict.peer == 1 and verdict.needs_details
    details = np.stack([ag.details(2, splits=[8, 8]), ag.details(2, splits=[4, 12])])
    assert ag.describe(rows[0], rows[1], 1, details, 0) == (
        "in reduce_scatter #1 this rank split its input into blocks of [8, 8] bytes but rank 1 into blocks of "
        "[4, 12] bytes; every rank of the group must pass the same block sizes")
    # the splits differ but so does the size: no second exchange, the size is named
    other = _table([rows[0], ag.row(1, sig, 32, splits=w.splits([4, 4]))])
    assert not ag.judge(other, 0).needs_details
