"""Simulated CUDA runtime and driver: ``cuda.bindings.runtime`` and
``cuda.bindings.driver`` as nccl_pg's NCCL backend and the simulated NCCL use
them, without a GPU. It proves our logic against CUDA's documented rules, never
GPU behaviour. The state is in cuda_state.py, the memory calls in
cuda_memory.py; this module has the device, stream, event and graph calls and
assembles the modules.

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
  behavior"); while a blocking stream captures, the legacy stream is unusable:
  work on it is refused with ``cudaErrorStreamCaptureImplicit`` (Runtime API,
  cudaStreamIsCapturing);
- events with and without timing; ``cudaEventElapsedTime`` on an event
  created with ``cudaEventDisableTiming`` returns
  ``cudaErrorInvalidResourceHandle`` (Runtime API, cudaEventElapsedTime);
- a current device per thread, 0 until ``cudaSetDevice``; a call that needs a
  context creates the primary context of the current device, and since CUDA
  12 ``cudaSetDevice`` does (Programming Guide, "Initialization");
  ``cuDevicePrimaryCtxGetState`` says whether it exists (Driver API). A
  context on a device where the process allocates nothing and creates no
  stream, event or communicator is recorded as a violation (the bug that puts
  every rank's context on GPU 0);
- ``cudaFree`` and ``cudaMalloc`` synchronize the device (Runtime API notes
  on cudaFree: "implicit synchronization"); ``cudaMallocAsync``/
  ``cudaFreeAsync``/``cudaMallocFromPoolAsync`` are stream-ordered, from a
  pool that keeps freed memory up to its release threshold (default 0) and
  gives the rest back at the next synchronization (Runtime API,
  cudaMemPoolSetAttribute); during a capture ``cudaFreeAsync`` takes only a
  graph allocation (Runtime API, cudaFreeAsync);
- stream capture: work enqueued on a capturing stream goes into the graph;
  waiting on an event recorded in a capture joins the waiting stream; a
  capture whose joined streams did not rejoin fails with
  ``cudaErrorStreamCaptureUnjoined``; "potentially unsafe" calls (cudaMalloc,
  cudaFree, synchronous copies, queries and synchronizations) are refused with
  ``cudaErrorStreamCaptureUnsupported`` and invalidate the capture as
  ``cudaThreadExchangeStreamCaptureMode``'s modes say (global: any thread;
  thread-local: the capturing thread; relaxed: never); user objects attached
  to a capture live until the graph and every graph instantiated from it are
  destroyed (Programming Guide, "CUDA User Objects");
- a happens-before check of stream work: an operation that reads or writes
  memory last written by another stream's operation it is not ordered after
  (no event wait, no host synchronization in between) is recorded as a race.

Violations are collected (``violations()``); the tests fail on any.
"""

from __future__ import annotations

import inspect
import threading
import time
import types
from collections.abc import Callable
from typing import Any

from cuda.bindings import driver as real_driver  # type: ignore[import-untyped]
from cuda.bindings import runtime as real_runtime  # type: ignore[import-untyped]

from . import (  # module_load: the driver's versions and module loads (NVRTC/driver pairing)
    cuda_memory,
    cuda_state,
    graph_events,
    module_load,
)
from .cuda_memory import allocs, view
from .cuda_state import MODE as _MODE
from .cuda_state import OK, Capture, E, Event, Graph, GraphExec, Sim, SimError, Stream, Violations, sim
from .cuda_state import STATUS as _STATUS
from .cuda_state import context_call as _context_call
from .cuda_state import count as _count
from .cuda_state import real_check as _real_check
from .cuda_state import stream_or_error as _stream_or_error

__all__ = ["SimError", "Violations", "allocs", "install", "modules", "real_runtime", "sim", "uninstall", "view"]


def __getattr__(name: str) -> Any:  # noqa: N807 - PEP 562: ``cudart.SIM`` is the state's current one
    if name == "SIM":
        return cuda_state.SIM
    raise AttributeError(name)


# --- the runtime functions -----------------------------------------------------------------------------

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
    s.set_device(d, "cudaSetDevice")
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


def cudaStreamSynchronize(stream: Any) -> Any:  # noqa: N802
    s = _context_call("cudaStreamSynchronize", (stream,))
    st = _stream_or_error(s, stream)
    if st is None:
        return (E.cudaErrorInvalidResourceHandle,)
    if st.capture is not None:  # synchronizing a capturing stream is invalid and ends the capture's validity
        st.capture.invalid = st.capture.invalid or "cudaStreamSynchronize on a capturing stream"
        return (E.cudaErrorStreamCaptureUnsupported,)
    bad = s.prohibited("cudaStreamSynchronize") or s.implicit_capture(st, "cudaStreamSynchronize")
    if bad is not None:
        return (bad,)
    pos = st.enq
    st.wait_pos(pos)
    s.observe(st, pos)
    s.synchronized()
    return (OK,)


def cudaStreamQuery(stream: Any) -> Any:  # noqa: N802
    s = _context_call("cudaStreamQuery", (stream,))
    st = _stream_or_error(s, stream)
    if st is None:
        return (E.cudaErrorInvalidResourceHandle,)
    if st.capture is not None:
        st.capture.invalid = st.capture.invalid or "cudaStreamQuery on a capturing stream"
        return (E.cudaErrorStreamCaptureUnsupported,)
    bad = s.prohibited("cudaStreamQuery") or s.implicit_capture(st, "cudaStreamQuery")
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
    bad = s.implicit_capture(st, "cudaStreamIsCapturing", invalidate=False)  # "The blocking stream capture is not
    if bad is not None:  # invalidated" (Runtime API, cudaStreamIsCapturing)
        return (bad, None)
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
                _drop(cap)
                return (E.cudaErrorStreamCaptureUnjoined, None)
    if cap.invalid is not None:
        s.violations.record(f"a stream capture was invalidated: {cap.invalid}")
        _drop(cap)
        return (E.cudaErrorStreamCaptureInvalidated, None)
    handle = 0x5000_0000 + next(Stream._ids) * 0x10
    s.graphs[handle] = Graph(cap)
    return (OK, real_runtime.cudaGraph_t(handle))


def _drop(cap: Capture) -> None:
    """A failed capture returns no graph: the graph it built goes, with its references to user objects."""
    for u in cap.user_objects:
        u.release()


def cudaGraphInstantiate(graph: Any, flags: Any) -> Any:  # noqa: N802
    s = _count("cudaGraphInstantiate")
    _real_check(s, "cudaGraphInstantiate", (graph, flags))
    g = s.graphs.get(int(graph))
    if g is None:
        return (E.cudaErrorInvalidValue, None)
    handle = 0x4000_0000 + next(Stream._ids) * 0x10
    s.execs[handle] = GraphExec(g)
    return (OK, real_runtime.cudaGraphExec_t(handle))


def cudaGraphLaunch(graphExec: Any, stream: Any) -> Any:  # noqa: N802, N803
    s = _context_call("cudaGraphLaunch", (graphExec, stream))
    ex = s.execs.get(int(graphExec))
    st = _stream_or_error(s, stream)
    if ex is None or st is None:
        return (E.cudaErrorInvalidValue,)
    bad = s.implicit_capture(st, "cudaGraphLaunch")
    if bad is not None:
        return (bad,)
    g = ex.graph
    if g.launched and any(a.freed is None for a in g.unfreed):
        # Programming Guide, "Graph Memory Nodes": a graph whose allocation was not freed cannot be relaunched
        s.violations.record("a graph with an unfreed allocation was launched again")
        return (E.cudaErrorInvalidValue,)
    g.launched = True
    for name, fn in g.nodes:  # a node that is a launch of its own (an NCCL kernel) is launched anew
        pos = st.enqueue(f"graph node {name}", fn.instance() if hasattr(fn, "instance") else fn)
        if isinstance(fn, graph_events.RecordNode):
            fn.arm(st, pos)
    return (OK,)


def cudaGraphDestroy(graph: Any) -> Any:  # noqa: N802
    s = _count("cudaGraphDestroy")
    g = s.graphs.pop(int(graph), None)
    if g is None:
        return (E.cudaErrorInvalidValue,)
    for u in g.user_objects:  # the graph's references (Programming Guide, "CUDA User Objects")
        u.release()
    return (OK,)


def cudaGraphExecDestroy(graphExec: Any) -> Any:  # noqa: N802, N803
    s = _count("cudaGraphExecDestroy")
    ex = s.execs.pop(int(graphExec), None)
    if ex is None:
        return (E.cudaErrorInvalidValue,)
    for u in ex.graph.user_objects:
        u.release()
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
    bad = s.implicit_capture(st, "cudaEventRecord")
    if bad is not None:
        return (bad,)
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
    bad = s.implicit_capture(st, "cudaStreamWaitEvent")
    if bad is not None:
        return (bad,)
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
    s.synchronized()
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




_FUNCTIONS: list[Callable[..., Any]] = [
    cudaGetDeviceCount, cudaGetDevice, cudaSetDevice, cudaDeviceGetAttribute, cudaDeviceGetStreamPriorityRange,
    cudaDriverGetVersion, cudaRuntimeGetVersion, cudaGetErrorName, cudaGetErrorString, cudaGetLastError,
    cudaThreadExchangeStreamCaptureMode, cudaStreamCreate, cudaStreamCreateWithFlags, cudaStreamCreateWithPriority,
    cudaStreamDestroy, cudaStreamSynchronize, cudaStreamQuery, cudaStreamIsCapturing, cudaStreamBeginCapture,
    cudaStreamEndCapture, cudaGraphInstantiate, cudaGraphLaunch, cudaGraphDestroy, cudaGraphExecDestroy,
    cudaEventCreate, cudaEventCreateWithFlags, cudaEventDestroy, cudaEventRecord, cudaStreamWaitEvent,
    cudaEventQuery, cudaEventSynchronize, cudaEventElapsedTime, *cuda_memory.FUNCTIONS, *graph_events.FUNCTIONS]


# --- the driver functions --------------------------------------------------------------------------------

def cuInit(Flags: Any) -> Any:  # noqa: N802, N803
    sim()
    return (real_driver.CUresult.CUDA_SUCCESS,)


def cuDeviceGetCount() -> Any:  # noqa: N802
    return (real_driver.CUresult.CUDA_SUCCESS, sim().ndev)


def cuDriverGetVersion() -> Any:  # noqa: N802
    return (real_driver.CUresult.CUDA_SUCCESS, module_load.VERSIONS.driver)


def cuDevicePrimaryCtxGetState(dev: Any) -> Any:  # noqa: N802
    """Driver API, cuDevicePrimaryCtxGetState: the primary context's flags and whether it is active; creates
    none."""
    s = sim()
    d = int(dev)
    if not 0 <= d < s.ndev:
        return (real_driver.CUresult.CUDA_ERROR_INVALID_DEVICE, None, None)
    return (real_driver.CUresult.CUDA_SUCCESS, 0, int(d in s.contexts))


_DRIVER_FUNCTIONS: list[Callable[..., Any]] = [cuInit, cuDeviceGetCount, cuDriverGetVersion, cuDevicePrimaryCtxGetState,
                                                *module_load.FUNCTIONS]


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
    if cuda_state.SIM is not None:
        cuda_state.SIM.close()
    cuda_state.SIM = Sim(devices)
    return cuda_state.SIM


def uninstall() -> None:
    if cuda_state.SIM is not None:
        cuda_state.SIM.close()
    cuda_state.SIM = None
