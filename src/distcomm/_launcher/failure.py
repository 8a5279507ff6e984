"""What failed and why: exit descriptions, the traceback tail, and the summary the launcher prints.

The traceback comes from the tail of the failed worker's stderr (Python prints an uncaught
exception's traceback there just before exiting), so no decorator is needed in the user's script.
If the worker wrote torch's error file (``@record`` from torch.distributed.elastic writes JSON to
TORCHELASTIC_ERROR_FILE), that traceback is preferred: it is the exact one.
"""

from __future__ import annotations

import json
import signal
import time
from dataclasses import asdict, dataclass, field

TRACEBACK_HEADER = "Traceback (most recent call last):"
CHAIN_LINES = (
    "During handling of the above exception, another exception occurred:",
    "The above exception was the direct cause of the following exception:",
)
MAX_TRACEBACK_LINES = 40


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def describe_exit(returncode: int) -> str:
    """``exit code 1`` / ``signal SIGSEGV (-11)`` / ``signal SIGKILL (-9) — possibly the OOM killer``."""
    if returncode >= 0:
        text = f"exit code {returncode}"
        if returncode > 128 and returncode - 128 in (signal.SIGKILL, signal.SIGSEGV, signal.SIGABRT):
            text += f" (128+{signal_name(returncode - 128)}: a process inside the worker was killed)"
        return text
    name = signal_name(-returncode)
    text = f"signal {name} ({returncode})"
    if -returncode == signal.SIGKILL:
        text = f"{name} ({returncode}) — possibly the out-of-memory killer (see dmesg)"
    return text


def traceback_tail(lines: list[str], max_lines: int = MAX_TRACEBACK_LINES) -> list[str]:
    """The last Python traceback in ``lines`` (with the exceptions it was chained from), or [].

    Chained exceptions print several ``Traceback`` blocks joined by a "During handling..." line;
    the whole chain is kept and then cut to its last ``max_lines`` lines (the end says what
    was raised, which matters most).
    """
    headers = [i for i, line in enumerate(lines) if line.startswith(TRACEBACK_HEADER)]
    start = headers[-1] if headers else None
    while start is not None:
        j = start - 1
        while j >= 0 and not lines[j].strip():
            j -= 1
        earlier = [h for h in headers if h < j]
        if j < 0 or lines[j].strip() not in CHAIN_LINES or not earlier:
            break
        start = earlier[-1]
    if start is None:
        return []
    chosen = lines[start:]
    if len(chosen) > max_lines:
        chosen = ["  ..."] + chosen[-max_lines:]
    return chosen


def read_error_file(path: str | None) -> list[str] | None:
    """The traceback torch's ``@record`` wrote (its JSON format), or None."""
    if not path:
        return None
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    message = data.get("message")
    if isinstance(message, dict):
        stack = (message.get("extraInfo") or {}).get("py_callstack")
        text = stack or message.get("message")
    else:
        text = message
    return str(text).rstrip("\n").splitlines() if text else None


@dataclass
class Failure:
    """One failed worker, as printed in the summary (and passed between nodes as JSON)."""

    rank: int
    local_rank: int
    node_rank: int
    pid: int
    host: str
    returncode: int
    when: float = field(default_factory=time.time)
    traceback: list[str] = field(default_factory=list)
    stderr_tail: list[str] = field(default_factory=list)  # when there is no traceback

    @property
    def exit_text(self) -> str:
        return describe_exit(self.returncode)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> "Failure":
        return cls(**json.loads(text))


def format_summary(
    what: str,
    root: Failure,
    also_failed: list[Failure],
    stopped: list[int],
    attempts: int,
    log_dir: str | None,
) -> str:
    """The block printed when the job fails: the root cause first, with its traceback tail."""
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(root.when))
    bar = "=" * 72
    lines = [
        bar,
        f"distcomm-run: {what} FAILED"
        + (f" after {attempts} attempts" if attempts > 1 else ""),
        "-" * 72,
        "Root cause (first worker to fail):",
        f"  rank      : {root.rank} (local_rank {root.local_rank} on node {root.node_rank})",
        f"  exit      : {root.exit_text}",
        f"  pid       : {root.pid}",
        f"  host      : {root.host}",
        f"  time      : {stamp}",
    ]
    if root.traceback:
        lines.append("  traceback :")
        lines.extend("    " + line for line in root.traceback)
    else:
        lines.append("  traceback : none (the worker did not raise a Python exception)")
        if root.stderr_tail:
            lines.append("  stderr    : (last lines)")
            lines.extend("    " + line for line in root.stderr_tail)
    if also_failed:
        lines.append("Also failed before the launcher stopped them:")
        for f in also_failed:
            lines.append(f"  rank {f.rank}: {f.exit_text} (pid {f.pid})")
    if stopped:
        lines.append(f"Stopped by the launcher: rank{'s' if len(stopped) > 1 else ''} " + ", ".join(map(str, stopped)))
    if log_dir:
        lines.append(f"Worker logs: {log_dir}")
    lines.append(bar)
    return "\n".join(lines) + "\n"
