"""pytest fixtures over ``nccl_pg.testing``, registered through the
``pytest11`` entry point: any project with nccl_pg installed can use them.

The harness modules are imported inside the fixtures, not here (and the
package ``nccl_pg.testing`` imports them only when a name is used): pytest
loads plugins before coverage starts, and an import here would hide
nccl_pg's module-level lines from coverage in every project that has it
installed.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from .processes import ProcessRanks


@pytest.fixture
def thread_ranks() -> Iterator[Callable[..., list[Any]]]:
    """``thread_ranks(fn, world_size=4, backend="host", timeout=60, args=())``
    runs ``fn(rank, world_size, *args)`` on thread ranks and returns the
    results in rank order (``nccl_pg.testing.run_threads``). A rank thread
    the harness could not stop (stuck outside any collective) is reported
    at teardown, as a warning, since it keeps running in the background."""
    from .threads import run_threads

    before = set(threading.enumerate())
    yield run_threads
    left = [t.name for t in threading.enumerate()
            if t not in before and t.name.startswith("nccl_pg-rank-") and t.is_alive()]
    if left:
        warnings.warn(f"thread ranks still running after the test: {left}", ResourceWarning, stacklevel=1)


class ProcessRanksFixture:
    """What the ``process_ranks`` fixture gives: call it to run ranks to
    completion, or ``start()`` them to act on them first (signal a rank by
    its pid, then ``join()``). Ranks still running at teardown are killed."""

    def __init__(self) -> None:
        self._started: list[ProcessRanks] = []

    def start(self, fn: Callable[..., Any], world_size: int, backend: str = "host", timeout: float | None = None,
              args: Sequence[Any] = ()) -> ProcessRanks:
        from .failures import DEFAULT_TIMEOUT
        from .processes import ProcessRanks

        ranks = ProcessRanks(fn, world_size, backend, DEFAULT_TIMEOUT if timeout is None else timeout, args)
        self._started.append(ranks)
        return ranks

    def __call__(self, fn: Callable[..., Any], world_size: int, backend: str = "host", timeout: float | None = None,
                 args: Sequence[Any] = ()) -> list[Any]:
        """``nccl_pg.testing.run_ranks``: the results in rank order."""
        return self.start(fn, world_size, backend, timeout, args).join()

    def close(self) -> None:
        for ranks in self._started:
            ranks.close()


@pytest.fixture
def process_ranks() -> Iterator[ProcessRanksFixture]:
    """Ranks as processes (``fn`` must be a module-level function): see
    ProcessRanksFixture."""
    fixture = ProcessRanksFixture()
    try:
        yield fixture
    finally:
        fixture.close()
