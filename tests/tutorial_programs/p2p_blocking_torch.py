#!/usr/bin/env python
"""run.py with the tutorial's "Blocking point-to-point communication" run().

From "Writing Distributed Applications with PyTorch" (seeds/tutorial-writing-distributed-
applications.txt), as printed there except: backend 'gloo' (torch 2.x has no 'tcp' backend) and
MASTER_PORT taken from the environment when it is set (tests run side by side). The *_distcomm.py
twin of this file differs from it only in the line that imports ``dist``.
"""
import os
import torch
import torch.distributed as dist
from torch.multiprocessing import Process

def run(rank, size):
    tensor = torch.zeros(1)
    if rank == 0:
        tensor += 1
        # Send the tensor to process 1
        dist.send(tensor=tensor, dst=1)
    else:
        # Receive tensor from process 0
        dist.recv(tensor=tensor, src=0)
    print('Rank ', rank, ' has data ', tensor[0])

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
