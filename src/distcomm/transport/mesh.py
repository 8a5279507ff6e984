"""Connect every pair of ranks once, through a store: the TCP transport's rendezvous.

Why it is apart from ``tcp.py``: building the mesh is a one-time, blocking, store-driven protocol
with its own failure modes (a rank that never shows up, a stray connection from another job);
the transport proper only ever sees a finished ``{peer: socket}`` map.

The protocol, for rank ``r`` of ``n``:

1. listen on an ephemeral port of the address that reaches the store (see ``listen_host``) and
   publish ``<prefix>/addr/<r>``; on Linux also on a Unix socket (below), published first as
   ``<prefix>/local/<r>``; rank 0 also publishes a random session token;
2. read everyone's address and the token;
3. connect to every *higher* rank and send it a hello (lower connects to higher: one socket per
   pair, no simultaneous-open races): by its Unix socket if that answers (a rank on this host, in
   this network namespace), else by TCP;
4. accept from every *lower* rank, check its hello (token, world size, ranks), answer with ours;
   anything else that connects is closed and ignored;
5. read the higher ranks' answers.

Steps 3-5 cannot deadlock: hellos are tiny (the kernel buffers them), so sending never waits, and
rank r's step 4 waits only on lower ranks' step 3, which waits on nothing.

Why a Unix socket between ranks on one host: both move a message with the same two copies by
CPUs of this host, but the loopback TCP path costs the kernel about twice as much per byte (64
MiB each way between two processes: about 21 ms by a Unix socket, 36-46 ms by loopback TCP;
docs/performance-notes.md). The socket is in the abstract namespace, so it is reachable only from
this host's network namespace, under a random name (which every process there can list, in
/proc/net/unix, as it can list TCP ports): what keeps others out is the session token's hello,
checked on it as on TCP. DISTCOMM_TCP_LOCAL_SOCKET=0 keeps every pair on TCP.
"""

from __future__ import annotations

import ipaddress
import os
import selectors
import socket
import sys
import time
from datetime import timedelta

from ..errors import DistNetworkError
from . import framing, interfaces

_WILDCARD = {"", "0.0.0.0", "::", "*"}
SOCKET_BUFFER = 4 << 20  # see tune_socket
LOOPBACK_SOCKET_BUFFER = 512 << 10  # a peer on this host: see tune_socket


def _same_host(sock: socket.socket) -> bool:
    """True when ``sock`` connects two ends on this host: a loopback peer address, or both ends
    with the same address (ranks that listen on one interface's address)."""
    if sock.family not in (socket.AF_INET, socket.AF_INET6):
        return False
    try:
        peer, local = sock.getpeername()[0], sock.getsockname()[0]
        return peer == local or ipaddress.ip_address(peer.split("%")[0]).is_loopback
    except (OSError, ValueError):
        return False


def local_socket_enabled() -> bool:
    """Whether ranks on one host connect by a Unix socket (DISTCOMM_TCP_LOCAL_SOCKET=0: no)."""
    return sys.platform.startswith("linux") and os.environ.get("DISTCOMM_TCP_LOCAL_SOCKET", "1") != "0"


def _open_local_listener(backlog: int) -> socket.socket | None:
    """An abstract-namespace Unix listener with a random name, or None where there is none."""
    if not local_socket_enabled():
        return None
    sock = None
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(b"\0distcomm-mesh-" + os.urandom(12).hex().encode())
        sock.listen(backlog)
    except OSError:
        if sock is not None:
            sock.close()
        return None
    return sock


def _connect_local(name: bytes, deadline: float) -> socket.socket | None:
    """A connection to a peer's Unix listener; None if it does not answer here (another host or
    network namespace), and the caller uses TCP."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(max(0.001, min(1.0, deadline - time.monotonic())))
        sock.connect(name)
        return sock
    except OSError:
        sock.close()
        return None


def tune_socket(sock: socket.socket) -> None:
    """TCP_NODELAY (small messages leave at once) and fixed kernel buffers: 4 MiB across hosts,
    512 KiB to a peer on this host (by loopback TCP or a Unix socket).

    Large buffers mean fewer sender wake-ups per large message, and 4 MiB (this machine's
    rmem_max) also bounds how much a large send parks in the kernel ahead of later frames. Over
    loopback the bytes are copied twice by CPUs of this host (into the socket by the sender, out
    by the receiver), and less in flight keeps them in cache between the two copies: measured
    (2 ranks, 64 MiB all_reduce on the TCP engine, process CPU per call, the sizes run in turn,
    seven rounds on a loaded 2-vCPU machine) 4 MiB mean 47.5 ms, 512 KiB 42.5, lower in 5 of the
    7 rounds (docs/performance-notes.md, "TCP engine, large all_reduce"). Fixed sizes switch off
    Linux's autotuning.
    """
    if sock.family == socket.AF_UNIX:
        size = LOOPBACK_SOCKET_BUFFER
    else:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        size = LOOPBACK_SOCKET_BUFFER if _same_host(sock) else SOCKET_BUFFER
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, size)
        except OSError:
            pass


def _store_host(store) -> str | None:
    """The host of the TCPStore under ``store`` (through PrefixStores), if it has one."""
    seen = 0
    while hasattr(store, "underlying_store") and seen < 64:
        store, seen = store.underlying_store, seen + 1
    host = getattr(store, "host", None)
    return host if isinstance(host, str) and host not in _WILDCARD else None


def listen_host(store, host: str | None = None) -> str:
    """The local address to listen on: ``host`` if given, else that of the interface named by
    ``DISTCOMM_SOCKET_IFNAME`` (interfaces.py), else the one that routes to the store.

    "Routes to" is asked of the kernel (a UDP socket connected to the store's host, which sends
    nothing): on one machine that is 127.0.0.1, across machines the interface facing the master.
    Never the wildcard unless the caller asks for it: a wildcard listener would accept from
    everywhere, and its address could not be published for peers to use.
    """
    if host:
        return host
    routed = _routed_host(store)
    return interfaces.selected(routed) or routed


def _routed_host(store) -> str:
    """The local address the kernel would use to reach the store's host."""
    target = _store_host(store) or os.environ.get("MASTER_ADDR") or socket.gethostname()
    try:
        family, _, _, _, addr = socket.getaddrinfo(target, 1, type=socket.SOCK_DGRAM)[0]
        if ipaddress.ip_address(addr[0]).is_loopback:
            return addr[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(addr)
            return probe.getsockname()[0]
    except (OSError, ValueError):
        return "127.0.0.1"


def encode_address(host: str, port: int) -> bytes:
    return f"{host}|{port}".encode()


def decode_address(value: bytes) -> tuple[str, int]:
    host, _, port = bytes(value).decode().rpartition("|")
    return host, int(port)


def connect_mesh(store, rank: int, size: int, timeout: float, host: str | None = None,
                 prefix: str = "tcp") -> dict[int, socket.socket]:
    """A connected, handshaken, tuned socket to every other rank: ``{peer global rank: socket}``."""
    deadline = time.monotonic() + timeout
    if size == 1:
        return {}
    try:
        bind_host = listen_host(store, host)
    except DistNetworkError as exc:
        raise DistNetworkError(f"rank {rank} cannot choose where to listen for its TCP peers: {exc}") from None
    # asked for the wildcard: listen everywhere, but publish an address peers can reach
    publish_host = bind_host if bind_host not in _WILDCARD else listen_host(store)
    family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    local_listener = _open_local_listener(size)
    socks: dict[int, socket.socket] = {}
    try:
        listener.bind((bind_host, 0))
        listener.listen(size)
        # the Unix name first: a peer that sees the address sees it too
        store.set(f"{prefix}/local/{rank}", local_listener.getsockname() if local_listener is not None else b"")
        store.set(f"{prefix}/addr/{rank}", encode_address(publish_host, listener.getsockname()[1]))
        if rank == 0:
            store.set(f"{prefix}/token", os.urandom(framing.TOKEN_BYTES))
        keys = [f"{prefix}/addr/{q}" for q in range(rank + 1, size)] + [f"{prefix}/token"]
        store.wait(keys, timedelta(seconds=max(0.001, deadline - time.monotonic())))
        token = bytes(store.get(f"{prefix}/token"))
        higher = range(rank + 1, size)
        for q in higher:
            local_name = bytes(store.get(f"{prefix}/local/{q}")) if local_listener is not None else b""
            sock = _connect_local(local_name, deadline) if local_name else None
            socks[q] = sock if sock is not None else _connect(decode_address(store.get(f"{prefix}/addr/{q}")), q, deadline)
            socks[q].sendall(framing.encode_hello(rank, q, size, token))
        listeners = [listener] if local_listener is None else [listener, local_listener]
        socks.update(_accept_lower(listeners, rank, size, token, deadline))
        for q in higher:
            hello = framing.decode_hello(_recv_exact(socks[q], framing.HELLO_SIZE, deadline, q))
            framing.check_hello(hello, token, size, rank)
            if hello.sender != q:
                raise framing.FramingError(f"the address published for rank {q} answered as rank {hello.sender}")
        for s in socks.values():
            s.settimeout(None)
            tune_socket(s)
        return socks
    except BaseException as exc:
        for s in socks.values():
            s.close()
        if isinstance(exc, (OSError, framing.FramingError)):
            raise DistNetworkError(f"rank {rank} could not connect the TCP mesh of {size} ranks: {exc}") from exc
        raise
    finally:
        listener.close()
        if local_listener is not None:
            local_listener.close()


def _remaining(deadline: float, what: str) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError(f"Timed out {what}")
    return left


def _connect(addr: tuple[str, int], peer: int, deadline: float) -> socket.socket:
    """Connect, retrying refusals until the deadline (a peer's listener may be briefly unreachable)."""
    while True:
        try:
            return socket.create_connection(addr, timeout=_remaining(deadline, f"connecting to rank {peer} at {addr}"))
        except (ConnectionRefusedError, ConnectionResetError):
            time.sleep(0.01)


def _recv_exact(sock: socket.socket, n: int, deadline: float, peer: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        sock.settimeout(_remaining(deadline, f"waiting for the hello of rank {peer}"))
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError(f"rank {peer} closed the connection during the handshake")
        buf += chunk
    return bytes(buf)


def _accept_lower(listeners: list[socket.socket], rank: int, size: int, token: bytes, deadline: float):
    """Accept (on any of ``listeners``) until every lower rank has said a valid hello; refuse
    anything else quietly."""
    accepted: dict[int, socket.socket] = {}
    pending: dict[socket.socket, bytearray] = {}
    sel = selectors.DefaultSelector()
    for listener in listeners:
        sel.register(listener, selectors.EVENT_READ)
    try:
        while len(accepted) < rank:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(rank)) - set(accepted))
                raise TimeoutError(f"ranks {missing} did not connect to rank {rank} in time; are they running, "
                                   "and can they reach this host?")
            for key, _ in sel.select(left):
                if key.fileobj in listeners:
                    conn, _ = key.fileobj.accept()
                    conn.setblocking(False)
                    pending[conn] = bytearray()
                    sel.register(conn, selectors.EVENT_READ)
                    continue
                conn = key.fileobj
                try:
                    chunk = conn.recv(framing.HELLO_SIZE - len(pending[conn]))
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    chunk = b""
                pending[conn] += chunk
                if chunk and len(pending[conn]) < framing.HELLO_SIZE:
                    continue
                data = pending.pop(conn)
                sel.unregister(conn)
                try:
                    if not chunk:
                        raise framing.FramingError("closed before its hello")
                    hello = framing.decode_hello(data)
                    framing.check_hello(hello, token, size, rank)
                    if hello.sender >= rank or hello.sender in accepted:
                        raise framing.FramingError(f"unexpected or duplicate hello from rank {hello.sender}")
                except framing.FramingError:
                    conn.close()  # a stray: another job, a scanner, a stale incarnation
                    continue
                conn.setblocking(True)
                conn.sendall(framing.encode_hello(rank, hello.sender, size, token))
                accepted[hello.sender] = conn
        return accepted
    except BaseException:
        for conn in list(pending) + list(accepted.values()):
            conn.close()
        raise
    finally:
        sel.close()
