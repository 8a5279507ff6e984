"""torch's own distributed test suite over distcomm (tests/torch_suite.py runs it): MPI's tests.

Below 8 ranks, the suite runs all_to_all and its subgroup tests only for MPI. Here it sees
backend "mpi", and every group the tests make is a "distcomm" group, at world size 3: every test
it runs passes but the one that checks the backend's name. Then, under distcomm's own name, that
test passes too.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("expecttest")  # torch.testing._internal needs it

from torch_suite import run  # noqa: E402

pytestmark = pytest.mark.slow


def test_mpis_tests_pass_over_distcomm_at_three_ranks(tmp_path, seg_dir):
    outcomes = run(tmp_path, seg_dir, "--as", "mpi", "--world", "3", "--timeout", "120", timeout=600)
    failed = {name: o for name, o in outcomes.items() if o.startswith("failed")}
    assert list(failed) == ["test_get_backend"] and "'distcomm' != 'mpi'" in failed["test_get_backend"], failed
    passed = {name for name, o in outcomes.items() if o == "passed"}
    assert len(passed) >= 85, f"only {len(passed)} of torch's tests ran and passed"
    alltoall = {name for name in passed if name.startswith("test_all_to_all")}
    assert len(alltoall) >= 12, sorted(alltoall)  # even and uneven splits, complex, full group and subgroup
    for name in ("test_all_reduce_group_sum", "test_scatter_group", "test_gather_group", "test_barrier_group"):
        assert name in passed, f"{name}: {outcomes.get(name)}"


def test_the_backend_under_its_own_name(tmp_path, seg_dir):
    outcomes = run(tmp_path, seg_dir, "--as", "distcomm", "-k", "test_get_backend", "-k", "test_all_reduce_sum",
                   timeout=300)
    assert outcomes["test_get_backend"] == "passed", outcomes["test_get_backend"]
    assert outcomes["test_all_reduce_sum"] == "passed", outcomes["test_all_reduce_sum"]
