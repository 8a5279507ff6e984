"""Where the job store listens, and how launchers leave, as users meet them (review 19).

- Under mpiexec with MASTER_ADDR set (and no MASTER_PORT), env:// agrees on the store over MPI:
  rank 0's store must listen on MASTER_ADDR only, never the wildcard, and MASTER_ADDR=::1 must work
  (the store listened on 0.0.0.0 then, which ::1 clients cannot reach: init hung until its timeout).
"""

from __future__ import annotations

import pytest

import mpi_harness


@pytest.mark.parametrize("addr, expect", [("localhost", {"127.0.0.1", "::1"}), ("::1", {"::1"})])
def test_mpiexec_store_listens_on_master_addr_only(addr, expect, tmp_path):
    reason = mpi_harness.skip_reason()
    if reason:
        pytest.skip(reason)
    # a private /dev/shm: a failing run's ranks exit without MPI_Finalize, leaving MPICH's segments
    private = mpi_harness.private_shm_unavailable() is None
    listing = str(tmp_path / "shm.txt") if private else None
    done = mpi_harness.run_mpiexec(2, "store_listen_worker.py", timeout=30, env={"MASTER_ADDR": addr},
                                   shm_listing=listing)
    assert done.returncode == 0, done.stdout + done.stderr
    line = [l for l in done.stdout.splitlines() if l.startswith("LISTEN ")]
    assert line, done.stdout
    where = set(line[0].split(" ", 1)[1].split(","))
    assert where and where <= expect, f"MASTER_ADDR={addr}: the store listens on {where}"


LAUNCH_DEADLINE = 20.0  # a passing launcher takes 2-3 s; before the fix node 0's took over 31 s


def test_launchers_stop_promptly_when_the_job_cannot_start(tmp_path):
    """--nnodes 3 and only nodes 0 and 1 come: node 0 times out waiting (join_timeout=1 s). Node 1,
    with a long join_timeout, must stop at once (node 0 tells it why), and node 0 must not wait for
    node 2, which never connected, to leave (it waited its 30 s exit barrier for it)."""
    import os
    import threading
    import time

    from harness import run_in_session
    from launcher_scripts.support import command, free_port, launcher_env

    script = tmp_path / "never.py"
    script.write_text("raise SystemExit('no worker may start')\n")
    port = free_port()
    common = ["--nnodes", "3", "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", port]
    results = {}

    def launch(node, join_timeout):
        start = time.monotonic()
        done = run_in_session(command([*common, "--node-rank", node, "--rdzv-conf", f"join_timeout={join_timeout}",
                                       str(script)]), LAUNCH_DEADLINE, env=launcher_env())
        results[node] = (done, time.monotonic() - start)

    node0 = threading.Thread(target=launch, args=(0, 1))
    node0.start()
    time.sleep(0.3)
    launch(1, 60)
    node0.join()
    (done0, took0), (done1, took1) = results[0], results[1]
    assert done0.returncode == 1 and "to join the job" in done0.stderr, done0.stderr
    assert done1.returncode == 1 and "node 0" in done1.stderr and "to join the job" in done1.stderr, done1.stderr
    assert took1 < 10, f"node 1's launcher waited {took1:.1f} s for a job node 0 had given up on"
    assert took0 < 10, f"node 0's launcher took {took0:.1f} s to leave (waited for a node that never came)"


def test_multi_node_master_name_resolving_to_loopback_is_named(tmp_path):
    """--master-addr <this host's name> where /etc/hosts maps it to a loopback address (Debian's
    127.0.1.1): the store listens there, and other hosts' launchers knock at nothing. Node rank 0
    says so at start, and its join timeout names the cause (it only said "timed out")."""
    import ipaddress
    import socket

    from harness import run_in_session
    from launcher_scripts.support import command, free_port, launcher_env

    name = socket.gethostname()
    try:
        addr = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)[0][4][0]
    except OSError:
        pytest.skip(f"this host's name {name!r} does not resolve")
    if not ipaddress.ip_address(addr).is_loopback:
        pytest.skip(f"this host's name {name!r} resolves to {addr}, not a loopback address")
    script = tmp_path / "never.py"
    script.write_text("raise SystemExit('no worker may start')\n")
    done = run_in_session(command(["--nnodes", "2", "--node-rank", "0", "--master-addr", name, "--master-port",
                                   free_port(), "--rdzv-conf", "join_timeout=1", str(script)]),
                          LAUNCH_DEADLINE, env=launcher_env())
    assert done.returncode == 1, done.stderr
    assert f"--master-addr {name} resolves to {addr}" in done.stderr, done.stderr
    assert "other hosts cannot reach" in done.stderr.split("timed out", 1)[1], done.stderr


def test_file_store_is_private_to_its_user(tmp_path):
    """file:// keeps the job's secrets (the TCP transport's session token, peers' addresses) in its
    file, protected by nothing but the file's mode: it must be 0600 whatever the umask (was 0644)."""
    import os
    import stat

    from distcomm import FileStore

    path = tmp_path / "store"
    old = os.umask(0o022)
    try:
        store = FileStore(str(path), 1)
        store.set("k", "v")
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        store.close() if hasattr(store, "close") else None
    finally:
        os.umask(old)
