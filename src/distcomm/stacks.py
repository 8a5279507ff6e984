"""Stacks on demand: a worker started by distcomm-run prints every thread's Python stack on SIGUSR1.

``distcomm-run`` sets ``DISTCOMM_STACKS_ON_SIGUSR1=1`` in its workers' environment and forwards a
SIGUSR1 it receives to every worker that handles it; ``import distcomm`` then calls ``install``.
The dump is faulthandler's (``faulthandler.register(SIGUSR1, all_threads=True)``): written by a
C signal handler at once, even while the main thread is blocked in a collective, where a Python
handler would wait for the call to return. It writes to a pipe; a daemon thread prefixes each line
with ``[rank N] `` and copies it to stderr, so the stacks of many ranks can be told apart in the
launcher's merged output.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading

ENV = "DISTCOMM_STACKS_ON_SIGUSR1"
_installed = False


def install_from_env() -> None:
    """``install()`` when the launcher asked for it (``DISTCOMM_STACKS_ON_SIGUSR1=1``)."""
    if os.environ.get(ENV) == "1":
        install(os.environ.get("RANK", "?"))


def install(rank: str | int) -> None:
    """Dump all threads' stacks, each line prefixed ``[rank <rank>] ``, to stderr on SIGUSR1."""
    global _installed
    if _installed or not hasattr(signal, "SIGUSR1") or threading.current_thread() is not threading.main_thread():
        return
    read_fd, write_fd = os.pipe()
    os.set_inheritable(write_fd, False)
    faulthandler.register(signal.SIGUSR1, file=write_fd, all_threads=True)
    _installed = True
    prefix = f"[rank {rank}] "

    def copy() -> None:
        pending = b""
        while True:
            try:
                data = os.read(read_fd, 65536)
            except OSError:
                return
            if not data:
                return
            pending += data
            *lines, pending = pending.split(b"\n")
            if lines:
                text = "".join(f"{prefix}{line.decode(errors='replace')}\n" for line in lines)
                try:
                    sys.stderr.write(text)
                    sys.stderr.flush()
                except (OSError, ValueError, AttributeError):
                    pass

    threading.Thread(target=copy, name="distcomm-stacks", daemon=True).start()
