"""The TCP transport's wire format on bytes alone: exact encodings, round trips, corrupt input."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from distcomm.store import HashStore, PrefixStore
from distcomm.transport import framing as f
from distcomm.transport import mesh
from distcomm.transport.base import KIND_COLLECTIVE, KIND_P2P, MessageKey

TOKEN = bytes(range(16))

# (key, signature, nbytes) -> the exact 32 bytes on the wire
HEADERS = [
    (MessageKey(0, KIND_COLLECTIVE, 0), 0, 0,
     "c7d1" "01" "00" "00000000" "0000000000000000" "00000000" "00000000" "0000000000000000"),
    (MessageKey(1, KIND_COLLECTIVE, 5), 0xDEADBEEF, 8,
     "c7d1" "01" "00" "01000000" "0500000000000000" "efbeadde" "00000000" "0800000000000000"),
    (MessageKey(7, KIND_P2P, -1), 1, 64 << 20,
     "c7d1" "01" "01" "07000000" "ffffffffffffffff" "01000000" "00000000" "0000000400000000"),
    (MessageKey(2**32 - 1, 254, 2**63 - 1), 2**32 - 1, f.MAX_NBYTES,
     "c7d1" "01" "fe" "ffffffff" "ffffffffffffff7f" "ffffffff" "00000000" "0000000000010000"),
    (MessageKey(3, KIND_P2P, -(2**63)), 0x01020304, 1,
     "c7d1" "01" "01" "03000000" "0000000000000080" "04030201" "00000000" "0100000000000000"),
]


@pytest.mark.parametrize("key,signature,nbytes,hexbytes", HEADERS)
def test_header_exact_bytes(key, signature, nbytes, hexbytes):
    wire = bytes.fromhex(hexbytes)
    assert len(wire) == f.HEADER_SIZE == 32
    assert f.encode_header(key, signature, nbytes) == wire
    assert f.decode_header(wire) == (key, signature, nbytes)
    decoded = f.decode_header(b"junk" + wire, 4)
    assert decoded.key == key and isinstance(decoded.key, MessageKey)
    assert (decoded.key.group, decoded.key.kind, decoded.key.seq) == tuple(key)


@given(
    group=st.integers(0, 2**32 - 1),
    kind=st.integers(0, 255),
    seq=st.integers(-(2**63), 2**63 - 1),
    signature=st.integers(0, 2**32 - 1),
    nbytes=st.integers(0, f.MAX_NBYTES),
)
def test_header_round_trip(group, kind, seq, signature, nbytes):
    key = MessageKey(group, kind, seq)
    assert f.decode_header(f.encode_header(key, signature, nbytes)) == (key, signature, nbytes)


@pytest.mark.parametrize("key,signature,nbytes", [
    (MessageKey(-1, 0, 0), 0, 0),
    (MessageKey(2**32, 0, 0), 0, 0),
    (MessageKey(0, 256, 0), 0, 0),
    (MessageKey(0, -1, 0), 0, 0),
    (MessageKey(0, 0, 2**63), 0, 0),
    (MessageKey(0, 0, -(2**63) - 1), 0, 0),
    (MessageKey(0, 0, 0), -1, 0),
    (MessageKey(0, 0, 0), 2**32, 0),
    (MessageKey(0, 0, 0), 0, -1),
    (MessageKey(0, 0, 0), 0, f.MAX_NBYTES + 1),
])
def test_header_values_out_of_range(key, signature, nbytes):
    with pytest.raises(f.FramingError, match="cannot encode a frame header"):
        f.encode_header(key, signature, nbytes)


GOOD = bytes.fromhex(HEADERS[1][3])


@pytest.mark.parametrize("wire,message", [
    (b"", "needs 32 bytes, got 0"),
    (GOOD[:31], "needs 32 bytes, got 31"),
    (b"\x00\x00" + GOOD[2:], "bad frame magic 0x0000"),
    (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n\r\n\r\n\r\n", "bad frame magic"),
    (GOOD[:2] + b"\x02" + GOOD[3:], "frame version 2"),
    (GOOD[:20] + b"\x01\x00\x00\x00" + GOOD[24:], "reserved header field"),
    (GOOD[:24] + (f.MAX_NBYTES + 1).to_bytes(8, "little"), "more than the limit"),
    (GOOD[:24] + b"\xff" * 8, "more than the limit"),
])
def test_header_bad_input(wire, message):
    with pytest.raises(f.FramingError, match=message):
        f.decode_header(wire)


def test_header_decode_offset_past_end():
    with pytest.raises(f.FramingError, match="got 0"):
        f.decode_header(GOOD, 32)


def test_goodbye_is_a_control_frame():
    wire = f.encode_goodbye()
    assert wire == bytes.fromhex("c7d101ff" "00000000" "0100000000000000" "00000000" "00000000" "0000000000000000")
    header = f.decode_header(wire)
    assert f.is_goodbye(header) and header.nbytes == 0
    assert not f.is_goodbye(f.decode_header(GOOD))


HELLO = bytes.fromhex("c8d1" "01" "00" "02000000" "03000000" "04000000") + TOKEN + bytes(4)


def test_hello_exact_bytes():
    assert f.HELLO_SIZE == len(HELLO) == 36
    assert f.encode_hello(2, 3, 4, TOKEN) == HELLO
    assert f.decode_hello(HELLO) == f.Hello(sender=2, receiver=3, world_size=4, token=TOKEN)


@pytest.mark.parametrize("wire,message", [
    (HELLO[:-1], "hello is 36 bytes, got 35"),
    (HELLO + b"\x00", "hello is 36 bytes, got 37"),
    (b"\xc7\xd1" + HELLO[2:], "bad hello magic 0xd1c7"),  # a frame header's magic is not a hello's
    (b"GET / HTTP/1.1\r\n" + b"x" * 20, "bad hello magic"),  # 36 bytes of HTTP
    (HELLO[:2] + b"\x09" + HELLO[3:], "version 9"),
    (HELLO[:3] + b"\x01" + HELLO[4:], "reserved hello fields"),
    (HELLO[:-4] + b"\x00\x00\x00\x01", "reserved hello fields"),
])
def test_hello_bad_input(wire, message):
    with pytest.raises(f.FramingError, match=message):
        f.decode_hello(wire)


def test_hello_encode_errors():
    with pytest.raises(f.FramingError, match="token must be 16 bytes"):
        f.encode_hello(0, 1, 2, b"short")
    with pytest.raises(f.FramingError, match="ranks are u32"):
        f.encode_hello(-1, 1, 2, TOKEN)


@pytest.mark.parametrize("hello,message", [
    (f.Hello(1, 0, 2, bytes(16)), "belongs to another job"),
    (f.Hello(1, 0, 3, TOKEN), "thinks the world has 3 ranks, this rank 2"),
    (f.Hello(1, 5, 2, TOKEN), "meant to reach rank 5 but reached rank 0"),
    (f.Hello(0, 0, 2, TOKEN), "invalid rank 0"),
    (f.Hello(2, 0, 2, TOKEN), "invalid rank 2"),
])
def test_check_hello_refuses(hello, message):
    with pytest.raises(f.FramingError, match=message):
        f.check_hello(hello, TOKEN, 2, 0)


def test_check_hello_accepts():
    f.check_hello(f.Hello(1, 0, 2, TOKEN), TOKEN, 2, 0)


@pytest.mark.parametrize("host,port", [("127.0.0.1", 1234), ("::1", 65535), ("fe80::1%eth0", 1), ("node-7.example", 29500)])
def test_address_record_round_trip(host, port):
    assert mesh.decode_address(mesh.encode_address(host, port)) == (host, port)


class _HostedStore(HashStore):
    host = "127.0.0.1"


def test_listen_host_prefers_explicit_then_store():
    assert mesh.listen_host(HashStore(), "10.1.2.3") == "10.1.2.3"
    assert mesh.listen_host(PrefixStore("a", PrefixStore("b", _HostedStore()))) == "127.0.0.1"


def test_listen_host_never_wildcard(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    store = _HostedStore()
    store.host = "0.0.0.0"  # a master bound to the wildcard: fall back to MASTER_ADDR
    assert mesh.listen_host(store) == "127.0.0.1"
