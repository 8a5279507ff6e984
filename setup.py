"""The one compiled piece: the shared-memory round in C (src/distcomm/backends/shm/_native.c).

Optional: where it does not build (no C compiler, no Python headers), the install goes on and
distcomm runs the same rounds in Python (backends/shm/native.py says which is in use). Everything
else about the package is in pyproject.toml.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "distcomm.backends.shm._native",
            ["src/distcomm/backends/shm/_native.c"],
            extra_compile_args=["-O2", "-fno-fast-math"],
            optional=True,
        )
    ]
)
