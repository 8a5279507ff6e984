"""A worker for stacks on demand: rank 0 waits in ``blocked_here`` for a stop file while rank 1
waits for it in a barrier (inside a collective, blocked in the engine); a helper thread sleeps in
``helper_thread_sleeps``. The test sends SIGUSR1 to the launcher and looks for each in the output."""

import os
import threading
import time

import distcomm as dist


def record_pid():
    with open(os.path.join(os.environ["TEST_PID_DIR"], f"worker.{os.getpid()}"), "w") as f:
        f.write(str(os.getpid()))


def helper_thread_sleeps():
    time.sleep(120)


def blocked_here(stop):
    while not os.path.exists(stop):
        time.sleep(0.05)


dist.init_process_group("tcp")
threading.Thread(target=helper_thread_sleeps, daemon=True).start()
record_pid()
stop = os.environ["TEST_STOP_FILE"]
if dist.get_rank() == 0:
    blocked_here(stop)
dist.barrier()
dist.destroy_process_group()
