"""Host streams and events: CUDA's semantics on CPU threads.

A stream is a worker thread running its queue in order. An event is a marker
recorded on a stream; it completes when the stream reaches it, can be queried
without blocking, waited on with a deadline, and timed. A stream can wait for
another stream's event. After an abort the stream keeps draining: aborted
operations fail at once and markers complete, as CUDA work does after
ncclCommAbort, so nothing waits on a dead stream.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable

from ..base import Event, Stream

log = logging.getLogger(__name__)

# How often a stream blocked on another stream's event checks for abort.
_ABORT_POLL = 0.02


class HostEvent(Event):
    __slots__ = ("_done", "time_ns")

    def __init__(self) -> None:
        self._done = threading.Event()
        self._done.set()  # never recorded: complete, as cudaEventQuery says
        self.time_ns: int | None = None

    def _arm(self) -> None:
        self._done.clear()
        self.time_ns = None

    def _fire(self) -> None:
        self.time_ns = time.perf_counter_ns()
        self._done.set()

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)

    def elapsed_ms(self, end: Event) -> float:
        if not isinstance(end, HostEvent):
            raise TypeError(f"elapsed_ms needs a HostEvent, got {type(end).__name__}")
        if self.time_ns is None or end.time_ns is None:
            raise RuntimeError("elapsed_ms: both events must be recorded and complete")
        return (end.time_ns - self.time_ns) / 1e6


Task = Callable[[], None]


class HostStream(Stream):
    """An in-order queue with a worker thread."""

    def __init__(self, name: str, on_error: Callable[[BaseException], None] | None = None) -> None:
        self.name = name
        self._on_error = on_error
        self._queue: collections.deque[tuple[str, object]] = collections.deque()
        self._cond = threading.Condition()
        self._busy = False
        self._closing = False
        self.aborted = False
        self._thread = threading.Thread(target=self._run, name=f"nccl_pg-{name}", daemon=True)
        self._thread.start()

    def __repr__(self) -> str:
        return f"HostStream({self.name})"

    # --- enqueue ---------------------------------------------------------------

    def _put(self, kind: str, item: object) -> None:
        with self._cond:
            if self._closing:
                raise RuntimeError(f"{self!r} is closed")
            self._queue.append((kind, item))
            self._cond.notify()

    def enqueue(self, task: Task) -> None:
        self._put("task", task)

    def record(self, event: Event | None = None) -> HostEvent:
        ev = HostEvent() if event is None else event
        if not isinstance(ev, HostEvent):
            raise TypeError(f"a HostStream records HostEvents, got {type(ev).__name__}")
        with self._cond:  # arm under the lock so a racing query never sees a stale "complete"
            ev._arm()
            self._put("record", ev)
        return ev

    def wait_event(self, event: Event) -> None:
        if not isinstance(event, HostEvent):
            raise TypeError(f"a HostStream waits on HostEvents, got {type(event).__name__}")
        if not event.query():
            self._put("wait", event)

    def query(self) -> bool:
        with self._cond:
            return not self._queue and not self._busy

    def synchronize(self, timeout: float | None = None) -> bool:
        return self.record().synchronize(timeout)

    # --- worker ----------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait()
                if not self._queue:
                    return
                kind, item = self._queue.popleft()
                self._busy = True
            try:
                if kind == "task":
                    self._run_task(item)  # type: ignore[arg-type]
                elif kind == "record":
                    item._fire()  # type: ignore[attr-defined]
                else:
                    while not item.synchronize(_ABORT_POLL) and not self.aborted:  # type: ignore[attr-defined]
                        pass
            finally:
                with self._cond:
                    self._busy = False

    def _run_task(self, task: Task) -> None:
        try:
            task()
        except BaseException as exc:  # the stream must survive; the owner records the failure
            if self._on_error is not None:
                self._on_error(exc)
            else:
                log.error("%r: operation failed: %s", self, exc)

    def close(self, timeout: float = 5.0) -> None:
        """Finish what is queued (bounded by ``timeout``), then stop the thread."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)
