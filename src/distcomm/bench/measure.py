"""What every benchmark rank does the same way, whatever library it calls: the buffers and their check
patterns (Tensors, case), the warmup and iteration counts (auto_counts, warm_up), the timed loop
(timed) and what a rank reports for a row (rank_stats).

collectives.py (distcomm and torch ranks) and mpi_world.py (MPI ranks) both measure through these,
so the three engines' rows are taken the same way and compare.
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np

# The automatic counts (see collectives.py's docstring): timed iterations clamped to [MIN_ITERS, MAX_ITERS],
# warmups (after the one that measures) at most MAX_WARMUP: as many as the OSU micro-benchmarks' 200
# for small messages, since two ranks calling an op of a few µs in a loop take a few hundred calls
# to fall into step (docs/performance-notes.md, "In a steady loop"); a tenth of the budget caps them.
MIN_ITERS, MAX_ITERS, MAX_WARMUP = 5, 1000, 200
PROBES = 3  # warmups rank 0 times to pick the counts (the quickest counts)

_PERIOD = 5  # the check pattern repeats every _PERIOD elements: small integers, exact in every dtype


def auto_counts(seconds_per_op: float, budget: float) -> tuple[int, int]:
    """(more warmups, timed iterations) for an op that took ``seconds_per_op`` once warm."""
    per_op = max(seconds_per_op, 1e-7)
    return (min(MAX_WARMUP, round(0.1 * budget / per_op)),
            min(MAX_ITERS, max(MIN_ITERS, round(budget / per_op))))


CACHE_LINE = 64  # bytes; what --fresh-inputs writes one byte of


class Tensors:
    """Allocate, fill and check buffers of one kind: numpy arrays or torch tensors of one dtype.

    Patterns are built in a numpy "host" dtype (the dtype itself; float32 for bfloat16) and are
    small integers, so every dtype holds them exactly and integer wrap-around is the same on both
    sides of a comparison.
    """

    def __init__(self, kind: str, dtype: str):
        self.torch = None
        if kind == "torch":
            import torch

            self.torch = torch
            self.torch_dtype = getattr(torch, dtype)
        self.host = np.dtype("float32" if dtype == "bfloat16" else dtype)

    def empty(self, count: int):
        if self.torch is not None:
            return self.torch.zeros(count, dtype=self.torch_dtype)
        return np.zeros(count, dtype=self.host)

    def ramp(self, count: int, add: int = 0, scale: int = 1, offset: int = 0) -> np.ndarray:
        """``add + scale * ((offset + i) % P)`` for i < count, in the host dtype."""
        base = add + scale * ((offset + np.arange(_PERIOD, dtype=np.int64)) % _PERIOD)
        out = np.empty(max(count, _PERIOD), dtype=self.host)
        out[:_PERIOD] = base  # then double the filled prefix (a multiple of the period) until full:
        filled = _PERIOD  # log2(count) large copies; np.resize concatenates count/P tiny arrays (seconds)
        while filled < count:
            step = min(filled, count - filled)
            out[filled:filled + step] = out[:step]
            filled += step
        return out[:count]

    def fill(self, buf, values: np.ndarray) -> None:
        if self.torch is not None:
            buf.copy_(self.torch.from_numpy(values))
        else:
            buf[...] = values

    def cache_lines(self, buf) -> np.ndarray:
        """The first byte of every 64-byte cache line of ``buf`` (contiguous), as a uint8 view."""
        raw = buf.view(self.torch.uint8).numpy() if self.torch is not None else buf.reshape(-1).view(np.uint8)
        return raw[::CACHE_LINE]

    def wrong(self, buf, expected: np.ndarray) -> int:
        """How many elements of ``buf`` differ from ``expected``."""
        if self.torch is not None:
            buf = buf.float().numpy() if buf.dtype == self.torch.bfloat16 else buf.numpy()
        return int(np.count_nonzero(buf != expected))


# Each case returns (run, check, refresh): ``run()`` does the op once on the row's buffers; ``check()``
# fills the inputs with the pattern, runs once, and returns the number of wrong elements on this
# rank; ``refresh()`` writes every cache line of the inputs, their values unchanged (--fresh-inputs).
# Buffers start zeroed, so an output the op failed to write is wrong. Rank r's input is
# ramp(add=r+1), so a SUM over n ranks is ramp(add=n(n+1)/2, scale=n).


def case(t: Tensors, run: Callable[[], None], fills: list, out=None, expected: Callable | None = None):
    """(run, check, refresh) from the input buffers and their ``values()``, the output buffer (or a
    list of equal output buffers, checked against consecutive blocks of ``expected()``) and
    ``expected()``."""
    def check() -> int:
        for buf, values in fills:
            t.fill(buf, values())
        run()
        if out is None:
            return 0
        if isinstance(out, list):
            want = expected()
            block = len(want) // len(out)
            return sum(t.wrong(o, want[i * block:(i + 1) * block]) for i, o in enumerate(out))
        return t.wrong(out, expected())

    lines = [t.cache_lines(buf) for buf, _ in fills]

    def refresh() -> None:
        # a store makes the line this process's own (modified) even when it writes the same value:
        # a peer then reads the input from this process's cache, as it would after a training step
        for view in lines:
            np.add(view, 0, out=view)

    return run, check, refresh


def sum_of_ramps(t: Tensors, count: int, n: int, offset: int = 0) -> np.ndarray:
    return t.ramp(count, add=n * (n + 1) // 2, scale=n, offset=offset)


def warm_up(run: Callable[[], None], entry: dict, rank: int, share: Callable[[str | None], str],
            budget: float) -> tuple[int, int]:
    """Run this row's warmups; return (warmups run, timed iterations to run).

    Counts the user gave are used as given. For the others, every rank runs ``PROBES`` warmups,
    rank 0 times them and picks the counts from the quickest (``auto_counts``), and ``share`` hands rank 0's text to every
    rank (through the store, or MPI's bcast: outside the data path being measured), so every rank
    runs the same number of each.
    """
    warmup, iters = entry["warmup"], entry["iters"]
    done = 0
    if warmup is None or iters is None:
        # the quickest of a few calls: one call alone could be a descheduled one (milliseconds on a
        # busy machine), and a row's counts would then be a few iterations instead of hundreds
        took = []
        for _ in range(PROBES):
            start = time.perf_counter()
            run()
            took.append(time.perf_counter() - start)
        done = PROBES
        counts = None
        if rank == 0:
            more, auto = auto_counts(min(took), budget)
            counts = f"{PROBES + more if warmup is None else warmup} {auto if iters is None else iters}"
        warmup, iters = map(int, share(counts).split())
    for _ in range(warmup - done):
        run()
    return max(warmup, done), iters


def timed(barrier: Callable[[], None], run: Callable[[], None], iters: int, sync_each: bool = False,
          before: Callable[[], None] | None = None) -> np.ndarray:
    """Seconds per iteration: a barrier so every rank starts together, then each iteration timed alone.

    ``sync_each``: an untimed barrier before every iteration too, so no iteration overlaps the next.
    ``before``: called, untimed, before every iteration, and then that barrier too: a peer waiting
    for this rank's data would otherwise time what ``before`` did.
    """
    barrier()
    times = np.empty(iters)
    clock = time.perf_counter
    for k in range(iters):
        if before is not None:
            before()
        if sync_each or before is not None:
            barrier()
        start = clock()
        run()
        times[k] = clock() - start
    return times


def rank_stats(times: np.ndarray, wrong: int, warmup: int, iters: int) -> dict:
    """What a rank reports for one row (report.make_row combines every rank's)."""
    return {"mean": float(times.mean()), "median": float(np.median(times)), "min": float(times.min()),
            "max": float(times.max()), "wrong": wrong, "warmup": warmup, "iters": iters}
