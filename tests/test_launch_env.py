"""Launching without torch's variables: what mpiexec (MPICH, Open MPI) and Slurm's srun tell a
process (distcomm.launcher_env, pure functions of an environment mapping), init_process_group's
env:// rendezvous using it, and distcomm-run inside a Slurm allocation. There is no Slurm here: its
variables are set the way srun sets them."""

from __future__ import annotations

import os
from datetime import timedelta

import numpy as np
import pytest

from distcomm import launcher_env as le
from distcomm._launcher.config import DEFAULT_MASTER_PORT, node_placement
from distcomm.rendezvous import rendezvous
from distcomm.run import config_from_args, parse_args
from harness import free_port, run_world


# -- Slurm node lists -------------------------------------------------------------------------------
@pytest.mark.parametrize("text,hosts", [
    ("node[01-03,07],gpu5", ["node01", "node02", "node03", "node07", "gpu5"]),
    ("a,b", ["a", "b"]),
    ("single", ["single"]),
    ("x[008-010]", ["x008", "x009", "x010"]),
    ("n[1-2]", ["n1", "n2"]),
    ("rack[1-2]-n[3,5]", ["rack1-n3", "rack1-n5", "rack2-n3", "rack2-n5"]),
    ("c[9-11]", ["c9", "c10", "c11"]),
    ("gpu5,node[1,3]", ["gpu5", "node1", "node3"]),
])
def test_parse_nodelist(text, hosts):
    assert le.parse_nodelist(text) == hosts


@pytest.mark.parametrize("text", ["node[01-", "node]1[", "node[3-1]", "node[a-b]", "", "node[]"])
def test_bad_nodelists_are_errors(text):
    with pytest.raises(le.LaunchEnvError):
        le.parse_nodelist(text)


def test_slurm_port_is_per_job_and_below_the_ephemeral_range():
    assert le.slurm_port(12345) == 10000 + 12345 % 20000
    assert le.slurm_port(1) != le.slurm_port(2)
    assert all(10000 <= le.slurm_port(j) < 30000 for j in (0, 19999, 20000, 987654321))


# -- detect -------------------------------------------------------------------------------------------
MPICH = {"PMI_RANK": "1", "PMI_SIZE": "3", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "3"}
OMPI = {"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
SRUN = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_STEP_NUM_TASKS": "6", "SLURM_LOCALID": "1",
        "SLURM_JOB_NODELIST": "node[01-03,07],gpu5", "SLURM_STEP_NODELIST": "node[02-03]", "SLURM_JOB_ID": "4242"}


def test_no_launcher_is_none():
    assert le.detect({}) is None
    assert le.detect({"PATH": "/bin", "SLURM_JOB_ID": "3"}) is None


def test_mpich_hydra_with_mpi4py_agrees_over_mpi_on_one_host():
    got = le.detect(MPICH, mpi_importable=True)
    assert got == le.LaunchEnv("mpich", 1, 3, 1, 3, le.VIA_MPI, "127.0.0.1", None)


def test_open_mpi_over_several_hosts_uses_rank0s_hostname():
    got = le.detect(OMPI, mpi_importable=True)
    assert got == le.LaunchEnv("openmpi", 2, 4, 0, 2, le.VIA_MPI, None, None)
    with_port = le.detect({**OMPI, "MASTER_PORT": "1234"}, mpi_importable=True)
    assert (with_port.store_via, with_port.master_port) == (le.VIA_MPI, 1234)


def test_master_addr_and_port_win():
    got = le.detect({**MPICH, "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "999"}, mpi_importable=True)
    assert (got.rank, got.world_size, got.store_via, got.master_addr, got.master_port) == \
        (1, 3, le.VIA_ADDRESS, "10.1.2.3", 999)


def test_mpi_without_mpi4py_has_no_address_unless_slurm_gives_one():
    assert le.detect(MPICH, mpi_importable=False).store_via == le.VIA_NONE
    under_srun = le.detect({**MPICH, "SLURM_JOB_NODELIST": "n[4-5]", "SLURM_JOB_ID": "7"}, mpi_importable=False)
    assert (under_srun.launcher, under_srun.store_via, under_srun.master_addr, under_srun.master_port) == \
        ("mpich", le.VIA_ADDRESS, "n4", le.slurm_port(7))


def test_srun_takes_the_step_and_the_first_host_of_its_node_list():
    got = le.detect(SRUN, mpi_importable=True)  # srun alone: no MPI launcher, so no MPI rendezvous
    assert got == le.LaunchEnv("slurm", 5, 6, 1, None, le.VIA_ADDRESS, "node02", le.slurm_port(4242))
    no_step = {k: v for k, v in SRUN.items() if not k.startswith("SLURM_STEP_")}
    got = le.detect({**no_step, "MASTER_PORT": "29555"})
    assert (got.world_size, got.master_addr, got.master_port) == (8, "node01", 29555)


def test_srun_without_a_node_list_has_no_address():
    got = le.detect({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"})
    assert got.store_via == le.VIA_NONE and got.master_addr is None


@pytest.mark.parametrize("env,word", [
    ({"PMI_RANK": "x", "PMI_SIZE": "2"}, "PMI_RANK='x'"),
    ({"PMI_RANK": "2", "PMI_SIZE": "2"}, "rank 2 is outside 0..1"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "n[1-", "SLURM_JOB_ID": "1"}, "unbalanced"),
])
def test_bad_launcher_variables(env, word):
    with pytest.raises(le.LaunchEnvError, match=word.replace("[", r"\[").replace(".", r"\.")):
        le.detect(env)


# -- env:// through the launcher's variables --------------------------------------------------------
def _launcher_only(monkeypatch, env):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    for name in list(os.environ):
        if name.startswith(("PMI_", "OMPI_", "SLURM_", "MPI_LOCAL")):
            monkeypatch.delenv(name)
    for k, v in env.items():
        monkeypatch.setenv(k, v)


def test_env_rendezvous_with_no_address_says_what_to_set(monkeypatch):
    _launcher_only(monkeypatch, {"SLURM_PROCID": "0", "SLURM_NTASKS": "2"})
    with pytest.raises(ValueError, match="started by slurm .rank 0 of 2., but nothing says where the store is"):
        next(rendezvous("env://"))


def test_env_rendezvous_reports_bad_launcher_variables(monkeypatch):
    _launcher_only(monkeypatch, {"PMI_RANK": "one", "PMI_SIZE": "2"})
    with pytest.raises(ValueError, match="env:// rendezvous: environment variable PMI_RANK='one'"):
        next(rendezvous("env://"))


def test_torch_variables_still_come_first(monkeypatch):
    _launcher_only(monkeypatch, {"PMI_RANK": "0", "PMI_SIZE": "2"})
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    store, rank, size = next(rendezvous("env://"))
    assert (rank, size) == (0, 1)


def _srun_rank(rank, world_size, port):
    """One task of a simulated `srun -n 2`: only Slurm's variables (and MASTER_PORT, as a job
    script would export it, so two test runs never share a port)."""
    import distcomm as dist

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR"):
        os.environ.pop(name, None)
    os.environ.update(SLURM_PROCID=str(rank), SLURM_NTASKS=str(world_size), SLURM_LOCALID=str(rank),
                      SLURM_JOB_NODELIST="localhost,node[2-3]", SLURM_JOB_ID="99", MASTER_PORT=str(port))
    dist.init_process_group(timeout=timedelta(seconds=30))
    t = np.full(3, float(rank + 1))
    dist.all_reduce(t)
    out = (dist.get_rank(), dist.get_world_size(), dist.get_node_local_rank(), t.tolist())
    dist.destroy_process_group()
    return out


@pytest.mark.slow
def test_init_process_group_under_simulated_srun():
    results = run_world(_srun_rank, 2, args=(free_port(),), timeout=60)
    assert results == [(0, 2, 0, [3.0] * 3), (1, 2, 1, [3.0] * 3)]


# -- distcomm-run inside an allocation -----------------------------------------------------------------
SBATCH_NODE = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NUM_NODES": "3", "SLURM_JOB_NODELIST": "cn[10-12]",
               "SLURM_NODEID": "2"}


def test_slurm_node_defaults():
    assert le.slurm_node_defaults(SBATCH_NODE) == le.SlurmNodes(3, 2, "cn10", le.slurm_port(4242))
    step = {**SBATCH_NODE, "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NODELIST": "cn[11-12]", "SLURM_NODEID": "1"}
    assert le.slurm_node_defaults(step) == le.SlurmNodes(2, 1, "cn11", le.slurm_port(4242))
    assert le.slurm_node_defaults({}) is None


def test_node_placement_options_then_slurm_then_defaults():
    assert node_placement(None, None, None, None, SBATCH_NODE) == (3, 2, "cn10", le.slurm_port(4242))
    assert node_placement("2", 0, "head", 1234, SBATCH_NODE) == ("2", 0, "head", 1234)
    assert node_placement(None, None, None, None, {}) == ("1", 0, "127.0.0.1", DEFAULT_MASTER_PORT)
    one_node = {**SBATCH_NODE, "SLURM_JOB_NUM_NODES": "1", "SLURM_NODEID": "0"}
    assert node_placement(None, None, None, None, one_node) == ("1", 0, "127.0.0.1", DEFAULT_MASTER_PORT)


def test_distcomm_run_inside_sbatch(monkeypatch):
    for name in list(os.environ):
        if name.startswith(("SLURM_", "PET_")):
            monkeypatch.delenv(name)
    for k, v in SBATCH_NODE.items():
        monkeypatch.setenv(k, v)
    c = config_from_args(parse_args(["--nproc-per-node", "2", "train.py"]))
    assert (c.nnodes, c.node_rank, c.master_addr, c.master_port) == (3, 2, "cn10", le.slurm_port(4242))
    c = config_from_args(parse_args(["--nnodes", "3", "--node-rank", "0", "--master-addr", "h", "train.py"]))
    assert (c.nnodes, c.node_rank, c.master_addr, c.master_port) == (3, 0, "h", le.slurm_port(4242))
    c = config_from_args(parse_args(["--standalone", "train.py"]))
    assert (c.nnodes, c.node_rank, c.master_addr, c.master_port) == (1, 0, "127.0.0.1", 0)
