"""all_gather and all_to_all on the shared-memory engine written straight into each output: into a
list of separate tensors and into one tensor, single copy (process_vm_readv) and through slots;
reduce_scatter and reduce_scatter_tensor reduced straight from each input, which stays as it was.

Each rank computes every rank's input (deterministic per rank) and checks its own outputs element
for element against what the collective's definition says lands there (the data-movement semantics
of ``_algorithms/reference.py``: block q of the result is rank q's input). The engine's observer
(backends/shm/observe.py) checks which algorithm ran, so a fall-back to the staging path or to slots
cannot pass for the single-copy one. Calls are async (``async_op=True``) so that the latency paths,
which take small synchronous calls, never intercept them.

``READV``: single copy from 2 KiB, slots of 4 KiB (small sizes take the algorithm under test);
``SLOTS``: single-copy reads off. Sizes: 0, 1, primes, and (slow tier) ~3 MiB with the default
slot size and threshold. Worlds 1-5 and 8 (oversubscribed on 2 cores: sizes stay small).

Tiers: the fast tier runs single copy at world 3 (a few seconds: one world); the rest is slow.
"""

from __future__ import annotations

import numpy as np
import pytest

from harness import run_world

READV = {"DISTCOMM_SHM_SLOT_BYTES": "4096", "DISTCOMM_SHM_THRESHOLD_READV_BYTES": "2048"}
SLOTS = {"DISTCOMM_SHM_SLOT_BYTES": "4096", "DISTCOMM_SHM_DIRECT": "0"}
SMALL = (0, 1, 7, 1031)  # 1031 float32 = 4124 B: over the 2 KiB threshold and over one 4 KiB slot
LARGE = (3 * (1 << 20) // 4 + 13,)  # ~3 MiB of float32, default slots: single copy by size


def _data(rank: int, n: int, salt: int) -> np.ndarray:
    return np.random.default_rng(1000 * salt + rank).standard_normal(n).astype(np.float32)


def _split(src: int, dst: int, n: int) -> int:
    """Elements rank src sends rank dst in the uneven all_to_all: differs per pair, 0 for some."""
    return 0 if n == 0 else n + (src * 3 + dst * 5) % 7 if (src + dst) % 4 else (n if src == dst else 0)


def _check(what, got, want):
    if not np.array_equal(got, want):
        bad = np.flatnonzero(got != want)
        raise AssertionError(f"{what}: {bad.size} wrong elements of {want.size}, first at {bad[:5].tolist()}")


def body(rank, world, sizes, tensors, expect):
    """Every form at every size; ``expect``: the algorithms that must have run for the sizes at or
    above the single-copy threshold ("readv" or "slots"), None for a group of one."""
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

    for salt, n in enumerate(sizes):
        ins = [_data(q, n, salt) for q in range(world)]
        # all_gather into a list of separate tensors
        outs = [wrap(np.full(n, -1.0, np.float32)) for _ in range(world)]
        dist.all_gather(outs, wrap(ins[rank].copy()), async_op=True).wait()
        for q in range(world):
            _check(f"all_gather list n={n} block {q}", back(outs[q]), ins[q])
        # the input is this rank's own output (torch allows it)
        outs = [wrap(np.full(n, -1.0, np.float32)) for _ in range(world)]
        back(outs[rank])[...] = ins[rank]
        dist.all_gather(outs, outs[rank], async_op=True).wait()
        for q in range(world):
            _check(f"all_gather list, input aliasing output, n={n} block {q}", back(outs[q]), ins[q])
        # all_gather_into_tensor
        flat = wrap(np.full(n * world, -1.0, np.float32))
        dist.all_gather_into_tensor(flat, wrap(ins[rank].copy()), async_op=True).wait()
        _check(f"all_gather_into_tensor n={n}", back(flat), np.concatenate(ins))

        # all_to_all of lists with uneven splits; piece (src -> dst) is data(src) salted by dst
        def piece(src, dst):
            return _data(src * world + dst, _split(src, dst, n), 50 + salt)

        sends = [wrap(piece(rank, q)) for q in range(world)]
        recvs = [wrap(np.full(_split(q, rank, n), -1.0, np.float32)) for q in range(world)]
        dist.all_to_all(recvs, sends, async_op=True).wait()
        for q in range(world):
            _check(f"all_to_all list n={n} from {q}", back(recvs[q]), piece(q, rank))
        # all_to_all_single with the same uneven splits
        send_counts = [_split(rank, q, n) for q in range(world)]
        recv_counts = [_split(q, rank, n) for q in range(world)]
        out = wrap(np.full(sum(recv_counts), -1.0, np.float32))
        inp = wrap(np.concatenate([piece(rank, q) for q in range(world)]))
        dist.all_to_all_single(out, inp, recv_counts, send_counts, async_op=True).wait()
        _check(f"all_to_all_single n={n}", back(out), np.concatenate([piece(q, rank) for q in range(world)]))

        _reduce_scatter_forms(dist, rank, world, n, salt, wrap, back)

    dist.destroy_process_group()
    if expect is not None:
        for op in ("allgather", "alltoall", "reduce_scatter"):
            want = f"{op}_{expect}"
            if want not in ran:
                raise AssertionError(f"{want} never ran; ran: {sorted(set(ran))}")
            other = f"{op}_{'slots' if expect == 'readv' else 'readv'}"
            if expect == "slots" and other in ran:
                raise AssertionError(f"{other} ran with single-copy reads off")
    return "ok"


def _fold(blocks):
    """The rank-order sum, as the shared-memory algorithms compute it (bit for bit)."""
    acc = blocks[0].copy()
    for b in blocks[1:]:
        acc += b
    return acc


def _reduce_scatter_forms(dist, rank, world, n, salt, wrap, back):
    """reduce_scatter of a list and reduce_scatter_tensor, read from the inputs in place: the result,
    the inputs left as they were, and the staged cases (an output overlapping an input, PREMUL_SUM)."""
    def block(src, dst):  # rank src's block for rank dst
        return _data(src * world + dst, n, 90 + salt)

    from distcomm.backends.shm import observe

    staged: list[str] = []
    seen = observe.current
    observe.set_observer(lambda name: (seen(name), staged.append(name) if name == "reduce_scatter_staged" else None))
    ins = [wrap(block(rank, q)) for q in range(world)]
    out = wrap(np.full(n, -1.0, np.float32))
    dist.reduce_scatter(out, ins, async_op=True).wait()
    _check(f"reduce_scatter list n={n}", back(out), _fold([block(q, rank) for q in range(world)]))
    for q in range(world):
        _check(f"reduce_scatter list n={n}: input {q} left as it was", back(ins[q]), block(rank, q))
    whole = wrap(np.concatenate([block(rank, q) for q in range(world)]))
    out = wrap(np.full(n, -1.0, np.float32))
    dist.reduce_scatter_tensor(out, whole, op=dist.ReduceOp.AVG, async_op=True).wait()
    _check(f"reduce_scatter_tensor AVG n={n}", back(out),
           _fold([block(q, rank) for q in range(world)]) / np.float32(world))
    _check(f"reduce_scatter_tensor n={n}: input left as it was", back(whole),
           np.concatenate([block(rank, q) for q in range(world)]))
    if world > 1 and staged:
        raise AssertionError(f"reduce_scatter n={n} staged its inputs: {staged}")
    # the output is this rank's own input block (a view of the input tensor): staged, still right
    whole = np.concatenate([block(rank, q) for q in range(world)])
    mine = whole[rank * n:(rank + 1) * n]
    dist.reduce_scatter_tensor(wrap(mine), wrap(whole), async_op=True).wait()
    _check(f"reduce_scatter_tensor into its own input block n={n}", mine, _fold([block(q, rank) for q in range(world)]))
    ins = [wrap(block(rank, q)) for q in range(world)]
    out = wrap(np.full(n, -1.0, np.float32))
    dist.reduce_scatter(out, ins, op=dist.ReduceOp.PREMUL_SUM(2.0), async_op=True).wait()
    _check(f"reduce_scatter PREMUL_SUM n={n}", back(out), _fold([block(q, rank) * np.float32(2.0) for q in range(world)]))
    _check(f"reduce_scatter PREMUL_SUM n={n}: input left as it was", back(ins[0]), block(rank, 0))
    observe.set_observer(seen)
    if world > 1 and len(staged) != (2 if n else 1):  # an empty output overlaps nothing
        raise AssertionError(f"reduce_scatter n={n}: the output overlapping an input and PREMUL_SUM should stage: {staged}")


def _run(world, sizes, tensors, env, expect, timeout=120):
    assert run_world(body, world, args=(sizes, tensors, expect), env=env, timeout=timeout) == ["ok"] * world


def test_single_copy_into_each_output():
    _run(3, SMALL, "numpy", READV, "readv")


@pytest.mark.slow
def test_single_copy_two_ranks():
    _run(2, SMALL, "numpy", READV, "readv")


@pytest.mark.slow
def test_through_slots_without_direct_reads():
    _run(2, SMALL, "numpy", SLOTS, "slots")


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 4, 5, 8])
def test_single_copy_other_worlds(world):
    _run(world, SMALL, "numpy", READV, "readv" if world > 1 else None, timeout=240)


@pytest.mark.slow
@pytest.mark.parametrize("world", [3, 5])
def test_through_slots_other_worlds(world):
    _run(world, SMALL, "numpy", SLOTS, "slots", timeout=240)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_large_messages_default_tuning(world):
    _run(world, LARGE, "numpy", {}, "readv", timeout=240)


@pytest.mark.slow
def test_torch_tensors():
    _run(3, SMALL + LARGE, "torch", READV, "readv", timeout=240)
