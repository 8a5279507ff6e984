"""A point-to-point message that does not fit its receive names the receive as the recv it is.

A receive expects the sender's signature ("send" with the receiving buffer's dtype), so the error
said "rank 1 is in send (float64) but rank 0 sent a message of send (float32)" of a rank in recv.
(torch's gloo does not check: the receive returns the wrong bytes.)
"""

from __future__ import annotations

from datetime import timedelta

import numpy as np
import pytest

from distcomm import dtypes
from distcomm.signatures import describe_receive, signature
from distcomm.transport.base import KIND_P2P, MessageKey
from distcomm.transport.matching import Matcher
from harness import run_world

FLOAT32, FLOAT64 = (dtypes.BY_NAME[n].code for n in ("float32", "float64"))


def test_a_receive_is_described_as_recv_and_a_collective_as_itself():
    assert describe_receive(signature("send", FLOAT64)) == "recv (float64)"
    assert describe_receive(signature("broadcast", FLOAT32, root=0)) == "broadcast (float32, src=0)"
    err = Matcher(1, 2).mismatch(MessageKey(0, KIND_P2P, 5), 0, signature("send", FLOAT32), 16,
                                 signature("send", FLOAT64), 32)
    assert "rank 1 is in recv (float64) but rank 0 sent a message of send (float32)" in str(err), str(err)


def _mismatched_recv(rank, world, engine):
    import distcomm as dist
    from distcomm.errors import CollectiveMismatchError

    dist.init_process_group(engine, timeout=timedelta(seconds=30))
    outcome = None
    if rank == 0:
        dist.send(np.zeros(4, np.float32), 1)
    else:
        try:
            dist.recv(np.zeros(4, np.float64), 0)
            outcome = "received"
        except CollectiveMismatchError as exc:
            outcome = str(exc)
    dist.destroy_process_group()
    return outcome


@pytest.mark.parametrize("engine", ["gloo", "tcp"])
def test_recv_of_another_dtype_says_recv(engine):
    got = run_world(_mismatched_recv, 2, args=(engine,), timeout=60)[1]
    assert "rank 1 is in recv (float64) but rank 0 sent a message of send (float32)" in got, got
