"""Cases of tests/test_torch_parity.py: the same calls through torch.distributed (gloo) and distcomm.

``run(rank, ws, plans)`` runs every case once per (framework, backend, port) in one process (torch is
imported once) and returns, per framework, each case's outputs as plain values (numpy arrays,
strings, tuples) for the parent to compare. A case that raises records (exception class name,
message); a case's outputs include the warnings it gave (category and text).
"""

from __future__ import annotations

import importlib
import os
import warnings
from datetime import timedelta
from typing import Any, Callable


def _np(t) -> Any:
    return t.detach().numpy().copy()


def _sparse(t) -> tuple:
    t = t.coalesce() if not t.is_coalesced() else t
    return ("sparse", _np(t._indices()), _np(t._values()), tuple(t.shape), t.is_coalesced())


def _future_value(fut) -> Any:
    def plain(v):
        return [plain(x) for x in v] if isinstance(v, list) else _np(v)

    value = fut.wait()
    return plain(value) if isinstance(value, list) else ("not a list", repr(value))


def cases(dist, rank: int, ws: int) -> dict[str, Callable[[], Any]]:
    import torch

    def full(*shape, value=0.0, dtype=torch.float32):
        return torch.full(shape, float(value), dtype=dtype)

    def coalesced_sync():
        ts = [full(3, value=rank + 1), full(2, 2, value=10 * (rank + 1))]
        r = dist.all_reduce_coalesced(ts)
        return r, [_np(t) for t in ts]

    def coalesced_async():
        ts = [torch.arange(4.0) * (rank + 1), full(1, value=rank)]
        fut = dist.all_reduce_coalesced(ts, op=dist.ReduceOp.MAX, async_op=True)
        return type(fut).__name__, _future_value(fut), [_np(t) for t in ts]

    def coalesced_single_tensor():
        t = full(5, value=rank + 1, dtype=torch.int64)
        return dist.all_reduce_coalesced(t), _np(t)

    def coalesced_complex_max():
        return dist.all_reduce_coalesced([torch.ones(2, dtype=torch.complex64)], op=dist.ReduceOp.MAX)

    def gather_coalesced_sync():
        ins = [full(2, value=rank + 1), full(3, value=-(rank + 1))]
        outs = [[full(2), full(3)] for _ in range(ws)]
        r = dist.all_gather_coalesced(outs, ins)
        return r, [[_np(t) for t in lst] for lst in outs]

    def gather_coalesced_async():
        ins = [torch.arange(3.0) + rank]
        outs = [[full(3)] for _ in range(ws)]
        fut = dist.all_gather_coalesced(outs, ins, async_op=True)
        return type(fut).__name__, _future_value(fut), [[_np(t) for t in lst] for lst in outs]

    def gather_coalesced_not_a_list():
        return dist.all_gather_coalesced((full(2),), [full(2)])

    def sparse_1d():
        s = torch.sparse_coo_tensor([[rank, ws]], [1.0, 2.0], (ws + 2,))
        r = dist.all_reduce(s)
        return r, _sparse(s)

    def sparse_2d_dense_dims():
        s = torch.sparse_coo_tensor([[rank, 2], [0, 1]], [[1.0, float(rank)], [2.0, 1.0]], (ws + 2, 3, 2))
        dist.all_reduce(s)
        return _sparse(s)

    def sparse_uncoalesced_int():
        s = torch.sparse_coo_tensor([[1, 1, rank]], torch.tensor([1, 2, 3], dtype=torch.int64), (ws + 1,))
        dist.all_reduce(s)
        return _sparse(s)

    def sparse_empty_on_rank0():
        idx = [[]] if rank == 0 else [[rank]]
        s = torch.sparse_coo_tensor(idx, torch.ones(len(idx[0])), (ws,))
        dist.all_reduce(s)
        return _sparse(s)

    def sparse_async():
        s = torch.sparse_coo_tensor([[0]], [float(rank + 1)], (2,))
        work = dist.all_reduce(s, async_op=True)
        work.wait()
        return _sparse(s)

    def sparse_max():
        s = torch.sparse_coo_tensor([[0]], [1.0], (2,))
        return dist.all_reduce(s, op=dist.ReduceOp.MAX)

    def expanded():
        # what autograd hands a custom Function's backward for the grad of a sum: stride 0
        t = full(1, value=rank + 1).expand(4)
        dist.all_reduce(t)
        return _np(t), t.stride()

    def expanded_2d():
        t = (torch.arange(3.0) + rank).unsqueeze(0).expand(2, 3)
        dist.all_reduce(t)
        return _np(t)

    def a2a_noncontiguous_input():
        inp = torch.arange(2.0 * ws).reshape(2, ws).t()
        return dist.all_to_all_single(full(ws, 2), inp)

    def a2a_noncontiguous_output():
        out = full(2, ws).t()
        dist.all_to_all_single(out, torch.arange(2.0 * ws).reshape(ws, 2) + 10 * rank)
        return _np(out)

    def monitored_barrier_float():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            r = dist.monitored_barrier(timeout=20.0)
        return r, [str(w.message) for w in caught]

    def irecv_any_source():
        if rank == 0:
            got = []
            for _ in range(ws - 1):
                t = full(1)
                work = dist.irecv(t)
                work.wait()
                got.append((work._source_rank(), float(t[0])))
            return sorted(got)
        dist.send(full(1, value=rank * 10), 0)
        return None

    return {
        "all_reduce_coalesced/sync": coalesced_sync,
        "all_reduce_coalesced/async": coalesced_async,
        "all_reduce_coalesced/single_tensor": coalesced_single_tensor,
        "all_reduce_coalesced/complex_max": coalesced_complex_max,
        "all_gather_coalesced/sync": gather_coalesced_sync,
        "all_gather_coalesced/async": gather_coalesced_async,
        "all_gather_coalesced/not_a_list": gather_coalesced_not_a_list,
        "sparse/1d": sparse_1d,
        "sparse/2d_dense_dims": sparse_2d_dense_dims,
        "sparse/uncoalesced_int": sparse_uncoalesced_int,
        "sparse/empty_on_rank0": sparse_empty_on_rank0,
        "sparse/async": sparse_async,
        "sparse/max": sparse_max,
        "expanded/1d": expanded,
        "expanded/2d": expanded_2d,
        "all_to_all_single/noncontiguous_input": a2a_noncontiguous_input,
        "all_to_all_single/noncontiguous_output": a2a_noncontiguous_output,
        "monitored_barrier/float_timeout": monitored_barrier_float,
        "irecv/any_source": irecv_any_source,
    }


def _attempt(fn: Callable[[], Any]) -> tuple:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            value = ("returned", fn())
        except Exception as exc:  # noqa: BLE001 - what we are here to see
            value = ("raised", type(exc).__name__, [c.__name__ for c in type(exc).__mro__], str(exc))
    future_warnings = sorted({str(w.message) for w in caught if issubclass(w.category, FutureWarning)})
    return value + (future_warnings,)


def _profiled(dist) -> list[str]:
    import torch

    t = torch.ones(8)
    for _ in range(3):  # the engine's fast path (if any) is installed by now
        dist.all_reduce(t)
    rank, ws = dist.get_rank(), dist.get_world_size()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            dist.all_reduce(t)
        dist.barrier()
        if ws > 1:  # point-to-point: a ring
            work = dist.isend(t, (rank + 1) % ws)
            dist.recv(torch.empty(8), (rank - 1) % ws)
            work.wait()
    return sorted(e.name for e in prof.events() if ":" in e.name and any(
        op in e.name for op in ("all_reduce", "barrier", "send", "recv")))


def run(rank: int, ws: int, plans: list[tuple[str, str, int]]) -> dict[str, Any]:
    import torch  # noqa: F401

    out: dict[str, Any] = {}
    for framework, backend, port in plans:
        dist = importlib.import_module("torch.distributed" if framework == "torch" else "distcomm")
        os.environ["MASTER_PORT"] = str(port)
        dist.init_process_group(backend, timeout=timedelta(seconds=60))
        res = {name: _attempt(fn) for name, fn in cases(dist, rank, ws).items()}
        dist.barrier()
        res["profiler"] = _profiled(dist)
        dist.destroy_process_group()
        out[framework] = res
    return out
