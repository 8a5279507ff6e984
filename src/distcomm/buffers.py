"""Buffers: a torch tensor or numpy array seen as one contiguous 1-D numpy array of its storage.

Every collective works on ``Buffer.flat``: a 1-D C-contiguous array sharing memory with the user's
tensor whenever the tensor is contiguous (the common case: zero copies). A non-contiguous tensor
is copied into a contiguous scratch array and ``commit()`` writes the result back, so results land
exactly where torch writes them. torch is never imported here: a tensor can only exist if the
user's program imported torch, so ``sys.modules`` is the test.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from . import dtypes
from .dtypes import DType


def _torch():
    return sys.modules.get("torch")


def is_tensor(obj: Any) -> bool:
    torch = _torch()
    return torch is not None and isinstance(obj, torch.Tensor)


def is_buffer_like(obj: Any) -> bool:
    return isinstance(obj, np.ndarray) or is_tensor(obj)


class Buffer:
    """One user buffer as ``flat`` (1-D, contiguous, storage dtype) plus how to write it back."""

    __slots__ = ("obj", "flat", "dtype", "shape", "_writeback")

    def __init__(self, obj: Any, flat: np.ndarray, dtype: DType, shape: tuple, writeback):
        self.obj = obj
        self.flat = flat
        self.dtype = dtype
        self.shape = shape
        self._writeback = writeback  # None when flat aliases obj's memory

    @property
    def count(self) -> int:
        return self.flat.size

    @property
    def nbytes(self) -> int:
        return self.flat.nbytes

    @property
    def aliases_user_memory(self) -> bool:
        return self._writeback is None

    def commit(self) -> None:
        """Write ``flat`` back into the user's object (no-op when they share memory)."""
        if self._writeback is not None:
            self._writeback(self.flat)


class _TensorMemory:
    """An object numpy reads an array interface from, holding the tensor it describes alive."""

    __slots__ = ("tensor", "__array_interface__")


def tensor_memory(t, storage: np.dtype, count: int | None = None) -> np.ndarray:
    """A contiguous CPU tensor's elements as a flat numpy array of ``storage`` dtype, sharing memory.

    Not ``Tensor.numpy()``: that marks the tensor's storage non-resizable for good, and FSDP frees
    and regrows its parameters' storages (``untyped_storage().resize_``) between collectives, which
    then fails with "Trying to resize storage that is not resizable". The array reads the memory
    through the data pointer instead and keeps the tensor alive; like any view, it must not outlive
    a resize of that storage (every collective drops its arrays when it returns).
    """
    count = t.numel() if count is None else count  # count: elements from the data pointer on
    if count == 0:
        return np.empty(0, dtype=storage)  # an empty tensor may have no data pointer at all
    holder = _TensorMemory()
    holder.tensor = t
    holder.__array_interface__ = {"data": (t.data_ptr(), False), "shape": (count,),
                                  "typestr": storage.str, "version": 3}
    return np.asarray(holder)



_ELEMENTS: dict = {}  # torch dtype -> numpy dtype of its elements, learnt once per dtype


def plain_tensor_memory(t) -> np.ndarray | None:
    """A plain dense CPU torch tensor's memory as a flat numpy array (shared, not copied), or None
    for anything else (sparse, another device, bfloat16, conjugated, not contiguous): what the
    engines' latency paths take as it is, leaving the rest to the general path's Buffers."""
    torch = _torch()
    if t.layout is not torch.strided or not t.is_cpu or t.dtype is torch.bfloat16 or t.is_conj() \
            or not t.is_contiguous():
        return None
    storage = _ELEMENTS.get(t.dtype)
    if storage is None:  # an empty scratch tensor says it
        storage = _ELEMENTS[t.dtype] = torch.empty(0, dtype=t.dtype).numpy().dtype
    return tensor_memory(t, storage)

# The Buffers of small contiguous tensors passed call after call (a loop's buffers, a benchmark's)
# are kept: making one costs about 4 µs of CPU (detach, the dtype's name, the numpy view), checking
# that the same tensor still has the same memory and shape about 0.5 µs, and a small collective
# takes two or three of them. The cache holds (so keeps alive) at most _CACHED tensors of at most
# _CACHE_BYTES each, and starts over when full.
_CACHE: dict = {}  # id(tensor) -> (tensor, data pointer, shape, Buffer)
_CACHED, _CACHE_BYTES = 16, 256 << 10


def _tensor_buffer(t, name: str) -> Buffer:
    hit = _CACHE.get(id(t))
    if hit is not None:
        known, address, shape, buf = hit
        # the same object (held here, so its id is not reused) with the same memory and shape:
        # a tensor's device, layout and dtype never change in place
        if known is t and t.data_ptr() == address and t.shape == shape and t.is_contiguous():
            return buf
    torch = _torch()
    if t.device.type != "cpu":
        raise ValueError(
            f"{name} is on {t.device}; distcomm's engines run on CPU tensors "
            f"(move it with .cpu(), or use the nccl backend for GPU tensors)"
        )
    if t.is_sparse:
        raise ValueError(
            f"{name} is a sparse tensor; only all_reduce (with ReduceOp.SUM) takes sparse tensors, as in torch's gloo")
    base = t.detach()
    if base.is_conj():
        base = base.resolve_conj()
    dtype_name = str(base.dtype).replace("torch.", "")
    dtype = dtypes.from_name(dtype_name)
    shape = tuple(base.shape)
    contiguous = base.is_contiguous()
    work = base if contiguous else base.contiguous()
    flat = tensor_memory(work, dtype.storage)
    if contiguous and not t.is_conj():
        buf = Buffer(t, flat, dtype, shape, None)
        if flat.nbytes <= _CACHE_BYTES and flat.size:
            if len(_CACHE) >= _CACHED:
                _CACHE.clear()
            _CACHE[id(t)] = (t, t.data_ptr(), t.shape, buf)
        return buf

    overlapping = any(st == 0 and n > 1 for st, n in zip(base.stride(), shape))

    def writeback(flat_result: np.ndarray, t=t, shape=shape, dtype=dtype) -> None:
        if overlapping:
            # An expanded tensor (stride 0, as autograd hands a custom Function's grad): torch's
            # copy_ refuses to write several elements into one memory location, so write through
            # a numpy view of the same strides, as gloo's reduction of the storage does (every
            # element of an expanded dimension holds the same value, so each location gets it).
            span = 1 + sum((n - 1) * st for n, st in zip(shape, t.stride()))  # the elements they reach
            whole = tensor_memory(t.detach(), dtype.storage, span)
            view = np.lib.stride_tricks.as_strided(
                whole, shape, [st * dtype.storage.itemsize for st in t.stride()])
            view[...] = flat_result.reshape(shape)
            return
        with torch.no_grad():
            t.copy_(_from_storage(flat_result, shape, dtype))

    return Buffer(t, flat, dtype, shape, writeback)


def _from_storage(flat: np.ndarray, shape: tuple, dtype: DType):
    """A torch tensor of ``dtype`` over ``flat`` (its storage dtype: uint16 for bfloat16)."""
    torch = _torch()
    src = torch.from_numpy(flat.reshape(shape))
    if dtype.name == "bfloat16":
        src = src.view(torch.int16).view(torch.bfloat16)
    return src


def is_sparse(obj: Any) -> bool:
    return is_tensor(obj) and obj.is_sparse


class SparseBuffer:
    """A sparse COO tensor as numpy arrays: ``indices`` (int64, sparse_dim x nnz, coalesced) and
    ``values`` (flat, storage dtype; ``row`` elements per index), and how to write a result back.

    ``commit(indices, values)`` takes every rank's entries, concatenated: duplicate indices are
    summed (torch's coalesce) and the result replaces the tensor's contents, as gloo's sparse
    all_reduce leaves it (coalesced)."""

    __slots__ = ("obj", "indices", "values", "dtype", "row", "_dense_shape")

    def __init__(self, t, name: str = "tensor"):
        if t.device.type != "cpu":
            raise ValueError(f"{name} is on {t.device}; distcomm's engines run on CPU tensors (move it with .cpu())")
        src = t.detach().coalesce()
        self.obj = t
        self.indices = np.ascontiguousarray(src._indices().numpy(), dtype=np.int64)
        values = _tensor_buffer(src._values(), name)
        self.values = values.flat
        self.dtype = values.dtype
        self._dense_shape = values.shape[1:]
        self.row = int(np.prod(self._dense_shape, dtype=np.int64))

    def commit(self, indices: np.ndarray, values: np.ndarray) -> None:
        torch = _torch()
        nnz = indices.shape[1] if indices.ndim == 2 else 0
        vals = _from_storage(values, (nnz, *self._dense_shape), self.dtype)
        # the indices came from the peers: checked against this tensor's shape before anything is
        # written (an index out of bounds would otherwise corrupt memory), and torch does not warn
        result = torch.sparse_coo_tensor(torch.from_numpy(indices), vals, self.obj.shape,
                                         check_invariants=True).coalesce()
        with torch.no_grad():
            self.obj.copy_(result)


def _array_buffer(a: np.ndarray, name: str) -> Buffer:
    dtype = _BY_NUMPY.get(a.dtype) or dtypes.from_numpy(a.dtype)  # (the latter raises the error)
    if a.flags.c_contiguous:
        return Buffer(a, a.reshape(-1), dtype, a.shape, None)
    flat = np.ascontiguousarray(a).reshape(-1)

    def writeback(flat_result: np.ndarray, a=a) -> None:
        a[...] = flat_result.reshape(a.shape)

    return Buffer(a, flat, dtype, a.shape, writeback)


_BY_NUMPY = dtypes.BY_NUMPY


def as_buffer(obj: Any, name: str = "tensor") -> Buffer:
    """The Buffer for a tensor or array; a clear TypeError for anything else."""
    if obj.__class__ is np.ndarray or isinstance(obj, np.ndarray):
        return _array_buffer(obj, name)
    if is_tensor(obj):
        return _tensor_buffer(obj, name)
    raise TypeError(
        f"{name} must be a torch.Tensor or numpy.ndarray, got {type(obj).__name__}"
    )


def as_buffers(objs: Any, name: str = "tensor_list") -> list[Buffer]:
    if not isinstance(objs, (list, tuple)):
        raise TypeError(f"{name} must be a list of tensors, got {type(objs).__name__}")
    return [as_buffer(o, f"{name}[{i}]") for i, o in enumerate(objs)]


def empty_like_flat(buf: Buffer, count: int | None = None) -> np.ndarray:
    return np.empty(buf.count if count is None else count, dtype=buf.flat.dtype)
