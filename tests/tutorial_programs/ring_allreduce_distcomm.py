#!/usr/bin/env python
"""run.py with the tutorial's "Our Own Ring-Allreduce", at world size 4.

From "Writing Distributed Applications with PyTorch" (seeds/tutorial-writing-distributed-
applications.txt). ``allreduce(send, recv)`` is as printed there. As printed it does not compute
the sum: it circulates its zero-filled scratch buffers and adds ``recv``/``send`` (the arguments)
instead of what arrived, so at world size 4 every rank ends with twice its own input. Both
frameworks must print exactly that. ``ring_allreduce_fixed`` below (not in the tutorial) is the
same ring passing the received data on, which sums all inputs. Other changes: backend 'gloo'
(torch 2.x has no 'tcp' backend), MASTER_PORT from the environment when set, and a run() (the
tutorial gives none for this section). The *_distcomm.py twin of this file differs from it only in
the line that imports ``dist``.
"""
import os
import torch as th
import distcomm as dist
from torch.multiprocessing import Process

""" Implementation of a ring-reduce with addition. """
def allreduce(send, recv):
    rank = dist.get_rank()
    size = dist.get_world_size()
    send_buff = th.zeros(send.size())
    recv_buff = th.zeros(send.size())
    accum = th.zeros(send.size())
    accum[:] = send[:]

    left = ((rank - 1) + size) % size
    right = (rank + 1) % size

    for i in range(size - 1):
        if i % 2 == 0:
            # Send send_buff
            send_req = dist.isend(send_buff, right)
            dist.recv(recv_buff, left)
            accum[:] += recv[:]
        else:
            # Send recv_buff
            send_req = dist.isend(recv_buff, right)
            dist.recv(send_buff, left)
            accum[:] += send[:]
        send_req.wait()
    recv[:] = accum[:]

def ring_allreduce_fixed(send, recv):
    rank = dist.get_rank()
    size = dist.get_world_size()
    send_buff = send.clone()
    recv_buff = th.zeros(send.size())
    accum = send.clone()

    left = ((rank - 1) + size) % size
    right = (rank + 1) % size

    for i in range(size - 1):
        send_req = dist.isend(send_buff, right)
        dist.recv(recv_buff, left)
        accum[:] += recv_buff[:]
        send_req.wait()
        send_buff[:] = recv_buff[:]
    recv[:] = accum[:]

def run(rank, size):
    send = th.arange(4, dtype=th.float32) + 10 * rank
    recv = th.zeros(4)
    allreduce(send, recv)
    print('Rank ', rank, ' tutorial ring: ', recv)
    recv = th.zeros(4)
    ring_allreduce_fixed(send, recv)
    print('Rank ', rank, ' fixed ring: ', recv)

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
