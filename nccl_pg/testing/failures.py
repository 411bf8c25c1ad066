"""What the rank harnesses share: the deadlines, the error that names
failing ranks, the report of each rank's traceback, and the release of a
world's groups."""

from __future__ import annotations

import sys
import traceback
import unittest
from collections.abc import Sequence

from ..distributed.world import World
from ..errors import Culprit, DistBackendError
from ..group.process_group import ProcessGroup

#: A test's deadline, by default (seconds, the whole run).
DEFAULT_TIMEOUT = 60.0
# The share of the deadline an operation may take by default: the rest is left to the timeout's diagnosis
# (at most a few seconds), to the other ranks' unwinding, and to the culprit's stack.
OP_TIMEOUT_SHARE = 0.5


def default_op_timeout(timeout: float) -> float:
    """Each collective's timeout (the group's) for a test with deadline ``timeout``."""
    return timeout * OP_TIMEOUT_SHARE


class RanksFailed(RuntimeError):
    """One or more ranks failed or did not finish in time.

    ``ranks`` are the ones the message blames (``culprits`` says why, with
    host, pid and, where known, the source line each was at): those that
    failed on their own (not with a communication error after another rank
    had failed), those a diagnosed timeout named (the ranks that never
    issued the operation, not the ones that timed out waiting for them),
    and otherwise those still running when the harness gave up on them.
    ``failures`` maps every rank that did not succeed to its report
    (traceback, exit code, or stack when stuck, and its last output).
    ``dump_dir``: where the ranks' output and debug dumps are (process
    ranks)."""

    def __init__(self, message: str, ranks: Sequence[int], failures: dict[int, str],
                 culprits: Sequence[Culprit] = (), dump_dir: str | None = None) -> None:
        super().__init__(message)
        self.ranks = sorted(set(ranks))
        self.failures = failures
        self.culprits = list(culprits)
        self.dump_dir = dump_dir


def is_skip(exc: BaseException) -> bool:
    """``unittest.SkipTest``, or pytest's skip outcome (``pytest.skip()``,
    ``pytest.importorskip``) without importing pytest."""
    skipped = getattr(sys.modules.get("_pytest.outcomes"), "Skipped", None)  # loaded only under pytest
    return isinstance(exc, unittest.SkipTest) or (skipped is not None and isinstance(exc, skipped))


def culprits_of(exc: BaseException) -> tuple[Culprit, ...]:
    """The culprits a diagnosed timeout named, anywhere in ``exc``'s chain."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, DistBackendError) and e.culprits:
            return e.culprits
        todo += [e.__cause__, e.__context__]
    return ()


def report(failures: dict[int, str], first: Sequence[int] = ()) -> str:
    """Each rank's report; the ``first`` ranks (those to blame) lead."""
    order = sorted(failures, key=lambda r: (r not in first, r))
    return "\n".join(f"--- rank {r} ---\n{failures[r].rstrip()}" for r in order)


def traceback_of(exc: BaseException) -> str:
    """The traceback without the harness's frame that called the rank's code."""
    tb = exc.__traceback__
    return "".join(traceback.format_exception(type(exc), exc, tb.tb_next if tb is not None else None))


def abort_groups(worlds: Sequence[World], aborted: set[ProcessGroup]) -> None:
    """Abort every group of these ranks not in ``aborted`` (and add it),
    parents first: a lazy subgroup may be splitting its parent's communicator."""
    for world in worlds:
        for pg in sorted(list(world.groups), key=lambda g: g.uid):
            if pg not in aborted:
                pg.abort()
                aborted.add(pg)
