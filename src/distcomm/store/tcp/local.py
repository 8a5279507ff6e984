"""LocalSocket: the socket a client in the server's own process uses — a function call, not a socket.

Why: the master's TCPStore is a client of its own server (so its requests follow the same rules and
order as every other client's), but sending them through the kernel costs two system calls and two
thread hand-offs per request, under the GIL, for bytes that never leave the process. A LocalSocket
offers the few socket methods TCPStoreClient uses: ``sendall`` hands the bytes straight to the
server, which handles them in the caller's thread under its lock; replies (immediate, or later for a
parked get/wait, from the loop thread) land in an inbox that ``recv`` reads, honouring the receive
timeout the client sets with SO_RCVTIMEO (BlockingIOError when it passes, as a real socket).
"""

from __future__ import annotations

import socket
import struct
import threading
import time


class LocalSocket:
    def __init__(self, server):
        self._server = server
        self.peer = None  # the server's Peer for this client, set by connect_local()
        self._inbox = bytearray()
        self._arrived = threading.Condition(threading.Lock())
        self._timeout: float | None = None
        self._closed = False

    # -- what the client calls --------------------------------------------------------------------

    def sendall(self, data: bytes) -> None:
        if self._closed:
            raise BrokenPipeError(32, "the local TCPStore connection is closed")
        self._server.handle(self.peer, data)

    def recv(self, size: int) -> bytes:
        with self._arrived:
            if not self._inbox and not self._closed:
                deadline = None if self._timeout is None else time.monotonic() + self._timeout
                while not self._inbox and not self._closed:
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        raise BlockingIOError(11, "timed out (SO_RCVTIMEO)")
                    self._arrived.wait(remaining)
            data = bytes(self._inbox[:size])
            del self._inbox[:size]
            return data

    def setsockopt(self, level: int, option: int, value) -> None:
        if level == socket.SOL_SOCKET and option == socket.SO_RCVTIMEO:
            seconds, micros = struct.unpack("ll", value)
            self._timeout = seconds + micros / 1e6 or None

    def settimeout(self, timeout: float | None) -> None:
        self._timeout = timeout

    def close(self) -> None:
        if not self._closed and self.peer is not None:
            self._server.disconnect(self.peer)  # which calls shutdown_from_server() below

    # -- what the server calls ----------------------------------------------------------------------

    def send(self, data: bytes) -> int:
        with self._arrived:
            self._inbox += data
            self._arrived.notify()
        return len(data)

    def fileno(self) -> int:
        return -1

    def shutdown_from_server(self) -> None:
        with self._arrived:
            self._closed = True
            self._arrived.notify_all()
