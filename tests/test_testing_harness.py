"""Tests of the test harness itself (nccl_pg.testing and its pytest fixtures):
results come back, failures name the rank (and its exit code for processes),
nothing hangs, and no rank thread or process outlives the call."""

from __future__ import annotations

import importlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
import unittest
from pathlib import Path

import numpy as np
import pytest
import tomllib

import nccl_pg as dist
from nccl_pg.testing import (
    MultiThreadedTestCase,
    ProcessRanks,
    RanksFailed,
    run_ranks,
    run_threads,
    spawn_threads_and_init_comms,
)
from nccl_pg.testing import threads as thread_ranks_module
from nccl_pg.testing.pytest_plugin import ProcessRanksFixture

pytestmark = pytest.mark.timeout(60)


# --- rank functions (module level: process ranks import them by name) ---------------------------


def sum_of_ranks(rank: int, world_size: int, offset: int = 0) -> dict:
    x = np.full(3, rank + offset, np.int64)
    dist.all_reduce(x)
    return {"rank": dist.get_rank(), "size": dist.get_world_size(), "sum": int(x[0]), "pid": os.getpid()}


def raise_after_first_collective(rank: int, world_size: int, bad: int) -> None:
    dist.all_reduce(np.ones(2))
    if rank == bad:
        raise ValueError(f"deliberate failure on rank {rank}")
    dist.all_reduce(np.ones(2))  # the others block here until the failing rank's teardown releases them


def exit_with_code(rank: int, world_size: int, code: int) -> None:
    dist.barrier()
    if rank == world_size - 1:
        os._exit(code)
    dist.barrier()


def write_pid_then_hang(rank: int, world_size: int, where: str) -> None:
    Path(where, f"{rank}.pid").write_text(str(os.getpid()))
    time.sleep(600)  # killed long before


def unpicklable_result(rank: int, world_size: int) -> object:
    return threading.Lock()


def _gone(pid: int) -> bool:
    """True once ``pid`` no longer exists (killed and reaped: not even a zombie)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _pids(where: Path, n: int) -> list[int]:
    deadline = time.monotonic() + 30
    while len(list(where.glob("*.pid"))) < n and time.monotonic() < deadline:
        time.sleep(0.05)
    return [int(p.read_text()) for p in sorted(where.glob("*.pid"))]


# --- thread ranks ---------------------------------------------------------------------------------


def test_run_threads_returns_results_in_rank_order() -> None:
    results = run_threads(sum_of_ranks, 3, args=(10,))
    assert [r["rank"] for r in results] == [0, 1, 2]
    assert {r["sum"] for r in results} == {33}
    assert not dist.is_initialized()  # the ranks' worlds are theirs; the caller's is untouched


def test_decorator_bare_and_with_arguments() -> None:
    seen: list[tuple[int, int, str]] = []

    @spawn_threads_and_init_comms
    def bare(tag: str) -> None:
        seen.append((dist.get_rank(), dist.get_world_size(), tag))

    @spawn_threads_and_init_comms(world_size=2)
    def two() -> None:
        seen.append((dist.get_rank(), dist.get_world_size(), "two"))

    assert bare("bare") is None
    two()
    assert sorted(seen) == [(0, 2, "two"), (0, 4, "bare"), (1, 2, "two"), (1, 4, "bare"),
                            (2, 4, "bare"), (3, 4, "bare")]


@pytest.mark.timeout(30)
def test_failure_before_any_collective_releases_peers_in_lazy_init() -> None:
    """Rank 1 fails before the default group's first collective: the others
    are creating the communicator, waiting for it. They are released at once
    (not at the 20 s timeout), and the error names rank 1."""

    def fn(rank: int, world_size: int) -> None:
        if rank == 1:
            raise KeyError("no such thing")
        dist.all_reduce(np.ones(2))

    with pytest.raises(RanksFailed) as caught:
        run_threads(fn, 4, timeout=20)
    message = str(caught.value)
    assert caught.value.ranks == [1] and message.startswith("rank 1 failed:"), message
    assert "KeyError" in message and "still running" not in message
    assert "KeyError" in caught.value.failures[1]


@pytest.mark.timeout(30)
def test_failure_releases_ranks_blocked_in_a_subgroup() -> None:
    def fn(rank: int, world_size: int) -> None:
        sub = dist.new_group([1, 2, 3])
        if rank in (1, 2, 3):
            dist.all_reduce(np.ones(2), group=sub)
        if rank == 3:
            raise RuntimeError("rank 3 gives up")
        if rank in (1, 2):
            dist.all_reduce(np.ones(2), group=sub)

    with pytest.raises(RanksFailed) as caught:
        run_threads(fn, 4, timeout=20)
    assert caught.value.ranks == [3] and str(caught.value).startswith("rank 3 failed:")
    assert set(caught.value.failures) >= {1, 2, 3}  # 1 and 2 were released with an error, not left hanging
    assert 0 not in caught.value.failures


@pytest.mark.timeout(40)
def test_rank_stuck_outside_collectives_is_reported_with_its_stack(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 never reaches the barrier; at the timeout the others are
    released and rank 0's stack shows where it was. The timeout leaves a
    loaded machine time to get rank 0 through init_process_group (its stack
    would show the rendezvous otherwise); no unwinding grace is waited for,
    since nothing can release rank 0 but the test. The collectives' timeout
    is the whole test's here (by default it is shorter: see
    test_thread_ranks_blame_the_rank_a_timeout_names)."""
    monkeypatch.setattr(thread_ranks_module, "_UNWIND_GRACE", 0.5)
    release = threading.Event()

    def fn(rank: int, world_size: int) -> None:
        if rank == 0:
            release.wait(30)  # longer than the timeout, bounded so the thread does end
            return
        dist.barrier()

    try:
        with pytest.raises(RanksFailed) as caught:
            run_threads(fn, 3, timeout=5, op_timeout=5)
    finally:
        release.set()
    message = str(caught.value)
    assert "still running at the timeout of 5 s" in message
    assert 0 in caught.value.ranks
    assert "release.wait" in caught.value.failures[0]


def test_rank_stuck_after_another_failed_is_reported_without_waiting_for_the_timeout(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 1 fails; rank 0 is busy outside any collective, so aborting
    cannot release it: it is reported once the unwinding grace has passed,
    not at the (long) timeout, and both ranks are blamed."""
    monkeypatch.setattr(thread_ranks_module, "_UNWIND_GRACE", 0.5)
    release = threading.Event()

    def fn(rank: int, world_size: int) -> None:
        if rank == 0:
            release.wait(5)
        else:
            raise ValueError("rank 1 fails")

    try:
        with pytest.raises(RanksFailed) as caught:
            run_threads(fn, 2, timeout=50)
    finally:
        release.set()
    assert caught.value.ranks == [0, 1]
    assert "ranks [0] were still running 0.5 s after rank 1 raised ValueError" in str(caught.value)


def test_skip_in_a_rank_skips() -> None:
    def fn(rank: int, world_size: int) -> None:
        if rank == 2:
            raise unittest.SkipTest("not on this machine")
        dist.barrier()

    with pytest.raises(unittest.SkipTest, match="not on this machine"):
        run_threads(fn, 4)


def test_pytest_skip_in_a_rank_skips() -> None:
    def fn(rank: int, world_size: int) -> None:
        pytest.skip("pytest's skip")

    with pytest.raises(pytest.skip.Exception, match="pytest's skip"):
        run_threads(fn, 2)


def test_harness_is_reusable_after_a_failure() -> None:
    def fn(rank: int, world_size: int) -> None:
        raise AssertionError(f"rank {rank} fails")

    with pytest.raises(RanksFailed) as caught:
        run_threads(fn, 2)
    assert sorted(caught.value.failures) == [0, 1]
    assert [r["sum"] for r in run_threads(sum_of_ranks, 2)] == [1, 1]


def test_world_size_is_checked() -> None:
    with pytest.raises(ValueError, match="world_size"):
        run_threads(sum_of_ranks, 0)


# --- MultiThreadedTestCase -----------------------------------------------------------------------


class _Sample(MultiThreadedTestCase):
    """Run by the tests below through unittest; pytest must not collect it."""

    __test__ = False

    @property
    def world_size(self) -> int:
        return 3

    def test_ranks(self) -> None:
        self.assertEqual(self.rank, dist.get_rank())
        self.assertEqual(dist.get_world_size(), 3)
        x = np.full(2, float(self.rank))
        dist.all_reduce(x)
        self.assertEqual(x, np.full(2, 3.0))
        self.assertEqualOnRank(self.rank, 1, rank=1)
        self.assertNotEqualOnRank(self.rank, 0, rank=2)

    def test_fails_on_rank_2(self) -> None:
        dist.barrier()
        self.assertEqualOnRank(np.zeros(2), np.ones(2), rank=2)
        dist.barrier()

    def test_not_equal_fails(self) -> None:
        self.assertNotEqualOnRank([np.ones(2)], [np.ones(2)], rank=1)

    @unittest.skip("skipped on purpose")
    def test_skipped(self) -> None:
        raise AssertionError("must not run")


def _run(name: str) -> unittest.TestResult:
    result = unittest.TestResult()
    _Sample(name).run(result)
    return result


def test_multithreaded_testcase_runs_each_rank() -> None:
    result = _run("test_ranks")
    assert result.wasSuccessful(), result.errors + result.failures


def test_multithreaded_testcase_names_the_failing_rank() -> None:
    result = _run("test_fails_on_rank_2")
    problems = result.errors + result.failures
    assert len(problems) == 1
    report = problems[0][1]
    assert "rank 2 failed" in report and "AssertionError" in report


def test_multithreaded_testcase_not_equal_on_rank() -> None:
    problems = (result := _run("test_not_equal_fails")).errors + result.failures
    assert len(problems) == 1 and "rank 1 failed" in problems[0][1]


def test_multithreaded_testcase_skip() -> None:
    result = _run("test_skipped")
    assert [why for _, why in result.skipped] == ["skipped on purpose"]


def test_multithreaded_testcase_rank_outside_a_rank_thread() -> None:
    with pytest.raises(RuntimeError, match="rank's thread"):
        _ = _Sample("test_ranks").rank


# --- process ranks --------------------------------------------------------------------------------


def test_run_ranks_returns_results() -> None:
    results = run_ranks(sum_of_ranks, 3, args=(10,))
    assert [r["rank"] for r in results] == [0, 1, 2]
    assert {r["sum"] for r in results} == {33}
    assert len({r["pid"] for r in results} | {os.getpid()}) == 4  # real processes
    assert all(_gone(r["pid"]) for r in results)


def test_run_ranks_names_the_failing_rank_and_exit_code(tmp_path: Path) -> None:
    with pytest.raises(RanksFailed) as caught:
        run_ranks(raise_after_first_collective, 2, args=(1,), dump_dir=tmp_path)
    message = str(caught.value)
    assert caught.value.ranks == [1] and re.search(r"exception: rank 1 \(\S+, pid \d+\) failed \(exit code 1\)", message)
    assert "deliberate failure on rank 1" in caught.value.failures[1]
    assert "ValueError" in message


def test_run_ranks_reports_an_exit_without_traceback(tmp_path: Path) -> None:
    with pytest.raises(RanksFailed) as caught:
        run_ranks(exit_with_code, 2, args=(3,), dump_dir=tmp_path)
    assert re.search(r"dead: rank 1 \(\S+, pid \d+\) failed \(exit code 3\)", str(caught.value))
    assert "without a result or a traceback" in caught.value.failures[1]


def test_run_ranks_unpicklable_result_is_a_failure(tmp_path: Path) -> None:
    with pytest.raises(RanksFailed) as caught:
        run_ranks(unpicklable_result, 1, dump_dir=tmp_path)
    assert re.search(r"exception: rank 0 \(\S+, pid \d+\) failed \(exit code 1\)", str(caught.value))
    assert "lock" in caught.value.failures[0]


def test_hung_ranks_are_killed_at_the_timeout(tmp_path: Path) -> None:
    """``run_ranks`` is ``ProcessRanks(...).join()`` in a with block; used
    here directly for the pids (a rank may be killed before it could write
    its own: the timeout is short)."""
    with ProcessRanks(write_pid_then_hang, 2, timeout=3, args=(str(tmp_path),), dump_dir=tmp_path / "ranks") as ranks:
        pids = ranks.pids
        with pytest.raises(RanksFailed) as caught:
            ranks.join()
    message = str(caught.value)
    assert caught.value.ranks == [0, 1] and "ranks [0, 1] were still running at the timeout of 3 s" in message
    assert all(pid is not None and _gone(pid) for pid in pids)


def test_process_ranks_context_kills_on_exit(tmp_path: Path) -> None:
    with ProcessRanks(write_pid_then_hang, 2, timeout=30, args=(str(tmp_path),)) as ranks:
        pids = _pids(tmp_path, 2)
        assert sorted(pids) == sorted(p for p in ranks.pids if p is not None)
    assert all(_gone(p) for p in pids)


# --- the pytest fixtures ---------------------------------------------------------------------------


def test_thread_ranks_fixture(thread_ranks) -> None:
    assert [r["sum"] for r in thread_ranks(sum_of_ranks, 2)] == [1, 1]


def test_process_ranks_fixture_runs_ranks(process_ranks: ProcessRanksFixture) -> None:
    assert [r["rank"] for r in process_ranks(sum_of_ranks, 2)] == [0, 1]


def test_process_ranks_fixture_start_and_signal_a_rank(process_ranks: ProcessRanksFixture, tmp_path: Path) -> None:
    ranks = process_ranks.start(write_pid_then_hang, 2, timeout=30, args=(str(tmp_path),))
    pids = _pids(tmp_path, 2)
    rank0 = ranks.pids[0]
    assert rank0 in pids
    os.kill(rank0, signal.SIGKILL)
    with pytest.raises(RanksFailed) as caught:
        ranks.join()
    assert re.search(r"dead: rank 0 \(\S+, pid \d+\) failed \(exit code -9, killed by signal SIGKILL\)",
                     str(caught.value))
    assert "SIGKILL" in caught.value.failures[0]
    assert "ranks [1] were still running" in str(caught.value)  # killed by the harness after rank 0 died
    assert all(_gone(p) for p in pids)


def test_process_ranks_fixture_teardown_kills_leftovers(tmp_path: Path) -> None:
    fixture = ProcessRanksFixture()
    fixture.start(write_pid_then_hang, 2, timeout=30, args=(str(tmp_path),))
    pids = _pids(tmp_path, 2)
    fixture.close()  # what the fixture does at teardown
    assert all(_gone(p) for p in pids)


def test_pytest_entry_point_names_the_plugin() -> None:
    """pyproject.toml's ``pytest11`` entry point names the module that defines the fixtures."""
    meta = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    plugin = importlib.import_module(meta["project"]["entry-points"]["pytest11"]["nccl_pg"])
    assert {"thread_ranks", "process_ranks"} <= set(vars(plugin))


def test_loading_the_plugin_imports_no_harness_code() -> None:
    """pytest loads plugins before coverage starts: the plugin must not import
    the harness modules (nccl_pg.testing exports its names on first use)."""
    code = ("import sys, nccl_pg.testing.pytest_plugin; "
            "print(sorted(m for m in sys.modules if m.startswith('nccl_pg.testing.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["['nccl_pg.testing.pytest_plugin']"]
    from nccl_pg.testing import run_threads as exported  # noqa: PLC0415 - the lazy export itself

    assert exported is run_threads
