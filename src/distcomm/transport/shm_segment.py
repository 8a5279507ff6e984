"""Shared-memory segments: files on /dev/shm's tmpfs, private to the user, never left behind.

Why files opened by hand instead of ``multiprocessing.shared_memory``: that module registers every
segment with the resource tracker, which warns and double-unlinks when another process unlinks it;
and it cannot create a segment with mode 0600 atomically. Here a segment is an ``O_TMPFILE`` file
(mode 0600) + ``ftruncate`` + ``posix_fallocate`` + ``mmap``.

Never named. An ``O_TMPFILE`` file has no name in /dev/shm at any moment: it lives while some
process holds it open or mapped, so no death (SIGKILL, SIGTERM from a launcher or a test harness,
``os._exit`` in a forked child, which runs no finalizer) can leave it behind. Peers on the host
open it through the creator's descriptor, ``/proc/<pid>/fd/<fd>`` (same user, same pid namespace:
the host id guarantees both), and check its owner, mode and inode. The creator closes that
descriptor once every peer has mapped the segment (``unlink()``); from then on nothing more can
open it, and the memory goes with the last mapping. A filesystem without ``O_TMPFILE`` gets a
named file instead (``distcomm-<run>-<attempt>-<token>``), unlinked by ``unlink()``, ``close()``,
a ``weakref.finalize`` and, for killed workers, the launcher's cleanup hook, which finds a run's
names by their prefix.

Reserved at creation. ``ftruncate`` alone makes a sparse file: its pages are allocated when first
touched, and on a full tmpfs (Docker's default 64 MiB /dev/shm) that touch kills the process with
SIGBUS, far from any Python code. ``posix_fallocate`` allocates every page now, so a full directory
is an error at creation that says how much was needed, where, and what to do.
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


# A segment that has no name is handed to peers as ``distcomm@<pid>.<fd>.<inode>``: where its creator
# holds it open, and which file it must be (a recycled pid or descriptor cannot pass for it).
_ANONYMOUS = re.compile(r"distcomm@(\d+)\.(\d+)\.(\d+)")


def _create_anonymous(directory: str) -> int | None:
    """An unnamed file in ``directory`` (O_TMPFILE), or None where the filesystem cannot make one."""
    flag = getattr(os, "O_TMPFILE", 0)
    if not flag:
        return None
    try:
        return os.open(directory, flag | os.O_RDWR | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
            return None
        raise


def _create_named(directory: str) -> tuple[int, str]:
    while True:
        name = f"{PREFIX}{_run_tag()}{secrets.token_hex(16)}"
        try:
            fd = os.open(os.path.join(directory, name),
                         os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except FileExistsError:
            continue
        return fd, name


def _check_private(st: os.stat_result, path: str, name: str, inode: int | None) -> None:
    """Refuse a file that is not a regular file of this user with mode 0600, or (``inode`` given:
    an unnamed segment) not the file the name says."""
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise PermissionError(f"{path} is not a private segment of this user (mode {st.st_mode:o})")
    if inode is not None and st.st_ino != inode:
        raise FileNotFoundError(f"{name}: the process no longer holds that segment at {path}")


class Segment:
    """One mapped shared-memory file. ``buf`` is the whole mapping as uint8; ``owner`` created it;
    ``name`` is what a peer gives ``Segment.open`` (until the owner calls ``unlink()``)."""

    def __init__(self, name: str, path: str, mm: mmap.mmap, owner: bool, fd: int | None = None):
        self.name = name
        self.path = path
        self.size = len(mm)
        self._mm = mm
        self.buf = np.frombuffer(mm, dtype=np.uint8)
        self.owner = owner
        self.address = self.buf.ctypes.data  # where it is mapped in this process
        # The owner's way of letting go of the name: close the descriptor peers open it through, or
        # unlink the named file. Also run at garbage collection and interpreter exit.
        if not owner:
            self._finalizer = None
        elif fd is not None:
            self._finalizer = weakref.finalize(self, os.close, fd)
        else:
            self._finalizer = weakref.finalize(self, _unlink, path)

    @classmethod
    def create(cls, nbytes: int, anonymous: bool = True) -> "Segment":
        """A new zero-filled segment of ``nbytes``, mode 0600: unnamed where the filesystem allows
        (see the module docstring), else, or with ``anonymous=False``, a file with a fresh random name."""
        directory = shm_dir()
        if not os.path.isdir(directory):
            raise OSError(f"shared memory needs {directory} (a tmpfs); it does not exist here")
        fd = _create_anonymous(directory) if anonymous else None
        named = fd is None
        if named:
            fd, name = _create_named(directory)
            path = os.path.join(directory, name)
        else:
            name = f"distcomm@{os.getpid()}.{fd}.{os.fstat(fd).st_ino}"
            path = f"/proc/{os.getpid()}/fd/{fd}"
        try:
            os.fchmod(fd, 0o600)  # O_CREAT's mode is already 0600 minus the umask; make it exact
            os.ftruncate(fd, nbytes)
            _reserve(fd, nbytes, directory)
            mm = mmap.mmap(fd, nbytes)
        except BaseException:
            os.close(fd)
            if named:
                _unlink(path)
            raise
        if named:
            os.close(fd)  # the name is how peers open it
        try:
            return cls(name, path, mm, owner=True, fd=None if named else fd)
        except BaseException:
            if named:
                _unlink(path)
            else:
                os.close(fd)
            raise

    @classmethod
    def open(cls, name: str) -> "Segment":
        """Map a peer's segment; refuse one that is not ours or that others may read.

        An unnamed segment's path is its creator's descriptor, whose number the creator may have
        closed and reused for any other file: what the path leads to is checked before it is opened
        (opening a device or a pipe can have effects of its own) and again once open (the descriptor
        may change in between), and only the file the name says, private to this user, is mapped.
        Raises FileNotFoundError when the segment is gone (or the path now leads to another file of
        ours) and PermissionError when it leads to a file that is not a private segment; the
        transport turns these into distcomm errors (it knows the peer and the operation)."""
        anonymous = _ANONYMOUS.fullmatch(name)
        if anonymous:
            pid, fd, inode = (int(x) for x in anonymous.groups())
            path = f"/proc/{pid}/fd/{fd}"
        elif os.sep in name or not name.startswith(PREFIX):
            raise ValueError(f"not a distcomm segment name: {name!r}")
        else:
            path = os.path.join(shm_dir(), name)
            inode = None
        before = os.stat(path, follow_symlinks=bool(anonymous))
        _check_private(before, path, name, inode)
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK | (0 if anonymous else os.O_NOFOLLOW))
        try:
            st = os.fstat(fd)
            _check_private(st, path, name, inode)
            if (st.st_dev, st.st_ino) != (before.st_dev, before.st_ino):
                raise FileNotFoundError(f"{name}: {path} changed to another file while this process opened it")
            mm = mmap.mmap(fd, st.st_size)
        finally:
            os.close(fd)
        return cls(name, path, mm, owner=False)

    def unlink(self) -> None:
        """Let go of the name (the memory lives on while mapped): no peer can open the segment from
        now on. Only the creator does this."""
        if self._finalizer is not None:
            self._finalizer()  # runs once and detaches

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
