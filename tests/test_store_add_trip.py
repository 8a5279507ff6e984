"""The TCPStore client's add() round trip in C (store/tcp/_add_trip.c), on bytes: the frame it
sends is frames.encode_add's, the reply it accepts is exactly frames.decode_integer_reply's, and
everything else (a late answer, part of a reply, the server gone, no reply in time, a signal while
it waits) comes back as the socket methods would hand it to the client's general parser.

The client's own behaviour around it (late answers, set_timeout, lost servers) is pinned through
TCPStoreClient in test_store_tcp_server.py, on this path and on the Python one."""

from __future__ import annotations

import signal
import socket
import struct
import sys
import threading
import time

import pytest

from distcomm.store.tcp import frames as f
from harness import Interrupted, alarm, answered_while_asleep, voluntary_sleeps

trip = pytest.importorskip("distcomm.store.tcp._add_trip", reason="the C round trip is not built here")
ADD_SIZE = f.ADD_HEAD.size


def _pair(receive_timeout: float = 10.0) -> tuple[socket.socket, socket.socket]:
    """A blocking socket pair. The client's deadlines are SO_RCVTIMEO/SO_SNDTIMEO on a blocking
    socket; here they also turn a round trip that would never end (a held GIL starving the replying
    thread, a send nobody drains) into a failed assertion rather than a hang (a wait in poll() has
    ``_trip``'s guard instead)."""
    ours, theirs = socket.socketpair()
    seconds = int(receive_timeout)
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO,
                    struct.pack("ll", seconds, int((receive_timeout - seconds) * 1e6)))
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", 10, 0))
    return ours, theirs


@pytest.fixture(params=["recv", "poll"])
def wait_in(request):
    """How the call waits for its reply: asleep in recv() until the socket's SO_RCVTIMEO, as the
    client's does on TCP; or asleep in poll() for as long, as on the server's Unix socket."""
    return request.param


def _trip(wait_in: str, ours: socket.socket, key: bytes, request_id: int, amount: int):
    """round_trip on ``ours``, waiting as ``wait_in`` says. For "poll", the wait is the socket's
    SO_RCVTIMEO, which is then taken off the socket: only poll()'s own wait can end the call early.
    Should the call still be waiting 30 s on, the socket is shut down under it (it then returns or
    raises, and the test fails) rather than leave the suite hanging."""
    guard = threading.Timer(30, ours.shutdown, (socket.SHUT_RDWR,))
    guard.start()
    try:
        if wait_in == "recv":
            return trip.round_trip(ours.fileno(), key, request_id, amount, None)
        seconds, microseconds = struct.unpack("ll", ours.getsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, 16))
        ours.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 0, 0))
        return trip.round_trip(ours.fileno(), key, request_id, amount, seconds + microseconds / 1e6)
    finally:
        guard.cancel()


def _answer(theirs: socket.socket, frame_size: int, reply: bytes, delay: float = 0.0) -> threading.Thread:
    def server():
        theirs.recv(frame_size, socket.MSG_WAITALL)
        time.sleep(delay)
        theirs.sendall(reply)

    thread = threading.Thread(target=server, daemon=True)
    thread.start()
    return thread


def _after(signalled, *steps) -> threading.Thread:
    """A thread that runs ``steps`` (the test's server) once the alarm's handler has run: until then
    the call under test is left waiting, on a full socket buffer or for its reply. If the handler
    never runs, the steps run after 5 s anyway (the test then fails on the alarm's calls)."""
    def server():
        signalled.fired.wait(5)
        for step in steps:
            step()

    thread = threading.Thread(target=server, daemon=True)
    thread.start()
    return thread


def test_its_layout_is_frames():
    assert (trip.ADD_OPCODE, trip.ADD_LENGTH, trip.INTEGER_OPCODE, trip.INTEGER_LENGTH, trip.REPLY_SIZE) == (
        f.Add.OPCODE, f.ADD_LENGTH, f.Integer.OPCODE, f.INTEGER_LENGTH, f.INTEGER_REPLY.size)


@pytest.mark.parametrize("request_id, key, amount", [
    (1, b"n", 1), (0xFFFFFFFF, b"", 2**63 - 1), (7, b"k" * 300, -(2**63)), (0, b"\x00\xff" * 5, -1)])
def test_sends_encode_add_and_returns_the_integer_reply(request_id, key, amount, wait_in):
    ours, theirs = _pair()
    frame = f.encode_add(request_id, key, amount)
    sent = []

    def server():
        sent.append(theirs.recv(len(frame), socket.MSG_WAITALL))
        theirs.sendall(f.encode_integer(request_id, amount ^ 5))

    thread = threading.Thread(target=server, daemon=True)
    thread.start()
    try:
        assert _trip(wait_in, ours, key, request_id, amount) == amount ^ 5
        thread.join(10)
        assert sent == [frame]
        ours.setblocking(False)
        with pytest.raises(BlockingIOError):  # nothing more was sent, nothing more was read
            theirs.recv(1, socket.MSG_DONTWAIT)
    finally:
        ours.close()
        theirs.close()


def test_a_send_cut_short_by_a_signal_goes_on_where_it_stopped(wait_in):
    """A key larger than the socket's buffer, and a signal while the send waits for the reader: the
    kernel returns the part it took, and the rest follows from there."""
    ours, theirs = _pair()
    key = bytes(range(256)) * 16384  # 4 MiB
    frame = f.encode_add(3, key, 9)
    sent = []
    try:
        with alarm(0.1) as signalled:
            thread = _after(signalled, lambda: sent.append(theirs.recv(len(frame), socket.MSG_WAITALL)),
                            lambda: theirs.sendall(f.encode_integer(3, 9)))
            assert _trip(wait_in, ours, key, 3, 9) == 9
    finally:
        thread.join(10)
        ours.close()
        theirs.close()
    assert signalled.calls == [True]
    assert sent == [frame]


def test_a_signal_before_any_byte_went_out_runs_its_handler_and_the_send_goes_on(wait_in):
    """The socket's buffer is full when the call starts, so its first send waits with nothing sent;
    a signal then interrupts it (EINTR), the handler runs, and the send starts again."""
    ours, theirs = _pair()
    filler = 0
    try:
        while True:
            filler += ours.send(b"\0" * 65536, socket.MSG_DONTWAIT)
    except BlockingIOError:
        pass
    frame = f.encode_add(1, b"n", 1)
    received = []
    try:
        with alarm(0.1) as signalled:
            thread = _after(signalled, lambda: received.append(theirs.recv(filler + len(frame), socket.MSG_WAITALL)),
                            lambda: theirs.sendall(f.encode_integer(1, 5)))
            assert _trip(wait_in, ours, b"n", 1, 1) == 5
    finally:
        thread.join(10)
        ours.close()
        theirs.close()
    assert signalled.calls == [True]
    assert received == [b"\0" * filler + frame]


@pytest.mark.parametrize("reply", [
    f.encode_integer(4, 10),                            # another request's answer (a late one)
    f.encode(f.Value(5, b"x" * 16)),                    # not an Integer
    f.encode_integer(5, 10)[:-1],                       # part of the reply: the rest comes later
    f.encode(f.Error(5, f.ERROR_NOT_AN_INTEGER, b"nope")),
], ids=["other-id", "other-frame", "partial", "error"])
def test_anything_but_the_awaited_integer_comes_back_as_bytes(reply, wait_in):
    ours, theirs = _pair()
    thread = _answer(theirs, len(f.encode_add(5, b"n", 1)), reply)
    try:
        got = _trip(wait_in, ours, b"n", 5, 1)
    finally:
        thread.join(10)
        ours.close()
        theirs.close()
    assert got.__class__ is bytes
    assert got == reply[:trip.REPLY_SIZE]  # never more than a reply's worth: the rest stays for the parser


def test_the_server_closing_comes_back_as_no_bytes(wait_in):
    ours, theirs = _pair()

    def server():
        theirs.recv(ADD_SIZE + 1, socket.MSG_WAITALL)
        theirs.shutdown(socket.SHUT_WR)

    thread = threading.Thread(target=server, daemon=True)
    thread.start()
    try:
        assert _trip(wait_in, ours, b"n", 1, 1) == b""
    finally:
        thread.join(10)
        ours.close()
        theirs.close()


def test_no_reply_within_the_receive_timeout_is_none(wait_in):
    ours, theirs = _pair(receive_timeout=0.1)
    try:
        start = time.monotonic()
        assert _trip(wait_in, ours, b"n", 1, 1) is None
        assert time.monotonic() - start < 5
        assert theirs.recv(ADD_SIZE + 1, socket.MSG_WAITALL) == f.encode_add(1, b"n", 1)  # the request went out
    finally:
        ours.close()
        theirs.close()


def test_a_failed_send_raises_oserror(wait_in):
    ours, theirs = _pair()
    theirs.close()
    try:
        with pytest.raises(BrokenPipeError):
            _trip(wait_in, ours, b"n", 1, 1)
    finally:
        ours.close()


def test_other_threads_run_while_it_waits(wait_in):
    """The GIL is released while it blocks: the reply here comes from a Python thread of this
    process, which could not run otherwise (the receive timeout turns a held GIL into None)."""
    ours, theirs = _pair()
    thread = _answer(theirs, ADD_SIZE + 1, f.encode_integer(1, 42), delay=0.05)
    try:
        assert _trip(wait_in, ours, b"n", 1, 1) == 42
    finally:
        thread.join(10)
        ours.close()
        theirs.close()


def test_a_signal_while_it_waits_runs_its_handler_and_it_goes_on(wait_in):
    ours, theirs = _pair()
    try:
        with alarm(0.05) as signalled:
            thread = _after(signalled, lambda: theirs.recv(ADD_SIZE + 1, socket.MSG_WAITALL),
                            lambda: theirs.sendall(f.encode_integer(1, 7)))
            assert _trip(wait_in, ours, b"n", 1, 1) == 7
        assert signalled.calls == [True]
    finally:
        thread.join(10)
        ours.close()
        theirs.close()


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="needs setitimer")
def test_a_handler_that_raises_ends_the_wait_with_its_exception(wait_in):
    ours, theirs = _pair(receive_timeout=5.0)
    try:
        start = time.monotonic()
        with pytest.raises(Interrupted), alarm(0.05, raising=True):
            _trip(wait_in, ours, b"n", 1, 1)
        assert time.monotonic() - start < 4
    finally:
        ours.close()
        theirs.close()


def test_a_handler_that_raises_during_a_send_under_way_gets_the_whole_frame_out_first(wait_in):
    """Part of the frame is out when the handler raises: the rest follows, then the exception, without
    waiting for the reply (the server would otherwise read the next request as this one's rest)."""
    ours, theirs = _pair()
    key = bytes(range(256)) * 16384  # 4 MiB: more than the socket's buffer
    frame = f.encode_add(3, key, 9)
    sent = []
    try:
        start = time.monotonic()
        with pytest.raises(Interrupted), alarm(0.1, raising=True) as signalled:
            # takes the frame once the signal came, and never answers
            thread = _after(signalled, lambda: sent.append(theirs.recv(len(frame), socket.MSG_WAITALL)))
            _trip(wait_in, ours, key, 3, 9)
        assert time.monotonic() - start < 5  # not the receive timeout (10 s): no wait for a reply
    finally:
        thread.join(10)
        ours.close()
        theirs.close()
    assert sent == [frame]


@pytest.mark.parametrize("args, error", [
    ((b"n", 2**32, 1, None), OverflowError),
    ((b"n", 1, 2**63, None), OverflowError),
    ((b"n", 1, -(2**63) - 1, 1.0), OverflowError),
    (("n", 1, 1, None), TypeError),
    ((b"n", 1, 1), TypeError),
    ((b"n", 1, 1.0, None), TypeError),
    ((b"n", 1, 1, -0.5), ValueError),
    ((b"n", 1, 1, float("nan")), ValueError),
    ((b"n", 1, 1, "1"), TypeError),
])
def test_bad_arguments_raise_before_anything_is_sent(args, error):
    ours, theirs = _pair()
    try:
        with pytest.raises(error):
            trip.round_trip(ours.fileno(), *args)
        with pytest.raises(BlockingIOError):
            theirs.recv(1, socket.MSG_DONTWAIT)
    finally:
        ours.close()
        theirs.close()


def test_a_negative_descriptor_is_refused():
    with pytest.raises(ValueError, match="not a file descriptor"):
        trip.round_trip(-1, b"n", 1, 1, None)


@pytest.mark.parametrize("wait", [3, 1e9, float("inf")])
def test_a_wait_in_poll_of_any_length_takes_the_reply(wait):
    """Seconds as an int, and waits longer than one poll() takes (about 24 days)."""
    ours, theirs = _pair()
    thread = _answer(theirs, ADD_SIZE + 1, f.encode_integer(1, 8))
    try:
        assert trip.round_trip(ours.fileno(), b"n", 1, 1, wait) == 8
    finally:
        thread.join(10)
        ours.close()
        theirs.close()


def test_a_wait_in_poll_is_the_whole_wait_when_poll_says_readable_and_nothing_comes():
    """An urgent (out-of-band) byte makes poll() say readable while recv() has nothing for the call.
    Each time, the wait goes on for what is left of it, not for all of it again: with a byte every
    0.4 s and a wait of 0.5 s, starting over would take 4 s and more."""
    ours, theirs = _pair()
    done = threading.Event()

    def server():
        theirs.recv(ADD_SIZE + 1, socket.MSG_WAITALL)
        for _ in range(10):
            try:
                theirs.send(b"!", socket.MSG_OOB)
            except OSError:  # this kernel's Unix sockets take no urgent data; the call then waits 0.5 s
                return
            if done.wait(0.4):
                return

    thread = threading.Thread(target=server, daemon=True)
    thread.start()
    try:
        start = time.monotonic()
        assert trip.round_trip(ours.fileno(), b"n", 1, 1, 0.5) is None
        assert time.monotonic() - start < 3
    finally:
        done.set()
        thread.join(10)
        ours.close()
        theirs.close()


def _sleeps_of_a_round_trip(wait) -> int:
    """How many times the calling thread slept in one round trip whose request the server (another
    process) reads while the thread is asleep waiting for the reply."""
    ours, theirs = _pair()
    try:
        with answered_while_asleep(theirs, ADD_SIZE + 1, f.encode_integer(1, 3)):
            before = voluntary_sleeps()
            value = trip.round_trip(ours.fileno(), b"n", 1, 1, wait)
            sleeps = voluntary_sleeps() - before
    finally:
        ours.close()
        theirs.close()
    assert value == 3
    return sleeps


needs_proc = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts a thread's sleeps through /proc")


@needs_proc
def test_waiting_in_poll_sleeps_once_per_reply_on_a_unix_socket():
    """On a Unix socket the kernel wakes every thread asleep on it when the peer reads what it sent;
    waiting in poll() for bytes to read, the call is not woken by that and sleeps once: from its
    request to the reply. A wait for the GIL counts as a sleep too (pytest-xdist's worker has a
    thread of its own), so the fewest of three round trips counts: the empty wake-up would be in
    every one of them."""
    assert min(_sleeps_of_a_round_trip(10.0) for _ in range(3)) == 1


@needs_proc
def test_waiting_in_recv_is_also_woken_when_the_server_reads_on_a_unix_socket():
    """Why the wait is in poll() on a Unix socket, by the same count: asleep in recv(), the call is
    woken when the server reads its request, and sleeps again."""
    sleeps = [_sleeps_of_a_round_trip(None) for _ in range(3)]
    if max(sleeps) < 2:
        pytest.skip("this kernel does not wake a reader asleep in recv() when the peer reads what it sent")
    assert min(sleeps) == 2
