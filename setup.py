"""The compiled pieces: the shared-memory round steps in C (src/distcomm/transport/_shm_round.c) and
the flight recorder's hot record (src/distcomm/_record.c).

Optional: where it does not build (no C compiler, no Python headers), the install goes on and
distcomm runs the same rounds (and makes the same records) in Python (transport/shm_group.py's C_UNAVAILABLE says why when it is not in use). Everything
else about the package is in pyproject.toml.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "distcomm.transport._shm_round",
            ["src/distcomm/transport/_shm_round.c"],
            extra_compile_args=["-O2", "-fno-fast-math", "-ffp-contract=off"],  # numpy's bits: no reassociation, no fused multiply-add
            optional=True,
        ),
        Extension("distcomm._record", ["src/distcomm/_record.c"], extra_compile_args=["-O2"], optional=True),
    ]
)
