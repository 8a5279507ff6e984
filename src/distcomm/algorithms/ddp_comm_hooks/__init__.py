"""DDP communication hooks (torch.distributed.algorithms.ddp_comm_hooks).

A hook replaces how DistributedDataParallel reduces one gradient bucket:
``hook(state, bucket) -> Future`` whose value is the bucket's reduced tensor (same shape as
``bucket.buffer()``). Register with ``ddp_model.register_comm_hook(state, hook)``; for the default
and quantization hooks ``state`` is the process group (None: the world), PowerSGD takes a
``PowerSGDState`` and post-local SGD a ``PostLocalSGDState``.

Modules, as torch's: ``default_hooks`` (allreduce, fp16/bf16 compression), ``powerSGD_hook``,
``quantization_hooks``, ``post_localSGD_hook``. ``DDPCommHookType`` names the built-in ones.
"""

from enum import Enum
from functools import partial

from . import default_hooks, post_localSGD_hook, powerSGD_hook, quantization_hooks
from .default_hooks import (
    allreduce_hook,
    bf16_compress_hook,
    bf16_compress_wrapper,
    fp16_compress_hook,
    fp16_compress_wrapper,
)


def _register(model, state, comm_hook):
    model.register_comm_hook(state, comm_hook)


def _register_powerSGD(model, state, comm_hook, matrix_approximation_rank):
    """PowerSGD with torch's DDPCommHookType settings: ``state`` is the process group."""
    powerSGD_state = powerSGD_hook.PowerSGDState(
        process_group=state, matrix_approximation_rank=matrix_approximation_rank
    )
    model.register_comm_hook(powerSGD_state, comm_hook)


class DDPCommHookType(Enum):
    """The built-in hooks by name: ``DDPCommHookType.FP16_COMPRESS.value(model=ddp, state=None)``."""

    ALLREDUCE = partial(_register, comm_hook=allreduce_hook)
    FP16_COMPRESS = partial(_register, comm_hook=fp16_compress_hook)
    BF16_COMPRESS = partial(_register, comm_hook=bf16_compress_hook)
    QUANTIZE_PER_TENSOR = partial(_register, comm_hook=quantization_hooks.quantization_pertensor_hook)
    QUANTIZE_PER_CHANNEL = partial(_register, comm_hook=quantization_hooks.quantization_perchannel_hook)
    POWER_SGD = partial(_register_powerSGD, comm_hook=powerSGD_hook.powerSGD_hook, matrix_approximation_rank=1)
    # rank 2: more accurate than rank 1, slower and more memory
    POWER_SGD_RANK2 = partial(_register_powerSGD, comm_hook=powerSGD_hook.powerSGD_hook, matrix_approximation_rank=2)
    BATCHED_POWER_SGD = partial(
        _register_powerSGD, comm_hook=powerSGD_hook.batched_powerSGD_hook, matrix_approximation_rank=1
    )
    BATCHED_POWER_SGD_RANK2 = partial(
        _register_powerSGD, comm_hook=powerSGD_hook.batched_powerSGD_hook, matrix_approximation_rank=2
    )
    NOOP = partial(_register, comm_hook=lambda state, bucket: _noop(bucket))


def _noop(bucket):
    """torch's debugging noop hook: the local gradient unreduced (to measure communication cost)."""
    return default_hooks.completed_future(bucket.buffer())


def register_ddp_comm_hook(comm_hook_type: DDPCommHookType, model, state=None) -> None:
    """Register the built-in hook ``comm_hook_type`` on the DDP ``model``."""
    comm_hook_type.value(model=model, state=state)


__all__ = [
    "DDPCommHookType", "allreduce_hook", "bf16_compress_hook", "bf16_compress_wrapper", "default_hooks",
    "fp16_compress_hook", "fp16_compress_wrapper", "post_localSGD_hook", "powerSGD_hook",
    "quantization_hooks", "register_ddp_comm_hook",
]
