"""ZeroRedundancyOptimizer: optimizer state sharded over the ranks (ZeRO stage 1).

Every rank holds all parameters, but each parameter is *owned* by one rank: only the owner keeps
its optimizer state (Adam's two moments, momentum buffers) and runs its update. After the local
step, every owner broadcasts its updated parameters, so all replicas stay identical while each
rank stores about 1/world_size of the optimizer state.

Ownership is a greedy partition (torch's): within each parameter group, largest parameters first,
each to the rank with the fewest elements so far. The gradients must already be averaged
(DistributedDataParallel does that), so the owner's update is the update every rank would make.
"""

from __future__ import annotations

import copy
from itertools import chain
from typing import Any, Callable

import torch
from torch.optim import Optimizer

from .. import world
from .._api.collectives import broadcast
from .._api.groups import get_global_rank
from .._api.objects import gather_object
from ..algorithms.join import Join, Joinable, JoinHook

__all__ = ["ZeroRedundancyOptimizer"]


class _ZeROJoinHook(JoinHook):
    def __init__(self, zero: "ZeroRedundancyOptimizer"):
        self.zero = zero

    def main_hook(self) -> None:
        """A joined rank still updates its shard (with the gradients it holds) and broadcasts it."""
        self.zero.step()


class ZeroRedundancyOptimizer(Optimizer, Joinable):
    """Wrap ``optimizer_class`` so that its state is sharded across the ranks of ``process_group``.

    Arguments:
        params: parameters or parameter groups, as for any optimizer.
        optimizer_class: the local optimizer's class (``torch.optim.Adam``...).
        process_group: the group to shard over (default: the world).
        parameters_as_bucket_view: pack each rank's parameters into one flat tensor (their ``.data``
            become views of it) so the post-step synchronization is one broadcast per rank.
        overlap_with_ddp: not supported by distcomm (raises NotImplementedError when True).
        **defaults: the local optimizer's arguments (``lr=0.01``...).

    Example::

        ddp = DistributedDataParallel(model)
        opt = ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.Adam, lr=0.01)
        ddp(x).sum().backward()
        opt.step()   # each rank updates its shard, then every shard is broadcast
    """

    def __init__(
        self,
        params,
        optimizer_class: type[Optimizer],
        process_group: Any = None,
        parameters_as_bucket_view: bool = False,
        overlap_with_ddp: bool = False,
        **defaults: Any,
    ):
        if overlap_with_ddp:
            raise NotImplementedError(
                "ZeroRedundancyOptimizer(overlap_with_ddp=True) is not supported by distcomm; construct it with "
                "overlap_with_ddp=False and call step() after backward"
            )
        params = self._check_params(params)
        self.initialized = False  # add_param_group behaves differently during Optimizer.__init__
        Optimizer.__init__(self, params, defaults)
        Joinable.__init__(self)
        self.process_group = process_group if process_group is not None else world.group.WORLD
        if self.process_group is None:
            raise ValueError(
                "Default process group has not been initialized, please make sure to call init_process_group."
            )
        self.world_size = self.process_group.size()
        self.rank = self.process_group.rank()
        self.global_rank = get_global_rank(self.process_group, self.rank)
        self._default_device = self._all_params[0].device
        self._optim_defaults = defaults
        self._optim_constructor = optimizer_class
        self._partition_cache: list[list[dict]] = []
        self._is_trainable_mask = self._trainable_mask()
        self.optim: Optimizer = optimizer_class(self._partition_parameters()[self.rank], **defaults)
        self._sync_param_groups(self.optim.param_groups, self.param_groups)
        self.parameters_as_bucket_view = parameters_as_bucket_view
        self._buckets: list[torch.Tensor] = []
        self._build_param_buckets()
        self._all_state_dicts: list[dict] = []
        self.initialized = True

    # -- parameters and their owners ----------------------------------------------------------
    def _check_params(self, params) -> list:
        if isinstance(params, torch.Tensor):
            raise TypeError(f"`params` argument should be an iterable of Tensors, but got {torch.typename(params)}")
        try:
            params = list(params)
        except TypeError as exc:
            raise TypeError(
                f"`params` argument should be an iterable of Tensors or dicts, but got {torch.typename(params)}"
            ) from exc
        if not params:
            raise ValueError("ZeroRedundancyOptimizer got an empty parameter list")
        if all(isinstance(p, torch.Tensor) for p in params):
            self._all_params = list(params)
        elif all(isinstance(p, dict) for p in params):
            if any("params" not in g for g in params):
                raise ValueError(
                    "Each parameter group passed-in via `params` must have a 'params' key mapping to the "
                    "parameters in the group"
                )
            self._all_params = [p for g in params for p in g["params"]]
        else:
            raise TypeError("`params` argument should be an iterable of Tensors or dicts")
        kinds = {torch.typename(p) for p in self._all_params}
        if len(kinds) > 1 or self._all_params[0].is_sparse:
            raise ValueError(
                "ZeroRedundancyOptimizer only supports using the same dense type for all parameters but got "
                + " and ".join(sorted(kinds))
            )
        return params

    def _trainable_mask(self) -> list[bool]:
        return [p.requires_grad for p in self._all_params]

    def _partition_parameters(self) -> list[list[dict]]:
        """Per rank, its parameter groups: each group of ``self.param_groups`` with only the
        parameters that rank owns (possibly none)."""
        if not self._partition_cache:
            per_rank: list[list[dict]] = [[] for _ in range(self.world_size)]
            sizes = [0] * self.world_size
            for group in self.param_groups:
                owned: list[list[torch.Tensor]] = [[] for _ in range(self.world_size)]
                for p in sorted(group["params"], key=lambda t: t.numel(), reverse=True):
                    rank = sizes.index(min(sizes))
                    owned[rank].append(p)
                    sizes[rank] += p.numel()
                for rank in range(self.world_size):
                    local = copy.copy(group)
                    local["params"] = owned[rank]
                    per_rank[rank].append(local)
            self._partition_cache = per_rank
        return self._partition_cache

    def _clear_cache(self) -> None:
        self._partition_cache = []
        self.__dict__.pop("_index_to_param_cache", None)

    @property
    def _index_to_param(self) -> list[torch.Tensor]:
        """Parameters in the global state_dict's numbering (groups in order)."""
        if "_index_to_param_cache" not in self.__dict__:
            self._index_to_param_cache = list(chain.from_iterable(g["params"] for g in self.param_groups))
        return self._index_to_param_cache

    # -- Optimizer interface ------------------------------------------------------------------
    def add_param_group(self, param_group: dict) -> None:
        """Add a parameter group (on every rank: the partition and the broadcasts depend on it)."""
        super().add_param_group(param_group)
        if not self.initialized:
            return
        self._clear_cache()
        local_groups = self._partition_parameters()[self.rank]
        if len(local_groups) == len(self.optim.param_groups) + 1:
            self.optim.add_param_group(local_groups[-1])
        if self.parameters_as_bucket_view:
            self._build_param_buckets()

    def step(self, closure: Callable[[], float] | None = None, **kwargs: Any):
        """Update this rank's shard with the local optimizer, then broadcast every shard from its
        owner. Returns the local optimizer's loss (from ``closure``), if any."""
        Join.notify_join_context(self)
        mask = self._trainable_mask()
        if mask != self._is_trainable_mask:
            self._build_param_buckets()
            self._is_trainable_mask = mask
        self._sync_param_groups(self.param_groups, self.optim.param_groups)
        loss = self.optim.step(**kwargs) if closure is None else self.optim.step(closure=closure, **kwargs)
        self._sync_param_groups(self.optim.param_groups, self.param_groups)
        self._sync_params()
        return loss

    def _sync_params(self) -> None:
        works = []
        for rank in range(self.world_size):
            src = get_global_rank(self.process_group, rank)
            if self.parameters_as_bucket_view:
                tensors = [self._buckets[rank]]
            else:
                tensors = [p.data for g in self._partition_parameters()[rank] for p in g["params"]]
            works.extend(broadcast(t, src=src, group=self.process_group, async_op=True) for t in tensors)
        for work in works:
            work.wait()

    def _build_param_buckets(self) -> None:
        """With parameters_as_bucket_view: one flat tensor per rank holding that rank's trainable
        parameters, whose ``.data`` become views into it."""
        if not self.parameters_as_bucket_view:
            return
        self._buckets = []
        for groups in self._partition_parameters():
            params = [p for g in groups for p in g["params"]]
            trainable = [p for p in params if p.requires_grad]
            for p in params:
                if not p.requires_grad:
                    p.data = p.data.detach().clone()  # out of any earlier bucket
            if not trainable:
                self._buckets.append(torch.zeros(1, device=self._default_device))
                continue
            bucket = torch.empty(sum(p.numel() for p in trainable), dtype=trainable[0].dtype, device=self._default_device)
            offset = 0
            for p in trainable:
                bucket[offset:offset + p.numel()].copy_(p.data.reshape(-1))
                p.data = bucket[offset:offset + p.numel()].view_as(p.data)
                offset += p.numel()
            self._buckets.append(bucket)

    @staticmethod
    def _sync_param_groups(src: list[dict], dst: list[dict]) -> None:
        """Copy every hyperparameter (lr, betas, ...) but ``params`` from ``src`` groups to ``dst``."""
        if len(src) != len(dst):
            raise AssertionError("Mismatch between number of source and destination parameter groups")
        for s, d in zip(src, dst):
            for key, value in s.items():
                if key != "params":
                    d[key] = value

    # -- state dicts --------------------------------------------------------------------------
    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather every rank's shard of the optimizer state on group rank ``to`` (call on all ranks);
        ``state_dict()`` is then available there."""
        self._sync_param_groups(self.param_groups, self.optim.param_groups)
        local = self.optim.state_dict()
        dst = get_global_rank(self.process_group, to)
        gathered: list[Any] | None = [None] * self.world_size if self.rank == to else None
        gather_object(local, gathered, dst=dst, group=self.process_group)
        self._all_state_dicts = gathered if gathered is not None else []

    def state_dict(self) -> dict[str, Any]:
        """The full optimizer state, numbered like the unsharded optimizer's, as of the last
        ``consolidate_state_dict`` to this rank."""
        if not self._all_state_dicts:
            raise RuntimeError(
                "Optimizer state has not been consolidated on this rank. "
                f"Please call `consolidate_state_dict(to={self.rank})` on all ranks beforehand if you meant to "
                "save the global state."
            )
        state_dict = super().state_dict()
        index_of = {p: i for i, p in enumerate(self._index_to_param)}
        for rank, local in enumerate(self._all_state_dicts):
            local_groups = local["param_groups"]
            owned_groups = self._partition_parameters()[rank]
            if len(local_groups) != len(owned_groups):
                raise AssertionError("Mismatch between number of local and global parameter groups")
            for local_group, owned in zip(local_groups, owned_groups):
                for local_index, param in zip(local_group["params"], owned["params"]):
                    if local_index in local["state"]:
                        state_dict["state"][index_of[param]] = local["state"][local_index]
        state_dict["state"] = dict(sorted(state_dict["state"].items()))
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a full state dict (from ``state_dict()``, or an unsharded optimizer of the same
        parameters): each rank keeps the state of the parameters it owns."""
        index_of = {p: i for i, p in enumerate(self._index_to_param)}
        local_state, local_groups, local_index = {}, [], 0
        for saved_group, owned in zip(state_dict["param_groups"], self._partition_parameters()[self.rank]):
            group = {k: v for k, v in saved_group.items() if k != "params"}
            group["params"] = []
            for param in owned["params"]:
                global_index = index_of[param]
                if global_index in state_dict["state"]:
                    local_state[local_index] = state_dict["state"][global_index]
                group["params"].append(local_index)
                local_index += 1
            local_groups.append(group)
        if len(state_dict["param_groups"]) != len(self.param_groups):
            raise ValueError("loaded state dict has a different number of parameter groups")
        self.optim.load_state_dict({"state": local_state, "param_groups": local_groups})
        self._sync_param_groups(state_dict["param_groups"], self.param_groups)
        self._sync_param_groups(self.param_groups, self.optim.param_groups)

    # -- Joinable -----------------------------------------------------------------------------
    def join_hook(self, **kwargs) -> JoinHook:
        return _ZeROJoinHook(self)

    @property
    def join_device(self):
        return self._default_device

    @property
    def join_process_group(self):
        return self.process_group
