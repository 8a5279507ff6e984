"""The shared-memory engine's choice of algorithm (backends/shm/choose.py), a pure function: each
rule at its boundary sizes, algorithms forced through the Tuning, and the fall-back from single-copy
reads when the group may not use them."""

from __future__ import annotations

import pytest

from distcomm.backends.shm import group_collectives
from distcomm.backends.shm.choose import THRESHOLDS, Capabilities, check_forced, choose, latency_limit
from distcomm.backends.shm.scatter_slots import piece_bytes
from distcomm.tuning import Tuning

KiB, MiB = 1024, 1 << 20
SLOT = MiB
CAN = Capabilities(direct_reads=True, slot_bytes=SLOT)
CANNOT = Capabilities(direct_reads=False, slot_bytes=SLOT)
DEFAULT = Tuning()


def tuned(**env) -> Tuning:
    return Tuning.from_env({k: str(v) for k, v in env.items()})


@pytest.mark.parametrize(
    "nbytes, size, expected",
    [
        (0, 4, "allreduce_direct"),
        (8, 4, "allreduce_direct"),
        (256 * KiB, 4, "allreduce_direct"),  # the direct limit itself
        (256 * KiB + 1, 4, "allreduce_slices"),
        (256 * KiB + 1, 3, "allreduce_slices"),
        (256 * KiB + 1, 8, "allreduce_slices"),
        (1 * MiB, 2, "allreduce_direct"),  # two ranks: direct up to its one slot,
        (1 * MiB + 1, 2, "allreduce_readv"),  # single copy past it (each rank folds into its own copy)
        (2 * MiB, 2, "allreduce_readv"),
        (2 * MiB, 3, "allreduce_slices"),
        (4 * MiB - 1, 4, "allreduce_slices"),
        (4 * MiB, 4, "allreduce_readv"),  # single copy from 4 MiB
        (4 * MiB, 2, "allreduce_readv"),
    ],
)
def test_all_reduce_by_size(nbytes, size, expected):
    assert choose("allreduce", nbytes, size, CAN, DEFAULT) == expected


def test_all_reduce_without_direct_reads_falls_back_to_slices():
    assert choose("allreduce", 4 * MiB, 4, CANNOT, DEFAULT) == "allreduce_slices"
    assert choose("allreduce", 1 * MiB + 1, 2, CANNOT, DEFAULT) == "allreduce_slices"
    assert choose("allreduce", 8, 4, CANNOT, tuned(DISTCOMM_SHM_ALGO_ALLREDUCE="readv")) == "allreduce_slices"


def test_all_reduce_forced():
    assert choose("allreduce", 8, 4, CAN, tuned(DISTCOMM_SHM_ALGO_ALLREDUCE="readv")) == "allreduce_readv"
    assert choose("allreduce", 8, 4, CAN, tuned(DISTCOMM_SHM_ALGO_ALLREDUCE="slices")) == "allreduce_slices"
    forced_direct = tuned(DISTCOMM_SHM_ALGO_ALLREDUCE="direct")
    assert choose("allreduce", 64 * MiB, 4, CAN, forced_direct) == "reduce_direct"  # past one slot
    assert choose("allreduce", SLOT, 4, CAN, forced_direct) == "allreduce_direct"
    assert choose("allreduce", SLOT + 1, 4, CAN, forced_direct) == "reduce_direct"
    # direct by size past a smaller slot runs in chunks too
    small_slots = Capabilities(True, 64 * KiB)
    assert choose("allreduce", 64 * KiB, 4, small_slots, DEFAULT) == "allreduce_direct"
    assert choose("allreduce", 64 * KiB + 1, 4, small_slots, DEFAULT) == "reduce_direct"


def test_thresholds_from_the_tuning():
    t = tuned(DISTCOMM_SHM_THRESHOLD_ALLREDUCE_DIRECT_BYTES=256, DISTCOMM_SHM_THRESHOLD_READV_BYTES=2048,
              DISTCOMM_SHM_THRESHOLD_ALLREDUCE_READV_BYTES=4096)
    for size in (2, 4):  # replaces both direct limits
        assert choose("allreduce", 256, size, CAN, t) == "allreduce_direct"
        assert choose("allreduce", 257, size, CAN, t) == "allreduce_slices"
        assert choose("allreduce", 4096, size, CAN, t) == "allreduce_readv"
    assert choose("allgather", 2047, 4, CAN, t) == "allgather_slots"
    assert choose("allgather", 2048, 4, CAN, t) == "allgather_readv"


@pytest.mark.parametrize("op, slots, readv", [
    ("reduce", "reduce_direct", "reduce_readv"),
    ("allgather", "allgather_slots", "allgather_readv"),
    ("reducescatter", "reduce_scatter_slots", "reduce_scatter_readv"),
    ("alltoall", "alltoall_slots", "alltoall_readv"),
    ("broadcast", "broadcast_slots", "broadcast_readv"),
])
def test_single_copy_from_4_mib(op, slots, readv):
    assert choose(op, 4 * MiB - 1, 4, CAN, DEFAULT) == slots
    assert choose(op, 4 * MiB, 4, CAN, DEFAULT) == readv
    assert choose(op, 64 * MiB, 4, CANNOT, DEFAULT) == slots  # not allowed: through slots
    forced = tuned(**{f"DISTCOMM_SHM_ALGO_{op.upper()}": "readv"})
    assert choose(op, 8, 4, CAN, forced) == readv
    assert choose(op, 8, 4, CANNOT, forced) == slots
    assert choose(op, 64 * MiB, 4, CAN, tuned(**{f"DISTCOMM_SHM_ALGO_{op.upper()}": "slots"})) == slots


@pytest.mark.parametrize("size", [2, 3, 4, 8])
def test_scatter_single_copy_once_a_block_takes_more_than_one_round(size):
    piece = piece_bytes(SLOT, size)  # a rank's part of one round's slot
    assert choose("scatter", size * piece, size, CAN, DEFAULT) == "scatter_slots"
    assert choose("scatter", size * piece + 1, size, CAN, DEFAULT) == "scatter_readv"
    assert choose("scatter", 4 * MiB, size, CAN, DEFAULT) == "scatter_readv"
    assert choose("scatter", 64 * MiB, size, CANNOT, DEFAULT) == "scatter_slots"  # not allowed: through slots
    assert choose("scatter", 8, size, CAN, tuned(DISTCOMM_SHM_ALGO_SCATTER="readv")) == "scatter_readv"
    assert choose("scatter", 64 * MiB, size, CAN, tuned(DISTCOMM_SHM_ALGO_SCATTER="slots")) == "scatter_slots"


def test_broadcast_at_two_ranks_splits_the_copy_past_one_slot():
    assert choose("broadcast", SLOT, 2, CAN, DEFAULT) == "broadcast_slots"
    assert choose("broadcast", SLOT + 1, 2, CAN, DEFAULT) == "broadcast_split"
    assert choose("broadcast", SLOT + 1, 3, CAN, DEFAULT) == "broadcast_slots"  # more ranks: from 4 MiB
    assert choose("broadcast", SLOT + 1, 2, CANNOT, DEFAULT) == "broadcast_slots"
    assert choose("broadcast", 4 * MiB, 2, CAN, DEFAULT) == "broadcast_split"
    assert choose("broadcast", 64 * MiB, 2, CANNOT, DEFAULT) == "broadcast_slots"  # not allowed: through slots
    assert choose("broadcast", 4 * MiB, 3, CAN, DEFAULT) == "broadcast_readv"
    assert choose("broadcast", 8, 2, CAN, tuned(DISTCOMM_SHM_ALGO_BROADCAST="readv")) == "broadcast_readv"
    split = tuned(DISTCOMM_SHM_ALGO_BROADCAST="split")
    assert choose("broadcast", 8, 4, CAN, split) == "broadcast_split"
    assert choose("broadcast", 8, 4, CANNOT, split) == "broadcast_slots"
    assert choose("broadcast", 64 * MiB, 2, CAN, tuned(DISTCOMM_SHM_ALGO_BROADCAST="slots")) == "broadcast_slots"


def test_barrier_through_slots_only():
    for nbytes in (0, 8, 64 * MiB):
        assert choose("barrier", nbytes, 4, CAN, DEFAULT) == "barrier_slots"


def test_gather_written_by_the_senders_from_4_mib():
    for size in (2, 4):
        assert choose("gather", 4 * MiB - 1, size, CAN, DEFAULT) == "gather_slots"
        assert choose("gather", 4 * MiB, size, CAN, DEFAULT) == "gather_writev"
        assert choose("gather", 64 * MiB, size, CANNOT, DEFAULT) == "gather_slots"  # not allowed: through slots
    assert choose("gather", 8, 4, CAN, tuned(DISTCOMM_SHM_ALGO_GATHER="writev")) == "gather_writev"


def test_gather_read_by_the_root_only_when_forced():
    forced = tuned(DISTCOMM_SHM_ALGO_GATHER="readv")
    assert choose("gather", 8, 4, CAN, forced) == "gather_readv"
    assert choose("gather", 64 * MiB, 2, CANNOT, forced) == "gather_slots"  # not allowed: through slots
    assert choose("gather", 64 * MiB, 4, CAN, tuned(DISTCOMM_SHM_ALGO_GATHER="slots")) == "gather_slots"


def test_every_choice_names_an_algorithm():
    ops = ("allreduce", "reduce", "broadcast", "allgather", "gather", "scatter", "reducescatter", "alltoall", "barrier")
    for op in ops:
        for nbytes in (0, 8, 300 * KiB, 2 * MiB, 5 * MiB, 20 * MiB):
            for size in (2, 3, 8):
                for caps in (CAN, CANNOT, Capabilities(True, 8192)):
                    assert choose(op, nbytes, size, caps, DEFAULT) in group_collectives.ALGORITHMS


def test_latency_limit():
    assert latency_limit(2, SLOT, DEFAULT) == SLOT
    assert latency_limit(4, SLOT, DEFAULT) == THRESHOLDS["allreduce_direct_bytes"]
    assert latency_limit(2, 8192, DEFAULT) == 8192  # never past a slot
    assert latency_limit(4, SLOT, tuned(DISTCOMM_SHM_ALGO_ALLREDUCE="direct")) == 0  # forced: no latency path


def test_a_forced_name_that_is_no_algorithm_is_refused():
    check_forced(tuned(DISTCOMM_SHM_ALGO_ALLREDUCE="slices", DISTCOMM_SHM_ALGO_ALL_TO_ALL="readv"))
    with pytest.raises(ValueError, match="DISTCOMM_SHM_ALGO_ALLREDUCE='ring'"):
        check_forced(tuned(DISTCOMM_SHM_ALGO_ALLREDUCE="ring"))
    with pytest.raises(ValueError, match="DISTCOMM_SHM_ALGO_BROADCAST='direct'"):
        check_forced(tuned(DISTCOMM_SHM_ALGO_BROADCAST="direct"))
