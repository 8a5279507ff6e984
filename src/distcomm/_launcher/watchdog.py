"""What cleans up after a launcher that cannot: a tiny process that outlives a SIGKILLed launcher.

A launcher killed with SIGKILL runs no code: its workers die with it (PR_SET_PDEATHSIG in the
worker shim), but the processes *they* started do not (the death signal is not inherited), and
its temp dir and the run's shared-memory segments stay. So each launcher starts one watchdog:

- in its own session (a Ctrl-C or a SIGTERM for the launcher's process group does not reach it),
  with SIGINT/SIGTERM/SIGHUP ignored, running a short stdlib-only script (``python -I -S``);
- connected by a pipe it reads, whose write end only the launcher holds. The launcher tells it,
  one line each, which worker sessions exist (``+<pgid>``, ``-<pgid>`` once reaped), which
  directories to remove (``dir <path>``) and which segment names to unlink (``shm <dir>
  <prefix>``);
- at a normal end the launcher writes ``done`` and the watchdog exits doing nothing. At end of
  file without ``done`` (the launcher died, however) it SIGKILLs every worker session still listed
  (each worker is the leader of its own session, so its children are in its process group),
  removes the directories and unlinks the segments.

A process that left its worker's process group on purpose (``setsid``) is out of its reach, as it
is out of torchrun's.
"""

from __future__ import annotations

import subprocess
import sys

_SCRIPT = r"""
import os, shutil, signal, sys, time
for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(s, signal.SIG_IGN)
groups, dirs, shm = set(), [], []
done = False
for line in sys.stdin:
    word, _, rest = line.rstrip("\n").partition(" ")
    if word == "done":
        done = True
        break
    if word.startswith("+"):
        groups.add(int(word[1:]))
    elif word.startswith("-"):
        groups.discard(int(word[1:]))
    elif word == "dir":
        dirs.append(rest)
    elif word == "shm":
        shm.append(rest.split(" ", 1))
if not done:
    for pgid in groups:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except OSError:
            pass
    deadline = time.monotonic() + 5
    for pgid in groups:  # gone before their files are removed (they may still be writing them)
        while time.monotonic() < deadline:
            try:
                os.killpg(pgid, 0)
            except OSError:
                break
            time.sleep(0.02)
    for path in dirs:
        shutil.rmtree(path, ignore_errors=True)
    for directory, prefix in shm:
        try:
            names = os.listdir(directory)
        except OSError:
            continue
        for name in names:
            if name.startswith(prefix):
                try:
                    path = os.path.join(directory, name)
                    if os.lstat(path).st_uid == os.getuid():
                        os.unlink(path)
                except OSError:
                    pass
"""


class Watchdog:
    """The launcher's side of the watchdog (see the module docstring). Every method is a no-op
    once the watchdog could not be started or has been told ``done``."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _SCRIPT],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
                close_fds=True,
            )
        except OSError:
            self._proc = None

    def _say(self, line: str) -> None:
        proc = self._proc
        if proc is None or proc.stdin is None:
            return
        try:
            proc.stdin.write(line.encode() + b"\n")
            proc.stdin.flush()
        except (OSError, ValueError):
            self._proc = None

    def remove_on_death(self, path: str) -> None:
        self._say(f"dir {path}")

    def unlink_on_death(self, directory: str, prefix: str) -> None:
        self._say(f"shm {directory} {prefix}")

    def session_started(self, pgid: int) -> None:
        self._say(f"+{pgid}")

    def session_ended(self, pgid: int) -> None:
        self._say(f"-{pgid}")

    def done(self) -> None:
        """The launcher cleaned up itself: the watchdog exits without doing anything."""
        proc = self._proc
        if proc is None:
            return
        self._say("done")
        self._proc = None
        try:
            proc.stdin.close()
        except OSError:
            pass
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
