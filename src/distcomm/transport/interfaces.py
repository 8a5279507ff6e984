"""Which local address the TCP transport listens on and tells its peers: ``DISTCOMM_SOCKET_IFNAME``.

Without it the mesh listens on the address the kernel would use to reach the store (mesh.py's
``listen_host``): right on a machine with one network, wrong on one with a slow management network
and a fast data network when the store is on the slow one. ``DISTCOMM_SOCKET_IFNAME`` names the
interface instead, as ``GLOO_SOCKET_IFNAME`` does for gloo:

* ``eth1``: the address of ``eth1``;
* ``eth1,ib0``: the first of these that exists on this host (hosts of one job may name their
  interfaces differently);
* ``^docker0,lo``: any interface but these (NCCL's syntax): the one the kernel routes to the store
  by if it is not excluded, else the first other interface (in the kernel's order) that has an
  address, loopback last.

Names match exactly (like gloo; NCCL matches prefixes). An interface's address is its IPv4 address,
or, when it has none, its first global IPv6 address (link-local ones need a scope and are skipped).
A name that no interface of this host has, or an interface without a usable address, is a
``DistNetworkError`` that lists the interfaces there are, with their addresses.

The transport then binds its listener to that address only (never the wildcard: it accepts only
where it was asked to) and publishes it to its peers, who connect to it.

``choose`` is the rule, with no I/O (the tests call it on tables); ``interface_addresses`` reads
this host's interfaces (Linux: ``SIOCGIFADDR`` for IPv4, ``/proc/net/if_inet6`` for IPv6).
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct

from ..errors import DistNetworkError

ENV = "DISTCOMM_SOCKET_IFNAME"
_SIOCGIFADDR = 0x8915  # Linux: the IPv4 address of an interface


def parse(spec: str) -> tuple[bool, list[str]]:
    """``(exclude, names)`` of a DISTCOMM_SOCKET_IFNAME value."""
    text = spec.strip()
    exclude = text.startswith("^")
    names = [n.strip() for n in text[1:].split(",") if n.strip()] if exclude else \
        [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise DistNetworkError(f"{ENV}={spec!r} names no interface; give one or more names, comma-separated "
                               "(or ^names to exclude)")
    return exclude, names


def _usable(addrs: list[str]) -> str | None:
    """The address to use among an interface's: IPv4 first, then a non-link-local IPv6 one."""
    for a in addrs:
        if ":" not in a:
            return a
    for a in addrs:
        if not ipaddress.ip_address(a.split("%")[0]).is_link_local:
            return a
    return None


def _listing(interfaces: dict[str, list[str]]) -> str:
    return ", ".join(f"{name} ({', '.join(addrs) or 'no address'})" for name, addrs in interfaces.items()) or "none"


def choose(spec: str, interfaces: dict[str, list[str]], routed: str | None = None) -> tuple[str, str]:
    """``(interface, address)`` that ``spec`` selects among ``interfaces`` (``{name: [addresses]}``
    in the kernel's order); ``routed`` is the local address the kernel would use to reach the store
    (the preferred one when ``spec`` only excludes). Raises DistNetworkError naming what exists."""
    exclude, names = parse(spec)
    if not exclude:
        for name in names:
            if name in interfaces:
                address = _usable(interfaces[name])
                if address is None:
                    raise DistNetworkError(
                        f"{ENV}={spec!r}: interface {name!r} has no usable address (IPv4, or IPv6 other "
                        f"than link-local); this host's interfaces: {_listing(interfaces)}")
                return name, address
        raise DistNetworkError(
            f"{ENV}={spec!r}: no interface named {' or '.join(repr(n) for n in names)} on this host "
            f"({socket.gethostname()}); its interfaces: {_listing(interfaces)}")
    allowed = {name: addrs for name, addrs in interfaces.items() if name not in names}
    if routed is not None:
        for name, addrs in allowed.items():
            if routed in addrs:
                return name, routed
    found = [(name, _usable(addrs)) for name, addrs in allowed.items()]
    found = [(name, a) for name, a in found if a is not None]
    found.sort(key=lambda f: ipaddress.ip_address(f[1]).is_loopback)  # stable: kernel order otherwise
    if found:
        return found[0]
    raise DistNetworkError(
        f"{ENV}={spec!r} excludes every interface with a usable address on this host "
        f"({socket.gethostname()}); its interfaces: {_listing(interfaces)}")


def _ipv4(name: str) -> str | None:
    import fcntl

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            ifreq = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError:  # no IPv4 address (or the interface went away)
            return None
    return socket.inet_ntoa(ifreq[20:24])


def _ipv6() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    try:
        with open("/proc/net/if_inet6") as f:
            lines = f.read().splitlines()
    except OSError:
        return found
    for line in lines:
        fields = line.split()
        if len(fields) == 6:
            found.setdefault(fields[5], []).append(str(ipaddress.IPv6Address(bytes.fromhex(fields[0]))))
    return found


def interface_addresses() -> dict[str, list[str]]:
    """``{interface: [addresses]}`` of this host, in the kernel's order (IPv4 first in each)."""
    if not hasattr(socket, "if_nameindex"):
        raise DistNetworkError(f"{ENV} needs socket.if_nameindex, which this platform lacks; unset it")
    v6 = _ipv6()
    out: dict[str, list[str]] = {}
    for _, name in socket.if_nameindex():
        v4 = _ipv4(name) if os.name == "posix" else None
        out[name] = ([v4] if v4 else []) + v6.get(name, [])
    return out


def selected(routed: str | None = None) -> str | None:
    """The address DISTCOMM_SOCKET_IFNAME selects on this host, or None when it is not set."""
    spec = os.environ.get(ENV, "")
    if not spec.strip():
        return None
    return choose(spec, interface_addresses(), routed)[1]
