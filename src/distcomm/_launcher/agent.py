"""One node's launcher: run rounds of workers, restart, report, exit; forward signals.

The agent starts this node's workers for each round (``workers``), watches them with one event loop
until the round is decided, stops them, and restarts or reports. What it agrees with the other
nodes' launchers (rendezvous, the root cause of a failure, abort, exit) goes through the job store
(``coordination``). Signals SIGINT/SIGTERM/SIGHUP/SIGQUIT (``--signals-to-handle``) are forwarded
to the workers; a second one skips the grace period. SIGUSR1 is forwarded to the workers that
handle it, which print their Python stacks (distcomm/stacks.py), and the job goes on. If the
launcher is SIGKILLed, its watchdog (``watchdog``) kills what the workers started and removes its
temp dir and the run's segments.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time

from ..errors import DistError
from .cleanup import run_cleanup_hooks
from .config import LaunchConfig, LaunchError
from .coordination import Coordinator, JobAborted, worker_store_prefix
from .failure import Failure, format_summary, read_error_file, signal_name, traceback_tail
from ..transport.shm_segment import run_prefix, shm_dir
from .output import OutputRouter
from .watchdog import Watchdog
from .workers import Worker, WorkerGroup, WorkerSpec

STDERR_TAIL_LINES = 5     # shown when a failed worker printed no traceback


def notice(text: str) -> None:
    print(f"distcomm-run: {text}", file=sys.stderr, flush=True)


class _Signaled(BaseException):
    """Raised in the main thread by the launcher's signal handler (first signal only)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


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
            config.redirects, config.tee, config.log_dir, config.local_ranks_filter,
            role=config.role, prefix_template=config.log_line_prefix_template,
            rank_prefix=config.rank_prefix,
        )
        self.host = config.local_addr or socket.gethostname()
        self.job = Coordinator(config)
        self.group: WorkerGroup | None = None
        self._stopping = False                  # signals now only escalate (and are remembered)
        self._pending_signal: int | None = None
        self._tmp = tempfile.mkdtemp(prefix="distcomm-run-")
        self._log_root: str | None = None
        # cleans up if this process is SIGKILLed: worker sessions, the temp dir, shm segments
        self._watchdog = Watchdog()
        self._watchdog.remove_on_death(self._tmp)

    # -- entry point --------------------------------------------------------------------------
    def run(self) -> int:
        """Run the job to the end; the launcher's exit code."""
        previous = self._install_signal_handlers()
        try:
            self.job.open()
            if self.job.run_id:  # the run's segments are named after it (shm_segment._run_tag)
                self._watchdog.unlink_on_death(shm_dir(), run_prefix(self.job.run_id))
            if self.job.multi_node and self.config.master_port == 0:
                notice(f"job store listening on {self.config.master_addr}:{self.job.port} "
                       f"(pass --master-port {self.job.port} to the other nodes)")
            return self._rounds()
        except _Signaled as sig:
            self.job.abort(f"the launcher of node {self.config.node_rank} ({self.host}) received {signal_name(sig.signum)}")
            notice(f"received {signal_name(sig.signum)}; workers stopped")
            return 128 + sig.signum
        except JobAborted as exc:
            notice(str(exc))
            return 1
        except DistError as exc:  # a store operation failed: node rank 0's launcher is gone
            notice(self.job.store_lost(exc))
            return 1
        except LaunchError as exc:
            # the other launchers stop at once instead of waiting out their own timeouts
            self.job.abort(f"the launcher of node {self.config.node_rank} ({self.host}) gave up: {exc}")
            notice(f"error: {exc}")
            return 1
        finally:
            self._stopping = True
            self.job.leave()
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._watchdog.done()

    def _install_signal_handlers(self) -> dict:
        def on_signal(signum, frame):
            if self._stopping:  # already stopping workers: no more grace period, act on it after
                if self.group is not None:
                    self.group.escalate = True
                self._pending_signal = self._pending_signal or signum
                return
            self._stopping = True
            raise _Signaled(signum)

        def on_usr1(signum, frame):
            group = self.group
            if group is None:
                return
            skipped = group.dump_stacks()
            if skipped:
                notice(f"SIGUSR1 not forwarded to rank(s) {', '.join(map(str, skipped))}: they do not handle it "
                       "(stacks are printed by workers that import distcomm)")

        previous = {}
        if threading.current_thread() is not threading.main_thread():
            return previous  # launched from library code in a thread: signals stay the caller's
        if hasattr(signal, "SIGUSR1"):  # stacks on demand: forwarded to the workers, never fatal here
            previous[signal.SIGUSR1] = signal.signal(signal.SIGUSR1, on_usr1)
        for name in self.config.signals:
            signum = getattr(signal, name.strip().upper(), None)
            if isinstance(signum, signal.Signals):
                previous[signum] = signal.signal(signum, on_signal)
        return previous

    # -- rounds -------------------------------------------------------------------------------
    def _rounds(self) -> int:
        c = self.config
        for attempt in range(c.max_restarts + 1):
            offset, world_size = self.job.rendezvous(attempt)
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
            MASTER_PORT=str(self.job.port),
            TORCHELASTIC_RUN_ID=self.job.run_id,
            TORCHELASTIC_RESTART_COUNT=str(attempt),
            TORCHELASTIC_MAX_RESTARTS=str(c.max_restarts),
            TORCHELASTIC_USE_AGENT_STORE="True",
            DISTCOMM_STORE_PREFIX=worker_store_prefix(attempt),
            DISTCOMM_STACKS_ON_SIGUSR1="1",  # distcomm/stacks.py: stacks on demand
        )
        specs = []
        for local_rank in range(c.nproc_per_node):
            rank = offset + local_rank
            env = dict(base)
            # @record (torch's or distcomm's) opens this file without creating its directory
            error_dir = os.path.join(self._tmp, f"attempt_{attempt}", str(local_rank))
            os.makedirs(error_dir, exist_ok=True)
            env.update(
                RANK=str(rank),
                LOCAL_RANK=str(local_rank),
                ROLE_RANK=str(rank),
                TORCHELASTIC_ERROR_FILE=os.path.join(error_dir, "error.json"),
            )
            extra = [f"{c.local_rank_arg}={local_rank}"] if c.local_rank_arg else []
            specs.append(WorkerSpec(local_rank, rank, c.entrypoint + extra + list(c.args), env))
        return specs

    def _attempt_dir(self, attempt: int) -> str | None:
        if not self.router.wants_files:
            return None
        if self._log_root is None:
            base = self.config.log_dir or tempfile.mkdtemp(prefix="distcomm-run-logs-")
            os.makedirs(base, exist_ok=True)
            # torchrun's layout, which log collectors glob for: a fresh <run_id>_<random> per run,
            # so a reused --log-dir and --rdzv-id never mix two runs' files
            root = tempfile.mkdtemp(prefix=f"{self.job.run_id}_", dir=base)
            self._log_root = root
            notice(f"worker logs in {root}")
        return os.path.join(self._log_root, f"attempt_{attempt}")

    def _run_round(self, attempt: int, offset: int, world_size: int) -> _Round:
        c = self.config
        result = _Round()
        group = self.group = WorkerGroup(self.router, self._attempt_dir(attempt), self._watchdog)
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
            run_cleanup_hooks(self.job.run_id, attempt)
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
        next_poll = time.monotonic()
        while group.running:
            for worker in group.pump(c.monitor_interval):
                if worker.returncode != 0:
                    result.root = self.job.publish_failure(attempt, self._failure_of(worker))
                    return
            if self.job.multi_node and time.monotonic() >= next_poll:
                next_poll = time.monotonic() + c.monitor_interval
                result.root = self.job.remote_failure(attempt)
                if result.root is not None:
                    return
        result.root = self.job.finish_round(attempt, c.monitor_interval)

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


def launch(config: LaunchConfig) -> int:
    """Run one node's share of the job described by ``config``; the launcher's exit code."""
    return NodeAgent(config).run()
