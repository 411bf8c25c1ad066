"""Simulated CUDA runtime and driver: ``cuda.bindings.runtime`` and
``cuda.bindings.driver`` as nccl_pg's NCCL backend and the simulated NCCL use
them, without a GPU. It proves our logic against CUDA's documented rules, never
GPU behaviour.

What it keeps from the real bindings: their types and enums (``cudaStream_t``,
``cudaEvent_t``, ``cudaError_t``, ...), their signatures, and their argument
checks: on a machine without a driver every call is first made on the real
``cuda.bindings.runtime`` (which converts the arguments, then returns
``cudaErrorInsufficientDriver``), so an argument the real binding rejects is
rejected here with the same exception.

What it models (each rule names the CUDA document it follows):
- device memory is host memory (numpy buffers; a device pointer is the
  buffer's address), so results can be checked against numpy;
- streams run their work in order on one worker thread each; the legacy
  default stream synchronizes with blocking streams of its device, not with
  ``cudaStreamNonBlocking`` ones (CUDA Runtime API, "Stream synchronization
  behavior");
- events with and without timing; ``cudaEventElapsedTime`` on an event
  created with ``cudaEventDisableTiming`` returns
  ``cudaErrorInvalidResourceHandle`` (Runtime API, cudaEventElapsedTime);
- a current device per thread, 0 until ``cudaSetDevice``; a call that needs a
  context creates the primary context of the current device, and since CUDA
  12 ``cudaSetDevice`` does (Programming Guide, "Initialization"). A context
  on a device where the process allocates nothing and creates no stream,
  event or communicator is recorded as a violation (the bug that puts every
  rank's context on GPU 0: a side thread querying events or restoring device
  0 without ever choosing its device);
- ``cudaFree`` and ``cudaMalloc`` synchronize the device (Runtime API notes
  on cudaFree: "implicit synchronization"); ``cudaMallocAsync``/
  ``cudaFreeAsync`` are stream-ordered (Programming Guide, "Stream Ordered
  Memory Allocator");
- stream capture: work enqueued on a capturing stream goes into the graph;
  waiting on an event recorded in a capture joins the waiting stream; a
  capture whose joined streams did not rejoin fails with
  ``cudaErrorStreamCaptureUnjoined``; "potentially unsafe" calls (cudaMalloc,
  cudaFree, synchronous copies, queries and synchronizations) are refused with
  ``cudaErrorStreamCaptureUnsupported`` and invalidate the capture as
  ``cudaThreadExchangeStreamCaptureMode``'s modes say (global: any thread;
  thread-local: the capturing thread; relaxed: never);
- a happens-before check of stream work: an operation that reads or writes
  memory last written by another stream's operation it is not ordered after
  (no event wait, no host synchronization in between) is recorded as a race.

Violations are collected (``violations()``); the tests fail on any.
"""

from __future__ import annotations

import ctypes
import inspect
import itertools
import threading
import time
import types
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
from cuda.bindings import driver as real_driver  # type: ignore[import-untyped]
from cuda.bindings import runtime as real_runtime  # type: ignore[import-untyped]

from . import module_load  # the driver's versions and module loads (the NVRTC/driver pairing)

E = real_runtime.cudaError_t
OK = E.cudaSuccess
_MODE = real_runtime.cudaStreamCaptureMode
_STATUS = real_runtime.cudaStreamCaptureStatus
_H2D, _D2H, _D2D, _DEFAULT = 1, 2, 3, 4
_LEGACY, _PER_THREAD = 1, 2  # cudaStreamLegacy, cudaStreamPerThread (0 is the legacy stream too)
_ALIGN = 256


class SimError(Exception):
    """A misuse the simulation cannot turn into a CUDA error code."""


# --- violations --------------------------------------------------------------------------------

class Violations:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.items: list[str] = []

    def record(self, what: str) -> None:
        with self._lock:
            if what not in self.items:
                self.items.append(what)


# --- memory ------------------------------------------------------------------------------------

class Alloc:
    """One allocation: device memory (or pinned host memory) backed by a numpy buffer."""

    __slots__ = ("ptr", "size", "device", "kind", "buf", "freed", "last_write", "stream_ordered", "graph",
                 "label")

    def __init__(self, size: int, device: int, kind: str) -> None:
        raw = np.zeros(max(size, 1) + _ALIGN, np.uint8)
        start = (-raw.ctypes.data) % _ALIGN
        self.buf = raw[start:start + max(size, 1)]
        self.ptr = int(self.buf.ctypes.data)
        self.size, self.device, self.kind = size, device, kind
        self.freed: str | None = None
        self.last_write: tuple[int, int] | None = None  # (stream id, position) of the latest writer
        self.stream_ordered = False
        self.graph: Any = None  # the capture that allocated it (a graph allocation)
        self.label = ""


class Memory:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.live: dict[int, Alloc] = {}
        self.graveyard: list[Alloc] = []  # freed buffers stay referenced: a racy access reads garbage, not freed RAM

    def add(self, a: Alloc) -> None:
        with self._lock:
            self.live[a.ptr] = a

    def remove(self, a: Alloc, why: str) -> None:
        with self._lock:
            self.live.pop(a.ptr, None)
            a.freed = why
            self.graveyard.append(a)

    def find(self, ptr: int, nbytes: int = 1, freed_too: bool = False) -> Alloc | None:
        with self._lock:
            pools: Iterable[Alloc] = list(self.live.values()) + (self.graveyard if freed_too else [])
        for a in pools:
            if a.ptr <= ptr and ptr + max(nbytes, 1) <= a.ptr + max(a.size, 1):
                return a
        return None


# --- streams, events, captures -------------------------------------------------------------------

class Capture:
    def __init__(self, origin: Stream, mode: int, thread: int) -> None:
        self.origin, self.mode, self.thread = origin, mode, thread
        self.nodes: list[tuple[str, Callable[[], None]]] = []
        self.joined: dict[int, Stream] = {origin.id: origin}
        self.count: dict[int, int] = {origin.id: 0}  # nodes captured per stream
        self.rejoined: dict[int, int] = {}  # stream id -> its node count when the origin last waited on it
        self.invalid: str | None = None
        self.allocs: list[Alloc] = []
        self.frees: set[int] = set()


class Graph:
    def __init__(self, capture: Capture) -> None:
        self.nodes = list(capture.nodes)
        self.unfreed = [a for a in capture.allocs if a.ptr not in capture.frees]
        self.launched = False


class Stream:
    _ids = itertools.count(1)

    def __init__(self, sim: Sim, device: int, blocking: bool, priority: int = 0, legacy: bool = False,
                 handle: int | None = None) -> None:
        self.sim, self.device, self.blocking, self.priority, self.legacy = sim, device, blocking, priority, legacy
        self.id = next(Stream._ids)
        self.handle = handle if handle is not None else 0x7000_0000 + self.id * 0x10
        self.cv = threading.Condition()
        self.queue: deque[tuple[int, Callable[[], object], str]] = deque()
        self.enq = 0  # positions handed out
        self.done = 0  # positions executed
        self.vc: dict[int, int] = {}  # stream id -> position ordered before this stream's next operation
        self.capture: Capture | None = None
        self.destroyed = False
        self._worker: threading.Thread | None = None

    def enqueue(self, name: str, fn: Callable[[], None], reads: Iterable[Alloc] = (),
                writes: Iterable[Alloc] = ()) -> int:
        """Append work (or capture it); returns its position (0 when captured)."""
        sim = self.sim
        if self.capture is not None:
            cap = self.capture
            cap.nodes.append((name, fn))
            cap.count[self.id] = cap.count.get(self.id, 0) + 1
            return 0
        if self.legacy:
            sim.legacy_sync(self)
        elif self.blocking:
            legacy = sim.legacy_stream(self.device)
            if legacy is not self:
                self._after(legacy, legacy.enq)
        with sim.clock_lock:
            for sid, pos in sim.host_clock.items():
                if self.vc.get(sid, 0) < pos:
                    self.vc[sid] = pos
        with self.cv:  # a position and its place in the queue in one step: threads share streams (legacy)
            self.enq += 1
            pos = self.enq
            sim.check_access(self, pos, name, reads, writes)
            self.queue.append((pos, fn, name))
            if self._worker is None:
                self._worker = threading.Thread(target=self._run, name=f"simcuda-stream-{self.id}", daemon=True)
                self._worker.start()
            self.cv.notify_all()
        return pos

    def _after(self, other: Stream, pos: int) -> None:
        """Make later work here wait for ``other`` up to ``pos`` (an implicit event)."""
        if pos <= self.vc.get(other.id, 0) or other is self:
            return
        for sid, p in list(other.vc.items()) + [(other.id, pos)]:
            if self.vc.get(sid, 0) < p:
                self.vc[sid] = p
        self.enqueue_raw(lambda: other.wait_pos(pos), f"implicit wait for stream {other.id} up to {pos}")

    def enqueue_raw(self, fn: Callable[[], object], name: str) -> None:
        with self.cv:
            self.enq += 1
            self.queue.append((self.enq, fn, name))
            if self._worker is None:
                self._worker = threading.Thread(target=self._run, name=f"simcuda-stream-{self.id}", daemon=True)
                self._worker.start()
            self.cv.notify_all()

    def _run(self) -> None:
        while True:
            with self.cv:
                while not self.queue:
                    if self.destroyed or self.sim.closed:
                        return
                    self.cv.wait(0.5)
                pos, fn, _ = self.queue[0]
            try:
                fn()
            except BaseException as exc:  # a fault in simulated device work
                self.sim.violations.record(f"stream {self.id} (device {self.device}): device work failed: "
                                           f"{type(exc).__name__}: {exc}")
            with self.cv:
                self.queue.popleft()
                self.done = pos
                self.cv.notify_all()

    def wait_pos(self, pos: int, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.cv:
            while self.done < pos:
                if self.sim.closed:
                    return False
                left = 0.5 if deadline is None else min(0.5, deadline - time.monotonic())
                if left <= 0:
                    return False
                self.cv.wait(left)
        return True

    def pending_names(self) -> str:
        with self.cv:
            return ", ".join(name for _, _, name in list(self.queue)[:3])

    def idle(self) -> bool:
        with self.cv:
            return self.done >= self.enq


class Event:
    def __init__(self, sim: Sim, device: int, timing: bool) -> None:
        self.sim, self.device, self.timing = sim, device, timing
        self.handle = 0x6000_0000 + next(Stream._ids) * 0x10
        self.stream: Stream | None = None
        self.pos = 0
        self.vc: dict[int, int] = {}
        self.stamp: float | None = None
        self.captured: Capture | None = None
        self.capture_count = 0
        self.destroyed = False

    def complete(self) -> bool:
        return self.stream is None or self.stream.done >= self.pos


# --- the simulated process --------------------------------------------------------------------------

class Sim:
    """The CUDA state of one simulated process: devices, memory, streams,
    events, captures, per-thread current device and capture mode."""

    def __init__(self, devices: int = 2) -> None:
        self.ndev = devices
        self.violations = Violations()
        self.memory = Memory()
        self.lock = threading.RLock()
        self.clock_lock = threading.Lock()
        self.host_clock: dict[int, int] = {}
        self.tl = threading.local()
        self.streams: dict[int, Stream] = {}
        self.legacy: dict[int, Stream] = {}
        self.events: dict[int, Event] = {}
        self.graphs: dict[int, Graph] = {}
        self.execs: dict[int, Graph] = {}
        self.captures: list[Capture] = []
        self.contexts: dict[int, str] = {}  # device -> who created its primary context, with which call
        self.used: set[int] = set()  # devices with allocations, streams, events or communicators
        self.calls: dict[str, int] = {}
        self.closed = False
        self.check_args = _real_runtime_checks()

    # ---- threads, devices, contexts ----

    def device(self) -> int:
        dev = getattr(self.tl, "device", None)
        return 0 if dev is None else dev

    def touch(self, call: str, device: int | None = None) -> int:
        """A call that needs a context: the current device's primary context is created if needed."""
        current = self.device() if device is None else device
        if current not in self.contexts:
            with self.lock:
                self.contexts.setdefault(current, f"thread {threading.current_thread().name!r} in {call}")
        return current

    def use(self, device: int) -> None:
        self.used.add(device)

    def context_violations(self) -> list[str]:
        return [f"a CUDA context was created on device {dev} by {who}, but this process uses no memory, stream, "
                f"event or communicator on device {dev} (a context there costs hundreds of MiB on a GPU)"
                for dev, who in sorted(self.contexts.items()) if dev not in self.used]

    # ---- streams ----

    def legacy_stream(self, device: int) -> Stream:
        with self.lock:
            s = self.legacy.get(device)
            if s is None:
                s = self.legacy[device] = Stream(self, device, True, legacy=True, handle=0)
            return s

    def per_thread_stream(self, device: int) -> Stream:
        streams = getattr(self.tl, "per_thread", None)
        if streams is None:
            streams = self.tl.per_thread = {}
        s = streams.get(device)
        if s is None:
            s = streams[device] = Stream(self, device, True, handle=_PER_THREAD)
        return s

    def stream(self, handle: Any) -> Stream | None:
        h = int(handle)
        if h in (0, _LEGACY):
            return self.legacy_stream(self.device())
        if h == _PER_THREAD:
            return self.per_thread_stream(self.device())
        s = self.streams.get(h)
        return None if s is None or s.destroyed else s

    def legacy_sync(self, legacy: Stream) -> None:
        """Work on the legacy stream waits for every blocking stream of its device (and for itself)."""
        for s in list(self.streams.values()):
            if s.device == legacy.device and s.blocking and not s.destroyed:
                if s.capture is not None and s.capture.invalid is None:
                    s.capture.invalid = "the legacy stream synchronized with a capturing blocking stream"
                legacy._after(s, s.enq)

    def observe(self, stream: Stream, pos: int, vc: dict[int, int] | None = None) -> None:
        """The host saw ``stream`` complete up to ``pos``: later work it enqueues is ordered after."""
        with self.clock_lock:
            for sid, p in list((vc or stream.vc).items()) + [(stream.id, pos)]:
                if self.host_clock.get(sid, 0) < p:
                    self.host_clock[sid] = p

    def check_access(self, stream: Stream, pos: int, name: str, reads: Iterable[Alloc],
                     writes: Iterable[Alloc]) -> None:
        writes = list(writes)
        for a in list(reads) + writes:
            if a.freed is not None:
                self.violations.record(f"{name} on stream {stream.id} uses memory 0x{a.ptr:x} after it was freed "
                                       f"({a.freed})")
                continue
            if a.kind == "device" and a.device != stream.device:
                self.violations.record(f"{name} on stream {stream.id} (device {stream.device}) uses memory of "
                                       f"device {a.device}")
            w = a.last_write
            if w is not None and w[0] != stream.id and stream.vc.get(w[0], 0) < w[1]:
                self.violations.record(
                    f"race: {name} on stream {stream.id} uses memory 0x{a.ptr:x}{' (' + a.label + ')' if a.label else ''}"
                    f" written by operation {w[1]} of stream {w[0]}, which it is not ordered after")
        for a in writes:
            a.last_write = (stream.id, pos)

    # ---- captures ----

    def prohibited(self, call: str) -> Any:
        """cudaThreadExchangeStreamCaptureMode: may this thread make a potentially unsafe call now?"""
        mode = getattr(self.tl, "mode", 0)
        me = threading.get_ident()
        hit = []
        for cap in self.captures:
            if cap.invalid is not None:
                continue
            own = cap.thread == me and cap.mode != int(_MODE.cudaStreamCaptureModeRelaxed)
            other = cap.thread != me and cap.mode == int(_MODE.cudaStreamCaptureModeGlobal)
            if mode == int(_MODE.cudaStreamCaptureModeRelaxed):
                continue
            if own or (mode == int(_MODE.cudaStreamCaptureModeGlobal) and other):
                hit.append(cap)
        for cap in hit:
            cap.invalid = f"{call} on thread {threading.current_thread().name!r} (capture mode {mode})"
        return E.cudaErrorStreamCaptureUnsupported if hit else None

    def clear(self) -> None:
        """Forget the violations recorded so far (contexts already created are not reported again)."""
        with self.violations._lock:
            self.violations.items.clear()
        self.used.update(self.contexts)

    def close(self) -> None:
        self.closed = True
        for s in list(self.streams.values()) + list(self.legacy.values()):
            with s.cv:
                s.cv.notify_all()


def _real_runtime_checks() -> bool:
    """Check arguments through the real binding only where it cannot act (no driver)."""
    try:
        err, _ = real_runtime.cudaGetDeviceCount()
    except Exception:
        return False
    return int(err) != 0


SIM: Sim | None = None


def sim() -> Sim:
    if SIM is None:
        raise SimError("the CUDA simulation is not installed (simnccl.install())")
    return SIM


# --- the runtime functions -----------------------------------------------------------------------------

def _count(name: str) -> Sim:
    s = sim()
    s.calls[name] = s.calls.get(name, 0) + 1
    return s


def _real_check(s: Sim, name: str, args: tuple[Any, ...]) -> None:
    if s.check_args:
        getattr(real_runtime, name)(*args)  # converts the arguments as the binding does; raises what it raises


def _context_call(name: str, args: tuple[Any, ...]) -> Sim:
    """A call that needs a context: counted, its arguments checked as the real binding would, the current
    device's context created if needed."""
    s = _count(name)
    _real_check(s, name, args)
    s.touch(name)
    return s


def cudaGetDeviceCount() -> Any:  # noqa: N802 - CUDA's names
    s = _count("cudaGetDeviceCount")
    return (OK, s.ndev)


def cudaGetDevice() -> Any:  # noqa: N802
    s = _count("cudaGetDevice")
    return (OK, s.device())


def cudaSetDevice(device: Any) -> Any:  # noqa: N802
    s = _count("cudaSetDevice")
    _real_check(s, "cudaSetDevice", (device,))
    d = int(device)
    if not 0 <= d < s.ndev:
        return (E.cudaErrorInvalidDevice,)
    s.tl.device = d
    s.touch("cudaSetDevice", d)  # since CUDA 12 cudaSetDevice initializes the device's primary context
    return (OK,)


def cudaDeviceGetAttribute(attr: Any, device: Any) -> Any:  # noqa: N802
    s = _count("cudaDeviceGetAttribute")
    _real_check(s, "cudaDeviceGetAttribute", (attr, device))
    values = {"cudaDevAttrComputeCapabilityMajor": 9, "cudaDevAttrComputeCapabilityMinor": 0,
              "cudaDevAttrMultiProcessorCount": 132, "cudaDevAttrMaxSharedMemoryPerBlockOptin": 232448}
    return (OK, values.get(getattr(attr, "name", ""), 0))


def cudaDeviceGetStreamPriorityRange() -> Any:  # noqa: N802
    s = _count("cudaDeviceGetStreamPriorityRange")
    s.touch("cudaDeviceGetStreamPriorityRange")
    return (OK, 0, -5)


def cudaDriverGetVersion() -> Any:  # noqa: N802
    _count("cudaDriverGetVersion")
    return (OK, module_load.VERSIONS.driver)


def cudaRuntimeGetVersion() -> Any:  # noqa: N802
    _count("cudaRuntimeGetVersion")
    return (OK, module_load.VERSIONS.runtime)


def cudaGetErrorName(error: Any) -> Any:  # noqa: N802
    return real_runtime.cudaGetErrorName(error)


def cudaGetErrorString(error: Any) -> Any:  # noqa: N802
    return real_runtime.cudaGetErrorString(error)


def cudaGetLastError() -> Any:  # noqa: N802
    return (OK,)


def cudaThreadExchangeStreamCaptureMode(mode: Any) -> Any:  # noqa: N802
    s = _count("cudaThreadExchangeStreamCaptureMode")
    _real_check(s, "cudaThreadExchangeStreamCaptureMode", (mode,))
    prev = getattr(s.tl, "mode", 0)
    s.tl.mode = int(mode)
    return (OK, _MODE(prev))


def _new_stream(s: Sim, flags: int, priority: int, call: str) -> tuple[Any, ...]:
    dev = s.touch(call)
    s.use(dev)
    st = Stream(s, dev, blocking=not (int(flags) & int(real_runtime.cudaStreamNonBlocking)), priority=priority)
    with s.lock:
        s.streams[st.handle] = st
    return (OK, real_runtime.cudaStream_t(st.handle))


def cudaStreamCreate() -> Any:  # noqa: N802
    return _new_stream(_count("cudaStreamCreate"), 0, 0, "cudaStreamCreate")


def cudaStreamCreateWithFlags(flags: Any) -> Any:  # noqa: N802
    s = _count("cudaStreamCreateWithFlags")
    _real_check(s, "cudaStreamCreateWithFlags", (flags,))
    return _new_stream(s, flags, 0, "cudaStreamCreateWithFlags")


def cudaStreamCreateWithPriority(flags: Any, priority: Any) -> Any:  # noqa: N802
    s = _count("cudaStreamCreateWithPriority")
    _real_check(s, "cudaStreamCreateWithPriority", (flags, priority))
    return _new_stream(s, flags, int(priority), "cudaStreamCreateWithPriority")


def cudaStreamDestroy(stream: Any) -> Any:  # noqa: N802
    s = _context_call("cudaStreamDestroy", (stream,))
    st = s.streams.get(int(stream))
    if st is None or st.destroyed:
        return (E.cudaErrorInvalidResourceHandle,)
    st.enqueue_raw(lambda: None, "cudaStreamDestroy")  # pending work still runs; then the worker exits
    st.destroyed = True
    return (OK,)


def _stream_or_error(s: Sim, stream: Any) -> Stream | None:
    st = s.stream(stream)
    if st is None:
        s.violations.record(f"a call used stream handle 0x{int(stream):x}, which is not a live stream")
    return st


def cudaStreamSynchronize(stream: Any) -> Any:  # noqa: N802
    s = _context_call("cudaStreamSynchronize", (stream,))
    st = _stream_or_error(s, stream)
    if st is None:
        return (E.cudaErrorInvalidResourceHandle,)
    if st.capture is not None:  # synchronizing a capturing stream is invalid and ends the capture's validity
        st.capture.invalid = st.capture.invalid or "cudaStreamSynchronize on a capturing stream"
        return (E.cudaErrorStreamCaptureUnsupported,)
    bad = s.prohibited("cudaStreamSynchronize")
    if bad is not None:
        return (bad,)
    pos = st.enq
    st.wait_pos(pos)
    s.observe(st, pos)
    return (OK,)


def cudaStreamQuery(stream: Any) -> Any:  # noqa: N802
    s = _context_call("cudaStreamQuery", (stream,))
    st = _stream_or_error(s, stream)
    if st is None:
        return (E.cudaErrorInvalidResourceHandle,)
    if st.capture is not None:
        st.capture.invalid = st.capture.invalid or "cudaStreamQuery on a capturing stream"
        return (E.cudaErrorStreamCaptureUnsupported,)
    bad = s.prohibited("cudaStreamQuery")
    if bad is not None:
        return (bad,)
    pos = st.enq
    if st.done >= pos:
        s.observe(st, pos)
        return (OK,)
    return (E.cudaErrorNotReady,)


def cudaStreamIsCapturing(stream: Any) -> Any:  # noqa: N802
    s = _context_call("cudaStreamIsCapturing", (stream,))
    st = _stream_or_error(s, stream)
    if st is None:
        return (E.cudaErrorInvalidResourceHandle, None)
    cap = st.capture
    if cap is None:
        return (OK, _STATUS.cudaStreamCaptureStatusNone)
    return (OK, _STATUS.cudaStreamCaptureStatusInvalidated if cap.invalid else _STATUS.cudaStreamCaptureStatusActive)


def cudaStreamBeginCapture(stream: Any, mode: Any) -> Any:  # noqa: N802
    s = _context_call("cudaStreamBeginCapture", (stream, mode))
    st = _stream_or_error(s, stream)
    if st is None or st.legacy:  # the legacy stream cannot be captured
        return (E.cudaErrorStreamCaptureUnsupported,)
    if st.capture is not None:
        return (E.cudaErrorIllegalState,)
    cap = Capture(st, int(mode), threading.get_ident())
    st.capture = cap
    s.captures.append(cap)
    return (OK,)


def cudaStreamEndCapture(stream: Any) -> Any:  # noqa: N802
    s = _count("cudaStreamEndCapture")
    _real_check(s, "cudaStreamEndCapture", (stream,))
    st = _stream_or_error(s, stream)
    if st is None or st.capture is None or st.capture.origin is not st:
        return (E.cudaErrorIllegalState, None)
    cap = st.capture
    for other in cap.joined.values():
        other.capture = None
    s.captures.remove(cap)
    if cap.invalid is None:
        for sid in cap.joined:
            if sid != st.id and cap.rejoined.get(sid, -1) != cap.count.get(sid, 0):
                cap.invalid = f"stream {sid} joined the capture and was not joined back"
                s.violations.record(f"capture ended with unjoined work: {cap.invalid}")
                return (E.cudaErrorStreamCaptureUnjoined, None)
    if cap.invalid is not None:
        s.violations.record(f"a stream capture was invalidated: {cap.invalid}")
        return (E.cudaErrorStreamCaptureInvalidated, None)
    handle = 0x5000_0000 + next(Stream._ids) * 0x10
    s.graphs[handle] = Graph(cap)
    return (OK, real_runtime.cudaGraph_t(handle))


def cudaGraphInstantiate(graph: Any, flags: Any) -> Any:  # noqa: N802
    s = _count("cudaGraphInstantiate")
    _real_check(s, "cudaGraphInstantiate", (graph, flags))
    g = s.graphs.get(int(graph))
    if g is None:
        return (E.cudaErrorInvalidValue, None)
    handle = 0x4000_0000 + next(Stream._ids) * 0x10
    s.execs[handle] = g
    return (OK, real_runtime.cudaGraphExec_t(handle))


def cudaGraphLaunch(graphExec: Any, stream: Any) -> Any:  # noqa: N802, N803
    s = _context_call("cudaGraphLaunch", (graphExec, stream))
    g = s.execs.get(int(graphExec))
    st = _stream_or_error(s, stream)
    if g is None or st is None:
        return (E.cudaErrorInvalidValue,)
    if g.launched and any(a.freed is None for a in g.unfreed):
        # Programming Guide, "Graph Memory Nodes": a graph whose allocation was not freed cannot be relaunched
        s.violations.record("a graph with an unfreed allocation was launched again")
        return (E.cudaErrorInvalidValue,)
    g.launched = True
    for name, fn in g.nodes:  # a node that is a launch of its own (an NCCL kernel) is launched anew
        st.enqueue(f"graph node {name}", fn.instance() if hasattr(fn, "instance") else fn)
    return (OK,)


def cudaGraphDestroy(graph: Any) -> Any:  # noqa: N802
    s = _count("cudaGraphDestroy")
    s.graphs.pop(int(graph), None)
    return (OK,)


def cudaGraphExecDestroy(graphExec: Any) -> Any:  # noqa: N802, N803
    s = _count("cudaGraphExecDestroy")
    s.execs.pop(int(graphExec), None)
    return (OK,)


# ---- events ----

def _new_event(s: Sim, flags: int, call: str) -> tuple[Any, ...]:
    dev = s.touch(call)
    s.use(dev)
    ev = Event(s, dev, timing=not (int(flags) & int(real_runtime.cudaEventDisableTiming)))
    with s.lock:
        s.events[ev.handle] = ev
    return (OK, real_runtime.cudaEvent_t(ev.handle))


def cudaEventCreate() -> Any:  # noqa: N802
    return _new_event(_count("cudaEventCreate"), 0, "cudaEventCreate")


def cudaEventCreateWithFlags(flags: Any) -> Any:  # noqa: N802
    s = _count("cudaEventCreateWithFlags")
    _real_check(s, "cudaEventCreateWithFlags", (flags,))
    return _new_event(s, flags, "cudaEventCreateWithFlags")


def _event(s: Sim, event: Any, call: str) -> Event | None:
    ev = s.events.get(int(event))
    if ev is None or ev.destroyed:
        s.violations.record(f"{call} on event handle 0x{int(event):x}, which is not a live event")
        return None
    return ev


def cudaEventDestroy(event: Any) -> Any:  # noqa: N802
    s = _context_call("cudaEventDestroy", (event,))
    ev = _event(s, event, "cudaEventDestroy")
    if ev is None:
        return (E.cudaErrorInvalidResourceHandle,)
    ev.destroyed = True
    s.events.pop(ev.handle, None)
    return (OK,)


def cudaEventRecord(event: Any, stream: Any) -> Any:  # noqa: N802
    s = _context_call("cudaEventRecord", (event, stream))
    ev, st = _event(s, event, "cudaEventRecord"), _stream_or_error(s, stream)
    if ev is None or st is None:
        return (E.cudaErrorInvalidResourceHandle,)
    if st.capture is not None:
        ev.captured, ev.stream = st.capture, st
        ev.capture_count = st.capture.count.get(st.id, 0)
        return (OK,)
    ev.captured = None
    ev.stamp = None

    def mark() -> None:
        if ev.timing:
            ev.stamp = time.perf_counter()

    pos = st.enqueue("cudaEventRecord", mark)
    ev.stream, ev.pos, ev.vc = st, pos, dict(st.vc)
    return (OK,)


def cudaStreamWaitEvent(stream: Any, event: Any, flags: Any) -> Any:  # noqa: N802
    s = _context_call("cudaStreamWaitEvent", (stream, event, flags))
    st, ev = _stream_or_error(s, stream), _event(s, event, "cudaStreamWaitEvent")
    if st is None or ev is None:
        return (E.cudaErrorInvalidResourceHandle,)
    if ev.captured is not None:
        cap = ev.captured
        if cap.invalid is None and ev.stream is not None and ev.stream.capture is cap:
            if st is cap.origin:
                cap.rejoined[ev.stream.id] = ev.capture_count
            elif st.capture is None:  # joins the capture
                st.capture = cap
                cap.joined[st.id] = st
                cap.count.setdefault(st.id, 0)
        return (OK,)
    if ev.stream is None or st.capture is not None and ev.stream.capture is None:
        return (OK,)  # never recorded: nothing to wait for; waits on outside work are not captured
    src, pos, vc = ev.stream, ev.pos, dict(ev.vc)
    for sid, p in list(vc.items()) + [(src.id, pos)]:
        if st.vc.get(sid, 0) < p:
            st.vc[sid] = p
    st.enqueue_raw(lambda: src.wait_pos(pos), f"cudaStreamWaitEvent (stream {src.id} up to {pos})")
    return (OK,)


def cudaEventQuery(event: Any) -> Any:  # noqa: N802
    s = _context_call("cudaEventQuery", (event,))
    ev = _event(s, event, "cudaEventQuery")
    if ev is None:
        return (E.cudaErrorInvalidResourceHandle,)
    bad = s.prohibited("cudaEventQuery")
    if bad is not None:
        return (bad,)
    if ev.captured is not None:
        return (E.cudaErrorStreamCaptureUnsupported,)
    if ev.complete():
        if ev.stream is not None:
            s.observe(ev.stream, ev.pos, ev.vc)
        return (OK,)
    return (E.cudaErrorNotReady,)


def cudaEventSynchronize(event: Any) -> Any:  # noqa: N802
    s = _context_call("cudaEventSynchronize", (event,))
    ev = _event(s, event, "cudaEventSynchronize")
    if ev is None:
        return (E.cudaErrorInvalidResourceHandle,)
    bad = s.prohibited("cudaEventSynchronize")
    if bad is not None:
        return (bad,)
    if ev.stream is not None:
        ev.stream.wait_pos(ev.pos)
        s.observe(ev.stream, ev.pos, ev.vc)
    return (OK,)


def cudaEventElapsedTime(start: Any, end: Any) -> Any:  # noqa: N802
    s = _context_call("cudaEventElapsedTime", (start, end))
    a, b = _event(s, start, "cudaEventElapsedTime"), _event(s, end, "cudaEventElapsedTime")
    if a is None or b is None:
        return (E.cudaErrorInvalidResourceHandle, None)
    # Runtime API, cudaEventElapsedTime: an event created with cudaEventDisableTiming, or never recorded, is an
    # invalid resource handle; one not yet completed is "not ready".
    if not (a.timing and b.timing) or a.stream is None or b.stream is None:
        return (E.cudaErrorInvalidResourceHandle, None)
    if not (a.complete() and b.complete()) or a.stamp is None or b.stamp is None:
        return (E.cudaErrorNotReady, None)
    return (OK, (b.stamp - a.stamp) * 1e3)


# ---- memory ----

def _alloc(s: Sim, size: int, kind: str, device: int) -> Alloc:
    s.use(device)
    a = Alloc(size, device, kind)
    s.memory.add(a)
    return a


_SYNC_PATIENCE = 5.0  # seconds a device synchronization waits before the simulation calls it a hang


def _device_sync(s: Sim, call: str, device: int) -> None:
    """cudaFree synchronizes the device: wait for every stream of it. On a GPU it waits as long as the work
    runs (forever behind a stuck kernel); here it is recorded past a few seconds, then given up."""
    for st in list(s.streams.values()) + [s.legacy_stream(device)]:
        if st.device == device and not st.destroyed:
            pos = st.enq
            if not st.wait_pos(pos, _SYNC_PATIENCE):
                s.violations.record(f"{call} on thread {threading.current_thread().name!r} blocked "
                                    f"{_SYNC_PATIENCE:.0f} s behind device work still running on stream {st.id} "
                                    f"({st.pending_names()}); on a GPU it waits as long as that work runs")
                continue
            s.observe(st, pos)


def cudaMalloc(size: Any) -> Any:  # noqa: N802
    s = _count("cudaMalloc")
    _real_check(s, "cudaMalloc", (size,))
    dev = s.touch("cudaMalloc")
    bad = s.prohibited("cudaMalloc")
    if bad is not None:
        return (bad, None)
    return (OK, _alloc(s, int(size), "device", dev).ptr)


def cudaFree(devPtr: Any) -> Any:  # noqa: N802, N803
    s = _count("cudaFree")
    _real_check(s, "cudaFree", (devPtr,))
    dev = s.touch("cudaFree")
    if int(devPtr) == 0:
        return (OK,)
    bad = s.prohibited("cudaFree")
    if bad is not None:
        return (bad,)
    a = s.memory.find(int(devPtr))
    if a is None or a.ptr != int(devPtr) or a.kind != "device":
        s.violations.record(f"cudaFree of 0x{int(devPtr):x}, which is not a live cudaMalloc allocation")
        return (E.cudaErrorInvalidValue,)
    _device_sync(s, "cudaFree", dev)  # implicit synchronization: blocks while any kernel of the device runs
    s.memory.remove(a, "cudaFree")
    return (OK,)


def cudaMallocAsync(size: Any, hStream: Any) -> Any:  # noqa: N802, N803
    s = _context_call("cudaMallocAsync", (size, hStream))
    st = _stream_or_error(s, hStream)
    if st is None:
        return (E.cudaErrorInvalidResourceHandle, None)
    a = _alloc(s, int(size), "device", st.device)
    a.stream_ordered = True
    if st.capture is not None:  # a graph allocation node
        a.graph = st.capture
        st.capture.allocs.append(a)
        st.enqueue("cudaMallocAsync", lambda: None)
        return (OK, a.ptr)
    st.enqueue("cudaMallocAsync", lambda: None, writes=[a])  # usable by work ordered after this point
    return (OK, a.ptr)


def cudaFreeAsync(devPtr: Any, hStream: Any) -> Any:  # noqa: N802, N803
    s = _context_call("cudaFreeAsync", (devPtr, hStream))
    st = _stream_or_error(s, hStream)
    a = s.memory.find(int(devPtr))
    if st is None or a is None or a.ptr != int(devPtr):
        s.violations.record(f"cudaFreeAsync of 0x{int(devPtr):x}, which is not a live allocation")
        return (E.cudaErrorInvalidValue,)
    if st.capture is not None:
        if a.graph is st.capture:
            st.capture.frees.add(a.ptr)
        st.enqueue("cudaFreeAsync", lambda: None)
        return (OK,)
    st.enqueue("cudaFreeAsync", lambda: None, writes=[a])
    s.memory.remove(a, "cudaFreeAsync")
    return (OK,)


def cudaMallocHost(size: Any) -> Any:  # noqa: N802
    s = _count("cudaMallocHost")
    _real_check(s, "cudaMallocHost", (size,))
    dev = s.touch("cudaMallocHost")
    bad = s.prohibited("cudaMallocHost")
    if bad is not None:
        return (bad, None)
    return (OK, _alloc(s, int(size), "pinned", dev).ptr)


def cudaHostAlloc(size: Any, flags: Any) -> Any:  # noqa: N802
    s = _count("cudaHostAlloc")
    _real_check(s, "cudaHostAlloc", (size, flags))
    dev = s.touch("cudaHostAlloc")
    bad = s.prohibited("cudaHostAlloc")
    if bad is not None:
        return (bad, None)
    return (OK, _alloc(s, int(size), "pinned", dev).ptr)


def cudaFreeHost(ptr: Any) -> Any:  # noqa: N802
    s = _context_call("cudaFreeHost", (ptr,))
    bad = s.prohibited("cudaFreeHost")
    if bad is not None:
        return (bad,)
    a = s.memory.find(int(ptr))
    if a is None or a.kind != "pinned":
        return (E.cudaErrorInvalidValue,)
    s.memory.remove(a, "cudaFreeHost")
    return (OK,)


def cudaPointerGetAttributes(ptr: Any) -> Any:  # noqa: N802
    s = _context_call("cudaPointerGetAttributes", (ptr,))
    attrs = real_runtime.cudaPointerAttributes()
    a = s.memory.find(int(ptr))
    if a is None:
        attrs.type = real_runtime.cudaMemoryType.cudaMemoryTypeUnregistered
        attrs.device = -2
    else:
        attrs.type = (real_runtime.cudaMemoryType.cudaMemoryTypeDevice if a.kind == "device"
                      else real_runtime.cudaMemoryType.cudaMemoryTypeHost)
        attrs.device = a.device
    return (OK, attrs)


def view(ptr: int, nbytes: int, what: str) -> np.ndarray:
    """Device (or pinned) memory as a uint8 numpy view; records a fault for anything else."""
    s = sim()
    if nbytes == 0:
        return np.zeros(0, np.uint8)
    a = s.memory.find(ptr, nbytes)
    if a is None:
        s.violations.record(f"{what}: 0x{ptr:x} (+{nbytes} bytes) is not simulated device memory (an illegal "
                            "address on a GPU)")
        raise SimError(f"{what}: illegal address 0x{ptr:x}")
    off = ptr - a.ptr
    return a.buf[off:off + nbytes]


def allocs(ptr: int, nbytes: int) -> list[Alloc]:
    a = sim().memory.find(ptr, max(nbytes, 1))
    return [] if a is None or nbytes == 0 else [a]


def _copy(s: Sim, dst: int, src: int, count: int, kind: int, st: Stream, call: str, sync: bool) -> Any:
    if count == 0:
        return OK
    d_alloc, s_alloc = s.memory.find(dst, count), s.memory.find(src, count)
    if kind == _DEFAULT:
        kind = _D2D if d_alloc and s_alloc else (_H2D if d_alloc else _D2H)
    if kind == _H2D:
        pinned = s_alloc is not None and s_alloc.kind == "pinned"
        if not pinned:  # pageable: staged at once, and not capturable
            if st.capture is not None:
                st.capture.invalid = st.capture.invalid or f"{call} from pageable host memory"
                return E.cudaErrorStreamCaptureUnsupported
            data = ctypes.string_at(src, count)

            def h2d() -> None:
                view(dst, count, call)[:] = np.frombuffer(data, np.uint8)

            st.enqueue(call, h2d, writes=allocs(dst, count))
            if sync:
                st.wait_pos(st.enq)
            return OK

        def h2d_pinned() -> None:
            view(dst, count, call)[:] = view(src, count, call)

        st.enqueue(call, h2d_pinned, writes=allocs(dst, count))
    elif kind == _D2H:
        pinned = d_alloc is not None and d_alloc.kind == "pinned"
        if not pinned and st.capture is not None:
            st.capture.invalid = st.capture.invalid or f"{call} to pageable host memory"
            return E.cudaErrorStreamCaptureUnsupported

        def d2h() -> None:
            data = view(src, count, call)
            if pinned:
                view(dst, count, call)[:] = data
            else:
                ctypes.memmove(dst, data.ctypes.data, count)

        pos = st.enqueue(call, d2h, reads=allocs(src, count), writes=allocs(dst, count) if pinned else ())
        if not pinned or sync:  # a copy into pageable memory returns once it is done
            st.wait_pos(pos)
            s.observe(st, pos)
    else:
        def d2d() -> None:
            view(dst, count, call)[:] = view(src, count, call).copy()

        st.enqueue(call, d2d, reads=allocs(src, count), writes=allocs(dst, count))
        if sync:
            st.wait_pos(st.enq)
    return OK


def cudaMemcpyAsync(dst: Any, src: Any, count: Any, kind: Any, stream: Any) -> Any:  # noqa: N802
    s = _context_call("cudaMemcpyAsync", (dst, src, count, kind, stream))
    st = _stream_or_error(s, stream)
    if st is None:
        return (E.cudaErrorInvalidResourceHandle,)
    k = int(kind)
    pageable = k in (_H2D, _D2H) and not (s.memory.find(int(src) if k == _H2D else int(dst), max(int(count), 1))
                                          or None)
    if pageable:
        bad = s.prohibited("cudaMemcpyAsync (pageable host memory)")
        if bad is not None:
            return (bad,)
    return (_copy(s, int(dst), int(src), int(count), k, st, "cudaMemcpyAsync", False),)


def cudaMemcpy(dst: Any, src: Any, count: Any, kind: Any) -> Any:  # noqa: N802
    s = _context_call("cudaMemcpy", (dst, src, count, kind))
    bad = s.prohibited("cudaMemcpy")
    if bad is not None:
        return (bad,)
    st = s.legacy_stream(s.device())
    return (_copy(s, int(dst), int(src), int(count), int(kind), st, "cudaMemcpy", True),)


def cudaMemsetAsync(devPtr: Any, value: Any, count: Any, stream: Any) -> Any:  # noqa: N802, N803
    s = _context_call("cudaMemsetAsync", (devPtr, value, count, stream))
    st = _stream_or_error(s, stream)
    if st is None:
        return (E.cudaErrorInvalidResourceHandle,)
    ptr, n, v = int(devPtr), int(count), int(value) & 0xFF
    if n:
        st.enqueue("cudaMemsetAsync", lambda: view(ptr, n, "cudaMemsetAsync").fill(v), writes=allocs(ptr, n))
    return (OK,)


def cudaDeviceSynchronize() -> Any:  # noqa: N802
    s = _count("cudaDeviceSynchronize")
    dev = s.touch("cudaDeviceSynchronize")
    bad = s.prohibited("cudaDeviceSynchronize")
    if bad is not None:
        return (bad,)
    _device_sync(s, "cudaDeviceSynchronize", dev)
    return (OK,)


_FUNCTIONS: list[Callable[..., Any]] = [cudaGetDeviceCount, cudaGetDevice, cudaSetDevice, cudaDeviceGetAttribute,
              cudaDeviceGetStreamPriorityRange, cudaDriverGetVersion, cudaRuntimeGetVersion, cudaGetErrorName,
              cudaGetErrorString, cudaGetLastError, cudaThreadExchangeStreamCaptureMode, cudaStreamCreate,
              cudaStreamCreateWithFlags, cudaStreamCreateWithPriority, cudaStreamDestroy, cudaStreamSynchronize,
              cudaStreamQuery, cudaStreamIsCapturing, cudaStreamBeginCapture, cudaStreamEndCapture,
              cudaGraphInstantiate, cudaGraphLaunch, cudaGraphDestroy, cudaGraphExecDestroy, cudaEventCreate,
              cudaEventCreateWithFlags, cudaEventDestroy, cudaEventRecord, cudaStreamWaitEvent, cudaEventQuery,
              cudaEventSynchronize, cudaEventElapsedTime, cudaMalloc, cudaFree, cudaMallocAsync, cudaFreeAsync,
              cudaMallocHost, cudaHostAlloc, cudaFreeHost, cudaPointerGetAttributes, cudaMemcpyAsync, cudaMemcpy,
              cudaMemsetAsync, cudaDeviceSynchronize]


def cuInit(Flags: Any) -> Any:  # noqa: N802, N803
    sim()
    return (real_driver.CUresult.CUDA_SUCCESS,)


def cuDeviceGetCount() -> Any:  # noqa: N802
    return (real_driver.CUresult.CUDA_SUCCESS, sim().ndev)


def cuDriverGetVersion() -> Any:  # noqa: N802
    return (real_driver.CUresult.CUDA_SUCCESS, module_load.VERSIONS.driver)


_DRIVER_FUNCTIONS: list[Callable[..., Any]] = [cuInit, cuDeviceGetCount, cuDriverGetVersion, *module_load.FUNCTIONS]


def _param_names(fn: Callable[..., Any]) -> list[str]:
    return list(inspect.signature(fn).parameters)


def _module(name: str, real: types.ModuleType, functions: list[Callable[..., Any]]) -> types.ModuleType:
    """A module with ``functions`` whose parameter lists must equal the real
    binding's; every other attribute (types, enums, constants) is the real
    module's, and a CUDA function not simulated raises."""
    mod = types.ModuleType(name, f"simulated {real.__name__} (tests/simnccl)")
    for fn in functions:
        real_fn = getattr(real, fn.__name__)
        if _param_names(fn) != _param_names(real_fn):
            raise SimError(f"{fn.__name__}{inspect.signature(fn)} does not match the real binding's "
                           f"{fn.__name__}{inspect.signature(real_fn)}")
        setattr(mod, fn.__name__, fn)

    def __getattr__(attr: str) -> Any:  # noqa: N807 - PEP 562
        value = getattr(real, attr)
        if callable(value) and not isinstance(value, type) and attr.startswith(("cuda", "cu")):
            raise SimError(f"{real.__name__}.{attr} is not simulated (tests/simnccl/cudart.py)")
        return value

    setattr(mod, "__getattr__", __getattr__)  # noqa: B010 - PEP 562 on a module object
    return mod


def modules() -> tuple[types.ModuleType, types.ModuleType]:
    return (_module("simnccl.runtime", real_runtime, _FUNCTIONS),
            _module("simnccl.driver", real_driver, _DRIVER_FUNCTIONS))


def install(devices: int = 2) -> Sim:
    global SIM
    if SIM is not None:
        SIM.close()
    SIM = Sim(devices)
    return SIM


def uninstall() -> None:
    global SIM
    if SIM is not None:
        SIM.close()
    SIM = None
