"""CUDA streams and events behind the Stream/Event contract (cuda.bindings
runtime API).

Events are queried without blocking; ``synchronize(timeout)`` polls with a
short backoff instead of cudaEventSynchronize, so it is bounded and returns
early once the owning communicator is aborted. A stream keeps references to
the buffers of the operations enqueued on it until an event recorded after
them completes, so memory is never freed (and reused by an allocator) while
NCCL still reads or writes it.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from typing import Any

from ..base import Event, Stream
from . import graph_life
from ._lib import check_cuda, cudart
from .device import device_guard, on_own_thread, restore_device
from .memory import DeviceMemory, free_released

_NOT_READY = 600  # cudaErrorNotReady
_CAPTURE_NONE = 0  # cudaStreamCaptureStatusNone
_CAPTURE_ACTIVE = 1  # cudaStreamCaptureStatusActive


class _AbortFlag:
    """Shared by a communicator and its streams: set by abort()."""

    __slots__ = ("aborted",)

    def __init__(self) -> None:
        self.aborted = False


# CUDA events of dead CudaEvents, per (device, timing), for the next ones: an event is re-recorded at each use,
# and the last reference to a CudaEvent may go on any thread (a watchdog thread retiring a Work), where a CUDA
# call (cudaEventDestroy) would create a context on GPU 0 if that thread never chose a device.
_spare_events: dict[tuple[int, bool], list[Any]] = {}


class CudaEvent(Event):
    __slots__ = ("handle", "device", "timing", "flag", "refs", "recorded")  # the last three: set by its stream

    def __init__(self, device: int, timing: bool = False, flag: _AbortFlag | None = None) -> None:
        spare = _spare_events.get((device, timing))
        try:
            self.handle = spare.pop() if spare else None
        except IndexError:  # another thread took the last one
            self.handle = None
        if self.handle is None:
            rt = cudart()
            flags = rt.cudaEventDefault if timing else rt.cudaEventDisableTiming
            prev = device_guard(device)
            try:
                self.handle = check_cuda(rt.cudaEventCreateWithFlags(flags), "cudaEventCreateWithFlags")
            finally:
                restore_device(prev)
        self.device, self.timing, self.flag = device, timing, flag
        self.refs: list[Any] | None = None
        self.recorded = False

    def __del__(self) -> None:
        handle = getattr(self, "handle", None)
        if handle is not None:
            _spare_events.setdefault((self.device, self.timing), []).append(handle)

    def query(self) -> bool:
        if not self.recorded:
            return True  # never recorded: complete, as cudaEventQuery says
        if on_own_thread(self.device):
            device_guard(self.device)  # the watchdog's poller: on this event's device, not on GPU 0
        (err,) = cudart().cudaEventQuery(self.handle)
        code = int(err)
        if code == 0:
            self.refs = None  # the operations before it are done: their buffers may go
            return True
        if code == _NOT_READY:
            return False
        check_cuda((err,), "cudaEventQuery")
        return False

    def synchronize(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = 20e-6
        while not self.query():
            if self.flag is not None and self.flag.aborted:
                return True
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)
        return True

    def elapsed_ms(self, end: Event) -> float:
        if not isinstance(end, CudaEvent):
            raise TypeError(f"elapsed_ms needs a CudaEvent, got {type(end).__name__}")
        if not (self.timing and end.timing):
            raise RuntimeError("elapsed_ms: both events must be created with timing=True")
        return float(check_cuda(cudart().cudaEventElapsedTime(self.handle, end.handle), "cudaEventElapsedTime"))


class CudaStream(Stream):
    """A CUDA stream, created (non-blocking w.r.t. the legacy stream) or wrapped."""

    def __init__(self, device: int, high_priority: bool = False, flag: _AbortFlag | None = None,
                 handle: Any = None) -> None:
        rt = cudart()
        self.device, self._flag, self._owned = device, flag, handle is None
        if handle is None:
            prev = device_guard(device)
            try:
                prio = 0
                if high_priority:
                    _least, greatest = check_cuda(rt.cudaDeviceGetStreamPriorityRange(),
                                                  "cudaDeviceGetStreamPriorityRange")
                    prio = greatest
                handle = check_cuda(rt.cudaStreamCreateWithPriority(rt.cudaStreamNonBlocking, prio),
                                    "cudaStreamCreateWithPriority")
            finally:
                restore_device(prev)
        self.handle = handle
        self.ptr = int(handle)
        self._pending: list[Any] = []  # buffers of operations enqueued since the last record()
        self._inflight: collections.deque[CudaEvent] = collections.deque()
        self._caller_event: CudaEvent | None = None  # reused by wait_stream
        self._graph_refs: list[Any] = []  # buffers of captured operations: every replay reads them

    def __repr__(self) -> str:
        return f"CudaStream(cuda:{self.device}, 0x{self.ptr:x})"

    def keep(self, *refs: Any) -> None:
        """Keep ``refs`` alive until the work enqueued so far completes."""
        self._pending.extend(refs)

    def record(self, event: Event | None = None) -> CudaEvent:
        ev = CudaEvent(self.device, flag=self._flag) if event is None else event
        if not isinstance(ev, CudaEvent):
            raise TypeError(f"a CudaStream records CudaEvents, got {type(ev).__name__}")
        capturing = self.capturing
        if capturing:  # no event queries during a capture; the graph may replay any time later
            for ref in self._pending:
                if isinstance(ref, DeviceMemory) and ref.captured:
                    ref.free_on(self.handle)  # a graph allocation: freed in the graph, after its last use and
                    # before the event (whoever joins the capture back through it also waits for the free)
                else:
                    self._graph_refs.append(ref)
            self._pending = []
        check_cuda(cudart().cudaEventRecord(ev.handle, self.handle), "cudaEventRecord")
        ev.recorded = True
        if ev.flag is None:
            ev.flag = self._flag
        if capturing:
            return ev
        if self._pending:
            ev.refs, self._pending = self._pending, []
            self._inflight.append(ev)
        while self._inflight and self._inflight[0].query():  # drop what completed
            self._inflight.popleft()
        return ev

    def wait_event(self, event: Event) -> None:
        if not isinstance(event, CudaEvent):
            raise TypeError(f"a CudaStream waits on CudaEvents, got {type(event).__name__}")
        if event.recorded:
            check_cuda(cudart().cudaStreamWaitEvent(self.handle, event.handle, 0), "cudaStreamWaitEvent")

    def wait_stream(self, other: int) -> None:
        """Later work here waits for what ``other`` (a raw handle) has enqueued so far."""
        ev = self._caller_event
        if ev is None:  # one event, re-recorded each time: a wait takes the event's state when issued
            ev = self._caller_event = CudaEvent(self.device)
        check_cuda(cudart().cudaEventRecord(ev.handle, other), "cudaEventRecord")
        check_cuda(cudart().cudaStreamWaitEvent(self.handle, ev.handle, 0), "cudaStreamWaitEvent")

    @property
    def capturing(self) -> bool:
        status = check_cuda(cudart().cudaStreamIsCapturing(self.handle), "cudaStreamIsCapturing")
        return int(status) != _CAPTURE_NONE

    def capture_id(self) -> int:
        """cudaStreamGetCaptureInfo's id of the capture this stream takes part in ("unique over the lifetime of
        the process"); 0 when it does not capture."""
        err, status, cid, *_ = cudart().cudaStreamGetCaptureInfo(self.handle)
        check_cuda((err,), "cudaStreamGetCaptureInfo")
        return int(cid) if int(status) == _CAPTURE_ACTIVE else 0

    def capture_gone(self) -> Callable[[], bool] | None:
        """A CUDA user object owned by the graph being captured (cudaUserObjectCreate, cudaGraphRetainUserObject
        with cudaGraphUserObjectMove: Programming Guide, "CUDA User Objects"): its destructor runs once the graph
        and every instantiation are destroyed, on a CUDA thread that may not call CUDA or block. It is libc's
        sem_post on a semaphore of ours: no Python, no lock, no GIL in that thread; the probe reads the count."""
        err, status, _, graph, *_ = cudart().cudaStreamGetCaptureInfo(self.handle)
        check_cuda((err,), "cudaStreamGetCaptureInfo")
        if int(status) != _CAPTURE_ACTIVE or graph is None:
            return None
        return graph_life.attach(graph)

    def record_replayed(self, event: Event) -> None:
        """An event record node in the capture (cudaEventRecordWithFlags with cudaEventRecordExternal): every
        replay of the graph records ``event`` there again, and the host can query it; before the first replay
        it is complete (CUDA: an event never recorded "represents an empty set of work")."""
        if not isinstance(event, CudaEvent):
            raise TypeError(f"a CudaStream records CudaEvents, got {type(event).__name__}")
        rt = cudart()
        check_cuda(rt.cudaEventRecordWithFlags(event.handle, self.handle, rt.cudaEventRecordExternal),
                   "cudaEventRecordWithFlags(cudaEventRecordExternal)")
        event.recorded = True
        if event.flag is None:
            event.flag = self._flag

    def query(self) -> bool:
        (err,) = cudart().cudaStreamQuery(self.handle)
        if int(err) == 0:
            return True
        if int(err) == _NOT_READY:
            return False
        check_cuda((err,), "cudaStreamQuery")
        return False

    def synchronize(self, timeout: float | None = None) -> bool:
        return self.record().synchronize(timeout)

    def release_kept(self) -> None:
        """Forget the buffers of the operations an abort or revoke stopped."""
        self._pending.clear()

    def release(self) -> None:
        """Forget the kept buffers (after abort/destroy) and destroy an owned stream."""
        self._pending.clear()
        self._inflight.clear()
        self._graph_refs.clear()
        prev = device_guard(self.device)
        try:
            free_released(self.device)
            if self._owned and self.handle is not None:
                cudart().cudaStreamDestroy(self.handle)
                self.handle = None
        except Exception:
            pass
        finally:
            restore_device(prev)
