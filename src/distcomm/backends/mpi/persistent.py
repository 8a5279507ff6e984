"""Small native all_reduces, barriers and the calls' agreement as persistent MPI requests (MPI 4's
``Allreduce_init``, ``Barrier_init``, ``Allgather_init``).

Why: MPICH builds a persistent collective's schedule once, at its initialisation, where a
nonblocking ``Iallreduce`` or ``Ibarrier`` builds one on every call; an 8-byte all_reduce as
``Start`` and ``Test`` of a persistent request costs less than even a blocking ``Allreduce``, and
being nonblocking it is still tested against the call's deadline (docs/performance-notes.md, "The
MPI engine's small all_reduce as a persistent request").

Matching. MPI matches a persistent collective only with persistent ones, and every member must
initialise the group's persistent collectives in the same order. So a request is keyed only by
what every rank's call has in common (the element count, the MPI datatype and op, and the call's
signature less its root: op, dtype and reduce op), and it runs on a staging array of its own, never
on the caller's memory (whose address differs between ranks and calls). Every member makes a
request (``make``), and keeps it (``keep``, which frees the oldest past ``CAPACITY``) at the same
call of the group's sequence: the first all_reduce of its key and count, whose rows the ranks
compare first (agreement.py; collectives.py's ``first_all_reduce``): a request is kept only when
every rank made it for the same signature and count, so ranks that start the same request agree
on both, and ranks that start different ones are never matched by MPI (MPICH's persistent
collectives each have a context of their own; tests/test_mpi_mismatch.py holds it to that): they
wait, and the long-wait check finds them (collectives.py). Every native all_reduce of at most
``LIMIT`` bytes goes through here, from the latency path and from the general path alike, so a
rank on either meets the others. An MPI library without persistent collectives (MPI 3) refuses the
first initialisation on every rank alike; from then on every such call is an ``Iallreduce``. A
barrier has one request per group, made by the group's first barrier (on every rank: every barrier
goes through here too); the agreement's ``Allgather_init`` is made with the group.
"""

from __future__ import annotations

import numpy as np

#: bytes: the largest all_reduce run as a persistent request (its staging copies are the price)
LIMIT = 64 * 1024
#: persistent requests kept per group (the oldest is freed first: the same one on every rank)
CAPACITY = 16


class PersistentRequests:
    """A group's persistent all_reduce requests, each with its staging array, its persistent
    barrier and its agreement's request (see the module docstring)."""

    def __init__(self, comm, MPI):
        self._comm = comm
        self._MPI = MPI
        self._made: dict = {}  # (id of the MPI datatype, of the MPI op, signature) -> {count: (staging, request)}
        self._order: list = []  # (that key, count) of every request kept, oldest first
        self._barrier = None
        self._agreement = None  # (table, request) of the group's agreement, or None where MPI has none
        self.available = True  # False once MPI refused: every member then runs Iallreduce and Ibarrier

    def barrier(self):
        """The group's persistent barrier request (made on first use), or None where MPI has no
        persistent collectives (the caller then runs ``Ibarrier``)."""
        if self._barrier is None and self.available:
            try:
                self._barrier = self._comm.Barrier_init()
            except NotImplementedError:
                self.available = False
        return self._barrier

    def agreement(self, table: np.ndarray):
        """The persistent ``Allgather_init`` of ``table`` in place (one row per rank: agreement.py),
        made on first use with that table (called when the group is made, on every member), or None
        where MPI has none (the caller then runs ``Iallgather``)."""
        if self._agreement is None and self.available:
            try:
                self._agreement = (table, self._comm.Allgather_init(self._MPI.IN_PLACE, [table, self._MPI.INT64_T]))
            except NotImplementedError:
                self.available = False
        return None if self._agreement is None else self._agreement[1]

    @staticmethod
    def _key(mtype, mop, sig: int | None) -> tuple:
        # predefined MPI datatypes and ops are mpi4py singletons: their ids stand for them
        return (id(mtype), id(mop), None if sig is None else sig & 0xFFFFFF)

    def made(self, mtype, mop, sig: int | None = None) -> dict:
        """{count: (staging array, request, its handle's address)} of the requests kept for this MPI
        datatype and op and the call's signature (``sig``: its root bits are ignored; the address:
        library.py's): the group's own dict, which a caller may keep and look a count up in
        (``keep`` adds to it, the eviction of the oldest removes from it)."""
        key = self._key(mtype, mop, sig)
        made = self._made.get(key)
        if made is None:
            made = self._made[key] = {}
        return made

    def all_reduce(self, flat: np.ndarray, mtype, mop, sig: int | None = None):
        """The kept request for an all_reduce of ``flat``'s count (``made``'s entry), made and kept
        now if there is none: with no agreement among the ranks (the engine's calls make theirs with
        ``make`` and ``keep`` around one: collectives.py's ``first_all_reduce``). None for more than
        LIMIT bytes, or where MPI has no persistent collectives."""
        staged = self.made(mtype, mop, sig).get(flat.size)
        if staged is not None or flat.nbytes > LIMIT or not flat.size:
            return staged
        staged = self.make(flat.size, flat.dtype, mtype, mop)
        if staged is not None:
            self.keep(staged, mtype, mop, sig)
        return staged

    def make(self, count: int, dtype, mtype, mop):
        """A new persistent in-place all_reduce of ``count`` elements of numpy ``dtype`` (at most
        LIMIT bytes, not empty): (staging array, request, its handle's address), not yet kept; None
        where MPI has no persistent collectives (the caller then runs ``Iallreduce``). Every member
        calls it at the same call; then every member ``keep``s it, or ``Free``s it."""
        if not self.available:
            return None
        staging = np.empty(count, dtype)
        try:
            request = self._comm.Allreduce_init(self._MPI.IN_PLACE, [staging, mtype], mop)
        except NotImplementedError:
            self.available = False
            return None
        return staging, request, self._MPI._addressof(request)

    def keep(self, staged, mtype, mop, sig: int | None = None) -> None:
        """Keep ``staged`` (``make``'s) for its count under (mtype, mop, sig), freeing the oldest
        request past CAPACITY (the same on every rank)."""
        made = self.made(mtype, mop, sig)
        count = staged[0].size
        if len(self._order) >= CAPACITY:  # the oldest: the same on every rank
            key, old_count = self._order.pop(0)
            _, oldest, _ = self._made[key].pop(old_count)
            oldest.Free()
        made[count] = staged
        self._order.append((self._key(mtype, mop, sig), count))

    def free(self) -> None:
        """Free every request (each inactive: the group's calls have all completed). Called when
        the group is released, before its communicator is."""
        requests = [request for made in self._made.values() for _, request, _ in made.values()]
        if self._barrier is not None:
            requests.append(self._barrier)
        if self._agreement is not None:
            requests.append(self._agreement[1])
        for made in self._made.values():  # a caller keeping one finds nothing there from now on
            made.clear()
        self._order, self._barrier, self._agreement = [], None, None
        if self._MPI.Is_finalized():
            return
        for request in requests:
            request.Free()
