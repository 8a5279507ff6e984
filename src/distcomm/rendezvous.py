"""Rendezvous: turn an init_method URL into (store, rank, world_size), as torch.distributed.rendezvous does.

Why a registry of generators: ``init_process_group`` only needs the triple, and users with their own
discovery mechanism register a scheme instead of patching distcomm. A handler is a generator that
yields one (store, rank, world_size) triple; asking it again means a re-rendezvous, which none of
the bundled methods support (they raise, as torch's do).

Bundled schemes:

* ``env://`` — MASTER_ADDR, MASTER_PORT, WORLD_SIZE and RANK from the environment (rank and
  world_size may come from the arguments or the URL query instead); rank 0 hosts the TCPStore.
  Under ``mpiexec`` or ``srun`` the launcher's variables fill in what is missing
  (launcher_env.py): rank and size, and the store's address agreed over MPI (mpi4py) or taken
  from the Slurm node list.
* ``tcp://host:port?rank=R&world_size=N`` — the same, with the address in the URL.
* ``file:///path?rank=R&world_size=N`` — a FileStore on a shared file system.

``rank``/``world_size`` given as arguments are merged into the URL query; giving them both ways is
an error (torch asserts the same).

Authentication: env:// and tcp:// build their TCPStore with the ordinary constructor, which reads
DISTCOMM_AUTH_KEY_FILE / DISTCOMM_AUTH_KEY (store/tcp/auth.py): with a key set in every process,
rank 0's store requires it of every client and the clients require rank 0's store to prove it.
file:// has no server to authenticate; the file system's permissions protect it.
"""

from __future__ import annotations

import importlib.util
import numbers
import os
import socket
from datetime import timedelta
from typing import Callable, Iterator
from urllib.parse import parse_qsl, urlencode, urlparse, urlunparse

from . import launcher_env
from .store import PrefixStore, Store, TCPStore
from .store.file import RendezvousFileStore

DEFAULT_TIMEOUT = timedelta(minutes=30)  # torch's default_pg_timeout

RendezvousHandler = Callable[..., Iterator[tuple[Store, int, int]]]
_handlers: dict[str, RendezvousHandler] = {}

__all__ = ["rendezvous", "register_rendezvous_handler"]


class NodeArgumentsTwiceError(AssertionError, ValueError):
    """rank/world_size given both in the URL and as arguments. torch raises AssertionError (with the
    text kept word for word above); distcomm raised ValueError before, so it is both, and code
    written for either catches it."""


def register_rendezvous_handler(scheme: str, handler: RendezvousHandler) -> None:
    """Register ``handler`` for URLs ``scheme://...``.

    ``handler(url, **kwargs)`` must be a generator function that yields a (store, rank, world_size)
    triple; ``url`` already carries ``rank`` and ``world_size`` in its query when they were given.
    """
    if scheme in _handlers:
        raise RuntimeError(f"Rendezvous handler for {scheme}:// already registered")
    _handlers[scheme] = handler


def rendezvous(url: str, rank: int = -1, world_size: int = -1, **kwargs) -> Iterator[tuple[Store, int, int]]:
    """An iterator yielding (store, rank, world_size) for ``url`` (env://, tcp://, file:// or a registered scheme)."""
    if not isinstance(url, (str, bytes)):
        raise RuntimeError(f"`url` must be a string. {type(url)}: {url}")
    if isinstance(url, bytes):
        url = url.decode()
    if not isinstance(rank, numbers.Integral):
        raise RuntimeError(f"`rank` must be an integer. {rank}")
    if not isinstance(world_size, numbers.Integral):
        raise RuntimeError(f"`world_size` must be an integer. {world_size}")
    parsed = urlparse(url)
    query = dict(parse_qsl(parsed.query))
    if rank != -1 or world_size != -1:
        if "rank" in query or "world_size" in query:
            raise NodeArgumentsTwiceError(
                f"The url: {url} has node-specific arguments(rank, world_size) already. Pass them either in the "
                f"URL or as arguments, not both."
            )
        if rank != -1:
            query["rank"] = str(int(rank))
        if world_size != -1:
            query["world_size"] = str(int(world_size))
        url = urlunparse(parsed._replace(query=urlencode(query)))
    handler = _handlers.get(parsed.scheme)
    if handler is None:
        known = ", ".join(f"{s}://" for s in sorted(_handlers))
        raise RuntimeError(f"No rendezvous handler for {parsed.scheme}:// (registered: {known})")
    return handler(url, **kwargs)


def _error(scheme: str, message: str) -> ValueError:
    return ValueError(f"Error initializing distcomm using {scheme}:// rendezvous: {message}")


def _int_param(scheme: str, query: dict, name: str, fix: str) -> int:
    if name not in query:
        raise _error(scheme, f"{name} parameter missing; {fix}")
    try:
        return int(query[name])
    except ValueError:
        raise _error(scheme, f"{name}={query[name]!r} is not an integer") from None


def _checked_rank(scheme: str, rank: int, world_size: int) -> None:
    if world_size <= 0:
        raise _error(scheme, f"world_size must be positive, got {world_size}")
    if not 0 <= rank < world_size:
        raise _error(scheme, f"rank {rank} is outside 0..{world_size - 1} (world_size={world_size})")


def _tcp_store(host: str, port: int, rank: int, world_size: int, timeout: timedelta) -> TCPStore:
    """Rank 0 hosts the server (multi-tenant, so several groups in one process may share the port)."""
    return TCPStore(host, port, world_size, is_master=(rank == 0), timeout=timeout, multi_tenant=True)


def _tcp_rendezvous_handler(url: str, timeout: timedelta = DEFAULT_TIMEOUT, **kwargs):
    parsed = urlparse(url)
    if not parsed.hostname:
        raise _error("tcp", f"host missing in {url!r}; use tcp://<master address>:<port>")
    try:
        port = parsed.port
    except ValueError as exc:
        raise _error("tcp", f"bad port in {url!r}: {exc}") from None
    if port is None:
        raise _error("tcp", f"port number missing in {url!r}; use tcp://<master address>:<port>")
    query = dict(parse_qsl(parsed.query))
    rank = _int_param("tcp", query, "rank", "add ?rank=<r> to the URL or pass rank=")
    world_size = _int_param("tcp", query, "world_size", "add &world_size=<n> to the URL or pass world_size=")
    _checked_rank("tcp", rank, world_size)
    # like torch's: under a launcher hosting the store (TORCHELASTIC_USE_AGENT_STORE=True) every rank connects
    yield _env_store(parsed.hostname, port, rank, world_size, timeout), rank, world_size
    raise RuntimeError("Unable to perform re-rendezvous using tcp:// method")


_ENV_FIXES = {
    "RANK": "set RANK to this process's rank (0..WORLD_SIZE-1) or pass rank= to init_process_group",
    "WORLD_SIZE": "set WORLD_SIZE to the number of processes or pass world_size= to init_process_group",
    "MASTER_ADDR": "set MASTER_ADDR to the address of the rank 0 host (127.0.0.1 on one machine)",
    "MASTER_PORT": "set MASTER_PORT to a free port on the rank 0 host (e.g. 29500)",
}


def _env(name: str) -> str:
    value = os.environ.get(name)
    if not value:
        raise _error("env", f"environment variable {name} expected, but not set; {_ENV_FIXES[name]}")
    return value


def _env_int(name: str) -> int:
    value = _env(name)
    try:
        return int(value)
    except ValueError:
        raise _error("env", f"environment variable {name}={value!r} is not an integer; {_ENV_FIXES[name]}") from None


def _env_rendezvous_handler(url: str, timeout: timedelta = DEFAULT_TIMEOUT, **kwargs):
    query = dict(parse_qsl(urlparse(url).query))
    env = os.environ
    have_rank = "rank" in query or bool(env.get("RANK"))
    have_size = "world_size" in query or bool(env.get("WORLD_SIZE"))
    launch = None
    if not (have_rank and have_size and env.get("MASTER_ADDR") and env.get("MASTER_PORT")):
        # started by mpiexec or srun: their variables fill in what torch's leave out
        try:
            launch = launcher_env.detect(env, importlib.util.find_spec("mpi4py") is not None)
        except launcher_env.LaunchEnvError as exc:
            raise _error("env", str(exc)) from None
    if launch is None:
        rank = int(query["rank"]) if "rank" in query else _env_int("RANK")
        world_size = int(query["world_size"]) if "world_size" in query else _env_int("WORLD_SIZE")
        master_addr = _env("MASTER_ADDR")
        master_port = _env_int("MASTER_PORT")
    else:
        rank = int(query["rank"]) if "rank" in query else (_env_int("RANK") if env.get("RANK") else launch.rank)
        world_size = (int(query["world_size"]) if "world_size" in query
                      else _env_int("WORLD_SIZE") if env.get("WORLD_SIZE") else launch.world_size)
        master_addr, master_port = launch.master_addr, launch.master_port
    if master_port is not None and not 0 <= master_port <= 65535:
        raise _error("env", f"MASTER_PORT={master_port} is not a port (0..65535)")
    _checked_rank("env", rank, world_size)
    if launch is not None and launch.store_via == launcher_env.VIA_MPI:
        store = _mpi_store(master_addr, master_port, rank, world_size, timeout)
    elif launch is not None and launch.store_via == launcher_env.VIA_NONE:
        raise _error("env", f"started by {launch.launcher} (rank {rank} of {world_size}), but nothing says where "
                     "the store is: set MASTER_ADDR and MASTER_PORT, or install mpi4py (pip install "
                     "'distcomm[mpi]') so that rank 0 can tell the others over MPI")
    else:
        store = _env_store(master_addr, master_port, rank, world_size, timeout)
    yield store, rank, world_size
    raise RuntimeError("Unable to perform re-rendezvous using env:// method")


def _mpi_store(host: str | None, port: int | None, rank: int, world_size: int, timeout: timedelta) -> Store:
    """The job's TCPStore, its address agreed over MPI: rank 0 starts it on ``port`` (None: a free
    one) and broadcasts ``host:port`` (``host`` None: rank 0's hostname) on a communicator of its own.

    The server listens on ``host`` only, when it is given (MASTER_ADDR, or 127.0.0.1 for a job on one
    host); with no address given at all it listens on every interface and publishes its hostname."""
    from .transport.mpi import load_mpi

    MPI = load_mpi(multiple=False)  # one broadcast from this thread: any thread level will do
    comm = MPI.COMM_WORLD.Dup()
    try:
        if comm.Get_rank() != rank or comm.Get_size() != world_size:
            raise _error("env", f"rank {rank} of {world_size} from the launcher's variables, but MPI_COMM_WORLD says "
                         f"rank {comm.Get_rank()} of {comm.Get_size()}; set MASTER_ADDR and MASTER_PORT instead")
        if rank == 0:
            failure = None
            try:
                # exactly where MASTER_ADDR says when it is set (a name resolves on this host as
                # the clients will reach it, ::1 included); the wildcard only when nothing says
                bind = host or ""
                store = TCPStore(bind, port or 0, world_size, is_master=True, timeout=timeout,
                                 wait_for_workers=False, multi_tenant=True)
                message = (host or socket.gethostname(), store.port, None)
            except Exception as exc:  # noqa: BLE001 - told to the others, then raised
                failure, message = exc, (None, None, f"{type(exc).__name__}: {exc}")
            comm.bcast(message, root=0)
            if failure is not None:
                raise failure
            return store
        host, port, error = comm.bcast(None, root=0)
        if error is not None:
            raise _error("env", f"rank 0 could not start the store: {error}")
        return TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    finally:
        comm.Free()


def _env_store(host: str, port: int, rank: int, world_size: int, timeout: timedelta) -> Store:
    """The job's store. Under distcomm-run / torchrun the launcher already hosts it
    (TORCHELASTIC_USE_AGENT_STORE=True): every rank, rank 0 included, connects as a client, and
    keys live under the round's prefix so a restarted round never reads an earlier round's keys."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return _tcp_store(host, port, rank, world_size, timeout)
    client = TCPStore(host, port, None, is_master=False, timeout=timeout)
    prefix = os.environ.get("DISTCOMM_STORE_PREFIX") or (
        f"/worker/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    )
    return PrefixStore(prefix, client)


def _file_rendezvous_handler(url: str, **kwargs):
    parsed = urlparse(url)
    path = parsed.path
    if not path:
        raise _error("file", f"path missing in {url!r}; use file:///absolute/path/to/a/new/file")
    query = dict(parse_qsl(parsed.query))
    rank = _int_param("file", query, "rank", "add ?rank=<r> to the URL or pass rank=")
    world_size = _int_param("file", query, "world_size", "add &world_size=<n> to the URL or pass world_size=")
    _checked_rank("file", rank, world_size)
    # The ranks hold the file open until init is over, so a file nobody holds is a finished or a
    # failed run's (ranks that timed out and exited): start it afresh rather than read its keys.
    yield RendezvousFileStore(path, world_size), rank, world_size
    raise RuntimeError("Unable to perform re-rendezvous using file:// method")


register_rendezvous_handler("tcp", _tcp_rendezvous_handler)
register_rendezvous_handler("env", _env_rendezvous_handler)
register_rendezvous_handler("file", _file_rendezvous_handler)
