"""torch.distributed.algorithms' public names: ``Join`` (``algorithms.join``) and the DDP
communication hooks (``algorithms.ddp_comm_hooks``).

The collective algorithms themselves (ring, halving-doubling, binomial trees, ...) are internal and
live in ``distcomm._algorithms``.
"""

from .join import Join, Joinable, JoinHook

__all__ = ["Join", "Joinable", "JoinHook"]
