"""Message signatures: a 32-bit summary of a collective (op, dtype, reduce op, root) on every message.

Ranks that call different collectives, or the same one on different dtypes, reduce ops or roots, at
the same sequence number of a group then see a mismatch error instead of exchanging each other's
bytes. Layout: ``root+1`` (low 8 bits; 0 for collectives without a root) << 24 | opcode << 16 |
dtype code << 8 | reduce op. Roots that differ by a multiple of 255 share a signature; the root
check of ProcessGroup (every rank tells its ring neighbour its whole root) still tells them apart.
"""

from __future__ import annotations

# Operation codes carried in message signatures, so ranks running different collectives at the
# same sequence number see a mismatch instead of exchanging each other's bytes.
OPCODES = {
    name: i + 1
    for i, name in enumerate(
        [
            "broadcast", "all_reduce", "reduce", "all_gather", "all_gather_into_tensor", "gather",
            "scatter", "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single",
            "barrier", "monitored_barrier", "broadcast_object_list", "all_gather_object",
            "gather_object", "scatter_object_list", "object_sizes", "send", "recv",
            # appended, so the codes above keep their values
            "all_reduce_coalesced", "all_gather_coalesced", "all_reduce_sparse",
        ]
    )
}


def signature(op: str, dtype_code: int = 0, reduce_code: int = 0, root: int | None = None) -> int:
    sig = (OPCODES[op] << 16) | ((dtype_code & 0xFF) << 8) | (reduce_code & 0xFF)
    if root is not None:
        sig |= ((root % 255) + 1) << 24
    return sig


def without_root(sig: int) -> int:
    """The signature with its root bits cleared."""
    return sig & 0xFFFFFF
