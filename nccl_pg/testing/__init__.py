"""A harness for distributed tests, for this project's suite and for users'.

Ranks run either as threads of the calling process (fast, one address space:
``spawn_threads_and_init_comms``, ``run_threads``, ``MultiThreadedTestCase``)
or as real processes (isolation, crashes and exit codes: ``run_ranks``,
``ProcessRanks``). Either way each rank has an initialized default group
while the test code runs, and the group is destroyed afterwards.

Every wait here is bounded. Each collective's timeout is shorter than the
test's deadline, so that a hang is diagnosed before the deadline: the error
(``RanksFailed``) blames the culprits (a rank that failed on its own, or
that a timed-out collective's diagnosis named), not the ranks that timed
out waiting for them, and says where each culprit is in its code. A rank
that raises makes the harness release the others (abort their groups and
fail their rendezvous waits; processes that do not then exit are killed);
a rank still running at the timeout is reported with its stack, and killed
for processes (with every process it started). A thread stuck outside any
collective cannot be stopped: it is reported and left running (daemon).
docs/TESTING.md tells it all.

The modules: ``threads`` (thread ranks), ``processes`` (process ranks) with
``rank_main`` (a rank process's side), ``devices`` (GPUs per rank and per
pytest-xdist worker), ``verdict`` (who is to blame, and where: by the
library's ``diagnostics.frames`` and C-level ``diagnostics.stacks``; a rank's
process tree by ``nccl_pg.process_tree``), ``warm`` (a set of ranks kept across tests), ``failures``
(``RanksFailed`` and what all report), ``ci_report`` (JUnit properties,
GitHub annotations), ``null_backend``, and ``pytest_plugin`` (the fixtures,
the ``ranks`` marker, registered through the ``pytest11`` entry point). The
names below are imported from them on first use, so that loading the pytest
plugin imports no harness code (see pytest_plugin.py).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .failures import DEFAULT_TIMEOUT, RanksFailed
    from .null_backend import register_null_backend
    from .processes import ProcessRanks, run_ranks
    from .threads import MultiThreadedTestCase, run_threads, spawn_threads_and_init_comms
    from .warm import WarmRanks

_HOME = {
    "DEFAULT_TIMEOUT": "failures",
    "RanksFailed": "failures",
    "register_null_backend": "null_backend",
    "ProcessRanks": "processes",
    "run_ranks": "processes",
    "MultiThreadedTestCase": "threads",
    "run_threads": "threads",
    "spawn_threads_and_init_comms": "threads",
    "WarmRanks": "warm",
}

__all__ = [
    "DEFAULT_TIMEOUT",
    "MultiThreadedTestCase",
    "ProcessRanks",
    "RanksFailed",
    "WarmRanks",
    "register_null_backend",
    "run_ranks",
    "run_threads",
    "spawn_threads_and_init_comms",
]


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_HOME[name]}", __name__), name)
