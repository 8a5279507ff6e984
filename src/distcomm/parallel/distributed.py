"""DistributedDataParallel: data parallelism at module level, on distcomm's collectives.

Each rank holds a replica of the module and a shard of every batch. At construction the replicas
are made equal (parameters and buffers broadcast from rank 0); during backward the gradients are
averaged over the ranks, bucket by bucket, overlapping communication with the rest of backward
(see ``reducer.py``); buffers (BatchNorm statistics) are broadcast from rank 0 before each forward.
After ``loss.backward()`` every rank holds the same averaged gradients, so identical optimizer
steps keep the replicas identical.

Behaviour follows ``torch.nn.parallel.DistributedDataParallel`` on CPU: same constructor, the same
collectives in the same order per iteration (so ``Join`` works the same way), the same error texts.
"""

from __future__ import annotations

import sys
import warnings
import weakref
from contextlib import contextmanager
from typing import Any, Callable

import numpy as np
import torch

from .. import world
from .._api.collectives import all_reduce, broadcast
from .._api.objects import all_gather_object
from .._api.groups import get_global_rank
from ..algorithms.join import Join, Joinable, JoinHook
from ..types import ReduceOp
from .reducer import (
    DEFAULT_FIRST_BUCKET_BYTES,
    MB,
    Reducer,
    _DDPSink,
    assign_buckets,
    debug_level,
    find_tensors,
)

DEFAULT_BUCKET_CAP_MB = 25
BROADCAST_BUCKET_BYTES = 250 * MB  # torch's broadcast_bucket_size for module states


def _chunks(tensors: list[torch.Tensor], bucket_bytes: int):
    chunk: list[torch.Tensor] = []
    size = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if chunk and size + nbytes > bucket_bytes:
            yield chunk
            chunk, size = [], 0
        chunk.append(t)
        size += nbytes
    if chunk:
        yield chunk


def broadcast_coalesced(tensors: list[torch.Tensor], src_rank: int, group, bucket_bytes: int = BROADCAST_BUCKET_BYTES) -> None:
    """Broadcast ``tensors`` from group rank ``src_rank``, packed into few flat messages (one per
    dtype and ``bucket_bytes``) instead of one collective per tensor."""
    src = get_global_rank(group, src_rank)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    with torch.no_grad():
        for same_dtype in by_dtype.values():
            for chunk in _chunks(same_dtype, bucket_bytes):
                flat = torch.cat([t.detach().reshape(-1) for t in chunk])
                broadcast(flat, src=src, group=group)
                if group.rank() == src_rank:
                    continue
                offset = 0
                for t in chunk:
                    t.copy_(flat[offset:offset + t.numel()].view_as(t))
                    offset += t.numel()


class _DDPJoinHook(JoinHook):
    """What a joined rank does for each iteration the others still train: the buffer broadcast,
    the "sync this backward?" all_reduce and, when they sync, one zero-filled all_reduce per bucket."""

    def __init__(self, ddp: "DistributedDataParallel", divide_by_initial_world_size: bool):
        self.ddp = ddp
        ddp._divide_by_initial_world_size = divide_by_initial_world_size

    def main_hook(self) -> None:
        ddp = self.ddp
        if ddp.will_sync_module_buffers():
            ddp._sync_buffers(authoritative_rank=ddp._find_common_rank(False))
        should_sync = ddp._check_global_requires_backward_grad_sync(is_joined_rank=True)
        ddp.require_forward_param_sync = should_sync
        if should_sync:
            ddp.reducer.match_backward_with_zeros()

    def post_hook(self, is_last_joiner: bool) -> None:
        self.ddp._sync_final_model(is_last_joiner)


class DistributedDataParallel(torch.nn.Module, Joinable):
    """Wrap ``module`` so that ``loss.backward()`` averages its gradients over the process group.

    Arguments (as torch's):
        module: the replica on this rank (on CPU).
        device_ids, output_device: for GPU modules; must be None for CPU modules.
        dim: kept for compatibility (inputs are not scattered on CPU).
        broadcast_buffers: deprecated in torch 2.13 for ``forward_sync_buffers`` (and warns when given,
            as torch's): broadcast buffers from rank 0 at the start of each forward; ``False`` also
            skips the buffers at construction (default None: True).
        init_sync: make replicas equal at construction by broadcasting from rank 0 (default True).
        process_group: the group to average over (default: the world).
        bucket_cap_mb: bucket size in MiB (default 25; the first bucket is then capped at 1 MiB
            so communication starts early).
        find_unused_parameters: tolerate parameters that get no gradient in some iterations.
        gradient_as_bucket_view: make ``param.grad`` views into the buckets (saves memory). Without
            it a ``.grad`` that backward creates is also a tensor on a bucket's memory, but on
            memory no later step writes while the gradient is still held; in a bucket of 4 MiB or
            more (reducer.IN_PLACE_BUCKET_BYTES) it stays the tensor backward made, reduced in place.
        static_graph: the set of used parameters never changes; unused ones are then tolerated
            without the per-iteration search.
        skip_all_reduce_unused_params, batched_grad_copy: torch's performance options; accepted, and
            the gradients are those without them (skipping requires the same unused parameters on
            every rank, where skipping changes nothing).
        bucket_cap_mb_list: per-bucket size limits in MiB (bucket k of a dtype gets entry k, later
            buckets the last one); overrides ``bucket_cap_mb``.
        forward_sync_buffers: broadcast buffers at the start of each forward and after a Join
            (default None: True); buffers are broadcast at construction either way.
        delay_all_reduce_named_params, param_to_hook_all_reduce, mixed_precision, device_mesh: not
            supported by distcomm (NotImplementedError when given).

    Example::

        model = DistributedDataParallel(torch.nn.Linear(10, 1))
        loss = model(inputs).pow(2).mean()
        loss.backward()          # gradients now averaged over all ranks
        optimizer.step()
    """

    def __init__(
        self,
        module: torch.nn.Module,
        device_ids=None,
        output_device=None,
        dim: int = 0,
        broadcast_buffers: bool | None = None,
        init_sync: bool = True,
        process_group=None,
        bucket_cap_mb: float | None = None,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        delay_all_reduce_named_params=None,
        param_to_hook_all_reduce=None,
        mixed_precision=None,
        device_mesh=None,
        skip_all_reduce_unused_params: bool = False,
        bucket_cap_mb_list: list[int] | None = None,
        batched_grad_copy: bool = False,
        forward_sync_buffers: bool | None = None,
    ):
        super().__init__()
        Joinable.__init__(self)
        if (delay_all_reduce_named_params is None) != (param_to_hook_all_reduce is None):
            raise ValueError("delay_all_reduce_named_params and param_to_hook_all_reduce need to be set at the same time.")
        if process_group is not None and device_mesh is not None:
            raise RuntimeError("Cannot specify both process_group and device_mesh arguments.")
        for name, value in (("delay_all_reduce_named_params", delay_all_reduce_named_params),
                            ("mixed_precision", mixed_precision), ("device_mesh", device_mesh)):
            if value is not None:
                hint = ("pass the mesh's group as process_group= (a distcomm group)" if name == "device_mesh"
                        else "leave it None")
                raise NotImplementedError(
                    f"distcomm's DistributedDataParallel does not support {name}; {hint}, or use torch's "
                    "DistributedDataParallel over the \"distcomm\" backend, which has it"
                )
        if broadcast_buffers is not None:
            if forward_sync_buffers is not None:
                warnings.warn(
                    "Both `broadcast_buffers` and `forward_sync_buffers` were specified. `broadcast_buffers` is "
                    "deprecated and its value is ignored when `forward_sync_buffers` is provided.",
                    stacklevel=2,
                )
            else:
                warnings.warn(
                    "`broadcast_buffers` is deprecated. Use `forward_sync_buffers` instead. IMPORTANT: unlike "
                    "`broadcast_buffers=False`, `forward_sync_buffers=False` still syncs buffers at init. If you "
                    "rely on buffers NOT being synced at init (e.g. rank-local buffers), keep using "
                    "`broadcast_buffers=False` until `init_sync_buffers` is available.",
                    stacklevel=2,
                )
        if forward_sync_buffers is not None:
            init_sync_buffers = True
        else:
            forward_sync_buffers = broadcast_buffers if broadcast_buffers is not None else True
            init_sync_buffers = forward_sync_buffers
        if check_reduction:
            warnings.warn(
                "The `check_reduction` argument in `DistributedDataParallel` module is deprecated. Please avoid "
                "using it.",
                stacklevel=2,
            )
        self.process_group = process_group if process_group is not None else world.group.WORLD
        if self.process_group is None:
            raise ValueError(
                "Default process group has not been initialized, please make sure to call init_process_group."
            )
        ignore = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
        self.parameters_to_ignore = ignore
        named = [(n, p) for n, p in module.named_parameters() if n not in ignore]
        if not any(p.requires_grad for _, p in named):
            raise RuntimeError(
                "DistributedDataParallel is not needed when a module doesn't have any parameter that requires a gradient."
            )
        if any(isinstance(p, torch.nn.parameter.UninitializedParameter) for _, p in named):
            raise RuntimeError(
                "Modules with uninitialized parameters can't be used with `DistributedDataParallel`. "
                "Run a dummy forward pass to correctly initialize the modules"
            )
        if device_ids is not None and len(device_ids) > 1:
            raise ValueError("device_ids can only be None or contain a single element.")
        devices = {p.device for _, p in named}
        if any(d.type != "cpu" for d in devices):
            raise ValueError(
                f"distcomm's DistributedDataParallel runs CPU modules; the module's parameters are on {devices}"
            )
        if device_ids or output_device:
            raise ValueError(
                "DistributedDataParallel device_ids and output_device arguments only work with single-device/"
                "multiple-device GPU modules or CPU modules, but got device_ids "
                f"{device_ids}, output_device {output_device}, and module parameters {devices}."
            )
        self.module = module
        self.device_ids = None
        self.output_device = None
        self.dim = dim
        self.device = next(iter(devices))
        self.forward_sync_buffers = bool(forward_sync_buffers)
        self.skip_all_reduce_unused_params = skip_all_reduce_unused_params
        self.batched_grad_copy = batched_grad_copy
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = static_graph
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True
        self._divide_by_initial_world_size = True
        self.broadcast_bucket_size = BROADCAST_BUCKET_BYTES
        cap_mb = DEFAULT_BUCKET_CAP_MB if bucket_cap_mb is None else bucket_cap_mb
        if bucket_cap_mb_list:
            limits = [int(mb * MB) for mb in bucket_cap_mb_list]
            self.bucket_bytes_cap = max(limits)
        else:
            self.bucket_bytes_cap = int(cap_mb * MB)
            first_cap = DEFAULT_FIRST_BUCKET_BYTES if bucket_cap_mb is None else self.bucket_bytes_cap
            limits = [first_cap, self.bucket_bytes_cap]

        # Parameters that take part: requires_grad, not ignored, shared ones once.
        memo: set[int] = set()
        params, names = [], []
        for n, p in named:
            if p.requires_grad and id(p) not in memo:
                memo.add(id(p))
                params.append(p)
                names.append(n)
        self._assign_modules_buffers()
        if init_sync:
            self._verify_param_shapes(params)
            self._sync_params_and_buffers(0, init_sync_buffers)
        # sparse=True embeddings give sparse gradients: each gets a bucket of its own (torch's rule)
        sparse_weights = {
            id(m.weight) for m in module.modules()
            if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse
        }
        expect_sparse = [id(p) in sparse_weights for p in params]
        members = assign_buckets(params, limits, expect_sparse)
        self.reducer = Reducer(
            params, names, members, self.process_group, find_unused_parameters, gradient_as_bucket_view, static_graph,
            expect_sparse,
        )
        self._comm_hook_registered = False
        if debug_level() in ("INFO", "DETAIL"):
            self._log_construction(params, members)

    # -- construction helpers -----------------------------------------------------------------
    def _assign_modules_buffers(self) -> None:
        named = [(n, b) for n, b in self.module.named_buffers() if n not in self.parameters_to_ignore]
        self.modules_buffers = [b for _, b in named]
        self.named_module_buffers = dict(named)

    def _verify_param_shapes(self, params: list[torch.Tensor]) -> None:
        mine = [(tuple(p.shape), str(p.dtype)) for p in params]
        everyone: list[Any] = [None] * self.process_group.size()
        all_gather_object(everyone, mine, group=self.process_group)
        ref = everyone[0]
        for rank, shapes in enumerate(everyone):
            if len(shapes) != len(ref):
                raise RuntimeError(
                    f"DDP expects same model across all ranks, but Rank {self.process_group.rank()} has "
                    f"{len(mine)} params, while rank {rank} has inconsistent {len(shapes)} params."
                )
            for i, (a, b) in enumerate(zip(ref, shapes)):
                if a != b:
                    raise RuntimeError(
                        f"DDP expects same model across all ranks, but parameter {i} has shape {b[0]} and dtype "
                        f"{b[1]} on rank {rank} and shape {a[0]}, dtype {a[1]} on rank 0."
                    )

    def _sync_params_and_buffers(self, src_rank: int, with_buffers: bool) -> None:
        states = [p for n, p in self.module.named_parameters() if n not in self.parameters_to_ignore]
        if with_buffers:
            states += self.modules_buffers
        if states:
            broadcast_coalesced(states, src_rank, self.process_group, self.broadcast_bucket_size)

    def _log_construction(self, params, members) -> None:
        sizes = [sum(params[i].numel() * params[i].element_size() for i in b) for b in members]
        lines = [
            f"[Rank {self.process_group.rank()}]: DDP Initialized with:",
            f"broadcast_buffers: {int(self.broadcast_buffers)}",
            f"bucket_cap_bytes: {self.bucket_bytes_cap}",
            f"find_unused_parameters: {int(self.find_unused_parameters)}",
            f"gradient_as_bucket_view: {int(self.gradient_as_bucket_view)}",
            f"num_parameter_tensors: {len(params)}",
            f"rank: {self.process_group.rank()}",
            f"total_parameter_size_bytes: {sum(sizes)}",
            f"world_size: {self.process_group.size()}",
            f"backend_name: {self.process_group.name()}",
            f"bucket_sizes: {', '.join(map(str, sizes))}",
            f"dtypes: {', '.join(sorted({str(p.dtype).replace('torch.', '') for p in params}))}",
            f"module_name: {type(self.module).__name__}",
            f"static_graph: {int(self.static_graph)}",
        ]
        sys.stderr.write("\n".join(lines) + "\n")

    # -- forward ------------------------------------------------------------------------------
    def forward(self, *inputs, **kwargs):
        grad_sync = torch.is_grad_enabled() and self.require_backward_grad_sync
        work = Join.notify_join_context(self)
        if work is not None:
            self.reducer.set_join_work(work, self._divide_by_initial_world_size)
        if self.will_sync_module_buffers():
            self._sync_buffers(self._find_common_rank(True) if self._join_config.enable else 0)
        if self._join_config.enable:
            self._check_global_requires_backward_grad_sync(is_joined_rank=False)
        output = self.module(*inputs, **kwargs)
        if not grad_sync:
            self.require_forward_param_sync = False
            return output
        self.require_forward_param_sync = True
        search = self.find_unused_parameters and not self.static_graph
        self.reducer.prepare_for_backward(find_tensors(output) if search else None)
        if search:
            output = self._through_sink(output)
        return output

    def _through_sink(self, output):
        tensors = find_tensors(output)
        routed = [t for t in tensors if t.requires_grad]
        if not routed:
            return output
        replaced = dict(zip(map(id, routed), _DDPSink.apply(weakref.ref(self.reducer), *routed)))
        return _rebuild(output, replaced)

    @property
    def broadcast_buffers(self) -> bool:
        """torch's deprecated name of ``forward_sync_buffers``."""
        return self.forward_sync_buffers

    @broadcast_buffers.setter
    def broadcast_buffers(self, value: bool) -> None:
        self.forward_sync_buffers = value

    def will_sync_module_buffers(self) -> bool:
        return self.require_forward_param_sync and self.broadcast_buffers and len(self.modules_buffers) > 0

    def _sync_buffers(self, authoritative_rank: int = 0) -> None:
        self._assign_modules_buffers()  # buffers may have been reassigned by the module
        broadcast_coalesced(self.modules_buffers, authoritative_rank, self.process_group, self.broadcast_bucket_size)

    def _find_common_rank(self, candidate: bool) -> int:
        """The largest group rank among the ranks passing ``candidate=True`` (one all_reduce MAX)."""
        value = np.array([self.process_group.rank() if candidate else -1], dtype=np.int64)
        all_reduce(value, op=ReduceOp.MAX, group=self.process_group)
        if value[0] < 0:
            raise ValueError("BUG! Expected rank_cond to be true for at least one process.")
        return int(value[0])

    def _check_global_requires_backward_grad_sync(self, is_joined_rank: bool):
        """Under Join: tell joined ranks whether this iteration's backward syncs gradients."""
        flag = np.array([0.0 if is_joined_rank or not self.require_backward_grad_sync else 1.0], dtype=np.float32)
        work = all_reduce(flag, group=self.process_group, async_op=True)
        if not is_joined_rank:
            return None
        work.wait()
        return bool(flag[0] != 0)

    def _sync_final_model(self, is_last_joiner: bool) -> None:
        self._sync_params_and_buffers(self._find_common_rank(is_last_joiner), self.broadcast_buffers)

    # -- user controls ------------------------------------------------------------------------
    @contextmanager
    def no_sync(self):
        """Disable gradient synchronization inside the context: gradients accumulate locally and
        are averaged in the first backward after it.

        Example::

            with ddp.no_sync():
                for inp in micro_batches[:-1]:
                    ddp(inp).sum().backward()   # no communication
            ddp(micro_batches[-1]).sum().backward()  # averages the accumulated gradients
        """
        old = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    def register_comm_hook(self, state: object, hook: Callable) -> None:
        """Replace the averaging all_reduce of each bucket by ``hook(state, bucket) -> Future``
        whose value is the bucket's reduced tensor (see ``distcomm.algorithms.ddp_comm_hooks``).
        Call it once, before the first backward."""
        if not callable(hook):
            raise TypeError("Communication hook must be callable.")
        if self._comm_hook_registered:
            raise RuntimeError("register_comm_hook or register_builtin_comm_hook can only be called once.")
        self._comm_hook_registered = True
        self.reducer.comm_hook = hook
        self.reducer.comm_state = state

    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False) -> Join:
        """A Join over this model alone (uneven inputs; see distcomm.algorithms.join.Join).

        ``divide_by_initial_world_size=False`` averages over the ranks still training instead.
        """
        return Join([self], enable, throw_on_early_termination,
                    divide_by_initial_world_size=divide_by_initial_world_size)

    def join_hook(self, **kwargs) -> JoinHook:
        return _DDPJoinHook(self, kwargs.get("divide_by_initial_world_size", True))

    @property
    def join_device(self):
        return self.device

    @property
    def join_process_group(self):
        return self.process_group

    def train(self, mode: bool = True):
        super().train(mode)
        return self


def _rebuild(obj, replaced: dict[int, torch.Tensor]):
    """``obj`` with each tensor whose id is in ``replaced`` swapped for its replacement."""
    if isinstance(obj, torch.Tensor):
        return replaced.get(id(obj), obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(_rebuild(o, replaced) for o in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_rebuild(o, replaced) for o in obj)
    if isinstance(obj, dict):
        return type(obj)((k, _rebuild(v, replaced)) for k, v in obj.items())
    if hasattr(obj, "__dataclass_fields__"):
        import dataclasses

        return dataclasses.replace(obj, **{f: _rebuild(getattr(obj, f), replaced) for f in obj.__dataclass_fields__})
    return obj
