"""CPU of one read's worth of add() requests in a TCPStore server, without its loop or any client.

``TCPStoreServer.handle`` on one end of a socketpair (the server's own code path for a read:
cut the frames, run the handlers, send the replies with one send), timed with ``time.thread_time``;
the minimum of 30 repetitions of 3,000 reads, for 1 and 4 adds per read, next to a bare send+recv
of the same size. Run with PYTHONPATH pointing at the tree to measure.
"""

import socket
import time

from distcomm.store.tcp import frames
from distcomm.store.tcp import handshake as hs
from distcomm.store.tcp.server import TCPStoreServer

server = TCPStoreServer("127.0.0.1", 0, local_socket=False)
ours, theirs = socket.socketpair()
ours.setblocking(False)
peer = server.adopt(ours, "socketpair")
server.handle(peer, hs.encode(hs.Hello(hs.VERSION)))
theirs.recv(65536)


def adds_per_read(count: int, reads: int = 3000) -> float:
    requests = b"".join(frames.encode_add(i, b"bench/counter", 1) for i in range(count))
    start = time.thread_time()
    for _ in range(reads):
        server.handle(peer, requests)
        theirs.recv(65536)
    return (time.thread_time() - start) / reads * 1e6


def bare(reads: int = 3000) -> float:
    start = time.thread_time()
    for _ in range(reads):
        ours.send(b"x" * 21)
        theirs.recv(65536)
    return (time.thread_time() - start) / reads * 1e6


for label, measure in (("1 add per read", lambda: adds_per_read(1)), ("4 adds per read", lambda: adds_per_read(4)),
                       ("bare send+recv", bare)):
    print(f"{label}: {min(measure() for _ in range(30)):.2f} us")
