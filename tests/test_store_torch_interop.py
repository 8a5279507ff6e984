"""distcomm's TCPStore and torch 2.13's, talking to each other (store/tcp/torch_wire.py).

Both directions, against torch's real classes:

* distcomm's client against torch's server (``torch.distributed.TCPStore(is_master=True)``, libuv
  and classic backends), in this process: every request, torch's timeouts, queues, barrier,
  wait_for_workers, and the keys both clients see alike;
* torch's client against distcomm's server: in this process for the requests whose torch binding
  lets go of the GIL while it waits (set, get, add, ...), and in a separate process for all of them
  (wait, queues and timeouts hold the GIL in torch's binding, which would starve a server thread of
  this process);
* a peer that speaks neither protocol (an HTTP server, garbage, silence) fails within 5 s naming
  what answered; a server with an authentication key refuses torch's clients;
* whole jobs: distcomm ranks on a torch master store (tcp:// and env:// with
  TORCHELASTIC_USE_AGENT_STORE=True, as under torchrun), torch gloo ranks on a distcomm store, and
  the real launchers crossed (torchrun running distcomm, distcomm-run running torch): slow.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as tdist  # noqa: E402

from distcomm.errors import (  # noqa: E402
    DistNetworkError,
    DistStoreAuthError,
    DistStoreTimeoutError,
    QueueEmptyError,
    StoreProtocolError,
)
from distcomm.store import TCPStore  # noqa: E402
from distcomm.store.tcp import TCPStoreServer  # noqa: E402
from harness import free_port, run_world  # noqa: E402

SRC = str(Path(__file__).resolve().parents[1] / "src")
T = timedelta(seconds=10)
CHILD_DEADLINE = 90  # seconds: a child process still running then is killed and the test fails


@pytest.fixture
def no_key(monkeypatch):
    monkeypatch.delenv("DISTCOMM_AUTH_KEY", raising=False)
    monkeypatch.delenv("DISTCOMM_AUTH_KEY_FILE", raising=False)
    return monkeypatch


@pytest.fixture(params=[True, False], ids=["libuv", "classic"])
def torch_master(request, no_key):
    store = tdist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=request.param,
                           timeout=T)
    yield store


def _client(port: int, timeout: timedelta = T) -> TCPStore:
    return TCPStore("127.0.0.1", port, None, False, timeout)


# -- distcomm's client, torch's server ------------------------------------------------------------------


def test_every_request_against_torchs_server(torch_master):
    s = _client(torch_master.port)
    try:
        assert "torch server" in repr(s)
        s.set("k", b"v")
        assert s.get("k") == b"v" and torch_master.get("k") == b"v"  # the same key for torch's own client
        torch_master.set("t", b"from torch")
        assert s.get("t") == b"from torch"
        assert s.add("c", 3) == 3 and torch_master.add("c", 1) == 4 and s.add("c", -4) == 0
        assert s.compare_set("k", b"v", b"w") == b"w" and torch_master.get("k") == b"w"
        assert s.compare_set("k", b"nope", b"x") == b"w"
        assert s.compare_set("fresh", b"", b"f") == b"f"
        assert s.check(["k", "t"]) and not s.check(["k", "missing"])
        s.multi_set(["a", "b"], [b"1", b"22"])
        assert s.multi_get(["a", "b"]) == [b"1", b"22"] == torch_master.multi_get(["a", "b"])
        assert s.delete_key("a") and not s.delete_key("a")
        s.append("k", b"x")
        s.append("new", b"y")  # no reply: this connection's next answer shows both appends are done
        assert s.get("new") == b"y" and torch_master.get("k") == b"wx"
        assert s.num_keys() == torch_master.num_keys()
        with pytest.raises(DistStoreTimeoutError):
            s.wait(["a"], timedelta(seconds=0.1))  # deleted above
    finally:
        s.close()


def test_torchs_timeout_and_the_connection_stays_usable(torch_master):
    s = _client(torch_master.port, timedelta(seconds=0.3))
    try:
        start = time.monotonic()
        with pytest.raises(DistStoreTimeoutError) as info:
            s.get("never")
        elapsed = time.monotonic() - start
        assert 0.25 < elapsed < 3
        assert str(info.value).startswith("wait timeout after 300ms, keys: /never")  # torch's own sentence
        with pytest.raises(DistStoreTimeoutError, match="keys: /x, /y"):
            s.wait(["x", "y"], timedelta(seconds=0.2))
        s.set("after", b"1")  # CANCEL_WAIT kept the stream in step
        assert s.get("after") == b"1"
    finally:
        s.close()


def test_a_wait_ends_when_torch_sets_the_key(torch_master):
    s = _client(torch_master.port)
    timer = threading.Timer(0.2, torch_master.set, ("late", b"here"))
    timer.start()
    try:
        s.wait(["late"], timedelta(seconds=5))
        assert s.get("late") == b"here"
    finally:
        timer.cancel()
        s.close()


def test_barrier_between_distcomm_clients_of_a_torch_server(torch_master):
    stores = [_client(torch_master.port) for _ in range(3)]
    errors = []

    def arrive(store):
        try:
            store.barrier("b", 3, timedelta(seconds=5))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=arrive, args=(s,)) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not errors and not any(t.is_alive() for t in threads)
    assert torch_master.get("b/num_members") == b"3"  # torch's barrier keys
    for s in stores:
        s.close()


def test_queues_on_torchs_libuv_server(no_key):
    master = tdist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True, timeout=T)
    s = _client(master.port)
    try:
        s.queue_push("q", b"one")
        master.queue_push("q", b"two")
        s.queue_len("q"), master.queue_len("q")  # pushes have no reply: one round trip on each connection
        assert s.queue_len("q") == 2 == master.queue_len("q")
        assert {s.queue_pop("q"), s.queue_pop("q", block=False)} == {b"one", b"two"}  # two connections: either order
        with pytest.raises(QueueEmptyError):
            s.queue_pop("q", block=False)
        timer = threading.Timer(0.2, master.queue_push, ("q", b"late"))
        timer.start()
        assert s.queue_pop("q") == b"late"  # a blocking pop waits for torch's push
        s.set_timeout(timedelta(seconds=0.2))
        with pytest.raises(DistStoreTimeoutError, match="keys: /q"):
            s.queue_pop("q")
    finally:
        s.close()


def test_torchs_classic_server_has_no_queues(no_key):
    master = tdist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=False, timeout=T)
    s = _client(master.port)
    try:
        with pytest.raises(DistNetworkError, match="classic server"):
            s.queue_len("q")
    finally:
        s.close()


@pytest.mark.slow
def test_a_distcomm_worker_counts_in_torchs_wait_for_workers(no_key):
    port = free_port()
    code = (
        "import sys; from datetime import timedelta; import torch.distributed as d; "
        f"m = d.TCPStore('127.0.0.1', {port}, 2, True, timedelta(seconds=20)); "
        "print('joined', flush=True); m.wait(['done'], timedelta(seconds=20))"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        worker = TCPStore("127.0.0.1", port, 2, False, timedelta(seconds=20))  # joins, as torch's workers do
        worker.set("done", b"1")
        out, _ = child.communicate(timeout=CHILD_DEADLINE)
        worker.close()
    finally:
        child.kill()
    assert child.returncode == 0 and "joined" in out  # torch's master constructor returned: 2 stores joined


# -- torch's client, distcomm's server -------------------------------------------------------------------


@pytest.fixture
def distcomm_master(no_key):
    store = TCPStore("127.0.0.1", 0, None, True, T)
    yield store
    store.close()


def test_torch_client_in_this_process(distcomm_master):
    """The requests whose torch binding releases the GIL while it waits for the answer."""
    t = tdist.TCPStore("127.0.0.1", distcomm_master.port, is_master=False, wait_for_workers=False, timeout=T)
    distcomm_master.set("from distcomm", b"hello")
    assert t.get("from distcomm") == b"hello"  # torch's "/" prefix is not part of the key
    t.set("k", b"v")
    assert distcomm_master.get("k") == b"v"
    assert t.add("c", 2) == 2 and distcomm_master.add("c", 1) == 3 and t.add("c", 0) == 3
    assert t.compare_set("k", b"v", b"w") == b"w" and t.compare_set("k", b"nope", b"x") == b"w"
    assert t.compare_set("nokey", b"x", b"y") == b"x" and t.compare_set("new", b"", b"n") == b"n"
    assert t.check(["k"]) and not t.check(["k", "missing"])
    t.multi_set(["a", "b"], [b"1", b"22"])
    assert t.multi_get(["a", "b"]) == [b"1", b"22"] == distcomm_master.multi_get(["a", "b"])
    assert t.delete_key("a") and not t.delete_key("a")
    t.append("k", b"x")  # no reply: only this connection's next request is sure to come after it
    assert t.get("k") == b"wx" and distcomm_master.get("k") == b"wx"
    assert t.num_keys() == distcomm_master.num_keys()


def test_torch_clients_one_request_a_read_wake_waiters_and_keep_add_errors(distcomm_master):
    """One SET, GET or ADD in a read takes the server's fast lane (handlers.TORCH_FAST_HANDLERS): a
    distcomm client waiting on the keys wakes, and an add() on a value that is not a number still
    ends the torch connection, as torch's servers do."""
    t = tdist.TCPStore("127.0.0.1", distcomm_master.port, is_master=False, wait_for_workers=False, timeout=T)
    waiter = TCPStore("127.0.0.1", distcomm_master.port, None, False, T)
    try:
        for key, write in (("set by torch", lambda: t.set("set by torch", b"1")),
                           ("added by torch", lambda: t.add("added by torch", 7))):
            woke = []
            thread = threading.Thread(target=lambda: woke.append(waiter.wait([key], T)))
            thread.start()
            time.sleep(0.2)  # the wait is parked on the server
            write()
            thread.join(3)  # well before the wait's own timeout (T), which would answer it too
            assert woke == [None], f"a wait for {key!r} did not wake"
        assert t.add("added by torch", -2) == 5 and distcomm_master.get("added by torch") == b"5"
        assert t.get("set by torch") == b"1"
        distcomm_master.set("words", b"not a number")
        with pytest.raises(RuntimeError):
            t.add("words", 1)
        fresh = tdist.TCPStore("127.0.0.1", distcomm_master.port, is_master=False, wait_for_workers=False, timeout=T)
        assert fresh.add("added by torch", 1) == 6 and distcomm_master.get("words") == b"not a number"
    finally:
        waiter.close()


TORCH_CHILD = r"""
import json, sys, time, threading
from datetime import timedelta
import torch.distributed as d

port, libuv = int(sys.argv[1]), sys.argv[2] == "1"
s = d.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=10),
               use_libuv=libuv)
out = {}
def record(name, f):
    start = time.monotonic()
    try:
        out[name] = ["ok", repr(f())]
    except Exception as e:
        out[name] = [type(e).__name__, str(e).splitlines()[0]]
    out[name].append(round(time.monotonic() - start, 2))

record("get_from_distcomm", lambda: s.get("from distcomm"))
record("set_get", lambda: (s.set("k", b"v"), s.get("k"))[1])
record("add", lambda: (s.add("c", 5), s.add("c", -2))[1])
record("compare_set", lambda: s.compare_set("k", b"v", b"w"))
record("check", lambda: (s.check(["k"]), s.check(["zz"])))
record("multi", lambda: (s.multi_set(["a", "b"], [b"1", b"22"]), s.multi_get(["a", "b"]))[1])
record("delete", lambda: (s.delete_key("a"), s.delete_key("a")))
record("append", lambda: (s.append("k", b"x"), s.get("k"))[1])
record("num_keys", s.num_keys)
record("wait_timeout", lambda: s.wait(["never"], timedelta(seconds=0.3)))
record("after_timeout", lambda: (s.set("after", b"1"), s.get("after"))[1])
record("wait_for_distcomm", lambda: s.wait(["late"], timedelta(seconds=10)))
s.set_timeout(timedelta(seconds=0.3))
record("get_timeout", lambda: s.get("never2"))
s.set_timeout(timedelta(seconds=10))
if libuv:
    record("queue", lambda: (s.queue_push("q", b"one"), s.queue_push("q", b"two"), s.queue_len("q"),
                             s.queue_pop("q"), s.queue_pop("q", block=False)))
    record("queue_empty", lambda: s.queue_pop("q", block=False))
    record("queue_from_distcomm", lambda: s.queue_pop("dq"))
    s.set_timeout(timedelta(seconds=0.3))
    record("queue_timeout", lambda: s.queue_pop("q"))
print(json.dumps(out))
"""


@pytest.mark.slow
@pytest.mark.parametrize("libuv", [True, False], ids=["libuv-client", "classic-client"])
def test_torch_client_in_another_process_every_request(distcomm_master, libuv):
    m = distcomm_master
    m.set("from distcomm", b"hello")
    threading.Timer(1.0, m.set, ("late", b"now")).start()
    threading.Timer(1.0, m.queue_push, ("dq", b"pushed by distcomm")).start()
    env = dict(os.environ, PYTHONPATH=SRC)
    result = subprocess.run([sys.executable, "-c", TORCH_CHILD, str(m.port), "1" if libuv else "0"],
                            capture_output=True, text=True, timeout=CHILD_DEADLINE, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["get_from_distcomm"][:2] == ["ok", "b'hello'"]
    assert out["set_get"][:2] == ["ok", "b'v'"] and m.get("k") == b"wx"
    assert out["add"][:2] == ["ok", "3"] and m.get("c") == b"3"
    assert out["compare_set"][:2] == ["ok", "b'w'"]
    assert out["check"][:2] == ["ok", "(True, False)"]
    assert out["multi"][:2] == ["ok", "[b'1', b'22']"]
    assert out["delete"][:2] == ["ok", "(True, False)"]
    assert out["append"][:2] == ["ok", "b'wx'"]
    assert out["num_keys"][0] == "ok"
    name, message, elapsed = out["wait_timeout"]
    assert name == "DistStoreError" and message.startswith("wait timeout after 300ms, keys: /never") \
        and 0.25 < elapsed < 3
    assert out["after_timeout"][:2] == ["ok", "b'1'"]
    assert out["wait_for_distcomm"][0] == "ok"
    assert out["get_timeout"][:2] == ["DistStoreError", "wait timeout after 300ms, keys: /never2"]
    if libuv:
        assert out["queue"][:2] == ["ok", "(None, None, 2, b'one', b'two')"]
        assert out["queue_empty"][0] == "QueueEmptyError"
        assert out["queue_from_distcomm"][:2] == ["ok", "b'pushed by distcomm'"]
        assert out["queue_timeout"][:2] == ["DistStoreError", "wait timeout after 300ms, keys: /q"]


@pytest.mark.slow
def test_torchs_wait_for_workers_counts_on_a_distcomm_master(no_key):
    """torch's workers join with ADD "init/"; a distcomm master with world_size counts them."""
    port = free_port()
    code = ("from datetime import timedelta; import torch.distributed as d; "
            f"w = d.TCPStore('127.0.0.1', {port}, 2, False, timedelta(seconds=20)); w.set('hi', b'1')")
    child = subprocess.Popen([sys.executable, "-c", code])
    try:
        master = TCPStore("127.0.0.1", port, 2, True, timedelta(seconds=20))  # returns once the torch worker joined
        assert master.get("hi") == b"1"
        assert child.wait(CHILD_DEADLINE) == 0
        master.close()
    finally:
        child.kill()


# -- neither protocol ----------------------------------------------------------------------------------------


def _one_shot_server(behaviour):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    held = []

    def serve():
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        held.append(conn)
        behaviour(conn)

    threading.Thread(target=serve, daemon=True).start()
    return listener, held


def _http(conn):
    conn.recv(4096)
    conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")


def _garbage(conn):
    conn.recv(4096)
    conn.sendall(b"\x13\x37garbage\xff\x00")


def _silent(conn):
    conn.recv(4096)  # and keep it open, saying nothing


@pytest.mark.parametrize(
    "behaviour, shown, at_most",
    [
        (_http, "b'HTTP/1.1 400 Bad Request\\r\\n", 2.0),
        (_garbage, "b'\\x137garbage\\xff\\x00'", 2.0),
        pytest.param(_silent, "answered nothing within 5 s", 7.0, marks=pytest.mark.slow),
    ],
    ids=["http", "garbage", "silent"],
)
def test_a_peer_speaking_neither_protocol_fails_within_5s_naming_what_answered(no_key, behaviour, shown, at_most):
    listener, held = _one_shot_server(behaviour)
    try:
        start = time.monotonic()
        with pytest.raises(StoreProtocolError) as info:
            TCPStore("127.0.0.1", listener.getsockname()[1], None, False, timedelta(seconds=60))
        elapsed = time.monotonic() - start
    finally:
        listener.close()
        for conn in held:
            conn.close()
    assert elapsed < at_most
    assert shown in str(info.value) and "neither distcomm's nor torch's" in str(info.value)
    assert isinstance(info.value, DistNetworkError)


# -- authentication ------------------------------------------------------------------------------------------


KEY = "0123456789abcdef0123456789abcdef"


@pytest.mark.slow  # torch's client retries its handshake for a few seconds
def test_a_keyed_server_refuses_torch_clients(no_key, caplog):
    server = TCPStoreServer("127.0.0.1", 0, auth_key=KEY.encode()).start()
    try:
        with caplog.at_level("WARNING", logger="distcomm.store.tcp.server"):
            with pytest.raises(RuntimeError):  # torch's DistNetworkError: the server closed the connection
                t = tdist.TCPStore("127.0.0.1", server.port, is_master=False, wait_for_workers=False,
                                   timeout=timedelta(seconds=3))
                t.set("k", b"v")
                t.get("k")
        assert server.table.values == {}
        assert server.stats["auth_refused"] >= 1  # torch retries its handshake a few times
        assert "torch.distributed TCPStore client" in caplog.text and "requires authentication" in caplog.text
    finally:
        server.stop()


def test_a_distcomm_client_with_a_key_refuses_torchs_server(no_key):
    master = tdist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=T)
    no_key.setenv("DISTCOMM_AUTH_KEY", KEY)
    with pytest.raises(DistStoreAuthError, match="is torch's, which cannot authenticate"):
        _client(master.port)


# -- whole jobs -----------------------------------------------------------------------------------------------


def _distcomm_rank(rank, world_size, init_method):
    import numpy as np

    import distcomm as dist

    dist.init_process_group("tcp", init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=30))
    a = np.array([float(rank + 1)])
    dist.all_reduce(a)
    dist.barrier()
    dist.destroy_process_group()
    return float(a[0])


@pytest.mark.slow
@pytest.mark.parametrize("init", ["tcp", "env"])
def test_distcomm_ranks_on_a_torch_master_store_as_under_torchrun(no_key, init):
    master = tdist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=T)
    url = f"tcp://127.0.0.1:{master.port}" if init == "tcp" else "env://"
    env = {"TORCHELASTIC_USE_AGENT_STORE": "True", "MASTER_PORT": str(master.port), "PYTHONPATH": SRC}
    assert run_world(_distcomm_rank, 2, args=(url,), timeout=60, env=env) == [3.0, 3.0]


TORCH_GLOO_RANK = r"""
import sys, torch, torch.distributed as d
from datetime import timedelta
d.init_process_group("gloo", init_method=sys.argv[1], rank=int(sys.argv[2]), world_size=2,
                     timeout=timedelta(seconds=30))
t = torch.tensor([float(d.get_rank() + 1)])
d.all_reduce(t)
d.barrier()
print("sum", t.item())
d.destroy_process_group()
"""


@pytest.mark.slow
def test_torch_gloo_ranks_on_a_distcomm_store(distcomm_master):
    env = dict(os.environ, TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RESTART_COUNT="0")
    url = f"tcp://127.0.0.1:{distcomm_master.port}"
    ranks = [subprocess.Popen([sys.executable, "-c", TORCH_GLOO_RANK, url, str(r)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    try:
        outs = [p.communicate(timeout=CHILD_DEADLINE) for p in ranks]
    finally:
        for p in ranks:
            p.kill()
    for p, (out, err) in zip(ranks, outs):
        assert p.returncode == 0, err[-2000:]
        assert "sum 3.0" in out


DISTCOMM_SCRIPT = """
import numpy as np, distcomm as dist
dist.init_process_group()
a = np.array([float(dist.get_rank() + 1)])
dist.all_reduce(a)
dist.barrier()
print(f"distcomm rank {dist.get_rank()} sum {a[0]}", flush=True)
dist.destroy_process_group()
"""

TORCH_SCRIPT = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
dist.barrier()
print(f"torch rank {dist.get_rank()} sum {t.item()}", flush=True)
dist.destroy_process_group()
"""


def _launch(cmd, tmp_path, script, env_extra=None):
    path = tmp_path / "script.py"
    path.write_text(script)
    env = dict(os.environ, PYTHONPATH=SRC, OMP_NUM_THREADS="1", **(env_extra or {}))
    env.pop("DISTCOMM_AUTH_KEY", None)
    env.pop("DISTCOMM_AUTH_KEY_FILE", None)
    proc = subprocess.Popen(cmd + [str(path)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=CHILD_DEADLINE)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, _ = proc.communicate()
        pytest.fail(f"{cmd[0]} still running after {CHILD_DEADLINE} s:\n{out[-3000:]}")
    return proc.returncode, out


@pytest.mark.slow
def test_torchrun_runs_a_distcomm_script(tmp_path):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                str(free_port())]
    code, out = _launch(torchrun, tmp_path, DISTCOMM_SCRIPT)
    assert code == 0, out[-3000:]
    assert "distcomm rank 0 sum 3.0" in out and "distcomm rank 1 sum 3.0" in out


@pytest.mark.slow
def test_distcomm_run_runs_a_torch_gloo_script(tmp_path):
    launcher = [sys.executable, "-m", "distcomm.run", "--nproc-per-node", "2", "--master-port", str(free_port())]
    code, out = _launch(launcher, tmp_path, TORCH_SCRIPT)
    assert code == 0, out[-3000:]
    assert "torch rank 0 sum 3.0" in out and "torch rank 1 sum 3.0" in out


def _torch_then_silent(conn):
    """Answers the client's probe as torch's servers do (it echoes the PING), then never again."""
    from distcomm.store.tcp.torch_wire import PROBE_NONCE, PROBE_SIZE

    probe = b""
    while len(probe) < PROBE_SIZE:
        probe += conn.recv(PROBE_SIZE - len(probe))
    conn.sendall(PROBE_NONCE)
    try:
        while conn.recv(4096):
            pass
    except OSError:
        pass  # the test closed it


@pytest.mark.parametrize("request_kind", ["add", "get"])
def test_a_torch_server_that_stops_answering_is_an_error_after_the_reply_timeout(no_key, request_kind):
    """The client waits for a torch server's reply the store timeout plus a grace period (a get's
    WAIT the timeout, then its CANCEL_WAIT's answer the rest), then fails naming the server."""
    listener, held = _one_shot_server(_torch_then_silent)
    try:
        s = TCPStore("127.0.0.1", listener.getsockname()[1], None, False, timedelta(seconds=0.3),
                     wait_for_workers=False)
        start = time.monotonic()
        with pytest.raises(DistNetworkError, match=r"torch's TCPStore server at 127\.0\.0\.1:\d+ did not answer within"):
            s.add("k", 1) if request_kind == "add" else s.get("k")
        assert time.monotonic() - start < 10  # not the 30 minutes of a default timeout
        with pytest.raises(DistNetworkError, match="cannot be used any more|is closed"):
            s.set("k", b"1")
    finally:
        listener.close()
        for conn in held:
            conn.close()
