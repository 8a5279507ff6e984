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
- ``/distcomm-run/abort`` (+ ``abort_reason``): a launcher was signalled or misconfigured, or node
  rank 0's lost one; everyone stops without restarting
- ``/distcomm-run/alive/<node_rank>``: the heartbeat of every launcher but node rank 0's, a counter
  a thread of that launcher bumps every ``keep_alive_interval`` s until it leaves
- ``/distcomm-run/exit`` (+ ``exit/<node_rank>``): node rank 0 keeps the store up until every
  launcher that connected has left, or is lost (at most 30 s)

Liveness: the other launchers notice that node rank 0's launcher is gone when its store is (their
next poll fails).
Node rank 0's launcher reads the others' heartbeats in every wait of its own (a rendezvous, the
running round, the wait for the other nodes' success, the exit barrier), and judges them on its own
clock: a counter that has not moved for ``keep_alive_interval * keep_alive_max_attempt`` seconds
(torchrun's keep-alive settings and defaults) belongs to a launcher that was killed, crashed or lost
its host. It then aborts the job naming that node: its workers are gone, so the job cannot complete.

Workers never see these keys: theirs live under ``/worker/attempt_<k>`` (DISTCOMM_STORE_PREFIX).
"""

from __future__ import annotations

import sys
import threading
import time
import uuid

from . import store as job_store
from .config import LaunchConfig, LaunchError
from .failure import Failure

AGENT = "/distcomm-run"
POLL = 0.05                 # seconds between store polls while launchers wait for each other
EXIT_BARRIER_TIMEOUT = 30.0
ROOT_WAIT = 5.0             # how long to wait for another node's root-cause record
HEARTBEAT_STOP_WAIT = 1.0   # how long leaving waits for a heartbeat stuck in a store call


def _heartbeat_key(node_rank: int) -> str:
    return f"{AGENT}/alive/{node_rank}"


class _Heartbeat:
    """A launcher's keep-alive: a daemon thread bumps its counter every ``interval`` seconds, so
    the launcher beats whatever its main thread is doing (stopping workers takes up to
    --shutdown-timeout). It beats through a connection of its own when it can open one, so a beat
    never queues behind the main thread's request. A failed beat ends the thread quietly: the store
    is gone, and the main thread finds out on its next poll."""

    def __init__(self, store, key: str, interval: float):
        try:
            self._store, self._owned = store.clone(), True
        except Exception:  # noqa: BLE001 - the shared client is thread-safe, only slower to share
            self._store, self._owned = store, False
        self._key, self._interval = key, min(interval, threading.TIMEOUT_MAX)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="distcomm-run-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                self._store.add(self._key, 1)
            except Exception:  # noqa: BLE001
                return
            if self._stop.wait(self._interval):
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(HEARTBEAT_STOP_WAIT)
        if self._owned and not self._thread.is_alive():  # never close a connection a beat is using
            self._store.close()


def worker_store_prefix(attempt: int) -> str:
    """The key prefix workers of round ``attempt`` must use (exported as DISTCOMM_STORE_PREFIX)."""
    return f"/worker/attempt_{attempt}"


class JobAborted(Exception):
    """Another launcher aborted the job, the store (node rank 0's launcher) went away, or node rank
    0's launcher lost another launcher."""


class Coordinator:
    """This launcher's side of the protocol above."""

    def __init__(self, config: LaunchConfig):
        self.config = config
        self.is_host = config.node_rank == 0
        self.multi_node = config.nnodes > 1
        self.store = None
        self.port = config.master_port
        self.run_id = config.run_id or ""
        self._heartbeat: _Heartbeat | None = None
        self._nprocs: list[int] = []    # every node's worker count, from the last rendezvous
        # node rank 0's view of the others' heartbeats: node -> (counter, when it was first seen at
        # that value, on this launcher's monotonic clock)
        self._beats: dict[int, tuple[int, float]] = {}
        self._lost: list[int] = []
        self._next_beat_poll = 0.0
        self._lost_after = config.keep_alive_interval * config.keep_alive_max_attempt
        self._beat_poll = max(POLL, min(1.0, config.keep_alive_interval / 2))
        self._join_hint = ""            # why other hosts may not reach the store (node rank 0)

    # -- the store ------------------------------------------------------------------------------
    def open(self) -> None:
        """Host the store (node rank 0) or connect to it; agree on the run id."""
        c = self.config
        if self.is_host:
            self.store = job_store.host_store(c.master_addr, c.master_port, c.join_timeout, self.multi_node)
            self.port = int(self.store.port)
            loopback = job_store.loopback_only(c.master_addr) if self.multi_node else None
            if loopback:
                self._join_hint = (
                    f"; the job store listens on {loopback}:{self.port}, the loopback address "
                    f"{c.master_addr!r} resolves to on this host, which other hosts cannot reach: pass this "
                    "host's address on the network the other nodes use as --master-addr (MASTER_ADDR), "
                    "or map the name to that address in /etc/hosts"
                )
                print(f"distcomm-run: warning: --master-addr {c.master_addr} resolves to {loopback} here: launchers on "
                      "other hosts cannot reach the job store there (fine if every node runs on this host)",
                      file=sys.stderr, flush=True)
            self.run_id = self.run_id or uuid.uuid4().hex[:12]
            self.store.set(f"{AGENT}/run_id", self.run_id)
            self.store.add(f"{AGENT}/run_id_set", 1)
        else:
            self.store = job_store.connect_store(c.master_addr, c.master_port, c.join_timeout)
            self._poll_until(lambda: self._count(f"{AGENT}/run_id_set") > 0, c.join_timeout,
                             "the run id from node rank 0")
            self.run_id = self.store.get(f"{AGENT}/run_id").decode()
            if self.multi_node:
                self._heartbeat = _Heartbeat(self.store, _heartbeat_key(c.node_rank), c.keep_alive_interval)

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
        """Raise JobAborted if another launcher aborted the job, or (node rank 0) one is lost."""
        self._check_abort_key()
        self._check_peers()

    def _check_abort_key(self) -> None:
        if self._count(f"{AGENT}/abort") > 0:
            reason = self.store.get(f"{AGENT}/abort_reason").decode()
            raise JobAborted(f"job aborted: {reason}")

    # -- liveness (node rank 0 judges the others) ------------------------------------------------
    def _lost_nodes(self) -> list[int]:
        """The other nodes whose launcher's heartbeat stopped (see the module docstring). Node rank
        0 only; a node that never beat (not started yet) is not judged. Read from the store at most
        every ``_beat_poll`` seconds."""
        if not (self.is_host and self.multi_node):
            return []
        now = time.monotonic()
        if now < self._next_beat_poll:
            return self._lost
        self._next_beat_poll = now + self._beat_poll
        lost = []
        for node in range(1, self.config.nnodes):
            beats = self._count(_heartbeat_key(node))
            seen = self._beats.get(node)
            if seen is None or seen[0] != beats:
                self._beats[node] = (beats, now)
            elif beats > 0 and now - seen[1] >= self._lost_after:
                lost.append(node)
        self._lost = lost
        return lost

    def _connected_nodes(self) -> list[int]:
        """The other nodes whose launcher reached the store (its first heartbeat is sent as soon
        as it has the run id, before it joins any round). Node rank 0 only."""
        return [n for n in range(1, self.config.nnodes) if self._count(_heartbeat_key(n)) > 0]

    def _left(self, node: int) -> bool:
        return self._count(f"{AGENT}/exit/{node}") > 0

    def _check_peers(self) -> None:
        lost = self._lost_nodes()
        if lost:
            self._give_up_on(lost)

    def _give_up_on(self, lost: list[int]) -> None:
        """Abort the job for the other launchers, then raise JobAborted, naming the lost nodes."""
        c = self.config
        parts = []
        for node in lost:
            if self._left(node):
                why = "its launcher exited before the job ended (its output says why)"
            else:
                why = (
                    f"its launcher sent no heartbeat for {self._lost_after:g} s (--rdzv-conf keep_alive_interval="
                    f"{c.keep_alive_interval:g} x keep_alive_max_attempt={c.keep_alive_max_attempt}): it was "
                    "killed or crashed, or its host is down or unreachable"
                )
            parts.append(f"lost node {node}{self._ranks_of(node)}: {why}")
        reason = "; ".join(parts) + f"; the job cannot complete without {'it' if len(lost) == 1 else 'them'}"
        self.abort(reason)
        raise JobAborted(reason)

    def _ranks_of(self, node: int) -> str:
        if node >= len(self._nprocs):
            return ""
        first, count = sum(self._nprocs[:node]), self._nprocs[node]
        return f" (rank {first})" if count == 1 else f" (ranks {first}-{first + count - 1})"

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
            self.store.add(f"{AGENT}/exit/{self.config.node_rank}", 1)
            self.store.add(f"{AGENT}/exit", 1)
            if self.is_host and self.multi_node:
                # a lost launcher never leaves, and one that never connected (the job failed to
                # start, or was interrupted, before it came) cannot: wait only for the live ones
                deadline = time.monotonic() + EXIT_BARRIER_TIMEOUT
                while time.monotonic() < deadline:
                    if self._count(f"{AGENT}/exit") >= self.config.nnodes:
                        break
                    gone = set(self._lost_nodes())
                    if not [n for n in self._connected_nodes() if n not in gone and not self._left(n)]:
                        break
                    time.sleep(POLL)
        except BaseException:  # noqa: BLE001 - leaving must not hide the job's result
            pass
        if self._heartbeat is not None:  # after "exit": a launcher that left is never taken for lost
            self._heartbeat.stop()
            self._heartbeat = None
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
            f"all {c.nnodes} launchers (--nnodes) to join the job at {c.master_addr}:{self.port}{self._join_hint}",
        )
        nprocs = self._nprocs = [int(self.store.get(f"{r}/nproc/{n}")) for n in range(c.nnodes)]
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
        """Another node's root cause for this round, if there is one yet (raises if aborted, or if
        another node's launcher is lost)."""
        self._check_abort_key()
        r = f"{AGENT}/round{attempt}"
        if self._count(f"{r}/failed") > 0:  # a launcher that reported a failure is not lost: it left
            return self._root(r)
        self._check_peers()
        return None

    def finish_round(self, attempt: int, interval: float) -> Failure | None:
        """Every local worker succeeded: wait for the other nodes; their root cause if one failed.
        Raises JobAborted if the job was aborted or (node rank 0) another node's launcher is lost."""
        r = f"{AGENT}/round{attempt}"
        self.store.add(f"{r}/succeeded", 1)
        while self._count(f"{r}/succeeded") < self.config.nnodes:
            self._check_abort_key()
            if self._count(f"{r}/failed") > 0:
                return self._root(r)
            lost = self._lost_nodes()
            # read again: a node may have succeeded, seen the round done and left since the first read
            if lost and self._count(f"{r}/succeeded") < self.config.nnodes:
                self._give_up_on(lost)
            time.sleep(interval)
        return None

    def _root(self, r: str) -> Failure:
        deadline = time.monotonic() + ROOT_WAIT
        while self._count(f"{r}/root_set") == 0:
            if time.monotonic() > deadline:
                raise JobAborted("another node reported a failed worker but not which one")
            time.sleep(POLL)
        return Failure.from_json(self.store.get(f"{r}/root"))
