"""Deadlines a blocking socket's kernel keeps: SO_RCVTIMEO and SO_SNDTIMEO.

Why not Python's socket timeouts: they put the socket in non-blocking mode, so every reply costs a
failed ``recv``, a ``poll()`` and a second ``recv``, and each change of timeout an ioctl. With these
options the socket stays blocking, a ``recv`` that waits longer than the deadline raises
BlockingIOError, and the store clients set the options only when their deadline changes.
"""

from __future__ import annotations

import socket
import struct


def timeval(seconds: float) -> bytes:
    """``seconds`` as the struct timeval that SO_RCVTIMEO and SO_SNDTIMEO take (at least 1 ms)."""
    seconds = min(max(seconds, 0.001), 1e8)
    whole = int(seconds)
    return struct.pack("ll", whole, int((seconds - whole) * 1e6))


def set_deadlines(sock, seconds: float) -> None:
    """A ``recv`` or ``send`` on ``sock`` that makes no progress for ``seconds`` raises BlockingIOError."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval(seconds))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval(seconds))
