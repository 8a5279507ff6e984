"""The Engine seam: what a backend name stands for, written down as two small interfaces.

An **Engine** is one world's way of moving data: it owns a Transport (point-to-point bytes between
the ranks it was connected among), hands every process group a **GroupCollectives** object (one
method per collective, over flat numpy arrays), may offer a **FastPath** for small synchronous
calls, lets go of a group's resources when the group is destroyed, and closes.

``ProcessGroup`` (process_group.py) is the only caller. It owns the sequence number, the message
signature, the deadline and the Work; it builds a ``Channel`` for each call and hands it, with the
call's flat arrays, to its GroupCollectives. A GroupCollectives method therefore only decides *how*
the bytes move (which algorithm, over which memory) and never sees tensors, Works or the world.

Implementations:

* ``generic.GenericEngine``: the algorithms of ``distcomm._algorithms`` over any Transport
  (TCP, a third-party Transport from ``Backend.register_backend``, the in-process one);
* ``shm.ShmEngine`` (the ``shm`` package): shared memory between the ranks of one host;
* ``hybrid.HybridEngine``: shared memory within a host, TCP between hosts;
* ``mpi.MpiEngine`` (the ``mpi`` package): MPI through mpi4py, a communicator per group.

Adding an engine: a class implementing ``Engine`` (and a GroupCollectives, or reuse
``GenericCollectives``) in its own module, and one ``register_engine`` line in ``backends/__init__``.
See docs/architecture.md.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable, NamedTuple, Optional, Sequence

import numpy as np

from ..dtypes import DType
from ..errors import CollectiveMismatchError, describe_op
from ..signatures import without_root
from ..transport.base import Channel, Transport


def root_mismatch(ch: Channel, root: int, peer: int, theirs: int, what: str) -> CollectiveMismatchError:
    """The error of a rooted collective whose ranks passed different roots (``peer``'s is ``theirs``)."""
    return CollectiveMismatchError(
        f"{describe_op(ch.op, ch.key.seq, ch.rank, peer)}: this rank called {ch.op} with {what}={root} but rank "
        f"{peer} with {what}={theirs} (group ranks); every rank of the group must pass the same {what}")


def late_root_mismatch(ch: Channel, late) -> CollectiveMismatchError:
    """The error of an earlier rooted collective whose root check this rank completed only in call
    ``ch`` (``late``: the transport's LateDisagreement): its own call returned before every peer's
    root was in, and ``ch``'s call has completed."""
    what = "src" if late.op in ("broadcast", "scatter") else "dst"
    return CollectiveMismatchError(
        f"{describe_op(late.op, late.seq, ch.rank, late.peer)}: this rank called {late.op} with {what}={late.root} "
        f"but rank {late.peer} with {what}={late.theirs} (group ranks); every rank of the group must pass the same "
        f"{what}. Found when {ch.op} #{ch.key.seq} completed: {late.op} returns on this rank before every peer's "
        f"{what} is in, and the next call checks them")


class GroupSpec(NamedTuple):
    """A process group as an engine sees it."""

    group_id: int  # the same number on every member; stamped on every message
    ranks: Sequence[int]  # group rank -> the engine's rank (its transport's address)
    rank: int  # this process's group rank


class GroupCollectives(ABC):
    """One group's collectives on one engine.

    Every method runs one whole collective over ``ch`` (the call's Channel: group-relative ranks,
    sequence number, signature, deadline) on flat C-contiguous numpy arrays of the storage dtype,
    and raises DistError subclasses in the operation's words (``ch.translate``). ``root`` is a
    group rank. Reductions take the ReduceOp (``types.RedOpType`` or a PREMUL_SUM ``ReduceOp``)
    and the element ``DType``; applying PREMUL_SUM's factor and AVG's division is the method's job.
    """

    @abstractmethod
    def all_reduce(self, ch: Channel, flat: np.ndarray, dtype: DType, op: Any) -> None:
        """Every rank's ``flat`` ends as the reduction of all ranks' ``flat``."""

    def all_reduce_coalesced(self, ch: Channel, flats: Sequence[np.ndarray], dtype: DType, op: Any) -> None:
        """Every rank's ``flats`` (the same sizes on every rank) end as the reduction of all ranks'
        ``flats``, in place, as one collective over their concatenation. This one all_reduces a
        concatenated copy and copies the result back; an engine may reduce the arrays where they are."""
        if len(flats) == 1:
            return self.all_reduce(ch, flats[0], dtype, op)
        flat = np.concatenate(flats)
        self.all_reduce(ch, flat, dtype, op)
        offset = 0
        for f in flats:
            f[...] = flat[offset:offset + f.size]
            offset += f.size

    @abstractmethod
    def reduce(self, ch: Channel, flat: np.ndarray, dtype: DType, op: Any, root: int) -> None:
        """The reduction lands in ``root``'s ``flat``; the other ranks' ``flat`` is left as it was."""

    @abstractmethod
    def broadcast(self, ch: Channel, flat: np.ndarray, root: int) -> None:
        """``root``'s ``flat`` is copied into every other rank's ``flat``."""

    @abstractmethod
    def all_gather(self, ch: Channel, out: np.ndarray, count: int) -> None:
        """``out`` holds size·count elements with this rank's block already in place; fill the rest."""

    @abstractmethod
    def gather(self, ch: Channel, send: np.ndarray, out: np.ndarray | None, root: int) -> None:
        """Every rank's ``send`` lands in block q of ``root``'s ``out`` (None elsewhere)."""

    @abstractmethod
    def scatter(self, ch: Channel, chunks: np.ndarray | None, out: np.ndarray, root: int) -> None:
        """Block q of ``root``'s ``chunks`` (None elsewhere) lands in rank q's ``out``."""

    @abstractmethod
    def reduce_scatter(self, ch: Channel, scratch: np.ndarray, out: np.ndarray, counts: Sequence[int],
                       dtype: DType, op: Any) -> None:
        """``scratch`` is the concatenated input (blocks of ``counts`` elements; the method may clobber
        it); ``out`` receives the reduction of block ``ch.rank``."""

    @abstractmethod
    def all_to_all(self, ch: Channel, send: np.ndarray, send_counts: Sequence[int], recv: np.ndarray,
                   recv_counts: Sequence[int]) -> None:
        """Block q of ``send`` (``send_counts[q]`` elements) goes to rank q; what rank q sends lands in
        block q of ``recv``. Counts that disagree between sender and receiver are a mismatch error."""

    @abstractmethod
    def barrier(self, ch: Channel) -> None:
        """Returns once every rank of the group has entered."""

    def all_gather_list(self, ch: Channel, outs: Sequence[np.ndarray], send: np.ndarray) -> None:
        """Every rank's ``send`` lands in ``outs[q]`` of every rank (separate arrays, each of ``send``'s
        size). The default stages through one flat buffer and ``all_gather``; an engine that can
        write each output in place overrides it."""
        count = send.size
        flat = np.empty(count * ch.size, dtype=send.dtype)
        flat[ch.rank * count:(ch.rank + 1) * count] = send
        self.all_gather(ch, flat, count)
        for q, out in enumerate(outs):
            out[...] = flat[q * count:(q + 1) * count]

    def all_to_all_list(self, ch: Channel, sends: Sequence[np.ndarray], recvs: Sequence[np.ndarray]) -> None:
        """``sends[q]`` goes to rank q; what rank q sends lands in ``recvs[q]`` (separate arrays of one
        dtype; sizes may differ per pair, a disagreement is a mismatch error). The default stages
        through one buffer each way and ``all_to_all``; an engine that can move each piece in place
        overrides it."""
        send = np.concatenate(list(sends))
        recv = np.empty(sum(x.size for x in recvs), dtype=send.dtype)
        self.all_to_all(ch, send, [s.size for s in sends], recv, [x.size for x in recvs])
        offset = 0
        for x in recvs:
            x[...] = recv[offset:offset + x.size]
            offset += x.size

    def gather_list(self, ch: Channel, send: np.ndarray, outs: Sequence[np.ndarray] | None, root: int) -> None:
        """Rank q's ``send`` lands in ``outs[q]`` on ``root`` (separate arrays of ``send``'s size; None
        elsewhere). The default stages through one flat buffer and ``gather``; an engine that can
        write each output in place overrides it."""
        count = send.size
        flat = np.empty(count * ch.size, dtype=send.dtype) if outs is not None else None
        self.gather(ch, send, flat, root)
        if outs is not None:
            for q, out in enumerate(outs):
                out[...] = flat[q * count:(q + 1) * count]

    def scatter_list(self, ch: Channel, ins: Sequence[np.ndarray] | None, out: np.ndarray, root: int) -> None:
        """``ins[q]`` on ``root`` (separate arrays of ``out``'s size; None elsewhere) lands in rank q's
        ``out``. The default stages through one flat buffer and ``scatter``; an engine that can
        read each input in place overrides it."""
        self.scatter(ch, np.concatenate(list(ins)) if ins is not None else None, out, root)

    def reduce_scatter_list(self, ch: Channel, ins: Sequence[np.ndarray], out: np.ndarray, dtype: DType,
                            op: Any) -> None:
        """``out`` receives the reduction over ranks of their ``ins[ch.rank]``; ``ins[q]`` (separate
        arrays, or views of one input tensor) are the caller's and must be left as they were. The
        default stages them through one scratch buffer and ``reduce_scatter`` (which may clobber
        it); an engine that can reduce from the inputs in place overrides it."""
        scratch = np.concatenate(list(ins)) if ins else np.empty(0, out.dtype)
        self.reduce_scatter(ch, scratch, out, [x.size for x in ins], dtype, op)

    def check_root(self, ch: Channel, root: int, what: str) -> None:
        """Raise CollectiveMismatchError if the ranks passed different roots to a rooted collective
        (``what``: the argument's name, "src" or "dst"); called before the collective itself.

        The root is in the signature, but that is not enough: when two ranks each believe they
        are the root of a broadcast, neither receives anything, so no signature is ever compared.
        The default: every rank sends its root to the next rank and checks the previous one's (one
        small message each way, in parallel, with the signature less its root bits, so a different
        root reaches the comparison that says what differs). Wherever the roots differ, at least
        two ranks see a neighbour that disagrees; a rank whose neighbours agree goes on, and its
        wait on a failed rank ends with that rank's exit (PeerLostError) or the timeout."""
        n = ch.size
        if n == 1:
            return
        prev, nxt = (ch.rank - 1) % n, (ch.rank + 1) % n
        hello = Channel(ch.transport, ch.ranks, ch.rank, ch.key, ch.op, without_root(ch.signature), ch.deadline)
        theirs = np.empty(1, dtype=np.int64)
        recv = hello.irecv(prev, theirs)
        send = hello.isend(nxt, np.array([root], dtype=np.int64))
        recv.wait()
        send.wait()
        if int(theirs[0]) != root:
            raise root_mismatch(ch, root, prev, int(theirs[0]), what)


class FastPath(NamedTuple):
    """An engine's latency paths for one group: one optional callable per collective, each doing
    the whole synchronous call and returning True, or returning False having done nothing at all
    (the general path then runs the call). None: the engine has no latency path for that op.

    ==========================  ==========================================  ==========================
    field                       called with                                 by
    ==========================  ==========================================  ==========================
    ``all_reduce``              (tensor or ndarray, ReduceOp)               ``_api.all_reduce``, before
                                                                            any Buffer is made
    ``barrier``                 ()                                          ``_api.barrier``
    ``broadcast``               (buf, root)                                 ProcessGroup.broadcast
    ``reduce``                  (buf, op, root)                             ProcessGroup.reduce
    ``allgather``               (outs, inp)                                 ProcessGroup.allgather
    ``allgather_into_tensor``   (out, inp)                                  ... and so on: the
    ``gather``                  (outs or None, inp, root)                   ProcessGroup method of
    ``scatter``                 (out, ins or None, root)                    the field's name, with
    ``reduce_scatter``          (out, ins, op)                              its own arguments
    ``reduce_scatter_tensor``   (out, inp, op)
    ``alltoall``                (outs, ins)
    ``alltoall_base``           (out, inp, recv_counts, send_counts)
    ==========================  ==========================================  ==========================

    The Buffer-level ones get the method's checked Buffers (``buf``, ``out``, ``inp``; lists
    ``outs``/``ins``) and write results back (``Buffer.commit``) themselves; ProcessGroup calls
    them only for ``async_op=False`` (``ProcessGroup._fast``).

    The ``tensor_<op>`` ones take the user's own arguments, before any Buffer is made (the API
    function calls its field of ``ProcessGroup.tensor_paths`` once the group and its root are known):
    ``tensor_broadcast`` (tensor, root), ``tensor_reduce`` (tensor, op, root),
    ``tensor_all_gather_into_tensor`` (output, input), ``tensor_reduce_scatter_tensor`` (output,
    input, op), ``tensor_gather`` (tensor, gather_list or None, root), ``tensor_scatter`` (tensor,
    scatter_list or None, root), ``tensor_all_to_all_single`` (output, input: even splits, the API
    passes it no split sizes), ``tensor_all_gather`` (tensor_list, tensor). They take only what
    needs no conversion and decline everything else, whose checks and errors are the general path's.

    A fast path takes its sequence number from ``ProcessGroup.next_seq`` and claims the group
    through ``ProcessGroup.executor.enter_inline`` like any synchronous call, so it interleaves
    correctly with the general path on the same group, and it must exchange exactly what the
    general path would (another member may be running the same call through it).
    """

    all_reduce: Optional[Callable[[Any, Any], bool]] = None
    barrier: Optional[Callable[[], bool]] = None
    broadcast: Optional[Callable[..., bool]] = None
    reduce: Optional[Callable[..., bool]] = None
    allgather: Optional[Callable[..., bool]] = None
    allgather_into_tensor: Optional[Callable[..., bool]] = None
    gather: Optional[Callable[..., bool]] = None
    scatter: Optional[Callable[..., bool]] = None
    reduce_scatter: Optional[Callable[..., bool]] = None
    reduce_scatter_tensor: Optional[Callable[..., bool]] = None
    alltoall: Optional[Callable[..., bool]] = None
    alltoall_base: Optional[Callable[..., bool]] = None
    tensor_broadcast: Optional[Callable[..., bool]] = None
    tensor_reduce: Optional[Callable[..., bool]] = None
    tensor_all_gather_into_tensor: Optional[Callable[..., bool]] = None
    tensor_reduce_scatter_tensor: Optional[Callable[..., bool]] = None
    tensor_gather: Optional[Callable[..., bool]] = None
    tensor_scatter: Optional[Callable[..., bool]] = None
    tensor_all_to_all_single: Optional[Callable[..., bool]] = None
    tensor_all_gather: Optional[Callable[..., bool]] = None


class Engine(ABC):
    """One world's engine; see the module docstring."""

    #: the point-to-point transport (send/recv, and what GenericCollectives runs over)
    transport: Transport

    @abstractmethod
    def collectives(self, group: GroupSpec) -> GroupCollectives:
        """The collectives of a new process group (called once per group, on its members)."""

    def fast_path(self, pg: Any) -> FastPath | bool | None:
        """The FastPath of ``pg`` (a ProcessGroup: the engine is below it and does not import it);
        None when it may exist later (the engine sets the group up on its first collective;
        ProcessGroup asks again then, and never again once it has an answer); False when it never
        will. The default: no fast path."""
        return False

    def release_group(self, group_id: int) -> None:
        """Let go of what the engine keeps for group ``group_id`` (destroy_process_group)."""

    def give_up(self, group_id: int, seq: int, why: str) -> None:
        """Collective call ``seq`` of group ``group_id`` failed on this rank (``why``: its error)
        partway, so the group's message sequence is broken here: make the group's later calls fail
        at once, and tell its peers, so that one arriving late does not complete the call with
        messages this rank sent before it failed. ProcessGroup and the latency paths call it when a
        call raises. The default does nothing (an engine that handles its own failures, such as
        the shared-memory engine's ``GroupShm.give_up``)."""

    def close(self) -> None:
        """Release everything: the transport, memory, threads. Pending requests fail as lost."""
        self.transport.close()

    def leave(self, failed: bool) -> None:
        """This process leaves its job without destroy_process_group while its process lives on (in
        an MPI job, whose exit waits in MPI_Finalize for every rank): make the peers' waits on it end
        as its death would, then close. ``failed``: it leaves because of an uncaught exception. The
        default is ``close``: the shared-memory engine's closed flag and TCP's goodbye already say
        it to the peers."""
        self.close()
