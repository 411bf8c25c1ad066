"""Host streams and events: CUDA's semantics on CPU threads.

A stream is a worker thread running its queue in order. An event is a marker
recorded on a stream; it completes when the stream reaches it, can be queried
without blocking, waited on with a deadline, and timed. A stream can wait for
another stream's event. After an abort the stream keeps draining: aborted
operations fail at once and markers complete, as CUDA work does after
ncclCommAbort, so nothing waits on a dead stream.

An idle stream (nothing queued, nothing running) costs no thread round trip
where none is needed: an event recorded on it is complete at once, and
``run_or_enqueue`` runs a task in the calling thread (the communicator uses it
when there is nothing to communicate). A pending event holds a lock, not a
``threading.Event`` (a Condition and two locks, microseconds to make and set).
"""

from __future__ import annotations

import _thread
import collections
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from ..base import Event, Stream

log = logging.getLogger(__name__)

# How often a stream blocked on another stream's event checks for abort.
_ABORT_POLL = 0.02
# close()'s default bound on finishing what is queued: host operations on a closing stream are local or
# already failed, so seconds are plenty.
_CLOSE_TIMEOUT = 5.0
# Local work up to this size (a copy, a one-rank collective) may run inline on an idle stream
# (``run_or_enqueue``): the thread round trip would cost more than the work. Larger work stays on the
# stream's thread, where the caller can overlap it with its own (numpy releases the GIL in copies).
INLINE_BYTES = 64 * 1024

Task = Callable[[], None]
_now_ns, _allocate_lock = time.perf_counter_ns, threading.Lock


class HostEvent(Event):
    """Complete when ``_gate`` is None; while pending, ``_gate`` is a lock held
    until the stream reaches the event: waiters block acquiring it (and pass
    it on), the stream releases it. A lock costs far less than an Event."""

    __slots__ = ("_gate", "time_ns")

    def __init__(self) -> None:
        self._gate: _thread.LockType | None = None  # never recorded: complete, as cudaEventQuery says
        self.time_ns: int | None = None

    def query(self) -> bool:
        return self._gate is None

    def synchronize(self, timeout: float | None = None) -> bool:
        gate = self._gate
        if gate is None:
            return True
        if not gate.acquire(True, -1 if timeout is None else max(timeout, 0.0)):
            return False
        gate.release()  # the next waiter's turn
        return True

    def arm(self) -> None:
        """Its stream recorded it: pending until ``fire``."""
        if self._gate is None:  # recorded again while pending: it completes at the first of its markers, as before
            gate = _allocate_lock()
            gate.acquire()
            self._gate = gate
        self.time_ns = None

    def fire(self) -> None:
        """Everything its stream ran before it is done: complete now."""
        gate = self._gate
        self.time_ns, self._gate = _now_ns(), None
        if gate is not None:
            gate.release()

    def elapsed_ms(self, end: Event) -> float:
        if not isinstance(end, HostEvent):
            raise TypeError(f"elapsed_ms needs a HostEvent, got {type(end).__name__}")
        if self.time_ns is None or end.time_ns is None:
            raise RuntimeError("elapsed_ms: both events must be recorded and complete")
        return (end.time_ns - self.time_ns) / 1e6


class HostStream(Stream):
    """An in-order queue with a worker thread. An event recorded behind
    queued or running work rides on it (fired when it finishes) rather than
    taking a turn of its own in the queue."""

    capturing = False  # never in a CUDA graph (a plain attribute: read on every operation)

    def __init__(self, name: str, on_error: Callable[[BaseException], None] | None = None) -> None:
        self.name = name
        self._on_error = on_error
        # [kind ("task" or "wait"), the task or the event waited for, the events recorded behind it or None]
        self._queue: collections.deque[list[Any]] = collections.deque()
        # The worker waits on the condition for work; everyone else takes its lock directly (a ``with`` on the
        # lock itself runs no Python code, the condition's does: every operation takes it three times).
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._busy = False  # an item is running (on the worker, or a task inline in a caller)
        self._then: list[HostEvent] | None = None  # events recorded behind the running item
        self._closing = False
        self.aborted = False
        self._thread = threading.Thread(target=self._run, name=f"nccl_pg-{name}", daemon=True)
        self._thread.start()

    def __repr__(self) -> str:
        return f"HostStream({self.name})"

    # --- enqueue ---------------------------------------------------------------

    def _put(self, kind: str, item: object) -> None:
        """Call holding the lock."""
        if self._closing:
            raise RuntimeError(f"{self!r} is closed")
        self._queue.append([kind, item, None])
        self._cond.notify()

    def enqueue(self, task: Task) -> None:
        with self._lock:
            self._put("task", task)

    def run_or_enqueue(self, task: Task) -> None:
        """Run ``task`` now in the calling thread when the stream is idle (it
        would run next anyway, and the caller's thread is free), else enqueue
        it. The stream is busy while it runs: work enqueued meanwhile waits."""
        with self._lock:
            if self._queue or self._busy:
                self._put("task", task)
                return
            if self._closing:
                raise RuntimeError(f"{self!r} is closed")
            self._busy = True
        try:
            self._run_task(task)
        finally:
            self._done()

    def record(self, event: Event | None = None) -> HostEvent:
        if event is None:
            ev = HostEvent()
        elif isinstance(event, HostEvent):
            ev = event
        else:
            raise TypeError(f"a HostStream records HostEvents, got {type(event).__name__}")
        with self._lock:  # armed under the lock so a racing query never sees a stale "complete"
            if self._closing:
                raise RuntimeError(f"{self!r} is closed")
            if self._queue:
                ev.arm()
                last = self._queue[-1]
                if last[2] is None:
                    last[2] = [ev]
                else:
                    last[2].append(ev)
            elif self._busy:
                ev.arm()
                if self._then is None:
                    self._then = [ev]
                else:
                    self._then.append(ev)
            else:
                ev.fire()  # everything before it has run: complete now
        return ev

    def wait_event(self, event: Event) -> None:
        if not isinstance(event, HostEvent):
            raise TypeError(f"a HostStream waits on HostEvents, got {type(event).__name__}")
        if not event.query():
            with self._lock:
                self._put("wait", event)

    def query(self) -> bool:
        with self._lock:
            return not self._queue and not self._busy

    def synchronize(self, timeout: float | None = None) -> bool:
        return self.record().synchronize(timeout)

    # --- worker ----------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._lock:
                while self._busy or not self._queue:  # busy: a caller runs a task inline
                    if self._closing and not self._queue:
                        return
                    self._cond.wait()
                kind, item, self._then = self._queue.popleft()
                self._busy = True
            try:
                if kind == "task":
                    self._run_task(item)
                else:
                    while not item.synchronize(_ABORT_POLL) and not self.aborted:
                        pass
            finally:
                self._done()
            kind = item = None  # hold no task (and what it references) while idle

    def _done(self) -> None:
        """The running item finished: fire the events recorded behind it."""
        with self._lock:
            self._busy = False
            then, self._then = self._then, None
            if then is not None:
                for ev in then:
                    ev.fire()
            if self._queue:
                self._cond.notify()

    def _run_task(self, task: Task) -> None:
        try:
            task()
        except BaseException as exc:  # the stream must survive; the owner records the failure
            if self._on_error is not None:
                self._on_error(exc)
            else:
                log.error("%r: operation failed: %s", self, exc)

    def close(self, timeout: float = _CLOSE_TIMEOUT) -> None:
        """Finish what is queued (bounded by ``timeout``), then stop the thread."""
        with self._lock:
            self._closing = True
            self._cond.notify()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)
