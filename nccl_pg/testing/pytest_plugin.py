"""pytest fixtures, a marker and reports over ``nccl_pg.testing``,
registered through the ``pytest11`` entry point: any project with nccl_pg
installed can use them (docs/TESTING.md).

- ``@pytest.mark.ranks(world_size, gpus=0, backend="host")``: what a test
  needs. A test needing more GPUs than this machine (or this pytest-xdist
  worker's share) skips, saying so; the fixtures below take their defaults
  from it.
- ``process_ranks``, ``thread_ranks``, ``warm_ranks``: ranks as processes,
  as threads, or as a warm set of processes kept across tests.
- A test that fails with ``RanksFailed`` (or a diagnosed ``DistBackendError``)
  gets the verdict in its report's ``user_properties`` (JUnit XML
  properties ``nccl_pg.verdict``, ``nccl_pg.culprits``), and, on GitHub
  Actions (``GITHUB_ACTIONS=true``), an error annotation at each culprit's
  source line.

The harness modules are imported inside the fixtures and hooks, not here
(and the package ``nccl_pg.testing`` imports them only when a name is
used): pytest loads plugins before coverage starts, and an import here would
hide nccl_pg's module-level lines from coverage in every project that has
it installed.
"""

from __future__ import annotations

import os
import threading
import unittest
import warnings
from collections.abc import Callable, Generator, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from .processes import ProcessRanks
    from .warm import WarmRanks

MARKER = "ranks"
# What the harness leaves of the test's own deadline (pytest-timeout's) for reporting a failure.
DEADLINE_MARGIN = 0.1
DEADLINE_MARGIN_MIN = 3.0


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("GITHUB_ACTIONS") == "true" and not hasattr(config, "workerinput"):  # not on xdist's workers
        config.pluginmanager.register(GitHubAnnotations(config), "nccl_pg-github-annotations")
    config.addinivalue_line(
        "markers", f"{MARKER}(world_size, gpus=0, backend='host'): the ranks a distributed test runs on (nccl_pg's "
        "process_ranks, thread_ranks and warm_ranks fixtures take their defaults from it); skips the test, saying "
        "so, where fewer GPUs are available")


def _spec(node: pytest.Item | None) -> dict[str, Any]:
    marker = node.get_closest_marker(MARKER) if node is not None else None
    if marker is None:
        return {}
    spec = dict(zip(("world_size", "gpus", "backend"), marker.args, strict=False))
    unknown = set(marker.kwargs) - {"world_size", "gpus", "backend"}
    if unknown:
        raise pytest.UsageError(f"@pytest.mark.{MARKER}: unknown arguments {sorted(unknown)}")
    return {**spec, **marker.kwargs}


def pytest_runtest_setup(item: pytest.Item) -> None:
    spec = _spec(item)
    gpus = spec.get("gpus")
    if gpus is None and spec.get("backend") == "nccl":
        gpus = spec.get("world_size")  # one per rank, as ProcessRanks defaults to
    if gpus:
        from . import devices

        try:
            devices.require(gpus, devices.available())
        except unittest.SkipTest as skip:
            pytest.skip(str(skip))


def _deadline(item: pytest.Item) -> float | None:
    """The test's own deadline (pytest-timeout's marker, option or ini value), if any."""
    marker = item.get_closest_marker("timeout")
    value: Any = None
    if marker is not None:
        value = marker.args[0] if marker.args else marker.kwargs.get("timeout")
    if value is None:
        try:
            value = item.config.getoption("timeout", None) or item.config.getini("timeout")
        except ValueError:  # pytest-timeout is not installed
            return None
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        return None
    return seconds if seconds > 0 else None


def harness_timeout(item: pytest.Item | None) -> float:
    """The harness's deadline in a test: a little less than the test's own,
    so that the harness reports (culprits, stacks, output) before
    pytest-timeout kills the test; else ``DEFAULT_TIMEOUT``."""
    from .failures import DEFAULT_TIMEOUT

    deadline = _deadline(item) if item is not None else None
    if deadline is None:
        return DEFAULT_TIMEOUT
    return max(deadline - max(DEADLINE_MARGIN * deadline, DEADLINE_MARGIN_MIN), deadline / 2)


class _Dirs:
    """A dump directory per harness run in a test: ``<tmp_path>/ranks``, ``ranks-2``, ..."""

    def __init__(self, tmp_path: Path) -> None:
        self._base, self._n = tmp_path, 0

    def next(self) -> str:
        self._n += 1
        path = self._base / ("ranks" if self._n == 1 else f"ranks-{self._n}")
        path.mkdir(parents=True, exist_ok=True)
        return str(path)


@pytest.fixture
def thread_ranks(request: pytest.FixtureRequest) -> Iterator[Callable[..., list[Any]]]:
    """``thread_ranks(fn, world_size=None, backend=None, timeout=None,
    args=(), op_timeout=None)`` runs ``fn(rank, world_size, *args)`` on
    thread ranks and returns the results in rank order
    (``nccl_pg.testing.run_threads``; defaults from the ``ranks`` marker,
    then 4 ranks on "host", within the test's deadline). A rank thread the
    harness could not stop (stuck outside any collective) is reported at
    teardown, as a warning, since it keeps running in the background."""
    from .threads import run_threads

    spec = _spec(request.node)

    def run(fn: Callable[..., Any], world_size: int | None = None, backend: str | None = None,
            timeout: float | None = None, args: Sequence[Any] = (), op_timeout: float | None = None) -> list[Any]:
        return run_threads(fn, world_size or spec.get("world_size", 4), backend or spec.get("backend", "host"),
                           harness_timeout(request.node) if timeout is None else timeout, args, op_timeout)

    before = set(threading.enumerate())
    yield run
    left = [t.name for t in threading.enumerate()
            if t not in before and t.name.startswith("nccl_pg-rank-") and t.is_alive()]
    if left:
        warnings.warn(f"thread ranks still running after the test: {left}", ResourceWarning, stacklevel=1)


class ProcessRanksFixture:
    """What the ``process_ranks`` fixture gives: call it to run ranks to
    completion, or ``start()`` them to act on them first (signal a rank by
    its pid, then ``join()``). Unset arguments come from the test's
    ``ranks`` marker; the deadline is a little less than the test's own
    (pytest-timeout's); each run's output and dumps go to a directory of the
    test's ``tmp_path``. Ranks still running at teardown are killed."""

    def __init__(self, node: pytest.Item | None = None, dirs: _Dirs | None = None) -> None:
        self._started: list[ProcessRanks] = []
        self._node, self._dirs = node, dirs
        self._spec = _spec(node)

    def start(self, fn: Callable[..., Any], world_size: int | None = None, backend: str | None = None,
              timeout: float | None = None, args: Sequence[Any] = (), **options: Any) -> ProcessRanks:
        """``ProcessRanks(fn, ...)``; ``options`` are its keyword arguments."""
        from .processes import ProcessRanks

        if self._dirs is not None and "dump_dir" not in options:
            options["dump_dir"] = self._dirs.next()
        if "gpus" not in options and "gpus" in self._spec:
            options["gpus"] = self._spec["gpus"]
        size = world_size or self._spec.get("world_size")
        if size is None:
            raise TypeError("process_ranks: give world_size, or mark the test with @pytest.mark.ranks(world_size)")
        ranks = ProcessRanks(fn, size, backend or self._spec.get("backend", "host"),
                             harness_timeout(self._node) if timeout is None else timeout, args, **options)
        self._started.append(ranks)
        return ranks

    def __call__(self, fn: Callable[..., Any], world_size: int | None = None, backend: str | None = None,
                 timeout: float | None = None, args: Sequence[Any] = (), **options: Any) -> list[Any]:
        """``nccl_pg.testing.run_ranks``: the results in rank order."""
        __tracebackhide__ = True
        return self.start(fn, world_size, backend, timeout, args, **options).join()

    def close(self) -> None:
        for ranks in self._started:
            ranks.close()


@pytest.fixture
def process_ranks(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ProcessRanksFixture]:
    """Ranks as processes (``fn`` must be a module-level function): see
    ProcessRanksFixture."""
    fixture = ProcessRanksFixture(request.node, _Dirs(tmp_path))
    try:
        yield fixture
    finally:
        fixture.close()


class WarmPool:
    """Warm sets of ranks for a session, one per (world size, backend, GPUs,
    operation timeout); a set that failed is replaced at its next use."""

    def __init__(self) -> None:
        self._sets: dict[tuple[Any, ...], WarmRanks] = {}

    def get(self, world_size: int, backend: str, gpus: int | None, op_timeout: float | None) -> WarmRanks:
        from .warm import WarmRanks

        key = (world_size, backend, gpus, op_timeout)
        ranks = self._sets.get(key)
        if ranks is None or ranks.broken is not None:
            ranks = self._sets[key] = WarmRanks(world_size, backend, gpus=gpus, op_timeout=op_timeout)
        return ranks

    def close(self) -> None:
        for ranks in self._sets.values():
            ranks.close()


@pytest.fixture(scope="session")
def nccl_pg_warm_pool() -> Iterator[WarmPool]:
    """The session's warm sets of ranks (see ``warm_ranks``)."""
    pool = WarmPool()
    try:
        yield pool
    finally:
        pool.close()


@pytest.fixture
def warm_ranks(request: pytest.FixtureRequest, tmp_path: Path,
               nccl_pg_warm_pool: WarmPool) -> Callable[..., list[Any]]:
    """``warm_ranks(fn, world_size=None, args=(), timeout=None, backend=None,
    op_timeout=None)``: ``fn(rank, world_size, *args)`` on a warm set of
    rank processes kept for the session (``nccl_pg.testing.WarmRanks``;
    isolation rules in docs/TESTING.md); the results in rank order.
    Defaults come from the ``ranks`` marker; the dumps go to the test's
    ``tmp_path``."""
    spec, dirs = _spec(request.node), _Dirs(tmp_path)

    def run(fn: Callable[..., Any], world_size: int | None = None, args: Sequence[Any] = (),
            timeout: float | None = None, backend: str | None = None, op_timeout: float | None = None) -> list[Any]:
        __tracebackhide__ = True
        size = world_size or spec.get("world_size")
        if size is None:
            raise TypeError("warm_ranks: give world_size, or mark the test with @pytest.mark.ranks(world_size)")
        ranks = nccl_pg_warm_pool.get(size, backend or spec.get("backend", "host"), spec.get("gpus"), op_timeout)
        return ranks.run(fn, args, harness_timeout(request.node) if timeout is None else timeout, dirs.next())

    return run


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]
                              ) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A failure that names culprits: the verdict into the report's
    ``user_properties`` (JUnit XML properties)."""
    report = yield
    exc = call.excinfo.value if call.excinfo is not None else None
    if exc is not None and type(exc).__module__.startswith("nccl_pg") and getattr(exc, "culprits", None):
        from . import ci_report

        found = ci_report.properties(exc)
        item.user_properties += found  # what record_property does: --junitxml writes them
        report.user_properties += found  # this report's, for the GitHub annotation
    return report


class GitHubAnnotations:
    """On GitHub Actions, an error annotation at each culprit's source line,
    written with the terminal summary (each on a line of its own, where the
    runner reads workflow commands) by the process that reports:
    pytest-xdist's controller, for its workers' tests too."""

    def __init__(self, config: pytest.Config) -> None:
        self._config = config
        self._lines: list[str] = []

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.failed and any(name == "nccl_pg.culprits" for name, _ in report.user_properties):
            from . import ci_report

            root = os.environ.get("GITHUB_WORKSPACE") or str(self._config.rootpath)
            self._lines += ci_report.github_annotations(report.user_properties, report.nodeid, root)

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        for line in self._lines:
            terminalreporter.write_line(line)
