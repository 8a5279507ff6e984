"""Rows, tables and JSON for distcomm-bench: what a result is and how it is printed.

A *row* is one (op, size) measured on one engine: a dict with ``op``, ``size`` (bytes), ``count``
(elements), ``dtype``, ``iters``, ``warmup``, ``time_us``, ``algbw``, ``busbw`` (GB/s = 1e9 B/s),
``wrong`` (wrong elements summed over ranks) and ``ranks`` (each rank's own statistics). The
tables follow nccl-tests' layout so the numbers read the same way:

* ``time`` is the time of one operation: each rank times every iteration, takes the median (or
  the mean, ``--stat``) of its iterations, and the row reports the slowest rank's value — a
  collective is done when its last rank is done;
* ``algbw = size / time``;
* ``busbw = algbw * factor``, the nccl-tests factor that makes bandwidths comparable across ops
  and world sizes (what each rank's link carries): all_reduce 2(n-1)/n; all_gather,
  reduce_scatter, all_to_all (n-1)/n; broadcast, reduce 1.
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import os
import platform
from typing import Any, Iterable, Sequence

BUS_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "gather": lambda n: (n - 1) / n,  # nccl-tests' gather/scatter: the root's link carries (n-1)/n
    "scatter": lambda n: (n - 1) / n,
}


def make_row(entry: dict, per_rank: Sequence[dict], world_size: int, stat: str) -> dict:
    """The row for one plan entry from every rank's report (``mean``/``median``/``min``/``max`` s, ``wrong``)."""
    seconds = max(r[stat] for r in per_rank)
    size = entry["size"]
    algbw = size / seconds / 1e9 if seconds > 0 and entry["op"] in BUS_FACTOR else math.nan
    busbw = algbw * BUS_FACTOR[entry["op"]](world_size) if entry["op"] in BUS_FACTOR else math.nan
    return {
        **entry,
        "warmup": per_rank[0]["warmup"],  # the same on every rank (chosen by rank 0 when automatic)
        "iters": per_rank[0]["iters"],
        "time_us": seconds * 1e6,
        "algbw": algbw,
        "busbw": busbw,
        "wrong": sum(r["wrong"] for r in per_rank),
        "ranks": [{f"{k}_us": r[k] * 1e6 for k in ("mean", "median", "min", "max")} | {"wrong": r["wrong"]}
                  for r in per_rank],
    }


def median_run(runs: Sequence[Sequence[dict]]) -> list[dict]:
    """One engine's rows from several runs of the same plan (``--repeat``): per (op, size), the row
    of the run whose time is the median, the lower middle one for an even count, so every figure
    of the row (counts, per-rank statistics, bandwidths) comes from one real run. The row also
    carries ``run_times_us``, every run's time in run order, and ``wrong`` sums every run's check.
    Rows keep the order of the run that measured them first; a row some runs missed (a world that
    failed) is the median of the runs that have it."""
    measured: dict[tuple, list[dict]] = {}
    for rows in runs:
        for row in rows:
            measured.setdefault((row["op"], row["size"]), []).append(row)
    combined = []
    for rows in measured.values():
        middle = sorted(rows, key=lambda r: r["time_us"])[(len(rows) - 1) // 2]
        combined.append({**middle, "wrong": sum(r["wrong"] for r in rows),
                         "run_times_us": [r["time_us"] for r in rows]})
    return combined


def format_bytes(size: float) -> str:
    """8 B, 4 KiB, 64 MiB: the size as a person reads it (powers of two)."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale:
            value = size / scale
            return f"{value:g} {unit}" if value == int(value) else f"{value:.1f} {unit}"
    return f"{int(size)} B"


def _num(value: float, width: int, digits: int = 2) -> str:
    return f"{'-':>{width}}" if value is None or math.isnan(value) else f"{value:{width}.{digits}f}"


def _ratio(value: float, width: int) -> str:
    """A speedup: two decimals, or two significant digits below 0.1 (a loaded machine can make one
    engine hundreds of times slower for a row, and "0.00" would read as no measure)."""
    if value is None or math.isnan(value) or value >= 0.1:
        return _num(value, width)
    return f"{value:{width}.2g}"


def _time(value: float, width: int = 10) -> str:
    return _num(value, width, 1 if value >= 1000 else 2)


_KEY = f"{'size':>12} {'count':>12} {'type':>9}"
_KEY_UNITS = f"{'(B)':>12} {'(elements)':>12} {'':>9}"
_ONE = f"{'time':>10} {'algbw':>7} {'busbw':>7} {'#wrong':>6}"
_ONE_UNITS = f"{'(us)':>10} {'(GB/s)':>7} {'(GB/s)':>7} {'':>6}"


def _measure(row: dict | None) -> str:
    if row is None:
        return f"{'n/a':>10} {'':>7} {'':>7} {'':>6}"
    return f"{_time(row['time_us'])} {_num(row['algbw'], 7)} {_num(row['busbw'], 7)} {row['wrong']:>6d}"


def _key(row: dict) -> str:
    dtype = "-" if row["op"] == "barrier" else row["dtype"]
    return f"{row['size']:>12d} {row['count']:>12d} {dtype:>9}"


def op_title(op: str) -> str:
    return f"# {op}" + (" (sum)" if op in ("all_reduce", "reduce", "reduce_scatter") else "") + (
        " (root 0)" if op in ("broadcast", "reduce") else "")


def table_header(op: str) -> str:
    """The lines above one engine's rows for ``op``."""
    return "\n".join((op_title(op), f"#{_KEY[1:]} {_ONE}", f"#{_KEY_UNITS[1:]} {_ONE_UNITS}"))


def table_row(row: dict) -> str:
    return f"{_key(row)} {_measure(row)}"


def engine_tables(ops: Sequence[str], rows: Sequence[dict]) -> str:
    """One engine's rows as the tables it prints live: per op, its header and its rows by size."""
    out = []
    for op in ops:
        mine = sorted((r for r in rows if r["op"] == op), key=lambda r: r["size"])
        if mine:
            out += [table_header(op), *(table_row(r) for r in mine), ""]
    return "\n".join(out)


def compare_header(op: str, labels: Sequence[str]) -> str:
    """Header of the side-by-side table: the key, one block per engine, then the speedup of the
    first engine over each of the others ("speedup" with two engines, "vs <library>" with more)."""
    width = len(_ONE)
    names = " ".join(f"{label[:width]:^{width}}" for label in labels)
    others = labels[1:]
    titles = ["speedup"] if len(others) == 1 else [("vs " + label.split("/")[0])[:8] for label in others]
    blank, units = " ".join(f"{'':>8}" for _ in others), " ".join(f"{'(x)':>8}" for _ in others)
    return "\n".join((
        op_title(op),
        f"#{' ' * (len(_KEY) - 1)} {names} {' '.join(f'{t:>8}' for t in titles)}",
        f"#{_KEY[1:]} {' '.join(_ONE for _ in labels)} {blank}",
        f"#{_KEY_UNITS[1:]} {' '.join(_ONE_UNITS for _ in labels)} {units}",
    ))


def speedup(ours: dict | None, theirs: dict | None) -> float:
    """theirs' time / ours' time: above 1 means ours is faster."""
    if ours is None or theirs is None or not ours["time_us"] > 0:
        return math.nan
    return theirs["time_us"] / ours["time_us"]


def compare_row(ours: dict | None, *theirs: dict | None) -> str:
    """One size: the first engine's measures, each other engine's, then ours' speedup over each."""
    key = _key(next(r for r in (ours, *theirs) if r is not None))
    measures = " ".join(_measure(r) for r in (ours, *theirs))
    return f"{key} {measures} {' '.join(_ratio(speedup(ours, t), 8) for t in theirs)}"


def _by_key(rows: Iterable[dict]) -> dict[tuple, dict]:
    return {(r["op"], r["size"]): r for r in rows}


def compare_tables(ops: Sequence[str], ours: Sequence[dict], theirs: Sequence[dict] | Sequence[Sequence[dict]],
                   labels: Sequence[str]) -> str:
    """The side-by-side table of every op, rows matched by (op, size), and a summary per op.

    ``theirs``: one other engine's rows, or (with more than two ``labels``) a list of them, one per
    label after the first; each gets its own speedup column and summary line.
    """
    others = [theirs] if len(labels) == 2 else list(theirs)
    mine, other = _by_key(ours), [_by_key(rows) for rows in others]
    out = []
    for op in ops:
        keys = sorted({k for k in (*mine, *(k for o in other for k in o)) if k[0] == op}, key=lambda k: k[1])
        if not keys:
            continue
        out.append(compare_header(op, labels))
        out.extend(compare_row(mine.get(k), *(o.get(k) for o in other)) for k in keys)
        for label, o in zip(labels[1:], other):
            what = op if len(other) == 1 else f"{op} vs {label}"
            out.append(speedup_summary(what, [speedup(mine.get(k), o.get(k)) for k in keys]))
        out.append("")
    return "\n".join(out)


def speedup_summary(op: str, ratios: Sequence[float]) -> str:
    ratios = [r for r in ratios if r > 0 and not math.isnan(r)]
    if not ratios:
        return f"# {op}: no sizes measured on both"
    geo = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
    return f"# {op}: speedup geometric mean {geo:.2f}x, min {min(ratios):.2f}x, max {max(ratios):.2f}x"


def _md_time(row: dict | None) -> str:
    return "n/a" if row is None else f"{row['time_us']:.1f}" if row["time_us"] >= 100 else f"{row['time_us']:.2f}"


def _md_bw(row: dict | None) -> str:
    return "" if row is None or math.isnan(row["busbw"]) else f"{row['busbw']:.2f}"


def markdown_tables(ops: Sequence[str], runs: dict[str, list[dict]], meta: dict) -> str:
    """The results as Markdown (for a README): one table per op, a column pair per engine, the
    speedup of the first engine over each other one; the machine and settings first."""
    labels = list(runs)
    info = meta.get("machine", {})
    lines = [
        f"world size {meta['world_size']}, {meta['dtype']}, backend {meta['backend']}, {meta['stat']} of each "
        f"rank's iterations, slowest rank; measured on {machine_line(info) if info else 'an unknown machine'}"
        + (f", torch {info['torch']}" if "torch" in info else ""),
        "",
    ]
    by_label = {label: _by_key(rows) for label, rows in runs.items()}
    for op in ops:
        keys = sorted({k for rows in by_label.values() for k in rows if k[0] == op}, key=lambda k: k[1])
        if not keys:
            continue
        head = ["size"] + [f"{label} time (µs)" for label in labels]
        if op != "barrier":
            head += [f"{label} busbw (GB/s)" for label in labels]
        if len(labels) == 2:
            head.append("speedup")
        elif len(labels) > 2:
            head += [f"speedup vs {label}" for label in labels[1:]]
        lines += [f"**{op_title(op)[2:]}**", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for key in keys:
            rows = [by_label[label].get(key) for label in labels]
            cells = [format_bytes(key[1]) if op != "barrier" else "-"] + [_md_time(r) for r in rows]
            if op != "barrier":
                cells += [_md_bw(r) for r in rows]
            for theirs in rows[1:]:
                ratio = speedup(rows[0], theirs)
                cells.append("" if math.isnan(ratio) else f"{ratio:.2f}x")
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def wrong_total(rows: Iterable[dict]) -> int:
    return sum(r["wrong"] for r in rows)


def machine() -> dict[str, Any]:
    """What the numbers were measured on: host, CPU model, CPU count, versions."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    import numpy

    info = {
        "host": platform.node(),
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "system": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "numpy": numpy.__version__,
    }
    try:
        info["torch"] = importlib.metadata.version("torch")  # without importing it (seconds)
    except importlib.metadata.PackageNotFoundError:
        pass
    return info


def machine_line(info: dict[str, Any]) -> str:
    return f"{info['cpu']}, {info['cpus']} CPUs, {info['system']}, host {info['host']}"


def write_json(path: str, meta: dict, runs: dict[str, list[dict]]) -> None:
    """Raw results: the run's settings and machine, and every engine's rows with per-rank statistics."""
    def clean(value):  # JSON has no NaN
        if isinstance(value, float) and math.isnan(value):
            return None
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items()}
        if isinstance(value, list):
            return [clean(v) for v in value]
        return value

    with open(path, "w") as f:
        json.dump(clean({"meta": meta, "runs": runs}), f, indent=1)
        f.write("\n")
