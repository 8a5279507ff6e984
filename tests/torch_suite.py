"""torch's own distributed test suite, run over distcomm.

The suite is ``DistributedTest._DistTestBase`` in torch/testing/_internal/distributed/distributed_test.py:
the ~290 tests behind torch's test/distributed/test_distributed_spawn.py (collectives, p2p, groups,
DDP, SyncBatchNorm, Join, ...), shipped in torch's wheel. Each test starts ``--world`` processes
that rendezvous through a FileStore and call ``init_process_group(backend=BACKEND)``.

Which tests run depends on the backend name the suite sees (``BACKEND``): most are gated on
``BACKEND == "gloo"`` (or "nccl", or "mpi"). So it runs in these ways:

* ``--as gloo`` (the default): the suite sees BACKEND "gloo" and runs gloo's tests, and every
  process group they create with backend "gloo" is created with "distcomm" instead (this script
  wraps torch.distributed's ``init_process_group`` and ``new_group`` in the test processes). The
  tests then check distcomm's answers with gloo's expectations.
* ``--as mpi``: MPI's tests the same way (below 8 ranks the suite runs all_to_all and its subgroup
  tests only for MPI).
* ``--as distcomm``: the suite sees BACKEND "distcomm", registered as a plugin backend with DDP and
  subgroup support (``DistTestCases.backend_feature``), and runs what it runs for such a backend.
* ``--reference``: torch's gloo itself, unchanged, for comparison.

``--engine`` runs every distcomm group on that engine (``pg_options`` of init_process_group and
new_group). Processes are forked (torch's harness spawns them: a fresh interpreter importing torch
per rank and test costs ~4 s, forking ~0.1 s). Outcomes go to ``--json`` as {test name: "passed" |
"failed: <the error raised>" | "skipped: <reason>"}; tests/test_torch_suite_gloo.py and
tests/test_torch_suite_mpi.py compare them with the failures they expect. A test whose processes
hang is killed after ``--timeout`` seconds (torch's harness does it) and counts as failed.

    python tests/torch_suite.py --world 3 --json /tmp/outcomes.json
    python tests/torch_suite.py --as mpi --engine tcp -k test_all_to_all
"""

from __future__ import annotations

import argparse
import fnmatch
import functools
import inspect
import json
import os
import re
import sys
import time
import unittest


def _parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--as", dest="name", choices=("gloo", "mpi", "distcomm"), default="gloo",
                        help="the backend name the suite sees (default: gloo's tests, run over distcomm)")
    parser.add_argument("--reference", action="store_true", help="run torch's gloo itself (with --as gloo)")
    parser.add_argument("--engine", choices=("gloo", "shm", "tcp"),
                        help="the distcomm engine of every group (default: distcomm's default, \"gloo\": shared "
                             "memory within a host, TCP between hosts)")
    parser.add_argument("--world", type=int, default=2, help="processes per test (default 2)")
    parser.add_argument("--timeout", type=int, default=120, help="seconds before a test's processes are killed")
    parser.add_argument("-k", dest="patterns", action="append", default=[],
                        help="run only tests whose name contains this (or matches this glob); repeatable")
    parser.add_argument("--json", help="write {test: outcome} here")
    return parser.parse_args(argv)


class _EngineOption:
    """init_process_group's ``pg_options`` for "distcomm": which distcomm engine runs the group."""

    def __init__(self, engine: str):
        self.engine = engine


def _distcomm_instead_of(name: str, engine: str | None, fn):
    """``fn`` (init_process_group or new_group) with backend ``name`` replaced by "distcomm", on
    ``engine`` (None: the default)."""
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        bound = signature.bind_partial(*args, **kwargs)
        backend = str(bound.arguments.get("backend", "")).lower()
        if backend == name:
            bound.arguments["backend"] = backend = "distcomm"
        if engine is not None and (backend == "distcomm" or (fn.__name__ == "new_group" and not backend)):
            bound.arguments["pg_options"] = _EngineOption(engine)
        return fn(*bound.args, **bound.kwargs)

    return wrapped


def _load_suite(args):
    """Set the suite's environment, import it and return its test class."""
    os.environ["BACKEND"] = args.name
    os.environ["WORLD_SIZE"] = str(args.world)
    os.environ["DISTRIBUTED_TESTS_DEFAULT_TIMEOUT"] = str(args.timeout)
    import torch
    import torch.distributed as dist
    from torch.testing._internal.common_distributed import DistTestCases

    if not args.reference:
        import distcomm.torch_backend  # noqa: F401  (registers "distcomm" with torch)
    if args.name == "distcomm":
        for feature in ("plugin", "ddp", "subgroup"):
            DistTestCases.backend_feature[feature].add("distcomm")
    if not args.reference:
        dist.init_process_group = _distcomm_instead_of(args.name, args.engine, dist.init_process_group)
        dist.new_group = _distcomm_instead_of(args.name, args.engine, dist.new_group)
    from torch.testing._internal.distributed.distributed_test import DistributedTest, TestDistBackend

    fork = torch.multiprocessing.get_context("fork").Process

    class TorchDistributedSuite(TestDistBackend, DistributedTest._DistTestBase):
        def setUp(self):
            super().setUp()
            self._start_processes(fork)

    return TorchDistributedSuite


class _Outcomes(unittest.TextTestResult):
    """A text result that also keeps {test name: outcome}."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.outcomes: dict[str, str] = {}

    @staticmethod
    def _name(test) -> str:
        return test.id().rsplit(".", 1)[-1]

    def addSuccess(self, test):
        super().addSuccess(test)
        self.outcomes[self._name(test)] = "passed"

    def addSkip(self, test, reason):
        super().addSkip(test, reason)
        self.outcomes[self._name(test)] = f"skipped: {reason}"

    def _failed(self, test, err):
        # torch's harness reports a rank's traceback inside its own error: keep the last exception line
        lines = [line.strip() for line in str(err[1]).split("To execute this test")[0].splitlines()]
        raised = [line for line in lines if re.match(r"[\w.]+(Error|Exception|Exit)\b.*:", line)]
        self.outcomes[self._name(test)] = f"failed: {(raised or lines or [''])[-1][:500]}"

    def addFailure(self, test, err):
        super().addFailure(test, err)
        self._failed(test, err)

    def addError(self, test, err):
        super().addError(test, err)
        self._failed(test, err)


def run(tmp_path, seg_dir: str, *args: str, timeout: float) -> dict[str, str]:
    """For the tests: this script in a subprocess with ``args``, ranks' segments in ``seg_dir``;
    returns {test: outcome}. A run past ``timeout`` seconds fails the calling test."""
    import signal
    import subprocess

    import pytest

    out = tmp_path / "outcomes.json"
    env = dict(os.environ, DISTCOMM_SHM_DIR=seg_dir, PYTORCH_PRINT_REPRO_ON_FAILURE="0")
    # its own session: past the deadline the script and every rank it forked go at once
    proc = subprocess.Popen([sys.executable, __file__, "--json", str(out), *args], env=env, cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"torch's suite ran past {timeout} s; its output:\n{stdout}\n{stderr[-5000:]}")
    try:  # torch's harness joins every rank it starts: nothing of the session may be left
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    else:
        pytest.fail("torch's suite left processes behind (killed now)")
    if not out.exists():
        pytest.fail(f"the suite wrote no outcomes (exit {proc.returncode}):\n{stdout}\n{stderr[-5000:]}")
    return json.loads(out.read_text())


def main(argv=None) -> int:
    args = _parse(argv)
    suite_class = _load_suite(args)
    names = unittest.TestLoader().getTestCaseNames(suite_class)
    if args.patterns:
        names = [n for n in names if any(p in n or fnmatch.fnmatch(n, p) for p in args.patterns)]
    suite = unittest.TestSuite(suite_class(name) for name in names)
    runner = unittest.TextTestRunner(resultclass=_Outcomes, verbosity=1, stream=sys.stderr)
    start = time.monotonic()
    result = runner.run(suite)
    outcomes = result.outcomes
    counts = {kind: sum(o.startswith(kind) for o in outcomes.values()) for kind in ("passed", "failed", "skipped")}
    mode = "gloo itself" if args.reference else f"as {args.name}" + (f", engine {args.engine}" if args.engine else "")
    print(f"torch's DistributedTest ({mode}, world {args.world}): {counts['passed']} passed, "
          f"{counts['failed']} failed, {counts['skipped']} skipped in {time.monotonic() - start:.0f} s")
    for name, outcome in sorted(outcomes.items()):
        if outcome.startswith("failed"):
            print(f"  {name}: {outcome}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(outcomes, f, indent=1, sort_keys=True)
    return 0 if result.wasSuccessful() else 1


if __name__ == "__main__":
    sys.exit(main())
