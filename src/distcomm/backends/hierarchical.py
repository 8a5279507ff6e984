"""The default engine's collectives for a group that spans hosts with the same number of its ranks on
each: all_reduce from ``THRESHOLDS["allreduce_hierarchical_bytes"]`` up runs hierarchically
(``_algorithms/allreduce_hierarchical.py``: shared memory inside each host, TCP across) unless
``DISTCOMM_ALGO_ALLREDUCE`` forces a generic algorithm; every other collective, and smaller
all_reduces, run the generic algorithms over the hybrid transport.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .. import reduction
from .._algorithms import select
from .._algorithms.allreduce_hierarchical import allreduce_hierarchical
from ..dtypes import DType
from ..transport.base import Channel
from ..tuning import DEFAULT, Tuning
from .generic import GenericCollectives


class HierarchicalCollectives(GenericCollectives):
    """GenericCollectives, but all_reduce is hierarchical past a threshold. ``hosts[r]``: the host
    of group rank r."""

    def __init__(self, hosts: Sequence, tuning: Tuning = DEFAULT):
        super().__init__(tuning)
        self.hosts = list(hosts)

    def all_reduce(self, ch: Channel, flat: np.ndarray, dtype: DType, op) -> None:
        # a forced generic algorithm (DISTCOMM_ALGO_ALLREDUCE) runs the whole all_reduce, as it says
        if (self.tuning.algorithm("allreduce") is not None
                or flat.nbytes < select.threshold("allreduce_hierarchical_bytes", self.tuning)):
            return super().all_reduce(ch, flat, dtype, op)

        def cross(sub: Channel, part: np.ndarray, reduce) -> None:
            select.choose("allreduce", part.nbytes, sub.size, self.tuning)(sub, part, reduce)

        def run(buf: np.ndarray) -> None:
            allreduce_hierarchical(ch, buf, reduction.reducer(op, dtype), self.hosts, cross)

        reduction.with_op_arithmetic(op, dtype, ch.size, flat, run)
