"""The message matcher alone (transport/matching.py): no sockets, no threads.

Every transport (tcp, shm, inproc, hybrid's stash) decides with it which receive a message goes to,
so the rules are tested here once: per-source order, ANY_SOURCE against specific receives,
unexpected messages taken later, signature and size checks, withdraw, peer loss.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from distcomm import dtypes
from distcomm.signatures import signature
from distcomm.transport.base import ANY_SOURCE, KIND_COLLECTIVE, KIND_P2P, MessageKey
from distcomm.types import RedOpType
from distcomm.transport.matching import Matcher, Unexpected

K = MessageKey(1, KIND_COLLECTIVE, 7)
K2 = MessageKey(1, KIND_COLLECTIVE, 8)


class _Recv:
    """A transport's receive as the matcher sees it: peer, key, and the order it writes."""

    def __init__(self, peer, key=K):
        self.peer, self.key, self.order = peer, key, 0

    def __repr__(self):
        return f"_Recv({self.peer}, {self.key})"


def _arrive(m: Matcher, src: int, key=K, signature: int = 0, nbytes: int = 4):
    recv, msg = m.offer(src, key, signature, nbytes)
    assert (recv is None) != (msg is None)  # exactly one: matched, or kept
    return recv if recv is not None else msg


# -- posted receives --------------------------------------------------------------------------------


def test_posted_receives_in_post_order():
    m = Matcher(0, 3)
    specific, anyone, specific2 = _Recv(1), _Recv(ANY_SOURCE), _Recv(1)
    for r in (specific, anyone, specific2):
        assert m.post(r) is None  # nothing unexpected: posted
    assert _arrive(m, 2) is anyone  # rank 2 only matches the any-source receive
    assert _arrive(m, 1) is specific
    assert isinstance(_arrive(m, 1, K2), Unexpected)  # another key: kept, matches nobody
    assert _arrive(m, 1) is specific2
    assert isinstance(_arrive(m, 1), Unexpected)
    assert m.clear()[0] == []  # no receive left posted


@pytest.mark.parametrize("first_peer", [ANY_SOURCE, 1])
def test_the_earlier_posted_of_any_source_and_specific_receives_wins(first_peer):
    m = Matcher(0, 3)
    first, second = _Recv(first_peer), _Recv(1 if first_peer == ANY_SOURCE else ANY_SOURCE)
    m.post(first)
    m.post(second)
    assert _arrive(m, 1) is first
    assert _arrive(m, 1) is second


def test_keys_never_match_each_other():
    m = Matcher(0, 2)
    m.post(_Recv(1, MessageKey(1, KIND_P2P, 7)))  # same numbers, another kind
    msg = _arrive(m, 1, K)
    assert isinstance(msg, Unexpected)
    assert m.take(1, MessageKey(1, KIND_P2P, 7)) is None
    assert m.take(1, K) is msg


# -- unexpected messages ----------------------------------------------------------------------------


def test_unexpected_in_arrival_order():
    m = Matcher(0, 3)
    a, b, c = _arrive(m, 2), _arrive(m, 1), _arrive(m, 2)
    assert (a.src, a.key, a.nbytes, a.complete, a.data) == (2, K, 4, False, None)  # bytes: the transport's
    assert m.unexpected() == [a, b, c] and m.unexpected(2) == [a, c]
    assert m.take(1, K) is b
    assert m.take(ANY_SOURCE, K) is a  # oldest arrival from anyone
    assert m.take(ANY_SOURCE, MessageKey(9, 0, 0)) is None
    assert m.take(2, K) is c
    assert not m.has_unexpected() and m.unexpected() == []


def test_a_later_receive_takes_the_unexpected_message_and_is_not_posted():
    m = Matcher(0, 3)
    first, second = _arrive(m, 1), _arrive(m, 1)
    r1, r2, r3 = _Recv(1), _Recv(ANY_SOURCE), _Recv(1)
    assert m.post(r1) is first
    assert m.post(r2) is second
    assert m.post(r3) is None  # nothing left: this one waits
    assert _arrive(m, 1) is r3
    assert m.clear() == ([], [])


def test_any_source_receive_takes_the_oldest_arrival_of_all_sources():
    m = Matcher(0, 4)
    late = _arrive(m, 1)
    _arrive(m, 3, K2)
    early_other_key = _arrive(m, 2, K2)
    assert m.post(_Recv(ANY_SOURCE)) is late
    assert m.post(_Recv(ANY_SOURCE, K2)).src == 3
    assert m.post(_Recv(ANY_SOURCE, K2)) is early_other_key


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 3), st.booleans()), max_size=40))
def test_non_overtaking_per_source(events):
    """Any interleaving of arrivals and posts: each source's messages are received in send order."""
    m = Matcher(0, 4)
    sent = {s: 0 for s in (1, 2, 3)}
    got: dict[int, list[int]] = {s: [] for s in (1, 2, 3)}
    serial = {}  # id(Unexpected) -> its send number

    def record(recv_src, number):
        got[recv_src].append(number)

    for is_arrival, src, any_source in events:
        if is_arrival:
            n = sent[src]
            sent[src] += 1
            recv, msg = m.offer(src, K, 0, 4)
            if recv is not None:
                record(src, n)
            else:
                serial[id(msg)] = n
        else:
            msg = m.post(_Recv(ANY_SOURCE if any_source else src))
            if msg is not None:
                record(msg.src, serial[id(msg)])
    for s, numbers in got.items():
        assert numbers == sorted(numbers) and len(set(numbers)) == len(numbers), (s, numbers)


# -- checks -----------------------------------------------------------------------------------------


ALL_REDUCE_SUM = signature("all_reduce", dtypes.BY_NAME["float32"].code, int(RedOpType.SUM))
BROADCAST_FROM_0 = signature("broadcast", dtypes.BY_NAME["float32"].code, root=0)


@pytest.mark.parametrize("nbytes,sig,text", [
    (100, ALL_REDUCE_SUM, "rank 1 expects 80 bytes but rank 0 sent 100 bytes"),
    (80, BROADCAST_FROM_0, "rank 1 is in all_reduce (float32, op=SUM) but rank 0 sent a message of broadcast "
                           f"(float32, src=0) (signatures {ALL_REDUCE_SUM:#010x} and {BROADCAST_FROM_0:#010x})"),
])
def test_mismatch_names_both_ranks_and_what_differs(nbytes, sig, text):
    m = Matcher(1, 2)
    assert m.mismatch(K, 0, ALL_REDUCE_SUM, 80, ALL_REDUCE_SUM, 80) is None
    err = m.mismatch(K, 0, sig, nbytes, ALL_REDUCE_SUM, 80)
    assert err.reason == "mismatch" and err.peer == 0
    assert text in str(err) and "does not match the receive posted on rank 1" in str(err)
    assert "group 1 collective #7" in str(err)


def test_mismatch_reports_both_differences():
    err = Matcher(1, 2).mismatch(MessageKey(0, KIND_P2P, 3), 0, 1, 8, 2, 16)
    assert "16 bytes" in str(err) and "8 bytes" in str(err) and "signatures" in str(err) and "tag 3" in str(err)


# -- withdraw, loss, close --------------------------------------------------------------------------


def test_withdraw():
    m = Matcher(0, 3)
    a, b = _Recv(1), _Recv(ANY_SOURCE)
    m.post(a)
    m.post(b)
    assert m.withdraw(a) and not m.withdraw(a)
    assert m.withdraw(b) and not m.withdraw(b)
    assert isinstance(_arrive(m, 1), Unexpected)  # nobody is waiting any more


def test_a_matched_receive_cannot_be_withdrawn():
    m = Matcher(0, 2)
    r = _Recv(1)
    m.post(r)
    assert _arrive(m, 1) is r
    assert not m.withdraw(r)


def test_discard():
    m = Matcher(0, 2)
    msg = _arrive(m, 1)
    assert m.discard(msg) and not m.discard(msg)
    assert m.take(1, K) is None


def test_lose_fails_the_receives_of_a_lost_peer():
    m = Matcher(0, 3)
    rs = [_Recv(1), _Recv(2), _Recv(ANY_SOURCE), _Recv(1, MessageKey(1, KIND_P2P, 0))]
    for r in rs:
        m.post(r)
    kept = _arrive(m, 1, K2)  # messages the peer completed stay deliverable
    assert set(map(id, m.lose(1, any_source=False))) == {id(rs[0]), id(rs[3])}
    assert m.lose(1, any_source=True) == [rs[2]]
    assert m.take(1, K2) is kept
    assert m.clear() == ([rs[1]], [])


def test_clear_returns_everything():
    m = Matcher(0, 3)
    r1, r2 = _Recv(1), _Recv(ANY_SOURCE, K2)
    m.post(r1)
    m.post(r2)
    msg = _arrive(m, 2)
    recvs, msgs = m.clear()
    assert recvs == [r1, r2] and msgs == [msg]
    assert m.clear() == ([], []) and not m.has_unexpected()


# -- a peer that gave up on a group ------------------------------------------------------------------

G = K.group  # the group of K and K2
K_EARLIER = MessageKey(G, KIND_COLLECTIVE, 6)
K_OTHER_GROUP = MessageKey(G + 1, KIND_COLLECTIVE, 7)
K_P2P = MessageKey(G, KIND_P2P, 7)


def _refused(m: Matcher, src: int, key) -> str:
    """The error text of posting a receive that ``m`` must refuse (fails the test if it does not)."""
    with pytest.raises(Exception) as info:
        m.post(_Recv(src, key))
    exc = info.value
    assert getattr(exc, "reason", None) == "gave up" and exc.peer == src, exc
    return str(exc)


def test_give_up_fails_the_posted_receives_of_that_call_and_later_from_that_peer_only():
    m = Matcher(0, 3)
    hit = [_Recv(1, K), _Recv(1, K2)]
    kept = [_Recv(1, K_EARLIER), _Recv(2, K), _Recv(ANY_SOURCE, K), _Recv(1, K_OTHER_GROUP), _Recv(1, K_P2P)]
    for r in hit + kept:
        m.post(r)
    recvs, msgs = m.give_up(1, G, K.seq)
    assert set(map(id, recvs)) == set(map(id, hit)) and msgs == []
    assert set(map(id, m.posted())) == set(map(id, kept))


def test_a_message_that_came_before_the_notice_is_dropped_and_its_receive_refused():
    # the late-rank case: the peer sent its part of the call, then its wait ran out
    m = Matcher(0, 3)
    early, sent, later = _arrive(m, 1, K_EARLIER), _arrive(m, 1, K), _arrive(m, 1, K2)
    other_peer, p2p = _arrive(m, 2, K), _arrive(m, 1, K_P2P)
    recvs, msgs = m.give_up(1, G, K.seq)
    assert recvs == [] and msgs == [sent, later]
    text = _refused(m, 1, K)
    assert "rank 1 gave up on this group" in text and f"call #{K.seq}" in text and "create it again" in text
    _refused(m, 1, K2)
    with pytest.raises(Exception, match="gave up"):
        m.take(1, K)
    # an earlier call of the group, another peer, point-to-point: as before
    assert m.post(_Recv(1, K_EARLIER)) is early
    assert m.post(_Recv(2, K)) is other_peer
    assert m.post(_Recv(1, K_P2P)) is p2p
    assert not m.has_unexpected()


def test_a_receive_matched_before_the_notice_stays_matched():
    m = Matcher(0, 2)
    r = _Recv(1, K)
    m.post(r)
    assert _arrive(m, 1, K) is r  # delivered: the failure came at the deadline's edge
    assert m.give_up(1, G, K.seq) == ([], [])


def test_the_earliest_notice_of_a_group_counts_and_forget_group_drops_it():
    m = Matcher(0, 2)
    m.give_up(1, G, K2.seq)
    assert m.gave_up_at(1, K) is None and m.gave_up_at(1, K2) == K2.seq
    m.give_up(1, G, K2.seq + 5)  # a later notice does not move it forward
    assert m.gave_up_at(1, K2) == K2.seq
    m.give_up(1, G, K.seq)
    assert m.gave_up_at(1, K) == K.seq and m.gave_up_at(1, K_EARLIER) is None
    assert m.gave_up_at(1, K_P2P) is None and m.gave_up_at(0, K) is None and m.gave_up_at(1, K_OTHER_GROUP) is None
    m.forget_group(G)
    r = _Recv(1, K)
    assert m.post(r) is None and m.posted() == [r]


def test_clear_forgets_notices_too():
    m = Matcher(0, 2)
    m.give_up(1, G, 0)
    m.clear()
    assert m.gave_up_at(1, K) is None
