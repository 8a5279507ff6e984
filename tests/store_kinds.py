"""Every kind of store the conformance suites run against, built the same way.

A *kind* makes a fresh, empty store and knows how to open a *peer*: a second handle onto the same
keys that another thread can block on independently (a TCPStore client serializes its own requests,
as torch's does, so a thread blocked in get() on one handle must not be the one another thread
sets through). PrefixStore appears over every base kind, and TCPStore both as the master's own
client and as a separate client.
"""

from __future__ import annotations

import itertools
import os
import tempfile
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Callable

from distcomm.store import FileStore, HashStore, PrefixStore, Store, TCPStore

_counter = itertools.count()


@dataclass
class Opened:
    store: Store
    peer: Callable[[], Store]  # another handle onto the same keys
    kind: str
    _cleanups: list = field(default_factory=list)

    def close(self) -> None:
        for cleanup in reversed(self._cleanups):
            cleanup()


def _hash() -> Opened:
    store = HashStore()
    return Opened(store, lambda: store, "hash")


def _file() -> Opened:
    path = os.path.join(tempfile.gettempdir(), f"distcomm-test-store-{os.getpid()}-{next(_counter)}")
    store = FileStore(path)
    opened = Opened(store, lambda: None, "file")
    peers = []

    def peer():
        peers.append(FileStore(path))
        return peers[-1]

    def cleanup():
        for s in [*peers, store]:
            s.close()
        if os.path.exists(path):
            os.unlink(path)

    opened.peer = peer
    opened._cleanups.append(cleanup)
    return opened


def _tcp_master() -> Opened:
    store = TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=30))
    clones = []

    def peer():
        clones.append(store.clone())
        return clones[-1]

    opened = Opened(store, peer, "tcp-master")
    opened._cleanups.append(lambda: [s.close() for s in [store, *clones]])
    return opened


def _tcp_client(**server_options) -> Opened:
    master = TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=30), **server_options)
    client = TCPStore("127.0.0.1", master.port, None, False, timeout=timedelta(seconds=30))
    clones = []

    def peer():
        clones.append(TCPStore("127.0.0.1", master.port))
        return clones[-1]

    opened = Opened(client, peer, "tcp-client")
    opened._cleanups.append(lambda: [s.close() for s in [client, *clones, master]])
    return opened


BASE_KINDS: dict[str, Callable[[], Opened]] = {
    "hash": _hash,
    "file": _file,
    "tcp-master": _tcp_master,  # the master's in-process connection
    "tcp-client": _tcp_client,  # a same-host client: moved to the server's Unix socket
}


def _prefixed(base: Callable[[], Opened]) -> Callable[[], Opened]:
    def make() -> Opened:
        inner = base()
        store = PrefixStore("group0", inner.store)
        return Opened(store, lambda: PrefixStore("group0", inner.peer()), "prefix-" + inner.kind, [inner.close])

    return make


KINDS: dict[str, Callable[[], Opened]] = {
    **BASE_KINDS,
    **{f"prefix-{name}": _prefixed(make) for name, make in BASE_KINDS.items()},
    "tcp-client-over-tcp": lambda: _tcp_client(local_socket=False),  # a client on another host
}
