"""distcomm.nn: forward values and input gradients of every autograd collective, against
torch.distributed.nn on gloo (same inputs, same upstream gradients), and against the exact
gradients for the reductions torch does not differentiate correctly (MAX, MIN, PRODUCT) or gloo
does not run (AVG).

Runs in the shared training world (training_helpers.shared_world).
"""

from __future__ import annotations

import warnings

import pytest

pytest.importorskip("torch")


def _x(rank, shape=(2, 3), offset=0.0):
    import torch

    g = torch.Generator().manual_seed(100 + rank)
    return (torch.rand(shape, generator=g) + 0.5 + offset).requires_grad_()


def _weights_like(outs, rank):
    import torch

    g = torch.Generator().manual_seed(200 + rank)
    return [torch.randn(o.shape, generator=g) for o in outs]


def _apply(fn, make_inputs, rank):
    """Run ``fn`` on fresh inputs; backprop sum(out * w) with rank-specific w; return (outs, grads)."""
    inputs = make_inputs()
    outs = fn(*inputs)
    outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
    loss = sum((o * w).sum() for o, w in zip(outs, _weights_like(outs, rank)))
    loss.backward()
    leaves = [t for t in _flatten(inputs) if getattr(t, "requires_grad", False)]
    return [o.detach() for o in outs], [t.grad for t in leaves]


def _flatten(items):
    for item in items:
        if isinstance(item, (list, tuple)):
            yield from _flatten(item)
        else:
            yield item


def _cases(rank, ws):
    """name -> (ours, theirs, make_inputs); ours/theirs take the same inputs."""
    import torch
    import torch.distributed.nn.functional as T

    import distcomm.nn as D

    splits_in = [(rank + i) % 2 + 1 for i in range(ws)]  # uneven all_to_all_single splits
    splits_out = [(r + rank) % 2 + 1 for r in range(ws)]

    def a2a_single(mod):
        return lambda x: mod.all_to_all_single(torch.empty(sum(splits_out), 3), x, splits_out, splits_in)

    return {
        "broadcast": (lambda x: D.broadcast(x, src=ws - 1), lambda x: T.broadcast(x, src=ws - 1), lambda: [_x(rank)]),
        "gather": (lambda x: D.gather(x, dst=1), lambda x: T.gather(x, dst=1), lambda: [_x(rank)]),
        "scatter": (lambda *xs: D.scatter(list(xs), src=0), lambda *xs: T.scatter(list(xs), src=0),
                    lambda: [_x(rank * 10 + i) for i in range(ws)]),
        "reduce": (lambda x: D.reduce(x, dst=0), lambda x: T.reduce(x, dst=0), lambda: [_x(rank)]),
        "reduce_scatter": (lambda *xs: D.reduce_scatter(torch.empty(2, 3), list(xs)),
                           lambda *xs: T.reduce_scatter(torch.empty(2, 3), list(xs)),
                           lambda: [_x(rank * 10 + i) for i in range(ws)]),
        "all_gather": (D.all_gather, T.all_gather, lambda: [_x(rank)]),
        # equal sizes: torch's gloo all_to_all is made of scatters (uneven sizes: all_to_all_single)
        "all_to_all": (lambda *xs: D.all_to_all([torch.empty(2, 3) for _ in range(ws)], list(xs)),
                       lambda *xs: T.all_to_all([torch.empty(2, 3) for _ in range(ws)], list(xs)),
                       lambda: [_x(rank * 10 + i) for i in range(ws)]),
        "all_to_all_single": (a2a_single(D), a2a_single(T), lambda: [_x(rank, (sum(splits_in), 3))]),
        "all_reduce_sum": (D.all_reduce, T.all_reduce, lambda: [_x(rank)]),
    }


def _exact_reductions(rank, ws):
    """all_reduce AVG/MAX/MIN/PRODUCT: (output, grad) against formulas over every rank's inputs."""
    import torch

    import distcomm
    import distcomm.nn as D
    from training_helpers import max_diff

    everyone = [_x(r).detach() for r in range(ws)]
    w_sum = sum(_weights_like([everyone[0]], r)[0] for r in range(ws))
    stacked = torch.stack(everyone)
    expected = {
        "AVG": (stacked.mean(0), w_sum / ws),
        "MAX": (stacked.max(0).values, w_sum * (everyone[rank] == stacked.max(0).values)),
        "MIN": (stacked.min(0).values, w_sum * (everyone[rank] == stacked.min(0).values)),
        "PRODUCT": (stacked.prod(0), w_sum * stacked.prod(0) / everyone[rank]),
    }
    diffs = {}
    for name, (out, grad) in expected.items():
        op = getattr(distcomm.ReduceOp, name)
        outs, grads = _apply(lambda x: D.all_reduce(x, op=op), lambda: [_x(rank)], rank)
        diffs[name] = max(max_diff(outs, [out]), max_diff(grads, [grad]))
    return diffs


def world_checks(rank, ws, dc, tdist):
    from training_helpers import max_diff

    results = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch deprecates some of its autograd collectives
        for name, (ours, theirs, make) in _cases(rank, ws).items():
            o_out, o_grad = _apply(ours, make, rank)
            t_out, t_grad = _apply(theirs, make, rank)
            # reduce's output is only defined on dst (gloo leaves partial sums elsewhere)
            out_diff = 0.0 if name == "reduce" and rank != 0 else max_diff(o_out, t_out)
            results[name] = {"out": out_diff, "grad": max_diff(o_grad, t_grad)}
    results["exact"] = _exact_reductions(rank, ws)
    return results


# the world of 3 only in the full suite (see training_helpers)
@pytest.fixture(scope="module", params=[2, pytest.param(3, marks=pytest.mark.slow)], ids=["world2", "world3"])
def world(request):
    from training_helpers import shared_world

    return request.param, shared_world(request.param, "test_nn_functional")


@pytest.mark.parametrize("name", ["broadcast", "gather", "scatter", "reduce", "reduce_scatter", "all_gather",
                                  "all_to_all", "all_to_all_single", "all_reduce_sum"])
def test_matches_torch_distributed_nn(world, name):
    ws, results = world
    for r in results:
        assert r[name]["out"] < 1e-6 and r[name]["grad"] < 1e-6, (name, r[name])


@pytest.mark.parametrize("op", ["AVG", "MAX", "MIN", "PRODUCT"])
def test_all_reduce_gradients_are_exact(world, op):
    ws, results = world
    for r in results:
        assert r["exact"][op] < 1e-5, r["exact"]
