"""Where the job store listens, and how launchers leave, as users meet them (review 19).

- Under mpiexec with MASTER_ADDR set (and no MASTER_PORT), env:// agrees on the store over MPI:
  rank 0's store must listen on MASTER_ADDR only, never the wildcard, and MASTER_ADDR=::1 must work
  (the store listened on 0.0.0.0 then, which ::1 clients cannot reach: init hung until its timeout).
"""

from __future__ import annotations

import pytest

import mpi_harness


@pytest.mark.parametrize("addr, expect", [("localhost", {"127.0.0.1", "::1"}), ("::1", {"::1"})])
def test_mpiexec_store_listens_on_master_addr_only(addr, expect):
    reason = mpi_harness.skip_reason()
    if reason:
        pytest.skip(reason)
    done = mpi_harness.run_mpiexec(2, "store_listen_worker.py", timeout=30, env={"MASTER_ADDR": addr})
    assert done.returncode == 0, done.stdout + done.stderr
    line = [l for l in done.stdout.splitlines() if l.startswith("LISTEN ")]
    assert line, done.stdout
    where = set(line[0].split(" ", 1)[1].split(","))
    assert where and where <= expect, f"MASTER_ADDR={addr}: the store listens on {where}"
