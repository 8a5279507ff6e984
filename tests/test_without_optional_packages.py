"""distcomm where an optional package is not installed: a numpy user's job launched with
distcomm-run, and the benchmark, with no torch; backend "mpi" with no mpi4py.

Every process these tests start (the launcher, its workers, the benchmark's ranks) runs a
``sitecustomize`` that sets ``sys.modules[name] = None`` for each hidden package: ``import name``
then raises ModuleNotFoundError and ``importlib.util.find_spec(name)`` returns None, as when it is
absent. The rest of the suite imports torch everywhere (its oracle), so without this file a stray
``import torch`` on a numpy path would break only the users who do not have it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from harness import SessionTimeout, run_in_session

DEADLINE = 90  # seconds for each command, its whole process group killed past it


WORKER = '''
import json
import sys

import numpy as np

import distcomm as dist

assert sys.modules["torch"] is None  # the sitecustomize ran here too
dist.init_process_group("gloo")  # env://, from distcomm-run
rank, world = dist.get_rank(), dist.get_world_size()
out = {}

a = np.arange(7, dtype=np.float32) * (rank + 1)
dist.all_reduce(a)
out["all_reduce_sum"] = a.tolist()
b = np.array([rank, -rank, 3 * rank], dtype=np.int64)
dist.all_reduce(b, op=dist.ReduceOp.MAX)
out["all_reduce_max"] = b.tolist()

c = np.full(5, rank, dtype=np.float64)
dist.broadcast(c, src=world - 1)
out["broadcast"] = c.tolist()

gathered = [np.zeros(3, dtype=np.int32) for _ in range(world)]
dist.all_gather(gathered, np.arange(3, dtype=np.int32) + 10 * rank)
out["all_gather"] = [g.tolist() for g in gathered]

rs = np.zeros(2, dtype=np.float32)
dist.reduce_scatter(rs, [np.full(2, rank + 10 * q, dtype=np.float32) for q in range(world)])
out["reduce_scatter"] = rs.tolist()

a2a = [np.zeros(1, dtype=np.int64) for _ in range(world)]
dist.all_to_all(a2a, [np.array([100 * rank + q], dtype=np.int64) for q in range(world)])
out["all_to_all"] = [x.tolist() for x in a2a]

ring = np.zeros(4, dtype=np.float32)
recv = dist.irecv(ring, src=(rank - 1) % world)
dist.send(np.full(4, rank, dtype=np.float32), dst=(rank + 1) % world)
recv.wait()
out["ring"] = ring.tolist()

objects = [None] * world
dist.all_gather_object(objects, {"rank": rank, "name": f"r{rank}"})
out["all_gather_object"] = objects

evens = dist.new_group([r for r in range(world) if r % 2 == 0])
if rank % 2 == 0:
    e = np.ones(3, dtype=np.float32)
    dist.all_reduce(e, group=evens)
    out["evens"] = e.tolist()

tcp = dist.new_group(backend="tcp")
t = np.full(1000, rank + 1, dtype=np.float64)
dist.all_reduce(t, group=tcp, async_op=True).wait()
out["tcp_sum"] = float(t[0])

dist.barrier()
print("RESULT " + json.dumps({"rank": rank, "out": out}), flush=True)
dist.destroy_process_group()
'''


def _hiding(tmp_path, *packages: str) -> dict[str, str]:
    """The environment of a process that cannot import ``packages`` (see the module docstring)."""
    site = tmp_path / "hiding_site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(
        "import sys\n" + "".join(f"sys.modules[{p!r}] = None  # as if it were not installed\n" for p in packages))
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("DISTCOMM_", "PET_", "TORCHELASTIC_"))
           and k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join([str(site)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    env["OMP_NUM_THREADS"] = "1"
    return env


@pytest.fixture
def no_torch_env(tmp_path):
    return _hiding(tmp_path, "torch")


def _run(args, env, cwd) -> subprocess.CompletedProcess:
    """``args`` in a session of its own, killed whole (launcher and workers) past DEADLINE."""
    try:
        return run_in_session(args, DEADLINE, env=env, cwd=cwd)
    except SessionTimeout as exc:
        pytest.fail(f"{exc}:\n{exc.stdout[-2000:]}\n{exc.stderr[-3000:]}")


def test_the_sitecustomize_hides_torch(no_torch_env, tmp_path):
    probe = ("import importlib.util, sys\n"
             "assert importlib.util.find_spec('torch') is None\n"
             "try:\n    import torch\nexcept ImportError:\n    print('no torch')\n")
    r = _run([sys.executable, "-c", probe], no_torch_env, tmp_path)
    assert r.returncode == 0 and r.stdout.strip() == "no torch", r.stderr


def _expected(rank: int, world: int) -> dict:
    """What WORKER's rank ``rank`` must print, computed here with numpy."""
    out = {
        "all_reduce_sum": (np.arange(7, dtype=np.float32) * sum(q + 1 for q in range(world))).tolist(),
        "all_reduce_max": [world - 1, 0, 3 * (world - 1)],
        "broadcast": [float(world - 1)] * 5,
        "all_gather": [(np.arange(3) + 10 * q).tolist() for q in range(world)],
        "reduce_scatter": [float(sum(q + 10 * rank for q in range(world)))] * 2,
        "all_to_all": [[100 * q + rank] for q in range(world)],
        "ring": [float((rank - 1) % world)] * 4,
        "all_gather_object": [{"rank": q, "name": f"r{q}"} for q in range(world)],
        "tcp_sum": float(sum(q + 1 for q in range(world))),
    }
    if rank % 2 == 0:
        out["evens"] = [float(len(range(0, world, 2)))] * 3
    return out


@pytest.mark.parametrize("world", [3])
def test_a_numpy_job_under_distcomm_run(no_torch_env, tmp_path, world):
    script = tmp_path / "numpy_worker.py"
    script.write_text(WORKER)
    r = _run([sys.executable, "-m", "distcomm.run", "--standalone", "--nproc-per-node", str(world), str(script)],
             no_torch_env, tmp_path)
    assert r.returncode == 0, f"{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    results = {}
    for line in r.stdout.splitlines():
        if "RESULT " in line:
            got = json.loads(line.split("RESULT ", 1)[1])
            results[got["rank"]] = got["out"]
    assert sorted(results) == list(range(world)), r.stdout
    for rank in range(world):
        assert results[rank] == _expected(rank, world), f"rank {rank}"


def test_the_benchmark_runs_without_torch(no_torch_env, tmp_path):
    r = _run([sys.executable, "-m", "distcomm.bench", "--world", "2", "-o", "all_reduce,all_gather,broadcast",
              "-b", "8", "-e", "1K", "-f", "16", "--budget", "0.02"], no_torch_env, tmp_path)
    assert r.returncode == 0, f"{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    assert "wrong elements: 0 OK" in r.stdout, r.stdout
    assert "Traceback" not in r.stderr, r.stderr


def test_backend_mpi_without_mpi4py_says_what_to_install(tmp_path):
    probe = ("import distcomm as dist\n"
             "try:\n    dist.init_process_group('mpi', init_method='tcp://127.0.0.1:1', rank=0, world_size=1)\n"
             "except RuntimeError as exc:\n    print(type(exc).__name__, exc)\n")
    r = _run([sys.executable, "-c", probe], _hiding(tmp_path, "mpi4py"), tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("DistBackendError backend 'mpi' needs mpi4py"), r.stdout
    assert "pip install 'distcomm[mpi]'" in r.stdout, r.stdout
