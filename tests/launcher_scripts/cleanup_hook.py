"""A cleanup hook for the launcher tests: records each call in $TEST_HOOK_LOG."""

import os


def record(run_id, attempt):
    with open(os.environ["TEST_HOOK_LOG"], "a") as f:
        f.write(f"{run_id} {attempt}\n")
