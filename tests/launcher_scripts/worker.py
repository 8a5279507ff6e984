"""A launcher test worker: meets the other ranks through the launcher's store, then behaves as told.

It reads the launcher's environment contract (RANK, WORLD_SIZE, MASTER_ADDR/PORT,
DISTCOMM_STORE_PREFIX, ...), connects to the job store as a client, counts itself in under its
round's prefix (failing if it ever sees more ranks than WORLD_SIZE, i.e. stale keys of an earlier
round), waits for every rank, and prints one ``meet`` line. Then the options below make it fail in
one of the ways the launcher must report. Its pid (and its child's, with --grandchild) goes to
``$TEST_PID_DIR`` so tests can check that nothing is left behind.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta


def connect():
    from distcomm.store import TCPStore

    return TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), None, False, timedelta(seconds=30))


def record_pid(tag, pid):
    directory = os.environ.get("TEST_PID_DIR")
    if directory:
        with open(os.path.join(directory, f"{tag}.{pid}"), "w") as f:
            f.write(str(pid))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--fail-rank", type=int, default=-1)
    p.add_argument("--how", default="raise", choices=["raise", "exit", "sigkill"])
    p.add_argument("--fail-attempts", type=int, default=1000, help="fail only while RESTART_COUNT < this")
    p.add_argument("--others", default="finish", choices=["finish", "hang", "ignore-term"])
    p.add_argument("--grandchild", action="store_true", help="start a sleeping child process first")
    p.add_argument("--lines", type=int, default=0, help="print this many long lines in fragments")
    p.add_argument("--no-meet", action="store_true")
    p.add_argument("--leave-shm", action="store_true", help="create a run-named file in $DISTCOMM_SHM_DIR")
    p.add_argument("rest", nargs="*")
    a = p.parse_args()

    env = os.environ
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    attempt = int(env["TORCHELASTIC_RESTART_COUNT"])
    print(f"stderr line of rank {rank}", file=sys.stderr, flush=True)
    if a.leave_shm:  # named as the shared-memory transport names its segments
        name = f"distcomm-{env['TORCHELASTIC_RUN_ID']}-{attempt}-rank{rank}"
        with open(os.path.join(env["DISTCOMM_SHM_DIR"], name), "wb") as f:
            f.write(b"\0" * 4096)
    if a.grandchild:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        record_pid("grandchild", child.pid)

    def on_term(signum, frame):
        print(f"got signal {signum}", flush=True)
        if a.others != "ignore-term":
            sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    # only now: a test that signals the workers once their pids are in knows they will say so
    record_pid("worker", os.getpid())

    if not a.no_meet:
        store = connect()
        prefix = env["DISTCOMM_STORE_PREFIX"]
        arrived = store.add(f"{prefix}/arrived", 1)
        if arrived > world:
            raise RuntimeError(f"stale keys: {arrived} arrivals for world size {world}")
        store.set(f"{prefix}/rank{rank}", env["GROUP_RANK"])
        while store.add(f"{prefix}/arrived", 0) < world:
            time.sleep(0.02)
        nodes = [store.get(f"{prefix}/rank{r}").decode() for r in range(world)]
        keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE",
                "TORCHELASTIC_RESTART_COUNT", "OMP_NUM_THREADS", "DISTCOMM_STORE_PREFIX"]
        print("meet " + json.dumps({"env": {k: env.get(k) for k in keys}, "nodes": nodes, "argv": sys.argv[1:]}),
              flush=True)

    for i in range(a.lines):
        line = f"line {i} of rank {rank} " + "x" * (100 + i % 300) + " end\n"
        for j in range(0, len(line), 37):  # fragments: the launcher must reassemble lines
            os.write(1, line[j:j + 37].encode())

    failing_round = a.fail_rank >= 0 and attempt < a.fail_attempts
    if rank == a.fail_rank and failing_round:
        time.sleep(0.2)
        if a.how == "raise":
            raise ValueError(f"boom from rank {rank}")
        if a.how == "exit":
            sys.exit(3)
        os.kill(os.getpid(), signal.SIGKILL)
    if a.others in ("hang", "ignore-term") and failing_round:  # wait to be stopped
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            time.sleep(0.05)
    print(f"done rank {rank}", flush=True)


if __name__ == "__main__":
    main()
