"""Which shared-memory algorithm ran: an optional observer, for tests and debugging.

``set_observer(fn)`` installs ``fn(name)`` for this process: every shared-memory collective calls
it with the name of the algorithm it is about to run (the names ``choose`` returns, and
"alltoall_readv" when an all_to_all's ranks vote for single copies in its first round), and the
latency paths with "latency_<op>" for each call they take (latency.ROUNDS lists them);
"reduce_scatter_staged" when a reduce_scatter copies its inputs into scratch first (PREMUL_SUM, or an
output overlapping an input) rather than reducing from them in place. None (the
default) removes it; unobserved, a call pays one ``is None`` check.
"""

from __future__ import annotations

from typing import Callable, Optional

Observer = Callable[[str], None]

#: the installed observer (read it, set it through set_observer)
current: Optional[Observer] = None


def set_observer(fn: Optional[Observer]) -> Optional[Observer]:
    """Install ``fn`` (None: none); returns the observer it replaces."""
    global current
    previous, current = current, fn
    return previous
