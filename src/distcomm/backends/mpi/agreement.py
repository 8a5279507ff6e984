"""What the ranks of a call must agree on before MPI's answer can be trusted, and the words of a
disagreement: the MPI engine's size, dtype, op and root checks (pure: no MPI here).

Why: MPI checks none of it. MPICH 5, at world size 2, completes an ``Iallreduce``, a persistent
all_reduce, ``Ireduce``, ``Iallgather``, ``Igather``, ``Iscatter``, ``Ireduce_scatter_block`` and
``Ialltoallv`` whose ranks passed different sizes (or dtypes) without an error, and returns what
was in the buffers: a receive longer than the message keeps stale bytes, a longer message is cut
(even ``Ialltoallv`` does not report the truncation), a reduction adds memory nobody sent. Only
``Ibcast`` fails, and only on the receivers (the root returns). So every rank describes its call
in one row of ``WORDS`` int64, and the rows are compared:

* ``SEQ``: the call's sequence number in the group;
* ``SIG``: its signature (signatures.py: op, dtype, reduce op, root modulo 255);
* ``ROOT``: the whole root (-1 without one);
* ``SIZE``: the bytes every rank passes alike (all_reduce, reduce, broadcast: the buffer; all_gather,
  gather: each rank's input; scatter: each rank's output; reduce_scatter: the whole input), -1 for
  all_to_all, whose sizes differ per pair;
* ``SPLITS``: a digest of reduce_scatter's block counts, which every rank passes alike;
* ``SENT``, ``EXPECTED``: all_to_all's digests of what this rank sends to each rank and of what it
  expects from each: summed over the ranks, the two are equal when every pair agrees (a weighted
  sum with a fixed odd 64-bit weight per (sender, receiver) pair: a disagreement that sums to the
  same value needs the differences to cancel modulo 2**64 under those weights).

``judge`` is a function of the whole table of rows, so every rank reaches the same verdict: all
raise, or none. ``describe`` puts a disagreement into words, both ranks' values named as the
shared-memory engine's messages do (``transport/shm_group.describe_mismatch``); a disagreement in
the splits or pairs needs every rank's counts (``details``: each rank's row of a second exchange,
made only then: collectives.py's ``exchange_details``).
"""

from __future__ import annotations

import struct
from operator import mul
from typing import NamedTuple, Sequence

import numpy as np

from ...signatures import ROOT_NAMES, decode, differences

WORDS = 8
SEQ, SIG, ROOT, SIZE, SPLITS, SENT, EXPECTED = range(7)
#: the words every rank of a call has alike (all but the all_to_all digests)
SHARED = 5
NONE = -1

_MASK = (1 << 64) - 1
SAME_CALLS = "every rank of the group must make the same collective calls, in the same order"


def row(seq: int, sig: int, size: int = NONE, root: int = NONE, splits: int = 0, sent: int = 0,
        expected: int = 0) -> tuple:
    """A call's row (see the module docstring)."""
    return (seq, sig, root, size, splits, sent, expected, 0)


def _mix(x: int) -> int:
    """splitmix64's finaliser: a well-spread 64-bit value of ``x``."""
    x &= _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def _signed(x: int) -> int:
    x &= _MASK
    return x - (1 << 64) if x >> 63 else x


class Weights:
    """The fixed weights of one rank in a group of ``n`` (computed once per group): of its sends
    (``out[j]``: to rank j), of its receives (``into[j]``: from rank j), of the splits (``split[q]``)."""

    def __init__(self, n: int, rank: int):
        self.out = [_mix((rank * n + j) * 2 + 1) | 1 for j in range(n)]
        self.into = [_mix((j * n + rank) * 2 + 1) | 1 for j in range(n)]
        self.split = [_mix(2 * (n * n + q)) | 1 for q in range(n)]
        self._split_sum = sum(self.split)

    def splits(self, counts: Sequence[int]) -> int:
        """SPLITS of reduce_scatter's block counts."""
        return _signed(sum(map(mul, map(int, counts), self.split)))

    def even(self, count: int) -> int:
        """``splits([count] * n)``, at the cost of one product."""
        return _signed(count * self._split_sum)

    def pairs(self, send_counts: Sequence[int], recv_counts: Sequence[int]) -> tuple[int, int]:
        """(SENT, EXPECTED) of this rank's all_to_all counts."""
        return (_signed(sum(map(mul, map(int, send_counts), self.out))),
                _signed(sum(map(mul, map(int, recv_counts), self.into))))


class Verdict(NamedTuple):
    """A disagreement: ``peer`` (group rank) is the rank to name; ``needs_details``: the splits or
    pairs differ and nothing else does (then every rank makes the second exchange: ``details``)."""

    peer: int
    needs_details: bool


_ROW_BYTES, _SHARED_BYTES, _DIGESTS_AT = WORDS * 8, SHARED * 8, SENT * 8
_DIGESTS = struct.Struct("=QQ")  # SENT, EXPECTED as unsigned: their sums are taken modulo 2**64


def judge(table: np.ndarray, rank: int) -> Verdict | None:
    """None when every row agrees (``table``: one row per group rank), else the verdict. Every rank
    of the call gets the same table, so every rank finds a disagreement or none; the peer named is
    the first rank whose row differs from this rank's (or, for the pairs, from the first row).

    Every call runs it: agreement is read from the table's bytes (a few slices a row, where numpy
    would spend 8 µs on a table of two rows); ``disagreement`` says what differs when something does."""
    raw = table.tobytes()
    first = raw[:_ROW_BYTES]
    if raw == first * (len(raw) // _ROW_BYTES) and first[_DIGESTS_AT:_DIGESTS_AT + 8] == \
            first[_DIGESTS_AT + 8:_DIGESTS_AT + 16]:
        return None  # every row the same (every call but all_to_all, where they differ)
    head = raw[:_SHARED_BYTES]
    sent = expected = 0
    for at in range(0, len(raw), _ROW_BYTES):
        if raw[at:at + _SHARED_BYTES] != head:
            return disagreement(table, rank)
        s, e = _DIGESTS.unpack_from(raw, at + _DIGESTS_AT)
        sent += s
        expected += e
    if (sent - expected) & _MASK:
        return Verdict(0 if rank else 1, True)
    return None


def disagreement(table: np.ndarray, rank: int) -> Verdict | None:
    """``judge``'s verdict, computed on the whole table."""
    shared = table[:, :SHARED]
    differing = np.flatnonzero((shared != shared[rank]).any(axis=1))
    rest_agree = not (table[:, :SPLITS] != table[0, :SPLITS]).any()
    if differing.size:
        return Verdict(int(differing[0]), rest_agree)
    sums = table[:, SENT:EXPECTED + 1].astype(np.uint64).sum(axis=0, dtype=np.uint64)
    if sums[0] != sums[1]:
        return Verdict(0 if rank else 1, True)
    return None


def details(n: int, splits: Sequence[int] | None = None, send_counts: Sequence[int] | None = None,
            recv_counts: Sequence[int] | None = None) -> np.ndarray:
    """This rank's row of the second exchange (``2 n`` int64, alike in size on every rank): the
    splits and zeros, or the send counts then the receive counts (in bytes)."""
    out = np.zeros(2 * n, np.int64)
    if splits is not None:
        out[:n] = splits
    if send_counts is not None:
        out[:n] = send_counts
        out[n:] = recv_counts
    return out


# -- the words --------------------------------------------------------------------------------
def _call(r: Sequence[int]):
    """The decoded signature of a row, with its whole root."""
    d = decode(int(r[SIG]))
    return d._replace(root=int(r[ROOT])) if d.root is not None else d


def call_words(r: Sequence[int]) -> str:
    """``all_reduce (float32, op=SUM, 16 bytes)``: a row's call, for messages."""
    d = _call(r)
    parts = [d.argument(f) for f in ("dtype", "reduce_op", "root") if getattr(d, f) is not None]
    if r[SIZE] >= 0:
        parts.append(f"{int(r[SIZE])} bytes")
    return f"{d.op} ({', '.join(parts)})" if parts else d.op


def describe(mine: Sequence[int], theirs: Sequence[int], peer: int, table_details: np.ndarray | None = None,
             rank: int | None = None) -> str:
    """What differs between this rank's row and group rank ``peer``'s, in words, with both values
    and what to do. ``table_details``: every rank's row of the second exchange (for the splits of
    reduce_scatter and the pairs of all_to_all; ``rank``: this rank's group rank)."""
    seq, their_seq = int(mine[SEQ]), int(theirs[SEQ])
    a, b = _call(mine), _call(theirs)
    if seq != their_seq:
        return (f"rank {peer} is at call #{their_seq} of this group ({call_words(theirs)}) where this rank is at "
                f"call #{seq} ({call_words(mine)}): one of them skipped a collective call or made an extra one; "
                f"{SAME_CALLS}")
    fields = [f for f in differences(int(mine[SIG]), int(theirs[SIG])) if f != "root"]
    if fields == ["op"]:
        return (f"at call #{seq} of this group this rank called {call_words(mine)} but rank {peer} called "
                f"{call_words(theirs)}; {SAME_CALLS}")
    if mine[ROOT] != theirs[ROOT]:
        what = ROOT_NAMES.get(a.op, "root")
        return (f"this rank called {a.op} with {what}={int(mine[ROOT])} but rank {peer} with {what}="
                f"{int(theirs[ROOT])} (group ranks); every rank of the group must pass the same {what}")
    if mine[SIZE] != theirs[SIZE]:
        fields.append("size")
    if fields:
        def values(d, r) -> str:
            return " and ".join(f"{int(r[SIZE])} bytes" if f == "size" else d.argument(f) for f in fields)

        what = " and ".join({"reduce_op": "reduce op"}.get(f, f) for f in fields)
        return (f"in {a.op} #{seq} this rank passed {values(a, mine)} but rank {peer} passed {values(b, theirs)}; "
                f"every rank of the group must pass the same {what}")
    if table_details is not None and mine[SPLITS] != theirs[SPLITS]:
        n = table_details.shape[0]
        own, other = table_details[rank, :n].tolist(), table_details[peer, :n].tolist()
        return (f"in {a.op} #{seq} this rank split its input into blocks of {own} bytes but rank {peer} into "
                f"blocks of {other} bytes; every rank of the group must pass the same block sizes")
    if table_details is not None:
        pair = _disagreeing_pair(table_details, rank)
        if pair is not None:
            i, j, sends, expects = pair
            return (f"in {a.op} #{seq} rank {i} sends {sends} bytes to rank {j}, which expects {expects} bytes "
                    f"from it; what a rank sends to rank j must be the size rank j receives from it (rank {i}'s "
                    f"input split for rank {j} is rank {j}'s output split for rank {i})")
    return (f"in {a.op} #{seq} rank {peer}'s call does not match this rank's ({call_words(mine)}), though no "
            f"field this rank can name differs; {SAME_CALLS}, with the same sizes")


def _disagreeing_pair(table_details: np.ndarray, rank: int | None):
    """(sender, receiver, bytes sent, bytes expected) of a pair that disagrees, one with ``rank`` in
    it first; None if none does."""
    n = table_details.shape[0]
    sends, expects = table_details[:, :n], table_details[:, n:]
    found = None
    for i in range(n):
        for j in range(n):
            if sends[i, j] != expects[j, i]:
                hit = (i, j, int(sends[i, j]), int(expects[j, i]))
                if rank in (i, j):
                    return hit
                found = found or hit
    return found


def peer_of_pair(table_details: np.ndarray, rank: int, default: int) -> int:
    """The rank to name in an all_to_all's pair disagreement: the other end of a pair this rank is
    in, else the sender of the first pair that disagrees."""
    pair = _disagreeing_pair(table_details, rank)
    if pair is None:
        return default
    i, j = pair[0], pair[1]
    return j if i == rank else i


def differs(mine: Sequence[int], theirs: Sequence[int]) -> bool:
    """Whether two rows of the same call (same SEQ) disagree in what every rank passes alike."""
    return any(int(mine[k]) != int(theirs[k]) for k in (SIG, ROOT, SIZE, SPLITS))
