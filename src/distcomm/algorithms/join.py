"""The generic join context manager: training on uneven inputs (torch.distributed.algorithms.join).

A rank that runs out of inputs *joins*: it leaves the training loop and, inside ``Join.__exit__``,
keeps answering the collectives the other ranks still issue, so nobody hangs. The protocol, per
training iteration of a rank that has not joined:

1. The first Joinable calls ``Join.notify_join_context(self)`` before its own collectives: an
   all_reduce of 1 ("I am still training"). A joined rank answers with 0, so the sum is the number
   of ranks still training; both sides of that all_reduce run each iteration.
2. Each Joinable then issues its collectives; each joined rank replays them through its JoinHook's
   ``main_hook()`` (DDP: the gradient all_reduces with zeros; ZeRO: the parameter broadcasts).
3. When every rank has joined (the sum is 0), each rank runs every hook's ``post_hook(is_last_joiner)``.

With ``throw_on_early_termination=True`` a second all_reduce per iteration carries "some rank has
joined": every rank then raises instead of continuing with fewer ranks.

The flags are numpy arrays, so this module needs no torch; the Joinables bring their own tensors.
"""

from __future__ import annotations

import warnings
from abc import ABC, abstractmethod
from typing import Any, NamedTuple

import numpy as np

from .._api.collectives import all_reduce
from .._api.groups import get_rank

__all__ = ["Join", "JoinHook", "Joinable"]

# A joined rank this many iterations behind the others gets a warning (torch's threshold).
_SKEW_WARNING = 1000


class JoinHook:
    """The two entry points a Joinable gives the join context manager.

    ``main_hook()`` runs once per iteration that some other rank is still training, and must issue
    the same collectives that one training iteration of this Joinable issues. ``post_hook()`` runs
    once after every rank has joined. Subclass and override either; the defaults do nothing.
    """

    def main_hook(self) -> None:
        """Shadow one training iteration's collectives (forward, backward, optimizer step)."""

    def post_hook(self, is_last_joiner: bool) -> None:
        """Called once all ranks have joined; ``is_last_joiner`` is True on the ranks that joined last."""


class _JoinConfig(NamedTuple):
    enable: bool
    throw_on_early_termination: bool
    is_first_joinable: bool

    @staticmethod
    def disabled() -> "_JoinConfig":
        return _JoinConfig(enable=False, throw_on_early_termination=False, is_first_joinable=False)


class Joinable(ABC):
    """Base class of what can take part in a Join: implement ``join_hook``, ``join_device`` and
    ``join_process_group``, and call ``Joinable.__init__(self)`` from the constructor."""

    @abstractmethod
    def __init__(self) -> None:
        super().__init__()
        self._join_config = _JoinConfig.disabled()

    @abstractmethod
    def join_hook(self, **kwargs) -> JoinHook:
        """The JoinHook for this Joinable; every Joinable of one Join gets the same ``kwargs``."""

    @property
    @abstractmethod
    def join_device(self) -> Any:
        """The device the join context manager's own collectives use (CPU here)."""

    @property
    @abstractmethod
    def join_process_group(self) -> Any:
        """The process group of the join context manager's own collectives."""


def _flag(value: float) -> np.ndarray:
    return np.full(1, value, dtype=np.float32)


class Join:
    """Context manager that lets ranks with fewer inputs join early without hanging the others.

    ``joinables``: the participating Joinables; their hooks run in this order, and the first one
    carries the per-iteration "not joined yet" all_reduce. All must use the same process group.
    ``enable=False`` turns the manager off (inputs known to be even). With
    ``throw_on_early_termination=True`` every rank raises RuntimeError as soon as one rank has
    exhausted its inputs. Extra keyword arguments go to every ``join_hook(**kwargs)``.

    Example (each rank)::

        model = DistributedDataParallel(torch.nn.Linear(1, 1))
        optim = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=0.01)
        inputs = [torch.tensor([1.0]) for _ in range(10 + rank)]  # rank 1 has one more
        with Join([model, optim]):
            for inp in inputs:
                model(inp).sum().backward()
                optim.step()
        # every rank gets here
    """

    def __init__(self, joinables: list, enable: bool = True, throw_on_early_termination: bool = False, **kwargs):
        if len(joinables) == 0:
            raise ValueError("The join context manager requires at least one joinable")
        self._joinables = list(joinables)
        self._join_hooks = [j.join_hook(**kwargs) for j in self._joinables]
        self._enable = enable
        self._throw_on_early_termination = throw_on_early_termination
        for i, joinable in enumerate(self._joinables):
            joinable._join_config = _JoinConfig(enable, throw_on_early_termination, is_first_joinable=i == 0)
        self._process_group = self._common_process_group()
        self._rank = get_rank(self._process_group)

    def _common_process_group(self):
        group = self._joinables[0].join_process_group
        for joinable in self._joinables[1:]:
            if joinable.join_process_group is not group:
                raise ValueError("Using join context manager with multiple process groups")
        return group

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        """Answer the other ranks' iterations until every rank has joined, then run the post-hooks."""
        if not self._enable or exc_type is not None:
            return None  # an exception in the loop propagates as it is
        is_last_joiner = True
        behind = 0
        while self._num_nonjoined() > 0:
            if behind == _SKEW_WARNING:
                warnings.warn(
                    f"Detected uneven input skew of greater than {_SKEW_WARNING}. This means that rank "
                    f"{self._rank} has at least {_SKEW_WARNING} fewer inputs than other currently-active "
                    "ranks. This level of skew could lead to performance degradation during training.",
                    stacklevel=2,
                )
            if self._throw_on_early_termination:
                self._notify_procs_to_terminate()
            for hook in self._join_hooks:
                hook.main_hook()
            is_last_joiner = False
            behind += 1
        for hook in self._join_hooks:
            hook.post_hook(is_last_joiner)
        return None

    def _num_nonjoined(self) -> int:
        # Matches the all_reduce(1) of notify_join_context on ranks still training.
        flag = _flag(0)
        all_reduce(flag, group=self._process_group)
        return int(flag[0])

    def _notify_procs_to_terminate(self) -> None:
        # Matches the throw check of notify_join_context on ranks still training.
        all_reduce(_flag(1), group=self._process_group)
        raise RuntimeError(f"Rank {self._rank} exhausted all inputs.")

    @staticmethod
    def notify_join_context(joinable: Joinable):
        """Tell the join context manager that this rank has not joined; call it from a Joinable
        before its per-iteration collectives.

        Only the first Joinable of the Join communicates: an all_reduce, returned as an async Work
        (``work.result()[0]`` is then the number of ranks still training). For the others, and
        outside a Join, this returns None. With ``throw_on_early_termination``, raises
        RuntimeError on every rank once some rank has joined.
        """
        config = getattr(joinable, "_join_config", None)
        if config is None:
            raise AssertionError(f"Check that the {type(joinable)} constructor calls the ``Joinable`` constructor")
        if not config.is_first_joinable or not config.enable:
            return None
        group = joinable.join_process_group
        ones = _flag(1)
        work = all_reduce(ones, group=group, async_op=True)
        if config.throw_on_early_termination:
            someone_joined = _flag(0)
            all_reduce(someone_joined, group=group)
            if someone_joined[0]:
                raise RuntimeError("Detected at least one rank that exhausted inputs. Throwing across all ranks.")
        return work
