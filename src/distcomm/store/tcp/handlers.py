"""What a TCPStore server does with each request: one function per request type, in HANDLERS.

Why functions, and no I/O here: a handler reads and changes the server's table (store/table.py) and
its parked requests (parking.py), and returns the reply's bytes — or None, for a request that is
answered later (parked) or never (SET and QUEUE_PUSH have no reply, see frames.py). Sending is the
event loop's (server.py), which calls ``HANDLERS[type(request)](server, peer, request)`` for every
request in arrival order, under its lock, so each handler runs to completion alone: that is what
makes add() and compare_set() atomic. A handler uses only the server's public face: ``table``,
``parking``, ``answer`` (for requests parked earlier, perhaps by other clients), ``count_join``,
``local_address``, ``stats`` and ``port``.

Blocking requests: a GET, WAIT or MULTI_GET whose keys are missing is parked under each missing key
and answered by the write that completes it, or with TIMED_OUT when the deadline the client sent
passes (a timeout of 0 is answered TIMED_OUT at once). Nothing polls. Before answering, the keys are
looked up again: one may have been deleted since it was written, and then the request waits for it
again.

Queues and barriers park in a line per name, oldest first. A QUEUE_PUSH hands its item straight to
the oldest parked QUEUE_POP (so an item is never in the queue while a pop waits, and never goes to
two pops); with no pop waiting it stays in the queue and releases at most one WAIT parked on that
queue name (torch: "wait with queues will only wake one waiting worker"). A WAIT whose deadline
finds its keys present (a queue filled while another WAIT got the wake-up) is answered OK, not
TIMED_OUT. A BARRIER counts its arrival in the key's value, like ADD; the arrival that reaches the
world size answers every BARRIER parked on that key. A connection that closes takes its parked
requests out of every line (Parking.cancel), so a push never goes to a pop nobody will read.

The hello and the authentication proof are handled here too: the connection (connection.py)
decides the answer; the handler adds the server's Unix socket address for a client that may learn
it, marks a refused connection for closing once its refusal is sent, and counts refusals.
"""

from __future__ import annotations

import logging
import time

from .frames import (
    ADD_HEAD,
    ADD_LENGTH,
    ERROR_BAD_REQUEST,
    ERROR_NOT_AN_INTEGER,
    Add,
    Append,
    Barrier,
    Check,
    CompareSet,
    DeleteKey,
    Error,
    Get,
    INTEGER_LENGTH,
    INTEGER_REPLY,
    Integer,
    Join,
    ListKeys,
    MultiGet,
    MultiSet,
    NumKeys,
    QueueLen,
    QueuePop,
    QueuePush,
    Set,
    TimedOut,
    Values,
    Wait,
    add_fields,
    encode,
    encode_bool,
    encode_integer,
    encode_ok,
    encode_value,
    get_fields,
    set_fields,
)
from .handshake import (
    HELLO_STATUS_AUTH_FAILED,
    HELLO_STATUS_AUTH_REQUIRED,
    HELLO_STATUS_AUTH_UNAVAILABLE,
    HELLO_STATUS_OK,
    HELLO_STATUS_UNSUPPORTED_VERSION,
    AuthAccepted,
    AuthProof,
    Hello,
    HelloReply,
)
from . import torch_wire
from ..rules import INT64_MAX, INT64_MIN

log = logging.getLogger(__name__)


# -- the handshake ------------------------------------------------------------------------------------


def on_hello(server, peer, hello):
    connection = peer.connection
    reply = connection.reply_to_hello(hello)  # decides version and authentication
    if reply.__class__ is HelloReply:
        if reply.status != HELLO_STATUS_OK:
            peer.closing = True  # after the reply, which tells the client why
            if reply.status != HELLO_STATUS_UNSUPPORTED_VERSION:
                _count_refusal(server, peer, reply.status)
        elif not peer.local:
            reply.local_address = server.local_address
    return connection.send(reply)


def on_auth_proof(server, peer, proof):
    connection = peer.connection
    reply = connection.reply_to_proof(proof, b"" if peer.local else server.local_address)
    if reply.__class__ is AuthAccepted:
        peer.lift_read_limit()
    else:
        peer.closing = True
        _count_refusal(server, peer, reply.status)
    return connection.send(reply)


_REFUSAL_REASONS = {
    HELLO_STATUS_AUTH_REQUIRED: "offered no authentication",
    HELLO_STATUS_AUTH_FAILED: "failed authentication (wrong key)",
    HELLO_STATUS_AUTH_UNAVAILABLE: "asked for authentication, which this server has no key for",
}


def _count_refusal(server, peer, status: int) -> None:
    server.stats["auth_refused"] += 1
    reason = _REFUSAL_REASONS.get(status, f"refused with status {status}")
    log.info("TCPStore server on port %d: refused %s: it %s", server.port, peer.name, reason)


# -- keys -----------------------------------------------------------------------------------------------


def on_set(server, peer, req):  # no reply: see frames.py
    server.table.values[req.key] = req.value
    if server.parking.waiting:
        _written(server, req.key)


def on_get(server, peer, req):
    value = server.table.values.get(req.key)
    if value is not None:
        return encode_value(req.request_id, value)
    return _park(server, peer, req, [req.key], [req.key], req.timeout_ms)


def on_add(server, peer, req):
    try:
        total = server.table.add(req.key, req.amount)
    except ValueError as exc:
        return encode(Error(req.request_id, ERROR_NOT_AN_INTEGER, str(exc).encode("utf-8")))
    if server.parking.waiting:
        _written(server, req.key)
    return encode_integer(req.request_id, total)


def on_compare_set(server, peer, req):
    returned, changed = server.table.compare_set(req.key, req.expected, req.desired)
    if changed and server.parking.waiting:
        _written(server, req.key)
    return encode_value(req.request_id, returned)


def on_wait(server, peer, req):
    missing = server.table.absent(req.keys)
    if not missing:
        return encode_ok(req.request_id)
    return _park(server, peer, req, req.keys, missing, req.timeout_ms)


def on_check(server, peer, req):
    return encode_bool(req.request_id, not server.table.absent(req.keys))


def on_num_keys(server, peer, req):
    return encode_integer(req.request_id, len(server.table) + (1 if server.joined else 0))


def on_delete_key(server, peer, req):
    return encode_bool(req.request_id, server.table.delete(req.key))


def on_append(server, peer, req):
    server.table.append(req.key, req.value)
    if server.parking.waiting:
        _written(server, req.key)
    return encode_ok(req.request_id)


def on_multi_get(server, peer, req):
    missing = server.table.missing(req.keys)
    if not missing:
        values = server.table.values
        return encode(Values(req.request_id, [values[k] for k in req.keys]))
    return _park(server, peer, req, req.keys, missing, req.timeout_ms)


def on_multi_set(server, peer, req):
    if len(req.keys) != len(req.values):
        message = f"multi_set(): {len(req.keys)} keys but {len(req.values)} values"
        return encode(Error(req.request_id, ERROR_BAD_REQUEST, message.encode()))
    server.table.multi_set(req.keys, req.values)
    if server.parking.waiting:
        for key in req.keys:
            _written(server, key)
    return encode_ok(req.request_id)


def on_list_keys(server, peer, req):
    return encode(Values(req.request_id, list(server.table.values)))


def on_join(server, peer, req):
    return encode_integer(req.request_id, server.count_join())


# -- queues and barriers ------------------------------------------------------------------------------


def on_queue_push(server, peer, req):  # no reply, like SET
    parking = server.parking
    popper = parking.first_in_line((QueuePop, req.key))
    if popper is not None:  # the oldest parked pop takes the item; answering it takes it out of line
        server.answer(popper, encode_value(popper.request.request_id, req.value))
        return None
    server.table.queue_push(req.key, req.value)
    if parking.waiting:
        waiter = parking.wake_oldest(req.key, Wait)  # only a WAIT: GET and MULTI_GET wait for a set
        if waiter is not None:
            _answer_unless_missing(server, waiter)
    return None


def on_queue_pop(server, peer, req):
    value = server.table.queue_pop(req.key)
    if value is not None:
        return encode_value(req.request_id, value)
    return _park(server, peer, req, [req.key], [], req.timeout_ms, line=(QueuePop, req.key))


def on_queue_len(server, peer, req):
    return encode_integer(req.request_id, server.table.queue_len(req.key))


def on_barrier(server, peer, req):
    try:
        arrived = server.table.add(req.key, 1)
    except ValueError as exc:
        return encode(Error(req.request_id, ERROR_NOT_AN_INTEGER, str(exc).encode("utf-8")))
    if server.parking.waiting:
        _written(server, req.key)  # the counter is a key: a get/wait on it sees the count
    if arrived < req.world_size:
        return _park(server, peer, req, [req.key], [], req.timeout_ms, line=(Barrier, req.key))
    for parked in server.parking.in_line((Barrier, req.key)):
        server.answer(parked, encode_ok(parked.request.request_id))
    return encode_ok(req.request_id)


HANDLERS = {
    Hello: on_hello,
    AuthProof: on_auth_proof,
    Set: on_set,
    Get: on_get,
    Add: on_add,
    CompareSet: on_compare_set,
    Wait: on_wait,
    Check: on_check,
    NumKeys: on_num_keys,
    DeleteKey: on_delete_key,
    Append: on_append,
    MultiGet: on_multi_get,
    MultiSet: on_multi_set,
    ListKeys: on_list_keys,
    Join: on_join,
    QueuePush: on_queue_push,
    QueuePop: on_queue_pop,
    QueueLen: on_queue_len,
    Barrier: on_barrier,
}


# -- the fast lane: the hottest requests straight from the frame's bytes -------------------------------
#
# The server's loop gives a frame whose opcode is here to its function with the frame's bytes:
# ``FAST_HANDLERS[opcode](server, peer, data, start, end, request_id)`` (``data[start:end]`` are
# its fields), without building an event first. Same answers as the handlers above, which these
# fall back to for anything but the common case (a missing key to park on, an add() error).


def set_from_bytes(server, peer, data, start, end, request_id):
    key, value = set_fields(data, start, end)
    server.table.values[key] = value
    if server.parking.waiting:
        _written(server, key)


def get_from_bytes(server, peer, data, start, end, request_id):
    key, timeout_ms = get_fields(data, start, end)
    value = server.table.values.get(key)
    if value is not None:
        return encode_value(request_id, value)
    return on_get(server, peer, Get(request_id, key, timeout_ms))


def add_from_bytes(server, peer, data, start, end, request_id):
    key, amount = add_fields(data, start, end)
    try:
        total = server.table.add(key, amount)
    except ValueError as exc:
        return encode(Error(request_id, ERROR_NOT_AN_INTEGER, str(exc).encode("utf-8")))
    if server.parking.waiting:
        _written(server, key)
    return encode_integer(request_id, total)


FAST_HANDLERS = {
    Set.OPCODE: set_from_bytes,
    Get.OPCODE: get_from_bytes,
    Add.OPCODE: add_from_bytes,
}

_ADD_HEAD_UNPACK, _ADD_FRAME_MIN, _ADD = ADD_HEAD.unpack_from, ADD_HEAD.size, Add.OPCODE
_INTEGER_REPLY_PACK, _INTEGER = INTEGER_REPLY.pack, Integer.OPCODE
_INT64_DIGITS = len(str(INT64_MAX))


def single_add(server, data: bytes, max_frame_size: int) -> bytes | None:
    """The reply to a read (at a frame boundary) that is exactly one Add frame on a counter add()
    wrote, with no request parked; None, having changed nothing, for anything else, which then takes
    the lane above. The same answer as ``add_from_bytes`` (tests hold the two to each other), with
    no call of Python's own: 32 clients' add()s make it the server's hottest read, and under that
    load the interpreter comes back to cold caches, where every call frame costs."""
    if len(data) < _ADD_FRAME_MIN or data[8] != _ADD or server.parking.waiting:
        return None
    length, _, request_id, amount = _ADD_HEAD_UNPACK(data)
    if length != len(data) - 8 or length > max_frame_size:
        return None
    key = data[_ADD_FRAME_MIN:]
    values = server.table.values
    current = values.get(key)
    if current is None or len(current) > _INT64_DIGITS or not current.isdigit():
        return None  # (a longer one is out of range, or more digits than int() takes: an Error)
    total = int(current) + amount
    if total > INT64_MAX or total < INT64_MIN:
        return None
    values[key] = b"%d" % total
    return _INTEGER_REPLY_PACK(INTEGER_LENGTH, _INTEGER, request_id, total)


# The same lane for torch's clients: a read that is one SET, GET, WAIT or ADD (torch_wire.single_query)
# is answered in torch's bytes at once, instead of becoming an event, a distcomm reply and then
# torch's reply. ``TORCH_FAST_HANDLERS[query](server, key, rest)`` returns the reply (b"" for SET,
# which torch's client does not read), or None, having changed nothing, for anything but the
# common case (a missing key, an add() error): the server then takes the usual path (which parks
# a WAIT).


def torch_set(server, key, value):
    server.table.values[key] = value
    if server.parking.waiting:
        _written(server, key)
    return b""


def torch_get(server, key, _):
    value = server.table.values.get(key)
    return None if value is None else torch_wire.reply_string(value)


def torch_wait(server, key, _):
    return None if server.table.absent((key,)) else torch_wire.STOPPED_WAITING


def torch_add(server, key, amount):
    try:
        total = server.table.add(key, amount)
    except ValueError:
        return None
    if server.parking.waiting:
        _written(server, key)
    return torch_wire.reply_integer(total)


TORCH_FAST_HANDLERS = {
    torch_wire.SET: torch_set,
    torch_wire.GET: torch_get,
    torch_wire.WAIT: torch_wait,
    torch_wire.ADD: torch_add,
}


# -- parked requests: when they are answered, and with what ----------------------------------------------


def _park(server, peer, request, keys: list, missing: list, timeout_ms: int, line=None):
    """Answer later: when every key in ``missing`` is written, or its turn in ``line`` comes; or at
    the deadline. A timeout of 0 is answered TIMED_OUT now."""
    if timeout_ms == 0:
        return encode(TimedOut(request.request_id, missing or keys))
    server.parking.park(peer, request, time.monotonic() + timeout_ms / 1000.0, keys, missing, line)
    return None


def _written(server, key: bytes) -> None:
    """``key`` now exists: answer the parked requests it completes."""
    for parked in server.parking.written(key):
        if not parked.done:  # not released meanwhile (its client gone when an earlier answer failed)
            _answer_unless_missing(server, parked)


def _answer_unless_missing(server, parked) -> None:
    """Answer ``parked``, whose keys were all written, unless one has been deleted since: then it waits on."""
    missing = _still_missing(server.table, parked)
    if missing:
        server.parking.wait_for(parked, missing)
    else:
        server.answer(parked, _completed(server.table, parked.request))


def _still_missing(table, parked) -> list:
    """The keys ``parked`` still lacks; a WAIT (not GET/MULTI_GET) takes a non-empty queue as present."""
    if parked.request.__class__ is Wait:
        return table.absent(parked.keys)
    return table.missing(parked.keys)


def _completed(table, request) -> bytes:
    kind = request.__class__
    if kind is Get:
        return encode_value(request.request_id, table.values[request.key])
    if kind is MultiGet:
        values = table.values
        return encode(Values(request.request_id, [values[k] for k in request.keys]))
    return encode_ok(request.request_id)


def deadline_reply(table, parked) -> bytes:
    """The answer for ``parked`` at its deadline: TIMED_OUT, or the answer itself if it holds by now."""
    request = parked.request
    kind = request.__class__
    if kind is QueuePop or kind is Barrier:
        return encode(TimedOut(request.request_id, [request.key]))
    missing = _still_missing(table, parked)
    if not missing:  # a WAIT on a queue another WAIT was woken for: its condition holds
        return _completed(table, request)
    return encode(TimedOut(request.request_id, missing))
