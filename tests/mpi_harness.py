"""Running a script under ``mpiexec`` with a hard deadline (the MPI tests' harness).

``run_mpiexec`` starts ``mpiexec -n N python script args`` in a session of its own, with
distcomm's ``src`` on PYTHONPATH and torch's variables (RANK, WORLD_SIZE, MASTER_ADDR, ...) removed,
so what the ranks learn they learn from mpiexec. Past the deadline the whole session (mpiexec, its
proxy and every rank) is killed and the test fails with what the ranks printed.
``skip_reason()`` says why the MPI tests cannot run here (no mpi4py, no mpiexec), or None.

``shm_listing``: the job runs in a mount namespace of its own with a small private tmpfs on
/dev/shm (root only; ``private_shm_unavailable()`` says why not), and what is left there when
mpiexec has ended is written to that file. A rank killed with SIGKILL leaves MPICH's own
segments behind (MPICH unlinks them at finalize); the namespace's tmpfs takes them with it, so a
fault test leaves nothing on the machine, and can check that nothing of distcomm's was left.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

from harness import SessionTimeout, run_in_session

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


def private_shm_unavailable() -> str | None:
    """Why a job cannot get a private /dev/shm here (a skip reason), or None."""
    if os.name != "posix" or os.geteuid() != 0:
        return "needs root (a mount namespace with a tmpfs on /dev/shm)"
    if shutil.which("unshare") is None:
        return "needs the 'unshare' command (util-linux)"
    return None


# in a new mount namespace: a 64 MiB tmpfs on /dev/shm, the job, then what it left there
_PRIVATE_SHM = ('mount --make-rprivate / && mount -t tmpfs -o size=64m,mode=1777 tmpfs /dev/shm && '
                '"$@"; rc=$?; ls -A /dev/shm > "$LISTING"; exit $rc')


def run_mpiexec(nprocs: int, script: str, args: list[str] = (), timeout: float = 120.0,
                env: dict[str, str] | None = None, shm_listing: str | None = None) -> subprocess.CompletedProcess:
    """Run ``script`` (a file in tests/mpi_scripts) on ``nprocs`` ranks; kill them all at ``timeout``.
    ``shm_listing``: run it with a private /dev/shm, and list what it left there into that file."""
    child_env = {k: v for k, v in os.environ.items() if k not in TORCH_VARS and not k.startswith(("PMI_", "OMPI_", "SLURM_"))}
    child_env["PYTHONPATH"] = SRC + os.pathsep + str(Path(__file__).resolve().parent) + (
        os.pathsep + child_env["PYTHONPATH"] if child_env.get("PYTHONPATH") else "")
    child_env["OMP_NUM_THREADS"] = "1"
    child_env.update(env or {})
    cmd = [shutil.which("mpiexec"), "-n", str(nprocs), sys.executable, "-u", str(SCRIPTS / script), *map(str, args)]
    if shm_listing is not None:
        child_env["LISTING"] = shm_listing
        cmd = ["unshare", "--mount", "--", "sh", "-c", _PRIVATE_SHM, "sh", *cmd]
    try:
        return run_in_session(cmd, timeout, env=child_env)
    except SessionTimeout as exc:
        raise MpiexecTimeout(f"mpiexec -n {nprocs} {script} killed after its {timeout}s deadline\n"
                             f"stdout:\n{exc.stdout[-4000:]}\nstderr:\n{exc.stderr[-4000:]}") from None
