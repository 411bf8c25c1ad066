"""Training with uneven inputs: the ``Join`` context manager.

When ranks have different numbers of inputs, the ranks that run out first
would leave the others blocked in collectives that never complete. Inside
``Join``, a rank that has finished its loop keeps *shadowing* the collectives
of the ranks still training (each ``Joinable`` says how, through the main
hook of its ``JoinHook``) until every rank has finished; then post hooks run
once, told whether this rank was among the last to finish.

Ranks find out how many are still training through one all_reduce per
iteration over the joinables' process group: ranks still training add 1
(issued by ``Join.notify_join_context``), finished ranks add 0 (issued by the
context manager). Mirrors ``torch.distributed.algorithms.join``.
"""

from __future__ import annotations

import warnings
from abc import ABC, abstractmethod
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import numpy as np

from .distributed import _get_default_group, all_reduce
from .group.process_group import ProcessGroup
from .group.work import Work

# Shadowed iterations after which a rank warns that the inputs are badly skewed.
_SKEW_WARN_THRESHOLD = 1000


class JoinHook:
    """What a finished rank runs for one ``Joinable``. Both hooks default to
    doing nothing, so a Joinable overrides only the ones it needs."""

    def main_hook(self) -> None:
        """Shadow one iteration of the Joinable's collectives, issuing the
        same collectives (in the same order) as a rank still training."""

    def post_hook(self, is_last_joiner: bool) -> None:
        """Run once after every rank has finished (e.g. to sync final state
        from a rank that saw all iterations: one with ``is_last_joiner``)."""


@dataclass(frozen=True)
class _JoinConfig:
    """How ``notify_join_context`` behaves for one Joinable. Only the first
    Joinable of a Join notifies, so that there is one count per iteration."""

    enable: bool
    throw_on_early_termination: bool
    is_first_joinable: bool


_NOT_JOINING = _JoinConfig(enable=False, throw_on_early_termination=False, is_first_joinable=False)


class Joinable(ABC):
    """An object whose per-iteration collectives a finished rank can shadow.

    Call ``Join.notify_join_context(self)`` once per iteration, before the
    object's own collectives. Outside a ``Join`` that call does nothing.
    """

    # A Join in progress overrides this per instance; the class default keeps
    # notify_join_context a no-op without requiring subclasses to call __init__.
    _join_config: _JoinConfig = _NOT_JOINING

    @abstractmethod
    def join_hook(self, **kwargs: Any) -> JoinHook:
        """The hook for a Join; ``kwargs`` are those given to ``Join``."""

    @property
    @abstractmethod
    def join_device(self) -> Any:
        """The device of the arrays the join collectives use (None: host)."""

    @property
    @abstractmethod
    def join_process_group(self) -> ProcessGroup | None:
        """The group the Joinable's collectives run on (None: the default group)."""


def _group_of(joinable: Joinable) -> ProcessGroup:
    pg = joinable.join_process_group
    if pg is None:
        return _get_default_group()
    if not isinstance(pg, ProcessGroup):
        raise ValueError(f"Join: {type(joinable).__name__}.join_process_group must be a ProcessGroup this rank "
                         f"belongs to, got {pg!r}")
    return pg


def _flag(pg: ProcessGroup, device: Any, value: int) -> Any:
    """A one-element count on the joinables' device, for an all_reduce over ``pg``."""
    return pg.comm_backend.from_host(np.full(1, value, np.int32), device)


def _sum(pg: ProcessGroup, device: Any, value: int) -> int:
    """Sum of ``value`` over the ranks of ``pg`` (a blocking all_reduce)."""
    array = _flag(pg, device, value)
    all_reduce(array, group=pg)
    return int(pg.comm_backend.to_host(array)[0])


class Join:
    """Context manager for uneven inputs across ranks (see the module doc).

    ``joinables`` must share one process group; ``kwargs`` are passed to each
    ``join_hook``. With ``enable=False`` it does nothing (for inputs known to
    be even). With ``throw_on_early_termination=True`` every rank raises
    RuntimeError in the iteration after the first rank finishes, instead of
    shadowing (for collectives that cannot be shadowed).
    """

    def __init__(self, joinables: list[Joinable], enable: bool = True, throw_on_early_termination: bool = False,
                 **kwargs: Any) -> None:
        if not joinables:
            raise ValueError("The join context manager requires at least one joinable")
        self._joinables = list(joinables)
        self._hooks = [j.join_hook(**kwargs) for j in self._joinables]
        self._enable = enable
        self._throw = throw_on_early_termination
        groups = [_group_of(j) for j in self._joinables]
        if any(g is not groups[0] for g in groups):
            raise ValueError("Using join context manager with multiple process groups: all joinables must share "
                             f"one, got {groups}")
        self._pg = groups[0]
        self._device = self._joinables[0].join_device
        self._rank = self._pg.rank()

    def __enter__(self) -> Join:
        for i, joinable in enumerate(self._joinables):
            joinable._join_config = _JoinConfig(self._enable, self._throw, is_first_joinable=i == 0)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        try:
            if self._enable and exc_type is None:  # an error in the body propagates as is: no shadowing
                self._shadow_until_all_joined()
        finally:
            for joinable in self._joinables:
                vars(joinable).pop("_join_config", None)

    def _shadow_until_all_joined(self) -> None:
        is_last_joiner = True
        shadowed = 0
        while _sum(self._pg, self._device, 0) > 0:  # ranks still training
            if self._throw:
                _sum(self._pg, self._device, 1)  # answers the ranks' "should throw?" all_reduce
                raise RuntimeError(f"Rank {self._rank} exhausted all inputs.")
            for hook in self._hooks:
                hook.main_hook()
            is_last_joiner = False
            shadowed += 1
            if shadowed == _SKEW_WARN_THRESHOLD:
                warnings.warn(f"Rank {self._rank} has shadowed {shadowed} iterations of the ranks still "
                              "training: the inputs are very uneven", UserWarning, stacklevel=3)
        for hook in self._hooks:
            hook.post_hook(is_last_joiner)

    @staticmethod
    def notify_join_context(joinable: Joinable) -> Work | None:
        """Tell finished ranks that this rank runs another iteration. Call
        once per iteration before ``joinable``'s own collectives. Returns the
        Work of the count all_reduce (only the first Joinable of an enabled
        Join issues one; None otherwise). With ``throw_on_early_termination``
        raises RuntimeError on every rank once any rank has finished."""
        config = getattr(joinable, "_join_config", _NOT_JOINING)  # duck-typed joinables too
        if not (config.enable and config.is_first_joinable):
            return None
        pg, device = _group_of(joinable), joinable.join_device
        work = all_reduce(_flag(pg, device, 1), group=pg, async_op=True)
        if config.throw_on_early_termination and _sum(pg, device, 0) > 0:
            raise RuntimeError("Detected at least one rank that exhausted inputs. Throwing across all ranks.")
        return work


__all__ = ["Join", "JoinHook", "Joinable"]
