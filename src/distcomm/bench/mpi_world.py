"""``--compare mpi``: the same plan through mpi4py's buffer calls, in a world started by ``mpiexec``.

Why MPI: it is the strongest CPU peer a user can pick on one machine (``pip install mpi4py mpich``,
the ``mpi`` extra), so it is the anchor for distcomm's latency and bandwidth goals.

The parent runs ``mpiexec -n <world> python -m distcomm.bench.mpi_world <job.json>``; each rank
checks and times every plan entry exactly as a distcomm or torch rank does (measure.warm_up,
measure.timed: the same patterns, counts, barriers and statistics), with numpy arrays and the
buffer calls (upper-case names) that move memory without pickling: Allreduce (in place), Bcast,
Reduce (in place on the root), Allgather, Reduce_scatter_block, Alltoall, Gather, Scatter, Barrier.
Each run callable is the bound mpi4py call itself (functools.partial, no Python frame of ours), so
the time is MPI's. Rank 0 gathers each row's per-rank statistics and prints them as one line of
JSON; the parent turns them into rows (report.make_row) as they arrive.

A world that fails or goes quiet for ``timeout`` seconds raises WorldFailed, after its whole process
group (mpiexec, its proxies, the ranks) is killed; mpiexec dies with the parent (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from functools import partial
from typing import Callable

import numpy as np

from . import report
from .measure import Tensors, case, rank_stats, sum_of_ramps, timed, warm_up
from .worlds import WorldFailed

_LINE = "distcomm-bench-mpi "  # prefix of rank 0's result lines (anything else on stdout is passed through)
DTYPES = ("float32", "float64", "int8", "uint8", "int32", "int64")  # numpy dtypes MPI has a type for


def available() -> str | None:
    """Why ``--compare mpi`` cannot run here, or None when it can."""
    import importlib.util

    if importlib.util.find_spec("mpi4py") is None:
        return "--compare mpi needs mpi4py and an MPI: pip install 'distcomm[mpi]' (mpi4py, mpich)"
    if shutil.which("mpiexec") is None:
        return "--compare mpi needs mpiexec on PATH (pip install mpich provides one)"
    return None


def version() -> str:
    """The MPI library's first line (e.g. "MPICH Version: 5.0.2"), without starting MPI here."""
    try:
        out = subprocess.run(["mpichversion"], capture_output=True, text=True, timeout=20).stdout
        first = out.strip().splitlines()[0] if out.strip() else ""
        return " ".join(first.split()) or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


# --- one rank (under mpiexec) -------------------------------------------------------------------------------


def cases(comm, MPI, t, count: int, rank: int, n: int) -> dict[str, Callable]:
    """op -> a thunk returning (run, check, refresh) for this row, with the patterns of collectives.CASES."""
    chunk = count // n if n else 0

    def all_reduce():
        buf = t.empty(count)
        return case(t, partial(comm.Allreduce, MPI.IN_PLACE, buf), [(buf, lambda: t.ramp(count, add=rank + 1))],
                    buf, lambda: sum_of_ramps(t, count, n))

    def broadcast():
        buf = t.empty(count)
        return case(t, partial(comm.Bcast, buf, 0), [(buf, lambda: t.ramp(count, add=rank + 1))],
                    buf, lambda: t.ramp(count, add=1))

    def reduce():
        buf = t.empty(count)
        run = partial(comm.Reduce, MPI.IN_PLACE, buf, MPI.SUM, 0) if rank == 0 else partial(comm.Reduce, buf, None, MPI.SUM, 0)
        return case(t, run, [(buf, lambda: t.ramp(count, add=rank + 1))],
                    buf if rank == 0 else None, lambda: sum_of_ramps(t, count, n))

    def all_gather():
        inp, out = t.empty(chunk), t.empty(count)
        return case(t, partial(comm.Allgather, inp, out), [(inp, lambda: t.ramp(chunk, add=rank + 1))],
                    out, lambda: np.concatenate([t.ramp(chunk, add=src + 1) for src in range(n)]))

    def reduce_scatter():
        inp, out = t.empty(count), t.empty(chunk)
        return case(t, partial(comm.Reduce_scatter_block, inp, out), [(inp, lambda: t.ramp(count, add=rank + 1))],
                    out, lambda: sum_of_ramps(t, chunk, n, offset=rank * chunk))

    def all_to_all():
        inp, out = t.empty(count), t.empty(count)
        return case(t, partial(comm.Alltoall, inp, out),
                    [(inp, lambda: np.concatenate([t.ramp(chunk, add=1 + rank * n + dst) for dst in range(n)]))],
                    out, lambda: np.concatenate([t.ramp(chunk, add=1 + src * n + rank) for src in range(n)]))

    def gather():
        inp = t.empty(chunk)
        out = t.empty(count) if rank == 0 else None
        return case(t, partial(comm.Gather, inp, out, 0), [(inp, lambda: t.ramp(chunk, add=rank + 1))],
                    out, lambda: np.concatenate([t.ramp(chunk, add=src + 1) for src in range(n)]))

    def scatter():
        out = t.empty(chunk)
        inp = t.empty(count) if rank == 0 else None
        fills = [(inp, lambda: np.concatenate([t.ramp(chunk, add=q + 1) for q in range(n)]))] if rank == 0 else []
        return case(t, partial(comm.Scatter, inp, out, 0), fills, out, lambda: t.ramp(chunk, add=rank + 1))

    def barrier():
        return case(t, comm.Barrier, [])

    return {"all_reduce": all_reduce, "broadcast": broadcast, "reduce": reduce, "all_gather": all_gather,
            "reduce_scatter": reduce_scatter, "all_to_all": all_to_all, "gather": gather, "scatter": scatter,
            "barrier": barrier}


def rank_main(job: dict) -> None:
    """One MPI rank: check and time every plan entry; rank 0 prints each row's per-rank statistics."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, n = comm.Get_rank(), comm.Get_size()
    tensors = Tensors("numpy", job["dtype"])
    for index, entry in enumerate(job["plan"]):
        run, check, refresh = cases(comm, MPI, tensors, entry["count"], rank, n)[entry["op"]]()
        wrong = check()
        warmup, iters = warm_up(run, entry, rank, partial(comm.bcast, root=0), job["budget"])
        times = timed(comm.Barrier, run, iters, job.get("sync_each", False),
                      refresh if job.get("fresh_inputs") else None)
        stats = comm.gather(rank_stats(times, wrong, warmup, iters), root=0)
        if rank == 0:
            print(_LINE + json.dumps({"index": index, "ranks": stats}), flush=True)
        del run, check, refresh


# --- the parent ----------------------------------------------------------------------------------------------


def _lines(stream, out: queue.Queue) -> None:
    for line in stream:
        out.put(line)
    out.put(None)


def run_mpi(job: dict, stat: str, on_row: Callable[[dict], None]) -> list[dict]:
    """Run ``job``'s plan on an MPI world of ``job["world"]`` ranks; call ``on_row`` with each row; return the rows.

    Raises WorldFailed (with the rows so far in ``rows``) when mpiexec fails or is quiet for
    ``job["timeout"]`` seconds.
    """
    plan, n = job["plan"], job["world"]
    rows: list[dict] = []
    with tempfile.NamedTemporaryFile("w", suffix=".json", prefix="distcomm-bench-mpi-", delete=False) as f:
        json.dump(job, f)
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    src = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)  # this distcomm, installed or not
    from ..multiprocessing.spawn import _set_pdeathsig

    proc = subprocess.Popen(
        ["mpiexec", "-n", str(n), sys.executable, "-m", "distcomm.bench.mpi_world", f.name],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True,
        preexec_fn=lambda: _set_pdeathsig(signal.SIGKILL),
    )
    lines: queue.Queue = queue.Queue()
    errors: list[str] = []
    readers = [threading.Thread(target=_lines, args=(proc.stdout, lines), daemon=True),
               threading.Thread(target=lambda: errors.extend(proc.stderr), daemon=True)]
    for reader in readers:
        reader.start()
    finished = False
    try:
        while True:
            try:
                line = lines.get(timeout=job["timeout"])
            except queue.Empty:
                doing = plan[len(rows)] if len(rows) < len(plan) else None
                where = f"{doing['op']} of {doing['size']} B" if doing else "finishing"
                raise WorldFailed(f"MPI world: no row for {job['timeout']:g} s (at {where}); killed it") from None
            if line is None:
                break
            if not line.startswith(_LINE):
                sys.stderr.write(line)
                continue
            message = json.loads(line[len(_LINE):])
            row = report.make_row(plan[message["index"]], message["ranks"], n, stat)
            rows.append(row)
            on_row(row)
        code = proc.wait()
        readers[1].join(5)
        if code != 0 or len(rows) != len(plan):
            tail = "".join(errors[-20:]).strip()
            raise WorldFailed(f"MPI world: mpiexec exited with code {code} after {len(rows)}/{len(plan)} rows"
                              + (f":\n{tail}" if tail else ""))
        finished = True
    except WorldFailed as exc:
        exc.rows = rows
        raise
    finally:
        if not finished and proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # mpiexec's own session: it, its proxies and the ranks
            except ProcessLookupError:
                pass
        proc.wait()
        os.unlink(f.name)
    return rows


if __name__ == "__main__":
    with open(sys.argv[1]) as job_file:
        rank_main(json.load(job_file))
