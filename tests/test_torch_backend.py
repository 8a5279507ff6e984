"""distcomm as a torch c10d backend: torch's own API, DDP, FSDP and DTensor on backend "distcomm".

Each world runs torch.distributed (not distcomm's API). Collectives are compared on the same inputs
with torch's gloo in the same processes (a gloo default group and a "distcomm" group of the same
ranks), or with a single-process reference where gloo has no such operation.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from harness import run_world  # noqa: E402

SRC = str(Path(__file__).resolve().parent.parent / "src")


def _init(rank, world, backend="distcomm"):
    import torch.distributed as dist

    import distcomm.torch_backend  # noqa: F401 - registers "distcomm"

    dist.init_process_group(backend, rank=rank, world_size=world)
    return dist


def _close(dist):
    dist.barrier()
    dist.destroy_process_group()


# -- every collective, against gloo --------------------------------------------------------------
def _collectives(group, rank, world):
    """Results of torch.distributed's collectives on ``group`` (None: the default group)."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    out = {}
    base = torch.arange(6, dtype=torch.float32) + rank * 10

    for name in ["SUM", "MAX", "MIN", "PRODUCT"]:
        x = base.clone() / 7 + 1
        dist.all_reduce(x, op=getattr(dist.ReduceOp, name), group=group)
        out[f"all_reduce_{name}"] = x
    for name in ["BAND", "BOR", "BXOR"]:
        x = torch.arange(5, dtype=torch.int64) * (rank + 3)
        dist.all_reduce(x, op=getattr(dist.ReduceOp, name), group=group)
        out[f"all_reduce_{name}"] = x
    big = torch.arange(300_000, dtype=torch.float64) * (rank + 1)
    dist.all_reduce(big, group=group)
    out["all_reduce_big"] = big
    x = base.clone()
    work = dist.all_reduce(x, async_op=True, group=group)
    work.wait()
    out["all_reduce_async"] = x
    out["future"] = work.get_future().wait()[0].clone()

    x = base.clone()
    dist.broadcast(x, src=world - 1, group=group)
    out["broadcast"] = x
    x = base.clone()
    dist.reduce(x, dst=0, group=group)
    out["reduce"] = x if rank == 0 else None

    outs = [torch.empty(6) for _ in range(world)]
    dist.all_gather(outs, base, group=group)
    out["all_gather"] = torch.stack(outs)
    flat = torch.empty(6 * world)
    dist.all_gather_into_tensor(flat, base, group=group)
    out["all_gather_into_tensor"] = flat
    gathered = [torch.empty(6) for _ in range(world)] if rank == 0 else None
    dist.gather(base, gathered, dst=0, group=group)
    out["gather"] = torch.stack(gathered) if rank == 0 else None
    x = torch.empty(6)
    dist.scatter(x, [base + 100 * r for r in range(world)] if rank == 0 else None, src=0, group=group)
    out["scatter"] = x
    x = torch.empty(3)
    dist.reduce_scatter(x, [base[:3] * (r + 1) for r in range(world)], group=group)
    out["reduce_scatter"] = x
    x = torch.empty(2)
    dist.reduce_scatter_tensor(x, torch.arange(2.0 * world) + rank, group=group)
    out["reduce_scatter_tensor"] = x

    ins = [torch.full((2,), float(rank * 10 + r)) for r in range(world)]  # gloo: equal sizes only
    outs = [torch.empty(2) for _ in range(world)]
    dist.all_to_all(outs, ins, group=group)
    out["all_to_all"] = torch.cat(outs)
    send_splits = [r + 1 for r in range(world)]
    recv_splits = [rank + 1] * world
    inp = torch.arange(float(sum(send_splits) * 2)).reshape(-1, 2) + rank * 100
    res = torch.empty(sum(recv_splits), 2)
    dist.all_to_all_single(res, inp, recv_splits, send_splits, group=group)
    out["all_to_all_single"] = res
    dist.barrier(group=group)

    # point-to-point on a ring
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    x = torch.empty(4)
    if rank % 2 == 0:
        dist.send(base[:4], dst=nxt, group=group)
        dist.recv(x, src=prv, group=group)
    else:
        dist.recv(x, src=prv, group=group)
        dist.send(base[:4], dst=nxt, group=group)
    out["send_recv"] = x
    y = torch.empty(4)
    reqs = dist.batch_isend_irecv([
        dist.P2POp(dist.isend, base[:4] * 2, nxt, group=group),
        dist.P2POp(dist.irecv, y, prv, group=group),
    ])
    for r in reqs:
        r.wait()
    out["batch_isend_irecv"] = y
    if rank == 0:
        srcs = set()
        for _ in range(world - 1):
            z = torch.empty(1)
            srcs.add(dist.recv(z, group=group))
        out["recv_any"] = sorted(srcs)
    else:
        dist.send(torch.tensor([float(rank)]), dst=0, group=group)
        out["recv_any"] = None

    # object collectives
    objs = [{"rank": rank, "text": "x" * rank}] if rank == 1 else [None]
    dist.broadcast_object_list(objs, src=1, group=group)
    out["broadcast_object_list"] = objs
    everyone = [None] * world
    dist.all_gather_object(everyone, ("r", rank), group=group)
    out["all_gather_object"] = everyone
    got = [None] * world if rank == 0 else None
    dist.gather_object({"k": rank}, got, dst=0, group=group)
    out["gather_object"] = got
    one = [None]
    dist.scatter_object_list(one, [f"to{r}" for r in range(world)] if rank == 0 else None, src=0, group=group)
    out["scatter_object_list"] = one

    # functional collectives resolve the group by its name
    fgroup = group if group is not None else dist.group.WORLD
    out["funcol_all_reduce"] = funcol.all_reduce(base, "sum", fgroup)
    out["funcol_all_gather"] = funcol.all_gather_tensor(base, 0, fgroup)
    out["funcol_reduce_scatter"] = funcol.reduce_scatter_tensor(torch.arange(2.0 * world) + rank, "sum", 0, fgroup)
    # clone(): a plain copy, which also waits for a functional collective's result
    return {k: (torch.Tensor(v.clone()) if isinstance(v, torch.Tensor) else v) for k, v in out.items()}


def _compare(a, b, where):
    assert a.keys() == b.keys()
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, torch.Tensor):
            # floats: summation order differs between algorithms (three ranks round differently)
            same = torch.allclose(x, y, rtol=1e-6) if x.is_floating_point() else torch.equal(x, y)
            assert same and x.shape == y.shape, f"{where}: {key}: {x} != {y}"
        else:
            assert x == y, f"{where}: {key}: {x!r} != {y!r}"


def _vs_gloo(rank, world):
    dist = _init(rank, world, backend="gloo")  # the default group is torch's gloo
    group = dist.new_group(backend="distcomm")
    assert dist.get_backend(group) == "distcomm"
    mine = _collectives(group, rank, world)
    theirs = _collectives(None, rank, world)
    _compare(mine, theirs, f"rank {rank}")

    # AVG and PREMUL_SUM: torch's gloo has neither; against the arithmetic
    x = torch.arange(4.0) + rank
    dist.all_reduce(x, op=dist.ReduceOp.AVG, group=group)
    assert torch.allclose(x, torch.arange(4.0) + (world - 1) / 2)
    x = torch.arange(4.0) + rank
    dist.all_reduce(x, op=dist._make_nccl_premul_sum(0.5), group=group)
    assert torch.allclose(x, 0.5 * (world * torch.arange(4.0) + world * (world - 1) / 2))
    # a subgroup of ranks 0 and the last
    sub = dist.new_group([0, world - 1], backend="distcomm")
    if rank in (0, world - 1):
        y = torch.tensor([float(rank)])
        dist.all_reduce(y, group=sub)
        assert y.item() == world - 1
    _close(dist)
    return True


@pytest.mark.slow  # worlds importing torch twice (gloo and distcomm groups)
@pytest.mark.parametrize("world", [2, 3])
def test_collectives_match_gloo(world):
    assert run_world(_vs_gloo, world, timeout=120) == [True] * world


# -- small collectives through torch's API take distcomm's tensor-level latency paths -------------
def _small_ops_on_latency_paths(rank, world):
    dist = _init(rank, world)
    from distcomm.backends.shm import observe

    dist.barrier()  # the engine sets a group's shared memory up on its first collective
    taken: list[str] = []
    observe.set_observer(lambda name: taken.append(name) if name.startswith("latency_") else None)
    base = torch.arange(3, dtype=torch.float32) + 10 * rank
    everyone = torch.stack([torch.arange(3, dtype=torch.float32) + 10 * r for r in range(world)])
    root = world - 1

    x = base.clone()
    dist.broadcast(x, src=root)
    assert torch.equal(x, everyone[root])
    x = base.clone()
    dist.reduce(x, dst=root, op=dist.ReduceOp.MAX)
    if rank == root:
        assert torch.equal(x, everyone.max(0).values)
    outs = [torch.empty(3) for _ in range(world)]
    dist.all_gather(outs, base)
    assert torch.equal(torch.stack(outs), everyone)
    flat = torch.empty(3 * world)
    dist.all_gather_into_tensor(flat, base)
    assert torch.equal(flat, everyone.reshape(-1))
    got = [torch.empty(3) for _ in range(world)] if rank == root else None
    dist.gather(base, got, dst=root)
    if rank == root:
        assert torch.equal(torch.stack(got), everyone)
    x = torch.empty(3)
    dist.scatter(x, list(everyone * 2) if rank == root else None, src=root)
    assert torch.equal(x, everyone[rank] * 2)
    x = torch.empty(3)
    dist.reduce_scatter_tensor(x, everyone.reshape(-1) * (rank + 1))
    assert torch.equal(x, everyone[rank] * sum(range(1, world + 1)))
    out = torch.empty(world, 2)
    dist.all_to_all_single(out, torch.arange(2.0 * world).reshape(world, 2) + 100 * rank)
    assert torch.equal(out, torch.stack([torch.arange(2.0) + 2 * rank + 100 * r for r in range(world)]))
    # an asynchronous call goes to the group's thread, off the latency paths (which wait for the
    # peers before returning: tests/test_torch_backend_async.py)
    x = base.clone()
    work = dist.broadcast(x, src=0, async_op=True)
    assert work.wait() and torch.equal(x, everyone[0])
    observe.set_observer(None)
    want = ["latency_broadcast", "latency_reduce", "latency_all_gather", "latency_all_gather_into_tensor",
            "latency_gather", "latency_scatter", "latency_reduce_scatter_tensor", "latency_all_to_all_single"]
    assert taken == want, taken
    _close(dist)
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_small_collectives_through_torchs_api_take_the_latency_paths(world):
    assert run_world(_small_ops_on_latency_paths, world, timeout=90) == [True] * world


# -- torch's DDP and ZeRO on init_process_group("distcomm") ---------------------------------------
def _model(seed, unused=False):
    torch.manual_seed(seed)
    layers = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    if not unused:
        return layers

    class WithUnused(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.spare = layers, torch.nn.Linear(8, 4)  # spare gets no gradient

        def forward(self, x):
            return self.body(x)

    return WithUnused()


def _batch(rank, step, micro=0):
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    return torch.randn(5, 8, generator=g), torch.randn(5, 4, generator=g)


def _loss(model, x, y):
    return torch.nn.functional.mse_loss(model(x), y)


def _reference(world, steps, micro, unused):
    """One process: the gradient of every step is the mean over ranks (and sum over micro-batches)."""
    model = _model(0, unused)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        opt.zero_grad()
        for r in range(world):
            for m in range(micro):
                (_loss(model, *_batch(r, step, m)) / world).backward()
        opt.step()
    return [p.detach() for p in model.parameters()]


def _ddp(rank, world, mode):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    _init(rank, world)
    assert dist.get_backend() == "distcomm"
    unused = mode == "unused"
    model = DDP(_model(rank, unused), find_unused_parameters=unused)  # rank 0's weights win
    if mode == "hook":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        model.register_comm_hook(None, default_hooks.allreduce_hook)
    if mode == "zero":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD, lr=0.1)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    micro = 2 if mode == "no_sync" else 1
    for step in range(3):
        opt.zero_grad()
        if micro == 2:
            with model.no_sync():
                _loss(model, *_batch(rank, step, 0)).backward()
        _loss(model, *_batch(rank, step, micro - 1)).backward()
        opt.step()
    expected = _reference(world, 3, micro, unused)
    got = [p.detach() for p in model.module.parameters()]
    for i, (a, b) in enumerate(zip(got, expected)):
        assert torch.allclose(a, b, atol=1e-6), f"rank {rank}: parameter {i} differs from the reference"
    _close(dist)
    return True


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["default", "unused", "no_sync", "hook", "zero"])
def test_ddp_matches_single_process(mode):
    assert run_world(_ddp, 2, args=(mode,), timeout=120) == [True, True]


def _ddp_peer_killed(rank, world):
    import signal
    from datetime import timedelta

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import distcomm.torch_backend  # noqa: F401

    dist.init_process_group("distcomm", rank=rank, world_size=world, timeout=timedelta(seconds=15))
    model = DDP(_model(0))
    if rank == 1:
        # dies inside backward, while DDP's reducer has buckets in flight on the others
        model.module[0].weight.register_hook(lambda g: os.kill(os.getpid(), signal.SIGKILL))
    try:
        for step in range(3):
            _loss(model, *_batch(rank, step)).backward()
    except Exception as exc:  # noqa: BLE001 - what the survivor saw is the result
        return f"{type(exc).__name__}: {exc}"
    return "no error"


@pytest.mark.slow
def test_ddp_peer_killed_in_backward_raises_naming_the_rank():
    results = run_world(_ddp_peer_killed, 3, timeout=90, expect_failure=[1])
    for rank in (0, 2):
        assert results[rank] != "no error", results
        assert "rank 1" in results[rank], results[rank]


# -- FSDP2, DeviceMesh, DTensor, distributed checkpoint ------------------------------------------
def _resize_after_collective(rank, world):
    """FSDP frees and regrows parameter storages: a collective must leave them resizable."""
    import torch.distributed as dist

    _init(rank, world, backend="cpu:distcomm")
    for n in (2, 100_000):  # the shared-memory latency path and the general one
        t = torch.ones(n)
        dist.all_reduce(t)
        out = torch.empty(n * world)
        dist.all_gather_into_tensor(out, t)
        for x in (t, out):
            nbytes = x.untyped_storage().nbytes()
            x.untyped_storage().resize_(0)
            x.untyped_storage().resize_(nbytes)
    _close(dist)
    return True


@pytest.mark.slow
def test_storage_stays_resizable_after_collectives():
    assert run_world(_resize_after_collective, 2, timeout=60) == [True, True]


def _fsdp2_and_checkpoint(rank, world, ckpt_dir):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    _init(rank, world)
    mesh = init_device_mesh("cpu", (world,))
    model = _model(0)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        opt.zero_grad()
        _loss(model, *_batch(rank, step)).backward()
        opt.step()
    expected = _reference(world, 3, 1, False)
    got = [p.full_tensor().detach() for p in model.parameters()]
    for i, (a, b) in enumerate(zip(got, expected)):
        assert torch.allclose(a, b, atol=1e-6), f"rank {rank}: FSDP2 parameter {i} differs from the reference"

    # distributed checkpoint: save the sharded state, spoil it, load it back
    dcp.save({"model": model.state_dict()}, checkpoint_id=ckpt_dir)
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().zero_()
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=ckpt_dir)
    model.load_state_dict(state["model"])
    got = [p.full_tensor().detach() for p in model.parameters()]
    for i, (a, b) in enumerate(zip(got, expected)):
        assert torch.allclose(a, b, atol=1e-6), f"rank {rank}: parameter {i} not restored by the checkpoint"
    _close(dist)
    return True


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_fsdp2_fully_shard_and_checkpoint(world, tmp_path):
    assert run_world(_fsdp2_and_checkpoint, world, args=(str(tmp_path / "ckpt"),), timeout=150) == [True] * world


def _dtensor(rank, world):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    _init(rank, world)
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)  # the same full matrices on every rank
    a, b = torch.randn(6 * world, 5), torch.randn(5, 3 * world)
    expected = a @ b
    row = distribute_tensor(a, mesh, [Shard(0)]) @ distribute_tensor(b, mesh, [Replicate()])
    col = distribute_tensor(a, mesh, [Replicate()]) @ distribute_tensor(b, mesh, [Shard(1)])
    for name, c in (("row", row), ("col", col)):
        assert torch.allclose(c.full_tensor(), expected, atol=1e-5), f"rank {rank}: {name}-sharded matmul"
    # the contraction dimension sharded: partial sums, reduced by an all_reduce on redistribute
    k = 2 * world
    a2, b2 = torch.randn(4, k), torch.randn(k, 3)
    partial = distribute_tensor(a2, mesh, [Shard(1)]) @ distribute_tensor(b2, mesh, [Shard(0)])
    assert torch.allclose(partial.redistribute(mesh, [Replicate()]).to_local(), a2 @ b2, atol=1e-5)
    _close(dist)
    return True


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_dtensor_sharded_matmul(world):
    assert run_world(_dtensor, world, timeout=120) == [True] * world


# -- the autoload entry point -------------------------------------------------------------------
# pyproject.toml declares the entry point; installing it would repoint this machine's editable
# install, so these tests give a subprocess the same entry point through a dist-info of its own.
_AUTOLOAD_PROGRAM = textwrap.dedent("""
    import sys, time
    import torch
    import torch.distributed as dist
    registered = "DISTCOMM" in dist.Backend._plugins
    lazy = "distcomm" not in sys.modules
    if registered:
        store = dist.HashStore()
        dist.init_process_group("distcomm", store=store, rank=0, world_size=1)
        t = torch.ones(3)
        dist.all_reduce(t)
        assert dist.get_backend() == "distcomm" and t.tolist() == [1.0, 1.0, 1.0]
        dist.destroy_process_group()
    print(registered, lazy)
""")


def _autoload_env(tmp_path, **extra):
    info = tmp_path / "distcomm_autoload_test-0.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: distcomm-autoload-test\nVersion: 0\n")
    (info / "entry_points.txt").write_text("[torch.backends]\ndistcomm = distcomm_torch_autoload:register\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), SRC]), **extra)
    return env


@pytest.mark.slow
def test_autoload_registers_distcomm_lazily(tmp_path):
    env = _autoload_env(tmp_path)
    out = subprocess.run([sys.executable, "-c", _AUTOLOAD_PROGRAM], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "True"]  # registered at import torch, distcomm not imported


@pytest.mark.slow
def test_autoload_off_with_torch_device_backend_autoload_0(tmp_path):
    env = _autoload_env(tmp_path, TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    out = subprocess.run([sys.executable, "-c", _AUTOLOAD_PROGRAM], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "True"]


@pytest.mark.slow
def test_autoload_hook_is_cheap():
    """The hook's cost at import torch (budget: 10 ms) is what it imports: only itself, never
    distcomm or anything distcomm would pull in (its time is measured in
    docs/performance-notes.md; a timing assert would fail on a loaded machine)."""
    code = textwrap.dedent("""
        import sys, torch
        before = set(sys.modules)
        import distcomm_torch_autoload
        distcomm_torch_autoload.register()
        print(sorted(set(sys.modules) - before))
        print("DISTCOMM" in torch.distributed.Backend._plugins)
    """)
    env = dict(os.environ, PYTHONPATH=SRC, TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    imported, registered = out.stdout.splitlines()
    assert imported == "['distcomm_torch_autoload']", imported
    assert registered == "True"


# -- the Work torch receives ---------------------------------------------------------------------
def test_torch_work_failure_is_an_error_for_wait_and_future():
    import threading

    from distcomm.errors import PeerLostError
    from distcomm.torch_backend import TorchWork
    from distcomm.work import Work

    result = [torch.ones(2)]
    error = PeerLostError("all_reduce #3 on rank 0 (peer rank 1): rank 1 exited")
    for finish_later in (False, True):
        inner = Work("all_reduce", result)
        work = TorchWork(result, [inner])
        if finish_later:
            fut = work.get_future()  # taken while pending: completed by the Work's completion
            threading.Timer(0.05, inner._finish, args=(error,)).start()
        else:
            inner._finish(error)
            fut = work.get_future()
        with pytest.raises(PeerLostError, match="peer rank 1"):
            work.wait()
        with pytest.raises(Exception, match="peer rank 1"):
            fut.wait()  # a failed future, not a success holding an exception (what C++ sees)
        assert fut.done()
    failed_inline = TorchWork(result, error=error)
    with pytest.raises(Exception, match="peer rank 1"):
        failed_inline.get_future().wait()
    ok = Work("all_reduce", result)
    pending = TorchWork(result, [ok])
    fut = pending.get_future()
    ok._finish(None)
    assert fut.wait() is result or torch.equal(fut.wait()[0], result[0])
    assert pending.is_completed() and pending.is_success()


# -- the synchronous all_reduce's Work -------------------------------------------------------------
def _sync_and_async_all_reduce_works(rank, world):
    dist = _init(rank, world)
    pg = dist.group.WORLD
    # torch's Python API (asyncOp False): each call's result is its own, whatever the op
    for step in range(5):
        for name, expect in (("SUM", 3.0 + 2 * step), ("MAX", 2.0 + step), ("AVG", 1.5 + step)):
            x = torch.full((2,), float(rank + 1 + step))
            dist.all_reduce(x, op=getattr(dist.ReduceOp, name))
            assert x.tolist() == [expect, expect], (rank, name, step, x)
    x = torch.full((3,), float(rank + 1))
    dist.all_reduce(x, op=dist._make_nccl_premul_sum(2.0))
    assert x.tolist() == [6.0] * 3, x

    # a synchronous call (asyncOp False) that a latency path completed returns None: torch's API
    # functions then do not wait ("the backend has synchronized at the C++ level")
    sync = dist.AllreduceOptions()
    sync.asyncOp = False
    a, b = torch.ones(2), torch.ones(4)
    assert pg.allreduce([a], sync) is None and pg.allreduce([b], sync) is None
    assert a.tolist() == [2.0] * 2 and b.tolist() == [2.0] * 4
    sync_barrier = dist.BarrierOptions()
    sync_barrier.asyncOp = False
    assert pg.barrier(sync_barrier) is None
    root = dist.BroadcastOptions()
    root.rootRank, root.asyncOp = 1, False
    c = torch.full((3,), float(rank))
    assert pg.broadcast([c], root) is None and c.tolist() == [1.0] * 3
    work_a = pg.allreduce([a], dist.AllreduceOptions())  # torch's default options: async
    assert work_a.wait() and work_a.get_future().wait()[0].data_ptr() == a.data_ptr()

    # an asynchronous one (torch's default options, DDP, async_op=True) gets its own Work, which
    # still answers for its tensor after later calls
    c = torch.full((2,), float(rank))
    held = dist.all_reduce(c, async_op=True)
    later = pg.allreduce([torch.ones(1)], dist.AllreduceOptions())
    assert later is not held
    later.wait()
    dist.all_reduce(torch.ones(2))
    held.wait()
    assert held.get_future().wait()[0].data_ptr() == c.data_ptr() and c.tolist() == [1.0, 1.0]

    # a coalescing block's all_reduces (torch issues them together at its end) are right too
    d, e = torch.ones(2), torch.full((2,), 2.0)
    with dist._coalescing_manager(device=torch.device("cpu")):
        dist.all_reduce(d)
        dist.all_reduce(e)
    assert d.tolist() == [2.0, 2.0] and e.tolist() == [4.0, 4.0]
    _close(dist)
    return True


@pytest.mark.slow
def test_a_synchronous_call_returns_no_work_an_async_one_its_own():
    assert run_world(_sync_and_async_all_reduce_works, 2, timeout=90) == [True, True]


def test_reduce_op_maps_every_torch_op():
    import torch.distributed as dist

    from distcomm.torch_backend import reduce_op
    from distcomm.types import PremulSum, RedOpType

    for name in ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"):
        assert reduce_op(getattr(dist.ReduceOp, name)) is RedOpType[name]
        assert reduce_op(dist.ReduceOp(getattr(dist.ReduceOp, name))) is RedOpType[name]
    premul = reduce_op(dist._make_nccl_premul_sum(0.25))
    assert isinstance(premul, PremulSum) and premul.factor == 0.25
