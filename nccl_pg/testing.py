"""A harness for distributed tests, for this project's suite and for users'.

Ranks run either as threads of the calling process (fast, one address space:
``spawn_threads_and_init_comms``, ``run_threads``, ``MultiThreadedTestCase``)
or as real processes (isolation, crashes and exit codes: ``run_ranks``,
``ProcessRanks``). Either way each rank has an initialized default group
while the test code runs, and the group is destroyed afterwards.

Every wait here is bounded. A rank that raises makes the harness release the
others (abort their groups and fail their rendezvous waits; processes that
do not then exit are killed), so a failure is reported as an error naming
the rank, never as a hang; a rank still running at the timeout is reported,
with its stack for threads, and killed for processes. A thread stuck outside
any collective cannot be stopped: it is reported and left running (daemon).
"""

from __future__ import annotations

import ctypes
import functools
import multiprocessing
import multiprocessing.connection
import os
import queue
import signal
import sys
import threading
import time
import traceback
import unittest
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from .distributed import (
    _set_thread_world,
    _World,
    _world,
    destroy_process_group,
    init_process_group,
    is_initialized,
)
from .errors import DistBackendError, DistError
from .process_group import ProcessGroup
from .store import HashStore, TCPStore, TCPStoreServer
from .store.base import timeout_error
from .timeouts import Timeout

__all__ = [
    "DEFAULT_TIMEOUT",
    "MultiThreadedTestCase",
    "ProcessRanks",
    "RanksFailed",
    "run_ranks",
    "register_null_backend",
    "run_threads",
    "spawn_threads_and_init_comms",
]

T = TypeVar("T")

DEFAULT_TIMEOUT = 60.0
# After the harness releases the ranks (abort or kill), how long they get to
# unwind before those still running are reported as stuck.
_UNWIND_GRACE = 10.0
# After one process rank fails, how long the others get to exit on their own
# (they usually fail at once, having lost a peer) before they are killed.
_FAILURE_GRACE = 2.0


class RanksFailed(RuntimeError):
    """One or more ranks failed or did not finish in time.

    ``ranks`` are the ones the message blames: those that failed on their
    own (not with a communication error after another rank had failed), and
    those still running when the harness gave up on them. ``failures`` maps
    every rank that did not succeed to its report (traceback, exit code, or
    stack when stuck)."""

    def __init__(self, message: str, ranks: Sequence[int], failures: dict[int, str]) -> None:
        super().__init__(message)
        self.ranks = sorted(ranks)
        self.failures = failures


def _is_skip(exc: BaseException) -> bool:
    """``unittest.SkipTest``, or pytest's skip outcome (``pytest.skip()``,
    ``pytest.importorskip``) without importing pytest."""
    skipped = getattr(sys.modules.get("_pytest.outcomes"), "Skipped", None)  # loaded only under pytest
    return isinstance(exc, unittest.SkipTest) or (skipped is not None and isinstance(exc, skipped))


def _report(failures: dict[int, str], first: Sequence[int] = ()) -> str:
    """Each rank's report; the ``first`` ranks (those to blame) lead."""
    order = sorted(failures, key=lambda r: (r not in first, r))
    return "\n".join(f"--- rank {r} ---\n{failures[r].rstrip()}" for r in order)


def _traceback(exc: BaseException) -> str:
    """The traceback without the harness's frame that called the rank's code."""
    tb = exc.__traceback__
    return "".join(traceback.format_exception(type(exc), exc, tb.tb_next if tb is not None else None))


def register_null_backend() -> str:
    """Make backend "null" available in this process and return its name:
    a communicator that sends nothing and completes every operation at once
    (nccl_pg/comm/null.py), for measuring and counting what the layers above
    the Communicator contract cost per operation. Not a collective: outputs
    are left as they are."""
    from . import backends
    from .comm.null import NULL

    backends.register_backend(NULL.name, NULL)
    return NULL.name


# --- ranks as threads -------------------------------------------------------------------------


class _HarnessStore(HashStore):
    """The thread ranks' rendezvous. Once the harness gives up, its waits
    fail at once: a rank blocked creating a communicator (lazy init waits
    in the store for peers' addresses) is released instead of waiting for
    a dead peer until the group timeout. The error is not a DistStoreError,
    which the communicator's init would retry until its deadline."""

    def __init__(self, timeout: float) -> None:
        super().__init__(timeout)
        self._abort_reason: str | None = None

    def abort(self, reason: str) -> None:
        with self._cond:
            self._abort_reason = reason
            self._cond.notify_all()

    def _wait_locked(self, keys: list[str], timeout: Timeout | None, op: str) -> None:
        start = time.monotonic()
        self._cond.wait_for(lambda: self._abort_reason is not None or not self._state.missing(keys),
                            self._deadline(timeout))
        if self._abort_reason is not None:
            raise DistBackendError(f"aborted by the test harness ({self._abort_reason}) during HashStore.{op}")
        if self._state.missing(keys):
            raise timeout_error(f"HashStore.{op}", keys, self._state.missing(keys), time.monotonic() - start)


@dataclass
class _Outcome:
    value: Any = None
    error: BaseException | None = None
    trace: str = ""
    # A communication error raised after another rank had failed: the harness's abort, or the lost peer.
    consequence: bool = False


def _abort_groups(worlds: Sequence[_World], aborted: set[ProcessGroup]) -> None:
    """Abort every group of these ranks not in ``aborted`` (and add it),
    parents first: a lazy subgroup may be splitting its parent's communicator."""
    for world in worlds:
        for pg in sorted(list(world.groups), key=lambda g: g.uid):
            if pg not in aborted:
                pg.abort()
                aborted.add(pg)


def _abort_until(worlds: Sequence[_World], done: threading.Event) -> None:
    """Abort the ranks' groups, and again those made later (by a rank still
    in init_process_group, or creating a subgroup), until ``done``."""
    aborted: set[ProcessGroup] = set()
    while True:
        _abort_groups(worlds, aborted)
        if done.wait(0.05):
            return


def _run_thread_ranks(call: Callable[[int], T], world_size: int, backend: str, timeout: float) -> list[T]:
    """Run ``call(rank)`` on ``world_size`` threads, each with its own World
    and an initialized default group; the results in rank order."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    store = _HarnessStore(timeout)
    worlds = [_World() for _ in range(world_size)]
    outcomes = [_Outcome() for _ in range(world_size)]
    events: queue.Queue[tuple[str, int]] = queue.Queue()
    first_failure = threading.Lock()
    stopping = threading.Event()  # set by the first rank to fail, or at the timeout
    finished = threading.Event()  # the harness is done with the ranks: stop aborting

    def rank_main(rank: int) -> None:
        _set_thread_world(worlds[rank])
        out = outcomes[rank]
        try:
            init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
            out.value = call(rank)
        except BaseException as exc:  # noqa: BLE001 - pytest's outcomes are BaseExceptions too
            out.error, out.trace = exc, _traceback(exc)
            with first_failure:  # decided before this rank's teardown can disturb its peers
                out.consequence = stopping.is_set() and isinstance(exc, DistError)
                stopping.set()
            events.put(("failed", rank))
        finally:
            try:
                if is_initialized():
                    destroy_process_group()
            except Exception as exc:
                if out.error is None:
                    out.error, out.trace = exc, traceback.format_exc()
            _set_thread_world(None)
            events.put(("exited", rank))

    def release(reason: str) -> None:
        store.abort(reason)
        # In a thread of its own: an abort can wait for a group's lock, and the harness must not.
        threading.Thread(target=_abort_until, args=(worlds, finished), name="nccl_pg-harness-abort",
                         daemon=True).start()

    threads = [threading.Thread(target=rank_main, args=(r,), name=f"nccl_pg-rank-{r}", daemon=True)
               for r in range(world_size)]
    deadline = time.monotonic() + timeout
    exited: set[int] = set()
    stuck: dict[int, str] = {}
    released = ""  # why the ranks were released, once they were
    try:
        for t in threads:
            t.start()
        while len(exited) < world_size:
            try:
                kind, rank = events.get(timeout=max(deadline - time.monotonic(), 0.0))
            except queue.Empty:
                break
            if kind == "exited":
                exited.add(rank)
            elif not released:
                released = f"{_UNWIND_GRACE:g} s after rank {rank} raised {type(outcomes[rank].error).__name__}"
                release(f"rank {rank} raised {type(outcomes[rank].error).__name__}")
                deadline = min(deadline, time.monotonic() + _UNWIND_GRACE)
    finally:
        if len(exited) < world_size:  # the timeout, or the caller interrupted (e.g. pytest-timeout)
            stuck = _stacks(threads, exited)
            stopping.set()
            if not released:
                release(f"ranks {sorted(stuck)} still running at the timeout")
                _join(threads, _UNWIND_GRACE)
        finished.set()
    if len(exited) < world_size:
        failures = {**{r: o.trace for r, o in enumerate(outcomes) if o.error is not None}, **stuck}
        when = released or f"at the timeout of {timeout:g} s"
        causes = [r for r, o in enumerate(outcomes) if o.error is not None and not o.consequence]
        raise RanksFailed(f"ranks {sorted(stuck)} were still running {when} (their stacks, and any rank's error, "
                          f"follow)\n{_report(failures, causes + list(stuck))}", causes + list(stuck), failures)
    return _outcome(outcomes)


def _stacks(threads: Sequence[threading.Thread], exited: set[int]) -> dict[int, str]:
    """Where each rank still running is now (the report for a stuck rank)."""
    frames = sys._current_frames()
    out = {}
    for r, t in enumerate(threads):
        if r not in exited:
            frame = frames.get(t.ident) if t.ident is not None else None
            where = "".join(traceback.format_stack(frame)) if frame is not None else "(not started)\n"
            out[r] = f"still running; stack:\n{where}"
    return out


def _join(threads: Sequence[threading.Thread], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(deadline - time.monotonic(), 0.0))


def _outcome(outcomes: list[_Outcome]) -> list[Any]:
    """The results, or the error that names the failing ranks (a skip on a
    rank, with no rank failing on its own, skips the whole test)."""
    errors = {r: o.error for r, o in enumerate(outcomes) if o.error is not None}
    causes = {r: e for r, e in errors.items() if not outcomes[r].consequence}
    failed = {r: e for r, e in causes.items() if not _is_skip(e)}
    if not failed and causes:
        raise next(iter(causes.values()))
    if not failed:
        return [o.value for o in outcomes]
    later = {r: e for r, e in errors.items() if outcomes[r].consequence}
    lines = [f"rank{'s' if len(failed) > 1 else ''} {', '.join(map(str, failed))} failed:"]
    lines += [f"  rank {r}: {_one_line(e)}" for r, e in failed.items()]
    if later:  # their tracebacks only show where they waited; RanksFailed.failures has them
        lines.append(f"then ranks {sorted(later)} failed as a consequence (released by the harness or lost a peer):")
        lines += [f"  rank {r}: {_one_line(e)}" for r, e in later.items()]
    lines.append(_report({r: outcomes[r].trace for r in failed}))
    raise RanksFailed("\n".join(lines), list(failed), {r: outcomes[r].trace for r in errors})


def _one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def run_threads(fn: Callable[..., T], world_size: int = 4, backend: str = "host", timeout: float = DEFAULT_TIMEOUT,
                args: Sequence[Any] = ()) -> list[T]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` thread ranks of
    this process (default group initialized over a shared in-process store,
    destroyed afterwards); return the results in rank order. Raise
    RanksFailed naming the failing or stuck ranks; ``timeout`` bounds the
    whole run and each collective."""
    return _run_thread_ranks(lambda rank: fn(rank, world_size, *args), world_size, backend, timeout)


def spawn_threads_and_init_comms(func: Callable[..., Any] | None = None, *, world_size: int = 4,
                                 backend: str = "host", timeout: float = DEFAULT_TIMEOUT) -> Any:
    """Decorator (bare or with arguments): calling the decorated function runs
    it with the same arguments on ``world_size`` thread ranks, each with an
    initialized default group; ``nccl_pg.get_rank()`` tells them apart. Made
    for test methods and nested functions in tests, like torch's."""
    if func is None:
        return functools.partial(spawn_threads_and_init_comms, world_size=world_size, backend=backend,
                                 timeout=timeout)

    @functools.wraps(func)
    def on_every_rank(*args: Any, **kwargs: Any) -> None:
        _run_thread_ranks(lambda rank: func(*args, **kwargs), world_size, backend, timeout)

    return on_every_rank


def _holds_array(x: Any) -> bool:
    return isinstance(x, np.ndarray) or (isinstance(x, (list, tuple)) and any(_holds_array(i) for i in x))


def _same(x: Any, y: Any) -> bool:
    """Equality that understands arrays (same shape and values; dtypes may
    differ) and sequences of them."""
    if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
        return np.shape(x) == np.shape(y) and bool(np.array_equal(x, y))
    if isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)):
        return len(x) == len(y) and all(_same(a, b) for a, b in zip(x, y, strict=True))
    return bool(x == y)


class MultiThreadedTestCase(unittest.TestCase):
    """Each test method runs once per rank, on ``world_size`` threads, with
    the default group initialized; ``self.rank`` is the rank. setUp and
    tearDown run once, on the calling thread. A failure on any rank fails the
    test with the rank named; a skip on a rank skips it.

    Class attributes ``backend`` and ``timeout`` (seconds, for the whole
    method on every rank) can be overridden, like the ``world_size`` property.
    """

    backend = "host"
    timeout = DEFAULT_TIMEOUT

    @property
    def world_size(self) -> int:
        return 4

    def __init__(self, methodName: str = "runTest") -> None:  # noqa: N803 - unittest's name
        super().__init__(methodName)
        self._thread_rank = threading.local()
        method = getattr(self, methodName, None)
        if method is not None:
            setattr(self, methodName, self._on_every_rank(method))

    def _on_every_rank(self, method: Callable[[], Any]) -> Callable[[], None]:
        @functools.wraps(method)  # keeps unittest's skip and expected-failure markers
        def run() -> None:
            def call(rank: int) -> Any:
                self._thread_rank.value = rank
                return method()

            _run_thread_ranks(call, self.world_size, self.backend, self.timeout)

        return run

    @property
    def rank(self) -> int:
        rank = getattr(self._thread_rank, "value", None)
        if rank is None:
            raise RuntimeError("self.rank is defined only on a rank's thread, inside a test method")
        return rank

    def assertEqual(self, first: Any, second: Any, msg: Any = None) -> None:  # noqa: N802
        """unittest's, except that arrays (and lists of them) compare by shape and values."""
        if _holds_array(first) or _holds_array(second):
            if not _same(first, second):
                self.fail(self._formatMessage(msg, f"{first!r} != {second!r}"))
        else:
            super().assertEqual(first, second, msg)

    def assertEqualOnRank(self, x: Any, y: Any, msg: Any = None, *, rank: int = 0) -> None:  # noqa: N802
        """Assert on ``rank`` only: values that legitimately differ between ranks."""
        if self.rank == rank:
            self.assertEqual(x, y, msg)

    def assertNotEqualOnRank(self, x: Any, y: Any, msg: Any = None, *, rank: int = 0) -> None:  # noqa: N802
        if self.rank == rank and _same(x, y):
            self.fail(self._formatMessage(msg, f"{x!r} == {y!r} on rank {rank}"))


# --- ranks as processes -------------------------------------------------------------------------


def _die_with_parent(parent: int) -> None:
    """A rank must not outlive a parent killed outright (SIGKILL on a CI
    timeout): it would hold its CPU and ports. Linux only; elsewhere the
    parent's kill at its own exit is the only guard."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # 1: PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def _process_rank_main(fn: Callable[..., Any], rank: int, world_size: int, backend: str, address: tuple[str, int],
                       timeout: float, args: Sequence[Any], conn: multiprocessing.connection.Connection,
                       parent: int) -> None:
    """A rank process: rendezvous, ``fn``, teardown; the result (or the
    traceback) goes back through ``conn``, and the exit code says which."""
    _die_with_parent(parent)
    try:
        store = TCPStore(*address, timeout=timeout)
        try:
            init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
            try:
                result = fn(rank, world_size, *args)
            except BaseException:
                # Abort rather than flush: peers blocked on this rank fail at once instead of at the timeout.
                _abort_groups([_world()], set())
                raise
            finally:
                if is_initialized():
                    destroy_process_group()
        finally:
            store.close()
        conn.send(("ok", result))
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the parent
        # A communication error may just be the echo of a peer's failure: the parent blames the others first.
        conn.send(("comm_error" if isinstance(exc, DistError) else "error", _traceback(exc)))
        conn.close()
        sys.exit(1)
    conn.close()


class ProcessRanks:
    """``world_size`` processes (multiprocessing's "spawn"), each calling
    ``fn(rank, world_size, *args)`` after ``init_process_group`` over a
    TCPStore hosted here. ``fn`` and ``args`` must be picklable (a
    module-level function), and so must ``fn``'s return value.

    Start with the constructor; ``pids`` lets a test signal ranks; ``join()``
    returns the results; leaving the ``with`` block, or ``close()``, kills
    whatever still runs, so no process outlives the test."""

    def __init__(self, fn: Callable[..., Any], world_size: int, backend: str = "host",
                 timeout: float = DEFAULT_TIMEOUT, args: Sequence[Any] = ()) -> None:
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        self.world_size, self.timeout = world_size, timeout
        self._deadline = time.monotonic() + timeout
        self._closed = False
        self._server = TCPStoreServer("127.0.0.1", 0).start()
        ctx = multiprocessing.get_context("spawn")
        self._procs: list[multiprocessing.process.BaseProcess] = []
        self._conns: list[multiprocessing.connection.Connection] = []
        try:
            for rank in range(world_size):
                reader, writer = ctx.Pipe(duplex=False)
                proc = ctx.Process(target=_process_rank_main, name=f"nccl_pg-rank-{rank}",
                                   args=(fn, rank, world_size, backend, ("127.0.0.1", self._server.port), timeout,
                                         tuple(args), writer, os.getpid()))
                self._procs.append(proc)
                self._conns.append(reader)
                proc.start()
                writer.close()  # the child's copy stays open: EOF here means the child is gone
        except BaseException:
            self.close()
            raise

    @property
    def pids(self) -> list[int | None]:
        return [p.pid for p in self._procs]

    def join(self) -> list[Any]:
        """Wait for every rank (bounded by the timeout given at start); return
        the results in rank order, or raise RanksFailed with each failing
        rank's exit code and traceback and the ranks killed."""
        messages: dict[int, tuple[str, Any]] = {}
        running = set(range(self.world_size))
        failed_at: float | None = None
        while running:
            limit = self._deadline if failed_at is None else min(self._deadline, failed_at + _FAILURE_GRACE)
            left = limit - time.monotonic()
            if left <= 0:
                break
            waitables: list[Any] = [self._procs[r].sentinel for r in running]
            waitables += [self._conns[r] for r in running if r not in messages and not self._conns[r].closed]
            multiprocessing.connection.wait(waitables, left)
            for r in sorted(running):
                self._receive(r, messages)
                if self._procs[r].exitcode is not None:
                    self._receive(r, messages, last=True)  # a result sent just before exiting
                    running.discard(r)
                    if self._procs[r].exitcode != 0 and failed_at is None:
                        failed_at = time.monotonic()
        killed = sorted(running)
        self.close()
        failures = {r: self._failure(r, messages.get(r)) for r in range(self.world_size)
                    if r not in killed and (self._procs[r].exitcode != 0 or messages.get(r, ("",))[0] != "ok")}
        if not failures and not killed:
            return [messages[r][1] for r in range(self.world_size)]
        echoes = [r for r in failures if messages.get(r, ("",))[0] == "comm_error"]
        blamed = [r for r in failures if r not in echoes] or list(failures) or killed
        parts = [f"rank {r} failed (exit code {self._procs[r].exitcode})" for r in blamed if r in failures]
        if echoes and blamed != echoes:
            parts.append(f"then ranks {echoes} failed with communication errors")
        if killed:
            why = f"at the timeout of {self.timeout:g} s" if failed_at is None else \
                f"{_FAILURE_GRACE:g} s after the first failure"
            parts.append(f"ranks {killed} were still running {why} and were killed")
            failures.update({r: "killed: still running\n" for r in killed})
        raise RanksFailed(f"{'; '.join(parts)}\n{_report(failures, blamed)}", blamed, failures)

    def _receive(self, rank: int, messages: dict[int, tuple[str, Any]], last: bool = False) -> None:
        conn = self._conns[rank]
        if rank in messages or conn.closed:
            return
        try:
            if conn.poll(0.1 if last else 0):
                messages[rank] = conn.recv()
        except (EOFError, OSError):
            conn.close()  # gone without a word: the exit code will tell

    def _failure(self, rank: int, message: tuple[str, Any] | None) -> str:
        code = self._procs[rank].exitcode
        if message is not None and message[0] != "ok":
            return f"exit code {code}\n{message[1]}"
        if code is not None and code < 0:
            return f"exit code {code}: killed by signal {signal.Signals(-code).name}, no traceback\n"
        return f"exit code {code}, without a result or a traceback\n"

    def close(self) -> None:
        """Kill every rank still running and reap them all (no zombies), then
        stop the store. Safe to call again."""
        if self._closed:
            return
        self._closed = True
        for p in self._procs:
            if p.exitcode is None and p.pid is not None:
                p.kill()
        for p in self._procs:
            if p.pid is not None:
                p.join(_UNWIND_GRACE)
        for c in self._conns:
            c.close()
        self._server.stop()

    def __enter__(self) -> ProcessRanks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def run_ranks(fn: Callable[..., T], world_size: int, backend: str = "host", timeout: float = DEFAULT_TIMEOUT,
              args: Sequence[Any] = ()) -> list[T]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` processes with
    an initialized default group; return the results in rank order. Raise
    RanksFailed with each failing rank's exit code and traceback; at the
    timeout every rank still running is killed and named."""
    with ProcessRanks(fn, world_size, backend, timeout, args) as ranks:
        return ranks.join()
