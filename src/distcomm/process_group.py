"""ProcessGroup: a group of processes and its operations, shaped like torch's c10d ProcessGroup.

A ProcessGroup holds the group's ranks, its Engine (backends/engine.py) and that engine's
GroupCollectives for it, its sequence numbers and its order of work (executor.py). Its methods are
torch c10d's, at the buffer level: each takes ``buffers.Buffer`` objects whose arguments the caller
has already checked (``_api/args.py`` does it for the public functions), runs the operation as
the group's next one, inline or on the group's worker thread, writes results back into the user's
tensors, and returns a Work when ``async_op`` is true (else None, once done). ``root``, ``dst`` and
``src`` are group ranks. The ``result`` argument is the value of the Work's future (torch's: the
output tensors).

Nothing here needs the global world: a ProcessGroup can be built around any connected Engine,
which is how distcomm's public API and a torch backend adapter both use it.

Every message of a collective carries the group id, the sequence number and a *signature* (op,
dtype, reduce op), so ranks that disagree about the call see a mismatch error instead of
exchanging each other's bytes.
"""

from __future__ import annotations

import itertools
import threading
import time
from datetime import timedelta
from functools import partial
from types import MappingProxyType
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np

from . import diagnostics
from . import flight_recorder as fr
from .backends.engine import Engine, FastPath, GroupSpec
from .buffers import Buffer, SparseBuffer
from .errors import (
    CollectiveMismatchError,
    DistBackendError,
    DistError,
    DistTimeoutError,
    PeerLostError,
    describe_op,
)
from .executor import OrderedExecutor
from .profiling import profiler_scope, profiling
from .signatures import signature
from .transport.base import ANY_SOURCE, KIND_COLLECTIVE, KIND_P2P, Channel, MessageKey, TransportError, wait_all
from .types import RedOpType
from .work import Work

# the flight recorder's clock, fields and states, bound once: run() touches them on every call
_now = time.time
_SCHEDULED, _STARTED, _COMPLETED = fr.SCHEDULED, fr.STARTED, fr.COMPLETED
_STATE, _T_COMPLETED = fr.STATE, fr.T_COMPLETED


class TensorPaths(NamedTuple):
    """A group's latency paths on the user's own tensors, one per collective (the engine's
    ``FastPath.tensor_<op>``), each called by the API function of that name with its own
    arguments and the group's root: True when the call is done, False when nothing was done (the
    API function then goes on: Buffers, checks, the method). Every field is callable: until the
    engine is first asked, one that asks it and then calls the path; where it has none, one that
    returns False."""

    broadcast: Callable[..., bool]
    reduce: Callable[..., bool]
    all_gather: Callable[..., bool]
    all_gather_into_tensor: Callable[..., bool]
    gather: Callable[..., bool]
    scatter: Callable[..., bool]
    reduce_scatter_tensor: Callable[..., bool]
    all_to_all_single: Callable[..., bool]


def _op_code(op) -> int:
    return int(getattr(op, "op", op))


class ProcessGroup:
    """A group of processes: its global ranks, this process's rank in it, its engine.

    ``rank()``/``size()`` are group-relative; ``ranks[i]`` is the global rank of group rank i. A
    process that is not a member has no ProcessGroup object: it holds GroupMember.NON_GROUP_MEMBER.
    ``engine_ranks`` (default: ``ranks``) are the members' ranks in the engine's own world, which
    differ when the group has an engine connected among its members only.
    """

    #: torch's ``group_desc``; new_group and init_process_group set the one they were given
    group_desc: str = "undefined"

    def __init__(
        self,
        group_id: int,
        name: str,
        ranks: Sequence[int],
        global_rank: int,
        engine: Engine,
        backend_name: str,
        timeout: timedelta,
        engine_name: str = "",
        store: Any = None,
        engine_ranks: Sequence[int] | None = None,
    ):
        self.group_id = group_id
        self.group_name = name
        self.ranks = list(ranks)
        self._rank_of = {g: i for i, g in enumerate(self.ranks)}
        #: ``group_ranks.get(global_rank)``: the member's group rank, or None (``group_rank``'s map, one C call)
        self.group_ranks = MappingProxyType(self._rank_of)
        self.global_rank = global_rank
        self._rank = self._rank_of[global_rank]
        self.engine = engine
        self.engine_name = engine_name or backend_name
        self.backend_name = backend_name
        self.timeout = timeout
        self.store = store
        self.spec = GroupSpec(group_id, list(self.ranks if engine_ranks is None else engine_ranks), self._rank)
        self._global_of = dict(zip(self.spec.ranks, self.ranks))  # engine rank -> global rank
        self.transport = engine.transport
        self.collectives = engine.collectives(self.spec)
        # The group's sequence numbers: ``next_seq()`` takes the next one, a C call that two threads
        # cannot interleave (a += on an attribute can hand them the same number).
        self._seqs = itertools.count(1)
        self.next_seq = self._seqs.__next__
        self.executor = OrderedExecutor(name, self._rank)
        # The engine's fast path (FastPath): ``fast_all_reduce(tensor, op) -> bool`` and
        # ``fast_barrier() -> bool`` each do the whole call and return True, or return False having
        # done nothing. Asked of the engine on first use (see _install_fast_path).
        self.fast_all_reduce = self._first_fast_all_reduce
        self.fast_barrier = self._first_fast_barrier
        if fr.recorder is not None:
            fr.recorder.register_group(name, group_id, self.ranks, global_rank, self._timeout_s)
        # ``tensor_paths.<op>(...) -> bool``: the same, on the user's tensors (TensorPaths)
        self.tensor_paths = TensorPaths(*(partial(self._first_tensor_path, i) for i in range(len(TensorPaths._fields))))
        # The rest of it: method name -> that method's latency path (see _fast); None until asked.
        self._fast_paths: dict | None = None
        self._has_fast_path = False  # once _fast_paths is set: whether the engine gave one

    @property
    def timeout(self) -> timedelta:
        return self._timeout

    @timeout.setter
    def timeout(self, value: timedelta) -> None:
        self._timeout = value
        self._timeout_s = value.total_seconds()  # read by every call: converted once

    # torch's ProcessGroup exposes these as methods
    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return len(self.ranks)

    def name(self) -> str:
        return self.backend_name

    def group_rank(self, global_rank: int) -> int:
        return self._rank_of.get(global_rank, -1)

    def global_rank_of_engine_rank(self, engine_rank: int) -> int:
        """The global rank of a member given by its engine rank (what a transport reports)."""
        return self._global_of.get(engine_rank, -1)

    def __repr__(self) -> str:
        return f"<distcomm.ProcessGroup {self.group_name!r} ranks={self.ranks} backend={self.backend_name}>"

    # -- running operations -------------------------------------------------------------------
    # next_seq() -> int: take the group's next sequence number (in issue order: every member numbers
    # alike); bound in __init__.

    @property
    def seq(self) -> int:
        """The last sequence number taken (0 before the first call): the counter's next value, which
        only its repr shows ("count(14)"), less one."""
        return int(repr(self._seqs)[6:-1]) - 1

    def channel(self, op: str, seq: int, sig: int, timeout: timedelta | None = None) -> Channel:
        """The point-to-point view of collective number ``seq``, with its deadline starting now."""
        seconds = self._timeout_s if timeout is None else timeout.total_seconds()
        return Channel(
            self.transport,
            self.spec.ranks,
            self._rank,
            MessageKey(self.group_id, KIND_COLLECTIVE, seq),
            op,
            sig,
            time.monotonic() + seconds,
        )

    def run(
        self,
        op: str,
        sig: int,
        body: Callable[[Channel], Any],
        async_op: bool = False,
        result: Any = None,
        timeout: timedelta | None = None,
        buf: Buffer | None = None,
        root: int | None = None,
    ) -> Work | None:
        """Run ``body(channel)`` as this group's next collective, inline or queued.

        The sequence number is taken now, in issue order, so every member numbers the same call
        alike whether it runs inline or later on the worker thread. ``buf`` (the call's input) and
        ``root`` describe the call to the flight recorder and to the DETAIL shape check.
        """
        seq = self.next_seq()
        recorder = fr.recorder
        entry = None
        if recorder is not None:
            # depth 4: the user's frame is no nearer than the caller of the ProcessGroup method
            # that called run (call_site's frames: 1 record, 2 run, 3 the method, 4 its caller)
            if buf is None:
                entry = recorder.record(self.group_name, seq, op, None, None, root, _SCHEDULED, None, 4)
            else:
                entry = recorder.record(self.group_name, seq, op, buf.flat.nbytes, buf.dtype.name, root,
                                        _SCHEDULED, None, 4)

        def run() -> None:
            if entry is not None:
                entry[_STATE] = _STARTED
            in_step = False  # the call failed alike on every rank, with the group's messages in step
            try:
                if diagnostics.check_shapes and buf is not None:
                    fp = diagnostics.fingerprint(op, buf.dtype.name, buf.shape, root)
                    mismatch = diagnostics.fingerprint_mismatch(
                        self.channel(op, seq, diagnostics.FINGERPRINT_SIGNATURE, timeout), fp, seq)
                    if mismatch is not None:
                        in_step = True
                        raise mismatch
                if profiling() is None:
                    body(self.channel(op, seq, sig, timeout))
                else:
                    with profiler_scope(f"{self.backend_name}:{op}"):  # torch's "<backend>:<op>" event names
                        body(self.channel(op, seq, sig, timeout))
            except BaseException as exc:
                try:
                    diagnostics.record_fault(self, exc, op, seq, entry)
                finally:
                    if not in_step:
                        self.give_up(seq, exc)  # after the report: see give_up
                raise
            if entry is not None:
                entry[_T_COMPLETED], entry[_STATE] = _now(), _COMPLETED

        return self.executor.run(op, run, async_op, result, seq)

    def give_up(self, seq: int, exc: BaseException) -> None:
        """Collective call ``seq`` failed here with ``exc``: the engine makes the group unusable
        on this rank and tells the members that still wait on it (``Engine.give_up``).

        Called once the failure is reported (``diagnostics.record_fault``, which waits up to a
        second for what the other ranks are doing), not before: a member waiting in the same call
        for the same late rank reaches its own timeout within moments of this one, and should
        time out naming that rank rather than fail on this rank's notice just before; this rank's
        report then shows it waiting, not failed by the notice. The cost: a rank arriving at the
        call within that report's time still completes it with this rank's messages."""
        why = str(exc) if isinstance(exc, DistError) else f"{type(exc).__name__}: {exc}"
        self.engine.give_up(self.spec.group_id, seq, why.split("\n", 1)[0])  # not the report's lines the fault added

    # -- collectives (torch c10d's names) ---------------------------------------------------------
    def broadcast(self, buf: Buffer, root: int, async_op: bool = False, result: Any = None) -> Work | None:
        if not async_op and self._fast("broadcast", buf, root):
            return None
        coll = self.collectives

        def body(ch: Channel) -> None:
            coll.check_root(ch, root, "src")
            coll.broadcast(ch, buf.flat, root)
            buf.commit()

        return self.run("broadcast", signature("broadcast", buf.dtype.code, root=root), body, async_op, result,
                        buf=buf, root=root)

    def allreduce(self, buf: Buffer, op, async_op: bool = False, result: Any = None) -> Work | None:
        """``op``: a ReduceOp the dtype supports (checked by the caller)."""
        coll = self.collectives

        def body(ch: Channel) -> None:
            coll.all_reduce(ch, buf.flat, buf.dtype, op)
            buf.commit()

        sig = signature("all_reduce", buf.dtype.code, _op_code(op))
        return self.run("all_reduce", sig, body, async_op, result, buf=buf)

    def allreduce_sparse(self, sparse: SparseBuffer, async_op: bool = False, result: Any = None) -> Work | None:
        """SUM of a sparse COO tensor (torch's gloo supports no other op on them): every rank sends
        its entries (count, indices, values) to every other, then sums the union of them all."""
        sparse_dim = sparse.indices.shape[0]

        def body(ch: Channel) -> None:
            mine = (sparse.indices.reshape(-1), sparse.values)
            nnz = np.empty(ch.size, dtype=np.int64)
            nnz[ch.rank] = sparse.indices.shape[1]
            peers = [p for p in range(ch.size) if p != ch.rank]
            # per peer, messages of one channel arrive in the order they were sent: count first,
            # so the receiver can size the next two
            sends = [ch.isend(p, nnz[ch.rank:ch.rank + 1]) for p in peers]
            for p in peers:
                ch.recv(p, nnz[p:p + 1])
            parts: list = [None] * ch.size
            parts[ch.rank] = mine
            for p in peers:
                sends += [ch.isend(p, mine[0]), ch.isend(p, mine[1])]
            for p in peers:
                idx = np.empty(sparse_dim * int(nnz[p]), dtype=np.int64)
                vals = np.empty(sparse.row * int(nnz[p]), dtype=sparse.values.dtype)
                ch.recv(p, idx)
                ch.recv(p, vals)
                parts[p] = (idx, vals)
            wait_all(sends)
            indices = np.concatenate([i.reshape(sparse_dim, -1) for i, _ in parts], axis=1)
            sparse.commit(indices, np.concatenate([v for _, v in parts]))

        sig = signature("all_reduce_sparse", sparse.dtype.code, _op_code(RedOpType.SUM))
        return self.run("all_reduce", sig, body, async_op, result)

    def allreduce_coalesced(self, bufs: Sequence[Buffer], op, async_op: bool = False,
                            result: Any = None) -> Work | None:
        """All of ``bufs`` (one dtype) reduced as one collective over their concatenation."""
        coll = self.collectives
        dtype = bufs[0].dtype

        def body(ch: Channel) -> None:
            coll.all_reduce_coalesced(ch, [b.flat for b in bufs], dtype, op)
            for b in bufs:
                b.commit()

        sig = signature("all_reduce_coalesced", dtype.code, _op_code(op))
        return self.run("all_reduce_coalesced", sig, body, async_op, result)

    def allgather_coalesced(self, out_lists: Sequence[Sequence[Buffer]], ins: Sequence[Buffer],
                            async_op: bool = False, result: Any = None) -> Work | None:
        """``out_lists[r][i]`` receives rank r's ``ins[i]``: one all_gather of the concatenated
        inputs (every rank's have the same sizes)."""
        count = sum(b.count for b in ins)

        def body(ch: Channel) -> None:
            send = np.concatenate([b.flat for b in ins])
            flat = np.empty(count * ch.size, dtype=send.dtype)
            self._gather_into(ch, flat, send)
            for r, outs in enumerate(out_lists):
                offset = r * count
                for out in outs:
                    out.flat[...] = flat[offset:offset + out.count]
                    offset += out.count
                    out.commit()

        sig = signature("all_gather_coalesced", ins[0].dtype.code)
        return self.run("all_gather_coalesced", sig, body, async_op, result)

    def reduce(self, buf: Buffer, op, root: int, async_op: bool = False, result: Any = None) -> Work | None:
        if not async_op and self._fast("reduce", buf, op, root):
            return None
        coll = self.collectives

        def body(ch: Channel) -> None:
            coll.check_root(ch, root, "dst")
            coll.reduce(ch, buf.flat, buf.dtype, op, root)
            if ch.rank == root:
                buf.commit()

        sig = signature("reduce", buf.dtype.code, _op_code(op), root)
        return self.run("reduce", sig, body, async_op, result, buf=buf, root=root)

    def _gather_into(self, ch: Channel, flat_out: np.ndarray, send: np.ndarray) -> None:
        count = send.size
        block = flat_out[ch.rank * count:(ch.rank + 1) * count]
        # in place (the input is this rank's block) needs no copy; an input elsewhere, even one
        # overlapping the block at another offset, is copied (numpy copies overlapping memory right)
        if not (block.__array_interface__["data"][0] == send.__array_interface__["data"][0]
                and block.strides == send.strides):
            block[...] = send
        self.collectives.all_gather(ch, flat_out, count)

    def allgather(self, outs: Sequence[Buffer], inp: Buffer, async_op: bool = False,
                  result: Any = None) -> Work | None:
        """``outs``: one buffer per rank, each of ``inp``'s size."""
        if not async_op and self._fast("allgather", outs, inp):
            return None

        def body(ch: Channel) -> None:
            self.collectives.all_gather_list(ch, [out.flat for out in outs], inp.flat)
            for out in outs:
                out.commit()

        return self.run("all_gather", signature("all_gather", inp.dtype.code), body, async_op, result, buf=inp)

    def allgather_into_tensor(self, out: Buffer, inp: Buffer, async_op: bool = False,
                              result: Any = None) -> Work | None:
        """``out`` holds size() times ``inp``'s elements (torch's ``_allgather_base``)."""
        if not async_op and self._fast("allgather_into_tensor", out, inp):
            return None

        def body(ch: Channel) -> None:
            self._gather_into(ch, out.flat, inp.flat)
            out.commit()

        sig = signature("all_gather_into_tensor", inp.dtype.code)
        return self.run("all_gather_into_tensor", sig, body, async_op, result, buf=inp)

    def gather(self, outs: Sequence[Buffer] | None, inp: Buffer, root: int, async_op: bool = False,
               result: Any = None) -> Work | None:
        """``outs``: one buffer per rank on ``root``, None elsewhere."""
        if not async_op and self._fast("gather", outs, inp, root):
            return None
        coll = self.collectives

        def body(ch: Channel) -> None:
            coll.check_root(ch, root, "dst")
            coll.gather_list(ch, inp.flat, [out.flat for out in outs] if outs is not None else None, root)
            if outs is not None:
                for out in outs:
                    out.commit()

        return self.run("gather", signature("gather", inp.dtype.code, root=root), body, async_op, result,
                        buf=inp, root=root)

    def scatter(self, out: Buffer, ins: Sequence[Buffer] | None, root: int, async_op: bool = False,
                result: Any = None) -> Work | None:
        """``ins``: one buffer per rank on ``root``, None elsewhere."""
        if not async_op and self._fast("scatter", out, ins, root):
            return None
        coll = self.collectives

        def body(ch: Channel) -> None:
            coll.check_root(ch, root, "src")
            coll.scatter_list(ch, [b.flat for b in ins] if ins is not None else None, out.flat, root)
            out.commit()

        return self.run("scatter", signature("scatter", out.dtype.code, root=root), body, async_op, result,
                        buf=out, root=root)

    def reduce_scatter(self, out: Buffer, ins: Sequence[Buffer], op, async_op: bool = False,
                       result: Any = None) -> Work | None:
        """``ins``: one buffer per rank; ``ins[rank()]`` has ``out``'s size."""
        if not async_op and self._fast("reduce_scatter", out, ins, op):
            return None
        coll = self.collectives

        def body(ch: Channel) -> None:
            coll.reduce_scatter_list(ch, [b.flat for b in ins], out.flat, out.dtype, op)
            out.commit()

        sig = signature("reduce_scatter", out.dtype.code, _op_code(op))
        return self.run("reduce_scatter", sig, body, async_op, result, buf=out)

    def reduce_scatter_tensor(self, out: Buffer, inp: Buffer, op, async_op: bool = False,
                              result: Any = None) -> Work | None:
        """``inp`` holds size() blocks of ``out``'s size (torch's ``_reduce_scatter_base``)."""
        if not async_op and self._fast("reduce_scatter_tensor", out, inp, op):
            return None
        coll = self.collectives
        n, size = out.count, self.size()

        def body(ch: Channel) -> None:
            flat = inp.flat  # read in place: the engine copies it if its algorithm needs scratch
            coll.reduce_scatter_list(ch, [flat[q * n:(q + 1) * n] for q in range(size)], out.flat, out.dtype, op)
            out.commit()

        sig = signature("reduce_scatter_tensor", out.dtype.code, _op_code(op))
        return self.run("reduce_scatter_tensor", sig, body, async_op, result, buf=inp)

    def alltoall(self, outs: Sequence[Buffer], ins: Sequence[Buffer], async_op: bool = False,
                 result: Any = None) -> Work | None:
        """``ins[q]`` goes to rank q; rank q's lands in ``outs[q]`` (sizes may differ per pair)."""
        if not async_op and self._fast("alltoall", outs, ins):
            return None
        coll = self.collectives

        def body(ch: Channel) -> None:
            coll.all_to_all_list(ch, [b.flat for b in ins], [b.flat for b in outs])
            for b in outs:
                b.commit()

        return self.run("all_to_all", signature("all_to_all", outs[0].dtype.code), body, async_op, result)

    def alltoall_base(self, out: Buffer, inp: Buffer, recv_counts: Sequence[int], send_counts: Sequence[int],
                      async_op: bool = False, result: Any = None) -> Work | None:
        """One buffer each way, split into per-rank blocks of the given element counts (torch's
        ``alltoall_base``, which all_to_all_single calls)."""
        if not async_op and self._fast("alltoall_base", out, inp, recv_counts, send_counts):
            return None
        coll = self.collectives

        def body(ch: Channel) -> None:
            send = inp.flat
            if np.may_share_memory(send, out.flat):  # all_to_all_single(t, t): blocks arrive over unsent ones
                send = send.copy()
            coll.all_to_all(ch, send, send_counts, out.flat, recv_counts)
            out.commit()

        sig = signature("all_to_all_single", out.dtype.code)
        return self.run("all_to_all_single", sig, body, async_op, result)

    def barrier(self, async_op: bool = False, result: Any = None, timeout: timedelta | None = None) -> Work | None:
        """``timeout``: this barrier's deadline instead of the group's."""
        return self.run("barrier", signature("barrier"), self.collectives.barrier, async_op, result, timeout)

    def monitored_barrier(self, timeout: timedelta | None = None, wait_all_ranks: bool = False) -> None:
        """Rank 0 waits for every other rank, then releases them; a rank missing at the deadline
        makes rank 0 raise naming it (every missing rank with ``wait_all_ranks``)."""
        timeout = self.timeout if timeout is None else timeout
        if not isinstance(timeout, timedelta):  # seconds, as torch's monitored_barrier takes them
            timeout = timedelta(seconds=timeout)
        millis = int(timeout.total_seconds() * 1000)
        global_ranks = self.ranks

        def body(ch: Channel) -> None:
            empty = np.empty(0, dtype=np.uint8)
            if ch.rank != 0:
                try:
                    ch.send(0, empty)
                    ch.recv(0, empty)
                except DistBackendError as exc:
                    # gloo's words: the fault is told on rank 0, which names the missing ranks
                    raise type(exc)(
                        f"Rank {ch.rank} successfully reached monitoredBarrier, but received errors "
                        "while waiting for send/recv from rank 0. Please check rank 0 logs for faulty rank.\n"
                        f" Original exception: \n{exc}"
                    ) from exc
                return
            if millis <= 0 < ch.size - 1:  # no time to wait for anyone: gloo's words
                raise DistBackendError(
                    f"Rank 0 timed out in monitoredBarrier after {millis} ms.\n"
                    "No ranks successfully processed in monitoredBarrier.")
            pending = [(peer, ch.irecv(peer, np.empty(0, np.uint8))) for peer in range(1, ch.size)]
            missing = []
            for peer, req in pending:
                try:
                    req.wait()
                except (DistTimeoutError, PeerLostError):
                    missing.append(peer)
                    if not wait_all_ranks:
                        break
            if missing:
                names = [global_ranks[m] for m in missing]
                # gloo's words first (code matches on them), then which call it was
                where = f" (monitored_barrier #{ch.key.seq} of group {self.group_name!r})"
                if len(names) == 1:
                    raise DistBackendError(
                        f"[Rank 0]: Rank {names[0]} failed to pass monitoredBarrier in {millis} ms{where}")
                raise DistBackendError(
                    f"[Rank 0]: Ranks {', '.join(map(str, names))} failed to pass monitoredBarrier in {millis} ms"
                    f"{where}"
                )
            for peer in range(1, ch.size):
                ch.send(peer, empty)

        self.run("monitored_barrier", signature("monitored_barrier"), body, False, timeout=timeout)

    # -- point-to-point ---------------------------------------------------------------------------
    def send(self, buf: Buffer, dst: int, tag: int = 0, op: str = "send") -> "P2PWork":
        """Post a send of ``buf`` to group rank ``dst``; the Work completes when it is handed over."""
        key = MessageKey(self.group_id, KIND_P2P, tag)
        entry = None if fr.recorder is None else fr.recorder.record(
            self.group_name, None, op, buf.nbytes, buf.dtype.name, dst, fr.STARTED, tag, 3)
        if profiling() is None:
            request = self.transport.isend(self.spec.ranks[dst], buf.flat, key, signature("send", buf.dtype.code))
        else:  # the event covers the posting; torch's gloo names it "gloo:send" for isend too
            with profiler_scope(f"{self.backend_name}:send"):
                request = self.transport.isend(self.spec.ranks[dst], buf.flat, key, signature("send", buf.dtype.code))
        return P2PWork(op, self, request, buf, dst, tag, receiving=False, entry=entry)

    def recv(self, buf: Buffer, src: int, tag: int = 0, op: str = "recv") -> "P2PWork":
        """Post a receive into ``buf`` from group rank ``src`` (``ANY_SOURCE``: any member; the
        Work's ``source_rank()`` then tells the sender's global rank)."""
        key = MessageKey(self.group_id, KIND_P2P, tag)
        peer = ANY_SOURCE if src == ANY_SOURCE else self.spec.ranks[src]
        entry = None if fr.recorder is None else fr.recorder.record(
            self.group_name, None, op, buf.nbytes, buf.dtype.name, src, fr.STARTED, tag, 3)
        if profiling() is None:
            request = self.transport.irecv(peer, buf.flat, key, signature("send", buf.dtype.code))
        else:
            with profiler_scope(f"{self.backend_name}:recv"):
                request = self.transport.irecv(peer, buf.flat, key, signature("send", buf.dtype.code))
        return P2PWork(op, self, request, buf, src, tag, receiving=True, entry=entry)

    def recv_anysource(self, buf: Buffer, tag: int = 0, op: str = "recv") -> "P2PWork":
        return self.recv(buf, ANY_SOURCE, tag, op)

    # -- the engine's fast path -------------------------------------------------------------------
    def _first_fast_all_reduce(self, tensor, op) -> bool:
        return self._install_fast_path() and self.fast_all_reduce(tensor, op)

    def _first_fast_barrier(self) -> bool:
        return self._install_fast_path() and self.fast_barrier()

    def _first_tensor_path(self, field: int, *args) -> bool:
        return self._install_fast_path() and self.tensor_paths[field](*args)

    def _fast(self, method: str, *args) -> bool:
        """Run this synchronous call of ``method`` (a collective method's name, with its arguments)
        through the engine's fast path for it, if there is one and it takes the call: True when
        the call is done, False when nothing was done (the general path then runs it)."""
        path = self._fast_path_for(method)
        return path is not None and path(*args)

    def _fast_path_for(self, name: str):
        """The engine's fast path called ``name`` (a FastPath field), or None.

        Under DETAIL every call takes the general path: it compares shapes across ranks first, and
        a rank on a fast path would not meet that exchange."""
        if diagnostics.check_shapes:
            return None
        paths = self._fast_paths
        if paths is None:
            if not self._install_fast_path():
                return None
            paths = self._fast_paths
        return paths.get(name)

    def _install_fast_path(self) -> bool:
        """Ask the engine for the group's fast path: none (False: never again), not yet (None: the
        engine sets the group up on its first collective), or one, which from then on takes the
        calls (True)."""
        if self._fast_paths is not None:  # settled: a caller kept a _first_fast_* method from before
            return self._has_fast_path
        paths: FastPath | bool | None = self.engine.fast_path(self)
        if paths is None:
            return False
        self._has_fast_path = paths is not False
        if paths is False:
            self.fast_all_reduce = self.fast_barrier = _no_fast_path
            self.tensor_paths = _NO_TENSOR_PATHS
            self._fast_paths = {}
            return False
        self.fast_all_reduce = paths.all_reduce or _no_fast_path
        self.fast_barrier = paths.barrier or _no_fast_path
        by_name = paths._asdict()
        self.tensor_paths = TensorPaths(*(by_name["tensor_" + op] or _no_fast_path for op in TensorPaths._fields))
        self._fast_paths = {name: fn for name, fn in paths._asdict().items()
                            if fn is not None and name not in ("all_reduce", "barrier")}
        return True

    def close(self) -> None:
        self.executor.close()
        if fr.recorder is not None:
            fr.recorder.retire_group(self.group_name)
        # The engine's fast paths hold this group (its channel, its faults): dropping them breaks
        # that cycle, so the group and what it holds (its store) go when its last user lets go.
        self.fast_all_reduce = self.fast_barrier = _no_fast_path
        self.tensor_paths = _NO_TENSOR_PATHS
        self._fast_paths, self._has_fast_path = {}, False


def _no_fast_path(*args) -> bool:
    return False


_NO_TENSOR_PATHS = TensorPaths(*(_no_fast_path for _ in TensorPaths._fields))


class P2PWork(Work):
    """The Work of one send or receive: waits on the transport's request directly (no queue, no
    thread hand-off). Where the request must complete while the caller does something else
    (``get_future()``, ``wait(timeout)``), a thread of its own waits on it: not the group's worker,
    whose queue would put the group's next collectives behind this message (torch's p2p and
    collectives do not wait for each other)."""

    def __init__(self, op: str, pg: ProcessGroup, request, buf: Buffer, peer: int, tag: int, receiving: bool,
                 entry: list | None = None):
        super().__init__(op, [buf.obj])
        self._entry = entry  # its flight recorder record, or None
        self._receiving = receiving  # by flag, not by op name: recv_object_list receives too
        self._pg = pg
        self._request = request
        self._buf = buf
        self._peer = peer  # group rank, or ANY_SOURCE
        self._tag = tag
        self._deadline = time.monotonic() + pg.timeout.total_seconds()
        self._completing = threading.Lock()  # one thread waits on the request; the others on the event
        self._background: threading.Thread | None = None

    def _complete(self) -> None:
        with self._completing:
            if not self._event.is_set():
                self._wait_request()

    def _wait_request(self) -> None:
        try:
            self._request.wait(self._deadline)
        except TransportError as exc:
            peer = self._peer
            if exc.peer is not None:
                peer = self._pg.group_rank(self._pg.global_rank_of_engine_rank(exc.peer))
            err = self._translate(exc, peer)
            diagnostics.record_fault(self._pg, err, self.op, None, self._entry)
            self._finish(err)
            raise err from None
        source = None
        if self._receiving:
            self._buf.commit()
            source = self._pg.global_rank_of_engine_rank(self._request.source)
        if self._entry is not None:
            fr.complete(self._entry)
        self._finish(None, source)

    def _translate(self, exc: TransportError, peer: int) -> DistBackendError:
        cls = {"timeout": DistTimeoutError, "lost": PeerLostError, "mismatch": CollectiveMismatchError}.get(
            exc.reason, DistBackendError)
        where = describe_op(self.op, None, self._pg.rank(), peer if peer >= 0 else None)
        return cls(f"{where} (tag {self._tag}): {exc}")

    def wait(self, timeout=None) -> bool:
        if not self._event.is_set():
            if timeout is None or self._background is not None:
                self._complete()
            else:  # the request completes (or fails at the group's timeout) whether or not this wait gives up
                self._complete_in_background()
        return super().wait(timeout)

    def is_completed(self) -> bool:
        if not self._event.is_set() and self._request.test():
            try:
                self._complete()
            except Exception:  # noqa: BLE001 - recorded in the Work, raised by wait()
                pass
        return self._event.is_set()

    def get_future(self):
        future = super().get_future()
        if not self._event.is_set():
            self._complete_in_background()
        return future

    def _complete_in_background(self) -> None:
        with self._completing:
            if self._background is not None or self._event.is_set():
                return
            self._background = threading.Thread(
                target=self._complete_quietly, name=f"distcomm-{self.op}-{self._pg.group_name}", daemon=True)
            self._background.start()

    def _complete_quietly(self) -> None:
        try:
            self._complete()
        except Exception:  # noqa: BLE001 - delivered through the Work and its future
            pass
