"""Small native all_reduces, and barriers, as persistent MPI requests (MPI 4's ``Allreduce_init``,
``Barrier_init``).

Why: MPICH builds a persistent collective's schedule once, at its initialisation, where a
nonblocking ``Iallreduce`` or ``Ibarrier`` builds one on every call; an 8-byte all_reduce as
``Start`` and ``Test`` of a persistent request costs less than even a blocking ``Allreduce``, and
being nonblocking it is still tested against the call's deadline (docs/performance-notes.md, "The
MPI engine's small all_reduce as a persistent request").

Matching. MPI matches a persistent collective only with persistent ones, and every member must
initialise the group's persistent collectives in the same order. So a request is keyed only by
what every rank's call has in common (the element count, the MPI datatype and the MPI op, which MPI
requires to agree anyway), and it runs on a staging array of its own, never on the caller's memory
(whose address differs between ranks and calls): every member makes a request, or frees the oldest
past ``CAPACITY``, at the same call of the group's sequence. Every native all_reduce of at most
``LIMIT`` bytes goes through here, from the latency path and from the general path alike, so a rank
on either meets the others. An MPI library without persistent collectives (MPI 3) refuses the
first initialisation on every rank alike; from then on every such call is an ``Iallreduce``. A
barrier has one request per group, made by the group's first barrier (on every rank: every barrier
goes through here too).
"""

from __future__ import annotations

import numpy as np

#: bytes: the largest all_reduce run as a persistent request (its staging copies are the price)
LIMIT = 64 * 1024
#: persistent requests kept per group (the oldest is freed first: the same one on every rank)
CAPACITY = 16


class PersistentRequests:
    """A group's persistent all_reduce requests, each with its staging array, and its persistent
    barrier (see the module docstring)."""

    def __init__(self, comm, MPI):
        self._comm = comm
        self._MPI = MPI
        self._made: dict = {}  # (id of the MPI datatype, of the MPI op) -> {count: (staging, request)}
        self._order: list = []  # (that key, count) of every request kept, oldest first
        self._barrier = None
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

    def made(self, mtype, mop) -> dict:
        """{count: (staging array, request, its handle's address)} of the requests kept for this MPI
        datatype and op (the address: library.py's): the
        group's own dict, which a caller may keep and look a count up in (``all_reduce`` adds to
        it, the eviction of the oldest removes from it)."""
        # predefined MPI datatypes and ops are mpi4py singletons: their ids stand for them
        key = (id(mtype), id(mop))
        made = self._made.get(key)
        if made is None:
            made = self._made[key] = {}
        return made

    def all_reduce(self, flat: np.ndarray, mtype, mop):
        """(staging array, persistent request, its handle's address) for an in-place all_reduce of ``flat`` (a flat
        C-contiguous array of at most LIMIT bytes, not empty), made on first use; None for a larger
        message or where MPI has no persistent collectives (the caller then runs ``Iallreduce``).
        The caller copies ``flat`` into the staging array, starts the request and, once it
        completes, copies the staging array back."""
        made = self.made(mtype, mop)
        count = flat.size
        staged = made.get(count)
        if staged is not None or flat.nbytes > LIMIT or not self.available:
            return staged
        staging = np.empty(count, flat.dtype)
        try:
            request = self._comm.Allreduce_init(self._MPI.IN_PLACE, [staging, mtype], mop)
        except NotImplementedError:
            self.available = False
            return None
        if len(self._order) >= CAPACITY:  # the oldest: the same on every rank
            key, old_count = self._order.pop(0)
            _, oldest, _ = self._made[key].pop(old_count)
            oldest.Free()
        staged = made[count] = (staging, request, self._MPI._addressof(request))
        self._order.append(((id(mtype), id(mop)), count))
        return staged

    def free(self) -> None:
        """Free every request (each inactive: the group's calls have all completed). Called when
        the group is released, before its communicator is."""
        requests = [request for made in self._made.values() for _, request, _ in made.values()]
        if self._barrier is not None:
            requests.append(self._barrier)
        for made in self._made.values():  # a caller keeping one finds nothing there from now on
            made.clear()
        self._order, self._barrier = [], None
        if self._MPI.Is_finalized():
            return
        for request in requests:
            request.Free()

