"""Tuning: every performance knob of distcomm's engines, read from the environment once.

``Tuning.from_env()`` is called when an engine is connected (``init_process_group``, or
``new_group`` with another backend) and the frozen result travels with the engine: nothing below
reads the environment while collectives run, so a knob changed mid-job changes nothing until the
next init, and every choice an engine makes is a pure function of its Tuning and the call.

The names follow one scheme, ``DISTCOMM_[SHM_]<KIND>_<NAME>``: no engine part for the generic
(point-to-point) algorithms, ``SHM_`` for the shared-memory engine.

=====================================  =======================================================
variable                               meaning (default)
=====================================  =======================================================
``DISTCOMM_ALGO_<OP>``                 force a generic algorithm for ``<OP>`` (ALLREDUCE,
                                       BROADCAST, REDUCE, ALLGATHER, GATHER, SCATTER,
                                       REDUCESCATTER, ALLTOALL, BARRIER; underscores optional):
                                       a name of ``_algorithms/select.ALGORITHMS``, or
                                       ``reference``
``DISTCOMM_THRESHOLD_<NAME>``          a generic selection threshold in bytes
                                       (``_algorithms/select.THRESHOLDS``)
``DISTCOMM_SHM_COLLECTIVES``           0: the shared-memory engine runs the generic algorithms
                                       over its rings instead of its own collectives (1)
``DISTCOMM_SHM_ALGO_<OP>``             force a shared-memory algorithm: ALLREDUCE =
                                       direct|slices|readv; BROADCAST, ALLGATHER, REDUCE,
                                       REDUCESCATTER, ALLTOALL, SCATTER, GATHER = slots|readv;
                                       also BROADCAST = split, GATHER = writev
``DISTCOMM_SHM_THRESHOLD_<NAME>``      a shared-memory selection threshold in bytes
                                       (the shared-memory engine's ``THRESHOLDS``)
``DISTCOMM_SHM_SLOT_BYTES``            bytes per slot of a group's shared memory (1 MiB)
``DISTCOMM_SHM_SLOTS``                 slots per rank and group (4; from 2 to 32)
``DISTCOMM_SHM_RING_BYTES``            point-to-point ring per pair of ranks
``DISTCOMM_SHM_SPIN_US``               spin before yielding while waiting (20 µs; 0 when there
                                       are more local ranks than CPUs)
``DISTCOMM_SHM_YIELD_US``              yield before sleeping (100 µs; 50 when oversubscribed)
``DISTCOMM_SHM_SHARED_YIELD_US``       yield when the awaited peer shares our CPU (200 µs)
``DISTCOMM_SHM_DIRECT``                0: no single-copy reads (process_vm_readv) (1)
``DISTCOMM_SHM_NATIVE``                0: no C at all in the shared-memory engine, even where it
                                       is built: every round step, round plan and whole small
                                       call in Python (1)
``DISTCOMM_SHM_DEFER``                 0: a small rooted collective run in C waits for every
                                       member's post and checks it at once, instead of
                                       leaving the members it does not read to a later call (1)
=====================================  =======================================================

Not tuning, and so not here: where things are (``DISTCOMM_SHM_DIR``, ``DISTCOMM_HOST_ID``,
``DISTCOMM_SOCKET_IFNAME``, ``DISTCOMM_TCP_LOCAL_SOCKET``), security (``DISTCOMM_AUTH_KEY[_FILE]``), the store
(``DISTCOMM_STORE_*``) and debugging (``DISTCOMM_DEBUG``, ``DISTCOMM_TRACE_BUFFER_SIZE`` and
``DISTCOMM_TRACE_DIR`` in flight_recorder.py); each is read where it is used, once, when that thing is
set up.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping

_OFF = ("0", "false", "no", "off")


def _mapping(prefix: str, environ: Mapping[str, str], convert) -> Mapping:
    """``{name: convert(value)}`` of the variables named ``prefix + NAME`` (NAME lower-cased)."""
    found = {}
    for key, value in environ.items():
        if key.startswith(prefix) and value != "":
            name = key[len(prefix):].lower()
            found[name] = convert(key, value)
    return MappingProxyType(found)


def _bytes(key: str, value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise ValueError(f"{key}={value!r} is not a number of bytes") from None
    if n < 0:
        raise ValueError(f"{key}={value!r}: a number of bytes must not be negative")
    return n


def _name(key: str, value: str) -> str:
    return value.strip().lower()


def _op_names(mapping: Mapping[str, str]) -> Mapping[str, str]:
    """Op names without underscores: ALL_REDUCE and ALLREDUCE name the same op."""
    return MappingProxyType({k.replace("_", ""): v for k, v in mapping.items()})


def _int(environ: Mapping[str, str], key: str) -> int | None:
    value = environ.get(key)
    return None if value in (None, "") else _bytes(key, value)


def _micros(environ: Mapping[str, str], key: str) -> float | None:
    value = environ.get(key)
    if value in (None, ""):
        return None
    try:
        return float(value) * 1e-6
    except ValueError:
        raise ValueError(f"{key}={value!r} is not a number of microseconds") from None


@dataclass(frozen=True)
class Tuning:
    """The knobs (see the module docstring); None or an empty mapping means "the default"."""

    algorithms: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    thresholds: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    shm_collectives: bool = True
    shm_algorithms: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    shm_thresholds: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    shm_slot_bytes: int | None = None
    shm_slots: int | None = None
    shm_ring_bytes: int | None = None
    shm_spin_s: float | None = None
    shm_yield_s: float | None = None
    shm_shared_yield_s: float | None = None
    shm_direct: bool = True
    shm_native: bool = True
    shm_defer: bool = True

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "Tuning":
        env = os.environ if environ is None else environ
        return cls(
            algorithms=_op_names(_mapping("DISTCOMM_ALGO_", env, _name)),
            thresholds=_mapping("DISTCOMM_THRESHOLD_", env, _bytes),
            shm_collectives=env.get("DISTCOMM_SHM_COLLECTIVES", "1").lower() not in _OFF,
            shm_algorithms=_op_names(_mapping("DISTCOMM_SHM_ALGO_", env, _name)),
            shm_thresholds=_mapping("DISTCOMM_SHM_THRESHOLD_", env, _bytes),
            shm_slot_bytes=_int(env, "DISTCOMM_SHM_SLOT_BYTES"),
            shm_slots=_int(env, "DISTCOMM_SHM_SLOTS"),
            shm_ring_bytes=_int(env, "DISTCOMM_SHM_RING_BYTES"),
            shm_spin_s=_micros(env, "DISTCOMM_SHM_SPIN_US"),
            shm_yield_s=_micros(env, "DISTCOMM_SHM_YIELD_US"),
            shm_shared_yield_s=_micros(env, "DISTCOMM_SHM_SHARED_YIELD_US"),
            shm_direct=env.get("DISTCOMM_SHM_DIRECT", "1").lower() not in _OFF,
            shm_native=env.get("DISTCOMM_SHM_NATIVE", "1").lower() not in _OFF,
            shm_defer=env.get("DISTCOMM_SHM_DEFER", "1").lower() not in _OFF,
        )

    def algorithm(self, op_key: str) -> str | None:
        """The generic algorithm forced for ``op_key`` ("allreduce", "reduce_scatter", ...), if any."""
        return self.algorithms.get(op_key.replace("_", ""))

    def shm_algorithm(self, op_key: str) -> str | None:
        """The shared-memory algorithm forced for ``op_key``, if any."""
        return self.shm_algorithms.get(op_key.replace("_", ""))


DEFAULT = Tuning()
