"""The generic algorithms' selection thresholds (bytes), with the measurements behind them.

``select.choose`` reads them (over a Tuning's ``DISTCOMM_THRESHOLD_<NAME>`` values); the pipelined
ring takes its default segment size and window from here.
"""

from __future__ import annotations

THRESHOLDS: dict[str, int] = {
    "allreduce_small_bytes": 64 * 1024,
    # Two ranks, tcp engine, loopback (distcomm-bench --algo all_reduce=..., two runs each, shared
    # 2-vCPU machine; µs, recursive doubling / halving-doubling):
    #   64 KiB 293/396, 215/331   128 KiB 303/388, 268/370   256 KiB 358/492, 363/475
    #   512 KiB 792/661, 784/668   1 MiB 1833/1143, 1790/1044   2 MiB 4004/2759, 3842/3802
    # Recursive doubling wins to 256 KiB, halving-doubling from 512 KiB.
    "allreduce_small_bytes_2ranks": 256 * 1024,
    # Two ranks above this: the pipelined ring (allreduce_ring_pipelined; at p = 2 it is
    # halving-doubling cut into segments). distcomm-bench --backend tcp --world 2 -b 4M -e 64M -f 4
    # --compare torch, speedup = gloo time / ours, one row per run, shared 2-vCPU machine:
    #   quiet (load ~1), 64 MiB: halving-doubling 1.27 1.23 1.12 1.24; pipelined 1 MiB/4: 0.97 0.57
    #     1.06 1.03, 2 MiB/4: 1.11 1.12 1.04 1.14, 4 MiB/2: 1.10 1.04 1.45 0.98
    #   loaded (load 3.5-4.6), halving-doubling (receives of the all-gather posted early) /
    #     pipelined 4 MiB, window 4 / window 2 / 2 MiB, 4 / 8 MiB, 4:
    #     64 MiB  0.52 0.80 0.54 / 0.94 1.03 0.85 / 0.90 0.87 1.26 / 0.86 0.78 0.58 / 0.78 0.75 0.68
    #     16 MiB  0.67 0.56 0.59 / 0.93 0.93 0.39 / 0.78 1.03 1.02 / 0.78 0.73 0.81 / 0.85 1.07 0.77
    #     4 MiB   0.86 0.69 0.98 / 0.62 0.96 0.63 / 0.84 1.14 2.10 / 0.75 0.60 0.85 / 1.10 1.06 0.68
    # Under load the pipeline holds up better (a descheduled rank stalls one segment, not a 32 MiB
    # phase); segments under 2 MiB pay more in per-message overhead than they gain. At 4 MiB each
    # block is one segment, so the threshold sits above it. World 3 (ring / pipelined, 64 MiB):
    # 0.58 0.92 / 0.93 0.71, 4 MiB 1.51 0.47 / 0.70 0.73: no clear winner on two shared cores, so
    # the ring stays the default there (DISTCOMM_ALGO_ALLREDUCE=ring_pipelined selects it).
    "allreduce_pipelined_bytes_2ranks": 8 << 20,
    "allreduce_segment_bytes": 4 << 20,
    "allreduce_segment_window": 4,
    "broadcast_large_bytes": 512 * 1024,
    "allgather_small_bytes": 64 * 1024,
}
