"""distcomm-bench collectives: an nccl-tests-style benchmark of distcomm's collectives, against torch's gloo and MPI.

Usage::

    distcomm-bench                                   # every op, 8 B .. 64 MiB, world 2, backend gloo
    distcomm-bench --world 4 --compare torch --plot bench.png --json bench.json
    distcomm-bench --world 2 --compare torch,mpi -e 1M      # also MPICH through mpi4py (the 'mpi' extra)
    distcomm-bench --compare mpi -e 64K -f 8192 --repeat 5  # five turns each; per row, the median run
    distcomm-bench --ops all_reduce -b 1M -e 256M --algo ring --backend tcp

The tool starts its own world: it hosts a TCPStore on a free loopback port and spawns ``--world``
processes, which rendezvous through it. With ``--compare torch`` it then does the same for
torch.distributed's gloo backend — separate worlds, one after the other, the same plan — and prints
the two side by side with the speedup (gloo time / distcomm time) on each row. ``--compare mpi``
runs the plan through mpi4py's buffer calls in a world started by ``mpiexec`` (mpi_world.py);
``--compare torch,mpi`` runs both, with a speedup column against each. ``--repeat N`` runs every
engine N times, taking turns, and reports each row from the run with the median time: a few-µs
row moves by up to 2x between runs minutes apart on a shared machine, and taking turns puts the
engines under the same load.

How each row is measured, on every rank, with the same buffers throughout:

1. check: fill the inputs with a known pattern, run the op once, count the elements that differ
   from the expected result (the #wrong column, summed over ranks; it must be 0);
2. warmup iterations, untimed;
3. a barrier, then ``iters`` iterations, each timed alone with ``time.perf_counter``.

The reported time is the slowest rank's median iteration time (``--stat mean`` for the mean, as
nccl-tests reports); algbw and busbw follow nccl-tests (see ``report.py``). Without ``--iters``,
rank 0 times three warmup iterations and picks the counts for the row from the quickest — timed iterations for about
``--budget`` seconds (at least 5, at most 1000), untimed warmups for a tenth of that (at most 200) —
and tells the other ranks through the store, so every engine gets the same time per row however
fast it is, and the default run at world 2 takes a couple of minutes. Iterations are not separated
by barriers (as in nccl-tests): an op whose data flows one way (broadcast, reduce) may overlap the
next iteration, so its time is a per-op throughput rather than an isolated latency; ``--sync-each``
puts an untimed barrier before every iteration to measure that latency instead. The inputs do not
change between iterations either, so a library that reads a peer's input in place finds it in its
own cache from the second iteration on; ``--fresh-inputs`` has every rank write each cache line of
its inputs (the values unchanged) before every iteration, untimed, as a training step would have
written them since the last call, and then an untimed barrier (a peer waiting for a rank's data
would otherwise time that rank's writes): it implies ``--sync-each``. Sizes are whole
buffers, as in nccl-tests: the all_gather output, the reduce_scatter and all_to_all input; they are
rounded down to a multiple of the world size (at least one element per rank) for those ops, and a
size that rounds to the previous one is skipped.

Ranks run with OMP_NUM_THREADS=1 unless it is set (as torchrun does); distcomm ranks get numpy
arrays unless ``--tensor torch``; torch ranks always get torch tensors.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import signal
import sys
import threading
from datetime import timedelta
from typing import Callable

import numpy as np

from . import report
from .measure import Tensors, case, rank_stats, sum_of_ramps, timed, warm_up
from .worlds import WorldFailed, connect_store, host_store, run_world

OPS = ("all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "all_to_all", "gather", "scatter", "barrier")
CHUNKED = ("all_gather", "reduce_scatter", "all_to_all", "gather", "scatter")  # buffers of world_size equal chunks
DTYPES = ("float32", "float64", "float16", "bfloat16", "int8", "uint8", "int32", "int64")
MAX_BYTES = 256 << 20

# --- the plan (parent) ----------------------------------------------------------------------------------


def parse_size(text: str) -> int:
    """Bytes from "8", "4K", "64M", "1G", "64MiB", "512KB" (K, M, G are powers of 1024, as in nccl-tests)."""
    match = re.fullmatch(r"\s*(\d+)\s*([kmg]?)(i?b)?\s*", text.lower())
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 8, 4K, 64M, 256MiB)")
    return int(match.group(1)) << {"": 0, "k": 10, "m": 20, "g": 30}[match.group(2)]


def sizes(min_bytes: int, max_bytes: int, factor: int) -> list[int]:
    out, size = [], max(1, min_bytes)
    while size <= max_bytes:
        out.append(size)
        size *= factor
    return out


def build_plan(ops, byte_sizes, world_size: int, dtype: str, iters: int | None = None,
               warmup: int | None = None) -> list[dict]:
    """One entry per (op, size) row: op, size (bytes, after rounding), count (elements), dtype, warmup, iters.

    ``warmup``/``iters`` None: chosen by the ranks at run time (``auto_counts``).
    """
    itemsize = 2 if dtype == "bfloat16" else np.dtype(dtype).itemsize
    plan = []
    for op in ops:
        counts = [0] if op == "barrier" else []
        for nbytes in [] if op == "barrier" else byte_sizes:
            count = nbytes // itemsize
            count = max(world_size, count - count % world_size) if op in CHUNKED else max(1, count)
            if not counts or count != counts[-1]:
                counts.append(count)
        for count in counts:
            plan.append({"op": op, "size": count * itemsize, "count": count, "dtype": dtype,
                         "warmup": warmup, "iters": iters})
    return plan


# --- one rank ---------------------------------------------------------------------------------------------


def _pick(lib, *names):
    """The first of ``names`` the library has (torch 2.13 renamed the tensor forms; older ones lack the new names)."""
    for name in names:
        fn = getattr(lib, name, None)
        if fn is not None:
            return fn
    raise AttributeError(f"{lib.__name__} has none of {names}")


def _all_reduce(d, t: Tensors, count: int, rank: int, n: int):
    buf = t.empty(count)
    return case(t, lambda: d.all_reduce(buf), [(buf, lambda: t.ramp(count, add=rank + 1))],
                 buf, lambda: sum_of_ramps(t, count, n))


def _broadcast(d, t: Tensors, count: int, rank: int, n: int):
    buf = t.empty(count)
    return case(t, lambda: d.broadcast(buf, src=0), [(buf, lambda: t.ramp(count, add=rank + 1))],
                 buf, lambda: t.ramp(count, add=1))


def _reduce(d, t: Tensors, count: int, rank: int, n: int):
    buf = t.empty(count)
    return case(t, lambda: d.reduce(buf, dst=0), [(buf, lambda: t.ramp(count, add=rank + 1))],
                 buf if rank == 0 else None, lambda: sum_of_ramps(t, count, n))  # only the root's result is defined


def _all_gather(d, t: Tensors, count: int, rank: int, n: int):
    chunk = count // n
    inp, out = t.empty(chunk), t.empty(count)
    gather = _pick(d, "all_gather_single", "all_gather_into_tensor")
    return case(t, lambda: gather(out, inp), [(inp, lambda: t.ramp(chunk, add=rank + 1))],
                 out, lambda: np.concatenate([t.ramp(chunk, add=src + 1) for src in range(n)]))


def _reduce_scatter(d, t: Tensors, count: int, rank: int, n: int):
    chunk = count // n
    inp, out = t.empty(count), t.empty(chunk)
    scatter = _pick(d, "reduce_scatter_single", "reduce_scatter_tensor")
    return case(t, lambda: scatter(out, inp), [(inp, lambda: t.ramp(count, add=rank + 1))],
                 out, lambda: sum_of_ramps(t, chunk, n, offset=rank * chunk))


def _all_to_all(d, t: Tensors, count: int, rank: int, n: int):
    chunk = count // n
    inp, out = t.empty(count), t.empty(count)
    # chunk (from r, to q) holds ramp(add=1 + r*n + q): every (sender, receiver) pair is distinguishable.
    return case(t, lambda: d.all_to_all_single(out, inp),
                 [(inp, lambda: np.concatenate([t.ramp(chunk, add=1 + rank * n + dst) for dst in range(n)]))],
                 out, lambda: np.concatenate([t.ramp(chunk, add=1 + src * n + rank) for src in range(n)]))


def _gather(d, t: Tensors, count: int, rank: int, n: int):
    chunk = count // n
    inp = t.empty(chunk)
    outs = [t.empty(chunk) for _ in range(n)] if rank == 0 else None
    return case(t, lambda: d.gather(inp, outs, dst=0), [(inp, lambda: t.ramp(chunk, add=rank + 1))],
                outs, lambda: np.concatenate([t.ramp(chunk, add=src + 1) for src in range(n)]))


def _scatter(d, t: Tensors, count: int, rank: int, n: int):
    chunk = count // n
    out = t.empty(chunk)
    ins = [t.empty(chunk) for _ in range(n)] if rank == 0 else None
    fills = [(b, lambda q=q: t.ramp(chunk, add=q + 1)) for q, b in enumerate(ins or [])]
    return case(t, lambda: d.scatter(out, ins, src=0), fills, out, lambda: t.ramp(chunk, add=rank + 1))


def _barrier(d, t: Tensors, count: int, rank: int, n: int):
    return case(t, d.barrier, [])


CASES: dict[str, Callable] = {
    "all_reduce": _all_reduce, "broadcast": _broadcast, "reduce": _reduce, "all_gather": _all_gather,
    "reduce_scatter": _reduce_scatter, "all_to_all": _all_to_all, "gather": _gather, "scatter": _scatter,
    "barrier": _barrier,
}


def rank_main(rank: int, send: Callable, job: dict) -> None:
    """One rank of a benchmark world: join it, then check and time every plan entry, reporting each."""
    if job["library"] == "torch":
        import torch.distributed as d

        if job["backend"] == "distcomm":  # torch's API over distcomm (bench/torch_backend_world.py)
            import distcomm.torch_backend  # noqa: F401 - registers torch's backend "distcomm"
    else:
        import distcomm as d
    timeout = job["timeout"]
    n = job["world"]
    d.init_process_group(job["backend"], store=connect_store(job["library"], job["port"], timeout), rank=rank,
                         world_size=n, timeout=timedelta(seconds=timeout))
    store = connect_store(job["library"], job["port"], timeout)  # the tool's own connection, for warm_up
    tensors = Tensors(job["tensor"], job["dtype"])
    for index, entry in enumerate(job["plan"]):
        send(("start", index))
        run, check, refresh = CASES[entry["op"]](d, tensors, entry["count"], rank, n)
        wrong = check()

        def share(counts: str | None, key=f"distcomm-bench/counts/{index}") -> str:
            if counts is not None:
                store.set(key, counts)
            return store.get(key).decode()

        warmup, iters = warm_up(run, entry, rank, share, job["budget"])
        times = timed(d.barrier, run, iters, job.get("sync_each", False),
                      refresh if job.get("fresh_inputs") else None)
        send(("row", index, rank_stats(times, wrong, warmup, iters)))
        del run, check, refresh
    d.destroy_process_group()


# --- one engine's world (parent) --------------------------------------------------------------------------


def run_engine(job: dict, stat: str, on_row: Callable[[dict], None]) -> list[dict]:
    """Run ``job`` on its own world; call ``on_row`` with each row as the last rank reports it; return the rows.

    Raises WorldFailed (after killing the world) if a rank fails; the rows finished so far are in
    the exception's ``rows`` attribute.
    """
    plan, n = job["plan"], job["world"]
    store = host_store(job["library"], job["timeout"])
    reports: dict[int, dict[int, dict]] = {}
    rows: list[dict] = []

    def describe(message) -> str:
        entry = plan[message[1]]
        what = "running" if message[0] == "start" else "finished"
        return f"{what} {entry['op']} of {entry['size']} B"

    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **job.get("env", {})}
    world = run_world(rank_main, n, (dict(job, port=store.port),), env, idle_timeout=job["timeout"],
                      describe=describe)
    try:
        for rank, message in world:
            if message[0] != "row":
                continue
            _, index, stats = message
            reports.setdefault(index, {})[rank] = stats
            if len(reports[index]) == n:
                by_rank = reports.pop(index)
                row = report.make_row(plan[index], [by_rank[r] for r in range(n)], n, stat)
                rows.append(row)
                on_row(row)
    except WorldFailed as exc:
        exc.rows = rows
        raise
    finally:
        world.close()  # kills the ranks if we leave early (an exception, SIGTERM)
        close = getattr(store, "close", None)  # torch's TCPStore has no close(): its server lives with the object
        if close is not None:
            close()
    return rows


# --- command line ------------------------------------------------------------------------------------------


def _op_list(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    if names == ["all"]:
        return list(OPS)
    unknown = [name for name in names if name not in OPS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown op(s) {', '.join(unknown) or text!r}; choose from {', '.join(OPS)} or all")
    return [op for op in OPS if op in names]


COMPARE = ("torch", "mpi")


def _compare_list(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in COMPARE]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown --compare {', '.join(unknown) or text!r}; choose from torch, mpi, torch,mpi")
    return [name for name in COMPARE if name in names]


def _algo_key(op: str) -> str:
    return op.replace("_", "")  # select.py's table key: all_reduce -> allreduce


def algo_env(ops: list[str], requests: list[str]) -> dict[str, str]:
    """DISTCOMM_ALGO_<OP> variables for ``--algo`` values: ``NAME`` (every chosen op that has it) or ``OP=NAME``."""
    from .._algorithms.select import ALGORITHMS

    env: dict[str, str] = {}
    for request in requests:
        op, _, name = request.rpartition("=")
        if op and op not in OPS:
            raise ValueError(f"--algo {request}: unknown op {op!r}; choose from {', '.join(OPS)}")
        targets = [op] if op else [o for o in ops if name in ALGORITHMS[_algo_key(o)]]
        if not targets:
            known = "; ".join(f"{o}: {', '.join(ALGORITHMS[_algo_key(o)])}" for o in ops)
            raise ValueError(f"--algo {name}: no chosen op has that algorithm ({known})")
        for target in targets:
            if name not in ALGORITHMS[_algo_key(target)]:
                raise ValueError(f"--algo {request}: {target} algorithms are {', '.join(ALGORITHMS[_algo_key(target)])}")
            env[f"DISTCOMM_ALGO_{_algo_key(target).upper()}"] = name
    return env


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="distcomm-bench",
        description="nccl-tests-style benchmark of distcomm's collectives (optionally against torch.distributed's gloo). "
                    "time = the slowest rank's median (--stat) time per iteration; algbw = size/time; "
                    "busbw = algbw x the nccl-tests factor of the op.",
        epilog="Other benchmarks (each with --help): distcomm-bench store, ddp, torch-backend, pingpong; "
               "distcomm-bench overview FILE.json ... prints the README's tables from saved results.",
    )
    parser.add_argument("--ops", "-o", type=_op_list, default=list(OPS),
                        help=f"comma-separated ops or 'all' (default: all = {','.join(OPS)})")
    parser.add_argument("--min-bytes", "-b", type=parse_size, default=8, help="smallest size (default 8)")
    parser.add_argument("--max-bytes", "-e", type=parse_size, default=64 << 20, help="largest size (default 64M; at most 256M)")
    parser.add_argument("--step-factor", "-f", type=int, default=2, help="size multiplier between rows (default 2)")
    parser.add_argument("--iters", "-n", type=int, default=None, help="timed iterations per row (default: by size)")
    parser.add_argument("--warmup", "-w", type=int, default=None, help="untimed iterations per row (default: by size)")
    parser.add_argument("--budget", type=float, default=0.2,
                        help="seconds of timed iterations per row that the automatic counts aim at (default 0.2)")
    parser.add_argument("--dtype", "-d", choices=DTYPES, default="float32", help="element type (default float32)")
    parser.add_argument("--world", "-p", type=int, default=2, help="number of processes to start (default 2)")
    parser.add_argument("--backend", default="gloo",
                        help="distcomm backend: gloo (distcomm's default CPU engine), tcp, shm when available (default gloo)")
    parser.add_argument("--algo", action="append", default=[], metavar="[OP=]NAME",
                        help="force a point-to-point algorithm (sets DISTCOMM_ALGO_<OP>; used by backend tcp), e.g. ring or "
                             "all_reduce=halving_doubling; repeatable. Other DISTCOMM_* variables in the environment "
                             "reach the ranks too and are shown in the header")
    parser.add_argument("--tensor", choices=("numpy", "torch"), default="numpy",
                        help="buffers distcomm ranks use (default numpy; torch ranks always use torch tensors)")
    parser.add_argument("--compare", type=_compare_list, default=[],
                        help="also run the same plan on torch.distributed's gloo backend (torch), on MPI through mpi4py "
                             "under mpiexec (mpi), or both (torch,mpi), and print them side by side with distcomm's "
                             "speedup over each")
    parser.add_argument("--repeat", type=int, default=1, metavar="N",
                        help="run every engine N times, taking turns (distcomm, torch, mpi, distcomm, ...), and report "
                             "per row the run with the median time: on a shared machine the engines then meet the "
                             "same load, and one slow run does not decide a row (default 1)")
    parser.add_argument("--sync-each", action="store_true",
                        help="untimed barrier before every timed iteration: one-way ops (broadcast, reduce) then report "
                             "an isolated latency instead of a back-to-back throughput")
    parser.add_argument("--fresh-inputs", action="store_true",
                        help="every rank writes each cache line of its inputs (values unchanged) before every timed "
                             "iteration, untimed: a peer that reads them then finds them changed, as after a training "
                             "step, not in its own cache from the iteration before; implies --sync-each (a peer "
                             "waiting for a rank's data would otherwise time those writes)")
    parser.add_argument("--stat", choices=("median", "mean"), default="median",
                        help="per-rank statistic of the iteration times; the row reports its maximum over ranks (default median)")
    parser.add_argument("--plot", metavar="FILE.png", help="draw latency and busbw against size (needs matplotlib)")
    parser.add_argument("--json", metavar="FILE", help="write the raw results, with per-rank statistics")
    parser.add_argument("--markdown", metavar="FILE", help="write the tables as Markdown (machine and settings included)")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds a world may go without finishing a row before it is killed (default 300)")
    return parser


def _validate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.world < 1:
        parser.error("--world must be at least 1")
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    if args.max_bytes > MAX_BYTES:
        parser.error(f"--max-bytes is at most {MAX_BYTES >> 20}M")
    if args.min_bytes > args.max_bytes:
        parser.error("--min-bytes is larger than --max-bytes")
    if args.step_factor < 2:
        parser.error("--step-factor must be at least 2")
    if (args.iters is not None and args.iters < 1) or (args.warmup is not None and args.warmup < 0):
        parser.error("--iters must be at least 1 and --warmup at least 0")
    if args.dtype == "bfloat16" and args.tensor == "numpy" and "torch" not in args.compare:
        parser.error("bfloat16 needs torch tensors: add --tensor torch (numpy has no bfloat16)")
    # find_spec, not import: importing torch here would cost the parent seconds for nothing.
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        parser.error("--plot needs matplotlib: pip install 'distcomm[bench]' (or pip install matplotlib)")
    if "mpi" in args.compare:
        from .mpi_world import DTYPES as MPI_DTYPES, available

        problem = available()
        if problem:
            parser.error(problem)
        if args.dtype not in MPI_DTYPES:
            parser.error(f"--compare mpi: MPI has no {args.dtype} type here; use one of {', '.join(MPI_DTYPES)}")
    if ("torch" in args.compare or args.tensor == "torch") and importlib.util.find_spec("torch") is None:
        parser.error("--compare torch and --tensor torch need torch: pip install 'distcomm[torch]'")
    from .. import Backend

    try:
        Backend(args.backend)
    except ValueError as exc:
        parser.error(f"--backend: {exc}")


def _distcomm_version() -> str:
    from .. import __version__

    return __version__


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)  # unwinds through run_world, which kills the ranks


def main(argv: list[str] | None = None) -> int:
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.dtype == "bfloat16" and "torch" in args.compare:
        args.tensor = "torch"
    _validate(parser, args)
    try:
        env = algo_env(args.ops, args.algo)
    except ValueError as exc:
        parser.error(str(exc))
    plan = build_plan(args.ops, sizes(args.min_bytes, args.max_bytes, args.step_factor), args.world,
                      args.dtype, args.iters, args.warmup)
    engines = [("distcomm", f"distcomm/{args.backend}", args.backend, args.tensor, env)]
    if "torch" in args.compare:
        engines.append(("torch", "torch/gloo", "gloo", "torch", {}))
    if "mpi" in args.compare:
        engines.append(("mpi", "mpi/mpich", "mpi", "numpy", {}))

    info = report.machine()
    print(f"# distcomm-bench: world {args.world}, {args.dtype}, ops {','.join(args.ops)}, "
          f"{report.format_bytes(args.min_bytes)} .. {report.format_bytes(args.max_bytes)}")
    print(f"# machine: {report.machine_line(info)}")
    barrier = "a barrier before every iteration" if args.sync_each or args.fresh_inputs else "a barrier before timing"
    buffers = "same buffers, every input's cache lines written before each iteration" if args.fresh_inputs \
        else "same buffers"
    print(f"# time: the slowest rank's {args.stat} over timed iterations (per-iteration perf_counter, "
          f"{barrier}, {buffers}); busbw: nccl-tests factors; #wrong: checked every row")
    inherited = {k: v for k, v in os.environ.items() if k.startswith("DISTCOMM_")}  # tuning knobs the ranks inherit
    for library, label, backend, kind, extra in engines:
        if library == "mpi":
            from .mpi_world import version as mpi_version

            version = mpi_version()
        else:
            version = info.get("torch") if library == "torch" else _distcomm_version()
        knobs = {**inherited, **extra} if library == "distcomm" else {}
        note = f", {' '.join(f'{k}={v}' for k, v in sorted(knobs.items()))}" if knobs else ""
        print(f"# {label}: {library} {version}, {kind} buffers{note}")
    if env and args.backend != "tcp":
        print("# note: --algo sets DISTCOMM_ALGO_<OP>, read by the point-to-point collectives (backend tcp, or any "
              "backend with DISTCOMM_SHM_COLLECTIVES=0); the shared-memory collectives have their own knobs")
    sys.stdout.flush()

    if args.repeat > 1:
        print(f"# --repeat {args.repeat}: every engine ran {args.repeat} times, taking turns; each row is the run "
              f"with the median time (the lower middle one of an even count)")
    live = sys.stderr if len(engines) > 1 or args.repeat > 1 else sys.stdout
    measured: dict[str, list[list[dict]]] = {label: [] for _, label, *_ in engines}
    failures: list[str] = []
    for run in range(1, args.repeat + 1):
        for library, label, backend, kind, extra in engines:
            current = {"op": None}
            title = f"{label}, run {run} of {args.repeat}" if args.repeat > 1 else label

            def on_row(row: dict, title=title, current=current) -> None:
                if row["op"] != current["op"]:
                    engine = f"\n# [{title}]" if current["op"] is None else ""
                    current["op"] = row["op"]
                    print(f"{engine}\n{report.table_header(row['op'])}", file=live)
                print(report.table_row(row), file=live, flush=True)

            job = {"library": library, "backend": backend, "world": args.world, "dtype": args.dtype,
                   "tensor": kind, "plan": plan, "timeout": args.timeout, "budget": args.budget, "env": extra,
                   "sync_each": args.sync_each, "fresh_inputs": args.fresh_inputs}
            try:
                if library == "mpi":
                    from .mpi_world import run_mpi

                    measured[label].append(run_mpi(job, args.stat, on_row))
                else:
                    measured[label].append(run_engine(job, args.stat, on_row))
            except WorldFailed as exc:
                measured[label].append(exc.rows)
                failures.append(f"{title}: {exc}")
                print(f"\n# {title} FAILED: {exc}", file=sys.stderr, flush=True)
    runs = {label: rows[0] if args.repeat == 1 else report.median_run(rows) for label, rows in measured.items()}

    labels = [label for _, label, *_ in engines]
    if len(engines) > 1:
        print()
        for other in labels[1:]:
            print(f"# speedup{'' if len(labels) == 2 else ' vs ' + other.split('/')[0]} = {other} time / "
                  f"{labels[0]} time (above 1: {labels[0]} is faster)")
        theirs = runs[labels[1]] if len(labels) == 2 else [runs[label] for label in labels[1:]]
        print(report.compare_tables(args.ops, runs[labels[0]], theirs, labels))
    elif args.repeat > 1:
        print()
        print(report.engine_tables(args.ops, runs[labels[0]]))
    print()
    wrong = 0
    for label in labels:
        count = report.wrong_total(runs[label])
        wrong += count
        print(f"# {label}: {len(runs[label])}/{len(plan)} rows, wrong elements: {count} {'OK' if count == 0 else 'FAILED'}")
    for failure in failures:
        print(f"# FAILED {failure.splitlines()[0]}")

    meta = {"world_size": args.world, "backend": args.backend, "dtype": args.dtype, "stat": args.stat,
            "tensor": args.tensor, "sync_each": args.sync_each, "fresh_inputs": args.fresh_inputs, "repeat": args.repeat, "algo_env": env, "distcomm_env": inherited, "machine": info, "engines": labels,
            "argv": sys.argv[1:] if argv is None else list(argv)}
    if args.json:
        report.write_json(args.json, meta, runs)
        print(f"# results written to {args.json}")
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(report.markdown_tables(args.ops, runs, meta))
        print(f"# Markdown tables written to {args.markdown}")
    if args.plot:
        from .plot import plot

        plot(args.plot, args.ops, runs, meta)
        print(f"# plot written to {args.plot}")
    return 1 if failures or wrong else 0


if __name__ == "__main__":
    sys.exit(main())
