"""One node's launcher: host or join the job store, run rounds of workers, restart, report, exit.

Between launchers (nodes) everything goes through the job store, under ``/distcomm-run/``; the
launcher only polls counters (``add(key, 0)``), so it never blocks where a signal could not reach
it. Keys (``R`` = ``/distcomm-run/round<attempt>``):

- ``/distcomm-run/run_id`` (+ ``run_id_set``): node rank 0 publishes the run id, the others adopt it
- ``R/nproc/<node_rank>``, ``R/node/<node_rank>``, ``R/joined``: the launchers' rendezvous for a
  round; once ``joined`` reaches nnodes every node knows every node's worker count, so rank
  offsets (the sum of the lower nodes' counts) and WORLD_SIZE agree everywhere
- ``R/failed``, ``R/root`` (+ ``root_set``): the first node to see a worker fail publishes it as
  the round's root cause; every node stops its workers, then all restart or all give up
- ``R/succeeded``: nodes whose workers all exited 0; the round succeeds when every node is in
- ``/distcomm-run/abort`` (+ ``abort_reason``): a launcher was signalled or misconfigured; everyone
  stops without restarting
- ``/distcomm-run/exit``: node rank 0 keeps the store up until every launcher has left

Workers never see these keys: their keys live under ``/worker/attempt_<k>`` (DISTCOMM_STORE_PREFIX).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import sys
import tempfile
import time
import uuid

from ..errors import DistError
from . import store as job_store
from .cleanup import run_cleanup_hooks
from .config import LaunchConfig, LaunchError
from .failure import Failure, format_summary, read_error_file, signal_name, traceback_tail
from .output import OutputRouter
from .workers import Worker, WorkerGroup, WorkerSpec

AGENT = "/distcomm-run"
POLL = 0.05               # seconds between store polls while launchers wait for each other
EXIT_BARRIER_TIMEOUT = 30.0
ROOT_WAIT = 5.0           # how long to wait for another node's root-cause record
STDERR_TAIL_LINES = 5     # shown when a failed worker printed no traceback


def worker_store_prefix(attempt: int) -> str:
    """The key prefix workers of round ``attempt`` must use (exported as DISTCOMM_STORE_PREFIX)."""
    return f"/worker/attempt_{attempt}"


def notice(text: str) -> None:
    print(f"distcomm-run: {text}", file=sys.stderr, flush=True)


class _Signaled(BaseException):
    """Raised in the main thread by the launcher's signal handler (first signal only)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


class _Aborted(Exception):
    """Another launcher aborted the job, or the store (node rank 0's launcher) went away."""


class _Round:
    """What happened in one round: success, or the job's root-cause failure and the rest."""

    def __init__(self) -> None:
        self.root: Failure | None = None
        self.local_failures: list[Failure] = []
        self.stopped: list[int] = []

    @property
    def ok(self) -> bool:
        return self.root is None


class NodeAgent:
    def __init__(self, config: LaunchConfig, router: OutputRouter | None = None):
        self.config = config
        self.router = router or OutputRouter(
            config.redirects, config.tee, config.log_dir, config.local_ranks_filter
        )
        self.host = config.local_addr or socket.gethostname()
        self.is_host = config.node_rank == 0
        self.multi_node = config.nnodes > 1
        self.store = None
        self.port = config.master_port
        self.run_id = config.run_id or ""
        self.group: WorkerGroup | None = None
        self._stopping = False                  # signals now only escalate (and are remembered)
        self._pending_signal: int | None = None
        self._tmp = tempfile.mkdtemp(prefix="distcomm-run-")
        self._log_root: str | None = None

    # -- entry point --------------------------------------------------------------------------
    def run(self) -> int:
        """Run the job to the end; the launcher's exit code."""
        previous = self._install_signal_handlers()
        try:
            self._open_store()
            return self._rounds()
        except _Signaled as sig:
            self._abort(f"the launcher of node {self.config.node_rank} ({self.host}) received {signal_name(sig.signum)}")
            notice(f"received {signal_name(sig.signum)}; workers stopped")
            return 128 + sig.signum
        except _Aborted as exc:
            notice(str(exc))
            return 1
        except DistError as exc:  # a store operation failed: node rank 0's launcher is gone
            notice(self._store_lost(exc))
            return 1
        except LaunchError as exc:
            notice(f"error: {exc}")
            return 1
        finally:
            self._stopping = True
            self._leave()
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            shutil.rmtree(self._tmp, ignore_errors=True)

    def _install_signal_handlers(self) -> dict:
        def on_signal(signum, frame):
            if self._stopping:  # already stopping workers: no more grace period, act on it after
                if self.group is not None:
                    self.group.escalate = True
                self._pending_signal = self._pending_signal or signum
                return
            self._stopping = True
            raise _Signaled(signum)

        previous = {}
        for name in self.config.signals:
            signum = getattr(signal, name.strip().upper(), None)
            if isinstance(signum, signal.Signals):
                previous[signum] = signal.signal(signum, on_signal)
        return previous

    # -- the store ----------------------------------------------------------------------------
    def _open_store(self) -> None:
        c = self.config
        if self.is_host:
            self.store = job_store.host_store(c.master_addr, c.master_port, c.join_timeout, self.multi_node)
            self.port = int(self.store.port)
            self.run_id = self.run_id or uuid.uuid4().hex[:12]
            self.store.set(f"{AGENT}/run_id", self.run_id)
            self.store.add(f"{AGENT}/run_id_set", 1)
            if self.multi_node and c.master_port == 0:
                notice(f"job store listening on {c.master_addr}:{self.port} (pass --master-port {self.port} to the other nodes)")
        else:
            self.store = job_store.connect_store(c.master_addr, c.master_port, c.join_timeout)
            self._poll_until(lambda: self._count(f"{AGENT}/run_id_set") > 0, c.join_timeout,
                             "the run id from node rank 0")
            self.run_id = self.store.get(f"{AGENT}/run_id").decode()

    def _count(self, key: str) -> int:
        try:
            return job_store.counter(self.store, key)
        except Exception as exc:
            if self.is_host:
                raise
            raise _Aborted(self._store_lost(exc)) from exc

    def _store_lost(self, exc: BaseException) -> str:
        return (
            f"lost the job store at {self.config.master_addr}:{self.port} ({exc}); "
            "the --node-rank 0 launcher is gone"
        )

    def _check_abort(self) -> None:
        if self._count(f"{AGENT}/abort") > 0:
            reason = self.store.get(f"{AGENT}/abort_reason").decode()
            raise _Aborted(f"job aborted: {reason}")

    def _poll_until(self, done, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            self._check_abort()
            if time.monotonic() > deadline:
                raise LaunchError(f"timed out after {timeout:.0f} s waiting for {what}")
            time.sleep(POLL)

    def _abort(self, reason: str) -> None:
        """Tell the other launchers to stop without restarting (best effort)."""
        if self.store is None or not self.multi_node:
            return
        try:
            self.store.set(f"{AGENT}/abort_reason", reason)
            self.store.add(f"{AGENT}/abort", 1)
        except Exception:  # noqa: BLE001 - the store may be what failed
            pass

    def _leave(self) -> None:
        """Exit barrier: node rank 0 keeps the store up until every launcher has left."""
        if self.store is None:
            return
        try:
            self.store.add(f"{AGENT}/exit", 1)
            if self.is_host and self.multi_node:
                deadline = time.monotonic() + EXIT_BARRIER_TIMEOUT
                while self._count(f"{AGENT}/exit") < self.config.nnodes and time.monotonic() < deadline:
                    time.sleep(POLL)
        except BaseException:  # noqa: BLE001 - leaving must not hide the job's result
            pass
        store, self.store = self.store, None
        store.close()  # on node rank 0 this stops the server

    # -- rounds -------------------------------------------------------------------------------
    def _rounds(self) -> int:
        c = self.config
        for attempt in range(c.max_restarts + 1):
            offset, world_size = self._rendezvous(attempt)
            result = self._run_round(attempt, offset, world_size)
            if result.ok:
                return 0
            root = result.root
            if attempt < c.max_restarts:
                notice(
                    f"rank {root.rank} failed ({root.exit_text}); restarting the worker group "
                    f"(restart {attempt + 1} of {c.max_restarts})"
                )
                continue
            also = [f for f in result.local_failures if f.rank != root.rank]
            sys.stderr.write(format_summary(c.script_name, root, also, result.stopped, attempt + 1, self._log_root))
            sys.stderr.flush()
            return 1
        raise AssertionError("unreachable")

    def _rendezvous(self, attempt: int) -> tuple[int, int]:
        """Meet the other launchers for round ``attempt``; (this node's rank offset, world size)."""
        c = self.config
        r = f"{AGENT}/round{attempt}"
        if self.store.add(f"{r}/node/{c.node_rank}", 1) > 1:
            reason = f"two launchers were started with --node-rank {c.node_rank}"
            self._abort(reason)
            raise LaunchError(reason + "; give each node its own --node-rank")
        self.store.set(f"{r}/nproc/{c.node_rank}", str(c.nproc_per_node))
        if self.store.add(f"{r}/joined", 1) > c.nnodes:
            raise LaunchError(f"more launchers than --nnodes={c.nnodes} joined this job")
        self._poll_until(
            lambda: self._count(f"{r}/joined") >= c.nnodes,
            c.join_timeout,
            f"all {c.nnodes} launchers (--nnodes) to join the job at {c.master_addr}:{self.port}",
        )
        nprocs = [int(self.store.get(f"{r}/nproc/{n}")) for n in range(c.nnodes)]
        return sum(nprocs[: c.node_rank]), sum(nprocs)

    def _worker_specs(self, attempt: int, offset: int, world_size: int) -> list[WorkerSpec]:
        c = self.config
        base = dict(os.environ)
        if "OMP_NUM_THREADS" not in base and c.nproc_per_node > 1:
            base["OMP_NUM_THREADS"] = "1"
            if attempt == 0:
                notice(
                    f"OMP_NUM_THREADS is not set: using OMP_NUM_THREADS=1 for each of the "
                    f"{c.nproc_per_node} workers on this node (set it yourself to tune)"
                )
        base.update(
            LOCAL_WORLD_SIZE=str(c.nproc_per_node),
            WORLD_SIZE=str(world_size),
            GROUP_RANK=str(c.node_rank),
            GROUP_WORLD_SIZE=str(c.nnodes),
            ROLE_NAME=c.role,
            ROLE_WORLD_SIZE=str(world_size),
            MASTER_ADDR=c.master_addr,
            MASTER_PORT=str(self.port),
            TORCHELASTIC_RUN_ID=self.run_id,
            TORCHELASTIC_RESTART_COUNT=str(attempt),
            TORCHELASTIC_MAX_RESTARTS=str(c.max_restarts),
            TORCHELASTIC_USE_AGENT_STORE="True",
            DISTCOMM_STORE_PREFIX=worker_store_prefix(attempt),
        )
        specs = []
        for local_rank in range(c.nproc_per_node):
            rank = offset + local_rank
            env = dict(base)
            env.update(
                RANK=str(rank),
                LOCAL_RANK=str(local_rank),
                ROLE_RANK=str(rank),
                TORCHELASTIC_ERROR_FILE=os.path.join(self._tmp, f"attempt_{attempt}", str(local_rank), "error.json"),
            )
            extra = [f"{c.local_rank_arg}={local_rank}"] if c.local_rank_arg else []
            specs.append(WorkerSpec(local_rank, rank, c.entrypoint + extra + list(c.args), env))
        return specs

    def _attempt_dir(self, attempt: int) -> str | None:
        if not self.router.wants_files:
            return None
        if self._log_root is None:
            base = self.config.log_dir or tempfile.mkdtemp(prefix="distcomm-run-logs-")
            root, n = os.path.join(base, self.run_id), 0
            while os.path.exists(root):
                n += 1
                root = os.path.join(base, f"{self.run_id}_{n}")
            self._log_root = root
            notice(f"worker logs in {root}")
        return os.path.join(self._log_root, f"attempt_{attempt}")

    def _run_round(self, attempt: int, offset: int, world_size: int) -> _Round:
        c = self.config
        result = _Round()
        group = self.group = WorkerGroup(self.router, self._attempt_dir(attempt))
        try:
            group.start(self._worker_specs(attempt, offset, world_size))
            self._watch(group, attempt, result)
            if group.running:
                self._stopping = True
                group.stop(signal.SIGTERM, c.shutdown_timeout)
        except _Signaled as sig:
            group.stop(sig.signum, c.shutdown_timeout)
            raise
        except BaseException:
            self._stopping = True
            group.stop(signal.SIGTERM, c.shutdown_timeout)
            raise
        finally:
            self._stopping = True
            group.close()
            self.group = None
            run_cleanup_hooks(self.run_id, attempt)
            self._stopping = False
        if self._pending_signal is not None:  # arrived while workers were being stopped
            raise _Signaled(self._pending_signal)
        if result.root is not None:
            result.stopped = sorted(w.rank for w in group.workers if w.signalled is not None)
            result.local_failures = [
                self._failure_of(w) for w in group.workers if w.returncode and w.signalled is None
            ]
        return result

    def _watch(self, group: WorkerGroup, attempt: int, result: _Round) -> None:
        """Pump output until the round is decided: all workers succeeded, or the first failure."""
        c = self.config
        r = f"{AGENT}/round{attempt}"
        next_poll = time.monotonic()
        while True:
            for worker in group.pump(c.monitor_interval):
                if worker.returncode != 0:
                    result.root = self._publish_failure(r, self._failure_of(worker))
                    return
            if not group.running:
                break
            if self.multi_node and time.monotonic() >= next_poll:
                next_poll = time.monotonic() + c.monitor_interval
                self._check_abort()
                if self._count(f"{r}/failed") > 0:
                    result.root = self._remote_root(r)
                    return
        # Every local worker exited 0: the round succeeds once every node's workers did.
        self.store.add(f"{r}/succeeded", 1)
        while self._count(f"{r}/succeeded") < c.nnodes:
            self._check_abort()
            if self._count(f"{r}/failed") > 0:
                result.root = self._remote_root(r)
                return
            time.sleep(POLL)

    def _failure_of(self, worker: Worker) -> Failure:
        stderr = worker.err.tail_text()
        tb = read_error_file(worker.spec.env.get("TORCHELASTIC_ERROR_FILE")) or traceback_tail(stderr)
        return Failure(
            rank=worker.rank,
            local_rank=worker.local_rank,
            node_rank=self.config.node_rank,
            pid=worker.pid,
            host=self.host,
            returncode=worker.returncode,
            when=worker.exit_time or time.time(),
            traceback=tb,
            stderr_tail=[] if tb else stderr[-STDERR_TAIL_LINES:],
        )

    def _publish_failure(self, r: str, failure: Failure) -> Failure:
        """Record a local failure; the job's root cause is the first one any node recorded."""
        if self.store.add(f"{r}/failed", 1) == 1:
            self.store.set(f"{r}/root", failure.to_json())
            self.store.add(f"{r}/root_set", 1)
            return failure
        return self._remote_root(r) if self.multi_node else failure

    def _remote_root(self, r: str) -> Failure:
        deadline = time.monotonic() + ROOT_WAIT
        while self._count(f"{r}/root_set") == 0:
            if time.monotonic() > deadline:
                raise _Aborted("another node reported a failed worker but not which one")
            time.sleep(POLL)
        return Failure.from_json(self.store.get(f"{r}/root"))


def launch(config: LaunchConfig) -> int:
    """Run one node's share of the job described by ``config``; the launcher's exit code."""
    return NodeAgent(config).run()
