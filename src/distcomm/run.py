"""distcomm-run: start the workers of a distributed job on this node, like torchrun.

Usage (``python -m distcomm.run`` works the same)::

    distcomm-run --standalone --nproc-per-node 4 train.py --lr 0.1
    distcomm-run --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --master-port 29500 --nproc-per-node 2 train.py
    distcomm-run --nnodes 2 --node-rank 1 --master-addr 10.0.0.1 --master-port 29500 --nproc-per-node 2 train.py

Inside a Slurm allocation of several nodes, one launcher per node (``srun --ntasks-per-node=1
distcomm-run --nproc-per-node 4 train.py``) takes what its options leave out from Slurm: the node
count, SLURM_NODEID as its node rank, and the first host of the node list as the master, on a port
derived from SLURM_JOB_ID (launcher_env.py).

torchrun's options are accepted with both spellings (``--nproc-per-node`` and ``--nproc_per_node``),
and, as in torchrun, each can also come from the environment as ``PET_<OPTION>`` (``PET_NPROC_PER_NODE``).

What the launcher does
----------------------
- The launcher of node rank 0 hosts the job's TCPStore at MASTER_ADDR:MASTER_PORT for the whole job
  (``--master-port 0`` or ``--standalone``: a free port), so the store outlives every worker,
  rank 0 included. Launchers of other nodes connect to it; launchers meet there before each round.
- Ranks: node ``n``'s workers get ranks ``offset(n) + local_rank`` where ``offset(n)`` is the sum
  of the lower nodes' ``--nproc-per-node`` (``n * nproc`` when every node runs the same count).
- Output, as torchrun: a worker's stdout/stderr reach the launcher's stdout/stderr unchanged
  (forwarded a whole line at a time, so lines of different workers never interleave mid-line).
  ``--redirects``/``-r`` and ``--tee``/``-t`` (``3``, or per local rank ``0:1,1:2``; 1 stdout,
  2 stderr, 3 both) send streams to ``<log-dir>/<run_id>_<random>/attempt_<k>/<local_rank>/
  {stdout,stderr}.log`` (torchrun's layout; a temporary directory without ``--log-dir``), redirect
  to the file only, tee to the file and the console. Teed console lines carry torchrun's header
  ``[<role><local_rank>]:`` or the template of ``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE`` (also
  ``--log-line-prefix-template``; ``${role_name}``, ``${rank}``, ``${local_rank}``).
  ``--local-ranks-filter 0,1`` shows only those local ranks on the console (files get all).
  Why no rank prefix by default: distcomm-run is a drop-in for torchrun, and scripts that parse
  a worker's output (``| grep loss``, JSON lines, a log collector) were written against torchrun's
  unprefixed lines. Attribution is one flag away: ``--rank-prefix`` (distcomm's own, or
  ``PET_RANK_PREFIX=1``) writes ``[rank<N>]: `` before every line that is not teed.
- Failure: the first worker to exit non-zero (or by a signal) is the root cause. The launcher
  stops the other workers (SIGTERM, then SIGKILL after ``--shutdown-timeout`` s, default 30), on
  every node, then prints a summary with that worker's rank, exit code or signal, pid, host, time
  and the tail of its Python traceback (read from its stderr; no decorator needed). With
  ``--max-restarts k`` the whole group is restarted (a new round, new key prefix) up to k times.
- A lost launcher ends the job, whether or not a worker noticed: the other nodes' launchers
  notice that node rank 0's is gone when its job store is; every other launcher sends node rank
  0's a heartbeat every ``keep_alive_interval`` s (``--rdzv-conf``, default 5), and once one has
  missed ``keep_alive_max_attempt`` (default 3) in a row, node rank 0's launcher names that node,
  stops the workers on every node and exits 1, without restarting (its workers may have finished:
  the job did not). Node rank 0's launcher then keeps the store up for the launchers still alive,
  at most 30 s.
- Exit code: 0 when every worker of every node exited 0; 1 when the job failed or could not start
  (the reason is printed); 128+N when the launcher was stopped by signal N. SIGINT, SIGTERM,
  SIGHUP and SIGQUIT sent to the launcher are forwarded to the workers (each runs in its own
  session, with every process it starts); a second signal skips the grace period. Workers die with
  the launcher even if it is killed with SIGKILL (PR_SET_PDEATHSIG, Linux), and so does everything
  they started: a watchdog process kills their sessions and removes the launcher's temp dir and the
  run's shared-memory segments (``_launcher/watchdog.py``). SIGUSR1 is forwarded to the workers that
  handle it: a worker that imported distcomm prints every thread's Python stack to stderr, each line
  prefixed ``[rank N] `` (``DISTCOMM_STACKS_ON_SIGUSR1=1`` is set for it; ``distcomm/stacks.py``).
- Authentication: with ``DISTCOMM_AUTH_KEY_FILE`` (a ``chmod 600`` file holding the key) or
  ``DISTCOMM_AUTH_KEY`` set for ``distcomm-run``, the job store requires that key of every client
  and proves it to them (mutual HMAC challenge-response; the key never crosses the wire). The
  workers inherit the variable, so nothing else is needed; a process without the key, or with
  another, is refused. Set it for the launcher of every node.
- After each round (success, failure, restart, or a signal to the launcher) the cleanup hooks run
  (``distcomm._launcher.cleanup``): the shared-memory transport's hook unlinks the segments that
  killed workers of that round left in /dev/shm (named ``distcomm-<run_id>-<attempt>-...``).

Environment of each worker (the env:// contract)
------------------------------------------------
===============================  ==================================================================
RANK, WORLD_SIZE                 global rank, number of workers in the job
LOCAL_RANK, LOCAL_WORLD_SIZE     rank on this node, workers on this node
GROUP_RANK, GROUP_WORLD_SIZE     node rank, number of nodes
ROLE_NAME, ROLE_RANK,            torchrun's role variables (``--role``, default ``default``)
ROLE_WORLD_SIZE
MASTER_ADDR, MASTER_PORT         where the launcher-hosted job store listens
TORCHELASTIC_USE_AGENT_STORE     ``True``: the store already exists. env:// must connect to it as a
                                 client on EVERY rank, rank 0 included (never start a server)
DISTCOMM_STORE_PREFIX            ``/worker/attempt_<k>``: env:// must wrap its client in
                                 ``PrefixStore(DISTCOMM_STORE_PREFIX, store)`` so a restarted round
                                 never sees the keys of an earlier one (the store lives on)
TORCHELASTIC_RESTART_COUNT       ``k``, the round: 0, then 1.. after restarts. If
                                 DISTCOMM_STORE_PREFIX is absent, env:// may use
                                 ``/worker/attempt_<TORCHELASTIC_RESTART_COUNT>``
TORCHELASTIC_MAX_RESTARTS        ``--max-restarts``
TORCHELASTIC_RUN_ID              the run id (``--rdzv-id``, or made up by node rank 0 and shared):
                                 ``is_torchelastic_launched()`` checks it; name per-run resources
                                 (shared-memory segments) with it
TORCHELASTIC_ERROR_FILE          where torch's ``@record`` may write its error JSON (read if present)
DISTCOMM_AUTH_KEY_FILE,          inherited unchanged from the launcher's environment: the job
DISTCOMM_AUTH_KEY                store's key (see Authentication above)
OMP_NUM_THREADS                  ``1`` when unset and more than one worker runs on the node (a
                                 one-line notice says so)
===============================  ==================================================================

Python workers run as ``python -u script args`` (``-m module`` with ``--module``); ``--no-python``
runs the script as a program. The legacy launcher (``python -m distcomm.launch``, deprecated with
a FutureWarning as torch's) adds ``--local-rank=<LOCAL_RANK>`` before the script's arguments unless
``--use-env`` is given.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

from ._launcher.agent import launch
from ._launcher.config import (
    DEFAULT_MASTER_PORT,
    LaunchConfig,
    LaunchError,
    parse_endpoint,
    node_placement,
    parse_nnodes,
    parse_nproc_per_node,
    parse_ranks_filter,
    parse_rdzv_conf,
    parse_std_spec,
)

__all__ = ["main", "get_args_parser", "parse_args", "config_from_args", "run"]


class _Env(argparse.Action):
    """torchrun's ``env`` action: the default comes from ``PET_<DEST>`` when that is set."""

    def __init__(self, dest, default=None, required=False, **kwargs):
        env_name = f"PET_{dest.upper()}"
        default = os.environ.get(env_name, default)
        if default is not None:
            required = False
        super().__init__(dest=dest, default=default, required=required, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)


class _EnvFlag(argparse.Action):
    """A flag whose default is ``PET_<DEST>`` (``1``/``true``) when set."""

    def __init__(self, dest, default=False, required=False, **kwargs):
        env = os.environ.get(f"PET_{dest.upper()}")
        default = env.lower() in ("1", "true", "yes") if env is not None else bool(default)
        super().__init__(dest=dest, const=True, default=default, required=required, nargs=0, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, self.const)


def _both(name: str) -> list[str]:
    """``--nproc-per-node`` and ``--nproc_per_node`` (one spelling for names without a dash)."""
    dashed = "--" + name.replace("_", "-")
    underscored = "--" + name.replace("-", "_")
    return [dashed] if dashed == underscored else [dashed, underscored]


def get_args_parser(prog: str = "distcomm-run") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Start the workers of a distributed job on this node (torchrun's options).",
    )
    p.add_argument(*_both("nnodes"), action=_Env, type=str, default=None,
                   help="Number of nodes (N, or N:N; elastic ranges are not supported). Default 1, or the "
                        "Slurm allocation's node count.")
    p.add_argument(*_both("nproc-per-node"), action=_Env, type=str, default="1",
                   help="Workers on this node: an int, or 'auto'/'cpu' = the CPUs available. Default 1.")
    p.add_argument(*_both("rdzv-backend"), action=_Env, type=str, default="static",
                   help="'static' or 'c10d': both use the TCPStore hosted by node rank 0's launcher.")
    p.add_argument(*_both("rdzv-endpoint"), action=_Env, type=str, default="",
                   help="HOST:PORT of the job store; overrides --master-addr/--master-port.")
    p.add_argument(*_both("rdzv-id"), action=_Env, type=str, default=None,
                   help="Run id (TORCHELASTIC_RUN_ID). Default: made up by node rank 0 and shared.")
    p.add_argument(*_both("rdzv-conf"), action=_Env, type=str, default="",
                   help="KEY=VALUE,...; join_timeout=<seconds> is how long launchers wait for each other; "
                        "keep_alive_interval=<seconds> (default 5) and keep_alive_max_attempt=<n> (default 3): "
                        "node rank 0's launcher gives up on another launcher that missed n heartbeats in a row.")
    p.add_argument("--standalone", action=_EnvFlag,
                   help="Single-node job with its store on a free local port: ignores --master-addr/"
                        "--master-port/--rdzv-endpoint.")
    p.add_argument(*_both("max-restarts"), action=_Env, type=int, default=0,
                   help="Restart the whole worker group up to this many times after a failure.")
    p.add_argument(*_both("monitor-interval"), action=_Env, type=float, default=0.1,
                   help="Seconds between checks of the other nodes' state. Default 0.1.")
    p.add_argument(*_both("start-method"), action=_Env, type=str, default="spawn",
                   choices=["spawn", "fork", "forkserver"],
                   help="Accepted for torchrun compatibility: workers always start as fresh processes.")
    p.add_argument("--role", action=_Env, type=str, default="default", help="ROLE_NAME of the workers.")
    p.add_argument("-m", "--module", action=_EnvFlag,
                   help="Run the script argument as a module, like 'python -m'.")
    p.add_argument(*_both("no-python"), action=_EnvFlag,
                   help="Run the script directly as a program instead of with 'python'.")
    p.add_argument(*_both("log-dir"), action=_Env, type=str, default=None,
                   help="Directory for --redirects/--tee logs (<log-dir>/<run_id>/attempt_<k>/<local_rank>/).")
    p.add_argument("-r", *_both("redirects"), action=_Env, type=str, default="",
                   help="Send worker streams to log files only: 1 stdout, 2 stderr, 3 both; or per "
                        "local rank, e.g. 0:1,1:2.")
    p.add_argument("-t", "--tee", action=_Env, type=str, default="",
                   help="Send worker streams to log files and the console (same format as --redirects).")
    p.add_argument(*_both("local-ranks-filter"), action=_Env, type=str, default="",
                   help="Only show the console output of these local ranks, e.g. 0,1 (log files "
                        "still get every rank's).")
    p.add_argument(*_both("log-line-prefix-template"), action=_Env, type=str,
                   default=os.environ.get("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"),
                   help="Prefix of teed console lines, with ${role_name}, ${rank}, ${local_rank} "
                        "(torchrun reads it from TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE, the default "
                        "here). Default: [${role_name}${local_rank}]:")
    p.add_argument(*_both("rank-prefix"), action=_EnvFlag,
                   help="distcomm only: put '[rank<N>]: ' before every console line that is not "
                        "teed (torchrun shows those lines unchanged).")
    p.add_argument(*_both("node-rank"), action=_Env, type=int, default=None,
                   help="Rank of this node (0..nnodes-1); node rank 0 hosts the job store. Default 0, or "
                        "SLURM_NODEID.")
    p.add_argument(*_both("master-addr"), action=_Env, type=str, default=None,
                   help="Address of node rank 0 (where the job store listens). Default 127.0.0.1, or the "
                        "first host of the Slurm node list.")
    p.add_argument(*_both("master-port"), action=_Env, type=int, default=None,
                   help=f"Port of the job store; 0 picks a free one (node rank 0). Default {DEFAULT_MASTER_PORT}, "
                        "or one derived from SLURM_JOB_ID (launcher_env.slurm_port).")
    p.add_argument(*_both("local-addr"), action=_Env, type=str, default=None,
                   help="This node's name in failure summaries. Default: the hostname.")
    p.add_argument(*_both("shutdown-timeout"), action=_Env, type=float,
                   default=float(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", 30)),
                   help="Seconds between SIGTERM and SIGKILL when stopping workers. Default 30.")
    p.add_argument(*_both("signals-to-handle"), action=_Env, type=str, default="SIGTERM,SIGINT,SIGHUP,SIGQUIT",
                   help="Signals the launcher forwards to its workers.")
    p.add_argument("training_script", type=str,
                   help="The script (or module with -m, or program with --no-python) each worker runs.")
    p.add_argument("training_script_args", nargs=argparse.REMAINDER)
    return p


def parse_args(argv: Sequence[str] | None = None, prog: str = "distcomm-run") -> argparse.Namespace:
    return get_args_parser(prog).parse_args(argv)


def _rdzv_conf_value(conf: dict, key: str, default, kind, what: str):
    """``--rdzv-conf key=value`` as ``kind`` (``default`` when absent); LaunchError naming it if not one."""
    try:
        return kind(conf.get(key, default))
    except ValueError:
        raise LaunchError(f"--rdzv-conf {key}={conf[key]!r}: expected {what}") from None


def config_from_args(args: argparse.Namespace) -> LaunchConfig:
    """Resolve the parsed options into a LaunchConfig (LaunchError on a bad combination)."""
    nproc = parse_nproc_per_node(args.nproc_per_node)
    # inside a multi-node Slurm allocation, what the options leave out comes from SLURM_*
    placement = node_placement(args.nnodes, args.node_rank, args.master_addr, args.master_port,
                               {} if args.standalone else os.environ)
    nnodes = parse_nnodes(placement.nnodes)
    if args.rdzv_backend not in ("static", "c10d"):
        raise LaunchError(f"--rdzv-backend={args.rdzv_backend!r}: only 'static' and 'c10d' are supported")
    conf = parse_rdzv_conf(args.rdzv_conf)
    master_addr, master_port = placement.master_addr, placement.master_port
    if args.standalone:
        if nnodes != 1:
            raise LaunchError(f"--standalone runs a single-node job, but --nnodes={args.nnodes}")
        master_addr, master_port = "127.0.0.1", 0
    elif args.rdzv_endpoint:
        master_addr, master_port = parse_endpoint(args.rdzv_endpoint, DEFAULT_MASTER_PORT)

    if args.no_python and args.module:
        raise LaunchError("--no-python and --module cannot be used together")
    if args.no_python:
        entrypoint = [args.training_script]
    else:
        python = os.environ.get("PYTHON_EXEC", sys.executable)
        entrypoint = [python, "-u"] + (["-m"] if args.module else []) + [args.training_script]
    join_timeout = _rdzv_conf_value(conf, "join_timeout", 600.0, float, "seconds")
    keep_alive_interval = _rdzv_conf_value(conf, "keep_alive_interval", 5.0, float, "seconds")
    keep_alive_max_attempt = _rdzv_conf_value(conf, "keep_alive_max_attempt", 3, int, "an int")
    return LaunchConfig(
        entrypoint=entrypoint,
        args=list(args.training_script_args),
        nproc_per_node=nproc,
        nnodes=nnodes,
        node_rank=placement.node_rank,
        master_addr=master_addr,
        master_port=master_port,
        standalone=args.standalone,
        run_id=None if args.rdzv_id in (None, "", "none") else args.rdzv_id,
        max_restarts=args.max_restarts,
        monitor_interval=args.monitor_interval,
        shutdown_timeout=args.shutdown_timeout,
        join_timeout=join_timeout,
        keep_alive_interval=keep_alive_interval,
        keep_alive_max_attempt=keep_alive_max_attempt,
        redirects=parse_std_spec(args.redirects, nproc, "--redirects"),
        tee=parse_std_spec(args.tee, nproc, "--tee"),
        log_dir=args.log_dir,
        local_ranks_filter=parse_ranks_filter(args.local_ranks_filter),
        log_line_prefix_template=args.log_line_prefix_template,
        rank_prefix=args.rank_prefix,
        role=args.role,
        signals=[s for s in args.signals_to_handle.split(",") if s.strip()],
        script_name=args.training_script,
        local_addr=args.local_addr,
    )


def run(args: argparse.Namespace, local_rank_arg: str | None = None) -> int:
    """Launch from parsed arguments; the exit code.

    ``local_rank_arg`` (the legacy launcher's ``"--local-rank"``) is passed to each worker as
    ``<local_rank_arg>=<LOCAL_RANK>`` before the script's own arguments.
    """
    try:
        config = config_from_args(args)
    except LaunchError as exc:
        print(f"distcomm-run: error: {exc}", file=sys.stderr)
        return 1
    config.local_rank_arg = local_rank_arg
    return launch(config)


def main(argv: Sequence[str] | None = None) -> None:
    sys.exit(run(parse_args(argv)))


if __name__ == "__main__":
    main()
