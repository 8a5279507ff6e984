"""HybridTransport: each pair of ranks over shared memory (same host) or TCP (different hosts).

The default engine (backends/hybrid.py) connects one when the world spans hosts.

Receives from ANY_SOURCE in a world that spans hosts are posted on both transports; the first to
complete wins and the other is withdrawn. If the TCP one had already matched a message by then, the
message is kept and handed to the next matching receive (from that source or any source) before
anything else is asked of TCP. The kept messages are a Matcher's unexpected messages (the rules
every transport shares); no receive is ever posted on it.
"""

from __future__ import annotations

import threading
import time

import numpy as np

from .base import ANY_SOURCE, MessageKey, Request, Transport, TransportError, unwatch_group, watch_group
from .buffers import as_bytes
from .matching import Matcher
from .shm import ShmTransport

class _Done(Request):
    """A receive satisfied from the stash, or failed before reaching a transport."""

    def __init__(self, source: int, nbytes: int, error: TransportError | None = None):
        self.source, self.nbytes, self._error = source, nbytes, error

    def wait(self, deadline: float | None = None) -> None:
        if self._error is not None:
            raise self._error

    def test(self) -> bool:
        return True


class _AnySource(Request):
    """An ANY_SOURCE receive posted on both transports; the first to complete wins."""

    def __init__(self, hybrid: "HybridTransport", out: np.ndarray, key: MessageKey, signature: int):
        self._h = hybrid
        self._out = out
        self._key, self._sig = key, signature
        self._shm_out = np.empty_like(out)
        self._tcp_out = np.empty_like(out)
        self._shm = hybrid.shm.irecv(ANY_SOURCE, self._shm_out, key, signature)
        self._tcp = hybrid.tcp.irecv(ANY_SOURCE, self._tcp_out, key, signature)
        self._winner: Request | None = None
        self._lock = threading.Lock()

    def _settle(self) -> bool:
        with self._lock:
            if self._winner is not None:
                return True
            if self._shm.test():
                self._winner, loser, loser_out = self._shm, self._tcp, self._tcp_out
            elif self._tcp.test():
                self._winner, loser, loser_out = self._tcp, self._shm, self._shm_out
            else:
                return False
            self._withdraw(loser, loser_out)
            self._out[...] = self._shm_out if self._winner is self._shm else self._tcp_out
            self.source, self.nbytes = self._winner.source, self._winner.nbytes
            return True

    def _withdraw(self, req: Request, out: np.ndarray) -> None:
        try:
            req.wait(time.monotonic() - 1.0)  # past deadline: withdraws it unless already matched
        except TransportError:
            return
        self._h._keep(req.source, self._key, self._sig, out.copy())

    def wait(self, deadline: float | None = None) -> None:
        while not self._settle():
            if deadline is not None and time.monotonic() >= deadline:
                if self._settle():
                    break
                for req, out in ((self._shm, self._shm_out), (self._tcp, self._tcp_out)):
                    self._withdraw(req, out)
                raise TransportError("Timed out waiting to receive from any rank", reason="timeout")
            time.sleep(0.0005)  # a rare path (ANY_SOURCE across hosts): poll both transports
        self._winner.wait()

    def test(self) -> bool:
        return self._settle()


class HybridTransport(Transport):
    """Each pair over shared memory (same host) or TCP (different hosts)."""

    def __init__(self, rank: int, size: int, shm: ShmTransport | None, tcp: Transport):
        self.rank = rank
        self.size = size
        self.shm = shm
        self.tcp = tcp
        self._local = frozenset(shm.local) if shm is not None else frozenset([rank])
        self._stash = Matcher(rank, size)  # only under _stash_lock
        self._stash_lock = threading.Lock()

    @property
    def local_ranks(self) -> list[int]:
        """The ranks on this host (this one included): what goes over shared memory."""
        return sorted(self._local)

    def _route(self, peer: int) -> Transport:
        return self.shm if (self.shm is not None and peer in self._local) else self.tcp

    def isend(self, dst: int, data: np.ndarray, key: MessageKey, signature: int = 0) -> Request:
        return self._route(dst).isend(dst, data, key, signature)

    def irecv(self, src: int, out: np.ndarray, key: MessageKey, signature: int = 0) -> Request:
        if self._stash.has_unexpected():  # unlocked peek: a message kept meanwhile is another thread's race
            with self._stash_lock:
                msg = self._stash.take(src, key)
            if msg is not None:
                err = self._stash.mismatch(key, msg.src, msg.signature, msg.nbytes, signature, out.nbytes)
                if err is not None:
                    return _Done(msg.src, 0, err)
                as_bytes(out)[...] = as_bytes(msg.data)
                return _Done(msg.src, out.nbytes)
        if src == ANY_SOURCE and self.shm is not None and len(self._local) < self.size:
            return _AnySource(self, out, key, signature)
        if src == ANY_SOURCE:
            return (self.shm if len(self._local) == self.size else self.tcp).irecv(src, out, key, signature)
        return self._route(src).irecv(src, out, key, signature)

    def _keep(self, src: int, key: MessageKey, signature: int, data: np.ndarray) -> None:
        """A message that an ANY_SOURCE receive got on the transport that lost the race: the next
        receive matching it takes it."""
        with self._stash_lock:
            _, msg = self._stash.offer(src, key, signature, data.nbytes)  # nothing is posted: kept
            msg.data, msg.complete = data, True

    def watch_group(self, group_id: int, ranks) -> None:
        """A crash of a member across hosts dooms the group's TCP traffic (the TCP transport watches
        it); members on this host are watched by the shared-memory waits."""
        watch_group(self.tcp, group_id, ranks)

    def unwatch_group(self, group_id: int) -> None:
        unwatch_group(self.tcp, group_id)

    def close(self) -> None:
        try:
            if self.shm is not None:
                self.shm.close()
        finally:
            self.tcp.close()

    def __repr__(self) -> str:
        return f"HybridTransport(rank={self.rank}, size={self.size}, local={sorted(self._local)})"
