"""Engines built on host identity: "shm" (shared memory only) and the default (shm within a host,
TCP between hosts, per pair of ranks).

The default engine ("gloo", or backend=None) asks every rank for its host id (hostid.py). When the
whole world is on one host, which is the common case, it *is* the shared-memory transport: no
sockets at all. Otherwise each rank connects a ShmTransport among the ranks of its own host and a
TcpTransport to the world, and ``HybridTransport`` sends each message over the right one. Its
collectives run through shared memory for groups entirely on one host and fall back to the
generic algorithms (over both transports) for groups that span hosts.

Receives from ANY_SOURCE in a world that spans hosts are posted on both transports; the first to
complete wins and the other is withdrawn. If the TCP one had already matched a message by then, the
message is kept and handed to the next matching receive (from that source or any source) before
anything else is asked of TCP.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import numpy as np

from . import hostid
from .base import ANY_SOURCE, MessageKey, Request, Transport, TransportError
from .shm import ShmTransport


def connect_shm(store, rank: int, size: int, timeout: float, options=None) -> ShmTransport:
    """The "shm" engine: every rank must be on this host."""
    hosts = hostid.exchange(store, rank, size)
    if len(set(hosts)) > 1:
        # Every rank raises the same error. Rank 0 (which hosts the store under env://) waits until
        # the others are done with the store, or its exit would turn their error into a lost
        # connection.
        if rank == 0:
            store.wait([f"hostid/refused/{q}" for q in range(1, size)], timedelta(seconds=timeout))
        else:
            store.set(f"hostid/refused/{rank}", "1")
        raise RuntimeError(
            f"backend 'shm' needs every rank on one host, but {hostid.describe(hosts)}. Use backend "
            "'gloo' (the default: shared memory within a host, TCP between hosts) or 'tcp'."
        )
    return ShmTransport.connect(store, rank, size, timeout)


def connect_default(store, rank: int, size: int, timeout: float, options=None) -> Transport:
    """The default CPU engine: shared memory between ranks of a host, TCP between hosts."""
    hosts = hostid.exchange(store, rank, size)
    local = [q for q in range(size) if hosts[q] == hosts[rank]]
    if len(local) == size:
        return ShmTransport.connect(store, rank, size, timeout)
    from .tcp import TcpTransport

    shm = ShmTransport.connect(store, rank, size, timeout, local) if len(local) > 1 else None
    try:
        tcp = TcpTransport.connect(store, rank, size, timeout)
    except BaseException:
        if shm is not None:
            shm.close()
        raise
    return HybridTransport(rank, size, shm, tcp)


class _Stashed:
    __slots__ = ("src", "key", "signature", "data")

    def __init__(self, src, key, signature, data):
        self.src, self.key, self.signature, self.data = src, key, signature, data


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
        self._h._stash.append(_Stashed(req.source, self._key, self._sig, out.copy()))

    def wait(self, deadline: float | None = None) -> None:
        while not self._settle():
            if deadline is not None and time.monotonic() >= deadline:
                if self._settle():
                    break
                for req, out in ((self._shm, self._shm_out), (self._tcp, self._tcp_out)):
                    self._withdraw(req, out)
                raise TransportError("timed out waiting to receive from any rank", reason="timeout")
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
        self._stash: list[_Stashed] = []
        self._stash_lock = threading.Lock()

    @property
    def collectives(self):
        return None if self.shm is None else self.shm.collectives

    def _route(self, peer: int) -> Transport:
        return self.shm if (self.shm is not None and peer in self._local) else self.tcp

    def isend(self, dst: int, data: np.ndarray, key: MessageKey, signature: int = 0) -> Request:
        return self._route(dst).isend(dst, data, key, signature)

    def irecv(self, src: int, out: np.ndarray, key: MessageKey, signature: int = 0) -> Request:
        if self._stash:
            with self._stash_lock:
                for i, m in enumerate(self._stash):
                    if m.key == key and src in (ANY_SOURCE, m.src):
                        del self._stash[i]
                        if m.signature != signature or m.data.nbytes != out.nbytes:
                            return _Done(m.src, 0, TransportError(
                                f"message from rank {m.src} does not match the receive posted on rank {self.rank}",
                                peer=m.src, reason="mismatch"))
                        out.reshape(-1).view(np.uint8)[...] = m.data.reshape(-1).view(np.uint8)
                        return _Done(m.src, out.nbytes)
        if src == ANY_SOURCE and self.shm is not None and len(self._local) < self.size:
            return _AnySource(self, out, key, signature)
        if src == ANY_SOURCE:
            return (self.shm if len(self._local) == self.size else self.tcp).irecv(src, out, key, signature)
        return self._route(src).irecv(src, out, key, signature)

    def release_group(self, gid: int) -> None:
        """Free group ``gid``'s shared memory (see ShmTransport.release_group)."""
        if self.shm is not None:
            self.shm.release_group(gid)

    def close(self) -> None:
        try:
            if self.shm is not None:
                self.shm.close()
        finally:
            self.tcp.close()

    def __repr__(self) -> str:
        return f"HybridTransport(rank={self.rank}, size={self.size}, local={sorted(self._local)})"
