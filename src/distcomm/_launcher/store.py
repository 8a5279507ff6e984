"""The job store: node rank 0's launcher hosts it, every other launcher and every worker connects.

This is the only module that names a TCPStore class, so the launcher has one dependency on the
store package and none on torch. The launcher only uses ``add``, ``set`` and ``get`` (every wait is
a poll of a counter with ``add(key, 0)``), so a signal reaches the launcher promptly and a lost
store shows up as an exception on the next poll.

Authentication needs nothing here: TCPStore reads DISTCOMM_AUTH_KEY_FILE / DISTCOMM_AUTH_KEY, so
the store this launcher hosts requires the key when the launcher was given one, and the workers,
which inherit the launcher's environment, present it. An authentication error is not retried.
"""

from __future__ import annotations

import errno
import socket
import time
from datetime import timedelta

from .config import LaunchError


def _tcp_store_class():
    from distcomm.store import TCPStore

    return TCPStore


def _is_auth_error(exc: BaseException) -> bool:
    from distcomm.store.tcp.auth import DistStoreAuthError

    return isinstance(exc, DistStoreAuthError)


def _port_in_use(port: int) -> bool:
    """Whether binding ``port`` on every interface fails with EADDRINUSE right now."""
    for family, addr in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind((addr, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return True
    return False


def host_store(addr: str, port: int, timeout: float, multi_node: bool):
    """Start the job's store server in this process, on ``port`` (0: a free one); return it.

    A port already in use becomes a LaunchError naming host:port and what to do instead.
    """
    TCPStore = _tcp_store_class()
    try:
        return TCPStore(addr, port, None, True, timedelta(seconds=timeout), wait_for_workers=False)
    except Exception as exc:
        if port and _port_in_use(port):
            hint = (
                "another job (or another launcher started with --node-rank 0) is using it. "
                if multi_node
                else "another job is using it. "
            )
            raise LaunchError(
                f"cannot host the job store on {addr}:{port}: the port is already in use; {hint}"
                "Pick a free port with --master-port 0 (single node) or another --master-port, "
                "or use --standalone for a single-node job."
            ) from exc
        raise LaunchError(f"cannot host the job store on {addr}:{port}: {exc}") from exc


def loopback_only(addr: str) -> str | None:
    """The loopback address ``addr`` resolves to here when it is a name other than localhost (as
    Debian's /etc/hosts maps the host's own name to 127.0.1.1), else None. A store listening there
    cannot be reached from another host, though the other hosts resolve the name elsewhere."""
    import ipaddress

    if addr.lower() in ("localhost", "localhost.localdomain"):
        return None
    try:
        ipaddress.ip_address(addr)
        return None  # a literal address is what the user meant
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(addr, None, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        first = ipaddress.ip_address(infos[0][4][0].split("%", 1)[0])
    except (OSError, ValueError, IndexError):
        return None
    return str(first) if first.is_loopback else None


def connect_store(addr: str, port: int, timeout: float):
    """Connect to the store hosted by node rank 0's launcher, retrying until ``timeout`` seconds."""
    TCPStore = _tcp_store_class()
    deadline = time.monotonic() + timeout
    while True:
        try:
            return TCPStore(addr, port, None, False, timedelta(seconds=max(1.0, min(timeout, 30.0))))
        except Exception as exc:
            if _is_auth_error(exc):  # a key does not change by waiting
                raise LaunchError(f"cannot use the job store at {addr}:{port}: {exc}") from exc
            if time.monotonic() >= deadline:
                raise LaunchError(
                    f"cannot reach the job store at {addr}:{port} (hosted by the --node-rank 0 "
                    f"launcher) within {timeout:.0f} s: {exc}. Start node rank 0 with the same "
                    "--master-addr/--master-port, or check that the address is reachable."
                ) from exc
            time.sleep(0.2)


def counter(store, key: str) -> int:
    """The value of a counter key (0 if never added to), without blocking."""
    return int(store.add(key, 0))
