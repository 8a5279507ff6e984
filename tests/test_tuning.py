"""Tuning: the environment read once into a frozen value, one naming scheme, clear errors."""

from __future__ import annotations

import dataclasses

import pytest

from distcomm.tuning import DEFAULT, Tuning


def test_defaults_when_nothing_is_set():
    t = Tuning.from_env({})
    assert t == DEFAULT
    assert t.algorithm("allreduce") is None and t.shm_algorithm("all_reduce") is None
    assert t.shm_collectives and t.shm_direct
    assert (t.shm_slot_bytes, t.shm_slots, t.shm_ring_bytes, t.shm_spin_s) == (None, None, None, None)


def test_every_variable_is_read():
    env = {
        "DISTCOMM_ALGO_ALL_REDUCE": "Ring",
        "DISTCOMM_ALGO_BROADCAST": "binomial",
        "DISTCOMM_THRESHOLD_ALLREDUCE_SMALL_BYTES": "1024",
        "DISTCOMM_SHM_COLLECTIVES": "0",
        "DISTCOMM_SHM_ALGO_REDUCESCATTER": "readv",
        "DISTCOMM_SHM_THRESHOLD_READV_BYTES": "2048",
        "DISTCOMM_SHM_SLOT_BYTES": "8192",
        "DISTCOMM_SHM_SLOTS": "2",
        "DISTCOMM_SHM_RING_BYTES": "4096",
        "DISTCOMM_SHM_SPIN_US": "5",
        "DISTCOMM_SHM_YIELD_US": "7.5",
        "DISTCOMM_SHM_SHARED_YIELD_US": "0",
        "DISTCOMM_SHM_DIRECT": "false",
        "DISTCOMM_AUTH_KEY": "not a knob",
    }
    t = Tuning.from_env(env)
    # ALL_REDUCE and ALLREDUCE name the same op; names are case-insensitive
    assert t.algorithm("allreduce") == t.algorithm("all_reduce") == "ring"
    assert t.algorithm("broadcast") == "binomial"
    assert t.thresholds == {"allreduce_small_bytes": 1024}
    assert not t.shm_collectives and not t.shm_direct
    assert t.shm_algorithm("reduce_scatter") == "readv"
    assert t.shm_thresholds == {"readv_bytes": 2048}
    assert (t.shm_slot_bytes, t.shm_slots, t.shm_ring_bytes) == (8192, 2, 4096)
    assert t.shm_spin_s == pytest.approx(5e-6) and t.shm_yield_s == pytest.approx(7.5e-6)
    assert t.shm_shared_yield_s == 0.0


def test_frozen():
    t = Tuning.from_env({"DISTCOMM_ALGO_ALLREDUCE": "ring"})
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.shm_direct = False  # type: ignore[misc]
    with pytest.raises(TypeError):
        t.algorithms["allreduce"] = "tree"  # type: ignore[index]


@pytest.mark.parametrize(
    "env,message",
    [
        ({"DISTCOMM_THRESHOLD_ALLGATHER_SMALL_BYTES": "64k"}, "DISTCOMM_THRESHOLD_ALLGATHER_SMALL_BYTES='64k' is not a number of bytes"),
        ({"DISTCOMM_SHM_SLOTS": "-1"}, "DISTCOMM_SHM_SLOTS='-1': a number of bytes must not be negative"),
        ({"DISTCOMM_SHM_SPIN_US": "fast"}, "DISTCOMM_SHM_SPIN_US='fast' is not a number of microseconds"),
    ],
)
def test_bad_values_name_the_variable(env, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        Tuning.from_env(env)


def test_read_from_the_process_environment(monkeypatch):
    monkeypatch.setenv("DISTCOMM_SHM_ALGO_ALLREDUCE", "slices")
    assert Tuning.from_env().shm_algorithm("allreduce") == "slices"
