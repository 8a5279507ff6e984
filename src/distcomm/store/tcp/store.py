"""TCPStore: the torch.distributed.TCPStore API over a TCPStoreServer and a TCPStoreClient.

Why this module is only glue: the server (event loop, table) and the client (connection, round
trip) are separate so each can be tested alone; this class decides *which* of them a process gets.
A master owns a server (started here, in a background thread) and, like every other TCPStore, is a
client of it — its requests are the same protocol frames, handled by the same code in the same
order, and its client counts towards ``world_size`` — but its connection is in-process (local.py):
a function call instead of two system calls and two thread hand-offs per request.

Queues and ``barrier`` are requests of their own (protocol version 2): a blocking queue_pop() and a
barrier() wait parked on the server, like a get(), and the server hands each pushed item to exactly
one pop. ``clone()`` opens another connection, so one thread can block while another writes.

``multi_tenant=True`` masters on the same host:port in one process share one server and therefore
one key space, as torch's do; the server stops when the last of them closes. ``wait_for_workers``
with a ``world_size`` makes every store send a JOIN on creation, and the master block until
``world_size`` stores joined (the master's own included), failing with "k/N clients joined".

Authentication: when DISTCOMM_AUTH_KEY_FILE or DISTCOMM_AUTH_KEY is set (auth.py), the key is read
once, here, before anything listens or connects: a master's server then requires it of every
client, and every client (the master's in-process one and clones included) demands that the server
prove it holds it too. Whoever builds a TCPStore — the constructor, env:// and tcp:// rendezvous,
distcomm-run's launcher and its workers, which inherit its environment — gets the same behaviour.
"""

from __future__ import annotations

import math
import threading
import weakref
from datetime import timedelta
from typing import TYPE_CHECKING

from ...errors import DistStoreError
from .. import rules
from ..base import Store
from ..rules import INT64_MAX, INT64_MIN
from .auth import key_from_environment
from .client import TCPStoreClient, open_client
from .frames import DEFAULT_MAX_FRAME_SIZE

if TYPE_CHECKING:
    from .server import TCPStoreServer


class _SharedServers:
    """The multi-tenant registry: (host, port) -> [server, users] for this process."""

    def __init__(self):
        # Reentrant: the garbage collector may finalize an old TCPStore (whose finalizer calls
        # release) in the middle of acquire, in the same thread. A plain lock deadlocked there:
        # a world's init_process_group hung in the differential suite.
        self._lock = threading.RLock()
        self._servers: dict[tuple[str, int], list] = {}

    def acquire(self, host: str, port: int, multi_tenant: bool, **server_options) -> TCPStoreServer:
        with self._lock:
            if multi_tenant and port != 0:
                entry = self._servers.get((host, port))
                if entry is not None:
                    entry[1] += 1
                    return entry[0]
            from .server import TCPStoreServer  # here, not at the top: a process that is no master never loads it

            server = TCPStoreServer(host, port, **server_options).start()
            if multi_tenant:
                self._servers[(host, server.port)] = [server, 1]
            return server

    def release(self, server: TCPStoreServer) -> None:
        with self._lock:
            entry = self._servers.get((server.host, server.port))
            if entry is not None and entry[0] is server:
                entry[1] -= 1
                if entry[1] > 0:
                    return
                del self._servers[(server.host, server.port)]
        server.stop()


_shared_servers = _SharedServers()


def _release(client: TCPStoreClient, server: TCPStoreServer | None) -> None:
    client.close()
    if server is not None:
        _shared_servers.release(server)


class TCPStore(Store):
    """A TCP-based distributed key-value store (torch.distributed.TCPStore).

    The master (``is_master=True``) runs the server in a background thread of its process; every
    store, the master's included, is a client of it. ``world_size`` is the number of stores that
    will connect (clients + 1 for the master); with ``wait_for_workers`` the master's constructor
    returns once they all have. ``port=0`` on the master picks a free port, readable as ``.port``.

    torch's ``master_listen_fd`` (a socket the caller bound, and maybe listens on, for the master
    to serve on instead of binding ``port``; the server owns and closes it) and ``use_libuv``
    (accepted and reported by ``libuvBackend``; distcomm has one server either way) are honoured.

    distcomm extensions, keyword-only, for a master: ``idle_timeout`` (seconds a connection may sit
    on an unfinished hello or frame, default 60), ``max_frame_size`` (bytes, default 1 GiB; also the
    limit a client accepts), ``backlog`` (listen backlog, default 4096), ``local_socket`` (offer the
    same-host Unix socket; default on, off with DISTCOMM_STORE_LOCAL_SOCKET=0).

    With DISTCOMM_AUTH_KEY_FILE (a file only its owner can read) or DISTCOMM_AUTH_KEY set, the
    server and every client authenticate each other with that key; a store without the key, or with
    another, is refused with DistStoreAuthError (a DistStoreError).
    """

    def __init__(
        self,
        host_name: str,
        port: int,
        world_size: int | None = None,
        is_master: bool = False,
        timeout: timedelta = rules.DEFAULT_TIMEOUT,
        wait_for_workers: bool = True,
        multi_tenant: bool = False,
        master_listen_fd: int | None = None,
        use_libuv: bool = True,
        **server_options,
    ):
        super().__init__(timeout)
        if not isinstance(host_name, str):
            raise TypeError(f"host_name is a str, got {type(host_name).__name__}: {host_name!r}")
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"port must be an int from 0 to 65535, got {port!r}")
        if world_size is not None and (isinstance(world_size, bool) or not isinstance(world_size, int)):
            raise TypeError(f"world_size is an int or None, got {type(world_size).__name__}: {world_size!r}")
        if world_size is not None and world_size < 0:
            world_size = None  # torch: a negative value means a non-fixed number of users
        if world_size == 0:
            raise ValueError(  # torch's sentence, then what to pass
                "TCPStore world size cannot be 0. Pass the number of stores (clients + 1 for the master), or "
                "None/-1 for a non-fixed number of stores"
            )
        if master_listen_fd is not None and (isinstance(master_listen_fd, bool) or not isinstance(master_listen_fd, int)):
            raise TypeError(f"master_listen_fd is an int or None, got {type(master_listen_fd).__name__}")
        if not is_master and port == 0:
            raise ValueError("a TCPStore client needs the master's port; port=0 only means 'pick one' on the master")
        if "auth_key" in server_options:
            raise TypeError("TCPStore takes its key from DISTCOMM_AUTH_KEY_FILE or DISTCOMM_AUTH_KEY, not auth_key=")
        self._auth_key = key_from_environment()  # before listening: a bad key file fails here
        self._host = host_name
        self._world_size = world_size
        # distcomm has one server, its own event loop; like torch it reports the backend asked for,
        # so code that branches on libuvBackend takes the branch it takes under torch
        self._use_libuv = bool(use_libuv)
        if is_master and master_listen_fd is not None:
            server_options["listen_fd"] = master_listen_fd  # adopted, as torch does; a client ignores it
        self._server = (
            _shared_servers.acquire(host_name, port, multi_tenant, auth_key=self._auth_key, **server_options)
            if is_master
            else None
        )
        self._port = self._server.port if self._server is not None else port
        max_frame_size = server_options.get("max_frame_size", DEFAULT_MAX_FRAME_SIZE)
        try:
            # the master talks to its own server in-process (see local.py); everyone else over the network
            local = self._server.connect_local() if self._server is not None else None
            self._client = open_client(
                host_name, self._port, self._timeout_s, max_frame_size, local=local, auth_key=self._auth_key
            )
        except BaseException:
            if self._server is not None:
                _shared_servers.release(self._server)
            raise
        self._finalizer = weakref.finalize(self, _release, self._client, self._server)
        if world_size is not None and wait_for_workers:
            try:
                self._client.join()
                if self._server is not None:
                    self._wait_for_workers(world_size)
            except BaseException:
                self.close()
                raise

    def _wait_for_workers(self, world_size: int) -> None:
        joined = self._server.wait_for_joins(world_size, self._timeout_s)
        if joined < world_size:
            # torch's sentences first; torch counts whole seconds ("Timed out after 1 seconds" for 0.7 s)
            raise DistStoreError(
                f"Timed out after {max(1, math.ceil(self._timeout_s))} seconds waiting for clients. "
                f"{joined}/{world_size} clients joined. The TCPStore master at {self._host}:{self._port} expected "
                f"world_size={world_size} stores (the master's own included); check that every rank started and "
                f"reaches this host and port."
            )

    def clone(self) -> "TCPStore":
        """A new connection to the same server, e.g. for another thread (a store serializes its requests)."""
        store = TCPStore.__new__(TCPStore)
        Store.__init__(store, timedelta(seconds=self._timeout_s))
        store._host, store._port, store._world_size, store._server = self._host, self._port, None, None
        store._auth_key, store._use_libuv = self._auth_key, self._use_libuv
        local = self._server.connect_local() if self._server is not None else None
        store._client = open_client(
            self._client.host, self._port, self._timeout_s, local=local, auth_key=self._auth_key
        )
        store._finalizer = weakref.finalize(store, _release, store._client, None)
        return store

    def close(self) -> None:
        """Close this store's connection; a master also releases its server (stopped when its last user closes)."""
        self._finalizer()

    def __repr__(self) -> str:
        # torch's shape: TCPStore(client=TCPClient(SocketImpl(...)), server=TCPServer(port=P) or <nullptr>)
        server = f"TCPServer(port={self._port})" if self._server is not None else "<nullptr>"
        return f"TCPStore(client={self._client.describe()}, server={server})"

    @property
    def host(self) -> str:
        """The host name this store was created with."""
        return self._host

    @property
    def port(self) -> int:
        """The server's port (the one picked when a master was created with port=0)."""
        return self._port

    @property
    def libuvBackend(self) -> bool:  # noqa: N802 - torch's name
        """``use_libuv`` as given (default True), as torch reports it. distcomm has one server (its
        Python event loop) whatever the value; reporting the value keeps code that branches on it
        on the branch it takes under torch."""
        return self._use_libuv

    def has_extended_api(self) -> bool:
        return True  # append, multi_get, multi_set and list_keys are requests of their own

    def set_timeout(self, timeout: timedelta) -> None:
        super().set_timeout(timeout)
        self._client.set_timeout(self._timeout_s)

    # -- Store ----------------------------------------------------------------------------------------
    # set, get and add are the hot path: they skip the base class's dispatch to _set/_get/_add.

    def set(self, key: str, value) -> None:
        """Inserts the key-value pair into the store; an existing key is overwritten."""
        if key.__class__ is not str:
            key = rules.as_key(key)
        self._client.set(key.encode(), value if value.__class__ is bytes else rules.as_value(value))

    def get(self, key: str) -> bytes:
        """Retrieves the value of ``key``, waiting up to the store timeout for it to be set."""
        return self._client.get(rules.as_key(key), self._timeout_s)

    def add(self, key: str, amount: int) -> int:
        """Adds ``amount`` to the counter at ``key`` (created at 0) and returns the new value."""
        if key.__class__ is not str:
            key = rules.as_key(key)
        if amount.__class__ is not int or not INT64_MIN <= amount <= INT64_MAX:
            amount = rules.as_amount(amount)
        return self._client.add(key.encode(), amount)

    def _set(self, key, value):
        self._client.set(key.encode(), value)

    def _get(self, key, timeout):
        return self._client.get(key, timeout)

    def _add(self, key, amount):
        return self._client.add(key.encode(), amount)

    def _compare_set(self, key, expected, desired):
        return self._client.compare_set(key.encode(), expected, desired)

    def _wait(self, keys, timeout):
        self._client.wait(keys, timeout)

    def _check(self, keys):
        return self._client.check([k.encode() for k in keys])

    def _num_keys(self):
        return self._client.num_keys()

    def _delete_key(self, key):
        return self._client.delete_key(key.encode())

    def _append(self, key, value):
        self._client.append(key.encode(), value)

    def _multi_get(self, keys, timeout):
        return self._client.multi_get(keys, timeout)

    def _multi_set(self, keys, values):
        self._client.multi_set([k.encode() for k in keys], values)

    def _list_keys(self):
        return [k.decode("utf-8", "replace") for k in self._client.list_keys()]

    def _queue_push(self, key, value):
        self._client.queue_push(key.encode(), value)

    def _queue_pop(self, key, block, timeout):
        return self._client.queue_pop(key, block, timeout)

    def _queue_len(self, key):
        return self._client.queue_len(key.encode())

    def _barrier(self, key, world_size, timeout):
        """One request: the server counts the arrival in ``key``'s value (as torch's TCPStore does, so
        get(key) reads the count) and answers when ``world_size`` have arrived. torch's server has no
        such request: with it, torch's add/set/wait barrier (Store's default)."""
        if self._client.speaks_torch:
            super()._barrier(key, world_size, timeout)
        else:
            self._client.barrier(key, world_size, timeout)
