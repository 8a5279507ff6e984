"""The shared-memory engine ("shm"): collectives among the ranks of one host through each group's
shared memory (``transport/shm_group.GroupShm``, in rounds of slots).

* ``engine``: ``ShmEngine`` and ``connect``;
* ``group_collectives``: ``ShmCollectives``, which runs each call's algorithm;
* ``choose``: which algorithm, a pure function of the call, the group and the Tuning;
* one module per algorithm: ``allreduce_direct``, ``allreduce_slices``, ``allreduce_readv``,
  ``allreduce_pieces_readv`` (all_reduce_coalesced in place),
  ``reduce_direct``, ``reduce_readv``, ``broadcast_slots``, ``broadcast_readv``,
  ``broadcast_split`` (reader reads, root writes: two ranks), ``allgather_readv``,
  ``gather_slots`` (all_gather through slots too), ``gather_writev`` (peers write into the root),
  ``gather_readv`` (only when forced), ``scatter_slots``, ``scatter_readv``,
  ``reduce_scatter_slots``, ``reduce_scatter_readv``, ``alltoall_slots`` (with its single-copy
  form), ``barrier_slots``; ``common`` holds the pieces they share;
* ``latency``: the latency paths of small synchronous all_reduces and barriers;
* ``observe``: an optional observer told which algorithm runs (tests, debugging).
"""

from .engine import ShmEngine, connect

__all__ = ["ShmEngine", "connect"]
