"""What the rank harnesses share: the error that names failing ranks, the
report of each rank's traceback, and the release of a world's groups."""

from __future__ import annotations

import sys
import traceback
import unittest
from collections.abc import Sequence

from ..distributed import _World
from ..group.process_group import ProcessGroup

DEFAULT_TIMEOUT = 60.0


class RanksFailed(RuntimeError):
    """One or more ranks failed or did not finish in time.

    ``ranks`` are the ones the message blames: those that failed on their
    own (not with a communication error after another rank had failed), and
    those still running when the harness gave up on them. ``failures`` maps
    every rank that did not succeed to its report (traceback, exit code, or
    stack when stuck)."""

    def __init__(self, message: str, ranks: Sequence[int], failures: dict[int, str]) -> None:
        super().__init__(message)
        self.ranks = sorted(ranks)
        self.failures = failures


def is_skip(exc: BaseException) -> bool:
    """``unittest.SkipTest``, or pytest's skip outcome (``pytest.skip()``,
    ``pytest.importorskip``) without importing pytest."""
    skipped = getattr(sys.modules.get("_pytest.outcomes"), "Skipped", None)  # loaded only under pytest
    return isinstance(exc, unittest.SkipTest) or (skipped is not None and isinstance(exc, skipped))


def report(failures: dict[int, str], first: Sequence[int] = ()) -> str:
    """Each rank's report; the ``first`` ranks (those to blame) lead."""
    order = sorted(failures, key=lambda r: (r not in first, r))
    return "\n".join(f"--- rank {r} ---\n{failures[r].rstrip()}" for r in order)


def traceback_of(exc: BaseException) -> str:
    """The traceback without the harness's frame that called the rank's code."""
    tb = exc.__traceback__
    return "".join(traceback.format_exception(type(exc), exc, tb.tb_next if tb is not None else None))


def abort_groups(worlds: Sequence[_World], aborted: set[ProcessGroup]) -> None:
    """Abort every group of these ranks not in ``aborted`` (and add it),
    parents first: a lazy subgroup may be splitting its parent's communicator."""
    for world in worlds:
        for pg in sorted(list(world.groups), key=lambda g: g.uid):
            if pg not in aborted:
                pg.abort()
                aborted.add(pg)
