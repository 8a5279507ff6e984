"""torch's TCPStore wire protocol on bytes alone (store/tcp/torch_wire.py): the exact bytes torch 2.13's
client sends and its libuv server answers (recorded from torch 2.13 through a logging proxy, and
re-checked live in test_store_torch_interop.py), the first-bytes classification of a new connection,
the server's parser fed in every split, and the translation of distcomm's replies into torch's shapes.
"""

from __future__ import annotations

import struct

import pytest

from distcomm.store.tcp import frames as f
from distcomm.store.tcp import torch_wire as w
from distcomm.store.tcp.frames import ProtocolError

# What torch 2.13's TCPStore client sent (hex), for store.<call>; keys carry torch's "/" prefix.
TORCH_CLIENT_BYTES = {
    "connect (VALIDATE, PING 0x1575)": "00cef7853c" "0d75150000",
    'set("k", b"v")': "0102000000000000002f6b010000000000000076",
    'wait(["k"]) (get\'s first query)': "06010000000000000002000000000000002f6b",
    'get("k") after the wait': "0302000000000000002f6b",
    'add("c", 5)': "0402000000000000002f630500000000000000",
    'compare_set("k", b"v", b"w")': "0202000000000000002f6b010000000000000076010000000000000077",
    'check(["k", "zz"])': "05020000000000000002000000000000002f6b03000000000000002f7a7a",
    "num_keys()": "07",
    'delete_key("c")': "0802000000000000002f63",
    'append("k", b"x")': "0902000000000000002f6b010000000000000078",
    'multi_set(["a", "b"], [b"1", b"22"])':
        "0b020000000000000002000000000000002f6101000000000000003102000000000000002f6202000000000000003232",
    'multi_get(["a", "b"]) after its wait': "0a020000000000000002000000000000002f6102000000000000002f62",
    'queue_push("q", b"item")': "0e02000000000000002f7104000000000000006974656d",
    'queue_len("q")': "1002000000000000002f71",
    'queue_pop("q") after its wait': "0f02000000000000002f71",
    "cancel_wait (a wait's timeout)": "0c",
}


def test_the_encoders_write_torchs_client_bytes():
    ours = {
        "connect (VALIDATE, PING 0x1575)": w.VALIDATE_QUERY + w.encode_ping(0x1575),
        'set("k", b"v")': w.encode_set(b"/k", b"v"),
        'wait(["k"]) (get\'s first query)': w.encode_wait([b"/k"]),
        'get("k") after the wait': w.encode_get(b"/k"),
        'add("c", 5)': w.encode_add(b"/c", 5),
        'compare_set("k", b"v", b"w")': w.encode_compare_set(b"/k", b"v", b"w"),
        'check(["k", "zz"])': w.encode_check([b"/k", b"/zz"]),
        "num_keys()": w.encode_num_keys(),
        'delete_key("c")': w.encode_delete_key(b"/c"),
        'append("k", b"x")': w.encode_append(b"/k", b"x"),
        'multi_set(["a", "b"], [b"1", b"22"])': w.encode_multi_set([b"/a", b"/b"], [b"1", b"22"]),
        'multi_get(["a", "b"]) after its wait': w.encode_multi_get([b"/a", b"/b"]),
        'queue_push("q", b"item")': w.encode_queue_push(b"/q", b"item"),
        'queue_len("q")': w.encode_queue_len(b"/q"),
        'queue_pop("q") after its wait': w.encode_queue_pop(b"/q"),
        "cancel_wait (a wait's timeout)": w.encode_cancel_wait(),
    }
    assert {name: data.hex() for name, data in ours.items()} == TORCH_CLIENT_BYTES


def test_the_probe_is_validate_then_a_ping_no_process_id_can_send():
    assert w.PROBE == bytes.fromhex("00cef7853c") + b"\x0d" + b"DCKV"
    assert struct.unpack("<I", w.PROBE_NONCE)[0] > 1 << 22  # Linux's largest pid_max
    assert w.PROBE_ANSWER != w.PROBE_NONCE and len(w.PROBE_ANSWER) == len(w.PROBE_NONCE)


# -- the replies torch's client reads ------------------------------------------------------------------


@pytest.mark.parametrize(
    "shape, data, value, size",
    [
        (w.U8, bytes.fromhex("00"), 0, 1),  # STOP_WAITING / READY
        (w.U32, bytes.fromhex("75150000"), 0x1575, 4),  # the ping's nonce
        (w.I64, bytes.fromhex("0500000000000000"), 5, 8),
        (w.I64, struct.pack("<q", -3), -3, 8),
        (w.STRING, bytes.fromhex("010000000000000077"), b"w", 9),
        (w.STRING, bytes.fromhex("0000000000000000"), b"", 8),
        (w.QUEUE_ITEM, bytes.fromhex("010000000000000004000000000000006974656d"), b"item", 20),
        (w.QUEUE_ITEM, bytes.fromhex("0000000000000000"), None, 8),  # empty queue: no string follows
    ],
)
def test_replies_parse_and_wait_for_their_last_byte(shape, data, value, size):
    assert w.parse_reply(shape, data + b"extra") == (value, size)
    for cut in range(size):
        assert w.parse_reply(shape, data[:cut]) is None


def test_a_reply_string_longer_than_the_limit_is_refused_before_it_arrives():
    with pytest.raises(ProtocolError, match="exceeds the maximum size 1024"):
        w.parse_reply(w.STRING, struct.pack("<Q", 1 << 40), max_size=1024)


# -- which protocol a new connection speaks ----------------------------------------------------------


def test_classify_by_the_first_bytes():
    assert w.classify(b"") is None
    assert w.classify(b"D") == w.DISTCOMM
    assert w.classify(b"DCKV\x02\x00\x00\x00") == w.DISTCOMM
    torch_hello = bytes.fromhex("00cef7853c0d75150000")
    for cut in range(1, len(torch_hello)):
        assert w.classify(torch_hello[:cut]) is None
    assert w.classify(torch_hello) == w.TORCH
    assert w.classify(bytes.fromhex("00cef7853c") + b"\x01") == w.TORCH  # an older client: no PING
    for cut in range(1, len(w.PROBE)):
        assert w.classify(w.PROBE[:cut]) is None
    assert w.classify(w.PROBE) == w.PROBE_FROM_DISTCOMM


@pytest.mark.parametrize(
    "data, shown",
    [
        (b"GET / HTTP/1.1\r\nHost: x\r\n", "b'GET / HTTP/1.1\\r\\nHost: x\\r\\n'"),
        (b"\x00\x01\x02\x03\x04", "wrong magic"),
        (b"\xff" * 100, "..."),
    ],
)
def test_anything_else_is_a_protocol_error_showing_its_bytes(data, shown):
    with pytest.raises(ProtocolError) as info:
        w.classify(data)
    assert shown in str(info.value)


# -- the server's side: torch's queries as distcomm's requests --------------------------------------------


def _events(connection, data: bytes, step: int | None = None) -> list:
    if step is None:
        return connection.receive_events(data)
    events = []
    for i in range(0, len(data), step):
        events.extend(connection.receive_events(data[i : i + step]))
    return events


ALL_QUERIES = b"".join(bytes.fromhex(h) for h in TORCH_CLIENT_BYTES.values()) + w.encode_add(w.INIT_KEY, 1)


@pytest.mark.parametrize("step", [None, 1, 3, 7])
def test_the_server_parses_torchs_queries_in_any_pieces(step):
    conn = w.TorchServerConnection()
    events = _events(conn, ALL_QUERIES, step)
    kinds = [type(e).__name__ for e in events]
    assert kinds == [
        "Validate", "Ping", "Set", "Wait", "Get", "Add", "CompareSet", "Check", "NumKeys", "DeleteKey", "Append",
        "MultiSet", "MultiGet", "QueuePush", "QueueLen", "QueuePop", "CancelWait", "Join",
    ]
    by_kind = {type(e).__name__: e for e in events}
    assert by_kind["Ping"].nonce == 0x1575
    assert (by_kind["Set"].key, by_kind["Set"].value) == (b"k", b"v")  # torch's "/" is not part of the key
    assert by_kind["Wait"].keys == [b"k"] and by_kind["Wait"].timeout_ms == w.WAIT_FOREVER_MS
    assert by_kind["Get"].timeout_ms == 0  # after its WAIT: a missing key reads as empty, never parks
    assert (by_kind["Add"].key, by_kind["Add"].amount) == (b"c", 5)
    assert by_kind["CompareSet"].expected == b"v" and by_kind["CompareSet"].desired == b"w"
    assert by_kind["Check"].keys == [b"k", b"zz"]
    assert by_kind["MultiSet"].keys == [b"a", b"b"] and by_kind["MultiSet"].values == [b"1", b"22"]
    assert by_kind["QueuePop"].timeout_ms == 0
    assert not conn.has_partial_data


def test_the_first_query_must_be_validate_with_the_magic():
    with pytest.raises(ProtocolError, match="must be VALIDATE"):
        w.TorchServerConnection().receive_events(w.encode_set(b"/k", b"v"))
    with pytest.raises(ProtocolError, match="magic"):
        w.TorchServerConnection().receive_events(b"\x00\x01\x02\x03\x04")


def test_lengths_and_counts_are_checked_before_anything_is_buffered_for_them():
    conn = w.TorchServerConnection(max_frame_size=1024)
    conn.receive_events(w.VALIDATE_QUERY)
    with pytest.raises(ProtocolError, match="longer than"):
        conn.receive_events(b"\x01" + struct.pack("<Q", 1 << 30))  # SET with a 1 GiB key: refused at once
    conn = w.TorchServerConnection()
    conn.receive_events(w.VALIDATE_QUERY)
    with pytest.raises(ProtocolError, match="keys, more than"):
        conn.receive_events(b"\x06" + struct.pack("<Q", 1 << 40))  # WAIT on 2^40 keys
    conn = w.TorchServerConnection()
    conn.receive_events(w.VALIDATE_QUERY)
    with pytest.raises(ProtocolError, match="unknown torch TCPStore query 99"):
        conn.receive_events(b"\x63")


def _ids(events):
    return [e.request_id for e in events if hasattr(e, "request_id")]


def test_distcomms_replies_become_torchs_shapes():
    conn = w.TorchServerConnection()
    events = conn.receive_events(ALL_QUERIES)
    by_kind = {type(e).__name__: e for e in events}
    rid = {name: e.request_id for name, e in by_kind.items() if hasattr(e, "request_id")}
    assert len(set(_ids(events))) == len(_ids(events))  # the connection numbers its requests
    reply = conn.reply
    assert reply(f.encode_ok(rid["Wait"])) == b"\x00"  # STOP_WAITING
    assert reply(f.encode_value(rid["Get"], b"v")) == bytes.fromhex("010000000000000076")
    assert reply(f.encode_integer(rid["Add"], 5)) == bytes.fromhex("0500000000000000")
    assert reply(f.encode_value(rid["CompareSet"], b"w")) == bytes.fromhex("010000000000000077")
    assert reply(f.encode_bool(rid["Check"], False)) == b"\x01"  # NOT_READY
    assert reply(f.encode_integer(rid["NumKeys"], 2)) == bytes.fromhex("0200000000000000")
    assert reply(f.encode_bool(rid["DeleteKey"], True)) == bytes.fromhex("0100000000000000")
    assert reply(f.encode_ok(rid["Append"])) == b""  # torch's client reads no reply to APPEND or MULTI_SET
    assert reply(f.encode_ok(rid["MultiSet"])) == b""
    two = f.encode(f.Values(rid["MultiGet"], [b"1", b"22"]))
    assert reply(two) == bytes.fromhex("01000000000000003102000000000000003232")
    assert reply(f.encode_integer(rid["QueueLen"], 1)) == bytes.fromhex("0100000000000000")
    assert reply(f.encode_value(rid["QueuePop"], b"item")) == bytes.fromhex("010000000000000004000000000000006974656d")
    assert reply(f.encode_integer(rid["Join"], 3)) == bytes.fromhex("0300000000000000")


def test_empty_answers_are_torch_libuvs():
    conn = w.TorchServerConnection()
    events = conn.receive_events(w.VALIDATE_QUERY + w.encode_get(b"/gone") + w.encode_queue_pop(b"/q"))
    get, pop = events[1], events[2]
    assert conn.reply(f.encode(f.TimedOut(get.request_id, [b"gone"]))) == struct.pack("<Q", 0)  # empty string
    assert conn.reply(f.encode(f.TimedOut(pop.request_id, [b"q"]))) == struct.pack("<q", 0)  # empty queue


def test_an_error_reply_closes_a_torch_connection():
    conn = w.TorchServerConnection()
    add = conn.receive_events(w.VALIDATE_QUERY + w.encode_add(b"/k", 1))[1]
    with pytest.raises(ProtocolError, match="not an integer"):
        conn.reply(f.encode(f.Error(add.request_id, f.ERROR_NOT_AN_INTEGER, b"not an integer")))


def test_several_replies_in_one_batch_keep_their_order():
    conn = w.TorchServerConnection()
    events = conn.receive_events(w.VALIDATE_QUERY + w.encode_add(b"/a", 1) + w.encode_num_keys())
    batch = f.encode_integer(events[1].request_id, 1) + f.encode_integer(events[2].request_id, 7)
    assert conn.reply(batch) == struct.pack("<qq", 1, 7)


def test_a_read_that_is_one_set_get_wait_or_add_is_cut_without_events():
    """The server's fast lane: exactly one SET, GET, WAIT (one key) or ADD, from torch's client's own bytes."""
    conn = w.TorchServerConnection()
    assert conn.single_query(w.encode_add(b"/c", 5)) is None  # not validated yet
    conn.receive_events(w.VALIDATE_QUERY)
    for call, expected in (('set("k", b"v")', (w.SET, b"k", b"v")), ('get("k") after the wait', (w.GET, b"k", None)),
                           ('wait(["k"]) (get\'s first query)', (w.WAIT, b"k", None)), ('add("c", 5)', (w.ADD, b"c", 5))):
        assert conn.single_query(bytes.fromhex(TORCH_CLIENT_BYTES[call])) == expected, call
    assert conn.single_query(w.encode_add(b"/c", -(1 << 63))) == (w.ADD, b"c", -(1 << 63))
    assert conn.single_query(w.encode_set(b"/k", b"")) == (w.SET, b"k", b"")


@pytest.mark.parametrize("data", [
    w.encode_add(w.INIT_KEY, 1),  # torch's wait_for_workers counter: a JOIN
    w.encode_add(b"/c", 1) + w.encode_add(b"/c", 1),  # two queries
    w.encode_set(b"/k", b"v")[:-1],  # a part of one
    w.encode_get(b"/k") + b"\x00",  # one and a part of the next
    w.encode_set(b"/k", b"vv")[:-2] + b"v",  # a value shorter than its length says
    w.encode_compare_set(b"/k", b"v", b"w"),  # another query
    w.encode_wait([b"/k", b"/j"]),  # a WAIT for more than one key
    w.encode_wait([b"/k"])[:-1],
    w.encode_wait([]),
    b"\x02\xff\xff\xff\xff\xff\xff\xff\xff",  # a key longer than anything sent
    b"\x04",
])
def test_anything_but_one_whole_set_get_wait_or_add_takes_the_usual_path(data):
    conn = w.TorchServerConnection()
    conn.receive_events(w.VALIDATE_QUERY)
    assert conn.single_query(data) is None


def test_no_single_query_while_earlier_bytes_are_buffered():
    conn = w.TorchServerConnection()
    conn.receive_events(w.VALIDATE_QUERY + w.encode_set(b"/k", b"v")[:5])
    assert conn.single_query(w.encode_add(b"/c", 1)) is None  # it would be read out of order


def test_fast_replies_are_torchs_shapes():
    assert w.reply_integer(-3) == struct.pack("<q", -3)
    assert w.reply_string(b"abc") == struct.pack("<Q", 3) + b"abc"
    assert w.STOPPED_WAITING == bytes([w.STOP_WAITING])
