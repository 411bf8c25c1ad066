"""Work, Future and WorkInfo: the handle a collective returns.

A Work is complete when the stream event recorded after its operation has
fired, or failed when its communicator reports an error or its timeout
passes, or (``NCCL_PG_NAN_CHECK=async``) when the NaN check that ran before
its operation on the same stream found a NaN. Completion is observed by whoever looks first: ``wait()`` in the
caller's thread or the process-wide watchdog thread (watchdog.py), which also
runs completion hooks, so un-waited Works complete too.
"""

from __future__ import annotations

import concurrent.futures
import enum
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Protocol

from ..diagnostics import diagnosis, verdicts
from ..errors import Culprit, DistBackendError, NanError
from ..timeouts import Timeout, to_seconds

if TYPE_CHECKING:
    from ..comm.base import Event
    from ..diagnostics.flight_recorder import Entry
    from ..diagnostics.group_view import GroupView

# Longest slice wait() blocks on an event before re-checking errors and deadlines.
_WAIT_SLICE = 0.05
_monotonic, _time, _time_ns, _allocate_lock = time.monotonic, time.time, time.time_ns, threading.Lock
_finished_cond = threading.Condition(threading.Lock())  # Work._wait_finished's


class OpType(enum.Enum):
    """The operation a Work stands for (names as in torch.distributed)."""

    BROADCAST = "broadcast"
    ALLREDUCE = "allreduce"
    ALLREDUCE_COALESCED = "allreduce_coalesced"
    REDUCE = "reduce"
    ALLGATHER = "allgather"
    _ALLGATHER_BASE = "_allgather_base"
    GATHER = "gather"
    SCATTER = "scatter"
    REDUCE_SCATTER = "reduce_scatter"
    _REDUCE_SCATTER_BASE = "_reduce_scatter_base"
    ALLTOALL_BASE = "alltoall_base"
    ALLTOALL = "alltoall"
    SEND = "send"
    RECV = "recv"
    BARRIER = "barrier"
    COALESCED = "coalesced"

    def __repr__(self) -> str:
        return f"OpType.{self.name}"

    __hash__ = object.__hash__  # members are singletons; Enum's hash runs Python code at every dict lookup


@dataclass(frozen=True)
class WorkInfo:
    """What a completion hook receives. Times are None unless timing is on
    (``NCCL_PG_ENABLE_TIMING`` or a registered hook)."""

    op_type: OpType
    seq: int
    time_started: datetime | None
    time_finished: datetime | None
    active_duration: timedelta | None


class Future:
    """The result of a Work as a future (value: the Work's output arrays)."""

    def __init__(self, inner: concurrent.futures.Future | None = None) -> None:
        self._f: concurrent.futures.Future = inner or concurrent.futures.Future()

    def done(self) -> bool:
        return self._f.done()

    def wait(self, timeout: float | None = None) -> Any:
        """Block until set (or ``timeout`` seconds: TimeoutError); returns the
        value or raises the error."""
        try:
            return self._f.result(timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"Future not completed after {timeout} s") from None

    def value(self) -> Any:
        if not self._f.done():
            raise RuntimeError("Future.value() called before the future completed")
        return self._f.result()

    def add_done_callback(self, callback: Callable[[Future], None]) -> None:
        self._f.add_done_callback(lambda _: callback(self))

    def then(self, callback: Callable[[Future], Any]) -> Future:
        """A new future holding ``callback(self)`` (or its exception)."""
        out = Future()

        def chain(_: Future) -> None:
            try:
                out.set_result(callback(self))
            except BaseException as exc:
                out.set_exception(exc)

        self.add_done_callback(chain)
        return out

    def set_result(self, value: Any) -> None:
        self._f.set_result(value)

    def set_exception(self, error: BaseException) -> None:
        self._f.set_exception(error)


class NanFinding(Protocol):
    """An async-mode NaN check of a Work's inputs (nan_check.Pending), read
    once the operation completed."""

    def error(self, work_op: OpType, seq: int) -> NanError | None:
        """The NaN found, for the Work ``work_op`` (``seq``), or None."""

    def abandon(self) -> None:
        """The Work failed otherwise: the finding is not read."""


class WorkGroup(Protocol):
    """What a Work calls back into its group for (ProcessGroup is one).
    Plain attributes where the hot path reads them (no property calls)."""

    uid: int
    group_name: str
    group_desc: str
    diag: GroupView
    waits_block: bool  # wait() blocks the CPU: a CPU backend, or NCCL_PG_BLOCKING_WAIT
    blocking_wait: bool  # NCCL_PG_BLOCKING_WAIT: a wait() that raises aborts the group first

    def rank(self) -> int: ...

    def size(self) -> int: ...

    def comm_error(self) -> BaseException | None:
        """The communicator's asynchronous error, if any (never blocks)."""

    def diagnose_timeout(self, timeout: diagnosis.Timeout) -> None:
        """A Work passed its deadline: find out who is missing (asking every
        rank, within a small budget), then call ``timeout``'s finish."""

    def work_started(self, seq: int) -> None:
        """The collective ``seq`` started on the stream (timing on)."""

    def work_failing(self, error: BaseException) -> None:
        """A Work is about to fail with ``error`` (no NaN finding): error
        handling that ends the process does so before any waiter sees it."""

    def work_failed(self, error: BaseException) -> None:
        """A Work failed with ``error`` (no NaN finding), before any waiter
        wakes: a process that ends on the error must leave its dump."""

    def work_finished(self, work: Work, error: BaseException | None, p2p: bool) -> None:
        """``work`` finished (``error``: None on success; ``p2p``: a
        point-to-point operation, numbered apart from the collectives)."""

    def work_done_at_issue(self, work: Work, seq: int, p2p: bool) -> None:
        """``work`` (number ``seq``) succeeded, found complete by the thread
        that issued it before anyone else could see it (Work.complete_at_issue):
        work_started and work_finished in one, without their locks."""

    def make_caller_wait(self, end: Event) -> None:
        """Order the caller's stream after ``end`` (no CPU wait)."""

    def close_for_blocking_wait(self, error: BaseException) -> None:
        """Blocking-wait mode: a wait is about to raise ``error``; the group
        refuses later operations, saying why (its abort() follows)."""

    def abort(self) -> None:
        """Fail every pending and later operation at once; never blocks."""


class Work:
    """One issued operation (or one coalesced group of them)."""

    # No __slots__: a field most Works never change keeps its class default below, and issuing (every operation)
    # stores only the others.
    _finished = False  # successfully or not; set once, under _lock (or before anyone sees it: complete_at_issue)
    _waiters = 0  # threads in _wait_finished
    _error: BaseException | None = None
    _finished_wall: float | None = None
    _future: Future | None = None
    _duration_ms: float | None = None  # on the stream, once completed with timing on
    _nan_found: NanError | None = None
    _captured = False
    _diagnosing = False  # past its deadline, and the group's diagnosis asked to fail it
    _issued_wall = 0.0  # time.time() at issue, kept for timed Works only

    def __init__(self, group: WorkGroup, op_type: OpType, seq: int, outputs: list[Any], end: Event,
                 start: Event | None, timeout: float, entries: Sequence[Entry] | None = None,
                 peers: tuple[int, ...] | None = None, nan: Sequence[NanFinding] | None = None,
                 source: Callable[[], int | None] | None = None, launched: Event | None = None) -> None:
        """``source``: for a receive from any source, who sent (once done). ``launched``: an event the backend
        records when the operation's kernel is launched (NCCL's launchCompletionEvent): the exact "started"
        mark, which ``start`` (recorded on the stream before the operation, for its duration) gives otherwise."""
        self._group = group
        self.op_type = op_type
        self._seq = seq
        self._outputs = outputs
        self._end = end
        self._start = start
        self._timeout = timeout
        self._issued_mono = _monotonic()
        if start is not None:  # timed: info() reports when it was issued (only a timed Work gets a duration)
            self._issued_wall = _time()
        self._lock = _allocate_lock()
        self._entries = entries or ()  # flight-recorder entries this Work settles
        self._launched = launched
        self._started = start is None and launched is None
        # A point-to-point operation (also a coalesced group of only sends/recvs) is numbered by the p2p
        # count; ``peers`` are the group ranks it exchanges with.
        self._p2p = peers is not None
        self._peers = peers or ()
        self._nan = nan  # async NaN checks, read once the operation completed
        self._source = source

    @classmethod
    def captured(cls, group: WorkGroup, op_type: OpType, outputs: list[Any], end: Event,
                 peers: tuple[int, ...] | None, source: Callable[[], int | None] | None = None) -> Work:
        """An operation captured into a CUDA graph: done as far as the host
        is concerned (it runs at each replay, where nothing can watch it);
        ``wait()`` still orders the caller's stream after it, which also
        joins the group's stream back into the capture."""
        work = cls(group, op_type, 0, outputs, end, None, 0.0, None, peers, None, source)
        work._captured = True
        work._finished = True
        return work

    def __repr__(self) -> str:
        state = "pending" if not self._finished else ("failed" if self._error else "completed")
        return f"Work({self.op_type.name}, seq={self._seq}, group={self._group.group_name!r}, {state})"

    # --- completion ----------------------------------------------------------------

    def is_completed(self) -> bool:
        """Observe the operation without blocking; True once it has finished
        (successfully or not)."""
        if self._finished:
            return True
        if not self._started:
            mark = self._start if self._launched is None else self._launched
            if mark is not None and mark.query():
                self._mark_started()
        error = self._group.comm_error()
        if self._end.query():
            self._finish(self._describe(error) if error else self._nan_error())
        elif error is not None:
            self._finish(self._describe(error))
        elif time.monotonic() - self._issued_mono > self._timeout:
            self._timed_out()  # finished once the diagnosis knows which ranks are missing
        return self._finished

    def _nan_error(self) -> NanError | None:
        """The async NaN checks' finding (read once: racing pollers agree)."""
        if self._nan is None:  # none, or read already (``_nan`` is cleared only once ``_nan_found`` is set)
            return self._nan_found
        with self._lock:
            if self._nan is not None:
                found = [p.error(self.op_type, self._seq) for p in self._nan]
                self._nan_found = next((e for e in found if e is not None), None)
                self._nan = None
            return self._nan_found

    def _wait_finished(self, timeout: float | None = None) -> bool:
        """Block until whoever polls (the watchdog, a waiter) finished this
        Work, without polling it; False after ``timeout`` seconds. Rare
        (tests, diagnostics): the waiters of every Work share one condition,
        so that a Work costs no Event of its own."""
        with _finished_cond:
            self._waiters += 1
            try:
                return _finished_cond.wait_for(lambda: self._finished, timeout)
            finally:
                self._waiters -= 1

    def _describe(self, error: BaseException) -> DistBackendError:
        return DistBackendError(f"{self._where()} failed: {error}")

    def _where(self) -> str:
        g = self._group
        return (f"process group {g.uid} ({g.group_desc!r}), rank {g.rank()} of {g.size()}: "
                f"{verdicts.op_name(self.op_type.value)} #{self._seq}")

    def _timed_out(self) -> None:
        """Past its deadline: the group's diagnosis finds out who is missing,
        then fails it (once, whoever polls)."""
        with self._lock:
            if self._diagnosing or self._finished:
                return
            self._diagnosing = True
        elapsed = time.monotonic() - self._issued_mono
        text = f"timeout: {self._where()} ran for {elapsed:.3f} s, past its timeout of {self._timeout:.3f} s"

        def finish(why: str, path: str | None, culprits: tuple[Culprit, ...]) -> None:
            error = DistBackendError(f"{text}; {why}" + (f"; debug dump: {path}" if path else ""))
            error.culprits = culprits
            self._finish(error)

        group = self._group
        self._group.diagnose_timeout(diagnosis.Timeout(
            group.diag, self._seq, tuple(self._peers) if self._p2p else None, self._timeout,
            self._issued_mono + self._timeout, self.name(), text,
            finish))

    def _mark_started(self) -> None:
        self._started = True
        now = time.time_ns()
        for e in self._entries:
            e.state, e.time_discovered_started_ns = "started", now
        if not self._p2p:
            self._group.work_started(self._seq)

    def _retire(self, error: BaseException | None) -> None:
        """Settle the flight-recorder entries: retired, and completed unless
        it failed (retired but not completed reads as timed out/failed). A
        NaN found by the async check fails the Work, but the operation ran."""
        now = time.time_ns()
        ran = error is None or isinstance(error, NanError)
        if self._start is not None and ran:
            try:
                self._duration_ms = self._start.elapsed_ms(self._end)
            except Exception:  # no duration rather than a Work that never completes
                self._duration_ms = None
        for e in self._entries:
            e.retired = True
            if ran:
                e.state, e.time_discovered_completed_ns, e.duration_ms = "completed", now, self._duration_ms

    def complete_at_issue(self) -> bool:
        """A Work whose end event completed before it was handed to anyone (a
        CPU backend with nothing queued before it): finished by the issuing
        thread as ``_finish`` would, without its lock (no other thread can see
        it yet) and with one clock read. False if it must go the usual way (a
        communicator error, NaN checks or timing to read)."""
        if self._nan is not None or self._start is not None or self._launched is not None:
            return False
        if self._group.comm_error() is not None:
            return False
        now = _time_ns()
        self._finished_wall = now / 1e9
        self._started = self._finished = True
        for e in self._entries:
            e.state, e.retired = "completed", True
            e.time_discovered_started_ns = e.time_discovered_completed_ns = now
        self._group.work_done_at_issue(self, self._seq, self._p2p)
        return True

    def _finish(self, error: BaseException | None) -> None:
        if error is not None and not isinstance(error, NanError) and not self._finished:
            self._group.work_failing(error)
        with self._lock:
            if self._finished:
                return
            self._error = error
            self._finished_wall = time.time()
            if self._nan is not None:  # failed otherwise before its checks were read
                for p in self._nan:
                    p.abandon()
                self._nan = None
            if error is None and not self._started:
                self._mark_started()
            self._retire(error)
            self._finished = True
            future = self._future
        if error is not None and not isinstance(error, NanError):
            self._group.work_failed(error)
        if self._waiters:  # read after the write: a waiter counted later sees the flag (see _wait_finished)
            with _finished_cond:
                _finished_cond.notify_all()
        if future is not None:
            self._settle(future)
        self._group.work_finished(self, error, self._p2p)

    def _settle(self, future: Future) -> None:
        if self._error is not None:
            future.set_exception(self._error)
        else:
            future.set_result(self._outputs)

    # --- public API -------------------------------------------------------------------

    @property
    def seq(self) -> int:
        return self._seq

    @property
    def issued_at(self) -> float:
        """When it was issued (``time.monotonic()``)."""
        return self._issued_mono

    def name(self) -> str:
        """The operation as every tool names it: "all_reduce #2 of group 0" (a
        point-to-point operation by its own count: "send #3 of group 0")."""
        return verdicts.collective(self.op_type.value, self._seq, self._group.group_name)

    @property
    def deadline(self) -> float:
        """When it times out (``time.monotonic()``)."""
        return self._issued_mono + self._timeout

    def is_success(self) -> bool:
        return self.is_completed() and self._error is None

    def exception(self) -> BaseException | None:
        self.is_completed()
        return self._error

    def wait(self, timeout: Timeout | None = None) -> bool:
        """Block until the operation completes and its outputs can be read;
        raise DistBackendError if it failed, timed out (group timeout), or is
        still running after ``timeout`` (seconds >= 0 or a timedelta; given,
        the CPU waits for the operation on every backend, as torch's does;
        ``None`` or ``inf``: no limit of the wait's own, the group timeout
        still ends the operation). In blocking-wait mode
        (``NCCL_PG_BLOCKING_WAIT``) a wait that raises aborts the group
        first, as torch's does: later operations fail at once, with the
        reason, instead of queueing behind the failed one."""
        seconds = None if timeout is None else to_seconds(timeout, "wait(timeout)", zero=True, forever=True)
        limit = None if seconds is None else time.monotonic() + seconds
        if self._finished and self._error is None and not self._captured:
            return True  # its end event completed: nothing is left for the CPU or a device stream to wait for
        group = self._group
        if self._captured:
            group.make_caller_wait(self._end)
            return True
        if group.waits_block or limit is not None:
            while not self.is_completed():
                now = time.monotonic()
                if limit is not None and now >= limit:
                    error = DistBackendError(f"timeout: {self._where()} not complete after wait({timeout}): Timed out "
                                             f"waiting {1000 * (seconds or 0):.0f}ms for it")
                    if group.blocking_wait:
                        self._abort_group(error)
                    raise error
                left = _WAIT_SLICE if limit is None else min(_WAIT_SLICE, limit - now)
                self._end.synchronize(max(left, 0.0))
        else:
            group.make_caller_wait(self._end)
            self.is_completed()
        if self._error is not None:
            if group.blocking_wait and not isinstance(self._error, NanError):  # a data error: the group is fine
                self._abort_group(self._error)
            raise self._error
        return True

    def _abort_group(self, error: BaseException) -> None:
        """Blocking wait: a ``wait()`` about to raise ``error`` aborts the
        group first (torch's blocking wait aborts its communicators too), so
        later operations fail at once with the reason instead of queueing
        behind the failed one. An abort of this process's own making: the
        error-handling mode does not act on it."""
        self._group.close_for_blocking_wait(error)
        self._finish(error if isinstance(error, DistBackendError) else DistBackendError(str(error)))
        self._group.abort()

    def get_future(self) -> Future:
        with self._lock:
            if self._future is None:
                self._future = Future()
                if self._finished:
                    self._settle(self._future)
            return self._future

    def result(self) -> list[Any]:
        return self._outputs

    def source_rank(self) -> int:
        """The group rank a receive got its data from (for a receive from
        any source, known once it completed)."""
        if self.op_type is not OpType.RECV or (self._source is None and len(self._peers) != 1):
            raise ValueError(f"source_rank: {self!r} is not a receive")
        if self._source is None:
            return self._peers[0]
        source = self._source() if self.is_success() else None
        if source is None:
            raise ValueError(f"source_rank: {self!r} has not received anything yet (wait() for it first)")
        return source

    def _get_duration(self) -> float:
        """Milliseconds the operation ran on its stream (timing must be on)."""
        if self._start is None:
            raise RuntimeError("Work duration needs timing: set NCCL_PG_ENABLE_TIMING=1 or register a "
                               "completion hook before issuing the operation")
        if not self.is_completed():
            raise RuntimeError(f"{self!r}: duration asked before completion")
        return self._start.elapsed_ms(self._end)

    def info(self) -> WorkInfo:
        """What a completion hook receives about it."""
        started = finished = active = None
        if self._duration_ms is not None:
            active = timedelta(milliseconds=self._duration_ms)
            started = datetime.fromtimestamp(self._issued_wall)
            finished = datetime.fromtimestamp(self._finished_wall or time.time())
        return WorkInfo(self.op_type, self._seq, started, finished, active)
