"""Key-value stores with torch.distributed's API: the place peers meet before any collective runs.

``Store`` is the interface; ``HashStore`` (one process), ``FileStore`` (processes sharing a file
system), ``TCPStore`` (processes on a network) hold the keys; ``PrefixStore`` gives a group its own
key space in any of them.
"""

from .base import Store
from .file import FileStore
from .hash import HashStore
from .prefix import PrefixStore
from .tcp import TCPStore

__all__ = ["Store", "TCPStore", "FileStore", "HashStore", "PrefixStore"]
