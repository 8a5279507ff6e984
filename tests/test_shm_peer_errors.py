"""What a rank sees when a peer's shared memory cannot be had, and when ranks disagree about a call.

Shared memory is set up per group at its first collective: each member publishes its segment (an
unnamed file, opened by peers through ``/proc/<pid>/fd/<n>``) in its directory, then opens every
other member's. Opening a peer's segment can fail, and each way it fails is a distcomm error naming
the operation, its sequence number, this rank, the peer and what to do, never a raw OSError:

* the peer was SIGKILLed after publishing and before this rank opened it: PeerLostError naming it
  (the same test of a peer's life every wait makes);
* the peer is alive but set the group up with other members: CollectiveMismatchError on every rank,
  whoever comes first or last (new_group checks its members through the store before any engine
  sees them; the engine's own check, beneath it, is tested here on a group built without new_group);
* the peer is alive but gave up setting the group up (it timed out waiting for a late member): the
  late member gets DistTimeoutError naming it;
* the path the peer published leads to another file (its descriptor number reused): that file is
  never mapped, and the error says so; the peer, which waits for this rank to map its memory in
  turn, learns at once that this rank gave up (not at the group's timeout);
* at init, a peer killed after publishing its world segment: PeerLostError from init_process_group.

And a CollectiveMismatchError on shared memory says what differs, in words and with both ranks'
values: the collective, the dtype, the reduce op or the size, on every rank, including sizes past one
slot, whose root check runs in a round of its own: that round carries the call's size, so a rank that
passed another size is found there by every member (a scatter's non-root with the root's size used
to return as if nothing were wrong, and only the odd rank failed, rounds later).

Every world has a hard deadline (run_world kills it), the worlds' own timeouts are far longer than
what the tests wait for (a late detection fails as a timeout, not as a flaky timing), and no process
or segment is left behind (each world gets its own segment directory).
"""

from __future__ import annotations

import multiprocessing
import os

import pytest

from harness import run_world

PROMPT_S = 10  # a vanished peer must be reported well before any timeout of these worlds


def no_children_left():
    alive = list(multiprocessing.active_children())
    assert alive == [], f"processes left running: {alive}"


def no_segments_named():
    leftovers = [n for n in os.listdir("/dev/shm") if n.startswith("distcomm-") and not n.startswith("distcomm-test-")]
    assert leftovers == [], leftovers


def _outcome(call):
    """(exception class name, message, is a RuntimeError, seconds) of ``call()``, or ("no error", ...)."""
    import time

    start = time.monotonic()
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - what kind of exception is the point
        return type(exc).__name__, str(exc), isinstance(exc, RuntimeError), time.monotonic() - start
    return "no error", "", True, time.monotonic() - start


def when_a_segment_appears(seg_dir: str, then, settle: float = 0.5) -> None:
    """Start a thread that waits for this process to open a new file in ``seg_dir`` (a segment of
    the group whose first collective comes next), waits ``settle`` seconds more (the segment is
    published right after it is made) and calls ``then(fds)`` with every descriptor of a file in
    ``seg_dir`` opened since (a rank may make more than one file for a group, in either order): a
    fault injected at that point from outside distcomm, through what the OS shows of the process."""
    import threading
    import time

    def segments() -> dict[int, str]:
        found = {}
        for name in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{name}")
            except OSError:
                continue
            if target.startswith(seg_dir.rstrip("/") + "/"):  # a file in it, not the directory itself
                found[int(name)] = target
        return found

    before = segments()

    def watch() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            new = [fd for fd, target in segments().items() if before.get(fd) != target]
            if new:  # the first one seen: this process makes its own segment before it opens its peers'
                time.sleep(settle)
                then(sorted(fd for fd, target in segments().items() if before.get(fd) != target))
                return
            time.sleep(0.001)

    threading.Thread(target=watch, daemon=True).start()


# -- a peer SIGKILLed between publishing its group segment and this rank's opening it ---------------
def killed_after_publishing_body(rank, world):
    """Rank 1 is SIGKILLed right after publishing its segment for group [1, 2]; rank 2 comes once
    rank 1 is gone. Rank 0 hosts the store, so it stays until rank 2 is done."""
    import signal
    import time

    import numpy as np

    import distcomm as dist
    from distcomm.transport.shm_wait import process_alive

    dist.init_process_group("gloo")  # the default engine: shared memory on one host
    pids = [None] * world
    dist.all_gather_object(pids, os.getpid())
    group = dist.new_group([1, 2])
    done = dist.new_group([0, 2])
    dist.barrier()  # every rank is past new_group's store checks before rank 1 dies
    if rank == 1:
        when_a_segment_appears(os.environ["DISTCOMM_SHM_DIR"], lambda fds: os.kill(os.getpid(), signal.SIGKILL))
        dist.all_reduce(np.ones(4, np.float32), group=group)
        return "rank 1 survived"
    out = None
    if rank == 2:
        give_up = time.monotonic() + 60
        while process_alive(pids[1]) and time.monotonic() < give_up:
            time.sleep(0.01)
        assert not process_alive(pids[1]), "rank 1 never died"
        out = _outcome(lambda: dist.all_reduce(np.ones(4, np.float32), group=group)), pids[1]
    dist.barrier(group=done)
    return out


@pytest.mark.slow
def test_peer_killed_after_publishing_its_group_segment_is_reported_lost(seg_dir):
    results = run_world(killed_after_publishing_body, 3, timeout=90, expect_failure=[1],
                        env={"DISTCOMM_SHM_DIR": seg_dir})
    (kind, msg, is_runtime, seconds), pid = results[2]
    assert kind == "PeerLostError" and is_runtime, (kind, msg)
    assert msg.startswith("all_reduce #1 on rank 1 (peer rank 0): "), msg  # group ranks: global 2 and 1
    assert f"rank 1 exited (pid {pid} is gone) before this rank could map its shared memory for group" in msg, msg
    assert "restart the job" in msg, msg
    assert seconds < PROMPT_S, seconds
    no_children_left()
    no_segments_named()


# -- ranks that pass different members to new_group ---------------------------------------------------
def different_members_body(rank, world):
    import numpy as np

    import distcomm as dist
    from datetime import timedelta

    from distcomm.process_group import ProcessGroup

    dist.init_process_group("gloo")
    # the group built on the world's engine directly: new_group would refuse the disagreement
    # through the store first (tests/test_new_group_agreement.py), and the engine must meet it too
    world_pg = dist.group.WORLD
    group = ProcessGroup(1, "disagreeing", [0, 1] if rank == 0 else [0, 1, 2], rank, world_pg.engine,
                         world_pg.backend_name, timedelta(seconds=30), world_pg.engine_name, world_pg.store)
    x = np.ones(4, np.float32)
    if rank == 2:
        dist.barrier()  # after ranks 0 and 1 have failed: rank 0 has let go of its segment by now
        out = _outcome(lambda: dist.all_reduce(x, group=group))
    else:
        out = _outcome(lambda: dist.all_reduce(x, group=group))
        dist.barrier()
    dist.barrier()  # nobody closes its transport before rank 2 is done
    dist.destroy_process_group()
    return out


@pytest.mark.slow
def test_ranks_that_disagree_on_a_groups_members_all_get_a_mismatch(seg_dir):
    results = run_world(different_members_body, 3, timeout=90, env={"DISTCOMM_SHM_DIR": seg_dir})
    for rank, (kind, msg, is_runtime, seconds) in enumerate(results):
        assert kind == "CollectiveMismatchError" and is_runtime, (rank, kind, msg)
        assert msg.startswith(f"all_reduce #1 on rank {rank} "), msg
        if rank == 0:
            assert "rank 1 set up process group 1 with 3 members, this rank with 2 ([0, 1])" in msg, msg
        else:
            assert "rank 0 set up process group 1 with 2 members, this rank with 3 ([0, 1, 2])" in msg, msg
        assert "passed different ranks to new_group" in msg, msg
        assert seconds < PROMPT_S, (rank, seconds)
    no_children_left()
    no_segments_named()


# -- a member that comes after the others gave up setting the group up ---------------------------------
def late_member_body(rank, world):
    from datetime import timedelta

    import numpy as np

    import distcomm as dist

    dist.init_process_group("gloo")
    group = dist.new_group([0, 1, 2], timeout=timedelta(seconds=2))
    x = np.ones(4, np.float32)
    if rank == 2:
        dist.barrier()  # ranks 0 and 1 have timed out waiting for this rank by now
        out = _outcome(lambda: dist.all_reduce(x, group=group))
    else:
        out = _outcome(lambda: dist.all_reduce(x, group=group))
        dist.barrier()
    dist.barrier()  # nobody closes its transport before rank 2 is done
    dist.destroy_process_group()
    return out


@pytest.mark.slow
def test_a_member_later_than_the_groups_timeout_hears_who_gave_up(seg_dir):
    results = run_world(late_member_body, 3, timeout=90, env={"DISTCOMM_SHM_DIR": seg_dir})
    for rank in (0, 1):
        kind, msg, _, _ = results[rank]
        assert kind == "DistTimeoutError" and "rank 2" in msg, (rank, kind, msg)
    kind, msg, is_runtime, seconds = results[2]
    assert kind == "DistTimeoutError" and is_runtime, (kind, msg)
    assert msg.startswith("all_reduce #1 on rank 2 (peer rank 0): rank 0 gave up setting up the shared memory of "
                          "group 1, so this group's first collective cannot complete: it timed out waiting for a "
                          "member"), msg
    assert seconds < PROMPT_S, seconds  # not this rank's own timeout: it learns at once
    no_children_left()
    no_segments_named()


# -- the published path leads to another file: never mapped -----------------------------------------
def reused_descriptor_body(rank, world, decoy_mode):
    import time

    import numpy as np

    import distcomm as dist
    from distcomm.transport.shm_segment import shm_dir

    dist.init_process_group("gloo")
    dist.barrier()  # the world group's shared memory is set up before the decoy goes in
    group = dist.new_group([0, 1])  # the default timeout (30 minutes): nobody waits for it
    x = np.ones(4, np.float32)
    decoy = None
    ready = os.environ["DISTCOMM_SHM_DIR"] + ".decoy-in-place"  # beside the segment directory, not in it
    if rank == 0:
        made = []

        def reuse(fds):
            # another file of this process takes each new segment's descriptor number, as a close
            # and an open would: the directory still names the segment, the path leads to a decoy
            for fd in fds:
                other = os.open(shm_dir(), os.O_TMPFILE | os.O_RDWR, 0o600)
                os.fchmod(other, decoy_mode)
                os.ftruncate(other, 1 << 20)
                os.dup2(other, fd)
                os.close(other)
                made.append(os.fstat(fd).st_ino)
            os.close(os.open(ready, os.O_CREAT | os.O_WRONLY, 0o600))

        when_a_segment_appears(shm_dir(), reuse)
        out = _outcome(lambda: dist.all_reduce(x, group=group))
        decoy = made
        maps = None
    else:
        while not os.path.exists(ready):  # rank 0's segment is published and its path leads to the decoy
            time.sleep(0.01)
        out = _outcome(lambda: dist.all_reduce(x, group=group))
        with open("/proc/self/maps") as f:  # every file this process has mapped, right after the error
            maps = {int(line.split()[4]) for line in f if len(line.split()) >= 5}
    inodes = [None] * world
    dist.all_gather_object(inodes, decoy)
    if rank == 0:
        os.unlink(ready)
    dist.destroy_process_group()
    return out, None if maps is None else any(inode in maps for inode in inodes[0])


@pytest.mark.slow
@pytest.mark.parametrize("decoy_mode,refusal", [
    (0o600, "no longer holds that segment"),  # a private file of ours, but not the segment named
    (0o644, "is not a private segment of this user"),  # a file that others may read
], ids=["private-file", "readable-file"])
def test_a_segment_path_leading_to_another_file_is_refused_and_never_mapped(seg_dir, decoy_mode, refusal):
    results = run_world(reused_descriptor_body, 2, args=(decoy_mode,), timeout=90, env={"DISTCOMM_SHM_DIR": seg_dir})
    (kind, msg, is_runtime, seconds), mapped = results[1]
    assert mapped is False  # no decoy's inode is in any of rank 1's mappings
    assert kind == "DistBackendError" and is_runtime, (kind, msg)
    assert msg.startswith("all_reduce #1 on rank 1 (peer rank 0): rank 0 published its shared memory for group 1, "
                          "but this rank cannot open it ("), msg
    assert refusal in msg and "only the segment it named is ever mapped" in msg, msg
    assert seconds < PROMPT_S, seconds
    # rank 0 mapped rank 1's memory and waited for rank 1 to map its own: it learns that rank 1 gave up
    kind, msg, _, seconds = results[0][0]
    assert kind == "DistBackendError", (kind, msg)
    assert msg.startswith("all_reduce #1 on rank 0 (peer rank 1): rank 1 gave up setting up the shared memory of "
                          "group 1, so this group's first collective cannot complete"), msg
    assert seconds < PROMPT_S, seconds
    no_children_left()
    no_segments_named()


# -- init: a peer killed after publishing its world segment -----------------------------------------
def killed_during_init_body(rank, world, store_file):
    import re
    import signal
    import time

    import distcomm as dist
    from distcomm.transport import shm
    from distcomm.transport.shm_wait import process_alive

    if rank == 1:  # dies once it has published its segment
        when_a_segment_appears(os.environ["DISTCOMM_SHM_DIR"], lambda fds: os.kill(os.getpid(), signal.SIGKILL))
    else:  # opens each peer's segment (Segment.open, wrapped) only once that peer is gone
        open_segment = shm.Segment.open.__func__

        def open_when_gone(cls, name):
            pid = int(re.match(r"distcomm@(\d+)\.", name).group(1))
            give_up = time.monotonic() + 60
            while pid != os.getpid() and process_alive(pid) and time.monotonic() < give_up:
                time.sleep(0.01)
            return open_segment(cls, name)

        shm.Segment.open = classmethod(open_when_gone)
    url = f"file://{store_file}"
    return _outcome(lambda: dist.init_process_group("shm", init_method=url, rank=rank, world_size=world))


@pytest.mark.slow
def test_peer_killed_after_publishing_its_world_segment_fails_init_with_peer_lost(seg_dir, tmp_path):
    results = run_world(killed_during_init_body, 2, args=(str(tmp_path / "store"),), timeout=90,
                        expect_failure=[1], env={"DISTCOMM_SHM_DIR": seg_dir})
    kind, msg, is_runtime, seconds = results[0]
    assert kind == "PeerLostError" and is_runtime, (kind, msg)
    assert msg.startswith("init_process_group on rank 0 (peer rank 1): rank 1 exited (pid "), msg
    assert "before this rank could map its shared memory" in msg and "restart the job" in msg, msg
    assert seconds < 60, seconds
    no_children_left()
    no_segments_named()


# -- mismatches on shared memory say what differs ------------------------------------------------------
def mismatch_body(rank, world):
    import numpy as np

    import distcomm as dist

    dist.init_process_group("gloo")
    mib = 1 << 18  # float32 elements in 1 MiB: one slot; twice that takes the multi-round forms
    odd = {"broadcast": 1, "reduce": 0, "gather": 2, "scatter": 2}  # the rank passing 2 MiB

    def n(op):
        return 2 * mib if rank == odd[op] else mib

    cases = {
        "broadcast": lambda g: dist.broadcast(np.zeros(n("broadcast"), np.float32), src=0, group=g),
        "reduce": lambda g: dist.reduce(np.ones(n("reduce"), np.float32), dst=0, group=g),
        "gather": lambda g: dist.gather(np.ones(n("gather"), np.float32),
                                        [np.zeros(mib, np.float32) for _ in range(world)] if rank == 0 else None,
                                        dst=0, group=g),
        "scatter": lambda g: dist.scatter(np.zeros(n("scatter"), np.float32),
                                          [np.ones(mib, np.float32) for _ in range(world)] if rank == 0 else None,
                                          src=0, group=g),
        "op": lambda g: dist.all_reduce(np.ones(4, np.float32), op=dist.ReduceOp.MAX if rank == 1 else
                                        dist.ReduceOp.SUM, group=g),
        "dtype": lambda g: dist.all_reduce(np.ones(4, np.int32 if rank == 1 else np.float32), group=g),
        "collective": lambda g: dist.barrier(group=g) if rank == 1 else dist.all_reduce(np.ones(4, np.float32),
                                                                                         group=g),
    }
    out = {}
    for name, call in cases.items():
        group = dist.new_group(list(range(world)))  # a mismatch leaves a group's memory unusable: one each
        out[name] = _outcome(lambda: call(group))
    dist.barrier()
    dist.destroy_process_group()
    return out


@pytest.mark.slow
def test_mismatch_messages_say_what_differs_with_both_ranks_values(seg_dir):
    world = 3
    results = run_world(mismatch_body, world, timeout=120, env={"DISTCOMM_SHM_DIR": seg_dir})
    mib = 1 << 20
    odd = {"broadcast": 1, "reduce": 0, "gather": 2, "scatter": 2}
    for rank, out in enumerate(results):
        for name, (kind, msg, is_runtime, _) in out.items():
            assert kind == "CollectiveMismatchError" and is_runtime, (rank, name, kind, msg)
            assert "0x" not in msg and "another collective" not in msg, msg  # no raw signatures
        for op, o in odd.items():  # past one slot: the size both ranks passed
            msg = out[op][1]
            peer = o if rank != o else 1 if o == 0 else 0  # the odd rank names its first peer
            mine, theirs = (2 * mib, mib) if rank == o else (mib, 2 * mib)
            assert msg.startswith(f"{op} #1 on rank {rank} "), msg
            assert (f"in {op} #1 this rank passed {mine} bytes but rank {peer} passed {theirs} bytes; every rank of "
                    "the group must pass the same size") in msg, msg
        peer = 0 if rank == 1 else 1
        mine, theirs = ("MAX", "SUM") if rank == 1 else ("SUM", "MAX")
        assert (f"in all_reduce #1 this rank passed op={mine} but rank {peer} passed op={theirs}; every rank of the "
                "group must pass the same reduce op") in out["op"][1], out["op"][1]
        mine, theirs = ("int32", "float32") if rank == 1 else ("float32", "int32")
        assert (f"in all_reduce #1 this rank passed {mine} but rank {peer} passed {theirs}; every rank of the group "
                "must pass the same dtype") in out["dtype"][1], out["dtype"][1]
        mine, theirs = ("barrier", "all_reduce (float32, op=SUM)") if rank == 1 else ("all_reduce (float32, op=SUM)",
                                                                                      "barrier")
        assert (f"at call #1 of this group this rank called {mine} but rank {peer} called {theirs}; every rank of "
                "the group must make the same collective calls, in the same order") in out["collective"][1], \
            out["collective"][1]
    no_children_left()
    no_segments_named()


# -- the words themselves (no processes) ---------------------------------------------------------------
def test_signatures_decode_to_the_collective_its_dtype_reduce_op_and_root():
    from distcomm.signatures import decode, differences, signature

    assert decode(signature("barrier")).describe() == "barrier"
    assert decode(signature("all_reduce", 9, 4)).describe() == "all_reduce (float32, op=MAX)"
    assert decode(signature("broadcast", 5, root=3)).describe() == "broadcast (int32, src=3)"
    assert decode(signature("reduce", 10, 0, 1)).describe() == "reduce (float64, op=SUM, dst=1)"
    assert decode(signature("gather", 9)).describe() == "gather (float32)"  # root bits cleared: none shown
    assert decode(signature("all_gather", 9)).reduce_op is None  # its zero bits are no SUM
    assert differences(signature("all_reduce", 9, 0), signature("broadcast", 5)) == ["op"]
    assert differences(signature("reduce", 9, 0, 0), signature("reduce", 5, 4, 1)) == ["dtype", "reduce_op", "root"]


def test_mismatch_words_for_each_way_headers_differ():
    from distcomm.signatures import signature
    from distcomm.transport.shm_group import ROOT_ROUND, describe_mismatch

    bcast, ar = signature("broadcast", 9), signature("all_reduce", 9, 0)
    # a root check's round of its own carries the call's size: both sizes, whichever form each ran
    assert describe_mismatch(2, 1, 1, bcast, 16, 1, 1, bcast, 32 | ROOT_ROUND) == (
        "in broadcast #1 this rank passed 16 bytes but rank 2 passed 32 bytes; every rank of the group must pass "
        "the same size")
    # the same size in both forms: the ranks chose different algorithms, and are told so
    assert describe_mismatch(2, 1, 1, bcast, 16 | ROOT_ROUND, 1, 1, bcast, 16).startswith(
        "in broadcast #1 (broadcast (float32), 16 bytes) this rank checked the root in a round of its own and "
        "rank 2 in the call's only round")
    assert describe_mismatch(1, 3, 2, ar, 16, 3, 3, ar, 16).startswith(
        "rank 1 is at call #3 of this group (all_reduce (float32, op=SUM)) where this rank is at call #2")
    assert describe_mismatch(1, 9, 2, ar, 16, 5, 1, bcast, 16).startswith(
        "rank 1 is out of step with this rank on this group's shared memory: its slot of round 9 holds round 5")
    # any size (None): only what the signatures say
    assert describe_mismatch(1, 1, 1, signature("all_to_all_single", 9), None, 1, 1, ar, 0) == (
        "at call #1 of this group this rank called all_to_all_single (float32) but rank 1 called all_reduce "
        "(float32, op=SUM); every rank of the group must make the same collective calls, in the same order")
