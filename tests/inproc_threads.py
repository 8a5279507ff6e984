"""The in-process counterpart of harness.run_world: every rank of a world as a thread of the test.

``run_threads(n, fn)`` runs ``fn(rank, transport)`` on n threads over a fresh InprocTransport world,
with a deadline, and closes a rank's transport when its function raises, so the others fail
promptly instead of waiting out their timeouts (as a dead process's peers do).

A module of its own rather than part of harness.py: every spawned rank imports harness before its
function runs, and harness stays free of distcomm so that what a rank imports (and when, relative
to the environment the test gives it) is up to that function.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

from distcomm.transport.inproc import DEFAULT_EAGER_LIMIT, InprocTransport


def run_threads(
    n: int,
    fn: Callable[[int, InprocTransport], Any],
    timeout: float = 60.0,
    eager_limit: int = DEFAULT_EAGER_LIMIT,
    return_exceptions: bool = False,
) -> list[Any]:
    """Run ``fn(rank, transport)`` for every rank of a new n-rank world, each on its own thread.

    Returns the results by rank. A rank whose ``fn`` raises has its transport closed at once (its
    peers' pending requests fail with reason "lost"); then, unless ``return_exceptions``, the first
    rank to fail has its exception re-raised (the root cause; others' results are dropped), else exceptions take their
    rank's place in the list. Ranks still running after ``timeout`` seconds raise TimeoutError:
    every transport is closed to unblock them, and the error names the ranks.
    """
    transports = InprocTransport.create_world(n, eager_limit=eager_limit)
    results: list[Any] = [None] * n
    failed: list[int] = []  # ranks, in the order they failed

    def body(rank: int) -> None:
        try:
            results[rank] = fn(rank, transports[rank])
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            results[rank] = exc
            failed.append(rank)
            transports[rank].close()

    threads = [threading.Thread(target=body, args=(r,), name=f"inproc-rank{r}", daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    hung = [r for r, t in enumerate(threads) if t.is_alive()]
    for tr in transports:
        tr.close()
    if hung:
        for t in threads:
            t.join(1.0)
        raise TimeoutError(f"in-process world of {n}: ranks {hung} still running after {timeout}s")
    if failed and not return_exceptions:
        raise results[failed[0]]
    return results
