"""Backend names and the engine registry.

A backend name (what the user passes to init_process_group / new_group) resolves to an *engine
factory*: ``factory(store, rank, size, timeout_seconds, tuning, options) -> Engine`` (engine.py;
``tuning`` is the Tuning read when the engine is connected, tuning.py). distcomm's
engines register here, one line each, at the bottom of this module. ``Backend.register_backend(name,
func)`` plugs in a third-party one: ``func`` receives ``(store, rank, size, timeout)`` and returns
an ``Engine``, or a ``distcomm.transport.base.Transport``, which then runs the generic algorithms
(``GenericEngine``).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Callable

from ..tuning import Tuning
from .engine import Engine

EngineFactory = Callable[..., Engine]

_ENGINES: dict[str, EngineFactory] = {}


def _tcp_engine(store, rank: int, size: int, timeout: float, tuning: Tuning, options: Any = None) -> Engine:
    from ..transport.tcp import TcpTransport
    from .generic import GenericEngine

    return GenericEngine(TcpTransport.connect(store, rank, size, timeout), tuning)


def _shm_engine(store, rank: int, size: int, timeout: float, tuning: Tuning, options: Any = None) -> Engine:
    from . import shm

    return shm.connect(store, rank, size, timeout, tuning, options)


def _default_engine(store, rank: int, size: int, timeout: float, tuning: Tuning, options: Any = None) -> Engine:
    from . import hybrid

    return hybrid.connect(store, rank, size, timeout, tuning, options)


def _mpi_engine(store, rank: int, size: int, timeout: float, tuning: Tuning, options: Any = None) -> Engine:
    from . import mpi

    return mpi.connect(store, rank, size, timeout, tuning, options)


def _world_of_one(tuning: Tuning) -> Engine:
    # A world of one needs no peers; the in-process transport serves it without sockets.
    from ..transport.inproc import InprocTransport
    from .generic import GenericEngine

    return GenericEngine(InprocTransport.create_world(1)[0], tuning)


def _unavailable(name: str, why: str) -> EngineFactory:
    def factory(*args, **kwargs):
        raise RuntimeError(f"backend {name!r} is not available here: {why}")

    return factory


class Backend(str):
    """An enum-like class of backend names: ``Backend("GLOO") == "gloo"``.

    distcomm's engines: "gloo" (the default CPU engine, the name torch programs already use: shared
    memory within a host, TCP between hosts), "shm" (shared memory only, one host), "tcp" (sockets
    between any hosts), "mpi" (MPI through mpi4py, under mpiexec or srun). "nccl" and "ucc" are
    recognised names whose engines are not available in this build. New engines are added with
    ``Backend.register_backend``.
    """

    UNDEFINED = "undefined"
    GLOO = "gloo"
    NCCL = "nccl"
    UCC = "ucc"
    MPI = "mpi"
    TCP = "tcp"
    backend_list = [UNDEFINED, GLOO, NCCL, UCC, MPI, TCP]
    default_device_backend_map = {"cpu": GLOO}

    def __new__(cls, name: str):
        if not isinstance(name, str):
            raise ValueError(f"Backend constructor parameter must be string-ish, got {type(name).__name__}")
        value = getattr(Backend, name.upper(), Backend.UNDEFINED)
        if value == Backend.UNDEFINED:
            value = name.lower()
        if value not in _ENGINES and value not in Backend.backend_list:
            raise ValueError(
                f"Invalid backend: '{name}'; available: {', '.join(sorted(set(Backend.backend_list) | set(_ENGINES)))}"
            )
        return str.__new__(cls, value)

    def __reduce__(self):
        # Unpickle as the plain name: a process where a third-party name was never registered
        # (a parent receiving get_backend() from a worker) could not rebuild a Backend of it.
        return (str, (str(self),))

    @classmethod
    def register_backend(cls, name: str, func: EngineFactory, extended_api: bool = False, devices=None) -> None:
        """Register a third-party engine under ``name`` (also reachable as ``Backend.NAME``).

        ``func(store, rank, size, timeout)`` (with ``extended_api=True``:
        ``func(store, rank, size, timeout, pg_options)``) returns a distcomm ``Engine``, or a
        ``Transport`` that the generic algorithms then run over.
        """
        if hasattr(Backend, name.upper()) and name.lower() in _ENGINES:
            raise ValueError(f"{name.upper()} c10d backend already exist")
        if name.upper() in Backend.__dict__ and name.lower() not in ("mpi", "nccl", "ucc"):
            raise ValueError(f"{name.upper()} c10d backend creator function already exist")
        setattr(Backend, name.upper(), name.lower())
        Backend.backend_list.append(name.lower())

        def factory(store, rank, size, timeout, tuning, options=None):
            td = timedelta(seconds=timeout)
            made = func(store, rank, size, td, options) if extended_api else func(store, rank, size, td)
            return _as_engine(made, name, tuning)

        _ENGINES[name.lower()] = factory


def resolve_engine(name: str) -> EngineFactory:
    try:
        return _ENGINES[name]
    except KeyError:
        raise ValueError(
            f"Invalid backend: '{name}'; distcomm runs 'gloo' (default), 'tcp'"
            + (", " + ", ".join(sorted(n for n in _ENGINES if n not in ("gloo", "tcp"))) if len(_ENGINES) > 2 else "")
        ) from None


def _as_engine(made: Any, name: str, tuning: Tuning) -> Engine:
    from ..transport.base import Transport
    from .generic import GenericEngine

    if isinstance(made, Engine):
        return made
    if isinstance(made, Transport):
        return GenericEngine(made, tuning)
    raise TypeError(
        f"backend {name!r}: the registered function returned {type(made).__name__}; it must return a "
        "distcomm.backends.engine.Engine or a distcomm.transport.base.Transport"
    )


def connect(name: str, store, rank: int, size: int, timeout: float, options: Any = None) -> Engine:
    """Connect this rank to the engine ``name`` among ``size`` ranks (``timeout`` in seconds), with
    the Tuning of the environment as it is now."""
    tuning = Tuning.from_env()
    if size == 1 and name in ("gloo", "tcp"):
        return _world_of_one(tuning)
    return resolve_engine(name)(store, rank, size, timeout, tuning, options)


def register_engine(name: str, factory: EngineFactory) -> None:
    """Internal: bind a backend name to an engine factory (distcomm's own engines)."""
    _ENGINES[name] = factory


register_engine("tcp", _tcp_engine)
register_engine("shm", _shm_engine)  # shared memory only: every rank on one host
register_engine("gloo", _default_engine)  # the default CPU engine: shared memory within a host, TCP between hosts
register_engine("mpi", _mpi_engine)  # MPI (mpi4py) among the processes of one MPI job
register_engine("nccl", _unavailable("nccl", "NCCL needs CUDA GPUs; this build of distcomm runs on CPU"))
register_engine("ucc", _unavailable("ucc", "distcomm has no UCC engine"))
