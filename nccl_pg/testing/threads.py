"""Ranks as threads of the calling process (fast, one address space):
``run_threads``, ``spawn_threads_and_init_comms``, ``MultiThreadedTestCase``.
Each thread has its own World (nccl_pg.distributed's per-thread worlds) and
an initialized default group over one in-process store."""

from __future__ import annotations

import functools
import os
import queue
import socket
import sys
import threading
import time
import traceback
import unittest
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from ..diagnostics import frames
from ..diagnostics.verdicts import format_verdict
from ..distributed import destroy_process_group, init_process_group, is_initialized
from ..distributed.world import World, set_thread_world
from ..errors import Culprit, DistBackendError, DistError
from ..group.process_group import ProcessGroup
from ..store import HashStore
from ..store.base import timeout_error
from ..timeouts import Timeout
from .failures import (
    DEFAULT_TIMEOUT,
    RanksFailed,
    abort_groups,
    culprits_of,
    default_op_timeout,
    is_skip,
    report,
    traceback_of,
)

T = TypeVar("T")

# After the harness releases the ranks (abort), how long they get to unwind
# before those still running are reported as stuck.
_UNWIND_GRACE = 10.0


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
    # A communication error raised after another rank had failed (the harness's abort, or the lost peer), or a
    # timeout whose diagnosis blamed other ranks.
    consequence: bool = False
    named: tuple[Culprit, ...] = ()  # the culprits that diagnosis named


def _abort_until(worlds: Sequence[World], done: threading.Event) -> None:
    """Abort the ranks' groups, and again those made later (by a rank still
    in init_process_group, or creating a subgroup), until ``done``."""
    aborted: set[ProcessGroup] = set()
    while True:
        abort_groups(worlds, aborted)
        if done.wait(0.05):
            return


def _run_thread_ranks(call: Callable[[int], T], world_size: int, backend: str, timeout: float,
                      op_timeout: float | None = None) -> list[T]:
    """Run ``call(rank)`` on ``world_size`` threads, each with its own World
    and an initialized default group (operations time out after
    ``op_timeout``, by default a share of ``timeout``); the results in rank
    order."""
    op_timeout = default_op_timeout(timeout) if op_timeout is None else op_timeout
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    store = _HarnessStore(timeout)
    worlds = [World() for _ in range(world_size)]
    outcomes = [_Outcome() for _ in range(world_size)]
    events: queue.Queue[tuple[str, int]] = queue.Queue()
    first_failure = threading.Lock()
    stopping = threading.Event()  # set by the first rank to fail, or at the timeout
    finished = threading.Event()  # the harness is done with the ranks: stop aborting

    def rank_main(rank: int) -> None:
        set_thread_world(worlds[rank])
        out = outcomes[rank]
        try:
            init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=op_timeout)
            out.value = call(rank)
        except BaseException as exc:  # noqa: BLE001 - pytest's outcomes are BaseExceptions too
            out.error, out.trace, out.named = exc, traceback_of(exc), culprits_of(exc)
            with first_failure:  # decided before this rank's teardown can disturb its peers
                out.consequence = (stopping.is_set() and isinstance(exc, DistError)) or \
                    any(c.rank != rank for c in out.named)
                stopping.set()
            events.put(("failed", rank))
        finally:
            try:
                if is_initialized():
                    destroy_process_group()
            except Exception as exc:
                if out.error is None:
                    out.error, out.trace = exc, traceback.format_exc()
            set_thread_world(None)
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
    seen: dict[int, frames.Frame | None] = {}
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
                continue
            for c in outcomes[rank].named:  # where a culprit is when named, before it moves on
                if 0 <= c.rank < world_size and c.rank not in exited and c.rank not in seen:
                    seen[c.rank] = _where_now(threads[c.rank])
            if not released:
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
        named = _named(outcomes)
        blamed = sorted(set(causes) | set(named) | set(stuck))
        said = "".join(format_verdict(c.kind or "never_joined", f"rank {r} {c.reason} (named by the timeout diagnosis "
                                      f"on ranks {by})") + "; " for r, (c, by) in named.items())
        raise RanksFailed(f"{said}ranks {sorted(stuck)} were still running {when} (their stacks, and any rank's "
                          f"error, follow)\n{report(failures, blamed)}", blamed, failures,
                          _culprits(blamed, outcomes, named, threads, exited, seen))
    return _outcome(outcomes, threads, seen)


def _named(outcomes: Sequence[_Outcome]) -> dict[int, tuple[Culprit, list[int]]]:
    """The ranks diagnosed timeouts blamed: the culprit, and who named it."""
    named: dict[int, tuple[Culprit, list[int]]] = {}
    for r, o in enumerate(outcomes):
        for c in o.named:
            named.setdefault(c.rank, (c, []))[1].append(r)
    return named


def _where_now(thread: threading.Thread) -> frames.Frame | None:
    """The line of the test's code a rank's thread is at."""
    frame = sys._current_frames().get(thread.ident) if thread.ident is not None else None  # noqa: SLF001
    return frames.user_frame(frames.of_frame(frame)) if frame is not None else None


def _culprits(blamed: Sequence[int], outcomes: Sequence[_Outcome], named: dict[int, tuple[Culprit, list[int]]],
              threads: Sequence[threading.Thread], exited: set[int],
              seen: dict[int, frames.Frame | None]) -> list[Culprit]:
    """The blamed ranks, with the line of the test's code each was at (where
    it was when a timeout named it, where it raised, or where it is still
    running)."""
    out = []
    for r in blamed:
        o, where = outcomes[r], seen.get(r)
        if where is None and r not in exited:
            where = _where_now(threads[r])
        if where is None and o.error is not None:
            where = frames.raised_at(o.error)
        reason = named[r][0].reason if r in named else _one_line(o.error) if o.error is not None else "still running"
        out.append(Culprit(r, reason, socket.gethostname(), os.getpid(), where.file if where else None,
                           where.line if where else None, where.function if where else None))
    return out


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


def _outcome(outcomes: list[_Outcome], threads: Sequence[threading.Thread],
             seen: dict[int, frames.Frame | None]) -> list[Any]:
    """The results, or the error that names the failing ranks and those a
    diagnosed timeout blamed (a skip on a rank, with no rank failing on its
    own, skips the whole test)."""
    errors = {r: o.error for r, o in enumerate(outcomes) if o.error is not None}
    causes = {r: e for r, e in errors.items() if not outcomes[r].consequence}
    failed = {r: e for r, e in causes.items() if not is_skip(e)}
    named = _named(outcomes)
    if not failed and causes:
        raise next(iter(causes.values()))
    if not failed and not errors:
        return [o.value for o in outcomes]
    blamed = sorted(set(failed) | set(named)) or sorted(errors)
    later = {r: e for r, e in errors.items() if r not in failed}
    lines = [f"rank{'s' if len(failed) > 1 else ''} {', '.join(map(str, failed))} failed:"] if failed else []
    lines += [f"  rank {r}: {_one_line(e)}" for r, e in failed.items()]
    lines += [format_verdict(c.kind or "no_answer", f"rank {r} {c.reason} (named by the timeout diagnosis on ranks {by})",
                             c.where or "") for r, (c, by) in named.items() if r not in failed]
    if later:  # their tracebacks only show where they waited; RanksFailed.failures has them
        lines.append(f"then ranks {sorted(later)} failed as a consequence (released by the harness or lost a peer):")
        lines += [f"  rank {r}: {_one_line(e)}" for r, e in later.items()]
    lines.append(report({r: outcomes[r].trace for r in failed or later}))
    raise RanksFailed("\n".join(lines), blamed, {r: outcomes[r].trace for r in errors},
                      _culprits(blamed, outcomes, named, threads, set(range(len(outcomes))), seen))


def _one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def run_threads(fn: Callable[..., T], world_size: int = 4, backend: str = "host", timeout: float = DEFAULT_TIMEOUT,
                args: Sequence[Any] = (), op_timeout: float | None = None) -> list[T]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` thread ranks of
    this process (default group initialized over a shared in-process store,
    destroyed afterwards); return the results in rank order. Raise
    RanksFailed naming the failing, blamed or stuck ranks; ``timeout``
    bounds the whole run, ``op_timeout`` each collective (by default a share
    of ``timeout``, leaving time for the timeout's diagnosis)."""
    return _run_thread_ranks(lambda rank: fn(rank, world_size, *args), world_size, backend, timeout, op_timeout)


def spawn_threads_and_init_comms(func: Callable[..., Any] | None = None, *, world_size: int = 4,
                                 backend: str = "host", timeout: float = DEFAULT_TIMEOUT,
                                 op_timeout: float | None = None) -> Any:
    """Decorator (bare or with arguments): calling the decorated function runs
    it with the same arguments on ``world_size`` thread ranks, each with an
    initialized default group; ``nccl_pg.get_rank()`` tells them apart. Made
    for test methods and nested functions in tests, like torch's."""
    if func is None:
        return functools.partial(spawn_threads_and_init_comms, world_size=world_size, backend=backend,
                                 timeout=timeout, op_timeout=op_timeout)

    @functools.wraps(func)
    def on_every_rank(*args: Any, **kwargs: Any) -> None:
        _run_thread_ranks(lambda rank: func(*args, **kwargs), world_size, backend, timeout, op_timeout)

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

    Class attributes ``backend``, ``timeout`` (seconds, for the whole
    method on every rank) and ``op_timeout`` (each collective's; None: a
    share of ``timeout``) can be overridden, like the ``world_size`` property.
    """

    backend = "host"
    timeout = DEFAULT_TIMEOUT
    op_timeout: float | None = None

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

            _run_thread_ranks(call, self.world_size, self.backend, self.timeout, self.op_timeout)

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
