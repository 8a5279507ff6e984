"""The TCPStore's frames: the exact bytes of every request and response, with no I/O.

Why a module of its own: the server and the client are the only two places that touch sockets, and
both are hard to test for "what exactly goes over the wire". Here every encoding is a pure function
and every decoding a pure parse of bytes, so the tests are tables of exact bytes (the h11 approach),
and the bad-input cases (a 2^40 length prefix, a field longer than its frame, an unknown opcode) are
decided here, once, on bytes alone. The hello and authentication that come before the first frame
are handshake.py; connection.py buffers a byte stream and cuts it into these frames.

Wire format (all integers little-endian)::

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

SET and QUEUE_PUSH have no response (as in torch's TCPStore): they cannot fail, and every later
request on the same connection is handled after it, so a client learns nothing from an
acknowledgement except the round trip it cost. A set() is therefore one send, and a set() followed
by a get() one round trip.

A frame's length is checked against the connection's maximum frame size (``check_frame_length``)
as soon as its eight bytes arrive, before anything is buffered for it; every field length and list
count is checked against the bytes left in its frame before it is read. Nothing is ever allocated
from an unchecked length.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Union

DEFAULT_MAX_FRAME_SIZE = 1 << 30  # 1 GiB: larger than any sane store value, far below 2^40

# Error codes carried by an Error response.
ERROR_NOT_AN_INTEGER = 1  # add() on a value that is not a decimal integer (torch raises ValueError)
ERROR_BAD_REQUEST = 2  # a well-formed frame asking for something invalid (e.g. mismatched multi_set)

_FRAME_HEAD = struct.Struct("<QBI")  # length, opcode, request_id
FRAME_HEAD_SIZE = _FRAME_HEAD.size
HEAD_AFTER_LENGTH = 5  # opcode + request_id: the least a frame's length can be
_U32 = struct.Struct("<I")
_I64 = struct.Struct("<q")
_U64 = struct.Struct("<Q")
_U8 = struct.Struct("<B")

# For connection.py, which cuts frames out of a stream: (data, offset) -> (length, opcode, request_id),
# and (data, offset) -> (length,) to check a length before the rest of its head is there.
unpack_head = _FRAME_HEAD.unpack_from
unpack_length = _U64.unpack_from


class ProtocolError(Exception):
    """The peer sent bytes that are not this protocol; the connection must be closed."""


def check_frame_length(length: int, max_frame_size: int) -> None:
    """ProtocolError unless ``length`` (a frame's u64 prefix) fits between a frame head and the maximum."""
    if length > max_frame_size:
        raise ProtocolError(f"frame length {length} exceeds the maximum frame size {max_frame_size}")
    if length < HEAD_AFTER_LENGTH:
        raise ProtocolError(f"frame length {length} is shorter than a frame head ({HEAD_AFTER_LENGTH} bytes)")


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
# Frames. Keys and values are bytes on the wire and in frames; the store layer encodes str.
# Each frame knows its OPCODE, its payload bytes, and how to parse its payload.
# ---------------------------------------------------------------------------------------------


class Frame:
    """A request or a response: ``request_id``, then fields that ``payload()`` encodes and ``parse`` decodes."""

    __slots__ = ()
    OPCODE = -1

    def payload(self) -> bytes:
        return b""

    @classmethod
    def parse(cls, data: bytes, start: int, end: int, request_id: int):
        _Fields(data, start, end, cls.__name__).done()
        return cls(request_id)


@dataclass(slots=True)
class Set(Frame):
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
class Get(Frame):
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
class Add(Frame):
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
class CompareSet(Frame):
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
class Wait(Frame):
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
class Check(Frame):
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
class NumKeys(Frame):
    request_id: int
    OPCODE = 0x07


@dataclass(slots=True)
class DeleteKey(Frame):
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
class MultiSet(Frame):
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
class ListKeys(Frame):
    request_id: int
    OPCODE = 0x0C


@dataclass(slots=True)
class Join(Frame):
    """A store counting itself towards the master's ``world_size`` (wait_for_workers)."""

    request_id: int
    OPCODE = 0x0D


@dataclass(slots=True)
class QueuePush(Set):
    """Append ``value`` to the queue ``key``; no response, like SET."""

    OPCODE = 0x0E


@dataclass(slots=True)
class QueuePop(Frame):
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
class Barrier(Frame):
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
class Ok(Frame):
    request_id: int
    OPCODE = 0x80


@dataclass(slots=True)
class Value(Frame):
    request_id: int
    value: bytes
    OPCODE = 0x81

    def payload(self) -> bytes:
        return self.value

    @staticmethod
    def parse(data, start, end, request_id):
        return Value(request_id, data[start:end])


@dataclass(slots=True)
class Integer(Frame):
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
class Bool(Frame):
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
class Values(Frame):
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
class TimedOut(Frame):
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
class Error(Frame):
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
REQUEST_PARSERS = {kind.OPCODE: kind.parse for kind in REQUESTS}
RESPONSE_PARSERS = {kind.OPCODE: kind.parse for kind in RESPONSES}


def encode(event: Frame) -> bytes:
    """The exact bytes of one frame (request or response)."""
    if not isinstance(event, Frame):
        raise TypeError(f"not a protocol frame event: {event!r}")
    payload = event.payload()
    return _FRAME_HEAD.pack(len(payload) + HEAD_AFTER_LENGTH, event.OPCODE, event.request_id) + payload


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


# ... the fields of the server's hottest requests, decoded without building an event (the server's
# fast lane, handlers.FAST_HANDLERS; same checks as the events' parse, tested against it)


def set_fields(data, start: int, end: int) -> tuple[bytes, bytes]:
    """(key, value) of a Set frame's fields ``data[start:end]``."""
    if end - start >= 4:
        key_end = start + 4 + _U32.unpack_from(data, start)[0]
        if key_end <= end:
            return data[start + 4 : key_end], data[key_end:end]
    Set.parse(data, start, end, 0)  # raises the precise ProtocolError
    raise AssertionError("unreachable")  # pragma: no cover


def get_fields(data, start: int, end: int) -> tuple[bytes, int]:
    """(key, timeout_ms) of a Get frame's fields."""
    if end - start < 8:
        raise ProtocolError(f"Get frame: {end - start} bytes cannot hold timeout_ms")
    return data[start + 8 : end], _U64.unpack_from(data, start)[0]


def add_fields(data, start: int, end: int) -> tuple[bytes, int]:
    """(key, amount) of an Add frame's fields."""
    if end - start < 8:
        raise ProtocolError(f"Add frame: {end - start} bytes cannot hold amount")
    return data[start + 8 : end], _I64.unpack_from(data, start)[0]


# ... and for the server's hottest responses.

_INTEGER_FRAME = struct.Struct("<QBIq")
_BOOL_FRAME = struct.Struct("<QBI?")


def encode_ok(request_id: int) -> bytes:
    return _FRAME_HEAD.pack(HEAD_AFTER_LENGTH, Ok.OPCODE, request_id)


def encode_value(request_id: int, value: bytes) -> bytes:
    return _FRAME_HEAD.pack(HEAD_AFTER_LENGTH + len(value), Value.OPCODE, request_id) + value


def encode_integer(request_id: int, value: int) -> bytes:
    return _INTEGER_FRAME.pack(HEAD_AFTER_LENGTH + 8, Integer.OPCODE, request_id, value)


# add()'s request and its Integer reply as a client builds and checks them inline (client.py's add:
# on the hottest round trip a function call costs more than the work). The same bytes as
# encode_add() and decode_integer_reply(), which tests hold them to:
#   request = ADD_HEAD.pack(ADD_LENGTH + len(key), Add.OPCODE, request_id, amount) + key
#   reply: len(data) == INTEGER_REPLY.size and INTEGER_REPLY.unpack(data) ==
#          (INTEGER_LENGTH, Integer.OPCODE, request_id, value)
ADD_HEAD = _ADD_HEAD
ADD_LENGTH = 13
INTEGER_REPLY = _INTEGER_FRAME
INTEGER_LENGTH = HEAD_AFTER_LENGTH + 8


def decode_integer_reply(data: bytes, request_id: int) -> int | None:
    """The value if ``data`` is exactly the Integer frame answering ``request_id``, else None (then
    parse it the general way: it may be an Error, a late answer, or not all here yet). add()'s
    reply, decoded without building an event: the client's hottest path."""
    if len(data) == _INTEGER_FRAME.size:
        length, opcode, got_id, value = _INTEGER_FRAME.unpack(data)
        if got_id == request_id and opcode == Integer.OPCODE and length == HEAD_AFTER_LENGTH + 8:
            return value
    return None


def encode_bool(request_id: int, value: bool) -> bytes:
    return _BOOL_FRAME.pack(HEAD_AFTER_LENGTH + 1, Bool.OPCODE, request_id, value)
