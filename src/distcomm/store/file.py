"""FileStore: a store shared by processes through one file (torch.distributed.FileStore).

The file is an append-only log of records, written and read under ``fcntl.flock`` (exclusive to
append, shared to read), so any number of processes — on one host, or on a shared file system that
supports flock — see the same keys. A process keeps a cache of the keys and the file offset it has
read up to; an operation first reads the records appended since (a cheap ``fstat`` tells whether
there are any), then acts. A mutation is decided and appended under the exclusive lock, which is
what makes add() and compare_set() atomic across processes. Blocking get()/wait() must poll — a
file has no way to wake another process — with a short, growing interval (1 ms up to 10 ms) and
only an ``fstat`` per poll while nothing changed.

File layout::

    b"DCFSTOR1"                                   magic, so no other file is mistaken for a store
    record*  u8 kind | u32 key length | u32 value length | key | value
             H header  key "distcomm-filestore", value JSON {world_size, created_by}
             S set     key, value
             D delete  key
             J join    key = member id, value JSON {host, boot_id, pid, start_time}
             L leave   key = member id
             Q push    key = queue name, value = the item appended to that queue
             P pop     key = queue name (its oldest item is removed)

Queues. torch's FileStore has none (its queue methods raise NotImplementedError); nothing about a
file prevents them, so this one has them: a push and a pop are records like a set, and a pop is
decided under the exclusive lock like add(), so each item goes to exactly one popper in any
process. What a file cannot do is hand a wake-up to one chosen process: a blocked queue_pop()
polls like get() (so poppers in several processes are served in no particular order), and a
wait() on a queue returns, in every waiting process, once the queue is non-empty — where
HashStore and TCPStore wake one wait() per push, as torch documents.

Clones. ``clone()`` gives another FileStore object over the same open file (a view: its own
closed flag, the original's membership); closing a clone closes only the clone, closing the
original leaves the store for all its clones too, as a TCPStore master's server does.

Who uses the file, and when it is removed. Each FileStore instance appends a JOIN when it opens the
file and a LEAVE when it is closed (``close()``, garbage collection, or interpreter exit). As in
torch, the last user removes the file: with ``world_size`` > 0, the close that brings the number
of LEAVEs to ``world_size`` (so a rank that finishes before another has even opened the file does
not delete it from under it); with ``world_size`` = -1, the close that leaves no member open. In
both cases never while another user still has it open.
Removal happens under the lock, and a process that opened the path just before it was removed
notices (its descriptor's file has no links any more) and starts over with a new file.

Stale files. A file left by a crashed run must not be silently reused with its old keys. Opening a
file that already has records checks its members: a member that joined and never left, recorded on
this host (same host name and boot id), whose process is gone (no such pid, or the pid now belongs
to a process with another start time) is proof of a crash. When *every* member still holding the
file is such a dead process, nobody can be using it: the open starts it afresh (truncated, under
the lock) and warns, naming the path and the dead pids. When a dead member sits beside live (or
uncheckable) ones, the open fails with a DistStoreError naming the path, the dead pids and the fix
(delete the file). ``RendezvousFileStore`` (the file:// rendezvous's: its ranks hold the file open
until init is over, so a file nobody holds is a finished or failed run's) also starts afresh a file
that no member holds open. Without it, so does a file whose ``world_size``
users have all already finished and none is open any more (while one is, the file is a live job's,
and more opens than ``world_size`` are allowed, as in torch), a file of a different ``world_size``,
and a file with a torn
record at its end (a writer died mid-append). Members on other hosts cannot be checked and are
presumed alive. An empty file is a new store (torch's docs ask for "non-existent or empty").
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import struct
import threading
import time
import uuid
import warnings
from datetime import timedelta
from collections import deque
from contextlib import contextmanager
from multiprocessing.util import Finalize

from ..errors import DistStoreError
from . import rules
from .base import Store

MAGIC = b"DCFSTOR1"
_RECORD_HEAD = struct.Struct("<BII")
_HEADER, _SET, _DELETE, _JOIN, _LEAVE, _QUEUE_PUSH, _QUEUE_POP = b"HSDJLQP"
_HEADER_KEY = b"distcomm-filestore"
_POLL_FIRST = 0.001
_POLL_MAX = 0.01


def _record(kind: int, key: bytes, value: bytes = b"") -> bytes:
    return _RECORD_HEAD.pack(kind, len(key), len(value)) + key + value


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _start_time(pid: int) -> str:
    """The process's start time in clock ticks since boot (Linux), to tell a reused pid apart."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return stat[stat.rindex(b")") + 2 :].split()[19].decode()
    except (OSError, ValueError, IndexError):
        return ""


def _identity() -> dict:
    pid = os.getpid()
    return {"host": socket.gethostname(), "boot_id": _boot_id(), "pid": pid, "start_time": _start_time(pid)}


def _is_dead(member: dict, here: dict) -> bool:
    """True only when we can prove the member's process is gone (it ran on this host, this boot)."""
    if member.get("host") != here["host"]:
        return False
    if member.get("boot_id") and here["boot_id"] and member["boot_id"] != here["boot_id"]:
        return True  # the host rebooted since
    pid = member.get("pid")
    if not isinstance(pid, int):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass
    started = member.get("start_time")
    return bool(started) and _start_time(pid) not in ("", started)


class _Log:
    """The parsed contents of the file: keys, members, and the offset parsed up to."""

    def __init__(self):
        self.values: dict[str, bytes] = {}
        self.queues: dict[str, deque] = {}  # non-empty queues only
        self.members: dict[bytes, dict] = {}  # joined and not yet left
        self.joined = 0
        self.left = 0
        self.world_size = -1
        self.offset = 0

    def apply(self, data: bytes, path: str) -> None:
        """Parse the records in ``data`` (which starts at ``self.offset``) into the tables."""
        pos, end = 0, len(data)
        if not data:
            return
        if self.offset == 0:
            if data[: len(MAGIC)] != MAGIC[: len(data)]:
                raise DistStoreError(
                    f"FileStore: {path} is not a distcomm FileStore file (it starts with {data[:8]!r}); "
                    f"delete it or give FileStore a new path"
                )
            if end < len(MAGIC):
                raise DistStoreError(f"FileStore: {path} is truncated inside its header; delete it")
            pos = len(MAGIC)
        while pos < end:
            if end - pos < _RECORD_HEAD.size:
                raise self._torn(path, pos)
            kind, key_len, value_len = _RECORD_HEAD.unpack_from(data, pos)
            start = pos + _RECORD_HEAD.size
            stop = start + key_len + value_len
            if stop > end:
                raise self._torn(path, pos)
            key = data[start : start + key_len]
            value = data[start + key_len : stop]
            pos = stop
            if kind == _SET:
                self.values[key.decode("utf-8")] = value
            elif kind == _DELETE:
                self.values.pop(key.decode("utf-8"), None)
            elif kind == _QUEUE_PUSH:
                name = key.decode("utf-8")
                queue = self.queues.get(name)
                if queue is None:
                    self.queues[name] = deque((value,))
                else:
                    queue.append(value)
            elif kind == _QUEUE_POP:
                name = key.decode("utf-8")
                queue = self.queues.get(name)
                if queue:
                    queue.popleft()
                    if not queue:
                        del self.queues[name]
            elif kind == _JOIN:
                self.members[key] = json.loads(value)
                self.joined += 1
            elif kind == _LEAVE:
                self.members.pop(key, None)
                self.left += 1
            elif kind == _HEADER:
                self.world_size = json.loads(value).get("world_size", -1)
            else:
                raise DistStoreError(f"FileStore: {path} has an unknown record kind {kind!r} at offset {self.offset + pos}")
        self.offset += end

    def _torn(self, path: str, pos: int) -> DistStoreError:
        return DistStoreError(
            f"FileStore: {path} ends in a torn record at offset {self.offset + pos} (a writer died mid-append); "
            f"the store is unusable: delete the file and restart the job"
        )


class FileStore(Store):
    """A store that keeps its key-value pairs in a file shared by processes (torch.distributed.FileStore)."""

    #: start afresh a file with records that no process holds open (RendezvousFileStore's)
    fresh_if_unused = False

    def __init__(self, file_name: str, world_size: int = -1):
        super().__init__()
        if not isinstance(file_name, str) or not file_name:
            raise ValueError(f"FileStore needs a file path, got {file_name!r}")
        if isinstance(world_size, bool) or not isinstance(world_size, int):
            raise TypeError(f"world_size is an int, got {type(world_size).__name__}: {world_size!r}")
        if world_size == 0:
            raise ValueError("world_size must be positive, or -1 for a non-fixed number of users")
        self.path = file_name
        self._world_size = world_size if world_size > 0 else -1
        self._member_id = uuid.uuid4().hex.encode()
        self._lock = threading.Lock()
        self._fd, self._log = self._open_and_join()
        # multiprocessing's Finalize also runs in multiprocessing children, which exit without atexit hooks
        self._finalizer = Finalize(self, _leave, (self._fd, self.path, self._member_id, self._world_size), exitpriority=10)
        self._origin: FileStore | None = None  # for a clone: the store whose open file it shares
        self._clone_closed = False

    def __repr__(self) -> str:
        return f"FileStore({self.path!r})"

    # -- membership ---------------------------------------------------------------------------------

    def _open_and_join(self) -> tuple[int, _Log]:
        while True:
            # 0600, not torch's 0644: the file holds what a job trusts (peers' addresses, the TCP
            # transport's session token), and file:// has only the file's permissions to protect it
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
            try:
                with _file_lock(fd, fcntl.LOCK_EX):
                    log = None
                    if _is_current(fd, self.path):  # else removed by its last user between our open and our lock
                        log = _Log()
                        log.apply(_read_from(fd, 0), self.path)
                        here = _identity()
                        records = b""
                        if log.offset != 0 and self._stale(log, here):
                            os.ftruncate(fd, 0)  # O_APPEND: the next write lands at offset 0
                            log = _Log()
                        if log.offset == 0:
                            header = {"world_size": self._world_size, "created_by": here}
                            records = MAGIC + _record(_HEADER, _HEADER_KEY, json.dumps(header).encode())
                        records += _record(_JOIN, self._member_id, json.dumps(here).encode())
                        os.write(fd, records)
                        log.apply(records, self.path)
            except BaseException:
                os.close(fd)
                raise
            if log is not None:
                return fd, log
            os.close(fd)

    def _stale(self, log: _Log, here: dict) -> bool:
        """True if the file may be started afresh (a crashed or finished run's, nobody holds it);
        raise DistStoreError if it may not be used at all; False to join it as it is."""
        dead = [m for m in log.members.values() if _is_dead(m, here)]
        fix = f"delete it (rm {self.path}) or use a new path"
        if dead and len(dead) == len(log.members):
            who = ", ".join(f"pid {m.get('pid')}" for m in dead)
            warnings.warn(
                f"FileStore: {self.path} was left by processes that exited without closing it ({who} on "
                f"{here['host']}, e.g. a crashed earlier run); nobody else holds it, so it starts afresh "
                f"(its {len(log.values)} old keys are dropped)", RuntimeWarning, stacklevel=4)
            return True
        if self.fresh_if_unused and not log.members:
            return True  # a finished or failed rendezvous's file: nobody holds it open
        if dead:
            who = ", ".join(f"pid {m.get('pid')} on {m.get('host')}" for m in dead)
            alive = len(log.members) - len(dead)
            raise DistStoreError(
                f"FileStore: {self.path} is stale: it holds {len(log.values)} keys from processes that exited without "
                f"closing it ({who}), e.g. a crashed earlier run, while {alive} other user(s) (alive, or on another "
                f"host where they cannot be checked) still hold it; its keys are not this run's: {fix}"
            )
        if self._world_size > 0 and log.world_size > 0 and log.world_size != self._world_size:
            raise DistStoreError(
                f"FileStore: {self.path} was created with world_size={log.world_size}, not {self._world_size}; "
                f"it belongs to another job: {fix}"
            )
        # More opens than world_size is a leftover only when none of them is still open: a file some
        # live user holds open (none is dead, checked above) belongs to a running job, e.g. the same
        # path opened twice in one process with world_size=1, which torch allows
        if self._world_size > 0 and log.joined >= self._world_size and not log.members:
            raise DistStoreError(
                f"FileStore: {self.path} has already been opened by world_size={self._world_size} users "
                f"({log.left} of them finished); it is left over from an earlier run: {fix}"
            )
        return False

    def close(self) -> None:
        """Leave the store; the last user removes the file. Idempotent. (A clone closes only itself.)"""
        if self._origin is not None:
            self._clone_closed = True
            return
        with self._lock:
            self._finalizer()

    def has_extended_api(self) -> bool:
        return True  # append, multi_get, multi_set and list_keys are native

    def clone(self) -> "FileStore":
        """Another FileStore object over this one's open file, e.g. for another thread.

        It shares this store's membership (it is not another user towards ``world_size``) and keeps
        this store's timeout (torch's clone opens the path anew with the default timeout). Closing
        the clone closes only the clone; closing this store closes its clones too.
        """
        self._check_open()
        twin = FileStore.__new__(FileStore)
        Store.__init__(twin, timedelta(seconds=self._timeout_s))
        twin.path, twin._world_size, twin._member_id = self.path, self._world_size, self._member_id
        twin._lock, twin._fd, twin._log, twin._finalizer = self._lock, self._fd, self._log, self._finalizer
        twin._origin = self._origin or self  # keeps the original, whose collection would leave the store, alive
        twin._clone_closed = False
        return twin

    # -- reading and writing --------------------------------------------------------------------------

    def _refresh(self) -> None:
        """Apply records appended since we last looked (caller holds self._lock)."""
        if os.fstat(self._fd).st_size == self._log.offset:
            return
        with _file_lock(self._fd, fcntl.LOCK_SH):
            self._log.apply(_read_from(self._fd, self._log.offset), self.path)

    def _mutate(self, decide):
        """Run ``decide(values) -> (records, result)`` on fresh contents under the exclusive lock; append."""
        with self._lock:
            self._check_open()
            with _file_lock(self._fd, fcntl.LOCK_EX):
                self._log.apply(_read_from(self._fd, self._log.offset), self.path)
                records, result = decide(self._log.values)
                if records:
                    os.write(self._fd, records)
                    self._log.apply(records, self.path)
                return result

    def _read(self, read):
        with self._lock:
            self._check_open()
            self._refresh()
            return read(self._log.values)

    def _check_open(self) -> None:
        if self._clone_closed or not self._finalizer.still_active():
            raise DistStoreError(f"FileStore {self.path} is closed")

    def _await(self, operation: str, keys: list[str], timeout: float, see_queues: bool = False) -> dict:
        """Poll until every key is set (or, with ``see_queues``, is a non-empty queue); the values."""
        deadline = time.monotonic() + timeout
        interval = _POLL_FIRST
        while True:
            with self._lock:
                self._check_open()
                self._refresh()
                values, queues = self._log.values, self._log.queues
                missing = [k for k in keys if k not in values and not (see_queues and k in queues)]
                if not missing:
                    return values
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                # torch's FileStore gets (multi_get included) one key at a time, and names the first missing
                get = operation in ("get", "multi_get")
                lead = rules.file_get_lead(missing[0], timeout) if get else rules.TORCH_WAIT_TIMEOUT
                raise rules.timeout_error(operation, keys, timeout, missing, repr(self), lead)
            time.sleep(min(interval, remaining))
            interval = min(interval * 2, _POLL_MAX)

    # -- Store ----------------------------------------------------------------------------------------

    def _set(self, key, value):
        self._mutate(lambda values: (_record(_SET, key.encode(), value), None))

    def _get(self, key, timeout):
        return self._await("get", [key], timeout)[key]

    def _add(self, key, amount):
        def decide(values):
            stored, total = rules.added(key, values.get(key), amount)
            return _record(_SET, key.encode(), stored), total

        return self._mutate(decide)

    def _compare_set(self, key, expected, desired):
        def decide(values):
            new_value, returned = rules.compare_set_outcome(values.get(key), expected, desired)
            return (b"" if new_value is None else _record(_SET, key.encode(), new_value)), returned

        return self._mutate(decide)

    def _wait(self, keys, timeout):
        self._await("wait", keys, timeout, see_queues=True)

    def _check(self, keys):
        queues = self._log.queues
        return self._read(lambda values: all(k in values or k in queues for k in keys))

    def _num_keys(self):
        # torch's FileStore counts its reference-count key; ours is the membership record: + 1
        return self._read(len) + 1

    def _delete_key(self, key):
        # torch's FileStore returns True whether or not the key existed; so does this one
        return self._mutate(lambda values: (_record(_DELETE, key.encode()) if key in values else b"", True))

    def _append(self, key, value):
        self._mutate(lambda values: (_record(_SET, key.encode(), values.get(key, b"") + value), None))

    def _multi_get(self, keys, timeout):
        values = self._await("multi_get", keys, timeout)
        return [values[k] for k in keys]

    def _multi_set(self, keys, values):
        records = b"".join(_record(_SET, k.encode(), v) for k, v in zip(keys, values))
        self._mutate(lambda current: (records, None))

    def _list_keys(self):
        return self._read(list)

    def _queue_push(self, key, value):
        self._mutate(lambda values: (_record(_QUEUE_PUSH, key.encode(), value), None))

    def _queue_pop(self, key, block, timeout):
        queues = self._log.queues

        def take(values):
            queue = queues.get(key)
            return (_record(_QUEUE_POP, key.encode()), queue[0]) if queue else (b"", None)

        deadline = time.monotonic() + timeout
        interval = _POLL_FIRST
        while True:
            # only an fstat and a look at our copy while nothing changed; the exclusive lock only
            # when our copy shows an item, which take() re-checks on the file's current contents
            if self._read(lambda values: key in queues):
                value = self._mutate(take)
                if value is not None:
                    return value
            if not block:
                raise rules.queue_empty_error()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise rules.queue_timeout_error(key, timeout, where=repr(self))
            time.sleep(min(interval, remaining))
            interval = min(interval * 2, _POLL_MAX)

    def _queue_len(self, key):
        queues = self._log.queues
        return self._read(lambda values: len(queues.get(key, ())))


def _read_from(fd: int, offset: int) -> bytes:
    size = os.fstat(fd).st_size
    return os.pread(fd, size - offset, offset) if size > offset else b""


def _is_current(fd: int, path: str) -> bool:
    """True if ``fd`` is still the file at ``path`` (not removed, nor replaced, since we opened it)."""
    mine = os.fstat(fd)
    if mine.st_nlink == 0:
        return False
    try:
        theirs = os.stat(path)
    except FileNotFoundError:
        return False
    return (mine.st_dev, mine.st_ino) == (theirs.st_dev, theirs.st_ino)


# How many FileStore file locks this process holds or is taking right now, any thread: see _leave.
_locks_held = 0
_locks_held_lock = threading.Lock()


@contextmanager
def _file_lock(fd: int, mode: int):
    """flock(fd, mode) for the block, counted in _locks_held from before it is taken to after it is
    released (so a finalizer that runs in between sees it)."""
    global _locks_held
    with _locks_held_lock:
        _locks_held += 1
    try:
        fcntl.flock(fd, mode)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        with _locks_held_lock:
            _locks_held -= 1


def _leave(fd: int, path: str, member_id: bytes, world_size: int) -> None:
    """Append our LEAVE; remove the file if we were its last user. Runs once (a finalizer).

    A finalizer may run inside the garbage collector while this very thread holds a lock on the
    file through another FileStore of the same path (flock locks of two open files conflict even
    in one process): waiting for it there would never end. So while this process holds any
    FileStore lock, a helper thread leaves; otherwise (close, interpreter exit) we wait our turn.
    """
    if _locks_held:
        threading.Thread(target=_leave_now, args=(fd, path, member_id, world_size), daemon=True,
                         name="distcomm-filestore-leave").start()
    else:
        _leave_now(fd, path, member_id, world_size)


def _leave_now(fd: int, path: str, member_id: bytes, world_size: int) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError:
        os.close(fd)
        return
    try:
        if _is_current(fd, path):
            log = _Log()
            log.apply(_read_from(fd, 0), path)
            os.write(fd, _record(_LEAVE, member_id))
            log.members.pop(member_id, None)
            finished = log.left + 1
            # never from under a user still holding it open (torch's would: its counter is all it has)
            if not log.members and (world_size <= 0 or finished >= world_size):
                os.unlink(path)
    except (OSError, DistStoreError):
        pass  # best effort, as torch's destructor: a stale file is caught by the next open
    finally:
        os.close(fd)


class RendezvousFileStore(FileStore):
    """The file:// rendezvous's FileStore: its ranks hold the file open until init is over, so a file
    with records that nobody holds open is a finished or failed run's, and starts afresh (a plain
    FileStore joins it as it is, as torch's does, for a late user of a finished job's file)."""

    fresh_if_unused = True
