"""FileStore: placeholder until the file-backed store lands (next commit)."""

from .base import Store


class FileStore(Store):
    def __init__(self, file_name: str, world_size: int = -1):
        raise NotImplementedError("FileStore is not implemented yet")
