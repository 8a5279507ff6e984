"""Run every tutorial program of one framework in this one process: ``python run_all.py torch``.

Each program runs as its own ``__main__`` (runpy), exactly as ``python <program>.py`` would run it,
so it starts its processes with torch.multiprocessing.Process (fork: the children inherit the
already imported torch, and starting them costs no import). Importing torch once for all programs
keeps the test fast on a small machine. Each program's output follows a line ``=== <name>``;
``=== <name> exit codes [...]`` reports its processes' exit codes.
"""

import os
import runpy
import socket
import sys

PROGRAMS = ["p2p_blocking", "p2p_nonblocking", "allreduce_group", "ring_allreduce", "sgd"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(framework: str, names: list[str]) -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    # One write per line, whoever prints it (the forked ranks share this stream): lines of
    # different ranks may come in any order but never mix (the test sorts them).
    sys.stdout.reconfigure(line_buffering=True, write_through=False)
    import torch  # noqa: F401 - once, before the programs fork

    for name in names:
        os.environ["MASTER_PORT"] = str(free_port())
        print(f"=== {name}", flush=True)
        namespace = runpy.run_path(os.path.join(here, f"{name}_{framework}.py"), run_name="__main__")
        codes = [p.exitcode for p in namespace.get("processes", [])]
        sys.stdout.flush()
        print(f"=== {name} exit codes {codes}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:] or PROGRAMS)
