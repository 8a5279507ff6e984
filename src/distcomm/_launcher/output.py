"""Worker output: whole lines, prefixed with the rank, to the console and/or a log file.

Every worker's stdout and stderr are pipes read by the launcher's one event loop (see
``workers.WorkerGroup``); this module turns the chunks read into lines. A line is written to the
console only when it is complete (or at end of stream, or when it grows past ``MAX_LINE`` bytes),
and only the launcher's main thread writes, so lines from different workers never interleave
mid-line. Each stream also keeps the tail of its last lines: the failure summary takes the Python
traceback from the stderr tail, so user scripts need no decorator.

Destinations per (local rank, stream), as torchrun's --redirects/--tee: console only (default),
file only (redirect), file and console (tee). --local-ranks-filter limits the console only.
Log files get the raw lines. On the console, as torchrun:

- a stream that is not teed is shown as the worker wrote it (torchrun hands the worker the
  launcher's own stdout/stderr); with ``--rank-prefix`` (distcomm's) each line gets ``[rank<N>]: ``;
- a teed line gets torchrun's TailLog header: ``[<role><local_rank>]:`` (``[default0]:line``), or
  the prefix template (``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE`` / ``--log-line-prefix-template``)
  with ``${role_name}``, ``${rank}``, ``${local_rank}`` substituted (``string.Template``, unknown
  names left as written).
"""

from __future__ import annotations

import collections
import os
import sys
from string import Template
from typing import BinaryIO

from .config import STD_ERR, STD_OUT

MAX_LINE = 64 * 1024
TAIL_LINES = 200


class StreamSink:
    """One worker stream: assembles lines from chunks and sends each to its destinations."""

    def __init__(self, console: BinaryIO | None, prefix: bytes, logfile: BinaryIO | None):
        self.console = console
        self.prefix = prefix
        self.logfile = logfile
        self.tail: collections.deque[bytes] = collections.deque(maxlen=TAIL_LINES)
        self._partial = bytearray()

    def feed(self, data: bytes) -> None:
        self._partial += data
        start = 0
        while True:
            end = self._partial.find(b"\n", start)
            if end < 0:
                break
            self._emit(bytes(self._partial[start : end + 1]))
            start = end + 1
        del self._partial[:start]
        if len(self._partial) >= MAX_LINE:
            self._emit(bytes(self._partial) + b"\n")
            self._partial.clear()

    def close(self) -> None:
        """End of stream: a last line without a newline is still a line."""
        if self._partial:
            self._emit(bytes(self._partial) + b"\n")
            self._partial.clear()
        if self.logfile is not None:
            self.logfile.close()
            self.logfile = None

    def _emit(self, line: bytes) -> None:
        self.tail.append(line)
        if self.logfile is not None:
            self.logfile.write(line)
        if self.console is not None:
            try:
                self.console.write(self.prefix + line)
            except (BrokenPipeError, ValueError):  # our own stdout went away: keep running the job
                self.console = None

    def tail_text(self) -> list[str]:
        return [line.decode("utf-8", "replace").rstrip("\n") for line in self.tail]


class OutputRouter:
    """Creates the sinks of each worker from the --redirects/--tee/--log-dir/filter settings."""

    def __init__(
        self,
        redirects: dict[int, int],
        tee: dict[int, int],
        log_dir: str | None,
        ranks_filter: set[int] | None,
        stdout: BinaryIO | None = None,
        stderr: BinaryIO | None = None,
        *,
        role: str = "default",
        prefix_template: str | None = None,
        rank_prefix: bool = False,
    ):
        self.redirects = redirects
        self.tee = tee
        self.log_dir = log_dir
        self.ranks_filter = ranks_filter
        self.role = role
        self.prefix_template = prefix_template
        self.rank_prefix = rank_prefix
        self.stdout = stdout if stdout is not None else sys.stdout.buffer
        self.stderr = stderr if stderr is not None else sys.stderr.buffer

    def sinks(self, local_rank: int, rank: int, attempt_dir: str | None) -> tuple[StreamSink, StreamSink]:
        """(stdout sink, stderr sink) of one worker; log files go under ``attempt_dir/<local_rank>/``."""
        made = []
        for stream, bit, console in (("stdout", STD_OUT, self.stdout), ("stderr", STD_ERR, self.stderr)):
            redirected = bool(self.redirects.get(local_rank, 0) & bit)
            teed = bool(self.tee.get(local_rank, 0) & bit)
            logfile = None
            if (redirected or teed) and attempt_dir is not None:
                directory = os.path.join(attempt_dir, str(local_rank))
                os.makedirs(directory, exist_ok=True)
                logfile = open(os.path.join(directory, f"{stream}.log"), "wb", buffering=0)
            shown = (teed or not redirected) and (self.ranks_filter is None or local_rank in self.ranks_filter)
            made.append(StreamSink(console if shown else None, self._prefix(teed, local_rank, rank), logfile))
        return made[0], made[1]

    def _prefix(self, teed: bool, local_rank: int, rank: int) -> bytes:
        if teed:
            if self.prefix_template:  # torchrun ignores an empty template too
                text = Template(self.prefix_template).safe_substitute(
                    role_name=self.role, rank=rank, local_rank=local_rank
                )
            else:
                text = f"[{self.role}{local_rank}]:"
        else:
            text = f"[rank{rank}]: " if self.rank_prefix else ""
        return text.encode()

    @property
    def wants_files(self) -> bool:
        return any(v for v in self.redirects.values()) or any(v for v in self.tee.values())

    def flush(self) -> None:
        for stream in (self.stdout, self.stderr):
            try:
                stream.flush()
            except (BrokenPipeError, ValueError):
                pass

