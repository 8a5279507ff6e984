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
``--repeat N`` runs the two worlds N times, taking turns, and reports each row's median run (as
``distcomm-bench --repeat``).

``--floor`` measures instead what an 8-byte all_reduce costs in CPU per call (``time.thread_time``
over many calls, each rank) at each layer, in one world with backend "distcomm": torch's API over a
trivial registered ProcessGroup whose allreduce returns an already completed Work (three kinds of
Work: the floor torch's Python API allows), torch's API over "distcomm", the torch ProcessGroup's
``allreduce`` called directly (no torch wrapper), and distcomm's own group (its latency path). The
CPU of a call that waits for a peer includes the wait (spinning, yielding), which on a loaded machine
is most of it; ``--no-round`` replaces the latency path's shared-memory round by a no-op in every
rank (the results are then wrong: measurement only), leaving each layer's own CPU.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys

from . import report
from .collectives import OPS, _op_list, build_plan, parse_size, run_engine, sizes
from .worlds import WorldFailed, connect_store, host_store, run_world

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
    p.add_argument("--repeat", type=int, default=1, metavar="N",
                   help="run both worlds N times, taking turns, and report per row the run with the median time "
                        "(default 1)")
    p.add_argument("--json", metavar="FILE", help="write the raw results")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds a world may take per row (default 300)")
    p.add_argument("--floor", action="store_true",
                   help="CPU per 8-byte all_reduce at each layer (torch's API over a trivial group, over "
                        "distcomm, distcomm's group directly) instead of the comparison with gloo")
    p.add_argument("--calls", type=int, default=20000, help="calls per --floor row (default 20000)")
    p.add_argument("--no-round", action="store_true",
                   help="with --floor: skip the shared-memory round (a no-op; results wrong) to see each layer's "
                        "own CPU")
    return p


# -- --floor: CPU per call at each layer ------------------------------------------------------------
FLOOR_WORKS = ("Work subclass", "work from future", "None")  # what the trivial group's allreduce returns


def _trivial_group_class():
    """A torch ProcessGroup whose allreduce does nothing and returns a completed Work of one kind."""
    import torch
    import torch.distributed as tdist

    class DoneWork(tdist.Work):
        def wait(self, timeout=None) -> bool:
            return True

    class TrivialGroup(tdist.ProcessGroup):
        def __init__(self, rank: int, size: int, kind: str):
            super().__init__(rank, size)
            self.kind = kind
            self.future = torch.futures.Future()
            self.future.set_result(None)

        def getBackendName(self) -> str:  # noqa: N802 - torch's name
            return "trivial"

        def allreduce(self, tensors, opts=None):
            if self.kind == "Work subclass":
                return DoneWork()
            if self.kind == "work from future":
                return torch._C._distributed_c10d._create_work_from_future(self.future)
            return None  # torch's Python API accepts it (a backend that completed the call itself)

    return TrivialGroup


def _cpu_per_call(fn, calls: int) -> float:
    """µs of this thread's CPU per call: the least of three runs of calls/3 (after a warm-up)."""
    import time

    for _ in range(min(300, calls)):
        fn()
    runs = []
    n = max(1, calls // 3)
    for _ in range(3):
        start = time.thread_time()
        for _ in range(n):
            fn()
        runs.append((time.thread_time() - start) / n * 1e6)
    return min(runs)


def _floor_rank(rank: int, send, port: int, world: int, calls: int, no_round: bool) -> None:
    import torch
    import torch.distributed as tdist

    import distcomm.torch_backend  # noqa: F401 - registers torch's backend "distcomm"
    from distcomm.buffers import as_buffer
    from distcomm.types import RedOpType

    if no_round:  # before the group's latency path binds it (on the group's first all_reduce)
        from distcomm.backends.shm import allreduce_direct

        allreduce_direct.one_round = lambda *args: None

    trivial = _trivial_group_class()
    for kind in FLOOR_WORKS:
        tdist.Backend.register_backend(
            f"floor-{FLOOR_WORKS.index(kind)}", lambda o, _=None, kind=kind: trivial(o.group_rank, o.group_size, kind),
            extended_api=True, devices=["cpu"])
    store = connect_store("torch", port, 120.0)
    tdist.init_process_group("distcomm", store=store, rank=rank, world_size=world)
    t = torch.zeros(2)  # 8 bytes
    rows = []
    for i, kind in enumerate(FLOOR_WORKS):
        group = tdist.new_group(backend=f"floor-{i}")
        rows.append((f"(a) torch all_reduce, trivial group, Work: {kind}",
                     _cpu_per_call(lambda: tdist.all_reduce(t, group=group), calls)))
    pg = tdist.group.WORLD
    rows.append(('(b) torch all_reduce over "distcomm"', _cpu_per_call(lambda: tdist.all_reduce(t), calls)))
    sync = tdist.AllreduceOptions()
    sync.asyncOp = False
    rows.append(("(b-) its allreduce([t], opts), synchronous, no torch wrapper",
                 _cpu_per_call(lambda: pg.allreduce([t], sync), calls)))
    group, buf, op = pg.group, as_buffer(t), RedOpType.SUM
    rows.append(("(c) distcomm's group: latency path (else allreduce)",
                 _cpu_per_call(lambda: group.fast_all_reduce(t, op) or group.allreduce(buf, op, False), calls)))
    send(("floor", rows))
    tdist.barrier()
    tdist.destroy_process_group()


def floor(world: int, calls: int, timeout: float, no_round: bool = False) -> list[tuple[str, list[float]]]:
    """Each --floor row's name and its µs of CPU per call on every rank."""
    store = host_store("torch", timeout)
    per_rank: dict[int, list] = {}
    for rank, (_, rows) in run_world(_floor_rank, world, (store.port, world, calls, no_round),
                                     env={"OMP_NUM_THREADS": "1"}, idle_timeout=timeout):
        per_rank[rank] = rows
    names = [name for name, _ in per_rank[0]]
    return [(name, [per_rank[r][i][1] for r in range(world)]) for i, name in enumerate(names)]


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if importlib.util.find_spec("torch") is None:
        parser.error("needs torch: pip install 'distcomm[torch]'")
    if args.world < 1:
        parser.error("--world must be at least 1")
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    if args.floor:
        print(f"# distcomm-bench torch-backend --floor: world {args.world}, all_reduce 8 B, {args.calls} calls a row; "
              "µs of CPU per call (time.thread_time), each rank"
              + ("; the shared-memory round skipped (--no-round)" if args.no_round else ""))
        print(f"# machine: {report.machine_line(report.machine())}")
        sys.stdout.flush()
        try:
            rows = floor(args.world, args.calls, args.timeout, args.no_round)
        except WorldFailed as exc:
            print(f"# FAILED {str(exc).splitlines()[0]}")
            return 1
        width = max(len(name) for name, _ in rows)
        print(f"{'layer':{width}}  " + "  ".join(f"{'rank ' + str(r):>8}" for r in range(args.world)))
        for name, values in rows:
            print(f"{name:{width}}  " + "  ".join(f"{v:8.2f}" for v in values))
        return 0
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
    if args.repeat > 1:
        print(f"# --repeat {args.repeat}: both worlds ran {args.repeat} times, taking turns; each row is the run with "
              f"the median time (the lower middle one of an even count)")
    measured: dict[str, list[list[dict]]] = {label: [] for label, _ in ENGINES}
    failures = []
    for run in range(1, args.repeat + 1):
        for label, backend in ENGINES:
            job = {"library": "torch", "backend": backend, "world": args.world, "dtype": args.dtype,
                   "tensor": "torch", "plan": plan, "timeout": args.timeout, "budget": args.budget, "env": {}}
            try:
                measured[label].append(run_engine(job, args.stat, lambda row: None))
            except WorldFailed as exc:
                measured[label].append(exc.rows)
                failures.append(f"{label}, run {run}: {exc}")
    runs = {label: rows[0] if args.repeat == 1 else report.median_run(rows) for label, rows in measured.items()}
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
        meta = {"world_size": args.world, "dtype": args.dtype, "stat": args.stat, "repeat": args.repeat, "machine": info,
                "engines": labels,
                "argv": sys.argv[1:] if argv is None else list(argv)}
        report.write_json(args.json, meta, runs)
        print(f"# results written to {args.json}")
    return 1 if failures or wrong else 0
