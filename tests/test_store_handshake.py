"""The handshake's phase table on its own, then both connections walking it on bytes.

The legal transitions are spelled out here rather than read from the module, so a change to the
table is a visible, deliberate diff; every other (phase, step) pair must be a ProtocolError. The
exact bytes of each message are in test_store_protocol.py.
"""

from __future__ import annotations

import pytest

from distcomm.store.tcp import connection as c, frames as f, handshake as h

LEGAL = [
    # the server
    (h.AWAIT_HELLO, h.HELLO_ACCEPTED, h.OPEN),
    (h.AWAIT_HELLO, h.HELLO_CHALLENGED, h.AWAIT_PROOF),
    (h.AWAIT_HELLO, h.HELLO_REFUSED, h.REFUSED),
    (h.AWAIT_PROOF, h.PROOF_ARRIVED, h.JUDGING_PROOF),
    (h.JUDGING_PROOF, h.PROOF_ACCEPTED, h.OPEN),
    (h.JUDGING_PROOF, h.PROOF_REFUSED, h.REFUSED),
    # the client
    (h.AWAIT_REPLY, h.HELLO_ACCEPTED, h.OPEN),
    (h.AWAIT_REPLY, h.HELLO_CHALLENGED, h.AWAIT_VERDICT),
    (h.AWAIT_REPLY, h.HELLO_REFUSED, h.REFUSED),
    (h.AWAIT_VERDICT, h.PROOF_ACCEPTED, h.OPEN),
    (h.AWAIT_VERDICT, h.PROOF_REFUSED, h.REFUSED),
]
PHASES = [h.AWAIT_HELLO, h.AWAIT_PROOF, h.JUDGING_PROOF, h.AWAIT_REPLY, h.AWAIT_VERDICT, h.OPEN, h.REFUSED]
STEPS = [h.HELLO_ACCEPTED, h.HELLO_CHALLENGED, h.HELLO_REFUSED, h.PROOF_ARRIVED, h.PROOF_ACCEPTED, h.PROOF_REFUSED]
ILLEGAL = [(phase, step) for phase in PHASES for step in STEPS if (phase, step) not in {(a, s) for a, s, _ in LEGAL}]

KEY = b"the job's key"
NC = bytes(range(32))
NS = bytes(range(100, 132))


# -- the table ----------------------------------------------------------------------------------------


def test_the_table_holds_exactly_the_legal_transitions():
    assert h.TRANSITIONS == {(phase, step): after for phase, step, after in LEGAL}
    assert len(ILLEGAL) == len(PHASES) * len(STEPS) - len(LEGAL)


@pytest.mark.parametrize("phase, step, after", LEGAL, ids=[f"{p} / {s}" for p, s, _ in LEGAL])
def test_every_legal_transition(phase, step, after):
    assert h.next_phase(phase, step) == after


@pytest.mark.parametrize("phase, step", ILLEGAL, ids=[f"{p} / {s}" for p, s in ILLEGAL])
def test_every_other_step_is_a_protocol_error_naming_step_and_phase(phase, step):
    with pytest.raises(f.ProtocolError, match=f"handshake: '{step}' cannot happen while {phase}"):
        h.next_phase(phase, step)


def test_open_and_refused_are_final():
    for phase in (h.OPEN, h.REFUSED):
        assert not [step for step in STEPS if (phase, step) in h.TRANSITIONS]


def test_the_step_each_answer_is():
    assert h.hello_step(h.HELLO_STATUS_OK) == h.HELLO_ACCEPTED
    assert h.hello_step(h.HELLO_STATUS_AUTH_CHALLENGE) == h.HELLO_CHALLENGED
    for refusal in (h.HELLO_STATUS_UNSUPPORTED_VERSION, h.HELLO_STATUS_AUTH_REQUIRED, h.HELLO_STATUS_AUTH_UNAVAILABLE):
        assert h.hello_step(refusal) == h.HELLO_REFUSED
    assert h.reply_step(h.HelloReply(2, h.HELLO_STATUS_OK, b"\0abc")) == h.HELLO_ACCEPTED
    assert h.reply_step(h.AuthChallenge(2, NS)) == h.HELLO_CHALLENGED
    assert h.reply_step(h.HelloReply(2, h.HELLO_STATUS_AUTH_REQUIRED)) == h.HELLO_REFUSED
    assert h.reply_step(h.AuthAccepted(2, bytes(32))) == h.PROOF_ACCEPTED
    assert h.reply_step(h.HelloReply(2, h.HELLO_STATUS_AUTH_FAILED)) == h.PROOF_REFUSED


# -- the server's connection walking it ------------------------------------------------------------------


def test_a_server_connection_walks_plain_and_authenticated_handshakes():
    plain = c.ServerConnection()
    assert plain.phase == h.AWAIT_HELLO
    plain.receive_events(h.encode(h.Hello()))
    assert plain.phase == h.OPEN

    keyed = c.ServerConnection(auth_key=KEY, server_nonce=NS)
    keyed.receive_events(h.encode(h.Hello(2, NC)))
    assert keyed.phase == h.AWAIT_PROOF
    (proof,) = keyed.receive_events(h.client_proof(KEY, NC, NS))
    assert keyed.phase == h.JUDGING_PROOF
    assert keyed.reply_to_proof(proof).__class__ is h.AuthAccepted
    assert keyed.phase == h.OPEN


@pytest.mark.parametrize(
    "server_key, hello, proof_key",
    [
        (None, h.Hello(99), None),  # another version
        (KEY, h.Hello(), None),  # the server requires a key
        (None, h.Hello(2, NC), None),  # the client demands one the server lacks
        (KEY, h.Hello(2, NC), b"another key"),  # a wrong proof
    ],
    ids=["version", "key required", "key unavailable", "wrong proof"],
)
def test_a_server_connection_ends_refused(server_key, hello, proof_key):
    server = c.ServerConnection(auth_key=server_key, server_nonce=NS)
    server.receive_events(h.encode(hello))
    if proof_key is not None:
        (proof,) = server.receive_events(h.client_proof(proof_key, NC, NS))
        assert server.reply_to_proof(proof).status == h.HELLO_STATUS_AUTH_FAILED
    assert server.phase == h.REFUSED and not server.authenticated


def test_a_server_judges_a_proof_only_after_receiving_one():
    for server in (c.ServerConnection(auth_key=KEY, server_nonce=NS), c.ServerConnection()):
        with pytest.raises(f.ProtocolError, match="cannot happen while awaiting the hello"):
            server.reply_to_proof(h.AuthProof(bytes(32)))
    opened = c.ServerConnection()
    opened.receive_events(h.encode(h.Hello()))
    with pytest.raises(f.ProtocolError, match="'proof refused' cannot happen while open"):
        opened.reply_to_proof(h.AuthProof(bytes(32)))
    assert opened.phase == h.OPEN  # an illegal step changes nothing


# -- the client's connection walking it ----------------------------------------------------------------


def _client_after(*messages) -> c.ClientConnection:
    client = c.ClientConnection()
    client.receive_events(b"".join(h.encode(m) for m in messages))
    return client


def test_a_client_connection_walks_to_open_or_refused():
    assert c.ClientConnection().phase == h.AWAIT_REPLY
    assert _client_after(h.HelloReply()).phase == h.OPEN
    assert _client_after(h.AuthChallenge(2, NS)).phase == h.AWAIT_VERDICT
    assert _client_after(h.AuthChallenge(2, NS), h.AuthAccepted(2, bytes(32))).phase == h.OPEN
    assert _client_after(h.AuthChallenge(2, NS), h.HelloReply(2, h.HELLO_STATUS_AUTH_FAILED)).phase == h.REFUSED
    for refusal in (h.HELLO_STATUS_UNSUPPORTED_VERSION, h.HELLO_STATUS_AUTH_REQUIRED, h.HELLO_STATUS_AUTH_UNAVAILABLE):
        assert _client_after(h.HelloReply(2, refusal)).phase == h.REFUSED


def test_a_refused_client_reads_nothing_more():
    client = _client_after(h.HelloReply(2, h.HELLO_STATUS_AUTH_REQUIRED))
    assert client.receive_events(f.encode(f.Ok(1))) == []


@pytest.mark.parametrize(
    "messages, step",
    [
        ([h.AuthAccepted(2, bytes(32))], "proof accepted"),  # a server's proof before any challenge
        ([h.HelloReply(2, h.HELLO_STATUS_AUTH_FAILED)], "proof refused"),  # a verdict on no proof
        ([h.AuthChallenge(2, NS), h.AuthChallenge(2, NS)], "hello challenged"),  # challenged twice
        ([h.AuthChallenge(2, NS), h.HelloReply()], "hello accepted"),  # let in without the server's proof
    ],
    ids=["accepted unchallenged", "verdict without proof", "second challenge", "ok after challenge"],
)
def test_a_server_answering_out_of_turn_is_a_protocol_error(messages, step):
    with pytest.raises(f.ProtocolError, match=f"'{step}' cannot happen"):
        _client_after(*messages)
