"""Deferred checks of the small rooted collectives in C (transport/shm_group.py, "header history";
_shm_round.c's shm_move with defer and shm_settle).

A member of a broadcast, reduce, gather or scatter that does not read every peer's slot (the root of
a broadcast or scatter reads none, the others only the root; a reduce's or gather's non-roots read
none) waits only for the members it reads and returns; a later call on the group checks the other
members' headers of that round, from their history. So:

* a member that reads nothing returns before the members it does not read have called at all
  (each waits here for a signal that the others send only after their own call returned: with every
  check made at once, as DISTCOMM_SHM_DEFER=0 makes them, these worlds deadlock, which the last test
  shows), with the right results everywhere;
* two members that both only write, in calls that do not match, return; their next call on the
  group fails on both, naming the peer and the earlier call's sequence number, and marks the group's
  memory unusable (root disagreements, which leave it usable: test_shm_latency_ops.py);
* many deferred rounds in a row, more than the slots and a group's rounds wrapping the history
  several times over, all checked and right;
* a rank that only writes may destroy its process group before the others have read: they still
  get their results (the program that ends with a broadcast from rank 0).

Tier: slow (multi-process worlds).
"""

from __future__ import annotations

import os
import time

import pytest

from harness import run_world

pytestmark = pytest.mark.slow


def _signal(path: str) -> None:
    with open(path, "w"):
        pass


def _await(path: str, seconds: float = 30.0) -> None:
    """Wait for another rank's signal file (its call returned); a missing one fails the rank."""
    deadline = time.monotonic() + seconds
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no signal {path}: the other ranks did not return")
        time.sleep(0.001)


def _latency_taken():
    from distcomm.backends.shm import observe

    taken: list[str] = []
    observe.set_observer(lambda name: taken.append(name) if name.startswith("latency_") else None)
    return taken


def writers_return_first_body(rank, world, tmp, wait_s=30.0):
    """Each rooted op with the members that only write calling first, and the others calling only
    once every writer-only member's call has returned (signal files, waited for ``wait_s``)."""
    import numpy as np

    import distcomm as dist

    dist.init_process_group(None)
    dist.barrier()
    taken = _latency_taken()
    results = {}
    # broadcast: the root only writes; the others call once it has returned
    x = np.full(5, float(rank), np.float32)
    if rank == 0:
        dist.broadcast(x, src=0)
        _signal(f"{tmp}/broadcast")
    else:
        _await(f"{tmp}/broadcast", wait_s)
        dist.broadcast(x, src=0)
    results["broadcast"] = x.tolist()
    # scatter: the same, from the last rank
    root = world - 1
    out = np.zeros(3, np.int64)
    pieces = [np.full(3, 10 * q + 1, np.int64) for q in range(world)] if rank == root else None
    if rank == root:
        dist.scatter(out, pieces, src=root)
        _signal(f"{tmp}/scatter")
    else:
        _await(f"{tmp}/scatter", wait_s)
        dist.scatter(out, None, src=root)
    results["scatter"] = out.tolist()
    # reduce and gather: the non-roots only write; the root calls once all of them have returned
    y = np.full(4, float(rank + 1), np.float64)
    if rank != 0:
        dist.reduce(y, dst=0)
        _signal(f"{tmp}/reduce{rank}")
    else:
        for q in range(1, world):
            _await(f"{tmp}/reduce{q}", wait_s)
        dist.reduce(y, dst=0)
    results["reduce"] = y.tolist()
    one = np.full(2, rank * 3, np.int32)
    outs = [np.zeros(2, np.int32) for _ in range(world)] if rank == 0 else None
    if rank != 0:
        dist.gather(one, None, dst=0)
        _signal(f"{tmp}/gather{rank}")
    else:
        for q in range(1, world):
            _await(f"{tmp}/gather{q}", wait_s)
        dist.gather(one, outs, dst=0)
    results["gather"] = None if outs is None else [o.tolist() for o in outs]
    dist.barrier()
    dist.destroy_process_group()
    return results, taken


@pytest.mark.parametrize("world", [2, 3])
def test_members_that_only_write_return_before_the_others_call(tmp_path, world):
    results = run_world(writers_return_first_body, world, args=(str(tmp_path),), timeout=90)
    total = float(sum(q + 1 for q in range(world)))
    for rank, (got, taken) in enumerate(results):
        assert got["broadcast"] == [0.0] * 5, got
        assert got["scatter"] == [10 * rank + 1] * 3, got
        assert got["reduce"] == ([total] * 4 if rank == 0 else [float(rank + 1)] * 4), got
        assert got["gather"] == ([[3 * q] * 2 for q in range(world)] if rank == 0 else None), got
        for op in ("broadcast", "scatter", "reduce", "gather"):  # each through the calls in C
            assert f"latency_{op}" in taken, taken


def late_mismatch_body(rank, world):
    """Rank 0 broadcasts as the root while the others reduce to rank 0: every member only writes,
    so every call returns; the barrier after it finds the mismatch."""
    import numpy as np

    import distcomm as dist

    dist.init_process_group(None)
    dist.barrier()
    x = np.ones(3, np.float32)
    if rank == 0:
        dist.broadcast(x, src=0)
    else:
        dist.reduce(x, dst=0)
    try:
        dist.barrier()
    except RuntimeError as exc:
        outcome = (type(exc).__name__, str(exc))
    else:
        outcome = ("no error", "")
    try:
        dist.barrier()
    except RuntimeError as exc:
        after = str(exc)
    else:
        after = "no error"
    dist.destroy_process_group()
    return outcome, after


def test_a_mismatch_between_members_that_only_write_fails_their_next_call():
    results = run_world(late_mismatch_body, 3, timeout=90)
    for rank, ((kind, msg), after) in enumerate(results):
        assert kind == "CollectiveMismatchError", (rank, kind, msg)
        assert msg.startswith(f"barrier #3 on rank {rank}"), msg  # the call that found it
        # the earlier call, by its own sequence number, and both ranks' collectives by name
        if rank == 0:
            assert "at call #2 of this group this rank called broadcast (float32) but rank 1 called reduce " \
                   "(float32, op=SUM)" in msg, msg
        else:
            assert "at call #2 of this group this rank called reduce (float32, op=SUM) but rank 0 called " \
                   "broadcast (float32)" in msg, msg
        assert "unusable" in after, after  # the group's memory is marked broken, as for any mismatch


def many_rounds_body(rank, world, calls):
    """``calls`` small broadcasts and reduces in a row, roots going round, then a barrier: every
    deferred check made and every result right."""
    import numpy as np

    import distcomm as dist

    dist.init_process_group(None)
    bad = []
    for i in range(calls):
        root = i % world
        x = np.full(2, float(rank + i), np.float64)
        if i % 2:
            dist.reduce(x, dst=root)
            want = sum(q + i for q in range(world)) if rank == root else rank + i
        else:
            dist.broadcast(x, src=root)
            want = root + i
        if x.tolist() != [float(want)] * 2:
            bad.append((i, x.tolist(), want))
    dist.barrier()
    dist.barrier()
    dist.destroy_process_group()
    return bad


def test_deferred_checks_over_many_rounds_wrap_the_history():
    from distcomm.transport.shm_group import HISTORY

    assert run_world(many_rounds_body, 3, args=(5 * HISTORY,), timeout=120) == [[], [], []]


def test_without_deferred_checks_a_writer_waits_for_every_member(tmp_path):
    """DISTCOMM_SHM_DEFER=0: the broadcast's root waits for the others, who wait for its signal
    until they give up (3 s): the world fails (so the first test's worlds do need the deferred
    checks)."""
    with pytest.raises(Exception, match="no signal"):
        run_world(writers_return_first_body, 2, args=(str(tmp_path), 3.0), timeout=60,
                  env={"DISTCOMM_SHM_DEFER": "0"})


def early_destroy_body(rank, world, op, tmp):
    """The ranks that only write call ``op`` and destroy their process group at once; the others
    call it only once those have destroyed theirs (signal files), and still get the right result."""
    import numpy as np

    import distcomm as dist

    dist.init_process_group(None)
    dist.barrier()
    early = (rank == 0) if op in ("broadcast", "scatter") else (rank != 0)
    x = np.full(3, float(rank + 1), np.float32)
    if not early:
        for q in ([0] if op in ("broadcast", "scatter") else range(1, world)):
            _await(f"{tmp}/{op}-destroyed{q}")
    if op == "broadcast":
        dist.broadcast(x, src=0)
        got = x.tolist()
    elif op == "reduce":
        dist.reduce(x, dst=0)
        got = x.tolist()
    elif op == "scatter":
        out = np.zeros(3, np.float32)
        dist.scatter(out, [np.full(3, 10.0 + q, np.float32) for q in range(world)] if rank == 0 else None, src=0)
        got = out.tolist()
    else:
        outs = [np.zeros(3, np.float32) for _ in range(world)] if rank == 0 else None
        dist.gather(x, outs, dst=0)
        got = [v for o in outs for v in o.tolist()] if rank == 0 else x.tolist()
    dist.destroy_process_group()
    if early:
        _signal(f"{tmp}/{op}-destroyed{rank}")
    return got


@pytest.mark.parametrize("op", ["broadcast", "reduce", "scatter", "gather"])
def test_a_rank_that_only_writes_may_destroy_its_group_before_the_others_read(tmp_path, op):
    world = 3
    got = run_world(early_destroy_body, world, args=(op, str(tmp_path)), timeout=90)
    total = float(sum(q + 1 for q in range(world)))
    for rank, values in enumerate(got):
        if op == "broadcast":
            assert values == [1.0] * 3, (rank, values)
        elif op == "reduce":
            assert values == ([total] * 3 if rank == 0 else [float(rank + 1)] * 3), (rank, values)
        elif op == "scatter":
            assert values == [10.0 + rank] * 3, (rank, values)
        else:
            assert values == ([float(q + 1) for q in range(world) for _ in range(3)] if rank == 0
                              else [float(rank + 1)] * 3), (rank, values)
