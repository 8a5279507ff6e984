"""DISTCOMM_SOCKET_IFNAME: which interface the TCP mesh listens on and publishes (transport/interfaces.py).

The rule (``interfaces.choose``) is pure and tested on tables of interfaces. The mesh's use of it
is tested in one process over loopback: it binds the chosen address only (never the wildcard:
"listen only where asked", checked in the kernel's own socket table) and publishes that address
through the store. Across real interfaces (a second network between namespaced hosts) it is in
tests/test_multihost_netns.py.
"""

from __future__ import annotations

import threading
import time

import pytest

from distcomm.errors import DistError, DistNetworkError
from distcomm.store import HashStore
from distcomm.transport import interfaces, mesh

HOST = {
    "lo": ["127.0.0.1", "::1"],
    "eth0": ["10.0.0.5", "fe80::1"],
    "eth1": ["192.168.7.5"],
    "ib0": ["fe80::9", "2001:db8::9"],  # IPv6 only: the global address
    "wg0": ["fe80::7"],  # link-local only: no usable address
    "docker0": [],
}


@pytest.mark.parametrize("spec,routed,expected", [
    ("eth1", None, ("eth1", "192.168.7.5")),
    (" eth1 ", None, ("eth1", "192.168.7.5")),
    ("eth0", "192.168.7.5", ("eth0", "10.0.0.5")),  # a named interface wins over the route
    ("ib0", None, ("ib0", "2001:db8::9")),
    ("lo", None, ("lo", "127.0.0.1")),
    ("missing0,eth1,eth0", None, ("eth1", "192.168.7.5")),  # the first one that exists, in the list's order
    ("eth0,eth1", None, ("eth0", "10.0.0.5")),
    ("^lo", "192.168.7.5", ("eth1", "192.168.7.5")),  # excluding: the route to the store if allowed
    ("^eth1", "192.168.7.5", ("eth0", "10.0.0.5")),  # else the first allowed, in kernel order
    ("^eth0,eth1,ib0", "192.168.7.5", ("lo", "127.0.0.1")),  # loopback only when nothing else is left
    ("^eth0", "127.0.0.1", ("lo", "127.0.0.1")),  # one host: the store is on loopback
])
def test_choose(spec, routed, expected):
    assert interfaces.choose(spec, HOST, routed) == expected


@pytest.mark.parametrize("spec,message", [
    ("bogus0", "no interface named 'bogus0'"),
    ("bogus0,bogus1", "no interface named 'bogus0' or 'bogus1'"),
    ("wg0", "interface 'wg0' has no usable address"),
    ("docker0", "interface 'docker0' has no usable address"),
    ("^lo,eth0,eth1,ib0", "excludes every interface with a usable address"),
    ("^", "names no interface"),
    (",", "names no interface"),
])
def test_choose_errors_list_what_exists(spec, message):
    with pytest.raises(DistNetworkError) as info:
        interfaces.choose(spec, HOST, None)
    text = str(info.value)
    assert isinstance(info.value, DistError) and message in text and "DISTCOMM_SOCKET_IFNAME" in text
    if "names no interface" not in text:
        assert "lo (127.0.0.1, ::1), eth0 (10.0.0.5, fe80::1), eth1 (192.168.7.5)" in text
        assert "docker0 (no address)" in text


def test_this_host_has_loopback():
    found = interfaces.interface_addresses()
    assert "127.0.0.1" in found.get("lo", []), found


def test_unset_selects_nothing(monkeypatch):
    monkeypatch.delenv(interfaces.ENV, raising=False)
    assert interfaces.selected("10.1.2.3") is None
    monkeypatch.setenv(interfaces.ENV, "  ")
    assert interfaces.selected("10.1.2.3") is None


def _listeners(port: int) -> set[str]:
    """Local addresses of the sockets LISTENing on ``port`` (the kernel's table, IPv4)."""
    found = set()
    with open("/proc/net/tcp") as f:
        for line in f.read().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, p = local.split(":")
            if state == "0A" and int(p, 16) == port:
                found.add(".".join(str(int(addr[i:i + 2], 16)) for i in (6, 4, 2, 0)))
    return found


def test_mesh_listens_only_on_the_named_interface(monkeypatch):
    monkeypatch.setenv(interfaces.ENV, "lo")
    monkeypatch.setenv("DISTCOMM_TCP_LOCAL_SOCKET", "0")  # ranks of one host would connect by a Unix socket
    monkeypatch.setenv("MASTER_ADDR", "192.0.2.1")  # the route to the "store" would not be loopback
    store = HashStore()
    socks, errors = {}, []

    def rank(r):
        try:
            socks[r] = mesh.connect_mesh(store, r, 2, timeout=20)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    one = threading.Thread(target=rank, args=(1,))
    one.start()  # rank 1 listens, then waits for rank 0, which has not started
    deadline = time.monotonic() + 20
    while not store.check(["tcp/addr/1"]):
        assert time.monotonic() < deadline and not errors, errors
        time.sleep(0.01)
    host, port = mesh.decode_address(store.get("tcp/addr/1"))
    assert host == "127.0.0.1"
    assert _listeners(port) == {"127.0.0.1"}, "the mesh must not listen on the wildcard or elsewhere"
    zero = threading.Thread(target=rank, args=(0,))
    zero.start()
    one.join(30)
    zero.join(30)
    assert not errors, errors
    try:
        assert socks[0][1].getpeername() == ("127.0.0.1", port)
        assert socks[1][0].getsockname() == ("127.0.0.1", port)
    finally:
        for s in list(socks[0].values()) + list(socks[1].values()):
            s.close()


def test_mesh_with_an_unknown_interface_fails_naming_the_rank(monkeypatch):
    monkeypatch.setenv(interfaces.ENV, "bogus0")
    with pytest.raises(DistNetworkError, match=r"rank 1 cannot choose where to listen.*no interface named "
                                               r"'bogus0'.*lo \(127\.0\.0\.1"):
        mesh.connect_mesh(HashStore(), 1, 2, timeout=5)


def test_an_explicit_host_wins_over_the_variable(monkeypatch):
    monkeypatch.setenv(interfaces.ENV, "bogus0")
    assert mesh.listen_host(HashStore(), "127.0.0.1") == "127.0.0.1"
