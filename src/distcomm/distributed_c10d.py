"""``distcomm.distributed_c10d``: torch.distributed.distributed_c10d's names, the same objects.

Programs written against torch sometimes import from the submodule (``from
torch.distributed.distributed_c10d import ...``). As in torch, the package takes these names from
here (``from .distributed_c10d import *``), so either spelling gives the same function.
"""

from ._api.collectives import (
    all_gather,
    all_gather_coalesced,
    all_gather_into_tensor,
    all_reduce,
    all_reduce_coalesced,
    all_to_all,
    all_to_all_single,
    barrier,
    broadcast,
    gather,
    monitored_barrier,
    reduce,
    reduce_scatter,
    reduce_scatter_tensor,
    scatter,
)
from ._api.debug import DebugLevel, get_debug_level, set_debug_level, set_debug_level_from_env
from ._api.groups import (
    default_pg_timeout,
    destroy_process_group,
    get_backend,
    get_backend_config,
    get_default_backend_for_device,
    get_global_rank,
    get_group_rank,
    get_node_local_rank,
    get_pg_count,
    get_process_group_ranks,
    get_rank,
    get_world_size,
    init_process_group,
    is_backend_available,
    is_gloo_available,
    is_initialized,
    is_mpi_available,
    is_nccl_available,
    is_torchelastic_launched,
    is_ucc_available,
    is_xccl_available,
    new_group,
    new_subgroups,
    new_subgroups_by_enumeration,
    split_group,
)
from ._api.objects import (
    all_gather_object,
    broadcast_object_list,
    gather_object,
    recv_object_list,
    scatter_object_list,
    send_object_list,
)
from ._api.args import default_group, is_non_member
from ._api.p2p import P2POp, batch_isend_irecv, irecv, isend, recv, send
from .backends import Backend
from .process_group import ProcessGroup
from .store import PrefixStore, Store
from .types import ReduceOp, _make_nccl_premul_sum, reduce_op, supports_complex
from .work import Work
from .world import GroupMember, group

# torch 2.13's newer names for the tensor forms
all_gather_single = all_gather_into_tensor
reduce_scatter_single = reduce_scatter_tensor


# Private in torch, but called by libraries written against it (as torch.distributed.distributed_c10d's).
def _get_default_group() -> ProcessGroup:
    """The default process group; ValueError (torch's text) before init_process_group."""
    return default_group()


def _rank_not_in_group(group) -> bool:
    """Whether this process is outside ``group`` (None: the default group, which every rank is in):
    ``group == GroupMember.NON_GROUP_MEMBER``, as torch's."""
    return is_non_member(group)

# torch's distributed_c10d.__all__, less what distcomm does not provide (see docs/torch-differences.md)
__all__ = [
    "Backend", "DebugLevel", "GroupMember", "P2POp", "PrefixStore", "ProcessGroup", "ReduceOp", "Store", "Work",
    "all_gather", "all_gather_coalesced", "all_gather_into_tensor", "all_gather_object", "all_gather_single",
    "all_reduce", "all_reduce_coalesced", "all_to_all", "all_to_all_single", "barrier", "batch_isend_irecv",
    "broadcast", "broadcast_object_list", "default_pg_timeout", "destroy_process_group", "gather", "gather_object",
    "get_backend", "get_backend_config", "get_debug_level", "get_default_backend_for_device", "get_global_rank",
    "get_group_rank", "get_node_local_rank", "get_pg_count", "get_process_group_ranks", "get_rank",
    "get_world_size", "group", "init_process_group", "irecv", "is_backend_available", "is_gloo_available",
    "is_initialized", "is_mpi_available", "is_nccl_available", "is_torchelastic_launched", "is_ucc_available",
    "is_xccl_available", "isend", "monitored_barrier", "new_group", "new_subgroups", "new_subgroups_by_enumeration",
    "recv", "recv_object_list", "reduce", "reduce_op", "reduce_scatter", "reduce_scatter_single",
    "reduce_scatter_tensor", "scatter", "scatter_object_list", "send", "send_object_list", "split_group",
    "supports_complex",
]
