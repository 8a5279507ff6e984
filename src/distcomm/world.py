"""The only global state: the default group, the group registry, group ids and engines.

torch requires every process of the world to call new_group() in the same order (members or not),
so a counter kept here numbers groups alike on every rank without any communication; the number is
the group id stamped on every message, which is what keeps groups from exchanging messages. A group
made with ``use_local_synchronization=True`` is made by its members only, so it takes no number
from this counter (torch's neither): its members agree on an id through the store
(_api/groups.py), from a range the counter never reaches.
"""

from __future__ import annotations

import threading
from typing import Any


class GroupMember:
    """``GroupMember.WORLD`` is the default group once initialized; ``NON_GROUP_MEMBER`` marks
    a process outside a group: torch's -100, an int, which programs compare with ``==`` as torch
    does (distcomm's own checks compare by value too)."""

    WORLD: Any = None
    NON_GROUP_MEMBER = -100


class group:  # noqa: N801 - torch's name (dist.group.WORLD)
    WORLD: Any = None


lock = threading.RLock()
default_pg = None  # the world's ProcessGroup
store = None  # the world's store (prefixed for this init)
global_rank = -1
world_size = -1
groups: dict[str, Any] = {}  # group name -> ProcessGroup (members only)
backends: dict[Any, str] = {}  # ProcessGroup -> the backend its creator named, "undefined" for none (torch's pg_map)
# The global ranks of the last group this process was made a non-member of: torch keeps one entry
# under NON_GROUP_MEMBER (its pg_group_ranks[-100]), which its rank queries read
non_member_ranks: list[int] | None = None
engines: dict[str, Any] = {}  # engine name -> the world's Engine of that name
next_group_id = 0
backend_name = None


def set_world(pg) -> None:
    global default_pg
    default_pg = pg
    GroupMember.WORLD = pg
    group.WORLD = pg


def allocate_group_id() -> int:
    global next_group_id
    with lock:
        gid = next_group_id
        next_group_id += 1
        return gid


def reset() -> None:
    global default_pg, store, global_rank, world_size, next_group_id, backend_name, non_member_ranks
    default_pg = None
    store = None
    global_rank = -1
    world_size = -1
    next_group_id = 0
    backend_name = None
    non_member_ranks = None
    groups.clear()
    backends.clear()
    engines.clear()
    GroupMember.WORLD = None
    group.WORLD = None
