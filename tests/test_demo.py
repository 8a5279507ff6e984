"""The main demo end to end: python -m distcomm.demo launches distcomm-run with 2 workers, every
rank reports each epoch, rank 0 the accuracy. A short run (the full one is `make demo`), still
slow: it trains a CNN on 2 processes that import torch."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

pytest.importorskip("torch")


@pytest.mark.slow
def test_demo_runs_under_distcomm_run():
    cmd = [sys.executable, "-m", "distcomm.demo", "--nproc", "2", "--epochs", "2", "--train-size", "1536",
           "--test-size", "256", "--lr", "0.1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert "$ distcomm-run --standalone --nproc-per-node 2 -m distcomm.demo --worker" in out
    for rank in (0, 1):
        for epoch in (1, 2):
            assert re.search(rf"\[rank{rank}\]: rank {rank}  epoch  {epoch}/2  loss \d+\.\d{{4}}", out), out
    assert "@progress" not in out  # progress lines are drawn on a terminal, dropped in a log
    accuracy = re.search(r"\[rank0\]: accuracy on 256 held-out digits: (\d+\.\d)%", out)
    assert accuracy and float(accuracy.group(1)) > 20.0, out  # 10 classes: chance is 10%
    assert out.rstrip().endswith("(exit code 0)")
