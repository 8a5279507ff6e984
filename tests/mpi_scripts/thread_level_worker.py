"""A program that initialised MPI itself at thread level FUNNELED (tests/test_mpi_engine.py): the
default engine still starts (the rendezvous broadcasts from the main thread only), backend "mpi"
refuses with the reason, and the program's MPI is left initialised and working."""

import os

import mpi4py

mpi4py.rc.thread_level = "funneled"
from mpi4py import MPI  # noqa: E402

import numpy as np  # noqa: E402

import distcomm as dist  # noqa: E402

dist.init_process_group()
rank = dist.get_rank()
t = np.ones(2)
dist.all_reduce(t)
dist.destroy_process_group()
os.write(1, f"{rank} default {t.tolist()}\n".encode())
try:
    dist.init_process_group("mpi")
    os.write(1, f"{rank} mpi started\n".encode())
except RuntimeError as exc:
    os.write(1, f"{rank} mpi {type(exc).__name__}: {exc}\n".encode())
os.write(1, f"{rank} own_mpi {MPI.COMM_WORLD.allreduce(1)} {MPI.Is_finalized()}\n".encode())
