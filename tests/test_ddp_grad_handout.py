"""DistributedDataParallel hands each step's averaged bucket out as the parameters' ``.grad``
(instead of copying it back into the tensors backward made) and reuses a bucket's memory only once
nothing holds it. These tests check what a user can see of that: the values, that a gradient kept
from an earlier step is never overwritten, that accumulation without zero_grad and
``zero_grad(set_to_none=False)`` still work (the ``.grad`` tensors then stay the same objects, as
in torch), and that the memory is reused when it is free. Buckets of 4 MiB and more are not handed
out: their gradients are reduced where they are (all_reduce_coalesced); the same checks hold."""

from __future__ import annotations

import pytest

from harness import run_world

pytest.importorskip("torch")

WORLD = 2


# width 6: small buckets, handed out; width 1024: two buckets of 4 and 8 MiB, reduced in place
def _model(width: int = 6):
    import torch

    torch.manual_seed(0)
    if width == 6:
        return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    return torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh(), torch.nn.Linear(width, width),
                               torch.nn.Tanh(), torch.nn.Linear(width, width), torch.nn.Tanh(), torch.nn.Linear(width, 3))


def _batch(rank: int, step: int, width: int = 6):
    import torch

    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, width, generator=g)


def _expected(steps: list[int], width: int = 6):
    """The average over the ranks of the gradients summed over ``steps`` (one process, no DDP)."""
    import torch

    model = _model(width)
    for step in steps:
        for rank in range(WORLD):
            (model(_batch(rank, step, width)).pow(2).sum() / WORLD).backward()
    return [p.grad.clone() for p in model.parameters()]


def _expected_alone(rank: int, step: int, width: int):
    """Rank ``rank``'s gradient divided by the world size: what it averages to while the others have joined."""
    model = _model(width)
    (model(_batch(rank, step, width)).pow(2).sum() / WORLD).backward()
    return [p.grad.clone() for p in model.parameters()]


def _rank(rank: int, world_size: int, width: int = 6):
    import torch

    import distcomm
    from distcomm.backends.shm import observe
    from distcomm.parallel import DistributedDataParallel

    distcomm.init_process_group("gloo")
    ran: list[str] = []
    observe.set_observer(ran.append)
    try:
        # width 6: several buckets by a tiny cap; width 1024: DDP's default caps
        ddp = DistributedDataParallel(_model(width), **({"bucket_cap_mb": 0.0001} if width == 6 else {}))
        params = list(ddp.parameters())
        out = {}

        def backward(step):
            ddp(_batch(rank, step, width)).pow(2).sum().backward()

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
        out["in_place"] = ran.count("allreduce_pieces_readv")
        # Join: rank 1 runs out of inputs after step 8; its answers to step 9 must match rank 0's buckets
        with ddp.join():
            for step in range(8, 10 - rank):
                ddp.zero_grad(set_to_none=True)
                backward(step)
        out["joined_step9"] = [p.grad.clone() for p in params] if rank == 0 else None
        out["direct_reads"] = distcomm.group.WORLD.engine.transport.direct_reads_ok(range(world_size))
        return out
    finally:
        distcomm.destroy_process_group()


@pytest.mark.slow
def test_handed_out_gradients_are_right_and_never_overwritten():
    import torch

    results = run_world(_rank, WORLD, timeout=120)
    for out in results:
        assert out["buckets"] > 1
        assert out["in_place"] == 0
        assert out["kept_untouched"], "a gradient kept from step 0 was overwritten by step 1"
        for key, steps in (("step0", [0]), ("step1", [1]), ("step4", [4]), ("step4+5", [4, 5]), ("step7", [7])):
            for got, want in zip(out[key], _expected(steps)):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=key)
        assert out["reused"] == 4, "the memory of dropped gradients was not reused"
        assert out["same_objects"], "zero_grad(set_to_none=False): .grad must stay the same tensors"
    for got, want in zip(results[0]["joined_step9"], _expected_alone(0, 9, 6)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg="joined")


@pytest.mark.slow
@pytest.mark.parametrize("overlap", ["1", "0"], ids=["during-backward", "in-finalize"])
def test_large_buckets_reduced_in_place_are_right(overlap):
    import torch

    results = run_world(_rank, WORLD, args=(1024,), env={"DISTCOMM_DDP_OVERLAP": overlap}, timeout=180)
    for got, want in zip(results[0]["joined_step9"], _expected_alone(0, 9, 1024)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg="joined")
    wrong = []  # every (rank, step, parameter, largest difference) that differs: the whole picture
    for rank, out in enumerate(results):
        assert out["buckets"] == 2
        # both buckets of the 8 backwards, where the engine may read the peer's memory
        assert out["in_place"] == (16 if out["direct_reads"] else 0)
        assert out["kept_untouched"], "a gradient kept from step 0 was overwritten by step 1"
        for key, steps in (("step0", [0]), ("step1", [1]), ("step4", [4]), ("step4+5", [4, 5]), ("step7", [7])):
            for i, (got, want) in enumerate(zip(out[key], _expected(steps, 1024))):
                if not torch.allclose(got, want, rtol=1e-5, atol=1e-6):
                    wrong.append((rank, key, i, tuple(got.shape), float((got - want).abs().max())))
        assert out["same_objects"], "zero_grad(set_to_none=False): .grad must stay the same tensors"
    assert not wrong, wrong


def test_overlap_setting(monkeypatch):
    import os

    from distcomm.parallel.reducer import overlap_setting

    for value, want in (("1", True), ("0", False)):
        monkeypatch.setenv("DISTCOMM_DDP_OVERLAP", value)
        assert overlap_setting(1000) is want
    monkeypatch.setenv("DISTCOMM_DDP_OVERLAP", "auto")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "100000")  # more ranks on this host than it has cores
    assert overlap_setting(2) is False
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert overlap_setting(2) is (len(os.sched_getaffinity(0)) >= 2)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert overlap_setting(2) is (len(os.sched_getaffinity(0)) >= 4)
    monkeypatch.setenv("DISTCOMM_DDP_OVERLAP", "yes")
    with pytest.raises(ValueError, match="DISTCOMM_DDP_OVERLAP"):
        overlap_setting(2)
