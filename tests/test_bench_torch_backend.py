"""The benchmarks of torch over the c10d backend "distcomm": run end to end, as a user runs them.

No timing asserts (a shared machine): what is asserted is that both worlds ran, every row was
checked with 0 wrong elements, and the DDP variants ended with the same weights.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")


def _bench(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, "-m", "distcomm.bench", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.mark.slow
def test_torch_backend_bench_compares_torch_over_distcomm_with_gloo(tmp_path):
    out = tmp_path / "r.json"
    result = _bench("torch-backend", "--world", "2", "--ops", "all_reduce,all_gather", "--budget", "0.01",
                    "--timeout", "60", "--repeat", "2", "--json", str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "torch/distcomm" in result.stdout and "torch/gloo" in result.stdout
    rows = [line.split() for line in result.stdout.splitlines() if line.strip() and not line.startswith("#")]
    assert len(rows) == 2 * 2  # 8 B and 1 MiB for each op
    for fields in rows:  # size count type | time algbw busbw #wrong | time algbw busbw #wrong | speedup
        assert len(fields) == 12 and fields[6] == "0" and fields[10] == "0", fields
        assert float(fields[11]) > 0
    assert result.stdout.count("wrong elements: 0 OK") == 2
    runs = json.loads(out.read_text())["runs"]  # --repeat 2: each row is the lower of its two runs
    assert all(r["time_us"] == min(r["run_times_us"]) and len(r["run_times_us"]) == 2 for rows in runs.values() for r in rows)


@pytest.mark.slow
def test_ddp_bench_has_torch_ddp_over_distcomm_with_the_same_weights():
    result = _bench("ddp", "--world", "2", "--models", "demo-cnn", "--steps", "2", "--warmup", "1", "--batch", "8")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "torch on" in result.stdout
    (row,) = [line.split() for line in result.stdout.splitlines() if line.lstrip().startswith("demo-cnn")]
    # model params grads(2) buckets local distcomm torch torch-distcomm speedup speedup same ...
    assert all(float(v) > 0 for v in row[5:9]), row
    assert row[11] == "yes", row  # the three DDPs ended with the same weights


@pytest.mark.slow
@pytest.mark.parametrize("no_round", [False, True])
def test_torch_backend_floor_measures_every_layer(no_round):
    extra = ["--no-round"] if no_round else []
    result = _bench("torch-backend", "--floor", "--world", "2", "--calls", "300", "--timeout", "60", *extra)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = [line for line in result.stdout.splitlines() if line.startswith("(")]
    assert [row.split()[0] for row in rows] == ["(a)", "(a)", "(a)", "(b)", "(b-)", "(c)"], rows
    for row in rows:
        ranks = [float(v) for v in row.split()[-2:]]
        assert all(v > 0 for v in ranks), row
    assert ("round skipped" in result.stdout) == no_round
