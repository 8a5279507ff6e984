"""A lock-free single-producer single-consumer byte ring in shared memory, and the record format
the shared-memory transport writes into it.

Layout of one ring block (``RING_HEADER`` bytes of counters, then the data)::

    u64[0]   head    bytes ever written (producer writes)
    u64[8]   tail    bytes ever consumed (consumer writes; its own cache line)
    u64[9]   pvm_ok  1 when the consumer may read the producer's memory directly (consumer writes)
    u64[10]  acked   direct-read messages the consumer has finished (consumer writes)

Each counter has a single writer, so no atomic read-modify-write is needed: a side publishes its
counter after copying the bytes, and the other side reads the counter before the bytes. That
order holds on x86-64 (stores are not reordered with stores, nor loads with loads); CPython runs
each copy and each counter store as separate C calls, so the compiler cannot reorder them either.

A message is a 64-byte record header followed (for inline messages) by its payload, which the
producer may push in pieces as the consumer makes room: a message larger than the ring streams
through it. A *direct* record carries instead the address of the sender's buffer; the consumer
copies it with process_vm_readv and bumps ``acked`` (one copy instead of two, and the sender need
not be running for its data to move).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

RING_HEADER = 128
HEAD, TAIL, PVM_OK, ACKED = 0, 8, 9, 10

RECORD = 64
MODE_INLINE = 1
MODE_DIRECT = 2


class Ring:
    """One end (producer or consumer) of a ring whose block is ``block`` (uint8, shared)."""

    __slots__ = ("ctl", "data", "capacity", "_head", "_tail")

    def __init__(self, block: np.ndarray):
        self.ctl = memoryview(block[:RING_HEADER]).cast("Q")
        self.data = block[RING_HEADER:]
        self.capacity = self.data.size
        self._head = self.ctl[HEAD]  # the producer's private copy
        self._tail = self.ctl[TAIL]  # the consumer's private copy

    @staticmethod
    def block_bytes(capacity: int) -> int:
        return RING_HEADER + capacity

    # -- producer -----------------------------------------------------------------------------
    def writable(self) -> int:
        return self.capacity - (self._head - self.ctl[TAIL])

    def push(self, src: np.ndarray) -> int:
        """Copy as much of ``src`` (uint8) as fits; publish it; return the bytes written."""
        n = min(src.size, self.writable())
        if n <= 0:
            return 0
        pos = self._head % self.capacity
        first = min(n, self.capacity - pos)
        self.data[pos : pos + first] = src[:first]
        if first < n:
            self.data[: n - first] = src[first:n]
        self._head += n
        self.ctl[HEAD] = self._head
        return n

    # -- consumer -----------------------------------------------------------------------------
    def readable(self) -> int:
        return self.ctl[HEAD] - self._tail

    def pull(self, dst: np.ndarray | None, n: int | None = None) -> int:
        """Move up to ``n`` (default dst.size) available bytes into ``dst`` (None: discard them)."""
        want = dst.size if n is None else n
        n = min(want, self.readable())
        if n <= 0:
            return 0
        if dst is not None:
            pos = self._tail % self.capacity
            first = min(n, self.capacity - pos)
            dst[:first] = self.data[pos : pos + first]
            if first < n:
                dst[first:n] = self.data[: n - first]
        self._tail += n
        self.ctl[TAIL] = self._tail
        return n


class Record(NamedTuple):
    mode: int
    group: int
    kind: int
    seq: int
    signature: int
    nbytes: int
    address: int


def encode(mode: int, key, signature: int, nbytes: int, address: int = 0) -> np.ndarray:
    """A record header as 64 bytes."""
    words = np.array([mode, key.group, key.kind, key.seq, signature, nbytes, address, 0], dtype=np.int64)
    return words.view(np.uint8)


def decode(header: np.ndarray) -> Record:
    w = header.view(np.int64).tolist()
    return Record(w[0], w[1], w[2], w[3], w[4], w[5], w[6])
