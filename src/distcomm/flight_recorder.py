"""The flight recorder: each process keeps its last N operations, to say after a hang or a fault
what every rank was doing (torch's NCCL flight recorder, for distcomm's engines).

One record per collective or point-to-point operation, made where its sequence number is taken:
``ProcessGroup.run`` (every collective of the general path), ``ProcessGroup.send``/``recv``, and
the shared-memory engine's latency path (``backends/shm/latency.py``, which takes its own sequence
numbers). A record holds the operation, its group, sequence number, byte count, dtype, peer or root
(group rank), the call site (file, line and function of the first frame outside distcomm's library
code and torch.distributed; distcomm's own programs, its benchmark and demo, are users of it)
and its times and state: "scheduled" when issued, "started" when its body runs, then "completed" or
"failed".

Cheap by construction: a record is one small list written into a preallocated ring (no lock: a
slot is replaced whole, or refilled in C while only the ring holds it; a dump copies the ring), the call site is kept as the frame's code object and
instruction offset (file, line and function are looked up from them only when read), found by a
walk of a few frames with one dict lookup each (which files are distcomm's is learnt once per
file), or by one lookup where the caller knows how many frames above it are distcomm's (``started``,
the latency paths' record), and nothing is formatted until a dump. Measurements are in
docs/performance-notes.md.

Settings, read once when distcomm is imported:

* ``DISTCOMM_TRACE_BUFFER_SIZE``: records kept (default 2000, torch's default; 0 disables the
  recorder, and every hook then costs one ``is None`` test).
* ``DISTCOMM_TRACE_DIR``: where dumps go, one file per rank (``distcomm_trace_rank_<rank>.jsonl``).
  Unset (the default) means no file is ever written unless ``dump`` is given a directory: a job
  that times out does not litter a temp dir behind the user's back.

A dump is JSON lines: one header line (rank, world size, pid, host, reason, time, the groups this
process knows with their ranks: its live groups, and destroyed ones while records of theirs are in
the ring) and then the records, oldest first. ``python -m distcomm.trace DIR``
reads the files of every rank.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import socket
import sys
import tempfile
import time
from typing import Iterable

# Field positions in a record (a list, so the hot path fills it with one literal).
ID, GROUP, SEQ, OP, NBYTES, DTYPE, PEER, SITE, T_CREATED, T_COMPLETED, STATE, ERROR, TAG = range(13)
FIELDS = ("id", "group", "seq", "op", "nbytes", "dtype", "peer", "site", "time_created", "time_completed",
          "state", "error", "tag")

SCHEDULED, STARTED, COMPLETED, FAILED = "scheduled", "started", "completed", "failed"

DEFAULT_CAPACITY = 2000
RETIRED_GROUPS_KEPT = 256  # destroyed groups kept before their entries are pruned (see retire_group)
FILE_PATTERN = "distcomm_trace_rank_{rank}.jsonl"

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
# distcomm's own programs, its benchmark and its demo, are its users: a call they make is named at
# their line (and costs the record one lookup, where a call from library code costs a walk up)
_PROGRAM_DIRS = tuple(os.path.join(_PACKAGE_DIR, name) + os.sep for name in ("bench", "demo"))
# torch.distributed's own frames are not the user's either (torch's c10d calls distcomm's backend)
_TORCH_DISTRIBUTED = os.sep + os.path.join("torch", "distributed") + os.sep
_internal: dict = {}  # file name -> is_library_file(name)
_now = time.time
_getframe = sys._getframe

try:  # ``started`` in C (setup.py builds it where it can): the latency paths' record, about 10x cheaper
    from ._record import Started as _StartedInC
except ImportError:
    _StartedInC = None
#: whether ``FlightRecorder.started`` runs in C here
STARTED_IN_C = _StartedInC is not None


def call_site(depth: int = 2):
    """Where the first frame outside distcomm is, starting ``depth`` frames up: its code object and
    instruction offset, turned into (file, line, function) only when read (``resolve_site``). A
    frame's line number costs a scan of its code's line table, over a microsecond for a loop deep
    in a long module; the offset costs nothing, and a code object holds no locals alive."""
    try:
        frame = _getframe(depth)
    except ValueError:
        return None
    return _outside(frame)


def is_library_file(name: str) -> bool:
    """Whether code in file ``name`` is library code, whose frames are not the user's: distcomm's
    (but for its benchmark and demo programs) or torch.distributed's. Kept per name."""
    inside = _internal.get(name)
    if inside is None:
        inside = _internal[name] = (name.startswith(_PACKAGE_DIR) and not name.startswith(_PROGRAM_DIRS)) \
            or _TORCH_DISTRIBUTED in name
    return inside


def _outside(frame):
    """``call_site`` from ``frame`` up."""
    internal = _internal
    while frame is not None:
        code = frame.f_code
        # keyed by file name, whose hash the string keeps (a code object's is recomputed per call)
        name = code.co_filename
        inside = internal.get(name)
        if inside is None:
            inside = is_library_file(name)
        if not inside:
            return (code, frame.f_lasti)
        frame = frame.f_back
    return None


def resolve_site(site) -> tuple[str, int] | None:
    """(file, line) of a ``call_site`` result (``site_function`` names its function)."""
    if site is None:
        return None
    code, offset = site
    line = code.co_firstlineno
    for start, end, number in code.co_lines():
        if start <= offset < end:
            line = number if number is not None else line
            break
    return (code.co_filename, line)


def site_function(site) -> str | None:
    """The qualified name of the function of a ``call_site`` result ("<module>" at top level)."""
    return None if site is None else site[0].co_qualname


def format_site(site) -> str:
    """``train.py:41`` for a (file, line) pair; "?" when unknown."""
    if not site:
        return "?"
    path, line = site
    return f"{os.path.basename(path)}:{line}"


class FlightRecorder:
    """A ring of the last ``capacity`` operations of this process (see the module docstring)."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY):
        if capacity <= 0:
            raise ValueError(f"flight recorder capacity must be positive, got {capacity}")
        self.capacity = capacity
        self._slots: list = [None] * capacity
        # ids of records (a record's slot is id % capacity): itertools.count's own method, one C
        # call, atomic under the GIL, unlike a += on an attribute
        ids = itertools.count()
        self._next_id = ids.__next__
        if _StartedInC is not None:  # the method below stays the reference the C one is tested against
            self.started = _StartedInC(self._slots, capacity, ids, _internal, _outside, STARTED)
        self.rank: int | None = None  # the global rank, once a group says it
        self.world_size: int | None = None
        self.groups: dict[str, dict] = {}  # name -> {"id", "ranks", "timeout"}
        self.retired: set[str] = set()  # names in ``groups`` of destroyed groups
        self._prune_above = RETIRED_GROUPS_KEPT

    def register_group(self, name: str, group_id: int, ranks: Iterable[int], global_rank: int,
                       timeout_s: float) -> None:
        self.groups[name] = {"id": group_id, "ranks": list(ranks), "timeout": timeout_s}
        self.retired.discard(name)
        self.rank = global_rank

    def retire_group(self, name: str) -> None:
        """The group ``name`` was destroyed. Its entry stays while records of it are in the ring (a
        dump still says which ranks they were about), and goes after that: a job that makes and
        destroys groups for as long as it runs keeps a bounded table. Pruning reads the ring, so it
        waits until more than RETIRED_GROUPS_KEPT (or twice what the last pruning kept) are retired."""
        if name not in self.groups:
            return
        self.retired.add(name)
        if len(self.retired) > self._prune_above:
            in_ring = {entry[GROUP] for entry in list(self._slots) if entry is not None}
            for old in [g for g in self.retired if g not in in_ring]:
                self.groups.pop(old, None)
                self.retired.discard(old)
            self._prune_above = max(RETIRED_GROUPS_KEPT, 2 * len(self.retired))

    # -- the hot path ---------------------------------------------------------------------------
    def record(self, group: str, seq: int | None, op: str, nbytes: int | None, dtype: str | None,
               peer: int | None, state: str = SCHEDULED, tag: int | None = None, depth: int = 2) -> list:
        """Add a record and return it; the caller marks it with ``complete``/``fail``. ``seq`` is
        the collective's sequence number in its group; a send or receive has none, but a ``tag``.
        ``depth``: the first frame that may be the user's, as ``call_site`` counts (1: this
        method, 2: its caller); a caller that knows its own callers are distcomm's skips them."""
        try:
            site = _outside(_getframe(depth - 1))
        except ValueError:
            site = None
        i = self._next_id()
        entry = [i, group, seq, op, nbytes, dtype, peer, site, _now(), None, state, None, tag]
        self._slots[i % self.capacity] = entry
        return entry

    def started(self, group: str, seq: int, op: str, nbytes: int | None, dtype: str | None,
                peer: int | None, skip: int) -> list:
        """``record`` of a collective already running ("started"), for the latency paths, whose
        every microsecond counts: the caller knows the ``skip`` frames from here up are distcomm's
        (1: this method, 2: its caller, ...), so the search for the user's frame starts above them
        with no frame between looked at. A latency path called by the API function
        (``_api.all_reduce`` -> ``FastPath.all_reduce``) passes 3: the frame there is the user's,
        and one dictionary lookup says so; a distcomm caller there (DDP, torch's c10d) costs the
        walk up from it, as ``record`` does."""
        try:
            frame = _getframe(skip)
        except ValueError:  # a thread whose first frame is distcomm's: no user frame
            site = None
        else:
            code = frame.f_code
            if _internal.get(code.co_filename) is False:
                site = (code, frame.f_lasti)
            else:  # distcomm's, or a file not seen yet
                site = _outside(frame)
        i = self._next_id()
        entry = [i, group, seq, op, nbytes, dtype, peer, site, _now(), None, STARTED, None, None]
        self._slots[i % self.capacity] = entry
        return entry

    # -- reading --------------------------------------------------------------------------------
    def entries(self) -> list[list]:
        """A copy of the records, oldest first (by id: a slot is replaced whole, or refilled in C
        only while nothing but the ring holds its record)."""
        return sorted((e for e in list(self._slots) if e is not None), key=lambda e: e[ID])

    def recorded(self) -> int:
        """How many records were ever made (the newest id + 1)."""
        newest = max((e[ID] for e in list(self._slots) if e is not None), default=-1)
        return newest + 1

    def recent(self, limit: int) -> list[list]:
        """The newest ``limit`` records, newest first (what the watchdog scans)."""
        return self.entries()[::-1][:limit]

    def snapshot(self) -> dict:
        """Per group: the last record started (or scheduled) and the last one completed, as dicts."""
        groups: dict[str, dict] = {}
        done: set[str] = set()
        for entry in self.recent(self.capacity):
            g = entry[GROUP]
            if g in done:
                continue
            state = groups.setdefault(g, {"last_started": None, "last_completed": None})
            if state["last_started"] is None:
                state["last_started"] = to_dict(entry)
            if entry[STATE] == COMPLETED:
                state["last_completed"] = to_dict(entry)
                done.add(g)
        return groups

    def header(self, reason: str) -> dict:
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "reason": reason,
            "time": _now(),
            "capacity": self.capacity,
            "recorded": self.recorded(),
            "groups": dict(self.groups),  # a copy (one C call): groups come and go in other threads
        }

    def dump(self, directory: str | None = None, reason: str = "on demand") -> str | None:
        """Write this rank's records to ``directory`` (default ``DISTCOMM_TRACE_DIR``); the path
        written, or None when there is no directory to write to."""
        directory = directory or os.environ.get("DISTCOMM_TRACE_DIR")
        if not directory:
            return None
        os.makedirs(directory, exist_ok=True)
        rank = self.rank if self.rank is not None else os.environ.get("RANK", os.getpid())
        path = os.path.join(directory, FILE_PATTERN.format(rank=rank))
        # Written aside and renamed, so a reader never sees half a dump; aside under a name of its
        # own, as two threads of a rank may dump at once (its own timeout, another rank's request).
        fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp", dir=directory)
        try:
            with open(fd, "w") as f:
                f.write(json.dumps(self.header(reason)) + "\n")
                for entry in self.entries():
                    f.write(json.dumps(to_dict(entry)) + "\n")
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return path


def complete(entry: list) -> None:
    entry[T_COMPLETED] = _now()
    entry[STATE] = COMPLETED


def fail(entry: list, exc: BaseException) -> None:
    entry[T_COMPLETED] = _now()
    entry[STATE] = FAILED
    first = str(exc).splitlines()[0] if str(exc) else ""
    entry[ERROR] = f"{type(exc).__name__}: {first if len(first) <= 120 else first[:117] + '...'}"


def to_dict(entry: list) -> dict:
    d = dict(zip(FIELDS, entry))
    code_site = d["site"]
    site = resolve_site(code_site)
    d["site"] = None if site is None else {"file": site[0], "line": site[1], "function": site_function(code_site)}
    return d


def read_dump(path: str) -> tuple[dict, list[dict]]:
    """One rank's dump file: (header, records oldest first). A file that is not a whole dump (empty,
    cut short, not JSON lines, lines that are not a header and records) raises ValueError saying
    what is wrong with it and where; one that cannot be read raises OSError."""
    lines = []
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                lines.append(json.loads(line.decode("utf-8")))  # as dump writes them (ASCII, in fact)
            except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
                cut = "" if line.endswith(b"\n") else ", cut short (the file ends inside it)"
                if isinstance(exc, json.JSONDecodeError):
                    what = f"column {exc.colno}: {exc.msg}"
                elif isinstance(exc, UnicodeDecodeError):
                    what = f"not UTF-8 text: {exc.reason} at byte {exc.start}"
                else:
                    what = str(exc)
                raise ValueError(f"line {number} is not JSON{cut} ({what})") from None
            item = lines[-1]
            if len(lines) == 1:  # the header: what header() writes, not a record
                if not isinstance(item, dict) or "op" in item or not isinstance(item.get("groups", {}), dict):
                    raise ValueError(f"line {number} is not the header of a flight recorder dump")
            elif not isinstance(item, dict) or "op" not in item or "seq" not in item:
                raise ValueError(f"line {number} is not a record of a flight recorder dump")
    if not lines:
        raise ValueError("empty file (no header)")
    return lines[0], lines[1:]


def _capacity_from_env() -> int:
    text = os.environ.get("DISTCOMM_TRACE_BUFFER_SIZE", "")
    if not text.strip():
        return DEFAULT_CAPACITY
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"DISTCOMM_TRACE_BUFFER_SIZE must be a whole number of records, got {text!r}") from None
    if value < 0:
        raise ValueError(f"DISTCOMM_TRACE_BUFFER_SIZE must be 0 (off) or more, got {value}")
    return value


def configure(capacity: int | None = None) -> FlightRecorder | None:
    """(Re)make the process's recorder with ``capacity`` records (default: from the environment);
    0 turns it off. Returns the recorder (None when off)."""
    global recorder
    capacity = _capacity_from_env() if capacity is None else capacity
    old = recorder
    recorder = FlightRecorder(capacity) if capacity > 0 else None
    if recorder is not None and old is not None:
        recorder.groups, recorder.rank, recorder.world_size = old.groups, old.rank, old.world_size
        recorder.retired = old.retired
    return recorder


# The process's recorder, or None when disabled. Hooks read this module attribute on each call.
recorder: FlightRecorder | None = None
configure()

__all__ = ["FlightRecorder", "configure", "recorder", "read_dump", "call_site", "format_site"]
