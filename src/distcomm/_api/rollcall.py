"""The roll call of init_process_group: every rank says who it is before any engine connects.

Without it, ranks that disagree about the job wait for store keys that will never be written and
fail with a timeout naming an internal key (``distcomm/1//world//hostid/2``). Here each rank first
checks the two things that go wrong in practice, and says them in the user's words:

* **a duplicate rank**: two live processes given the same RANK. Each init of rank r takes the next
  number of the per-rank counter ``distcomm/init_generation/<r>`` (which is what keeps a re-init
  after destroy_process_group off the earlier init's keys) and records its owner (host id, pid).
  A rank whose previous number belongs to another process that is still running on this host is
  a duplicate (one on another host cannot be checked and is taken as an earlier run's);
* **a world size disagreement**: each rank publishes its world size under the init's namespace
  (``roll/<rank>``) and waits for ranks 0..world_size-1. A rank that sees another world size
  fills in the keys the others may still wait for with its finding, so every rank raises
  promptly, each naming the ranks and the sizes they were given.

A rank that never comes ends the wait at the init's timeout with the ranks that did not join, and,
when the store holds an earlier init's counters (a reused store), which.
"""

from __future__ import annotations

import json
import os
from datetime import timedelta

from ..errors import DistError, DistStoreError
from ..store import PrefixStore
from ..transport.hostid import host_id

_ABORT = "abort:"


def _alive_here(owner: dict) -> bool:
    """Is ``owner`` (host id, pid) a running process of this host other than us?"""
    if owner.get("host") != host_id() or owner.get("pid") == os.getpid():
        return False
    try:
        with open(f"/proc/{owner['pid']}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")
    except (OSError, IndexError, KeyError, TypeError):
        return False


def take_generation(store, rank: int, world_size: int, timeout: timedelta) -> int:
    """This init's number for ``rank`` (1 for the first); DistError if another live process of this
    host already holds the same rank."""
    generation = store.add(f"distcomm/init_generation/{rank}", 1)
    me = {"host": host_id(), "pid": os.getpid()}
    store.set(f"distcomm/init_owner/{rank}/{generation}", json.dumps(me))
    if generation > 1:
        key = f"distcomm/init_owner/{rank}/{generation - 1}"
        try:
            store.wait([key], min(timeout, timedelta(seconds=5)))
            owner = json.loads(store.get(key))
        except (DistStoreError, ValueError):
            owner = {}
        if _alive_here(owner):
            text = (f"rank {rank} is taken twice: by pid {owner['pid']} and by pid {os.getpid()}, both on this host "
                    f"with world_size={world_size}. Give every process its own RANK (0..WORLD_SIZE-1): check the "
                    "RANK/LOCAL_RANK you set, or launch with distcomm-run")
            earlier = namespace(store, generation - 1)  # the other one may be waiting there: tell it
            for q in range(world_size):
                earlier.compare_set(f"roll/{q}", "", _ABORT + text)
            raise DistError(f"init_process_group: {text}")
    return generation


def namespace(store, generation: int):
    """The keys of init number ``generation``: a re-init never reads an earlier init's keys."""
    return PrefixStore(f"distcomm/{generation}/", store)


def roll_call(store, rank: int, world_size: int, timeout: timedelta) -> None:
    """Publish this rank's world size, wait for ranks 0..world_size-1, and raise DistError naming the
    disagreement if any rank was given another world size. ``store`` is the init's namespace."""
    store.set(f"roll/{rank}", str(world_size))
    keys = [f"roll/{q}" for q in range(world_size)]
    try:
        store.wait(keys, timeout)
    except DistStoreError:
        missing = [q for q in range(world_size) if not store.check([f"roll/{q}"])]
        raise DistError(
            f"init_process_group on rank {rank}: rank(s) {missing} of world_size={world_size} did not join within "
            f"{timeout.total_seconds():g} s. Check that every process was started and given the same "
            "MASTER_ADDR/MASTER_PORT (or init_method) and world size; a store or file:// path reused from an "
            "earlier run can also keep ranks apart"
        ) from None
    values = [v.decode() if isinstance(v, bytes) else str(v) for v in store.multi_get(keys)]
    aborted = next((v for v in values if v.startswith(_ABORT)), None)
    if aborted is not None:
        present = [q for q, v in enumerate(values) if not v.startswith(_ABORT)]
        _fail(store, rank, present, aborted[len(_ABORT):])
    sizes = {q: int(v) for q, v in enumerate(values)}
    if all(n == world_size for n in sizes.values()):
        return
    by_size: dict[int, list[int]] = {}
    for q, n in sizes.items():
        by_size.setdefault(n, []).append(q)
    text = "ranks disagree on the world size: " + "; ".join(
        f"rank{'s' if len(qs) > 1 else ''} {', '.join(map(str, qs))} {'were' if len(qs) > 1 else 'was'} given "
        f"world_size={n}" for n, qs in sorted(by_size.items())
    ) + ". Give every process the same WORLD_SIZE (or world_size=)"
    # the ranks given a larger world wait for ranks that do not exist: answer in their place
    for q in range(world_size, max(sizes.values())):
        store.compare_set(f"roll/{q}", "", _ABORT + text)
    _fail(store, rank, list(sizes), text)


FINISH_WAIT_S = 10.0  # how long rank 0 waits at the end of init for the others' last store call


def finish(store, rank: int, world_size: int, wait: float = FINISH_WAIT_S) -> None:
    """The last store call of every rank's init (``store``: the init's namespace).

    Under env:// rank 0's process hosts the store, and a program whose rank 0 is quick (send one
    tensor, print, exit) can end it while another rank, descheduled between two store calls of
    its init, has yet to send the last one: that rank then fails with a lost store. So every other
    rank says it is done, and rank 0 returns once they all have (their earlier requests answered;
    this one needs no answer), or after ``wait`` seconds: a rank that failed meanwhile raises its own
    error, and rank 0's first collective reports it."""
    if world_size < 2:
        return
    if rank != 0:
        store.set(f"done/{rank}", "1")
        return
    try:
        store.wait([f"done/{q}" for q in range(1, world_size)], timedelta(seconds=wait))
    except DistError:
        pass


def _fail(store, rank: int, present: list[int], text: str) -> None:
    """Raise DistError(text). Rank 0 first gives the others (``present``: the ranks that joined) a
    moment to read what they need: under env:// and tcp:// it hosts the store, and its exit would
    turn their error into a lost store."""
    try:
        store.set(f"roll/failed/{rank}", "1")
        if rank == 0:
            store.wait([f"roll/failed/{q}" for q in present if q != 0], timedelta(seconds=5))
    except DistError:
        pass
    raise DistError(f"init_process_group on rank {rank}: {text}")
