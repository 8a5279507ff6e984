"""``from distcomm.elastic.multiprocessing.errors import record``: torch's error file, and the
launcher's failure summary built from it (also from torch's own ``@record``)."""

from __future__ import annotations

import json
import textwrap

import pytest

from launcher_scripts.support import launcher_env, run_launcher

from distcomm.elastic.multiprocessing.errors import ErrorHandler, get_error_handler, record


def _boom():
    raise ValueError("bad value 42")


def test_record_writes_torchs_error_file(tmp_path, monkeypatch):
    ours, theirs = tmp_path / "ours.json", tmp_path / "torch.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(ours))
    with pytest.raises(ValueError):
        record(_boom)()
    got = json.loads(ours.read_text())
    assert got["message"]["message"] == "ValueError: bad value 42"
    assert got["message"]["extraInfo"]["py_callstack"].rstrip().endswith("ValueError: bad value 42")
    assert "in _boom" in got["message"]["extraInfo"]["py_callstack"]
    int(got["message"]["extraInfo"]["timestamp"])

    torch_errors = pytest.importorskip("torch.distributed.elastic.multiprocessing.errors")
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(theirs))
    with pytest.raises(ValueError):
        torch_errors.record(_boom)()
    expected = json.loads(theirs.read_text())
    assert set(got) == set(expected) and set(got["message"]) == set(expected["message"])
    assert set(got["message"]["extraInfo"]) == set(expected["message"]["extraInfo"])
    assert got["message"]["message"] == expected["message"]["message"]


def test_record_passes_results_and_exit_codes(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "e.json"))
    assert record(lambda x: x + 1)(1) == 2

    @record
    def exits(code):
        raise SystemExit(code)

    assert exits(0) is None  # a clean sys.exit(0) is a success
    with pytest.raises(SystemExit):
        exits(3)
    assert not (tmp_path / "e.json").exists()  # SystemExit is not an error to record
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE")
    with pytest.raises(ValueError):
        record(_boom)()  # no file to write: just re-raised
    assert isinstance(get_error_handler(), ErrorHandler)


# The worker hides its stderr before failing, so the traceback in the summary can only come from
# the error file that @record wrote.
WORKER = textwrap.dedent(
    """
    import os, sys
    from {module} import record

    def helper_that_fails():
        raise RuntimeError("rank " + os.environ["RANK"] + " failed on purpose")

    @record
    def main():
        if os.environ["RANK"] == "1":
            sys.stderr = open(os.devnull, "w")
            os.dup2(sys.stderr.fileno(), 2)
            helper_that_fails()

    main()
    """
)


@pytest.mark.parametrize("module", ["distcomm.elastic.multiprocessing.errors",
                                    "torch.distributed.elastic.multiprocessing.errors"])
@pytest.mark.slow
def test_launcher_summary_uses_the_error_file(module, tmp_path):
    if module.startswith("torch"):
        pytest.importorskip(module)
    script = tmp_path / "worker.py"
    script.write_text(WORKER.format(module=module))
    r = run_launcher(["--standalone", "--nproc-per-node", "2", "--shutdown-timeout", "5", script],
                     env=launcher_env(tmp_path, OMP_NUM_THREADS="1"))
    assert r.returncode == 1
    summary = r.stderr[r.stderr.index("Root cause"):]
    assert "in helper_that_fails" in summary
    assert "RuntimeError: rank 1 failed on purpose" in summary
