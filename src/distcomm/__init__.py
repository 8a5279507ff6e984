"""distcomm: torch.distributed's communication package in Python.

``import distcomm as dist`` runs torch.distributed CPU programs with torch tensors or numpy arrays:
the same names, signatures, defaults and semantics, on distcomm's own engines.
"""

from . import distributed_c10d
from ._api.debug import breakpoint, dump_flight_recorder, set_debug_level, set_debug_level_from_env
from ._api.groups import is_available
from ._api.multigpu import (
    all_gather_multigpu,
    all_reduce_multigpu,
    broadcast_multigpu,
    reduce_multigpu,
    reduce_scatter_multigpu,
)
from .distributed_c10d import *  # noqa: F403 - torch.distributed takes these the same way
from .distributed_c10d import __all__ as _c10d_all
from .distributed_c10d import _rank_not_in_group  # noqa: F401 - torch.distributed has it too
from .errors import (
    CollectiveMismatchError,
    DistBackendError,
    DistError,
    DistNetworkError,
    DistStoreAuthError,
    DistStoreError,
    DistStoreTimeoutError,
    DistTimeoutError,
    PeerFailedError,
    PeerLostError,
    QueueEmptyError,
)
from .rendezvous import register_rendezvous_handler, rendezvous
from .store import FileStore, HashStore, TCPStore
from .types import _make_nccl_premul_sum
from .work import Future

__version__ = "0.1.0"

from . import stacks as _stacks  # noqa: E402 - after the public names: a worker of distcomm-run

_stacks.install_from_env()  # dumps its stacks on SIGUSR1 (see stacks.py)

__all__ = sorted(set(_c10d_all) | {
    "CollectiveMismatchError", "DistBackendError", "DistError", "DistNetworkError", "DistStoreAuthError",
    "DistStoreError", "DistStoreTimeoutError", "DistTimeoutError", "FileStore", "Future", "HashStore",
    "PeerFailedError", "PeerLostError", "QueueEmptyError", "TCPStore", "all_gather_multigpu", "all_reduce_multigpu", "breakpoint",
    "broadcast_multigpu", "dump_flight_recorder", "is_available", "reduce_multigpu", "reduce_scatter_multigpu", "register_rendezvous_handler",
    "rendezvous", "set_debug_level", "set_debug_level_from_env",
})

set_debug_level_from_env()  # as importing torch.distributed does
