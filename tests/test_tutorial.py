"""The seed tutorial's programs print the same with ``import distcomm as dist`` as with torch.

tests/tutorial_programs/ holds each program twice, ``<name>_torch.py`` and ``<name>_distcomm.py``,
differing only in the line that imports ``dist`` (checked here). ``run_all.py <framework>`` runs
every program of one framework in one process (torch imported once; the programs fork their
ranks), and the test compares each program's lines — sorted, since ranks print in any order —
between the two. The SGD program's losses are compared within float rounding; the others exactly.

The runs are slow (both drivers import torch and fork up to 4 ranks per program); the fast tier
(``pytest -m "not slow"``) keeps the check of the import lines.
"""

from __future__ import annotations

import functools
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent / "tutorial_programs"
PROGRAMS = ["p2p_blocking", "p2p_nonblocking", "allreduce_group", "ring_allreduce", "sgd"]
DEADLINE = 240  # seconds for all programs of one framework (generous: shared machine)


@functools.lru_cache(maxsize=None)
def _runs() -> dict[str, tuple[int | None, str, str]]:
    """Both frameworks' drivers, started together (their waits for peers overlap)."""
    env = dict(os.environ)
    env.pop("PYTHONUNBUFFERED", None)
    procs = {fw: subprocess.Popen([sys.executable, str(HERE / "run_all.py"), fw], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
             for fw in ("torch", "distcomm")}
    done = {}
    for fw, proc in procs.items():
        try:
            out, err = proc.communicate(timeout=DEADLINE)
            done[fw] = (proc.returncode, out, err)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the driver and the ranks it forked
            out, err = proc.communicate()
            done[fw] = (None, out, err)
    return done


@functools.lru_cache(maxsize=None)
def outputs(framework: str) -> dict[str, list[str]] | str:
    """Program name -> its stdout lines (sorted), or the reason the run failed."""
    code, out, err = _runs()[framework]
    if code is None:
        return f"{framework}: killed after {DEADLINE} s\nstdout:\n{out[-3000:]}\nstderr:\n{err[-3000:]}"
    if code != 0:
        return f"{framework}: exit code {code}\nstdout:\n{out[-3000:]}\nstderr:\n{err[-3000:]}"
    result: dict[str, list[str]] = {}
    current = None
    for line in out.splitlines():
        m = re.fullmatch(r"=== (\w+) exit codes \[(.*)\]", line)
        if m:
            codes = [int(c) for c in m.group(2).split(",") if c.strip()]
            if any(codes) or not codes:
                return f"{framework}: {m.group(1)}'s processes exited with {codes}\nstderr:\n{err[-3000:]}"
            current = None
            continue
        m = re.fullmatch(r"=== (\w+)", line)
        if m:
            current = m.group(1)
            result[current] = []
        elif current is not None:
            result[current].append(line)
    return {k: sorted(v) for k, v in result.items()}


def _lines(framework: str, program: str) -> list[str]:
    got = outputs(framework)
    if isinstance(got, str):
        pytest.fail(got)
    assert program in got, f"{program} printed nothing under {framework}"
    return got[program]


@pytest.mark.parametrize("program", PROGRAMS)
def test_only_the_import_line_differs(program):
    ours = (HERE / f"{program}_distcomm.py").read_text().splitlines()
    theirs = (HERE / f"{program}_torch.py").read_text().splitlines()
    assert len(ours) == len(theirs)
    different = [(a, b) for a, b in zip(theirs, ours) if a != b]
    assert different == [("import torch.distributed as dist", "import distcomm as dist")]


EXPECTED = {  # what torch's versions print (sorted), spelled out so the oracle itself is checked
    "p2p_blocking": ["Rank  0  has data  tensor(1.)", "Rank  1  has data  tensor(1.)"],
    "p2p_nonblocking": ["Rank  0  has data  tensor(1.)", "Rank  1  has data  tensor(1.)",
                        "Rank 0 started sending", "Rank 1 started receiving"],
    "allreduce_group": ["Rank  0  has data  tensor(2.)", "Rank  1  has data  tensor(2.)",
                        "Rank  2  has data  tensor(1.)", "Rank  3  has data  tensor(1.)"],
    "ring_allreduce": sorted(
        [f"Rank  {r}  tutorial ring:  tensor([{20 * r}., {20 * r + 2}., {20 * r + 4}., {20 * r + 6}.])"
         for r in range(4)]  # as printed, the tutorial's ring doubles each rank's own input
        + [f"Rank  {r}  fixed ring:  tensor([60., 64., 68., 72.])" for r in range(4)]),
}


@pytest.mark.slow
@pytest.mark.parametrize("program", [p for p in PROGRAMS if p != "sgd"])
def test_prints_what_torch_prints(program):
    theirs = _lines("torch", program)
    assert theirs == EXPECTED[program]
    assert _lines("distcomm", program) == theirs


_LOSS = re.compile(r"Rank  (\d) , epoch  (\d+) :  (\S+)")


def _losses(framework: str) -> dict[tuple[int, int], float]:
    lines = _lines(framework, "sgd")
    losses = {}
    for line in lines:
        m = _LOSS.fullmatch(line)
        assert m, f"unexpected line from the {framework} SGD program: {line!r}"
        losses[int(m.group(1)), int(m.group(2))] = float(m.group(3))
    return losses


@pytest.mark.slow
def test_distributed_sgd_same_losses():
    theirs, ours = _losses("torch"), _losses("distcomm")
    assert sorted(theirs) == [(r, e) for r in range(2) for e in range(10)]
    assert sorted(ours) == sorted(theirs)
    for key, loss in theirs.items():
        assert ours[key] == pytest.approx(loss, rel=1e-6, abs=1e-9), key
    # training did something: the loss went down on both ranks
    assert all(theirs[r, 9] < theirs[r, 0] for r in range(2))
