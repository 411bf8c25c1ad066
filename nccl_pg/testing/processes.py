"""Ranks as real processes (isolation, crashes, exit codes, GPUs):
``run_ranks`` and ``ProcessRanks``, over a TCPStore served by the calling
process. The rank's side is rank_main.py; the verdict (who is to blame,
where it is, what it printed) is verdict.py's."""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing.connection
import multiprocessing.spawn
import os
import pickle
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import time
import unittest
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from .. import env as _env
from .. import process_tree
from ..diagnostics import heartbeat, jobs_folder, trace
from ..diagnostics import stacks as c_stacks
from ..store import TCPStoreServer
from . import devices, verdict
from .failures import DEFAULT_TIMEOUT, default_op_timeout
from .rank_main import Job, Start, importing_main

T = TypeVar("T")

# After one rank fails, how long the others get to exit on their own
# (they usually fail at once, having lost a peer) before they are killed.
_FAILURE_GRACE = 2.0
# How long a rank that answered gets to exit before it counts as stuck (it is ending its descendants).
_EXIT_WAIT = 1.0
# How long a rank asked for its stacks gets to write them, and the most read of them.
_STACK_WAIT = 1.0
_STACK_CAP = 1 << 20
# How long a killed rank gets to be reaped.
_REAP_GRACE = 10.0
# Without pidfds (not Linux), how often a wait looks at the ranks' exits.
_POLL = 0.05

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # where nccl_pg is


@dataclass
class _Rank:
    rank: int
    proc: subprocess.Popen[bytes]
    conn: multiprocessing.connection.Connection
    output: str
    pidfd: int | None
    exitcode: int | None = None
    output_from: int = 0  # where the current job's output starts


def _exit_status(pid: int) -> int | None:
    """The exit code of an ended child without reaping it (its pid, and its
    process group's id, stay reserved until ``close``); None while it runs."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return None
    if info is None or info.si_pid == 0:
        return None
    return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status


class RankProcesses:
    """``world_size`` rank processes with a default group (see rank_main.py
    for what a rank does), and the means to run jobs on them and to end
    them. ``ProcessRanks`` runs one job; ``WarmRanks`` (warm.py) many."""

    def __init__(self, world_size: int, backend: str = "host", timeout: float = DEFAULT_TIMEOUT,
                 op_timeout: float | None = None, gpus: int | None = None, devices_: Sequence[str] | None = None,
                 dump_dir: str | os.PathLike[str] | None = None, env: Mapping[str, str] | None = None,
                 warm: bool = False) -> None:
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        main = importing_main()
        if main is not None:
            raise RuntimeError(
                f"run_ranks (or process_ranks, ProcessRanks) was called while a rank imported {main}: the script "
                "calls it at module level. Each rank imports the main module to find the function it runs (as "
                "multiprocessing's spawn does), so every rank would start ranks again. Put the call under "
                "`if __name__ == \"__main__\":`.")
        self.world_size, self.backend, self.timeout = world_size, backend, timeout
        self.op_timeout = default_op_timeout(timeout) if op_timeout is None else op_timeout
        # the ranks' C-level stack signal (diagnostics/stacks.py), as their environment sets it (0: none)
        self._stacks_signal = _env.STACKS_SIGNAL.get({**os.environ, **(env or {})})
        needed = (world_size if backend == "nccl" else 0) if gpus is None else gpus
        pool = list(devices_) if devices_ is not None else devices.available() if needed else []
        devices.require(needed, pool)
        self.gpus = pool[:needed]
        self._own_dir = dump_dir is None
        self.dump_dir = tempfile.mkdtemp(prefix="nccl_pg-ranks-") if dump_dir is None else os.fspath(dump_dir)
        os.makedirs(self.dump_dir, exist_ok=True)
        self._dump_dirs = {self.dump_dir}
        self._closed = False
        self._ranks: list[_Rank] = []
        self._server = TCPStoreServer("127.0.0.1", 0, idle_timeout=0).start()
        # Every rank's: torch's env:// rendezvous (a free port for its TCPStore, rank 0's), the job's id (its dumps'
        # and stacks' tag, and how its processes are found at the end), the operation timeout any group gets at most
        # (a torch group made with torch's default, 30 minutes, too), the progress file of each rank's watchdog.
        self.job = f"test-{os.getpid()}-{next(_runs)}"
        self._job_env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), _env.JOB_ID.name: self.job,
                         _env.MAX_TIMEOUT.name: repr(self.op_timeout)}
        self._progress = os.path.join(self.dump_dir, "progress")
        try:
            for rank in range(world_size):
                self._ranks.append(self._start(rank, env or {}, warm))
        except BaseException:
            self.close()
            raise

    def _start(self, rank: int, env: Mapping[str, str], warm: bool) -> _Rank:
        output = os.path.join(self.dump_dir, f"rank{rank}.out")
        ours, theirs = socket.socketpair()
        code = (f"import sys; sys.path.insert(0, {_ROOT!r}); from nccl_pg.testing.rank_main import main; "
                f"main({theirs.fileno()}, {os.getpid()})")
        os.makedirs(self._progress, mode=0o700, exist_ok=True)
        full_env = {**os.environ, **devices.rank_env(rank, self.world_size, self.gpus), "PYTHONUNBUFFERED": "1",
                    "NCCL_PG_DEBUG_INFO_TEMP_FILE": self.dump_prefix(self.dump_dir), **self._job_env,
                    _env.PROGRESS_FILE.name: os.path.join(self._progress, str(rank)), **env}
        with open(output, "ab") as out:
            proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, env=full_env, pass_fds=[theirs.fileno()],
                                    start_new_session=True)
        theirs.close()
        conn = multiprocessing.connection.Connection(ours.detach())
        pidfd = os.pidfd_open(proc.pid) if hasattr(os, "pidfd_open") else None
        r = _Rank(rank, proc, conn, output, pidfd)
        preparation = multiprocessing.spawn.get_preparation_data(f"nccl_pg-rank-{rank}")
        preparation["authkey"] = bytes(preparation["authkey"])  # spawn's own pickler sends it; ours must say so
        conn.send(Start(preparation, ("127.0.0.1", self._server.port), rank, self.world_size, self.backend,
                        self.op_timeout, self.timeout, len(self.gpus), warm))
        return r

    @staticmethod
    def dump_prefix(folder: str) -> str:
        return os.path.join(folder, "nccl_pg_trace_rank_")

    @property
    def pids(self) -> list[int]:
        return [r.proc.pid for r in self._ranks]

    def send(self, fn: Callable[..., Any], args: Sequence[Any], dump_dir: str) -> None:
        """Give every rank a job (its output is counted from here)."""
        self._dump_dirs.add(dump_dir)
        payload = pickle.dumps(Job(fn, tuple(args), self.dump_prefix(dump_dir)))
        for r in self._ranks:
            r.output_from = os.path.getsize(r.output) if os.path.exists(r.output) else 0
            if r.exitcode is None:
                with contextlib.suppress(OSError):
                    r.conn.send_bytes(payload)

    def _exited(self, r: _Rank) -> bool:
        if r.exitcode is None:
            r.exitcode = _exit_status(r.proc.pid)
        return r.exitcode is not None

    def _receive(self, r: _Rank, wait: float = 0.0) -> tuple[Any, ...] | None:
        try:
            if r.conn.closed or not r.conn.poll(wait):
                return None
            raw = r.conn.recv_bytes()
        except (EOFError, OSError):
            r.conn.close()  # gone without a word: the exit code will tell
            return None
        try:
            message = pickle.loads(raw)
        except Exception as exc:  # noqa: BLE001 - e.g. a result whose class this process cannot import
            return ("error", verdict.unreadable(exc))
        return message if isinstance(message, tuple) else ("error", verdict.unreadable(TypeError(message)))

    def gather(self, deadline: float, until_exit: bool, timeout: float | None = None,
               dump_dir: str | None = None) -> verdict.Outcome:
        """Every rank's answer to the current job, until each has answered
        (and, ``until_exit``, exited), or the deadline (or ``_FAILURE_GRACE``
        after the first failure): those still running then are asked for
        their stacks. ``timeout`` and ``dump_dir``: the job's, for the
        report (by default the ranks')."""
        answers: dict[int, tuple[Any, ...]] = {}
        pending = {r.rank for r in self._ranks}
        failed_at: float | None = None
        while pending:
            limit = deadline if failed_at is None else min(deadline, failed_at + _FAILURE_GRACE)
            left = limit - time.monotonic()
            if left <= 0:
                break
            ranks = [self._ranks[i] for i in sorted(pending)]
            waitables: list[Any] = [r.conn for r in ranks if not r.conn.closed]
            waitables += [r.pidfd for r in ranks if r.pidfd is not None]
            poll = left if all(r.pidfd is not None for r in ranks) else min(left, _POLL)
            multiprocessing.connection.wait(waitables, poll)
            for r in ranks:
                message = self._receive(r) if r.rank not in answers else None
                exited = self._exited(r)
                if message is None and exited and r.rank not in answers:
                    message = self._receive(r, 0.1)  # sent just before exiting
                if message is not None:
                    answers[r.rank] = message
                if exited or (r.rank in answers and not until_exit):
                    pending.discard(r.rank)
                if (message is not None and message[0] != "ok") or (exited and r.exitcode != 0) or \
                        (exited and r.rank not in answers):
                    failed_at = time.monotonic() if failed_at is None else failed_at
                if message is not None and not getattr(message[1], "started", True):
                    failed_at = time.monotonic() - _FAILURE_GRACE  # the others wait for it at the start: no grace
        answered = [self._ranks[i] for i in sorted(pending) if i in answers]
        end = time.monotonic() + _EXIT_WAIT
        while answered and time.monotonic() < end:  # those that answered are leaving: let them
            answered = [r for r in answered if not self._exited(r)]
            multiprocessing.connection.wait([r.pidfd for r in answered if r.pidfd is not None], _POLL)
        pending = {i for i in pending if not self._exited(self._ranks[i])}
        stuck = self.stacks([self._ranks[i] for i in sorted(pending)]) if pending else {}
        return verdict.Outcome(
            timeout=self.timeout if timeout is None else timeout, grace=_FAILURE_GRACE, failed_early=failed_at is not None, answers=answers,
            stuck=stuck, exitcodes={r.rank: r.exitcode for r in self._ranks}, pids=self.pids,
            host=socket.gethostname(), outputs={r.rank: verdict.read_from(r.output, r.output_from) for r in self._ranks},
            output_files={r.rank: r.output for r in self._ranks},
            dump_dir=self.dump_dir if dump_dir is None else dump_dir)

    def stacks(self, ranks: Sequence[_Rank]) -> dict[int, c_stacks.Written | None]:
        """Ask ranks for every thread's stack (the library's C-level stacks,
        by signal: also a rank holding the GIL or blocked in C answers); what
        each wrote within ``_STACK_WAIT`` (None: nothing, or no handler)."""
        running = {r.rank: r.proc.pid for r in ranks if not self._exited(r)}
        got = c_stacks.request_all(running, self._stacks_signal, _STACK_WAIT, _STACK_CAP) if self._stacks_signal else {}
        return {r.rank: got.get(r.rank) for r in ranks}

    def last_ops(self) -> dict[int, str]:
        """The collective each rank was in, or last completed, by its progress file (heartbeat.py)."""
        out = {}
        for r in self._ranks:
            p = heartbeat.read(os.path.join(self._progress, str(r.rank)))
            if p is not None and p.describe():
                out[r.rank] = p.describe()
        return out

    def stop(self, deadline: float) -> None:
        """Tell ranks waiting for a job to leave (their group destroyed), and
        wait for them until ``deadline``."""
        for r in self._ranks:
            if not self._exited(r):
                with contextlib.suppress(OSError):
                    r.conn.send_bytes(pickle.dumps(None))
        for r in self._ranks:
            while not self._exited(r) and time.monotonic() < deadline:
                multiprocessing.connection.wait([r.pidfd] if r.pidfd is not None else [],
                                                min(_POLL, max(deadline - time.monotonic(), 0)))

    def close(self) -> None:
        """Kill every rank's process tree and reap the ranks (no zombies),
        then stop the store and remove the ranks' dump pipes. Safe to call
        again."""
        if self._closed:
            return
        self._closed = True
        for r in self._ranks:
            process_tree.kill_tree(r.proc.pid)  # also a rank that ended: its children may not have
        if any(self._exited(r) and (r.exitcode or 0) < 0 for r in self._ranks) or \
                any(not self._exited(r) for r in self._ranks):
            # a rank that died by a signal left its descendants to init (it could not end them): found by the job's
            # id, which they inherited with the rank's environment
            process_tree.kill(process_tree.tagged(_env.JOB_ID.name, self.job))
        for r in self._ranks:
            with contextlib.suppress(subprocess.TimeoutExpired):
                r.exitcode = r.proc.wait(_REAP_GRACE) if r.exitcode is None else r.exitcode
            with contextlib.suppress(subprocess.TimeoutExpired):
                r.proc.wait(_REAP_GRACE)
            r.conn.close()
            if r.pidfd is not None:
                os.close(r.pidfd)
        self._server.stop()
        for folder in self._dump_dirs:
            _remove_pipes(folder)
        shutil.rmtree(self._progress, ignore_errors=True)

    def remove_dump_dir(self) -> None:
        """Remove the dump directory made for these ranks (not one given)."""
        if self._own_dir:
            shutil.rmtree(self.dump_dir, ignore_errors=True)


_runs = itertools.count()


def _free_port() -> int:
    """A port free now on the loopback interface (for torch's TCPStore, which rank 0 will host)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _remove_pipes(folder: str) -> None:
    """The dump pipes a rank killed before its exit handlers ran leaves."""
    with contextlib.suppress(OSError):
        for name in os.listdir(folder):
            path = os.path.join(folder, name)
            with contextlib.suppress(OSError):
                if name.endswith(".pipe") and stat.S_ISFIFO(os.lstat(path).st_mode):
                    os.unlink(path)


class ProcessRanks:
    """``world_size`` processes, each calling ``fn(rank, world_size, *args)``
    after ``init_process_group`` over a TCPStore hosted here. ``fn`` and
    ``args`` must be picklable (a module-level function), and so must
    ``fn``'s return value.

    ``timeout`` is the test's deadline (from the start); each collective's
    (the group's) is ``op_timeout``, by default shorter (see
    ``failures.default_op_timeout``), so that a hang is diagnosed, and its
    culprit named, before the deadline. ``gpus``: how many GPUs the test
    needs (default: one per rank with backend "nccl", none otherwise); too
    few on this machine (or this pytest-xdist worker's share) skips the
    test. Each rank's output goes to ``<dump_dir>/rank<N>.out``, its dumps
    to ``<dump_dir>/nccl_pg_trace_rank_<N>``; ``dump_dir`` defaults to a
    new temporary directory, removed after a success. ``env`` adds to the
    ranks' environment.

    Start with the constructor; ``pids`` lets a test signal ranks; ``join()``
    returns the results; leaving the ``with`` block, or ``close()``, kills
    whatever still runs, so no process outlives the test."""

    def __init__(self, fn: Callable[..., Any], world_size: int, backend: str = "host",
                 timeout: float = DEFAULT_TIMEOUT, args: Sequence[Any] = (), *, op_timeout: float | None = None,
                 gpus: int | None = None, devices: Sequence[str] | None = None,
                 dump_dir: str | os.PathLike[str] | None = None, env: Mapping[str, str] | None = None,
                 echo: bool = True) -> None:
        self._deadline = time.monotonic() + timeout
        self._echo = echo
        self._ranks = RankProcesses(world_size, backend, timeout, op_timeout, gpus, devices, dump_dir, env)
        self.world_size, self.timeout, self.op_timeout = world_size, timeout, self._ranks.op_timeout
        self.dump_dir = self._ranks.dump_dir
        self._joined = False
        try:
            self._ranks.send(fn, args, self.dump_dir)
        except BaseException:
            self.close()
            raise

    @property
    def pids(self) -> list[int]:
        return self._ranks.pids

    def join(self) -> list[Any]:
        """Wait for every rank (bounded by the deadline given at start);
        return the results in rank order, or raise RanksFailed naming the
        culprits (with where each is in its code, and its last output),
        each failing rank's exit code and traceback, and the ranks killed;
        or skip the test (``unittest.SkipTest``) when a rank skipped and
        none failed on its own."""
        __tracebackhide__ = True  # pytest shows the verdict, not the harness's frames
        try:
            outcome = self._ranks.gather(self._deadline, until_exit=True)
            last_ops = self._ranks.last_ops()
        finally:
            self._ranks.close()
        self._joined = True
        if self._echo:
            verdict.echo(outcome)
        result = verdict.judge(outcome)
        if isinstance(result, BaseException):
            if isinstance(result, unittest.SkipTest):
                self._ranks.remove_dump_dir()
            else:  # how each rank ended, beside the dumps, for `nccl-pg trace` (as the launcher writes it)
                jobs_folder.write_endings(self.dump_dir, self._ranks.job, verdict.endings(outcome, last_ops))
                if verdict.unexplained(outcome):  # communication errors that name nobody: the dumps may
                    report = trace.analyze_dir(self.dump_dir, os.path.basename(self._ranks.dump_prefix(self.dump_dir)),
                                               allow_incomplete_ranks=True)
                    again = verdict.judge(outcome, report.get("verdicts") or ())
                    result = again if isinstance(again, BaseException) else result
            raise result  # a failure keeps the directory it names
        self._ranks.remove_dump_dir()
        return result

    def close(self) -> None:
        """Kill whatever still runs; without a ``join()`` nothing will name
        the directory made for these ranks, so it goes too."""
        self._ranks.close()
        if not self._joined:
            self._ranks.remove_dump_dir()

    def __enter__(self) -> ProcessRanks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def run_ranks(fn: Callable[..., T], world_size: int, backend: str = "host", timeout: float = DEFAULT_TIMEOUT,
              args: Sequence[Any] = (), **options: Any) -> list[T]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` processes with
    an initialized default group; return the results in rank order. Raise
    RanksFailed naming the culprits; see ProcessRanks for ``timeout`` (the
    deadline) and the ``options`` (op_timeout, gpus, devices, dump_dir, env,
    echo)."""
    __tracebackhide__ = True
    with ProcessRanks(fn, world_size, backend, timeout, args, **options) as ranks:
        return ranks.join()
