"""Parking on plain values: no sockets, no clock, no table — owners are strings, deadlines numbers.

What it must get right is who is released when: a request waiting on several keys only after the
last, oldest first; a request whose deadline comes, in deadline order and only once; one that was
answered or whose client hung up, never again.
"""

from __future__ import annotations

from distcomm.store.tcp.parking import Parking


class Get:  # stand-ins for the requests the server parks: parking looks at nothing but their class
    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


class Wait(Get):
    pass


def _names(parked_list) -> list:
    return [parked.request.name for parked in parked_list]


# -- waiting for keys -------------------------------------------------------------------------------------


def test_a_request_is_released_by_the_write_of_its_last_missing_key():
    parking = Parking()
    both = parking.park("alice", Get("both"), 10.0, keys=[b"a", b"b"], missing=[b"a", b"b"])
    assert parking.written(b"a") == []
    assert both.missing == {b"b"} and len(parking) == 1
    assert parking.written(b"b") == [both]
    assert parking.waiting == {}
    assert not both.done and len(parking) == 1  # the caller answers it: still parked until released
    parking.release(both)
    assert both.done and len(parking) == 0


def test_a_write_releases_every_request_it_completes_oldest_first_and_no_other():
    parking = Parking()
    first = parking.park("alice", Get("first"), 10.0, missing=[b"k"])
    parking.park("bob", Get("needs more"), 10.0, missing=[b"k", b"other"])
    second = parking.park("carol", Get("second"), 5.0, missing=[b"k"])
    assert parking.written(b"k") == [first, second]
    assert parking.written(b"k") == []  # nobody waits on it any more
    assert _names(parking.written(b"other")) == ["needs more"]
    assert parking.written(b"never parked on") == []


def test_a_request_asking_for_a_key_twice_is_released_once():
    parking = Parking()
    twice = parking.park("alice", Get("twice"), 10.0, keys=[b"k", b"k"], missing=[b"k"])
    parking.wait_for(twice, [b"k"])  # listed a second time under the same key
    assert parking.written(b"k") == [twice]


def test_a_request_whose_key_went_missing_again_waits_on():
    parking = Parking()
    request = parking.park("alice", Get("r"), 10.0, missing=[b"a"])
    (released,) = parking.written(b"a")
    parking.wait_for(released, [b"a"])  # the caller found it deleted meanwhile
    assert parking.waiting == {b"a": [request]} and request.missing == {b"a"}
    assert parking.written(b"a") == [request]


def test_a_queue_item_wakes_only_the_oldest_wait():
    parking = Parking()
    get = parking.park("alice", Get("get"), 10.0, missing=[b"q"])
    old = parking.park("bob", Wait("old"), 10.0, missing=[b"q"])
    young = parking.park("carol", Wait("young"), 10.0, missing=[b"q"])
    both = parking.park("dave", Wait("both"), 10.0, missing=[b"q", b"x"])
    assert parking.wake_oldest(b"q", Wait) is old  # the GET before it waits for a set, not an item
    assert parking.waiting[b"q"] == [get, young, both]
    assert parking.wake_oldest(b"q", Wait) is young
    assert parking.wake_oldest(b"q", Wait) is None  # "both" took the wake-up but still misses x
    assert both.missing == {b"x"} and parking.waiting[b"q"] == [get]
    assert parking.wake_oldest(b"q", Wait) is None and parking.wake_oldest(b"nobody", Wait) is None


# -- lines -------------------------------------------------------------------------------------------------


def test_a_line_serves_its_oldest_first_and_forgets_whoever_leaves():
    parking = Parking()
    line = ("pop", b"q")
    first = parking.park("alice", Get("first"), 10.0, line=line)
    second = parking.park("bob", Get("second"), 10.0, line=line)
    parking.park("carol", Get("elsewhere"), 10.0, line=("pop", b"other"))
    assert parking.first_in_line(line) is first
    assert parking.in_line(line) == [first, second]
    parking.release(first)
    assert parking.first_in_line(line) is second
    parking.release(second)
    assert parking.first_in_line(line) is None and parking.in_line(line) == []
    assert _names(parking.in_line(("pop", b"other"))) == ["elsewhere"]


def test_in_line_is_a_copy_to_release_from():
    parking = Parking()
    barrier = ("barrier", b"b")
    for name in ("a", "b", "c"):
        parking.park(name, Get(name), 10.0, line=barrier)
    for parked in parking.in_line(barrier):
        parking.release(parked)
    assert len(parking) == 0 and parking.in_line(barrier) == []


# -- deadlines ---------------------------------------------------------------------------------------------


def test_deadlines_come_in_deadline_order_not_parking_order():
    parking = Parking()
    assert parking.next_deadline is None and parking.expired(1e9) == []
    late = parking.park("alice", Get("late"), 30.0, missing=[b"k"])
    parking.park("bob", Get("early"), 10.0, missing=[b"k"])
    parking.park("carol", Get("middle"), 20.0, line=("pop", b"q"))
    assert parking.next_deadline == 10.0
    assert parking.expired(9.999) == []
    assert _names(parking.expired(25.0)) == ["early", "middle"]
    assert parking.next_deadline == 30.0
    assert parking.waiting == {b"k": [late]} and parking.first_in_line(("pop", b"q")) is None
    (expired,) = parking.expired(30.0)  # a deadline equal to now is due
    assert expired is late and expired.done
    assert parking.next_deadline is None and len(parking) == 0 and parking.waiting == {}


def test_an_answered_request_never_expires():
    parking = Parking()
    answered = parking.park("alice", Get("answered"), 10.0, missing=[b"k"])
    parking.park("bob", Get("waits"), 20.0, missing=[b"k"])
    parking.release(answered)
    assert parking.next_deadline == 20.0  # the loop has no deadline to wake up for before the live one's
    assert parking.expired(15.0) == []
    assert parking.next_deadline == 20.0
    assert _names(parking.expired(20.0)) == ["waits"]
    assert parking.next_deadline is None


def test_the_next_deadline_is_always_a_parked_requests():
    parking = Parking()
    first = parking.park("alice", Get("first"), 10.0, missing=[b"k"])
    middle = parking.park("bob", Get("middle"), 20.0, missing=[b"k"])
    parking.park("carol", Get("last"), 30.0, missing=[b"k"])
    parking.release(middle)  # not the earliest: the next deadline stays the first's
    assert parking.next_deadline == 10.0
    parking.release(first)  # the earliest: the released middle behind it goes too
    assert parking.next_deadline == 30.0 and parking.heap_size == 1
    assert _names(parking.expired(30.0)) == ["last"]
    early = parking.park("dave", Get("early"), 40.0, missing=[b"k"])
    parking.park("erin", Get("later"), 60.0, missing=[b"k"])
    parking.release(parking.park("frank", Get("between"), 50.0, missing=[b"k"]))
    assert parking.expired(45.0) == [early] and parking.next_deadline == 60.0


def test_a_second_release_changes_nothing():
    parking = Parking()
    request = parking.park("alice", Get("r"), 10.0, missing=[b"k"], line=("pop", b"k"))
    parking.release(request)
    parking.release(request)
    assert request.done and len(parking) == 0 and parking.waiting == {}


# -- owners ------------------------------------------------------------------------------------------------


def test_a_client_that_hangs_up_takes_every_request_it_parked_and_nothing_else():
    parking = Parking()
    parking.park("alice", Get("get"), 10.0, missing=[b"k"])
    parking.park("alice", Get("pop"), 10.0, line=("pop", b"q"))
    parking.park("alice", Wait("wait"), 10.0, missing=[b"k", b"q"])
    kept = parking.park("bob", Get("bob's"), 20.0, missing=[b"k"])
    assert len(parking) == 4
    parking.cancel("alice")
    assert len(parking) == 1 and parking.first_in_line(("pop", b"q")) is None
    assert parking.waiting == {b"k": [kept]}
    assert parking.written(b"k") == [kept]
    assert _names(parking.expired(100.0)) == ["bob's"]  # the cancelled ones never expire
    parking.cancel("nobody")  # an owner with nothing parked


def test_released_requests_do_not_pile_up_in_the_deadline_heap():
    """A torch client's WAIT parks until a far-off deadline; cancelled, it must not stay for good."""
    parking = Parking()
    keep = parking.park("keeper", Get("kept"), 5.0, ["k"], ["k"])
    for i in range(10 * Parking.COMPACT_AFTER):
        parked = parking.park(f"client {i}", Wait(f"w{i}"), 1e12, ["x"], ["x"])
        parking.cancel(f"client {i}")
        assert parked.done
    assert parking.heap_size <= 2 * Parking.COMPACT_AFTER + 2
    assert len(parking) == 1 and parking.next_deadline == 5.0
    assert parking.expired(10.0) == [keep]  # the live request still expires, once
    assert parking.expired(1e13) == [] and parking.next_deadline is None
