"""The generic algorithms' selection thresholds (bytes); the measurements behind them are in
docs/performance-notes.md ("Generic algorithm thresholds").

``select.choose`` reads them (over a Tuning's ``DISTCOMM_THRESHOLD_<NAME>`` values); the pipelined
ring takes its default segment size and window from here.
"""

from __future__ import annotations

THRESHOLDS: dict[str, int] = {
    "allreduce_small_bytes": 64 * 1024,
    # two ranks: recursive doubling wins to 256 KiB, halving-doubling from 512 KiB (measured)
    "allreduce_small_bytes_2ranks": 256 * 1024,
    # Two ranks above this: the pipelined ring. Under load it holds up better (a descheduled rank
    # stalls one segment, not a 32 MiB phase); segments under 2 MiB pay more in per-message
    # overhead than they gain; at 4 MiB each block is one segment, so the threshold sits above it.
    # At world 3 there was no clear winner, so the ring stays the default there.
    "allreduce_pipelined_bytes_2ranks": 8 << 20,
    "allreduce_segment_bytes": 4 << 20,
    "allreduce_segment_window": 4,
    # An exchange (one message each way) of at least this many bytes first swaps zero-byte
    # "receive posted" tokens, so the data never arrives unexpected and is copied twice
    # (_blocks.send_when_ready; the token round trip is ~0.1 ms under load, a 256 KiB copy
    # into fresh memory about as much). Read from here only (not DISTCOMM_THRESHOLD_*): the
    # algorithms that use it are not given the Tuning.
    "ready_exchange_bytes": 256 * 1024,
    "broadcast_large_bytes": 512 * 1024,
    "allgather_small_bytes": 64 * 1024,
    # the default engine, a group spread evenly over hosts: hierarchical all_reduce from here up
    # (_algorithms/allreduce_hierarchical.py). Across two namespaced hosts it beats the TCP engine
    # from 1 MiB and about ties it at 256 KiB (docs/performance-notes.md, "Across hosts")
    "allreduce_hierarchical_bytes": 256 * 1024,
    # its cross-host phase between two hosts: one exchange of the whole slice up to here (slice
    # bytes; halving-doubling's two rounds above, where the one exchange lost at 32 MiB)
    "allreduce_hierarchical_cross_exchange_bytes": 2 << 20,
    # and its reduce-scatter inside a host on the shared-memory collectives up to here (all_reduce
    # bytes), point to point above, where their slot algorithm cost ~2x the CPU of the ring at
    # 4 and 16 MiB (its all-gather is always on the shared-memory collectives)
    "allreduce_hierarchical_host_scatter_bytes": 2 << 20,
}
