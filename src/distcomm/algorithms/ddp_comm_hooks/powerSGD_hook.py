"""PowerSGD gradient compression (Vogels et al., NeurIPS 2019), as torch's ``powerSGD_hook``.

Each gradient matrix ``M`` (n x m: a parameter's gradient viewed as ``shape[0]`` rows) is replaced
by a rank-r approximation ``P Q^T`` computed with one step of power iteration, so only ``P``
(n x r) and ``Q`` (m x r) cross the network instead of ``M``:

1. ``M += error`` (error feedback: what compression lost last time is added back);
2. ``P = M Q``; all_reduce(P); orthogonalize P;  3. ``Q = M^T P``; all_reduce(Q); Q /= world;
4. ``M = P Q^T`` (the averaged approximation); ``error = M_before - M``.

``Q`` is kept between iterations (warm start) and re-orthogonalized; the first ``Q`` is drawn from
``randn`` seeded from ``numpy.random.RandomState(random_seed)`` exactly as torch draws it, so the
same seed gives the same run as torch's hook. Tensors for which ``(n + m) * r * min_compression_rate
>= n * m`` (biases, small matrices) are not worth compressing: they are averaged with one
all_reduce of their concatenation. Before ``start_powerSGD_iter`` iterations the hook is plain
averaging (compression early in training hurts accuracy).

``batched_powerSGD_hook`` treats the whole bucket as one square matrix (zero-padded), which is
faster but compresses less precisely.
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict

import numpy as np
import torch

from ..._api.collectives import all_reduce
from . import default_hooks

__all__ = ["PowerSGDState", "powerSGD_hook", "batched_powerSGD_hook"]

logger = logging.getLogger(__name__)


def _orthogonalize(matrices: torch.Tensor, epsilon: float = 0) -> None:
    """Orthonormalize the columns of each matrix of a (batch, n, r) tensor in place.

    Gram-Schmidt for r <= 2 (cheaper than QR, and the only choice for 16-bit types), QR otherwise,
    as torch chooses, so results agree with its hook to rounding.
    """
    rank = matrices.shape[2]
    if rank <= 2 or matrices.dtype in (torch.float16, torch.bfloat16):
        for i in range(rank):
            col = matrices[:, :, i:i + 1]
            col /= torch.norm(col, dim=1, keepdim=True) + epsilon
            if i + 1 < rank:
                rest = matrices[:, :, i + 1:]
                rest -= torch.sum(col * rest, dim=1, keepdim=True) * col
    else:
        q, _ = torch.linalg.qr(matrices)
        matrices.copy_(q)


class PowerSGDState:
    """The hook's settings and what it keeps between iterations (torch's PowerSGDState).

    ``process_group`` None means the world. ``start_powerSGD_iter`` must be > 1 when
    ``use_error_feedback`` or ``warm_start`` (DDP rebuilds its buckets after the first iteration).
    """

    __slots__ = [
        "process_group", "matrix_approximation_rank", "start_powerSGD_iter", "min_compression_rate",
        "orthogonalization_epsilon", "use_error_feedback", "warm_start", "batch_tensors_with_same_shape",
        "rng", "error_dict", "p_memory_dict", "q_memory_dict", "iter", "total_numel_before_compression",
        "total_numel_after_compression", "compression_stats_logging_frequency", "next_stats_report",
    ]

    def __init__(
        self,
        process_group,
        matrix_approximation_rank: int = 1,
        start_powerSGD_iter: int = 1_000,
        min_compression_rate: float = 2,
        use_error_feedback: bool = True,
        warm_start: bool = True,
        orthogonalization_epsilon: float = 0,
        random_seed: int = 0,
        compression_stats_logging_frequency: int = 10_000,
        batch_tensors_with_same_shape: bool = False,
    ):
        if (use_error_feedback or warm_start) and start_powerSGD_iter <= 1:
            raise ValueError(
                "Expect `start_powerSGD_iter` > 1 if `use_error_feedback` or `warm_start` is enabled, "
                "because PowerSGD can only be applied after the first two iterations in DDP."
            )
        self.process_group = process_group
        self.matrix_approximation_rank = matrix_approximation_rank
        self.start_powerSGD_iter = start_powerSGD_iter
        self.min_compression_rate = min_compression_rate
        self.use_error_feedback = use_error_feedback
        self.warm_start = warm_start
        self.orthogonalization_epsilon = orthogonalization_epsilon
        self.batch_tensors_with_same_shape = batch_tensors_with_same_shape
        # one generator for every rank: the same seed gives every rank the same initial Q
        self.rng = np.random.RandomState(random_seed)
        self.error_dict: dict[int, torch.Tensor] = {}
        self.p_memory_dict: dict[int, torch.Tensor] = {}
        self.q_memory_dict: dict[int, torch.Tensor] = {}
        self.iter = 0
        self.total_numel_before_compression = 0
        self.total_numel_after_compression = 0
        self.compression_stats_logging_frequency = max(1, compression_stats_logging_frequency)
        self.next_stats_report = 0

    def __getstate__(self):
        """Everything but the process group (not picklable); checkpoints keep the error and Q."""
        return {slot: getattr(self, slot) for slot in self.__slots__ if slot != "process_group"}

    def __setstate__(self, state):
        self.process_group = None  # the world; set it after loading for another group
        for slot, value in state.items():
            setattr(self, slot, value)

    def maybe_increase_iter(self, bucket) -> None:
        """An iteration ends with its last bucket."""
        if bucket.is_last():
            self.iter += 1

    def compression_stats(self) -> tuple[float, int, int]:
        """(compression rate, elements before, elements after) over every compressed bucket so far."""
        after = self.total_numel_after_compression
        rate = self.total_numel_before_compression / after if after > 0 else 0
        return rate, self.total_numel_before_compression, after

    def _report(self, bucket) -> None:
        if bucket.is_last() and self.iter >= self.next_stats_report:
            rate, before, after = self.compression_stats()
            logger.info("Compression stats: iter %s, total before compression %s, total after "
                        "compression %s, rate %s", self.iter, before, after, rate)
            self.next_stats_report = self.iter + self.compression_stats_logging_frequency

    def _seeded_randn(self, *shape, dtype) -> torch.Tensor:
        """randn from the state's generator, leaving the caller's global torch RNG untouched."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.rng.randint(1_000_000_000))
            return torch.randn(*shape, dtype=dtype)

    def _add_error(self, bucket_index: int, tensor: torch.Tensor) -> torch.Tensor | None:
        """Error feedback, step 1: add last iteration's error; the tensor's copy to diff against."""
        if not self.use_error_feedback:
            return None
        if bucket_index in self.error_dict:
            tensor.add_(self.error_dict[bucket_index])
        else:
            self.error_dict[bucket_index] = torch.zeros_like(tensor)
        return tensor.detach().clone()

    def _end(self, bucket, bucket_index: int, before: torch.Tensor | None, after: torch.Tensor) -> None:
        """Keep what compression lost (error feedback), drop P/Q without warm start, count."""
        if before is not None:
            self.error_dict[bucket_index] = before - after
        if not self.warm_start:
            self.p_memory_dict.clear()
            self.q_memory_dict.clear()
        self.maybe_increase_iter(bucket)


def _should_compress(n: int, m: int, rank: int, min_rate: float) -> tuple[bool, int, int]:
    dense, low_rank = n * m, (n + m) * rank
    return low_rank * min_rate < dense, dense, low_rank


# PowerSGD needs each all_reduce's result before it can start the next one, so the hooks wait for
# each in turn, in the thread DDP called them from, and return a completed future. Waiting inside
# a future's callback instead (torch's way) can deadlock with distcomm: a callback may run on the
# thread that executes the collectives, and it would then wait for a collective queued behind it.
_completed = default_hooks.completed_future


def _averaging_until_start(state: PowerSGDState, bucket):
    """(group, buffer, None) once PowerSGD has started; before that, plain averaging of the bucket:
    (group, buffer, its future)."""
    group, buffer = default_hooks.group_or_world(state.process_group), bucket.buffer()
    if state.iter < state.start_powerSGD_iter:
        state.maybe_increase_iter(bucket)
        return group, buffer, default_hooks.allreduce_fut(group, buffer)
    return group, buffer, None


def powerSGD_hook(state: PowerSGDState, bucket):
    """Rank-``matrix_approximation_rank`` PowerSGD of each gradient matrix of the bucket."""
    group, buffer, averaged = _averaging_until_start(state, bucket)
    if averaged is not None:
        return averaged
    world_size = group.size()

    index = bucket.index()
    before = state._add_error(index, buffer)

    # which gradients are worth compressing (views of the buffer: writing them writes the bucket)
    matrices, dense = [], []
    p_size = q_size = 0
    for grad in bucket.gradients():
        matrix = grad.view(grad.shape[0], -1)
        n, m = matrix.shape
        r = min(n, m, state.matrix_approximation_rank)
        worth, numel, low_rank = _should_compress(n, m, r, state.min_compression_rate)
        state.total_numel_before_compression += numel
        if worth:
            matrices.append(matrix)
            p_size, q_size = p_size + n * r, q_size + m * r
            state.total_numel_after_compression += low_rank
        else:
            dense.append(grad)
            state.total_numel_after_compression += numel
    state._report(bucket)
    dense_flat = torch.cat([g.reshape(-1) for g in dense]) if dense else buffer.new_empty(0)

    fresh = not state.warm_start or index not in state.p_memory_dict
    if fresh:
        state.p_memory_dict[index] = buffer.new_empty(p_size)
        state.q_memory_dict[index] = buffer.new_empty(q_size)

    # matrices of one shape may be multiplied as one batch; P and Q of each live in the flat memory
    by_shape = defaultdict(list)
    for matrix in matrices:
        by_shape[matrix.shape].append(matrix)
    batches = []
    for group_of_shape in by_shape.values():
        if state.batch_tensors_with_same_shape and len(group_of_shape) > 1:
            batches.append((torch.stack(group_of_shape), group_of_shape))
        else:
            batches.extend((mat.unsqueeze(0), None) for mat in group_of_shape)
    ps, qs = [], []
    p_at = q_at = 0
    for batch, _ in batches:
        b, n, m = batch.shape
        r = min(n, m, state.matrix_approximation_rank)
        ps.append(state.p_memory_dict[index][p_at:p_at + b * n * r].view(b, n, r))
        qs.append(state.q_memory_dict[index][q_at:q_at + b * m * r].view(b, m, r))
        p_at, q_at = p_at + b * n * r, q_at + b * m * r

    if fresh:
        # one seed draw per initialization, then the Qs in order: torch's sequence of numbers
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(state.rng.randint(1_000_000_000))
            for q in qs:
                q.copy_(torch.randn(*q.shape, dtype=buffer.dtype))
                _orthogonalize(q, state.orthogonalization_epsilon)
    else:
        for q in qs:
            _orthogonalize(q, state.orthogonalization_epsilon)
    for (batch, _), q, p in zip(batches, qs, ps):
        torch.bmm(batch, q, out=p)

    # The three all_reduces run one after the other, each waited for here (see _completed).
    all_reduce(dense_flat, group=group)
    dense_flat.div_(world_size)
    at = 0
    for grad in dense:
        grad.copy_(dense_flat[at:at + grad.numel()].view_as(grad))
        at += grad.numel()

    all_reduce(state.p_memory_dict[index], group=group)
    for p in ps:
        _orthogonalize(p, state.orthogonalization_epsilon)
    for (batch, _), p, q in zip(batches, ps, qs):
        torch.bmm(batch.transpose(1, 2), p, out=q)

    all_reduce(state.q_memory_dict[index], group=group)
    state.q_memory_dict[index].div_(world_size)
    for (batch, originals), p, q in zip(batches, ps, qs):
        torch.bmm(p, q.transpose(1, 2), out=batch)
        if originals is not None:  # a stacked copy: write each matrix back into the bucket
            for original, approx in zip(originals, batch):
                original.copy_(approx)
    state._end(bucket, index, before, buffer)
    return _completed(buffer)


def batched_powerSGD_hook(state: PowerSGDState, bucket):
    """PowerSGD of the whole bucket as one zero-padded square matrix (one P and one Q per bucket)."""
    group, buffer, averaged = _averaging_until_start(state, bucket)
    if averaged is not None:
        return averaged
    world_size = group.size()

    length = buffer.shape[0]
    side = math.ceil(math.sqrt(length))
    r = state.matrix_approximation_rank
    state.total_numel_before_compression += length
    state.total_numel_after_compression += side * r * 2
    state._report(bucket)
    # a padded copy rather than resizing the bucket's buffer, which DDP owns
    padded = buffer.new_zeros(side * side)
    padded[:length].copy_(buffer)
    index = bucket.index()
    before = state._add_error(index, padded)
    matrix = padded.view(side, side)

    if not state.warm_start or index not in state.p_memory_dict:
        state.p_memory_dict[index] = buffer.new_empty(side, r)
        state.q_memory_dict[index] = state._seeded_randn(side, r, dtype=buffer.dtype)
    _orthogonalize(state.q_memory_dict[index].unsqueeze(0))
    torch.matmul(matrix, state.q_memory_dict[index], out=state.p_memory_dict[index])

    all_reduce(state.p_memory_dict[index], group=group)
    _orthogonalize(state.p_memory_dict[index].unsqueeze(0))
    torch.matmul(matrix.t(), state.p_memory_dict[index], out=state.q_memory_dict[index])

    all_reduce(state.q_memory_dict[index], group=group)
    state.q_memory_dict[index].div_(world_size)
    torch.matmul(state.p_memory_dict[index], state.q_memory_dict[index].t(), out=matrix)
    state._end(bucket, index, before, padded)
    buffer.copy_(padded[:length])
    return _completed(buffer)
