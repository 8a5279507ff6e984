"""TCPStore: frames, handshake and connection (the protocol, no I/O); the server (one event loop, its
listeners, handlers and parked requests); the client (one connection); and the Store glue.

TCPStoreServer is imported on first use: a process that only connects to a store never loads it.
"""

from .store import TCPStore

__all__ = ["TCPStore", "TCPStoreServer"]


def __getattr__(name: str):
    if name == "TCPStoreServer":
        from .server import TCPStoreServer

        return TCPStoreServer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
