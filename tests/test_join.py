"""Join: uneven inputs with DDP and ZeroRedundancyOptimizer, against torch's Join on gloo.

The scenarios run in the shared training world (training_helpers.shared_world): rank r has
10 + r inputs, so ranks join one after another; every rank must get through and end with the
parameters torch's implementation gives.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")


def _seed_example(rank, ddp_cls, zero_cls, join_cls):
    """The seed page's example, on CPU: DDP + ZeRO(Adam) inside Join; rank r has 10 + r inputs."""
    import torch

    torch.manual_seed(0)
    model = ddp_cls(torch.nn.Linear(1, 1))
    optim = zero_cls(model.parameters(), torch.optim.Adam, lr=0.01)
    inputs = [torch.tensor([1.0 + 0.1 * i]) for i in range(10 + rank)]
    with join_cls([model, optim]):
        for inp in inputs:
            loss = model(inp).sum()
            loss.backward()
            optim.step()
    return [p.detach().clone() for p in model.parameters()]


def _ddp_join(rank, ddp_cls, divide_by_initial_world_size):
    """DDP's own join() with SGD, a model with a buffer, zero_grad each step; 3 + 2*rank inputs."""
    import torch

    torch.manual_seed(1)
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1))
    model = ddp_cls(net, bucket_cap_mb=0.00005)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    with model.join(divide_by_initial_world_size=divide_by_initial_world_size):
        for _ in range(3 + 2 * rank):
            opt.zero_grad()
            model(torch.randn(4, 3, generator=g)).pow(2).mean().backward()
            opt.step()
    return {k: v.detach().clone() for k, v in model.module.state_dict().items()}


def _throw(rank, ddp_cls, join_cls):
    import torch

    model = ddp_cls(torch.nn.Linear(2, 1))
    steps = 0
    try:
        with join_cls([model], throw_on_early_termination=True):
            for _ in range(4 + rank):
                model(torch.ones(1, 2)).sum().backward()
                steps += 1
    except RuntimeError as exc:
        return steps, str(exc)
    return steps, "no error"


def _custom_joinable(rank, ws, dc):
    """A Joinable of our own: one all_reduce of 1 per input; a joined rank's main_hook answers 0."""
    import numpy as np

    from distcomm.algorithms.join import Join, Joinable, JoinHook

    class Counter(Joinable):
        def __init__(self):
            super().__init__()
            self.total = 0.0
            self.last_joiner = None

        def step(self):
            Join.notify_join_context(self)
            x = np.ones(1)
            dc.all_reduce(x)
            self.total += x[0]

        def join_hook(self, **kwargs):
            counter = self

            class Hook(JoinHook):
                def main_hook(self):
                    dc.all_reduce(np.zeros(1))

                def post_hook(self, is_last_joiner):
                    counter.last_joiner = is_last_joiner

            return Hook()

        @property
        def join_device(self):
            return "cpu"

        @property
        def join_process_group(self):
            return dc.group.WORLD

    counter = Counter()
    with Join([counter]):
        for _ in range(2 + rank):
            counter.step()
    errors = []
    for bad in ([], [counter, _OtherGroup()]):
        try:
            Join(bad)
            errors.append("no error")
        except ValueError as exc:
            errors.append(str(exc))
    return {"total": counter.total, "last_joiner": counter.last_joiner, "errors": errors}


class _OtherGroup:
    """Looks like a Joinable on another process group."""

    _join_config = None
    join_process_group = object()
    join_device = "cpu"

    def join_hook(self, **kwargs):
        from distcomm.algorithms.join import JoinHook

        return JoinHook()


def world_checks(rank, ws, dc, tdist):
    from torch.distributed.algorithms.join import Join as TorchJoin
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZeRO
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from distcomm.algorithms.join import Join
    from distcomm.optim import ZeroRedundancyOptimizer
    from distcomm.parallel import DistributedDataParallel as DDP
    from training_helpers import max_diff

    results = {}
    ours = _seed_example(rank, DDP, ZeroRedundancyOptimizer, Join)
    theirs = _seed_example(rank, TorchDDP, TorchZeRO, TorchJoin)
    results["seed_example"] = {"vs_torch": max_diff(ours, theirs), "params": [p.tolist() for p in ours]}
    for divide in (True, False):
        ours = _ddp_join(rank, DDP, divide)
        theirs = _ddp_join(rank, TorchDDP, divide)
        results[f"ddp_join_divide_{divide}"] = {"vs_torch": max_diff(ours, theirs)}
    results["throw"] = _throw(rank, DDP, Join)
    results["custom"] = _custom_joinable(rank, ws, dc)
    return results


# the world of 3 only in the full suite (see training_helpers)
@pytest.fixture(scope="module", params=[2, pytest.param(3, marks=pytest.mark.slow)], ids=["world2", "world3"])
def world(request):
    from training_helpers import shared_world

    return request.param, shared_world(request.param, "test_join")


def test_seed_example_ends_everywhere_with_torchs_parameters(world):
    ws, results = world
    for r in results:
        assert r["seed_example"]["vs_torch"] < 1e-6, r["seed_example"]
        assert r["seed_example"]["params"] == results[0]["seed_example"]["params"]


@pytest.mark.parametrize("divide", [True, False])
def test_ddp_join_matches_torch(world, divide):
    ws, results = world
    for r in results:
        assert r[f"ddp_join_divide_{divide}"]["vs_torch"] < 1e-6


def test_throw_on_early_termination_raises_on_every_rank(world):
    ws, results = world
    steps0, text0 = results[0]["throw"]
    assert steps0 == 4 and text0 == "Rank 0 exhausted all inputs."
    for steps, text in [r["throw"] for r in results[1:]]:
        assert steps == 4
        assert text == "Detected at least one rank that exhausted inputs. Throwing across all ranks."


def test_custom_joinable(world):
    ws, results = world
    for rank, r in enumerate(results):
        c = r["custom"]
        # while k ranks still train, each of their all_reduces sums to k
        expected = sum(sum(1 for other in range(ws) if 2 + other > step) for step in range(2 + rank))
        assert c["total"] == expected
        assert c["last_joiner"] == (rank == ws - 1)
        assert c["errors"][0] == "The join context manager requires at least one joinable"
        assert c["errors"][1] == "Using join context manager with multiple process groups"
