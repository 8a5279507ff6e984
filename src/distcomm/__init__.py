"""distcomm: torch.distributed's communication package in Python.

``import distcomm as dist`` runs torch.distributed CPU programs with torch tensors or numpy arrays.
"""

from .errors import (
    CollectiveMismatchError,
    DistBackendError,
    DistError,
    DistNetworkError,
    DistStoreError,
    DistStoreTimeoutError,
    DistTimeoutError,
    PeerLostError,
)
from .types import ReduceOp, reduce_op

__version__ = "0.1.0"
