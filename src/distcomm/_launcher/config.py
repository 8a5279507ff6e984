"""LaunchConfig: everything one node's launcher needs, and the parsers of torchrun's option values.

The argument parser lives in ``distcomm.run``; this module turns its strings into checked values
with error texts that say what was expected, so ``distcomm.launch`` and tests can build a config
without going through argparse.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Mapping, NamedTuple, Sequence

from .. import launcher_env

DEFAULT_MASTER_PORT = 29500


class LaunchError(RuntimeError):
    """The launcher cannot start (bad options, port in use, rendezvous failed): exit 1 with this text."""


# Which of a worker's streams go to a log file: torchrun's Std values.
STD_NONE, STD_OUT, STD_ERR, STD_ALL = 0, 1, 2, 3


def parse_nproc_per_node(value: str | int) -> int:
    """An int, or ``auto``/``cpu`` = the CPUs this process may run on (torch: cpu count without GPUs)."""
    text = str(value).strip()
    if text in ("auto", "cpu"):
        try:
            return len(os.sched_getaffinity(0))
        except AttributeError:  # not Linux
            return os.cpu_count() or 1
    if text in ("gpu", "xpu"):
        raise LaunchError(f"--nproc-per-node={text}: distcomm runs on CPU only; use an int, 'auto' or 'cpu'")
    try:
        n = int(text)
    except ValueError:
        raise LaunchError(
            f"--nproc-per-node={text!r}: expected a positive int, 'auto' or 'cpu'"
        ) from None
    if n < 1:
        raise LaunchError(f"--nproc-per-node={n}: expected at least 1 worker per node")
    return n


def parse_nnodes(value: str | int) -> int:
    """``N`` or ``N:N``. Elastic ranges (min < max) are not supported: the group size is fixed."""
    text = str(value).strip()
    lo, sep, hi = text.partition(":")
    try:
        low = int(lo)
        high = int(hi) if sep else low
    except ValueError:
        raise LaunchError(f"--nnodes={text!r}: expected an int or MIN:MAX") from None
    if low != high:
        raise LaunchError(
            f"--nnodes={text}: elastic node ranges are not supported; give a fixed count such as --nnodes={high}"
        )
    if low < 1:
        raise LaunchError(f"--nnodes={text}: expected at least 1 node")
    return low


def parse_std_spec(value: str | None, nproc: int, option: str) -> dict[int, int]:
    """torchrun's --redirects/--tee value: ``3`` (every local rank) or ``0:1,1:2`` (per local rank)."""
    if value is None or str(value).strip() == "":
        return {}
    text = str(value).strip()

    def std(token: str) -> int:
        try:
            v = int(token)
        except ValueError:
            v = -1
        if v not in (STD_NONE, STD_OUT, STD_ERR, STD_ALL):
            raise LaunchError(
                f"{option}={text!r}: each value must be 0 (none), 1 (stdout), 2 (stderr) or 3 (both)"
            )
        return v

    if ":" not in text:
        v = std(text)
        return {lr: v for lr in range(nproc)}
    result = {}
    for part in text.split(","):
        lr, sep, v = part.partition(":")
        try:
            local_rank = int(lr)
        except ValueError:
            local_rank = -1
        if not sep or not 0 <= local_rank < nproc:
            raise LaunchError(
                f"{option}={text!r}: expected LOCAL_RANK:VALUE pairs with local ranks in [0, {nproc})"
            )
        result[local_rank] = std(v)
    return result


def parse_ranks_filter(value: str | None) -> set[int] | None:
    """--local-ranks-filter: comma-separated local ranks whose output reaches the console."""
    if value is None or str(value).strip() == "":
        return None
    try:
        return {int(x) for x in str(value).split(",") if x.strip()}
    except ValueError:
        raise LaunchError(f"--local-ranks-filter={value!r}: expected comma-separated ints") from None


class NodePlacement(NamedTuple):
    nnodes: str | int
    node_rank: int
    master_addr: str
    master_port: int


def node_placement(nnodes: str | None, node_rank: int | None, master_addr: str | None, master_port: int | None,
                   env: Mapping[str, str]) -> NodePlacement:
    """The node count, node rank and master, each from its option (or PET_ variable) when given,
    else from Slurm inside a multi-node allocation (``launcher_env.slurm_node_defaults``: run one
    launcher per node, ``srun --ntasks-per-node=1 distcomm-run ...``), else the single-node
    defaults (1 node, rank 0, 127.0.0.1:29500)."""
    slurm = None
    if None in (nnodes, node_rank, master_addr, master_port):
        try:
            slurm = launcher_env.slurm_node_defaults(env)
        except launcher_env.LaunchEnvError as exc:
            raise LaunchError(f"inside a Slurm allocation: {exc}") from None
        if slurm is not None and slurm.nnodes <= 1:
            slurm = None  # one node: the single-node defaults serve, with no name to resolve
    return NodePlacement(
        nnodes if nnodes is not None else (slurm.nnodes if slurm else "1"),
        node_rank if node_rank is not None else (slurm.node_rank if slurm else 0),
        master_addr if master_addr is not None else (slurm.master_addr if slurm else "127.0.0.1"),
        master_port if master_port is not None else (
            slurm.master_port if slurm and slurm.master_port is not None else DEFAULT_MASTER_PORT),
    )


def parse_endpoint(value: str, default_port: int) -> tuple[str, int]:
    """``host``, ``host:port`` or ``[v6addr]:port``."""
    text = value.strip()
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
    elif text.count(":") == 1:
        host, port = text.split(":")
    else:
        host, port = text, ""
    try:
        return host or "127.0.0.1", int(port) if port else default_port
    except ValueError:
        raise LaunchError(f"--rdzv-endpoint={value!r}: expected HOST:PORT") from None


def parse_rdzv_conf(value: str | None) -> dict[str, str]:
    """``key1=value1,key2=value2``."""
    conf = {}
    for part in (value or "").split(","):
        if part.strip():
            key, sep, val = part.partition("=")
            if not sep:
                raise LaunchError(f"--rdzv-conf={value!r}: expected KEY=VALUE pairs separated by commas")
            conf[key.strip()] = val.strip()
    return conf


@dataclass
class LaunchConfig:
    """One node's launch, fully resolved (no 'auto', no unparsed strings)."""

    entrypoint: list[str]               # e.g. [python, -u, script] / [python, -u, -m, module] / [binary]
    args: list[str] = field(default_factory=list)  # the script's own arguments
    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = DEFAULT_MASTER_PORT  # 0: pick a free port (node rank 0 only)
    standalone: bool = False
    run_id: str | None = None           # None: node rank 0 makes one up, the others learn it
    max_restarts: int = 0
    monitor_interval: float = 0.1
    shutdown_timeout: float = 30.0      # SIGTERM -> SIGKILL grace period
    join_timeout: float = 600.0         # how long launchers wait for each other at a rendezvous
    # torchrun's keep-alive settings: every launcher but node rank 0's beats this often, and node
    # rank 0's gives up on one after this many beats in a row are missing
    keep_alive_interval: float = 5.0
    keep_alive_max_attempt: int = 3
    redirects: dict[int, int] = field(default_factory=dict)
    tee: dict[int, int] = field(default_factory=dict)
    log_dir: str | None = None
    local_ranks_filter: set[int] | None = None
    log_line_prefix_template: str | None = None  # teed lines' prefix (torchrun's template)
    rank_prefix: bool = False           # distcomm's: "[rank<N>]: " before every other console line
    role: str = "default"
    local_rank_arg: str | None = None   # legacy launch: f"{local_rank_arg}={local_rank}" before args
    signals: Sequence[str] = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")  # forwarded to workers
    script_name: str = ""               # for messages: the script or module the user named
    local_addr: str | None = None       # this node's name in summaries (default: the hostname)

    def __post_init__(self) -> None:
        if not 0 <= self.node_rank < self.nnodes:
            raise LaunchError(
                f"--node-rank={self.node_rank} is out of range for --nnodes={self.nnodes} "
                f"(node ranks are 0..{self.nnodes - 1})"
            )
        if self.max_restarts < 0:
            raise LaunchError(f"--max-restarts={self.max_restarts}: expected 0 or more")
        if not 0 <= self.master_port < 65536:
            raise LaunchError(f"--master-port={self.master_port}: expected 0..65535")
        if self.master_port == 0 and self.node_rank != 0:
            raise LaunchError(
                "--master-port=0 only works on node rank 0 (which picks the port); the other "
                "nodes must be given the port node rank 0 printed"
            )
        if self.monitor_interval <= 0:
            raise LaunchError(f"--monitor-interval={self.monitor_interval}: expected a positive number")
        if not 0 < self.keep_alive_interval < float("inf"):
            raise LaunchError(
                f"--rdzv-conf keep_alive_interval={self.keep_alive_interval}: expected a positive number of seconds"
            )
        if self.keep_alive_max_attempt < 1:
            raise LaunchError(f"--rdzv-conf keep_alive_max_attempt={self.keep_alive_max_attempt}: expected 1 or more")
