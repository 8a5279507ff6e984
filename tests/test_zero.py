"""ZeroRedundancyOptimizer: the same training as an unsharded optimizer and as torch's ZeRO,
with the state really sharded, and state dicts that round-trip through the unsharded format.

Runs in the shared training world (training_helpers.shared_world).
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

STEPS = 4


def _model():
    import torch

    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3), torch.nn.Linear(3, 2))


def _batches(ws):
    import torch

    g = torch.Generator().manual_seed(5)
    return torch.randn(STEPS, 2 * ws, 5, generator=g)


def _run(model, opt, X, lo, hi, steps=range(STEPS)):
    for s in steps:
        opt.zero_grad()
        model(X[s, lo:hi]).pow(2).mean().backward()
        opt.step()


def _state_diff(a: dict, b: dict) -> float:
    import torch

    assert a["param_groups"] == b["param_groups"], (a["param_groups"], b["param_groups"])
    assert a["state"].keys() == b["state"].keys()
    worst = 0.0
    for k in a["state"]:
        for name, v in a["state"][k].items():
            w = b["state"][k][name]
            worst = max(worst, float((torch.as_tensor(v).double() - torch.as_tensor(w).double()).abs().max()))
    return worst


def world_checks(rank, ws, dc, tdist):
    import copy

    import torch
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZeRO
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from distcomm.optim import ZeroRedundancyOptimizer as ZeRO
    from distcomm.parallel import DistributedDataParallel as DDP
    from training_helpers import max_diff

    X = _batches(ws)
    lo, hi = 2 * rank, 2 * rank + 2
    results = {}

    single = _model()
    plain = torch.optim.Adam(single.parameters(), lr=0.02)
    _run(single, plain, X, 0, 2 * ws)
    plain_state = copy.deepcopy(plain.state_dict())  # state_dict() aliases the live state tensors

    for bucket_view in (False, True):
        model = DDP(_model())
        zero = ZeRO(model.parameters(), torch.optim.Adam, lr=0.02, parameters_as_bucket_view=bucket_view)
        _run(model, zero, X, lo, hi)
        entry = {
            "vs_single": max_diff(list(model.module.parameters()), list(single.parameters())),
            "local_state": len(zero.optim.state),
            "local_ids": sorted(i for i, p in enumerate(model.parameters()) if p in zero.optim.state),
        }
        tmodel = TorchDDP(_model())
        tzero = TorchZeRO(tmodel.parameters(), torch.optim.Adam, lr=0.02, parameters_as_bucket_view=bucket_view)
        _run(tmodel, tzero, X, lo, hi)
        entry["vs_torch"] = max_diff(list(model.module.parameters()), list(tmodel.module.parameters()))
        results[f"adam_bucket_view_{bucket_view}"] = entry

        if not bucket_view:
            for to in (0, ws - 1):
                zero.consolidate_state_dict(to=to)
                try:
                    results[f"consolidated_{to}"] = _state_diff(zero.state_dict(), plain_state)
                except RuntimeError as exc:
                    results[f"consolidated_{to}"] = str(exc)
            unsharded_model = model

    # load the unsharded optimizer's state into a fresh ZeRO and keep training in lockstep
    fresh = ZeRO(unsharded_model.parameters(), torch.optim.Adam, lr=0.5)
    fresh.load_state_dict(plain_state)
    _run(unsharded_model, fresh, X, lo, hi, steps=[0])
    _run(single, plain, X, 0, 2 * ws, steps=[0])
    results["after_load"] = max_diff(list(unsharded_model.module.parameters()), list(single.parameters()))
    results["loaded_lr"] = fresh.param_groups[0]["lr"]

    # add_param_group in the middle of training, as torch's ZeRO does it
    def grow(ddp_cls, zero_cls):
        torch.manual_seed(9)
        body, extra = torch.nn.Linear(5, 3), torch.nn.Linear(3, 1)
        model = ddp_cls(torch.nn.Sequential(body, extra))
        opt = zero_cls(body.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9)
        _run(model, opt, X, lo, hi, steps=[0, 1])
        opt.add_param_group({"params": list(extra.parameters()), "lr": 0.05})
        _run(model, opt, X, lo, hi, steps=[2, 3])
        return list(model.module.parameters())

    results["add_param_group_vs_torch"] = max_diff(grow(DDP, ZeRO), grow(TorchDDP, TorchZeRO))
    return results


# the world of 3 only in the full suite (see training_helpers)
@pytest.fixture(scope="module", params=[2, pytest.param(3, marks=pytest.mark.slow)], ids=["world2", "world3"])
def world(request):
    from training_helpers import shared_world

    return request.param, shared_world(request.param, "test_zero")


@pytest.mark.parametrize("bucket_view", [False, True])
def test_zero_adam_equals_unsharded_adam_and_torch(world, bucket_view):
    ws, results = world
    for r in results:
        entry = r[f"adam_bucket_view_{bucket_view}"]
        assert entry["vs_single"] < 2e-6, entry
        assert entry["vs_torch"] < 1e-6, entry


def test_state_is_sharded(world):
    ws, results = world
    owned = [r["adam_bucket_view_False"]["local_ids"] for r in results]
    assert sorted(i for ids in owned for i in ids) == list(range(6))  # each of the 6 parameters has one owner
    assert all(ids for ids in owned)  # every rank owns something


def test_consolidated_state_dict_equals_unsharded_optimizer(world):
    ws, results = world
    for rank, r in enumerate(results):
        for to in (0, ws - 1):
            value = r[f"consolidated_{to}"]
            if rank == to:
                assert isinstance(value, float) and value < 2e-6, value
            else:
                assert "has not been consolidated on this rank" in value


def test_load_state_dict_continues_like_unsharded(world):
    ws, results = world
    for r in results:
        assert r["after_load"] < 2e-6
        assert r["loaded_lr"] == 0.02


def test_add_param_group_matches_torch(world):
    ws, results = world
    for r in results:
        assert r["add_param_group_vs_torch"] < 1e-6
