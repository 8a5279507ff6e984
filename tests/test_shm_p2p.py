"""Point-to-point over the shared-memory transport, through the public API.

Sizes that go inline through a ring, that are read directly from the sender's memory
(process_vm_readv), and that stream through a ring smaller than the message (direct reads off,
4 KiB rings); messages that arrive before their receive (unexpected), tags received out of order,
the non-overtaking order of one tag, ANY_SOURCE, batch_isend_irecv, and a size
mismatch reported as an error on the receiver.

Tiers: slow (a world of 3 per variant). In the fast tier (``pytest -m "not slow"``),
test_differential's world of 2 runs point-to-point on the default engine (shared memory on one
host) against torch: send/recv with tags and empty messages, any source, isend/irecv and
batch_isend_irecv.
"""

from __future__ import annotations

import numpy as np
import pytest

from harness import run_world

pytestmark = pytest.mark.slow


def _data(rank: int, n: int, salt: int = 0) -> np.ndarray:
    return np.random.default_rng(100 * salt + rank).standard_normal(n)


def p2p_body(rank, world):
    import distcomm as dist

    dist.init_process_group("shm")
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    for i, n in enumerate([0, 10, 70_000, 400_000]):
        recv = np.zeros(n)
        reqs = [dist.irecv(recv, src=prv), dist.isend(_data(rank, n, i), dst=nxt)] if rank % 2 else [
            dist.isend(_data(rank, n, i), dst=nxt), dist.irecv(recv, src=prv)]
        for r in reqs:
            r.wait()
        assert np.array_equal(recv, _data(prv, n, i)), n
    dist.barrier()

    if rank == 0:  # sent before the receives are posted; tags received in another order
        dist.send(_data(0, 90_000, 5), dst=1, tag=1)
        dist.send(_data(0, 300, 6), dst=1, tag=2)
        for v in range(20):
            dist.isend(np.full(3, v, np.int64), dst=1, tag=3).wait()
    elif rank == 1:
        import time

        time.sleep(0.2)
        b = np.zeros(300)
        dist.recv(b, src=0, tag=2)
        assert np.array_equal(b, _data(0, 300, 6))
        a = np.zeros(90_000)
        dist.recv(a, src=0, tag=1)
        assert np.array_equal(a, _data(0, 90_000, 5))
        got = []
        for _ in range(20):
            c = np.zeros(3, np.int64)
            dist.recv(c, src=0, tag=3)
            got.append(int(c[0]))
        assert got == list(range(20)), got
    dist.barrier()

    if rank == 0:  # ANY_SOURCE
        sources = set()
        for _ in range(world - 1):
            b = np.zeros(5, np.int32)
            src = dist.recv(b)
            assert (b == src).all()
            sources.add(src)
        assert sources == set(range(1, world))
    else:
        dist.send(np.full(5, rank, np.int32), dst=0)
    dist.barrier()  # or a rank running ahead could send its next message into the any-source receive

    ops = [dist.P2POp(dist.isend, np.full(4, rank, np.float32), nxt),
           dist.P2POp(dist.irecv, buf := np.zeros(4, np.float32), prv)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    assert (buf == prv).all()

    error = None
    if rank == 0:
        dist.send(np.zeros(5), dst=1, tag=9)
    elif rank == 1:
        try:
            dist.recv(np.zeros(6), src=0, tag=9)
        except dist.DistBackendError as exc:
            error = str(exc)
        assert error and "does not match" in error, error
    dist.barrier()
    dist.destroy_process_group()
    return "ok"


@pytest.mark.parametrize(
    "env",
    [{}, {"DISTCOMM_SHM_DIRECT": "0", "DISTCOMM_SHM_RING_BYTES": "4096"}],
    ids=["direct-reads", "streaming-4k-rings"],
)
def test_point_to_point(env):
    assert run_world(p2p_body, 3, env=env, timeout=120) == ["ok"] * 3
