"""Single-copy reads from (and writes to) a peer's memory with process_vm_readv/writev, where the
OS allows it.

Linux lets a process read another's memory when it may ptrace it: same user, the target dumpable,
and, under the Yama LSM (/proc/sys/kernel/yama/ptrace_scope = 1), only if the target named it as a
tracer. ``allow_peers()`` grants that (prctl PR_SET_PTRACER, PR_SET_PTRACER_ANY) at init; a
harmless no-op without Yama. Whether it works is then *tested* pairwise at connection time
(``probe``), never assumed: containers without CAP_SYS_PTRACE under a stricter seccomp policy,
ptrace_scope 2 or 3, or a non-dumpable process make the transport fall back to copying through its
rings. ``DISTCOMM_SHM_DIRECT=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import errno
import os

import numpy as np

from .base import TransportError
from .shm_wait import process_alive

_PR_SET_PTRACER = 0x59616D61
_PR_SET_PTRACER_ANY = ctypes.c_ulong(-1 & ((1 << (8 * ctypes.sizeof(ctypes.c_ulong))) - 1))


class _Iovec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


try:
    _libc = ctypes.CDLL(None, use_errno=True)
    _readv = _libc.process_vm_readv
    _writev = _libc.process_vm_writev
    for _fn in (_readv, _writev):
        _fn.restype = ctypes.c_ssize_t
        _fn.argtypes = [ctypes.c_int, ctypes.POINTER(_Iovec), ctypes.c_ulong, ctypes.POINTER(_Iovec), ctypes.c_ulong,
                        ctypes.c_ulong]
except (OSError, AttributeError):  # pragma: no cover - not Linux/glibc
    _libc = None
    _readv = None
    _writev = None


class DirectReadError(TransportError):
    """process_vm_readv from a peer (or process_vm_writev to it: ``writing``) failed. ``pid`` is
    the peer's process; ``reason`` is "lost" when that process is gone (ESRCH, or it died while we
    read: its memory is torn down before it is reaped), else "error". The caller knows which rank
    has that pid and names it."""

    def __init__(self, pid: int, err: int, writing: bool = False):
        gone = err == errno.ESRCH or not process_alive(pid)
        what = "the process has exited" if gone else os.strerror(err)
        action = "writing to the memory of pid {} (process_vm_writev)" if writing else \
            "reading the memory of pid {} (process_vm_readv)"
        super().__init__(f"{action.format(pid)} failed: {what}",
                         reason="lost" if gone else "error")
        self.pid = pid
        self.errno = err


def available() -> bool:
    """Can this platform read another process's memory at all (Linux, glibc's process_vm_readv)?"""
    return _readv is not None


def allow_peers() -> None:
    """Let processes of this user read our memory even under Yama ptrace_scope=1."""
    if _libc is not None:
        try:
            _libc.prctl(_PR_SET_PTRACER, _PR_SET_PTRACER_ANY, 0, 0, 0)
        except (AttributeError, OSError):  # pragma: no cover
            pass


def read(pid: int, address: int, out: np.ndarray) -> None:
    """Copy ``out.nbytes`` bytes at ``address`` in process ``pid`` into ``out`` (contiguous)."""
    _transfer(_readv, pid, address, out, False)


def write(pid: int, address: int, src: np.ndarray) -> None:
    """Copy ``src`` (contiguous) to ``address`` in process ``pid`` (process_vm_writev: the same
    permission as reading, so whatever ``probe`` found readable is writable too)."""
    _transfer(_writev, pid, address, src, True)


def _transfer(call, pid: int, address: int, local: np.ndarray, writing: bool) -> None:
    """process_vm_readv/writev of all of ``local`` against ``address`` in ``pid``, in pieces of at
    most 1 GiB (the calls may move less than asked: continue where they stopped)."""
    total = local.nbytes
    base = local.ctypes.data
    done = 0
    while done < total:
        n = min(total - done, 1 << 30)
        mine = _Iovec(base + done, n)
        theirs = _Iovec(address + done, n)
        got = call(pid, ctypes.byref(mine), 1, ctypes.byref(theirs), 1, 0)
        if got <= 0:
            raise DirectReadError(pid, ctypes.get_errno(), writing=writing)
        done += got


def probe(pid: int, address: int, expect: int) -> bool:
    """True if we can read the u64 ``expect`` at ``address`` in process ``pid``."""
    if not available():
        return False
    word = np.zeros(1, np.uint64)
    try:
        read(pid, address, word)
    except (OSError, TransportError):
        return False
    return int(word[0]) == expect
