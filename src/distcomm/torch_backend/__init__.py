"""distcomm as a torch c10d backend: ``init_process_group("distcomm")``.

``import distcomm.torch_backend`` registers the backend "distcomm" with torch
(``torch.distributed.Backend.register_backend``, CPU tensors). torch's own DDP, FSDP, DTensor,
DeviceMesh and functional collectives then run their communication on distcomm's engines (shared
memory within a host, TCP between hosts) with no other change than the backend string, including
``"cpu:distcomm"`` and ``new_group(backend="distcomm")`` next to a gloo default group.

Installed distcomm also registers it without the import: an entry point in torch's
``torch.backends`` group (``distcomm_torch_autoload``), which torch loads at ``import torch``
unless ``TORCH_DEVICE_BACKEND_AUTOLOAD=0``; that registration defers importing distcomm to the
first group created.
"""

from __future__ import annotations

import torch.distributed as tdist

from .process_group import BACKEND_NAME, DistcommProcessGroup, create, reduce_op
from .work import TorchWork


def register() -> None:
    """Register (again: the autoload's lazy registration is replaced by this one) with torch."""
    tdist.Backend.register_backend(BACKEND_NAME, create, extended_api=True, devices=["cpu"])


register()

__all__ = ["BACKEND_NAME", "DistcommProcessGroup", "TorchWork", "create", "reduce_op", "register"]
