"""torch's coalescing, FSDP1, 2-D DeviceMesh and tensor parallel over the c10d backend "distcomm".

Like test_torch_backend.py, each world runs torch.distributed's own API (not distcomm's), and checks
results against torch's gloo in the same processes or against a single-process reference. One
world serves several checks to keep the worlds few.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from harness import run_world  # noqa: E402
from test_torch_backend import _batch, _close, _compare, _init, _loss, _model, _reference  # noqa: E402


# -- _coalescing_manager, batch_isend_irecv, and async calls on an idle group --------------------
def _coalesced(group, rank, world, async_ops, device=None):
    """all_reduce, all_gather_into_tensor and reduce_scatter_tensor, each in its own coalescing
    block (torch requires one kind of collective per block)."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _coalescing_manager

    out, managers = {}, []
    sums = [torch.arange(3.0) + rank, torch.arange(5.0) * (rank + 1), torch.full((2,), 2.0 ** rank)]
    with _coalescing_manager(group, device, async_ops=async_ops) as cm:
        for x in sums:
            dist.all_reduce(x, group=group)
    managers.append(cm)
    ins = [torch.arange(2.0) + 10 * rank, torch.arange(3.0) - rank]
    gathered = [torch.empty(world * t.numel()) for t in ins]
    with _coalescing_manager(group, device, async_ops=async_ops) as cm:
        for o, i in zip(gathered, ins):
            dist.all_gather_into_tensor(o, i, group=group)
    managers.append(cm)
    big = [torch.arange(2.0 * world) * (rank + 1), torch.arange(4.0 * world) + rank]
    scattered = [torch.empty(t.numel() // world) for t in big]
    with _coalescing_manager(group, device, async_ops=async_ops) as cm:
        for o, i in zip(scattered, big):
            dist.reduce_scatter_tensor(o, i, group=group)
    managers.append(cm)
    if async_ops:
        for cm in managers:
            assert cm.works, "an async coalescing block returned no Work to wait on"
            cm.wait()
    if device is None:  # the older public coalesced calls (deprecated in torch, still there)
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            pair = [torch.arange(4.0) * (rank + 1), torch.full((3,), float(rank))]
            work = dist.all_reduce_coalesced(pair, dist.ReduceOp.MAX, group=group, async_op=async_ops)
            if async_ops:
                work.wait()
            lists = [[torch.empty(2), torch.empty(3)] for _ in range(world)]  # [rank][input]
            dist.all_gather_coalesced(lists, [torch.ones(2) * rank, torch.arange(3.0) + rank], group=group)
        out.update({f"all_reduce_coalesced_{i}": t for i, t in enumerate(pair)})
        out.update({f"all_gather_coalesced_{r}": torch.cat(lst) for r, lst in enumerate(lists)})
    for i, t in enumerate(sums):
        out[f"all_reduce_{i}"] = t
    for i, t in enumerate(gathered):
        out[f"all_gather_into_tensor_{i}"] = t
    for i, t in enumerate(scattered):
        out[f"reduce_scatter_tensor_{i}"] = t
    return out


def _batch_p2p(group, rank, world):
    """A ring exchange both ways in one batch_isend_irecv; several tensors per peer, in order."""
    import torch.distributed as dist

    nxt, prv = (rank + 1) % world, (rank - 1) % world
    got = [torch.empty(3), torch.empty(2), torch.empty(4)]
    ops = [
        dist.P2POp(dist.irecv, got[0], prv, group=group),
        dist.P2POp(dist.isend, torch.arange(3.0) + rank, nxt, group=group),
        dist.P2POp(dist.isend, torch.full((2,), float(rank)), nxt, group=group),
        dist.P2POp(dist.irecv, got[1], prv, group=group),
        dist.P2POp(dist.isend, torch.arange(4.0) * rank, prv, group=group),
        dist.P2POp(dist.irecv, got[2], nxt, group=group),
    ]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return {f"batch_isend_irecv_{i}": t for i, t in enumerate(got)}


def _bracketed_p2p(group, rank, world):
    """isend/irecv inside a device coalescing block: the block's one Work waits for all of them."""
    import time

    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _coalescing_manager

    nxt, prv = (rank + 1) % world, (rank - 1) % world
    got = torch.zeros(3)
    with _coalescing_manager(group, torch.device("cpu"), async_ops=True) as cm:
        dist.irecv(got, prv, group=group)
        if rank == 0:
            time.sleep(0.3)  # rank 1's receive is still pending when its block ends
        dist.isend(torch.full((3,), float(rank + 1)), nxt, group=group)
    assert len(cm.works) == 1
    cm.wait()
    assert got.tolist() == [float(prv + 1)] * 3, f"rank {rank}: the block's Work returned before its irecv finished"


def _coalescing_world(rank, world):
    import torch.distributed as dist

    dist_ = _init(rank, world, backend="gloo")  # gloo's default group is the reference
    group = dist.new_group(backend="distcomm")
    for async_ops in (False, True):
        mine = _coalesced(group, rank, world, async_ops)
        theirs = _coalesced(None, rank, world, async_ops)
        _compare(mine, theirs, f"rank {rank}, async_ops={async_ops}")
        # the NCCL style, with a device: torch brackets the block with _start/_end_coalescing
        # (gloo refuses it: "does not implement startCoalescing"); the same results
        bracketed = _coalesced(group, rank, world, async_ops, device=torch.device("cpu"))
        _compare(bracketed, {k: theirs[k] for k in bracketed}, f"rank {rank}, device=cpu, async_ops={async_ops}")
    _compare(_batch_p2p(group, rank, world), _batch_p2p(None, rank, world), f"rank {rank}")
    _bracketed_p2p(group, rank, world)

    # issued async, an operation goes to the group's thread (it must not wait for the peers before
    # returning: tests/test_torch_backend_async.py); its Work completes with the result in place
    # (all_reduce at a latency path's size and at a large one; all_gather_into_tensor)
    small = torch.ones(2) * (rank + 1)  # 8 bytes
    large = torch.ones(1 << 18) * (rank + 1)  # 1 MiB
    for x in (small, large):
        work = dist.all_reduce(x, async_op=True, group=group)
        assert work.wait() and work.is_completed()
        assert torch.all(x == world * (world + 1) / 2), f"rank {rank}: async all_reduce of {x.nbytes} B"
    out = torch.empty(2 * world)
    work = dist.all_gather_into_tensor(out, torch.ones(2) * rank, async_op=True, group=group)
    assert work.wait() and work.is_completed()
    assert out.tolist() == [float(r) for r in range(world) for _ in range(2)]
    _close(dist_)
    return True


@pytest.mark.slow  # torch with gloo and distcomm groups in each rank
@pytest.mark.parametrize("world", [2, 3])
def test_coalescing_manager_batch_p2p_and_async(world):
    assert run_world(_coalescing_world, world, timeout=120) == [True] * world


# -- FSDP1 (FullyShardedDataParallel) ---------------------------------------------------------------
def _fsdp1_world(rank, world):
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy, StateDictType
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    _init(rank, world)
    expected = _reference(world, 3, 1, False)
    cases = [
        ("NO_SHARD", dict(use_orig_params=False)),
        ("SHARD_GRAD_OP", dict(use_orig_params=True, auto_wrap_policy=ModuleWrapPolicy({torch.nn.Linear}))),
        ("FULL_SHARD", dict(use_orig_params=True)),
        ("FULL_SHARD", dict(use_orig_params=False, auto_wrap_policy=ModuleWrapPolicy({torch.nn.Linear}))),
    ]  # the last (nested FULL_SHARD units) is also the one whose state dicts are checked
    for strategy, kwargs in cases:
        where = f"rank {rank}: FSDP1 {strategy} {sorted(kwargs)}"
        # device_id: FSDP1 asks for an accelerator unless told the module stays on the CPU
        model = FSDP(_model(0), sharding_strategy=getattr(ShardingStrategy, strategy),
                     device_id=torch.device("cpu"), **kwargs)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            opt.zero_grad()
            _loss(model, *_batch(rank, step)).backward()
            opt.step()
        with FSDP.summon_full_params(model):
            got = [p.detach().clone() for p in model.parameters()]
        for i, (a, b) in enumerate(zip(got, expected)):
            assert torch.allclose(a, b, atol=1e-6), f"{where}: parameter {i} differs from the reference"
    # state dicts of the last model: the full one gathered on rank 0, the sharded one saved, spoiled
    # and loaded back
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
        full = model.state_dict()
    if rank == 0:
        for i, (a, b) in enumerate(zip(full.values(), expected)):
            assert torch.allclose(a, b, atol=1e-6), f"rank {rank}: full state dict entry {i}"
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        sharded = model.state_dict()
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        model.load_state_dict(sharded)
    with FSDP.summon_full_params(model):
        got = [p.detach().clone() for p in model.parameters()]
    for i, (a, b) in enumerate(zip(got, expected)):
        assert torch.allclose(a, b, atol=1e-6), f"rank {rank}: parameter {i} not restored from the sharded state dict"
    _tensor_parallel_1d(rank, world)
    _close(dist)
    return True


def _tensor_parallel_1d(rank, world):
    """Colwise then rowwise over a 1-D mesh of the whole world."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = parallelize_module(_MLP(), mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        opt.zero_grad()
        x, y = _mlp_batch(0, step)  # tensor parallel: every rank computes on the same batch
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    expected = _mlp_reference(1, 3)
    for name, p in model.named_parameters():
        assert torch.allclose(p.full_tensor(), expected[name], atol=1e-5), f"rank {rank}: 1-D TP {name}"


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_fsdp1_strategies_state_dicts_and_1d_tensor_parallel(world):
    assert run_world(_fsdp1_world, world, timeout=180) == [True] * world


# -- DeviceMesh 2-D: DTensor, tensor parallel with FSDP2 across, FSDP1 HYBRID_SHARD -----------------
class _MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        # 24 hidden units divide among 2 and 3 ranks: torch's tensor parallel (over gloo too) fails
        # on rows that shard unevenly ("a and b must have same reduction dim")
        self.up, self.down = torch.nn.Linear(8, 24), torch.nn.Linear(24, 8)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def _mlp_reference(dp, steps):
    """One process: each step's gradient is the mean over the ``dp`` data-parallel batches."""
    torch.manual_seed(0)
    model = _MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        opt.zero_grad()
        for r in range(dp):
            x, y = _mlp_batch(r, step)
            (torch.nn.functional.mse_loss(model(x), y) / dp).backward()
        opt.step()
    return {k: v.detach() for k, v in model.state_dict().items()}


def _mlp_batch(dp_rank, step):
    g = torch.Generator().manual_seed(100 * step + dp_rank)
    return torch.randn(5, 8, generator=g), torch.randn(5, 8, generator=g)


def _mesh_2d_world(rank, world):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy, fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    _init(rank, world)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank, tp_rank = mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank()
    assert (dp_rank, tp_rank) == divmod(rank, 2)
    assert dist.get_backend(mesh["tp"].get_group()) == "distcomm"

    # DTensor on both mesh dimensions
    torch.manual_seed(0)
    a, b = torch.randn(8, 6), torch.randn(6, 4)
    both = distribute_tensor(a, mesh, [Shard(0), Shard(1)])
    assert both.to_local().shape == (4, 3)
    assert torch.equal(both.full_tensor(), a)
    moved = both.redistribute(mesh, [Replicate(), Shard(0)])
    assert torch.equal(moved.to_local(), a.chunk(2, dim=0)[tp_rank])
    product = distribute_tensor(a, mesh, [Shard(0), Shard(1)]) @ distribute_tensor(b, mesh, [Replicate(), Shard(0)])
    assert torch.allclose(product.full_tensor(), a @ b, atol=1e-5)

    # tensor parallel inside each "tp" pair, FSDP2 across the "dp" pairs; 3 SGD steps
    torch.manual_seed(0)
    model = parallelize_module(_MLP(), mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    assert model.up.weight.to_local().shape == (12, 8)  # half the output rows
    fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        opt.zero_grad()
        x, y = _mlp_batch(dp_rank, step)  # the two ranks of a tp pair see the same batch
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    expected = _mlp_reference(2, 3)
    for name, p in model.named_parameters():
        assert torch.allclose(p.full_tensor(), expected[name], atol=1e-5), f"rank {rank}: TP+FSDP2 {name}"

    # FSDP1 HYBRID_SHARD: shards within "tp" (the inner dimension), replicas across "dp"
    torch.manual_seed(0)
    hybrid = FSDP(_MLP(), sharding_strategy=ShardingStrategy.HYBRID_SHARD, device_mesh=mesh,
                  device_id=torch.device("cpu"), use_orig_params=True)
    opt = torch.optim.SGD(hybrid.parameters(), lr=0.1)
    for step in range(3):
        opt.zero_grad()
        torch.nn.functional.mse_loss(hybrid(*_mlp_batch(rank, step)[:1]), _mlp_batch(rank, step)[1]).backward()
        opt.step()
    expected = _mlp_reference(world, 3)
    with FSDP.summon_full_params(hybrid):
        for name, p in hybrid.named_parameters():
            name = name.replace("_fsdp_wrapped_module.", "")
            assert torch.allclose(p, expected[name], atol=1e-5), f"rank {rank}: FSDP1 HYBRID_SHARD {name}"
    _close(dist)
    return True


@pytest.mark.slow
def test_device_mesh_2d_dtensor_tensor_parallel_and_hybrid_shard():
    assert run_world(_mesh_2d_world, 4, timeout=240) == [True] * 4
