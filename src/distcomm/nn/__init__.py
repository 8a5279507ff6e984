"""Autograd-aware collectives (torch.distributed.nn): ``distcomm.nn.all_reduce(t)`` returns a new
tensor and gradients flow back through the collective."""

from .functional import (
    all_gather,
    all_reduce,
    all_to_all,
    all_to_all_single,
    broadcast,
    gather,
    reduce,
    reduce_scatter,
    scatter,
)

__all__ = [
    "all_gather", "all_reduce", "all_to_all", "all_to_all_single", "broadcast", "gather", "reduce",
    "reduce_scatter", "scatter",
]
