"""distcomm-bench ddp: the time of one DistributedDataParallel training step, distcomm against torch.

Usage::

    python -m distcomm.bench ddp                  # world 2, both models
    python -m distcomm.bench ddp --world 3 --models mlp --steps 50 --json ddp.json

One world runs everything, so both libraries meet the same machine at the same moment: each rank
initializes distcomm's default group (``--backend``, distcomm's default engine "gloo"), torch's
gloo group, and a torch group on the c10d backend "distcomm" (``distcomm.torch_backend``) of the
same ranks, through two stores the parent hosts. For each model, four variants train on the same
per-rank batches from the same initial weights:

- ``local``: the module alone, no communication (the compute floor);
- ``distcomm``: ``distcomm.parallel.DistributedDataParallel`` on distcomm's group;
- ``torch``: ``torch.nn.parallel.DistributedDataParallel`` on torch's gloo group;
- ``torch-distcomm``: torch's DistributedDataParallel on the torch group whose backend is
  "distcomm" (what a torch user gets by changing only the backend string).

A step is ``zero_grad; loss = f(model(x)); loss.backward(); optimizer.step()`` (SGD). After
``--warmup`` untimed steps of each, the variants take turns one step at a time, in an order that
rotates every step, so a burst of load on a shared machine hits every variant alike; an untimed
barrier starts each step on every rank together. A step's time is the slowest rank's; the table
shows the median over the ``--steps`` timed steps of each variant. The three DDPs see the same data, so their weights
must end equal: the table says so (``same result``), which checks the numbers being timed.

Models: ``demo-cnn`` is the demo's network (about 22 KB of gradients: one bucket, latency-bound);
``mlp`` is four 1024-wide linear layers (12.6 MiB of gradients: several buckets, bandwidth-bound,
where overlapping communication with backward matters).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time

from . import report
from .worlds import WorldFailed, connect_store, host_store, run_world

MODELS = ("demo-cnn", "mlp")
VARIANTS = ("local", "distcomm", "torch", "torch-distcomm")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="distcomm-bench ddp", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=2, help="number of ranks (default 2)")
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, from {', '.join(MODELS)}")
    p.add_argument("--steps", type=int, default=60, help="timed steps per variant (default 60)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps per variant first (default 5)")
    p.add_argument("--batch", type=int, default=64, help="samples per rank per step (default 64)")
    p.add_argument("--bucket-cap-mb", type=float, default=None, help="DDP bucket_cap_mb (default: DDP's 25)")
    p.add_argument("--backend", default="gloo", help="distcomm engine (default gloo, distcomm's default)")
    p.add_argument("--json", default=None, help="also write the results to this file")
    return p


# -- in each rank ---------------------------------------------------------------------------------
def _build(name: str, rank: int, batch: int):
    """(fresh-model factory, per-rank input, target, loss function) for a model name."""
    import torch
    import torch.nn.functional as F

    if name == "demo-cnn":
        from ..demo import make_net

        g = torch.Generator().manual_seed(100 + rank)  # the demo's 8x8 digits' shape; values do not matter here
        return make_net, torch.rand(batch, 1, 8, 8, generator=g), torch.randint(0, 10, (batch,), generator=g), F.nll_loss
    if name == "mlp":
        def make():
            width = 1024
            return torch.nn.Sequential(
                torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width), torch.nn.ReLU(),
                torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, 10))

        g = torch.Generator().manual_seed(100 + rank)
        return make, torch.randn(batch, 1024, generator=g), torch.randint(0, 10, (batch,), generator=g), F.cross_entropy
    raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")


def _rank_main(rank: int, send, world: int, dc_port: int, torch_port: int, config: dict) -> None:
    import torch
    import torch.distributed as tdist
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    import distcomm
    import distcomm.torch_backend  # noqa: F401 - registers torch's backend "distcomm"
    from distcomm.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    distcomm.init_process_group(config["backend"], store=connect_store("distcomm", dc_port, 120), rank=rank,
                                world_size=world)
    tdist.init_process_group("gloo", store=connect_store("torch", torch_port, 120), rank=rank, world_size=world)
    over_distcomm = tdist.new_group(backend="distcomm")
    ddp_kwargs = {} if config["bucket_cap_mb"] is None else {"bucket_cap_mb": config["bucket_cap_mb"]}
    for name in config["models"]:
        make, x, y, loss_fn = _build(name, rank, config["batch"])
        models, optims = {}, {}
        for variant in VARIANTS:
            torch.manual_seed(0)
            module = make()
            if variant == "distcomm":
                module = DistributedDataParallel(module, **ddp_kwargs)
            elif variant == "torch":
                module = TorchDDP(module, **ddp_kwargs)
            elif variant == "torch-distcomm":
                module = TorchDDP(module, process_group=over_distcomm, **ddp_kwargs)
            models[variant] = module
            optims[variant] = torch.optim.SGD(module.parameters(), lr=0.01)

        counters = dict.fromkeys(VARIANTS, 0)

        def step(variant):
            counters[variant] += 1
            torch.manual_seed(counters[variant])  # the same dropout masks for every variant's k-th step
            optims[variant].zero_grad()
            loss_fn(models[variant](x), y).backward()
            optims[variant].step()

        for variant in VARIANTS:
            for _ in range(config["warmup"]):
                step(variant)
        times = {v: [] for v in VARIANTS}
        for i in range(config["steps"]):
            shift = i % len(VARIANTS)
            for variant in VARIANTS[shift:] + VARIANTS[:shift]:
                distcomm.barrier()  # every rank starts the step together; not timed
                start = time.perf_counter()
                step(variant)
                times[variant].append(time.perf_counter() - start)
        params = sum(p.numel() for p in models["local"].parameters())
        diff = max(float((a - b).detach().abs().max()) for other in ("distcomm", "torch-distcomm") for a, b in
                   zip(models[other].module.parameters(), models["torch"].module.parameters()))
        send({"model": name, "times": times, "params": params, "grad_bytes": params * 4, "diff": diff,
              "buckets": len(models["distcomm"].reducer.buckets)})
    tdist.destroy_process_group()
    distcomm.destroy_process_group()


# -- in the parent --------------------------------------------------------------------------------
def _summarize(per_rank: list[dict]) -> dict:
    row = {k: per_rank[0][k] for k in ("model", "params", "grad_bytes", "buckets")}
    row["max_diff"] = max(r["diff"] for r in per_rank)
    for variant in VARIANTS:
        slowest = [max(step) for step in zip(*(r["times"][variant] for r in per_rank))]
        row[f"{variant}_ms"] = statistics.median(slowest) * 1e3
    row["speedup"] = row["torch_ms"] / row["distcomm_ms"]
    row["torch_backend_speedup"] = row["torch_ms"] / row["torch-distcomm_ms"]
    return row


def _table(rows: list[dict], world: int, config: dict) -> str:
    lines = [
        f"distcomm-bench ddp: world {world}, batch {config['batch']} per rank, {config['steps']} steps per variant "
        "(interleaved); median step time of the slowest rank",
        f"{'model':>9} {'params':>9} {'grads':>10} {'buckets':>7} {'local':>9} {'distcomm':>9} {'torch':>9} "
        f"{'torch on':>9} {'torch/':>9} {'torch/':>9}  same result",
        f"{'':>9} {'':>9} {'':>10} {'':>7} {'(ms)':>9} {'DDP (ms)':>9} {'DDP (ms)':>9} {'distcomm':>9} "
        f"{'distcomm':>9} {'torch on':>9}",
        f"{'':>9} {'':>9} {'':>10} {'':>7} {'':>9} {'':>9} {'gloo':>9} {'(ms)':>9} {'':>9} {'distcomm':>9}",
    ]
    for r in rows:
        same = "yes" if r["max_diff"] < 1e-4 else "NO"
        lines.append(
            f"{r['model']:>9} {r['params']:>9,} {report.format_bytes(r['grad_bytes']):>10} {r['buckets']:>7} "
            f"{r['local_ms']:>9.2f} {r['distcomm_ms']:>9.2f} {r['torch_ms']:>9.2f} {r['torch-distcomm_ms']:>9.2f} "
            f"{r['speedup']:>8.2f}x {r['torch_backend_speedup']:>8.2f}x  "
            f"{same} (max diff {r['max_diff']:.1e})")
    lines.append("torch/distcomm > 1: distcomm's DDP step is faster than torch's DDP over gloo; torch/torch on "
                 "distcomm > 1: torch's DDP is faster over the backend \"distcomm\" than over gloo. distcomm engine: "
                 f"{config['backend']} (distcomm's DDP); the torch backend's default engine (torch on distcomm).")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if importlib.util.find_spec("torch") is None:
        print("distcomm-bench ddp needs torch (pip install -e '.[torch]')", file=sys.stderr)
        return 1
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        _parser().error(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(MODELS)}")
    config = {"models": models, "steps": args.steps, "warmup": args.warmup,
              "batch": args.batch, "bucket_cap_mb": args.bucket_cap_mb, "backend": args.backend}
    dc_store = host_store("distcomm", 120)
    torch_store = host_store("torch", 120)
    results: dict[str, list] = {m: [None] * args.world for m in models}
    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    try:
        for rank, message in run_world(_rank_main, args.world,
                                       args=(args.world, dc_store.port, torch_store.port, config), env=env,
                                       describe=lambda m: f"reported {m.get('model')}"):
            results[message["model"]][rank] = message
    except WorldFailed as exc:
        print(f"distcomm-bench ddp: {exc}", file=sys.stderr)
        return 1
    rows = [_summarize(results[m]) for m in models]
    print(_table(rows, args.world, config))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"world": args.world, "config": config, "machine": report.machine(), "rows": rows}, f, indent=2)
    return 0
