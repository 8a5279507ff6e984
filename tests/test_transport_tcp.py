"""TcpTransport: matching, copies, errors, progress — over real TCP sockets.

Most tests build a small world in one process (one thread per rank, a HashStore, the real mesh on
127.0.0.1), which is quick and lets a test look at both sides. The multi-process tests (run_world)
cover what needs processes: large transfers between address spaces, world sizes 2-4 through
distcomm's TCPStore, and a rank that dies.

No timing assertions (the machine is shared). "Fails promptly" is checked structurally: the wait
gets a deadline longer than the harness's, so a failure found by waiting out the deadline would be
a killed world, not the asserted error.

Tiers: the multi-process tests are slow; the fast tier (``pytest -m "not slow"``) keeps the
in-process ones. The tcp engine between processes runs there too, in test_differential's fast
world and in test_api_errors' killed-peer world.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from contextlib import contextmanager

import numpy as np
import pytest

from harness import run_world

from distcomm.store import HashStore
from distcomm.transport import framing, mesh
from distcomm.transport.base import ANY_SOURCE, KIND_COLLECTIVE, KIND_P2P, MessageKey, TransportError
from distcomm.transport import tcp as tcp_module
from distcomm.transport.tcp import TcpTransport

K = MessageKey(1, KIND_COLLECTIVE, 7)
MiB = 1 << 20


def soon(seconds: float = 20.0) -> float:
    return time.monotonic() + seconds


def pattern(nbytes: int, salt: int = 0) -> np.ndarray:
    """Bytes that differ from every other (size, salt) pattern, so a mixed-up message shows.

    Random bytes seeded by (size, salt), at most 1 MiB + 13 of them repeated: cheap at 64 MiB.
    """
    block = np.random.default_rng([nbytes, salt]).integers(0, 256, min(nbytes, MiB + 13), dtype=np.uint8)
    return np.resize(block, nbytes)


@contextmanager
def local_world(n: int):
    """n transports in this process, connected through a HashStore by the real mesh code."""
    store, out, errors = HashStore(), [None] * n, []

    def connect(rank):
        try:
            out[rank] = TcpTransport.connect(store, rank, n, 20.0, host="127.0.0.1")
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=connect, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    try:
        if errors:
            raise errors[0]
        yield out
    finally:
        for t in out:
            if t is not None:
                t.close()


def wait_all(*reqs, seconds=20.0):
    for r in reqs:
        r.wait(soon(seconds))


# -- matching --------------------------------------------------------------------------------------


@pytest.mark.parametrize("nbytes", [0, 1, 7, 4096, 3 * MiB + 5])
def test_posted_first_and_unexpected(nbytes):
    with local_world(2) as (a, b):
        data = pattern(nbytes)
        out = np.zeros(nbytes, np.uint8)
        r = b.irecv(0, out, K)  # posted first: read straight into out
        wait_all(a.isend(1, data, K), r)
        assert np.array_equal(out, data) and r.source == 0 and r.nbytes == nbytes

        out2 = np.zeros(nbytes, np.uint8)
        s = a.isend(1, data, K)  # unexpected: arrives (partly or fully) before the receive
        time.sleep(0.05)
        r = b.irecv(0, out2, K)
        wait_all(r, s)
        assert np.array_equal(out2, data)


def test_many_small_messages_keep_order():
    n = 2000
    with local_world(2) as (a, b):
        sends = [a.isend(1, np.array([i], np.int64), K) for i in range(n // 2)]
        outs = [np.full(1, -1, np.int64) for _ in range(n)]
        recvs = [b.irecv(0, o, K) for o in outs]  # half arrived already, half posted first
        sends += [a.isend(1, np.array([i], np.int64), K) for i in range(n // 2, n)]
        wait_all(*sends, *recvs)
        assert [int(o[0]) for o in outs] == list(range(n))


def test_different_keys_never_match():
    keys = [MessageKey(1, KIND_COLLECTIVE, 3), MessageKey(1, KIND_P2P, 3), MessageKey(2, KIND_COLLECTIVE, 3),
            MessageKey(1, KIND_COLLECTIVE, 4), MessageKey(1, KIND_P2P, -3)]
    with local_world(2) as (a, b):
        outs = {k: np.zeros(16, np.uint8) for k in keys}
        # receives posted in reverse order, two of them after their message arrived
        recvs = {k: b.irecv(0, outs[k], k) for k in reversed(keys[2:])}
        sends = [a.isend(1, pattern(16, i), k) for i, k in enumerate(keys)]
        time.sleep(0.05)
        recvs.update({k: b.irecv(0, outs[k], k) for k in keys[:2]})
        wait_all(*sends, *recvs.values())
        for i, k in enumerate(keys):
            assert np.array_equal(outs[k], pattern(16, i)), k


def test_any_source():
    with local_world(3) as (a, b, c):
        outs = [np.zeros(8, np.uint8) for _ in range(2)]
        recvs = [a.irecv(ANY_SOURCE, o, K) for o in outs]
        wait_all(b.isend(0, pattern(8, 1), K))
        wait_all(recvs[0])
        assert recvs[0].source == 1 and np.array_equal(outs[0], pattern(8, 1))
        wait_all(c.isend(0, pattern(8, 2), K), recvs[1])
        assert recvs[1].source == 2 and np.array_equal(outs[1], pattern(8, 2))

        # arrived first, then taken by an any-source receive: oldest arrival wins
        wait_all(c.isend(0, pattern(8, 2), K))
        time.sleep(0.05)
        wait_all(b.isend(0, pattern(8, 1), K))
        time.sleep(0.05)
        first, second = a.irecv(ANY_SOURCE, outs[0], K), a.irecv(ANY_SOURCE, outs[1], K)
        wait_all(first, second)
        assert (first.source, second.source) == (2, 1)

        # a specific receive posted before an any-source one takes the message first
        specific, anyone = a.irecv(1, outs[0], K), a.irecv(ANY_SOURCE, outs[1], K)
        wait_all(b.isend(0, pattern(8, 5), K), specific)
        assert not anyone.test()
        wait_all(b.isend(0, pattern(8, 6), K), anyone)
        assert anyone.source == 1 and np.array_equal(outs[1], pattern(8, 6))


def test_buffers_of_any_dtype_and_shape():
    with local_world(2) as (a, b):
        for data in (np.arange(6, dtype=np.complex128).reshape(2, 3), np.array(3.5), np.array([True, False]),
                     np.zeros((0, 4), np.float32), np.arange(10, dtype=np.int16)[::1]):
            out = np.zeros_like(data)
            wait_all(b.irecv(0, out, K), a.isend(1, data, K))
            assert np.array_equal(out, data)


def test_bad_arguments_raise_at_once():
    with local_world(2) as (a, _):
        with pytest.raises(ValueError, match="C-contiguous"):
            a.isend(1, np.zeros((4, 4))[:, 0], K)
        with pytest.raises(ValueError, match="read-only"):
            ro = np.zeros(4)
            ro.flags.writeable = False
            a.irecv(1, ro, K)
        for bad in (0, 2, -2):
            with pytest.raises(ValueError, match="cannot send to rank"):
                a.isend(bad, np.zeros(1), K)
        with pytest.raises(framing.FramingError):
            a.isend(1, np.zeros(1), MessageKey(-1, 0, 0))


# -- mismatches, timeouts, close --------------------------------------------------------------------


@pytest.mark.parametrize("posted_first", [True, False])
@pytest.mark.parametrize("sent,expected,sig_sent,sig_expected,text", [
    (100, 80, 5, 5, "expects 80 bytes but rank 0 sent 100"),
    (2 * MiB, 2 * MiB + 1, 5, 5, f"expects {2 * MiB + 1} bytes but rank 0 sent {2 * MiB}"),
    (64, 64, 0x11, 0x22, "rank 0 sent a message of .* \\(signatures 0x00000022 and 0x00000011\\)"),
])
def test_mismatch_fails_receive_and_stream_stays_in_step(posted_first, sent, expected, sig_sent, sig_expected, text):
    with local_world(2) as (a, b):
        out = np.zeros(expected, np.uint8)
        if posted_first:
            r = b.irecv(0, out, K, sig_expected)
        s = a.isend(1, pattern(sent), K, sig_sent)
        if not posted_first:
            time.sleep(0.05)
            r = b.irecv(0, out, K, sig_expected)
        with pytest.raises(TransportError, match=text) as info:
            r.wait(soon())
        assert info.value.reason == "mismatch" and info.value.peer == 0
        assert not out.any()  # nothing was written into the receive's buffer
        s.wait(soon())
        follow = np.zeros(1000, np.uint8)
        wait_all(b.irecv(0, follow, K), a.isend(1, pattern(1000, 9), K))
        assert np.array_equal(follow, pattern(1000, 9))


def test_timeout_names_peer_withdraws_and_transport_stays_usable():
    with local_world(3) as (a, b, c):
        out = np.zeros(4)
        r = a.irecv(2, out, K)
        with pytest.raises(TransportError, match="Timed out on rank 0 waiting to receive 32 bytes from rank 2") as info:
            r.wait(time.monotonic() + 0.2)
        assert info.value.reason == "timeout" and info.value.peer == 2 and r.test()
        r2 = a.irecv(ANY_SOURCE, out, K)
        with pytest.raises(TransportError, match="from any rank") as info:
            r2.wait(time.monotonic() + 0.05)
        assert info.value.peer is None
        # the late message was not delivered to the withdrawn receives; the next receive gets it
        wait_all(c.isend(0, np.full(4, 2.0), K))
        time.sleep(0.05)
        assert not out.any()
        wait_all(a.irecv(2, out, K))
        assert (out == 2.0).all()
        wait_all(b.isend(0, np.full(4, 1.0), K), a.irecv(1, out, K))
        assert (out == 1.0).all()


def _silent_peer_transport():
    """Rank 0 of 2 whose peer is a plain socket that never reads: its sends cannot finish."""
    mine, theirs = socket.socketpair()
    return TcpTransport(0, 2, {1: mine}), theirs


def test_send_timeout_and_close_fail_pending_requests():
    t, theirs = _silent_peer_transport()
    big = np.zeros(64 * MiB, np.uint8)
    stuck = t.isend(1, big, K)  # partly written: will be finished from the buffer after the timeout
    queued = t.isend(1, big, K)  # nothing written yet: withdrawn on timeout
    with pytest.raises(TransportError, match="Timed out on rank 0 waiting to send 67108864 bytes to rank 1") as info:
        queued.wait(time.monotonic() + 0.1)
    assert info.value.peer == 1 and info.value.reason == "timeout"
    recv = t.irecv(1, np.zeros(4), K)
    waiter_error = []
    waiter = threading.Thread(target=lambda: waiter_error.append(_error_of(recv)))
    waiter.start()
    time.sleep(0.1)
    t.close()
    waiter.join(10)
    assert waiter_error[0].reason == "lost" and "closed" in str(waiter_error[0])
    assert _error_of(stuck).reason == "lost"
    late = t.isend(1, np.zeros(1), K)
    assert late.test() and _error_of(late).reason == "lost"
    assert _error_of(t.irecv(1, np.zeros(1), K)).reason == "lost"
    t.close()  # idempotent
    assert not any(th.name.startswith("distcomm-tcp-0") for th in threading.enumerate())
    theirs.close()


def _error_of(req) -> TransportError | None:
    try:
        req.wait(soon())
    except TransportError as exc:
        return exc
    return None


def test_peer_close_fails_its_requests_not_others():
    with local_world(3) as (a, b, c):
        from_b, from_c, anyone = a.irecv(1, np.zeros(1), K), a.irecv(2, np.zeros(1), K), a.irecv(ANY_SOURCE, np.zeros(1), K)
        b.close()
        err = _error_of(from_b)
        assert err.reason == "lost" and err.peer == 1 and "closed its transport" in str(err)
        assert not from_c.test() and not anyone.test()  # an orderly close does not fail any-source receives
        wait_all(c.isend(0, np.ones(1), K), c.isend(0, np.ones(1), K), from_c, anyone)
        assert anyone.source == 2
        assert _error_of(a.isend(1, np.ones(1), K)).peer == 1


def test_protocol_error_drops_the_peer():
    mine, theirs = socket.socketpair()
    t = TcpTransport(0, 2, {1: mine})
    try:
        r = t.irecv(1, np.zeros(4), K)
        theirs.sendall(b"\x00" * framing.HEADER_SIZE)
        err = _error_of(r)
        assert err.reason == "lost" and err.peer == 1 and "bad frame magic" in str(err)
    finally:
        t.close()
        theirs.close()


# -- progress ---------------------------------------------------------------------------------------


def test_background_progress_without_wait():
    with local_world(2) as (a, b):
        data = pattern(32 * MiB)
        s = a.isend(1, data, K)  # a never waits: its background thread has to push the rest
        out = np.zeros_like(data)
        wait_all(b.irecv(0, out, K))
        assert np.array_equal(out, data)
        deadline = soon()
        while not s.test() and time.monotonic() < deadline:
            time.sleep(0.001)
        assert s.test()


def _drive_once(a, b, tag):
    """One small exchange that both transports wait for: each has "driven" its event loop."""
    key = MessageKey(2, KIND_P2P, tag)
    ra, rb = a.irecv(1, np.zeros(1), key), b.irecv(0, np.zeros(1), key)
    sa, sb = a.isend(1, np.ones(1), key), b.isend(0, np.ones(1), key)
    wait_all(ra, rb, sa, sb)


def test_background_thread_leaves_small_messages_to_a_busy_caller(monkeypatch):
    # With an endless park period the background thread never wakes by itself: a small message
    # must then stay in the socket until the caller asks (no thread hand-off on the latency path)
    monkeypatch.setattr(tcp_module, "_PARK_S", 3600.0)
    with local_world(2) as (a, b):
        _drive_once(a, b, 0)
        a.isend(1, pattern(100), K).wait(soon())
        time.sleep(0.2)
        assert not b.matcher.has_unexpected()  # not read behind the caller's back
        out = np.zeros(100, np.uint8)
        wait_all(b.irecv(0, out, K))
        assert np.array_equal(out, pattern(100))


def test_background_thread_reads_small_messages_of_an_idle_caller():
    with local_world(2) as (a, b):
        _drive_once(a, b, 0)
        a.isend(1, pattern(100), K).wait(soon())
        deadline = soon()
        while not b.matcher.has_unexpected() and time.monotonic() < deadline:  # b never calls in
            time.sleep(0.001)
        assert b.matcher.has_unexpected()  # its background thread read it, once the caller was idle
        msg = b.matcher.unexpected()[0]
        assert msg.complete and bytes(msg.data) == pattern(100).tobytes()


def test_bulk_transfers_move_in_the_background_while_the_caller_is_busy(monkeypatch):
    # Endless park period: only the "bulk" rule can wake the background threads
    monkeypatch.setattr(tcp_module, "_PARK_S", 3600.0)
    with local_world(2) as (a, b):
        _drive_once(a, b, 0)
        data = pattern(32 * MiB)
        s = a.isend(1, data, K)  # a never waits: its background thread pushes the rest
        out = np.zeros_like(data)
        wait_all(b.irecv(0, out, K))
        assert np.array_equal(out, data)
        deadline = soon()
        while not s.done and time.monotonic() < deadline:  # its last bytes may still be leaving
            time.sleep(0.001)
        assert s.done and s.error is None
        # and the receiving side: b posts a large receive and never waits on it
        _drive_once(a, b, 1)
        out2 = np.zeros_like(data)
        r = b.irecv(0, out2, K)
        wait_all(a.isend(1, data[::-1].copy(), K))  # completes only if b's background thread reads
        deadline = soon()
        while not r.done and time.monotonic() < deadline:
            time.sleep(0.001)
        assert r.done and r.error is None
        assert np.array_equal(out2, data[::-1])


def test_several_threads_waiting_at_once():
    with local_world(2) as (a, b):
        outs = [np.zeros(1000, np.uint8) for _ in range(6)]
        recvs = [b.irecv(0, o, MessageKey(1, KIND_P2P, i)) for i, o in enumerate(outs)]
        errors = []

        def waiter(r):
            try:
                r.wait(soon())
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

        threads = [threading.Thread(target=waiter, args=(r,)) for r in recvs]
        for th in threads:
            th.start()
        time.sleep(0.05)
        for i in reversed(range(6)):
            a.isend(1, pattern(1000, i), MessageKey(1, KIND_P2P, i))
        for th in threads:
            th.join(30)
        assert not errors
        for i, o in enumerate(outs):
            assert np.array_equal(o, pattern(1000, i))


# -- mesh --------------------------------------------------------------------------------------------


def test_mesh_refuses_stray_connections():
    store = HashStore()
    result = {}

    def rank1():
        result[1] = TcpTransport.connect(store, 1, 2, 20.0, host="127.0.0.1")

    th = threading.Thread(target=rank1)
    th.start()
    host, port = mesh.decode_address(store.get("tcp/addr/1"))
    strays = [socket.create_connection((host, port)) for _ in range(3)]
    strays[0].sendall(b"GET / HTTP/1.1\r\n\r\n" + bytes(20))  # not a distcomm peer
    strays[1].sendall(framing.encode_hello(0, 1, 2, bytes(16)))  # another job's token
    strays[2].close()  # connects and leaves
    result[0] = TcpTransport.connect(store, 0, 2, 20.0, host="127.0.0.1")
    th.join(30)
    try:
        out = np.zeros(3)
        wait_all(result[1].isend(0, np.arange(3.0), K), result[0].irecv(1, out, K))
        assert list(out) == [0.0, 1.0, 2.0]
    finally:
        for t in result.values():
            t.close()
        for s in strays:
            s.close()


def test_mesh_with_wildcard_listener_publishes_a_reachable_address(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    store, out = HashStore(), {}
    th = threading.Thread(target=lambda: out.setdefault(1, TcpTransport.connect(store, 1, 2, 20.0, host="0.0.0.0")))
    th.start()
    out[0] = TcpTransport.connect(store, 0, 2, 20.0, host="127.0.0.1")
    th.join(30)
    try:
        assert mesh.decode_address(store.get("tcp/addr/1"))[0] == "127.0.0.1"
        got = np.zeros(2)
        wait_all(out[0].isend(1, np.ones(2), K), out[1].irecv(0, got, K))
        assert list(got) == [1.0, 1.0]
    finally:
        for t in out.values():
            t.close()


def test_mesh_names_missing_ranks():
    from distcomm.errors import DistNetworkError

    store = HashStore()
    store.set("tcp/token", bytes(16))
    store.set("tcp/addr/0", b"127.0.0.1|1")  # never connects to us
    with pytest.raises(DistNetworkError, match=r"ranks \[0\] did not connect to rank 1"):
        TcpTransport.connect(store, 1, 2, 0.5, host="127.0.0.1")


# -- between processes -------------------------------------------------------------------------------


def _connect(rank, world):
    from datetime import timedelta

    from distcomm.store import TCPStore

    store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, rank == 0,
                     timeout=timedelta(seconds=30))
    return store, TcpTransport.connect(store, rank, world, 30.0)


def pingpong_body(rank, world):
    store, t = _connect(rank, world)
    peer = 1 - rank
    for nbytes in (0, 1, 7, MiB, 64 * MiB):
        out = np.empty(nbytes, np.uint8)
        for turn in range(2):
            if turn == rank:
                t.isend(peer, pattern(nbytes, turn), K).wait(soon(60))
            else:
                t.irecv(peer, out, K).wait(soon(60))
                assert np.array_equal(out, pattern(nbytes, turn)), nbytes
    # both ways at once, receives posted first (straight into the buffers) ...
    mine, out = pattern(64 * MiB, rank), np.empty(64 * MiB, np.uint8)
    r = t.irecv(peer, out, K)
    s = t.isend(peer, mine, K)
    r.wait(soon(60))
    s.wait(soon(60))
    assert np.array_equal(out, pattern(64 * MiB, peer))
    # ... and sends first (each side's payload arrives unexpected, then is redirected or copied)
    out[:] = 0
    s = t.isend(peer, mine, K)
    r = t.irecv(peer, out, K)
    s.wait(soon(60))
    r.wait(soon(60))
    assert np.array_equal(out, pattern(64 * MiB, peer))
    t.close()
    return "ok"


@pytest.mark.slow
def test_pingpong_and_simultaneous_64mib_between_processes():
    assert run_world(pingpong_body, 2, timeout=120) == ["ok", "ok"]


def all_pairs_body(rank, world):
    store, t = _connect(rank, world)
    sends = [t.isend(q, pattern(1000 + q, rank), K) for q in range(world) if q != rank]
    outs = {q: np.empty(1000 + rank, np.uint8) for q in range(world) if q != rank}
    recvs = [t.irecv(q, outs[q], K) for q in outs]
    for r in recvs + sends:
        r.wait(soon(60))
    for q, o in outs.items():
        assert np.array_equal(o, pattern(1000 + rank, q)), q
    # any-source: everyone sends to rank 0 with another key
    key = MessageKey(1, KIND_P2P, 11)
    if rank == 0:
        got = set()
        for _ in range(world - 1):
            r = t.irecv(ANY_SOURCE, np.empty(1, np.int64), key)
            r.wait(soon(60))
            got.add(r.source)
        assert got == set(range(1, world))
    else:
        t.isend(0, np.array([rank], np.int64), key).wait(soon(60))
    # a last exchange so nobody closes while another still needs it
    for q in range(world):
        if q != rank:
            t.isend(q, np.zeros(1), MessageKey(9, 0, 0))
    for q in range(world):
        if q != rank:
            t.irecv(q, np.zeros(1), MessageKey(9, 0, 0)).wait(soon(60))
    t.close()
    return "ok"


@pytest.mark.slow
@pytest.mark.parametrize("world", [3, 4])
def test_all_pairs_between_processes(world):
    assert run_world(all_pairs_body, world, timeout=120) == ["ok"] * world


def dead_peer_body(rank, world):
    store, t = _connect(rank, world)
    victim = 1
    # everyone connected before the victim dies
    for q in range(world):
        if q != rank:
            t.isend(q, np.zeros(1), K)
    for q in range(world):
        if q != rank:
            t.irecv(q, np.zeros(1), K).wait(soon(60))
    if rank == victim:
        time.sleep(0.2)  # let the others post their receives
        os._exit(3)
    # deadlines longer than the harness's: a failure by timeout would be a killed world instead
    pending = t.irecv(victim, np.zeros(4), K)
    try:
        pending.wait(soon(600))
        return "no error"
    except TransportError as exc:
        if exc.reason != "lost" or exc.peer != victim or "rank 1" not in str(exc):
            return f"wrong error: {exc.reason} {exc.peer} {exc}"
    after = _error_of(t.isend(victim, np.zeros(1), K))
    if after is None or after.reason != "lost":
        return f"send after death: {after}"
    # the survivors still talk to each other
    other = 2 if rank == 0 else 0
    out = np.zeros(1)
    t.isend(other, np.full(1, rank + 10.0), MessageKey(1, KIND_P2P, 1)).wait(soon(600))
    t.irecv(other, out, MessageKey(1, KIND_P2P, 1)).wait(soon(600))
    t.close()
    return "lost" if out[0] == other + 10 else f"bad data {out}"


@pytest.mark.slow
def test_killed_peer_fails_pending_requests_promptly():
    results = run_world(dead_peer_body, 3, timeout=60, expect_failure=[1])
    assert results[0] == "lost" and results[2] == "lost", results


def test_mesh_through_torch_tcpstore():
    """The mesh needs only torch's Store interface: set, get, wait(keys, timedelta), and .host."""
    torch_dist = pytest.importorskip("torch.distributed")
    from harness import free_port

    port, out, errors = free_port(), [None, None], []

    def rank(r):
        try:
            store = torch_dist.TCPStore("127.0.0.1", port, 2, r == 0, wait_for_workers=False)
            out[r] = (store, TcpTransport.connect(store, r, 2, 20.0, prefix="torchstore"))
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    try:
        assert not errors, errors
        (_, a), (_, b) = out
        got = np.zeros(5)
        wait_all(a.isend(1, np.arange(5.0), K), b.irecv(0, got, K))
        assert list(got) == [0.0, 1.0, 2.0, 3.0, 4.0]
    finally:
        for item in out:
            if item is not None:
                item[1].close()
