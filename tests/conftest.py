"""Shared fixtures."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import pytest
from harness.etcd_cluster import INSTALL_HINT as ETCD_INSTALL_HINT
from harness.etcd_cluster import EtcdCluster, etcd_binary
from harness.forked import nccl_unavailable_reason
from harness.procs import live_children
from harness.threads import ThreadWorld, create_comms, destroy_all

from nccl_pg.comm.host import HostCommunicator

Spawn = Callable[..., subprocess.Popen]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--gpu-skips-only", action="store_true",
        help="fail every test (or module) that skips for a reason other than a missing GPU: `make test` "
             "installs everything else the suite needs, so any other skip means a broken install",
    )


def _skip_reason(report: pytest.CollectReport | pytest.TestReport) -> str:
    longrepr = report.longrepr
    return str(longrepr[2]) if isinstance(longrepr, tuple) else str(longrepr)


def _fail_non_gpu_skip(config: pytest.Config, report: pytest.CollectReport | pytest.TestReport) -> None:
    if report.skipped and config.getoption("--gpu-skips-only") and "GPU" not in _skip_reason(report):
        if getattr(report, "wasxfail", None) is not None:
            return
        report.outcome = "failed"
        report.longrepr = (f"skipped for a reason other than a missing GPU ({_skip_reason(report)}); "
                           "`make test` installs everything else this test needs")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    report = yield
    _fail_non_gpu_skip(item.config, report)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Iterator[None]:
    report = yield
    _fail_non_gpu_skip(collector.config, report)
    return report


@pytest.fixture(autouse=True)
def _skip_unavailable_nccl(request: pytest.FixtureRequest) -> None:
    """A test parametrized with backend="nccl" skips, saying why, where it cannot run."""
    callspec = getattr(request.node, "callspec", None)
    if callspec is not None and callspec.params.get("backend") == "nccl":
        reason = nccl_unavailable_reason()
        if reason is not None:
            pytest.skip(reason)


@pytest.fixture
def clean_store_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Store tests set secrets and limits explicitly; the environment must not (children inherit this)."""
    for name in ("NCCL_PG_STORE_SECRET", "NCCL_PG_STORE_MAX_VALUE_SIZE", "NCCL_PG_STORE_TIMEOUT",
                 "NCCL_PG_STORE_IDLE_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def etcd_cluster() -> Iterator[EtcdCluster]:
    """A real 3-member etcd cluster on loopback for EtcdStore (tests/harness/etcd_cluster.py), one per
    module that uses it (not per session: later modules check that no child process of theirs is left);
    without etcd installed, a skip that says how to install it."""
    if etcd_binary() is None:
        pytest.skip(ETCD_INSTALL_HINT)
    cluster = EtcdCluster(3, start_timeout=20)
    yield cluster
    cluster.stop()


@pytest.fixture
def own_etcd_cluster() -> Iterator[EtcdCluster]:
    """A cluster of the test's own, for tests that kill or freeze members (skips as ``etcd_cluster`` does)."""
    if etcd_binary() is None:
        pytest.skip(ETCD_INSTALL_HINT)
    with EtcdCluster(3, start_timeout=20) as cluster:
        yield cluster


@pytest.fixture
def spawn() -> Iterator[Spawn]:
    """Start ``python -c code *args`` with text pipes for stdin/stdout; children still alive at teardown are killed."""
    procs: list[subprocess.Popen] = []

    def start(code: str, *args: object) -> subprocess.Popen:
        proc = subprocess.Popen(
            [sys.executable, "-c", code, *map(str, args)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                pipe.close()


@pytest.fixture
def no_children_left() -> Iterator[None]:
    """The test ends with no child process of ours alive (multiprocessing's service processes aside)."""
    yield
    deadline = time.monotonic() + 5
    while live_children() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert live_children() == []


@pytest.fixture(scope="session", autouse=True)
def _simnccl_stub(request: pytest.FixtureRequest) -> None:
    """nccl4py binds libnccl once per process, at its first call: where the session runs simnccl tests, the stub
    libnccl.so.2 of tests/simnccl loads before any test calls NCCL (it passes calls on to the real libnccl while
    the simulation is not installed)."""
    if any(item.get_closest_marker("simnccl") for item in request.session.items):
        import simnccl  # noqa: PLC0415 - only sessions that run simulated tests pay for it
        from simnccl.stublib import StubBuildError  # noqa: PLC0415

        try:
            simnccl.preload()
        except StubBuildError:
            pass  # each simnccl test reports it: its install() builds again and raises


@pytest.fixture(scope="module")
def simnccl_installed() -> Iterator[None]:
    """The NCCL backend on the simulated bindings (tests/simnccl) for a module's tests; the real ones after."""
    import simnccl  # noqa: PLC0415 - only the modules that ask for it pay for it

    simnccl.install()
    yield
    simnccl.uninstall()


@pytest.fixture(scope="module")
def worlds() -> Iterator[Callable[[int], ThreadWorld]]:
    """Thread worlds of n ranks, built once per module (rebuilt if broken)."""
    cache: dict[int, ThreadWorld] = {}

    def get(n: int) -> ThreadWorld:
        w = cache.get(n)
        if w is None or not w.healthy():
            if w is not None:
                w.close()
            w = cache[n] = ThreadWorld(n)
        return w

    yield get
    for w in cache.values():
        w.close()


@pytest.fixture
def make_comms() -> Iterator[Callable[..., list[HostCommunicator]]]:
    """Fresh communicators for tests that break or block them; destroyed at teardown."""
    made: list[HostCommunicator] = []

    def make(n: int, **config: object) -> list[HostCommunicator]:
        comms = create_comms(n, **config)
        made.extend(comms)
        return comms

    yield make
    destroy_all(made)


@pytest.fixture
def no_simnccl_violations() -> Iterator[None]:
    """The test fails on any violation the NCCL simulation recorded; it starts on simulated GPU 1, and
    ends with no call slowed down."""
    import simnccl  # noqa: PLC0415 - only the modules that ask for it pay for it
    from harness.sim_threads import DEVICE  # noqa: PLC0415
    from simnccl import ncclsim  # noqa: PLC0415

    simnccl.select_device(DEVICE)
    simnccl.clear()
    yield
    problems = simnccl.violations()
    simnccl.clear()
    for call in list(ncclsim.world().delay):
        simnccl.slow(call, 0)
    assert problems == [], "\n".join(problems)
