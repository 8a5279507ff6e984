"""``python -m distcomm.bench [<benchmark>] [options]``: a dispatcher to the benchmark modules.

Why only a table of names: each benchmark owns its options and output; this file just finds the
module (imported on demand, so one benchmark's imports never slow another down) and calls its
``main(argv)``. Without a benchmark name the collectives benchmark runs (``distcomm-bench --world 4``).
"""

from __future__ import annotations

import importlib
import sys

# subcommand -> module with main(argv) -> int
BENCHMARKS = {
    "collectives": "distcomm.bench.collectives",
    "store": "distcomm.bench.store",
    "ddp": "distcomm.bench.ddp",
    "torch-backend": "distcomm.bench.torch_backend_world",  # torch's API over backend "distcomm" vs gloo
    "pingpong": "distcomm.bench.pingpong",  # the TCP transport alone, two processes, no collectives
    "overview": "distcomm.bench.overview",  # not a benchmark: the README's table from saved results
}
DEFAULT = "collectives"


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in BENCHMARKS:
        name, rest = argv[0], argv[1:]
    else:
        name, rest = DEFAULT, argv
    module = importlib.import_module(BENCHMARKS[name])
    return module.main(rest) or 0


if __name__ == "__main__":
    sys.exit(main())
