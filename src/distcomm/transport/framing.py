"""The TCP transport's wire format, with no I/O (bytes in, values out; values in, bytes out).

Why a module of its own: like h11, the protocol can then be tested on bytes alone (tables of exact
encodings, corrupt input), and the socket code in ``tcp.py`` only moves bytes and matches messages.

Two fixed-size records, both little-endian:

**Frame header** (32 bytes) before every message's payload::

    magic u16 | version u8 | kind u8 | group u32 | seq i64 | signature u32 | reserved u32 | nbytes u64

``(group, kind, seq)`` is the ``MessageKey`` (seq is a collective's sequence number or a p2p tag,
so signed 64-bit); ``signature`` is the sender's 32-bit summary of the collective; ``nbytes`` the
payload length that follows. ``kind == KIND_CONTROL`` is the transport's own, ``seq`` saying which:
GOODBYE ("I closed my transport on purpose", so the peer can tell an orderly exit from a crash;
group 0, no payload) and GAVE_UP ("a collective call of this group failed on my side: I will
complete none of its calls from this one on"; ``group`` is the group, the payload the call's
sequence number, i64). A bad magic or
version means the byte stream is out of step, which is never recoverable: the connection is dropped.

**Hello** (36 bytes), exchanged once per connection, each way::

    magic u16 | version u8 | reserved u8 | sender u32 | receiver u32 | world_size u32 | token 16s | reserved u32

The token is a random value of this job's store (one per transport), so a connection from another
job, an earlier incarnation on a reused port, or a port scanner is told apart and refused;
``receiver`` catches a connection that reached the wrong rank.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

from .base import MessageKey

VERSION = 1
FRAME_MAGIC = 0xD1C7
HELLO_MAGIC = 0xD1C8
KIND_CONTROL = 0xFF  # MessageKey.kind reserved for the transport's own frames
CONTROL_GOODBYE = 1  # seq of a KIND_CONTROL frame
CONTROL_GAVE_UP = 2  # seq of a KIND_CONTROL frame; payload: the failed call's sequence number

# A payload larger than this is a corrupt header, not a message: refusing it keeps a garbled stream
# from making the receiver allocate absurd amounts of memory for an "unexpected" message.
MAX_NBYTES = 1 << 40  # 1 TiB
TOKEN_BYTES = 16

_HEADER = struct.Struct("<HBBIqIIQ")
_HELLO = struct.Struct("<HBBIII16sI")
_GAVE_UP = struct.Struct("<q")
GAVE_UP_NBYTES = _GAVE_UP.size  # 8
HEADER_SIZE = _HEADER.size  # 32
HELLO_SIZE = _HELLO.size  # 36
_HEADER_PACK = _HEADER.pack
_HEADER_UNPACK = _HEADER.unpack_from
_new = tuple.__new__


class FramingError(ValueError):
    """Bytes that are not a valid frame header or hello, or values that do not fit the format."""


class FrameHeader(NamedTuple):
    key: MessageKey
    signature: int
    nbytes: int


class Hello(NamedTuple):
    sender: int
    receiver: int
    world_size: int
    token: bytes


def encode_header(key: MessageKey, signature: int, nbytes: int) -> bytes:
    """The 32-byte header announcing ``nbytes`` of payload with ``key`` and ``signature``."""
    group, kind, seq = key
    try:
        if nbytes > MAX_NBYTES:
            raise struct.error("nbytes too large")
        return _HEADER_PACK(FRAME_MAGIC, VERSION, kind, group, seq, signature, 0, nbytes)
    except struct.error:
        raise FramingError(
            f"cannot encode a frame header for key {tuple(key)!r}, signature {signature!r}, nbytes {nbytes!r}: "
            f"group is u32, kind u8, seq signed 64-bit, signature u32, nbytes at most {MAX_NBYTES}"
        ) from None


def decode_header(buf, offset: int = 0) -> FrameHeader:
    """Parse the header at ``buf[offset:offset + HEADER_SIZE]``; FramingError if it is not one."""
    try:
        magic, version, kind, group, seq, signature, reserved, nbytes = _HEADER_UNPACK(buf, offset)
    except struct.error:
        raise FramingError(f"frame header needs {HEADER_SIZE} bytes, got {max(0, len(buf) - offset)}") from None
    if magic != FRAME_MAGIC or version != VERSION or reserved or nbytes > MAX_NBYTES:
        _reject_header(magic, version, reserved, nbytes)
    # tuple.__new__ builds the NamedTuples without their Python-level __new__: this runs per message
    return _new(FrameHeader, (_new(MessageKey, (group, kind, seq)), signature, nbytes))


def _reject_header(magic: int, version: int, reserved: int, nbytes: int) -> None:
    if magic != FRAME_MAGIC:
        raise FramingError(f"bad frame magic {magic:#06x} (expected {FRAME_MAGIC:#06x}): the stream is corrupt")
    if version != VERSION:
        raise FramingError(f"frame version {version}, this side speaks {VERSION}: run one distcomm version on every rank")
    if reserved:
        raise FramingError(f"reserved header field is {reserved:#x}, expected 0: the stream is corrupt")
    raise FramingError(f"frame announces {nbytes} bytes, more than the limit {MAX_NBYTES}: the stream is corrupt")


def encode_goodbye() -> bytes:
    """The control frame a transport sends on close(): "no more frames, and this was on purpose"."""
    return encode_header(MessageKey(0, KIND_CONTROL, CONTROL_GOODBYE), 0, 0)


def is_goodbye(header: FrameHeader) -> bool:
    return header.key.kind == KIND_CONTROL and header.key.seq == CONTROL_GOODBYE


def encode_gave_up(group: int, seq: int) -> bytes:
    """The control frame (header and payload) saying that this rank's collective call ``seq`` of
    ``group`` failed: the peer receives none of the group's calls ``seq`` and later from it."""
    try:
        payload = _GAVE_UP.pack(seq)
    except struct.error:
        raise FramingError(f"cannot encode a gave-up notice for call {seq!r}: seq is signed 64-bit") from None
    return encode_header(MessageKey(group, KIND_CONTROL, CONTROL_GAVE_UP), 0, GAVE_UP_NBYTES) + payload


def is_gave_up(header: FrameHeader) -> bool:
    return header.key.kind == KIND_CONTROL and header.key.seq == CONTROL_GAVE_UP


def decode_gave_up(payload) -> int:
    """The sequence number in a gave-up notice's payload; FramingError if it is not one."""
    if len(payload) != GAVE_UP_NBYTES:
        raise FramingError(f"a gave-up notice carries {GAVE_UP_NBYTES} bytes, got {len(payload)}: the stream is corrupt")
    return _GAVE_UP.unpack(payload)[0]


def encode_hello(sender: int, receiver: int, world_size: int, token: bytes) -> bytes:
    if len(token) != TOKEN_BYTES:
        raise FramingError(f"hello token must be {TOKEN_BYTES} bytes, got {len(token)}")
    try:
        return _HELLO.pack(HELLO_MAGIC, VERSION, 0, sender, receiver, world_size, token, 0)
    except struct.error:
        raise FramingError(f"cannot encode hello {sender} -> {receiver} of {world_size}: ranks are u32") from None


def decode_hello(buf) -> Hello:
    """Parse a hello (exactly HELLO_SIZE bytes); FramingError if it is not one."""
    if len(buf) != HELLO_SIZE:
        raise FramingError(f"hello is {HELLO_SIZE} bytes, got {len(buf)}")
    magic, version, reserved8, sender, receiver, world_size, token, reserved = _HELLO.unpack(buf)
    if magic != HELLO_MAGIC:
        raise FramingError(f"bad hello magic {magic:#06x} (expected {HELLO_MAGIC:#06x}): not a distcomm peer")
    if version != VERSION:
        raise FramingError(f"peer speaks transport version {version}, this side {VERSION}: run one distcomm version everywhere")
    if reserved8 or reserved:
        raise FramingError("reserved hello fields are not zero: not a distcomm peer of this version")
    return Hello(sender, receiver, world_size, token)


def check_hello(hello: Hello, token: bytes, world_size: int, me: int) -> None:
    """Refuse a hello that belongs to another job, another world, or another rank."""
    if hello.token != token:
        raise FramingError(f"connection claiming to be rank {hello.sender} belongs to another job (session token differs)")
    if hello.world_size != world_size:
        raise FramingError(f"rank {hello.sender} thinks the world has {hello.world_size} ranks, this rank {world_size}")
    if hello.receiver != me:
        raise FramingError(f"rank {hello.sender} meant to reach rank {hello.receiver} but reached rank {me}")
    if not 0 <= hello.sender < world_size or hello.sender == me:
        raise FramingError(f"hello from invalid rank {hello.sender} in a world of {world_size}")
