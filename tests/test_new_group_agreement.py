"""new_group's members agree on who they are before the group is used.

Ranks given different member lists would otherwise meet in collectives of different shapes; on the
TCP engine, whose messages match by group and sequence number, that returned wrong sums without an
error. Each member now checks the others' lists through the store, on every engine.
"""

from __future__ import annotations

from datetime import timedelta

import numpy as np
import pytest

from harness import run_world


def _disagree(rank, world, engine):
    import distcomm as dist
    from distcomm.errors import CollectiveMismatchError

    dist.init_process_group(engine, timeout=timedelta(seconds=30))
    try:
        dist.new_group([0, 1] if rank == 0 else [0, 1, 2])
        outcome = "created"
    except CollectiveMismatchError as exc:
        outcome = str(exc)
    x = np.ones(2, np.float32)
    dist.all_reduce(x)  # the world is unharmed
    assert x.tolist() == [world, world]
    dist.destroy_process_group()
    return outcome


@pytest.mark.parametrize("engine", ["gloo", "tcp"])
def test_members_given_different_lists_all_raise_naming_the_lists(engine):
    outcomes = run_world(_disagree, 3, args=(engine,), timeout=90)
    for rank, text in enumerate(outcomes):
        assert text.startswith(f"new_group on rank {rank}: the ranks disagree on the members"), text
    # each rank reads the members it was given
    assert "rank 0 gave [0,1]; rank 1 gave [0,1,2]" in outcomes[0], outcomes[0]
    for text in outcomes[1:]:
        assert "rank 0 gave [0,1]; ranks 1, 2 gave [0,1,2]" in text, text


def _one_skips(rank, world):
    import distcomm as dist
    from distcomm.errors import DistBackendError

    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    outcome = "skipped"
    if rank != 1:  # rank 1 never calls new_group
        try:
            g = dist.new_group([0, 1], timeout=timedelta(seconds=2))
            outcome = "non-member" if g is dist.GroupMember.NON_GROUP_MEMBER else "created"
        except DistBackendError as exc:
            outcome = str(exc)
    dist.barrier()
    dist.destroy_process_group()
    return outcome


def test_a_member_that_never_calls_new_group_is_named_at_the_timeout():
    outcomes = run_world(_one_skips, 3, timeout=90)
    assert outcomes[1:] == ["skipped", "non-member"], outcomes
    assert outcomes[0].startswith("new_group on rank 0: rank(s) [1] of the new group [0, 1] did not call new_group"), \
        outcomes[0]
