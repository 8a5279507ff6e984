"""Sharding a dataset over the ranks: DistributedSampler (torch's) and the tutorial's DataPartitioner.

``DistributedSampler`` yields exactly the indices of
``torch.utils.data.distributed.DistributedSampler`` for the same arguments, with or without torch:
the shuffle is torch's ``randperm`` on a generator seeded with ``seed + epoch`` (torch's CPU
generator is MT19937 seeded with the low 32 bits of the seed, and randperm is a Fisher-Yates
shuffle drawing ``random() % (n - i)``), reproduced here with numpy's MT19937.
"""

from __future__ import annotations

import math
import random
import sys
from typing import Any, Iterator, Sequence

import numpy as np

__all__ = ["DataPartitioner", "DistributedSampler", "Partition", "randperm"]


def randperm(n: int, seed: int) -> list[int]:
    """``torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()``."""
    torch = sys.modules.get("torch")
    if torch is not None:
        g = torch.Generator()
        g.manual_seed(seed)
        return torch.randperm(n, generator=g).tolist()
    if n >= 2**32 // 20:
        raise ValueError("randperm without torch supports n < 214748364 (torch switches to 64-bit draws above)")
    if n <= 1:
        return list(range(n))
    draws = np.random.RandomState(seed & 0xFFFFFFFF).randint(0, 2**32, size=n - 1, dtype=np.uint32)
    offsets = (draws.astype(np.int64) % np.arange(n, 1, -1, dtype=np.int64)).tolist()
    perm = list(range(n))
    for i, z in enumerate(offsets):
        j = i + z
        perm[i], perm[j] = perm[j], perm[i]
    return perm


class DistributedSampler:
    """Restrict data loading to this rank's share of the dataset (for a DataLoader's ``sampler=``).

    Every rank sees ``len(dataset) / num_replicas`` indices (rounded up: the list is padded by
    repeating its start, so every rank gets as many; with ``drop_last`` rounded down instead).
    With ``shuffle`` the order changes with ``set_epoch(epoch)``: call it at the start of each epoch,
    on every rank, or every epoch repeats the same order.

    ``num_replicas``/``rank`` default to the default group's size and this process's rank.
    """

    def __init__(self, dataset: Any, num_replicas: int | None = None, rank: int | None = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False):
        if num_replicas is None or rank is None:
            from .._api.groups import get_rank, get_world_size

            num_replicas = get_world_size() if num_replicas is None else num_replicas
            rank = get_rank() if rank is None else rank
        if rank >= num_replicas or rank < 0:
            raise ValueError(f"Invalid rank {rank}, rank should be in the interval [0, {num_replicas - 1}]")
        self.dataset = dataset
        self.num_replicas = num_replicas
        self.rank = rank
        self.epoch = 0
        self.drop_last = drop_last
        n = len(dataset)
        if drop_last and n % num_replicas:
            self.num_samples = math.ceil((n - num_replicas) / num_replicas)
        else:
            self.num_samples = math.ceil(n / num_replicas)
        self.total_size = self.num_samples * num_replicas
        self.shuffle = shuffle
        self.seed = seed

    def __iter__(self) -> Iterator[int]:
        n = len(self.dataset)
        indices = randperm(n, self.seed + self.epoch) if self.shuffle else list(range(n))
        if self.drop_last:
            indices = indices[:self.total_size]
        else:
            padding = self.total_size - len(indices)
            repeats = math.ceil(padding / len(indices)) if indices else 0
            indices += (indices * max(repeats, 1))[:padding]
        assert len(indices) == self.total_size, (len(indices), self.total_size)
        mine = indices[self.rank:self.total_size:self.num_replicas]
        assert len(mine) == self.num_samples
        return iter(mine)

    def __len__(self) -> int:
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        """Use the shuffle of ``epoch`` (``seed + epoch``) from the next iteration on."""
        self.epoch = epoch


class Partition:
    """The items of ``data`` at positions ``index``, as a dataset (the tutorial's Partition)."""

    def __init__(self, data: Sequence, index: Sequence[int]):
        self.data = data
        self.index = index

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int):
        return self.data[self.index[i]]


class DataPartitioner:
    """Split ``data`` into disjoint random partitions of the given fractions (the tutorial's
    DataPartitioner): every rank builds it with the same ``seed`` and takes ``use(rank)``.

    ``sizes`` are fractions of ``len(data)`` (each partition gets ``int(fraction * len)`` items,
    taken in order from one shuffle of the indices by ``random.Random(seed)``).
    """

    def __init__(self, data: Sequence, sizes: Sequence[float] = (0.7, 0.2, 0.1), seed: int = 1234):
        self.data = data
        indexes = list(range(len(data)))
        random.Random(seed).shuffle(indexes)
        self.partitions: list[list[int]] = []
        for fraction in sizes:
            count = int(fraction * len(data))
            self.partitions.append(indexes[:count])
            indexes = indexes[count:]

    def use(self, partition: int) -> Partition:
        return Partition(self.data, self.partitions[partition])
