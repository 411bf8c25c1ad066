"""The process-rank harness as GPU CI meets it (issue 24): a hang fails
within the test's deadline naming the rank that caused it (not the ranks
that timed out waiting) and its line; skips from any rank skip; a rank's
output, import errors included, is shown; no process a rank started
outlives the test; dumps go to the test's own directory; GPUs are bound per
rank and split between pytest-xdist workers; a warm set of ranks runs test
after test. Real processes on the host backend; every run is bounded."""

from __future__ import annotations

import itertools
import os
import pickle
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import unittest
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import nccl_pg as dist
from nccl_pg.comm.backends import gpu_count
from nccl_pg.errors import Culprit, DistBackendError
from nccl_pg.process_tree import alive
from nccl_pg.testing import ProcessRanks, RanksFailed, WarmRanks, devices, run_ranks, run_threads
from nccl_pg.testing import threads as thread_ranks_module

pytestmark = pytest.mark.timeout(90)

HERE = Path(__file__).resolve()


def _line_of(marker: str) -> int:
    return next(i for i, line in enumerate(HERE.read_text().splitlines(), 1) if line.rstrip().endswith(marker))


# --- rank functions (module level: process ranks import them by name) ---------------------------


def rank_1_sleeps_in_user_code(rank: int, world_size: int) -> float:
    x = np.ones(4)
    dist.all_reduce(x)
    if rank == 1:
        time.sleep(300)  # <- rank 1 sleeps here
    dist.all_reduce(x)
    return float(x[0])


def rank_1_spins_in_c(rank: int, world_size: int) -> None:
    dist.all_reduce(np.ones(2))
    if rank == 1:
        sum(itertools.repeat(0, 10**13))  # <- rank 1 spins in C, the GIL held
    dist.all_reduce(np.ones(2))


def skip_on_rank(rank: int, world_size: int, skipping: int, how: str) -> None:
    if rank == skipping:
        if how == "unittest":
            raise unittest.SkipTest("not on this machine")
        pytest.skip("pytest's skip")
    dist.barrier()


def fail_on_rank_1_after_printing(rank: int, world_size: int) -> None:
    print(f"hello from rank {rank}")
    print(f"to stderr from rank {rank}", file=sys.stderr)
    dist.barrier()
    if rank == 1:
        raise ValueError("rank 1 gives up")  # <- rank 1 raises here


GRANDCHILD = """
import os, signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
os.setsid()  # out of the rank's process group
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(600)
"""
# The rank's child starts the grandchild and exits at once: the grandchild is an orphan.
CHILD = "import subprocess, sys; subprocess.Popen([sys.executable, '-c', sys.argv[1], sys.argv[2]])"


def start_grandchild(rank: int, world_size: int, where: str, hang: bool) -> int:
    """Leave behind a grandchild that ignores SIGTERM, is in a session of its
    own and whose parent is gone; then return (or hang, to be killed)."""
    path = Path(where, f"grandchild{rank}.pid")
    subprocess.run([sys.executable, "-c", CHILD, GRANDCHILD, str(path)], check=True, timeout=60)
    deadline = time.monotonic() + 60
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    dist.barrier()
    if hang:
        threading.Event().wait(300)
    return int(path.read_text())


def environment(rank: int, world_size: int) -> dict[str, str | None]:
    return {k: os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES", "LOCAL_RANK", "RANK", "WORLD_SIZE",
                                           "NCCL_PG_DEBUG_INFO_TEMP_FILE")}


def hang_after_a_collective(rank: int, world_size: int) -> None:
    dist.all_reduce(np.ones(2))
    threading.Event().wait(300)


def count_calls(rank: int, world_size: int) -> tuple[int, int, int]:
    """How many times this process ran a test (module state persists in a warm set)."""
    global _calls
    _calls += 1
    x = np.full(2, rank)
    dist.all_reduce(x)
    return _calls, os.getpid(), int(x[0])


_calls = 0


def make_a_subgroup(rank: int, world_size: int) -> int:
    sub = dist.new_group([0, 1])
    if rank in (0, 1):
        dist.all_reduce(np.ones(1), group=sub)
    return len(dist.distributed.world.current_world().groups)  # what the harness leaves after a test


def nccl_all_reduce(rank: int, world_size: int) -> float:
    import cupy as cp

    x = cp.full(4, rank + 1, dtype=cp.float32)
    dist.all_reduce(x)
    return float(x[0].get())


# --- a hang: the culprit, its line, within the deadline -----------------------------------------


def _fails_within(fn: Any, world_size: int, deadline: float, dump_dir: Path) -> tuple[RanksFailed, list[int]]:
    """Run ``fn`` on process ranks, which must fail (RanksFailed) before ``deadline``: the error and the pids."""
    t0 = time.monotonic()
    with ProcessRanks(fn, world_size, timeout=deadline, dump_dir=dump_dir) as ranks:
        pids = ranks.pids
        with pytest.raises(RanksFailed) as caught:
            ranks.join()
    assert time.monotonic() - t0 < deadline
    return caught.value, pids


def test_sleeping_rank_is_named_alone_with_its_line(tmp_path: Path) -> None:
    """The done criterion of issue 24: rank 1 sleeps in user code between two
    all_reduces. With the default per-operation timeout (half the deadline),
    ranks 0 and 2 time out, their diagnosis names rank 1, and the harness
    blames rank 1 alone, at the sleeping line, well within the deadline;
    the dumps are in the test's directory and no dump pipe is left."""
    err, pids = _fails_within(rank_1_sleeps_in_user_code, 3, 12.0, tmp_path)
    assert err.ranks == [1]
    [culprit] = err.culprits
    assert (culprit.rank, culprit.file, culprit.line, culprit.function) == \
        (1, str(HERE), _line_of("# <- rank 1 sleeps here"), "rank_1_sleeps_in_user_code")
    assert (culprit.host, culprit.pid) == (socket.gethostname(), pids[1])
    assert "never joined all_reduce #2 of group 0" in culprit.reason and culprit.kind == "stuck_in_user_code"
    message = str(err)
    assert message.startswith(f"stuck in user code: rank 1 ({socket.gethostname()}, pid {pids[1]}) never joined "
                              "all_reduce #2 of group 0"), message
    assert f"at {HERE}:{_line_of('# <- rank 1 sleeps here')} in rank_1_sleeps_in_user_code" in message
    assert "failed waiting: ranks 0, 2 then failed with communication errors" in message
    # the victims' own errors print the culprit's host and pid
    for victim in (0, 2):
        assert f"verdict: stuck in user code: rank 1 ({socket.gethostname()}, pid {pids[1]}) never joined all_reduce " \
               "#2 of group 0" in err.failures[victim]
        assert "Traceback" not in err.failures[victim]  # a victim's traceback is one line (all of it in its file)
    assert "time.sleep" not in err.failures[1] and "rank_1_sleeps_in_user_code" in err.failures[1]  # its stack
    assert sorted(p.name for p in tmp_path.glob("nccl_pg_trace_rank_*")) == \
        ["nccl_pg_trace_rank_0", "nccl_pg_trace_rank_1", "nccl_pg_trace_rank_2"]
    assert not list(tmp_path.glob("*.pipe"))
    assert all(not alive(p) for p in pids)


def test_rank_spinning_in_c_with_the_gil_held_is_named_with_its_line(tmp_path: Path) -> None:
    """Rank 1 spins in C holding the GIL: none of its Python threads (its incident listener included) can run, so
    only a C-level handler can say where it is. The harness asks through the library's (NCCL_PG_STACKS_SIGNAL,
    written to <dump_dir>/c_stacks/rank1.<pid>.txt, the file nccl-pg why and trace read) and blames rank 1 alone,
    at the spinning line, within the deadline."""
    err, pids = _fails_within(rank_1_spins_in_c, 2, 14.0, tmp_path)
    assert err.ranks == [1], str(err)
    [culprit] = err.culprits
    assert (culprit.file, culprit.line, culprit.function, culprit.pid) == \
        (str(HERE), _line_of("# <- rank 1 spins in C, the GIL held"), "rank_1_spins_in_c", pids[1]), str(err)
    assert f"every thread in {tmp_path / 'c_stacks' / f'rank1.{pids[1]}.txt'}" in err.failures[1], err.failures[1]


def test_timeout_error_carries_structured_culprits() -> None:
    """``DistBackendError.culprits``, set by the timeout's diagnosis: rank 1
    holds back; ranks 0 and 2 catch the timeout and return what it says
    (then, both caught, release rank 1: released at the first, it ended and
    destroyed its group while the other's timeout was still being explained,
    which then failed on the lost connection instead). It survives pickling
    (it crosses processes)."""
    caught = threading.Semaphore(0)

    def fn(rank: int, world_size: int) -> object:
        x = np.ones(2)
        dist.all_reduce(x)
        if rank == 1:
            assert caught.acquire(timeout=30) and caught.acquire(timeout=30)
            return None
        try:
            dist.all_reduce(x)
        except DistBackendError as exc:
            caught.release()
            return pickle.loads(pickle.dumps(exc))
        raise AssertionError("the all_reduce without rank 1 completed")

    errors = run_threads(fn, 3, timeout=20, op_timeout=2)
    for err in (errors[0], errors[2]):
        assert err.culprits == (Culprit(1, "never joined all_reduce #2 of group 0", socket.gethostname(),
                                        os.getpid(), kind="stuck_in_user_code"),), str(err)
        assert f"verdict: stuck in user code: rank 1 ({socket.gethostname()}, pid {os.getpid()}) never joined " \
               "all_reduce #2 of group 0" in str(err)


def test_point_to_point_timeout_names_the_peer() -> None:
    """A receive that times out blames the peer that never sent."""
    caught = threading.Event()

    def fn(rank: int, world_size: int) -> object:
        dist.barrier()
        if rank == 1:
            assert caught.wait(30)
            return None
        try:
            dist.recv(np.zeros(2), src=1)
        except DistBackendError as exc:
            caught.set()
            return exc
        raise AssertionError("received from a rank that sent nothing")

    err = run_threads(fn, 2, timeout=20, op_timeout=1)[0]
    assert err.culprits == (Culprit(1, "did not complete its side of recv #1 of group 0", socket.gethostname(),
                                    os.getpid(), kind="p2p_deadlock"),)
    assert f"verdict: point-to-point deadlock: rank 1 ({socket.gethostname()}, pid {os.getpid()}) did not complete " \
           "its side of recv #1 of group 0" in str(err)


def test_thread_ranks_blame_the_rank_a_timeout_names(monkeypatch: pytest.MonkeyPatch) -> None:
    """Thread ranks too: the rank the diagnosis names is blamed, with the
    line it is stuck at, not the ranks that timed out. (A thread cannot be
    stopped: it is reported once the others have unwound, then released.)"""
    monkeypatch.setattr(thread_ranks_module, "_UNWIND_GRACE", 0.5)
    release = threading.Event()

    def fn(rank: int, world_size: int) -> None:
        dist.all_reduce(np.ones(2))
        if rank == 1:
            release.wait(30)  # <- the thread rank waits here
            return
        dist.all_reduce(np.ones(2))

    try:
        with pytest.raises(RanksFailed) as caught:
            run_threads(fn, 3, timeout=20, op_timeout=2)
    finally:
        release.set()
    assert caught.value.ranks == [1]
    assert "stuck in user code: rank 1 never joined all_reduce #2 of group 0" in str(caught.value)
    [culprit] = caught.value.culprits
    assert (culprit.rank, culprit.file, culprit.line) == (1, str(HERE), _line_of("# <- the thread rank waits here"))


# --- skips, output, import errors ---------------------------------------------------------------


@pytest.mark.parametrize("how", ["unittest", "pytest"])
def test_skip_in_a_process_rank_skips(how: str, tmp_path: Path) -> None:
    with pytest.raises(unittest.SkipTest, match="not on this machine" if how == "unittest" else "pytest's skip"):
        run_ranks(skip_on_rank, 3, timeout=30, args=(2, how), dump_dir=tmp_path)


def test_output_is_captured_prefixed_and_shown(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(RanksFailed) as caught:
        run_ranks(fail_on_rank_1_after_printing, 2, timeout=30, dump_dir=tmp_path)
    err = caught.value
    assert err.ranks == [1]
    assert err.culprits[0].line == _line_of("# <- rank 1 raises here")
    assert "[rank 1] hello from rank 1" in str(err) and "[rank 1] to stderr from rank 1" in str(err)
    echoed = capfd.readouterr().out  # every rank's output, echoed prefixed after the run
    assert "[rank 0] hello from rank 0" in echoed and "[rank 1] hello from rank 1" in echoed
    assert (tmp_path / "rank0.out").read_text().startswith("hello from rank 0")


def test_import_error_in_a_rank_shows_its_traceback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A test module that imports here but not in rank 1 (before the harness
    saw "exit code 1, without a result or a traceback")."""
    (tmp_path / "flaky_module_for_ranks.py").write_text(textwrap.dedent("""
        import os
        if os.environ.get("RANK") == "1":
            import no_such_module_in_rank_1  # noqa: F401

        def work(rank, world_size):
            return rank
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    import flaky_module_for_ranks  # noqa: PLC0415 - written by this test

    with pytest.raises(RanksFailed) as caught:
        run_ranks(flaky_module_for_ranks.work, 2, timeout=30, dump_dir=tmp_path / "ranks")
    err = caught.value
    assert err.ranks == [1]
    assert re.search(r"exception: rank 1 \(\S+, pid \d+\) failed \(exit code 1\): ModuleNotFoundError: No module named "
                     "'no_such_module_in_rank_1'", str(err)), str(err)
    assert "ranks [0] were waiting for them to start and were killed" in str(err)  # at once, not after a grace
    assert "Traceback" in err.failures[1] and "flaky_module_for_ranks.py" in err.failures[1]
    assert "without a result or a traceback" not in err.failures[1]


# --- no process outlives the test -----------------------------------------------------------------


@pytest.mark.parametrize("hang", [False, True], ids=["rank_returns", "rank_killed_at_deadline"])
def test_a_ranks_children_are_gone_after_the_test(hang: bool, tmp_path: Path) -> None:
    """Each rank leaves an orphaned grandchild that ignores SIGTERM and
    started a session of its own; whether the rank returns or hangs and is
    killed at the deadline, no grandchild is alive after the run."""
    where = tmp_path / "pids"
    where.mkdir()
    if hang:
        with pytest.raises(RanksFailed, match=r"ranks \[0, 1\] were still running at the timeout"):
            run_ranks(start_grandchild, 2, timeout=6, args=(str(where), True), dump_dir=tmp_path / "ranks")
    else:
        run_ranks(start_grandchild, 2, timeout=30, args=(str(where), False), dump_dir=tmp_path / "ranks")
    pids = [int(p.read_text()) for p in sorted(where.glob("grandchild*.pid"))]
    assert len(pids) == 2
    deadline = time.monotonic() + 5  # SIGKILL is delivered at once; its reaping may take a moment
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.01)
    left = [p for p in pids if alive(p)]
    for p in left:  # do not leak them into the rest of the suite, but fail
        os.kill(p, signal.SIGKILL)
    assert left == []


def test_dump_pipes_are_in_the_tests_directory_and_removed(tmp_path: Path) -> None:
    """Ranks killed at the deadline cannot remove their dump pipes: the
    harness does (and they are in this test's directory, not a shared one)."""
    with ProcessRanks(hang_after_a_collective, 2, timeout=6, dump_dir=tmp_path) as ranks:
        deadline = time.monotonic() + 10
        while len(list(tmp_path.glob("*.pipe"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert sorted(p.name for p in tmp_path.glob("*.pipe")) == \
            ["nccl_pg_trace_rank_0.pipe", "nccl_pg_trace_rank_1.pipe"]
        with pytest.raises(RanksFailed):
            ranks.join()
    assert not list(tmp_path.glob("*.pipe"))


# --- GPUs -------------------------------------------------------------------------------------------


def test_gpu_share_per_xdist_worker() -> None:
    gpus = [str(i) for i in range(8)]
    assert devices.share(gpus, None) == gpus
    assert [devices.share(gpus, (w, 4)) for w in range(4)] == [["0", "1"], ["2", "3"], ["4", "5"], ["6", "7"]]
    assert [devices.share(gpus, (w, 3)) for w in range(3)] == [["0", "1"], ["2", "3"], ["4", "5"]]
    assert [devices.share(["a", "b"], (w, 4)) for w in range(4)] == [["a"], ["b"], ["a"], ["b"]]
    assert devices.share([], (1, 2)) == []
    assert devices.xdist_worker({"PYTEST_XDIST_WORKER": "gw3", "PYTEST_XDIST_WORKER_COUNT": "4"}) == (3, 4)
    assert devices.xdist_worker({}) is None
    with pytest.raises(ValueError, match="PYTEST_XDIST_WORKER="):
        devices.xdist_worker({"PYTEST_XDIST_WORKER": "w3", "PYTEST_XDIST_WORKER_COUNT": "4"})
    with pytest.raises(ValueError, match="PYTEST_XDIST_WORKER_COUNT="):
        devices.xdist_worker({"PYTEST_XDIST_WORKER": "gw4", "PYTEST_XDIST_WORKER_COUNT": "4"})


def test_too_few_gpus_skips_saying_so() -> None:
    with pytest.raises(unittest.SkipTest, match=r"needs 3 GPUs; pytest-xdist worker gw1 of 2 was given 1 \(5\)"):
        devices.require(3, ["5"], {"PYTEST_XDIST_WORKER": "gw1", "PYTEST_XDIST_WORKER_COUNT": "2"})
    with pytest.raises(unittest.SkipTest, match="needs 1 GPU; this machine has 0"):
        devices.require(1, [], {})
    big = gpu_count() + 2
    with pytest.raises(unittest.SkipTest, match=f"needs {big} GPUs"):
        ProcessRanks(environment, 2, gpus=big)


def test_each_rank_is_bound_to_its_gpus(tmp_path: Path) -> None:
    """The environment a rank gets: the test's GPUs (given here, as a CPU
    machine has none: this checks the binding, not a GPU), its LOCAL_RANK
    (its device among them, as nccl_pg.comm.backends.pick_gpu reads it),
    and its dump prefix in the test's directory."""
    envs = run_ranks(environment, 2, timeout=30, gpus=2, devices=["3", "5", "7"], dump_dir=tmp_path)
    prefix = str(tmp_path / "nccl_pg_trace_rank_")
    assert envs == [{"CUDA_VISIBLE_DEVICES": "3,5", "LOCAL_RANK": str(r), "RANK": str(r), "WORLD_SIZE": "2",
                     "NCCL_PG_DEBUG_INFO_TEMP_FILE": prefix} for r in range(2)]


@pytest.mark.gpu
def test_nccl_ranks_on_a_gpu(tmp_path: Path) -> None:
    """On a GPU machine: two NCCL ranks sharing the one GPU the test asks for."""
    if gpu_count() < 1:
        pytest.skip("needs a GPU")
    pytest.importorskip("cupy", reason="the GPU tests use CuPy arrays")
    assert run_ranks(nccl_all_reduce, 2, backend="nccl", timeout=120, gpus=1, dump_dir=tmp_path) == [3.0, 3.0]


# --- a warm set ---------------------------------------------------------------------------------------


def test_warm_ranks_run_test_after_test(tmp_path: Path) -> None:
    """The same processes and default group run one job after another;
    module state persists (documented), a job's subgroups do not; a failed
    job ends the set."""
    with WarmRanks(2, start_timeout=60, dump_dir=tmp_path / "set") as ranks:
        pids = ranks.pids
        first = ranks.run(count_calls, timeout=30, dump_dir=tmp_path / "a")
        second = ranks.run(count_calls, timeout=30, dump_dir=tmp_path / "b")
        assert [c[2] for c in first + second] == [1, 1, 1, 1]  # the sum of ranks 0 and 1
        assert [c[:2] for c in first] == [(1, pids[0]), (1, pids[1])]
        assert [c[:2] for c in second] == [(2, pids[0]), (2, pids[1])]
        assert ranks.run(make_a_subgroup, timeout=30) == [2, 2]  # the default and the new subgroup
        assert ranks.run(make_a_subgroup, timeout=30) == [2, 2]  # the previous run's subgroup was destroyed
        with pytest.raises(RanksFailed) as caught:
            ranks.run(fail_on_rank_1_after_printing, timeout=30, dump_dir=tmp_path / "c")
        assert caught.value.ranks == [1] and caught.value.dump_dir == str(tmp_path / "c")
        with pytest.raises(RuntimeError, match="can run nothing more: a run failed"):
            ranks.run(count_calls)
    assert all(not alive(p) for p in pids)
