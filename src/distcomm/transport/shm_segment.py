"""Shared-memory segments: files in /dev/shm, private to the user, named unpredictably, never left behind.

Why files opened by hand instead of ``multiprocessing.shared_memory``: that module registers every
segment with the resource tracker, which warns and double-unlinks when another process unlinks it;
and it cannot create a segment with mode 0600 atomically. Here a segment is ``os.open(O_CREAT |
O_EXCL | O_NOFOLLOW, 0o600)`` + ``ftruncate`` + ``posix_fallocate`` + ``mmap``.

Reserved at creation. ``ftruncate`` alone makes a sparse file: its pages are allocated when first
touched, and on a full tmpfs (Docker's default 64 MiB /dev/shm) that touch kills the process with
SIGBUS, far from any Python code. ``posix_fallocate`` allocates every page now, so a full directory
is an error at creation that says how much was needed, where, and what to do.

Lifetime. The creator unlinks its segment as soon as every peer has mapped it (the mapping keeps
the memory alive, the name is no longer needed), so a segment normally exists in /dev/shm only for
the few milliseconds of connection setup. Until then it is unlinked by ``Segment.close()``
(transport close / destroy_process_group), by a ``weakref.finalize`` (garbage collection and
interpreter exit), and, for a SIGKILLed worker, by the launcher's cleanup hook: names carry the
launcher's run id and attempt (``distcomm-<run>-<attempt>-<token>``) so ``cleanup(run_id,
attempt)`` can find them.
"""

from __future__ import annotations

import errno
import mmap
import os
import re
import secrets
import stat
import weakref

import numpy as np

from .base import TransportError

PREFIX = "distcomm-"


def shm_dir() -> str:
    """Where segments live: /dev/shm, or DISTCOMM_SHM_DIR (a tmpfs; tests may point it elsewhere)."""
    return os.environ.get("DISTCOMM_SHM_DIR", "/dev/shm")


def _run_tag(run_id: str | None = None, attempt: int | str | None = None) -> str:
    """``<run>-<attempt>-`` of the launcher's run (TORCHELASTIC_RUN_ID), or "" outside a launcher."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID") if run_id is None else run_id
    if not run_id:
        return ""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") if attempt is None else attempt
    safe = re.sub(r"[^A-Za-z0-9_.]", "_", str(run_id))[:40]
    return f"{safe}-{attempt}-"


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError:
        pass  # nothing more we can do at exit; the launcher's cleanup hook is the backstop


def _reserve(fd: int, nbytes: int, directory: str) -> None:
    """Allocate the file's pages now (see the module docstring); a full directory raises
    TransportError saying how much was needed, where, and what to do."""
    if nbytes <= 0:
        return
    while True:
        try:
            os.posix_fallocate(fd, 0, nbytes)
            return
        except InterruptedError:
            continue
        except OSError as exc:
            if exc.errno in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                return  # a filesystem without fallocate: pages are allocated on first touch, as before
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT, errno.ENOMEM):
                raise
            try:
                st = os.statvfs(directory)
                free = f"{st.f_bavail * st.f_frsize} bytes free of {st.f_blocks * st.f_frsize}"
            except OSError:
                free = "free space unknown"
            raise TransportError(
                f"out of shared memory: could not reserve {nbytes} bytes in {directory} ({free}; "
                f"{os.strerror(exc.errno)}). Give it more room (docker run --shm-size=1g, or a larger tmpfs), "
                "point DISTCOMM_SHM_DIR at a bigger tmpfs, or use backend=\"tcp\"", reason="error") from None


class Segment:
    """One mapped shared-memory file. ``buf`` is the whole mapping as uint8; ``owner`` created it."""

    def __init__(self, name: str, mm: mmap.mmap, owner: bool):
        self.name = name
        self.path = os.path.join(shm_dir(), name)
        self.size = len(mm)
        self._mm = mm
        self.buf = np.frombuffer(mm, dtype=np.uint8)
        self.owner = owner
        self.address = self.buf.ctypes.data  # where it is mapped in this process
        self._finalizer = weakref.finalize(self, _unlink, self.path) if owner else None

    @classmethod
    def create(cls, nbytes: int) -> "Segment":
        """A new zero-filled segment of ``nbytes`` (mode 0600, a fresh random name)."""
        directory = shm_dir()
        if not os.path.isdir(directory):
            raise OSError(f"shared memory needs {directory} (a tmpfs); it does not exist here")
        while True:
            name = f"{PREFIX}{_run_tag()}{secrets.token_hex(16)}"
            path = os.path.join(directory, name)
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            except FileExistsError:
                continue
            break
        try:
            os.fchmod(fd, 0o600)  # O_CREAT's mode is already 0600 minus the umask; make it exact
            os.ftruncate(fd, nbytes)
            _reserve(fd, nbytes, directory)
            mm = mmap.mmap(fd, nbytes)
        except BaseException:
            os.close(fd)
            _unlink(path)
            raise
        os.close(fd)
        try:
            return cls(name, mm, owner=True)
        except BaseException:
            _unlink(path)
            raise

    @classmethod
    def open(cls, name: str) -> "Segment":
        """Map a peer's segment; refuse one that is not ours or that others may read."""
        if os.sep in name or not name.startswith(PREFIX):
            raise ValueError(f"not a distcomm segment name: {name!r}")
        path = os.path.join(shm_dir(), name)
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
                raise PermissionError(f"{path} is not a private segment of this user (mode {st.st_mode:o})")
            mm = mmap.mmap(fd, st.st_size)
        finally:
            os.close(fd)
        return cls(name, mm, owner=False)

    def unlink(self) -> None:
        """Remove the name (the memory lives on while mapped). Only the creator does this."""
        if self._finalizer is not None:
            self._finalizer()  # runs _unlink once and detaches

    def close(self) -> None:
        """Unlink (if ours) and unmap when no array still points into the mapping."""
        self.unlink()
        self.buf = None
        try:
            self._mm.close()
        except BufferError:
            pass  # views are still alive somewhere; the mapping goes when they do

    def __repr__(self) -> str:
        return f"Segment({self.name!r}, {self.size} bytes{', owner' if self.owner else ''})"


def run_prefix(run_id: str) -> str:
    """The name prefix of every segment of a launcher's run (all attempts)."""
    return f"{PREFIX}{_run_tag(run_id, 0).rsplit('-', 2)[0]}-"


def cleanup(run_id: str, attempt: int) -> None:
    """Launcher hook: unlink the segments a run's (killed) workers left in shm_dir()."""
    directory = shm_dir()
    prefix = f"{PREFIX}{_run_tag(run_id, attempt)}"
    if prefix == PREFIX:
        return
    try:
        names = os.listdir(directory)
    except OSError:
        return
    uid = os.getuid()
    for name in names:
        if name.startswith(prefix):
            path = os.path.join(directory, name)
            try:
                if os.lstat(path).st_uid == uid:
                    os.unlink(path)
            except OSError:
                pass
