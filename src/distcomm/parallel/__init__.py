"""Data parallelism: ``DistributedDataParallel`` (torch.nn.parallel's, on distcomm's collectives)."""

from .distributed import DistributedDataParallel
from .reducer import GradBucket

__all__ = ["DistributedDataParallel", "GradBucket"]
