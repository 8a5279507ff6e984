"""torch's TCPStore wire protocol (torch 2.13, both its libuv and its classic server), with no I/O.

Why: a distcomm program started by torchrun must talk to torchrun's agent store (torch's TCPStore
server), and a torch program started by distcomm-run must talk to distcomm's server. Both sides of
torch's protocol are here as pure functions on bytes (the h11 approach, like frames.py and
handshake.py); client.py and server.py do the I/O. Learned from torch's TCPStore.cpp,
TCPStoreBackend.cpp and TCPStoreLibUvBackend.cpp, and checked byte for byte against torch 2.13's
own client and servers (tests/test_store_torch_wire.py, tests/test_store_torch_interop.py).

Wire format (integers are the host's, i.e. little-endian on every platform torch ships for)::

    request   u8 query | fields        (no length prefix, no request id: one request in flight)
    string    u64 n | n bytes          (keys and values alike)
    list      u64 count | count x string

    VALIDATE     u32 0x3C85F7CE              -> nothing      (must be a connection's first query)
    PING         u32 nonce                   -> u32 nonce    (torch's client sends it right after VALIDATE)
    SET          key, value                  -> nothing
    COMPARE_SET  key, expected, desired      -> string (the value now)
    GET          key                         -> string       (libuv: empty if missing; classic: closes)
    ADD          key, i64                    -> i64 (the new value)
    CHECK        list of keys                -> u8 0 READY / 1 NOT_READY
    WAIT         list of keys                -> u8 0 STOP_WAITING, when all exist (no timeout on the wire)
    CANCEL_WAIT                              -> u8 1 WAIT_CANCELED (after a STOP_WAITING sent meanwhile, if any)
    GETNUMKEYS                               -> i64
    DELETE_KEY   key                         -> i64 (how many were deleted: 0 or 1)
    APPEND       key, value                  -> nothing
    MULTI_GET    list of keys                -> count x string
    MULTI_SET    u64 count, count x (key, value) -> nothing
    QUEUE_PUSH   key, value                  -> nothing
    QUEUE_POP    key                         -> i64 length before the pop, then the string if it was > 0
    QUEUE_LEN    key                         -> i64

torch's client does the waiting itself: get() and multi_get() send WAIT first and GET only once it
is answered; on its timeout it sends CANCEL_WAIT and raises "wait timeout after N ms, keys: ...".
A blocking queue_pop() is WAIT then QUEUE_POP. Its keys carry a "/" of its own in front (its key
prefix), except the "init/" counter its constructor adds to when ``wait_for_workers`` is on.
The classic server has no queues (it closes the connection on them).

Telling the protocols apart. A torch client's first byte is VALIDATE (0x00), distcomm's hello's is
"D": the server decides on the first byte (``classify``). A distcomm client cannot just send its
hello to an unknown server: torch's libuv server ignores a first query that is not VALIDATE and
then says nothing, so the client would learn only from a timeout. It sends ``PROBE`` instead:
VALIDATE and a PING whose nonce is ``PROBE_NONCE`` ("DCKV", above any process id, which is what
torch's client uses as its nonce). torch's servers, both of them, echo the nonce at once; a distcomm
server answers ``PROBE_ANSWER`` and goes on with distcomm's handshake on the same connection. So
one round trip tells the client which server it reached, and anything else that answers (an HTTP
server, a stray process) is caught in that same round trip, with its first bytes to show.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from .frames import (
    DEFAULT_MAX_FRAME_SIZE,
    FRAME_HEAD_SIZE,
    Add,
    Append,
    Bool,
    Check,
    CompareSet,
    DeleteKey,
    Error,
    Get,
    Join,
    MultiGet,
    MultiSet,
    NumKeys,
    ProtocolError,
    QueueLen,
    QueuePop,
    QueuePush,
    RESPONSE_PARSERS,
    Set,
    Value,
    Values,
    Wait,
    unpack_head,
)

VALIDATION_MAGIC = 0x3C85F7CE

# torch's QueryType, in its order
VALIDATE, SET, COMPARE_SET, GET, ADD, CHECK, WAIT, GETNUMKEYS, DELETE_KEY, APPEND, MULTI_GET, MULTI_SET, \
    CANCEL_WAIT, PING, QUEUE_PUSH, QUEUE_POP, QUEUE_LEN = range(17)

CHECK_READY, CHECK_NOT_READY = 0, 1
STOP_WAITING, WAIT_CANCELED = 0, 1

KEY_PREFIX = b"/"  # torch's TCPStore puts it before every key it sends
INIT_KEY = b"init/"  # ... except this one: its constructor's wait_for_workers counter

_U8 = struct.Struct("<B")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_I64 = struct.Struct("<q")

VALIDATE_QUERY = _U8.pack(VALIDATE) + _U32.pack(VALIDATION_MAGIC)
PROBE_NONCE = b"DCKV"  # 0x564B4344 as a u32: no process id is that large (Linux's pid_max is at most 2^22)
PROBE = VALIDATE_QUERY + _U8.pack(PING) + PROBE_NONCE
PROBE_ANSWER = b"dckv"  # a distcomm server's answer; torch's servers echo PROBE_NONCE
PROBE_SIZE = len(PROBE)
PROBE_ANSWER_SIZE = len(PROBE_ANSWER)

# A torch-speaking connection may send no more than this much in one query (its limits: 8 KiB
# keys, 8 MiB values, 128 Ki keys per query; distcomm's are its max frame size for the whole query).
MAX_KEY_COUNT = 128 * 1024

DISTCOMM = "distcomm"
TORCH = "torch"
PROBE_FROM_DISTCOMM = "probe"


# ---------------------------------------------------------------------------------------------
# Which protocol a new connection speaks (the server's side)
# ---------------------------------------------------------------------------------------------


def classify(data: bytes) -> str | None:
    """What a new connection's first bytes say it speaks: DISTCOMM (a hello), TORCH (torch's
    VALIDATE), PROBE_FROM_DISTCOMM (a distcomm client's PROBE), or None until enough bytes are in.
    ProtocolError for anything else, naming the bytes."""
    if not data:
        return None
    first = data[0]
    if first == ord("D"):
        return DISTCOMM
    if first != VALIDATE:
        raise ProtocolError(f"first bytes {printable(data)} are neither a distcomm hello nor torch's VALIDATE")
    prefix = data[:5]
    if prefix != VALIDATE_QUERY[: len(prefix)]:
        raise ProtocolError(f"torch VALIDATE with the wrong magic number: {printable(data)}")
    if len(data) < 6:
        return None
    if data[5] != PING:  # an older torch client, which does not ping
        return TORCH
    if len(data) < PROBE_SIZE:
        return None
    return PROBE_FROM_DISTCOMM if data[6:PROBE_SIZE] == PROBE_NONCE else TORCH


def printable(data: bytes, limit: int = 64) -> str:
    """``data``'s first ``limit`` bytes for a message: text where it is text, escapes elsewhere."""
    text = repr(bytes(data[:limit]))
    return text + ("..." if len(data) > limit else "")


# ---------------------------------------------------------------------------------------------
# The client's side: requests out, replies in
# ---------------------------------------------------------------------------------------------


def _string(data: bytes) -> bytes:
    return _U64.pack(len(data)) + data


def _strings(items) -> bytes:
    return _U64.pack(len(items)) + b"".join(_U64.pack(len(item)) + item for item in items)


def encode_ping(nonce: int) -> bytes:
    return _U8.pack(PING) + _U32.pack(nonce)


def encode_set(key: bytes, value: bytes) -> bytes:
    return _U8.pack(SET) + _string(key) + _string(value)


def encode_compare_set(key: bytes, expected: bytes, desired: bytes) -> bytes:
    return _U8.pack(COMPARE_SET) + _string(key) + _string(expected) + _string(desired)


def encode_get(key: bytes) -> bytes:
    return _U8.pack(GET) + _string(key)


def encode_add(key: bytes, amount: int) -> bytes:
    return _U8.pack(ADD) + _string(key) + _I64.pack(amount)


def encode_check(keys) -> bytes:
    return _U8.pack(CHECK) + _strings(keys)


def encode_wait(keys) -> bytes:
    return _U8.pack(WAIT) + _strings(keys)


def encode_cancel_wait() -> bytes:
    return _U8.pack(CANCEL_WAIT)


def encode_num_keys() -> bytes:
    return _U8.pack(GETNUMKEYS)


def encode_delete_key(key: bytes) -> bytes:
    return _U8.pack(DELETE_KEY) + _string(key)


def encode_append(key: bytes, value: bytes) -> bytes:
    return _U8.pack(APPEND) + _string(key) + _string(value)


def encode_multi_get(keys) -> bytes:
    return _U8.pack(MULTI_GET) + _strings(keys)


def encode_multi_set(keys, values) -> bytes:
    if len(keys) != len(values):
        raise ValueError(f"multi_set: {len(keys)} keys but {len(values)} values")
    body = b"".join(_string(k) + _string(v) for k, v in zip(keys, values))
    return _U8.pack(MULTI_SET) + _U64.pack(len(keys)) + body


def encode_queue_push(key: bytes, value: bytes) -> bytes:
    return _U8.pack(QUEUE_PUSH) + _string(key) + _string(value)


def encode_queue_pop(key: bytes) -> bytes:
    return _U8.pack(QUEUE_POP) + _string(key)


def encode_queue_len(key: bytes) -> bytes:
    return _U8.pack(QUEUE_LEN) + _string(key)


# The shapes of the replies a client reads; the client knows which one its request gets.
U8, U32, I64, STRING, QUEUE_ITEM = "u8", "u32", "i64", "string", "queue item"


def parse_reply(shape: str, data: bytes, max_size: int = DEFAULT_MAX_FRAME_SIZE):
    """``(value, size)`` of the reply of ``shape`` at the start of ``data``, or None until all of it
    is there. QUEUE_ITEM's value is None for an empty queue. A string longer than ``max_size`` is a
    ProtocolError (checked before anything waits for it)."""
    if shape == U8:
        return (data[0], 1) if data else None
    if shape == U32:
        return (_U32.unpack_from(data)[0], 4) if len(data) >= 4 else None
    if shape == I64:
        return (_I64.unpack_from(data)[0], 8) if len(data) >= 8 else None
    if shape == STRING:
        return _parse_string(data, 0, max_size)
    if shape == QUEUE_ITEM:
        if len(data) < 8:
            return None
        if _I64.unpack_from(data)[0] <= 0:
            return None, 8
        item = _parse_string(data, 8, max_size)
        return None if item is None else (item[0], 8 + item[1])
    raise ValueError(f"unknown reply shape {shape!r}")


def _parse_string(data: bytes, pos: int, max_size: int):
    if len(data) - pos < 8:
        return None
    (n,) = _U64.unpack_from(data, pos)
    if n > max_size:
        raise ProtocolError(f"a {n}-byte string exceeds the maximum size {max_size}")
    end = pos + 8 + n
    if len(data) < end:
        return None
    return bytes(data[pos + 8 : end]), end - pos


# ---------------------------------------------------------------------------------------------
# The server's side: torch's queries in, as distcomm's request events; distcomm's replies out, in torch's shapes
# ---------------------------------------------------------------------------------------------


@dataclass(slots=True)
class Validate:
    magic: int


@dataclass(slots=True)
class Ping:
    nonce: int


@dataclass(slots=True)
class CancelWait:
    pass


# A torch WAIT carries no timeout: it waits until the keys exist or the client cancels it.
WAIT_FOREVER_MS = 10**12  # ~30 years; the server's poll caps its timeout anyway


class _Reader:
    """A cursor over the buffered bytes of one query: every read says None when the bytes are not all there."""

    __slots__ = ("data", "pos", "limit")

    def __init__(self, data: bytes, pos: int, limit: int):
        self.data, self.pos, self.limit = data, pos, limit

    def _take(self, n: int):
        end = self.pos + n
        if end > len(self.data):
            return None
        value = self.data[self.pos : end]
        self.pos = end
        return value

    def u32(self):
        raw = self._take(4)
        return None if raw is None else _U32.unpack(raw)[0]

    def i64(self):
        raw = self._take(8)
        return None if raw is None else _I64.unpack(raw)[0]

    def count(self, what: str):
        raw = self._take(8)
        if raw is None:
            return None
        (n,) = _U64.unpack(raw)
        if n > MAX_KEY_COUNT:
            raise ProtocolError(f"torch {what}: {n} keys, more than the {MAX_KEY_COUNT} a query may carry")
        return n

    def string(self, what: str):
        raw = self._take(8)
        if raw is None:
            return None
        (n,) = _U64.unpack(raw)
        if self.pos + n > self.limit:
            raise ProtocolError(f"torch {what}: a {n}-byte string makes the query longer than {self.limit} bytes")
        return self._take(n)

    def strings(self, what: str):
        n = self.count(what)
        if n is None:
            return None
        items = []
        for _ in range(n):
            item = self.string(what)
            if item is None:
                return None
            items.append(item)
        return items


def server_key(key: bytes) -> bytes:
    """A torch client's key as distcomm's clients name it: without torch's "/" prefix."""
    return key[1:] if key[:1] == KEY_PREFIX else key


def reply_integer(value: int) -> bytes:
    """torch's reply to ADD (and the other I64 queries)."""
    return _I64.pack(value)


STOPPED_WAITING = _U8.pack(STOP_WAITING)  # torch's reply to a WAIT whose keys all exist


def reply_string(value: bytes) -> bytes:
    """torch's reply to GET."""
    return _U64.pack(len(value)) + value


def single_query(data: bytes):
    """``(query, key, rest)`` if ``data`` is exactly one SET (rest: the value), GET or WAIT for one
    key (rest: None) or ADD (rest: the amount) of an ordinary key, with the key as distcomm's
    clients name it; None for anything else (more or fewer bytes, another query, torch's "init/"
    counter). The server's fast lane: one query per read is what a busy client sends, and a get()
    is a WAIT then a GET."""
    size = len(data)
    if size < 9:
        return None
    query = data[0]
    if query == WAIT:
        if size < 17 or _U64.unpack_from(data, 1)[0] != 1 or 17 + _U64.unpack_from(data, 9)[0] != size:
            return None
        return WAIT, server_key(data[17:]), None
    if query not in (SET, GET, ADD):
        return None
    key_end = 9 + _U64.unpack_from(data, 1)[0]
    if query == GET:
        return (GET, server_key(data[9:key_end]), None) if key_end == size else None
    if query == ADD:
        if key_end + 8 != size or data[9:key_end] == INIT_KEY:
            return None
        return ADD, server_key(data[9:key_end]), _I64.unpack_from(data, key_end)[0]
    if key_end + 8 > size or key_end + 8 + _U64.unpack_from(data, key_end)[0] != size:
        return None
    return SET, server_key(data[9:key_end]), data[key_end + 8 :]


class TorchServerConnection:
    """The server's side of one connection from a torch TCPStore client, with no I/O.

    ``receive_events(data)`` returns the complete queries so far as events: Validate, Ping,
    CancelWait, or distcomm's own request events (frames.py) with request ids this connection
    numbers — so the server's handlers serve torch's clients unchanged. ``reply(response)`` turns
    the distcomm response a handler gave to one of them into the bytes torch's client reads.

    What differs from distcomm's requests: a torch GET never waits (its client sent WAIT first; a
    key deleted meanwhile reads as empty, as torch's libuv server answers); a WAIT waits until the
    keys exist or CANCEL_WAIT; ADD of "init/" is a JOIN (torch's wait_for_workers); torch's "/"
    key prefix is removed, so torch's and distcomm's clients of one server see the same keys.
    """

    def __init__(self, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE):
        self.max_frame_size = max_frame_size
        self.validated = False
        self._buffer = b""
        self._next_id = 0
        self._shapes: dict[int, str] = {}  # request id -> what torch's client expects back

    @property
    def buffered(self) -> int:
        """How many received bytes this connection holds that are not a query yet."""
        return len(self._buffer)

    @property
    def has_partial_data(self) -> bool:
        return bool(self._buffer) or not self.validated

    def single_query(self, data: bytes):
        """``single_query(data)`` on a validated connection holding no earlier bytes; else None.
        The caller answers it itself (SET: nothing; GET and ADD: reply_string, reply_integer)."""
        if not self.validated or self._buffer:
            return None
        return single_query(data)

    def receive_events(self, data: bytes) -> list:
        """Every complete query in the bytes received so far, as events; ProtocolError for bytes that
        are not torch's protocol (the connection must be closed)."""
        self._buffer = self._buffer + bytes(data) if self._buffer else bytes(data)
        events = []
        while self._buffer:
            parsed = self._next(self._buffer)
            if parsed is None:
                if len(self._buffer) > self.max_frame_size:
                    raise ProtocolError(f"a torch query longer than {self.max_frame_size} bytes")
                break
            event, size = parsed
            self._buffer = self._buffer[size:]
            events.append(event)
        return events

    def _id(self, shape: str | None) -> int:
        self._next_id = (self._next_id + 1) & 0xFFFFFFFF
        if shape is not None:
            self._shapes[self._next_id] = shape
        return self._next_id

    def _next(self, data: bytes):
        query = data[0]
        r = _Reader(data, 1, self.max_frame_size + 1)
        if not self.validated:
            if query != VALIDATE:
                raise ProtocolError(f"a torch client's first query must be VALIDATE, not {query}")
            magic = r.u32()
            if magic is None:
                return None
            if magic != VALIDATION_MAGIC:
                raise ProtocolError(f"torch VALIDATE with magic 0x{magic:08x}, not 0x{VALIDATION_MAGIC:08x}")
            self.validated = True
            return Validate(magic), r.pos
        if query == PING:
            nonce = r.u32()
            return None if nonce is None else (Ping(nonce), r.pos)
        if query == CANCEL_WAIT:
            return CancelWait(), 1
        if query == GETNUMKEYS:
            return NumKeys(self._id(I64)), 1
        if query in (SET, APPEND, QUEUE_PUSH):
            key, value = r.string("key"), None
            if key is not None:
                value = r.string("value")
            if value is None:
                return None
            kind = {SET: Set, APPEND: Append, QUEUE_PUSH: QueuePush}[query]
            return kind(self._id(None), server_key(key), value), r.pos
        if query in (GET, DELETE_KEY, QUEUE_LEN, QUEUE_POP):
            key = r.string("key")
            if key is None:
                return None
            key = server_key(key)
            if query == GET:
                return Get(self._id(STRING), key, 0), r.pos
            if query == DELETE_KEY:
                return DeleteKey(self._id(I64), key), r.pos
            if query == QUEUE_LEN:
                return QueueLen(self._id(I64), key), r.pos
            return QueuePop(self._id(QUEUE_ITEM), key, 0), r.pos
        if query == ADD:
            key = r.string("key")
            amount = None if key is None else r.i64()
            if amount is None:
                return None
            if key == INIT_KEY:
                return Join(self._id(I64)), r.pos
            return Add(self._id(I64), server_key(key), amount), r.pos
        if query == COMPARE_SET:
            key = r.string("key")
            expected = None if key is None else r.string("expected value")
            desired = None if expected is None else r.string("desired value")
            if desired is None:
                return None
            return CompareSet(self._id(STRING), server_key(key), expected, desired), r.pos
        if query in (CHECK, WAIT, MULTI_GET):
            keys = r.strings("key list")
            if keys is None:
                return None
            keys = [server_key(k) for k in keys]
            if query == CHECK:
                return Check(self._id(U8), keys), r.pos
            if query == WAIT:
                return Wait(self._id(U8), keys, WAIT_FOREVER_MS), r.pos
            return MultiGet(self._id(f"{len(keys)} strings"), keys, WAIT_FOREVER_MS), r.pos
        if query == MULTI_SET:
            n = r.count("multi_set")
            if n is None:
                return None
            keys, values = [], []
            for _ in range(n):
                key = r.string("key")
                value = None if key is None else r.string("value")
                if value is None:
                    return None
                keys.append(server_key(key))
                values.append(value)
            return MultiSet(self._id(None), keys, values), r.pos
        raise ProtocolError(f"unknown torch TCPStore query {query}")

    def reply(self, response: bytes) -> bytes:
        """The bytes torch's client expects for ``response`` — one or more distcomm response frames,
        each answering a request this connection made from a torch query. ProtocolError for an
        Error response (torch's servers close the connection where distcomm's answers an error)."""
        out = []
        pos = 0
        while pos < len(response):
            length, opcode, request_id = unpack_head(response, pos)
            end = pos + 8 + length
            event = RESPONSE_PARSERS[opcode](response, pos + FRAME_HEAD_SIZE, end, request_id)
            pos = end
            shape = self._shapes.pop(request_id, None)
            if shape is None:  # SET, APPEND, MULTI_SET and QUEUE_PUSH: torch's client reads no reply
                continue
            out.append(self._translate(shape, event))
        return b"".join(out)

    def forget(self) -> None:
        """CANCEL_WAIT: the parked WAIT (or MULTI_GET) will not be answered."""
        for request_id, shape in list(self._shapes.items()):
            if shape == U8 or shape.endswith("strings"):
                del self._shapes[request_id]

    @staticmethod
    def _translate(shape: str, event) -> bytes:
        kind = event.__class__
        if kind is Error:
            raise ProtocolError(f"torch query refused: {event.message.decode('utf-8', 'replace')}")
        if shape == I64:
            return _I64.pack(int(event.value))  # Integer, or Bool (DELETE_KEY answers how many)
        if shape == U8:
            if kind is Bool:
                return _U8.pack(CHECK_READY if event.value else CHECK_NOT_READY)
            return _U8.pack(STOP_WAITING)  # Ok: a WAIT's keys all exist
        if shape == STRING:
            return _string(event.value if kind is Value else b"")  # TimedOut: deleted since its WAIT
        if shape == QUEUE_ITEM:
            if kind is Value:
                return _I64.pack(1) + _string(event.value)
            return _I64.pack(0)
        if kind is Values:
            return b"".join(_string(v) for v in event.values)
        raise ProtocolError(f"no torch reply of shape {shape!r} for {event!r}")

