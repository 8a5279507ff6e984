"""The MPI engine ("mpi", ``Backend.MPI``): distcomm's collectives on an MPI library through mpi4py.

* ``engine``: ``MpiEngine`` and ``connect`` (one communicator for the engine's world, found through
  the store among the processes of one MPI job);
* ``collectives``: ``MpiCollectives``, a group's collectives: MPI's nonblocking buffer calls where
  MPI computes what torch does, distcomm's own algorithms over ``transport.mpi.MpiTransport``
  otherwise (``native``: which is which);
* ``native``: the pure choice of MPI datatype and op for a (ReduceOp, dtype);
* ``agreement``: what the ranks of a call compare before its result is used (MPI checks no size,
  dtype, op or root), and the words of a disagreement;
* ``persistent``: the persistent requests (small all_reduces, the barrier, the agreement);
* ``latency``: the latency path of small synchronous all_reduces and barriers.
"""

from .engine import MpiEngine, connect

__all__ = ["MpiEngine", "connect"]
