"""Scripted API-error cases for tests/test_api_errors.py, run by torch.distributed and by distcomm.

Each case is a call with bad arguments. A world runs them all in order, for each framework in the
same processes (torch imported once): first the calls made before init_process_group, then — after
init — every case followed by a check collective (an all_reduce whose value is known). A case
"raised before any communication, on every rank" when every rank raised and the check that
follows still gives the right value (a rank that had sent something would put the ranks out of
step). The parent compares the kinds (ValueError / TypeError / RuntimeError) with torch's.
"""

from __future__ import annotations

import importlib
import os
import warnings
from datetime import timedelta
from typing import Any, Callable

import numpy as np

TIMEOUT_S = 30.0


def kinds(exc: BaseException) -> tuple[str, ...]:
    """The standard classes ``exc`` is an instance of: what an ``except`` clause written for torch
    would have to name to catch it."""
    found = tuple(cls.__name__ for cls in (TypeError, ValueError, RuntimeError, IndexError, AssertionError)
                  if isinstance(exc, cls))
    return found or (type(exc).__name__,)


def attempt(fn: Callable[[], Any]) -> tuple:
    try:
        value = fn()
    except Exception as exc:  # noqa: BLE001 - what we are here to see
        return ("raised", kinds(exc), type(exc).__name__, str(exc)[:300])
    return ("returned", repr(value)[:200])


def _t(*shape, dtype="float32", value=0.0):
    import torch

    return torch.full(shape, value, dtype=getattr(torch, dtype))


# -- calls before init_process_group ---------------------------------------------------------------
def before_init_cases(dist) -> dict[str, Callable]:
    return {
        "before_init/all_reduce": lambda: dist.all_reduce(_t(2)),
        "before_init/broadcast": lambda: dist.broadcast(_t(2), 0),
        "before_init/send": lambda: dist.send(_t(2), 1),
        "before_init/barrier": lambda: dist.barrier(),
        "before_init/get_rank": lambda: dist.get_rank(),
        "before_init/get_world_size": lambda: dist.get_world_size(),
        "before_init/get_backend": lambda: dist.get_backend(),
        "before_init/new_group": lambda: dist.new_group([0]),
        "before_init/all_gather_object": lambda: dist.all_gather_object([None, None], 1),
        "before_init/destroy_process_group": lambda: dist.destroy_process_group(),
        "before_init/is_initialized": lambda: dist.is_initialized(),
    }


# -- calls with bad arguments after init -------------------------------------------------------------
def error_cases(dist, rank: int, ws: int) -> dict[str, Callable]:
    import torch

    other = (rank + 1) % ws

    def on(ranks, fn):
        """Only ``ranks`` make the call; the others skip it."""
        ranks = {ranks} if isinstance(ranks, int) else set(ranks)
        return (lambda: fn()) if rank in ranks else (lambda: "skipped")
    f32 = lambda *s: _t(*s)  # noqa: E731
    i64 = lambda *s: _t(*s, dtype="int64")  # noqa: E731
    cases: dict[str, Callable] = {
        # invalid src/dst ranks
        "rank/broadcast_src_too_big": lambda: dist.broadcast(f32(2), src=ws),
        "rank/broadcast_src_negative": lambda: dist.broadcast(f32(2), src=-1),
        "rank/reduce_dst_too_big": lambda: dist.reduce(f32(2), dst=ws + 3),
        "rank/gather_dst_too_big": lambda: dist.gather(f32(2), None, dst=ws),
        "rank/scatter_src_too_big": lambda: dist.scatter(f32(2), None, src=ws),
        "rank/send_dst_too_big": lambda: dist.send(f32(2), dst=ws),
        "rank/recv_src_too_big": lambda: dist.recv(f32(2), src=ws),
        "rank/isend_dst_negative": lambda: dist.isend(f32(2), dst=-2),
        "rank/broadcast_object_list_src_too_big": lambda: dist.broadcast_object_list([1], src=ws),
        "rank/send_to_self": lambda: dist.send(f32(2), dst=rank),
        "rank/recv_from_self": lambda: dist.recv(f32(2), src=rank),
        "rank/isend_to_self": lambda: dist.isend(f32(2), dst=rank),
        "rank/new_group_rank_too_big": lambda: dist.new_group([0, ws]),
        "rank/get_global_rank_bad": lambda: dist.get_global_rank(dist.group.WORLD, ws),
        "rank/get_group_rank_bad": lambda: dist.get_group_rank(dist.group.WORLD, ws + 1),
        # wrong list lengths
        "length/all_gather_short": lambda: dist.all_gather([f32(2) for _ in range(ws - 1)], f32(2)),
        "length/all_gather_long": lambda: dist.all_gather([f32(2) for _ in range(ws + 1)], f32(2)),
        "length/reduce_scatter_short": lambda: dist.reduce_scatter(f32(2), [f32(2) for _ in range(ws - 1)]),
        "length/all_gather_object_short": lambda: dist.all_gather_object([None] * (ws - 1), rank),
        "length/all_to_all_short": lambda: dist.all_to_all([f32(2) for _ in range(ws - 1)],
                                                           [f32(2) for _ in range(ws - 1)]),
        # root-only lists: only the root makes the bad call (the others would rightly go ahead)
        "root/gather_list_short": on(0, lambda: dist.gather(f32(2), [f32(2) for _ in range(ws - 1)], dst=0)),
        "root/gather_list_missing": on(0, lambda: dist.gather(f32(2), None, dst=0)),
        "root/gather_list_mixed_dtypes": on(0, lambda: dist.gather(f32(2), [i64(2) for _ in range(ws)], dst=0)),
        "root/scatter_list_long": on(0, lambda: dist.scatter(f32(2), [f32(2) for _ in range(ws + 1)], src=0)),
        "root/scatter_list_missing": on(0, lambda: dist.scatter(f32(2), None, src=0)),
        "root/scatter_list_mixed_dtypes": on(0, lambda: dist.scatter(f32(2), [i64(2) for _ in range(ws)], src=0)),
        "nonroot/gather_list_given": on(1, lambda: dist.gather(f32(2), [f32(2) for _ in range(ws)], dst=0)),
        "nonroot/scatter_list_given": on(1, lambda: dist.scatter(f32(2), [f32(2) for _ in range(ws)], src=0)),
        # mixed dtypes
        "dtype/all_gather_mixed_outputs": lambda: dist.all_gather([f32(2)] + [i64(2) for _ in range(ws - 1)], f32(2)),
        "dtype/all_gather_output_vs_input": lambda: dist.all_gather([i64(2) for _ in range(ws)], f32(2)),
        "dtype/all_to_all_mixed": lambda: dist.all_to_all([f32(2) for _ in range(ws)], [i64(2) for _ in range(ws)]),
        "dtype/all_gather_into_tensor_mixed": lambda: dist.all_gather_into_tensor(i64(2 * ws), f32(2)),
        "dtype/reduce_scatter_tensor_mixed": lambda: dist.reduce_scatter_tensor(f32(2), i64(2 * ws)),
        "dtype/all_to_all_single_mixed": lambda: dist.all_to_all_single(f32(ws), i64(ws)),
        # wrong sizes
        "size/all_gather_into_tensor": lambda: dist.all_gather_into_tensor(f32(2 * ws + 1), f32(2)),
        "size/reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(f32(2), f32(2 * ws + 2)),
        "size/all_to_all_single_bad_splits": lambda: dist.all_to_all_single(
            f32(ws), f32(ws), [1] * ws, [2] * ws),
        "size/all_to_all_single_indivisible": lambda: dist.all_to_all_single(f32(ws + 1), f32(ws + 1)),
        # ops not defined for the dtype
        "op/band_float32": lambda: dist.all_reduce(f32(2), op=dist.ReduceOp.BAND),
        "op/bxor_float64": lambda: dist.all_reduce(_t(2, dtype="float64"), op=dist.ReduceOp.BXOR),
        "op/min_complex64": lambda: dist.all_reduce(_t(2, dtype="complex64"), op=dist.ReduceOp.MIN),
        "op/product_complex128": lambda: dist.all_reduce(_t(2, dtype="complex128"), op=dist.ReduceOp.PRODUCT),
        "op/reduce_max_complex": lambda: dist.reduce(_t(2, dtype="complex64"), 0, op=dist.ReduceOp.MAX),
        "op/reduce_product_complex": lambda: dist.reduce(_t(2, dtype="complex128"), 0, op=dist.ReduceOp.PRODUCT),
        "op/reduce_scatter_max_complex": lambda: dist.reduce_scatter(
            _t(2, dtype="complex64"), [_t(2, dtype="complex64") for _ in range(ws)], op=dist.ReduceOp.MAX),
        "op/reduce_scatter_tensor_min_complex": lambda: dist.reduce_scatter_tensor(
            _t(2, dtype="complex64"), _t(2 * ws, dtype="complex64"), op=dist.ReduceOp.MIN),
        "op/reduce_bor_float": lambda: dist.reduce(f32(2), 0, op=dist.ReduceOp.BOR),
        "op/avg_bool": lambda: dist.all_reduce(_t(2, dtype="bool"), op=dist.ReduceOp.AVG),
        "op/avg_int64": lambda: dist.all_reduce(i64(2), op=dist.ReduceOp.AVG),
        "op/premul_sum_float32": lambda: dist.all_reduce(f32(2), op=dist._make_nccl_premul_sum(2.0)),
        "op/sum_int16": lambda: dist.all_reduce(_t(2, dtype="int16")),
        # not tensors, bad types
        "type/all_reduce_list": lambda: dist.all_reduce([1.0, 2.0]),
        "type/broadcast_int": lambda: dist.broadcast(3, 0),
        "type/all_gather_not_list": lambda: dist.all_gather(f32(2 * ws), f32(2)),
        "type/p2pop_bad_op": lambda: dist.P2POp(dist.all_reduce, f32(2), other),
        "type/batch_not_p2pops": lambda: dist.batch_isend_irecv([f32(2)]),
        "type/batch_empty": lambda: dist.batch_isend_irecv([]),
        "type/init_timeout_not_timedelta": lambda: dist.new_group([0, 1], timeout=30),
        # groups
        "group/broadcast_src_not_in_group": lambda: dist.broadcast(f32(2), src=0, group=_GROUPS["tail"]),
        "group/send_dst_not_in_group": lambda: dist.send(f32(2), dst=0, group=_GROUPS["tail"]),
        "group/get_group_rank_not_member": lambda: dist.get_group_rank(_GROUPS["tail"], 0),
        "group/both_src_and_group_src": lambda: dist.broadcast(f32(2), src=0, group_src=0),
        # init twice
        "init/twice": lambda: dist.init_process_group("gloo"),
        # read-only numpy outputs (torch tensors are always writable): refused before communicating
        "readonly/all_reduce": lambda: dist.all_reduce(_read_only(2)),
        "readonly/all_reduce_large": lambda: dist.all_reduce(_read_only(1 << 17)),
        "readonly/all_gather_into_tensor": lambda: dist.all_gather_into_tensor(_read_only(2 * ws), np.ones(2)),
        "readonly/reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(_read_only(2), np.ones(2 * ws)),
        "readonly/all_to_all_single": lambda: dist.all_to_all_single(_read_only(ws), np.ones(ws)),
        "readonly/all_gather_list": lambda: dist.all_gather([np.ones(2)] * (ws - 1) + [_read_only(2)], np.ones(2)),
        "readonly/recv": lambda: dist.recv(_read_only(2), src=other),
        # a rooted call writes on some ranks only: those refuse, after taking part
        "readonly/broadcast": lambda: dist.broadcast(_read_only(2), src=0),
        "readonly/reduce": lambda: dist.reduce(_read_only(2), dst=0),
    }
    return cases


def _read_only(n: int) -> np.ndarray:
    a = np.ones(n)
    a.flags.writeable = False
    return a


_GROUPS: dict[str, Any] = {}

# Calls torch's gloo cannot survive, not run on torch: what torch 2.13 does instead (observed; the
# process then crashes in destroy_process_group with "double free or corruption"). The parent
# expects distcomm to raise the kind given here, at once.
TORCH_SKIPPED = {
    "rank/send_dst_too_big": ("RuntimeError", "torch waits out the store timeout, then DistStoreError "
                                              "'wait timeout after 30000ms, keys: /default_pg/0//cpu//0/3'"),
    "rank/isend_dst_negative": ("RuntimeError", "torch waits out the store timeout, then DistStoreError"),
    "rank/recv_src_too_big": ("RuntimeError", "torch does not check recv's src: gloo waits out the store "
                                              "timeout, then the process dies with SIGSEGV"),
    "rank/recv_from_self": ("RuntimeError", "gloo: RuntimeError 'Pair is not connected', then the crash"),
    "rank/isend_to_self": ("RuntimeError", "gloo: RuntimeError 'Pair is not connected', then the crash"),
    # gloo fails AVG on bool/integers after the communication, in the division; its next barrier
    # re-raises that error on rank 0 alone (the ranks go out of step)
    "op/avg_bool": ("RuntimeError", "RuntimeError \"result type Float can't be cast to the desired output "
                                    "type Bool\", and later again from rank 0's next barrier"),
    "op/avg_int64": ("RuntimeError", "as op/avg_bool (distcomm supports it: see DELIBERATE)"),
}
TORCH_SKIPPED.update({  # numpy-only cases: torch.distributed takes no numpy arrays
    name: ("ValueError", "not applicable: a read-only numpy array (torch tensors are always writable)")
    for name in ("readonly/all_reduce", "readonly/all_reduce_large", "readonly/all_gather_into_tensor",
                 "readonly/reduce_scatter_tensor", "readonly/all_to_all_single", "readonly/all_gather_list",
                 "readonly/recv", "readonly/broadcast", "readonly/reduce")
})


def _check(dist, rank: int, ws: int) -> tuple:
    """An all_reduce with a known answer: the ranks are still in step after the case."""
    import torch

    t = torch.tensor([float(rank + 1)])
    try:
        dist.all_reduce(t)
    except Exception as exc:  # noqa: BLE001
        return ("check raised", type(exc).__name__, str(exc)[:200])
    return ("check ok",) if t.item() == ws * (ws + 1) / 2 else ("check wrong value", t.item())


def run_errors(rank: int, ws: int, plans: list[tuple[str, str, int]]) -> dict[str, Any]:
    """For each (framework, backend, port): the outcome of every case on this rank."""
    import torch  # noqa: F401

    warnings.simplefilter("ignore")
    out: dict[str, Any] = {}
    for framework, backend, port in plans:
        dist = importlib.import_module("torch.distributed" if framework == "torch" else "distcomm")
        res: dict[str, Any] = {}
        for name, fn in before_init_cases(dist).items():
            res[name] = attempt(fn)
        os.environ["MASTER_PORT"] = str(port)
        dist.init_process_group(backend, timeout=timedelta(seconds=TIMEOUT_S))
        _GROUPS["tail"] = dist.new_group(list(range(1, ws)))
        for name, fn in error_cases(dist, rank, ws).items():
            if os.environ.get("API_CASES_TRACE"):
                print(f"[{framework} rank {rank}] {name}", flush=True)
            if framework == "torch" and name in TORCH_SKIPPED:
                continue
            res[name] = attempt(fn)
            res[name + "#check"] = _check(dist, rank, ws)
            if os.environ.get("API_CASES_TRACE"):
                print(f"[{framework} rank {rank}]    -> {res[name]} {res[name + '#check']}", flush=True)
        dist.destroy_process_group()
        res["after_destroy/is_initialized"] = attempt(dist.is_initialized)
        out[f"{framework}:{backend}"] = res
    return out


# -- distcomm-only scenarios (one world; each on a fresh group so a poisoned group stays behind) ------
def _group(dist, seconds: float, backend=None):
    return dist.new_group(timeout=timedelta(seconds=seconds), backend=backend)


def scenarios(rank: int, ws: int) -> dict[str, Any]:
    """Failure scenarios and more on distcomm (world of ``ws`` >= 3)."""
    import time

    import torch

    import distcomm as dist

    warnings.simplefilter("ignore")
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    out: dict[str, Any] = {}

    out["third_party"] = attempt(lambda: _third_party(dist, rank, ws, out))
    out["overlapping_groups"] = _guard(lambda: _overlapping_groups(dist, rank, ws))
    out["multigpu"] = _guard(lambda: _multigpu(dist, rank, ws))
    out["profiler_events"] = _profiled_names(dist)
    out["extensions"] = _guard(lambda: _extensions(dist, rank, ws))

    # monitored_barrier: the last rank never arrives
    g = _group(dist, 30)
    if rank != ws - 1:
        out["monitored_barrier/one_missing"] = attempt(
            lambda: dist.monitored_barrier(g, timeout=timedelta(seconds=1.5)))
    # monitored_barrier(wait_all_ranks=True): ranks 1.. never arrive; rank 0 names them all
    g = _group(dist, 30)
    if rank == 0:
        out["monitored_barrier/wait_all_ranks"] = attempt(
            lambda: dist.monitored_barrier(g, timeout=timedelta(seconds=1.5), wait_all_ranks=True))
    # monitored_barrier that everyone passes
    g = _group(dist, 30)
    out["monitored_barrier/all_arrive"] = attempt(lambda: dist.monitored_barrier(g, timeout=timedelta(seconds=20)))
    # a float timeout is seconds, as torch takes it (with a warning)
    out["monitored_barrier/float_timeout"] = attempt(lambda: dist.monitored_barrier(g, timeout=20.0))
    # no time at all: rank 0 (alone in the call) raises before waiting for anyone, in gloo's words
    g = _group(dist, 30)
    if rank == 0:
        out["monitored_barrier/zero_timeout"] = attempt(lambda: dist.monitored_barrier(g, timeout=timedelta(0)))

    # a peer that never calls the collective: the group's timeout, naming op, seq, rank, peer
    g = _group(dist, 1.5)
    dist.barrier(g)  # seq 1 on the group; the all_reduce below is #2
    if rank != ws - 1:
        start = time.monotonic()
        out["timeout/all_reduce"] = attempt(lambda: dist.all_reduce(torch.ones(4), group=g))
        out["timeout/all_reduce_seconds"] = time.monotonic() - start

    # collective mismatches: sizes, ops, dtypes, different collectives; on both engines. The groups
    # are made first, while the ranks are in step (a tcp group connects within its timeout).
    fresh = {(e, i): _group(dist, 2.5, backend=e) for e in ["gloo", "tcp"] for i in range(4)}
    dist.barrier()
    for engine in ["gloo", "tcp"]:
        for i, (what, make) in enumerate([
            ("size", lambda: dist.all_reduce(torch.ones(4 if rank == 0 else 8), group=g2)),
            ("op", lambda: dist.all_reduce(torch.ones(4), op=dist.ReduceOp.SUM if rank == 0 else dist.ReduceOp.MAX,
                                           group=g2)),
            ("dtype", lambda: dist.all_reduce(torch.ones(4, dtype=torch.float32 if rank == 0 else torch.int32),
                                              group=g2)),
            ("collective", lambda: (dist.all_reduce(torch.ones(4), group=g2) if rank == 0
                                    else dist.broadcast(torch.ones(4), 0, group=g2))),
        ]):
            g2 = fresh[engine, i]
            start = time.monotonic()
            out[f"mismatch/{engine}/{what}"] = attempt(make)
            out[f"mismatch/{engine}/{what}_seconds"] = time.monotonic() - start
            # Start the next case in step: the rank that saw the mismatch leaves at once while
            # those waiting on it sit out the group's timeout (on tcp only the receiver of the
            # mismatching message can see it), and would then arrive late for the next case.
            dist.barrier()
    dist.barrier()

    dist.destroy_process_group()
    return out


def _guard(fn) -> str:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001
        import traceback

        return f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    return "ok"


class _Counting:
    """A third-party engine's transport: distcomm's TCP transport, counting sends."""

    def __init__(self, inner):
        self.inner, self.sends = inner, 0

    def isend(self, dst, data, key, signature=0):
        self.sends += 1
        return self.inner.isend(dst, data, key, signature)

    def irecv(self, src, out, key, signature=0):
        return self.inner.irecv(src, out, key, signature)

    def close(self):
        self.inner.close()


def _third_party(dist, rank, ws, out):
    import torch

    from distcomm.transport.tcp import TcpTransport

    made = []

    def engine(store, rank_, size, timeout):
        made.append(_Counting(TcpTransport.connect(store, rank_, size, timeout.total_seconds())))
        return made[-1]

    dist.Backend.register_backend("wrapped_tcp", engine)
    g = dist.new_group(backend="wrapped_tcp")
    g_tcp = dist.new_group(backend="tcp")
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t, group=g)
    # get_backend(g) as it is: the parent, which never registered "wrapped_tcp", unpickles it
    out["third_party_info"] = {"backend": dist.get_backend(g), "world_backend": dist.get_backend(),
                               "tcp_backend": dist.get_backend(g_tcp), "sum": t.item(),
                               "sends": made[0].sends if made else 0}


def _overlapping_groups(dist, rank, ws):
    """Async all_reduces and broadcasts on three overlapping groups, issued interleaved (each rank
    in its own order across groups, the same order within a group), waited in reverse."""
    import torch

    groups = [dist.new_group(list(range(ws))), dist.new_group([0, 1]), dist.new_group(list(range(1, ws)))]
    members = [list(range(ws)), [0, 1], list(range(1, ws))]
    pending = []
    for i in range(24):
        gi = i % 3
        if rank not in members[gi]:
            continue
        n = 30000 if i % 4 == 0 else 7
        if i % 5 == 4:
            src = members[gi][-1]
            t = torch.full((n,), float(rank * 1000 + i), dtype=torch.float64)
            pending.append((dist.broadcast(t, src, group=groups[gi], async_op=True), t, float(src * 1000 + i)))
        else:
            t = torch.full((n,), float((rank + 1) * (i + 1)), dtype=torch.float64)
            want = float(sum(r + 1 for r in members[gi]) * (i + 1))
            pending.append((dist.all_reduce(t, group=groups[gi], async_op=True), t, want))
    for work, t, want in reversed(pending):
        work.wait()
        assert bool((t == want).all()), (t[:3], want)


def _multigpu(dist, rank, ws):
    """The seed's *_multigpu functions with two CPU tensors per process, against numpy."""
    import torch

    L, n = 2, 4

    def val(p, j, salt=0):  # process p's tensor j
        return np.arange(n, dtype=np.float64) * (p + 1) + 10 * j + 100 * salt

    def tl(salt=0):
        return [torch.from_numpy(val(rank, j, salt)) for j in range(L)]

    t = tl(1)
    dist.broadcast_multigpu(t, src=1, src_tensor=1)
    for x in t:
        np.testing.assert_array_equal(x.numpy(), val(1, 1, 1))

    for op, fn in [(dist.ReduceOp.SUM, np.sum), (dist.ReduceOp.MAX, np.max), (dist.ReduceOp.AVG, np.mean)]:
        t = tl(2)
        dist.all_reduce_multigpu(t, op=op)
        want = fn(np.stack([val(p, j, 2) for p in range(ws) for j in range(L)]), axis=0)
        for x in t:
            np.testing.assert_allclose(x.numpy(), want, rtol=0, atol=1e-12)

    t = tl(3)
    dist.reduce_multigpu(t, dst=0, dst_tensor=1)
    if rank == 0:
        want = np.sum([val(p, j, 3) for p in range(ws) for j in range(L)], axis=0)
        np.testing.assert_array_equal(t[1].numpy(), want)

    # all_gather_multigpu: output_tensor_lists[i][k * L + j] = input_tensor_list[j] of rank k.
    # (The seed says "k * world_size + j", which only fits when L == world_size: its lists have
    # world_size * L entries. L = 2 != 3 here tells the two apart.)
    outs = [[torch.zeros(n, dtype=torch.float64) for _ in range(ws * L)] for _ in range(L)]
    dist.all_gather_multigpu(outs, tl(4))
    for i in range(L):
        for k in range(ws):
            for j in range(L):
                np.testing.assert_array_equal(outs[i][k * L + j].numpy(), val(k, j, 4))

    # reduce_scatter_multigpu: output_tensor_list[j] of rank k = the reduction over every process
    # and every i of input_tensor_lists[i][k * L + j]
    def inp(p, i, m):
        return np.arange(n, dtype=np.float64) + 1000 * p + 100 * i + m

    ins = [[torch.from_numpy(inp(rank, i, m)) for m in range(ws * L)] for i in range(L)]
    outs = [torch.zeros(n, dtype=torch.float64) for _ in range(L)]
    dist.reduce_scatter_multigpu(outs, ins)
    for j in range(L):
        want = np.sum([inp(p, i, rank * L + j) for p in range(ws) for i in range(L)], axis=0)
        np.testing.assert_array_equal(outs[j].numpy(), want)


def _profiled_names(dist) -> list[str]:
    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        t = torch.ones(16)
        dist.all_reduce(t)
        dist.all_reduce(t, async_op=True).wait()
    return sorted({e.name for e in prof.events() if "all_reduce" in e.name or "distcomm" in e.name})


def killed_peer(rank: int, ws: int, kill_rank: int) -> dict[str, Any]:
    """``kill_rank`` exits (os._exit) between two barriers; the others then call operations that
    need it, directly or through a peer. numpy only: no torch import, a fast world."""
    import time

    import distcomm as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    survivors = [r for r in range(ws) if r != kill_rank]
    g_tcp = _group(dist, 60, backend="tcp")
    g_short = _group(dist, 20)  # bounds the wait where failure has to travel through a live peer
    g_alive = dist.new_group(survivors)  # to leave together at the end
    dist.barrier()
    if rank == kill_rank:
        os._exit(1)
    out: dict[str, Any] = {}
    x = np.zeros(4)
    for name, fn in [
        ("recv", lambda: dist.recv(x, src=kill_rank)),
        ("irecv_tcp", lambda: dist.irecv(x, src=kill_rank, group=g_tcp).wait()),
        ("broadcast_gloo", lambda: dist.broadcast(x, src=kill_rank)),
        ("broadcast_tcp", lambda: dist.broadcast(x, src=kill_rank, group=g_tcp)),
        ("all_reduce_short", lambda: dist.all_reduce(np.ones(1000), group=g_short)),
    ]:
        start = time.monotonic()
        out[name] = attempt(fn)
        out[name + "_seconds"] = time.monotonic() - start
    # the survivors still work together in a group without the dead rank
    t = np.array([float(rank)])
    dist.all_reduce(t, group=g_alive)
    out["survivors_sum"] = float(t[0])
    return out


def _extensions(dist, rank, ws):
    """What distcomm does where torch 2.13's gloo refuses: recv_object_list from any source,
    non-contiguous tensors in send/recv ("input tensor has to be contiguous" in torch), and a
    point-to-point Work's future ("Work::getFuture not implemented")."""
    import torch

    # recv_object_list(src=None): torch raises ValueError "Must specify global_rank or group_rank"
    if rank == 1:
        dist.send_object_list([{"from": 1}, "x" * 100], dst=0)
    elif rank == 0:
        got = [None, None]
        sender = dist.recv_object_list(got, src=None)
        assert sender == 1 and got == [{"from": 1}, "x" * 100], (sender, got)
    dist.barrier()
    # non-contiguous send and receive (a (4, 3) view each): the strided elements travel, the
    # rest of the receiving tensor stays as it was
    if rank == 0:
        src = torch.arange(24.0).reshape(4, 6)
        dist.send(src[:, ::2], dst=1)
    elif rank == 1:
        base = torch.full((6, 8), -1.0)
        view = base.t()[::2, :][:4, :3]
        dist.recv(view, src=0)
        expect = torch.full((6, 8), -1.0)
        expect.t()[::2, :][:4, :3] = torch.arange(24.0).reshape(4, 6)[:, ::2]
        assert torch.equal(base, expect), base
    dist.barrier()
    # a point-to-point Work's future holds the received tensor
    if rank == 0:
        dist.isend(torch.tensor([5.0, 6.0]), dst=1).wait()
    elif rank == 1:
        t = torch.zeros(2)
        value = dist.irecv(t, src=0).get_future().wait()
        assert isinstance(value, list) and torch.equal(value[0], torch.tensor([5.0, 6.0])), value
    dist.barrier()
