"""What MPI launchers and Slurm tell a process, read from an environment mapping (no I/O).

``init_process_group()``'s env:// rendezvous reads torch's variables (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT). A job started by ``mpiexec`` or ``srun`` has none of them; it has its
launcher's:

=========================  ===================  ==========================  ==============================
launcher                   rank                 size                        local rank
=========================  ===================  ==========================  ==============================
MPICH hydra (mpiexec)      PMI_RANK             PMI_SIZE                    MPI_LOCALRANKID (MPI_LOCALNRANKS)
Open MPI (mpirun)          OMPI_COMM_WORLD_RANK OMPI_COMM_WORLD_SIZE        OMPI_COMM_WORLD_LOCAL_RANK (_SIZE)
Slurm (srun)               SLURM_PROCID         SLURM_STEP_NUM_TASKS, or    SLURM_LOCALID
                                                SLURM_NTASKS
=========================  ===================  ==========================  ==============================

``detect(env, mpi_importable)`` gives the rank, the size, the local rank and how the ranks agree on
the store's address, checked in this order:

1. MASTER_ADDR and MASTER_PORT, when both are set (as under torchrun);
2. through MPI, when an MPI launcher started the process and mpi4py imports: rank 0 starts the
   TCPStore on MASTER_PORT (or a free port) and broadcasts ``host:port`` (rendezvous.py);
3. under Slurm, the first host of the step's node list (SLURM_STEP_NODELIST, else
   SLURM_JOB_NODELIST, in Slurm's compressed form ``node[01-03,07],gpu5``) and MASTER_PORT, else
   ``slurm_port(SLURM_JOB_ID)``.

Torch's variables win wherever they are set: ``detect`` is consulted only for what they leave out.
``slurm_node_defaults`` gives ``distcomm-run`` its node count, node rank and master inside a Slurm
allocation (one launcher per node: ``srun --ntasks-per-node=1 distcomm-run ...``).
"""

from __future__ import annotations

import re
from typing import Mapping, NamedTuple

# Ports derived from a Slurm job id: 10000 + id mod 20000 stays below Linux's ephemeral ports
# (32768 and up), is the same on every node of a job, and differs between jobs sharing a node
# (unless their ids are 20000 apart).
SLURM_PORT_BASE = 10000
SLURM_PORT_SPAN = 20000

VIA_ADDRESS = "address"  # master_addr:master_port is known
VIA_MPI = "mpi"  # rank 0 picks the port and broadcasts it over MPI
VIA_NONE = "none"  # nothing says where the store is


class LaunchEnvError(ValueError):
    """A launcher's variable is there but not usable (not an integer, rank out of range, a bad
    node list)."""


class LaunchEnv(NamedTuple):
    launcher: str  # "mpich", "openmpi" or "slurm"
    rank: int
    world_size: int
    local_rank: int | None
    local_world_size: int | None
    store_via: str  # VIA_ADDRESS, VIA_MPI or VIA_NONE
    master_addr: str | None
    master_port: int | None  # None with VIA_MPI: a free port


def _int(env: Mapping[str, str], name: str) -> int | None:
    value = env.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise LaunchEnvError(f"environment variable {name}={value!r} is not an integer") from None


def _first(env: Mapping[str, str], *names: str) -> int | None:
    for name in names:
        value = _int(env, name)
        if value is not None:
            return value
    return None


def parse_nodelist(text: str) -> list[str]:
    """Slurm's compressed host list, expanded in order: ``node[01-03,07],gpu5`` -> node01, node02,
    node03, node07, gpu5 (zero padding kept; several bracket groups in one name multiply out)."""
    hosts: list[str] = []
    for item in _split_top(text.strip()):
        if item:
            hosts.extend(_expand(item, text))
    if not hosts:
        raise LaunchEnvError(f"the Slurm node list {text!r} names no host")
    return hosts


def _split_top(text: str) -> list[str]:
    """Split on commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise LaunchEnvError(f"unbalanced ']' in the Slurm node list {text!r}")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise LaunchEnvError(f"unbalanced '[' in the Slurm node list {text!r}")
    parts.append(text[start:])
    return parts


_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def _expand(item: str, whole: str) -> list[str]:
    open_at = item.find("[")
    if open_at < 0:
        return [item]
    close_at = item.index("]", open_at)
    prefix, body, rest = item[:open_at], item[open_at + 1 : close_at], item[close_at + 1 :]
    tails = _expand(rest, whole) if rest else [""]
    out = []
    for part in body.split(","):
        m = _RANGE.match(part.strip())
        if not m:
            raise LaunchEnvError(f"bad range {part!r} in the Slurm node list {whole!r}")
        lo_text, hi_text = m.group(1), m.group(2) or m.group(1)
        lo, hi = int(lo_text), int(hi_text)
        if hi < lo:
            raise LaunchEnvError(f"descending range {part!r} in the Slurm node list {whole!r}")
        width = len(lo_text) if lo_text.startswith("0") else 0
        for n in range(lo, hi + 1):
            out.extend(f"{prefix}{n:0{width}d}{tail}" for tail in tails)
    return out


def slurm_port(job_id: int) -> int:
    """The store's port for Slurm job ``job_id`` when MASTER_PORT is not set."""
    return SLURM_PORT_BASE + job_id % SLURM_PORT_SPAN


def _slurm_nodelist(env: Mapping[str, str]) -> str | None:
    return env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")


def _slurm_address(env: Mapping[str, str]) -> tuple[str, int] | None:
    """(first host of the node list, MASTER_PORT or the job's derived port), or None."""
    nodelist = _slurm_nodelist(env)
    if not nodelist:
        return None
    port = _int(env, "MASTER_PORT")
    if port is None:
        job = _first(env, "SLURM_JOB_ID", "SLURM_JOBID")
        if job is None:
            return None
        port = slurm_port(job)
    return parse_nodelist(nodelist)[0], port


def detect(env: Mapping[str, str], mpi_importable: bool = False) -> LaunchEnv | None:
    """The launcher that started this process and what it says, or None when no launcher's
    variables are set (see the module docstring for the order)."""
    if env.get("PMI_RANK") and env.get("PMI_SIZE"):
        launcher, rank, size = "mpich", _int(env, "PMI_RANK"), _int(env, "PMI_SIZE")
        local, local_size = _int(env, "MPI_LOCALRANKID"), _int(env, "MPI_LOCALNRANKS")
    elif env.get("OMPI_COMM_WORLD_RANK") and env.get("OMPI_COMM_WORLD_SIZE"):
        launcher, rank, size = "openmpi", _int(env, "OMPI_COMM_WORLD_RANK"), _int(env, "OMPI_COMM_WORLD_SIZE")
        local, local_size = _int(env, "OMPI_COMM_WORLD_LOCAL_RANK"), _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE")
    elif env.get("SLURM_PROCID") and (env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS")):
        launcher, rank, size = "slurm", _int(env, "SLURM_PROCID"), _first(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
        local, local_size = _int(env, "SLURM_LOCALID"), None
    else:
        return None
    if size <= 0 or not 0 <= rank < size:
        raise LaunchEnvError(f"{launcher}: rank {rank} is outside 0..{size - 1} (size {size})")
    addr, port = env.get("MASTER_ADDR") or None, _int(env, "MASTER_PORT")
    if addr and port is not None:
        via = VIA_ADDRESS
    elif launcher != "slurm" and mpi_importable:
        via = VIA_MPI
        addr = addr or ("127.0.0.1" if local_size is not None and local_size == size else None)
    else:
        found = _slurm_address(env)
        if found is not None:
            via, addr, port = VIA_ADDRESS, addr or found[0], found[1]
        else:
            via = VIA_NONE
    return LaunchEnv(launcher, rank, size, local, local_size, via, addr, port)


class SlurmNodes(NamedTuple):
    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int | None  # None: no SLURM_JOB_ID to derive it from


def slurm_node_defaults(env: Mapping[str, str]) -> SlurmNodes | None:
    """Inside a Slurm allocation: the number of nodes (SLURM_STEP_NUM_NODES, else
    SLURM_JOB_NUM_NODES / SLURM_NNODES), this node's rank (SLURM_NODEID) and the master (the first
    host of the node list; the port from ``slurm_port``); None outside Slurm."""
    if not (env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")):
        return None
    nodelist = _slurm_nodelist(env)
    nnodes = _first(env, "SLURM_STEP_NUM_NODES", "SLURM_JOB_NUM_NODES", "SLURM_NNODES")
    node_rank = _int(env, "SLURM_NODEID")
    if not nodelist or nnodes is None or node_rank is None:
        return None
    hosts = parse_nodelist(nodelist)
    job = _first(env, "SLURM_JOB_ID", "SLURM_JOBID")
    return SlurmNodes(nnodes, node_rank, hosts[0], None if job is None else slurm_port(job))
