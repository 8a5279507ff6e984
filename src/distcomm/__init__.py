"""distcomm: torch.distributed's communication package in Python.

``import distcomm as dist`` runs torch.distributed CPU programs with torch tensors or numpy arrays:
the same names, signatures, defaults and semantics, on distcomm's own engines.
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
from ._api.debug import DebugLevel, breakpoint, get_debug_level, set_debug_level, set_debug_level_from_env
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
    is_available,
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
from ._api.multigpu import (
    all_gather_multigpu,
    all_reduce_multigpu,
    broadcast_multigpu,
    reduce_multigpu,
    reduce_scatter_multigpu,
)
from ._api.objects import (
    all_gather_object,
    broadcast_object_list,
    gather_object,
    recv_object_list,
    scatter_object_list,
    send_object_list,
)
from ._api.p2p import P2POp, batch_isend_irecv, irecv, isend, recv, send
from .backends import Backend
from .errors import (
    CollectiveMismatchError,
    DistBackendError,
    DistError,
    DistNetworkError,
    DistStoreAuthError,
    DistStoreError,
    DistStoreTimeoutError,
    DistTimeoutError,
    PeerLostError,
    QueueEmptyError,
)
from .process_group import ProcessGroup
from .rendezvous import register_rendezvous_handler, rendezvous
from .store import FileStore, HashStore, PrefixStore, Store, TCPStore
from .types import ReduceOp, _make_nccl_premul_sum, reduce_op, supports_complex
from .work import Future, Work
from .world import GroupMember, group

# torch 2.13's newer names for the tensor forms
all_gather_single = all_gather_into_tensor
reduce_scatter_single = reduce_scatter_tensor

__version__ = "0.1.0"

__all__ = [
    "Backend", "CollectiveMismatchError", "DebugLevel", "DistBackendError", "DistError", "DistNetworkError",
    "DistStoreAuthError", "DistStoreError", "DistStoreTimeoutError", "DistTimeoutError", "FileStore", "Future",
    "GroupMember", "HashStore", "P2POp", "PeerLostError", "PrefixStore", "ProcessGroup", "QueueEmptyError",
    "ReduceOp", "Store", "TCPStore", "Work", "all_gather", "all_gather_coalesced", "all_gather_into_tensor",
    "all_gather_multigpu", "all_gather_object", "all_gather_single", "all_reduce", "all_reduce_coalesced",
    "all_reduce_multigpu", "all_to_all", "all_to_all_single", "barrier", "batch_isend_irecv", "breakpoint",
    "broadcast", "broadcast_multigpu", "broadcast_object_list", "default_pg_timeout", "destroy_process_group",
    "gather", "gather_object", "get_backend", "get_backend_config", "get_debug_level",
    "get_default_backend_for_device", "get_global_rank", "get_group_rank", "get_node_local_rank", "get_pg_count",
    "get_process_group_ranks", "get_rank", "get_world_size", "group", "init_process_group", "irecv",
    "is_available", "is_backend_available", "is_gloo_available", "is_initialized", "is_mpi_available",
    "is_nccl_available", "is_torchelastic_launched", "is_ucc_available", "is_xccl_available", "isend",
    "monitored_barrier", "new_group", "new_subgroups", "new_subgroups_by_enumeration", "recv", "recv_object_list",
    "reduce", "reduce_multigpu", "reduce_op", "reduce_scatter", "reduce_scatter_multigpu", "reduce_scatter_single",
    "reduce_scatter_tensor", "register_rendezvous_handler", "rendezvous", "scatter", "scatter_object_list", "send",
    "send_object_list", "set_debug_level", "set_debug_level_from_env", "split_group", "supports_complex",
]

set_debug_level_from_env()  # as importing torch.distributed does

# torch.distributed.distributed_c10d: the same functions under torch's module name (imported last:
# it takes them from this package's namespace)
from . import distributed_c10d  # noqa: E402
