"""Running a script under ``mpiexec`` with a hard deadline (the MPI tests' harness).

``run_mpiexec`` starts ``mpiexec -n N python script args`` in a session of its own, with
distcomm's ``src`` on PYTHONPATH and torch's variables (RANK, WORLD_SIZE, MASTER_ADDR, ...) removed,
so what the ranks learn they learn from mpiexec. Past the deadline the whole session (mpiexec, its
proxy and every rank) is killed and the test fails with what the ranks printed.
``skip_reason()`` says why the MPI tests cannot run here (no mpi4py, no mpiexec), or None.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

SRC = str(Path(__file__).resolve().parent.parent / "src")
SCRIPTS = Path(__file__).resolve().parent / "mpi_scripts"
TORCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
              "GROUP_RANK", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE")


def skip_reason() -> str | None:
    if importlib.util.find_spec("mpi4py") is None:
        return "mpi4py is not installed (pip install 'distcomm[mpi]')"
    if shutil.which("mpiexec") is None:
        return "mpiexec is not on PATH (pip install mpich, or a system MPI)"
    return None


class MpiexecTimeout(AssertionError):
    pass


def run_mpiexec(nprocs: int, script: str, args: list[str] = (), timeout: float = 120.0,
                env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``script`` (a file in tests/mpi_scripts) on ``nprocs`` ranks; kill them all at ``timeout``."""
    child_env = {k: v for k, v in os.environ.items() if k not in TORCH_VARS and not k.startswith(("PMI_", "OMPI_", "SLURM_"))}
    child_env["PYTHONPATH"] = SRC + os.pathsep + str(Path(__file__).resolve().parent) + (
        os.pathsep + child_env["PYTHONPATH"] if child_env.get("PYTHONPATH") else "")
    child_env["OMP_NUM_THREADS"] = "1"
    child_env.update(env or {})
    cmd = [shutil.which("mpiexec"), "-n", str(nprocs), sys.executable, "-u", str(SCRIPTS / script), *map(str, args)]
    proc = subprocess.Popen(cmd, env=child_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise MpiexecTimeout(f"mpiexec -n {nprocs} {script} killed after its {timeout}s deadline\n"
                             f"stdout:\n{out[-4000:]}\nstderr:\n{err[-4000:]}") from None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
