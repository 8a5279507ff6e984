"""TorchWireClient: a distcomm TCPStore's connection to torch's TCPStore server (torch_wire.py).

When: client.connect() found torch's server at the address (torchrun's agent store, or a torch
rank 0's master store): the probe's nonce came back echoed. This client then speaks torch's protocol
on that same connection, already validated, and behaves as torch's own client does, so torch's
ranks and distcomm's ranks of one job see the same keys and the same errors:

* every key gets torch's "/" prefix (but the JOIN of wait_for_workers is ADD "init/", as torch's);
* get() and multi_get() send WAIT first and GET/MULTI_GET once it is answered; a wait that times out
  sends CANCEL_WAIT and reads the server's answers out, so the connection stays in step;
* a blocking queue_pop() waits for the queue's name, then pops (again if another client took the item).

Same face as TCPStoreClient (the methods TCPStore calls), with what torch's server cannot do:
``list_keys`` raises, and ``barrier`` is not a request (TCPStore uses torch's add/set/wait barrier
for it; ``speaks_torch`` says so). torch's classic server (use_libuv=False) has no queues: it closes
the connection on them, which this client reports as a lost connection naming the reason.
"""

from __future__ import annotations

import errno
import socket
import threading

from ...errors import DistNetworkError, DistStoreError
from .. import rules
from . import torch_wire as wire
from .deadlines import set_deadlines
from .frames import DEFAULT_MAX_FRAME_SIZE, ProtocolError

_RECV_SIZE = 1 << 16


def _prefixed(key: bytes) -> bytes:
    return wire.KEY_PREFIX + key


class TorchWireClient:
    """A connection to a torch TCPStore server; every method is torch's client's exchange for it."""

    speaks_torch = True

    def __init__(self, host: str, port: int, sock: socket.socket, timeout: float,
                 max_frame_size: int = DEFAULT_MAX_FRAME_SIZE, leftover: bytes = b""):
        self.host, self.port = host, port
        self.where = f"{host}:{port}"
        self._sock = sock
        self._buffer = leftover
        self._max = max_frame_size
        self._lock = threading.Lock()
        # Blocking mode, deadlines kept by the kernel (deadlines.py), re-set only when they change,
        # as TCPStoreClient does.
        sock.settimeout(None)
        self._deadline = -1.0
        self.set_timeout(timeout)

    # -- plumbing -----------------------------------------------------------------------------------

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None

    @property
    def closed(self) -> bool:
        return self._sock is None

    def describe(self) -> str:
        sock = self._sock
        if sock is None:
            return "TCPClient(closed)"
        try:
            fd, local, remote = sock.fileno(), sock.getsockname(), sock.getpeername()
        except OSError:
            return "TCPClient(closed)"
        where = f"addr={local[0]}:{local[1]}, remote={remote[0]}:{remote[1]}"
        return f"TCPClient(SocketImpl(fd={fd}, {where}), torch server)"

    def set_timeout(self, timeout: float) -> None:
        self.timeout = timeout
        self.reply_timeout = timeout + min(max(1.0, 0.1 * timeout), 30.0)

    def _socket(self, operation: str) -> socket.socket:
        if self._sock is None:
            raise DistNetworkError(f"{operation}: this TCPStore client's connection to {self.where} is closed")
        return self._sock

    def _broken(self, operation: str, reason: str):
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()
        raise DistNetworkError(
            f"{operation}: lost the connection to torch's TCPStore server at {self.where}: {reason}. The process "
            f"hosting it may have exited, or it refused the request (torch's classic server, use_libuv=False, "
            f"closes the connection on queue requests); this store cannot be used any more."
        ) from None

    def _set_deadline(self, sock: socket.socket, seconds: float) -> None:
        if seconds != self._deadline:
            set_deadlines(sock, seconds)
            self._deadline = seconds

    def _send(self, operation: str, data: bytes) -> None:
        sock = self._socket(operation)
        try:
            self._set_deadline(sock, self.timeout)  # a system call only after a wait's own timeout or a grace
            sock.sendall(data)
        except OSError as exc:
            self._broken(operation, str(exc) or type(exc).__name__)

    def _read(self, operation: str, shape: str, timeout: float | None = None):
        """The reply of ``shape``; None if ``timeout`` passed first (None: the reply timeout, then an error).

        The kernel's deadline stays at the store's timeout, which a get()'s WAIT uses too, so a get
        sets none; a reply that has not come by then gets the rest of the reply timeout."""
        sock = self._socket(operation)
        grace = timeout is None
        try:
            self._set_deadline(sock, self.timeout if grace else timeout)
            while True:
                parsed = wire.parse_reply(shape, self._buffer, self._max)
                if parsed is not None:
                    value, size = parsed
                    self._buffer = self._buffer[size:]
                    return value
                try:
                    data = sock.recv(_RECV_SIZE)
                except BlockingIOError:  # SO_RCVTIMEO: no byte for that long
                    if grace:
                        grace = False
                        self._set_deadline(sock, self.reply_timeout - self.timeout)
                        continue
                    if timeout is not None:
                        return None
                    # torch's replies carry no request id: a late one would answer the next request
                    self._sock = None
                    sock.close()
                    raise DistNetworkError(
                        f"{operation}: torch's TCPStore server at {self.where} did not answer within "
                        f"{rules.format_seconds(self.reply_timeout)}; it may be hung or overloaded. This "
                        f"connection is closed (a late answer could not be told from the next one's)"
                    ) from None
                if not data:
                    raise ConnectionResetError(errno.ECONNRESET, "the server closed the connection")
                self._buffer += data
        except ProtocolError as exc:
            self._broken(operation, f"the server sent bytes that are not torch's protocol ({exc})")
        except OSError as exc:
            self._broken(operation, str(exc) or type(exc).__name__)

    def _request(self, operation: str, data: bytes, shape: str):
        with self._lock:
            self._send(operation, data)
            return self._read(operation, shape)

    def _wait_locked(self, operation: str, keys: list[str], timeout: float) -> bool:
        """torch's doWait: WAIT, and on timeout CANCEL_WAIT; True if the keys all exist."""
        self._send(operation, wire.encode_wait([_prefixed(k.encode()) for k in keys]))
        answer = self._read(operation, wire.U8, timeout)
        if answer is not None:
            if answer != wire.STOP_WAITING:
                self._broken(operation, f"WAIT answered {answer}, not STOP_WAITING")
            return True
        self._send(operation, wire.encode_cancel_wait())
        answer = self._read(operation, wire.U8)
        if answer == wire.STOP_WAITING:  # it came just before the cancel: the cancel's answer follows
            answer = self._read(operation, wire.U8)
        if answer != wire.WAIT_CANCELED:
            self._broken(operation, f"CANCEL_WAIT answered {answer}, not WAIT_CANCELED")
        return False

    def _timeout_error(self, operation: str, keys: list[str], timeout: float):
        return rules.timeout_error(
            operation, keys, timeout, keys, f"torch TCPStore {self.where}", rules.tcp_wait_lead(keys, timeout)
        )

    # -- requests -----------------------------------------------------------------------------------

    def set(self, key: bytes, value: bytes) -> None:
        with self._lock:
            self._send("set", wire.encode_set(_prefixed(key), value))

    def get(self, key: str, timeout: float) -> bytes:
        with self._lock:
            if not self._wait_locked("get", [key], timeout):
                raise self._timeout_error("get", [key], timeout)
            self._send("get", wire.encode_get(_prefixed(key.encode())))
            return self._read("get", wire.STRING)

    def add(self, key: bytes, amount: int) -> int:
        return self._request("add", wire.encode_add(_prefixed(key), amount), wire.I64)

    def compare_set(self, key: bytes, expected: bytes, desired: bytes) -> bytes:
        return self._request("compare_set", wire.encode_compare_set(_prefixed(key), expected, desired), wire.STRING)

    def wait(self, keys: list[str], timeout: float) -> None:
        with self._lock:
            if not self._wait_locked("wait", keys, timeout):
                raise self._timeout_error("wait", keys, timeout)

    def check(self, keys: list[bytes]) -> bool:
        answer = self._request("check", wire.encode_check([_prefixed(k) for k in keys]), wire.U8)
        return answer == wire.CHECK_READY

    def num_keys(self) -> int:
        return self._request("num_keys", wire.encode_num_keys(), wire.I64)

    def delete_key(self, key: bytes) -> bool:
        return self._request("delete_key", wire.encode_delete_key(_prefixed(key)), wire.I64) == 1

    def append(self, key: bytes, value: bytes) -> None:
        with self._lock:
            self._send("append", wire.encode_append(_prefixed(key), value))

    def multi_get(self, keys: list[str], timeout: float) -> list[bytes]:
        with self._lock:
            if not self._wait_locked("multi_get", keys, timeout):
                raise self._timeout_error("multi_get", keys, timeout)
            self._send("multi_get", wire.encode_multi_get([_prefixed(k.encode()) for k in keys]))
            return [self._read("multi_get", wire.STRING) for _ in keys]

    def multi_set(self, keys: list[bytes], values: list[bytes]) -> None:
        with self._lock:
            self._send("multi_set", wire.encode_multi_set([_prefixed(k) for k in keys], values))

    def list_keys(self) -> list[bytes]:
        raise DistStoreError(
            f"list_keys: the TCPStore server at {self.where} is torch's, whose protocol has no way to list keys"
        )

    def queue_push(self, key: bytes, value: bytes) -> None:
        with self._lock:
            self._send("queue_push", wire.encode_queue_push(_prefixed(key), value))

    def queue_pop(self, key: str, block: bool, timeout: float) -> bytes:
        pop = wire.encode_queue_pop(_prefixed(key.encode()))
        with self._lock:
            while True:
                if block and not self._wait_locked("queue_pop", [key], timeout):
                    raise rules.queue_timeout_error(
                        key, timeout, f"torch TCPStore {self.where}", rules.tcp_wait_lead([key], timeout)
                    )
                self._send("queue_pop", pop)
                item = self._read("queue_pop", wire.QUEUE_ITEM)
                if item is not None:
                    return item
                if not block:
                    raise rules.queue_empty_error()
                # another client popped the item our WAIT saw: wait again

    def queue_len(self, key: bytes) -> int:
        return self._request("queue_len", wire.encode_queue_len(_prefixed(key)), wire.I64)

    def join(self) -> int:
        """torch's wait_for_workers: count this store in "init/" (no prefix), which torch's master polls."""
        return self._request("join", wire.encode_add(wire.INIT_KEY, 1), wire.I64)
