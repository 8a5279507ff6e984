"""A Transport over MPI point-to-point (mpi4py's buffer calls), for the "mpi" engine.

Why a transport at all when MPI has collectives: distcomm's own algorithms (``_algorithms``) run
over it for what MPI lacks (fp16, bfloat16, complex and bool reductions, MIN/MAX with torch's NaN
rule, uneven splits), and torch's ``send``/``recv``/``irecv(src=None)`` are point-to-point.

**Matching.** MPI matches by (communicator, source, tag) in posting order, the same
non-overtaking rule as ``transport/matching.py``; so a MessageKey maps onto MPI instead of being
matched here. Each process group has its own communicator (``open_group``, a collective call on the
group's members, made by the engine when the group is created), so the key's group is the
communicator and only (kind, seq) must fit in the tag. Tags have ``MPI_TAG_UB`` bits (29 with
MPICH, 31 with Open MPI): the top bit is the kind; a collective's tag then holds 8 bits of the
call's signature and its sequence number modulo what is left (only one collective of a group is in
flight at a time, so the wrap-around never aliases); a point-to-point tag is the user's tag when it is in
0..``p2p_tag_limit``-1 (2**27 with MPICH); any other tag (negative, or larger) is taken modulo that
limit in a range of its own, so two such tags that differ by a multiple of it, used at once between
the same two ranks of a group, would match each other's messages.

**Checks.** A message bigger than its receive fails the receive (MPI's truncation error); a smaller
one is detected from the status: both are reported as a mismatch naming the peer. A collective
message with a different signature has a different tag, so it is never matched: the call times out
instead of reading another collective's bytes. Point-to-point messages carry no signature (torch's
gloo accepts a recv of another dtype of the same byte size; so does this transport).

**Deadlines.** A request is tested against its deadline (``wait_request``): a receive that times
out is cancelled; a send cannot be (MPI deprecates cancelling sends), so it is left to MPI.

**Lost peers.** MPI has no notion of one: under MPICH's hydra (tests/test_mpi_engine.py), Open MPI's
mpirun (by default) and ``srun --kill-on-bad-exit=1``, a process that dies makes the launcher abort
the whole job, so a peer's death ends this process too rather than raising here; under a launcher
that lets the job go on, the survivors' requests time out (README "MPI and Slurm").

A rank whose program ends without destroy_process_group (an uncaught exception, ``sys.exit``) does
not die at once: its exit waits in MPI_Finalize for every other rank's, so the others would wait
for it until their timeout. Such a rank says so instead (``announce_departure``, called at exit
through ``MpiEngine.leave``: _api/leaving.py), and so does a rank that closes its transport (destroy_process_group), as the
shared-memory transport's closed flag does: one small message to every other rank on a
communicator of the transport's own, on which every rank keeps a receive posted. A wait on a
request among ranks that left ends (reason "lost", naming the rank) ``DEPARTED_GRACE_S`` after the
notice is seen, time for what the rank sent before leaving to land. Waits look for notices only
once they have spun (``wait_request``'s ``check``, at most every ``NOTICE_POLL_S``): a call that
completes at once never does. A notice carries its transport's number (drawn by rank 0, told to
all when the transport is made): one that arrives after its receiver closed is never read by a
later transport whose communicator MPI gave the same context.

**Long waits.** A call that waits longer than ``TELL_AFTER_S`` can tell the other members of its
group what it waits in (``tell_waiting``: a few int64 words of the engine's, sent on the notices'
communicator with a tag of their own), and read what they told (``waiting_calls``). The engine uses
it where MPI hangs instead of failing: ranks that started different persistent requests (or a
persistent request and a nonblocking collective) are never matched by MPI, so each waits, tells,
sees that the other waits in another call, and raises (backends/mpi/collectives.py). The words are
read, like the notices, when a wait has spun (``poll_notices``), and the last one of each (group,
rank) is kept.

**Initialisation.** ``load_mpi`` imports ``mpi4py.MPI``, which initialises MPI at thread level
MULTIPLE (mpi4py's default; distcomm runs each group's work on its own thread) unless the program
already did; it refuses a lower level. distcomm never finalises MPI: mpi4py does at exit, after the
program, whoever initialised it.
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np

from ..errors import DistBackendError
from .base import ANY_SOURCE, KIND_P2P, MessageKey, Request, Transport, TransportError

# How a waiter polls MPI, which makes progress only inside its calls (so a large transfer needs the
# test loop to keep turning, as MPI's own blocking calls spin): tightly for SPIN_S, then yielding
# the CPU between tests until YIELD_S (ranks may outnumber CPUs: a peer may need this one), then,
# a wait that long being a wait for a peer that is elsewhere (a barrier while others compute),
# sleeping POLL_SLEEP_S between tests.
SPIN_S = 0.0001
YIELD_S = 1.0
POLL_SLEEP_S = 0.0002
# Departures (see "Lost peers" in the module doc): how often a wait tests for a notice; how long a
# wait on a rank that left goes on after its notice (its last messages may still be in flight);
# how long a leaving rank waits for its notices to go.
NOTICE_POLL_S = 0.01
DEPARTED_GRACE_S = 0.5
NOTICE_SEND_S = 1.0
#: why a rank left, in its notice
DEPARTED_FAILED, DEPARTED_EXITED, DEPARTED_CLOSED = 1, 2, 3
_NOTICE_TAG = 1
# Long waits (see the module doc): after how long a wait tells the others what it waits in; the
# words it tells (the engine's), after the transport's number and the group's id.
TELL_AFTER_S = 0.05
WAITING_WORDS = 6
_WAITING_TAG = 2
_DEPARTURES = {
    DEPARTED_FAILED: "failed (an uncaught exception ended its program) and left the MPI job",
    DEPARTED_EXITED: "ended its program without destroy_process_group and left the MPI job",
    DEPARTED_CLOSED: "closed its transport (destroy_process_group or an error)",
}


def load_mpi(multiple: bool = True):
    """The ``mpi4py.MPI`` module, MPI initialised at thread level MULTIPLE (see the module doc).
    ``multiple=False`` accepts an MPI the program initialised at a lower level (for calls made
    from one thread only, as the rendezvous's broadcast)."""
    try:
        import mpi4py
    except ImportError as exc:
        raise DistBackendError(
            f"backend 'mpi' needs mpi4py ({exc}); install it with: pip install 'distcomm[mpi]'"
        ) from None
    import sys

    if "mpi4py.MPI" not in sys.modules:
        mpi4py.rc.threads = True
        mpi4py.rc.thread_level = "multiple"
    from mpi4py import MPI

    if MPI.Is_finalized():
        raise DistBackendError("backend 'mpi': MPI has already been finalized in this process")
    if not MPI.Is_initialized():
        MPI.Init_thread(MPI.THREAD_MULTIPLE)
    if multiple and MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        raise DistBackendError(
            "backend 'mpi': MPI was initialised below thread level MULTIPLE, but distcomm calls MPI from "
            "each group's worker thread; set mpi4py.rc.thread_level = 'multiple' before importing mpi4py.MPI"
        )
    return MPI


def fold_signature(signature: int) -> int:
    """A 32-bit signature folded into the 8 bits a tag has room for."""
    s = signature & 0xFFFFFFFF
    return (s ^ (s >> 8) ^ (s >> 16) ^ (s >> 24)) & 0xFF


class TagLayout:
    """MessageKey -> MPI tag, within ``tag_ub`` (see the module doc). Pure, tested on numbers."""

    def __init__(self, tag_ub: int):
        bits = int(tag_ub).bit_length()  # tag_ub is 2**bits - 1 in practice; the tags stay below it
        if bits < 15:
            raise DistBackendError(f"MPI_TAG_UB={tag_ub} is below 32767, the MPI standard's minimum")
        self.kind_bit = 1 << (bits - 1)
        self.sig_bits = 8 if bits >= 24 else 0
        self.seq_bits = bits - 1 - self.sig_bits
        # point-to-point tags 0 .. limit-1 are themselves; any other int (a negative one, or
        # send_object_list's -2**62) is taken modulo limit in a second range of its own
        self.p2p_tag_limit = self.kind_bit >> 1

    def tag(self, key: MessageKey, signature: int) -> int:
        if key.kind == KIND_P2P:
            t = key.seq
            if 0 <= t < self.p2p_tag_limit:
                return self.kind_bit | t
            return self.kind_bit | self.p2p_tag_limit | (t % self.p2p_tag_limit)
        sig = fold_signature(signature) if self.sig_bits else 0
        return (sig << self.seq_bits) | (key.seq & ((1 << self.seq_bits) - 1))


class GroupComm:
    """One process group's communicator: ``ranks`` maps comm rank -> engine rank; ``check``: the
    transport's health for waits on the group's requests (``MpiTransport.check``)."""

    __slots__ = ("comm", "ranks", "rank_of", "check")

    def __init__(self, comm, ranks, transport: "MpiTransport | None" = None):
        self.comm = comm
        self.ranks = list(ranks)
        self.rank_of = {r: i for i, r in enumerate(self.ranks)}
        members = tuple(self.ranks)
        self.check = None if transport is None else (lambda: transport.check(members))


def mpi_error(MPI, exc, peer: int | None, what: str) -> TransportError:
    try:
        cls = exc.Get_error_class()
    except Exception:  # noqa: BLE001 - not an MPI.Exception
        cls = None
    if cls == MPI.ERR_TRUNCATE:
        return TransportError(
            f"{what}: the message from rank {peer} is longer than the receive (the ranks called different "
            "collectives, or the same one with different sizes)", peer=peer, reason="mismatch")
    return TransportError(f"{what}: MPI error: {exc}", peer=peer, reason="error")


def wait_request(MPI, req, deadline: float | None, status=None, check=None) -> None:
    """Test ``req`` until it completes; TransportError(timeout) past ``deadline`` (time.monotonic);
    ``check()`` (a GroupComm's ``check``: the transport closed, a member left), called once the wait
    has spun, returns the TransportError that ends the wait, or None. MPI errors propagate."""
    if req.Test(status):
        return
    start = time.monotonic()
    spin_until, yield_until = start + SPIN_S, start + YIELD_S
    test = req.Test
    pause = None
    n = 0
    while True:
        if test(status):
            return
        n += 1
        if pause is not None:
            pause()
        if n & 63 == 0 or pause is not None:
            now = time.monotonic()
            if deadline is not None and now > deadline:
                raise TransportError(f"Timed out ({now - start:.1f}s into this wait)", reason="timeout")
            if check is not None:
                problem = check()
                if problem is not None:
                    raise problem
            if now > yield_until:
                pause = _poll_sleep
            elif now > spin_until:
                pause = os.sched_yield


def _poll_sleep() -> None:
    time.sleep(POLL_SLEEP_S)


class MpiRequest(Request):
    """A posted Isend or Irecv. One thread at a time tests it (MPI forbids concurrent tests)."""

    __slots__ = ("transport", "req", "status", "peer", "out", "receiving", "group", "done", "error", "lock",
                 "source", "nbytes")

    def __init__(self, transport: "MpiTransport", req, peer: int, out: np.ndarray, receiving: bool,
                 group: GroupComm):
        self.transport = transport
        self.req = req
        self.status = transport.MPI.Status() if receiving else None
        self.peer = peer  # engine rank, or ANY_SOURCE
        self.out = out  # kept alive until MPI is done with it
        self.receiving = receiving
        self.group = group
        self.done = False
        self.error: TransportError | None = None
        self.lock = threading.Lock()
        self.source = -1
        self.nbytes = 0

    def _finish(self) -> None:
        self.done = True
        if not self.receiving:
            return
        st = self.status
        src = st.Get_source()
        self.source = self.group.ranks[src] if 0 <= src < len(self.group.ranks) else -1
        self.nbytes = st.Get_count(self.transport.MPI.BYTE)
        if self.nbytes != self.out.nbytes:
            self.error = TransportError(
                f"the message from rank {self.source} does not match the receive posted on rank "
                f"{self.transport.rank}: it expects {self.out.nbytes} bytes but rank {self.source} sent "
                f"{self.nbytes} bytes", peer=self.source, reason="mismatch")

    def _fail(self, exc: TransportError) -> None:
        self.done = True
        self.error = exc

    def wait(self, deadline: float | None = None) -> None:
        with self.lock:
            if not self.done:
                MPI = self.transport.MPI
                peer = None if self.peer == ANY_SOURCE else self.peer
                try:
                    wait_request(MPI, self.req, deadline, self.status, self._check)
                except TransportError as exc:
                    exc.peer = exc.peer if exc.peer is not None else peer
                    if exc.reason in ("timeout", "lost") and self.receiving:
                        self._cancel()
                    if exc.reason != "timeout" or self.receiving:
                        self._fail(exc)  # a timed-out send is still MPI's: wait() may be called again
                    raise
                except MPI.Exception as exc:
                    self._fail(mpi_error(MPI, exc, peer, "receive" if self.receiving else "send"))
                else:
                    self._finish()
        if self.error is not None:
            raise self.error

    def _check(self) -> TransportError | None:
        """Why the wait must end (the transport closed, the peer left), or None; for a receive from
        any rank, any member of the group leaving ends it."""
        return self.transport.check(self.group.ranks if self.peer == ANY_SOURCE else (self.peer,))

    def _cancel(self) -> None:
        try:
            self.req.Cancel()
            self.req.Wait()
        except Exception:  # noqa: BLE001 - the receive may have completed meanwhile; it is dropped
            pass

    def test(self) -> bool:
        if self.done:
            return True
        if not self.lock.acquire(blocking=False):
            return False
        try:
            if self.done:
                return True
            try:
                if not self.req.Test(self.status):
                    return False
            except self.transport.MPI.Exception as exc:
                self._fail(mpi_error(self.transport.MPI, exc, None if self.peer == ANY_SOURCE else self.peer, "request"))
                return True
            self._finish()
            return True
        finally:
            self.lock.release()


class MpiTransport(Transport):
    """Point-to-point over MPI among the ranks of ``comm`` (the engine's world communicator, owned:
    freed by ``close``). Messages of a process group travel on that group's communicator, opened
    with ``open_group`` on its members."""

    def __init__(self, MPI, comm):
        self.MPI = MPI
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.layout = TagLayout(MPI.COMM_WORLD.Get_attr(MPI.TAG_UB))
        self._groups: dict[int, GroupComm] = {}
        self._lock = threading.Lock()
        self._closed = False
        # departures (module doc): engine rank -> (why, time.monotonic() its notice was seen)
        self.departed: dict[int, tuple[int, float]] = {}
        self._announced = False
        self._notice_lock = threading.Lock()  # one thread at a time tests the notice receive
        self._next_poll = 0.0
        self._notices = comm.Dup()  # collective: every rank makes its transport at the same point
        number = np.array([int.from_bytes(os.urandom(7), "little") if self.rank == 0 else 0], np.int64)
        self._notices.Bcast([number, MPI.INT64_T], root=0)
        self._number = int(number[0])
        self._notice_in = np.zeros(2, np.int64)  # (transport number, why)
        self._notice_status = MPI.Status()
        self._notice_req = self._post_notice_receive()
        self._notice_out: tuple = ()  # (payload, requests) of this rank's own notices, kept for MPI
        # long waits (module doc): group id -> {engine rank: the words it told last}
        self.waiting: dict[int, dict[int, tuple]] = {}
        self._waiting_in = np.zeros(2 + WAITING_WORDS, np.int64)  # (transport number, group id, words)
        self._waiting_status = MPI.Status()
        self._waiting_req = self._post_waiting_receive()
        self._told: list = []  # (payload, requests) of this rank's own words, kept until sent

    def __repr__(self) -> str:
        return f"MpiTransport(rank={self.rank}, size={self.size})"

    def is_closed(self) -> bool:
        return self._closed

    # -- departures ----------------------------------------------------------------------------
    def _post_notice_receive(self):
        return self._notices.Irecv([self._notice_in, self.MPI.INT64_T], self.MPI.ANY_SOURCE, _NOTICE_TAG)

    def _post_waiting_receive(self):
        return self._notices.Irecv([self._waiting_in, self.MPI.INT64_T], self.MPI.ANY_SOURCE, _WAITING_TAG)

    def poll_notices(self) -> None:
        """Record the departure notices and the long waits' words that have arrived (a Test of each
        posted receive)."""
        if not self._notice_lock.acquire(blocking=False):
            return  # another thread is testing it
        try:
            self._next_poll = time.monotonic() + NOTICE_POLL_S
            req = self._notice_req
            while req is not None and not self._closed and req.Test(self._notice_status):
                number, why = (int(x) for x in self._notice_in)
                if number == self._number:
                    self.departed.setdefault(self._notice_status.Get_source(), (why, time.monotonic()))
                req = self._notice_req = self._post_notice_receive()
            req = self._waiting_req
            while req is not None and not self._closed and req.Test(self._waiting_status):
                words = [int(x) for x in self._waiting_in]
                if words[0] == self._number:  # a new dict: a waiter may be reading the old one
                    told = dict(self.waiting.get(words[1]) or {})
                    told[self._waiting_status.Get_source()] = tuple(words[2:])
                    self.waiting[words[1]] = told
                req = self._waiting_req = self._post_waiting_receive()
        except self.MPI.Exception:
            pass  # MPI is being torn down: the waits' own deadlines still hold
        finally:
            self._notice_lock.release()

    def tell_waiting(self, group_id: int, members, words) -> None:
        """Tell the other ``members`` (engine ranks) of group ``group_id`` that this rank waits in
        the call ``words`` describes (``WAITING_WORDS`` ints, the engine's): see "Long waits"."""
        MPI = self.MPI
        payload = np.zeros(2 + WAITING_WORDS, np.int64)
        payload[0], payload[1] = self._number, group_id
        payload[2:] = list(words)[:WAITING_WORDS]
        with self._lock:
            if self._closed:
                return
            try:
                self._told = [(p, reqs) for p, reqs in self._told if not MPI.Request.Testall(reqs)]
                reqs = [self._notices.Isend([payload, MPI.INT64_T], r, _WAITING_TAG)
                        for r in members if r != self.rank]
            except MPI.Exception:
                return  # MPI is being torn down: the waits' own deadlines still hold
            self._told.append((payload, reqs))

    def waiting_calls(self, group_id: int) -> dict:
        """{engine rank: the words it told last} of the members of group ``group_id`` that told (a
        dict that is never changed: a newer word replaces it)."""
        return self.waiting.get(group_id) or {}

    def check(self, members) -> TransportError | None:
        """Why a wait on a request among ``members`` (engine ranks) must end, or None: this
        transport closed, or a member left (announce_departure) ``DEPARTED_GRACE_S`` ago."""
        if self._closed:
            return TransportError("the transport was closed while the request was pending", reason="lost")
        if time.monotonic() >= self._next_poll:
            self.poll_notices()
        departed = self.departed
        if departed:
            now = time.monotonic()
            for r in members:
                if r in departed and r != self.rank and now - departed[r][1] >= DEPARTED_GRACE_S:
                    why = _DEPARTURES.get(departed[r][0], "left")
                    return TransportError(f"rank {r} {why}; no collective of a group with rank {r} can complete",
                                          peer=r, reason="lost")
        return None

    def announce_departure(self, why: int = DEPARTED_EXITED) -> None:
        """Tell every other rank that this one is leaving (``why``: a DEPARTED_* number): their
        waits on it end (``check``). Waits up to NOTICE_SEND_S for the notices to go (small
        messages: at once, in practice). Once per transport; ``close`` calls it too."""
        with self._lock:
            if self._closed or self._announced:
                return
            self._announced = True
        MPI = self.MPI
        payload = np.array([self._number, why], np.int64)
        try:
            requests = [self._notices.Isend([payload, MPI.INT64_T], r, _NOTICE_TAG)
                        for r in range(self.size) if r != self.rank]
            self._notice_out = (payload, requests)
            deadline = time.monotonic() + NOTICE_SEND_S
            while not MPI.Request.Testall(requests) and time.monotonic() < deadline:
                time.sleep(POLL_SLEEP_S)
        except MPI.Exception:
            pass  # leaving anyway: the others' timeouts still hold

    # -- groups --------------------------------------------------------------------------------
    def open_group(self, group_id: int, ranks) -> GroupComm:
        """A communicator for group ``group_id`` of these engine ranks (group rank i = ranks[i]).
        Collective over the members; every member calls it for the same groups in the same order."""
        ranks = list(ranks)
        with self._lock:
            if self._closed:
                raise DistBackendError("backend 'mpi': the engine is closed")
            known = self._groups.get(group_id)
        if known is not None:
            return known
        if ranks == list(range(self.size)):
            comm = self.comm.Dup()
        else:
            members = self.comm.Get_group().Incl(ranks)
            try:
                comm = self.comm.Create_group(members, tag=group_id % (self.layout.kind_bit))
            finally:
                members.Free()
        group = GroupComm(comm, ranks, self)
        with self._lock:
            self._groups[group_id] = group
        return group

    def group(self, group_id: int) -> GroupComm:
        group = self._groups.get(group_id)
        if group is None:
            raise DistBackendError(
                f"backend 'mpi': no communicator for group {group_id} on rank {self.rank} (the group was "
                "destroyed, or was not created on this rank)")
        return group

    def release_group(self, group_id: int) -> None:
        with self._lock:
            group = self._groups.pop(group_id, None)
            self.waiting.pop(group_id, None)
        if group is not None and not self.MPI.Is_finalized():
            group.comm.Free()

    # -- Transport -----------------------------------------------------------------------------
    def isend(self, dst: int, data: np.ndarray, key: MessageKey, signature: int = 0) -> MpiRequest:
        group = self.group(key.group)
        tag = self.layout.tag(key, signature)
        buf = data.reshape(-1).view(np.uint8)
        req = group.comm.Isend([buf, self.MPI.BYTE], group.rank_of[dst], tag)
        return MpiRequest(self, req, dst, data, False, group)

    def irecv(self, src: int, out: np.ndarray, key: MessageKey, signature: int = 0) -> MpiRequest:
        group = self.group(key.group)
        tag = self.layout.tag(key, signature)
        buf = out.reshape(-1).view(np.uint8)
        source = self.MPI.ANY_SOURCE if src == ANY_SOURCE else group.rank_of[src]
        req = group.comm.Irecv([buf, self.MPI.BYTE], source, tag)
        return MpiRequest(self, req, src, out, True, group)

    def close(self) -> None:
        if not self.MPI.Is_finalized():
            self.announce_departure(DEPARTED_CLOSED)
        with self._lock:
            if self._closed:
                return
            self._closed = True
            groups = list(self._groups.values())
            self._groups.clear()
        if self.MPI.Is_finalized():
            return
        with self._notice_lock:
            for name in ("_notice_req", "_waiting_req"):
                req = getattr(self, name)
                setattr(self, name, None)
                if req is not None:
                    try:
                        req.Cancel()
                        req.Wait()
                    except self.MPI.Exception:
                        pass  # the receive matched meanwhile: it is done either way
        for group in groups:
            group.comm.Free()
        self._notices.Free()
        self.comm.Free()
