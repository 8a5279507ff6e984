"""The shared-memory transport: ranks of one host exchange bytes through /dev/shm, not sockets.

Each rank creates one *world segment* at connect time and maps every local peer's::

    header   magic, pid, closed flag                              (u64 words)
    bell     the rank's doorbell and its sleeper count           (shm_wait.Bell)
    rings    one SPSC ring per local destination (shm_ring.Ring)  this rank produces into them
    directory  (group id, members, state, segment name) of each group this rank has opened
               collectives on

Point-to-point (the Transport contract: MessageKey matching in arrival order, signature and size
checks, deadlines, loss) runs over the rings. A message is a record header plus its payload
streamed through the sender's ring to the receiver, or, for large messages where the kernel allows
it, a header carrying the sender's buffer address that the receiver copies in one step with
process_vm_readv (shm_direct), then acknowledges. There is no progress thread: every wait(), test(),
isend() and irecv() moves whatever can move for all pending requests of the process (under one
lock), so two ranks waiting on each other always both advance.

Collectives do not use the rings: the shared-memory engine (backends/shm/) reduces and copies
straight through per-group segments (shm_group.GroupShm), created at a group's first collective.

Setup goes through the store: each rank publishes its segment's name, pid and address, maps its
peers', tests single-copy reads, and waits until all have mapped its segment; then it lets go of the
name. Segments are unnamed files (shm_segment), so nothing is ever left in /dev/shm, whenever and
however a process dies.

A peer is lost when its process has exited (pidfd) or its transport is closed (its closed flag);
waiters notice within ~0.1 s and fail with reason "lost" naming it. The same test decides why a
peer's segment cannot be opened (``_unopenable``): a peer that vanished between publishing its
segment and our opening it is lost; one that is alive but set up the group with other members
(its directory entry says which) or gave up setting it up (its entry's state says why) is the
matching mismatch or timeout.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import threading
import time
from collections import deque
from datetime import timedelta

import numpy as np

from ..errors import DistBackendError, PeerLostError, describe_op
from ..tuning import DEFAULT, Tuning
from . import shm_direct
from .base import ANY_SOURCE, MessageKey, Request, Transport, TransportError
from .buffers import as_bytes
from .matching import Matcher, Unexpected
from .shm_group import MAGIC as GROUP_MAGIC
from .shm_group import GroupShm, init_segment, layout, slot_config
from .shm_ring import ACKED, MODE_DIRECT, MODE_INLINE, PVM_OK, RECORD, Ring, decode, encode
from .shm_segment import Segment, shm_dir
from .shm_wait import Bell, PeerHealth, WaitPolicy, current_cpu, process_alive, wait_until

WORLD_MAGIC = 0x64636F6D6D73686D  # "dcommshm"
_W_MAGIC, _W_PID, _W_CLOSED, _W_CPU = 0, 1, 2, 3  # _W_CPU: 1 + the CPU of the last wait
# Crash news, shared through the world segments: whoever finds a rank's process gone sets that
# rank's _W_CRASHED and bumps every live rank's _W_NEWS, which each rank reads (one word) when it
# opens a collective's round, so a rank that was not waiting learns of the crash as it enters.
_W_CRASHED, _W_NEWS = 4, 5
_BELL_U32 = 16  # u32 index of the bell (byte 64); its sleeper count follows
_RINGS_AT = 128
# A directory entry: u64 words (group id + 1, published last; member count; digest of the members;
# state), then the segment name (NUL-padded). Peers compare the members before opening the segment,
# and read the state when it cannot be opened.
_DIR_ENTRY = 128
_D_GID, _D_COUNT, _D_DIGEST, _D_STATE = 0, 1, 2, 3
_D_NAME = 32
DIR_ENTRIES = 1024
# _D_GID of an entry let go of (its group was destroyed, or set up again under a newer entry): peers
# skip it (0 ends the directory), and the owner reuses it, so the limit is on groups held at once
_D_FREE = (1 << 64) - 1
# _D_STATE: 0 while the owner sets the group up or uses it; else why it gave up setting it up (the
# reason of its error), set before it lets go of the segment
_GAVE_UP = {"mismatch": 1, "timeout": 2, "lost": 3, "error": 4}
_GAVE_UP_REASON = {code: reason for reason, code in _GAVE_UP.items()}
# how long a peer whose segment is gone may take to be seen as exited: a killed process loses its
# descriptors before its pidfd says it exited
_DYING_GRACE_S = 1.0

_CLOSED_WHILE_WAITING = ("this rank's transport was closed while waiting (destroy_process_group, from another "
                         "thread, or the process is exiting)")

DEFAULT_RING_BYTES = 256 * 1024
DIRECT_MIN_BYTES = 64 * 1024  # below this a copy through the ring is cheaper than a system call


def members_digest(ranks) -> int:
    """A 64-bit digest of a group's member list (global ranks in group order), for the directory."""
    raw = b"".join(int(g).to_bytes(8, "little", signed=True) for g in ranks)
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little")


def _open_world_segment(rank: int, g: int, name: str, pid: int) -> Segment:
    """Map rank g's world segment at connect time, or raise the distcomm error saying why it
    cannot be: its process exited (PeerLostError), or gave up setting up and let go of it."""
    try:
        return Segment.open(name)
    except OSError as exc:
        give_up = time.monotonic() + _DYING_GRACE_S
        while process_alive(pid) and time.monotonic() < give_up:
            time.sleep(0.01)
        where = describe_op("init_process_group", None, rank, g)
        if not process_alive(pid):
            raise PeerLostError(
                f"{where}: rank {g} exited (pid {pid} is gone) before this rank could map its shared memory; "
                f"find why it died (its output or exit code), then restart the job") from None
        raise DistBackendError(
            f"{where}: rank {g}'s shared memory can no longer be opened ({exc}) although its process (pid {pid}) "
            f"is alive: it gave up setting up the shared-memory engine; its own error says why. Fix that, then "
            "restart the job") from None


def _unusable(directory: str) -> str | None:
    """Why segments cannot be made in ``directory`` (DISTCOMM_SHM_DIR), or None if they can."""
    try:
        st = os.stat(directory)
    except FileNotFoundError:
        return "it does not exist"
    except NotADirectoryError:
        return "a part of the path before its last name is a file, not a directory"
    except PermissionError:
        return "this user may not look into a directory on the path (no search permission)"
    except OSError as exc:
        return f"it cannot be looked at ({exc.strerror or exc})"
    if not stat.S_ISDIR(st.st_mode):
        kind = "a regular file" if stat.S_ISREG(st.st_mode) else "a special file"
        return f"it is {kind}, not a directory"
    if not os.access(directory, os.W_OK | os.X_OK):
        return (f"this user (uid {os.getuid()}) may not create files in it (mode {stat.S_IMODE(st.st_mode):o}, "
                f"owner uid {st.st_uid}), or it is on a read-only filesystem")
    return None


def _create_segment(nbytes: int, where: str) -> Segment:
    """``Segment.create(nbytes)``, its directory checked first: a DISTCOMM_SHM_DIR that cannot hold
    segments is a TransportError (a DistBackendError) that says why and what to do, never a bare
    OSError. ``where``: the operation and rank, for the message ("" in a collective, whose channel
    adds them)."""
    directory = shm_dir()
    problem = _unusable(directory)
    if problem is None:
        try:
            return Segment.create(nbytes)
        except TransportError:  # out of room: already says so, and what to do
            raise
        except OSError as exc:
            problem = f"a {nbytes}-byte segment could not be made there ({exc.strerror or exc})"
    named = f"DISTCOMM_SHM_DIR={directory}" if "DISTCOMM_SHM_DIR" in os.environ else directory
    raise TransportError(
        f"{where + ': ' if where else ''}the shared-memory engine cannot use {named}: {problem}. Shared memory needs "
        "a writable directory on a tmpfs: point DISTCOMM_SHM_DIR at one, or unset it (the default, /dev/shm, is "
        "one); or use backend=\"tcp\", which needs no shared memory", reason="error")


def _ring_bytes(tuning: Tuning) -> int:
    n = DEFAULT_RING_BYTES if tuning.shm_ring_bytes is None else tuning.shm_ring_bytes
    if n < 4096 or n % 64:
        raise ValueError(f"DISTCOMM_SHM_RING_BYTES={n}: need a multiple of 64 of at least 4096")
    return n


def _world_layout(nlocal: int, ring_bytes: int) -> tuple[int, int]:
    """(offset of the directory, total bytes) of a world segment."""
    directory = _RINGS_AT + nlocal * Ring.block_bytes(ring_bytes)
    return directory, directory + DIR_ENTRIES * _DIR_ENTRY


class _ShmRequest(Request):
    __slots__ = ("_t", "kind", "peer", "key", "signature", "buf", "done", "error", "source", "nbytes",
                 "header", "sent", "direct", "direct_no", "attached", "order")

    def __init__(self, transport, kind: str, peer: int, buf: np.ndarray, key: MessageKey, signature: int):
        self._t = transport
        self.kind = kind  # "send" | "recv"
        self.peer = peer
        self.buf = buf
        self.key = key
        self.signature = signature
        self.done = False
        self.error: TransportError | None = None
        self.source = -1
        self.nbytes = 0
        self.header = None
        self.sent = -1  # sends: -1 until the record header is in the ring, then payload bytes pushed
        self.direct = False
        self.direct_no = 0
        self.attached = None  # receives: the _Incoming streaming into it, once matched
        self.order = 0  # receives: post number (the Matcher's)

    def wait(self, deadline: float | None = None) -> None:
        self._t._wait(self, deadline)

    def test(self) -> bool:
        return self._t._test(self)


class _Incoming:
    """The message whose payload is streaming in from one source."""

    __slots__ = ("src", "nbytes", "got", "target", "recv", "entry")

    def __init__(self, src, nbytes, target, recv, entry):
        self.src = src
        self.nbytes = nbytes
        self.got = 0
        self.target = target  # where the bytes go; None: discard them
        self.recv = recv
        self.entry = entry


class ShmTransport(Transport):
    """Point-to-point between the ranks of one host, plus shared-memory collectives."""

    def __init__(self, rank: int, size: int, local: list[int], segments: dict[int, Segment], pids: dict[int, int],
                 ring_bytes: int, tuning: Tuning = DEFAULT):
        self.rank = rank
        self.size = size
        self.local = list(local)  # global ranks on this host, sorted
        self._index = {g: i for i, g in enumerate(self.local)}
        self._segments = segments
        self._pids = pids
        self._ctl = {g: memoryview(s.buf[:64]).cast("Q") for g, s in segments.items()}
        self._bells = {
            g: Bell(memoryview(s.buf[:_RINGS_AT]).cast("I"), _BELL_U32, s.address + 4 * _BELL_U32)
            for g, s in segments.items()
        }
        self._block = Ring.block_bytes(ring_bytes)
        me = self._index[rank]
        ring_block = self._ring_block
        self._out = {g: Ring(ring_block(segments[rank], self._index[g])) for g in self.local if g != rank}
        self._in = {g: Ring(ring_block(segments[g], me)) for g in self.local if g != rank}
        self._direct_ok: dict[tuple, bool] = {}
        self._dir_at, _ = _world_layout(len(self.local), ring_bytes)
        self._dir_count = 0
        self._dir_free: list[int] = []  # offsets of entries let go of (_D_FREE), reused first
        self._dir_of: dict[int, int] = {}  # group id -> offset of its entry, while it has one
        self.tuning = tuning
        self.policy = WaitPolicy(len(self.local), tuning)
        self.health = PeerHealth({g: p for g, p in pids.items() if g != rank})
        self.bell = self._bells[rank]
        # point-to-point state, all under self._lock
        self._lock = threading.Lock()
        self._queue = {g: deque() for g in self._out}  # sends not yet fully in the ring
        self._unacked = {g: deque() for g in self._out}  # direct sends waiting for the reader
        self._direct_sent = {g: 0 for g in self._out}
        self._direct_read = {g: 0 for g in self._in}
        self._incoming: dict[int, _Incoming | None] = {g: None for g in self._in}
        self._match = Matcher(rank, size)
        self._header = np.empty(RECORD, np.uint8)
        self._closed = False
        # collectives
        self._groups: dict[int, GroupShm] = {}
        self._groups_lock = threading.Lock()

    # -- setup --------------------------------------------------------------------------------
    @classmethod
    def connect(cls, store, rank: int, size: int, timeout: float, local: list[int] | None = None,
                tuning: Tuning = DEFAULT) -> "ShmTransport":
        """Create this rank's segment, map every local peer's, and let go of ours once all have it.

        ``local`` lists the global ranks on this host (default: all ``size`` ranks); ``tuning``
        gives the ring size, the wait policy, the group slots and whether to read peers directly.
        """
        local = sorted(range(size) if local is None else local)
        if rank not in local:
            raise ValueError(f"rank {rank} is not among the local ranks {local}")
        ring_bytes = _ring_bytes(tuning)
        _, total = _world_layout(len(local), ring_bytes)
        shm_direct.allow_peers()
        mine = _create_segment(total, describe_op("init_process_group", None, rank))
        segments = {rank: mine}
        try:
            ctl = memoryview(mine.buf[:64]).cast("Q")
            ctl[_W_PID] = os.getpid()
            ctl[_W_MAGIC] = WORLD_MAGIC
            info = {"name": mine.name, "pid": os.getpid(), "address": mine.address, "ring_bytes": ring_bytes}
            store.set(f"shm/segment/{rank}", json.dumps(info))
            peers = [g for g in local if g != rank]
            infos = {g: json.loads(v) for g, v in zip(peers, store.multi_get([f"shm/segment/{g}" for g in peers]))}
            pids = {rank: os.getpid()}
            for g, peer in infos.items():
                if peer["ring_bytes"] != ring_bytes:
                    raise ValueError(
                        f"rank {g} uses DISTCOMM_SHM_RING_BYTES={peer['ring_bytes']}, this rank {ring_bytes}: "
                        "set the same value on every rank"
                    )
                seg = _open_world_segment(rank, g, peer["name"], peer["pid"])
                segments[g] = seg
                if memoryview(seg.buf[:64]).cast("Q")[_W_MAGIC] != WORLD_MAGIC:
                    raise RuntimeError(f"rank {g}'s shared-memory segment {peer['name']} is not initialized")
                pids[g] = peer["pid"]
            transport = cls(rank, size, local, segments, pids, ring_bytes, tuning)
            for g, peer in infos.items():  # may we read the peer's memory directly?
                ok = tuning.shm_direct and shm_direct.probe(peer["pid"], peer["address"], WORLD_MAGIC)
                transport._in[g].ctl[PVM_OK] = int(ok)
            store.set(f"shm/mapped/{rank}", "1")
            store.wait([f"shm/mapped/{g}" for g in local], timedelta(seconds=timeout))
            mine.unlink()
            return transport
        except BaseException:
            for seg in segments.values():
                seg.close()
            raise

    def _ring_block(self, seg: Segment, i: int) -> np.ndarray:
        """The ring that ``seg``'s owner produces for the local rank of index i."""
        return seg.buf[_RINGS_AT + i * self._block : _RINGS_AT + (i + 1) * self._block]

    # -- helpers for collectives ----------------------------------------------------------------
    def bell_of(self, global_rank: int) -> Bell:
        return self._bells[global_rank]

    def is_local(self, global_rank: int) -> bool:
        return global_rank in self._index

    def all_local(self, ranks) -> bool:
        index = self._index
        return all(g in index for g in ranks)

    def pid_of(self, global_rank: int) -> int:
        return self._pids[global_rank]

    def direct_reads_ok(self, ranks) -> bool:
        """True if every member of ``ranks`` may read every other's memory (process_vm_readv).

        Each rank recorded at connect time, in the rings it consumes, whether it can read their
        producer; every rank maps every ring, so all members compute the same answer.
        """
        key = tuple(ranks)
        ok = self._direct_ok.get(key)
        if ok is None:
            ok = all(
                Ring(self._ring_block(self._segments[g], self._index[h])).ctl[PVM_OK]
                for g in ranks for h in ranks if g != h
            )
            self._direct_ok[key] = ok
        return ok

    def lost_peers(self, ranks) -> list[int]:
        """Ranks among ``ranks`` whose transport is closed or whose process has exited (found here,
        or reported by another rank through the world segments)."""
        ctl = self._ctl
        closed = [g for g in ranks if g != self.rank and ctl[g][_W_CLOSED]]
        reported = [g for g in ranks if g != self.rank and g not in closed and ctl[g][_W_CRASHED]]
        dead = self.health.dead([g for g in ranks if g != self.rank and g not in closed and g not in reported])
        for g in dead:  # tell every rank of this host
            ctl[g][_W_CRASHED] = 1
            for h in self.local:
                if h != g:
                    ctl[h][_W_NEWS] += 1
        return closed + reported + dead

    @property
    def crash_news(self) -> memoryview:
        """One word of shared memory: ``crash_news[0]`` is non-zero once some rank of this host is
        known to have crashed (``lost_peers`` then says which)."""
        return self._ctl[self.rank][_W_NEWS:_W_NEWS + 1]

    def check_members(self, ranks) -> None:
        """Raise TransportError (reason "lost") if a rank among ``ranks`` crashed or closed."""
        lost = self.lost_peers(ranks)
        if lost:
            raise self.lost_error(lost)

    def lost_error(self, lost: list[int], what: str = "") -> TransportError:
        g = lost[0]
        if self._ctl[g][_W_CLOSED]:
            return TransportError(f"rank {g} closed its transport (destroy_process_group or an error){what}",
                                  peer=g, reason="lost")
        return TransportError(
            f"rank {g} exited (pid {self._pids[g]} is gone){what}; no collective of a group with rank {g} can "
            "complete: find why it died (its output or exit code), then restart the job", peer=g, reason="lost")

    def wait_for(self, ready, deadline, peers, on_timeout, arm=None, polled: bool = False, also=None) -> None:
        """Wait for a shared-memory condition involving ``peers`` (global ranks); see shm_wait
        (``arm``: wait_until's, run before the first sleep; ``polled``: the caller has just spun
        for the policy's spin time, so the wait does not spin again; ``also()``: one more check,
        run with the peers' health checks, that raises when the wait can no longer end well)."""

        def check() -> None:
            if self._closed:
                raise TransportError(_CLOSED_WHILE_WAITING, reason="lost")
            lost = self.lost_peers(peers)
            if lost and not ready():
                raise self.lost_error(lost)
            if also is not None and not ready():
                also()

        wait_until(ready, deadline, self.bell, self.policy, check, on_timeout, self._spin_worthwhile(peers), arm,
                   polled)

    def _spin_worthwhile(self, peers) -> bool:
        """Record our CPU; False if a peer we wait for last waited on the same CPU (spinning would
        only delay it). Ranks of one host move between CPUs, so this is asked at every wait."""
        cpu = current_cpu() + 1
        ctl = self._ctl
        ctl[self.rank][_W_CPU] = cpu
        return not any(ctl[g][_W_CPU] == cpu for g in peers if g != self.rank)

    def group_shm(self, gid: int) -> GroupShm | None:
        """Group ``gid``'s shared memory if it has been set up (by ``group_context``), else None."""
        return self._groups.get(gid)

    def group_context(self, gid: int, ranks, rank: int, deadline: float | None) -> GroupShm | None:
        """The shared memory of group ``gid`` (members ``ranks``, global), created on first use;
        None when some member is on another host."""
        ctx = self._groups.get(gid)
        if ctx is not None:
            return ctx
        ranks = list(ranks)
        if not self.all_local(ranks):
            return None
        # No lock held while waiting for peers: groups are set up by their own threads, in any
        # order across ranks. A group's collectives run one at a time (its executor), so one gid is
        # never set up twice at once.
        ctx = self._open_group(gid, ranks, rank, deadline)
        with self._groups_lock:
            if self._closed:
                ctx.close()
                raise TransportError("the shared-memory transport was closed", reason="lost")
            self._groups[gid] = ctx
        return ctx

    def release_group(self, gid: int) -> None:
        """Let go of group ``gid``'s shared memory (destroy_process_group of that group). Peers keep
        their own mappings of our segment until they release the group too; the names were let go of
        at setup, so the memory goes when the last member has let go. The group's directory entry
        is reused by a later group: every member mapped our segment before its setup ended, so no
        peer reads that entry again (an entry of a setup that failed stays: its state tells the
        peers why)."""
        with self._groups_lock:
            ctx = self._groups.pop(gid, None)
            if ctx is not None and not self._closed:
                self._free_entry(gid)
        if ctx is not None:
            ctx.close()

    def _free_entry(self, gid: int) -> None:
        """Let go of group ``gid``'s directory entry, if it has one (under ``_groups_lock``)."""
        at = self._dir_of.pop(gid, None)
        if at is not None:
            memoryview(self._segments[self.rank].buf[at : at + _D_NAME]).cast("Q")[_D_GID] = _D_FREE
            self._dir_free.append(at)

    def _open_group(self, gid: int, ranks: list[int], rank: int, deadline: float | None) -> GroupShm:
        if self._closed:
            raise TransportError("the shared-memory transport is closed", reason="lost")
        slot_bytes, nslots = slot_config(self.tuning)
        _, total = layout(len(ranks), slot_bytes, nslots)
        digest = members_digest(ranks)
        try:
            mine = _create_segment(total, "")
        except TransportError as exc:
            # No segment (out of room, an unusable DISTCOMM_SHM_DIR): the peers, which wait for our
            # entry to map our segment, would otherwise wait out the group's timeout. An entry that
            # says we gave up lets them fail at once, pointing at this rank's own error.
            try:
                self._gave_up(self._publish_group(gid, "", len(ranks), digest), exc.reason or "error")
            except Exception:  # noqa: BLE001 - the directory is full, or the transport closed meanwhile
                pass  # the peers then time out (or see it closed), naming this rank
            raise
        segments = [None] * len(ranks)
        segments[rank] = mine
        entry = None
        try:
            init_segment(mine.buf, gid, len(ranks), slot_bytes, nslots)
            entry = self._publish_group(gid, mine.name, len(ranks), digest)
            for q, g in enumerate(ranks):
                if q == rank:
                    continue
                name, count, theirs, state = self._find_group(g, gid, deadline)
                if (count, theirs) != (len(ranks), digest):
                    raise self._other_members(g, gid, ranks, count)
                if state:  # its segment is going or gone: mapping it would only lead to waiting for g
                    raise self._unopenable(g, gid, ranks, None)
                try:
                    seg = Segment.open(name)
                except OSError as exc:
                    raise self._unopenable(g, gid, ranks, exc) from None
                segments[q] = seg
                words = memoryview(seg.buf[:64]).cast("Q")
                if (words[0], words[1]) != (GROUP_MAGIC, gid):
                    raise TransportError(f"rank {g}'s directory names {name} for group {gid}, which is not that "
                                         "group's shared memory", peer=g, reason="error")
                if words[2] != len(ranks):
                    raise self._other_members(g, gid, ranks, words[2])
                if (words[3], words[4]) != (slot_bytes, nslots):
                    raise TransportError(
                        f"rank {g}'s shared memory for group {gid} has {words[4]} slots of {words[3]} bytes, this "
                        f"rank's {nslots} slots of {slot_bytes} bytes: set DISTCOMM_SHM_SLOT_BYTES and "
                        "DISTCOMM_SHM_SLOTS alike on every rank",
                        peer=g,
                        reason="mismatch",
                    )
            ctx = GroupShm(self, gid, ranks, rank, segments, slot_bytes, nslots)

            def gave_up(waiting: list[int]) -> None:  # a member we wait for gave up: it never maps ours
                for q in waiting:
                    entry = self._lookup_group(ranks[q], gid)
                    if entry is not None and entry[3]:
                        raise self._unopenable(ranks[q], gid, ranks, None)

            ctx.unlink_when_mapped(deadline, gave_up)
            return ctx
        except BaseException as exc:
            if entry is not None:  # before the segment goes: a peer that cannot open it then learns why
                reason = exc.reason if isinstance(exc, TransportError) else "error"
                self._gave_up(entry, reason)
            for seg in segments:
                if seg is not None:
                    seg.close()
            raise

    def _other_members(self, g: int, gid: int, ranks: list[int], count: int) -> TransportError:
        """The mismatch of a member whose group ``gid`` has other members than ours."""
        if count != len(ranks):
            theirs = f"with {count} members, this rank with {len(ranks)} ({list(ranks)})"
        else:
            theirs = f"with other members than this rank's {list(ranks)}"
        return TransportError(
            f"rank {g} set up process group {gid} {theirs}: the ranks passed different ranks to new_group, or "
            "created their groups in a different order; every rank must create the same groups, with the same "
            "ranks, in the same order",
            peer=g,
            reason="mismatch",
        )

    def _unopenable(self, g: int, gid: int, ranks: list[int], exc: OSError | None) -> TransportError:
        """Why rank g's segment for group ``gid``, which its directory entry names, cannot be opened
        or will never be mapped (``exc``: Segment.open's error; None: g's entry says it gave up), as
        the error to raise. A member whose process exited (the test every wait makes) is the cause,
        g or another one; else g's entry says why it gave up (a member that closed its transport,
        when that is why); else a member that closed its transport; else the segment is gone, or its
        path leads to another file (never mapped: Segment.open checks), while g lives on."""
        give_up = time.monotonic() + _DYING_GRACE_S
        what = f" before this rank could map its shared memory for group {gid}"
        while True:
            lost = self.lost_peers(ranks)
            crashed = [x for x in lost if not self._ctl[x][_W_CLOSED]]
            if crashed:
                return self.lost_error(crashed, what)
            found = self._lookup_group(g, gid)
            state = found[3] if found is not None else 0
            if state:
                reason = _GAVE_UP_REASON.get(state, "error")
                if reason == "lost" and lost:
                    return self.lost_error(lost, what)
                return self._gave_up_error(g, gid, reason)
            if lost:
                return self.lost_error(lost, what)
            if time.monotonic() >= give_up:
                break
            time.sleep(0.01)
        return TransportError(
            f"rank {g} published its shared memory for group {gid}, but this rank cannot open it ({exc}) although "
            f"rank {g} is alive and has not given up on the group; only the segment it named is ever mapped. "
            f"Something closed rank {g}'s descriptors behind its back (os.closerange, a library that closes file "
            "descriptors): destroy the process group and create it again, or restart the job",
            peer=g,
            reason="error",
        )

    @staticmethod
    def _gave_up_error(g: int, gid: int, reason: str) -> TransportError:
        why = {
            "mismatch": "it found a member whose group differs from its own (its CollectiveMismatchError names the "
                        "member): every rank must create the same groups, with the same ranks, in the same order",
            "timeout": "it timed out waiting for a member (its DistTimeoutError names the member): every member "
                       "must reach the group's first collective within the group's timeout",
            "lost": "a member it needed was lost (its PeerLostError names the member)",
        }.get(reason, "it failed there (its own error says why)")
        return TransportError(
            f"rank {g} gave up setting up the shared memory of group {gid}, so this group's first collective "
            f"cannot complete: {why}",
            peer=g,
            reason=reason if reason in ("mismatch", "timeout") else "error",
        )

    def _publish_group(self, gid: int, name: str, count: int, digest: int) -> int:
        """Add group ``gid``'s entry to our directory; returns where it is (``_gave_up``'s argument)."""
        buf = self._segments[self.rank].buf
        raw = name.encode()
        if len(raw) > _DIR_ENTRY - _D_NAME:
            raise TransportError(f"segment name {name!r} is longer than {_DIR_ENTRY - _D_NAME} bytes: shorten "
                                 "TORCHELASTIC_RUN_ID", reason="error")
        with self._groups_lock:  # one writer per directory: this process's threads take turns
            # a group set up again (its earlier setup failed) has one entry: the newest
            self._free_entry(gid)
            if self._dir_free:
                at = self._dir_free.pop()
            elif self._dir_count < DIR_ENTRIES:
                at = self._dir_at + self._dir_count * _DIR_ENTRY
                self._dir_count += 1
            else:
                raise TransportError(
                    f"the shared-memory engine supports {DIR_ENTRIES} process groups with shared memory at once "
                    "per process; destroy the groups you no longer use (destroy_process_group(group)), or create "
                    "fewer groups",
                    reason="error",
                )
            buf[at + _D_NAME : at + _DIR_ENTRY] = 0
            buf[at + _D_NAME : at + _D_NAME + len(raw)] = np.frombuffer(raw, np.uint8)
            words = memoryview(buf[at : at + _D_NAME]).cast("Q")
            words[_D_COUNT] = count
            words[_D_DIGEST] = digest
            words[_D_STATE] = 0
            words[_D_GID] = gid + 1  # publish after the rest
            self._dir_of[gid] = at
        for g in self.local:
            if g != self.rank:
                self._bells[g].ring()
        return at

    def _gave_up(self, at: int, reason: str) -> None:
        """Mark our directory entry at ``at``: we gave up setting its group up, for ``reason``.
        Nothing to mark once the transport is closed (destroy_process_group from another thread):
        the peers then read that this rank closed its transport."""
        buf = self._segments[self.rank].buf
        if buf is not None:
            memoryview(buf[at : at + _D_NAME]).cast("Q")[_D_STATE] = _GAVE_UP.get(reason, 4)

    def _lookup_group(self, g: int, gid: int) -> tuple[str, int, int, int] | None:
        """Rank g's latest directory entry for group ``gid`` (a rank that gave up setting a group up
        publishes a new entry when it tries again): (segment name, member count, members' digest,
        state), or None if it has not published one."""
        buf = self._segments[g].buf
        if buf is None:  # closed (destroy_process_group from another thread while this one waits)
            raise TransportError(_CLOSED_WHILE_WAITING, reason="lost")
        words = memoryview(buf[self._dir_at :]).cast("Q")
        step = _DIR_ENTRY // 8
        last = None
        for i in range(DIR_ENTRIES):
            v = words[i * step]
            if v == 0:
                break
            if v == gid + 1:
                last = i
        if last is None:
            return None
        at = self._dir_at + last * _DIR_ENTRY
        name = bytes(buf[at + _D_NAME : at + _DIR_ENTRY]).rstrip(b"\0").decode()
        e = last * step
        return name, words[e + _D_COUNT], words[e + _D_DIGEST], words[e + _D_STATE]

    def _find_group(self, g: int, gid: int, deadline: float | None) -> tuple[str, int, int, int]:
        found: list = []

        def ready() -> bool:
            entry = self._lookup_group(g, gid)
            if entry:
                found.append(entry)
            return bool(found)

        def on_timeout() -> TransportError:
            return TransportError(
                f"Timed out waiting for rank {g} to open its shared memory for group {gid} (it has not "
                "reached this group's first collective)",
                peer=g,
                reason="timeout",
            )

        self.wait_for(ready, deadline, [g], on_timeout)
        return found[0]

    # -- the Transport interface ---------------------------------------------------------------
    def isend(self, dst: int, data: np.ndarray, key: MessageKey, signature: int = 0) -> Request:
        flat = as_bytes(data)
        self._check_peer(dst, False)
        req = _ShmRequest(self, "send", dst, flat, key, signature)
        req.nbytes = flat.nbytes
        with self._lock:
            if self._closed:
                self._fail(req, TransportError("cannot send: this rank's transport is closed", peer=dst, reason="lost"))
            elif dst == self.rank:
                self._arrive_local(req)
            elif self._ctl[dst][_W_CLOSED]:
                self._fail(req, self.lost_error([dst], "; cannot send to it"))
            else:
                req.direct = flat.nbytes >= DIRECT_MIN_BYTES and bool(self._out[dst].ctl[PVM_OK])
                req.header = encode(MODE_DIRECT if req.direct else MODE_INLINE, key, signature, flat.nbytes,
                                    flat.ctypes.data if req.direct else 0)
                self._queue[dst].append(req)
                self._push(dst)
        return req

    def irecv(self, src: int, out: np.ndarray, key: MessageKey, signature: int = 0) -> Request:
        flat = as_bytes(out)
        self._check_peer(src, True)
        req = _ShmRequest(self, "recv", src, flat, key, signature)
        with self._lock:
            if self._closed:
                self._fail(req, TransportError("cannot receive: this rank's transport is closed", peer=src, reason="lost"))
                return req
            msg = self._match.post(req)
            if msg is not None:
                self._take(msg, req)
            else:
                self._progress()
        return req

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._ctl[self.rank][_W_CLOSED] = 1
            err = TransportError("this rank's shared-memory transport was closed", reason="lost")
            pending, _ = self._match.clear()
            for q in list(self._queue.values()) + list(self._unacked.values()):
                pending.extend(q)
            pending.extend(st.recv for st in self._incoming.values() if st is not None and st.recv is not None)
            for req in pending:
                if not req.done:
                    self._fail(req, err)
        for g in self.local:
            if g != self.rank:
                self._bells[g].ring()
        with self._groups_lock:
            for ctx in self._groups.values():
                ctx.close()
            self._groups.clear()
        self.health.close()
        for seg in self._segments.values():
            seg.close()

    def __repr__(self) -> str:
        return f"ShmTransport(rank={self.rank}, size={self.size}, local={self.local})"

    # -- requests -----------------------------------------------------------------------------
    def _check_peer(self, peer: int, allow_any: bool) -> None:
        if allow_any and peer == ANY_SOURCE:
            return
        if peer not in self._index:
            raise ValueError(f"rank {peer} is not a shared-memory peer of rank {self.rank} (local ranks {self.local})")

    def _complete(self, req: _ShmRequest) -> None:
        if not req.done:
            req.done = True
            req.attached = None
            if req.kind == "recv":
                req.buf = None  # sends keep theirs: a direct read may still be reading it

    def _fail(self, req: _ShmRequest, err: TransportError) -> None:
        if not req.done:
            req.error = err
            self._complete(req)

    def _test(self, req: _ShmRequest) -> bool:
        if not req.done:
            with self._lock:
                self._progress()
        return req.done

    def _wait(self, req: _ShmRequest, deadline: float | None) -> None:
        if not req.done:
            peers = [req.peer] if req.peer != ANY_SOURCE else [g for g in self.local if g != self.rank]

            def check() -> None:
                lost = self.lost_peers(peers)
                if lost or self._closed:
                    with self._lock:
                        self._progress()
                        if not req.done:
                            if self._closed:
                                err = TransportError("this rank's transport was closed", reason="lost")
                            else:
                                what = "; the message can no longer be " + ("sent" if req.kind == "send" else "received")
                                err = self.lost_error(lost, what)
                            self._withdraw(req)
                            self._fail(req, err)

            wait_until(lambda: self._test(req), deadline, self.bell, self.policy, check, lambda: self._timed_out(req),
                       self._spin_worthwhile(peers))
        if req.error is not None:
            raise req.error

    def _timed_out(self, req: _ShmRequest) -> TransportError | None:
        with self._lock:
            self._progress()
            if req.done:
                return None
            peer = None if req.peer == ANY_SOURCE else req.peer
            who = "any rank" if peer is None else f"rank {peer}"
            what = "send to" if req.kind == "send" else "receive from"
            err = TransportError(f"Timed out waiting to {what} {who}", peer=peer, reason="timeout")
            self._withdraw(req)
            self._fail(req, err)
            return err

    def _withdraw(self, req: _ShmRequest) -> None:
        """Take an unfinished request out of the engine (under the lock); late bytes are discarded."""
        if req.kind == "recv":
            self._match.withdraw(req)
            if req.attached is not None:  # streaming in: the rest of it is discarded
                req.attached.recv, req.attached.target = None, None
            return
        queue = self._queue.get(req.peer)
        if queue is None or req not in queue:
            return  # waiting for a direct read's acknowledgement: keep its buffer referenced
        if req.sent < 0:
            queue.remove(req)
        else:  # mid-stream: the receiver expects the rest; send it from a private copy
            req.buf = req.buf[req.sent :].copy()
            req.sent = 0
            req.header = None

    # -- matching -----------------------------------------------------------------------------
    def _take(self, msg: Unexpected, req: _ShmRequest) -> None:
        """A new receive takes a message that arrived before it (whole, or still streaming in)."""
        err = msg.error or self._match.mismatch(req.key, msg.src, msg.signature, msg.nbytes, req.signature,
                                                req.buf.nbytes)
        if not msg.complete:  # still streaming in from its ring: the rest goes straight to req
            st = self._incoming[msg.src]
            st.entry = None
            if err is None:
                req.buf[: st.got] = msg.data[: st.got]
                st.target, st.recv, req.attached = req.buf, req, st
                return
            st.target = None  # discard the rest
        elif err is None:
            if msg.nbytes:
                req.buf[...] = msg.data
            req.source = msg.src
            req.nbytes = msg.nbytes
            self._complete(req)
            return
        self._fail(req, err)

    def _arrived(self, src: int, key: MessageKey, signature: int, nbytes: int):
        """(target buffer or None to discard, receive, Unexpected entry) for a message that just arrived."""
        recv, msg = self._match.offer(src, key, signature, nbytes)
        if recv is None:
            msg.data = np.empty(nbytes, np.uint8)
            return msg.data, None, msg
        err = self._match.mismatch(key, src, signature, nbytes, recv.signature, recv.buf.nbytes)
        if err is not None:
            self._fail(recv, err)
            return None, None, None
        return recv.buf, recv, None

    def _finish(self, src: int, nbytes: int, recv, entry, error=None) -> None:
        if recv is not None:
            if error is not None:
                self._fail(recv, error)
            else:
                recv.source = src
                recv.nbytes = nbytes
                self._complete(recv)
        if entry is not None:
            entry.error = error
            entry.complete = True

    def _arrive_local(self, send: _ShmRequest) -> None:
        """A send to ourselves: match it like an arrival, with the payload already at hand."""
        target, recv, entry = self._arrived(self.rank, send.key, send.signature, send.nbytes)
        if target is not None and send.nbytes:
            target[...] = send.buf
        self._finish(self.rank, send.nbytes, recv, entry)
        self._complete(send)

    # -- progress (under self._lock) --------------------------------------------------------------
    def _progress(self) -> None:
        for dst, queue in self._queue.items():
            if queue or self._unacked[dst]:
                self._push(dst)
        for src, ring in self._in.items():
            if self._incoming[src] is not None or ring.readable() >= RECORD:
                self._pull(src, ring)

    def _push(self, dst: int) -> None:
        ring = self._out[dst]
        queue = self._queue[dst]
        moved = False
        while queue:
            s = queue[0]
            if s.sent < 0:
                if ring.writable() < RECORD:
                    break
                ring.push(s.header)
                s.sent = 0
                moved = True
                if s.direct:
                    queue.popleft()
                    self._direct_sent[dst] += 1
                    s.direct_no = self._direct_sent[dst]
                    self._unacked[dst].append(s)
                    continue
            if s.sent < s.buf.size:
                n = ring.push(s.buf[s.sent :])
                s.sent += n
                moved = moved or n > 0
            if s.sent < s.buf.size:
                break
            queue.popleft()
            self._complete(s)
        unacked = self._unacked[dst]
        if unacked:
            acked = ring.ctl[ACKED]
            while unacked and unacked[0].direct_no <= acked:
                self._complete(unacked.popleft())
        if moved:
            self._bells[dst].ring()

    def _pull(self, src: int, ring: Ring) -> None:
        moved = False
        while True:
            st = self._incoming[src]
            if st is None:
                if ring.readable() < RECORD:
                    break
                ring.pull(self._header)
                moved = True
                st = self._begin(src, ring, decode(self._header))
                if st is None:
                    continue
                self._incoming[src] = st
            want = st.nbytes - st.got
            n = ring.pull(None if st.target is None else st.target[st.got :], want)
            if n == 0:
                break
            moved = True
            st.got += n
            if st.got == st.nbytes:
                self._incoming[src] = None
                self._finish(src, st.nbytes, st.recv, st.entry)
        if moved:
            self._bells[src].ring()

    def _begin(self, src: int, ring: Ring, rec) -> _Incoming | None:
        key = MessageKey(rec.group, rec.kind, rec.seq)
        target, recv, entry = self._arrived(src, key, rec.signature, rec.nbytes)
        if rec.mode == MODE_DIRECT:
            error = None
            if target is not None:
                try:
                    shm_direct.read(self._pids[src], rec.address, target)
                except shm_direct.DirectReadError as exc:
                    error = TransportError(f"could not read rank {src}'s message directly: {exc}", peer=src,
                                           reason=exc.reason)
            self._direct_read[src] += 1
            ring.ctl[ACKED] = self._direct_read[src]
            self._finish(src, rec.nbytes, recv, entry, error)
            return None
        if rec.nbytes == 0:
            self._finish(src, 0, recv, entry)
            return None
        st = _Incoming(src, rec.nbytes, target, recv, entry)
        if recv is not None:
            recv.attached = st
        return st
