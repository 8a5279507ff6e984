"""Shared pieces of the training tests (DDP, Join, ZeRO, distcomm.nn): worlds that run distcomm
and torch.distributed side by side in the same processes, so one spawn pays for both.

Each rank initializes distcomm's default group from the harness's env:// variables and torch's
gloo group on a second port given by the test; the functions below compare the two.

The world of 2 runs in the fast tier (``pytest -m "not slow"``): every training module's checks
against torch, in one spawn. The world of 3 (uneven shards, a rank in the middle) is marked slow.
"""

from __future__ import annotations

import os


def init_both(rank: int, world_size: int, torch_port: int):
    """distcomm's world (env://, default engine) and torch's gloo world on ``torch_port``."""
    import torch
    import torch.distributed as tdist

    import distcomm

    torch.set_num_threads(1)
    distcomm.init_process_group("gloo")
    tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{torch_port}", rank=rank, world_size=world_size)
    return distcomm, tdist


def shutdown_both() -> None:
    import torch.distributed as tdist

    import distcomm

    distcomm.destroy_process_group()
    tdist.destroy_process_group()


def max_diff(a, b) -> float:
    """Largest absolute difference between two lists (or dicts) of tensors."""
    import torch

    if isinstance(a, dict):
        assert a.keys() == b.keys(), (a.keys(), b.keys())
        a, b = list(a.values()), list(b.values())
    assert len(a) == len(b)
    worst = 0.0
    for x, y in zip(a, b):
        assert x.shape == y.shape, (x.shape, y.shape)
        worst = max(worst, float((x.double() - y.double()).abs().max()) if x.numel() else 0.0)
    return worst


def snapshot(module) -> dict:
    """Detached copies of a module's parameters and buffers, by name."""
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def env_flag(name: str) -> bool:
    return os.environ.get(name, "") not in ("", "0")


# -- one world per world size for every training test module ---------------------------------------
# Modules that define ``world_checks(rank, world_size, dc, tdist) -> dict`` (run inside the world).
SCENARIO_MODULES = ("test_ddp", "test_join", "test_zero", "test_nn_functional")
_worlds: dict[int, list] = {}


def _all_scenarios(rank: int, world_size: int, torch_port: int) -> dict:
    import importlib
    import time
    import traceback

    dc, tdist = init_both(rank, world_size, torch_port)
    results: dict = {}
    for name in SCENARIO_MODULES:
        start = time.perf_counter()
        try:
            results[name] = importlib.import_module(name).world_checks(rank, world_size, dc, tdist)
        except Exception:  # noqa: BLE001 - reported by that module's tests, the others still run
            results[name] = {"error": traceback.format_exc()}
        results[name]["seconds"] = time.perf_counter() - start
    shutdown_both()
    return results


def shared_world(world_size: int, module: str) -> list[dict]:
    """Per rank, the results of ``module``'s world_checks; the world runs once per session."""
    import pytest

    from harness import free_port, run_world

    if world_size not in _worlds:
        _worlds[world_size] = run_world(_all_scenarios, world_size, args=(free_port(),), timeout=150)
    per_rank = [r[module] for r in _worlds[world_size]]
    for rank, r in enumerate(per_rank):
        if "error" in r:
            pytest.fail(f"{module}.world_checks failed on rank {rank}:\n{r['error']}")
    return per_rank
