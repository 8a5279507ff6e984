"""Functions run by distcomm.multiprocessing.spawn in the spawn tests (importable by the children)."""

import os
import signal
import sys
import time


def write_index(i, out_dir, tag):
    with open(os.path.join(out_dir, f"{i}"), "w") as f:
        f.write(f"{tag} {os.getpid()}")


def _record_and_wait(out_dir):
    with open(os.path.join(out_dir, f"pid.{os.getpid()}"), "w") as f:
        f.write("x")
    time.sleep(60)


def fail(i, how, failing, out_dir):
    if i != failing:
        _record_and_wait(out_dir)
    time.sleep(0.3)  # let the others start and record their pids
    if how == "raise":
        raise ValueError(f"bad child {i}")
    if how == "exit":
        sys.exit(3)
    os.kill(os.getpid(), signal.SIGKILL)


def sleep_then_return(i, seconds):
    time.sleep(seconds)
