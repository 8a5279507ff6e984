"""Store benchmark: distcomm's TCPStore against torch's, in the same run, on the same machine.

Why these two numbers: a store is on every job's start-up path (rendezvous, process-group
creation, barriers built on add/wait), where what matters is the latency of one request from one
rank (set+get round trip) and how many requests per second the master sustains when every rank
hits it at once (add() from many processes).

How it measures: each store's master runs in a fresh subprocess (so the measuring process has no
server thread competing for its GIL); the round trip is timed per iteration from a client in this
process, and from the master's own client inside the server process (rank 0's situation). For
throughput, worker processes forked from this one connect, wait at a start key, do ``--adds``
add() calls each, and report their first/last timestamps (CLOCK_MONOTONIC, comparable across
processes); throughput = all adds / (last end - first start). Next to it, the CPU time per add() of
the server process (user + system from /proc, over the run) and of the clients (process_time,
summed): steadier than the rate on a shared machine, and with few CPUs the clients' CPU caps the
rate as much as the server's. Implementations alternate over
``--rounds`` rounds and the table shows the median round, because this machine is shared and noisy.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import timedelta

# distcomm-tcp: distcomm with same-host clients kept on loopback TCP (no Unix-socket shortcut),
# the transport torch's store uses, to show what each of the two contributes.
# distcomm-server: distcomm's server with torch's C++ clients (it speaks their protocol,
# torch_wire.py): on a machine with few CPUs the 32 client processes' CPU caps the add() rate as
# much as the server's, so this row compares the two servers behind the same clients.
# torch-server: the other way round, torch's C++ server behind distcomm's clients (they speak its
# protocol, torch_client.py): with the row above it tells which side of distcomm's caps the rate.
IMPLEMENTATIONS = ("distcomm", "distcomm-tcp", "distcomm-server", "torch-server", "torch")
_NO_LOCAL_SOCKET = {"DISTCOMM_STORE_LOCAL_SOCKET": "0"}
_TIMEOUT = timedelta(seconds=120)


def _server_library(impl: str) -> str:
    return "torch" if impl in ("torch", "torch-server") else "distcomm"


def _tcp_store(impl: str, port: int, is_master: bool):
    if impl == "torch" or (impl == "distcomm-server" and not is_master) or (impl == "torch-server" and is_master):
        import torch.distributed as backend
    else:
        import distcomm.store as backend
    return backend.TCPStore("127.0.0.1", port, None, is_master, _TIMEOUT)


def _round_trips(store, iterations: int) -> list[float]:
    value = b"v" * 8
    for _ in range(min(500, iterations)):  # warm-up
        store.set("bench/key", value)
        store.get("bench/key")
    times = []
    clock = time.perf_counter
    for _ in range(iterations):
        start = clock()
        store.set("bench/key", value)
        store.get("bench/key")
        times.append(clock() - start)
    return times


def _percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _latency(samples: list[float]) -> dict:
    return {"p50_us": _percentile(samples, 0.50) * 1e6, "p99_us": _percentile(samples, 0.99) * 1e6}


def serve(impl: str) -> None:
    """Subprocess entry: host a master, print its port, then run commands from stdin until EOF."""
    master = _tcp_store(impl, 0, True)
    print(master.port, flush=True)
    for line in sys.stdin:
        command, _, arg = line.strip().partition(" ")
        if command == "local":
            print(json.dumps(_latency(_round_trips(master, int(arg)))), flush=True)


class _Server:
    def __init__(self, impl: str):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "distcomm.bench.store", "--serve", _server_library(impl)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,  # torch's store logs warnings there
            text=True,
        )
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the {impl} store server process exited before printing its port")
        self.port = int(line)

    def local_latency(self, iterations: int) -> dict:
        self.proc.stdin.write(f"local {iterations}\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def cpu_seconds(self) -> float:
        """The server process's CPU time so far (user + system, all its threads)."""
        return _process_cpu(self.proc.pid)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.kill()
        self.proc.wait()


def _process_cpu(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (Linux /proc; NaN elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def _add_worker(impl: str, port: int, index: int, adds: int, conn) -> None:
    try:
        store = _tcp_store(impl, port, False)
        store.set(f"ready/{index}", "1")
        store.wait(["go"])
        clock = time.perf_counter
        cpu = time.process_time
        start, start_cpu = clock(), cpu()
        for _ in range(adds):
            store.add("bench/counter", 1)
        conn.send((start, clock(), adds, cpu() - start_cpu))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        conn.send(repr(exc))
    finally:
        conn.close()


def _throughput(impl: str, server: _Server, workers: int, adds: int) -> dict:
    """add()/s over all workers, and the CPU per add() of the server and of a client (µs): on a
    machine with few CPUs the clients' CPU caps the rate as much as the server's."""
    ctx = mp.get_context("fork")  # forked, not spawned: 32 fresh interpreters importing torch take ages
    pipes, procs = [], []
    for index in range(workers):
        receiver, sender = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_add_worker, args=(impl, server.port, index, adds, sender), daemon=True)
        proc.start()
        sender.close()
        pipes.append(receiver)
        procs.append(proc)
    try:
        store = _tcp_store(impl, server.port, False)
        store.wait([f"ready/{i}" for i in range(workers)])
        server_cpu = server.cpu_seconds()
        store.set("go", "1")
        reports = [pipe.recv() for pipe in pipes]
        server_cpu = server.cpu_seconds() - server_cpu
    finally:
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
    failures = [r for r in reports if isinstance(r, str)]
    if failures:
        raise RuntimeError(f"{len(failures)} {impl} add() workers failed, e.g. {failures[0]}")
    first = min(r[0] for r in reports)
    last = max(r[1] for r in reports)
    total = sum(r[2] for r in reports)
    return {
        "adds_per_s": total / (last - first),
        "server_us_per_add": server_cpu / total * 1e6,
        "client_us_per_add": sum(r[3] for r in reports) / total * 1e6,
    }


def _measure(impl: str, args) -> dict:
    saved = dict(os.environ)
    if impl == "distcomm-tcp":
        os.environ.update(_NO_LOCAL_SOCKET)  # inherited by the server subprocess and the forked workers
    try:
        return _measure_in_env(impl, args)
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _measure_in_env(impl: str, args) -> dict:
    server = _Server(impl)
    try:
        client = _tcp_store(impl, server.port, False)
        remote = _latency(_round_trips(client, args.iters))
        del client
        local = server.local_latency(args.iters)
        throughput = _throughput(impl, server, args.workers, args.adds)
    finally:
        server.close()
    return {"client": remote, "master": local, **throughput}


def _available(impl: str) -> bool:
    if impl in ("distcomm", "distcomm-tcp"):
        return True
    try:
        import torch.distributed  # noqa: F401
    except ImportError:
        return False
    return True


def _median_round(rounds: list[dict]) -> dict:
    def med(path):
        values = []
        for r in rounds:
            value = r
            for part in path:
                value = value[part]
            values.append(value)
        return statistics.median(values)

    return {
        "client": {"p50_us": med(("client", "p50_us")), "p99_us": med(("client", "p99_us"))},
        "master": {"p50_us": med(("master", "p50_us")), "p99_us": med(("master", "p99_us"))},
        "adds_per_s": med(("adds_per_s",)),
        "server_us_per_add": med(("server_us_per_add",)),
        "client_us_per_add": med(("client_us_per_add",)),
    }


def format_table(results: dict, args) -> str:
    lines = [
        f"store benchmark: {os.cpu_count()} CPUs, Python {platform.python_version()}, "
        f"load average {os.getloadavg()[0]:.2f}, median of {args.rounds} rounds",
        f"  set+get round trip: {args.iters} iterations, one client; add() throughput: "
        f"{args.workers} processes x {args.adds} adds",
        "",
        f"{'store':<24} {'client p50':>11} {'client p99':>11} {'master p50':>11} {'master p99':>11} {'add()/s':>10} {'server CPU':>11} {'client CPU':>11}",
    ]
    labels = {
        "distcomm": "distcomm TCPStore", "distcomm-tcp": "distcomm, TCP only",
        "distcomm-server": "distcomm, torch clients", "torch-server": "torch, distcomm clients",
        "torch": "torch TCPStore",
    }
    for impl, r in results.items():
        lines.append(
            f"{labels[impl]:<24} {r['client']['p50_us']:>8.1f} us {r['client']['p99_us']:>8.1f} us "
            f"{r['master']['p50_us']:>8.1f} us {r['master']['p99_us']:>8.1f} us {r['adds_per_s']:>10,.0f} "
            f"{r['server_us_per_add']:>8.1f} us {r['client_us_per_add']:>8.1f} us"
        )
    lines.append("")
    lines.append("client: a client in another process than the master; master: the master's own client (rank 0),")
    lines.append("  which for distcomm calls its server in-process. distcomm's same-host clients use the server's")
    lines.append("  Unix socket; 'TCP only' keeps them on loopback TCP, as torch's are. server/client CPU: CPU time")
    lines.append("  (user + system) per add() of the server process and of the client processes, during the add() run.")
    lines.append("  'torch clients': distcomm's server behind torch's C++ clients, through its torch-protocol translation")
    lines.append("  (torch_wire.py); 'distcomm clients': torch's C++ server behind distcomm's clients, which speak its")
    lines.append("  protocol (torch_client.py); the other rows use each store's own clients.")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m distcomm.bench store", description=__doc__.split("\n")[0])
    parser.add_argument("--iters", type=int, default=5000, help="set+get round trips per measurement")
    parser.add_argument("--workers", type=int, default=32, help="processes doing add() at once")
    parser.add_argument("--adds", type=int, default=1000, help="add() calls per worker process")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per implementation")
    parser.add_argument("--only", choices=IMPLEMENTATIONS, help="measure one implementation only")
    parser.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")
    parser.add_argument("--serve", choices=("distcomm", "torch"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        serve(args.serve)
        return 0
    impls = [i for i in IMPLEMENTATIONS if (args.only in (None, i)) and _available(i)]
    if "torch" not in impls and args.only is None:
        print("torch is not installed: measuring distcomm only", file=sys.stderr)
    rounds: dict[str, list] = {impl: [] for impl in impls}
    for _ in range(args.rounds):
        for impl in impls:
            rounds[impl].append(_measure(impl, args))
    results = {impl: _median_round(r) for impl, r in rounds.items()}
    print(json.dumps(results, indent=2) if args.json else format_table(results, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
