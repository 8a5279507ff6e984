"""The gradient reducer behind DistributedDataParallel: buckets, readiness, overlap, finalize.

How one backward pass is reduced
--------------------------------
- Parameters are grouped into *buckets* (flat tensors, one dtype each) in reverse parameter
  order, because backward produces the last layer's gradients first.
- Each parameter has a post-accumulate-grad hook. When it fires, the parameter's gradient is
  copied into its slot of the bucket (multiplied by 1/world_size, as torch does) and the parameter
  is *ready*. Where dividing the sum gives the same bits as summing the divided gradients (a
  floating-point bucket, a world size that is a power of two, the usual divisor and no comm hook
  or Join), the gradient is copied as it is and the bucket's all_reduce is an AVG: the engine
  divides each reduced part while it is still in cache, instead of a multiply per gradient.
  When every parameter of a bucket is ready the bucket is launched: an async all_reduce (or the
  registered comm hook), which the group's worker thread runs while backward goes on.
- Buckets are launched strictly in index order, on every rank, whatever order their gradients
  arrive in: collectives on a group are matched by order, so a rank must never launch bucket 3
  before bucket 2 while another rank does the opposite.
- The first hook of a backward queues ``finalize`` on the autograd engine; it runs when backward
  ends: it reduces the last bucket inline (its gradients are the last to be ready, so nothing is
  left to overlap with, and this saves two thread hand-offs), waits for the other buckets and
  makes the averaged values the parameters' ``.grad``.
- Without a comm hook, ``gradient_as_bucket_view``, ``find_unused_parameters``, ``static_graph``
  or Join, a bucket of at least ``IN_PLACE_BUCKET_BYTES`` is not used at all: its gradients are
  reduced where backward left them, one ``all_reduce_coalesced`` of the list (the engine reads the peers'
  gradients directly), so nothing is copied in or handed out. A gradient that existed before
  backward is the user's tensor and so updated in place, as torch does. Where the host has no
  spare core per rank, such buckets are not launched during backward but in finalize, one after
  the other (``overlap_setting``): the same collectives, without a reduction taking turns with
  backward on the same core.
- Otherwise, without a comm hook or ``gradient_as_bucket_view``, the bucket's memory itself is
  handed out: each ``param.grad`` becomes a tensor on this step's bucket instead of receiving a copy of it
  (one pass over every gradient less than torch's copy back). The next forward gives the bucket
  memory nothing else holds: the last buffer or the one before if ``zero_grad`` dropped the
  gradients on it (checked by the storage's use count), else a new one, so a gradient a user
  kept is never overwritten. Only gradients backward creates (``zero_grad(set_to_none=True)``,
  torch's default) are replaced so: a ``.grad`` that existed before backward is updated in place,
  as torch does.

Unused parameters
-----------------
With ``find_unused_parameters=True`` parameters unreachable from the forward outputs are marked
ready (with zeros) at the end of forward, so their buckets are not held back; any other parameter
still without a gradient when backward ends is marked then. An all_reduce of the "used locally"
map, launched after the last bucket, tells every rank which parameters no rank used: their
``.grad`` is left untouched, as torch does. With ``find_unused_parameters=False`` a parameter without
a gradient leaves its bucket unlaunched; the next forward raises torch's error naming it.
"""

from __future__ import annotations

import os
import warnings
import weakref
from typing import Any, Callable, Sequence

import numpy as np
import torch

from .._api.collectives import all_reduce, all_reduce_list
from ..types import ReduceOp

DEFAULT_FIRST_BUCKET_BYTES = 1024 * 1024  # torch's dist._DEFAULT_FIRST_BUCKET_BYTES
MB = 1024 * 1024
# From this size a bucket's gradients are reduced where they are (all_reduce_coalesced), with no
# copy into the bucket: the size from which the shared-memory engine reads the peers' tensors
# directly (its single-copy all_reduce). Below it the engine would concatenate them, and copying
# into the bucket and handing the bucket out is one pass less.
IN_PLACE_BUCKET_BYTES = 4 * MB


def debug_level() -> str:
    """OFF, INFO or DETAIL, from DISTCOMM_DEBUG or TORCH_DISTRIBUTED_DEBUG."""
    level = os.environ.get("DISTCOMM_DEBUG") or os.environ.get("TORCH_DISTRIBUTED_DEBUG") or "OFF"
    return level.upper()


def overlap_setting(group_size: int) -> bool:
    """Whether buckets reduced in place overlap backward (launched as they fill) or wait for its
    end: ``DISTCOMM_DDP_OVERLAP`` 1 or 0, or "auto" (the default): overlap when this process may
    use two cores per rank of the host (``LOCAL_WORLD_SIZE``, else the group's size), one for
    backward and one for the reduction. Without a spare core the reduction only takes turns with
    backward on the same core, and the turns (thread hand-offs, the interpreter lock) cost more than
    the overlap gains. Ranks may decide differently: the buckets' collectives are the same either way."""
    setting = os.environ.get("DISTCOMM_DDP_OVERLAP", "auto").strip().lower()
    if setting in ("1", "0"):
        return setting == "1"
    if setting != "auto":
        raise ValueError(f"DISTCOMM_DDP_OVERLAP={setting!r}: use 1, 0 or auto")
    local = int(os.environ.get("LOCAL_WORLD_SIZE") or group_size)
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    return cores >= 2 * local


def _no_sparse_gradient(param: torch.Tensor) -> torch.Tensor:
    """A sparse gradient of ``param`` with no entries: what a rank that did not use a sparse
    embedding (or joined early) contributes to its sum."""
    return torch.sparse_coo_tensor(torch.empty(1, 0, dtype=torch.int64),
                                   torch.empty(0, *param.shape[1:], dtype=param.dtype), param.shape,
                                   check_invariants=True)


def assign_buckets(params: Sequence[torch.Tensor], limits: Sequence[int],
                   expect_sparse: Sequence[bool] | None = None) -> list[list[int]]:
    """Indices of ``params`` per bucket, bucket 0 first: walk the parameters in reverse order,
    one open bucket per dtype, closing a bucket once it reaches its byte limit (``limits[0]`` for a
    dtype's first bucket, ``limits[1]`` (or the last limit) for the next ones). A parameter whose
    gradient is sparse (``expect_sparse[i]``: a ``sparse=True`` embedding) gets a bucket of its own,
    as in torch."""
    open_buckets: dict[torch.dtype, list[int]] = {}
    open_bytes: dict[torch.dtype, int] = {}
    closed_count: dict[torch.dtype, int] = {}
    buckets: list[list[int]] = []
    for i in reversed(range(len(params))):
        p = params[i]
        if expect_sparse is not None and expect_sparse[i]:
            buckets.append([i])
            continue
        bucket = open_buckets.setdefault(p.dtype, [])
        bucket.append(i)
        open_bytes[p.dtype] = open_bytes.get(p.dtype, 0) + p.numel() * p.element_size()
        n = closed_count.get(p.dtype, 0)
        if open_bytes[p.dtype] >= limits[min(n, len(limits) - 1)]:
            buckets.append(bucket)
            closed_count[p.dtype] = n + 1
            del open_buckets[p.dtype]
            open_bytes[p.dtype] = 0
    buckets.extend(b for b in open_buckets.values() if b)
    # Order by when their first gradient is expected: the reverse-order position of their first member.
    buckets.sort(key=lambda b: -b[0])
    return buckets


class GradBucket:
    """One bucket as a comm hook sees it (torch.distributed.GradBucket).

    ``buffer()`` is the flat tensor of the bucket's gradients (not yet averaged);
    ``gradients()`` are views of it shaped like ``parameters()``; ``index()`` is the bucket's
    number (bucket 0 holds the last parameters); ``is_last()`` is True for the last bucket of the
    iteration; ``set_buffer(t)`` replaces the buffer a later hook stage sees.
    """

    def __init__(self, index: int, buffer: torch.Tensor, params: list, offsets: list[int], is_last: bool):
        self._index = index
        self._buffer = buffer
        self._params = params
        self._offsets = offsets
        self._is_last = is_last

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def set_buffer(self, buffer: torch.Tensor) -> None:
        self._buffer = buffer

    def gradients(self) -> list[torch.Tensor]:
        if self._buffer.is_sparse:
            return [self._buffer]
        return [
            self._buffer[off:off + p.numel()].view(p.shape) for p, off in zip(self._params, self._offsets)
        ]

    def parameters(self) -> list[torch.Tensor]:
        return list(self._params)

    def is_last(self) -> bool:
        return self._is_last

    def __repr__(self) -> str:
        return f"<GradBucket {self._index} of {len(self._params)} parameters, {self._buffer.numel()} elements>"


class _Bucket:
    __slots__ = ("index", "members", "offsets", "numels", "shapes", "dtype", "buffer", "array", "views",
                 "pending", "handle", "is_last", "handed_out", "refs", "spare", "floating", "large", "in_place",
                 "deferred", "sparse", "sparse_grad")

    def __init__(self, index: int, members: list[int], params: Sequence[torch.Tensor], is_last: bool,
                 sparse: bool = False):
        self.index = index
        # A sparse bucket holds one parameter whose gradient is a sparse COO tensor: no flat buffer,
        # the gradient itself is reduced (a sparse all_reduce) and becomes the parameter's .grad.
        self.sparse = sparse
        self.sparse_grad = None
        self.members = members
        self.offsets = []
        self.numels = [params[i].numel() for i in members]
        self.shapes = [params[i].shape for i in members]
        self.dtype = params[members[0]].dtype
        self.floating = self.dtype.is_floating_point  # real floats: scaling by 1/2^k is exact
        total = 0
        for n in self.numels:
            self.offsets.append(total)
            total += n
        self.large = not sparse and total * params[members[0]].element_size() >= IN_PLACE_BUCKET_BYTES
        self.in_place = False  # this step: reduced on the gradients themselves (Reducer.prepare_for_backward)
        self.deferred = False  # this step: reduced in finalize, not during backward
        self.pending = len(members)
        self.handle = None  # Work (all_reduce) or Future (comm hook) once launched
        self.is_last = is_last
        self.buffer = self.spare = None
        self.handed_out = False
        if sparse:
            self.views, self.array, self.refs = [None], None, -1
        else:
            self.renew(torch.zeros)

    def renew(self, allocate=torch.empty) -> None:
        """Make the bucket's memory free for the coming backward: the last one was handed out as the
        parameters' ``.grad``. Reuse it, or the one before, if nothing else holds it any more
        (``zero_grad()`` dropped those gradients); else allocate a new buffer (the user keeps the
        old). Two buffers cover both ``zero_grad(set_to_none=True)`` and ``set_to_none=False``."""
        current = (self.buffer, self.views, self.array, self.refs) if self.buffer is not None else None
        if current is not None and _storage_free(current):
            self.handed_out = False
            return
        if self.spare is not None and _storage_free(self.spare):
            self.buffer, self.views, self.array, self.refs = self.spare
            self.spare = current
            self.handed_out = False
            return
        self.spare = current
        self.buffer = allocate(sum(self.numels), dtype=self.dtype)
        self.views = [flat.view(shape) for flat, shape in zip(self.buffer.split(self.numels), self.shapes)]
        # The numpy view of the buffer (same memory): all_reduce takes it without converting a
        # tensor each step. bfloat16 has no numpy dtype: the tensor is used then.
        self.array = None if self.dtype == torch.bfloat16 else self.buffer.numpy()
        self.refs = _storage_refs(self.buffer)  # the references the bucket itself holds
        self.handed_out = False


# How many tensors share a tensor's memory: a handed-out bucket is reused only when the bucket's own
# tensors are all that is left. Without this torch function every renewal allocates.
_use_count = getattr(torch._C, "_storage_Use_Count", None)


def _storage_refs(buffer: torch.Tensor) -> int:
    return -1 if _use_count is None else _use_count(buffer.untyped_storage()._cdata)


def _storage_free(entry) -> bool:
    buffer, _views, _array, refs = entry
    return _use_count is not None and _storage_refs(buffer) == refs


class _DDPSink(torch.autograd.Function):
    """Identity on the forward outputs whose backward queues finalize: backward then always ends
    with a finalize, even on a rank where no parameter gets a gradient (find_unused_parameters)."""

    @staticmethod
    def forward(ctx, reducer_ref, *outputs):
        ctx.set_materialize_grads(False)
        ctx.reducer_ref = reducer_ref
        return tuple(t.clone() for t in outputs)

    @staticmethod
    def backward(ctx, *grads):
        reducer = ctx.reducer_ref()
        if reducer is not None:
            reducer._queue_finalize()
        return (None, *grads)


def find_tensors(obj: Any) -> list[torch.Tensor]:
    """The tensors in a forward output: nested lists, tuples, dicts and dataclass fields."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in find_tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in find_tensors(o)]
    if hasattr(obj, "__dataclass_fields__"):
        return [t for name in obj.__dataclass_fields__ for t in find_tensors(getattr(obj, name))]
    return []


def reachable_leaves(outputs: Sequence[torch.Tensor]) -> set[int]:
    """ids of the leaf tensors the autograd graph of ``outputs`` reaches (its AccumulateGrad nodes)."""
    found: set[int] = set()
    seen = set()
    stack = []
    for t in outputs:
        if t.grad_fn is not None:
            stack.append(t.grad_fn)
        elif t.requires_grad:
            found.add(id(t))
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if variable is not None:
            found.add(id(variable))
        for nxt, _ in node.next_functions:
            if nxt is not None and nxt not in seen:
                stack.append(nxt)
    return found


class Reducer:
    """Averages the gradients of ``params`` over ``group`` during backward; see the module docstring."""

    def __init__(
        self,
        params: list[torch.Tensor],
        names: list[str],
        bucket_members: list[list[int]],
        group,
        find_unused_parameters: bool,
        gradient_as_bucket_view: bool,
        static_graph: bool,
        expect_sparse: Sequence[bool] | None = None,
    ):
        self.params = params
        self.names = names
        self.group = group
        self.world_size = group.size()
        self.rank = group.rank()
        self.find_unused = find_unused_parameters
        self.static_graph = static_graph
        self.grad_as_view = gradient_as_bucket_view
        self.buckets = [
            _Bucket(k, members, params, k == len(bucket_members) - 1,
                    sparse=bool(expect_sparse is not None and expect_sparse[members[0]]))
            for k, members in enumerate(bucket_members)
        ]
        # param index -> (its bucket, its place among the bucket's members); not the view itself:
        # a bucket's buffer changes when the last one was handed out as gradients
        self.slot: list = [None] * len(params)
        for b in self.buckets:
            for place, i in enumerate(b.members):
                self.slot[i] = (b, place)
        self.comm_hook: Callable | None = None
        self.comm_state: Any = None
        self.divide_by_initial_world_size = True
        self._join_work = None
        self._expect_hooks = False
        self._finalize_queued = False
        self._ready = [False] * len(params)
        self._used = np.zeros(len(params), dtype=np.int32)
        self._used_work = None
        self._next_bucket = 0
        self._had_grad: list[bool] = []
        self._div_factor: float | None = None
        # this step's buckets of floats are averaged by the all_reduce (see _divide_factor)
        self._avg_in_reduce = False
        # Multiplying by 1/2^k is exact, so for such world sizes (a0/p + a1/p) + ... equals
        # (a0 + a1 + ...)/p bit for bit (barring overflow and subnormals): torch's premultiplied
        # sum and the engine's AVG agree.
        self._pow2_world = self.world_size & (self.world_size - 1) == 0
        self._unfinished: list[int] | None = None  # params without a gradient in the last backward
        self._warned_all_used = False
        self.overlap_in_place = overlap_setting(self.world_size)
        self._handles = []
        ref = weakref.ref(self)
        for i, p in enumerate(params):
            self._handles.append(p.register_post_accumulate_grad_hook(_make_hook(ref, i)))

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    # -- per iteration ------------------------------------------------------------------------
    def set_join_work(self, work, divide_by_initial_world_size: bool) -> None:
        self._join_work = work
        self.divide_by_initial_world_size = divide_by_initial_world_size

    def prepare_for_backward(self, outputs: list[torch.Tensor] | None) -> None:
        """Arm the hooks for the coming backward. ``outputs`` (find_unused_parameters only): the
        forward's output tensors, to mark the parameters they cannot reach as unused right away."""
        self.ensure_prior_reduction_finished()
        self._expect_hooks = True
        self._finalize_queued = False
        self._ready = [False] * len(self.params)
        self._used[:] = 0
        self._used_work = None
        self._next_bucket = 0
        self._div_factor = None
        self._avg_in_reduce = False
        # A gradient that exists before backward is the user's tensor, updated in place as torch
        # does; only gradients backward creates are replaced by tensors on the bucket.
        self._had_grad = [p.grad is not None for p in self.params]
        # Under Join a joined rank answers each bucket with an all_reduce of a zero-filled bucket:
        # the training ranks must then issue the same collective, on their buckets.
        in_place = (self.comm_hook is None and not self.grad_as_view and not self.find_unused
                    and not self.static_graph and self._join_work is None)
        for b in self.buckets:
            b.pending = len(b.members)
            b.handle = None
            b.in_place = in_place and b.large
            b.deferred = b.in_place and not self.overlap_in_place
            if b.handed_out:
                b.renew()
        if outputs is not None:
            reached = reachable_leaves(outputs)
            unused = [i for i, p in enumerate(self.params) if id(p) not in reached]
            for i in unused:
                # its .grad, if any (accumulated under no_sync()), is its contribution, as in torch;
                # it is not marked used: no rank using it leaves every .grad as it is
                self._mark_ready(i, self.params[i])
            if not unused and not self._warned_all_used:
                self._warned_all_used = True
                warnings.warn(
                    "find_unused_parameters=True was specified in DDP constructor, but did not find any unused "
                    "parameters in the forward pass. This flag results in an extra traversal of the autograd graph "
                    "every iteration, which can adversely affect performance. If your model indeed never has any "
                    "unused parameters in the forward pass, consider turning this flag off. Note that this warning "
                    "may be a false positive if your model has flow control causing later iterations to have unused "
                    "parameters.",
                    stacklevel=4,
                )

    def ensure_prior_reduction_finished(self) -> None:
        if self._unfinished is None:
            return
        missing, self._unfinished = self._unfinished, None
        raise RuntimeError(self._unused_error(missing))

    def _unused_error(self, missing: list[int]) -> str:
        text = (
            "Expected to have finished reduction in the prior iteration before starting a new one. This error "
            "indicates that your module has parameters that were not used in producing loss. You can enable unused "
            "parameter detection by passing the keyword argument `find_unused_parameters=True` to "
            "`torch.nn.parallel.DistributedDataParallel`, and by \nmaking sure all `forward` function outputs "
            "participate in calculating loss. \nIf you already have done the above, then the distributed data "
            "parallel module wasn't able to locate the output tensors in the return value of your module's "
            "`forward` function. Please include the loss function and the structure of the return value of "
            "`forward` of your module when reporting this issue (e.g. list, dict, iterable).\n"
        )
        if debug_level() in ("INFO", "DETAIL"):
            text += f"Parameters which did not receive grad for rank {self.rank}: {', '.join(self.names[i] for i in missing)}\n"
            text += f"Parameter indices which did not receive grad for rank {self.rank}: {' '.join(map(str, missing))}"
        else:
            text += f"Parameter indices which did not receive grad for rank {self.rank}: {' '.join(map(str, missing))}\n"
            text += (
                " In addition, you can set the environment variable TORCH_DISTRIBUTED_DEBUG (or DISTCOMM_DEBUG) to "
                "either INFO or DETAIL to print out information about which particular parameters did not receive "
                "gradient on this rank as part of this error"
            )
        return text

    # -- readiness ----------------------------------------------------------------------------
    def _queue_finalize(self) -> None:
        if not self._finalize_queued:
            self._finalize_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finalize)

    def _on_grad(self, i: int) -> None:
        if not self._expect_hooks:
            return  # no_sync(), eval, or a second backward: gradients stay local
        self._queue_finalize()
        if self._ready[i]:
            raise RuntimeError(
                f"Expected to mark a variable ready only once. This error is caused by parameter "
                f"{self._describe(i)} being marked ready twice in one iteration: it is used by more than one "
                "reentrant backward pass, or it was found unused in the forward pass (its output was not "
                "returned by forward) yet received a gradient. With find_unused_parameters=True, make every "
                "tensor that depends on parameters part of forward's return value."
            )
        param = self.params[i]
        if param.grad is not None:  # None: an output not used in the loss sent no gradient here
            self._used[i] = 1
        self._mark_ready(i, param)

    def _describe(self, i: int) -> str:
        return self.names[i] if debug_level() in ("INFO", "DETAIL") else f"index {i}"

    def _divide_factor(self) -> float:
        """This step's divisor; also decides whether the all_reduce averages the float buckets
        (an AVG): only with no comm hook (it gets the bucket premultiplied, as torch's do) and no
        Join (a joined rank answers with a SUM of zeros, and the divisor may not be the world size)."""
        if self._div_factor is None:
            self._div_factor = float(self.world_size)
            if self._join_work is not None and not self.divide_by_initial_world_size:
                self._div_factor = float(self._join_work.result()[0][0])
            self._avg_in_reduce = self._pow2_world and self.comm_hook is None and self._join_work is None
            self._join_work = None
        return self._div_factor

    def _mark_ready(self, i: int, param: torch.Tensor | None) -> None:
        """Put parameter i's contribution in its bucket slot (zeros when ``param`` is None).

        No ``torch.no_grad()`` here: gradients and buckets never require grad, and hooks run with
        grad mode off, so nothing is recorded (and this runs once per parameter per step)."""
        self._ready[i] = True
        bucket, place = self.slot[i]
        view = bucket.views[place]
        grad = None if param is None else param.grad
        if bucket.sparse:
            self._sparse_ready(bucket, i, grad)
        elif bucket.in_place:
            if grad is None:  # no gradient reached it: it contributes zeros, and gets the average
                grad = param.grad = torch.zeros_like(param)
            factor = self._div_factor or self._divide_factor()
            if not (self._avg_in_reduce and bucket.floating):
                grad.mul_(1.0 / factor)
        elif grad is None:
            view.zero_()
        elif self.comm_hook is not None:
            if not self.grad_as_view or grad.data_ptr() != view.data_ptr():
                view.copy_(grad)
                if self.grad_as_view:
                    param.grad = view
        else:
            factor = self._div_factor or self._divide_factor()
            averaged_later = self._avg_in_reduce and bucket.floating
            if self.grad_as_view:
                if grad.data_ptr() != view.data_ptr():
                    view.copy_(grad)
                    param.grad = view
                if not averaged_later:
                    view.div_(factor)
            elif averaged_later:
                view.copy_(grad)
            else:
                torch.mul(grad, 1.0 / factor, out=view)
        bucket.pending -= 1
        if bucket.pending == 0:
            self._launch_ready_buckets()

    def _sparse_ready(self, bucket: _Bucket, i: int, grad: torch.Tensor | None) -> None:
        """A sparse bucket's contribution: the gradient (an empty sparse tensor when there is none),
        divided by this step's factor before the sum unless a comm hook reduces it (torch's order)."""
        param = self.params[i]
        if grad is None:
            grad = _no_sparse_gradient(param)
        elif not grad.is_sparse:
            raise RuntimeError(
                f"DistributedDataParallel expected a sparse gradient for parameter {self._describe(i)} (a sparse=True "
                f"embedding) on rank {self.rank}, got a dense one: keep the embedding's sparse flag the same for the "
                "whole training, or construct DistributedDataParallel again after changing it"
            )
        if self.comm_hook is None:
            grad = grad / (self._div_factor or self._divide_factor())
        else:
            grad = grad.clone()  # the hook's buffer: the user's .grad is replaced only by the result
        bucket.sparse_grad = grad

    def _launch_ready_buckets(self, final: bool = False) -> None:
        """Launch the ready buckets, in index order. The last bucket waits for ``final`` (finalize):
        once its gradients are ready backward has ended, and reducing it inline in finalize saves
        two thread hand-offs, which is most of a small model's communication time. So does a
        deferred bucket (and every bucket after it): see ``overlap_in_place``. What finalize
        launches runs inline."""
        last = len(self.buckets) - 1
        while self._next_bucket <= last and self.buckets[self._next_bucket].pending == 0:
            bucket = self.buckets[self._next_bucket]
            if not final and (self._next_bucket == last or bucket.deferred):
                return
            if bucket.sparse:
                data = bucket.sparse_grad
            elif bucket.in_place:
                data = [self.params[i].grad for i in bucket.members]
            else:
                data = bucket.array if bucket.array is not None and self.comm_hook is None else bucket.buffer
            bucket.handle = self._reduce(bucket.index, data, inline=final)
            self._next_bucket += 1
        if self._next_bucket == len(self.buckets) and self.find_unused and not self.static_graph:
            if self._used_work is None:
                self._used_work = all_reduce(self._used, group=self.group, async_op=True)

    def _reduce(self, index: int, buffer, inline: bool = False, op=None):
        """Start reducing bucket ``index`` (``buffer``: its tensor, or its numpy view on the default
        path, or the list of its gradients when it is reduced in place); ``op``: this step's (SUM
        or AVG, see ``_divide_factor``) unless given."""
        if self.comm_hook is None:
            if op is None:
                self._divide_factor()  # decides the op, also for a bucket of unused parameters alone
                bucket = self.buckets[index]
                op = ReduceOp.AVG if self._avg_in_reduce and bucket.floating and not bucket.sparse else ReduceOp.SUM
            reduce = all_reduce_list if isinstance(buffer, list) else all_reduce
            if inline:
                reduce(buffer, op=op, group=self.group)
                return _DONE
            return reduce(buffer, op=op, group=self.group, async_op=True)
        bucket = self.buckets[index]
        grad_bucket = GradBucket(index, buffer, [self.params[i] for i in bucket.members], bucket.offsets, bucket.is_last)
        future = self.comm_hook(self.comm_state, grad_bucket)
        if not callable(getattr(future, "wait", None)):
            name = getattr(self.comm_hook, "__name__", repr(self.comm_hook))
            raise TypeError(
                f"DDP communication hook {name} returned {type(future).__name__} for bucket {index} on rank "
                f"{self.rank}: a hook must return a torch.futures.Future whose value is the bucket's reduced tensor "
                "(e.g. all_reduce(..., async_op=True).get_future(), or a Future you complete with set_result)"
            )
        return future

    # -- end of backward ----------------------------------------------------------------------
    def _finalize(self) -> None:
        self._expect_hooks = False
        self._finalize_queued = False
        if self.find_unused or self.static_graph:
            for i, ready in enumerate(self._ready):
                if not ready:
                    self._mark_ready(i, self.params[i])
        self._launch_ready_buckets(final=True)
        if self._next_bucket < len(self.buckets):
            # find_unused_parameters=False and some parameter got no gradient: report it at the next
            # forward, as torch does. Launched buckets are left running: waiting could hang when
            # the ranks disagree about which parameters were used.
            self._unfinished = [i for i, ready in enumerate(self._ready) if not ready]
            return
        for bucket in self.buckets:
            self._wait_bucket(bucket)
        if self._used_work is not None:
            self._used_work.wait()
            globally_used = self._used
        elif self.static_graph:
            globally_used = self._used  # the same parameters are used on every rank
        else:
            globally_used = None
        hand_out = not self.grad_as_view and self.comm_hook is None
        with torch.no_grad():
            for bucket in self.buckets:
                if bucket.sparse:
                    i = bucket.members[0]
                    if globally_used is None or globally_used[i]:
                        self.params[i].grad = bucket.sparse_grad
                    bucket.sparse_grad = None
                    continue
                if bucket.in_place:
                    continue  # the gradients themselves were reduced
                if hand_out:
                    # The averaged values are already in the bucket: they become the gradients
                    # (views of this step's bucket, which the next step does not reuse) instead
                    # of being copied into the tensors backward made. This saves a pass over
                    # every gradient; the bucket is renewed at the next forward.
                    bucket.handed_out = True
                for i, view in zip(bucket.members, bucket.views):
                    if globally_used is not None and not globally_used[i]:
                        continue
                    param = self.params[i]
                    if hand_out and not self._had_grad[i]:
                        # A tensor of its own on the bucket's memory (not the bucket's view object),
                        # so that the storage's use count shows whether anyone still holds it.
                        param.grad = view.detach()
                    elif self.grad_as_view:
                        if param.grad is None or param.grad.data_ptr() != view.data_ptr():
                            param.grad = view
                    elif param.grad is None:
                        param.grad = view.clone()
                    else:
                        param.grad.copy_(view)

    def _wait_bucket(self, bucket: _Bucket) -> None:
        handle, bucket.handle = bucket.handle, None
        if self.comm_hook is None:
            handle.wait()
            return
        result = handle.wait()
        if isinstance(result, (list, tuple)):
            result = result[0]
        if not isinstance(result, torch.Tensor):
            raise RuntimeError(
                f"the DDP communication hook must return a Future whose value is the bucket's tensor; "
                f"bucket {bucket.index} got {type(result).__name__}"
            )
        if bucket.sparse:
            bucket.sparse_grad = result
            return
        if result.numel() != bucket.buffer.numel():
            raise RuntimeError(
                f"the DDP communication hook's result for bucket {bucket.index} on rank {self.rank} has "
                f"{result.numel()} elements, the bucket {bucket.buffer.numel()}: the Future's value must be the "
                "bucket's reduced tensor, with as many elements as bucket.buffer()"
            )
        if result.data_ptr() != bucket.buffer.data_ptr():
            with torch.no_grad():
                bucket.buffer.copy_(result.reshape(-1))

    # -- join: what a joined rank does to answer one backward of the others -------------------
    def match_backward_with_zeros(self) -> None:
        handles = []
        for bucket in self.buckets:
            if bucket.sparse:
                param = self.params[bucket.members[0]]
                handles.append(self._reduce(bucket.index, _no_sparse_gradient(param), op=ReduceOp.SUM))
                continue
            zeros = torch.zeros_like(bucket.buffer)
            # the training ranks are under Join: their buckets are premultiplied and summed
            handles.append(self._reduce(bucket.index, zeros, op=ReduceOp.SUM))
        for handle in handles:
            handle.wait()
        if self.find_unused and not self.static_graph:
            all_reduce(np.zeros(len(self.params), dtype=np.int32), group=self.group)


class _Done:
    """The handle of a bucket reduced inline: already complete."""

    @staticmethod
    def wait() -> None:
        return None


_DONE = _Done()


def _make_hook(ref: "weakref.ref[Reducer]", i: int):
    def hook(param):
        reducer = ref()
        if reducer is not None:
            reducer._on_grad(i)

    return hook
