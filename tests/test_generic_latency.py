"""The generic engine's latency path (backends/generic_latency.py), on the TCP engine.

Each call is made through the engine's FastPath (``engine.fast_path(group)``, the seam ProcessGroup
calls), so a result says both that the path took the call (it returned True) and what it computed:

* SUM, MAX and AVG of numpy arrays (1-D and 2-D) and torch tensors, against the arithmetic, at world
  sizes 2 and 3 (recursive doubling with a folded rank);
* rank 0 on the path and the others on the general path (async_op=True), and the other way round:
  the two make the same messages, or this hangs until the harness's deadline;
* what it declines (PREMUL_SUM, too large, empty, bfloat16, a busy group), having done nothing;
* the flight recorder's records, and the public API's calls taking the path;
* a call that times out names the op, sequence number and rank.
"""

from __future__ import annotations

import pytest

from harness import run_world


def _body(rank, world):
    from datetime import timedelta

    import numpy as np
    import torch

    import distcomm as dist
    from distcomm import flight_recorder as fr
    from distcomm.backends import generic_latency

    dist.init_process_group("tcp", timeout=timedelta(seconds=60))
    g = dist.group.WORLD
    paths = g.engine.fast_path(g)
    SUM, MAX, AVG = dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.AVG
    total = world * (world + 1) // 2

    a = np.full(3, float(rank + 1), np.float32)
    assert paths.all_reduce(a, SUM) and a.tolist() == [float(total)] * 3
    m = np.array([[rank, -rank]], np.int64)
    assert paths.all_reduce(m, MAX) and m.tolist() == [[world - 1, 0]]
    t = torch.full((2, 2), float(rank + 1), dtype=torch.float64)
    assert paths.all_reduce(t, AVG) and t.flatten().tolist() == [total / world] * 4
    records = [(e[fr.OP], e[fr.SEQ], e[fr.STATE]) for e in fr.recorder.entries() if e[fr.GROUP] == g.group_name]
    assert records[-3:] == [("all_reduce", s, "completed") for s in (1, 2, 3)], records

    # one rank on the path, the others on the general path, then the other way round
    for first in (0, world - 1):
        b = np.full(2, float(rank), np.float32)
        if rank == first:
            assert paths.all_reduce(b, SUM)
        else:
            dist.all_reduce(b, async_op=True).wait()
        assert b.tolist() == [float(world * (world - 1) // 2)] * 2, (first, b)

    # what it declines, having done nothing (every rank alike: the group stays in step)
    busy = dist.all_reduce(np.ones(1), async_op=True)  # queued work: the path must not jump it
    declined = [
        paths.all_reduce(np.ones(2, np.float32), dist._make_nccl_premul_sum(2.0)),
        paths.all_reduce(np.ones(generic_latency.LIMIT // 4 + 1, np.float32), SUM),
        paths.all_reduce(np.ones(0, np.float32), SUM),
        paths.all_reduce(torch.ones(2, dtype=torch.bfloat16), SUM),
        paths.all_reduce(np.ones(4)[::2], SUM),  # not contiguous
    ]
    busy.wait()
    assert declined == [False] * 5, declined
    c = np.full(2, 1.0)
    dist.all_reduce(c)  # the public API: through the path (the group is idle again)
    assert c.tolist() == [float(world)] * 2
    last = [e for e in fr.recorder.entries() if e[fr.GROUP] == g.group_name][-1]
    assert (last[fr.OP], last[fr.STATE], last[fr.SITE][0].co_name) == ("all_reduce", "completed", "_body")

    # a call that times out: rank 1 joins late, past the group's timeout
    s = dist.new_group(list(range(world)), timeout=timedelta(seconds=1.5))
    spaths = s.engine.fast_path(s)
    dist.barrier()
    outcome = "ok"
    if rank == 1:
        import time

        time.sleep(3)
    else:
        try:
            spaths.all_reduce(np.ones(2), SUM)
        except Exception as exc:  # noqa: BLE001 - checked below
            outcome = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    dist.destroy_process_group()
    return outcome


@pytest.mark.parametrize("world", [2, 3])
def test_generic_latency_path(world):
    results = run_world(_body, world, timeout=120)
    assert results[1] == "ok"
    for rank in (0, *range(2, world)):
        assert results[rank].startswith(f"DistTimeoutError: all_reduce #1 on rank {rank}"), results[rank]
