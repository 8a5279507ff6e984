"""new_group(..., use_local_synchronization=True): only the members call it.

torch names such a group by a hash of its ranks and does not advance the group counter, so the
groups every rank creates afterwards still agree. A world of 4 runs the same script through torch
(gloo) and distcomm (its default engine, and "tcp"): ranks 0 and 1 make two local groups, rank 2
calls too (a non-member gets None), rank 3 does not call at all; then every rank makes an ordinary
group. Names, group counts and results must be torch's. distcomm-only: what torch cannot do (members
holding different numbers of groups, whose hashed names then differ: torch waits under different
names), local and ordinary groups of the same ranks used at once (their ids and store keys must not
meet), a local group on another engine, and the errors of members that disagree or do not call.
"""

from __future__ import annotations

import functools
import hashlib
import warnings
from datetime import timedelta

import numpy as np
import pytest

from harness import free_port, initialized, run_world

ENGINES = ["gloo", "tcp"]


def _sha1(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()


def _script(dist, rank: int, ws: int) -> dict:
    import torch

    out = {"pg_count/start": dist.get_pg_count()}
    if rank in (0, 1, 2):  # rank 2 is not a member and may call anyway; rank 3 does not call
        first = dist.new_group([0, 1], use_local_synchronization=True)
        second = dist.new_group([1, 0], use_local_synchronization=True, group_desc="second")
        if rank == 2:
            out["non_member"] = (first, second)
        else:
            for name, g in (("first", first), ("second", second)):
                t = torch.tensor([float(rank + 1)])
                dist.all_reduce(t, group=g)
                out[name] = (g.group_name, g.group_desc, dist.get_rank(g), dist.get_process_group_ranks(g), t.item())
    try:
        dist.new_group([0, 1], backend="mpi", use_local_synchronization=True)
    except ValueError as exc:
        out["mpi"] = str(exc)
    out["pg_count/after_local"] = dist.get_pg_count()
    everyone = dist.new_group(list(range(ws)))
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t, group=everyone)
    out["everyone"] = (everyone.group_name, t.item())
    out["pg_count/end"] = dist.get_pg_count()
    return out


def _run(rank: int, ws: int, plans: list) -> dict:
    import torch  # noqa: F401

    warnings.simplefilter("ignore")
    results = {}
    for framework, engine, port in plans:
        with initialized(framework, engine, port) as lib:
            results[f"{framework}:{engine}"] = _script(lib, rank, ws)
            lib.barrier()
    return results


@functools.lru_cache(maxsize=None)
def _world():
    plans = [("torch", "gloo", free_port())] + [("distcomm", e, free_port()) for e in ENGINES]
    return run_world(_run, 4, args=(plans,), timeout=240)


@pytest.mark.parametrize("engine", ENGINES)
def test_only_members_call_and_later_groups_agree_as_in_torch(engine):
    results = _world()
    for rank in range(4):
        theirs, ours = results[rank]["torch:gloo"], results[rank][f"distcomm:{engine}"]
        assert ours == theirs, (rank, theirs, ours)
    # what the comparison covers, as torch does it
    r0 = results[0]["torch:gloo"]
    assert r0["first"] == (_sha1("0_1_1"), "undefined", 0, [0, 1], 3.0)
    assert r0["second"][:2] == (_sha1("0_1_2"), "second")
    assert results[2]["torch:gloo"]["non_member"] == (None, None)
    assert r0["pg_count/after_local"] == r0["pg_count/start"] == 1 and r0["everyone"] == ("1", 10.0)
    assert r0["mpi"] == "MPI backend doesn't support use_local_synchronization=True"


def _different_counts(rank, ws, engine):
    """Rank 0 holds one group more than rank 1 when they make a local group: torch's hashed names
    differ between them (torch's gloo then waits under two names); distcomm's members still meet."""
    import torch

    import distcomm as dist

    dist.init_process_group(engine, timeout=timedelta(seconds=30))
    dist.new_group([0])
    got = None
    if rank in (0, 1):
        g = dist.new_group([0, 1], use_local_synchronization=True)
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t, group=g)
        got = (g.group_name, t.item())
    dist.barrier()
    dist.destroy_process_group()
    return got


@pytest.mark.parametrize("engine", ENGINES)
def test_members_holding_different_numbers_of_groups_still_meet(engine):
    got = run_world(_different_counts, 3, args=(engine,), timeout=90)
    # each member's name is torch's formula over the groups it holds (world, [0] on rank 0)
    assert got == [(_sha1("0_1_2"), 3.0), (_sha1("0_1_1"), 3.0), None]


def _at_once(rank, ws, engine):
    """Local and ordinary groups of the same members, and a local group on another engine, each
    given its own values, all issued before any is waited for: were two of them to share an id (the
    key of their messages) or store keys, their messages would meet and the sums mix or mismatch."""
    import distcomm as dist

    dist.init_process_group(engine, timeout=timedelta(seconds=30))
    groups = []
    if rank in (0, 1):
        groups.append(dist.new_group([0, 1], use_local_synchronization=True))
    groups.append(dist.new_group([0, 1]))  # every rank calls: rank 2 gets NON_GROUP_MEMBER
    if rank in (0, 1):
        groups.append(dist.new_group([0, 1], use_local_synchronization=True))
        other = "tcp" if engine == "gloo" else "gloo"
        groups.append(dist.new_group([0, 1], backend=other, use_local_synchronization=True))
    everyone = dist.new_group()
    mine = [g for g in groups if g != dist.GroupMember.NON_GROUP_MEMBER]
    pending = []
    for rnd in range(20):
        for i, g in enumerate(mine):
            x = np.full(1000 if rnd % 2 else 3, 100.0 * i + rnd + rank, np.float64)
            pending.append((i, rnd, x, dist.all_reduce(x, group=g, async_op=True)))
    wrong = []
    for i, rnd, x, work in pending:
        work.wait()
        if not np.all(x == 2 * (100.0 * i + rnd) + 1):
            wrong.append((i, rnd, x[0]))
    t = np.ones(1)
    dist.all_reduce(t, group=everyone)
    ids = sorted(g.group_id for g in mine + [dist.group.WORLD, everyone])
    dist.destroy_process_group()
    return len(mine), wrong, t[0], len(set(ids)) == len(ids)


@pytest.mark.parametrize("engine", ENGINES)
def test_local_and_ordinary_groups_of_the_same_ranks_do_not_meet(engine):
    got = run_world(_at_once, 3, args=(engine,), timeout=120)
    assert got == [(4, [], 3.0, True), (4, [], 3.0, True), (0, [], 3.0, True)]


def _disagree(rank, ws):
    import distcomm as dist
    from distcomm.errors import CollectiveMismatchError

    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    outcome = None
    if rank in (0, 1):
        try:  # group rank order given differently on the two members
            dist.new_group([0, 1] if rank == 0 else [1, 0], use_local_synchronization=True, sort_ranks=False)
            outcome = "created"
        except CollectiveMismatchError as exc:
            outcome = str(exc)
    g = dist.new_group()  # the world is in step: rank 2 never called
    x = np.ones(1)
    dist.all_reduce(x, group=g)
    dist.destroy_process_group()
    return outcome, x[0]


def test_members_that_disagree_raise_naming_the_lists():
    got = run_world(_disagree, 3, timeout=90)
    for rank in (0, 1):
        text, total = got[rank]
        assert text.startswith(f"new_group on rank {rank}: the ranks disagree on the members of the new group made "
                               "with use_local_synchronization=True: "), text
        assert "rank 0 gave [0,1]" in text and "rank 1 gave [1,0]" in text, text
        assert total == 3.0
    assert got[2] == (None, 3.0)


def _leader_absent(rank, ws):
    import distcomm as dist
    from distcomm.errors import DistBackendError

    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    outcome = "skipped"
    if rank == 1:  # rank 0, the lowest member, never calls
        try:
            dist.new_group([0, 1], use_local_synchronization=True, timeout=timedelta(seconds=1.5))
            outcome = "created"
        except DistBackendError as exc:
            outcome = str(exc)
    dist.barrier()
    dist.destroy_process_group()
    return outcome


def test_a_member_that_does_not_call_is_named_at_the_timeout():
    got = run_world(_leader_absent, 2, timeout=90)
    assert got[0] == "skipped"
    assert got[1].startswith("new_group on rank 1: rank 0 of the new group [0, 1] did not call "
                             "new_group(..., use_local_synchronization=True) within 1.5 s"), got[1]


def _splits(rank, ws, engine):
    """split_group of a subgroup and of the world: each rank makes only its own split."""
    import distcomm as dist

    dist.init_process_group(engine, timeout=timedelta(seconds=30))
    out = {}
    tail = dist.new_group([1, 2, 3])  # every rank calls new_group; rank 0 is not a member
    if rank == 0:
        try:  # torch's: NON_GROUP_MEMBER is no group
            dist.split_group(tail, [[0, 1], [2]])
        except ValueError as exc:
            out["outside"] = str(exc)
    else:
        mine = dist.split_group(tail, [[0, 1], [2]])  # parent group ranks: global [1, 2] and [3]
        t = np.full(2, float(rank), dtype=np.float32)
        dist.all_reduce(t, group=mine)
        out["tail"] = (dist.get_process_group_ranks(mine), t.tolist())
    pair = dist.split_group(split_ranks=[[3, 0]])  # the world's; ranks 1 and 2 are in no split
    if pair is None:
        out["world"] = None
    else:
        t = np.full(1, float(rank + 1), dtype=np.float32)
        dist.all_reduce(t, group=pair)
        out["world"] = (dist.get_process_group_ranks(pair), t.tolist())
    everyone = np.ones(1, dtype=np.float32)
    dist.all_reduce(everyone)  # the world's group is still in step
    out["everyone"] = everyone.tolist()
    dist.destroy_process_group()
    return out


@pytest.mark.parametrize("engine", ENGINES)
def test_split_group_of_a_subgroup_and_of_the_world(engine):
    got = run_world(_splits, 4, args=(engine,), timeout=90)
    assert got[0]["outside"] == "Group -100 is not registered"  # rank 0 holds NON_GROUP_MEMBER: torch's words
    assert [g.get("tail") for g in got[1:]] == [([1, 2], [3.0, 3.0]), ([1, 2], [3.0, 3.0]), ([3], [3.0, 3.0])]
    assert [g["world"] for g in got] == [([0, 3], [5.0]), None, None, ([0, 3], [5.0])]
    assert all(g["everyone"] == [4.0] for g in got)
