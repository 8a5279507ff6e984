"""InprocTransport: the Transport contract (matching, checks, copies, deadlines, loss) on threads.

The thread-safety stress (6 ranks, 200 messages to every peer) is slow; the rest is in the fast tier
(``pytest -m "not slow"``).
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from distcomm.errors import CollectiveMismatchError, DistTimeoutError, PeerLostError
from distcomm.transport.base import ANY_SOURCE, Channel, MessageKey, TransportError
from distcomm.transport.inproc import InprocTransport
from inproc_threads import run_threads

K = MessageKey(group=0, kind=0, seq=0)
K2 = MessageKey(group=0, kind=0, seq=1)
OTHER_GROUP = MessageKey(group=1, kind=0, seq=0)
P2P = MessageKey(group=0, kind=1, seq=0)


def soon(seconds: float = 5.0) -> float:
    return time.monotonic() + seconds


@pytest.fixture(params=[0, 1 << 20], ids=["rendezvous", "eager"])
def world(request):
    transports = InprocTransport.create_world(3, eager_limit=request.param)
    yield transports
    for t in transports:
        t.close()


def test_send_then_recv_and_recv_then_send(world):
    a, b, _ = world
    s = a.isend(1, np.arange(4, dtype=np.int32), K)
    out = np.zeros(4, np.int32)
    r = b.irecv(0, out, K)
    r.wait(soon())
    s.wait(soon())
    assert out.tolist() == [0, 1, 2, 3] and r.source == 0 and r.nbytes == 16

    out2 = np.zeros(2, np.float64)
    r2 = b.irecv(0, out2, K)
    assert not r2.test()
    a.isend(1, np.array([1.5, 2.5]), K).wait(soon())
    r2.wait(soon())
    assert out2.tolist() == [1.5, 2.5] and r2.test()


def test_fifo_per_source_and_key(world):
    a, b, _ = world
    sends = [a.isend(1, np.array([i], np.int64), K) for i in range(5)]
    outs = [np.zeros(1, np.int64) for _ in range(5)]
    recvs = [b.irecv(0, o, K) for o in outs]
    for r in recvs + sends:
        r.wait(soon())
    assert [int(o[0]) for o in outs] == [0, 1, 2, 3, 4]


def test_keys_never_match_each_other(world):
    a, b, _ = world
    out_k2, out_k, out_g, out_p = (np.zeros(1, np.int32) for _ in range(4))
    r_k2 = b.irecv(0, out_k2, K2)
    r_g = b.irecv(0, out_g, OTHER_GROUP)
    r_p = b.irecv(0, out_p, P2P)
    r_k = b.irecv(0, out_k, K)
    for value, key in ((1, K), (2, K2), (3, OTHER_GROUP), (4, P2P)):
        a.isend(1, np.array([value], np.int32), key)
    for r in (r_k, r_k2, r_g, r_p):
        r.wait(soon())
    assert (out_k[0], out_k2[0], out_g[0], out_p[0]) == (1, 2, 3, 4)


def test_any_source(world):
    a, b, c = world
    out = np.zeros(1, np.int32)
    r = a.irecv(ANY_SOURCE, out, K)
    c.isend(0, np.array([7], np.int32), K).wait(soon())
    r.wait(soon())
    assert out[0] == 7 and r.source == 2
    # an already-arrived message is taken by an any-source receive too
    b.isend(0, np.array([8], np.int32), K)
    r = a.irecv(ANY_SOURCE, out, K)
    r.wait(soon())
    assert out[0] == 8 and r.source == 1


def test_receiver_gets_a_copy(world):
    a, b, _ = world
    data = np.arange(8, dtype=np.uint8)
    out = np.zeros(8, np.uint8)
    r = b.irecv(0, out, K)
    a.isend(1, data, K).wait(soon())
    r.wait(soon())
    data[:] = 99  # the sender reuses its buffer after wait
    assert out.tolist() == list(range(8))
    # unexpected (sent before the receive) and eager: copied at send time
    s = a.isend(1, data, K)
    if s.test():  # eager
        data[:] = 5
    out2 = np.zeros(8, np.uint8)
    b.irecv(0, out2, K).wait(soon())
    s.wait(soon())
    assert out2.tolist() == [99] * 8


def test_size_mismatch_fails_both_sides_known(world):
    a, b, _ = world
    out = np.zeros(3, np.int32)
    r = b.irecv(0, out, K)
    s = a.isend(1, np.zeros(4, np.int32), K)
    with pytest.raises(TransportError) as info:
        r.wait(soon())
    assert info.value.reason == "mismatch" and info.value.peer == 0
    assert "16 bytes" in str(info.value) and "12 bytes" in str(info.value)
    assert out.tolist() == [0, 0, 0]  # nothing truncated into the buffer
    if not s.test() or s._error is not None:  # a rendezvous send learns it too
        with pytest.raises(TransportError, match="expected 12 bytes"):
            s.wait(soon())


def test_signature_mismatch(world):
    a, b, _ = world
    a.isend(1, np.zeros(2, np.float32), K, signature=0x1234)
    r = b.irecv(0, np.zeros(2, np.float32), K, signature=0x9999)
    with pytest.raises(TransportError, match="signature") as info:
        r.wait(soon())
    assert info.value.reason == "mismatch"


def test_zero_byte_and_zero_d_messages(world):
    a, b, _ = world
    r = b.irecv(0, np.empty(0, np.uint8), K)
    a.isend(1, np.empty(0, np.uint8), K).wait(soon())
    r.wait(soon())
    assert r.nbytes == 0 and r.source == 0
    out = np.zeros((), np.float64)
    r = b.irecv(0, out, K)
    a.isend(1, np.array(3.25), K).wait(soon())
    r.wait(soon())
    assert float(out) == 3.25


def test_recv_timeout_names_peer_and_withdraws(world):
    a, b, _ = world
    out = np.zeros(1, np.int32)
    r = b.irecv(0, out, K)
    t0 = time.monotonic()
    with pytest.raises(TransportError) as info:
        r.wait(time.monotonic() + 0.05)
    assert time.monotonic() - t0 < 2.0
    assert info.value.reason == "timeout" and info.value.peer == 0 and "rank 0" in str(info.value)
    assert r.test()  # done (failed): waiting again raises at once
    with pytest.raises(TransportError):
        r.wait(None)
    # the withdrawn receive does not swallow a later message
    a.isend(1, np.array([5], np.int32), K)
    out2 = np.zeros(1, np.int32)
    b.irecv(0, out2, K).wait(soon())
    assert out[0] == 0 and out2[0] == 5


def test_any_source_timeout_has_no_peer(world):
    a, *_ = world
    with pytest.raises(TransportError) as info:
        a.irecv(ANY_SOURCE, np.zeros(1), K).wait(time.monotonic() + 0.02)
    assert info.value.reason == "timeout" and info.value.peer is None


def test_rendezvous_send_times_out_without_receiver():
    a, b = InprocTransport.create_world(2, eager_limit=0)
    s = a.isend(1, np.zeros(4), K)
    assert not s.test()
    with pytest.raises(TransportError) as info:
        s.wait(time.monotonic() + 0.05)
    assert info.value.reason == "timeout" and info.value.peer == 1
    # withdrawn: a later receive does not get it
    with pytest.raises(TransportError, match="Timed out"):
        b.irecv(0, np.zeros(4), K).wait(time.monotonic() + 0.05)


def test_close_fails_pending_requests_promptly():
    a, b, c = InprocTransport.create_world(3, eager_limit=0)
    r_from_a = b.irecv(0, np.zeros(1), K)
    r_any = b.irecv(ANY_SOURCE, np.zeros(1), K2)
    s_to_a = c.isend(0, np.zeros(1), K)
    own = a.irecv(1, np.zeros(1), K)
    a.close()
    for req in (r_from_a, s_to_a, own):
        with pytest.raises(TransportError) as info:
            req.wait(soon())
        assert info.value.reason == "lost" and info.value.peer == 0
    assert not r_any.test()  # rank 2 may still send it
    with pytest.raises(TransportError, match="closed"):
        b.isend(0, np.zeros(1), K).wait(soon())
    with pytest.raises(TransportError, match="closed"):
        b.irecv(0, np.zeros(1), K).wait(soon())
    c.isend(1, np.ones(1), K2).wait(soon())
    r_any.wait(soon())


def test_eager_message_survives_sender_close():
    a, b = InprocTransport.create_world(2)  # default eager limit: small sends complete at once
    a.isend(1, np.array([42], np.int64), K).wait(soon())
    a.close()
    out = np.zeros(1, np.int64)
    b.irecv(0, out, K).wait(soon())
    assert out[0] == 42


def test_invalid_ranks():
    (a,) = InprocTransport.create_world(1)
    with pytest.raises(ValueError):
        a.isend(1, np.zeros(1), K)
    with pytest.raises(ValueError):
        InprocTransport.create_world(0)
    with pytest.raises(ValueError, match="contiguous"):
        a.irecv(0, np.zeros(4)[::2], K)
    # a world of one can still talk to itself at the transport level
    out = np.zeros(1)
    r = a.irecv(0, out, K)
    a.isend(0, np.ones(1), K).wait(soon())
    r.wait(soon())
    assert out[0] == 1


def test_channel_errors_carry_op_seq_rank_peer():
    def body(rank, transport):
        ch = Channel(transport, [0, 1], rank, MessageKey(0, 0, 17), "all_gather", deadline=soon())
        if rank == 0:
            ch.send(1, np.zeros(3, np.float32))
        else:
            ch.recv(0, np.zeros(4, np.float32))

    results = run_threads(2, body, eager_limit=0, return_exceptions=True)
    assert isinstance(results[1], CollectiveMismatchError)
    assert str(results[1]).startswith("all_gather #17 on rank 1 (peer rank 0)")
    assert isinstance(results[0], CollectiveMismatchError)

    def late(rank, transport):
        ch = Channel(transport, [0, 1], rank, MessageKey(0, 0, 3), "broadcast", deadline=time.monotonic() + 0.05)
        if rank == 1:
            ch.recv(0, np.zeros(1))

    results = run_threads(2, late, return_exceptions=True)
    assert isinstance(results[1], DistTimeoutError) and "broadcast #3 on rank 1 (peer rank 0)" in str(results[1])


def test_group_relative_ranks_translate():
    """A channel over global ranks [2, 0] (a subgroup) talks to the right threads."""

    def body(rank, transport):
        if rank == 1:
            return None
        group = [2, 0]
        ch = Channel(transport, group, group.index(rank), K, "send", deadline=soon())
        if rank == 2:
            ch.send(1, np.array([rank], np.int32))
        else:
            out = np.zeros(1, np.int32)
            ch.recv(0, out)
            return int(out[0])

    assert run_threads(3, body)[0] == 2


def test_run_threads_reports_failures_and_hangs():
    def boom(rank, transport):
        if rank == 1:
            raise KeyError("rank one")
        transport.irecv(1, np.zeros(1), K).wait(soon())  # fails promptly: rank 1 closed

    with pytest.raises(KeyError):
        run_threads(2, boom)
    results = run_threads(2, boom, return_exceptions=True)
    assert isinstance(results[1], KeyError)
    assert isinstance(results[0], TransportError) and results[0].reason == "lost"

    def hang(rank, transport):
        transport.irecv(1 - rank, np.zeros(1), K).wait(None)

    with pytest.raises(TimeoutError, match=r"ranks \[0, 1\]"):
        run_threads(2, hang, timeout=0.2)


@pytest.mark.slow
def test_many_threads_hammering_one_world():
    """Thread safety: 6 ranks, each sending 200 messages to every other rank, any order of arrival."""
    n, rounds = 6, 200

    def body(rank, transport):
        outs = {src: np.zeros(rounds, np.int64) for src in range(n) if src != rank}
        recvs = [transport.irecv(src, outs[src][i : i + 1], K) for i in range(rounds) for src in outs]
        sends = [transport.isend(dst, np.array([rank * 1000 + i], np.int64), K) for i in range(rounds) for dst in range(n) if dst != rank]
        for r in recvs + sends:
            r.wait(soon(30))
        return {src: out.tolist() for src, out in outs.items()}

    for rank, outs in enumerate(run_threads(n, body, eager_limit=4)):
        for src, values in outs.items():
            assert values == [src * 1000 + i for i in range(rounds)]


def test_peer_lost_through_channel():
    barrier = threading.Barrier(2)

    def body(rank, transport):
        ch = Channel(transport, [0, 1], rank, K, "all_reduce", deadline=soon())
        if rank == 0:
            barrier.wait()
            transport.close()
            return None
        req = ch.irecv(0, np.zeros(1))
        barrier.wait()
        req.wait()

    results = run_threads(2, body, return_exceptions=True)
    assert isinstance(results[1], PeerLostError) and "all_reduce #0 on rank 1 (peer rank 0)" in str(results[1])
