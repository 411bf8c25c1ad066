"""Events recorded into CUDA graphs, and what a capture says about itself, in
the simulated CUDA runtime: the calls the watchdog's watch of CUDA-graph
replays makes (nccl_pg/group/replays.py). Each rule names the CUDA document
it follows; it proves our logic against CUDA's documented rules, never GPU
behaviour.

- ``cudaEventRecordWithFlags(event, stream, cudaEventRecordExternal)`` on a
  capturing stream adds an *event record node* to the graph (Runtime API,
  cudaEventRecordWithFlags: "cudaEventRecordExternal: Event is captured in the
  graph as an external event node when performing stream capture"): every
  launch of the graph records the event again where the node sits (Runtime
  API, cudaGraphAddEventRecordNode: "Each launch of the graph will record
  event to capture execution of the node's dependencies"). The event is
  re-armed when the graph is launched (cudaEventRecord's semantics: "Captures
  in event the contents of stream at the time of this call"), so a query
  between a launch and the node's execution says not ready. The node is work
  of the capturing stream like any other: a stream that joined the capture
  must still be joined back past it. Outside a capture the flag is invalid
  (Driver API, CUevent_record_flags: CU_EVENT_RECORD_EXTERNAL "This flag is
  invalid when used outside of capture"): ``cudaErrorInvalidValue``. With
  flags 0 it is ``cudaEventRecord``.
- ``cudaStreamGetCaptureInfo(stream)``: the capture status and, while active,
  an id "unique over the lifetime of the process" and the graph being captured
  into (Runtime API).
- User objects (Programming Guide, "CUDA User Objects"; Runtime API
  cudaUserObjectCreate, cudaGraphRetainUserObject): ``cudaUserObjectCreate``
  needs the flag cudaUserObjectNoDestructorSync ("Currently it is required");
  the caller owns the initial references; ``cudaGraphRetainUserObject`` with
  cudaGraphUserObjectMove hands them to the graph (0: new references). The
  destructor, a C function called with ``ptr``, runs once the graph and every
  instantiation of it are destroyed ("executed by a shared internal thread":
  here on the thread that released the last reference).
"""

from __future__ import annotations

import ctypes
import time
import weakref
from typing import Any

from cuda.bindings import runtime as real_runtime  # type: ignore[import-untyped]

from .cuda_state import OK, STATUS, Capture, E, Event, Stream, UserObject, context_call, count, stream_or_error

_EXTERNAL = int(real_runtime.cudaEventRecordExternal)
_NO_DESTRUCTOR_SYNC = int(real_runtime.cudaUserObjectFlags.cudaUserObjectNoDestructorSync)
_MOVE = int(real_runtime.cudaUserObjectRetainFlags.cudaGraphUserObjectMove)
_capture_graphs: weakref.WeakValueDictionary[int, Capture] = weakref.WeakValueDictionary()  # graph_out -> capture
_user_objects: dict[int, tuple[UserObject, list[int]]] = {}  # handle -> (object, [references the caller owns])


class RecordNode:
    """An event record node: records its event at each launch of the graph (cudart.cudaGraphLaunch arms it)."""

    def __init__(self, ev: Event) -> None:
        self.ev = ev

    def arm(self, st: Stream, pos: int) -> None:
        """The graph was launched on ``st`` with this node at ``pos``: the event now stands for that work."""
        mark(self.ev, st, pos)

    def __call__(self) -> None:
        if self.ev.timing:
            self.ev.stamp = time.perf_counter()


def mark(ev: Event, st: Stream, pos: int) -> None:
    """``ev`` now stands for the work of ``st`` up to ``pos`` (complete once the stream ran it)."""
    ev.captured = None
    ev.stamp = None
    ev.stream, ev.pos, ev.vc = st, pos, dict(st.vc)


def cudaEventRecordWithFlags(event: Any, stream: Any, flags: Any) -> Any:  # noqa: N802 - CUDA's names
    s = context_call("cudaEventRecordWithFlags", (event, stream, flags))
    ev, st = s.events.get(int(event)), stream_or_error(s, stream)
    if ev is None or ev.destroyed or st is None:
        s.violations.record(f"cudaEventRecordWithFlags on event 0x{int(event):x}, which is not a live event")
        return (E.cudaErrorInvalidResourceHandle,)
    f = int(flags)
    if f & ~_EXTERNAL:
        return (E.cudaErrorInvalidValue,)
    if not f:
        from .cudart import cudaEventRecord  # noqa: PLC0415 - cudart imports this module

        return cudaEventRecord(event, stream)
    bad = s.implicit_capture(st, "cudaEventRecordWithFlags")
    if bad is not None:
        return (bad,)
    if st.capture is None:
        return (E.cudaErrorInvalidValue,)
    st.enqueue("event record node (cudaEventRecordExternal)", RecordNode(ev))
    return (OK,)


def cudaStreamGetCaptureInfo(stream: Any) -> Any:  # noqa: N802
    s = context_call("cudaStreamGetCaptureInfo", (stream,))
    st = stream_or_error(s, stream)
    if st is None:
        return (E.cudaErrorInvalidValue, None, None, None, None, None, None)
    bad = s.implicit_capture(st, "cudaStreamGetCaptureInfo", invalidate=False)
    if bad is not None:
        return (bad, None, None, None, None, None, None)
    cap = st.capture
    if cap is None:
        return (OK, STATUS.cudaStreamCaptureStatusNone, 0, None, None, None, 0)
    if cap.invalid is not None:
        return (OK, STATUS.cudaStreamCaptureStatusInvalidated, 0, None, None, None, 0)
    graph = 0x3000_0000 + cap.id * 0x10  # the graph being captured into: what cudaGraphRetainUserObject takes
    _capture_graphs[graph] = cap
    return (OK, STATUS.cudaStreamCaptureStatusActive, cap.id, real_runtime.cudaGraph_t(init_value=graph), None, None,
            0)


def cudaUserObjectCreate(ptr: Any, destroy: Any, initialRefcount: Any, flags: Any) -> Any:  # noqa: N802, N803
    count("cudaUserObjectCreate")
    if int(flags) != _NO_DESTRUCTOR_SYNC or int(initialRefcount) < 1:
        return (E.cudaErrorInvalidValue, None)
    fn, arg = int(destroy), int(ptr)

    def destructor() -> None:
        ctypes.CFUNCTYPE(None, ctypes.c_void_p)(fn)(arg)

    obj = UserObject(destructor)
    obj.refs = int(initialRefcount)
    handle = 0x2000_0000 + id(obj) % 0x0FFF_FFF0
    _user_objects[handle] = (obj, [int(initialRefcount)])
    return (OK, real_runtime.cudaUserObject_t(init_value=handle))


def cudaGraphRetainUserObject(graph: Any, object: Any, count: Any, flags: Any) -> Any:  # noqa: N802, A002
    cap = _capture_graphs.get(int(graph))
    entry = _user_objects.get(int(object))
    n = int(count)
    if cap is None or entry is None or n < 1:
        return (E.cudaErrorInvalidValue,)
    obj, owned = entry
    if int(flags) & _MOVE:
        if owned[0] < n:
            return (E.cudaErrorInvalidValue,)
        owned[0] -= n  # the caller's references become the graph's
    else:
        for _ in range(n):
            obj.retain()
    for _ in range(n):  # each reference the graph holds is released with it (cudart._drop, cudaGraphDestroy)
        cap.user_objects.append(obj)
    if owned[0] == 0:
        _user_objects.pop(int(object), None)
    return (OK,)


FUNCTIONS = [cudaEventRecordWithFlags, cudaStreamGetCaptureInfo, cudaUserObjectCreate, cudaGraphRetainUserObject]
