"""The flight recorder: the ring, the call site, the settings, what each path records, dumps (on
demand, on every rank, on a mismatch), and the DETAIL shape check."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest

from distcomm import flight_recorder as fr
from harness import run_world

SRC = str(Path(__file__).resolve().parents[1] / "src")


def _line_of(marker: str) -> int:
    with open(__file__) as f:
        for i, line in enumerate(f, 1):
            if marker in line and "_line_of" not in line:
                return i
    raise AssertionError(marker)


# -- the ring, in process -------------------------------------------------------------------------
def test_ring_keeps_the_last_n_oldest_first():
    rec = fr.FlightRecorder(3)
    for seq in range(1, 6):
        fr.complete(rec.record("g", seq, "all_reduce", 8, "float32", None))
    assert [e[fr.SEQ] for e in rec.entries()] == [3, 4, 5]
    assert [e[fr.SEQ] for e in rec.recent(2)] == [5, 4]
    assert all(e[fr.STATE] == fr.COMPLETED and e[fr.T_COMPLETED] >= e[fr.T_CREATED] for e in rec.entries())


def test_record_names_the_callers_line_outside_distcomm():
    rec = fr.FlightRecorder(4)
    entry = rec.record("g", 1, "barrier", 0, None, None)  # SITE-HERE
    assert fr.resolve_site(entry[fr.SITE]) == (__file__, _line_of("# SITE-HERE"))
    assert fr.to_dict(entry)["site"] == {"file": __file__, "line": _line_of("# SITE-HERE"),
                                         "function": "test_record_names_the_callers_line_outside_distcomm"}
    assert fr.format_site(fr.resolve_site(entry[fr.SITE])) == f"test_flight_recorder.py:{_line_of('# SITE-HERE')}"


def _deep_module_loop_site():
    # a loop far into a long function: the line comes from the instruction offset, resolved late
    rec = fr.FlightRecorder(4)
    out = []
    for i in range(3):
        out.append(rec.record("g", i, "all_reduce", 8, "float32", None))  # SITE-LOOP
    return [fr.to_dict(e)["site"]["line"] for e in out]


def test_site_of_a_loop():
    assert _deep_module_loop_site() == [_line_of("# SITE-LOOP")] * 3


# -- started in C, against the Python method it stands in for --------------------------------------
def _records_from_here(rec, skip: int):
    """The record of the Python method and of ``rec.started`` (C where built), from one frame."""
    py = fr.FlightRecorder.started(rec, "g", 7, "broadcast", 8, "float32", 1, skip)  # SITE-PY
    c = rec.started("g", 7, "broadcast", 8, "float32", 1, skip)  # SITE-C
    return py, c


def _records_from_a_file_not_seen_yet(rec, skip: int):
    # a caller whose file the recorder has not classified: both learn it through the frame walk
    namespace = {"records": _records_from_here}
    exec(compile("def call(rec, skip):\n    return records(rec, skip)\n", f"/tmp/not-seen-{time.time_ns()}.py",
                 "exec"), namespace)
    return namespace["call"](rec, skip)


@pytest.mark.skipif(not fr.STARTED_IN_C, reason="the C record is not built here (no compiler at install)")
def test_started_in_c_makes_the_python_methods_record():
    rec = fr.FlightRecorder(8)
    assert rec.started != rec.record  # the instance's own (C) started, not the class's method
    py, c = _records_from_here(rec, 1)  # skip 1: the caller's frame, at each call's own line
    assert fr.resolve_site(py[fr.SITE])[1] == _line_of("# SITE-PY")
    assert fr.resolve_site(c[fr.SITE])[1] == _line_of("# SITE-C")
    for get in (_records_from_here, _records_from_a_file_not_seen_yet):
        for skip in (2, 3, 10_000):  # the caller's caller, one more, past the stack's top (no site)
            py, c = get(rec, skip)
            assert c[fr.ID] == py[fr.ID] + 1
            assert c[:fr.ID] + c[fr.ID + 1:fr.T_CREATED] == py[:fr.ID] + py[fr.ID + 1:fr.T_CREATED]
            assert (c[fr.SITE] is None) == (skip == 10_000)
            assert c[fr.T_COMPLETED:] == py[fr.T_COMPLETED:] == [None, fr.STARTED, None, None]
            assert type(c[fr.T_CREATED]) is float and 0 <= c[fr.T_CREATED] - py[fr.T_CREATED] < 5
    # both went into the ring under their ids: the last 8 records, oldest first
    assert [e[fr.ID] for e in rec.entries()] == list(range(rec.recorded() - 8, rec.recorded()))
    assert rec.entries()[-1] is c


@pytest.mark.skipif(not fr.STARTED_IN_C, reason="the C record is not built here (no compiler at install)")
def test_a_record_someone_holds_survives_the_ring_wrapping():
    # the C record refills the record its slot evicts when only the ring holds it: one kept by a
    # caller (or a reader's copy of the ring) must never change
    rec = fr.FlightRecorder(2)
    kept = rec.started("g", 1, "reduce", 8, "float32", 0, 1)
    fr.complete(kept)
    before = list(kept)
    for seq in range(2, 9):
        rec.started("g", seq, "gather", 16, "int64", 1, 1)
    assert kept == before
    copy = rec.entries()  # a reader's copy holds the ring's records while the ring goes on
    frozen = [list(e) for e in copy]
    for seq in range(9, 13):
        rec.started("g", seq, "scatter", 4, "int8", None, 1)
    assert [list(e) for e in copy] == frozen
    assert [e[fr.SEQ] for e in rec.entries()] == [11, 12]
    assert [e[fr.OP] for e in rec.entries()] == ["scatter", "scatter"]
    assert all(e[fr.STATE] == fr.STARTED and e[fr.T_COMPLETED] is None for e in rec.entries())


@pytest.mark.skipif(not fr.STARTED_IN_C, reason="the C record is not built here (no compiler at install)")
def test_started_in_c_walks_past_library_frames_to_the_users_line():
    # a call made through library code (torch's API calling the backend, distcomm's DDP): the C
    # record walks past the frames of files it knows are library code, as the Python walk does
    import distcomm

    rec = fr.FlightRecorder(8)
    namespace = {"rec": rec}
    library_file = os.path.join(os.path.dirname(distcomm.__file__), f"not_a_module_{time.time_ns()}.py")
    exec(compile("def api(skip):\n    return rec.started('g', 3, 'all_reduce', 8, 'float32', None, skip)\n"
                 "def library(skip):\n    return api(skip)\n", library_file, "exec"), namespace)
    for _ in range(2):  # the first call learns the file through Python's walk, the next walks in C
        c = namespace["library"](2)  # SITE-THROUGH-LIBRARY
        assert fr.resolve_site(c[fr.SITE]) == (__file__, _line_of("# SITE-THROUGH-LIBRARY"))
        assert fr.is_library_file(library_file)


def test_snapshot_and_failure():
    rec = fr.FlightRecorder(8)
    fr.complete(rec.record("a", 1, "all_reduce", 8, "float32", None))
    fr.fail(rec.record("a", 2, "broadcast", 8, "float32", 1), RuntimeError("x" * 500))
    rec.record("b", 1, "barrier", 0, None, None, fr.STARTED)
    snap = rec.snapshot()
    assert snap["a"]["last_started"]["seq"] == 2 and snap["a"]["last_started"]["state"] == "failed"
    assert snap["a"]["last_started"]["error"].startswith("RuntimeError: xxx") and len(snap["a"]["last_started"]["error"]) < 140
    assert snap["a"]["last_completed"]["seq"] == 1
    assert snap["b"]["last_started"]["state"] == "started" and snap["b"]["last_completed"] is None


def test_a_destroyed_groups_entry_goes_once_its_records_have_left_the_ring():
    rec = fr.FlightRecorder(10)
    rec.register_group("live", 0, [0, 1], 0, 30.0)  # never destroyed, never recorded: kept
    for i in range(1, 2000):
        rec.register_group(f"g{i}", i, [0, 1], 0, 30.0)
        fr.complete(rec.record(f"g{i}", 1, "all_reduce", 8, "float32", None))
        rec.retire_group(f"g{i}")
    assert len(rec.groups) <= 1 + 10 + fr.RETIRED_GROUPS_KEPT + 1  # was one entry per group ever made
    assert "live" in rec.groups
    in_ring = {e[fr.GROUP] for e in rec.entries()}
    assert in_ring <= set(rec.groups), "a dump must still name the ranks of every group in the ring"
    rec.register_group("g5", 5, [0], 0, 30.0)  # a name made again is a live group
    for i in range(2000, 2400):
        rec.register_group(f"g{i}", i, [0, 1], 0, 30.0)
        rec.retire_group(f"g{i}")
    assert "g5" in rec.groups and "live" in rec.groups


def _groups_made_and_destroyed(rank, world_size, count):
    import distcomm as dist

    fr.configure(50)  # a ring of 50 records
    dist.init_process_group("tcp", timeout=timedelta(seconds=20))
    x = np.ones(2, dtype=np.float32)
    for _ in range(count):
        group = dist.new_group([0, 1])
        dist.all_reduce(x, group=group)
        dist.destroy_process_group(group)
    names = len(fr.recorder.groups)
    dist.destroy_process_group()
    return names


def test_a_job_that_makes_and_destroys_groups_keeps_a_bounded_group_table():
    count = fr.RETIRED_GROUPS_KEPT + 150
    names = run_world(_groups_made_and_destroyed, 2, args=(count,), timeout=120)
    assert all(n <= 1 + 50 + fr.RETIRED_GROUPS_KEPT + 1 for n in names), names  # was count + 1 (the world)


def test_dump_round_trips_and_needs_a_directory(tmp_path, monkeypatch):
    rec = fr.FlightRecorder(4)
    rec.rank = 3
    fr.complete(rec.record("g", 1, "all_reduce", 8, "float32", None))
    monkeypatch.delenv("DISTCOMM_TRACE_DIR", raising=False)
    assert rec.dump() is None  # no directory: no file behind the user's back
    monkeypatch.setenv("DISTCOMM_TRACE_DIR", str(tmp_path))
    path = rec.dump(reason="test")
    assert path == str(tmp_path / "distcomm_trace_rank_3.jsonl")
    header, records = fr.read_dump(path)
    assert header["rank"] == 3 and header["reason"] == "test"
    assert records[0]["op"] == "all_reduce" and records[0]["site"]["file"] == __file__


def test_dumps_from_two_threads_at_once_never_make_a_broken_file(tmp_path):
    """A rank that times out dumps from its own thread while its answer thread dumps at another
    rank's request: each dump is written aside under a name of its own, so the file is always one
    whole dump (one shared temporary name once left NUL bytes where a reader expected JSON)."""
    import threading

    rec = fr.FlightRecorder(512)
    rec.rank = 1
    for seq in range(512):
        fr.complete(rec.record("g", seq, "all_reduce", 8, "float32", None))
    errors = []

    def dump_many():
        try:
            for _ in range(40):
                rec.dump(str(tmp_path), reason="race")
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=dump_many) for _ in range(3)]
    for t in threads:
        t.start()
    reads = 0
    while any(t.is_alive() for t in threads) or reads == 0:
        path = tmp_path / "distcomm_trace_rank_1.jsonl"
        if path.exists():
            header, records = fr.read_dump(str(path))
            assert header["rank"] == 1 and len(records) == 512
            reads += 1
    for t in threads:
        t.join()
    assert not errors, errors
    assert sorted(os.listdir(tmp_path)) == ["distcomm_trace_rank_1.jsonl"]  # no temporary file left


def _env_capacity(value: str) -> subprocess.CompletedProcess:
    code = "from distcomm import flight_recorder as fr; print(None if fr.recorder is None else fr.recorder.capacity)"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={"PYTHONPATH": SRC, "DISTCOMM_TRACE_BUFFER_SIZE": value})


@pytest.mark.slow
def test_buffer_size_from_the_environment():
    assert _env_capacity("").stdout.strip() == "2000"
    assert _env_capacity("16").stdout.strip() == "16"
    assert _env_capacity("0").stdout.strip() == "None"
    bad = _env_capacity("lots")
    assert bad.returncode != 0 and "DISTCOMM_TRACE_BUFFER_SIZE must be a whole number" in bad.stderr


# -- what a world records ---------------------------------------------------------------------------
def _record_everything(rank, world_size, engine):
    import distcomm as dist

    dist.init_process_group(engine, timeout=timedelta(seconds=10))
    x = np.ones(2, dtype=np.float32)
    dist.all_reduce(x)  # REC-SMALL
    dist.broadcast(np.ones(1000, dtype=np.int64), src=1)  # REC-BCAST
    dist.all_reduce(np.ones(100_000, dtype=np.float64)).__class__  # REC-BIG
    if rank == 0:
        dist.send(x, 1, tag=7)  # REC-SEND
    else:
        dist.recv(x, 0, tag=7)  # REC-RECV
    work = dist.all_reduce(x, async_op=True)  # REC-ASYNC
    work.wait()
    dist.barrier()  # REC-BARRIER
    return [fr.to_dict(e) for e in fr.recorder.entries()]


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["tcp", "gloo"])
def test_every_path_records_op_seq_size_peer_and_site(engine):
    results = run_world(_record_everything, 2, args=(engine,), timeout=60)
    for rank, records in enumerate(results):
        got = [(r["op"], r["seq"], r["nbytes"], r["dtype"], r["peer"], r["site"]["line"], r["state"], r["tag"])
               for r in records]
        site = {m: _line_of(f"# REC-{m}") for m in ("SMALL", "BCAST", "BIG", "SEND", "RECV", "ASYNC", "BARRIER")}
        p2p = (("send", None, 8, "float32", 1, site["SEND"], "completed", 7) if rank == 0 else
               ("recv", None, 8, "float32", 0, site["RECV"], "completed", 7))
        assert got == [
            ("all_reduce", 1, 8, "float32", None, site["SMALL"], "completed", None),
            ("broadcast", 2, 8000, "int64", 1, site["BCAST"], "completed", None),
            ("all_reduce", 3, 800_000, "float64", None, site["BIG"], "completed", None),
            p2p,
            ("all_reduce", 4, 8, "float32", None, site["ASYNC"], "completed", None),
            ("barrier", 5, 0 if engine == "gloo" else None, None, None, site["BARRIER"], "completed", None),
        ]
        assert all(r["time_completed"] >= r["time_created"] for r in records)
        assert all(r["site"]["file"] == __file__ for r in records)


def _dump_everywhere(rank, world_size, trace_dir):
    import distcomm as dist

    dist.init_process_group("tcp", timeout=timedelta(seconds=4))
    x = np.ones(2, dtype=np.float32)
    for _ in range(3):
        dist.all_reduce(x)
    dist.barrier()
    if rank == 0:
        dist.dump_flight_recorder(all_ranks=True)
    deadline = time.monotonic() + 5
    path = os.path.join(trace_dir, f"distcomm_trace_rank_{rank}.jsonl")
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)  # the other ranks sit outside distcomm: their watchdog dumps
    dist.barrier()
    return os.path.exists(path)


@pytest.mark.slow
def test_dump_on_demand_reaches_every_rank(tmp_path):
    assert run_world(_dump_everywhere, 3, args=(str(tmp_path),), timeout=60,
                     env={"DISTCOMM_TRACE_DIR": str(tmp_path)}) == [True, True, True]
    from distcomm import trace

    lines = trace.analyze(trace.load(str(tmp_path)))
    assert "  ranks 0,1,2 completed barrier #4 (test_flight_recorder.py:" in "\n".join(lines)


def _mismatch(rank, world_size, trace_dir):
    import distcomm as dist

    dist.init_process_group("tcp", timeout=timedelta(seconds=4))
    x = np.ones(4, dtype=np.float32)
    dist.all_reduce(x)
    try:
        if rank == 0:
            dist.all_reduce(x)  # MISMATCH-A
        else:
            dist.broadcast(x, src=0)  # MISMATCH-B
    except dist.DistError as exc:  # the rank that sees the mismatch; the other loses it when it exits
        time.sleep(0.5)  # every rank's dump lands
        return type(exc).__name__, str(exc)
    return None


@pytest.mark.slow
def test_mismatch_dumps_every_rank_and_trace_finds_the_divergence(tmp_path):
    errors = run_world(_mismatch, 2, args=(str(tmp_path),), timeout=60, env={"DISTCOMM_TRACE_DIR": str(tmp_path)})
    assert all(e is not None and f"python -m distcomm.trace {tmp_path}" in e[1] for e in errors), errors
    assert "CollectiveMismatchError" in [e[0] for e in errors]
    from distcomm import trace

    lines = trace.analyze(trace.load(str(tmp_path)))
    assert (f"  first divergence at #2: rank 0 called all_reduce (16 B, float32) at "
            f"test_flight_recorder.py:{_line_of('# MISMATCH-A')}; rank 1 called broadcast (16 B, float32, root 0) "
            f"at test_flight_recorder.py:{_line_of('# MISMATCH-B')}") in lines


def _disabled(rank, world_size):
    import distcomm as dist

    # the harness sets the world's environment after this module (so distcomm) was imported: read it again
    fr.configure()

    dist.init_process_group("gloo", timeout=timedelta(seconds=10))
    dist.all_reduce(np.ones(2))
    dist.barrier()
    return fr.recorder is None and dist.dump_flight_recorder("/nonexistent-dir-never-written") is None


@pytest.mark.slow
def test_buffer_size_zero_turns_it_off():
    assert run_world(_disabled, 2, timeout=60, env={"DISTCOMM_TRACE_BUFFER_SIZE": "0"}) == [True, True]


# -- TORCH_DISTRIBUTED_DEBUG=DETAIL ---------------------------------------------------------------
def _shapes(rank, world_size, engine):
    import distcomm as dist

    dist.set_debug_level_from_env()  # the harness sets the environment after distcomm was imported

    dist.init_process_group(engine, timeout=timedelta(seconds=5))
    assert dist.get_debug_level() == dist.DebugLevel.DETAIL
    dist.all_reduce(np.ones((4, 5), dtype=np.float32))  # same shapes: fine
    shape = (4, 5) if rank == 0 else (5, 4)  # the same 20 elements: bytes alone cannot tell
    try:
        dist.all_reduce(np.ones(shape, dtype=np.float32))
    except dist.CollectiveMismatchError as exc:
        after = np.ones(3)
        dist.all_reduce(after)  # the group goes on: the check failed alike on every rank
        error = str(exc)
    else:
        return None, None, None, None
    # every collective is checked, not only all_reduce: a synchronous broadcast (which the
    # shared-memory engine would otherwise run on its latency path, with no shape check)...
    try:
        dist.broadcast(np.ones(shape, dtype=np.float32), src=0)
        broadcast_error = None
    except dist.CollectiveMismatchError as exc:
        broadcast_error = str(exc)
    # ... and one rank synchronous, the other asynchronous (the general path, which checks): they
    # meet in the same check
    x = np.full(6, float(rank + 1), dtype=np.float32)
    if rank == 0:
        dist.broadcast(x, src=1, async_op=True).wait()
    else:
        dist.broadcast(x, src=1)
    return error, after.tolist(), broadcast_error, x.tolist()


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["tcp", "gloo"])
def test_detail_checks_shapes_across_ranks(engine):
    results = run_world(_shapes, 2, args=(engine,), timeout=60, env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"})
    for rank, (error, after, broadcast_error, mixed) in enumerate(results):
        assert error is not None, f"rank {rank} saw no mismatch"
        assert f"all_reduce #2 on rank {rank}: ranks called it with different tensors" in error
        assert "rank 0: all_reduce of float32 shape (4, 5)" in error
        assert "rank 1: all_reduce of float32 shape (5, 4)" in error
        assert after == [2.0, 2.0, 2.0]
        assert broadcast_error is not None, f"rank {rank}: broadcast's shapes were not checked"
        assert "broadcast #4" in broadcast_error and "shape (5, 4)" in broadcast_error, broadcast_error
        assert mixed == [2.0] * 6


def _shapes_off(rank, world_size):
    import distcomm as dist

    dist.set_debug_level_from_env()

    dist.init_process_group("tcp", timeout=timedelta(seconds=5))
    x = np.ones((4, 5) if rank == 0 else (5, 4), dtype=np.float32)
    dist.all_reduce(x)  # without DETAIL only bytes, dtypes and signatures are compared
    return float(x.sum())


@pytest.mark.slow
def test_shapes_are_not_checked_without_detail():
    assert run_world(_shapes_off, 2, timeout=60, env={"TORCH_DISTRIBUTED_DEBUG": "OFF"}) == [40.0, 40.0]


# -- the latency paths' records: the user's line, found without a walk ------------------------------
def _latency_calls(rank, world_size):
    import torch

    import distcomm as dist
    from distcomm.backends.shm import observe

    dist.init_process_group("shm", timeout=timedelta(seconds=20))
    dist.all_reduce(np.ones(1))  # the group's shared memory is set up on its first collective
    taken: list[str] = []
    observe.set_observer(lambda name: taken.append(name) if name.startswith("latency_") else None)
    x, t = np.ones(2, dtype=np.float32), torch.ones(2)
    outs = [np.zeros(2, dtype=np.float32) for _ in range(world_size)]
    big = np.zeros(2 * world_size, dtype=np.float32)
    before = fr.recorder.recorded()
    dist.all_reduce(x)  # LAT-ALL_REDUCE
    dist.all_reduce(t)  # LAT-ALL_REDUCE_TORCH
    dist.barrier()  # LAT-BARRIER
    dist.broadcast(x, src=0)  # LAT-BROADCAST
    dist.reduce(x, dst=1)  # LAT-REDUCE
    dist.all_gather(outs, x)  # LAT-ALL_GATHER
    dist.all_gather_into_tensor(big, x)  # LAT-ALL_GATHER_INTO_TENSOR
    dist.gather(x, outs if rank == 0 else None, dst=0)  # LAT-GATHER
    dist.scatter(x, outs if rank == 0 else None, src=0)  # LAT-SCATTER
    dist.reduce_scatter(x, outs)  # LAT-REDUCE_SCATTER
    dist.reduce_scatter_tensor(x, big)  # LAT-REDUCE_SCATTER_TENSOR
    dist.all_to_all(outs, [o.copy() for o in outs])  # LAT-ALL_TO_ALL
    dist.all_to_all_single(big, big.copy())  # LAT-ALL_TO_ALL_SINGLE
    dist.broadcast_object_list([1, 2], src=0)  # LAT-OBJECTS
    observe.set_observer(None)
    # read after every call returned: the records hold code objects and offsets, not frames
    records = [fr.to_dict(e) for e in fr.recorder.entries()][before:]
    dist.destroy_process_group()
    return taken, [(r["op"], r["site"]) for r in records]


@pytest.mark.slow
def test_latency_paths_record_the_users_line_and_function():
    ops = ("ALL_REDUCE", "ALL_REDUCE_TORCH", "BARRIER", "BROADCAST", "REDUCE", "ALL_GATHER",
           "ALL_GATHER_INTO_TENSOR", "GATHER", "SCATTER", "REDUCE_SCATTER", "REDUCE_SCATTER_TENSOR", "ALL_TO_ALL",
           "ALL_TO_ALL_SINGLE")
    for taken, records in run_world(_latency_calls, 2, timeout=90):
        # every call took its latency path (the observer counts them; the object collective's
        # broadcasts too)
        assert taken[:len(ops)] == ["latency_" + op.lower().replace("_torch", "") for op in ops]
        assert taken[len(ops):] and set(taken[len(ops):]) == {"latency_broadcast"}
        sites = [site for _, site in records]
        want = {"file": __file__, "function": "_latency_calls"}
        assert [op for op, _ in records[:len(ops)]] == [op.lower().replace("_torch", "") for op in ops]
        assert sites[:len(ops)] == [dict(want, line=_line_of(f"# LAT-{op}")) for op in ops]
        # broadcast_object_list calls ProcessGroup.broadcast from distcomm's own code: the walk goes
        # up past it to the user's line
        assert len(records) > len(ops)
        assert all(site == dict(want, line=_line_of("# LAT-OBJECTS")) for site in sites[len(ops):])


def test_library_files_are_distcomms_and_torch_distributeds_but_not_its_programs():
    import distcomm

    package = os.path.dirname(distcomm.__file__)
    assert fr.is_library_file(os.path.join(package, "process_group.py"))
    assert fr.is_library_file(os.path.join(package, "backends", "shm", "latency.py"))
    assert fr.is_library_file(os.path.join(os.sep, "x", "torch", "distributed", "distributed_c10d.py"))
    # the benchmark and the demo call distcomm as a user does: their lines are the call sites
    assert not fr.is_library_file(os.path.join(package, "bench", "collectives.py"))
    assert not fr.is_library_file(os.path.join(package, "demo", "__init__.py"))
    assert not fr.is_library_file(__file__)
