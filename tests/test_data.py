"""DistributedSampler gives torch's indices (with and without torch loaded); DataPartitioner
splits like the tutorial's."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest

from distcomm.utils.data import DataPartitioner, DistributedSampler, randperm

torch = pytest.importorskip("torch")
from torch.utils.data.distributed import DistributedSampler as TorchSampler  # noqa: E402

CASES = [
    # (dataset length, replicas, shuffle, seed, drop_last)
    (10, 3, True, 0, False),
    (10, 3, True, 0, True),
    (10, 3, False, 0, False),
    (10, 3, False, 0, True),
    (7, 4, True, 42, False),
    (2, 5, True, 1, False),  # padding longer than the dataset
    (2, 5, False, 1, False),
    (101, 2, True, 2**33 + 5, False),
    (64, 8, True, -3, True),
    (1000, 3, True, 7, True),
]


@pytest.mark.parametrize("n,replicas,shuffle,seed,drop_last", CASES)
def test_sampler_indices_equal_torchs(n, replicas, shuffle, seed, drop_last):
    data = list(range(n))
    for epoch in (0, 1, 5):
        for rank in range(replicas):
            ours = DistributedSampler(data, replicas, rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
            theirs = TorchSampler(data, replicas, rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
            ours.set_epoch(epoch)
            theirs.set_epoch(epoch)
            assert list(ours) == list(theirs), (rank, epoch)
            assert len(ours) == len(theirs)


def test_randperm_without_torch_equals_torch():
    """The numpy MT19937 path, in a process where torch is not imported."""
    cases = [(0, 1), (1, 5), (2, 0), (50, 3), (1000, 2**40 + 1), (5000, -7)]
    code = (
        "import sys, json; from distcomm.utils.data import randperm; "
        f"print(json.dumps([randperm(n, s) for n, s in {cases!r}])); "
        "assert 'torch' not in sys.modules"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    import json

    for (n, seed), perm in zip(cases, json.loads(out)):
        g = torch.Generator()
        g.manual_seed(seed)
        assert perm == torch.randperm(n, generator=g).tolist(), (n, seed)


def test_sampler_defaults_to_the_world_and_rejects_bad_ranks():
    with pytest.raises(ValueError, match=r"Invalid rank 3, rank should be in the interval \[0, 2\]"):
        DistributedSampler(range(10), num_replicas=3, rank=3)
    import distcomm

    distcomm.init_process_group(store=distcomm.HashStore(), rank=0, world_size=1)
    try:
        sampler = DistributedSampler(range(5), shuffle=False)
        assert (sampler.num_replicas, sampler.rank, list(sampler)) == (1, 0, [0, 1, 2, 3, 4])
    finally:
        distcomm.destroy_process_group()


def test_sampler_works_with_a_dataloader():
    dataset = torch.utils.data.TensorDataset(torch.arange(12.0))
    sampler = DistributedSampler(dataset, num_replicas=2, rank=1, seed=3)
    loader = torch.utils.data.DataLoader(dataset, batch_size=2, sampler=sampler)
    got = [int(x) for (batch,) in loader for x in batch]
    assert got == list(TorchSampler(dataset, num_replicas=2, rank=1, seed=3))


def _tutorial_partitions(n, sizes, seed):
    """The tutorial's DataPartitioner, as printed there."""
    rng = random.Random()
    rng.seed(seed)
    indexes = list(range(n))
    rng.shuffle(indexes)
    parts = []
    for frac in sizes:
        part_len = int(frac * n)
        parts.append(indexes[0:part_len])
        indexes = indexes[part_len:]
    return parts


@pytest.mark.parametrize("n,sizes", [(100, [0.7, 0.2, 0.1]), (60000, [0.25] * 4), (10, [1 / 3] * 3)])
def test_data_partitioner_matches_tutorial(n, sizes):
    data = [f"item{i}" for i in range(n)]
    partitioner = DataPartitioner(data, sizes)
    expected = _tutorial_partitions(n, sizes, 1234)
    for k, idx in enumerate(expected):
        part = partitioner.use(k)
        assert len(part) == len(idx)
        assert [part[i] for i in range(len(part))] == [data[i] for i in idx]
    assert len({i for idx in expected for i in idx}) == sum(len(i) for i in expected)  # disjoint
