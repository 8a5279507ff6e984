"""``python -m distcomm.bench overview FILE.json ...``: the README's speedup table from saved runs.

Each file is a ``distcomm-bench --compare torch[,mpi] --json`` result; there is one table per peer
(torch's gloo, MPICH), with one row per (op, world size) and one column per size, each cell the
peer's time over distcomm's (``make bench-readme`` prints them after the runs, so the README's
numbers always come from the files beside it).
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Sequence

from .report import format_bytes, speedup

DEFAULT_SIZES = (8, 1 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20)


def overview(results: Sequence[dict], sizes: Sequence[int] = DEFAULT_SIZES) -> str:
    """Markdown tables of speedups by op and world size, at ``sizes``: one table per peer engine
    (every engine of a run after the first: torch's gloo, MPICH), each cell the peer's time over
    the first engine's; after each table barrier's times and the lowest ratio over every row of
    every file."""
    peers: dict[str, None] = {}
    for result in results:
        labels = list(result["runs"])
        if len(labels) < 2:
            raise ValueError(f"need runs of at least two engines (--compare torch), got {labels}")
        peers.update(dict.fromkeys(_peer_name(label) for label in labels[1:]))
    tables = [_peer_table(results, peer, sizes) for peer in peers]
    return "\n\n".join(tables)


def _peer_name(label: str) -> str:
    """The engine a run label names: "torch/gloo" -> "gloo", "mpi/mpich" -> "mpich"."""
    return label.rsplit("/", 1)[-1]


def _peer_table(results: Sequence[dict], peer: str, sizes: Sequence[int]) -> str:
    by_op: dict[str, list[tuple[int, dict, dict]]] = {}
    lowest = math.inf
    for result in results:
        labels = list(result["runs"])
        theirs_label = next((label for label in labels[1:] if _peer_name(label) == peer), None)
        if theirs_label is None:
            continue
        ours = {(r["op"], r["size"]): r for r in result["runs"][labels[0]]}
        theirs = {(r["op"], r["size"]): r for r in result["runs"][theirs_label]}
        for key, row in ours.items():
            ratio = speedup(row, theirs.get(key))
            if not math.isnan(ratio):
                lowest = min(lowest, ratio)
        for op in dict.fromkeys(k[0] for k in ours):
            by_op.setdefault(op, []).append((result["meta"]["world_size"], ours, theirs))
    lines = [
        f"{peer}'s time / distcomm's:",
        "",
        "| op | world | " + " | ".join(format_bytes(s) for s in sizes) + " |",
        "|---|---|" + "---|" * len(sizes),
    ]
    barriers = []
    for op, worlds in by_op.items():
        for world, ours, theirs in sorted(worlds, key=lambda w: w[0]):
            if op == "barrier":  # no size: its times go below the table
                key = next(k for k in ours if k[0] == op)
                mine, other = ours[key], theirs.get(key)
                if other is not None:
                    barriers.append(f"{mine['time_us']:.1f} µs vs {other['time_us']:.1f} µs (world {world})")
                continue
            cells = []
            for size in sizes:
                ratio = speedup(ours.get((op, size)), theirs.get((op, size)))
                cells.append("" if math.isnan(ratio) else f"{ratio:.1f}x" if ratio >= 0.95 else f"{ratio:.2f}x")
            lines.append(f"| {op} | {world} | " + " | ".join(cells) + " |")
    if barriers:
        lines += ["", "barrier: " + ", ".join(barriers)]
    if lowest is not math.inf:
        lines += ["", f"lowest ratio over every op and size: {lowest:.2f}x"]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m distcomm.bench overview", description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", help="JSON results of distcomm-bench --compare torch[,mpi] --json")
    args = parser.parse_args(argv)
    results = []
    for path in args.files:
        with open(path) as f:
            results.append(json.load(f))
    print(overview(results))
    return 0
