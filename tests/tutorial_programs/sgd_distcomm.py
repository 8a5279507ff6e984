#!/usr/bin/env python
"""The tutorial's "Distributed Synchronous SGD Example" with its DataPartitioner, at world size 2.

From "Writing Distributed Applications with PyTorch" (seeds/tutorial-writing-distributed-
applications.txt): Partition, DataPartitioner, partition_dataset, run and average_gradients as
printed there except where today's torch requires otherwise or the test supplies the data:

* the dataset is made here (1024 points of 20 features, 4 classes from a fixed random linear
  teacher; seeded) instead of downloading MNIST, and Net is a two-layer perceptron for it;
* the batch size is an int (``int(128 / float(size))``: DataLoader refuses floats) and the epoch
  loss uses ``loss.item()`` (``loss.data[0]`` fails on 0-dim tensors since torch 0.4);
* backend 'gloo' (torch 2.x has no 'tcp' backend) and MASTER_PORT from the environment when set.

The deprecated ``dist.reduce_op.SUM`` and ``Variable`` are kept, as printed. The *_distcomm.py
twin of this file differs from it only in the line that imports ``dist``.
"""
import os
from math import ceil
from random import Random

import torch
import distcomm as dist
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.autograd import Variable
from torch.multiprocessing import Process

""" Dataset partitioning helper """
class Partition(object):

    def __init__(self, data, index):
        self.data = data
        self.index = index

    def __len__(self):
        return len(self.index)

    def __getitem__(self, index):
        data_idx = self.index[index]
        return self.data[data_idx]


class DataPartitioner(object):

    def __init__(self, data, sizes=[0.7, 0.2, 0.1], seed=1234):
        self.data = data
        self.partitions = []
        rng = Random()
        rng.seed(seed)
        data_len = len(data)
        indexes = [x for x in range(0, data_len)]
        rng.shuffle(indexes)

        for frac in sizes:
            part_len = int(frac * data_len)
            self.partitions.append(indexes[0:part_len])
            indexes = indexes[part_len:]

    def use(self, partition):
        return Partition(self.data, self.partitions[partition])


def make_dataset(n=1024, features=20, classes=4):
    """ The data this test makes, in place of MNIST. """
    g = torch.Generator().manual_seed(2024)
    x = torch.randn(n, features, generator=g)
    teacher = torch.randn(features, classes, generator=g)
    y = (x @ teacher + 0.5 * torch.randn(n, classes, generator=g)).argmax(dim=1)
    return torch.utils.data.TensorDataset(x, y)


class Net(nn.Module):
    def __init__(self):
        super(Net, self).__init__()
        self.fc1 = nn.Linear(20, 32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x):
        x = F.relu(self.fc1(x))
        return F.log_softmax(self.fc2(x), dim=1)


""" Partitioning the dataset """
def partition_dataset():
    dataset = make_dataset()
    size = dist.get_world_size()
    bsz = int(128 / float(size))
    partition_sizes = [1.0 / size for _ in range(size)]
    partition = DataPartitioner(dataset, partition_sizes)
    partition = partition.use(dist.get_rank())
    train_set = torch.utils.data.DataLoader(partition,
                                         batch_size=bsz,
                                         shuffle=True)
    return train_set, bsz


""" Distributed Synchronous SGD Example """
def run(rank, size):
        torch.manual_seed(1234)
        train_set, bsz = partition_dataset()
        model = Net()
        optimizer = optim.SGD(model.parameters(),
                              lr=0.01, momentum=0.5)

        num_batches = ceil(len(train_set.dataset) / float(bsz))
        for epoch in range(10):
            epoch_loss = 0.0
            for data, target in train_set:
                data, target = Variable(data), Variable(target)
                optimizer.zero_grad()
                output = model(data)
                loss = F.nll_loss(output, target)
                epoch_loss += loss.item()
                loss.backward()
                average_gradients(model)
                optimizer.step()
            print('Rank ', dist.get_rank(), ', epoch ',
                  epoch, ': ', epoch_loss / num_batches)


""" Gradient averaging. """
def average_gradients(model):
    size = float(dist.get_world_size())
    for param in model.parameters():
        dist.all_reduce(param.grad.data, op=dist.reduce_op.SUM)
        param.grad.data /= size


def init_processes(rank, size, fn, backend='gloo'):
    """ Initialize the distributed environment. """
    os.environ['MASTER_ADDR'] = '127.0.0.1'
    os.environ.setdefault('MASTER_PORT', '29500')
    dist.init_process_group(backend, rank=rank, world_size=size)
    fn(rank, size)


if __name__ == "__main__":
    size = 2
    processes = []
    for rank in range(size):
        p = Process(target=init_processes, args=(rank, size, run))
        p.start()
        processes.append(p)

    for p in processes:
        p.join()
