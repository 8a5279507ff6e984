"""Unit tests for buffers (tensor/array -> flat view, write-back) and Work/Future/OrderedExecutor."""

import threading
import time

import numpy as np
import pytest
import torch

from distcomm.buffers import as_buffer
from distcomm.errors import DistTimeoutError
from distcomm.process_group import OrderedExecutor
from distcomm.work import Future, Work, completed_work


def test_contiguous_tensor_shares_memory():
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    buf = as_buffer(t)
    assert buf.aliases_user_memory and buf.count == 6 and buf.dtype.name == "float32"
    buf.flat[:] = 7
    assert torch.equal(t, torch.full((2, 3), 7.0))


def test_noncontiguous_tensor_written_back_exactly_where_torch_writes():
    base = torch.zeros(4, 4)
    view = base[:, 1]  # stride 4
    buf = as_buffer(view)
    assert not buf.aliases_user_memory
    buf.flat[:] = torch.arange(4.0).numpy()
    buf.commit()
    expected = torch.zeros(4, 4)
    expected[:, 1] = torch.arange(4.0)
    assert torch.equal(base, expected)


def test_bfloat16_round_trips_bits():
    t = torch.tensor([1.5, -2.25, 3e38], dtype=torch.bfloat16)
    buf = as_buffer(t)
    assert buf.dtype.name == "bfloat16" and buf.flat.dtype == np.uint16
    assert np.array_equal(buf.flat, t.view(torch.int16).numpy().view(np.uint16))


def test_noncontiguous_bfloat16_writeback():
    base = torch.zeros(3, 2, dtype=torch.bfloat16)
    view = base[:, 0]
    buf = as_buffer(view)
    buf.flat[:] = torch.tensor([1.0, 2.0, 3.0], dtype=torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    buf.commit()
    assert base[:, 0].tolist() == [1.0, 2.0, 3.0] and base[:, 1].tolist() == [0.0, 0.0, 0.0]


def test_numpy_noncontiguous_and_zero_dim():
    a = np.zeros((3, 4), dtype=np.int64)[:, ::2]
    buf = as_buffer(a)
    buf.flat[:] = np.arange(6)
    buf.commit()
    assert a.tolist() == [[0, 1], [2, 3], [4, 5]]
    scalar = torch.tensor(5.0)
    assert as_buffer(scalar).count == 1
    assert as_buffer(torch.empty(0)).count == 0


def test_tensor_requiring_grad_and_conj():
    t = torch.ones(3, requires_grad=True)
    assert as_buffer(t).count == 3
    c = torch.tensor([1 + 2j, 3 - 1j]).conj()
    buf = as_buffer(c)
    assert np.array_equal(buf.flat, np.array([1 - 2j, 3 + 1j]))


def test_bad_buffer_types():
    with pytest.raises(TypeError, match="torch.Tensor or numpy.ndarray"):
        as_buffer([1, 2, 3])
    with pytest.raises(TypeError, match="not supported"):
        as_buffer(np.array(["a"]))


def test_future_then_and_callbacks():
    f = Future()
    chained = f.then(lambda fut: fut.value() * 2)
    seen = []
    f.add_done_callback(lambda fut: seen.append(fut.value()))
    f.set_result(21)
    assert chained.wait() == 42 and seen == [21]
    with pytest.raises(RuntimeError):
        f.set_result(1)
    g = Future()
    g.set_exception(ValueError("boom"))
    with pytest.raises(ValueError):
        g.wait()


def test_work_states_and_future():
    w = Work("all_reduce", result=["t"])
    assert not w.is_completed()
    assert w.is_success()  # torch's meaning: no error (yet), whether or not it has completed
    fut = w.get_future()
    w._finish()
    assert w.is_completed() and w.is_success() and w.wait() and fut.wait() == ["t"]
    failed = completed_work("barrier", exc=DistTimeoutError("late"))
    assert not failed.is_success() and isinstance(failed.exception(), DistTimeoutError)
    with pytest.raises(DistTimeoutError):
        failed.wait()
    with pytest.raises(DistTimeoutError, match="Timed out"):
        Work("x").wait(timeout=0.01)


def test_executor_runs_in_issue_order_and_sync_waits_behind_async():
    ex = OrderedExecutor("t")
    order = []
    gate = threading.Event()
    w1 = ex.run("a", lambda: (gate.wait(5), order.append(1)), async_op=True)
    w2 = ex.run("b", lambda: order.append(2), async_op=True)
    threading.Timer(0.05, gate.set).start()
    ex.run("c", lambda: order.append(3), async_op=False)  # must run after 1 and 2
    assert order == [1, 2, 3] and w1.is_completed() and w2.is_completed()
    # with nothing queued, a synchronous op runs inline in the caller's thread
    caller = []
    ex.run("d", lambda: caller.append(threading.current_thread()), async_op=False)
    assert caller == [threading.current_thread()]
    ex.close()


def test_executor_delivers_errors_through_work():
    ex = OrderedExecutor("t")

    def fail():
        raise ValueError("bad")

    w = ex.run("x", fail, async_op=True)
    with pytest.raises(ValueError):
        w.wait()
    with pytest.raises(ValueError):
        ex.run("y", fail, async_op=False)
    ex.close()
