"""The argument checks of list collectives (``_api/args.tensor_list``), in-process: they pass
without formatting anything, and a failing one still names the element, the op and what to do."""

from __future__ import annotations

import numpy as np
import pytest

from distcomm._api import args
from distcomm.buffers import as_buffer


def _check(objs, length=2, like=None, writes=True):
    return args.tensor_list(objs, "all_gather", "tensor_list", length, like=like, writes=writes)


def test_a_good_list_gives_one_buffer_per_element_sharing_memory():
    outs = [np.zeros(2, np.float32), np.zeros(2, np.float32)]
    bufs = _check(outs, like=as_buffer(np.ones(2, np.float32)))
    assert [b.obj for b in bufs] == outs
    bufs[1].flat[...] = 7
    assert outs[1].tolist() == [7.0, 7.0]
    assert len(_check(tuple(outs))) == 2

    class MyList(list):
        pass

    assert len(_check(MyList(outs))) == 2


def test_an_element_that_is_not_a_tensor_is_named():
    with pytest.raises(TypeError, match=r"all_gather: tensor_list\[1\] must be a torch.Tensor or numpy.ndarray, got str"):
        _check([np.zeros(2), "x"])


def test_not_a_list():
    with pytest.raises(TypeError, match="all_gather: tensor_list must be a list of tensors, got ndarray"):
        _check(np.zeros(2))


def test_a_read_only_element_is_named():
    ro = np.zeros(2)
    ro.flags.writeable = False
    with pytest.raises(args.ArgumentError, match=r"all_gather: tensor_list\[1\] is a read-only numpy array"):
        _check([np.zeros(2), ro])
    assert len(_check([np.zeros(2), ro], writes=False)) == 2  # an input may be read-only


def test_length_dtypes_and_sizes():
    with pytest.raises(args.ArgumentError, match="expected length 3, got 2"):
        _check([np.zeros(2), np.zeros(2)], length=3)
    with pytest.raises(args.ArgumentError, match="different dtypes: found float32, float64"):
        _check([np.zeros(2, np.float32), np.zeros(2)])
    with pytest.raises(args.ArgumentError, match="different dtypes: found float32, float64"):
        _check([np.zeros(2), np.zeros(2)], like=as_buffer(np.zeros(2, np.float32)))
    with pytest.raises(args.ArgumentError, match=r"tensor_list\[1\] has 3 elements, expected 2"):
        _check([np.zeros(2), np.zeros(3)], like=as_buffer(np.zeros(2)))
    assert _check([], length=None) == []
