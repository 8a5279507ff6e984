"""Measure the TCP transport alone: ping-pong latency and bandwidth between two processes.

    python -m distcomm.bench pingpong [--iters 2000] [--big-iters 10]

Why a script and not a test: timings on a shared 2-core machine are noise-prone, so they are
reported, never asserted. Prints the median and best round trip for 8 B (and for an 8 B exchange, both ranks sending at
once, which is a two-rank all_reduce's traffic), and the round-trip time
and one-direction bandwidth for a 64 MiB ping-pong (2 x 64 MiB moved per round trip), next to a
plain blocking-socket ping-pong (the floor Python sockets can reach here) for scale.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import statistics
import struct
import time

import numpy as np

from ..transport.base import MessageKey

KEY = MessageKey(0, 0, 0)


def _transport_rank(rank: int, port: int, iters: int, big_iters: int, q) -> None:
    from ..store import TCPStore
    from ..transport.tcp import TcpTransport

    store = TCPStore("127.0.0.1", port, 2, rank == 0)
    t = TcpTransport.connect(store, rank, 2, 30.0)
    peer = 1 - rank
    small, small_in = np.zeros(1, np.float64), np.zeros(1, np.float64)
    big, big_in = np.ones(64 << 20, np.uint8), np.empty(64 << 20, np.uint8)
    results = {}
    for label, out, inp, n in (("8B", small, small_in, iters), ("64MiB", big, big_in, big_iters)):
        times = []
        for i in range(n + max(2, n // 20)):  # the first rounds warm up
            t0 = time.perf_counter()
            if rank == 0:
                t.isend(peer, out, KEY).wait()
                t.irecv(peer, inp, KEY).wait()
            else:
                t.irecv(peer, inp, KEY).wait()
                t.isend(peer, out, KEY).wait()
            times.append(time.perf_counter() - t0)
        results[label] = times[-n:]
    # the exchange (both ranks send at once, then wait): a two-rank all_reduce's whole traffic
    times = []
    for i in range(iters + max(2, iters // 20)):
        key = MessageKey(0, 0, i + 1)
        t0 = time.perf_counter()
        r = t.irecv(peer, small_in, key)
        s = t.isend(peer, small, key)
        r.wait()
        s.wait()
        times.append(time.perf_counter() - t0)
    results["exchange"] = times[-iters:]
    t.close()
    q.put((rank, results))


def _socket_rank(rank: int, port: int, iters: int, q) -> None:
    """The floor: blocking sockets, one sendall and one recv_into per message, nothing else."""
    if rank == 0:
        ls = socket.create_server(("127.0.0.1", port))
        s, _ = ls.accept()
    else:
        for _ in range(500):  # rank 0 may not be listening yet
            try:
                s = socket.create_connection(("127.0.0.1", port))
                break
            except ConnectionRefusedError:
                time.sleep(0.01)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    msg, buf, times = struct.pack("<Q", 1) * 5, bytearray(40), []
    for _ in range(iters):
        t0 = time.perf_counter()
        if rank == 0:
            s.sendall(msg)
            s.recv_into(buf)
        else:
            s.recv_into(buf)
            s.sendall(msg)
        times.append(time.perf_counter() - t0)
    big, bigbuf, btimes = bytearray(64 << 20), memoryview(bytearray(64 << 20)), []
    for _ in range(max(3, iters // 200)):
        t0 = time.perf_counter()
        for turn in (0, 1):
            if turn == rank:
                s.sendall(big)
            else:
                got = 0
                while got < len(bigbuf):
                    got += s.recv_into(bigbuf[got:])
        btimes.append(time.perf_counter() - t0)
    q.put((rank, {"socket": times, "socket64": btimes}))


def _run(target, args) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=target, args=(r, port, *args, q)) for r in range(2)]
    for p in procs:
        p.start()
    res = dict(q.get(timeout=600) for _ in procs)
    for p in procs:
        p.join()
    return res[0]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m distcomm.bench pingpong", description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--big-iters", type=int, default=10)
    a = ap.parse_args(argv)
    floor_res = _run(_socket_rank, (a.iters,))
    floor, floor64 = floor_res["socket"], floor_res["socket64"]
    res = _run(_transport_rank, (a.iters, a.big_iters))
    us = lambda xs, f: f"{f(xs) * 1e6:8.1f}"  # noqa: E731
    print(f"{'':28}{'median':>8} {'best':>8}  (round trip, µs)")
    print(f"{'blocking socket, 40 B':28}{us(floor, statistics.median)} {us(floor, min)}")
    print(f"{'TcpTransport, 8 B':28}{us(res['8B'], statistics.median)} {us(res['8B'], min)}")
    print(f"{'TcpTransport, 8 B exchange':28}{us(res['exchange'], statistics.median)} {us(res['exchange'], min)}"
          "  (both send at once: one two-rank all_reduce)")
    print(f"blocking socket, 64 MiB: {2 * (64 << 20) / statistics.median(floor64) / 1e9:.2f} GB/s one way")
    big = res["64MiB"]
    med = statistics.median(big)
    print(f"TcpTransport, 64 MiB: round trip median {med * 1e3:.1f} ms (best {min(big) * 1e3:.1f} ms); "
          f"{2 * (64 << 20) / med / 1e9:.2f} GB/s one way")


if __name__ == "__main__":
    main()
