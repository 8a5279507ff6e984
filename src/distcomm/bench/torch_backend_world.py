"""distcomm-bench torch-backend: torch.distributed's own API over the c10d backend "distcomm", against gloo.

Usage::

    python -m distcomm.bench torch-backend                       # all_reduce 8 B and 1 MiB, world 2
    python -m distcomm.bench torch-backend --world 4 --ops all_reduce,all_gather -b 8 -e 16M

What a torch program gets by changing only its backend string: both worlds run the same rank code
(``collectives.rank_main`` with library "torch": ``torch.distributed.init_process_group`` on a torch
TCPStore, torch tensors, torch's ``all_reduce`` etc.), one with backend "distcomm"
(``distcomm.torch_backend``), then one with torch's "gloo", the same plan, one after the other.
Rows are measured as in ``distcomm-bench`` (see collectives.py: checked results, then the slowest
rank's median iteration time); the speedup column is gloo's time over distcomm's.

Without ``-b``/``-e`` the rows are the issue's two sizes, 8 B and 1 MiB; with them, the usual sweep.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys

from . import report
from .collectives import OPS, _op_list, build_plan, parse_size, run_engine, sizes
from .worlds import WorldFailed

ENGINES = (("torch/distcomm", "distcomm"), ("torch/gloo", "gloo"))  # (label, torch backend string)
DEFAULT_SIZES = (8, 1 << 20)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="distcomm-bench torch-backend", description=__doc__.split("\n\n")[0])
    p.add_argument("--world", "-p", type=int, default=2, help="number of processes (default 2)")
    p.add_argument("--ops", "-o", type=_op_list, default=["all_reduce"],
                   help=f"comma-separated ops or 'all' ({','.join(OPS)}; default all_reduce)")
    p.add_argument("--min-bytes", "-b", type=parse_size, default=None, help="smallest size of a sweep")
    p.add_argument("--max-bytes", "-e", type=parse_size, default=None, help="largest size of a sweep")
    p.add_argument("--step-factor", "-f", type=int, default=2, help="size multiplier of a sweep (default 2)")
    p.add_argument("--dtype", "-d", default="float32", help="element type (default float32)")
    p.add_argument("--budget", type=float, default=0.2, help="seconds of timed iterations per row (default 0.2)")
    p.add_argument("--stat", choices=("median", "mean"), default="median")
    p.add_argument("--json", metavar="FILE", help="write the raw results")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds a world may take per row (default 300)")
    return p


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if importlib.util.find_spec("torch") is None:
        parser.error("needs torch: pip install 'distcomm[torch]'")
    if args.world < 1:
        parser.error("--world must be at least 1")
    if args.min_bytes is None and args.max_bytes is None:
        byte_sizes = list(DEFAULT_SIZES)
    else:
        byte_sizes = sizes(args.min_bytes or 8, args.max_bytes or (64 << 20), args.step_factor)
    plan = build_plan(args.ops, byte_sizes, args.world, args.dtype)
    info = report.machine()
    print(f"# distcomm-bench torch-backend: world {args.world}, {args.dtype}, ops {','.join(args.ops)}; "
          f"torch.distributed's API on both, backend \"distcomm\" vs \"gloo\"")
    print(f"# machine: {report.machine_line(info)}")
    sys.stdout.flush()
    runs: dict[str, list[dict]] = {}
    failures = []
    for label, backend in ENGINES:
        job = {"library": "torch", "backend": backend, "world": args.world, "dtype": args.dtype, "tensor": "torch",
               "plan": plan, "timeout": args.timeout, "budget": args.budget, "env": {}}
        try:
            runs[label] = run_engine(job, args.stat, lambda row: None)
        except WorldFailed as exc:
            runs[label] = exc.rows
            failures.append(f"{label}: {exc}")
    labels = [label for label, _ in ENGINES]
    print(f"\n# speedup = {labels[1]} time / {labels[0]} time (above 1: {labels[0]} is faster)")
    print(report.compare_tables(args.ops, runs[labels[0]], runs[labels[1]], labels))
    wrong = 0
    for label in labels:
        count = report.wrong_total(runs[label])
        wrong += count
        print(f"# {label}: {len(runs[label])}/{len(plan)} rows, wrong elements: {count} {'OK' if count == 0 else 'FAILED'}")
    for failure in failures:
        print(f"# FAILED {failure.splitlines()[0]}")
    if args.json:
        meta = {"world_size": args.world, "dtype": args.dtype, "stat": args.stat, "machine": info, "engines": labels,
                "argv": sys.argv[1:] if argv is None else list(argv)}
        report.write_json(args.json, meta, runs)
        print(f"# results written to {args.json}")
    return 1 if failures or wrong else 0
