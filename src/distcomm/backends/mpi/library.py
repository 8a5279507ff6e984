"""The MPI library mpi4py loaded, for the calls in C (_mpi_calls.c): the addresses of its own
``MPI_Start`` and ``MPI_Test``.

Why: each of mpi4py's ``Request`` methods releases the GIL around its MPI call and takes it back,
and a test loop of them spent more time doing that than in MPI (docs/performance-notes.md). Calling
the library's functions from C, the loop runs without the GIL and takes it back once.

How: the library is the one ``libmpi`` mapped into this process (mpi4py loaded it; ``dlopen`` with
``RTLD_NOLOAD`` finds it again and cannot load another). Anything else (no such mapping, two of
them, a library without the symbols) gives None, and the calls in C keep mpi4py's methods. A
request's handle is passed by its address (``MPI._addressof``), which both ABIs (MPICH's int
handles, Open MPI's pointers) take.
"""

from __future__ import annotations

import ctypes
import os


def mapped_libraries() -> set[str]:
    """The files of this process's mappings whose name starts with ``libmpi.so`` (Linux)."""
    try:
        with open("/proc/self/maps") as maps:
            lines = maps.read().splitlines()
    except OSError:
        return set()
    paths = {line.split()[-1] for line in lines if len(line.split()) >= 6}
    return {p for p in paths if os.path.basename(p).startswith("libmpi.so")}


def entry_points() -> tuple[int, int] | None:
    """(address of MPI_Start, address of MPI_Test) in the MPI library this process has loaded, or
    None where there is not exactly one such library or it lacks them."""
    paths = mapped_libraries()
    if len(paths) != 1:
        return None
    try:
        lib = ctypes.CDLL(paths.pop(), mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        start, test = lib.MPI_Start, lib.MPI_Test
    except (OSError, AttributeError):
        return None
    return ctypes.cast(start, ctypes.c_void_p).value, ctypes.cast(test, ctypes.c_void_p).value
