"""distcomm-bench: the tool runs end to end as a user runs it (a subprocess), and its plan and launcher behave.

No timing asserts: the machine is shared and the numbers are noise at these sizes. What is
asserted is what a user relies on: a table per op, every row checked with 0 wrong elements, the
comparison and speedup columns with --compare torch, the plot and JSON files, and a world that
fails or hangs being reported and killed instead of hanging the tool.

Tiers: the runs of the tool and of its worlds are slow; the fast tier (``pytest -m "not slow"``)
keeps the in-process tests of its options, plan, bus bandwidth and overview table.
"""

from __future__ import annotations

import importlib.util
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

from distcomm.bench import collectives, measure, report
from distcomm.bench.worlds import WorldFailed, run_world

TINY = ["--world", "2", "-b", "8", "-e", "4K", "-f", "16", "--timeout", "60"]
FEW = ["--iters", "3", "--warmup", "1"]


def _bench(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, "-m", "distcomm.bench", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def _rows(stdout: str) -> list[list[str]]:
    """The table rows of the output: every non-comment line, split into fields."""
    return [line.split() for line in stdout.splitlines() if line.strip() and not line.startswith("#")]


def _wrong_columns(fields: list[str]) -> list[str]:
    # size count type | time algbw busbw #wrong | per other engine: time algbw busbw #wrong | speedup per other
    engines = (len(fields) - 3 + 1) // 5  # 3 key fields, 4 per engine, 1 speedup per engine after the first
    assert len(fields) == 3 + 4 * engines + (engines - 1), fields
    return [fields[6 + 4 * e] for e in range(engines)]


@pytest.mark.slow
def test_world_of_two_prints_a_checked_table_per_op(tmp_path):
    out = tmp_path / "r.json"
    result = _bench(*TINY, "--budget", "0.01", "--sync-each", "--ops", "all", "--json", str(out))  # automatic counts
    assert result.returncode == 0, result.stdout + result.stderr
    for op in collectives.OPS:
        assert f"\n# {op}" in result.stdout
    rows = _rows(result.stdout)
    assert len(rows) == 8 * 3 + 1  # 8 B, 128 B, 2 KiB for each sized op, one barrier row
    assert all(w == "0" for fields in rows for w in _wrong_columns(fields))
    assert "wrong elements: 0 OK" in result.stdout
    data = json.loads(out.read_text())
    assert data["meta"]["world_size"] == 2 and data["meta"]["sync_each"]
    (rows_json,) = data["runs"].values()
    assert len(rows_json) == len(rows) and all(r["wrong"] == 0 and len(r["ranks"]) == 2 for r in rows_json)
    assert all(measure.MIN_ITERS <= r["iters"] <= measure.MAX_ITERS and r["warmup"] >= 1 for r in rows_json)


@pytest.mark.slow
def test_compare_torch_prints_both_with_speedup_and_plots(tmp_path):
    pytest.importorskip("torch")
    png = tmp_path / "bench.png"
    plot = ["--plot", str(png)] if importlib.util.find_spec("matplotlib") else []  # the optional 'bench' extra
    md = tmp_path / "bench.md"
    result = _bench(*TINY, *FEW, "--ops", "all_reduce,all_to_all,barrier", "--compare", "torch", *plot,
                    "--markdown", str(md))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "distcomm/gloo" in result.stdout and "torch/gloo" in result.stdout and "speedup" in result.stdout
    rows = _rows(result.stdout)
    assert len(rows) == 2 * 3 + 1 and all(len(fields) == 12 for fields in rows)
    assert all(w == "0" for fields in rows for w in _wrong_columns(fields))
    assert all(float(fields[11]) > 0 for fields in rows)
    if plot:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the Markdown tables: the machine, then per op a header and one row per size with the speedup
    text = md.read_text()
    assert "CPUs" in text.splitlines()[0] and "world size 2" in text.splitlines()[0]
    table_rows = [line for line in text.splitlines() if line.startswith("| ") and "time" not in line]
    assert len(table_rows) == len(rows), text
    speedups = [float(line.rstrip(" |").rsplit("|", 1)[1].strip().rstrip("x")) for line in table_rows]
    assert speedups == pytest.approx([float(fields[11]) for fields in rows], rel=0.01, abs=0.01)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("mpiexec") is None or importlib.util.find_spec("mpi4py") is None,
                    reason="needs mpi4py and mpiexec (the 'mpi' extra)")
def test_compare_torch_and_mpi_prints_three_engines_with_two_speedups(tmp_path):
    pytest.importorskip("torch")
    md, out = tmp_path / "bench.md", tmp_path / "bench.json"
    result = _bench("--world", "2", "-b", "8", "-e", "64", "-f", "8", "--timeout", "60", "--iters", "1",
                    "--warmup", "0", "--ops", "all", "--compare", "torch,mpi", "--markdown", str(md),
                    "--json", str(out), "--fresh-inputs", timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "distcomm/gloo" in result.stdout and "torch/gloo" in result.stdout and "mpi/mpich" in result.stdout
    rows = _rows(result.stdout)
    assert len(rows) == 8 * 2 + 1  # 8 B and 64 B for each sized op, one barrier row
    assert all(len(fields) == 3 + 3 * 4 + 2 for fields in rows)
    assert all(w == "0" for fields in rows for w in _wrong_columns(fields))  # MPI's results checked too
    assert all(float(fields[-1]) > 0 and float(fields[-2]) > 0 for fields in rows)
    assert "# gather vs mpi/mpich: speedup geometric mean" in result.stdout
    assert "mpi/mpich: 17/17 rows, wrong elements: 0 OK" in result.stdout
    # the speedup against MPI is MPI's time over distcomm's, row by row
    runs = json.loads(out.read_text())["runs"]
    ours = {(r["op"], r["size"]): r["time_us"] for r in runs["distcomm/gloo"]}
    ratios = [r["time_us"] / ours[(r["op"], r["size"])] for r in runs["mpi/mpich"]]  # in the printed order
    assert [float(fields[-1]) for fields in rows] == pytest.approx(ratios, rel=0.01, abs=0.006)
    table_rows = [line for line in md.read_text().splitlines() if line.startswith("| ") and "time" not in line]
    assert len(table_rows) == len(rows)
    assert "speedup vs torch/gloo" in md.read_text() and "speedup vs mpi/mpich" in md.read_text()
    assert json.loads(out.read_text())["meta"]["fresh_inputs"]
    assert "every input's cache lines written before each iteration" in result.stdout


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_fresh_inputs_write_every_cache_line_of_every_input_and_change_no_value(kind):
    if kind == "torch":
        pytest.importorskip("torch")
    t = measure.Tensors(kind, "float32")
    inputs = [t.empty(1000), t.empty(17)]  # 4000 bytes: 63 lines; 68 bytes: 2
    outputs = t.empty(1000)
    ran = []
    run, check, refresh = measure.case(t, lambda: ran.append(1),
                                       [(inputs[0], lambda: t.ramp(1000, add=1)), (inputs[1], lambda: t.ramp(17))],
                                       outputs, lambda: np.zeros(1000))
    assert check() == 0 and ran == [1]
    lines = [t.cache_lines(buf) for buf in inputs]
    assert [len(view) for view in lines] == [63, 2] and all(view.strides == (64,) for view in lines)
    as_numpy = (lambda buf: buf.numpy()) if kind == "torch" else (lambda buf: buf)
    before = [as_numpy(buf).copy() for buf in inputs]
    refresh()
    assert all(np.array_equal(as_numpy(buf), old) for buf, old in zip(inputs, before))
    assert ran == [1]  # refreshing runs no op
    if kind == "numpy":  # and it writes: a read-only input refuses it
        frozen = t.empty(100)
        frozen.flags.writeable = False
        with pytest.raises(ValueError, match="read-only"):
            measure.case(t, lambda: None, [(frozen, lambda: t.ramp(100))])[2]()


@pytest.mark.parametrize("sync_each", [False, True])
def test_timed_calls_before_and_a_barrier_ahead_of_every_iteration(sync_each):
    """The barrier after ``before``: a peer waiting for this rank's data would otherwise time it."""
    calls = []
    times = measure.timed(lambda: calls.append("barrier"), lambda: calls.append("run"), 3, sync_each=sync_each,
                          before=lambda: calls.append("before"))
    assert calls == ["barrier"] + ["before", "barrier", "run"] * 3 and len(times) == 3


def test_compare_refuses_unknown_engines_and_mpi_dtypes(capsys):
    with pytest.raises(SystemExit):
        collectives.main(["--compare", "nccl"])
    assert "unknown --compare" in capsys.readouterr().err
    if shutil.which("mpiexec") and importlib.util.find_spec("mpi4py"):
        with pytest.raises(SystemExit):
            collectives.main(["--compare", "mpi", "--dtype", "float16"])
        assert "MPI has no float16" in capsys.readouterr().err


def test_compare_table_has_a_speedup_column_per_other_engine():
    def row(op, size, us):
        return {"op": op, "size": size, "count": size // 4, "dtype": "float32", "time_us": us,
                "algbw": 0.0, "busbw": 0.0, "wrong": 0}

    text = report.compare_tables(["broadcast"], [row("broadcast", 8, 10.0)],
                                 [[row("broadcast", 8, 40.0)], [row("broadcast", 8, 5.0)]],
                                 ["distcomm/gloo", "torch/gloo", "mpi/mpich"])
    (fields,) = _rows(text)
    assert fields[-2:] == ["4.00", "0.50"]
    assert "# broadcast vs torch/gloo: speedup geometric mean 4.00x" in text
    assert "# broadcast vs mpi/mpich: speedup geometric mean 0.50x" in text


def test_repeated_runs_report_each_row_from_its_median_run():
    def row(op, size, us, iters, wrong=0):
        return {"op": op, "size": size, "time_us": us, "iters": iters, "wrong": wrong}

    runs = [[row("all_reduce", 8, 3.0, iters=1), row("barrier", 0, 9.0, iters=1)],
            [row("all_reduce", 8, 1.0, iters=2, wrong=2)],  # this run's world failed before the barrier row
            [row("all_reduce", 8, 2.0, iters=3), row("barrier", 0, 7.0, iters=3, wrong=1)]]
    all_reduce, barrier = report.median_run(runs)
    # the whole row is the median run's (its counts too), with every run's time in run order
    assert (all_reduce["time_us"], all_reduce["iters"], all_reduce["run_times_us"]) == (2.0, 3, [3.0, 1.0, 2.0])
    assert all_reduce["wrong"] == 2  # a wrong element in any run counts
    # of two runs, the lower middle: a real run, not their mean
    assert (barrier["time_us"], barrier["iters"], barrier["run_times_us"], barrier["wrong"]) == (7.0, 3, [9.0, 7.0], 1)


@pytest.mark.slow
def test_repeat_takes_turns_between_engines_and_reports_the_median_run(tmp_path):
    pytest.importorskip("torch")
    out = tmp_path / "r.json"
    result = _bench(*TINY, *FEW, "--ops", "all_reduce,barrier", "--compare", "torch", "--repeat", "3",
                    "--json", str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    titles = [line[3:-1] for line in result.stderr.splitlines() if line.startswith("# [")]
    assert titles == [f"{label}, run {run} of 3" for run in (1, 2, 3) for label in ("distcomm/gloo", "torch/gloo")]
    assert len(_rows(result.stdout)) == 3 + 1 and "--repeat 3" in result.stdout  # 8 B, 128 B, 2 KiB; a barrier
    data = json.loads(out.read_text())
    assert data["meta"]["repeat"] == 3
    for rows in data["runs"].values():
        assert len(rows) == 3 + 1
        for r in rows:
            assert len(r["run_times_us"]) == 3 and r["time_us"] == sorted(r["run_times_us"])[1] and r["wrong"] == 0


@pytest.mark.parametrize("argv, message", [
    (["--ops", "all_reduce", "--algo", "nosuch"], "recursive_doubling"),  # lists the valid ones
    (["--ops", "allreduce"], "unknown op"),
    (["-e", "1G"], "256M"),
    (["--repeat", "0"], "--repeat must be at least 1"),
])
def test_bad_options_are_refused_before_starting_anything(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        collectives.main(argv)
    assert info.value.code not in (0, None)
    assert message in capsys.readouterr().err + str(info.value.code)


def test_plan_rounds_sizes_to_the_world_and_bounds_iterations():
    assert collectives.parse_size("64M") == 64 << 20 and collectives.parse_size("4KiB") == 4096
    assert collectives.sizes(8, 64, 2) == [8, 16, 32, 64]
    plan = collectives.build_plan(["all_gather", "all_reduce", "barrier"], [8, 16, 32], 4, "float32")
    gather = [e for e in plan if e["op"] == "all_gather"]
    assert [e["count"] for e in gather] == [4, 8]  # 8 B is 2 elements: one per rank at least; 16 B repeats it
    assert [e["size"] for e in plan if e["op"] == "all_reduce"] == [8, 16, 32]
    assert [e["count"] for e in plan if e["op"] == "barrier"] == [0]
    for seconds in (1e-9, 20e-6, 0.06, 10.0):
        warmup, iters = measure.auto_counts(seconds, 0.2)
        assert measure.MIN_ITERS <= iters <= measure.MAX_ITERS and 0 <= warmup <= measure.MAX_WARMUP


def test_counts_come_from_the_quickest_probe_not_a_descheduled_first_call():
    """Rank 0 picks a row's counts from the quickest of ``PROBES`` warmups: one call that happened
    to be descheduled (here the first, 50 ms) must not turn a row of microsecond calls into a handful
    of timed iterations. Every rank runs the same probes and then rank 0's counts."""

    calls = []

    def run():
        calls.append(1)
        if len(calls) == 1:
            time.sleep(0.05)

    shared = []

    def share(counts):
        shared.append(counts)
        return counts

    entry = {"warmup": None, "iters": None}
    warmup, iters = measure.warm_up(run, entry, 0, share, 0.2)
    assert iters == measure.MAX_ITERS  # 1000 calls of microseconds fit the budget; 4 would if 50 ms counted
    assert warmup == len(calls) and warmup >= measure.PROBES
    assert measure.warm_up(run, {"warmup": 2, "iters": 7}, 0, share, 0.2) == (2, 7)  # given counts: as given

def test_busbw_uses_the_nccl_tests_factors():
    stats = [{"mean": 1e-3, "median": 1e-3, "min": 1e-3, "max": 1e-3, "wrong": 0, "warmup": 1, "iters": 1}] * 4
    entry = {"op": "all_reduce", "size": 10**6, "count": 250000, "dtype": "float32", "warmup": 1, "iters": 1}
    row = report.make_row(entry, stats, 4, "median")
    assert row["algbw"] == pytest.approx(1.0) and row["busbw"] == pytest.approx(1.5)
    row = report.make_row(dict(entry, op="all_gather"), stats, 4, "median")
    assert row["busbw"] == pytest.approx(0.75)


# --- the launcher: failures and hangs become one exception, and no process is left behind -----------------


def _fail_on_rank_one(rank, send):
    send(("hello", rank))
    if rank == 1:
        raise ValueError("rank one is broken")
    time.sleep(60)


def _hang(rank, send):
    send(("hello", rank))
    time.sleep(60)


@pytest.mark.slow
@pytest.mark.parametrize("target, expected", [(_fail_on_rank_one, "rank 1 failed: ValueError: rank one is broken"),
                                              (_hang, "no rank reported for 3 s")])
def test_a_failed_or_hung_world_is_reported_and_killed(target, expected):
    start = time.monotonic()
    with pytest.raises(WorldFailed, match=expected) as info:
        for _ in run_world(target, 2, idle_timeout=3, describe=lambda m: f"said {m[0]}"):
            pass
    assert time.monotonic() - start < 30
    assert not multiprocessing.active_children()  # killed and joined
    if target is _hang:  # each rank named with the last thing it said ("starting" if a loaded machine was slow)
        assert "rank 0: " in str(info.value) and "rank 1: " in str(info.value)


def _report_session(rank, send):
    send((os.getsid(0), os.getpid()))


@pytest.mark.slow
def test_each_rank_leads_its_own_session():
    """Like mpiexec's ranks (--compare mpi): under autogroup scheduling a session is a CPU share."""
    sessions = [message for _, message in run_world(_report_session, 2, idle_timeout=60)]
    assert len(sessions) == 2
    for sid, pid in sessions:
        assert sid == pid
    assert sessions[0][0] != os.getsid(0)


def _children(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    kids.append(int(entry))
        except (OSError, ValueError, IndexError):
            continue
    return kids


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("signum", ["SIGTERM", "SIGKILL"])
def test_killing_the_tool_kills_its_world(signum):
    import signal

    tool = subprocess.Popen([sys.executable, "-m", "distcomm.bench", "--world", "2", "--ops", "all_reduce", "-b", "8",
                             "-e", "8", "--iters", "100000000", "--warmup", "0"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while len(ranks := _children(tool.pid)) < 2 and time.monotonic() < deadline:  # 2 ranks (+ resource tracker)
            time.sleep(0.2)
        assert len(ranks) >= 2
        tool.send_signal(getattr(signal, signum))
        tool.wait(30)
        deadline = time.monotonic() + 10
        while any(os.path.exists(f"/proc/{pid}") for pid in ranks) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in ranks if os.path.exists(f"/proc/{pid}")]
    finally:
        tool.kill()
        tool.wait()


def test_overview_table_from_saved_results(tmp_path, capsys):
    """The README's speedup tables: per peer (gloo, then MPICH where the run has it), the peer's
    time over distcomm's per (op, world) at chosen sizes, barrier's times below it, and the lowest
    ratio over every row of every file."""
    from distcomm.bench import overview

    def result(world, rows, mpi=None):
        runs = {"distcomm/gloo": [], "torch/gloo": []}
        for op, size, ours, theirs in rows:
            runs["distcomm/gloo"].append({"op": op, "size": size, "time_us": ours})
            runs["torch/gloo"].append({"op": op, "size": size, "time_us": theirs})
        if mpi is not None:
            runs["mpi/mpich"] = [{"op": op, "size": size, "time_us": t} for op, size, t in mpi]
        return {"meta": {"world_size": world}, "runs": runs}

    two = result(2, [("all_reduce", 8, 10.0, 300.0), ("all_reduce", 1024, 20.0, 30.0), ("barrier", 0, 5.0, 250.0)],
                 mpi=[("all_reduce", 8, 2.5), ("all_reduce", 1024, 40.0), ("barrier", 0, 1.5)])
    four = result(4, [("all_reduce", 8, 40.0, 800.0), ("all_reduce", 1024, 50.0, 40.0)])
    paths = []
    for i, res in enumerate((two, four)):
        paths.append(tmp_path / f"w{i}.json")
        paths[-1].write_text(json.dumps(res))
    assert overview.main([str(p) for p in paths]) == 0
    text = capsys.readouterr().out
    gloo, mpich = text.split("\n\nmpich's time / distcomm's:\n")
    assert gloo.startswith("gloo's time / distcomm's:\n\n| op | world | 8 B | 1 KiB | 64 KiB")
    assert "| all_reduce | 2 | 30.0x | 1.5x |" in gloo
    assert "| all_reduce | 4 | 20.0x | 0.80x |" in gloo
    assert "barrier: 5.0 µs vs 250.0 µs (world 2)" in gloo
    assert "lowest ratio over every op and size: 0.80x" in gloo
    # MPICH: only the world that ran it, its ratios, its barrier
    assert "| all_reduce | 2 | 0.25x | 2.0x |" in mpich and "| all_reduce | 4 |" not in mpich
    assert "barrier: 5.0 µs vs 1.5 µs (world 2)" in mpich
    assert "lowest ratio over every op and size: 0.25x" in mpich


def test_a_tiny_speedup_is_printed_with_its_digits_not_as_zero():
    """A row where the peer is hundreds of times faster (a loaded machine, or MPICH at 8 B) shows
    its ratio, not "0.00"; ordinary ratios keep two decimals."""
    def row(time_us):
        return {"op": "all_reduce", "size": 8, "count": 2, "dtype": "float32", "time_us": time_us,
                "algbw": 0.0, "busbw": 0.0, "wrong": 0}

    fields = report.compare_row(row(1000.0), row(4.0), row(2500.0)).split()
    assert fields[-2:] == ["0.004", "2.50"], fields
