"""Collective algorithms: one function per module, written only against the point-to-point Channel.

Every algorithm takes a ``Channel`` (group-relative ``ch.rank`` / ``ch.size``; ``isend``, ``irecv``,
``send``, ``recv``, ``sendrecv``) and 1-D C-contiguous numpy arrays of the storage dtype, and
reduces with a ``reducer(acc, x)`` from ``distcomm.reduction``. They know nothing of tensors, groups,
dtypes or sockets, so each can be tested alone on the in-process transport.

==========================  ===================================================================
module                      function(s)
==========================  ===================================================================
allreduce_ring              allreduce_ring(ch, buf, reduce)
allreduce_recursive_doubling allreduce_recursive_doubling(ch, buf, reduce)
allreduce_halving_doubling  allreduce_halving_doubling(ch, buf, reduce)
broadcast_binomial          broadcast_binomial(ch, buf, root)
broadcast_scatter_allgather broadcast_scatter_allgather(ch, buf, root)
reduce_binomial             reduce_binomial(ch, buf, root, reduce)
allgather_ring              allgather_ring(ch, out, count)
allgather_bruck             allgather_bruck(ch, out, count)
gather                      gather_direct(ch, send, out_or_None, root)
scatter                     scatter_direct(ch, chunks_or_None, out, root)
reduce_scatter_ring         reduce_scatter_ring(ch, buf, out, counts, reduce)
alltoall_pairwise           alltoallv_pairwise(ch, send, send_counts, recv, recv_counts)
barrier_dissemination       barrier_dissemination(ch)
reference                   the naive oracle of each, same signatures (tests only)
select                      choose(op_name, nbytes, world_size, algo=None) -> function
==========================  ===================================================================

Costs are given in the α-β model: α per message round, β per byte; ``n`` is the message size in
bytes and ``p`` the group size. "Rounds" counts message steps on the critical path; "bytes" is what
one rank sends (gloo's "bytes on the wire").

Determinism: for a given (algorithm, p, root) every algorithm combines the ranks' values in a fixed
order, and every rank ends with bit-identical results (each reduced element is either computed once
and copied, or computed by every rank with the same operands in the same order).
"""
