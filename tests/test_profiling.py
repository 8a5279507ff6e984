"""profiling.profiler_check: the latency paths' per-call question "is torch's profiler on?"."""

from __future__ import annotations

from distcomm.profiling import profiler_check, profiling


def test_profiler_check_follows_torchs_profiler_as_profiling_does():
    import torch

    check = profiler_check()
    assert check() is False and profiling() is None
    with torch.profiler.profile():
        assert check() is True and profiling() is torch
        with torch.profiler.record_function("inner"):
            assert check() is True
    assert check() is False and profiling() is None
    # a check made before its first question and one reused after the profiler stopped agree
    assert profiler_check()() is False
