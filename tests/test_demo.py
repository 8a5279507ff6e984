"""The main demo end to end: python -m distcomm.demo launches distcomm-run with 2 workers on
scikit-learn's digits, every rank reports each epoch, rank 0 the accuracy and the plot it saved. A
short run (the full one is `make demo`), still slow: it trains a CNN on 2 processes that import torch."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("sklearn")
pytest.importorskip("matplotlib")


@pytest.mark.slow
def test_demo_runs_under_distcomm_run(tmp_path):
    plot = tmp_path / "demo.png"
    cmd = [sys.executable, "-m", "distcomm.demo", "--nproc", "2", "--epochs", "3", "--lr", "0.05",
           "--plot", str(plot)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert "$ distcomm-run --standalone --nproc-per-node 2 --rank-prefix -m distcomm.demo --worker" in out
    for rank in (0, 1):
        for epoch in (1, 2, 3):
            assert re.search(rf"\[rank{rank}\]: rank {rank}  epoch  {epoch}/3  loss \d+\.\d{{4}}  "
                             r"held-out accuracy \d+\.\d%", out), out
    assert "@progress" not in out  # progress lines are drawn on a terminal, dropped in a log
    accuracy = re.search(r"\[rank0\]: accuracy on 360 held-out digits: (\d+\.\d)%", out)
    assert accuracy and float(accuracy.group(1)) > 50.0, out  # 10 classes: chance is 10%
    assert f"[rank0]: plot of the loss curves and the accuracy: {plot}" in out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 10_000
    assert out.rstrip().endswith("(exit code 0)")
