"""The MPI engine's pure parts, with no MPI: the MessageKey -> tag layout, and which reductions
MPI computes natively (the rest run distcomm's algorithms over MPI point-to-point)."""

from __future__ import annotations

import pytest

from distcomm import dtypes
from distcomm.backends.mpi.native import equal, native_reduction
from distcomm.transport.base import KIND_COLLECTIVE, KIND_P2P, MessageKey
from distcomm.transport.mpi import TagLayout, fold_signature
from distcomm.types import RedOpType

MPICH_TAG_UB = 2**29 - 1
OMPI_TAG_UB = 2**31 - 1


@pytest.mark.parametrize("ub", [MPICH_TAG_UB, OMPI_TAG_UB, 2**15 - 1])
def test_every_tag_is_within_tag_ub(ub):
    layout = TagLayout(ub)
    keys = [MessageKey(3, KIND_COLLECTIVE, s) for s in (0, 1, 2**20, 2**40 + 5)]
    keys += [MessageKey(3, KIND_P2P, t) for t in (0, 7, layout.p2p_tag_limit - 1, layout.p2p_tag_limit,
                                                  -1, -(2**62), 2**40)]
    for key in keys:
        for sig in (0, 0xFFFFFFFF, 0x12345678):
            assert 0 <= layout.tag(key, sig) <= ub, (key, sig)


def test_collective_and_p2p_tags_never_meet():
    layout = TagLayout(MPICH_TAG_UB)
    coll = {layout.tag(MessageKey(0, KIND_COLLECTIVE, s), sig) for s in range(300) for sig in (0, 0xDEADBEEF)}
    p2p = {layout.tag(MessageKey(0, KIND_P2P, t), 0) for t in list(range(300)) + [-1, -(2**62), 2**40]}
    assert not coll & p2p


def test_p2p_tags_in_range_are_exact_and_others_have_their_own_range():
    layout = TagLayout(MPICH_TAG_UB)
    assert layout.p2p_tag_limit == 2**27
    exact = [layout.tag(MessageKey(0, KIND_P2P, t), 0) for t in range(0, layout.p2p_tag_limit, 2**20)]
    assert len(set(exact)) == len(exact)
    assert layout.tag(MessageKey(0, KIND_P2P, -(2**62)), 0) != layout.tag(MessageKey(0, KIND_P2P, 0), 0)
    assert layout.tag(MessageKey(0, KIND_P2P, -1), 0) != layout.tag(MessageKey(0, KIND_P2P, 2**27 - 1), 0)


def test_collective_tags_differ_by_signature_and_by_sequence_number():
    layout = TagLayout(MPICH_TAG_UB)
    key = MessageKey(0, KIND_COLLECTIVE, 12)
    assert layout.tag(key, 0x00000001) != layout.tag(key, 0x00000002)
    seqs = {layout.tag(MessageKey(0, KIND_COLLECTIVE, s), 5) for s in range(1000)}
    assert len(seqs) == 1000
    assert layout.seq_bits == 20 and layout.sig_bits == 8


def test_fold_signature_uses_every_byte():
    assert fold_signature(0) == 0
    assert {fold_signature(1 << (8 * i)) for i in range(4)} == {1}
    assert fold_signature(0x01000001) == 0


def test_tiny_tag_ub_is_refused():
    from distcomm.errors import DistBackendError

    with pytest.raises(DistBackendError, match="MPI_TAG_UB=1023"):
        TagLayout(1023)


D = dtypes.from_name


@pytest.mark.parametrize("op,dtype,expected", [
    (RedOpType.SUM, "float32", ("FLOAT", "SUM")),
    (RedOpType.AVG, "float64", ("DOUBLE", "SUM")),
    (RedOpType.PRODUCT, "int64", ("INT64_T", "PROD")),
    (RedOpType.MIN, "int32", ("INT32_T", "MIN")),
    (RedOpType.BXOR, "uint8", ("UINT8_T", "BXOR")),
    (RedOpType.AVG, "int16", ("INT16_T", "SUM")),
    (RedOpType.PREMUL_SUM(0.5), "float32", ("FLOAT", "SUM")),
    # distcomm's algorithms: no MPI type, torch's NaN rule, torch's logical rules
    (RedOpType.SUM, "float16", None),
    (RedOpType.SUM, "bfloat16", None),
    (RedOpType.SUM, "complex64", None),
    (RedOpType.SUM, "bool", None),
    (RedOpType.MIN, "float32", None),
    (RedOpType.MAX, "float64", None),
])
def test_native_reductions(op, dtype, expected):
    assert native_reduction(op, D(dtype)) == expected


def test_equal_counts():
    assert equal([3, 3, 3]) and equal([]) and not equal([3, 4])


# -- persistent all_reduce requests (backends/mpi/persistent.py), on a recording stand-in for MPI ----
class _Request:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def Free(self):  # noqa: N802 - mpi4py's name
        self.log.append(("free", self.name))


class _Comm:
    """Records each Allreduce_init (what it was given) and each Free of its requests."""

    def __init__(self, refuse=False):
        self.log: list = []
        self.refuse = refuse

    def Allreduce_init(self, sendbuf, recvbuf, op):  # noqa: N802
        if self.refuse:
            raise NotImplementedError("MPI 3")
        staging, mtype = recvbuf
        name = (staging.size, staging.dtype.name, mtype, op)
        self.log.append(("init", name, sendbuf))
        return _Request(self.log, name)

    def Barrier_init(self):  # noqa: N802
        if self.refuse:
            raise NotImplementedError("MPI 3")
        self.log.append(("init", "barrier", None))
        return _Request(self.log, "barrier")


class _MPI:
    IN_PLACE = "IN_PLACE"

    @staticmethod
    def Is_finalized():  # noqa: N802
        return False

    @staticmethod
    def _addressof(request):  # where the request's handle lies (mpi4py's): here, a stand-in
        return id(request)


def test_persistent_requests_per_count_datatype_and_op_oldest_freed_first_one_barrier():
    import numpy as np

    from distcomm.backends.mpi import persistent

    comm = _Comm()
    cache = persistent.PersistentRequests(comm, _MPI)
    FLOAT, DOUBLE, SUM, MAX = object(), object(), object(), object()
    staging, request, handle = cache.all_reduce(np.ones(3, np.float32), FLOAT, SUM)
    assert staging.shape == (3,) and staging.dtype == np.float32 and handle == id(request)
    assert comm.log == [("init", (3, "float32", FLOAT, SUM), "IN_PLACE")]
    # the same count, datatype and op: the same request, whatever the array
    assert cache.all_reduce(np.zeros(3, np.float32), FLOAT, SUM)[1] is request
    assert cache.all_reduce(np.zeros(3, np.float32), FLOAT, MAX)[1] is not request
    assert cache.all_reduce(np.zeros(3, np.float64), DOUBLE, SUM)[1] is not request
    assert len(comm.log) == 3
    # past CAPACITY the oldest is freed, before nothing else
    for count in range(4, 4 + persistent.CAPACITY - 3):
        cache.all_reduce(np.zeros(count, np.float32), FLOAT, SUM)
    assert [e for e in comm.log if e[0] == "free"] == []
    cache.all_reduce(np.zeros(100, np.float32), FLOAT, SUM)
    assert comm.log[-2:] == [("init", (100, "float32", FLOAT, SUM), "IN_PLACE"),
                             ("free", (3, "float32", FLOAT, SUM))]
    # past LIMIT bytes: none (the caller runs Iallreduce)
    assert cache.all_reduce(np.zeros(persistent.LIMIT // 4 + 1, np.float32), FLOAT, SUM) is None
    # one barrier request, made on first use
    barrier = cache.barrier()
    assert cache.barrier() is barrier and comm.log[-1] == ("init", "barrier", None)
    # the dict of what is kept for a datatype and op, which the latency path keeps and looks up
    made = cache.made(FLOAT, SUM)
    assert sorted(made) == list(range(4, 4 + persistent.CAPACITY - 3)) + [100]
    # free() frees every request left
    cache.free()
    assert made == {}
    freed = [e[1] for e in comm.log if e[0] == "free"]
    assert len(freed) == persistent.CAPACITY + 2 and freed[-1] == "barrier"


def test_persistent_requests_refused_by_an_mpi_3_library_fall_back_for_good():
    import numpy as np

    from distcomm.backends.mpi import persistent

    cache = persistent.PersistentRequests(_Comm(refuse=True), _MPI)
    assert cache.all_reduce(np.ones(2, np.float32), object(), object()) is None
    assert not cache.available
    assert cache.barrier() is None
