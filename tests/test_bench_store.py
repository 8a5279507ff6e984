"""``python -m distcomm.bench store`` runs end to end as a user runs it (a subprocess, a hard timeout).

No timing asserts (the machine is shared): what is asserted is that every row is measured (a
worker that fails makes the tool fail), which ``--json`` exposes as numbers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch.distributed")


@pytest.mark.slow
def test_store_bench_measures_every_row_including_each_server_behind_the_others_clients():
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    done = subprocess.run(
        [sys.executable, "-m", "distcomm.bench", "store", "--iters", "20", "--workers", "3", "--adds", "30",
         "--rounds", "1", "--json"],
        capture_output=True, text=True, timeout=240, env=env,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads(done.stdout)
    assert set(results) == {"distcomm", "distcomm-tcp", "distcomm-server", "torch-server", "torch"}
    for impl, row in results.items():
        assert row["adds_per_s"] > 0, impl
        assert row["client"]["p50_us"] > 0 and row["master"]["p50_us"] > 0, impl
        assert row["client_us_per_add"] > 0, impl
