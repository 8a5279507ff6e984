"""Under mpiexec with MASTER_ADDR set and MASTER_PORT not: env:// agrees on the store over MPI.
Rank 0 prints where the store's port listens (read from /proc/net/tcp{,6}); every rank uses the
store once, so a store the clients cannot reach fails the run instead of passing."""

import socket
import sys
from datetime import timedelta

from distcomm.rendezvous import rendezvous

LISTEN = "0A"


def listening(port: int) -> list[str]:
    found = []
    for name, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        try:
            lines = open(name).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            addr, state = fields[1], fields[3]
            host_hex, port_hex = addr.split(":")
            if state != LISTEN or int(port_hex, 16) != port:
                continue
            raw = bytes.fromhex(host_hex)
            # /proc prints each 32-bit word in host (little-endian) order
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            found.append(socket.inet_ntop(family, raw))
    return sorted(found)


store, rank, size = next(rendezvous("env://", timeout=timedelta(seconds=20)))
if rank == 0:
    print("LISTEN", ",".join(listening(store.port)), flush=True)
# every rank reaches the store; rank 0 (its host) leaves last
if store.add("done", 1) == size:
    store.set("all_done", "1")
store.wait(["all_done"], timedelta(seconds=20))
if rank == 0:
    while store.add("left", 0) < size - 1:
        pass
else:
    store.add("left", 1)
sys.exit(0)
