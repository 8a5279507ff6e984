"""One rank of the MPI differential run (tests/test_mpi_engine.py), started by mpiexec.

Runs every case of tests/diff_cases.py on distcomm's "mpi" engine and on the default engine, both
initialised with no torch variables (what they know comes from mpiexec), then on torch's gloo (the
oracle, given RANK/WORLD_SIZE/MASTER_* now), and pickles the three results to <out>/rank<r>.pkl.
argv: out directory, a free port for torch's store.
"""

import os
import pickle
import sys

import diff_cases as dc
from mpi4py import MPI

out_dir, port = sys.argv[1], sys.argv[2]
rank, size = int(os.environ["PMI_RANK"]), int(os.environ["PMI_SIZE"])
assert "RANK" not in os.environ and "MASTER_ADDR" not in os.environ
between = MPI.COMM_WORLD.Dup().Barrier  # the cases are kept apart outside the runs' own engines
results = {
    "distcomm:mpi": dc.run_cases(rank, size, "distcomm", "mpi", between=between),
    "distcomm:default": dc.run_cases(rank, size, "distcomm", None, between=between),
}
os.environ.update(RANK=str(rank), WORLD_SIZE=str(size), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
results["torch:gloo"] = dc.run_cases(rank, size, "torch", "gloo", between=between)
with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
    pickle.dump(results, f)
