"""distcomm-run's and distcomm.launch's console and log-file behaviour against torchrun's own.

Each case runs real workers under both launchers (torch's when torch is installed) with the same
options, and compares what a log parser would see: the worker lines on stdout and stderr, and the
log files under --log-dir. Every launcher run has the hard timeout of ``run_launcher``.
"""

from __future__ import annotations

import os
import sys
import textwrap

import pytest

from launcher_scripts.support import SCRIPTS, TIMEOUT, launcher_env, run_launcher

LEGACY_WORKER = os.path.join(SCRIPTS, "legacy_worker.py")

# A worker that needs neither distcomm nor torch, so both launchers run the very same program.
PRINTER = textwrap.dedent(
    """
    import os
    r, lr = os.environ["RANK"], os.environ["LOCAL_RANK"]
    # one write() per line: torchrun's workers share its stdout, and a line written in pieces
    # (print under PYTHONUNBUFFERED writes the text and the newline apart) can mix with another's
    for i in range(3):
        os.write(1, f"out {r} {lr} line {i}\\n".encode())
    os.write(2, f"err {r} {lr}\\n".encode())
    """
)


def _printer(tmp_path) -> str:
    path = tmp_path / "printer.py"
    path.write_text(PRINTER)
    return str(path)


def _env(tmp_path, **extra):
    # torchrun's default output (no rank prefix); OMP_NUM_THREADS set so no launcher notice
    return launcher_env(tmp_path, PET_RANK_PREFIX="0", OMP_NUM_THREADS="1", **extra)


def _worker_lines(text: str) -> list[str]:
    """The lines the printer wrote (launcher notices and torch's logging left out), sorted."""
    return sorted(line for line in text.splitlines() if "out " in line or "err " in line)


def _launch(module, args, tmp_path, **env):
    r = run_launcher(args, module=module, env=_env(tmp_path, **env), timeout=TIMEOUT)
    assert r.returncode == 0, r.stderr
    return r


def _log_files(log_dir) -> dict[str, str]:
    """{"attempt_0/<local_rank>/<stream>.log": text} under the single <run_id>_<random> directory."""
    runs = os.listdir(log_dir)
    assert len(runs) <= 1, runs
    if not runs:
        return {}
    root = os.path.join(log_dir, runs[0])
    found = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            if name.endswith(".log") and os.path.getsize(os.path.join(dirpath, name)):
                rel = os.path.relpath(os.path.join(dirpath, name), root)
                found[rel] = open(os.path.join(dirpath, name)).read()
    return found


CASES = {
    "default": [],
    "tee_all": ["--tee", "3"],
    "tee_short_per_rank": ["-t", "0:1,1:2"],
    "tee_role": ["--role", "trainer", "--tee", "1"],
    "filter": ["--local-ranks-filter", "1"],
    "filter_tee": ["--local_ranks_filter=0", "--tee", "3"],
    "redirect_stdout": ["-r", "1"],
    "redirect_tee": ["--redirects", "3", "--tee", "0:3"],
}


@pytest.fixture(scope="module")
def torch_available():
    pytest.importorskip("torch.distributed.run")


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_console_and_files_match_torchrun(case, tmp_path, torch_available):
    script = _printer(tmp_path)
    seen = {}
    for module in ("distcomm.run", "torch.distributed.run"):
        log_dir = tmp_path / module
        args = ["--standalone", "--nproc-per-node", "2", "--log-dir", log_dir,
                *CASES[case], script]
        r = _launch(module, args, tmp_path)
        files = _log_files(log_dir) if log_dir.exists() else {}
        seen[module] = (_worker_lines(r.stdout), _worker_lines(r.stderr), files)
    assert seen["distcomm.run"] == seen["torch.distributed.run"]


@pytest.mark.slow
def test_prefix_template_from_torch_variable_and_option(tmp_path, torch_available):
    script = _printer(tmp_path)
    template = "<${role_name}|${rank}|${local_rank}|${unknown}> "
    args = ["--standalone", "--nproc-per-node", "2", "--tee", "3", "--log-dir", tmp_path / "logs", script]
    ours = _launch("distcomm.run", args, tmp_path, TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE=template)
    torchs = _launch("torch.distributed.run", args, tmp_path, TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE=template)
    assert _worker_lines(ours.stdout) == _worker_lines(torchs.stdout)
    assert "<default|1|1|${unknown}> out 1 1 line 0" in ours.stdout
    # distcomm-run also takes it as an option (torchrun only reads the variable)
    option = _launch("distcomm.run", ["--log-line-prefix-template", template, *args], tmp_path)
    assert _worker_lines(option.stdout) == _worker_lines(ours.stdout)


@pytest.mark.slow
def test_rank_prefix_is_opt_in(tmp_path):
    script = _printer(tmp_path)
    plain = _launch("distcomm.run", ["--standalone", "--nproc-per-node", "2", script], tmp_path)
    assert "out 1 1 line 2" in plain.stdout.splitlines() and "[rank" not in plain.stdout
    tagged = _launch("distcomm.run", ["--standalone", "--nproc-per-node", "2", "--rank-prefix", script], tmp_path)
    assert "[rank1]: out 1 1 line 2" in tagged.stdout.splitlines()
    assert "[rank0]: err 0 0" in tagged.stderr.splitlines()


@pytest.mark.slow
@pytest.mark.parametrize("use_env", [[], ["--use-env"], ["--use_env"]])
def test_legacy_launch_matches_torch(use_env, tmp_path, torch_available):
    args = ["--nproc-per-node", "2", "--master-port", "0", *use_env, LEGACY_WORKER, "x"]
    got = {}
    for module in ("distcomm.launch", "torch.distributed.launch"):
        r = _launch(module, args, tmp_path)
        lines = sorted(line.split(" MASTER=")[0] + " " + line.split(" rest=")[1]
                       for line in r.stdout.splitlines() if "local_rank_arg" in line)
        warning = [line for line in r.stderr.splitlines() if "FutureWarning" in line]
        got[module] = (lines, len(warning))
        assert len(warning) == 1 and "launch is deprecated" in warning[0]
        assert "Note that --use-env is set by default in" in r.stderr
    assert got["distcomm.launch"] == got["torch.distributed.launch"]
    if not use_env:
        assert "argv=['--local-rank=1', 'x']" in got["distcomm.launch"][0][1]


def test_legacy_no_python_needs_use_env(tmp_path):
    r = run_launcher(["--nproc-per-node", "1", "--no-python", "/bin/true"], module="distcomm.launch",
                     env=_env(tmp_path))
    assert r.returncode == 1
    assert "ValueError: When using the '--no-python' flag, you must also set the '--use-env' flag." in r.stderr


def test_legacy_main_is_deprecated_like_torch():
    import warnings

    from distcomm import launch

    assert "distcomm.launch is deprecated" in launch.main.__deprecated__
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(SystemExit) as stop:
            launch.main(["--help"])
    assert stop.value.code == 0
    assert [w.category for w in caught] == [FutureWarning]
    assert caught[0].filename == __file__  # reported at the caller's line, as typing_extensions does
