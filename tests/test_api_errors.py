"""API errors and API surface: distcomm against torch.distributed (gloo, torch==2.13.0).

* Bad arguments (tests/api_cases.py): one world of 3 runs every bad call with torch, then with
  distcomm's "gloo" and "tcp" backends. For each call and rank, distcomm must raise an exception
  that an ``except`` clause naming torch's exception class would catch, and the all_reduce that
  follows each call must still give the right value on every rank (the error came before any
  communication). Where torch's behaviour is an accident (a crash, a wait for the store timeout, an
  IndexError after the communication, no check at all) distcomm's own is asserted and the reason is
  in DELIBERATE below.
* The surface that needs no world: Backend, register_backend (a third-party engine at world size 1),
  is_*_available, is_torchelastic_launched, GroupMember, ReduceOp, PREMUL_SUM(factor), reduce_op.
* Failure scenarios on distcomm (one world of 3, tests/api_cases.py ``scenarios``):
  monitored_barrier naming the missing ranks, a timeout naming op/seq/rank/peer, collective
  mismatches (size, op, dtype, different collectives) raising CollectiveMismatchError without a
  hang, a killed peer making the others fail promptly with PeerLostError naming it, and, in the
  same world, a third-party engine, get_backend, overlapping groups used asynchronously at once, the
  seed's *_multigpu functions against numpy, and torch.profiler traces.

Tiers: the bad-argument world (three processes importing torch, three runs of every call) and the
scenario world (which waits out deliberate timeouts) are slow; the killed-peer world and the
surface tests run in the fast tier too (``pytest -m "not slow"``).
"""

from __future__ import annotations

import functools
import re
import warnings
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as tdist

import api_cases
import distcomm as dist
from harness import free_port, run_world

WS = 3
ENGINES = ["gloo", "tcp"]

# Calls where distcomm deliberately does not do what torch does: (expected distcomm outcome per rank
# as a function of rank, why).
DELIBERATE = {
    # numpy only (torch is not run): the ranks the call writes refuse a read-only array, after taking
    # part (their peers only read, and cannot see the refusal), so the group stays in step
    "readonly/broadcast": (
        lambda r: ("returned", "None") if r == 0 else ("raised", "ValueError"),
        "torch takes no numpy arrays; the source only reads its array"),
    "readonly/reduce": (
        lambda r: ("raised", "ValueError") if r == 0 else ("returned", "None"),
        "torch takes no numpy arrays; only the destination writes its array"),
    "before_init/destroy_process_group": (
        lambda r: ("raised", "ValueError"),
        "torch fails an assert (AssertionError 'Process group cannot be None'); distcomm raises the "
        "not-initialized ValueError every other call before init raises"),
    "rank/get_global_rank_bad": (
        lambda r: ("raised", "ValueError"),
        "torch returns its argument for the default group without checking it (3 in a world of 3)"),
    "rank/get_group_rank_bad": (
        lambda r: ("raised", "ValueError"),
        "torch returns its argument for the default group without checking it (4 in a world of 3)"),
    "length/all_gather_object_short": (
        lambda r: ("raised", "ValueError"),
        "torch raises IndexError after the communication; distcomm checks the length first"),
    "type/batch_empty": (
        lambda r: ("returned", "[]"),
        "torch raises IndexError (p2p_op_list[0] on an empty list); distcomm returns no works"),
    "group/broadcast_src_not_in_group": (
        lambda r: ("returned", "None") if r == 0 else ("raised", "ValueError"),
        "on a non-member torch raises ValueError 'Invalid process group specified' when src is not in "
        "the group (and returns None when it is); distcomm's non-members return None at once"),
    "group/send_dst_not_in_group": (
        lambda r: ("returned", "None") if r == 0 else ("raised", "ValueError"),
        "as group/broadcast_src_not_in_group"),
    "op/avg_int64": (lambda r: ("returned", "None"), "distcomm supports AVG on integers (gloo does not)"),
    "op/premul_sum_float32": (lambda r: ("returned", "None"), "distcomm supports PREMUL_SUM on CPU"),
    "op/sum_int16": (lambda r: ("returned", "None"), "distcomm supports int16 (gloo: 'Invalid scalar type')"),
}


def once(fn):
    """Run a world at most once per session; a failure is remembered and re-raised, not re-run."""
    @functools.lru_cache(maxsize=None)
    def cached():
        try:
            return True, fn()
        except Exception as exc:  # noqa: BLE001
            return False, exc

    @functools.wraps(fn)
    def get():
        ok, value = cached()
        if not ok:
            raise AssertionError(f"the world failed: {value}") from value
        return value

    return get


@once
def error_world():
    plans = [("torch", "gloo", free_port())] + [("distcomm", e, free_port()) for e in ENGINES]
    return run_world(api_cases.run_errors, WS, args=(plans,), timeout=300)


def _case_names():
    names = list(api_cases.before_init_cases(tdist))
    # error_cases needs only names here: build it with dummy arguments (nothing is called)
    names += list(api_cases.error_cases(tdist, 0, WS))
    return names


@pytest.mark.slow
@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("name", _case_names())
def test_bad_arguments_like_torch(name, engine):
    results = error_world()
    problems = []
    for rank in range(WS):
        theirs = results[rank]["torch:gloo"].get(name)
        ours = results[rank][f"distcomm:{engine}"][name]
        if name in DELIBERATE:
            outcome, why = DELIBERATE[name]
            want = outcome(rank)
            if ours[0] != want[0] or (want[0] == "raised" and want[1] not in ours[1]) or (
                    want[0] == "returned" and ours[1] != want[1]):
                problems.append(f"rank {rank}: expected {want} (deliberately unlike torch: {why}), got {ours}")
        elif name in api_cases.TORCH_SKIPPED:
            kind, what_torch_does = api_cases.TORCH_SKIPPED[name]
            if ours[0] != "raised" or kind not in ours[1]:
                problems.append(f"rank {rank}: expected a {kind} at once ({what_torch_does}), got {ours}")
        elif theirs[0] == "raised":
            if ours[0] != "raised":
                problems.append(f"rank {rank}: torch raised {theirs[2]} ({theirs[3]!r}), distcomm returned {ours[1]}")
            elif theirs[1][0] not in ours[1]:
                problems.append(f"rank {rank}: torch raised a {theirs[1][0]} ({theirs[2]}: {theirs[3]!r}); "
                                f"distcomm's {ours[2]} ({ours[3]!r}) is not one")
        elif ours != theirs:
            problems.append(f"rank {rank}: torch {theirs}, distcomm {ours}")
        check = results[rank][f"distcomm:{engine}"].get(name + "#check")
        if check is not None and check != ("check ok",):
            problems.append(f"rank {rank}: the all_reduce after the call: {check} (the call communicated?)")
    assert not problems, f"{name} on distcomm:{engine}:\n" + "\n".join(problems)


@pytest.mark.slow
def test_torch_side_stayed_in_step():
    """The oracle's own run is sound: every check collective after every call was right."""
    results = error_world()
    bad = [(r, k, v) for r in range(WS) for k, v in results[r]["torch:gloo"].items()
           if k.endswith("#check") and v != ("check ok",)]
    assert not bad


# -- surface: no world needed (runs in this process; world size 1 where a group is needed) ------------
def test_backend_names():
    assert dist.Backend("GLOO") == "gloo" == dist.Backend.GLOO
    assert dist.Backend("tcp") == "tcp" and dist.Backend("TCP") == dist.Backend.TCP
    assert isinstance(dist.Backend("gloo"), str)
    assert tdist.Backend("GLOO") == dist.Backend("GLOO")
    # Deliberately stricter than torch, whose Backend("no-such-backend") returns the lowered name
    # and fails only in init_process_group: distcomm refuses at once, listing what exists.
    assert tdist.Backend("No-Such-Backend") == "no-such-backend"
    with pytest.raises(ValueError, match="gloo"):
        dist.Backend("no-such-backend")


def test_backend_pickles_as_its_name():
    import pickle

    assert pickle.loads(pickle.dumps(dist.Backend("GLOO"))) == "gloo"
    # (a name registered only in the pickling process: see test_third_party_engine_in_a_real_world)


def test_availability_and_launch_queries(monkeypatch):
    assert dist.is_available() is True
    assert dist.is_gloo_available() is True  # "gloo" is distcomm's default engine: it runs here
    import importlib.util

    # "mpi" is distcomm's MPI engine: available exactly when mpi4py imports (torch's CPU build has none)
    assert dist.is_mpi_available() is (importlib.util.find_spec("mpi4py") is not None)
    assert dist.is_nccl_available() is False
    assert tdist.is_nccl_available() is dist.is_nccl_available()  # CPU build: no NCCL either way
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert dist.is_torchelastic_launched() is False is tdist.is_torchelastic_launched()
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "abc")
    assert dist.is_torchelastic_launched() is True is tdist.is_torchelastic_launched()


def test_reduce_op_spellings():
    R = dist.ReduceOp
    names = ["SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "PREMUL_SUM"]
    for n in names:
        assert getattr(R, n).name == getattr(tdist.ReduceOp, n).name == n
    p = R.PREMUL_SUM(2.5)
    assert p.op is R.PREMUL_SUM and p.factor == 2.5
    assert dist._make_nccl_premul_sum(3.0).factor == 3.0
    # torch's own ReduceOp values are accepted too (programs that mix the two modules)
    from distcomm.types import normalize_op

    assert normalize_op(tdist.ReduceOp.MAX) is R.MAX
    with pytest.raises(TypeError):
        R.SUM(2.0)  # only PREMUL_SUM takes a factor


def test_deprecated_reduce_op_warns():
    with pytest.warns(FutureWarning, match="reduce_op is deprecated"):
        op = dist.reduce_op.SUM
    assert op is dist.ReduceOp.SUM
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tdist.reduce_op.SUM  # noqa: B018 - the oracle warns as well
    assert caught


def test_group_member_sentinels():
    assert dist.GroupMember.NON_GROUP_MEMBER is not None
    assert dist.GroupMember.WORLD is None and dist.group.WORLD is None  # before init, as torch
    assert tdist.GroupMember.WORLD is None


class _CountingTransport:
    """A third-party engine: wraps a distcomm Transport and counts what it moves."""

    def __init__(self, inner):
        self.inner = inner
        self.sends = 0

    def isend(self, dst, data, key, signature=0):
        self.sends += 1
        return self.inner.isend(dst, data, key, signature)

    def irecv(self, src, out, key, signature=0):
        return self.inner.irecv(src, out, key, signature)

    def close(self):
        self.inner.close()


def test_register_backend_third_party_engine_world_of_one():
    from distcomm.transport.inproc import InprocTransport

    made = []

    def engine(store, rank, size, timeout):
        assert isinstance(timeout, timedelta) and (rank, size) == (0, 1)
        made.append(_CountingTransport(InprocTransport.create_world(1)[0]))
        return made[-1]

    dist.Backend.register_backend("counting_inproc", engine)
    assert dist.Backend("COUNTING_INPROC") == "counting_inproc" == dist.Backend.COUNTING_INPROC
    dist.init_process_group("counting_inproc", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert len(made) == 1
        assert dist.get_backend() == "counting_inproc"
        t = np.arange(5.0)
        dist.all_reduce(t)
        np.testing.assert_array_equal(t, np.arange(5.0))
        assert dist.GroupMember.WORLD is not None and dist.group.WORLD is dist.GroupMember.WORLD
        assert dist.get_rank() == 0 and dist.get_world_size() == 1
        # torch's private helpers that libraries call
        assert dist.distributed_c10d._get_default_group() is dist.group.WORLD
        assert not dist._rank_not_in_group(None) and not dist._rank_not_in_group(dist.new_group([0]))
        assert dist._rank_not_in_group(dist.GroupMember.NON_GROUP_MEMBER)
    finally:
        dist.destroy_process_group()
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="Default process group has not been initialized"):
        dist.distributed_c10d._get_default_group()
    with pytest.raises(ValueError):
        dist.Backend.register_backend("counting_inproc", engine)  # twice: refused, as torch


def test_get_backend_is_the_name_given(tmp_path):
    for name, expected in [("gloo", "gloo"), ("GLOO", "gloo"), ("tcp", "tcp")]:
        dist.init_process_group(name, init_method=f"file://{tmp_path}/{name}", rank=0, world_size=1)
        try:
            assert dist.get_backend() == expected
            assert isinstance(dist.get_backend(), str)
        finally:
            dist.destroy_process_group()


# -- failure scenarios and the rest, on distcomm -------------------------------------------------------
KILL_RANK = WS - 1


@once
def scenario_world():
    return run_world(api_cases.scenarios, WS, timeout=240)


def _outcome(rank, name):
    return scenario_world()[rank][name]


@pytest.mark.slow
def test_monitored_barrier_names_the_missing_rank():
    raised = _outcome(0, "monitored_barrier/one_missing")
    assert raised[0] == "raised" and "RuntimeError" in raised[1], raised
    assert re.search(rf"Rank {WS - 1} failed to pass monitoredBarrier in 1500 ms", raised[3]), raised[3]
    # the rank that did arrive is released with an error too, not left waiting
    other = _outcome(1, "monitored_barrier/one_missing")
    assert other[0] == "raised" and "RuntimeError" in other[1], other
    # in gloo's words
    assert other[3].startswith("Rank 1 successfully reached monitoredBarrier, but received errors while waiting "
                               "for send/recv from rank 0. Please check rank 0 logs for faulty rank."), other[3]


@pytest.mark.slow
def test_monitored_barrier_wait_all_ranks_lists_every_missing_rank():
    raised = _outcome(0, "monitored_barrier/wait_all_ranks")
    assert raised[0] == "raised", raised
    missing = ", ".join(str(r) for r in range(1, WS))
    assert f"Ranks {missing} failed to pass monitoredBarrier in 1500 ms" in raised[3], raised[3]


@pytest.mark.slow
def test_monitored_barrier_with_no_time_left_says_so_in_gloos_words():
    raised = _outcome(0, "monitored_barrier/zero_timeout")
    assert raised[0] == "raised" and "RuntimeError" in raised[1], raised
    assert raised[3].startswith("Rank 0 timed out in monitoredBarrier after 0 ms.\n"
                                "No ranks successfully processed in monitoredBarrier."), raised[3]


@pytest.mark.slow
def test_monitored_barrier_passes_when_everyone_arrives():
    for rank in range(WS):
        assert _outcome(rank, "monitored_barrier/all_arrive") == ("returned", "None")
        assert _outcome(rank, "monitored_barrier/float_timeout") == ("returned", "None")


@pytest.mark.slow
def test_timeout_names_op_seq_rank_and_peer():
    for rank in range(WS - 1):
        raised = _outcome(rank, "timeout/all_reduce")
        assert raised[0] == "raised" and raised[2] == "DistTimeoutError", raised
        msg = raised[3]
        assert "all_reduce" in msg and "#2" in msg and f"rank {rank}" in msg, msg
        assert re.search(r"peer rank \d", msg), msg
        assert _outcome(rank, "timeout/all_reduce_seconds") < 60  # the group's 1.5 s, not the world's 60 s


@pytest.mark.slow
@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("what", ["size", "op", "dtype", "collective"])
def test_collective_mismatch_raises_and_does_not_hang(what, engine):
    outcomes = [_outcome(r, f"mismatch/{engine}/{what}") for r in range(WS)]
    # no rank got a result: every one raised (a mismatch, or the timeout of a peer that stopped),
    # and every error names the op, its sequence number, this rank and the peer
    assert all(o[0] == "raised" and "RuntimeError" in o[1] for o in outcomes), "\n".join(map(str, outcomes))
    for o in outcomes:
        assert re.search(r"(all_reduce|broadcast) #1 on rank \d \(peer rank \d\)", o[3]), o[3]
    if what != "collective":
        # the same collective with different sizes/ops/dtypes: data flows, so it is seen
        assert any(o[2] == "CollectiveMismatchError" for o in outcomes), "\n".join(map(str, outcomes))
    # (all_reduce on one rank and broadcast on the others may leave both sides only waiting to
    # receive from each other, as on tcp: then a timeout is all anyone can see)
    # none waited past the group's 2.5 s timeout (much; the world's is 60 s)
    assert all(_outcome(r, f"mismatch/{engine}/{what}_seconds") < 30 for r in range(WS))


@once
def killed_world():
    return run_world(api_cases.killed_peer, WS, args=(KILL_RANK,), timeout=240, expect_failure=[KILL_RANK])


@pytest.mark.parametrize("op", ["recv", "irecv_tcp", "broadcast_gloo", "broadcast_tcp"])
def test_killed_peer_fails_the_others_promptly(op):
    """Operations that wait on the dead rank fail with PeerLostError naming it, long before the
    60 s timeout (no fine timing asserted: the machine is shared)."""
    results = killed_world()
    assert results[KILL_RANK].startswith("process exited with code 1"), results[KILL_RANK]
    for rank in range(WS - 1):
        raised = results[rank][op]
        assert raised[0] == "raised" and raised[2] == "PeerLostError", (rank, raised)
        assert f"rank {KILL_RANK}" in raised[3], raised[3]
        assert results[rank][f"{op}_seconds"] < 45, results[rank][f"{op}_seconds"]


def test_killed_peer_all_reduce_fails_everywhere():
    """A collective on a group with the dead rank fails on every survivor, with PeerLostError
    naming the dead rank where it waited on it directly; the survivors can go on in a group of
    their own."""
    results = killed_world()
    outcomes = [results[r]["all_reduce_short"] for r in range(WS - 1)]
    assert all(o[0] == "raised" and "RuntimeError" in o[1] for o in outcomes), outcomes
    assert any(o[2] == "PeerLostError" and f"rank {KILL_RANK}" in o[3] for o in outcomes), outcomes
    assert all(results[r]["survivors_sum"] == sum(range(WS - 1)) for r in range(WS - 1))


@pytest.mark.slow
def test_third_party_engine_in_a_real_world():
    for rank in range(WS):
        r = _outcome(rank, "third_party")
        assert r[0] == "returned", r
    info = scenario_world()[0]["third_party_info"]
    assert info["backend"] == "wrapped_tcp" and info["world_backend"] == "gloo" and info["tcp_backend"] == "tcp"
    assert info["sum"] == sum(range(1, WS + 1)) and info["sends"] > 0


@pytest.mark.slow
def test_overlapping_groups_async_interleaved():
    for rank in range(WS):
        r = scenario_world()[rank]["overlapping_groups"]
        assert r == "ok", r


@pytest.mark.slow
def test_multigpu_functions_against_numpy():
    for rank in range(WS):
        r = scenario_world()[rank]["multigpu"]
        assert r == "ok", r


@pytest.mark.slow
def test_what_distcomm_adds_to_gloo():
    """recv_object_list from any source, non-contiguous send/recv, p2p futures (see _extensions)."""
    for rank in range(WS):
        r = scenario_world()[rank]["extensions"]
        assert r == "ok", r


@pytest.mark.slow
def test_profiler_trace_shows_all_reduce():
    for rank in range(WS):
        names = scenario_world()[rank]["profiler_events"]
        assert any("all_reduce" in n for n in names), names
