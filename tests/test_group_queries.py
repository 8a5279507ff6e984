"""Group queries, group names and descriptions, and the sentinels, against torch.distributed 2.13 (gloo).

One world of 3 runs the same script through torch (gloo) and then distcomm (its default engine, and
"tcp"), in the same processes: rank queries on a process outside the group (torch answers them about
the last group the process was not made a member of), on a destroyed group and on things that are not
groups; ``group_name`` and ``group_desc`` (new_subgroups_by_enumeration's too); ``get_backend``
after ``init_process_group()`` without a backend ("undefined"). Where torch raises, distcomm must
raise something an ``except`` naming torch's class catches, and where torch's message is a
ValueError's, the same text (group reprs aside). Without a world: ``GroupMember.NON_GROUP_MEMBER ==
-100`` and how ReduceOp prints.
"""

from __future__ import annotations

import functools
import re
import warnings

import pytest
import torch.distributed as tdist

import distcomm as dist
from harness import free_port, initialized, run_world

WS = 3
ENGINES = ["gloo", "tcp"]

# The classes an ``except`` clause written for torch might name.
_KINDS = (ValueError, KeyError, TypeError, AttributeError, RuntimeError, AssertionError)


def _attempt(fn):
    try:
        value = fn()
    except Exception as exc:  # noqa: BLE001 - what we are here to see
        kinds = tuple(k.__name__ for k in _KINDS if isinstance(exc, k))
        # a group's repr is each library's own: compare the rest of the message
        text = re.sub(r"<(torch\.distributed\.distributed_c10d\.|distcomm\.)ProcessGroup[^>]*>", "<group>", str(exc))
        return ("raised", type(exc).__name__, kinds, text)
    return ("returned", value)


def _script(dist, rank: int, ws: int) -> dict:
    """The calls, in order, with each one's outcome on this rank."""
    out = {}

    def record(name, fn):
        out[name] = _attempt(fn)

    non_member = dist.GroupMember.NON_GROUP_MEMBER
    record("backend/default", lambda: str(dist.get_backend()))  # init_process_group() without a backend
    record("backend_config/default", lambda: dist.get_backend_config())
    record("world/group_name", lambda: dist.group.WORLD.group_name)
    record("world/group_desc", lambda: dist.group.WORLD.group_desc)
    record("pg_count/start", dist.get_pg_count)
    # NON_GROUP_MEMBER before this process was left out of any group
    record("non_member/get_rank", lambda: dist.get_rank(non_member))
    record("non_member/get_world_size", lambda: dist.get_world_size(non_member))
    record("non_member/ranks_before", lambda: dist.get_process_group_ranks(non_member))
    record("non_member/group_rank_before", lambda: dist.get_group_rank(non_member, 0))
    record("non_member/get_backend", lambda: dist.get_backend(non_member))
    # things that are not groups
    for bad in ("foo", 3):
        for fn in ("get_rank", "get_process_group_ranks", "get_backend"):
            record(f"bad/{fn}({bad!r})", lambda: getattr(dist, fn)(bad))
        record(f"bad/get_group_rank({bad!r})", lambda: dist.get_group_rank(bad, 0))
        record(f"bad/get_global_rank({bad!r})", lambda: dist.get_global_rank(bad, 0))
    record("none/get_group_rank", lambda: dist.get_group_rank(None, 0))
    record("none/get_global_rank", lambda: dist.get_global_rank(None, 0))
    record("none/get_process_group_ranks", lambda: dist.get_process_group_ranks(None))
    # groups some ranks are not in: rank 1 is in neither, rank 2 only in the second
    groups = {"first": dist.new_group([0]), "second": dist.new_group([0, 2]),
              "described": dist.new_group(list(range(ws)), group_desc="mydesc"), "plain": dist.new_group()}
    sub = dist.new_group(backend=None)
    record("backend/subgroup", lambda: str(dist.get_backend(sub)))
    for name, g in groups.items():
        record(f"{name}/is_non_member", lambda: g == non_member)
        record(f"{name}/get_process_group_ranks", lambda: dist.get_process_group_ranks(g))
        for r in range(ws):
            record(f"{name}/get_group_rank({r})", lambda: dist.get_group_rank(g, r))
            record(f"{name}/get_global_rank({r})", lambda: dist.get_global_rank(g, r))
        record(f"{name}/get_rank", lambda: dist.get_rank(g))
        record(f"{name}/get_world_size", lambda: dist.get_world_size(g))
        if g != non_member:
            record(f"{name}/group_name", lambda: g.group_name)
            record(f"{name}/group_desc", lambda: g.group_desc)
    mine, _ = dist.new_subgroups_by_enumeration([[0, 1], list(range(2, ws))], group_desc="halves")
    record("subgroups/group_desc", lambda: mine.group_desc)
    # new_subgroups of a group: a rank outside it sees its size -1 and raises (then makes the same
    # two groups its peers make, to stay in step); the members split that group, not the world
    pair = dist.new_group([0, 1])
    record("subgroups_of_group", lambda: [dist.get_process_group_ranks(g)
                                          for g in dist.new_subgroups(1, group=pair)[1]])
    if rank not in (0, 1):
        dist.new_group([0])
        dist.new_group([1])
    record("pg_count/after", dist.get_pg_count)
    # a destroyed group
    gone = groups["described"]
    dist.destroy_process_group(gone)
    for fn in ("get_rank", "get_world_size", "get_process_group_ranks", "get_backend"):
        record(f"destroyed/{fn}", lambda: getattr(dist, fn)(gone))
    record("destroyed/get_group_rank", lambda: dist.get_group_rank(gone, 0))
    record("destroyed/get_global_rank", lambda: dist.get_global_rank(gone, 0))
    record("destroyed/destroy_again", lambda: dist.destroy_process_group(gone))
    record("pg_count/end", dist.get_pg_count)
    return out


def _run(rank: int, ws: int, plans: list) -> dict:
    import torch  # noqa: F401

    warnings.simplefilter("ignore")
    results = {}
    for framework, engine, port in plans:
        # engine None: no backend named (torch's default group then says "undefined"); "tcp":
        # distcomm's tcp engine, a backend name torch would not know
        with initialized(framework, engine, port) as lib:
            results[f"{framework}:{engine}"] = _script(lib, rank, ws)
            lib.barrier()
    return results


@functools.lru_cache(maxsize=None)
def _world():
    plans = [("torch", None, free_port()), ("distcomm", None, free_port()), ("distcomm", "tcp", free_port())]
    return run_world(_run, WS, args=(plans,), timeout=240)


# The distcomm run on "tcp" names its backend so; torch's run has no backend name ("undefined")
_ENGINE_NAMES = {"backend/default", "backend_config/default", "backend/subgroup"}


def _oracle_as_expected(results) -> None:
    """torch's answers that the comparison relies on (torch 2.13): if torch changes, look here."""
    r1 = results[1]["torch:None"]
    assert r1["first/get_process_group_ranks"] == ("returned", [0, 2])  # the last group rank 1 is not in
    assert r1["second/get_global_rank(1)"] == ("returned", 2)
    assert r1["first/get_rank"] == ("returned", -1)
    r0 = results[0]["torch:None"]
    assert r0["world/group_desc"] == ("returned", "default_pg") and r0["described/group_desc"] == ("returned", "mydesc")
    assert r0["described/group_name"] == ("returned", "3") and r0["plain/group_desc"] == ("returned", "undefined")
    assert r0["backend/default"] == ("returned", "undefined") and r0["destroyed/get_rank"][1] == "ValueError"
    assert r0["destroyed/get_process_group_ranks"][1] == "KeyError"


@pytest.mark.parametrize("engine", [None, "tcp"])
def test_group_queries_answer_as_torch(engine):
    results = _world()
    _oracle_as_expected(results)
    problems = []
    for rank in range(WS):
        theirs, ours = results[rank]["torch:None"], results[rank][f"distcomm:{engine}"]
        assert set(theirs) == set(ours), set(theirs) ^ set(ours)
        for name, want in theirs.items():
            got = ours[name]
            if engine == "tcp" and name in _ENGINE_NAMES:
                continue  # distcomm's "tcp" is an engine torch does not have
            if want[0] == "returned":
                if got != want:
                    problems.append(f"rank {rank} {name}: torch {want}, distcomm {got}")
            elif got[0] != "raised" or want[1] not in got[2]:
                problems.append(f"rank {rank} {name}: torch raised {want[1]} ({want[3]!r}), distcomm {got}")
            elif want[1] == "ValueError" and got[3] != want[3]:
                problems.append(f"rank {rank} {name}: torch's text {want[3]!r}, distcomm's {got[3]!r}")
    assert not problems, "\n".join(problems)


def test_non_group_member_is_torchs_minus_100():
    assert dist.GroupMember.NON_GROUP_MEMBER == -100 == tdist.GroupMember.NON_GROUP_MEMBER
    assert repr(dist.GroupMember.NON_GROUP_MEMBER) == repr(tdist.GroupMember.NON_GROUP_MEMBER)
    # a program may keep torch's value: distcomm's checks compare by value, as torch's
    assert dist.distributed_c10d._rank_not_in_group(-100) and not dist.distributed_c10d._rank_not_in_group(None)
    assert dist.get_rank(-100) == -1 == dist.get_world_size(-100)


@pytest.mark.parametrize("name", ["SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "PREMUL_SUM"])
def test_reduce_op_prints_as_torchs(name):
    ours, theirs = getattr(dist.ReduceOp, name), getattr(tdist.ReduceOp, name)
    assert str(ours) == str(theirs) and repr(ours) == repr(theirs)
    assert f"{ours}" == f"{theirs}" and "%s" % ours == "%s" % theirs
    assert int(ours) == int(theirs) and ours == theirs
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # reduce_op is deprecated (both warn)
        assert str(getattr(dist.reduce_op, name)) == str(getattr(tdist.reduce_op, name))
