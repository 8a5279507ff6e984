"""DistributedDataParallel hands each step's averaged bucket out as the parameters' ``.grad``
(instead of copying it back into the tensors backward made) and reuses a bucket's memory only once
nothing holds it. These tests check what a user can see of that: the values, that a gradient kept
from an earlier step is never overwritten, that accumulation without zero_grad and
``zero_grad(set_to_none=False)`` still work (the ``.grad`` tensors then stay the same objects, as
in torch), and that the memory is reused when it is free."""

from __future__ import annotations

import pytest

from harness import run_world

pytest.importorskip("torch")

WORLD = 2


def _model():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def _batch(rank: int, step: int):
    import torch

    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, 6, generator=g)


def _expected(steps: list[int]):
    """The average over the ranks of the gradients summed over ``steps`` (one process, no DDP)."""
    import torch

    model = _model()
    for step in steps:
        for rank in range(WORLD):
            (model(_batch(rank, step)).pow(2).sum() / WORLD).backward()
    return [p.grad.clone() for p in model.parameters()]


def _rank(rank: int, world_size: int):
    import torch

    import distcomm
    from distcomm.parallel import DistributedDataParallel

    distcomm.init_process_group("gloo")
    try:
        ddp = DistributedDataParallel(_model(), bucket_cap_mb=0.0001)  # several buckets
        params = list(ddp.parameters())
        out = {}

        def backward(step):
            ddp(_batch(rank, step)).pow(2).sum().backward()

        # zero_grad(set_to_none=True), gradients of step 0 kept by the user across step 1
        backward(0)
        kept = [p.grad for p in params]
        kept_values = [g.clone() for g in kept]
        out["step0"] = kept_values
        ddp.zero_grad(set_to_none=True)
        backward(1)
        out["kept_untouched"] = all(torch.equal(a, b) for a, b in zip(kept, kept_values))
        out["step1"] = [p.grad.clone() for p in params]
        del kept
        # nothing holds step 1's gradients once zero_grad drops them: their memory is reused
        ptrs = [p.grad.data_ptr() for p in params]
        ddp.zero_grad(set_to_none=True)
        backward(2)
        ddp.zero_grad(set_to_none=True)
        backward(3)
        out["reused"] = sum(p.grad.data_ptr() in ptrs for p in params)
        # zero_grad(set_to_none=False) keeps the tensors, which then hold step 4's average
        ddp.zero_grad(set_to_none=False)
        backward(4)
        out["step4"] = [p.grad.clone() for p in params]
        # accumulation without zero_grad: steps 4 and 5 summed
        backward(5)
        out["step4+5"] = [p.grad.clone() for p in params]
        ddp.zero_grad(set_to_none=False)
        backward(6)
        ddp.zero_grad(set_to_none=False)
        before = [p.grad for p in params]
        backward(7)
        out["same_objects"] = all(p.grad is g for p, g in zip(params, before))  # updated in place, as torch
        out["step7"] = [g.clone() for g in before]
        out["buckets"] = len(ddp.reducer.buckets)
        return out
    finally:
        distcomm.destroy_process_group()


@pytest.mark.slow
def test_handed_out_gradients_are_right_and_never_overwritten():
    import torch

    results = run_world(_rank, WORLD, timeout=120)
    for out in results:
        assert out["buckets"] > 1
        assert out["kept_untouched"], "a gradient kept from step 0 was overwritten by step 1"
        for key, steps in (("step0", [0]), ("step1", [1]), ("step4", [4]), ("step4+5", [4, 5]), ("step7", [7])):
            for got, want in zip(out[key], _expected(steps)):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=key)
        assert out["reused"] == 4, "the memory of dropped gradients was not reused"
        assert out["same_objects"], "zero_grad(set_to_none=False): .grad must stay the same tensors"
