"""8-bit quantization hooks, as torch's ``quantization_hooks``.

Each rank quantizes its bucket to uint8 with its own scale and zero point (torch's MinMaxObserver
parameters: the range of the values, including 0), all_gathers every rank's parameters and
quantized bucket, then dequantizes each with its owner's parameters and averages. A quarter of
float32's bytes on the wire, at 8-bit precision. ``quantization_pertensor_hook`` uses one scale for
the bucket; ``quantization_perchannel_hook`` cuts the bucket into rows of ``bucket_size`` values
(zero-padded, always by at least one value, as torch) with one scale per row.

``process_group`` is the hook's state (None: the world).
"""

from __future__ import annotations

import torch

from ..._api.collectives import all_gather
from . import default_hooks

__all__ = ["quantization_pertensor_hook", "quantization_perchannel_hook"]


def _quantize(x, scale, zero_point):
    return torch.clamp(torch.round(x / scale) + zero_point, 0, 255).to(torch.uint8)


def _dequantize(y, scale, zero_point):
    return scale * (y.to(torch.float32) - zero_point)


def _gather(tensor, group) -> list:
    """Every rank's ``tensor``, by rank."""
    out = [torch.zeros_like(tensor) for _ in range(group.size())]
    all_gather(out, tensor, group=group)
    return out


def _quantized_average(process_group, rows, qparams, quantize, dequantize):
    """The steps both hooks share: exchange (scale, zero point), exchange the quantized values,
    sum the dequantized ones (float32); (sum, group size).

    The second exchange needs the first's result, so each all_gather is waited for here, in the
    thread DDP called the hook from, rather than inside a future's callback, which could run on
    the thread that executes distcomm's collectives and wait for one queued behind itself.
    """
    group = default_hooks.group_or_world(process_group)
    rank = group.rank()
    all_qparams = _gather(qparams(rows), group)
    values = _gather(quantize(rows, all_qparams[rank][0], all_qparams[rank][1]), group)
    total = torch.zeros_like(values[0], dtype=torch.float32)
    for r, value in enumerate(values):
        total += dequantize(value, all_qparams[r][0], all_qparams[r][1])
    return total, group.size()


def quantization_pertensor_hook(process_group, bucket):
    """Average the bucket over the group as uint8 values with one scale and zero point per rank."""
    tensor = bucket.buffer()

    def qparams(x):
        observer = torch.ao.quantization.MinMaxObserver().to(x.device)
        observer(x)
        scale, zero_point = observer.calculate_qparams()
        return torch.tensor([float(scale), float(zero_point)], dtype=torch.float32, device=x.device)

    total, size = _quantized_average(process_group, tensor, qparams, _quantize, _dequantize)
    return default_hooks.completed_future(total / size)


def quantization_perchannel_hook(process_group, bucket, bucket_size: int = 512):
    """As the per-tensor hook, with one scale and zero point per row of ``bucket_size`` values."""
    tensor = bucket.buffer()
    rows = torch.nn.functional.pad(tensor, (0, bucket_size - len(tensor) % bucket_size)).view(-1, bucket_size)

    def qparams(x):
        observer = torch.ao.quantization.PerChannelMinMaxObserver().to(x.device)
        observer(x)
        scales, zero_points = observer.calculate_qparams()
        return torch.stack((scales.to(torch.float32), zero_points.to(torch.float32)))

    def per_row(fn):
        return lambda x, scales, zero_points: fn(x, scales[:, None], zero_points[:, None])

    total, size = _quantized_average(process_group, rows, qparams, per_row(_quantize), per_row(_dequantize))
    return default_hooks.completed_future(total.flatten()[: tensor.shape[0]] / size)
