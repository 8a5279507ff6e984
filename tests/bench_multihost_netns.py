"""All_reduce across 2 namespaced hosts x 2 ranks: the default engine (shared memory inside a
host, TCP between hosts) against the TCP engine alone (``backend="tcp"``). Needs root.

    sudo PYTHONPATH=src python tests/bench_multihost_netns.py [repeat] [NAME=VALUE ...]

Prints a markdown table: the slowest rank's median wall time per call and median CPU time per call
(the process's, all threads), and the wall-time ratio. The engines alternate call by call. No timing
is asserted anywhere; on a shared machine compare ratios within one run, not times across runs.
``NAME=VALUE`` arguments are set in the workers' environment, e.g.
``DISTCOMM_THRESHOLD_ALLREDUCE_HIERARCHICAL_BYTES=1000000000000`` turns the hierarchy off (the default
engine then runs the flat generic algorithms over shared memory and TCP).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import netns  # noqa: E402
from test_multihost_netns import Job, _env  # noqa: E402

SIZES = [256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
ITERATIONS = [30, 20, 12, 8, 5]


def main() -> None:
    reason = netns.unavailable()
    if reason:
        sys.exit(f"cannot run: {reason}")
    repeat = int(sys.argv[1]) if len(sys.argv) > 1 and "=" not in sys.argv[1] else 1
    extra = dict(a.split("=", 1) for a in sys.argv[1:] if "=" in a)
    out = tempfile.mkdtemp(prefix="distcomm-bench-netns-")
    with netns.Network(2) as net:
        job = Job(net, out, "bench", [",".join(map(str, SIZES)), ",".join(str(n * repeat) for n in ITERATIONS)],
                  env=_env(**extra))
        if job.wait(deadline=600) != [0, 0]:
            sys.exit(job.outputs())
    with open(os.path.join(out, "bench.json")) as f:
        res = json.load(f)
    print("| size | default engine (shm + TCP): wall, CPU | TCP engine: wall, CPU | TCP / default (wall) |")
    print("|---:|---:|---:|---:|")
    for n in SIZES:
        (dw, dc), (tw, tc) = res["default"][str(n)], res["tcp"][str(n)]
        label = f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"
        print(f"| {label} | {dw * 1e3:.2f} ms, {dc * 1e3:.2f} ms | {tw * 1e3:.2f} ms, {tc * 1e3:.2f} ms | {tw / dw:.2f} |")
    phases = res.get("phases", {})
    if phases:
        names = list(next(iter(phases.values())))
        print()
        print("default engine's hierarchical phases, slowest rank's median wall, thread CPU:")
        print("| size | " + " | ".join(names) + " |")
        print("|---:|" + "---:|" * len(names))
        for n in SIZES:
            if str(n) in phases:
                label = f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"
                cells = [f"{w * 1e3:.2f} ms, {c * 1e3:.2f} ms" for w, c in (phases[str(n)][k] for k in names)]
                print(f"| {label} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
