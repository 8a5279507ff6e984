"""The compiled pieces: the shared-memory round steps and whole small calls in C
(src/distcomm/transport/_shm_round.c, _shm_calls.c), the MPI engine's small all_reduce
(src/distcomm/backends/mpi/_mpi_calls.c), the flight recorder's hot record (src/distcomm/_record.c)
and the TCPStore client's add() round trip (src/distcomm/store/tcp/_add_trip.c).

Optional: where they do not build (no C compiler, no Python headers), the install goes on and
distcomm runs the same rounds and calls (and makes the same records) in Python
(transport/shm_group.py's C_UNAVAILABLE says why when the rounds are not in use). Everything else
about the package is in pyproject.toml.
"""

from setuptools import Extension, setup

try:  # the whole latency calls on numpy arrays (_shm_calls.c) read an array's fields through numpy's headers
    import numpy

    numpy_fields = {"include_dirs": [numpy.get_include()], "define_macros": [("DISTCOMM_NUMPY_FIELDS", "1")]}
except ImportError:  # built without them: the Python latency paths take those calls
    numpy_fields = {}

setup(
    ext_modules=[
        Extension(
            "distcomm.transport._shm_round",
            ["src/distcomm/transport/_shm_round.c", "src/distcomm/transport/_shm_calls.c"],
            depends=["src/distcomm/transport/_shm_round.h", "src/distcomm/_calls.h"],
            extra_compile_args=["-O2", "-fno-fast-math", "-ffp-contract=off"],  # numpy's bits: no reassociation, no fused multiply-add
            optional=True,
            **numpy_fields,
        ),
        Extension("distcomm._record", ["src/distcomm/_record.c"], extra_compile_args=["-O2"], optional=True),
        Extension("distcomm.store.tcp._add_trip", ["src/distcomm/store/tcp/_add_trip.c"], extra_compile_args=["-O2"],
                  optional=True),
    ]
    + (  # the MPI engine's small all_reduce in C: Python methods of mpi4py's requests, no MPI header
        [Extension("distcomm.backends.mpi._mpi_calls", ["src/distcomm/backends/mpi/_mpi_calls.c"],
                   depends=["src/distcomm/_calls.h"], extra_compile_args=["-O2"], optional=True, **numpy_fields)]
        if numpy_fields else []
    )
)
