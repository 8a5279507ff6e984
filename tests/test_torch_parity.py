"""distcomm against torch.distributed 2.13 (gloo): calls that torch accepts and distcomm must match.

* In worlds of 2 and 3 (tests/parity_cases.py), torch then distcomm run: all_reduce_coalesced and
  all_gather_coalesced (results, torch's FutureWarning, the future they return when async), sparse
  COO all_reduce, all_reduce of an expanded (stride 0) tensor, all_to_all_single with a
  non-contiguous input (torch's ValueError) or output, monitored_barrier with a float timeout,
  irecv from any source with ``work._source_rank()``, and the profiler's event names.
* Without a world: get_node_local_rank, the debug level API, ReduceOp identity, the names torch
  2.13 has, split_group's checks, and every public signature against torch's
  (``inspect.signature``), with the deliberate differences in ONE table below
  (also docs/torch-differences.md).
"""

from __future__ import annotations

import copy
import functools
import inspect
import os
import pickle
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
import torch.distributed as tdist
import torch.distributed.distributed_c10d as tc10d

import diff_cases as dc
import distcomm as dist
import parity_cases
from harness import free_port, run_world

WORLD_SIZES = [2, 3]


@functools.lru_cache(maxsize=None)
def _world(ws: int):
    plans = [("torch", "gloo", free_port()), ("distcomm", "gloo", free_port())]
    return run_world(parity_cases.run, ws, args=(plans,), timeout=240)


CASES = list(parity_cases.cases(tdist, 0, 2))
# cases where distcomm deliberately differs: (torch's outcome -> distcomm's, why); also in
# docs/torch-differences.md
DELIBERATE = {
    "all_to_all_single/noncontiguous_output": (
        lambda theirs: (theirs[0], theirs[1].T.reshape(theirs[1].shape), theirs[2]),
        "gloo writes the received elements in the output's memory order, ignoring its strides (a "
        "transposed output reads scrambled); distcomm writes them in the tensor's element order"),
}
# where torch raises: the words of its message that distcomm's must say too
ERROR_PHRASES = {
    "all_reduce_coalesced/complex_max": "on complex tensors",
    "all_gather_coalesced/not_a_list": "output_tensor_lists should be a list",
    "sparse/max": "allreduce of sparse tensors only works with ReduceOp.SUM",
    "all_to_all_single/noncontiguous_input": "Tensors must be contiguous",
}


@pytest.mark.slow  # worlds importing torch; the fast tier compares with torch in test_differential
@pytest.mark.parametrize("ws", WORLD_SIZES)
@pytest.mark.parametrize("name", CASES)
def test_like_torch_gloo(name, ws):
    for rank, out in enumerate(_world(ws)):
        theirs, ours = out["torch"][name], out["distcomm"][name]
        if name in DELIBERATE:
            theirs = DELIBERATE[name][0](theirs)
        if theirs[0] == "raised":
            # an ``except`` naming torch's class catches ours; the message says what torch's does
            assert ours[0] == "raised" and theirs[1] in ours[2], (rank, theirs, ours)
            phrase = ERROR_PHRASES[name]
            assert phrase in theirs[3] and phrase in ours[3], (rank, phrase, theirs, ours)
            assert ours[-1] == theirs[-1], (rank, "FutureWarnings", theirs[-1], ours[-1])
            continue
        diff = dc.diff(dc.plain(theirs), dc.plain(ours))
        assert diff is None, f"rank {rank}: {diff}"


@pytest.mark.slow
def test_coalesced_warn_as_torch():
    out = _world(2)[0]["distcomm"]
    for name in ["all_reduce_coalesced/sync", "all_gather_coalesced/async"]:
        (text,) = out[name][-1]
        assert text.startswith(f"`torch.distributed.{name.split('/')[0]}` will be deprecated"), text


@pytest.mark.slow
def test_async_coalesced_returns_a_future():
    for rank, out in enumerate(_world(3)):
        assert out["distcomm"]["all_reduce_coalesced/async"][1][0] == "Future", out["distcomm"]


@pytest.mark.slow
def test_errors_name_the_operation_and_rank():
    for rank, out in enumerate(_world(3)):
        for name in ["sparse/max", "all_to_all_single/noncontiguous_input"]:
            raised = out["distcomm"][name]
            assert raised[0] == "raised" and "RuntimeError" in raised[2], raised
            assert f"rank {rank}" in raised[3] and name.split("/")[0].replace("sparse", "all_reduce") in raised[3]


@pytest.mark.slow
@pytest.mark.parametrize("ws", WORLD_SIZES)
def test_profiler_events_are_backend_op_and_fast_path_hides_none(ws):
    for rank, out in enumerate(_world(ws)):
        ours = out["distcomm"]["profiler"]
        assert ours.count("gloo:all_reduce") == 3, ours
        assert "gloo:barrier" in ours, ours
        if ws > 1:  # point-to-point calls are events too
            assert "gloo:send" in ours and "gloo:recv" in ours, ours
        assert set(ours) <= set(out["torch"]["profiler"]) | {"gloo:barrier"}, (ours, out["torch"]["profiler"])


# -- without a world -------------------------------------------------------------------------------------
def test_get_node_local_rank(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    for fn in (tdist.get_node_local_rank, dist.get_node_local_rank):
        assert fn(fallback_rank=3) == 3
        with pytest.raises(RuntimeError, match="LOCAL_RANK is not in the environment"):
            fn()
    monkeypatch.setenv("LOCAL_RANK", "2")
    assert dist.get_node_local_rank() == 2 == tdist.get_node_local_rank(fallback_rank=5)
    assert dist.get_node_local_rank(fallback_rank=5) == 2


def test_debug_level(monkeypatch):
    assert [m.name for m in dist.DebugLevel] == list(tdist.DebugLevel.__members__)
    assert [int(m) for m in dist.DebugLevel] == [int(v) for v in tdist.DebugLevel.__members__.values()]
    assert repr(dist.DebugLevel.INFO) == repr(tdist.DebugLevel.INFO)
    assert str(dist.DebugLevel.INFO) == str(tdist.DebugLevel.INFO)
    saved = dist.get_debug_level()
    try:
        dist.set_debug_level(dist.DebugLevel.DETAIL)
        assert dist.get_debug_level() is dist.DebugLevel.DETAIL
        with pytest.raises(TypeError):
            dist.set_debug_level(1)
        monkeypatch.delenv("DISTCOMM_DEBUG", raising=False)
        monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "info")
        dist.set_debug_level_from_env()
        assert dist.get_debug_level() is dist.DebugLevel.INFO
        monkeypatch.setenv("DISTCOMM_DEBUG", "Detail")  # distcomm's own variable wins
        dist.set_debug_level_from_env()
        assert dist.get_debug_level() is dist.DebugLevel.DETAIL
        monkeypatch.setenv("DISTCOMM_DEBUG", "loud")
        with pytest.raises(ValueError, match="The value of DISTCOMM_DEBUG must be OFF, INFO, or DETAIL."):
            dist.set_debug_level_from_env()
        monkeypatch.delenv("DISTCOMM_DEBUG")
        monkeypatch.delenv("TORCH_DISTRIBUTED_DEBUG")
        dist.set_debug_level_from_env()
        assert dist.get_debug_level() is dist.DebugLevel.OFF
    finally:
        dist.set_debug_level(saved)


def test_debug_level_read_at_import():
    env = dict(os.environ, TORCH_DISTRIBUTED_DEBUG="DETAIL")
    env.pop("DISTCOMM_DEBUG", None)
    code = "import distcomm; print(distcomm.get_debug_level().name)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "DETAIL", out.stderr


def test_reduce_op_identity():
    for ours, theirs in [(dist.ReduceOp, tdist.ReduceOp)]:
        assert isinstance(ours.SUM, ours) and isinstance(theirs.SUM, theirs)
        assert isinstance(dist._make_nccl_premul_sum(2.0), ours)
    for make in (dist._make_nccl_premul_sum, tdist._make_nccl_premul_sum):
        op = make(2.0)
        for other in (copy.copy(op), copy.deepcopy(op), pickle.loads(pickle.dumps(op))):
            assert other == op and hash(other) == hash(op)
        # torch compares by the op alone: so does distcomm
        assert (op == make(3.0)) and (op == op.__class__.PREMUL_SUM if hasattr(op.__class__, "PREMUL_SUM") else True)
        assert op != dist.ReduceOp.SUM if make is dist._make_nccl_premul_sum else op != tdist.ReduceOp.SUM
    assert pickle.loads(pickle.dumps(dist._make_nccl_premul_sum(2.0))).factor == 2.0
    assert dist.ReduceOp.PREMUL_SUM == dist._make_nccl_premul_sum(0.5)


def test_supports_complex_like_torch():
    for name in ["SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "PREMUL_SUM"]:
        assert dist.supports_complex(getattr(dist.ReduceOp, name)) == tdist.supports_complex(getattr(tdist.ReduceOp, name))


def test_availability_like_torch():
    for name in ["gloo", "GLOO", "nccl", "ucc", "xccl", "cpu:gloo", "cpu:gloo,cuda:nccl", "undefined"]:
        assert dist.is_backend_available(name) == tdist.is_backend_available(name), name
    # deliberately not torch's (its CPU build has no MPI): distcomm's "mpi" engine runs when mpi4py imports
    assert dist.is_backend_available("mpi") == dist.is_mpi_available()
    assert dist.is_backend_available("tcp")
    assert dist.is_xccl_available() is False
    assert dist.get_default_backend_for_device("cpu") == tdist.get_default_backend_for_device("cpu") == "gloo"
    assert dist.get_default_backend_for_device(torch.device("cpu")) == "gloo"
    with pytest.raises(ValueError, match="Default backend not registered for device : meta"):
        dist.get_default_backend_for_device("meta")


def test_distributed_c10d_alias():
    import distcomm.distributed_c10d as c10d

    assert dist.distributed_c10d is c10d
    for name in c10d.__all__:
        assert getattr(c10d, name) is getattr(dist, name), name


def test_world_of_one_queries(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/f", rank=0, world_size=1)
    try:
        assert dist.get_pg_count() == 1
        assert dist.get_backend_config() == "cpu:gloo"
        g = dist.new_group([0])
        assert dist.get_pg_count() == 2 and dist.get_backend_config(g) == "cpu:gloo"
        with pytest.raises(ValueError, match="split_ranks cannot be None or empty"):
            dist.split_group(split_ranks=[])
        with pytest.raises(ValueError, match="less or equal to the world_size"):
            dist.split_group(split_ranks=[[0, 0]])
        with pytest.raises(ValueError, match="not a rank of the parent group"):
            dist.split_group(g, [[1]])
        s = dist.split_group(split_ranks=[[0]])
        t = np.ones(3)
        dist.all_reduce(t, group=s)
        assert dist.get_process_group_ranks(s) == [0] and dist.get_pg_count() == 2  # a split is named by hash, not counted (torch's)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dist.monitored_barrier(timeout=5.0)  # seconds, as torch takes them
        dist.breakpoint(rank=1, timeout_s=None)  # rank 1 does not exist: only the barrier runs
    finally:
        dist.destroy_process_group()


# -- every public name and signature of torch.distributed that applies to a CPU package ------------------
# name -> why distcomm deliberately differs (missing, or a different signature). The same table is
# docs/torch-differences.md.
DIFFERENCES = {
    "AllreduceCoalescedOptions": "c10d's C++ option structs: distcomm's ProcessGroup methods take plain arguments",
    "AllreduceOptions": "as AllreduceCoalescedOptions",
    "AllToAllOptions": "as AllreduceCoalescedOptions",
    "BarrierOptions": "as AllreduceCoalescedOptions",
    "BroadcastOptions": "as AllreduceCoalescedOptions",
    "GatherOptions": "as AllreduceCoalescedOptions",
    "ReduceOptions": "as AllreduceCoalescedOptions",
    "ReduceScatterOptions": "as AllreduceCoalescedOptions",
    "ScatterOptions": "as AllreduceCoalescedOptions",
    "BackendConfig": "a torch-internal device-to-backend map; get_backend_config gives its string",
    "GroupName": "a typing alias of torch's group-name strings, not an API",
    "ProcessGroupGloo": "torch's C++ gloo backend class; distcomm's engines register by name (Backend.register_backend)",
    "shrink_group": "needs a backend that can shrink communicators (NCCL); no CPU backend can",
    "record_comm": "torch's flight-recorder hook for its C++ backends",
    "ProcessGroup": "distcomm's ProcessGroup is built around an Engine, not a (store, rank, size) triple",
    "Work": "distcomm's Work is made by its ProcessGroup (op name, result), not default-constructed",
    "PrefixStore": "the store is distcomm's own; its constructor differs in parameter names",
    "Store": "as PrefixStore",
    "init_process_group": "torch's private ``_ranks`` parameter (an internal subset init) is not taken",
    "Backend": "register_backend takes a distcomm engine factory; the constructor takes name",
}


def _public_torch_names() -> list[str]:
    return sorted(set(tc10d.__all__) | {"get_node_local_rank", "breakpoint", "is_available", "set_debug_level",
                                        "set_debug_level_from_env", "register_rendezvous_handler", "rendezvous",
                                        "FileStore", "HashStore", "TCPStore", "DistError", "DistBackendError",
                                        "DistNetworkError", "DistStoreError", "QueueEmptyError"})


MISSING_ON_PURPOSE = {n for n in DIFFERENCES if n.endswith("Options")} | {
    "BackendConfig", "GroupName", "ProcessGroupGloo", "shrink_group", "record_comm"}


@pytest.mark.parametrize("name", _public_torch_names())
def test_torch_name_exists_with_its_signature(name):
    if name in MISSING_ON_PURPOSE:
        assert not hasattr(dist, name) or name in ("ProcessGroup",), name
        return
    assert hasattr(dist, name), f"distcomm lacks torch.distributed.{name} and DIFFERENCES does not say why"
    theirs, ours = getattr(tdist, name), getattr(dist, name)
    if inspect.isclass(theirs) or not callable(theirs) or name in DIFFERENCES:
        return
    try:
        want = inspect.signature(theirs)
    except (TypeError, ValueError):  # a pybind11 function: no Python signature to compare
        return
    got = inspect.signature(ours)
    assert [(p.name, p.kind, _default(p)) for p in got.parameters.values()] == \
        [(p.name, p.kind, _default(p)) for p in want.parameters.values()], f"{name}: {got} vs torch {want}"


def _default(p: inspect.Parameter):
    d = p.default
    if d is inspect.Parameter.empty or d is None or isinstance(d, (bool, int, float, str)):
        return d if not hasattr(d, "name") else d.name  # ReduceOp.SUM: by name
    return getattr(d, "name", repr(d))


def test_differences_are_documented():
    text = open(os.path.join(os.path.dirname(__file__), "..", "docs", "torch-differences.md")).read()
    for name in DIFFERENCES:
        assert f"`{name}`" in text, name
    for name in DELIBERATE:
        assert f"`{name.split('/')[0]}`" in text, name
