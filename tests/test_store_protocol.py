"""The TCPStore wire protocol on bytes alone: exact encodings, incremental parsing, and bad input.

The tables spell every frame out field by field (hex, little-endian) so a change to the format is
a visible, deliberate diff here, not a silent incompatibility between versions.
"""

from __future__ import annotations

import struct

import pytest

from distcomm.store.tcp import connection as c, frames as f, handshake as h


def frame(length: int, opcode: str, request_id: str, *fields: str) -> bytes:
    """u64 length | u8 opcode | u32 request id | fields — each given as hex."""
    return struct.pack("<Q", length) + bytes.fromhex(opcode + request_id + "".join(fields))


U32_1, U32_2 = "01000000", "02000000"

REQUESTS = [
    (f.Set(1, b"k", b"v"), frame(11, "01", U32_1, U32_1, "6b", "76")),
    (f.Set(1, b"", b""), frame(9, "01", U32_1, "00000000")),
    (f.Get(2, b"k", 1500), frame(14, "02", U32_2, "dc05000000000000", "6b")),
    (f.Add(3, b"c", -2), frame(14, "03", "03000000", "feffffffffffffff", "63")),
    (f.CompareSet(4, b"k", b"", b"d"), frame(15, "04", "04000000", U32_1, "6b", "00000000", "64")),
    (f.Wait(5, [b"a", b"bc"], 0), frame(28, "05", "05000000", "0000000000000000", U32_2, U32_1, "61", U32_2, "6263")),
    (f.Check(6, []), frame(9, "06", "06000000", "00000000")),
    (f.NumKeys(7), frame(5, "07", "07000000")),
    (f.DeleteKey(8, b"k"), frame(6, "08", "08000000", "6b")),
    (f.Append(9, b"k", b"v"), frame(11, "09", "09000000", U32_1, "6b", "76")),
    (f.MultiGet(10, [b"a"], 7), frame(22, "0a", "0a000000", "0700000000000000", U32_1, U32_1, "61")),
    (f.MultiSet(11, [b"a"], [b"b"]), frame(23, "0b", "0b000000", U32_1, U32_1, "61", U32_1, U32_1, "62")),
    (f.ListKeys(12), frame(5, "0c", "0c000000")),
    (f.Join(0xFFFFFFFF), frame(5, "0d", "ffffffff")),
    # version 2: queues and barrier
    (f.QueuePush(13, b"q", b"item"), frame(14, "0e", "0d000000", U32_1, "71", "6974656d")),
    (f.QueuePush(13, b"q", b""), frame(10, "0e", "0d000000", U32_1, "71")),
    (f.QueuePop(14, b"q", 300_000), frame(14, "0f", "0e000000", "e093040000000000", "71")),
    (f.QueuePop(14, b"q", 0), frame(14, "0f", "0e000000", "0000000000000000", "71")),  # block=False
    (f.QueueLen(15, b"qq"), frame(7, "10", "0f000000", "7171")),
    (f.Barrier(16, b"b", 3, 250), frame(22, "11", "10000000", "0300000000000000", "fa00000000000000", "62")),
    (f.Barrier(17, b"", 2**63 - 1, 2**64 - 1), frame(21, "11", "11000000", "ffffffffffffff7f", "ffffffffffffffff")),
]

RESPONSES = [
    (f.Ok(7), frame(5, "80", "07000000")),
    (f.Value(8, b"xy"), frame(7, "81", "08000000", "7879")),
    (f.Integer(9, -1), frame(13, "82", "09000000", "ffffffffffffffff")),
    (f.Integer(9, 2**63 - 1), frame(13, "82", "09000000", "ffffffffffffff7f")),
    (f.Bool(10, True), frame(6, "83", "0a000000", "01")),
    (f.Bool(10, False), frame(6, "83", "0a000000", "00")),
    (f.Values(11, [b"a", b""]), frame(18, "84", "0b000000", U32_2, U32_1, "61", "00000000")),
    (f.TimedOut(12, [b"a"]), frame(14, "85", "0c000000", U32_1, U32_1, "61")),
    (f.Error(13, f.ERROR_NOT_AN_INTEGER, b"no"), frame(8, "86", "0d000000", "01", "6e6f")),
]

HELLO = b"DCKV\x02\x00\x00\x00"  # version 2: version 1 plus queues and barrier
HELLO_OK = b"DCKV\x02\x00\x00\x00\x00\x00"  # no local address
HELLO_OK_LOCAL = b"DCKV\x02\x00\x00\x00\x04\x00\x00abc"
HELLO_REFUSED = b"DCKV\x02\x00\x01\x00\x00\x00"


def _server(max_frame_size: int = f.DEFAULT_MAX_FRAME_SIZE) -> c.ServerConnection:
    proto = c.ServerConnection(max_frame_size)
    proto.receive_data(HELLO)
    assert proto.next_event() == h.Hello(2)
    return proto


def _client() -> c.ClientConnection:
    proto = c.ClientConnection()
    proto.receive_data(HELLO_OK)
    assert proto.next_event() == h.HelloReply(2, h.HELLO_STATUS_OK)
    return proto


# -- exact encodings ------------------------------------------------------------------------------


def test_hello_bytes():
    assert c.ClientConnection.send(h.Hello()) == HELLO
    assert c.ServerConnection.send(h.HelloReply(2, h.HELLO_STATUS_OK)) == HELLO_OK
    assert c.ServerConnection.send(h.HelloReply(2, h.HELLO_STATUS_UNSUPPORTED_VERSION)) == HELLO_REFUSED
    assert c.ServerConnection.send(h.HelloReply(2, h.HELLO_STATUS_OK, b"\0abc")) == HELLO_OK_LOCAL


def test_hello_reply_with_a_local_address_arriving_in_pieces():
    client = c.ClientConnection()
    events = []
    for i in range(len(HELLO_OK_LOCAL)):
        events += client.receive_events(HELLO_OK_LOCAL[i : i + 1])
    assert events == [h.HelloReply(2, h.HELLO_STATUS_OK, b"\0abc")]
    assert not client.has_partial_data


@pytest.mark.parametrize("event, wire", REQUESTS, ids=lambda x: type(x).__name__ if not isinstance(x, bytes) else "")
def test_request_encoding_and_decoding(event, wire):
    assert c.ClientConnection.send(event) == wire
    server = _server()
    server.receive_data(wire)
    assert server.next_event() == event
    assert server.next_event() is c.NEED_DATA


@pytest.mark.parametrize("event, wire", RESPONSES, ids=lambda x: type(x).__name__ if not isinstance(x, bytes) else "")
def test_response_encoding_and_decoding(event, wire):
    assert c.ServerConnection.send(event) == wire
    client = _client()
    assert client.receive_events(wire) == [event]


def test_fast_encoders_match_the_generic_encoder():
    assert f.encode_set(5, b"key", b"value") == f.encode(f.Set(5, b"key", b"value"))
    assert f.encode_get(5, b"key", 300_000) == f.encode(f.Get(5, b"key", 300_000))
    assert f.encode_add(5, b"key", -(2**63)) == f.encode(f.Add(5, b"key", -(2**63)))
    assert f.encode_ok(5) == f.encode(f.Ok(5))
    assert f.encode_value(5, b"v") == f.encode(f.Value(5, b"v"))
    assert f.encode_integer(5, 42) == f.encode(f.Integer(5, 42))
    assert f.encode_bool(5, True) == f.encode(f.Bool(5, True))


def test_the_inline_add_layout_is_encode_add_and_decode_integer_reply():
    """client.py's add() builds and checks its frames with these, inline (see frames.ADD_HEAD)."""
    for request_id, key, amount in ((5, b"key", -(2**63)), (0xFFFFFFFF, b"", 2**63 - 1), (1, b"k" * 300, 0)):
        assert f.ADD_HEAD.pack(f.ADD_LENGTH + len(key), f.Add.OPCODE, request_id, amount) + key == \
            f.encode_add(request_id, key, amount)
        reply = f.encode_integer(request_id, amount)
        assert len(reply) == f.INTEGER_REPLY.size
        assert f.INTEGER_REPLY.unpack(reply) == (f.INTEGER_LENGTH, f.Integer.OPCODE, request_id, amount)
        assert f.decode_integer_reply(reply, request_id) == amount


def test_each_side_sends_only_its_own_events():
    with pytest.raises(TypeError):
        c.ClientConnection.send(f.Ok(1))
    with pytest.raises(TypeError):
        c.ServerConnection.send(f.Set(1, b"k", b"v"))
    with pytest.raises(TypeError):
        f.encode(h.Hello())
    with pytest.raises(ValueError):
        f.encode(f.MultiSet(1, [b"a"], []))


def test_version_policy():
    assert c.ServerConnection.reply_to(h.Hello(h.VERSION)) == h.HelloReply(h.VERSION, h.HELLO_STATUS_OK)
    assert c.ServerConnection.reply_to(h.Hello(99)).status == h.HELLO_STATUS_UNSUPPORTED_VERSION


# -- incremental parsing --------------------------------------------------------------------------


def test_byte_by_byte_gives_the_same_events():
    stream = b"".join(wire for _, wire in REQUESTS)
    server = c.ServerConnection()
    events = []
    for i in range(len(HELLO + stream)):
        events += server.receive_events((HELLO + stream)[i : i + 1])
    assert events == [h.Hello(2)] + [event for event, _ in REQUESTS]
    assert not server.has_partial_data


def test_many_frames_in_one_chunk_and_a_split_frame():
    wires = [wire for _, wire in RESPONSES]
    client = _client()
    blob = b"".join(wires)
    cut = len(blob) - 3
    assert client.receive_events(blob[:cut]) == [event for event, _ in RESPONSES[:-1]]
    assert client.has_partial_data
    assert client.receive_events(blob[cut:]) == [RESPONSES[-1][0]]
    assert not client.has_partial_data


def test_partial_data_tracks_the_hello_and_frames():
    server = c.ServerConnection()
    assert server.has_partial_data  # no hello yet
    server.receive_data(HELLO[:3])
    assert server.next_event() is c.NEED_DATA and server.has_partial_data
    server.receive_data(HELLO[3:])
    assert server.next_event() == h.Hello(2)
    assert not server.has_partial_data
    server.receive_data(REQUESTS[0][1][:4])
    assert server.next_event() is c.NEED_DATA and server.has_partial_data


def test_empty_data_means_closed():
    server = c.ServerConnection()
    server.receive_data(b"")
    assert server.closed


# -- bad input ------------------------------------------------------------------------------------


def test_wrong_magic_is_reported_at_the_first_wrong_byte():
    server = c.ServerConnection()
    server.receive_data(b"G")  # e.g. "GET / HTTP/1.1"
    with pytest.raises(f.ProtocolError, match="bad magic"):
        server.next_event()


@pytest.mark.parametrize("version", [1, 3])  # 1: before queues and barrier, whose opcodes it would not know
def test_unsupported_version_is_parsed_then_refused(version):
    server = c.ServerConnection()
    server.receive_data(b"DCKV" + bytes([version]) + b"\x00\x00\x00")
    hello = server.next_event()
    assert hello == h.Hello(version)
    assert server.send(server.reply_to(hello)) == HELLO_REFUSED


def test_a_huge_length_prefix_is_refused_before_anything_else_arrives():
    server = _server(max_frame_size=1 << 20)
    server.receive_data(struct.pack("<Q", 2**40))  # only the 8 length bytes
    with pytest.raises(f.ProtocolError, match="exceeds the maximum frame size"):
        server.next_event()
    assert f.DEFAULT_MAX_FRAME_SIZE < 2**40


def test_a_huge_length_prefix_in_a_batch_is_refused():
    server = _server(max_frame_size=1 << 20)
    with pytest.raises(f.ProtocolError, match="exceeds"):
        server.receive_events(f.encode(f.NumKeys(1)) + struct.pack("<Q", 2**40) + b"\x01")


@pytest.mark.parametrize(
    "wire, message",
    [
        (frame(4, "07", "01000000")[:12], "shorter than a frame head"),
        (frame(5, "7f", "01000000"), "unknown opcode 0x7f"),
        (frame(5, "80", "01000000"), "unknown opcode 0x80"),  # a response sent to the server
        (frame(13, "01", U32_1, "ff000000", "6b6b6b6b"), "needs 255 bytes"),  # key length past the frame
        (frame(9, "02", U32_1, "00000000"), "cannot hold timeout_ms"),
        (frame(12, "0f", U32_1, "00000000000071"), "QueuePop frame: 7 bytes cannot hold timeout_ms"),
        (frame(18, "11", U32_1, "0300000000000000", "fa000000", "62"), "Barrier frame: 13 bytes cannot hold"),
        (frame(9, "0e", U32_1, "05000000"), "needs 5 bytes"),  # QueuePush key length past the frame
        (frame(17, "05", U32_1, "0000000000000000", "ffffffff"), "count 4294967295 cannot fit"),
        (frame(15, "06", U32_1, U32_1, "00000000", "zz".encode().hex()), "unexpected bytes"),
    ],
)
def test_malformed_frames_raise_protocol_error(wire, message):
    server = _server()
    with pytest.raises(f.ProtocolError, match=message):
        server.receive_events(wire)


def test_bad_responses_raise_protocol_error():
    client = _client()
    with pytest.raises(f.ProtocolError, match="not one byte 0 or 1"):
        client.receive_events(frame(6, "83", U32_1, "02"))
    with pytest.raises(f.ProtocolError, match="not 8"):
        _client().receive_events(frame(6, "82", U32_1, "02"))
    with pytest.raises(f.ProtocolError, match="unknown opcode 0x01"):
        _client().receive_events(REQUESTS[0][1])  # a request sent to the client


def test_receive_events_equals_next_event_loop():
    stream = b"".join(wire for _, wire in REQUESTS) * 3
    a, b = _server(), _server()
    via_batch = a.receive_events(stream[:50]) + a.receive_events(stream[50:])
    b.receive_data(stream[:50])
    b.receive_data(stream[50:])
    via_loop = []
    while (event := b.next_event()) is not c.NEED_DATA:
        via_loop.append(event)
    assert via_batch == via_loop == [event for event, _ in REQUESTS] * 3


def test_receive_reply_picks_the_awaited_answer_and_drops_late_ones():
    late = f.encode(f.Value(3, b"late"))
    awaited = f.encode(f.Integer(4, 9))
    client = _client()
    assert client.receive_reply(awaited, 4) == f.Integer(4, 9)  # the fast path
    assert client.receive_reply(late + awaited[:5], 4) is None  # late answer dropped, reply incomplete
    assert client.receive_reply(awaited[5:], 4) == f.Integer(4, 9)
    assert not client.has_partial_data


def test_receive_integer_decodes_only_the_exact_awaited_integer_and_consumes_nothing_else():
    awaited = f.encode(f.Integer(4, -9))
    assert f.decode_integer_reply(awaited, 4) == -9
    client = _client()
    assert client.receive_integer(awaited, 4) == -9
    # anything else is left whole for receive_reply: another id, another frame, a piece, two frames
    error = f.encode(f.Error(4, f.ERROR_NOT_AN_INTEGER, b"not an integer"))
    for data in (f.encode(f.Integer(5, 1)), error, awaited[:20], awaited + awaited, f.encode(f.Value(4, b"x" * 8))):
        assert client.receive_integer(data, 4) is None
        assert not client.has_partial_data
    assert client.receive_reply(error, 4) == f.Error(4, f.ERROR_NOT_AN_INTEGER, b"not an integer")
    # with a piece of a frame buffered, the exact bytes are not the whole reply: no shortcut
    assert client.receive_reply(f.encode(f.Value(3, b"late"))[:6], 4) is None
    assert client.receive_integer(awaited, 4) is None


# -- fuzzing: whatever arrives, the parser yields events or raises ProtocolError, nothing else --------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

framed = st.builds(
    lambda opcode, request_id, payload: struct.pack("<QBI", 5 + len(payload), opcode, request_id) + payload,
    st.integers(0, 255),
    st.integers(0, 2**32 - 1),
    st.binary(max_size=40),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(framed | st.binary(max_size=30), max_size=6), st.integers(1, 7))
def test_server_parser_never_fails_otherwise(chunks, cut):
    server = _server(max_frame_size=1 << 16)
    stream = b"".join(chunks)
    try:
        for i in range(0, len(stream), cut):
            for event in server.receive_events(stream[i : i + cut]):
                assert isinstance(event, f.REQUESTS)
    except f.ProtocolError:
        pass


# -- authentication (opt-in): the handshake on bytes alone ------------------------------------------
#
# Fixed nonces and key make every message exact. The proofs are spelled out here from their
# definition (HMAC-SHA256 under the key, over a label, the authenticating hello's bytes and the
# server's nonce; the server's also over the address it reveals), not taken from the module.

import hashlib  # noqa: E402
import hmac  # noqa: E402

KEY = b"the job's key"
NC = bytes(range(32))  # the client's nonce
NS = bytes(range(100, 132))  # the server's nonce
AUTH_HELLO = b"DCKV\x02\x00\x01\x00" + NC  # flags bit 0: the client holds a key and demands proof
CHALLENGE = b"DCKV\x02\x00\x03\x00\x20\x00" + NS  # status 3, a 32-byte body: the server's nonce
CLIENT_PROOF = hmac.new(KEY, b"distcomm-store client\0" + AUTH_HELLO + NS, hashlib.sha256).digest()
SERVER_PROOF = hmac.new(KEY, b"distcomm-store server\0" + AUTH_HELLO + NS + b"\x04\x00\0abc", hashlib.sha256).digest()
ACCEPTED = b"DCKV\x02\x00\x04\x00\x24\x00" + SERVER_PROOF + b"\0abc"  # status 4: proof, then the address
AUTH_REQUIRED = b"DCKV\x02\x00\x02\x00\x00\x00"  # a key-holding server, a hello without one
AUTH_FAILED = b"DCKV\x02\x00\x05\x00\x00\x00"  # a wrong proof
AUTH_UNAVAILABLE = b"DCKV\x02\x00\x06\x00\x00\x00"  # an authenticating client, a server without a key


def _auth_server() -> c.ServerConnection:
    return c.ServerConnection(auth_key=KEY, server_nonce=NS)


def test_auth_message_bytes():
    auth = h.ClientAuth(KEY, nonce=NC)
    assert c.ClientConnection.send(auth.hello()) == AUTH_HELLO
    assert c.ServerConnection.send(h.AuthChallenge(2, NS)) == CHALLENGE
    assert c.ClientConnection.send(auth.proof(h.AuthChallenge(2, NS))) == CLIENT_PROOF  # 32 bytes, nothing else
    assert c.ServerConnection.send(h.AuthAccepted(2, SERVER_PROOF, b"\0abc")) == ACCEPTED
    assert c.ServerConnection.send(h.HelloReply(2, h.HELLO_STATUS_AUTH_REQUIRED)) == AUTH_REQUIRED
    assert c.ServerConnection.send(h.HelloReply(2, h.HELLO_STATUS_AUTH_FAILED)) == AUTH_FAILED
    assert c.ServerConnection.send(h.HelloReply(2, h.HELLO_STATUS_AUTH_UNAVAILABLE)) == AUTH_UNAVAILABLE
    assert h.client_proof(KEY, NC, NS) == CLIENT_PROOF
    assert h.server_proof(KEY, NC, NS, b"\0abc") == SERVER_PROOF
    assert len(AUTH_HELLO) == h.AUTH_HELLO_SIZE == 40 and len(CLIENT_PROOF) == h.PROOF_SIZE


def test_auth_handshake_from_hello_to_the_first_request():
    server, client, auth = _auth_server(), c.ClientConnection(), h.ClientAuth(KEY, nonce=NC)
    assert server.receive_events(AUTH_HELLO) == [h.Hello(2, NC)]
    assert server.send(server.reply_to_hello(h.Hello(2, NC))) == CHALLENGE
    assert client.receive_events(CHALLENGE) == [h.AuthChallenge(2, NS)]
    assert client.has_partial_data  # still in the handshake: another reply follows
    assert not server.authenticated and server.has_partial_data  # the handshake timeout still runs
    assert server.receive_events(CLIENT_PROOF) == [h.AuthProof(CLIENT_PROOF)]
    accepted = server.reply_to_proof(h.AuthProof(CLIENT_PROOF), b"\0abc")
    assert server.send(accepted) == ACCEPTED
    assert server.authenticated and not server.has_partial_data
    assert client.receive_events(ACCEPTED) == [h.AuthAccepted(2, SERVER_PROOF, b"\0abc")]
    assert auth.proof(h.AuthChallenge(2, NS)).proof == CLIENT_PROOF
    assert auth.server_proved(h.AuthAccepted(2, SERVER_PROOF, b"\0abc"))
    set_wire = REQUESTS[0][1]
    assert server.receive_events(set_wire) == [REQUESTS[0][0]]  # requests flow only now
    assert client.receive_events(RESPONSES[0][1]) == [RESPONSES[0][0]]


def test_auth_handshake_byte_by_byte():
    server = _auth_server()
    events = []
    for i in range(len(AUTH_HELLO)):
        events += server.receive_events(AUTH_HELLO[i : i + 1])
    assert events == [h.Hello(2, NC)]
    server.reply_to_hello(events[0])
    for i in range(len(CLIENT_PROOF)):
        events += server.receive_events(CLIENT_PROOF[i : i + 1])
    assert events[1:] == [h.AuthProof(CLIENT_PROOF)]
    client, replies = c.ClientConnection(), []
    for i, byte in enumerate(CHALLENGE + ACCEPTED):
        replies += client.receive_events(bytes([byte]))
    assert replies == [h.AuthChallenge(2, NS), h.AuthAccepted(2, SERVER_PROOF, b"\0abc")]


def test_the_server_proof_is_checked_and_binds_the_revealed_address():
    auth = h.ClientAuth(KEY, nonce=NC)
    assert not auth.server_proved(h.AuthAccepted(2, SERVER_PROOF, b"\0abc"))  # no challenge answered yet
    auth.proof(h.AuthChallenge(2, NS))
    assert auth.server_proved(h.AuthAccepted(2, SERVER_PROOF, b"\0abc"))
    assert not auth.server_proved(h.AuthAccepted(2, SERVER_PROOF, b"\0abd"))  # another address
    assert not auth.server_proved(h.AuthAccepted(2, bytes(32), b"\0abc"))
    other = h.ClientAuth(b"another key", nonce=NC)
    other.proof(h.AuthChallenge(2, NS))
    assert not other.server_proved(h.AuthAccepted(2, SERVER_PROOF, b"\0abc"))
    # the two directions differ: a server's proof cannot be reflected back as a client's
    assert h.server_proof(KEY, NC, NS, b"") != h.client_proof(KEY, NC, NS)


UNAUTHENTICATED_REQUESTS = b"".join(wire for _, wire in REQUESTS)


@pytest.mark.parametrize(
    "server_key, hello, reply",
    [
        (KEY, HELLO, AUTH_REQUIRED),  # a client without a key
        (None, AUTH_HELLO, AUTH_UNAVAILABLE),  # a client demanding proof from a server without a key
    ],
    ids=["no key on the client", "no key on the server"],
)
def test_a_refused_hello_is_answered_and_nothing_after_it_is_parsed(server_key, hello, reply):
    server = c.ServerConnection(auth_key=server_key, server_nonce=NS)
    events = server.receive_events(hello + UNAUTHENTICATED_REQUESTS)
    assert events == [h.Hello(2, hello[8:])]  # the requests were dropped unread
    assert server.send(server.reply_to_hello(events[0])) == reply
    assert server.receive_events(UNAUTHENTICATED_REQUESTS) == []
    assert not server.authenticated


def test_a_wrong_proof_is_refused_and_nothing_after_it_is_parsed():
    server = _auth_server()
    (hello,) = server.receive_events(AUTH_HELLO)
    server.reply_to_hello(hello)
    wrong = h.client_proof(b"another key", NC, NS)
    assert server.receive_events(wrong) == [h.AuthProof(wrong)]
    assert server.send(server.reply_to_proof(h.AuthProof(wrong), b"\0abc")) == AUTH_FAILED
    assert server.receive_events(UNAUTHENTICATED_REQUESTS) == [] and not server.authenticated


@pytest.mark.parametrize(
    "after_hello",
    [
        CLIENT_PROOF + REQUESTS[0][1],  # even a right proof: a client waits for the server's before requesting
        UNAUTHENTICATED_REQUESTS,  # requests instead of a proof
        bytes(33),
    ],
)
def test_bytes_beyond_the_fixed_size_handshake_are_a_protocol_error(after_hello):
    server = _auth_server()
    with pytest.raises(f.ProtocolError, match="authentication proof"):
        server.receive_events(AUTH_HELLO + after_hello)


def test_bytes_after_the_proof_before_its_answer_are_a_protocol_error():
    server = _auth_server()
    assert server.receive_events(AUTH_HELLO + CLIENT_PROOF) == [h.Hello(2, NC), h.AuthProof(CLIENT_PROOF)]
    with pytest.raises(f.ProtocolError, match="before the server answered"):
        server.receive_events(REQUESTS[0][1])


def test_a_plain_hello_to_a_keyless_server_is_unchanged_by_the_auth_support():
    server = c.ServerConnection(auth_key=None)
    assert server.receive_events(HELLO) == [h.Hello(2)]
    assert server.send(server.reply_to_hello(h.Hello(2))) == HELLO_OK
    assert server.authenticated


@pytest.mark.parametrize(
    "wire, message",
    [
        (b"DCKV\x02\x00\x03\x00\x1f\x00" + NS[:31], "31-byte nonce"),
        (b"DCKV\x02\x00\x04\x00\x1f\x00" + SERVER_PROOF[:31], "cannot hold the server's proof"),
    ],
)
def test_malformed_auth_replies_raise_protocol_error(wire, message):
    with pytest.raises(f.ProtocolError, match=message):
        c.ClientConnection().receive_events(wire)


@settings(max_examples=150, deadline=None)
@given(st.lists(framed | st.binary(max_size=40), max_size=6), st.integers(1, 7), st.booleans())
def test_a_key_holding_server_parses_no_request_before_a_right_proof(chunks, cut, with_nonce):
    server = _auth_server()
    stream = (AUTH_HELLO if with_nonce else HELLO) + b"".join(chunks)
    try:
        for i in range(0, len(stream), cut):
            for event in server.receive_events(stream[i : i + cut]):
                assert isinstance(event, (h.Hello, h.AuthProof))
                if isinstance(event, h.Hello):
                    server.reply_to_hello(event)
                else:
                    assert server.reply_to_proof(event).status == h.HELLO_STATUS_AUTH_FAILED
    except f.ProtocolError:
        pass
    assert not server.authenticated


# -- the server's fast lane: frames cut without events, the hottest requests' fields from bytes -------


def test_cut_frames_gives_the_frames_receive_events_parses_and_keeps_the_tail():
    stream = b"".join(wire for _, wire in REQUESTS)
    tail = REQUESTS[3][1]  # an Add, sent in two pieces
    server = _server()
    assert server.at_frame_boundary()
    cut = server.cut_frames(stream + tail[:10])
    assert [f.REQUEST_PARSERS[opcode](stream, start, end, rid) for opcode, rid, start, end in cut] == [
        event for event, _ in REQUESTS
    ]
    assert [opcode for opcode, *_ in cut] == [event.OPCODE for event, _ in REQUESTS]
    assert not server.at_frame_boundary() and server.buffered == 10  # the Add's first 10 bytes wait
    assert server.receive_events(tail[10:]) == [REQUESTS[3][0]]
    assert server.at_frame_boundary()


def test_cut_frames_refuses_what_receive_events_refuses():
    with pytest.raises(f.ProtocolError, match="unknown opcode 0x80"):
        _server().cut_frames(frame(5, "80", "01000000"))
    with pytest.raises(f.ProtocolError, match="exceeds"):
        _server(max_frame_size=1 << 20).cut_frames(f.encode(f.NumKeys(1)) + struct.pack("<Q", 2**40) + b"\x01")
    with pytest.raises(f.ProtocolError, match="shorter than a frame head"):
        _server().cut_frames(frame(4, "07", "01000000")[:12] + b"\0")


def test_a_connection_in_its_handshake_is_not_at_a_frame_boundary():
    assert not c.ServerConnection().at_frame_boundary()


@pytest.mark.parametrize(
    "event, fields",
    [
        (f.Set(1, b"k", b"v"), lambda e: (e.key, e.value)),
        (f.Set(1, b"", b""), lambda e: (e.key, e.value)),
        (f.Get(2, b"key", 1500), lambda e: (e.key, e.timeout_ms)),
        (f.Add(3, b"c", -(2**63)), lambda e: (e.key, e.amount)),
        (f.Add(3, b"", 2**63 - 1), lambda e: (e.key, e.amount)),
    ],
)
def test_field_decoders_match_the_events_parse(event, fields):
    wire = f.encode(event)
    decode = {f.Set: f.set_fields, f.Get: f.get_fields, f.Add: f.add_fields}[type(event)]
    assert decode(wire, f.FRAME_HEAD_SIZE, len(wire)) == fields(event)


@pytest.mark.parametrize(
    "decode, wire, message",
    [
        (f.set_fields, frame(13, "01", U32_1, "ff000000", "6b6b6b6b"), "needs 255 bytes"),
        (f.set_fields, frame(7, "01", U32_1, "0000"), "needs 4 bytes"),
        (f.get_fields, frame(9, "02", U32_1, "00000000"), "Get frame: 4 bytes cannot hold timeout_ms"),
        (f.add_fields, frame(12, "03", U32_1, "00000000000000"), "Add frame: 7 bytes cannot hold amount"),
    ],
)
def test_field_decoders_refuse_short_fields_like_the_parse(decode, wire, message):
    with pytest.raises(f.ProtocolError, match=message):
        decode(wire, f.FRAME_HEAD_SIZE, len(wire))
    with pytest.raises(f.ProtocolError, match=message):
        _server().receive_events(wire)
