"""The MPI engine: ``MpiEngine`` and ``connect``.

``connect`` runs in every process of the engine's world (the default group's ranks, or a new
group's members for ``new_group(backend="mpi")``): each publishes its rank in ``MPI_COMM_WORLD``
through the store, and the members make one communicator of those processes (``Dup`` of
MPI_COMM_WORLD when they are all of it, ``Create_group`` otherwise). So the processes must belong
to one MPI job: started by ``mpiexec``/``mpirun``/``srun``, not by distcomm-run or spawn (each would be
its own MPI world of one). The engine's communicator is its own, never MPI_COMM_WORLD itself: the
program's own mpi4py calls and distcomm's never match each other's messages.

Each process group gets a communicator of its own (``MpiTransport.open_group``), released with the
group. ``close`` frees the engine's communicators and never finalises MPI (see transport/mpi.py).
"""

from __future__ import annotations

from datetime import timedelta

from ...errors import DistBackendError
from ...transport.mpi import DEPARTED_EXITED, DEPARTED_FAILED, MpiTransport, load_mpi
from ...tuning import DEFAULT, Tuning
from ..engine import Engine, FastPath, GroupCollectives, GroupSpec
from . import latency
from .collectives import MpiCollectives


class MpiEngine(Engine):
    """distcomm's collectives on MPI (see the package docstring)."""

    def __init__(self, transport: MpiTransport, tuning: Tuning = DEFAULT):
        self.transport = transport
        self.tuning = tuning
        self._groups: dict[int, MpiCollectives] = {}

    def collectives(self, group: GroupSpec) -> GroupCollectives:
        comm = self.transport.open_group(group.group_id, group.ranks)
        coll = MpiCollectives(self.transport, comm, group, self.tuning)
        self._groups[group.group_id] = coll
        return coll

    def fast_path(self, pg) -> FastPath | bool | None:
        coll = self._groups.get(pg.spec.group_id)
        if coll is None or len(pg.spec.ranks) == 1:
            return False
        return latency.build(pg, coll)

    def release_group(self, group_id: int) -> None:
        coll = self._groups.pop(group_id, None)
        if coll is not None:
            coll.release()
        self.transport.release_group(group_id)

    def leave(self, failed: bool) -> None:
        """Engine.leave: MPI's waits do not see a peer that stays alive in MPI_Finalize, so every
        other rank gets a notice first (transport/mpi.py, "Lost peers")."""
        self.transport.announce_departure(DEPARTED_FAILED if failed else DEPARTED_EXITED)
        self.close()

    def close(self) -> None:
        groups, self._groups = list(self._groups.values()), {}
        for coll in groups:
            coll.release()
        self.transport.close()

    def __repr__(self) -> str:
        return f"MpiEngine({self.transport!r})"


def connect(store, rank: int, size: int, timeout: float, tuning: Tuning = DEFAULT, options=None) -> MpiEngine:
    """The "mpi" engine among ``size`` processes of one MPI job (see the module docstring).

    Every rank publishes its MPI_COMM_WORLD rank, or why it cannot run MPI, before any rank raises:
    the ranks then fail alike, and rank 0 (whose process hosts the store under env://) waits until
    the others have read the store, or its exit would turn their error into a lost connection."""
    failure = None
    try:
        MPI = load_mpi()
        mine = str(MPI.COMM_WORLD.Get_rank())
    except DistBackendError as exc:
        failure, mine = exc, f"refused: {exc}"
    store.set(f"mpi/world_rank/{rank}", mine)
    published = [store.get(f"mpi/world_rank/{q}").decode() for q in range(size)]
    refused = [q for q, text in enumerate(published) if text.startswith("refused: ")]
    if failure is None and refused:
        failure = DistBackendError(f"backend 'mpi' on rank {rank}: rank {refused[0]} cannot run it: "
                                   f"{published[refused[0]][len('refused: '):]}")
    elif failure is None and len(set(published)) != size:
        failure = DistBackendError(
            f"backend 'mpi' on rank {rank}: the {size} processes are not one MPI job (their ranks in "
            f"MPI_COMM_WORLD are {[int(t) for t in published]}). Start them with mpiexec/mpirun/srun (e.g. "
            "mpiexec -n 4 python train.py), or use backend 'gloo'.")
    if failure is not None:
        store.set(f"mpi/read/{rank}", "1")
        if rank == 0:
            store.wait([f"mpi/read/{q}" for q in range(size)], timedelta(seconds=timeout))
        raise failure
    world = MPI.COMM_WORLD
    world_ranks = [int(text) for text in published]
    if world_ranks == list(range(world.Get_size())):
        comm = world.Dup()
    else:
        members = world.Get_group().Incl(world_ranks)
        try:
            # the tag keeps this apart from the program's own messages on MPI_COMM_WORLD
            comm = world.Create_group(members, tag=(1 << 15) - 7)
        finally:
            members.Free()
    return MpiEngine(MpiTransport(MPI, comm), tuning)
