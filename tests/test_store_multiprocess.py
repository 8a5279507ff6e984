"""Stores across processes (tests/harness.py worlds, each with a hard deadline): an exact total from
16 processes doing 1000 add() each on TCPStore and on FileStore, blocking get/wait/multi_get
released by a set from another process, through the env:// rendezvous, and several processes
popping one queue, blocking and not, with every pushed item popped exactly once.

Tiers: slow. The fast tier (``pytest -m "not slow"``) has the same calls on threads
(test_store_conformance), and its multi-process tests rendezvous through TCPStore.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

import pytest

from distcomm.errors import QueueEmptyError
from distcomm.rendezvous import rendezvous
from distcomm.store import FileStore, TCPStore
from harness import run_world

pytestmark = pytest.mark.slow

ADDS = 1000


def _sixteen_adders(rank: int, world_size: int, file_path: str) -> tuple[int, int]:
    tcp = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, rank == 0,
                   timeout=timedelta(seconds=60))
    shared_file = FileStore(file_path, world_size)
    shared_file.set_timeout(timedelta(seconds=60))
    for store in (tcp, shared_file):
        for _ in range(ADDS):
            store.add("counter", 1)
        if store.add("finished", 1) == world_size:
            store.set("all finished", "1")
    totals = []
    for store in (tcp, shared_file):
        store.wait(["all finished"])
        totals.append(int(store.get("counter")))
    if rank == 0:  # the master's server must outlive every other rank's last request
        tcp.wait([f"gone/{r}" for r in range(1, world_size)])
    else:
        tcp.set(f"gone/{rank}", "1")
    shared_file.close()
    return tuple(totals)


def test_sixteen_processes_add_an_exact_total(tmp_path):
    path = str(tmp_path / "filestore")
    results = run_world(_sixteen_adders, 16, args=(path,), timeout=120)
    assert results == [(16 * ADDS, 16 * ADDS)] * 16
    assert not os.path.exists(path)  # the last of the 16 users removed it


def _blocked_then_released(rank: int, world_size: int, file_path: str):
    store, got_rank, got_world = next(rendezvous("env://", timeout=timedelta(seconds=30)))
    assert (got_rank, got_world) == (rank, world_size)
    shared_file = FileStore(file_path, world_size)
    shared_file.set_timeout(timedelta(seconds=30))
    if rank == 1:
        start = time.monotonic()
        value = store.get("late")  # blocks until rank 0 sets it
        store.wait(["w1", "w2"])
        values = store.multi_get(["w1", "w2"])
        file_value = shared_file.get("late")
        shared_file.wait(["w1"])
        store.set("done", "1")
        return value, values, file_value, time.monotonic() - start
    store.add("ready", 1)
    time.sleep(0.3)  # rank 1 is now blocked in get()
    store.set("late", "from rank 0")
    store.multi_set(["w1", "w2"], ["a", "b"])
    shared_file.set("late", "file value")
    shared_file.set("w1", "x")
    store.wait(["done"])
    return None


def test_blocking_get_and_wait_are_released_by_another_process(tmp_path):
    results = run_world(_blocked_then_released, 2, args=(str(tmp_path / "fs"),), timeout=60)
    value, values, file_value, waited = results[1]
    assert value == b"from rank 0"
    assert values == [b"a", b"b"]
    assert file_value == b"file value"
    assert waited > 0.1  # it really blocked (no timing bound: the machine is shared)


QUEUE_ITEMS = 300


def _pop_until_stop(store, block: bool) -> list[int]:
    got = []
    while True:
        try:
            item = store.queue_pop("work", block)
        except QueueEmptyError:  # only without blocking: try again shortly
            time.sleep(0.001)
            continue
        if item == b"stop":
            return got
        got.append(int(item))


def _one_queue_many_poppers(rank: int, world_size: int, file_path: str) -> list[list[int]]:
    tcp = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, rank == 0,
                   timeout=timedelta(seconds=60))
    shared_file = FileStore(file_path, world_size)
    shared_file.set_timeout(timedelta(seconds=60))
    popped = []
    for store in (tcp, shared_file):
        store.barrier("poppers ready", world_size)
        if rank == 0:
            for n in range(QUEUE_ITEMS):
                store.queue_push("work", str(n))
            for _ in range(world_size - 1):
                store.queue_push("work", "stop")  # one per popper, after every item: FIFO brings it last
            popped.append([])
        else:
            popped.append(_pop_until_stop(store, block=rank % 2 == 1))  # odd ranks block, even ranks poll
        store.barrier("all popped", world_size)
        assert store.queue_len("work") == 0
    if rank == 0:  # the master's server must outlive every other rank's last request
        tcp.wait([f"gone/{r}" for r in range(1, world_size)])
    else:
        tcp.set(f"gone/{rank}", "1")
    shared_file.close()
    return popped


def test_processes_popping_one_queue_get_every_item_exactly_once(tmp_path):
    results = run_world(_one_queue_many_poppers, 4, args=(str(tmp_path / "queue-file"),), timeout=120)
    for store_index in (0, 1):  # TCPStore, FileStore
        popped = [item for rank_results in results for item in rank_results[store_index]]
        assert sorted(popped) == list(range(QUEUE_ITEMS))  # none lost, none twice
        for rank_results in results:
            assert rank_results[store_index] == sorted(rank_results[store_index])  # each popper: push order
