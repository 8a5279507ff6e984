"""Outputs whose elements share memory (``expand()``: stride 0), against torch.distributed 2.13 (gloo).

gloo refuses to write a collective's result into such a tensor ("more than one element of the
written-to tensor refers to a single memory location", torch's ``at::has_internal_overlap``) in
all_gather, all_gather_into_tensor, reduce_scatter, reduce_scatter_tensor, all_to_all and the
coalesced collectives. distcomm wrote each element's value into the one location, so the output
held only the last. A world of 2 runs each call through torch (gloo) and distcomm (its default
engine and "tcp"): both must refuse with a RuntimeError saying so, and the ranks must stay in step
(an all_reduce follows every call). distcomm-only, where gloo aborts (all_to_all_single), writes
past the tensor's memory (scatter) or refuses for another reason (recv): the same refusal, on
numpy arrays too; and all_reduce, reduce and broadcast, whose results are per element, still take
an expanded tensor.
"""

from __future__ import annotations

import functools
import warnings
from datetime import timedelta

import numpy as np
import pytest

from harness import free_port, initialized, run_world

ENGINES = ["gloo", "tcp"]
PHRASE = "more than one element of the written-to tensor refers to a single memory location"


def _cases(dist, rank: int, ws: int) -> dict:
    import torch

    def expanded(n=4):
        return torch.zeros(1).expand(n)

    def plain(n=4):
        return torch.arange(float(n)) + 10 * rank

    return {
        "all_gather": lambda: dist.all_gather([expanded() for _ in range(ws)], plain()),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(expanded(4 * ws), plain()),
        "reduce_scatter": lambda: dist.reduce_scatter(expanded(), [plain() for _ in range(ws)]),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(expanded(), plain(4 * ws)),
        "all_to_all": lambda: dist.all_to_all([expanded() for _ in range(ws)], [plain() for _ in range(ws)]),
        "all_gather_coalesced": lambda: dist.all_gather_coalesced([[expanded()] for _ in range(ws)], [plain()]),
        "all_reduce_coalesced": lambda: dist.all_reduce_coalesced([expanded()]),
    }


def _outcome(fn) -> tuple:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - what we are here to see
        return ("raised", isinstance(exc, RuntimeError), type(exc).__name__, str(exc))
    return ("returned",)


def _run(rank: int, ws: int, plans: list) -> dict:
    import torch

    warnings.simplefilter("ignore")
    results = {}
    import distcomm.torch_backend  # noqa: F401 - registers torch's backend "distcomm"

    for framework, engine, port in plans:
        with initialized(framework, engine, port) as lib:
            res = {}
            for name, fn in _cases(lib, rank, ws).items():
                res[name] = _outcome(fn)
                t = torch.ones(1)
                lib.all_reduce(t)  # the ranks are still in step
                res[name + "#check"] = t.item()
        results[f"{framework}:{engine}"] = res
    return results


@functools.lru_cache(maxsize=None)
def _world():
    plans = [("torch", "gloo", free_port()), ("torch", "distcomm", free_port())] + [
        ("distcomm", e, free_port()) for e in ENGINES]
    return run_world(_run, 2, args=(plans,), timeout=180)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("case", list(_cases(None, 0, 2)))
def test_expanded_output_refused_as_gloo_refuses_it(case, engine):
    for rank, res in enumerate(_world()):
        theirs, ours = res["torch:gloo"], res[f"distcomm:{engine}"]
        assert theirs[case][:2] == ("raised", True) and PHRASE in theirs[case][3], theirs[case]
        assert ours[case][:3] == ("raised", True, "ArgumentError"), (rank, ours[case])
        assert PHRASE in ours[case][3] and "stride 0" in ours[case][3], ours[case][3]
        assert ours[case + "#check"] == theirs[case + "#check"] == 2.0


@pytest.mark.parametrize("case", list(_cases(None, 0, 2)))
def test_expanded_output_refused_through_torchs_api_on_backend_distcomm(case):
    for rank, res in enumerate(_world()):
        theirs, ours = res["torch:gloo"], res["torch:distcomm"]
        assert ours[case][:3] == ("raised", True, "ArgumentError"), (rank, ours[case])
        assert PHRASE in ours[case][3], ours[case][3]
        assert ours[case + "#check"] == theirs[case + "#check"] == 2.0


def _distcomm_only(rank: int, ws: int, engine: str) -> dict:
    import torch

    import distcomm as dist
    from distcomm._api.args import ArgumentError

    dist.init_process_group(engine, timeout=timedelta(seconds=30))
    out = {}

    def refused(name, fn):
        try:
            fn()
            out[name] = "returned"
        except ArgumentError as exc:
            out[name] = "refused" if PHRASE in str(exc) else str(exc)
        t = np.ones(1)
        dist.all_reduce(t)
        out[name + "#check"] = t[0]

    shared = np.lib.stride_tricks.as_strided(np.zeros(1), (4,), (0,))  # writable, one location
    refused("all_to_all_single", lambda: dist.all_to_all_single(torch.zeros(1).expand(4 * ws), torch.ones(4 * ws)))
    refused("scatter", lambda: dist.scatter(torch.zeros(1).expand(4), [torch.ones(4)] * ws if rank == 0 else None,
                                            src=0))
    refused("recv", lambda: dist.recv(torch.zeros(1).expand(4), src=0) if rank == 1 else None)
    refused("numpy/all_gather", lambda: dist.all_gather(
        [np.lib.stride_tricks.as_strided(np.zeros(1), (4,), (0,)) for _ in range(ws)], np.arange(4.0)))
    refused("numpy/reduce_scatter_tensor", lambda: dist.reduce_scatter_tensor(shared, np.ones(4 * ws)))
    # a result per element: an expanded tensor stays consistent, and is taken
    t = torch.full((1,), float(rank + 1)).expand(4)
    dist.all_reduce(t)
    out["all_reduce"] = t.tolist()
    t = torch.full((1,), float(rank + 1)).expand(3, 2)
    dist.broadcast(t, src=1)
    out["broadcast"] = t.tolist()
    t = torch.full((1,), float(rank + 1)).expand(4)
    dist.reduce(t, dst=0)
    out["reduce"] = t.tolist()
    dist.destroy_process_group()
    return out


def test_distcomm_refuses_where_gloo_aborts_or_writes_past_and_keeps_per_element_results():
    for engine in ENGINES:
        got = run_world(_distcomm_only, 2, args=(engine,), timeout=90)
        for rank, out in enumerate(got):
            for name in ("all_to_all_single", "scatter", "numpy/all_gather", "numpy/reduce_scatter_tensor"):
                assert out[name] == "refused" and out[name + "#check"] == 2.0, (engine, rank, name, out)
            assert out["recv"] == ("refused" if rank == 1 else "returned") and out["recv#check"] == 2.0
            assert out["all_reduce"] == [3.0] * 4
            assert out["broadcast"] == [[2.0, 2.0]] * 3
            assert out["reduce"] == ([3.0] * 4 if rank == 0 else [float(rank + 1)] * 4)
