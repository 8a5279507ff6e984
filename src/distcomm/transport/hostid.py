"""Which ranks share a host, and so may share memory: an identity published through the store.

Two processes can use each other's /dev/shm segments and pids only if they run on the same kernel
(boot id), see the same /dev/shm (mount namespace and device) and the same pids (pid namespace).
The host id is all of these, plus the hostname; ``DISTCOMM_HOST_ID`` replaces it (tests use it to
pretend ranks of one machine are on different hosts).

Two containers on one machine share the boot id, so what tells them apart is the rest: their own
/dev/shm (a tmpfs of their own, another device), their own mount namespace, usually their own
hostname. tests/test_multihost_netns.py runs hosts as network + UTS + mount namespaces and relies on
exactly that, without DISTCOMM_HOST_ID. The network namespace is deliberately not part of the id:
processes that share /dev/shm and pids can share memory whatever their network, and should.
"""

from __future__ import annotations

import os
import socket


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return "?"


def _inode(path: str) -> str:
    try:
        return str(os.stat(path).st_ino)
    except OSError:
        return "?"


def host_id() -> str:
    override = os.environ.get("DISTCOMM_HOST_ID")
    if override:
        return override
    try:
        shm_dev = str(os.stat(os.environ.get("DISTCOMM_SHM_DIR", "/dev/shm")).st_dev)
    except OSError:
        shm_dev = "none"
    parts = [
        socket.gethostname(),
        _read("/proc/sys/kernel/random/boot_id"),
        shm_dev,
        _inode("/proc/self/ns/mnt"),
        _inode("/proc/self/ns/pid"),
    ]
    return "/".join(parts)


def exchange(store, rank: int, size: int) -> list[str]:
    """Every rank's host id, by rank (each rank publishes its own through ``store``)."""
    store.set(f"hostid/{rank}", host_id())
    return [v.decode() if isinstance(v, bytes) else v for v in store.multi_get([f"hostid/{q}" for q in range(size)])]


def describe(hosts: list[str]) -> str:
    """"ranks 0-1 on host A, ranks 2-3 on host B" for error messages."""
    groups: dict[str, list[int]] = {}
    for rank, h in enumerate(hosts):
        groups.setdefault(h, []).append(rank)
    return "; ".join(f"ranks {ranks} on host {h.split('/')[0]!r}" for h, ranks in groups.items())
