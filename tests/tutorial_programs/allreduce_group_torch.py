#!/usr/bin/env python
"""run.py with the tutorial's "All-Reduce example" run(), at world size 4 (group [0, 1]).

From "Writing Distributed Applications with PyTorch" (seeds/tutorial-writing-distributed-
applications.txt), as printed there except: backend 'gloo' (torch 2.x has no 'tcp' backend),
MASTER_PORT taken from the environment when it is set (tests run side by side), and 4 processes
instead of the template's 2, so that ranks 2 and 3 are outside the group (their all_reduce returns
at once and leaves their tensor as it was). The deprecated dist.reduce_op is kept, as printed.
The *_distcomm.py twin of this file differs from it only in the line that imports ``dist``.
"""
import os
import torch
import torch.distributed as dist
from torch.multiprocessing import Process

""" All-Reduce example."""
def run(rank, size):
    """ Simple point-to-point communication. """
    group = dist.new_group([0, 1])
    tensor = torch.ones(1)
    dist.all_reduce(tensor, op=dist.reduce_op.SUM, group=group)
    print('Rank ', rank, ' has data ', tensor[0])

def init_processes(rank, size, fn, backend='gloo'):
    """ Initialize the distributed environment. """
    os.environ['MASTER_ADDR'] = '127.0.0.1'
    os.environ.setdefault('MASTER_PORT', '29500')
    dist.init_process_group(backend, rank=rank, world_size=size)
    fn(rank, size)


if __name__ == "__main__":
    size = 4
    processes = []
    for rank in range(size):
        p = Process(target=init_processes, args=(rank, size, run))
        p.start()
        processes.append(p)

    for p in processes:
        p.join()
