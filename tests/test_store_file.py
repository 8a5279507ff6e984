"""FileStore's own contract: who removes the file and when, and how a stale or foreign file is refused."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from distcomm.errors import DistStoreError
from distcomm.store import FileStore
from distcomm.store.file import MAGIC, RendezvousFileStore


def test_the_last_of_world_size_users_removes_the_file(tmp_path):
    path = str(tmp_path / "fs")
    first = FileStore(path, 2)
    first.set("k", "v")
    first.close()  # finished before the second user even opened it: the file must stay
    assert os.path.exists(path)
    second = FileStore(path, 2)
    assert second.get("k") == b"v"
    second.close()
    assert not os.path.exists(path)


def test_without_world_size_the_last_open_user_removes_it(tmp_path):
    path = str(tmp_path / "fs")
    a, b = FileStore(path), FileStore(path)
    a.set("k", "v")
    a.close()
    assert b.get("k") == b"v" and os.path.exists(path)
    b.close()
    assert not os.path.exists(path)


def test_garbage_collection_and_close_are_the_same_leave(tmp_path):
    path = str(tmp_path / "fs")
    store = FileStore(path, 1)
    store.close()
    store.close()  # idempotent
    assert not os.path.exists(path)
    store = FileStore(path, 1)
    del store
    assert not os.path.exists(path)


def test_a_closed_store_refuses_operations(tmp_path):
    store = FileStore(str(tmp_path / "fs"), 1)
    store.close()
    with pytest.raises(DistStoreError, match="closed"):
        store.set("k", "v")


def test_path_and_empty_file(tmp_path):
    path = tmp_path / "fs"
    path.write_bytes(b"")  # an empty file is a new store, as torch's docs promise
    store = FileStore(str(path), 1)
    assert store.path == str(path)
    store.set("k", "v")
    assert store.num_keys() == 2  # the key, and the store's own membership key (torch counts one too)
    store.close()


_CRASHING_USER = textwrap.dedent(
    """
    import os, sys
    from distcomm.store import FileStore
    store = FileStore(sys.argv[1], int(sys.argv[2]))
    store.set("old run", "old value")
    os.kill(os.getpid(), 9)
    """
)


def _crash_a_user(path: str, world_size: int) -> None:
    result = subprocess.run([sys.executable, "-c", _CRASHING_USER, path, str(world_size)], capture_output=True)
    assert result.returncode == -signal.SIGKILL, result.stderr


def test_a_file_left_by_a_crashed_run_starts_afresh_with_a_warning(tmp_path):
    path = str(tmp_path / "fs")
    _crash_a_user(path, 2)
    with pytest.warns(RuntimeWarning) as caught:
        fresh = FileStore(path, 2)  # its only holder is provably dead: nobody can be using it
    text = str(caught[0].message)
    assert path in text and "pid" in text and "starts afresh" in text and "1 old keys" in text, text
    assert not fresh.check(["old run"])
    fresh.set("k", "v")
    assert fresh.get("k") == b"v"
    fresh.close()


def test_a_crashed_user_beside_a_live_one_is_reported_not_reused(tmp_path):
    path = str(tmp_path / "fs")
    live = FileStore(path, 3)
    _crash_a_user(path, 3)
    with pytest.raises(DistStoreError) as info:
        FileStore(path, 3)
    text = str(info.value)
    assert "stale" in text and path in text and "pid" in text and "still hold it" in text and "delete it" in text
    assert live.get("old run") == b"old value"  # the live user's file was left alone
    live.close()


def test_rendezvous_file_store_starts_afresh_a_file_nobody_holds(tmp_path):
    path = str(tmp_path / "fs")

    def left_by_one_of_two_users():
        one = FileStore(path, 2)
        one.set("old", "1")
        one.close()  # 1 of 2 users finished: the file stays, for the second
        assert os.path.exists(path)

    left_by_one_of_two_users()
    late = FileStore(path, 2)  # the plain store: a late second user reads what the first left
    assert late.get("old") == b"1"
    late.close()
    assert not os.path.exists(path)

    left_by_one_of_two_users()
    fresh = RendezvousFileStore(path, 2)  # the file:// rendezvous: a failed run's file
    assert not fresh.check(["old"])
    peer = RendezvousFileStore(path, 2)  # held open by `fresh`: joined as it is
    fresh.set("new", "2")
    assert peer.get("new") == b"2"
    fresh.close()
    peer.close()
    assert not os.path.exists(path)


def test_a_file_whose_users_all_finished_is_leftover(tmp_path):
    path = str(tmp_path / "fs")
    one, two = FileStore(path, 2), FileStore(path, 2)
    os.link(path, str(tmp_path / "keep"))  # the file survives its removal under another name
    one.close()
    two.close()
    os.rename(str(tmp_path / "keep"), path)
    with pytest.raises(DistStoreError, match="already been opened by world_size=2 users"):
        FileStore(path, 2)


def test_world_size_mismatch(tmp_path):
    path = str(tmp_path / "fs")
    first = FileStore(path, 2)
    with pytest.raises(DistStoreError, match="created with world_size=2, not 3"):
        FileStore(path, 3)
    first.close()


def test_a_foreign_file_is_refused(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("my notes")
    with pytest.raises(DistStoreError, match="not a distcomm FileStore file"):
        FileStore(str(path), 1)
    assert path.read_text() == "my notes"


def test_a_torn_record_is_reported(tmp_path):
    path = str(tmp_path / "fs")
    store = FileStore(path, 2)
    with open(path, "ab") as f:
        f.write(b"S\x05\x00\x00\x00")  # a record head cut short, as by a writer killed mid-append
    with pytest.raises(DistStoreError, match="torn record"):
        store.get("anything")
    with pytest.raises(DistStoreError, match="torn record"):
        FileStore(path, 2)


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError):
        FileStore("", 1)
    with pytest.raises(ValueError):
        FileStore(str(tmp_path / "fs"), 0)
    with pytest.raises(TypeError):
        FileStore(str(tmp_path / "fs"), "2")


def test_magic_is_at_the_start(tmp_path):
    path = str(tmp_path / "fs")
    store = FileStore(path, 2)
    with open(path, "rb") as f:
        assert f.read(len(MAGIC)) == MAGIC
    store.close()


def test_a_clone_shares_the_membership_of_the_store_it_was_cloned_from(tmp_path):
    path = str(tmp_path / "fs")
    first = FileStore(path, 2)
    twin = first.clone()  # not a second user: world_size=2 still has room for one
    second = FileStore(path, 2)
    twin.set("k", "v")
    assert second.get("k") == b"v"
    twin.close()  # a clone's close is not a leave
    assert first.get("k") == b"v"
    another = first.clone()
    first.close()  # the original leaves, for its clones too
    with pytest.raises(DistStoreError, match="closed"):
        another.get("k")
    assert os.path.exists(path)
    second.close()
    assert not os.path.exists(path)


def test_queue_records_are_read_by_every_user_and_pops_are_not_repeated(tmp_path):
    path = str(tmp_path / "fs")
    a, b = FileStore(path), FileStore(path)
    a.queue_push("q", "1")
    a.queue_push("q", b"\x00two")
    assert b.queue_len("q") == 2
    assert b.queue_pop("q") == b"1"
    assert a.queue_pop("q", block=False) == b"\x00two"  # a's copy showed "1" first: it reads b's pop before taking
    assert a.queue_len("q") == b.queue_len("q") == 0
    a.queue_push("q", "3")
    c = FileStore(path)  # a new user replays the whole log: pushes and pops
    assert c.queue_len("q") == 1 and c.queue_pop("q") == b"3"
    for store in (a, b, c):
        store.close()


def test_a_leave_while_this_thread_holds_the_file_lock_does_not_deadlock(tmp_path):
    """A store's leave can run (a finalizer, in the garbage collector) while this thread holds the
    file's lock through another store of the same path: it must not wait for it, and still leave."""
    import fcntl
    import threading
    import time

    from distcomm.store.file import _file_lock

    path = str(tmp_path / "fs")
    a, b = FileStore(path), FileStore(path)
    with _file_lock(b._fd, fcntl.LOCK_EX):  # b in the middle of an operation, when a is collected
        closer = threading.Thread(target=a.close, daemon=True)
        closer.start()
        closer.join(10)
        assert not closer.is_alive(), "a's leave waited for the lock this thread holds"
    deadline = time.monotonic() + 10
    while any(t.name == "distcomm-filestore-leave" for t in threading.enumerate()):
        assert time.monotonic() < deadline, "the helper never left for a"
        time.sleep(0.01)
    b.close()  # a has left, so b was the last user
    assert not os.path.exists(path)
