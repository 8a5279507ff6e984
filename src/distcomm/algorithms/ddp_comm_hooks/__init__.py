"""DDP communication hooks (torch.distributed.algorithms.ddp_comm_hooks).

A hook replaces how DistributedDataParallel reduces one gradient bucket:
``hook(state, bucket) -> Future`` whose value is the bucket's reduced tensor (same shape as
``bucket.buffer()``). Register with ``ddp_model.register_comm_hook(state, hook)``; for the built-in
hooks ``state`` is the process group (None: the world).
"""

from enum import Enum
from functools import partial

from . import default_hooks
from .default_hooks import (
    allreduce_hook,
    bf16_compress_hook,
    bf16_compress_wrapper,
    fp16_compress_hook,
    fp16_compress_wrapper,
)


def _register(model, state, comm_hook):
    model.register_comm_hook(state, comm_hook)


class DDPCommHookType(Enum):
    """The built-in hooks by name: ``DDPCommHookType.FP16_COMPRESS.value(model=ddp, state=None)``."""

    ALLREDUCE = partial(_register, comm_hook=allreduce_hook)
    FP16_COMPRESS = partial(_register, comm_hook=fp16_compress_hook)
    BF16_COMPRESS = partial(_register, comm_hook=bf16_compress_hook)


def register_ddp_comm_hook(comm_hook_type: DDPCommHookType, model, state=None) -> None:
    """Register the built-in hook ``comm_hook_type`` on the DDP ``model``."""
    comm_hook_type.value(model=model, state=state)


__all__ = [
    "DDPCommHookType", "allreduce_hook", "bf16_compress_hook", "bf16_compress_wrapper", "default_hooks",
    "fp16_compress_hook", "fp16_compress_wrapper", "register_ddp_comm_hook",
]
