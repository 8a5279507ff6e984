"""distcomm.multiprocessing.spawn, called as torch.multiprocessing.spawn is.

Tiers: each test spawns processes; the fast tier (``pytest -m "not slow"``) keeps a successful
spawn, the rest is slow.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import time

import pytest

import distcomm.multiprocessing as mp
from launcher_scripts import spawn_fns
from launcher_scripts.support import SCRIPTS, assert_no_leftovers


def test_runs_fn_with_index_and_args(tmp_path):
    assert mp.spawn(spawn_fns.write_index, args=(str(tmp_path), "tag"), nprocs=3) is None
    contents = {name: (tmp_path / name).read_text().split() for name in os.listdir(tmp_path)}
    assert sorted(contents) == ["0", "1", "2"]
    assert {c[0] for c in contents.values()} == {"tag"}
    assert len({c[1] for c in contents.values()}) == 3  # three processes


@pytest.mark.slow
def test_child_exception_is_reraised_with_index_and_traceback(tmp_path):
    with pytest.raises(mp.ProcessRaisedException) as info:
        mp.spawn(spawn_fns.fail, args=("raise", 1, str(tmp_path)), nprocs=3)
    err = info.value
    assert err.error_index == 1 and err.error_pid > 0
    text = str(err)
    assert "-- Process 1 terminated with the following error:" in text
    assert "Traceback (most recent call last):" in text and "ValueError: bad child 1" in text
    assert 'raise ValueError(f"bad child {i}")' in text
    assert_no_leftovers(tmp_path, 2)  # the other children were stopped


@pytest.mark.slow
def test_exit_code_and_signal(tmp_path):
    with pytest.raises(mp.ProcessExitedException) as info:
        mp.spawn(spawn_fns.fail, args=("exit", 0, str(tmp_path)), nprocs=2)
    assert (info.value.error_index, info.value.exit_code, info.value.signal_name) == (0, 3, None)
    assert str(info.value) == "process 0 terminated with exit code 3"
    with pytest.raises(mp.ProcessExitedException) as info:
        mp.spawn(spawn_fns.fail, args=("kill", 1, str(tmp_path)), nprocs=2)
    assert (info.value.error_index, info.value.exit_code, info.value.signal_name) == (1, -9, "SIGKILL")
    assert str(info.value) == "process 1 terminated with signal SIGKILL"
    assert_no_leftovers(tmp_path, 2)


@pytest.mark.slow
def test_join_false_returns_a_context():
    ctx = mp.spawn(spawn_fns.sleep_then_return, args=(0.5,), nprocs=2, join=False)
    assert isinstance(ctx, mp.ProcessContext)
    assert len(ctx.processes) == 2 and ctx.pids() == [p.pid for p in ctx.processes]
    assert ctx.join(timeout=0.01) is False
    deadline = time.monotonic() + 30
    while not ctx.join(timeout=1):
        assert time.monotonic() < deadline
    assert ctx.join() is True  # idempotent once done


def test_exceptions_pickle():
    e = mp.ProcessExitedException("m", 2, 123, -9, "SIGKILL")
    back = pickle.loads(pickle.dumps(e))
    assert (back.msg, back.error_index, back.error_pid, back.exit_code, back.signal_name) == ("m", 2, 123, -9, "SIGKILL")
    r = pickle.loads(pickle.dumps(mp.ProcessRaisedException("t", 1, 5)))
    assert isinstance(r, mp.ProcessException) and (r.error_index, r.error_pid) == (1, 5)


@pytest.mark.slow
def test_usable_without_torch_and_reexports_multiprocessing(tmp_path):
    code = (
        "import sys; sys.modules['torch'] = None\n"  # any import of torch would fail
        "import distcomm.multiprocessing as mp\n"
        "from launcher_scripts import spawn_fns\n"
        "if __name__ == '__main__':\n"
        f"    mp.spawn(spawn_fns.write_index, args=({str(tmp_path)!r}, 'nt'), nprocs=2)\n"
        "    assert mp.get_context is not None and mp.Queue is not None\n"
        "    print('ok', sorted(__import__('os').listdir({!r})))\n".format(str(tmp_path))
    )
    script = tmp_path / "main.py"
    script.write_text(code)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(SCRIPTS), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0, r.stderr
    assert "ok ['0', '1', 'main.py']" in r.stdout
