"""Fault matrix with real processes and real signals (issue 5).

{one rank SIGKILLed, SIGTERMed, os.abort()ed, exits cleanly early, exits
non-zero, hangs, skips one collective} x {all_reduce, broadcast, barrier,
send/recv, all_to_all}, 3 ranks, a group timeout of 1.5 s, error-handling
mode 2 (the default); plus {SIGKILL, skip} x all_reduce x modes 0, 1, 3
and mode 0 with blocking wait.

Each cell is one world of 3 processes (harness.procs.World running
harness/fault_scenarios.py) around a TCPStore served by this process.
Rank 1 is the victim (and the broadcast root, so that every op's
completion depends on it on every survivor); ranks 0 and 2 survive;
send/recv is one batch_isend_irecv in which each survivor exchanges with the
victim (and the victim with both). Every rank first runs the op once (the
communicator and its connections exist, and the op works), then:

- dead peers (kill, term, abort, exit0, exit1): the survivors issue the op
  and, once they are inside it, the victim dies (a signal from here, or the
  victim's own os.abort() / sys.exit(0) / os._exit(1) on a store key);
- hang: the victim's main thread sleeps instead of issuing the op (its
  watchdog threads still run) and is SIGKILLed here once the survivors are done;
- skip: the survivors issue the op twice, the victim once: their first one
  completes (paired with the victim's only one) and the second times out.

Expected: with modes 0 and 2 every survivor's op raises DistBackendError
within timeout + 1 s of being issued (a dead peer is seen through its lost
connection, well before the timeout; a hang or skip is reported by the
timeout, whose message names global rank 1 as never having issued the
collective, or for send/recv as the operation's peer); with modes 1 and 3 every survivor ends by SIGABRT (-6) within
timeout + 1 s. Survivors then destroy the default group and exit 0 on their
own; nothing is left running at the end of a cell.

Under ``gpu``, {SIGKILL, exit 1, hang, skip} x {all_reduce, send/recv} run
again with three ranks sharing GPU 0 over NCCL (CuPy arrays; a lost peer may
surface as NCCL's own error or as the timeout naming rank 1). Under
``simnccl`` the same cells run the NCCL backend's code on the simulated
bindings (tests/simnccl; each rank drives simulated GPU 1 and reports the
violations the simulation recorded): our logic against NCCL's documented
behaviour, not GPU behaviour.

Worlds run ``CONCURRENCY`` at a time on a thread pool (a module fixture
starts every selected cell in collection order); each test waits for its
own cell's outcome, so a failure names its cell.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import pytest
from harness.fault_scenarios import fault_cell
from harness.forked import nccl_unavailable_reason
from harness.procs import World, live_children

from nccl_pg.comm.backends import SAME_GPU_ENV

N = 3
VICTIM = 1
SURVIVORS = (0, 2)
TIMEOUT = 1.5  # the group timeout, seconds
SLACK = 1.0  # every survivor's outcome comes within TIMEOUT + SLACK of issuing the op
CONCURRENCY = 3  # worlds at a time
WORLD_LIMIT = 40.0  # hard bound on one world, start to finish

FAULTS = ("kill", "term", "abort", "exit0", "exit1", "hang", "skip")
DEAD = ("kill", "term", "abort", "exit0", "exit1")  # the victim process is gone
OPS = ("all_reduce", "broadcast", "barrier", "send_recv", "all_to_all")
VICTIM_RC = {"kill": -signal.SIGKILL, "term": -signal.SIGTERM, "abort": -signal.SIGABRT, "exit0": 0, "exit1": 1}

@dataclass(frozen=True)
class Cell:
    fault: str
    op: str
    mode: int = 2
    blocking: bool = False  # NCCL_PG_BLOCKING_WAIT=1: wait() polls, and aborts the group when it raises
    backend: str = "host"  # "nccl": three ranks on GPU 0; "simnccl": the NCCL backend on the simulated bindings

    def __str__(self) -> str:
        return (f"{self.fault}-{self.op}-mode{self.mode}" + ("-blocking" if self.blocking else "")
                + ("" if self.backend == "host" else f"-{self.backend}"))

    @property
    def failing_op(self) -> int:
        """Index of the survivors' op that must fail."""
        return 1 if self.fault == "skip" else 0


@dataclass
class Outcome:
    cell: Cell
    results: dict[int, Any] = field(default_factory=dict)  # survivor -> its JSON result (None: none)
    rc: dict[int, int | None] = field(default_factory=dict)
    died_at: dict[int, float] = field(default_factory=dict)  # rank -> CLOCK_MONOTONIC when seen exited
    issued_at: dict[int, float] = field(default_factory=dict)  # survivor -> when it issued the failing op
    left_behind: list[int] = field(default_factory=list)  # ranks still running when they should have exited
    logs: dict[int, str] = field(default_factory=dict)
    problem: str | None = None  # the orchestration itself failed (a rank died during warm-up, ...)

    def describe(self) -> str:
        parts = [f"cell {self.cell}: problem={self.problem} rc={self.rc} left_behind={self.left_behind}"]
        for r in range(N):
            parts.append(f"--- rank {r}: result {json.dumps(self.results.get(r))}\n{self.logs.get(r, '')[-3000:]}")
        return "\n".join(parts)


class _Abandon(Exception):
    pass


def run_world(cell: Cell, stop: threading.Event) -> Outcome:
    out = Outcome(cell)
    tmp = tempfile.mkdtemp(prefix="fault_matrix_")
    env = {"NCCL_PG_ASYNC_ERROR_HANDLING": str(cell.mode), "NCCL_PG_BLOCKING_WAIT": str(int(cell.blocking))}
    rank_env = {r: {"NCCL_HOSTID": f"rank{r}", **SAME_GPU_ENV} for r in range(N)} if cell.backend == "nccl" else None
    args = {"fault": cell.fault, "op": cell.op, "mode": cell.mode, "timeout": TIMEOUT, "backend": cell.backend}
    deadline = time.monotonic() + WORLD_LIMIT
    w: World | None = None

    def wait_keys(keys: list[str], what: str) -> None:
        assert w is not None
        while True:
            try:
                w.store.wait(keys, timeout=0.02)
                return
            except Exception:
                pass
            w.poll()
            early = [r for r in w.procs if r in w.exited_at and not (r == VICTIM and cell.fault in DEAD)]
            if early:
                raise _Abandon(f"ranks {early} exited ({[w.procs[r].returncode for r in early]}) before {what}")
            if stop.is_set() or time.monotonic() > deadline:
                raise _Abandon(f"gave up waiting for {what}")

    try:
        w = World(N, fault_cell, tmp, args=args, env=env, rank_env=rank_env)
        out.died_at = w.exited_at
        wait_keys([f"ready/{r}" for r in range(N)], "warm-up")
        w.set("go")
        keys = [f"in_op/{r}/{cell.failing_op}" for r in SURVIVORS]
        wait_keys(keys, "the survivors issuing the op")
        for r in SURVIVORS:
            out.issued_at[r] = float(w.store.get(f"in_op/{r}/{cell.failing_op}"))
        if cell.fault in DEAD:
            time.sleep(0.2)  # let the survivors get into wait() (a kill before that must work too; it is just less typical)
            if cell.fault == "kill":
                w.procs[VICTIM].send_signal(signal.SIGKILL)
            elif cell.fault == "term":
                w.procs[VICTIM].send_signal(signal.SIGTERM)
            else:
                w.set("strike")
        # The survivors must end on their own: after their error (modes 0, 2) or by SIGABRT (1, 3).
        limit = time.monotonic() + TIMEOUT + 15.0
        watch = [*SURVIVORS, VICTIM] if cell.fault in DEAD else list(SURVIVORS)
        while any(r not in out.died_at for r in watch) and time.monotonic() < limit and not stop.is_set():
            time.sleep(0.01)
            w.poll()
        out.left_behind = [r for r in watch if r not in out.died_at]
        if cell.fault == "skip" and not out.left_behind:
            w.set("exit")  # the victim, alive and well, destroys its group and exits
            limit = time.monotonic() + 10.0
            while VICTIM not in out.died_at and time.monotonic() < limit:
                time.sleep(0.01)
                w.poll()
            if VICTIM not in out.died_at:
                out.left_behind.append(VICTIM)
        for r in SURVIVORS:
            key = f"result/{r}"
            out.results[r] = json.loads(w.store.get(key)) if w.store.check([key]) else None
    except _Abandon as exc:
        out.problem = str(exc)
    except Exception as exc:  # report, never raise out of the pool
        out.problem = f"{type(exc).__name__}: {exc}"
    finally:
        if w is not None:
            w.kill_all()
            out.rc = {r: p.returncode for r, p in w.procs.items()}
            out.left_behind += [r for r, p in w.procs.items() if p.returncode is None]
            out.logs = {r: w.log(r) for r in w.procs}
            w.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return out


class Matrix:
    """Runs cells on a pool, in the order the tests will ask for them."""

    def __init__(self, cells: list[Cell]) -> None:
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(CONCURRENCY, thread_name_prefix="fault-world")
        self._futures: dict[Cell, Future[Outcome]] = {}
        for c in cells:
            self._submit(c)

    def _submit(self, cell: Cell) -> Future[Outcome]:
        if cell not in self._futures:
            self._futures[cell] = self._pool.submit(run_world, cell, self._stop)
        return self._futures[cell]

    def outcome(self, cell: Cell) -> Outcome:
        return self._submit(cell).result(timeout=3 * WORLD_LIMIT)

    def close(self) -> None:
        self._stop.set()
        for f in self._futures.values():
            f.cancel()
        self._pool.shutdown(wait=True)


@pytest.fixture(scope="module")
def matrix(request: pytest.FixtureRequest) -> Iterator[Matrix]:
    cells = [item.callspec.params["cell"] for item in request.session.items
             if isinstance(getattr(item, "callspec", None) and item.callspec.params.get("cell"), Cell)]
    cells = [c for c in cells if c.backend != "nccl" or nccl_unavailable_reason() is None]
    m = Matrix(cells)
    yield m
    m.close()
    deadline = time.monotonic() + 10
    while live_children() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert live_children() == [], "processes left behind by the fault matrix"


def check(o: Outcome) -> None:
    cell = o.cell
    assert o.problem is None, o.describe()
    assert o.left_behind == [], o.describe()
    if cell.fault in DEAD:
        assert o.rc[VICTIM] == VICTIM_RC[cell.fault], o.describe()
    for r in SURVIVORS:
        res = o.results.get(r)
        if cell.mode in (1, 3):
            assert o.rc[r] == -signal.SIGABRT, o.describe()
            took = o.died_at[r] - o.issued_at[r]
            assert took < TIMEOUT + SLACK, f"rank {r} ended {took:.2f} s after issuing the op\n{o.describe()}"
            if res is not None:  # it could report the error before the abort
                last = res["ops"][-1]
                assert not last["ok"] and last["backend"], o.describe()
            continue
        assert o.rc[r] == 0, o.describe()
        assert res is not None, o.describe()
        ops = res["ops"]
        assert len(ops) == cell.failing_op + 1, o.describe()
        assert all(op["ok"] for op in ops[:-1]), o.describe()
        err = ops[-1]
        assert not err["ok"], f"rank {r}: the op completed without the victim\n{o.describe()}"
        assert err["backend"], f"rank {r}: {err['type']} instead of DistBackendError\n{o.describe()}"
        took = err["t1"] - err["t0"]
        assert took < TIMEOUT + SLACK, f"rank {r}: the error came {took:.2f} s after issuing\n{o.describe()}"
        if cell.fault in ("hang", "skip"):
            # p2p is numbered per pair, not per group: the message names the operation's peers instead
            missing = "with ranks [1]: a peer did not post" if cell.op == "send_recv" else "ranks [1] never issued"
            assert "timeout" in err["msg"] and missing in err["msg"], o.describe()
            assert took >= TIMEOUT, o.describe()  # a timeout, not something earlier
        elif cell.backend in ("nccl", "simnccl"):  # a lost peer surfaces as a timeout naming it, or NCCL's error
            assert re.search(r"ranks? \[?1\b", err["msg"]) or "NCCL" in err["msg"], o.describe()
        else:
            assert "rank 1" in err["msg"], o.describe()  # names the peer whose connection was lost
        assert res["destroy_s"] < TIMEOUT + SLACK, o.describe()
        assert res.get("violations", []) == [], o.describe()


MATRIX = [Cell(f, op) for f in FAULTS for op in OPS]
MODES = [Cell(f, "all_reduce", m) for f in ("kill", "skip") for m in (0, 1, 3)]
MODES += [Cell(f, "all_reduce", 0, blocking=True) for f in ("kill", "skip")]


@pytest.mark.timeout(3 * WORLD_LIMIT + 10)
@pytest.mark.parametrize("cell", MATRIX, ids=str)
def test_fault_matrix(matrix: Matrix, cell: Cell) -> None:
    check(matrix.outcome(cell))


@pytest.mark.timeout(3 * WORLD_LIMIT + 10)
@pytest.mark.parametrize("cell", MODES, ids=str)
def test_error_handling_modes(matrix: Matrix, cell: Cell) -> None:
    check(matrix.outcome(cell))


NCCL_CELLS = [Cell(f, op, backend="nccl") for f in ("kill", "exit1", "hang", "skip") for op in ("all_reduce",
                                                                                             "send_recv")]


@pytest.mark.gpu
@pytest.mark.timeout(3 * WORLD_LIMIT + 10)
@pytest.mark.parametrize("cell", NCCL_CELLS, ids=str)
def test_fault_matrix_nccl(matrix: Matrix, cell: Cell) -> None:
    """The same faults with three ranks sharing GPU 0 over NCCL."""
    reason = nccl_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    check(matrix.outcome(cell))


SIM_CELLS = [Cell(f, op, backend="simnccl") for f in ("kill", "exit1", "hang", "skip")
             for op in ("all_reduce", "send_recv")]


@pytest.mark.simnccl
@pytest.mark.timeout(3 * WORLD_LIMIT + 10)
@pytest.mark.parametrize("cell", SIM_CELLS, ids=str)
def test_fault_matrix_simnccl(matrix: Matrix, cell: Cell) -> None:
    """The NCCL cells on the simulated bindings: the NCCL backend's code, every CI run."""
    check(matrix.outcome(cell))
