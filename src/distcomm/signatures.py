"""Message signatures: a 32-bit summary of a collective (op, dtype, reduce op, root) on every message.

Ranks that call different collectives, or the same one on different dtypes, reduce ops or roots, at
the same sequence number of a group then see a mismatch error instead of exchanging each other's
bytes. Layout: ``root+1`` (low 8 bits; 0 for collectives without a root) << 24 | opcode << 16 |
dtype code << 8 | reduce op. Roots that differ by a multiple of 255 share a signature; the root
check of ProcessGroup (every rank tells its ring neighbour its whole root) still tells them apart.
"""

from __future__ import annotations

from typing import NamedTuple

from .dtypes import BY_CODE
from .types import RedOpType

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


#: the collectives whose signature carries a reduce op (in every other one its bits are 0, not SUM)
REDUCING = frozenset({"all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor", "all_reduce_coalesced",
                      "all_reduce_sparse"})
#: the rooted collectives, and their root argument's name
ROOT_NAMES = {"broadcast": "src", "scatter": "src", "broadcast_object_list": "src", "scatter_object_list": "src",
              "reduce": "dst", "gather": "dst", "gather_object": "dst"}
_OP_NAMES = {code: name for name, code in OPCODES.items()}


class Decoded(NamedTuple):
    """A signature in words (``decode``): what error messages say instead of its hex."""

    op: str  # the collective's name, or "opcode 0x..." for a code distcomm does not know
    dtype: str | None  # torch's name of the dtype; None when the signature carries none
    reduce_op: str | None  # "SUM", "MAX", ...; None for a collective that does not reduce
    root: int | None  # the root modulo 255 (what the signature holds); None without one

    def argument(self, field: str) -> str:
        """One field as the caller passed it: "float32", "op=MAX", "src=2"."""
        if field == "dtype":
            return str(self.dtype)
        if field == "reduce_op":
            return f"op={self.reduce_op}"
        return f"{ROOT_NAMES.get(self.op, 'root')}={self.root}"

    def describe(self) -> str:
        """``all_reduce (float32, op=SUM)``, ``broadcast (float32, src=0)``, ``barrier``."""
        parts = [self.argument(f) for f in ("dtype", "reduce_op", "root") if getattr(self, f) is not None]
        return f"{self.op} ({', '.join(parts)})" if parts else self.op


def decode(sig: int) -> Decoded:
    """The op, dtype, reduce op and root a signature encodes."""
    opcode, dtype_code, reduce_code, root_bits = (sig >> 16) & 0xFF, (sig >> 8) & 0xFF, sig & 0xFF, (sig >> 24) & 0xFF
    op = _OP_NAMES.get(opcode, f"opcode {opcode:#x}")
    dtype = BY_CODE[dtype_code].name if dtype_code in BY_CODE else (f"dtype code {dtype_code}" if dtype_code else None)
    reduce_op = None
    if op in REDUCING or (opcode not in _OP_NAMES and reduce_code):
        try:
            reduce_op = RedOpType(reduce_code).name
        except ValueError:  # a code this version does not know
            reduce_op = str(reduce_code)
    return Decoded(op, dtype, reduce_op, root_bits - 1 if root_bits else None)


def describe_receive(sig: int) -> str:
    """``describe()`` of the call a rank is in when its receive expects ``sig``: a point-to-point
    receive expects the sender's signature (``send``, with the receiving buffer's dtype), so it is
    described as the ``recv`` it is ("recv (float64)"); a collective's receive as its collective."""
    decoded = decode(sig)
    if decoded.op == "send":
        decoded = decoded._replace(op="recv")
    return decoded.describe()


def differences(mine: int, theirs: int) -> list[str]:
    """The fields in which two signatures differ, in the order a reader should hear them:
    "op" (then nothing else counts), else some of "dtype", "reduce_op", "root"."""
    a, b = decode(mine), decode(theirs)
    if a.op != b.op:
        return ["op"]
    return [f for f in ("dtype", "reduce_op", "root") if getattr(a, f) != getattr(b, f)]
