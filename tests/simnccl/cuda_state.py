"""The state of the simulated CUDA runtime (cudart.py holds its functions):
devices and primary contexts, memory and memory pools, streams, events,
captures, graphs and their user objects. Each rule names the CUDA document it
follows; it proves our logic against CUDA's documented rules, never GPU
behaviour.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
from cuda.bindings import runtime as real_runtime  # type: ignore[import-untyped]

E = real_runtime.cudaError_t
OK = E.cudaSuccess
MODE = real_runtime.cudaStreamCaptureMode
STATUS = real_runtime.cudaStreamCaptureStatus
LEGACY, PER_THREAD = 1, 2  # cudaStreamLegacy, cudaStreamPerThread (0 is the legacy stream too)
_ALIGN = 256
SYNC_PATIENCE = 5.0  # seconds a wait that never ends on a GPU (behind work or graphs that never go) is given here


class SimError(Exception):
    """A misuse the simulation cannot turn into a CUDA error code."""


class Violations:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.items: list[str] = []

    def record(self, what: str) -> None:
        with self.lock:
            if what not in self.items:
                self.items.append(what)

    def clear(self) -> None:
        with self.lock:
            self.items.clear()


# --- memory and pools ------------------------------------------------------------------------------

class Pool:
    """A cudaMemPool_t. Runtime API, cudaMemPoolSetAttribute, cudaMemPoolAttrReleaseThreshold: "Amount of
    reserved memory in bytes to hold onto before trying to release memory back to the OS. When more than the
    release threshold bytes of memory are held by the memory pool, the allocator will try to release memory
    back to the OS on the next call to stream, event or context synchronize. (default 0)". ``held``: bytes
    freed into the pool and kept; ``releases``: times it gave memory back; ``maps``: allocations it could not
    serve from what it held (new memory mapped)."""

    def __init__(self, device: int, handle: int, default: bool) -> None:
        self.device, self.handle, self.default = device, handle, default
        self.threshold = 0
        self.held = 0
        self.releases = 0
        self.maps = 0
        self.destroyed = False

    def take(self, size: int) -> None:
        if self.held >= size:
            self.held -= size
        else:
            self.maps += 1

    def trim(self) -> None:
        if self.held > self.threshold:
            self.held = self.threshold
            self.releases += 1


class Alloc:
    """One allocation: device memory (or pinned host memory) backed by a numpy buffer."""

    __slots__ = ("ptr", "size", "device", "kind", "buf", "freed", "last_write", "stream_ordered", "graph",
                 "label", "pool")

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
        self.pool: Pool | None = None


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


# --- graphs and user objects ------------------------------------------------------------------------

class UserObject:
    """A CUDA user object (Programming Guide, "CUDA User Objects"): graphs own references to it; an
    executable graph instantiated from a graph holds references of its own; the destructor runs once the
    last reference is released. NCCL attaches one per captured plan (enqueue.cc ncclLaunchPrepare,
    ncclCudaGraphAddDestructor), whose destructor gives the plan back (reclaimPlan)."""

    def __init__(self, destructor: Callable[[], None]) -> None:
        self.destructor = destructor
        self.refs = 1  # the capture graph's
        self.lock = threading.Lock()

    def retain(self) -> None:
        with self.lock:
            self.refs += 1

    def release(self) -> None:
        with self.lock:
            self.refs -= 1
            last = self.refs == 0
        if last:
            self.destructor()


_capture_ids = itertools.count(1)


class Capture:
    def __init__(self, origin: Stream, mode: int, thread: int) -> None:
        self.origin, self.mode, self.thread = origin, mode, thread
        self.id = next(_capture_ids)  # cudaStreamGetCaptureInfo's id_out: "unique over the lifetime of the process"
        self.nodes: list[tuple[str, Callable[[], None]]] = []
        self.joined: dict[int, Stream] = {origin.id: origin}
        self.count: dict[int, int] = {origin.id: 0}  # nodes captured per stream
        self.rejoined: dict[int, int] = {}  # stream id -> its node count when the origin last waited on it
        self.invalid: str | None = None
        self.allocs: list[Alloc] = []
        self.frees: set[int] = set()
        self.user_objects: list[UserObject] = []


class Graph:
    def __init__(self, capture: Capture) -> None:
        self.nodes = list(capture.nodes)
        self.unfreed = [a for a in capture.allocs if a.ptr not in capture.frees]
        self.user_objects = capture.user_objects  # the capture graph's references, now this graph's
        self.launched = False
        self.destroyed = False


class GraphExec:
    """cudaGraphInstantiate: its own references to the graph's user objects (Programming Guide, "CUDA User
    Objects"), released by cudaGraphExecDestroy."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        for u in graph.user_objects:
            u.retain()


# --- streams and events ------------------------------------------------------------------------------

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
        """Append work (or capture it); returns its position (0 when captured). Work on the legacy stream while
        a blocking stream of its device captures is refused before this (``Sim.implicit_capture``)."""
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
            self._start()
            self.cv.notify_all()
        return pos

    def _start(self) -> None:
        if self._worker is None:
            self._worker = threading.Thread(target=self._run, name=f"simcuda-stream-{self.id}", daemon=True)
            self._worker.start()

    def after(self, other: Stream, pos: int) -> None:
        """Make later work here wait for ``other`` up to ``pos`` (an implicit event)."""
        if pos <= self.vc.get(other.id, 0) or other is self:
            return
        for sid, p in list(other.vc.items()) + [(other.id, pos)]:
            if self.vc.get(sid, 0) < p:
                self.vc[sid] = p
        self.enqueue_raw(lambda: other.wait_pos(pos), f"implicit wait for stream {other.id} up to {pos}")

    _after = after

    def enqueue_raw(self, fn: Callable[[], object], name: str) -> None:
        with self.cv:
            self.enq += 1
            self.queue.append((self.enq, fn, name))
            self._start()
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


# --- the simulated process ----------------------------------------------------------------------------

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
        self.execs: dict[int, GraphExec] = {}
        self.pools: dict[int, Pool] = {}
        self.default_pools: dict[int, Pool] = {}
        self.captures: list[Capture] = []
        self.contexts: dict[int, str] = {}  # device -> who created its primary context, with which call
        self.used: set[int] = set()  # devices with allocations, streams, events or communicators
        self.calls: dict[str, int] = {}
        self.checks: list[Callable[[], list[str]]] = []  # more violations, computed when asked (ncclsim's)
        self.resets: list[Callable[[], None]] = []  # what clear() forgets besides (ncclsim's groups left open)
        self.closed = False
        self.check_args = _real_runtime_checks()

    # ---- threads, devices, contexts ----

    def device(self) -> int:
        """cudaGetDevice: the calling thread's current device, 0 until it chose one."""
        dev = getattr(self.tl, "device", None)
        return 0 if dev is None else dev

    def set_device(self, device: int, call: str) -> None:
        """cudaSetDevice: current on this thread, and (since CUDA 12) its primary context initialized
        (Programming Guide, "Initialization": cudaSetDevice "initialize[s] the runtime and the primary context
        associated with the specified device")."""
        self.tl.device = device
        self.touch(call, device)

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
        found = [f"a CUDA context was created on device {dev} by {who}, but this process uses no memory, stream, "
                 f"event or communicator on device {dev} (a context there costs hundreds of MiB on a GPU)"
                 for dev, who in sorted(self.contexts.items()) if dev not in self.used]
        for check in self.checks:
            found += check()
        return found

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
            s = streams[device] = Stream(self, device, True, handle=PER_THREAD)
        return s

    def stream(self, handle: Any) -> Stream | None:
        h = int(handle)
        if h in (0, LEGACY):
            return self.legacy_stream(self.device())
        if h == PER_THREAD:
            return self.per_thread_stream(self.device())
        s = self.streams.get(h)
        return None if s is None or s.destroyed else s

    def blocking_captures(self, device: int) -> list[Capture]:
        return [s.capture for s in list(self.streams.values()) if s.device == device and s.blocking and
                not s.destroyed and s.capture is not None and s.capture.invalid is None]

    def implicit_capture(self, st: Stream, call: str, invalidate: bool = True) -> Any:
        """The legacy stream while a blocking stream of its device captures: cudaErrorStreamCaptureImplicit,
        "the operation would have resulted in a disallowed implicit dependency on a current capture sequence
        from cudaStreamLegacy" (Runtime API, cudaStreamIsCapturing: "When a blocking stream is capturing, the
        legacy stream is in an unusable state until the blocking stream capture is terminated"; only that query
        says the capture stays valid, so other uses invalidate it). None: allowed."""
        if not st.legacy:
            return None
        caps = self.blocking_captures(st.device)
        if not caps:
            return None
        if invalidate:
            for cap in caps:
                cap.invalid = cap.invalid or f"{call} on the legacy stream during the capture of a blocking stream"
        return E.cudaErrorStreamCaptureImplicit

    def legacy_sync(self, legacy: Stream) -> None:
        """Work on the legacy stream waits for every blocking stream of its device (and for itself)."""
        for s in list(self.streams.values()):
            if s.device == legacy.device and s.blocking and not s.destroyed:
                if s.capture is not None and s.capture.invalid is None:  # a call not refused before (see above)
                    s.capture.invalid = "the legacy stream synchronized with a capturing blocking stream"
                legacy.after(s, s.enq)

    def observe(self, stream: Stream, pos: int, vc: dict[int, int] | None = None) -> None:
        """The host saw ``stream`` complete up to ``pos``: later work it enqueues is ordered after."""
        with self.clock_lock:
            for sid, p in list((vc or stream.vc).items()) + [(stream.id, pos)]:
                if self.host_clock.get(sid, 0) < p:
                    self.host_clock[sid] = p

    def synchronized(self) -> None:
        """A stream, event or device synchronization: pools holding more than their release threshold give
        memory back (see Pool)."""
        with self.lock:
            for p in self.pools.values():
                p.trim()

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

    # ---- pools ----

    def default_pool(self, device: int) -> Pool:
        with self.lock:
            p = self.default_pools.get(device)
            if p is None:
                p = self.default_pools[device] = Pool(device, 0x3000_0000 + device * 0x10, default=True)
                self.pools[p.handle] = p
            return p

    # ---- captures ----

    def prohibited(self, call: str) -> Any:
        """cudaThreadExchangeStreamCaptureMode: may this thread make a potentially unsafe call now?"""
        mode = getattr(self.tl, "mode", 0)
        me = threading.get_ident()
        hit = []
        for cap in self.captures:
            if cap.invalid is not None:
                continue
            own = cap.thread == me and cap.mode != int(MODE.cudaStreamCaptureModeRelaxed)
            other = cap.thread != me and cap.mode == int(MODE.cudaStreamCaptureModeGlobal)
            if mode == int(MODE.cudaStreamCaptureModeRelaxed):
                continue
            if own or (mode == int(MODE.cudaStreamCaptureModeGlobal) and other):
                hit.append(cap)
        for cap in hit:
            cap.invalid = f"{call} on thread {threading.current_thread().name!r} (capture mode {mode})"
        return E.cudaErrorStreamCaptureUnsupported if hit else None

    def clear(self) -> None:
        """Forget the violations recorded so far (contexts already created are not reported again)."""
        self.violations.clear()
        self.used.update(self.contexts)
        for reset in self.resets:
            reset()

    def close(self) -> None:
        self.closed = True
        for s in list(self.streams.values()) + list(self.legacy.values()):
            with s.cv:
                s.cv.notify_all()


SIM: Sim | None = None


def sim() -> Sim:
    if SIM is None:
        raise SimError("the CUDA simulation is not installed (simnccl.install())")
    return SIM


def _real_runtime_checks() -> bool:
    """Check arguments through the real binding only where it cannot act (no driver)."""
    try:
        err, _ = real_runtime.cudaGetDeviceCount()
    except Exception:
        return False
    return int(err) != 0


# --- what every simulated call does first --------------------------------------------------------------

def count(name: str) -> Sim:
    s = sim()
    s.calls[name] = s.calls.get(name, 0) + 1
    return s


def real_check(s: Sim, name: str, args: tuple[Any, ...]) -> None:
    if s.check_args:
        getattr(real_runtime, name)(*args)  # converts the arguments as the binding does; raises what it raises


def context_call(name: str, args: tuple[Any, ...]) -> Sim:
    """A call that needs a context: counted, its arguments checked as the real binding would, the current
    device's context created if needed."""
    s = count(name)
    real_check(s, name, args)
    s.touch(name)
    return s


def stream_or_error(s: Sim, stream: Any) -> Stream | None:
    st = s.stream(stream)
    if st is None:
        s.violations.record(f"a call used stream handle 0x{int(stream):x}, which is not a live stream")
    return st
