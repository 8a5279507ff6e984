"""DistcommProcessGroup: a torch c10d ProcessGroup whose operations run on a distcomm ProcessGroup.

torch (2.13) lets Python implement a process group by subclassing ``torch.distributed.ProcessGroup``
(its pybind trampoline ``PyProcessGroup`` forwards C++ virtual calls, such as DDP's reducer's
``allreduce``, to the Python methods here). torch's c10d Backend has no such trampoline, which is
why this is a ProcessGroup and not a Backend; ``_new_process_group_helper`` then uses the object as
the group itself. Each method takes torch's arguments (lists of tensors and an options object),
turns them into distcomm Buffers and calls distcomm's ProcessGroup, whose ranks are this group's.

torch's Python API says in ``opts.asyncOp`` whether the user asked for a Work (``async_op=True``)
or will wait at once; C++ callers (DDP's buckets, functional collectives) leave it at its default,
True. A synchronous call issued while the group is idle runs inline: a small all_reduce does not pay
a thread hand-off, and one a latency path completed returns None, which torch's API functions take as
"the backend synchronized at the C++ level" and do not wait on (making, wrapping and waiting on a
Work costs more than the rest of our part of an 8-byte all_reduce). An asynchronous call, and any
call issued while earlier work is still queued, goes to the group's worker thread, as gloo's do: run
inline, it would wait for the peers before returning, and a program that issues it, then a send or a
collective on another group its peers need first, would deadlock (torch's gloo returns at once).

torch private names used (torch's own seams for Python backends): ``torch.distributed.Work``
subclassed (work.py), ``ProcessGroup.__init__(rank, size)``. Reduce ops are read from torch's
``ReduceOp`` object (``.op`` and, for PREMUL_SUM, ``.factor``).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as tdist

from .. import backends, diagnostics
from .._api import args, rollcall
from ..buffers import SparseBuffer, as_buffer, as_buffers
from ..process_group import ProcessGroup
from ..transport.base import ANY_SOURCE
from ..types import PremulSum, RedOpType
from .store import TorchStore
from .work import TorchWork

BACKEND_NAME = "distcomm"
NOT_TAKEN = object()  # _fast's answer when the latency path did nothing
DEFAULT_ENGINE = "gloo"  # distcomm's default: shared memory within a host, TCP between hosts


_RED_OPS = {int(kind): kind for kind in RedOpType}  # an Enum call costs a microsecond; a dict a tenth
_TORCH_SUM = tdist.ReduceOp.SUM


def reduce_op(op) -> Any:
    """torch's ReduceOp (an object with ``.op``, and ``.factor`` for PREMUL_SUM) as distcomm's."""
    kind = _RED_OPS.get(int(getattr(op, "op", op)))
    if kind is None:
        raise ValueError(f"distcomm: unknown torch ReduceOp {op!r}")
    if kind is RedOpType.PREMUL_SUM:
        return PremulSum(op.factor)
    return kind


def _allreduce_op(opts) -> Any:
    """The op of torch's AllreduceOptions: SUM (nearly every call) is one comparison, not the two
    pybind attribute reads ``reduce_op`` makes."""
    if opts is None:
        return RedOpType.SUM
    op = opts.reduceOp
    return RedOpType.SUM if op == _TORCH_SUM else reduce_op(op)


def _timeout(value) -> timedelta:
    # torch's default options carry a negative timedelta meaning "the group's"
    return value if isinstance(value, timedelta) and value.total_seconds() > 0 else timedelta(minutes=30)


class DistcommProcessGroup(tdist.ProcessGroup):
    """A torch ProcessGroup over a distcomm ProcessGroup (``self.group``) of the same ranks."""

    def __init__(self, group: ProcessGroup, watches_the_world: bool = False):
        super().__init__(group.rank(), group.size())
        self.group = group
        self._watches_the_world = watches_the_world  # it installed the diagnostics' watchdog (create())
        self._name = ""
        self._desc = ""
        self._coalesced: list[TorchWork] | None = None  # Works issued inside _start/_end_coalescing

    # -- identity -------------------------------------------------------------------------------
    def getBackendName(self) -> str:  # noqa: N802 - torch's name (C++ virtual)
        return BACKEND_NAME

    # torch's ProcessGroup keeps its name in its backends, and this group registers none: without
    # these, functional collectives and DeviceMesh (which find a group by name) fail "name not set"
    def getGroupName(self) -> str:  # noqa: N802 - torch's names (C++ virtuals)
        return self._name

    def setGroupName(self, name: str) -> None:  # noqa: N802
        self._name = name

    def getGroupDesc(self) -> str:  # noqa: N802
        return self._desc

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802
        self._desc = desc

    # torch reads a group's devices from the C++ backends registered in it, and this group registers
    # none: without this, torch code asking for the group's device (FSDP1's sharded state dict,
    # ``_get_pg_default_device``) fails "no backend has been registered with this ProcessGroup"
    @property
    def _device_types(self) -> list[torch.device]:
        return [torch.device("cpu")]

    def __repr__(self) -> str:
        return f"<distcomm torch ProcessGroup rank={self.group.rank()} size={self.group.size()}>"

    # -- running ----------------------------------------------------------------------------------
    def _run(self, call, result, opts) -> TorchWork:
        return self._track(self._issue(call, result, _asynchronous(opts)))

    def _issue(self, call, result, asynchronous: bool) -> TorchWork:
        """``call(async_op)`` issues the operation: a synchronous one inline when the group is idle
        (then the Work is complete, or holds the error), else queued behind the group's earlier work
        (see the module docstring)."""
        if not asynchronous and self.group.executor.idle():
            try:
                call(False)
            except Exception as exc:  # noqa: BLE001 - delivered by wait(), as an async failure is
                return TorchWork(result, error=exc)
            return TorchWork(result)
        return TorchWork(result, [call(True)])

    # -- coalescing -------------------------------------------------------------------------------
    # torch's ``_coalescing_manager(group, device=...)`` (the NCCL style) brackets the operations
    # issued inside it with these and keeps only the Work of the end; without a device it calls the
    # *_coalesced methods below instead. torch's gloo implements neither bracket (it raises); here
    # the end's Work stands for every operation issued since the start, so waiting on it (as the
    # manager does for async_ops=False, or cm.wait() after) waits for them all.
    def _start_coalescing(self, device=None) -> None:
        # as NCCL's startCoalescing: a block left by an exception (torch then never ends it) is
        # simply dropped; its operations were issued and run as usual
        self._coalesced = []

    def _end_coalescing(self, device=None) -> TorchWork:
        issued, self._coalesced = self._coalesced or [], None
        error = next((w.exception() for w in issued if w.exception() is not None), None)
        return TorchWork([t for w in issued for t in w.outputs], [x for w in issued for x in w.works], error)

    def _fast(self, path, result, opts, *args):
        """What a call returns when the engine's tensor-level latency path ``path`` (a field of
        ``ProcessGroup.tensor_paths``) took it with ``args`` (an idle group, plain CPU tensors, a
        small message): None (see the module docstring), or a completed Work inside a coalescing
        block; NOT_TAKEN when it did nothing (always for an asynchronous call, which must not wait
        for the peers here, and under DETAIL, whose shape check only the general path makes). As an inline call on the general path, a failure is delivered by the Work's ``wait()``."""
        try:
            if diagnostics.check_shapes or _asynchronous(opts) or not path(*args):
                return NOT_TAKEN
        except Exception as exc:  # noqa: BLE001 - delivered by wait(), as _issue does
            return self._track(TorchWork(result, error=exc))
        return self._completed(result)

    def _completed(self, result) -> TorchWork | None:
        """A synchronous call a latency path completed: None, or a completed Work inside a
        coalescing block (whose end's Work stands for it)."""
        if self._coalesced is None:
            return None
        return self._track(TorchWork(result))

    def _track(self, work: TorchWork) -> TorchWork:
        if self._coalesced is not None:
            self._coalesced.append(work)
        return work

    # -- collectives ------------------------------------------------------------------------------
    def allreduce(self, tensors, opts=None):
        op = _allreduce_op(opts)
        tensor = tensors[0]
        # the latency path takes a synchronous call only when the group is idle and the tensor a plain
        # dense CPU one (it declines a sparse tensor, a PREMUL_SUM, a busy group, having done nothing);
        # never under DETAIL, whose shape check only the general path makes
        if op.__class__ is RedOpType and not diagnostics.check_shapes and not _asynchronous(opts) \
                and self.group.fast_all_reduce(tensor, op):
            return self._completed(tensors)
        if tensor.is_sparse:
            sparse = SparseBuffer(tensor)
            return self._run(lambda a: self.group.allreduce_sparse(sparse, a, tensors), tensors, opts)
        buf = as_buffer(tensor)
        return self._run(lambda a: self.group.allreduce(buf, op, a, tensors), tensors, opts)

    def allreduce_coalesced(self, tensors, opts=None):
        op = reduce_op(opts.reduceOp) if opts is not None else RedOpType.SUM
        bufs = args.tensor_list(tensors, "all_reduce_coalesced", "tensors", writes=True)
        return self._run(lambda a: self.group.allreduce_coalesced(bufs, op, a, tensors), tensors, opts)

    def broadcast(self, tensors, opts):
        args.rank_in_group(opts.rootRank, self.group.size(), "broadcast", "root")
        done = self._fast(self.group.tensor_paths.broadcast, tensors, opts, tensors[0], opts.rootRank)
        if done is not NOT_TAKEN:
            return done
        buf = as_buffer(tensors[0])
        return self._run(lambda a: self.group.broadcast(buf, opts.rootRank, a, tensors), tensors, opts)

    def reduce(self, tensors, opts):
        args.rank_in_group(opts.rootRank, self.group.size(), "reduce", "root")
        op = reduce_op(opts.reduceOp)
        if op.__class__ is RedOpType:  # the latency path takes plain ops only (not PREMUL_SUM)
            done = self._fast(self.group.tensor_paths.reduce, tensors, opts, tensors[0], op, opts.rootRank)
            if done is not NOT_TAKEN:
                return done
        buf = as_buffer(tensors[0])
        return self._run(lambda a: self.group.reduce(buf, op, opts.rootRank, a, tensors), tensors, opts)

    def allgather(self, output_lists, inputs, opts=None):
        done = self._fast(self.group.tensor_paths.all_gather, output_lists, opts, output_lists[0], inputs[0])
        if done is not NOT_TAKEN:
            return done
        inp = as_buffer(inputs[0])
        outs = args.tensor_list(output_lists[0], "all_gather", "tensor_list", self.group.size(), like=inp, writes=True)
        return self._run(lambda a: self.group.allgather(outs, inp, a, output_lists), output_lists, opts)

    def all_gather_single(self, output, input, opts=None):  # noqa: A002 - torch's names
        done = self._fast(self.group.tensor_paths.all_gather_into_tensor, [output], opts, output, input)
        if done is not NOT_TAKEN:
            return done
        out, inp = args.tensor(output, "all_gather_into_tensor", "output_tensor", writes=True), as_buffer(input)
        args.gathered_into(out, inp, self.group.size(), "all_gather_into_tensor")
        return self._run(lambda a: self.group.allgather_into_tensor(out, inp, a, [output]), [output], opts)

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        pairs = [(as_buffer(o), as_buffer(i)) for o, i in zip(outputs, inputs)]
        for o, i in pairs:
            args.gathered_into(o, i, self.group.size(), "all_gather_into_tensor")
        return self._run_each(
            [lambda a, o=o, i=i: self.group.allgather_into_tensor(o, i, a) for o, i in pairs], outputs, opts)

    def allgather_coalesced(self, output_lists, inputs, opts=None):
        ins = as_buffers(inputs)
        outs = args.gathered_lists(output_lists, ins, self.group.size(), "all_gather_coalesced")
        return self._run(lambda a: self.group.allgather_coalesced(outs, ins, a, output_lists), output_lists, opts)

    def gather(self, output_lists, inputs, opts):
        root = args.rank_in_group(opts.rootRank, self.group.size(), "gather", "root")
        is_root = self.group.rank() == root
        done = self._fast(self.group.tensor_paths.gather, output_lists, opts, inputs[0],
                          output_lists[0] if is_root else None, root)
        if done is not NOT_TAKEN:
            return done
        inp = as_buffer(inputs[0])
        outs = args.tensor_list(output_lists[0], "gather", "gather_list", self.group.size(), like=inp,
                                writes=True) if is_root else None
        return self._run(lambda a: self.group.gather(outs, inp, root, a, output_lists), output_lists, opts)

    def scatter(self, outputs, input_lists, opts):
        root = args.rank_in_group(opts.rootRank, self.group.size(), "scatter", "root")
        is_root = self.group.rank() == root
        done = self._fast(self.group.tensor_paths.scatter, outputs, opts, outputs[0],
                          input_lists[0] if is_root else None, root)
        if done is not NOT_TAKEN:
            return done
        out = args.tensor(outputs[0], "scatter", "tensor", writes=True)
        ins = args.tensor_list(input_lists[0], "scatter", "scatter_list", self.group.size(), like=out) if is_root else None
        return self._run(lambda a: self.group.scatter(out, ins, root, a, outputs), outputs, opts)

    def reduce_scatter(self, outputs, input_lists, opts):
        op = reduce_op(opts.reduceOp)
        out = args.tensor(outputs[0], "reduce_scatter", "output", writes=True)
        ins = args.tensor_list(input_lists[0], "reduce_scatter", "input_list", self.group.size())
        args.reduce_scatter_list(out, ins, self.group.rank(), "reduce_scatter")
        return self._run(lambda a: self.group.reduce_scatter(out, ins, op, a, outputs), outputs, opts)

    def reduce_scatter_single(self, output, input, opts):  # noqa: A002 - torch's name
        op = reduce_op(opts.reduceOp)
        if op.__class__ is RedOpType:
            done = self._fast(self.group.tensor_paths.reduce_scatter_tensor, [output], opts, output, input, op)
            if done is not NOT_TAKEN:
                return done
        out, inp = args.tensor(output, "reduce_scatter_tensor", "output", writes=True), as_buffer(input)
        args.scattered_from(out, inp, self.group.size(), "reduce_scatter_tensor")
        return self._run(lambda a: self.group.reduce_scatter_tensor(out, inp, op, a, [output]), [output], opts)

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts):
        op = reduce_op(opts.reduceOp)
        pairs = [(as_buffer(o), as_buffer(i)) for o, i in zip(outputs, inputs)]
        for o, i in pairs:
            args.scattered_from(o, i, self.group.size(), "reduce_scatter_tensor")
        return self._run_each(
            [lambda a, o=o, i=i: self.group.reduce_scatter_tensor(o, i, op, a) for o, i in pairs], outputs, opts)

    def alltoall(self, outputs, inputs, opts=None):
        size = self.group.size()
        outs = args.tensor_list(outputs, "all_to_all", "output_tensor_list", size, writes=True)
        ins = args.tensor_list(inputs, "all_to_all", "input_tensor_list", size)
        args.same_dtype(outs + ins, "all_to_all")
        return self._run(lambda a: self.group.alltoall(outs, ins, a, outputs), outputs, opts)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):  # noqa: A002
        if not output_split_sizes and not input_split_sizes:  # the latency path's even splits
            done = self._fast(self.group.tensor_paths.all_to_all_single, [output], opts, output, input)
            if done is not NOT_TAKEN:
                return done
        size = self.group.size()
        out, inp = args.tensor(output, "all_to_all_single", "output", writes=True), as_buffer(input)
        args.same_dtype([out, inp], "all_to_all_single")
        recv_counts = _counts(output, output_split_sizes, size, "output")
        send_counts = _counts(input, input_split_sizes, size, "input")
        return self._run(
            lambda a: self.group.alltoall_base(out, inp, recv_counts, send_counts, a, [output]), [output], opts)

    def barrier(self, opts=None):
        done = [torch.empty(0)]  # torch's barrier Work carries a tensor list too
        if not _asynchronous(opts) and self.group.executor.idle() and self.group.fast_barrier():
            return self._completed(done)
        return self._run(lambda a: self.group.barrier(a, done), done, opts)

    def monitored_barrier(self, timeout=None, wait_all_ranks=False):
        """``ProcessGroup.monitored_barrier`` (torch's C++ method looks for a per-device backend,
        which this group does not register). ``torch.distributed.monitored_barrier`` itself still
        refuses every backend but gloo by name."""
        self.group.monitored_barrier(timeout, wait_all_ranks)

    # torch 2.13 names the single-tensor collectives *_single; older callers (and the C++
    # trampoline's fallbacks) use these names
    _allgather_base = all_gather_single
    allgather_into_tensor_coalesced = all_gather_single_coalesced
    _reduce_scatter_base = reduce_scatter_single
    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced
    alltoall_base = all_to_all_single

    # -- point-to-point ---------------------------------------------------------------------------
    def send(self, tensors, dst, tag=0):
        args.rank_in_group(dst, self.group.size(), "send", "destination")
        return self._track(TorchWork(tensors, [self.group.send(as_buffer(tensors[0]), dst, tag)]))

    def recv(self, tensors, src, tag=0):
        args.rank_in_group(src, self.group.size(), "recv", "source")
        return self._track(TorchWork(tensors, [self.group.recv(as_buffer(tensors[0]), src, tag)]))

    def recv_anysource(self, tensors, tag=0):
        return self._track(TorchWork(tensors, [self.group.recv(as_buffer(tensors[0]), ANY_SOURCE, tag)]))

    # -- helpers and lifetime ---------------------------------------------------------------------
    def _run_each(self, calls, result, opts) -> TorchWork:
        """Several operations issued in order (a coalesced call), as one Work."""
        works, error, asynchronous = [], None, _asynchronous(opts)
        for call in calls:
            work = self._issue(call, result, asynchronous)
            if work.exception() is not None:
                error = work.exception()
                break
            works.extend(work.works)
        return self._track(TorchWork(result, works, error))

    def shutdown(self) -> None:
        """torch's destroy_process_group calls this on every group it destroys."""
        self.group.close()
        self.group.engine.close()
        if self._watches_the_world:  # the watchdog polls the store, which may go once this rank leaves
            self._watches_the_world = False
            diagnostics.uninstall()

    def abort(self) -> None:
        self.shutdown()


def _asynchronous(opts) -> bool:
    """Whether the caller may go on before the operation completes: torch's Python API sets
    ``asyncOp`` from ``async_op``; C++ callers leave it at True (as an absent options object means)."""
    return opts is None or opts.asyncOp


def _counts(tensor, split_sizes, size: int, name: str) -> list[int]:
    """Per-rank element counts of torch's split sizes (rows of dim 0), checked as gloo checks them:
    one per rank, summing to dim 0. None given: equal blocks of the elements (gloo does not ask
    dim 0 to divide by the group size here; distcomm's own all_to_all_single does)."""
    if not split_sizes:
        return [tensor.numel() // size] * size
    dim0 = tensor.shape[0] if tensor.dim() else 1
    rows = args.split_sizes(split_sizes, dim0, size, "all_to_all_single", name)
    row = tensor.numel() // dim0 if dim0 else 0
    return [s * row for s in rows]


def create(common_opts, backend_options=None) -> DistcommProcessGroup:
    """torch's creator (``extended_api=True``): ``common_opts`` is a ``_DistributedBackendOptions``
    (store, group_rank, group_size, timeout, group_id, global_ranks_in_group).

    ``backend_options`` (init_process_group's ``pg_options``) may name the distcomm engine in an
    ``engine`` attribute: "gloo" (default), "shm" or "tcp"."""
    rank, size = common_opts.group_rank, common_opts.group_size
    timeout = _timeout(common_opts.timeout)
    engine_name = getattr(backend_options, "engine", None) or DEFAULT_ENGINE
    # the group's keys are numbered per init (as distcomm's own init_process_group numbers them): a
    # store that outlives destroy_process_group (one passed to init_process_group, torchrun's) holds
    # the earlier init's keys under the same group name, and an engine reading those would connect
    # to segments and ports that are gone
    generation = rollcall.take_generation(TorchStore(common_opts.store), rank, size, timeout)
    store = TorchStore(tdist.PrefixStore(f"distcomm/{generation}", common_opts.store))
    engine = backends.connect(engine_name, store, rank, size, timeout.total_seconds())
    global_ranks = list(common_opts.global_ranks_in_group) or list(range(size))
    group = ProcessGroup(
        0, str(common_opts.group_id), global_ranks, global_ranks[rank], engine, BACKEND_NAME, timeout,
        engine_name=engine_name, store=store, engine_ranks=range(size),
    )
    world = not common_opts.global_ranks_in_group  # torch's default group: the whole world, its store
    if world:
        # hang reports, failure causes, dumps on every rank
        diagnostics.install(store, rank, size, answer_on_leave=False)
        rollcall.finish(store, rank, size)  # rank 0, the store's host under env://, leaves init last
    return DistcommProcessGroup(group, watches_the_world=world)
