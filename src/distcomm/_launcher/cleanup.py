"""Hook point: clean up what a round's workers left behind, once all of them are gone.

The launcher calls ``run_cleanup_hooks(run_id, attempt)`` after every round's workers have exited
or been killed: on success, on failure, before a restart, and when the launcher itself is
signalled (SIGINT/SIGTERM/SIGHUP/SIGQUIT). Workers killed by SIGKILL cannot unlink their own
shared-memory segments; this is where the launcher does it for them. (The shared-memory
transport's segments are unnamed files where the filesystem allows, which no death leaves behind;
the hook is for the named ones of filesystems without ``O_TMPFILE``.)

The shared-memory transport's hook is ``distcomm.transport.shm_segment:cleanup`` (listed in
``HOOK_SPECS``). The contract it follows:

- every named segment is named so that the run can be recognised: ``distcomm-<run_id>-<attempt>-...``
  (each worker finds the run id in TORCHELASTIC_RUN_ID and the attempt in
  TORCHELASTIC_RESTART_COUNT);
- ``cleanup(run_id: str, attempt: int) -> None`` unlinks the segments of that run and attempt.

Another hook is added by listing ``"module.path:function"`` in ``HOOK_SPECS`` below, or by calling
``register_cleanup_hook`` from code that the launcher imports.

Users (and tests) can add hooks without code: ``DISTCOMM_RUN_CLEANUP_HOOKS="pkg.mod:fn,other:fn"``
in the launcher's environment.

Hooks must be quick and must not raise; an exception is reported as a one-line warning and the
other hooks still run.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Callable

CleanupHook = Callable[[str, int], None]

# "module:function" entries imported lazily the first time hooks run (missing modules are skipped).
HOOK_SPECS: tuple[str, ...] = ("distcomm.transport.shm_segment:cleanup",)

_hooks: list[CleanupHook] = []
_specs_loaded = False


def register_cleanup_hook(hook: CleanupHook) -> CleanupHook:
    """Run ``hook(run_id, attempt)`` after each round's workers are gone. Usable as a decorator."""
    if hook not in _hooks:
        _hooks.append(hook)
    return hook


def _load_specs() -> None:
    global _specs_loaded
    if _specs_loaded:
        return
    _specs_loaded = True
    from_env = [s.strip() for s in os.environ.get("DISTCOMM_RUN_CLEANUP_HOOKS", "").split(",") if s.strip()]
    for spec in (*HOOK_SPECS, *from_env):
        module, _, name = spec.partition(":")
        try:
            register_cleanup_hook(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError) as exc:
            if spec in from_env:  # a user's typo deserves a word; built-in ones may be absent
                print(f"distcomm-run: cleanup hook {spec!r} not loaded: {exc}", file=sys.stderr)


def run_cleanup_hooks(run_id: str, attempt: int) -> None:
    _load_specs()
    for hook in list(_hooks):
        try:
            hook(run_id, attempt)
        except Exception as exc:  # noqa: BLE001 - a cleanup problem must not hide the job's result
            print(f"distcomm-run: cleanup hook {hook!r} failed: {exc}", file=sys.stderr)
