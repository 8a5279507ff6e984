"""Initialization and groups: init_process_group, new_group, subgroups, rank queries, destroy."""

from __future__ import annotations

import hashlib
import os
from datetime import timedelta
from typing import Any, Sequence

from .. import diagnostics, launcher_env, world
from ..backends import Backend, connect
from ..process_group import ProcessGroup
from ..errors import CollectiveMismatchError, DistBackendError, DistStoreError
from . import leaving
from .args import NOT_INITIALIZED, default_group, is_non_member

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
    "gloo" (distcomm's default CPU engine, also run when None: get_backend then says "undefined", as
    torch's), "tcp" or "mpi" (under mpiexec or srun); ``timeout`` bounds every collective on the group (default 30 minutes). Under mpiexec or
    srun, env:// needs none of torch's variables (see distcomm.launcher_env). ``group_name`` is
    ignored, as torch ignores it: the default group is named "0" and described "default_pg".
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
        # torch's default group without a backend says "undefined" (get_backend) and runs gloo
        world.backend_name = "undefined" if backend is None else user_name
        world.engines[engine] = world_engine
        gid = world.allocate_group_id()
        # torch ignores group_name ("not visible to users"): the default group is named "0"
        pg = ProcessGroup(gid, str(gid), range(world_size), rank, world_engine, user_name, timeout, engine, prefixed)
        _register(pg, world.backend_name, "default_pg")
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
        if is_non_member(group):
            return
        if not _is_registered(group):  # destroyed already, or not a group (torch's text)
            raise ValueError("Invalid process group specified")
        group.close()
        if world.groups.get(group.group_name) is group:
            del world.groups[group.group_name]
        world.backends.pop(group, None)
        if group.engine is not world.engines.get(group.engine_name):
            group.engine.close()  # an engine connected for this group alone
        else:  # the world's engine stays; what it keeps for this group can go now
            group.engine.release_group(group.group_id)


def _register(pg: ProcessGroup, backend: str, group_desc: str | None) -> None:
    """Enter a new group of this process in the registry, as torch's ``_world`` does: by name
    (what get_rank and friends accept), with the backend its creator named (what get_backend says)
    and its description (``pg.group_desc``, "undefined" when none was given)."""
    # ProcessGroup's constructor takes no description (it is the public API's, not the engine's)
    pg.group_desc = "undefined" if group_desc is None else group_desc
    world.groups[pg.group_name] = pg
    world.backends[pg] = backend


def _is_registered(group: Any) -> bool:
    """Whether ``group`` is a process group not destroyed (torch's registry holds it). A
    ProcessGroup built around its own engine, without the world, counts until it is closed."""
    return isinstance(group, ProcessGroup) and not group.executor.closed


# Ids of groups made with use_local_synchronization=True: from here up, past any id the world's
# counter gives (one per new_group call of every rank), and within the 32 bits a TCP frame header
# carries (transport/framing.py)
LOCAL_GROUP_IDS = 1 << 31


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
    ``use_local_synchronization=True``: only the members call it (and a non-member that does gets
    None, as in torch); the group is named by a hash of its ranks, not numbered, so the groups that
    every rank creates stay numbered alike. Members that create several groups of the same ranks
    this way must create them in the same order.
    ``group_desc`` describes the group (``group.group_desc``).
    """
    world_pg = default_group()
    with world.lock:
        size = world.world_size
        timeout = world_pg.timeout if timeout is None else timeout
        _timeout_seconds(timeout)
        if backend is None:
            user_name, engine = world.backends.get(world_pg, world_pg.backend_name), world_pg.engine_name
        else:
            user_name, engine = _engine_name(backend)
        if use_local_synchronization:
            if engine == "mpi":  # torch's check: MPI has no way to create a group among its members only
                raise ValueError("MPI backend doesn't support use_local_synchronization=True")
            if ranks is not None and world.global_rank not in ranks:
                return None  # torch's: the non-members need not call, and one that does gets None
        ranks = _new_group_ranks(ranks, size, sort_ranks)
        if use_local_synchronization:
            gid, name = None, _hashed_group_name(ranks)
        else:
            gid = world.allocate_group_id()
            name = str(gid)
        if world.global_rank not in ranks:
            world.non_member_ranks = ranks  # what torch's rank queries answer about NON_GROUP_MEMBER
            return world.GroupMember.NON_GROUP_MEMBER
        if gid is None:
            gid = _local_group_id(world.store, ranks, timeout)
        if world.store is not None and len(ranks) > 1:
            _agree_on_members(world.store, gid, ranks, timeout, use_local_synchronization)
        world_engine = world.engines.get(engine)
        # what the ProcessGroup calls its backend (its name(), the profiler's "gloo:all_reduce"): the
        # world's, where get_backend may say "undefined" (torch's default group runs gloo then)
        backend_name = world_pg.backend_name if backend is None else user_name
        if world_engine is None or engine != world_pg.engine_name:
            # A different engine: connect just the members, through a namespace of this group. Its
            # ranks are the members' group ranks.
            from ..store import PrefixStore

            rank = ranks.index(world.global_rank)
            own = connect(engine, PrefixStore(f"group/{gid}/", world.store), rank, len(ranks),
                          timeout.total_seconds(), pg_options)
            pg = ProcessGroup(gid, name, ranks, world.global_rank, own, backend_name, timeout, engine, world.store,
                              engine_ranks=range(len(ranks)))
        else:
            pg = ProcessGroup(gid, name, ranks, world.global_rank, world_engine, backend_name, timeout, engine,
                              world.store)
        _register(pg, user_name, group_desc)
        return pg


def _new_group_ranks(ranks: Sequence[int] | None, size: int, sort_ranks: bool) -> list[int]:
    """new_group's ``ranks`` checked as torch checks them, with torch's texts: every rank if None."""
    if ranks is None:
        return list(range(size))
    ranks = [int(r) for r in ranks]
    if sort_ranks:
        ranks.sort()
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"ranks list must not contain duplicate entries, got {ranks}")
    if len(ranks) > size:
        raise ValueError(
            "the new group's world size should be less or equal to the world size set by init_process_group")
    for r in ranks:
        if not 0 <= r < size:
            raise ValueError(f"Rank {r} is out of range. Valid ranks are 0 to {size - 1} (world_size={size})")
    return ranks


def _hashed_group_name(ranks: list[int]) -> str:
    """The name torch gives a group made with use_local_synchronization=True (its
    ``_process_group_name(ranks, use_hashed_name=True)``): the SHA-1 of the ranks and the number
    of groups this process holds. Where that name is taken (a group of the same ranks made when
    this process held as many groups, before some were destroyed), torch raises; distcomm hashes
    again with "_" appended until the name is free (only the name differs: the members agree on
    the group itself through the store, _local_group_id)."""
    unique = "_".join(map(str, ranks)) + "_" + str(len(world.groups))
    name = hashlib.sha1(unique.encode(), usedforsecurity=False).hexdigest()
    while name in world.groups:
        unique += "_"
        name = hashlib.sha1(unique.encode(), usedforsecurity=False).hexdigest()
    return name


def _local_group_id(store, ranks: list[int], timeout: timedelta) -> int:
    """The id the members of a group made with use_local_synchronization=True agree on, without
    the non-members: a number no other group of this init has, ordinary or local.

    torch's hashed name cannot be the id: it counts the groups this process holds, which differ
    between members that belong to different other groups (torch's gloo then waits for peers
    under another name until the timeout). Instead each member counts, in the store, its calls
    for this set of members, so the n-th such call of each member is the same group; the lowest
    member draws the group a number from the store's counter of local groups and publishes it
    under that count, and the others read it there.
    """
    me = world.global_rank
    members = hashlib.sha1(",".join(map(str, sorted(ranks))).encode(), usedforsecurity=False).hexdigest()
    nth = store.add(f"local_group/{members}/calls/{me}", 1)
    key = f"local_group/{members}/{nth}/id"
    leader = min(ranks)
    if me == leader:
        number = store.add("local_group/count", 1)
        store.set(key, str(number))
    else:
        try:
            store.wait([key], timeout)
        except DistStoreError:
            raise DistBackendError(
                f"new_group on rank {me}: rank {leader} of the new group {ranks} did not call new_group(..., "
                f"use_local_synchronization=True) within {timeout.total_seconds():g} s; every member must call it "
                "for every group it is in, and members of several groups of the same ranks in the same order"
            ) from None
        value = store.get(key)
        number = int(value.decode() if isinstance(value, bytes) else value)
    return LOCAL_GROUP_IDS + number


def _agree_on_members(store, gid: int, ranks: list[int], timeout: timedelta, local: bool = False) -> None:
    """Every member of group ``gid`` publishes the ranks it was given and checks the others'.

    Members that were given different lists would otherwise meet in collectives of different
    shapes: an engine whose messages match by group and sequence number (TCP) then mixes them and
    returns wrong results without an error. The check costs a store round trip per member, as
    torch's own new_group waits at a store barrier. ``local``: the group is made with
    use_local_synchronization=True (its id is from _local_group_id, so its keys are its own too).
    """
    me = world.global_rank
    text = ",".join(map(str, ranks))
    store.set(f"group/{gid}/members/{me}", text)
    keys = [f"group/{gid}/members/{r}" for r in ranks]
    call = "new_group(..., use_local_synchronization=True)" if local else "new_group"
    try:
        store.wait(keys, timeout)
    except DistStoreError:
        missing = [r for r in ranks if not store.check([f"group/{gid}/members/{r}"])]
        who = "every member must call it for every group it is in" if local else \
            "every rank must call new_group for every group, in the same order"
        raise DistBackendError(
            f"new_group on rank {me}: rank(s) {missing} of the new group {ranks} did not call {call} within "
            f"{timeout.total_seconds():g} s; {who}"
        ) from None
    values = [v.decode() if isinstance(v, bytes) else str(v) for v in store.multi_get(keys)]
    if all(v == text for v in values):
        return
    given: dict[str, list[int]] = {}
    for r, v in zip(ranks, values):
        given.setdefault(v, []).append(r)
    said = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))} gave [{v}]"
                     for v, rs in given.items())
    which = "made with use_local_synchronization=True" if local else f"(group {gid})"
    raise CollectiveMismatchError(
        f"new_group on rank {me}: the ranks disagree on the members of the new group {which}: {said}. "
        f"Call {call} with the same ranks on every {'member' if local else 'process'}"
    )


def new_subgroups(
    group_size: int | None = None,
    group: Any = None,
    timeout: timedelta | None = None,
    backend: str | None = None,
    pg_options: Any = None,
    group_desc: str | None = None,
):
    """Split ``group`` (default: the world) into equal consecutive subgroups of ``group_size`` ranks.

    Returns ``(this rank's subgroup, all subgroups)``. ``group_size`` defaults to
    LOCAL_WORLD_SIZE (one subgroup per machine) when set, else the whole group. Every rank of the
    world calls it, as new_group; on a rank outside ``group`` its size is -1, so it fails as torch's.
    """
    size = get_world_size(group)
    if group_size is None:
        group_size = int(os.environ.get("LOCAL_WORLD_SIZE", size))
    if group_size <= 0:
        raise ValueError(f"The arg 'group_size' ({group_size}) must be positive")
    if group_size > size:
        raise ValueError(f"The arg 'group_size' ({group_size}) must not exceed the world size ({size})")
    if size % group_size != 0:
        raise ValueError(f"The world size ({size}) must be divisible by 'group_size' ({group_size})")
    ranks = get_process_group_ranks(group)
    ranks_per = [ranks[i:i + group_size] for i in range(0, size, group_size)]
    return new_subgroups_by_enumeration(ranks_per, timeout, backend, pg_options, group_desc)


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
        g = new_group(ranks, timeout=timeout, backend=backend, pg_options=pg_options, group_desc=group_desc)
        subgroups.append(g)
        if world.global_rank in ranks:
            mine = g
    return mine, subgroups


# -- rank queries ------------------------------------------------------------------------------------
# torch answers them from its registry of groups: a destroyed group, or anything that is not a group,
# is "not registered" (a ValueError; get_process_group_ranks's is a KeyError), and NON_GROUP_MEMBER
# stands for the last group this process was not made a member of (world.non_member_ranks).


class UnregisteredGroupError(ValueError, KeyError):
    """A group torch's registry would not hold (destroyed, or not a group): torch's rank queries
    raise ValueError, its get_process_group_ranks a KeyError (a lookup in its registry); this is
    both, so an ``except`` written for either catches it."""

    __str__ = ValueError.__str__  # the message as written (KeyError's would quote it)


def _unregistered(group: Any) -> UnregisteredGroupError:
    return UnregisteredGroupError(
        f"Group {group} is not registered, please create group with torch.distributed.new_group API")


def _registered_group(group: Any) -> ProcessGroup:
    """``group`` if it is a live process group, else torch's "not registered" error."""
    if not _is_registered(group):
        raise _unregistered(group)
    return group


def _non_member_ranks(group: Any) -> list[int]:
    """What torch's rank queries read for NON_GROUP_MEMBER: the ranks of the last group this
    process is not a member of (none yet: not registered)."""
    if world.non_member_ranks is None:
        raise _unregistered(group)
    return world.non_member_ranks


def get_rank(group: Any = None) -> int:
    """This process's rank in ``group`` (default: the world); -1 if it is not a member."""
    if group is None or group is world.GroupMember.WORLD:
        return default_group().rank()
    if is_non_member(group):
        return -1
    default_group()
    return _registered_group(group).rank()


def get_world_size(group: Any = None) -> int:
    """The number of processes in ``group`` (default: the world); -1 if this is not a member."""
    if is_non_member(group):
        return -1
    pg = default_group()
    if group is None or group is world.GroupMember.WORLD:
        return pg.size()
    return group.size()  # as torch's: a destroyed group still has its size


def _named_group(group: Any) -> ProcessGroup:
    """get_backend's and get_backend_config's group (None: the world), with torch's errors."""
    pg = default_group() if group is None else group
    if is_non_member(pg):
        raise ValueError("Invalid process group specified")
    if not _is_registered(pg):
        raise ValueError(
            f"Process group {pg} is not initialized in the world group map. Please initialize the group first.")
    return pg


def get_backend(group: Any = None) -> str:
    """The backend name ``group`` was created with, as the user gave it ("undefined" for a group
    made without one, as torch says: it runs gloo)."""
    pg = _named_group(group)
    name = world.backends.get(pg, pg.backend_name)
    return Backend(name) if ":" not in name else name


def get_group_rank(group: Any, global_rank: int) -> int:
    """The group rank of ``global_rank`` in ``group``; ValueError if it is not a member.

    On a process outside the group (``group`` is NON_GROUP_MEMBER), torch answers about the last
    group this process was not made a member of, and so does distcomm."""
    if group is None:
        default_group()  # before init: say so (torch returns its argument, None being WORLD then)
    elif is_non_member(group):
        ranks = _non_member_ranks(group)
        if global_rank not in ranks:
            raise ValueError(f"Global rank {global_rank} is not part of group {group}")
        return ranks.index(global_rank)
    pg = _registered_group(group)  # the default group included: its ranks are checked too
    r = pg.group_rank(global_rank)
    if r < 0:
        raise ValueError(f"Global rank {global_rank} is not part of group {pg}")
    return r


def get_global_rank(group: Any, group_rank: int) -> int:
    """The global rank of ``group_rank`` in ``group`` (NON_GROUP_MEMBER: as get_group_rank)."""
    if group is None:
        default_group()
    elif is_non_member(group):
        ranks = _non_member_ranks(group)
        if not (group_rank.__class__ is int and 0 <= group_rank < len(ranks)):
            raise ValueError(f"Group rank {group_rank} is not part of group {group}")
        return ranks[group_rank]
    pg = _registered_group(group)
    if not (isinstance(group_rank, int) and 0 <= group_rank < pg.size()):
        raise ValueError(f"Group rank {group_rank} is not part of group {pg}")
    return pg.ranks[group_rank]


def get_process_group_ranks(group: Any) -> list[int]:
    """The global ranks of ``group`` (None: the world), in group-rank order (NON_GROUP_MEMBER: as
    get_group_rank)."""
    if group is None or group is world.GroupMember.WORLD:
        return list(default_group().ranks)
    if is_non_member(group):
        return list(_non_member_ranks(group))
    return list(_registered_group(group).ranks)


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
    pg = _named_group(group)
    if ":" in pg.backend_name:
        return ",".join(f"{d}:{b}" for d, b in _device_map(pg.backend_name).items())
    return f"cpu:{pg.backend_name}"


def get_pg_count() -> int:
    """The number of process groups created since init_process_group (the default group
    included), counted alike on every rank, members or not; groups made with
    use_local_synchronization=True are not counted (torch's neither)."""
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
    """Split ``parent_pg`` (default: the world) into disjoint groups; ``split_ranks`` lists each
    group's ranks (group ranks of the parent). Every rank of the parent calls it with the same
    ``split_ranks``; a rank gets its own group, or None when it is in none of them.

    distcomm's CPU engines split by creating the groups (torch's gloo cannot split at all): each
    rank makes only the group it is in, with its other members, as ``new_group(...,
    use_local_synchronization=True)`` makes one (named by a hash of its ranks, as torch names a
    split), on the parent's engine.
    """
    if split_ranks is None or len(split_ranks) == 0:
        raise ValueError("split_ranks cannot be None or empty")
    world_pg = default_group()
    parent = world_pg if parent_pg is None or parent_pg is world.GroupMember.WORLD else parent_pg
    if not _is_registered(parent):
        raise ValueError(f"Group {parent} is not registered")
    if world.global_rank not in parent.ranks:
        raise ValueError(f"Global rank {world.global_rank} is not part of the parent group {parent}")
    parent_name = world.backends.get(parent, parent.backend_name)
    if backend is not None and str(backend).lower() != str(parent.backend_name).lower():
        raise ValueError(
            f"Backend mismatch: parent has '{parent.backend_name}', requested '{backend}'. Backend names "
            "must match exactly when filtering split_group backends."
        )
    my_split = None
    me = parent.group_rank(world.global_rank)
    for ranks in split_ranks:
        if len(ranks) == 0:
            raise ValueError("the split group cannot be empty")
        if len(ranks) > world_pg.size():
            raise ValueError(
                "the split group's size should be less or equal to the world_size set by init_process_group")
        if len(ranks) != len(set(ranks)):
            raise ValueError("the split group cannot have duplicate ranks")
        outside = [r for r in ranks if not (isinstance(r, int) and 0 <= r < parent.size())]
        if outside:
            raise ValueError(f"split_ranks holds {outside[0]!r}, not a rank of the parent group (its ranks are 0 to "
                             f"{parent.size() - 1}): split_ranks are group ranks of the parent")
        if my_split is None and me in ranks:
            my_split = sorted(ranks)
    if parent.engine_name == "mpi":
        # MPI makes a communicator with every rank of the world's taking part: each rank makes every
        # split, in order (new_group), which only the world's members all call
        if parent is not world_pg:
            raise DistBackendError(
                f"split_group on rank {world.global_rank}: on the MPI engine only the default group can be split "
                "(MPI makes a group with every rank of the world taking part); call new_group from every rank instead"
            )
        mine = None
        for ranks in split_ranks:
            g = new_group([parent.ranks[r] for r in ranks], timeout=timeout, pg_options=pg_options,
                          group_desc=group_desc)
            if not is_non_member(g):
                mine = g
        return mine
    if my_split is None:
        return None
    engine_backend = None if parent is world_pg or parent_name == "undefined" else parent_name
    return new_group([parent.ranks[r] for r in my_split], timeout=timeout, backend=engine_backend, pg_options=pg_options,
                     use_local_synchronization=True, group_desc=group_desc)
