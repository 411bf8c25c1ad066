"""A warm set of rank processes: started and given a default group once,
then running one test function after another (``WarmRanks.run``), so that
a suite of small distributed tests pays the start-up (interpreter, imports,
rendezvous, communicator) once per set rather than once per test.

Isolation between the tests that share a set (docs/TESTING.md):
- each run gets its own dump directory, its output is reported on its own,
  and the processes a run started are ended when it ends;
- the default group persists (its sequence numbers go on), and so does
  every module's state in the rank processes, and their environment;
  groups a run created are destroyed after it;
- a run that fails, skips or times out ends the set: the next run on it
  raises, and the pytest fixture starts a fresh set for the next test.
"""

from __future__ import annotations

import os
import time
import unittest
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from . import verdict
from .failures import DEFAULT_TIMEOUT
from .processes import RankProcesses

# How long the ranks get to leave cleanly (destroy their group) when the set is closed.
_STOP_GRACE = 10.0


def _up(rank: int, world_size: int) -> None:
    """The first job: the set is up once every rank has its default group."""


class WarmRanks:
    """``world_size`` rank processes kept with an initialized default group.
    ``run(fn, args)`` calls ``fn(rank, world_size, *args)`` on each and
    returns the results in rank order, raising RanksFailed (or skipping) as
    ``run_ranks`` does. ``op_timeout`` is every collective's timeout, for
    the set's life; ``start_timeout`` bounds the start. The other options
    are ``ProcessRanks``'."""

    def __init__(self, world_size: int, backend: str = "host", *, op_timeout: float | None = None,
                 start_timeout: float = DEFAULT_TIMEOUT, gpus: int | None = None,
                 devices: Sequence[str] | None = None, dump_dir: str | os.PathLike[str] | None = None,
                 env: Mapping[str, str] | None = None) -> None:
        self.world_size, self.backend = world_size, backend
        self._ranks = RankProcesses(world_size, backend, start_timeout, op_timeout, gpus, devices, dump_dir, env,
                                    warm=True)
        self.op_timeout, self.dump_dir = self._ranks.op_timeout, self._ranks.dump_dir
        self.broken: str | None = None  # why the set can run nothing more
        self.runs = 0
        self._call(_up, (), start_timeout, self.dump_dir)

    @property
    def pids(self) -> list[int]:
        return self._ranks.pids

    def run(self, fn: Callable[..., Any], args: Sequence[Any] = (), timeout: float = DEFAULT_TIMEOUT,
            dump_dir: str | os.PathLike[str] | None = None, echo: bool = True) -> list[Any]:
        """Run ``fn`` on every rank (``timeout``: this run's deadline;
        ``dump_dir``: this run's dumps, by default the set's)."""
        __tracebackhide__ = True
        if self.broken is not None:
            raise RuntimeError(f"this warm set of ranks can run nothing more: {self.broken}")
        folder = self.dump_dir if dump_dir is None else os.fspath(dump_dir)
        os.makedirs(folder, exist_ok=True)
        self.runs += 1
        return self._call(fn, args, timeout, folder, echo)

    def _call(self, fn: Callable[..., Any], args: Sequence[Any], timeout: float, folder: str,
              echo: bool = True) -> list[Any]:
        __tracebackhide__ = True
        self._ranks.send(fn, args, folder)
        try:
            outcome = self._ranks.gather(time.monotonic() + timeout, until_exit=False, timeout=timeout,
                                         dump_dir=folder)
        except BaseException:
            self.broken = "interrupted during a run"
            self.close()
            raise
        if echo:
            verdict.echo(outcome)
        result = verdict.judge(outcome)
        if isinstance(result, list):
            return result
        self.broken = "a run skipped" if isinstance(result, unittest.SkipTest) else "a run failed"
        self.close()
        raise result

    def close(self) -> None:
        """Let the ranks destroy their group and leave (bounded), then kill
        whatever remains."""
        clean = self.broken is None
        if clean:
            self.broken = "closed"
            self._ranks.stop(time.monotonic() + _STOP_GRACE)
        self._ranks.close()
        if clean:
            self._ranks.remove_dump_dir()  # a directory of its own only; a failed set's stays to be read

    def __enter__(self) -> WarmRanks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
