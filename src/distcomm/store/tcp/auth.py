"""Where a TCPStore's authentication key comes from, and the error every authentication problem raises.

Why the store, and why a shared key: everything a job trusts is found through its store — the
peer-to-peer transport's session token, the shared-memory segments' names, the addresses object
collectives unpickle from — so a process that can talk to the store can join the job. With a key,
the store's server and each client prove to each other that they hold it (handshake.py: a mutual
HMAC-SHA256 challenge-response over fresh nonces; the key never crosses the wire), and so
authenticating the store's clients authenticates the job.

The key is opt-in and comes from the environment, so that everything that makes a TCPStore gets it
without new arguments (TCPStore, env:// and tcp:// rendezvous, distcomm-run, whose workers inherit
its environment):

* ``DISTCOMM_AUTH_KEY_FILE``: a file holding the key (trailing whitespace ignored). Preferred: a
  process's environment can be read through /proc by its owner and by root, a 0600 file only by its
  owner. The file must not be accessible to group or others (``chmod 600``), or it is refused.
* ``DISTCOMM_AUTH_KEY``: the key itself.

Setting both is an error (which one wins would be a guess). A set but empty variable is an error,
not "no authentication": someone who set it meant to be protected. Generate a key with
``python -c "import secrets; print(secrets.token_hex(32))" > key && chmod 600 key``; a short or
guessable key can be brute-forced offline by anyone who can pose as the store to a client.

What it does not do: encrypt. Authenticated connections carry the store's keys and values in the
clear, and someone who can intercept and rewrite traffic on the path between two hosts can take
over a connection after its handshake. Run multi-host jobs on a network you trust for that.
"""

from __future__ import annotations

import os
import stat

from ...errors import DistStoreAuthError  # noqa: F401 - re-exported: the store modules raise it from here

AUTH_KEY_ENV = "DISTCOMM_AUTH_KEY"
AUTH_KEY_FILE_ENV = "DISTCOMM_AUTH_KEY_FILE"
MAX_KEY_FILE_SIZE = 4096  # far more than any key needs; checked before reading


def key_from_environment(environ=None) -> bytes | None:
    """The job's authentication key from DISTCOMM_AUTH_KEY_FILE or DISTCOMM_AUTH_KEY; None if neither is set."""
    environ = os.environ if environ is None else environ
    path = environ.get(AUTH_KEY_FILE_ENV)
    value = environ.get(AUTH_KEY_ENV)
    if path is None and value is None:
        return None
    if path is not None and value is not None:
        raise DistStoreAuthError(
            f"both {AUTH_KEY_FILE_ENV} and {AUTH_KEY_ENV} are set; set only one (preferably {AUTH_KEY_FILE_ENV}: "
            f"a process's environment is readable through /proc)"
        )
    if path is not None:
        return read_key_file(path)
    if not value:
        raise DistStoreAuthError(
            f"{AUTH_KEY_ENV} is set but empty; set it to the job's key (or unset it to run without authentication)"
        )
    return value.encode("utf-8")


def read_key_file(path: str) -> bytes:
    """The key in ``path``: a regular file private to its owner, at most MAX_KEY_FILE_SIZE bytes."""
    if not path:
        raise DistStoreAuthError(
            f"{AUTH_KEY_FILE_ENV} is set but empty; set it to the path of the job's key file (or unset it)"
        )
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise DistStoreAuthError(f"{AUTH_KEY_FILE_ENV}={path}: cannot open the key file: {exc.strerror}") from None
    try:
        info = os.fstat(fd)  # of what was opened, not of what the path names a moment later
        if not stat.S_ISREG(info.st_mode):
            raise DistStoreAuthError(f"{AUTH_KEY_FILE_ENV}={path} is not a regular file")
        if info.st_mode & 0o077:
            raise DistStoreAuthError(
                f"{AUTH_KEY_FILE_ENV}={path} is accessible by group or others (mode "
                f"{stat.S_IMODE(info.st_mode):04o}); the key must be private to its owner: run chmod 600 {path}"
            )
        if info.st_size > MAX_KEY_FILE_SIZE:
            raise DistStoreAuthError(
                f"{AUTH_KEY_FILE_ENV}={path} is {info.st_size} bytes; a key file holds at most {MAX_KEY_FILE_SIZE}"
            )
        data = os.read(fd, MAX_KEY_FILE_SIZE + 1)
    finally:
        os.close(fd)
    key = data.strip()
    if not key or len(data) > MAX_KEY_FILE_SIZE:
        what = "is empty" if not key else f"holds more than {MAX_KEY_FILE_SIZE} bytes"
        raise DistStoreAuthError(f"{AUTH_KEY_FILE_ENV}={path} {what}; write the job's key into it")
    return key
