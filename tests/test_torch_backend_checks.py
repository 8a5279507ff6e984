"""The torch backend "distcomm" refuses bad arguments as gloo does, and survives a job's lifecycle.

* Every call gloo refuses from its own checks (sizes, dtypes, roots, split sizes) is refused on
  every rank before any communication, and the group works afterwards: the same program runs on
  backend "gloo" as the oracle and on "distcomm".
* init_process_group, destroy_process_group, init_process_group again on a store given to init,
  which outlives them: the second init must not read the first one's keys.
* An env:// job whose rank 0 (the host of torch's TCPStore) exits first: the other ranks, their
  groups destroyed, make no call to the gone store, whose C++ client would print a backtrace.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

torch = pytest.importorskip("torch")

from harness import free_port, run_world  # noqa: E402


def _bad_calls(dist, rank: int, world: int) -> dict:
    """Calls that are wrong the same way on every rank, each refused locally by gloo."""
    two = torch.tensor([1.0, 2.0]) + rank
    return {
        "all_gather_into_tensor, other dtype": lambda: dist.all_gather_into_tensor(
            torch.zeros(2 * world, dtype=torch.float64), two),
        "all_gather_into_tensor, output too big": lambda: dist.all_gather_into_tensor(torch.zeros(2 * world + 1), two),
        "all_gather, sizes differ by rank": lambda: dist.all_gather(
            [torch.zeros(j + 1) for j in range(world)], torch.ones(rank + 1)),
        "all_gather, list too long": lambda: dist.all_gather([torch.zeros(2) for _ in range(world + 1)], two),
        "all_gather_coalesced, wrong shapes": lambda: dist.all_gather_coalesced(
            [[torch.zeros(3)] for _ in range(world)], [two]),
        "reduce_scatter_tensor, input too big": lambda: dist.reduce_scatter_tensor(
            torch.zeros(2), torch.zeros(2 * world + 1)),
        "reduce_scatter_tensor, other dtype": lambda: dist.reduce_scatter_tensor(
            torch.zeros(2), torch.zeros(2 * world, dtype=torch.float64)),
        "reduce_scatter, wrong sizes": lambda: dist.reduce_scatter(torch.zeros(2), [torch.zeros(3)] * world),
        "all_to_all_single, splits do not sum": lambda: dist.all_to_all_single(
            torch.zeros(2 * world), torch.zeros(2 * world), [1] * world, [1] * world),
        "all_to_all_single, a split too many": lambda: dist.all_to_all_single(
            torch.zeros(world + 1), torch.zeros(world + 1), [1] * (world + 1), [1] * (world + 1)),
        "broadcast, root past the group": lambda: dist.broadcast(two, src=world),
        "reduce, root past the group": lambda: dist.reduce(two, dst=world),
    }


def _refused_and_group_still_works(rank, world, backend):
    import torch.distributed as dist

    import distcomm.torch_backend  # noqa: F401 - registers "distcomm"
    from distcomm.errors import DistError

    dist.init_process_group(backend, rank=rank, world_size=world)
    dist.barrier()  # the shared memory is set up: a bad call must not break it
    results = {}
    for name, call in _bad_calls(dist, rank, world).items():
        try:
            call()
            results[name] = "accepted"
        except (RuntimeError, ValueError) as exc:
            # distcomm's refusal is its ArgumentError, a DistError (torch's RuntimeError family)
            results[name] = "refused" if backend == "gloo" or isinstance(exc, DistError) else repr(exc)
        x = torch.ones(3) * (rank + 1)
        dist.all_reduce(x)
        assert torch.equal(x, torch.full((3,), float(sum(range(1, world + 1))))), (name, x)
    dist.barrier()
    dist.destroy_process_group()
    return results


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("backend", ["gloo", "distcomm"])
def test_bad_arguments_are_refused_on_every_rank_and_the_group_still_works(backend, world):
    results = run_world(_refused_and_group_still_works, world, args=(backend,), timeout=120)
    for rank_results in results:
        assert rank_results == {name: "refused" for name in rank_results}, rank_results


def _p2p_to_a_rank_past_the_group(rank, world):
    import torch.distributed as dist

    import distcomm.torch_backend  # noqa: F401
    from distcomm._api.args import ArgumentError

    dist.init_process_group("distcomm", rank=rank, world_size=world)
    started = time.monotonic()
    for call in (lambda: dist.send(torch.ones(2), dst=world + 3), lambda: dist.recv(torch.ones(2), src=world)):
        with pytest.raises(ArgumentError, match="invalid (destination|source) rank"):
            call()
    assert time.monotonic() - started < 5  # refused at once (gloo waits for the rank's address)
    dist.barrier()
    dist.destroy_process_group()
    return True


def test_p2p_to_a_rank_past_the_group_is_refused_at_once():
    assert run_world(_p2p_to_a_rank_past_the_group, 2, timeout=60) == [True, True]


# -- init, destroy, init again ------------------------------------------------------------------
def _init_twice(rank, world, backend, port):
    from datetime import timedelta

    import torch.distributed as dist

    import distcomm.torch_backend  # noqa: F401

    timeout = timedelta(seconds=30)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timeout)
    sums = []
    for _ in range(2):
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
        x = torch.ones(3) * (rank + 1)
        dist.all_reduce(x)
        sums.append(x.tolist())
        dist.barrier()
        dist.destroy_process_group()
    return sums


@pytest.mark.slow
def test_init_destroy_init_on_a_store_that_outlives_them():
    # (torch's gloo is no oracle here: its second init on the same store hung past 120 s under load)
    results = run_world(_init_twice, 2, args=("distcomm", free_port()), timeout=120)
    assert results == [[[3.0] * 3] * 2] * 2


# -- rank 0 (the store's host) leaves first -------------------------------------------------------
RANK_LEAVES = textwrap.dedent("""
    import os, sys, time
    import torch, torch.distributed as dist
    import distcomm.torch_backend
    rank = int(os.environ["RANK"])
    dist.init_process_group("distcomm")
    x = torch.ones(2)
    dist.all_reduce(x)
    if rank == 0:
        dist.destroy_process_group()
        print(os.getpid(), flush=True)
        sys.exit(0)
    host = int(sys.stdin.readline())  # rank 0 has left its group and is exiting
    dist.destroy_process_group()
    while os.path.exists(f"/proc/{host}"):  # this rank outlives the store's host, as a slower rank does
        time.sleep(0.01)
    time.sleep(1.5)
""")


@pytest.mark.slow
def test_ranks_outliving_the_store_host_make_no_call_to_its_store():
    world, port = 3, free_port()
    procs = []
    try:
        for rank in range(world):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port), PYTHONWARNINGS="ignore")
            procs.append(subprocess.Popen([sys.executable, "-c", RANK_LEAVES], env=env, text=True,
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
        host_pid = procs[0].stdout.readline()
        assert host_pid.strip().isdigit(), procs[0].communicate(timeout=30)
        for p in procs[1:]:  # at once: these ranks leave their groups while rank 0 exits
            p.stdin.write(host_pid)
            p.stdin.flush()
        outputs = [p.communicate(timeout=60) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    stderr = "".join(err for _, err in outputs)
    assert [p.returncode for p in procs] == [0] * world, stderr
    assert "TCPStore" not in stderr and "recvValue" not in stderr, stderr
