"""The TCPStore wire protocol, with no I/O: bytes in, events out; ``send(event) -> bytes``.

Why a module of its own: the server and the client are the only two places that touch sockets, and
both are hard to test for "what exactly goes over the wire". Here every encoding is a pure function,
so the tests are tables of exact bytes (the h11 approach), and the bad-input cases (wrong magic,
wrong version, a 2^40 length prefix, garbage in a frame) are decided here, once, on bytes alone.

Wire format (all integers little-endian)::

    hello        client -> server   b"DCKV" | u16 version | u16 flags (0; bit 0: see Authentication)
    hello reply  server -> client   b"DCKV" | u16 version | u16 status (0 ok, 1 unsupported version)
                                    | u16 n | n bytes local_address (may be empty)
    frame        both ways          u64 length | u8 opcode | u32 request_id | fields   (length counts
                                    everything after itself, so it is >= 5)
    fields       bytes: u32 n | n bytes;  list: u32 count | count x bytes;  i64 / u64 as 8 bytes

Requests carry the ``request_id`` the client chose; the response echoes it. A client that gave up
on a blocking request (its own deadline passed) therefore recognises the late answer and drops it:
the stream can never be read out of step. Blocking requests (GET, WAIT, MULTI_GET, QUEUE_POP,
BARRIER) also carry the client's timeout, so the server answers TIMED_OUT itself instead of holding
the request forever. A QUEUE_POP with timeout 0 is the non-blocking pop: VALUE, or TIMED_OUT at
once when the queue is empty (the client turns that into QueueEmptyError). A BARRIER carries the
world size and is answered OK when that many arrivals have been counted at its key.

Version 2 added QUEUE_PUSH, QUEUE_POP, QUEUE_LEN and BARRIER; a version-1 peer would close the
connection on them as unknown opcodes, so the handshake refuses mixed versions instead.

``local_address`` in the hello reply names a Unix socket of the same server (Linux abstract
namespace, with a random part only this handshake reveals). A client on the same host that can
connect to it moves there and drops the TCP connection: same protocol, about a third less kernel
time per request than loopback TCP. A client elsewhere cannot reach it and stays on TCP.

SET and QUEUE_PUSH have no response (as in torch's TCPStore): they cannot fail, and every later request on the same
connection is handled after it, so a client learns nothing from an acknowledgement except the
round trip it cost. A set() is therefore one send, and a set() followed by a get() one round trip.

A frame's length is checked against ``max_frame_size`` as soon as its eight bytes arrive, before
anything is buffered for it; every field length and list count is checked against the bytes left
in its frame before it is read. Nothing is ever allocated from an unchecked length.

Authentication (opt-in: a process holding a key, see auth.py). Everything a job trusts is found
through its store — peers' addresses, the transport's session token — so whoever can talk to the
store can join the job. With a key, client and server each prove they hold it, and neither
ever sends it: HMAC-SHA256 under the key over the handshake transcript, which carries a fresh
random nonce from each side (a recorded proof is worth nothing on another connection) and a label
per direction (a server's proof cannot be reflected back as a client's)::

    auth hello      client -> server   b"DCKV" | u16 version | u16 flags (bit 0: AUTH) | 32 bytes Nc
    challenge       server -> client   b"DCKV" | u16 version | u16 status 3 | u16 32 | 32 bytes Ns
    client proof    client -> server   32 bytes HMAC(key, b"distcomm-store client\\0" | T)
    accepted        server -> client   b"DCKV" | u16 version | u16 status 4 | u16 32+n
                                       | 32 bytes HMAC(key, b"distcomm-store server\\0" | T | u16 n | address)
                                       | n bytes local_address
    T (transcript)  = the auth hello's 40 bytes | Ns

The client proves first, so a peer that merely reaches the port learns nothing computed from the
key (only Ns); the server's proof covers the local address it reveals. The client sends no request
before it has checked the server's proof: a process posing as the store gets nothing either.
Every other outcome is a hello reply with an empty body, after which the server closes:
status 2 (the server requires authentication, the hello offered none), 5 (the client's proof was
wrong), 6 (the client asked for authentication, the server has no key). Without a key on either
side the hello and its reply are byte for byte those above, so VERSION stays 2: a pre-auth server
ignores the flag and answers status 0, which an authenticating client refuses (it demanded proof),
and a pre-auth client gets status 2 and stops with a refusal.

Until a connection has authenticated, the server's protocol yields nothing but the hello and the
proof, both of fixed size: bytes beyond them are a protocol error (a client never sends a request
before the handshake ends), bytes after a refusal are discarded, and no frame is ever parsed.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from dataclasses import dataclass
from typing import Union

MAGIC = b"DCKV"
VERSION = 2
DEFAULT_MAX_FRAME_SIZE = 1 << 30  # 1 GiB: larger than any sane store value, far below 2^40

HELLO_STATUS_OK = 0
HELLO_STATUS_UNSUPPORTED_VERSION = 1
HELLO_STATUS_AUTH_REQUIRED = 2  # the server holds a key; the hello offered no authentication
HELLO_STATUS_AUTH_CHALLENGE = 3  # body: the server's nonce (an AuthChallenge event)
HELLO_STATUS_AUTH_ACCEPTED = 4  # body: the server's proof, then local_address (an AuthAccepted event)
HELLO_STATUS_AUTH_FAILED = 5  # the client's proof was wrong
HELLO_STATUS_AUTH_UNAVAILABLE = 6  # the client asked for authentication; the server holds no key

HELLO_FLAG_AUTH = 0x0001  # the hello carries a client nonce: the client holds a key and demands proof
NONCE_SIZE = 32
PROOF_SIZE = 32  # an HMAC-SHA256 digest

# Error codes carried by an Error response.
ERROR_NOT_AN_INTEGER = 1  # add() on a value that is not a decimal integer (torch raises ValueError)
ERROR_BAD_REQUEST = 2  # a well-formed frame asking for something invalid (e.g. mismatched multi_set)

_HELLO = struct.Struct("<4sHH")
_FRAME_HEAD = struct.Struct("<QBI")  # length, opcode, request_id
_FRAME_HEAD_SIZE = _FRAME_HEAD.size
_U32 = struct.Struct("<I")
_I64 = struct.Struct("<q")
_U64 = struct.Struct("<Q")
_U8 = struct.Struct("<B")
_U16 = struct.Struct("<H")
_HEAD_AFTER_LENGTH = 5  # opcode + request_id
HELLO_SIZE = _HELLO.size
AUTH_HELLO_SIZE = HELLO_SIZE + NONCE_SIZE  # the largest message a client sends before it is authenticated


class ProtocolError(Exception):
    """The peer sent bytes that are not this protocol; the connection must be closed."""


class NeedData:
    """Sentinel type: ``next_event`` needs more bytes before it can return an event."""

    def __repr__(self) -> str:
        return "NEED_DATA"


NEED_DATA = NeedData()


# ---------------------------------------------------------------------------------------------
# Field readers: every length is checked against the bytes left in the frame before it is used.
# The last field of a frame (key or value) takes the rest of the frame without a length prefix:
# one length fewer to write and check on the hot path (SET, GET, ADD, VALUE).
# ---------------------------------------------------------------------------------------------


class _Fields:
    __slots__ = ("data", "pos", "end", "what")

    def __init__(self, data: bytes, pos: int, end: int, what: str):
        self.data, self.pos, self.end, self.what = data, pos, end, what

    def _need(self, n: int, field: str) -> None:
        if n > self.end - self.pos:
            raise ProtocolError(
                f"{self.what} frame: field {field} needs {n} bytes but only {self.end - self.pos} remain in the frame"
            )

    def fixed(self, codec: struct.Struct, field: str) -> int:
        self._need(codec.size, field)
        (value,) = codec.unpack_from(self.data, self.pos)
        self.pos += codec.size
        return value

    def sized(self, field: str) -> bytes:
        n = self.fixed(_U32, field + " length")
        self._need(n, field)
        start = self.pos
        self.pos = start + n
        return self.data[start : self.pos]

    def items(self, field: str) -> list:
        count = self.fixed(_U32, field + " count")
        if count * 4 > self.end - self.pos:  # each item needs at least its 4-byte length
            raise ProtocolError(
                f"{self.what} frame: {field} count {count} cannot fit in the {self.end - self.pos} bytes left"
            )
        return [self.sized(field) for _ in range(count)]

    def rest(self) -> bytes:
        value = self.data[self.pos : self.end]
        self.pos = self.end
        return value

    def done(self) -> None:
        if self.pos != self.end:
            raise ProtocolError(f"{self.what} frame: {self.end - self.pos} unexpected bytes after the last field")


def _sized(data: bytes) -> bytes:
    return _U32.pack(len(data)) + data


def _items(items) -> bytes:
    return _U32.pack(len(items)) + b"".join([_U32.pack(len(item)) + item for item in items])


# ---------------------------------------------------------------------------------------------
# Events. Keys and values are bytes on the wire and in events; the store layer encodes str.
# Each frame event knows its OPCODE, its payload bytes, and how to parse its payload.
# ---------------------------------------------------------------------------------------------


@dataclass(slots=True)
class Hello:
    version: int = VERSION
    client_nonce: bytes = b""  # empty: no authentication offered; else NONCE_SIZE bytes (flag AUTH)


@dataclass(slots=True)
class HelloReply:
    """The hello's answer: OK (no authentication), or a refusal (any other status; the server closes)."""

    version: int = VERSION
    status: int = HELLO_STATUS_OK
    local_address: bytes = b""


@dataclass(slots=True)
class AuthChallenge:
    """The server's answer to an authenticating hello: its nonce; the client's proof comes next."""

    version: int
    server_nonce: bytes


@dataclass(slots=True)
class AuthProof:
    """The client's proof that it holds the key (PROOF_SIZE bytes, nothing else on the wire)."""

    proof: bytes


@dataclass(slots=True)
class AuthAccepted:
    """The client's proof was right: the server's own proof, and the local address (now revealed)."""

    version: int
    server_proof: bytes
    local_address: bytes = b""


# ---------------------------------------------------------------------------------------------
# Authentication: the proofs, pure functions of the key and the two nonces
# ---------------------------------------------------------------------------------------------

_CLIENT_PROOF_LABEL = b"distcomm-store client\0"
_SERVER_PROOF_LABEL = b"distcomm-store server\0"


def _transcript(client_nonce: bytes, server_nonce: bytes) -> bytes:
    """The authenticating hello's exact bytes, then the server's nonce."""
    return _HELLO.pack(MAGIC, VERSION, HELLO_FLAG_AUTH) + client_nonce + server_nonce


def client_proof(key: bytes, client_nonce: bytes, server_nonce: bytes) -> bytes:
    return hmac.new(key, _CLIENT_PROOF_LABEL + _transcript(client_nonce, server_nonce), hashlib.sha256).digest()


def server_proof(key: bytes, client_nonce: bytes, server_nonce: bytes, local_address: bytes) -> bytes:
    message = _SERVER_PROOF_LABEL + _transcript(client_nonce, server_nonce) + _U16.pack(len(local_address))
    return hmac.new(key, message + local_address, hashlib.sha256).digest()


class ClientAuth:
    """The client's half of the handshake: its nonce, its proof, the check of the server's proof.

    ``nonce`` is for tests (exact bytes); by default each handshake draws a fresh one.
    """

    def __init__(self, key: bytes, nonce: bytes | None = None):
        if not key:
            raise ValueError("an authentication key must not be empty")
        self._key = bytes(key)
        self.nonce = os.urandom(NONCE_SIZE) if nonce is None else nonce
        self._server_nonce: bytes | None = None

    def hello(self) -> Hello:
        return Hello(VERSION, self.nonce)

    def proof(self, challenge: AuthChallenge) -> AuthProof:
        self._server_nonce = challenge.server_nonce
        return AuthProof(client_proof(self._key, self.nonce, challenge.server_nonce))

    def server_proved(self, accepted: AuthAccepted) -> bool:
        """Whether the server's proof is right (constant-time); False before a challenge was answered."""
        if self._server_nonce is None:
            return False
        expected = server_proof(self._key, self.nonce, self._server_nonce, accepted.local_address)
        return hmac.compare_digest(accepted.server_proof, expected)


class _Frame:
    __slots__ = ()
    OPCODE = -1

    def payload(self) -> bytes:
        return b""

    @classmethod
    def parse(cls, data: bytes, start: int, end: int, request_id: int):
        _Fields(data, start, end, cls.__name__).done()
        return cls(request_id)


@dataclass(slots=True)
class Set(_Frame):
    request_id: int
    key: bytes
    value: bytes
    OPCODE = 0x01

    def payload(self) -> bytes:
        return _sized(self.key) + self.value

    @classmethod
    def parse(cls, data, start, end, request_id):
        if end - start >= 4:  # the hot path, checked inline: key length, key, value
            key_end = start + 4 + _U32.unpack_from(data, start)[0]
            if key_end <= end:
                return cls(request_id, data[start + 4 : key_end], data[key_end:end])
        f = _Fields(data, start, end, cls.__name__)
        key = f.sized("key")  # raises the precise error
        return cls(request_id, key, f.rest())


@dataclass(slots=True)
class Get(_Frame):
    request_id: int
    key: bytes
    timeout_ms: int
    OPCODE = 0x02

    def payload(self) -> bytes:
        return _U64.pack(self.timeout_ms) + self.key

    @staticmethod
    def parse(data, start, end, request_id):
        if end - start < 8:
            raise ProtocolError(f"Get frame: {end - start} bytes cannot hold timeout_ms")
        return Get(request_id, data[start + 8 : end], _U64.unpack_from(data, start)[0])


@dataclass(slots=True)
class Add(_Frame):
    request_id: int
    key: bytes
    amount: int
    OPCODE = 0x03

    def payload(self) -> bytes:
        return _I64.pack(self.amount) + self.key

    @staticmethod
    def parse(data, start, end, request_id):
        if end - start < 8:
            raise ProtocolError(f"Add frame: {end - start} bytes cannot hold amount")
        return Add(request_id, data[start + 8 : end], _I64.unpack_from(data, start)[0])


@dataclass(slots=True)
class CompareSet(_Frame):
    request_id: int
    key: bytes
    expected: bytes
    desired: bytes
    OPCODE = 0x04

    def payload(self) -> bytes:
        return _sized(self.key) + _sized(self.expected) + self.desired

    @staticmethod
    def parse(data, start, end, request_id):
        f = _Fields(data, start, end, "CompareSet")
        key = f.sized("key")
        expected = f.sized("expected")
        return CompareSet(request_id, key, expected, f.rest())


@dataclass(slots=True)
class Wait(_Frame):
    request_id: int
    keys: list
    timeout_ms: int
    OPCODE = 0x05

    def payload(self) -> bytes:
        return _U64.pack(self.timeout_ms) + _items(self.keys)

    @classmethod
    def parse(cls, data, start, end, request_id):
        f = _Fields(data, start, end, cls.__name__)
        timeout_ms = f.fixed(_U64, "timeout_ms")
        keys = f.items("keys")
        f.done()
        return cls(request_id, keys, timeout_ms)


@dataclass(slots=True)
class Check(_Frame):
    request_id: int
    keys: list
    OPCODE = 0x06

    def payload(self) -> bytes:
        return _items(self.keys)

    @staticmethod
    def parse(data, start, end, request_id):
        f = _Fields(data, start, end, "Check")
        keys = f.items("keys")
        f.done()
        return Check(request_id, keys)


@dataclass(slots=True)
class NumKeys(_Frame):
    request_id: int
    OPCODE = 0x07


@dataclass(slots=True)
class DeleteKey(_Frame):
    request_id: int
    key: bytes
    OPCODE = 0x08

    def payload(self) -> bytes:
        return self.key

    @staticmethod
    def parse(data, start, end, request_id):
        return DeleteKey(request_id, data[start:end])


@dataclass(slots=True)
class Append(Set):
    OPCODE = 0x09


@dataclass(slots=True)
class MultiGet(Wait):
    OPCODE = 0x0A


@dataclass(slots=True)
class MultiSet(_Frame):
    request_id: int
    keys: list
    values: list
    OPCODE = 0x0B

    def payload(self) -> bytes:
        if len(self.keys) != len(self.values):
            raise ValueError(f"MultiSet has {len(self.keys)} keys but {len(self.values)} values")
        return _items(self.keys) + _items(self.values)

    @staticmethod
    def parse(data, start, end, request_id):
        f = _Fields(data, start, end, "MultiSet")
        keys = f.items("keys")
        values = f.items("values")
        f.done()
        return MultiSet(request_id, keys, values)


@dataclass(slots=True)
class ListKeys(_Frame):
    request_id: int
    OPCODE = 0x0C


@dataclass(slots=True)
class Join(_Frame):
    """A store counting itself towards the master's ``world_size`` (wait_for_workers)."""

    request_id: int
    OPCODE = 0x0D


@dataclass(slots=True)
class QueuePush(Set):
    """Append ``value`` to the queue ``key``; no response, like SET."""

    OPCODE = 0x0E


@dataclass(slots=True)
class QueuePop(_Frame):
    """Take the oldest item of queue ``key``, waiting up to ``timeout_ms`` (0: do not wait)."""

    request_id: int
    key: bytes
    timeout_ms: int
    OPCODE = 0x0F

    def payload(self) -> bytes:
        return _U64.pack(self.timeout_ms) + self.key

    @classmethod
    def parse(cls, data, start, end, request_id):
        if end - start < 8:
            raise ProtocolError(f"{cls.__name__} frame: {end - start} bytes cannot hold timeout_ms")
        return cls(request_id, data[start + 8 : end], _U64.unpack_from(data, start)[0])


@dataclass(slots=True)
class QueueLen(DeleteKey):
    OPCODE = 0x10

    @staticmethod
    def parse(data, start, end, request_id):
        return QueueLen(request_id, data[start:end])


@dataclass(slots=True)
class Barrier(_Frame):
    """Count one arrival at ``key``; answered once ``world_size`` have arrived, or at ``timeout_ms``."""

    request_id: int
    key: bytes
    world_size: int
    timeout_ms: int
    OPCODE = 0x11

    def payload(self) -> bytes:
        return _I64.pack(self.world_size) + _U64.pack(self.timeout_ms) + self.key

    @staticmethod
    def parse(data, start, end, request_id):
        if end - start < 16:
            raise ProtocolError(f"Barrier frame: {end - start} bytes cannot hold world_size and timeout_ms")
        world_size = _I64.unpack_from(data, start)[0]
        timeout_ms = _U64.unpack_from(data, start + 8)[0]
        return Barrier(request_id, data[start + 16 : end], world_size, timeout_ms)


@dataclass(slots=True)
class Ok(_Frame):
    request_id: int
    OPCODE = 0x80


@dataclass(slots=True)
class Value(_Frame):
    request_id: int
    value: bytes
    OPCODE = 0x81

    def payload(self) -> bytes:
        return self.value

    @staticmethod
    def parse(data, start, end, request_id):
        return Value(request_id, data[start:end])


@dataclass(slots=True)
class Integer(_Frame):
    request_id: int
    value: int
    OPCODE = 0x82

    def payload(self) -> bytes:
        return _I64.pack(self.value)

    @staticmethod
    def parse(data, start, end, request_id):
        if end - start != 8:
            raise ProtocolError(f"Integer frame: payload is {end - start} bytes, not 8")
        return Integer(request_id, _I64.unpack_from(data, start)[0])


@dataclass(slots=True)
class Bool(_Frame):
    request_id: int
    value: bool
    OPCODE = 0x83

    def payload(self) -> bytes:
        return b"\x01" if self.value else b"\x00"

    @staticmethod
    def parse(data, start, end, request_id):
        if end - start != 1 or data[start] > 1:
            raise ProtocolError(f"Bool frame: payload {data[start:end]!r} is not one byte 0 or 1")
        return Bool(request_id, data[start] == 1)


@dataclass(slots=True)
class Values(_Frame):
    request_id: int
    values: list
    OPCODE = 0x84

    def payload(self) -> bytes:
        return _items(self.values)

    @classmethod
    def parse(cls, data, start, end, request_id):
        f = _Fields(data, start, end, cls.__name__)
        values = f.items("values")
        f.done()
        return cls(request_id, values)


@dataclass(slots=True)
class TimedOut(_Frame):
    """A blocking request's timeout passed on the server; ``missing_keys`` were still absent."""

    request_id: int
    missing_keys: list
    OPCODE = 0x85

    def payload(self) -> bytes:
        return _items(self.missing_keys)

    @staticmethod
    def parse(data, start, end, request_id):
        f = _Fields(data, start, end, "TimedOut")
        missing = f.items("missing_keys")
        f.done()
        return TimedOut(request_id, missing)


@dataclass(slots=True)
class Error(_Frame):
    request_id: int
    code: int
    message: bytes
    OPCODE = 0x86

    def payload(self) -> bytes:
        return _U8.pack(self.code) + self.message

    @staticmethod
    def parse(data, start, end, request_id):
        if end - start < 1:
            raise ProtocolError("Error frame: no error code")
        return Error(request_id, data[start], data[start + 1 : end])


REQUESTS = (
    Set, Get, Add, CompareSet, Wait, Check, NumKeys, DeleteKey, Append, MultiGet, MultiSet, ListKeys, Join,
    QueuePush, QueuePop, QueueLen, Barrier,
)
RESPONSES = (Ok, Value, Integer, Bool, Values, TimedOut, Error)
Request = Union[REQUESTS]
Response = Union[RESPONSES]
_REQUEST_PARSERS = {kind.OPCODE: kind.parse for kind in REQUESTS}
_RESPONSE_PARSERS = {kind.OPCODE: kind.parse for kind in RESPONSES}


def encode(event: _Frame) -> bytes:
    """The exact bytes of one frame (request or response)."""
    if not isinstance(event, _Frame):
        raise TypeError(f"not a protocol frame event: {event!r}")
    payload = event.payload()
    return _FRAME_HEAD.pack(len(payload) + _HEAD_AFTER_LENGTH, event.OPCODE, event.request_id) + payload


# ---------------------------------------------------------------------------------------------
# Connection state machines
# ---------------------------------------------------------------------------------------------


class _Connection:
    """Shared receive side: a hello first, then length-prefixed frames.

    Received chunks are kept as they came and joined only once a whole frame (whose length passed
    the size check) is present, so a large frame arriving in many pieces is copied once, and a peer
    can make the buffer grow only by actually sending bytes.
    """

    _parsers: dict = {}

    def __init__(self, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE):
        self.max_frame_size = max_frame_size
        self._buffer = b""
        self._pos = 0
        self._chunks: list[bytes] = []
        self._pending = 0  # bytes in _chunks
        self._hello_done = False
        self.closed = False

    def receive_data(self, data: bytes) -> None:
        """Feed bytes read from the socket (b"" means the peer closed)."""
        if not data:
            self.closed = True
        elif self._pos >= len(self._buffer) and not self._pending:
            self._buffer = bytes(data)
            self._pos = 0
        else:
            self._chunks.append(bytes(data))
            self._pending += len(data)

    @property
    def has_partial_data(self) -> bool:
        """True while bytes are buffered that do not yet form a complete hello or frame, or while the
        handshake (hello, and authentication if any) is unfinished: the server's idle timer runs."""
        return self._pos < len(self._buffer) or self._pending > 0 or not self._hello_done

    def _gather(self, needed: int) -> bool:
        """Make ``needed`` bytes contiguous at ``_pos`` if that many were received."""
        if len(self._buffer) - self._pos + self._pending < needed:
            return False
        self._buffer = self._buffer[self._pos :] + b"".join(self._chunks)
        self._pos = 0
        self._chunks.clear()
        self._pending = 0
        return True

    def next_event(self):
        """The next complete event, NEED_DATA, or ProtocolError for bytes that are not this protocol."""
        if not self._hello_done:
            return self._next_hello()
        buffer, pos = self._buffer, self._pos
        if len(buffer) - pos < _FRAME_HEAD_SIZE:
            if len(buffer) - pos >= 8 or self._gather(8):  # the length alone: check it before waiting for more
                self._check_length(_U64.unpack_from(self._buffer, self._pos)[0])
            if not self._gather(_FRAME_HEAD_SIZE):
                return NEED_DATA
            buffer, pos = self._buffer, 0
        length, opcode, request_id = _FRAME_HEAD.unpack_from(buffer, pos)
        if length > self.max_frame_size or length < _HEAD_AFTER_LENGTH:
            self._check_length(length)
        end = pos + 8 + length
        if end > len(buffer):
            if not self._gather(8 + length):
                return NEED_DATA
            buffer, pos, end = self._buffer, 0, 8 + length
        parse = self._parsers.get(opcode)
        if parse is None:
            raise ProtocolError(f"unknown opcode 0x{opcode:02x}")
        self._pos = end
        return parse(buffer, pos + _FRAME_HEAD_SIZE, end, request_id)

    def receive_events(self, data: bytes) -> list:
        """``receive_data(data)`` then every complete event, as a list (the loop's one call per read).

        Same result as calling ``next_event`` until NEED_DATA; the common case — nothing buffered,
        ``data`` holding whole frames — is parsed straight out of ``data`` without a copy.
        """
        if not data or not self._hello_done or self._pos < len(self._buffer) or self._pending:
            self.receive_data(data)
            events = []
            while (event := self.next_event()) is not NEED_DATA:
                events.append(event)
            return events
        events = []
        parsers, max_frame_size = self._parsers, self.max_frame_size
        pos, size = 0, len(data)
        while size - pos >= _FRAME_HEAD_SIZE:
            length, opcode, request_id = _FRAME_HEAD.unpack_from(data, pos)
            if length > max_frame_size or length < _HEAD_AFTER_LENGTH:
                self._check_length(length)
            end = pos + 8 + length
            if end > size:
                break
            parse = parsers.get(opcode)
            if parse is None:
                raise ProtocolError(f"unknown opcode 0x{opcode:02x}")
            events.append(parse(data, pos + _FRAME_HEAD_SIZE, end, request_id))
            pos = end
        if pos < size:  # the start of a frame: keep it (and check its length if it is here already)
            self._buffer, self._pos = bytes(data), pos
            if size - pos >= 8:
                self._check_length(_U64.unpack_from(data, pos)[0])
        return events

    def receive_reply(self, data: bytes, request_id: int):
        """``receive_data(data)``; the event answering ``request_id`` if it is complete, else None.

        Other complete events are dropped: for a client with one request in flight they can only be
        late answers to requests it gave up on. The common case — nothing buffered, ``data`` exactly
        the one frame awaited — is decoded without building a list.
        """
        if self._hello_done and self._pos >= len(self._buffer) and not self._pending and len(data) >= _FRAME_HEAD_SIZE:
            length, opcode, got_id = _FRAME_HEAD.unpack_from(data, 0)
            if got_id == request_id and len(data) == 8 + length and length <= self.max_frame_size:
                parse = self._parsers.get(opcode)
                if parse is not None:
                    return parse(data, _FRAME_HEAD_SIZE, len(data), got_id)
        for event in self.receive_events(data):
            if event.request_id == request_id:
                return event
        return None

    def _check_length(self, length: int) -> None:
        if length > self.max_frame_size:
            raise ProtocolError(f"frame length {length} exceeds the maximum frame size {self.max_frame_size}")
        if length < _HEAD_AFTER_LENGTH:
            raise ProtocolError(f"frame length {length} is shorter than a frame head ({_HEAD_AFTER_LENGTH} bytes)")

    def _check_magic(self) -> None:
        # A wrong magic is reported as soon as the bytes received so far differ from it.
        prefix = self._buffer[self._pos : self._pos + len(MAGIC)]
        if prefix != MAGIC[: len(prefix)]:
            raise ProtocolError(f"bad magic {prefix!r}: expected {MAGIC!r} (is this a distcomm TCPStore peer?)")


# The server's handshake phases (frames follow once _hello_done is set).
_HELLO_PHASE = "hello"
_AWAIT_PROOF = "await proof"  # challenge due or sent: exactly PROOF_SIZE bytes may come next
_PROOF_RECEIVED = "proof received"  # the proof is being judged (reply_to_proof): nothing may come
_REFUSED = "refused"  # the reply refuses the client; whatever else it sends is dropped unread
_AUTHENTICATED = "authenticated"  # frames (as after a plain hello to a server without a key)


class ServerProtocol(_Connection):
    """The server's side of one connection: Hello (and AuthProof) and requests in; HelloReply
    (AuthChallenge, AuthAccepted) and responses out.

    With ``auth_key`` the connection yields no request until the client has proven it holds the
    key; ``server_nonce`` is for tests (exact bytes), by default each connection draws its own.
    """

    _parsers = _REQUEST_PARSERS

    def __init__(self, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE, auth_key: bytes | None = None,
                 server_nonce: bytes | None = None):
        super().__init__(max_frame_size)
        self._auth_key = auth_key or None
        self._server_nonce = server_nonce
        self._client_nonce = b""
        self._phase = _HELLO_PHASE

    @property
    def authenticated(self) -> bool:
        """True once requests may flow: after an accepted proof, or after a plain hello to a keyless server."""
        return self._hello_done

    def _next_hello(self):
        phase = self._phase
        if phase is _HELLO_PHASE:
            self._gather(0)
            self._check_magic()
            buffer = self._buffer
            if len(buffer) < HELLO_SIZE:
                return NEED_DATA
            _, version, flags = _HELLO.unpack_from(buffer, 0)
            end, nonce = HELLO_SIZE, b""
            if flags & HELLO_FLAG_AUTH:
                end = AUTH_HELLO_SIZE
                if len(buffer) < end:
                    return NEED_DATA
                nonce = buffer[HELLO_SIZE:end]
            self._pos = end
            hello = Hello(version, nonce)
            # decided here, not when the reply is built: the bytes after the hello in this very
            # batch must already be treated as what they are (frames, a proof, or to be dropped)
            status = self._hello_status(hello)
            if status == HELLO_STATUS_OK:
                self._hello_done = True
            elif status == HELLO_STATUS_AUTH_CHALLENGE:
                self._client_nonce = nonce
                if self._server_nonce is None:
                    self._server_nonce = os.urandom(NONCE_SIZE)
                self._phase = _AWAIT_PROOF
            else:
                self._phase = _REFUSED
            return hello
        self._gather(0)
        buffered = len(self._buffer) - self._pos
        if phase is _AWAIT_PROOF:
            if buffered > PROOF_SIZE:
                raise ProtocolError(
                    f"{buffered} bytes where the {PROOF_SIZE}-byte authentication proof was due: a client sends "
                    f"nothing else before the server has answered its proof"
                )
            if buffered < PROOF_SIZE:
                return NEED_DATA
            self._pos = len(self._buffer)
            self._phase = _PROOF_RECEIVED
            return AuthProof(self._buffer[-PROOF_SIZE:])
        if phase is _PROOF_RECEIVED and buffered:
            raise ProtocolError("bytes after the authentication proof, before the server answered it")
        self._buffer, self._pos = b"", 0  # _REFUSED: dropped unread
        return NEED_DATA

    def _hello_status(self, hello: Hello) -> int:
        """OK (requests may follow), AUTH_CHALLENGE, or the status of a refusal."""
        if hello.version != VERSION:
            return HELLO_STATUS_UNSUPPORTED_VERSION
        if self._auth_key is None:
            return HELLO_STATUS_AUTH_UNAVAILABLE if hello.client_nonce else HELLO_STATUS_OK
        return HELLO_STATUS_AUTH_CHALLENGE if hello.client_nonce else HELLO_STATUS_AUTH_REQUIRED

    @staticmethod
    def reply_to(hello: Hello) -> HelloReply:
        """The version policy alone (see reply_to_hello for the whole answer)."""
        status = HELLO_STATUS_OK if hello.version == VERSION else HELLO_STATUS_UNSUPPORTED_VERSION
        return HelloReply(VERSION, status)

    def reply_to_hello(self, hello: Hello):
        """The answer to ``hello``: HelloReply OK (the caller may add its local address), an
        AuthChallenge, or a refusal (HelloReply with another status: close after sending it)."""
        reply = self.reply_to(hello)
        if reply.status != HELLO_STATUS_OK:
            self._refuse()
            return reply
        status = self._hello_status(hello)
        if status == HELLO_STATUS_OK:
            return reply
        if status == HELLO_STATUS_AUTH_CHALLENGE:
            return AuthChallenge(VERSION, self._server_nonce)
        self._refuse()
        return HelloReply(VERSION, status)

    def reply_to_proof(self, proof: AuthProof, local_address: bytes = b""):
        """AuthAccepted (requests may follow; ``local_address`` is revealed, under the server's proof)
        or HelloReply AUTH_FAILED (close after sending it). Compared in constant time."""
        if self._phase is not _PROOF_RECEIVED:
            raise ProtocolError(f"an authentication proof in phase {self._phase!r}")
        key = self._auth_key
        expected = client_proof(key, self._client_nonce, self._server_nonce)
        if not hmac.compare_digest(proof.proof, expected):
            self._refuse()
            return HelloReply(VERSION, HELLO_STATUS_AUTH_FAILED)
        self._phase = _AUTHENTICATED
        self._hello_done = True
        return AuthAccepted(VERSION, server_proof(key, self._client_nonce, self._server_nonce, local_address),
                            local_address)

    def _refuse(self) -> None:
        self._phase = _REFUSED
        self._hello_done = False
        self._buffer, self._pos = b"", 0
        self._chunks.clear()
        self._pending = 0

    @staticmethod
    def send(event) -> bytes:
        kind = type(event)
        if kind is HelloReply:
            address = event.local_address
            return _HELLO.pack(MAGIC, event.version, event.status) + _U16.pack(len(address)) + address
        if kind is AuthChallenge:
            if len(event.server_nonce) != NONCE_SIZE:
                raise ValueError(f"a server nonce is {NONCE_SIZE} bytes, not {len(event.server_nonce)}")
            return _HELLO.pack(MAGIC, event.version, HELLO_STATUS_AUTH_CHALLENGE) + _U16.pack(NONCE_SIZE) + \
                event.server_nonce
        if kind is AuthAccepted:
            body = event.server_proof + event.local_address
            if len(event.server_proof) != PROOF_SIZE:
                raise ValueError(f"a server proof is {PROOF_SIZE} bytes, not {len(event.server_proof)}")
            return _HELLO.pack(MAGIC, event.version, HELLO_STATUS_AUTH_ACCEPTED) + _U16.pack(len(body)) + body
        if not isinstance(event, RESPONSES):
            raise TypeError(f"a server sends HelloReply, AuthChallenge, AuthAccepted or responses, not {kind.__name__}")
        return encode(event)


class ClientProtocol(_Connection):
    """The client's side: Hello (and AuthProof) and requests out; HelloReply (AuthChallenge,
    AuthAccepted) and responses in. An AuthChallenge keeps it in the handshake: another reply follows."""

    _parsers = _RESPONSE_PARSERS

    def _next_hello(self):
        self._gather(0)
        self._check_magic()
        buffer = self._buffer
        if len(buffer) < HELLO_SIZE + 2:
            return NEED_DATA
        _, version, status = _HELLO.unpack_from(buffer, 0)
        end = HELLO_SIZE + 2 + _U16.unpack_from(buffer, HELLO_SIZE)[0]
        if len(buffer) < end:
            return NEED_DATA
        body = buffer[HELLO_SIZE + 2 : end]
        self._pos = end
        if status == HELLO_STATUS_AUTH_CHALLENGE:
            if len(body) != NONCE_SIZE:
                raise ProtocolError(f"authentication challenge: a {len(body)}-byte nonce, not {NONCE_SIZE}")
            return AuthChallenge(version, body)  # the handshake goes on: _hello_done stays False
        self._hello_done = True
        if status == HELLO_STATUS_AUTH_ACCEPTED:
            if len(body) < PROOF_SIZE:
                raise ProtocolError(f"authentication accepted: a {len(body)}-byte body cannot hold the server's proof")
            return AuthAccepted(version, body[:PROOF_SIZE], body[PROOF_SIZE:])
        return HelloReply(version, status, body)

    @staticmethod
    def send(event) -> bytes:
        kind = type(event)
        if kind is Hello:
            nonce = event.client_nonce
            if nonce and len(nonce) != NONCE_SIZE:
                raise ValueError(f"a client nonce is {NONCE_SIZE} bytes, not {len(nonce)}")
            return _HELLO.pack(MAGIC, event.version, HELLO_FLAG_AUTH if nonce else 0) + nonce
        if kind is AuthProof:
            if len(event.proof) != PROOF_SIZE:
                raise ValueError(f"a proof is {PROOF_SIZE} bytes, not {len(event.proof)}")
            return event.proof
        if not isinstance(event, REQUESTS):
            raise TypeError(f"a client sends Hello, AuthProof or requests, not {kind.__name__}")
        return encode(event)


# ---------------------------------------------------------------------------------------------
# Fast paths for the client's hottest requests (same bytes as encode(); tested against it)
# ---------------------------------------------------------------------------------------------

_SET_HEAD = struct.Struct("<QBII")  # length, opcode, request_id, key length
_GET_HEAD = struct.Struct("<QBIQ")  # length, opcode, request_id, timeout_ms
_ADD_HEAD = struct.Struct("<QBIq")  # length, opcode, request_id, amount


def encode_set(request_id: int, key: bytes, value: bytes) -> bytes:
    return _SET_HEAD.pack(9 + len(key) + len(value), Set.OPCODE, request_id, len(key)) + key + value


def encode_get(request_id: int, key: bytes, timeout_ms: int) -> bytes:
    return _GET_HEAD.pack(13 + len(key), Get.OPCODE, request_id, timeout_ms) + key


def encode_add(request_id: int, key: bytes, amount: int) -> bytes:
    return _ADD_HEAD.pack(13 + len(key), Add.OPCODE, request_id, amount) + key


# ... and for the server's hottest responses.

_INTEGER_FRAME = struct.Struct("<QBIq")
_BOOL_FRAME = struct.Struct("<QBI?")


def encode_ok(request_id: int) -> bytes:
    return _FRAME_HEAD.pack(_HEAD_AFTER_LENGTH, Ok.OPCODE, request_id)


def encode_value(request_id: int, value: bytes) -> bytes:
    return _FRAME_HEAD.pack(_HEAD_AFTER_LENGTH + len(value), Value.OPCODE, request_id) + value


def encode_integer(request_id: int, value: int) -> bytes:
    return _INTEGER_FRAME.pack(_HEAD_AFTER_LENGTH + 8, Integer.OPCODE, request_id, value)


def encode_bool(request_id: int, value: bool) -> bytes:
    return _BOOL_FRAME.pack(_HEAD_AFTER_LENGTH + 1, Bool.OPCODE, request_id, value)
