"""torch's shipped DDP comm hooks (PowerSGD, quantization, post-local SGD) under distcomm's DDP.

One world of 2 ranks runs every scenario with distcomm's DDP + distcomm's hook and with torch's
DDP (gloo) + torch's hook on the same data, from the same (per-rank different) initial models.
Checked: (a) every rank ends with the same parameters (when the algorithm keeps them equal),
(b) the parameters match torch's. Hard deadline: run_world's timeout.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow  # worlds of 2 that import torch and train under both DDPs

pytest.importorskip("torch")

from test_ddp import _data, _model, _train  # noqa: E402  the same model, data and SGD as test_ddp

STEPS = 6


def _scenarios():
    """name -> (make our hook and state, make torch's hook and state, kwargs for DDP)."""
    import torch.distributed as tdist
    from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as t_local
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as t_psgd
    from torch.distributed.algorithms.ddp_comm_hooks import quantization_hooks as t_quant

    import distcomm as dc
    from distcomm.algorithms.ddp_comm_hooks import post_localSGD_hook as o_local
    from distcomm.algorithms.ddp_comm_hooks import powerSGD_hook as o_psgd
    from distcomm.algorithms.ddp_comm_hooks import quantization_hooks as o_quant

    def psgd(mod, **kw):
        # torch's defaults (error feedback, warm start, seed 0) but compression from iteration 2
        return lambda: (mod.powerSGD_hook, mod.PowerSGDState(None, start_powerSGD_iter=2, **kw))

    small = {"bucket_cap_mb": 0.0002}
    return {
        "powerSGD": (psgd(o_psgd), psgd(t_psgd), {}),
        # torch's PowerSGD deadlocks under gloo with several buckets (its callbacks wait on gloo's
        # own threads), so several buckets are checked on distcomm's side only
        "powerSGD_small_buckets": (psgd(o_psgd), None, small),
        "powerSGD_rank2_batch": (psgd(o_psgd, matrix_approximation_rank=2, batch_tensors_with_same_shape=True),
                                 psgd(t_psgd, matrix_approximation_rank=2, batch_tensors_with_same_shape=True), {}),
        "powerSGD_rank3_no_ef": (psgd(o_psgd, matrix_approximation_rank=3, use_error_feedback=False,
                                      warm_start=False),
                                 psgd(t_psgd, matrix_approximation_rank=3, use_error_feedback=False,
                                      warm_start=False), {}),
        # torch 2.13's quantization hooks fail under gloo (they index all_gather's future value,
        # which gloo returns differently: "invalid index of a 0-dim tensor"): distcomm's side only
        "quant_pertensor": (lambda: (o_quant.quantization_pertensor_hook, None), None, small),
        "quant_perchannel": (lambda: (o_quant.quantization_perchannel_hook, None), None, {}),
        "post_localSGD_world": (lambda: (o_local.post_localSGD_hook, o_local.PostLocalSGDState(None, dc.new_group([0, 1]), 2)),
                                lambda: (t_local.post_localSGD_hook, t_local.PostLocalSGDState(None, tdist.new_group([0, 1]), 2)),
                                small),
        "post_localSGD_local": (lambda: (o_local.post_localSGD_hook, o_local.PostLocalSGDState(None, None, 3, False)),
                                lambda: (t_local.post_localSGD_hook, t_local.PostLocalSGDState(None, None, 3, False)),
                                {}),
    }


def _hooks_world(rank, ws, torch_port):
    import torch
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from distcomm.parallel import DistributedDataParallel as DDP
    from training_helpers import init_both, max_diff, shutdown_both, snapshot

    init_both(rank, ws, torch_port)
    X, Y = _data(ws, steps=STEPS)
    results = {}
    for name, (ours_fn, theirs_fn, kwargs) in _scenarios().items():
        ours = DDP(_model(rank), **kwargs)
        ours.register_comm_hook(*reversed(ours_fn()))
        _train(ours, X, Y, rank, ws, True)
        params = snapshot(ours.module)
        vs_torch = None
        if theirs_fn is not None:
            theirs = TorchDDP(_model(rank), **kwargs)
            theirs.register_comm_hook(*reversed(theirs_fn()))
            _train(theirs, X, Y, rank, ws, True)
            vs_torch = max_diff(params, snapshot(theirs.module))
        plain = _train(DDP(_model(rank), **kwargs), X, Y, rank, ws, True)
        results[name] = {
            "vs_torch": vs_torch,
            "vs_no_hook": max_diff(params, snapshot(plain.module)),
            "params": {k: v.numpy() for k, v in params.items()},
            "finite": all(bool(torch.isfinite(v).all()) for v in params.values()),
        }
    shutdown_both()
    return results


@pytest.fixture(scope="module")
def results():
    from harness import free_port, run_world

    return run_world(_hooks_world, 2, args=(free_port(),), timeout=240)


# deterministic algorithms: the only differences are float32 rounding (bmm/QR vs torch's order)
TOL = {"powerSGD": 1e-5, "powerSGD_rank2_batch": 1e-5, "powerSGD_rank3_no_ef": 1e-4,
       "post_localSGD_world": 2e-6, "post_localSGD_local": 2e-6}
SAME_ON_EVERY_RANK = (set(TOL) - {"post_localSGD_local"}) | {"powerSGD_small_buckets", "quant_pertensor",
                                                             "quant_perchannel"}  # local SGD lets the models drift apart


@pytest.mark.parametrize("scenario", sorted(TOL))
def test_hook_matches_torchs_hook(results, scenario):
    for rank, r in enumerate(results):
        entry = r[scenario]
        assert entry["finite"], (rank, scenario)
        assert entry["vs_torch"] < TOL[scenario], (rank, scenario, entry["vs_torch"])


@pytest.mark.parametrize("scenario", sorted(SAME_ON_EVERY_RANK))
def test_every_rank_keeps_the_same_parameters(results, scenario):
    import numpy as np

    first, second = results[0][scenario]["params"], results[1][scenario]["params"]
    for name in first:
        np.testing.assert_array_equal(first[name], second[name], err_msg=f"{scenario}: {name}")


@pytest.mark.parametrize("scenario", ["powerSGD", "powerSGD_small_buckets", "quant_pertensor",
                                      "quant_perchannel", "post_localSGD_local"])
def test_hook_really_changes_the_reduction(results, scenario):
    # compression (or local steps) must show in the result: the hook ran, not plain averaging
    assert results[0][scenario]["vs_no_hook"] > 1e-6


@pytest.mark.parametrize("scenario", ["quant_pertensor", "quant_perchannel"])
def test_quantization_stays_close_to_plain_averaging(results, scenario):
    # 8-bit gradients: the trained model stays near the unquantized one
    assert results[0][scenario]["vs_no_hook"] < 1e-2, results[0][scenario]["vs_no_hook"]


def test_local_sgd_models_drift_apart(results):
    first, second = results[0]["post_localSGD_local"]["params"], results[1]["post_localSGD_local"]["params"]
    assert any(abs(first[k] - second[k]).max() > 1e-6 for k in first)
