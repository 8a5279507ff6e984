"""Initialization and groups: init_process_group, new_group, subgroups, rank queries, destroy."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any, Sequence

from .. import diagnostics, launcher_env, world
from ..backends import Backend, connect
from ..process_group import ProcessGroup
from ..errors import CollectiveMismatchError, DistBackendError, DistStoreError
from . import leaving
from .args import NOT_INITIALIZED, default_group, resolve_group

default_pg_timeout = timedelta(minutes=30)


def is_available() -> bool:
    """True: distcomm's engines run on every platform with sockets."""
    return True


def is_initialized() -> bool:
    """Whether the default process group has been initialized."""
    return world.default_pg is not None


def is_gloo_available() -> bool:
    """True: "gloo" names distcomm's default CPU engine."""
    return True


def is_mpi_available() -> bool:
    """True when mpi4py imports: backend "mpi" then runs under mpiexec/srun (MPI is not initialised
    by this check)."""
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return False
    return True


def is_nccl_available() -> bool:
    """False: NCCL needs CUDA GPUs; this build runs on CPU."""
    return False


def is_ucc_available() -> bool:
    return False


def is_torchelastic_launched() -> bool:
    """Whether this process was started by distcomm-run / torchrun (TORCHELASTIC_RUN_ID is set)."""
    return os.getenv("TORCHELASTIC_RUN_ID") is not None


def _timeout_seconds(timeout: Any, name: str = "timeout") -> float:
    if isinstance(timeout, timedelta):
        return timeout.total_seconds()
    raise TypeError(f"Expected timeout argument to be of type datetime.timedelta, got {type(timeout).__name__}")


def _engine_name(backend: str | None) -> tuple[str, str]:
    """(name the user gave, engine to run). None and "cpu:gloo,cuda:nccl" style strings mean gloo."""
    if backend is None:
        return "gloo", "gloo"
    name = str(backend).lower()
    if ":" in name:  # torch's "cpu:gloo,cuda:nccl" device map: we run the cpu entry
        mapping = dict(part.split(":", 1) for part in name.split(","))
        return name, mapping.get("cpu", "gloo")
    return str(Backend(name)), str(Backend(name))


def init_process_group(
    backend: str | None = None,
    init_method: str | None = None,
    timeout: timedelta | None = None,
    world_size: int = -1,
    rank: int = -1,
    store: Any = None,
    group_name: str = "",
    pg_options: Any = None,
    device_id: Any = None,
) -> None:
    """Initialize the default distributed process group.

    Either give ``init_method`` (a URL: ``env://`` (default), ``tcp://host:port``,
    ``file:///path``) or an explicit ``store`` with ``rank`` and ``world_size``. ``backend`` is
    "gloo" (distcomm's default CPU engine, also chosen when None), "tcp" or "mpi" (under mpiexec or
    srun); ``timeout`` bounds every collective on the group (default 30 minutes). Under mpiexec or
    srun, env:// needs none of torch's variables (see distcomm.launcher_env).
    """
    from ..rendezvous import rendezvous
    from ..store import PrefixStore
    from . import rollcall

    with world.lock:
        if world.default_pg is not None:
            raise ValueError("trying to initialize the default process group twice!")
        timeout = default_pg_timeout if timeout is None else timeout
        seconds = _timeout_seconds(timeout)
        user_name, engine = _engine_name(backend)
        if store is None:
            if init_method is None:
                init_method = "env://"
            store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
            store.set_timeout(timeout)
        else:
            if init_method is not None:
                raise ValueError("Cannot specify both init_method and store.")
            if world_size <= 0:
                raise ValueError("world_size must be positive if using store")
            if rank < 0:
                raise ValueError("rank must be non-negative if using store")
        if not 0 <= rank < world_size:
            raise ValueError(f"Invalid rank {rank}: must be in 0..{world_size - 1} for world_size {world_size}")
        # Each init round gets its own namespace, so a re-init after destroy never reads stale keys;
        # the roll call turns a duplicate rank or a world size disagreement into an error that says so
        generation = rollcall.take_generation(store, rank, world_size, timeout)
        prefixed = rollcall.namespace(store, generation)
        rollcall.roll_call(prefixed, rank, world_size, timeout)
        world_engine = connect(engine, PrefixStore("world/", prefixed), rank, world_size, seconds, pg_options)
        world.store = prefixed
        world.global_rank = rank
        world.world_size = world_size
        world.backend_name = user_name
        world.engines[engine] = world_engine
        gid = world.allocate_group_id()
        name = group_name or str(gid)
        pg = ProcessGroup(gid, name, range(world_size), rank, world_engine, user_name, timeout, engine, prefixed)
        world.groups[name] = pg
        world.set_world(pg)
        diagnostics.install(prefixed, rank, world_size)  # hang reports, failure causes, dumps on every rank
        leaving.register()  # an MPI job's rank that exits without destroy_process_group
        rollcall.finish(prefixed, rank, world_size)  # rank 0, the store's host, leaves init last


def destroy_process_group(group: Any = None) -> None:
    """Destroy ``group`` (default: every group and the default group, releasing all resources)."""
    with world.lock:
        if group is None or group is world.GroupMember.WORLD:
            if world.default_pg is None:
                raise ValueError(NOT_INITIALIZED)
            for pg in list(world.groups.values()):
                pg.close()
            for engine in list(world.engines.values()):
                engine.close()
            diagnostics.uninstall()
            world.reset()
            return
        if group is world.GroupMember.NON_GROUP_MEMBER:
            return
        group.close()
        world.groups.pop(group.group_name, None)
        if group.engine is not world.engines.get(group.engine_name):
            group.engine.close()  # an engine connected for this group alone
        else:  # the world's engine stays; what it keeps for this group can go now
            group.engine.release_group(group.group_id)


def new_group(
    ranks: Sequence[int] | None = None,
    timeout: timedelta | None = None,
    backend: str | None = None,
    pg_options: Any = None,
    use_local_synchronization: bool = False,
    group_desc: str | None = None,
    device_id: Any = None,
    sort_ranks: bool = True,
):
    """Create a group of a subset of the world's ranks; every process must call it, in the same
    order, even those not in ``ranks``. Non-members get ``GroupMember.NON_GROUP_MEMBER``.

    ``ranks`` are global ranks, sorted into group-rank order unless ``sort_ranks=False`` (then group
    rank i is ``ranks[i]``); None means all.
    ``backend`` defaults to the world's; a different engine connects the members anew.
    """
    world_pg = default_group()
    with world.lock:
        size = world.world_size
        if ranks is None:
            ranks = list(range(size))
        ranks = [int(r) for r in ranks]
        if sort_ranks:
            ranks.sort()
        for r in ranks:
            if not 0 <= r < size:
                raise ValueError(f"Invalid rank {r} in new_group: ranks must be in 0..{size - 1}")
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"new_group: ranks {ranks} contain duplicates")
        timeout = world_pg.timeout if timeout is None else timeout
        _timeout_seconds(timeout)
        user_name, engine = _engine_name(backend) if backend is not None else (world_pg.backend_name, world_pg.engine_name)
        gid = world.allocate_group_id()
        name = group_desc if (group_desc and group_desc not in world.groups) else str(gid)
        if world.global_rank not in ranks:
            return world.GroupMember.NON_GROUP_MEMBER
        if world.store is not None and len(ranks) > 1:
            _agree_on_members(world.store, gid, ranks, timeout)
        world_engine = world.engines.get(engine)
        if world_engine is None or engine != world_pg.engine_name:
            # A different engine: connect just the members, through a namespace of this group. Its
            # ranks are the members' group ranks.
            from ..store import PrefixStore

            rank = ranks.index(world.global_rank)
            own = connect(engine, PrefixStore(f"group/{gid}/", world.store), rank, len(ranks),
                          timeout.total_seconds(), pg_options)
            pg = ProcessGroup(gid, name, ranks, world.global_rank, own, user_name, timeout, engine, world.store,
                              engine_ranks=range(len(ranks)))
        else:
            pg = ProcessGroup(gid, name, ranks, world.global_rank, world_engine, user_name, timeout, engine,
                              world.store)
        world.groups[name] = pg
        return pg


def _agree_on_members(store, gid: int, ranks: list[int], timeout: timedelta) -> None:
    """Every member of group ``gid`` publishes the ranks it was given and checks the others'.

    Members that were given different lists would otherwise meet in collectives of different
    shapes: an engine whose messages match by group and sequence number (TCP) then mixes them and
    returns wrong results without an error. The check costs a store round trip per member, as
    torch's own new_group waits at a store barrier.
    """
    me = world.global_rank
    text = ",".join(map(str, ranks))
    store.set(f"group/{gid}/members/{me}", text)
    keys = [f"group/{gid}/members/{r}" for r in ranks]
    try:
        store.wait(keys, timeout)
    except DistStoreError:
        missing = [r for r in ranks if not store.check([f"group/{gid}/members/{r}"])]
        raise DistBackendError(
            f"new_group on rank {me}: rank(s) {missing} of the new group {ranks} did not call new_group within "
            f"{timeout.total_seconds():g} s; every rank must call new_group for every group, in the same order"
        ) from None
    values = [v.decode() if isinstance(v, bytes) else str(v) for v in store.multi_get(keys)]
    if all(v == text for v in values):
        return
    given: dict[str, list[int]] = {}
    for r, v in zip(ranks, values):
        given.setdefault(v, []).append(r)
    said = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))} gave [{v}]"
                     for v, rs in given.items())
    raise CollectiveMismatchError(
        f"new_group on rank {me}: the ranks disagree on the members of the new group (group {gid}): {said}. "
        "Call new_group with the same ranks on every process"
    )


def new_subgroups(
    group_size: int | None = None,
    group: Any = None,
    timeout: timedelta | None = None,
    backend: str | None = None,
    pg_options: Any = None,
    group_desc: str | None = None,
):
    """Split the world into equal consecutive subgroups of ``group_size`` ranks.

    Returns ``(this rank's subgroup, all subgroups)``. ``group_size`` defaults to
    LOCAL_WORLD_SIZE (one subgroup per machine) when set, else the whole world.
    """
    pg = default_group()
    size = pg.size()
    if group_size is None:
        group_size = int(os.environ.get("LOCAL_WORLD_SIZE", size))
    if group_size <= 0:
        raise ValueError(f"The arg 'group_size' ({group_size}) must be positive")
    if group_size > size:
        raise ValueError(f"The arg 'group_size' ({group_size}) must not exceed the world size ({size})")
    if size % group_size != 0:
        raise ValueError(f"The world size ({size}) must be divisible by 'group_size' ({group_size})")
    ranks_per = [list(range(i, i + group_size)) for i in range(0, size, group_size)]
    return new_subgroups_by_enumeration(ranks_per, timeout, backend, pg_options)


def new_subgroups_by_enumeration(
    ranks_per_subgroup_list: Sequence[Sequence[int]],
    timeout: timedelta | None = None,
    backend: str | None = None,
    pg_options: Any = None,
    group_desc: str | None = None,
):
    """Create one subgroup per list of global ranks; a rank may appear in at most one.

    Returns ``(this rank's subgroup or None, all subgroups this process created)``.
    """
    if not ranks_per_subgroup_list:
        raise ValueError("The arg 'ranks_per_subgroup_list' cannot be empty")
    seen: dict[int, int] = {}
    for i, ranks in enumerate(ranks_per_subgroup_list):
        for r in ranks:
            if r in seen:
                raise ValueError(f"Rank {r} has appeared in both subgroup {seen[r]} and subgroup {i}")
            seen[r] = i
    mine = None
    subgroups = []
    for ranks in ranks_per_subgroup_list:
        g = new_group(ranks, timeout=timeout, backend=backend, pg_options=pg_options)
        subgroups.append(g)
        if world.global_rank in ranks:
            mine = g
    return mine, subgroups


def get_rank(group: Any = None) -> int:
    """This process's rank in ``group`` (default: the world); -1 if it is not a member."""
    pg = default_group()
    if group is None or group is world.GroupMember.WORLD:
        return pg.rank()
    if group is world.GroupMember.NON_GROUP_MEMBER:
        return -1
    return group.rank()


def get_world_size(group: Any = None) -> int:
    """The number of processes in ``group`` (default: the world); -1 if this is not a member."""
    pg = default_group()
    if group is None or group is world.GroupMember.WORLD:
        return pg.size()
    if group is world.GroupMember.NON_GROUP_MEMBER:
        return -1
    return group.size()


def get_backend(group: Any = None) -> str:
    """The backend name ``group`` was created with, as the user gave it."""
    pg = resolve_group(group, "get_backend")
    if pg is None:
        raise ValueError("Invalid process group specified")
    return Backend(pg.backend_name) if ":" not in pg.backend_name else pg.backend_name


def _member_group(group: Any, op: str):
    if group is world.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(f"{op}: this process is not a member of the group")
    return resolve_group(group, op)


def get_group_rank(group: Any, global_rank: int) -> int:
    """The group rank of ``global_rank`` in ``group``; ValueError if it is not a member."""
    pg = _member_group(group, "get_group_rank")
    r = pg.group_rank(global_rank)
    if r < 0:
        raise ValueError(f"Global rank {global_rank} is not part of group {pg.group_name}")
    return r


def get_global_rank(group: Any, group_rank: int) -> int:
    """The global rank of ``group_rank`` in ``group``."""
    pg = _member_group(group, "get_global_rank")
    if not 0 <= group_rank < pg.size():
        raise ValueError(f"Group rank {group_rank} is not part of group {pg.group_name}")
    return pg.ranks[group_rank]


def get_process_group_ranks(group: Any) -> list[int]:
    """The global ranks of ``group``, in group-rank order."""
    return list(_member_group(group, "get_process_group_ranks").ranks)


def is_xccl_available() -> bool:
    """False: XCCL needs Intel GPUs; this build runs on CPU."""
    return False


# torch asks ``is_<name>_available`` of the names that have one; the others are available when
# they are registered (Backend.backend_list).
_AVAILABILITY = {
    "gloo": is_gloo_available,
    "mpi": is_mpi_available,
    "nccl": is_nccl_available,
    "ucc": is_ucc_available,
    "xccl": is_xccl_available,
}


def _one_backend_available(name: str) -> bool:
    name = str(name).lower()
    check = _AVAILABILITY.get(name)
    return check() if check is not None else name in Backend.backend_list


def is_backend_available(backend: str) -> bool:
    """Whether ``backend`` (a name, or a "cpu:gloo,cuda:nccl" device map: every entry) can be used:
    a built-in name with its ``is_<name>_available``, or a name registered with
    ``Backend.register_backend``."""
    if ":" in backend.lower():
        return all(_one_backend_available(name) for name in _device_map(backend).values())
    return _one_backend_available(backend)


def _device_map(backend: str) -> dict[str, str]:
    """"cpu:gloo,cuda:nccl" as {"cpu": "gloo", "cuda": "nccl"}."""
    return dict(part.strip().split(":", 1) for part in backend.lower().split(","))


def get_default_backend_for_device(device) -> str:
    """The backend torch would pick for ``device`` ("cpu" or a torch.device): "gloo" for CPU.
    Other devices have none here (a ValueError, as torch's for an unregistered device)."""
    device_type = getattr(device, "type", None) or str(device).split(":", 1)[0]
    backend = Backend.default_device_backend_map.get(device_type)
    if backend is None:
        raise ValueError(f"Default backend not registered for device : {device}")
    return backend


def get_backend_config(group: Any = None) -> str:
    """The device-to-backend map of ``group`` as torch spells it ("cpu:gloo"): distcomm runs CPU
    tensors only, so a plain backend maps the cpu device; a device map given at init is kept."""
    pg = resolve_group(group, "get_backend_config")
    if pg is None:
        raise ValueError("Invalid process group specified")
    if ":" in pg.backend_name:
        return ",".join(f"{d}:{b}" for d, b in _device_map(pg.backend_name).items())
    return f"cpu:{pg.backend_name}"


def get_pg_count() -> int:
    """The number of process groups created since init_process_group (the default group
    included), counted alike on every rank, members or not."""
    return world.next_group_id


def get_node_local_rank(fallback_rank: int | None = None) -> int:
    """This process's rank on its machine: LOCAL_RANK (set by distcomm-run / torchrun), else the
    local rank mpiexec or srun gave (MPI_LOCALRANKID, OMPI_COMM_WORLD_LOCAL_RANK, SLURM_LOCALID),
    else ``fallback_rank``; none of them is a RuntimeError, as in torch."""
    if "LOCAL_RANK" in os.environ:
        return int(os.environ["LOCAL_RANK"])
    launched = launcher_env.detect(os.environ)
    if launched is not None and launched.local_rank is not None:
        return launched.local_rank
    if fallback_rank is not None:
        return int(fallback_rank)
    raise RuntimeError(
        "LOCAL_RANK is not in the environment. Consider passing fallback_rank to allow `get_node_local_rank` to work, "
        "assuming you are not running in a multi-device context and want the code to run locally instead."
    )


def split_group(
    parent_pg: Any = None,
    split_ranks: list | None = None,
    timeout: timedelta | None = None,
    pg_options: Any = None,
    group_desc: str | None = None,
    backend: str | None = None,
):
    """Split the default group into disjoint groups; ``split_ranks`` lists each group's ranks (group
    ranks of the parent). Every rank of the parent calls it with the same ``split_ranks``; a rank
    gets its own group, or None when it is in none of them.

    distcomm's CPU engines split by creating the groups (torch's gloo cannot split at all). Only
    the default group splits: a group's id is numbered alike on every rank of the world because
    every rank takes part in making it, which a subgroup's non-members would not.
    """
    if split_ranks is None or len(split_ranks) == 0:
        raise ValueError("split_ranks cannot be None or empty")
    world_pg = default_group()
    parent = world_pg if parent_pg is None or parent_pg is world.GroupMember.WORLD else parent_pg
    if parent is not world_pg:
        raise DistBackendError(
            f"split_group on rank {world.global_rank}: only the default group can be split here (each rank "
            "of the world must take part in creating a group); call new_group from every rank instead"
        )
    if backend is not None and str(backend).lower() != str(parent.backend_name).lower():
        raise ValueError(
            f"Backend mismatch: parent has '{parent.backend_name}', requested '{backend}'. Backend names "
            "must match exactly when filtering split_group backends."
        )
    for ranks in split_ranks:
        if len(ranks) == 0:
            raise ValueError("the split group cannot be empty")
        if len(ranks) > parent.size():
            raise ValueError(
                "the split group's size should be less or equal to the world_size set by init_process_group")
        if len(ranks) != len(set(ranks)):
            raise ValueError("the split group cannot have duplicate ranks")
    mine = None
    for ranks in split_ranks:  # every rank creates every split, in order: ids agree everywhere
        g = new_group([parent.ranks[r] for r in ranks], timeout=timeout, pg_options=pg_options,
                      group_desc=group_desc)
        if g is not world.GroupMember.NON_GROUP_MEMBER:
            mine = g
    return mine
