"""A rank that arrives at a collective after its peers timed out on it fails too; it does not complete it.

The peers' call timed out (a DistTimeoutError each); rank 2 comes late to the same call. The peers
had already sent or posted their data, so before, rank 2 used it and returned success: the ranks
disagreed on whether the call happened (a barrier passed by one rank that the others abandoned).
Now a rank whose call fails mid-collective gives up on the group and tells its peers: on the
shared-memory engine ("gloo" on one host) it takes back the post of the round it did not finish
and marks the group given up in its header; on the TCP engine it sends each member a GAVE_UP
notice after its messages, and the late rank's receives of that call from it fail even though its
message for the call is already there. The late rank fails with PeerFailedError naming the rank,
as torch's gloo fails it ("Connection closed by peer"), and is told what the peers were doing
(their failures); the group's later calls fail at once on every rank.
"""

from __future__ import annotations

import os
import socket
import time
from contextlib import contextmanager
from datetime import timedelta

import numpy as np
import pytest

from distcomm.transport import framing
from distcomm.transport.base import KIND_COLLECTIVE, KIND_P2P, MessageKey, TransportError
from distcomm.transport.tcp import TcpTransport
from harness import run_world

TIMEOUT_S = 3  # the peers' timeout; the late rank comes 2 s after it
LATE_S = TIMEOUT_S + 2

# calls in which every rank waits for every other (a rooted call's root may complete without its
# peers: a broadcast's root only writes)
OPS = {
    "all_reduce 8 B": lambda dist, rank, world: dist.all_reduce(np.ones(2, dtype=np.float32)),
    "barrier": lambda dist, rank, world: dist.barrier(),
    "all_gather 8 B": lambda dist, rank, world: dist.all_gather_into_tensor(
        np.zeros(2 * world, dtype=np.float32), np.ones(2, dtype=np.float32)),
    "all_reduce 8 MiB": lambda dist, rank, world: dist.all_reduce(np.ones(1 << 21, dtype=np.float32)),
}


def _late(rank, world, engine, name, done_path):
    import distcomm as dist
    from distcomm.errors import DistTimeoutError, PeerFailedError

    dist.init_process_group(engine, timeout=timedelta(seconds=TIMEOUT_S))
    call = OPS[name]
    call(dist, rank, world)  # every rank once: the group's shared memory (or connections) is set up
    late = rank == world - 1
    if late:
        time.sleep(LATE_S)
    outcome = "completed"
    try:
        call(dist, rank, world)
    except PeerFailedError as exc:
        assert "gave up on this group" in str(exc), exc
        if late:  # what the peers reported comes along
            assert "were doing" in str(exc) and "failed: " in str(exc), exc
        outcome = "peer failed"
    except DistTimeoutError:
        outcome = "timed out"
    # the group is unusable on every rank now: its next call fails at once
    started = time.monotonic()
    with pytest.raises(dist.DistError, match="unusable .* destroy the process group and create it again"):
        dist.all_reduce(np.ones(1, dtype=np.float32))
    assert time.monotonic() - started < TIMEOUT_S  # not waited out: the failure is known
    if late:
        open(done_path, "w").close()
    else:  # the late rank still reads this rank's header (or connection) until it is done
        deadline = time.monotonic() + 30
        while not os.path.exists(done_path) and time.monotonic() < deadline:
            time.sleep(0.01)
    dist.destroy_process_group()
    return outcome


@pytest.mark.slow
@pytest.mark.parametrize("name", list(OPS))
@pytest.mark.parametrize("engine", ["gloo", "tcp"])
def test_a_late_rank_fails_the_call_its_peers_timed_out_on(engine, name, tmp_path):
    world = 3
    outcomes = run_world(_late, world, args=(engine, name, str(tmp_path / "late-rank-done")), timeout=60)
    # the first peer to time out gives up; the other may find that before its own timeout
    assert "timed out" in outcomes[:-1] and set(outcomes[:-1]) <= {"timed out", "peer failed"}, outcomes
    assert outcomes[-1] == "peer failed", outcomes


# -- the TCP transport's side: the GAVE_UP notice, three transports in this process ------------------

GID = 5


@contextmanager
def _tcp_world(n: int):
    """n TcpTransports over socketpairs, all watching group GID of every rank."""
    pairs = {(a, b): socket.socketpair() for a in range(n) for b in range(a + 1, n)}
    socks = [{} for _ in range(n)]
    for (a, b), (sa, sb) in pairs.items():
        socks[a][b], socks[b][a] = sa, sb
    ts = [TcpTransport(r, n, socks[r]) for r in range(n)]
    for t in ts:
        t.watch_group(GID, range(n))
    try:
        yield ts
    finally:
        for t in ts:
            t.close()


def _until(check, seconds: float = 20.0):
    end = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < end, "not within the deadline"
        time.sleep(0.005)


def _p2p_roundtrip(src: TcpTransport, dst: TcpTransport, tag: int) -> None:
    """A point-to-point message src -> dst: anything src sent dst before it has been read."""
    out = np.empty(1, np.int64)
    recv = dst.irecv(src.rank, out, MessageKey(GID, KIND_P2P, tag))
    src.isend(dst.rank, np.array([tag], np.int64), MessageKey(GID, KIND_P2P, tag)).wait(time.monotonic() + 20)
    recv.wait(time.monotonic() + 20)
    assert out[0] == tag


def test_gave_up_notice_bytes():
    frame = framing.encode_gave_up(GID, 7)
    header = framing.decode_header(frame)
    assert framing.is_gave_up(header) and not framing.is_goodbye(header)
    assert header.key == MessageKey(GID, framing.KIND_CONTROL, framing.CONTROL_GAVE_UP)
    assert header.nbytes == 8 and framing.decode_gave_up(frame[framing.HEADER_SIZE:]) == 7
    with pytest.raises(framing.FramingError):
        framing.decode_gave_up(b"\0" * 4)


def test_tcp_a_notice_refuses_a_message_already_there_and_fails_pending_receives():
    call = MessageKey(GID, KIND_COLLECTIVE, 3)
    nxt = MessageKey(GID, KIND_COLLECTIVE, 4)
    with _tcp_world(3) as (a, b, c):
        a.isend(2, np.ones(2, np.float32), call).wait(time.monotonic() + 20)  # sent before a's timeout
        _until(lambda: c.matcher.unexpected(0))
        pending = c.irecv(0, np.empty(2, np.float32), nxt)  # c waits for a's next call
        from_b = c.irecv(1, np.empty(2, np.float32), call)  # b did not give up: this one goes on
        a.give_up(GID, 3, "all_reduce #3 on rank 0: Timed out")
        with pytest.raises(TransportError) as info:
            pending.wait(time.monotonic() + 20)
        assert info.value.reason == "gave up" and info.value.peer == 0
        assert "rank 0 gave up on this group after an error in its call #3" in str(info.value)
        late = c.irecv(0, np.empty(2, np.float32), call)  # the late receive: its message is there
        with pytest.raises(TransportError, match="gave up on this group") as info:
            late.wait(time.monotonic() + 20)
        assert info.value.reason == "gave up"
        assert not from_b.test()
        b.isend(2, np.ones(2, np.float32), call)
        from_b.wait(time.monotonic() + 20)
        _p2p_roundtrip(a, c, 1)  # point-to-point between them still works
        # on a itself, the group's later calls fail at once and say why
        with pytest.raises(TransportError, match=r"unusable on rank 0 after an earlier failure in its call #3 "
                                                 r"\(all_reduce #3 on rank 0: Timed out\); destroy the process group"):
            a.isend(1, np.ones(1, np.float32), nxt).wait(time.monotonic() + 20)
        with pytest.raises(TransportError, match="unusable on rank 0"):
            a.irecv(1, np.empty(1, np.float32), nxt).wait(time.monotonic() + 20)


def test_tcp_a_receive_completed_before_the_notice_stays_completed():
    call = MessageKey(GID, KIND_COLLECTIVE, 3)
    with _tcp_world(2) as (a, b):
        out = np.zeros(2, np.float32)
        recv = b.irecv(0, out, call)
        a.isend(1, np.ones(2, np.float32), call)
        recv.wait(time.monotonic() + 20)
        a.give_up(GID, 3, "a failure after the message went")
        _until(lambda: b.matcher.gave_up_at(0, call) is not None)
        recv.wait()  # still a success
        assert (out == 1).all()


def test_tcp_destroying_a_group_normally_sends_no_notice():
    call = MessageKey(GID, KIND_COLLECTIVE, 3)
    with _tcp_world(2) as (a, b):
        a.unwatch_group(GID)  # destroy_process_group
        _p2p_roundtrip(a, b, 2)  # whatever a sent before this has been read by b
        assert b.matcher.gave_up_at(0, call) is None
        a.close()
        _until(lambda: b.irecv(0, np.empty(1, np.int64), MessageKey(GID, KIND_P2P, 9)).test())
        assert b.matcher.gave_up_at(0, call) is None
