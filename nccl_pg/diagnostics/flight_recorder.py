"""The flight recorder: a process-wide ring buffer with one entry per
collective, point-to-point operation or coalesced group, for diagnosing
hangs after the fact.

Entries use PyTorch's field names and its dump layout (version "2.10"), so
PyTorch's analyzer reads our dumps and ``nccl-pg trace`` reads theirs.
Recording is cheap: a slot object filled with values the caller already has
(shapes and dtypes as the arrays hold them, named only when dumped), appended
to a bounded deque without a lock, no stack capture unless
``NCCL_PG_TRACE_STACKS`` is on (tools/bench_recorder.py measures it). States
move from scheduled to started (with timing) to completed as the watchdog
observes them; a dump only copies the buffer and never waits on a stream.
"""

from __future__ import annotations

import collections
import itertools
import operator
import pickle
import threading
import time
import traceback
from collections.abc import Sequence
from typing import Any

import numpy as np

from .. import env
from . import group_view
from .group_view import GroupView

VERSION = "2.10"
_RETRACTED = -1  # the record_id of an entry taken back (a coalesced group's parts, merged into one)
_by_record_id = operator.attrgetter("record_id")
_shape_dtype = operator.attrgetter("shape", "dtype")  # an array's (shape, dtype), as a comprehension would, faster
_time_ns = time.time_ns


class _ThisThread(threading.local):
    thread: threading.Thread | None = None  # a class default: reading it never raises


_this = _ThisThread()


def _current_thread() -> threading.Thread:
    """threading.current_thread(), kept per thread (every entry asks)."""
    t = _this.thread
    if t is None:
        t = _this.thread = threading.current_thread()
    return t

# numpy dtype name -> the name torch's recorder writes (c10::ScalarType)
_TORCH_DTYPE = {
    "float32": "Float", "float64": "Double", "float16": "Half", "bfloat16": "BFloat16", "int8": "Char",
    "uint8": "Byte", "int16": "Short", "int32": "Int", "int64": "Long", "bool": "Bool", "uint16": "UInt16",
    "uint32": "UInt32", "uint64": "UInt64", "complex64": "ComplexFloat", "complex128": "ComplexDouble",
    "float8_e4m3fn": "Float8_e4m3fn", "float8_e5m2": "Float8_e5m2",
}


# The coalescing manager's single-entry "fast path" in torch: a group of only
# these collectives is recorded as one entry under the second name.
_COALESCED_FAST = {"nccl:all_reduce": "nccl:allreduce_coalesced",
                   "nccl:_all_gather_base": "nccl:all_gather_into_tensor_coalesced",
                   "nccl:_reduce_scatter_base": "nccl:reduce_scatter_tensor_coalesced"}


_dtype_names: dict[Any, str] = {}


def dtype_name(dtype: Any) -> str:
    """torch's name of a dtype ("Float" for float32)."""
    try:
        return _dtype_names[dtype]
    except (KeyError, TypeError):
        pass
    try:
        name = np.dtype(dtype).name
    except TypeError:  # not a numpy dtype (e.g. a torch one): its own name
        name = str(dtype).rpartition(".")[2]
    name = _TORCH_DTYPE.get(name, name)
    try:
        _dtype_names[dtype] = name
    except TypeError:
        pass
    return name


def _pairs(arrays: Sequence[Any]) -> list[tuple[Any, Any]]:
    """(shape, dtype) of each array; torch's nested per-device lists are flattened."""
    return [(getattr(a, "shape", ()), getattr(a, "dtype", None)) for a in _flatten(arrays)]


def _shapes_dtypes(arrays: Sequence[Any]) -> list[tuple[Any, Any]]:
    """(shape, dtype) of each array (AttributeError for a nested list)."""
    if len(arrays) == 1:  # most operations: a list with one array, built without map's machinery
        a = arrays[0]
        return [(a.shape, a.dtype)]
    return list(map(_shape_dtype, arrays))


def _flatten(arrays: Sequence[Any]) -> Any:
    for a in arrays:
        if isinstance(a, (list, tuple)):
            yield from _flatten(a)
        else:
            yield a


def _sizes(pairs: Sequence[tuple[Any, Any]]) -> list[list[int]]:
    return [list(shape) for shape, _ in pairs]


def _dtypes(pairs: Sequence[tuple[Any, Any]]) -> list[str]:
    return [dtype_name(d) if d is not None else "Undefined" for _, d in pairs]


# torch's field order in a dumped entry
_FIELDS = ("record_id", "pg_id", "process_group", "thread_name", "thread_id", "collective_seq_id", "p2p_seq_id",
           "op_id", "profiling_name", "time_created_ns", "duration_ms", "input_sizes", "input_dtypes",
           "output_sizes", "output_dtypes", "state", "time_discovered_started_ns", "time_discovered_completed_ns",
           "retired", "timeout_ms", "is_p2p")


class Entry:
    """One operation. To keep recording cheap, sizes and dtypes are kept as
    the arrays have them (``ins``/``outs``: (shape, dtype) pairs), the
    thread as its object and the timeout in seconds; they take torch's forms
    (lists, "Float", names, milliseconds) when read or dumped."""

    __slots__ = ("record_id", "pg_id", "process_group", "thread", "collective_seq_id", "p2p_seq_id", "op_id",
                 "profiling_name", "time_created_ns", "duration_ms", "state", "time_discovered_started_ns",
                 "time_discovered_completed_ns", "retired", "timeout_s", "is_p2p", "frames", "ins", "outs")
    record_id: int
    pg_id: int
    process_group: tuple[str, str]  # (name, desc)
    thread: threading.Thread
    collective_seq_id: int
    p2p_seq_id: int
    op_id: int
    profiling_name: str
    time_created_ns: int
    duration_ms: float | None
    state: str  # "scheduled", "started", "completed"
    time_discovered_started_ns: int | None
    time_discovered_completed_ns: int | None
    retired: bool
    timeout_s: float
    is_p2p: bool
    frames: list[dict[str, Any]] | None
    ins: list[tuple[Any, Any]]  # (shape, dtype) of each input
    outs: list[tuple[Any, Any]]

    @property
    def input_sizes(self) -> list[list[int]]:
        return _sizes(self.ins)

    @property
    def input_dtypes(self) -> list[str]:
        return _dtypes(self.ins)

    @property
    def output_sizes(self) -> list[list[int]]:
        return _sizes(self.outs)

    @property
    def output_dtypes(self) -> list[str]:
        return _dtypes(self.outs)

    @property
    def thread_name(self) -> str:
        return self.thread.name

    @property
    def thread_id(self) -> int | None:
        return self.thread.ident

    @property
    def timeout_ms(self) -> int:
        return int(self.timeout_s * 1000)

    def as_dict(self, stacks: bool) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in _FIELDS}
        if d["duration_ms"] is None:  # as torch: present only when timed and completed
            del d["duration_ms"]
        d["frames"] = self.frames if stacks and self.frames else []
        return d


class FlightRecorder:
    def __init__(self, capacity: int, stacks: bool) -> None:
        self.capacity = capacity
        self.stacks = stacks
        # deque.append and list(deque) are atomic: no lock on the hot path
        self._ring: collections.deque[Entry] = collections.deque(maxlen=capacity or 1)
        self._ids = itertools.count()

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    def record(self, group: GroupView, timeout: float, name: str, collective_seq: int, p2p_seq: int, op_id: int,
               inputs: Sequence[Any], outputs: Sequence[Any], is_p2p: bool) -> Entry | None:
        """A new entry in state "scheduled" on ``group`` (its operations'
        timeout now: ``timeout``); None when the recorder is off."""
        if not self.capacity:
            return None
        e = Entry()
        try:
            if len(inputs) == 1:  # most operations (_shapes_dtypes inline: every operation records)
                a = inputs[0]
                ins = [(a.shape, a.dtype)]
            else:
                ins = list(map(_shape_dtype, inputs))
            outs = ins if outputs is inputs else _shapes_dtypes(outputs)
        except AttributeError:  # torch's [tensor] / [[t0, t1]] forms
            ins, outs = _pairs(inputs), _pairs(outputs)
        e.ins, e.outs = ins, outs
        e.pg_id, e.process_group = group.uid, (group.name, group.desc)
        e.thread = _this.thread or _current_thread()
        e.collective_seq_id, e.p2p_seq_id, e.op_id = collective_seq, p2p_seq, op_id
        e.profiling_name, e.time_created_ns = name, _time_ns()
        e.state, e.retired, e.duration_ms = "scheduled", False, None
        e.time_discovered_started_ns = e.time_discovered_completed_ns = None
        e.timeout_s, e.is_p2p = timeout, is_p2p
        e.frames = ([{"name": f.name, "filename": f.filename, "line": f.lineno}
                     for f in reversed(traceback.extract_stack()[:-3])] if self.stacks else None)
        e.record_id = next(self._ids)
        self._ring.append(e)
        return e

    def record_coalesced(self, group: GroupView, timeout: float, parts: Sequence[Entry], collective_seq: int,
                         p2p_seq: int, op_id: int, is_p2p: bool) -> Entry | None:
        """The entry of a coalesced group whose operations were recorded as
        ``parts``. A group of one kind of all_reduce, all_gather_into_tensor
        or reduce_scatter_tensor becomes one entry (torch's
        "nccl:<op>_coalesced", with every part's sizes) and its parts leave
        the buffer; any other group keeps its parts and ends with one
        "nccl:coalesced" entry."""
        if not self.capacity:
            return None
        names = {e.profiling_name for e in parts}
        fast = _COALESCED_FAST.get(next(iter(names))) if len(names) == 1 and not is_p2p else None
        whole = self.record(group, timeout, fast or "nccl:coalesced", collective_seq, p2p_seq, op_id, (), (), is_p2p)
        if fast and whole is not None:
            whole.ins = [p for e in parts for p in e.ins]
            whole.outs = [p for e in parts for p in e.outs]
            whole.time_created_ns, whole.frames = parts[0].time_created_ns, parts[0].frames
            for e in parts:
                e.record_id = _RETRACTED  # out of every dump; its slot ages out with the others
        return whole

    def entries(self) -> list[Entry]:
        """Oldest first."""
        return sorted((e for e in list(self._ring) if e.record_id != _RETRACTED), key=_by_record_id)

    def reset(self) -> None:
        self._ring.clear()

    def dump(self, groups: Sequence[GroupView], include_collectives: bool = True,
             include_stack_traces: bool = True, only_active: bool = False) -> dict[str, Any]:
        """PyTorch's dump layout as a dict (``pickle.dumps`` it for their tools)."""
        out: dict[str, Any] = {"version": VERSION, "comm_lib_version": _comm_lib_version(groups)}
        out["pg_config"] = {g.name: {"name": g.name, "desc": g.desc, "ranks": str(g.global_ranks())} for g in groups}
        activity = {g.uid: g.activity() for g in groups}
        out["pg_status"] = {str(uid): {"last_enqueued_collective": a.issued or -1,
                                       "last_started_collective": a.started or -1,
                                       "last_completed_collective": a.completed or -1}
                            for uid, a in activity.items()}
        if include_collectives:
            out["entries"] = [e.as_dict(include_stack_traces) for e in self.entries()
                              if not (only_active and e.state == "completed")]
        return out


def _comm_lib_version(groups: Sequence[GroupView]) -> str:
    names = sorted({g.backend for g in groups})
    return ", ".join(names) or "none"


_recorder: FlightRecorder | None = None
_lock = threading.Lock()


def get() -> FlightRecorder:
    global _recorder
    with _lock:
        if _recorder is None:
            _recorder = FlightRecorder(env.TRACE_BUFFER_SIZE.get(), env.TRACE_STACKS.get())
        return _recorder


def dump_flight_recorder(include_collectives: bool = True, include_stack_traces: bool = True,
                         only_active: bool = False) -> bytes:
    """This process's recorder as pickled bytes in PyTorch's layout
    (``_dump_nccl_trace`` in torch)."""
    return pickle.dumps(get().dump(group_view.views(), include_collectives, include_stack_traces, only_active))


def _json_ready(d: dict[str, Any]) -> dict[str, Any]:
    """torch's JSON variant: times not yet discovered are 0, not null."""
    for e in d.get("entries", ()):
        for k in ("time_discovered_started_ns", "time_discovered_completed_ns"):
            if e.get(k) is None:
                e[k] = 0
    return d


def dump_flight_recorder_json(include_collectives: bool = True, include_stack_traces: bool = True,
                              only_active: bool = False) -> str:
    """This process's recorder as JSON text (``_dump_nccl_trace_json`` in
    torch): the pickle's layout, with undiscovered times as 0."""
    import json

    return json.dumps(_json_ready(get().dump(group_view.views(), include_collectives, include_stack_traces, only_active)))
