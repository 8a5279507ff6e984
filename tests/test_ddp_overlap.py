"""When distcomm's DDP overlaps bucket reductions with backward: the decision alone (reducer.overlaps).
Both ways are checked against torch and one process in test_ddp.py (scenarios overlapped/not_overlapped)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from distcomm.parallel.reducer import overlap_on_this_host, overlaps  # noqa: E402


@pytest.mark.parametrize("cpus, local_ranks, expected", [(2, 2, False), (3, 2, False), (4, 2, True), (64, 8, True),
                                                         (8, 8, False), (1, 1, False), (2, 1, True)])
def test_overlap_needs_a_spare_core_per_rank(cpus, local_ranks, expected):
    assert overlaps(cpus, local_ranks, None) is expected
    assert overlaps(cpus, local_ranks, "auto") is expected


@pytest.mark.parametrize("setting, expected", [("1", True), ("0", False)])
def test_the_setting_forces_either_way(setting, expected):
    for cpus, local_ranks in ((2, 2), (64, 2)):
        assert overlaps(cpus, local_ranks, setting) is expected


def test_a_wrong_setting_is_refused_naming_the_variable():
    with pytest.raises(ValueError, match="DISTCOMM_DDP_OVERLAP='yes'"):
        overlaps(4, 2, "yes")


def test_this_host_counts_local_world_size(monkeypatch):
    monkeypatch.delenv("DISTCOMM_DDP_OVERLAP", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "100000")  # more ranks than any host's cores
    assert overlap_on_this_host(2) is False
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setenv("DISTCOMM_DDP_OVERLAP", "0")
    assert overlap_on_this_host(1) is False
    monkeypatch.setenv("DISTCOMM_DDP_OVERLAP", "1")
    assert overlap_on_this_host(100000) is True
