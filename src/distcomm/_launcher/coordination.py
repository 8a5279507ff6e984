"""How the launchers of one job (one per node) agree, through the job store.

Node rank 0's launcher hosts the store; the others connect. Everything between launchers goes
through keys under ``/distcomm-run/``, and every wait is a poll of a counter (``add(key, 0)``), so
a launcher never blocks where a signal could not reach it and a lost store shows up on the next
poll. Keys (``R`` = ``/distcomm-run/round<attempt>``):

- ``/distcomm-run/run_id`` (+ ``run_id_set``): node rank 0 publishes the run id, the others adopt it
- ``R/node/<node_rank>``, ``R/nproc/<node_rank>``, ``R/joined``: the launchers' rendezvous for a
  round; once ``joined`` reaches nnodes every node knows every node's worker count, so rank
  offsets (the sum of the lower nodes' counts) and WORLD_SIZE agree everywhere
- ``R/failed``, ``R/root`` (+ ``root_set``): the first node to see a worker fail publishes it as
  the round's root cause; every node stops its workers, then all restart or all give up
- ``R/succeeded``: nodes whose workers all exited 0; the round succeeds when every node is in
- ``/distcomm-run/abort`` (+ ``abort_reason``): a launcher was signalled or misconfigured; everyone
  stops without restarting
- ``/distcomm-run/exit``: node rank 0 keeps the store up until every launcher has left

Workers never see these keys: theirs live under ``/worker/attempt_<k>`` (DISTCOMM_STORE_PREFIX).
"""

from __future__ import annotations

import time
import uuid

from . import store as job_store
from .config import LaunchConfig, LaunchError
from .failure import Failure

AGENT = "/distcomm-run"
POLL = 0.05                 # seconds between store polls while launchers wait for each other
EXIT_BARRIER_TIMEOUT = 30.0
ROOT_WAIT = 5.0             # how long to wait for another node's root-cause record


def worker_store_prefix(attempt: int) -> str:
    """The key prefix workers of round ``attempt`` must use (exported as DISTCOMM_STORE_PREFIX)."""
    return f"/worker/attempt_{attempt}"


class JobAborted(Exception):
    """Another launcher aborted the job, or the store (node rank 0's launcher) went away."""


class Coordinator:
    """This launcher's side of the protocol above."""

    def __init__(self, config: LaunchConfig):
        self.config = config
        self.is_host = config.node_rank == 0
        self.multi_node = config.nnodes > 1
        self.store = None
        self.port = config.master_port
        self.run_id = config.run_id or ""

    # -- the store ------------------------------------------------------------------------------
    def open(self) -> None:
        """Host the store (node rank 0) or connect to it; agree on the run id."""
        c = self.config
        if self.is_host:
            self.store = job_store.host_store(c.master_addr, c.master_port, c.join_timeout, self.multi_node)
            self.port = int(self.store.port)
            self.run_id = self.run_id or uuid.uuid4().hex[:12]
            self.store.set(f"{AGENT}/run_id", self.run_id)
            self.store.add(f"{AGENT}/run_id_set", 1)
        else:
            self.store = job_store.connect_store(c.master_addr, c.master_port, c.join_timeout)
            self._poll_until(lambda: self._count(f"{AGENT}/run_id_set") > 0, c.join_timeout,
                             "the run id from node rank 0")
            self.run_id = self.store.get(f"{AGENT}/run_id").decode()

    def store_lost(self, exc: BaseException) -> str:
        return (
            f"lost the job store at {self.config.master_addr}:{self.port} ({exc}); "
            "the --node-rank 0 launcher is gone"
        )

    def _count(self, key: str) -> int:
        try:
            return job_store.counter(self.store, key)
        except Exception as exc:
            if self.is_host:
                raise
            raise JobAborted(self.store_lost(exc)) from exc

    def check_abort(self) -> None:
        if self._count(f"{AGENT}/abort") > 0:
            reason = self.store.get(f"{AGENT}/abort_reason").decode()
            raise JobAborted(f"job aborted: {reason}")

    def _poll_until(self, done, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            self.check_abort()
            if time.monotonic() > deadline:
                raise LaunchError(f"timed out after {timeout:.0f} s waiting for {what}")
            time.sleep(POLL)

    def abort(self, reason: str) -> None:
        """Tell the other launchers to stop without restarting (best effort)."""
        if self.store is None or not self.multi_node:
            return
        try:
            self.store.set(f"{AGENT}/abort_reason", reason)
            self.store.add(f"{AGENT}/abort", 1)
        except Exception:  # noqa: BLE001 - the store may be what failed
            pass

    def leave(self) -> None:
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

    # -- one round ------------------------------------------------------------------------------
    def rendezvous(self, attempt: int) -> tuple[int, int]:
        """Meet the other launchers for round ``attempt``; (this node's rank offset, world size)."""
        c = self.config
        r = f"{AGENT}/round{attempt}"
        if self.store.add(f"{r}/node/{c.node_rank}", 1) > 1:
            reason = f"two launchers were started with --node-rank {c.node_rank}"
            self.abort(reason)
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

    def publish_failure(self, attempt: int, failure: Failure) -> Failure:
        """Record a local failure; return the round's root cause (the first any node recorded)."""
        r = f"{AGENT}/round{attempt}"
        if self.store.add(f"{r}/failed", 1) == 1:
            self.store.set(f"{r}/root", failure.to_json())
            self.store.add(f"{r}/root_set", 1)
            return failure
        return self._root(r)

    def remote_failure(self, attempt: int) -> Failure | None:
        """Another node's root cause for this round, if there is one yet (raises if aborted)."""
        self.check_abort()
        r = f"{AGENT}/round{attempt}"
        return self._root(r) if self._count(f"{r}/failed") > 0 else None

    def finish_round(self, attempt: int, interval: float) -> Failure | None:
        """Every local worker succeeded: wait for the other nodes; their root cause if one failed."""
        r = f"{AGENT}/round{attempt}"
        self.store.add(f"{r}/succeeded", 1)
        while self._count(f"{r}/succeeded") < self.config.nnodes:
            failure = self.remote_failure(attempt)
            if failure is not None:
                return failure
            time.sleep(interval)
        return None

    def _root(self, r: str) -> Failure:
        deadline = time.monotonic() + ROOT_WAIT
        while self._count(f"{r}/root_set") == 0:
            if time.monotonic() > deadline:
                raise JobAborted("another node reported a failed worker but not which one")
            time.sleep(POLL)
        return Failure.from_json(self.store.get(f"{r}/root"))
