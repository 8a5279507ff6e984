"""The shared-memory algorithms where peers write into each other's memory (process_vm_writev):
"broadcast_split" (the root writes the tail of its buffer into every reader while each reads the
head) and "gather_writev" (every peer writes its block into the root's output for it), against
numpy at world sizes 1-5 and 8, sizes 0, 1, prime, over a slot and (slow tier) a few MiB not a
multiple of a page, every root, numpy arrays and torch tensors.

The algorithm under test is forced (``DISTCOMM_SHM_ALGO_<OP>``) and the engine's observer checks it
ran, so a fall-back to slots cannot pass for it. Calls are async so that the latency paths never
intercept them; each rank's input differs per rank and per call, and the root's own input (gather)
and the readers' stale contents (broadcast) are set to values the result must not keep.
"""

from __future__ import annotations

import numpy as np
import pytest

from harness import run_world

FORCED = {"DISTCOMM_SHM_ALGO_BROADCAST": "split", "DISTCOMM_SHM_ALGO_GATHER": "writev",
          "DISTCOMM_SHM_SLOT_BYTES": "4096"}
SMALL = (0, 1, 7, 1031, 5003)  # 5003 float32: over a page, so the root writes a tail at two ranks
LARGE = (3 * (1 << 20) // 4 + 13,)


def _data(rank: int, n: int, salt: int) -> np.ndarray:
    return np.random.default_rng(1000 * salt + rank).standard_normal(n).astype(np.float32)


def _check(what, got, want):
    if not np.array_equal(got, want):
        bad = np.flatnonzero(got != want)
        raise AssertionError(f"{what}: {bad.size} wrong elements of {want.size}, first at {bad[:5].tolist()}")


def body(rank, world, sizes, tensors):
    import distcomm as dist
    from distcomm.backends.shm import observe

    ran: list[str] = []
    observe.set_observer(ran.append)
    dist.init_process_group("shm")
    if tensors == "torch":
        import torch

        wrap, back = torch.from_numpy, lambda t: t.numpy()
    else:
        wrap, back = (lambda a: a), (lambda a: a)
    salt = 0
    for n in sizes:
        for root in range(world):
            salt += 1
            buf = wrap(_data(rank, n, salt) if rank == root else np.full(n, -1.0, np.float32))
            dist.broadcast(buf, src=root, async_op=True).wait()
            _check(f"broadcast n={n} root {root}", back(buf), _data(root, n, salt))

            mine = wrap(_data(rank, n, salt))
            outs = [wrap(np.full(n, -1.0, np.float32)) for _ in range(world)] if rank == root else None
            dist.gather(mine, outs, dst=root, async_op=True).wait()
            if rank == root:
                for q in range(world):
                    _check(f"gather n={n} root {root} block {q}", back(outs[q]), _data(q, n, salt))
            _check(f"gather n={n}: the input left as it was", back(mine), _data(rank, n, salt))
    dist.destroy_process_group()
    if world > 1:
        for name in ("broadcast_split", "gather_writev"):
            if name not in ran:
                raise AssertionError(f"{name} never ran; ran: {sorted(set(ran))}")
    return "ok"


def _run(world, sizes, tensors="numpy", timeout=120):
    assert run_world(body, world, args=(sizes, tensors), env=FORCED, timeout=timeout) == ["ok"] * world


def test_two_ranks():
    _run(2, SMALL)


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 3, 4, 5, 8])
def test_other_worlds(world):
    _run(world, SMALL, timeout=240)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_a_few_mib(world):
    _run(world, LARGE, timeout=240)


@pytest.mark.slow
def test_torch_tensors():
    _run(2, SMALL + LARGE, "torch", timeout=240)
