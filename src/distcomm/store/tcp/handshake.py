"""The TCPStore handshake, with no I/O: the hello, the optional mutual authentication, and one table
of the phases a connection goes through before its first frame.

Why a module of its own: everything a connection may say before it is trusted is decided here, on
bytes and on a phase, never on a socket — so which bytes a stranger can make the server read, and
what a client learns before it has checked the server's proof, can be read off one table and tested
without a network (tests/test_store_handshake.py, tests/test_store_protocol.py).

Wire format (all integers little-endian)::

    hello        client -> server   b"DCKV" | u16 version | u16 flags (0; bit 0: see Authentication)
    hello reply  server -> client   b"DCKV" | u16 version | u16 status (0 ok, 1 unsupported version)
                                    | u16 n | n bytes local_address (may be empty)

Version 2 added QUEUE_PUSH, QUEUE_POP, QUEUE_LEN and BARRIER; a version-1 peer would close the
connection on them as unknown opcodes, so the handshake refuses mixed versions instead.

``local_address`` in the hello reply names a Unix socket of the same server (Linux abstract
namespace, with a random part only this handshake reveals). A client on the same host that can
connect to it moves there and drops the TCP connection: same protocol, about a third less kernel
time per request than loopback TCP. A client elsewhere cannot reach it and stays on TCP.

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

The phases (``TRANSITIONS``): a connection's phase is all the handshake state it keeps, and the
table says which step may come in which phase; any other step is a ProtocolError. Each side takes a
step when it learns of it: the server when a hello or a proof arrives (deciding its answer at once,
so that bytes behind the hello in the same read are already treated as what they are: frames, a
proof, or to be dropped), and when it has judged the proof; the client when it reads the server's
answer. Until a server's connection is OPEN it reads nothing but the hello and the proof, both of
fixed size: bytes beyond them are a protocol error (a client never sends a request before the
handshake ends), bytes after a refusal are discarded, and no frame is ever parsed.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from dataclasses import dataclass

from .frames import ProtocolError

MAGIC = b"DCKV"
VERSION = 2

HELLO_STATUS_OK = 0
HELLO_STATUS_UNSUPPORTED_VERSION = 1
HELLO_STATUS_AUTH_REQUIRED = 2  # the server holds a key; the hello offered no authentication
HELLO_STATUS_AUTH_CHALLENGE = 3  # body: the server's nonce (an AuthChallenge message)
HELLO_STATUS_AUTH_ACCEPTED = 4  # body: the server's proof, then local_address (an AuthAccepted message)
HELLO_STATUS_AUTH_FAILED = 5  # the client's proof was wrong
HELLO_STATUS_AUTH_UNAVAILABLE = 6  # the client asked for authentication; the server holds no key

HELLO_FLAG_AUTH = 0x0001  # the hello carries a client nonce: the client holds a key and demands proof
NONCE_SIZE = 32
PROOF_SIZE = 32  # an HMAC-SHA256 digest

_HELLO = struct.Struct("<4sHH")
_U16 = struct.Struct("<H")
HELLO_SIZE = _HELLO.size
AUTH_HELLO_SIZE = HELLO_SIZE + NONCE_SIZE  # the largest message a client sends before it is authenticated
_REPLY_HEAD_SIZE = HELLO_SIZE + 2  # magic, version, status, body length


# ---------------------------------------------------------------------------------------------
# Messages
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


CLIENT_MESSAGES = (Hello, AuthProof)
SERVER_MESSAGES = (HelloReply, AuthChallenge, AuthAccepted)


def encode(message) -> bytes:
    """The exact bytes of one handshake message; ValueError for a nonce or proof of the wrong size."""
    kind = type(message)
    if kind is Hello:
        nonce = message.client_nonce
        if nonce and len(nonce) != NONCE_SIZE:
            raise ValueError(f"a client nonce is {NONCE_SIZE} bytes, not {len(nonce)}")
        return _HELLO.pack(MAGIC, message.version, HELLO_FLAG_AUTH if nonce else 0) + nonce
    if kind is AuthProof:
        if len(message.proof) != PROOF_SIZE:
            raise ValueError(f"a proof is {PROOF_SIZE} bytes, not {len(message.proof)}")
        return message.proof
    if kind is HelloReply:
        address = message.local_address
        return _HELLO.pack(MAGIC, message.version, message.status) + _U16.pack(len(address)) + address
    if kind is AuthChallenge:
        if len(message.server_nonce) != NONCE_SIZE:
            raise ValueError(f"a server nonce is {NONCE_SIZE} bytes, not {len(message.server_nonce)}")
        return _HELLO.pack(MAGIC, message.version, HELLO_STATUS_AUTH_CHALLENGE) + _U16.pack(NONCE_SIZE) + \
            message.server_nonce
    if kind is AuthAccepted:
        if len(message.server_proof) != PROOF_SIZE:
            raise ValueError(f"a server proof is {PROOF_SIZE} bytes, not {len(message.server_proof)}")
        body = message.server_proof + message.local_address
        return _HELLO.pack(MAGIC, message.version, HELLO_STATUS_AUTH_ACCEPTED) + _U16.pack(len(body)) + body
    raise TypeError(f"not a handshake message: {message!r}")


def _check_magic(data: bytes) -> None:
    # A wrong magic is reported as soon as the bytes received so far differ from it.
    prefix = data[: len(MAGIC)]
    if prefix != MAGIC[: len(prefix)]:
        raise ProtocolError(f"bad magic {prefix!r}: expected {MAGIC!r} (is this a distcomm TCPStore peer?)")


def decode_hello(data: bytes) -> tuple[Hello, int] | None:
    """The hello at the start of ``data`` and its size, or None until all of it is there."""
    _check_magic(data)
    if len(data) < HELLO_SIZE:
        return None
    _, version, flags = _HELLO.unpack_from(data, 0)
    if not flags & HELLO_FLAG_AUTH:
        return Hello(version), HELLO_SIZE
    if len(data) < AUTH_HELLO_SIZE:
        return None
    return Hello(version, data[HELLO_SIZE:AUTH_HELLO_SIZE]), AUTH_HELLO_SIZE


def decode_reply(data: bytes) -> tuple[HelloReply | AuthChallenge | AuthAccepted, int] | None:
    """The server's message at the start of ``data`` and its size, or None until all of it is there."""
    _check_magic(data)
    if len(data) < _REPLY_HEAD_SIZE:
        return None
    _, version, status = _HELLO.unpack_from(data, 0)
    end = _REPLY_HEAD_SIZE + _U16.unpack_from(data, HELLO_SIZE)[0]
    if len(data) < end:
        return None
    body = data[_REPLY_HEAD_SIZE:end]
    if status == HELLO_STATUS_AUTH_CHALLENGE:
        if len(body) != NONCE_SIZE:
            raise ProtocolError(f"authentication challenge: a {len(body)}-byte nonce, not {NONCE_SIZE}")
        return AuthChallenge(version, body), end
    if status == HELLO_STATUS_AUTH_ACCEPTED:
        if len(body) < PROOF_SIZE:
            raise ProtocolError(f"authentication accepted: a {len(body)}-byte body cannot hold the server's proof")
        return AuthAccepted(version, body[:PROOF_SIZE], body[PROOF_SIZE:]), end
    return HelloReply(version, status, body), end


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


def client_proved(key: bytes, client_nonce: bytes, server_nonce: bytes, proof: bytes) -> bool:
    """Whether ``proof`` is the client's proof for this key and these nonces (constant-time)."""
    return hmac.compare_digest(proof, client_proof(key, client_nonce, server_nonce))


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


# ---------------------------------------------------------------------------------------------
# Phases: one table for both sides
# ---------------------------------------------------------------------------------------------

# A server's connection starts in AWAIT_HELLO, a client's in AWAIT_REPLY; both end OPEN or REFUSED.
AWAIT_HELLO = "awaiting the hello"  # server
AWAIT_PROOF = "awaiting the proof"  # server: challenged; exactly PROOF_SIZE bytes may come next
JUDGING_PROOF = "judging the proof"  # server: the proof is in, its answer not out; nothing may come
AWAIT_REPLY = "awaiting the hello's answer"  # client
AWAIT_VERDICT = "awaiting the verdict on the proof"  # client: challenged; AuthAccepted or a refusal is next
OPEN = "open"  # the handshake is over: frames flow
REFUSED = "refused"  # the server refused the client (and closes); whatever else arrives is dropped unread

# The steps. The server decides each answer; the client reads it from the server's message.
HELLO_ACCEPTED = "hello accepted"  # no authentication on either side, same version
HELLO_CHALLENGED = "hello challenged"  # an authenticating hello to a server holding a key
HELLO_REFUSED = "hello refused"  # another version, or a key on one side only
PROOF_ARRIVED = "proof arrived"  # the server has the client's proof (the client takes no step for it)
PROOF_ACCEPTED = "proof accepted"  # right: the server proves itself in turn
PROOF_REFUSED = "proof refused"  # wrong key

TRANSITIONS = {
    # the server
    (AWAIT_HELLO, HELLO_ACCEPTED): OPEN,
    (AWAIT_HELLO, HELLO_CHALLENGED): AWAIT_PROOF,
    (AWAIT_HELLO, HELLO_REFUSED): REFUSED,
    (AWAIT_PROOF, PROOF_ARRIVED): JUDGING_PROOF,
    (JUDGING_PROOF, PROOF_ACCEPTED): OPEN,
    (JUDGING_PROOF, PROOF_REFUSED): REFUSED,
    # the client
    (AWAIT_REPLY, HELLO_ACCEPTED): OPEN,
    (AWAIT_REPLY, HELLO_CHALLENGED): AWAIT_VERDICT,
    (AWAIT_REPLY, HELLO_REFUSED): REFUSED,
    (AWAIT_VERDICT, PROOF_ACCEPTED): OPEN,
    (AWAIT_VERDICT, PROOF_REFUSED): REFUSED,
}


def next_phase(phase: str, step: str) -> str:
    """The phase after ``step``; ProtocolError if ``step`` cannot happen in ``phase``."""
    try:
        return TRANSITIONS[phase, step]
    except KeyError:
        raise ProtocolError(f"handshake: '{step}' cannot happen while {phase}") from None


def hello_step(status: int) -> str:
    """The step a server takes when it answers a hello with ``status`` (see ServerConnection.hello_status)."""
    if status == HELLO_STATUS_OK:
        return HELLO_ACCEPTED
    if status == HELLO_STATUS_AUTH_CHALLENGE:
        return HELLO_CHALLENGED
    return HELLO_REFUSED


def reply_step(message: HelloReply | AuthChallenge | AuthAccepted) -> str:
    """The step a client takes when it reads ``message`` from the server."""
    kind = type(message)
    if kind is AuthChallenge:
        return HELLO_CHALLENGED
    if kind is AuthAccepted:
        return PROOF_ACCEPTED
    if message.status == HELLO_STATUS_AUTH_FAILED:
        return PROOF_REFUSED
    return hello_step(message.status)
