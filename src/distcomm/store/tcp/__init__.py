"""TCPStore: protocol (no I/O), server (one event loop), client (one connection), and the Store glue."""

from .server import TCPStoreServer
from .store import TCPStore

__all__ = ["TCPStore", "TCPStoreServer"]
