"""Post-local SGD (Lin et al., ICLR 2020), as torch's ``post_localSGD_hook``.

For the first ``start_localSGD_iter`` iterations gradients are averaged over the whole group
(``process_group``, None: the world), as usual. After that each rank trains locally: gradients are
averaged only within ``subgroup`` (created with ``new_subgroups()`` on first use when None: one
per node, LOCAL_WORLD_SIZE ranks), or not at all with ``post_local_gradient_allreduce=False``.
The models then drift apart; average them periodically yourself (torch pairs this hook with
``PeriodicModelAverager``, which distcomm does not provide).
"""

from __future__ import annotations

import logging

from ..._api.groups import new_subgroups
from . import default_hooks

__all__ = ["PostLocalSGDState", "post_localSGD_hook"]

logger = logging.getLogger(__name__)


class PostLocalSGDState:
    """Settings and iteration count of ``post_localSGD_hook`` (torch's PostLocalSGDState)."""

    __slots__ = ["process_group", "subgroup", "start_localSGD_iter", "post_local_gradient_allreduce", "iter"]

    def __init__(self, process_group, subgroup, start_localSGD_iter: int, post_local_gradient_allreduce: bool = True):
        logger.info("Local SGD will be started after %s iterations", start_localSGD_iter)
        self.process_group = process_group
        self.subgroup = subgroup
        self.start_localSGD_iter = start_localSGD_iter
        self.post_local_gradient_allreduce = post_local_gradient_allreduce
        self.iter = 0

    def maybe_increase_iter(self, bucket) -> None:
        """An iteration ends with its last bucket."""
        if bucket.is_last():
            self.iter += 1
        if self.iter == self.start_localSGD_iter:
            logger.info("Start to apply local SGD after %s iterations.", self.iter)


def post_localSGD_hook(state: PostLocalSGDState, bucket):
    """Global averaging before ``start_localSGD_iter``, then averaging within ``subgroup`` only."""
    buffer = bucket.buffer()
    if state.iter < state.start_localSGD_iter:
        state.maybe_increase_iter(bucket)
        return default_hooks.allreduce_fut(state.process_group, buffer)
    if not state.post_local_gradient_allreduce:
        return default_hooks.completed_future(buffer)  # nothing to communicate: the local gradient
    if state.subgroup is None:
        state.subgroup, _ = new_subgroups()
    return default_hooks.allreduce_fut(state.subgroup, buffer)
