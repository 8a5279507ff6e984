"""The default DDP communication hooks: plain averaging, and averaging in 16-bit floats.

Each hook divides by the group size *before* the all_reduce (so sums of large gradients do not
overflow a 16-bit type) and returns the future of an async all_reduce, chained so that its value
is the averaged bucket tensor. ``state`` is the process group to reduce over (None: the world).
"""

from __future__ import annotations

import torch

from ... import world
from ..._api.collectives import all_reduce


def group_or_world(process_group):
    """The group a hook reduces over: ``process_group``, or the world when it is None."""
    return process_group if process_group is not None else world.group.WORLD


_group = group_or_world


def allreduce_fut(process_group, tensor):
    """Average ``tensor`` in place over the group (divide first, then all_reduce); a future whose
    value is ``tensor``. The other hooks fall back to it (PowerSGD before it starts, ...)."""
    group = group_or_world(process_group)
    tensor.div_(group.size())
    fut = all_reduce(tensor, group=group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def completed_future(tensor):
    """A future already holding ``tensor``: what a hook returns when it has nothing left to wait
    for (it communicated synchronously, or not at all)."""
    fut = torch.futures.Future()
    fut.set_result(tensor)
    return fut


def allreduce_hook(process_group, bucket):
    """Average the bucket over the group with one all_reduce; DDP's results are unchanged by
    registering it (it is what DDP does without a hook). A starting point for custom hooks."""
    return allreduce_fut(process_group, bucket.buffer())


def _compressed_allreduce(dtype, process_group, bucket):
    group = _group(process_group)
    buffer = bucket.buffer()
    compressed = buffer.to(dtype).div_(group.size())

    def decompress(fut):
        buffer.copy_(fut.value()[0])
        return buffer

    return all_reduce(compressed, group=group, async_op=True).get_future().then(decompress)


def fp16_compress_hook(process_group, bucket):
    """Cast the bucket to float16, divide by the group size, all_reduce, and cast the result back
    to the bucket's dtype: half the bytes on the wire, float16 precision."""
    return _compressed_allreduce(torch.float16, process_group, bucket)


def bf16_compress_hook(process_group, bucket):
    """As fp16_compress_hook with bfloat16: float32's range, 8 bits of mantissa."""
    return _compressed_allreduce(torch.bfloat16, process_group, bucket)


def _compress_wrapper(dtype, hook):
    def wrapped(hook_state, bucket):
        bucket.set_buffer(bucket.buffer().to(dtype))
        fut = hook(hook_state, bucket)

        def decompress(f):
            out = bucket.buffer()
            out.copy_(f.value())
            return out

        return fut.then(decompress)

    wrapped.__name__ = f"{dtype}_compress_wrapper({getattr(hook, '__name__', 'hook')})".replace("torch.", "")
    return wrapped


def fp16_compress_wrapper(hook):
    """Run ``hook`` on a float16 copy of the bucket and cast its result back to the bucket's dtype
    (``fp16_compress_wrapper(allreduce_hook)`` is ``fp16_compress_hook``)."""
    return _compress_wrapper(torch.float16, hook)


def bf16_compress_wrapper(hook):
    """Run ``hook`` on a bfloat16 copy of the bucket and cast its result back to the bucket's dtype."""
    return _compress_wrapper(torch.bfloat16, hook)
