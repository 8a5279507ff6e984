"""One side of one TCPStore connection, with no I/O: bytes in, events out; ``send(event) -> bytes``.

Why sans-I/O (the h11 approach): the server's event loop, the master's in-process connection and
the blocking client all read and write their sockets differently, but must cut the same byte stream
into the same events; here that is done once, on bytes alone, so the tests feed it bytes in any
pieces and compare events. A connection runs the handshake (handshake.py) until its phase is OPEN,
then cuts frames (frames.py). ServerConnection and ClientConnection differ in what they receive and
may send.

How bytes are buffered: received chunks are kept as they came and joined only once a whole hello or
frame (whose length passed the size check) is present, so a large frame arriving in many pieces is
copied once, and a peer can make the buffer grow only by actually sending bytes. The common case,
a read holding whole frames and nothing buffered, is parsed straight out of the read's bytes.
"""

from __future__ import annotations

import os

from . import frames, handshake
from .frames import (
    DEFAULT_MAX_FRAME_SIZE,
    FRAME_HEAD_SIZE,
    HEAD_AFTER_LENGTH,
    REQUEST_PARSERS,
    REQUESTS,
    RESPONSE_PARSERS,
    RESPONSES,
    ProtocolError,
    check_frame_length,
    unpack_head,
    unpack_length,
)
from .handshake import (
    AWAIT_HELLO,
    AWAIT_PROOF,
    AWAIT_REPLY,
    CLIENT_MESSAGES,
    HELLO_STATUS_AUTH_CHALLENGE,
    HELLO_STATUS_AUTH_FAILED,
    HELLO_STATUS_AUTH_REQUIRED,
    HELLO_STATUS_AUTH_UNAVAILABLE,
    HELLO_STATUS_OK,
    HELLO_STATUS_UNSUPPORTED_VERSION,
    JUDGING_PROOF,
    NONCE_SIZE,
    OPEN,
    PROOF_ACCEPTED,
    PROOF_ARRIVED,
    PROOF_REFUSED,
    PROOF_SIZE,
    REFUSED,
    SERVER_MESSAGES,
    VERSION,
    AuthAccepted,
    AuthChallenge,
    AuthProof,
    Hello,
    HelloReply,
    client_proved,
    decode_hello,
    decode_reply,
    hello_step,
    next_phase,
    reply_step,
    server_proof,
)


class NeedData:
    """Sentinel type: ``next_event`` needs more bytes before it can return an event."""

    def __repr__(self) -> str:
        return "NEED_DATA"


NEED_DATA = NeedData()


class _Connection:
    """The receive side both ends share: the handshake's messages until ``phase`` is OPEN, then frames."""

    _parsers: dict = {}  # opcode -> the parse of the frames this side receives

    def __init__(self, max_frame_size: int, phase: str):
        self.max_frame_size = max_frame_size
        self.phase = phase  # handshake.py's phases; the only handshake state a connection keeps
        self._buffer = b""
        self._pos = 0
        self._chunks: list[bytes] = []
        self._pending = 0  # bytes in _chunks
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
    def buffered(self) -> int:
        """How many received bytes this connection holds that are not an event yet."""
        return len(self._buffer) - self._pos + self._pending

    def at_frame_boundary(self) -> bool:
        """True when the handshake is over and no bytes are buffered: the next bytes received start a
        frame, so they can be cut straight out of the read (``cut_frames``)."""
        return self.phase is OPEN and self._pos >= len(self._buffer) and not self._pending

    @property
    def has_partial_data(self) -> bool:
        """True while bytes are buffered that do not yet form a complete hello or frame, or while the
        handshake (hello, and authentication if any) is unfinished: the server's idle timer runs."""
        return self._pos < len(self._buffer) or self._pending > 0 or self.phase is not OPEN

    def _gather(self, needed: int) -> bool:
        """Make ``needed`` bytes contiguous at ``_pos`` if that many were received."""
        if len(self._buffer) - self._pos + self._pending < needed:
            return False
        self._buffer = self._buffer[self._pos :] + b"".join(self._chunks)
        self._pos = 0
        self._chunks.clear()
        self._pending = 0
        return True

    def _discard_input(self) -> None:
        self._buffer, self._pos = b"", 0
        self._chunks.clear()
        self._pending = 0

    def next_event(self):
        """The next complete event, NEED_DATA, or ProtocolError for bytes that are not this protocol."""
        if self.phase is not OPEN:
            return self._next_handshake_message()
        buffer, pos = self._buffer, self._pos
        if len(buffer) - pos < FRAME_HEAD_SIZE:
            if len(buffer) - pos >= 8 or self._gather(8):  # the length alone: check it before waiting for more
                check_frame_length(unpack_length(self._buffer, self._pos)[0], self.max_frame_size)
            if not self._gather(FRAME_HEAD_SIZE):
                return NEED_DATA
            buffer, pos = self._buffer, 0
        length, opcode, request_id = unpack_head(buffer, pos)
        if length > self.max_frame_size or length < HEAD_AFTER_LENGTH:
            check_frame_length(length, self.max_frame_size)
        end = pos + 8 + length
        if end > len(buffer):
            if not self._gather(8 + length):
                return NEED_DATA
            buffer, pos, end = self._buffer, 0, 8 + length
        parse = self._parsers.get(opcode)
        if parse is None:
            raise ProtocolError(f"unknown opcode 0x{opcode:02x}")
        self._pos = end
        return parse(buffer, pos + FRAME_HEAD_SIZE, end, request_id)

    def receive_events(self, data: bytes) -> list:
        """``receive_data(data)`` then every complete event, as a list (the loop's one call per read).

        Same result as calling ``next_event`` until NEED_DATA; the common case — nothing buffered,
        ``data`` holding whole frames — is parsed straight out of ``data`` without a copy.
        """
        if not data or self.phase is not OPEN or self._pos < len(self._buffer) or self._pending:
            self.receive_data(data)
            events = []
            while (event := self.next_event()) is not NEED_DATA:
                events.append(event)
            return events
        parsers = self._parsers
        return [parsers[opcode](data, start, end, request_id) for opcode, request_id, start, end in self.cut_frames(data)]

    def cut_frames(self, data: bytes) -> list:
        """At a frame boundary (``at_frame_boundary``, ``data`` not empty): the complete frames at the
        start of ``data`` as (opcode, request_id, start, end) tuples, ``data[start:end]`` being the
        frame's fields, cut without a copy and not parsed; a trailing partial frame is kept as this
        connection's buffer. ProtocolError for a bad length or an opcode this side does not receive.

        The server's hot path: it hands the hottest requests' fields straight to their handlers
        (handlers.FAST_HANDLERS) instead of building an event for each.
        """
        parsers, max_frame_size = self._parsers, self.max_frame_size
        size = len(data)
        if size >= FRAME_HEAD_SIZE:  # the usual read: exactly one whole frame
            length, opcode, request_id = unpack_head(data, 0)
            if size == 8 + length and HEAD_AFTER_LENGTH <= length <= max_frame_size and opcode in parsers:
                return [(opcode, request_id, FRAME_HEAD_SIZE, size)]
        cut = []
        pos = 0
        while size - pos >= FRAME_HEAD_SIZE:
            length, opcode, request_id = unpack_head(data, pos)
            if length > max_frame_size or length < HEAD_AFTER_LENGTH:
                check_frame_length(length, max_frame_size)
            end = pos + 8 + length
            if end > size:
                break
            if opcode not in parsers:
                raise ProtocolError(f"unknown opcode 0x{opcode:02x}")
            cut.append((opcode, request_id, pos + FRAME_HEAD_SIZE, end))
            pos = end
        if pos < size:  # the start of a frame: keep it (and check its length if it is here already)
            self._buffer, self._pos = bytes(data), pos
            if size - pos >= 8:
                check_frame_length(unpack_length(data, pos)[0], max_frame_size)
        return cut

    def receive_reply(self, data: bytes, request_id: int):
        """``receive_data(data)``; the event answering ``request_id`` if it is complete, else None.

        Other complete events are dropped: for a client with one request in flight they can only be
        late answers to requests it gave up on. The common case — nothing buffered, ``data`` exactly
        the one frame awaited — is decoded without building a list.
        """
        if self.phase is OPEN and self._pos >= len(self._buffer) and not self._pending and len(data) >= FRAME_HEAD_SIZE:
            length, opcode, got_id = unpack_head(data, 0)
            if got_id == request_id and len(data) == 8 + length and length <= self.max_frame_size:
                parse = self._parsers.get(opcode)
                if parse is not None:
                    return parse(data, FRAME_HEAD_SIZE, len(data), got_id)
        for event in self.receive_events(data):
            if event.request_id == request_id:
                return event
        return None

    def receive_integer(self, data: bytes, request_id: int) -> int | None:
        """The value if ``data`` is exactly the Integer reply to ``request_id`` and nothing is buffered;
        else None and nothing consumed: give ``data`` to ``receive_reply`` then."""
        if self.phase is OPEN and self._pos >= len(self._buffer) and not self._pending:
            return frames.decode_integer_reply(data, request_id)
        return None



class ServerConnection(_Connection):
    """The server's side of one connection: Hello (and AuthProof) and requests in; HelloReply
    (AuthChallenge, AuthAccepted) and responses out.

    With ``auth_key`` the connection yields no request until the client has proven it holds the
    key; ``server_nonce`` is for tests (exact bytes), by default each connection draws its own.
    """

    _parsers = REQUEST_PARSERS

    def __init__(self, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE, auth_key: bytes | None = None,
                 server_nonce: bytes | None = None):
        super().__init__(max_frame_size, AWAIT_HELLO)
        self._auth_key = auth_key or None
        self._server_nonce = server_nonce
        self._client_nonce = b""

    @property
    def authenticated(self) -> bool:
        """True once requests may flow: after an accepted proof, or after a plain hello to a keyless server."""
        return self.phase is OPEN

    def _next_handshake_message(self):
        phase = self.phase
        self._gather(0)
        if phase is AWAIT_HELLO:
            decoded = decode_hello(self._buffer)
            if decoded is None:
                return NEED_DATA
            hello, self._pos = decoded
            status = self.hello_status(hello)
            if status == HELLO_STATUS_AUTH_CHALLENGE:
                self._client_nonce = hello.client_nonce
                if self._server_nonce is None:
                    self._server_nonce = os.urandom(NONCE_SIZE)
            self.phase = next_phase(phase, hello_step(status))
            return hello
        buffered = len(self._buffer) - self._pos
        if phase is AWAIT_PROOF:
            if buffered > PROOF_SIZE:
                raise ProtocolError(
                    f"{buffered} bytes where the {PROOF_SIZE}-byte authentication proof was due: a client sends "
                    f"nothing else before the server has answered its proof"
                )
            if buffered < PROOF_SIZE:
                return NEED_DATA
            self._pos = len(self._buffer)
            self.phase = next_phase(phase, PROOF_ARRIVED)
            return AuthProof(self._buffer[-PROOF_SIZE:])
        if phase is JUDGING_PROOF and buffered:
            raise ProtocolError("bytes after the authentication proof, before the server answered it")
        self._discard_input()  # REFUSED: dropped unread
        return NEED_DATA

    def hello_status(self, hello: Hello) -> int:
        """This server's answer to ``hello``: OK (requests may follow), AUTH_CHALLENGE, or the status of a refusal."""
        status = self.reply_to(hello).status
        if status != HELLO_STATUS_OK:
            return status
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
        status = self.hello_status(hello)
        if status == HELLO_STATUS_OK:
            return HelloReply(VERSION, status)
        if status == HELLO_STATUS_AUTH_CHALLENGE:
            return AuthChallenge(VERSION, self._server_nonce)
        self._discard_input()
        if status == HELLO_STATUS_UNSUPPORTED_VERSION:
            return self.reply_to(hello)  # the version policy's own answer, naming the version it speaks
        return HelloReply(VERSION, status)

    def proof_is_right(self, proof: AuthProof) -> bool:
        """Whether ``proof`` shows that the client holds this server's key (constant-time)."""
        if self._auth_key is None or self._server_nonce is None:
            return False  # no challenge went out: there is nothing a proof could answer
        return client_proved(self._auth_key, self._client_nonce, self._server_nonce, proof.proof)

    def reply_to_proof(self, proof: AuthProof, local_address: bytes = b""):
        """AuthAccepted (requests may follow; ``local_address`` is revealed, under the server's proof)
        or HelloReply AUTH_FAILED (close after sending it)."""
        if not self.proof_is_right(proof):
            self.phase = next_phase(self.phase, PROOF_REFUSED)
            self._discard_input()
            return HelloReply(VERSION, HELLO_STATUS_AUTH_FAILED)
        self.phase = next_phase(self.phase, PROOF_ACCEPTED)
        return AuthAccepted(
            VERSION, server_proof(self._auth_key, self._client_nonce, self._server_nonce, local_address), local_address
        )

    @staticmethod
    def send(event) -> bytes:
        if type(event) in SERVER_MESSAGES:
            return handshake.encode(event)
        if not isinstance(event, RESPONSES):
            raise TypeError(
                f"a server sends HelloReply, AuthChallenge, AuthAccepted or responses, not {type(event).__name__}"
            )
        return frames.encode(event)


class ClientConnection(_Connection):
    """The client's side: Hello (and AuthProof) and requests out; HelloReply (AuthChallenge,
    AuthAccepted) and responses in. An AuthChallenge keeps it in the handshake: another reply follows."""

    _parsers = RESPONSE_PARSERS

    def __init__(self, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE):
        super().__init__(max_frame_size, AWAIT_REPLY)

    def _next_handshake_message(self):
        self._gather(0)
        if self.phase is REFUSED:
            self._discard_input()  # the server closes after a refusal; nothing it sent after one counts
            return NEED_DATA
        decoded = decode_reply(self._buffer)
        if decoded is None:
            return NEED_DATA
        message, self._pos = decoded
        self.phase = next_phase(self.phase, reply_step(message))
        return message

    @staticmethod
    def send(event) -> bytes:
        if type(event) in CLIENT_MESSAGES:
            return handshake.encode(event)
        if not isinstance(event, REQUESTS):
            raise TypeError(f"a client sends Hello, AuthProof or requests, not {type(event).__name__}")
        return frames.encode(event)
