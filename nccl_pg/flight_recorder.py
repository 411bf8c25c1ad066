"""The flight recorder: a process-wide ring buffer with one entry per
collective, point-to-point operation or coalesced group, for diagnosing
hangs after the fact.

Entries use PyTorch's field names and its dump layout (version "2.10"), so
PyTorch's analyzer reads our dumps and ``nccl-pg trace`` reads theirs.
Recording is cheap: a slot object filled with values the caller already has
(no stack capture unless ``NCCL_PG_TRACE_STACKS`` is on). States move from
scheduled to started (with timing) to completed as the watchdog observes
them; a dump only copies entries under the lock and never waits on a
stream.
"""

from __future__ import annotations

import itertools
import pickle
import threading
import time
import traceback
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from . import env

if TYPE_CHECKING:
    from .process_group import ProcessGroup

VERSION = "2.10"

# numpy dtype name -> the name torch's recorder writes (c10::ScalarType)
_TORCH_DTYPE = {
    "float32": "Float", "float64": "Double", "float16": "Half", "bfloat16": "BFloat16", "int8": "Char",
    "uint8": "Byte", "int16": "Short", "int32": "Int", "int64": "Long", "bool": "Bool", "uint16": "UInt16",
    "uint32": "UInt32", "uint64": "UInt64", "complex64": "ComplexFloat", "complex128": "ComplexDouble",
    "float8_e4m3fn": "Float8_e4m3fn", "float8_e5m2": "Float8_e5m2",
}


def dtype_name(dtype: Any) -> str:
    name = np.dtype(dtype).name
    return _TORCH_DTYPE.get(name, name)


class Entry:
    __slots__ = ("record_id", "pg_id", "process_group", "thread_name", "thread_id", "collective_seq_id",
                 "p2p_seq_id", "op_id", "profiling_name", "time_created_ns", "duration_ms", "input_sizes",
                 "input_dtypes", "output_sizes", "output_dtypes", "state", "time_discovered_started_ns",
                 "time_discovered_completed_ns", "retired", "timeout_ms", "is_p2p", "frames")

    def as_dict(self, stacks: bool) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in self.__slots__ if k != "frames"}
        d["frames"] = self.frames if stacks and self.frames else []
        return d


class FlightRecorder:
    def __init__(self, capacity: int, stacks: bool) -> None:
        self.capacity = capacity
        self.stacks = stacks
        self._ring: list[Entry | None] = [None] * capacity
        self._next = 0
        self._ids = itertools.count()
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    def record(self, pg: ProcessGroup, name: str, collective_seq: int, p2p_seq: int, op_id: int,
               inputs: Sequence[Any], outputs: Sequence[Any], is_p2p: bool) -> Entry | None:
        """A new entry in state "scheduled"; None when the recorder is off."""
        if not self.capacity:
            return None
        e = Entry()
        e.pg_id, e.process_group = pg.uid, (pg.group_name, pg.group_desc)
        t = threading.current_thread()
        e.thread_name, e.thread_id = t.name, t.ident
        e.collective_seq_id, e.p2p_seq_id, e.op_id = collective_seq, p2p_seq, op_id
        e.profiling_name, e.time_created_ns = name, time.time_ns()
        e.input_sizes = [list(getattr(a, "shape", ())) for a in inputs]
        e.input_dtypes = [dtype_name(a.dtype) for a in inputs]
        e.output_sizes = [list(getattr(a, "shape", ())) for a in outputs]
        e.output_dtypes = [dtype_name(a.dtype) for a in outputs]
        e.state, e.retired, e.duration_ms = "scheduled", False, None
        e.time_discovered_started_ns = e.time_discovered_completed_ns = None
        e.timeout_ms, e.is_p2p = int(pg._timeout * 1000), is_p2p
        e.frames = ([{"name": f.name, "filename": f.filename, "line": f.lineno}
                     for f in reversed(traceback.extract_stack()[:-3])] if self.stacks else None)
        with self._lock:
            e.record_id = next(self._ids)
            self._ring[self._next] = e
            self._next = (self._next + 1) % self.capacity
        return e

    def entries(self) -> list[Entry]:
        """Oldest first."""
        with self._lock:
            ring = self._ring[self._next:] + self._ring[:self._next]
        return [e for e in ring if e is not None]

    def reset(self) -> None:
        with self._lock:
            self._ring = [None] * self.capacity
            self._next = 0

    def dump(self, groups: Sequence[ProcessGroup], include_collectives: bool = True,
             include_stack_traces: bool = True, only_active: bool = False) -> dict[str, Any]:
        """PyTorch's dump layout as a dict (``pickle.dumps`` it for their tools)."""
        out: dict[str, Any] = {"version": VERSION, "comm_lib_version": _comm_lib_version(groups)}
        out["pg_config"] = {pg.group_name: {"name": pg.group_name, "desc": pg.group_desc,
                                            "ranks": str(pg._global_ranks or list(range(pg.size())))}
                            for pg in groups}
        out["pg_status"] = {str(pg.uid): {"last_enqueued_collective": pg._seq or -1,
                                          "last_started_collective": pg._started_seq or -1,
                                          "last_completed_collective": pg._completed_seq or -1}
                            for pg in groups}
        if include_collectives:
            out["entries"] = [e.as_dict(include_stack_traces) for e in self.entries()
                              if not (only_active and e.state == "completed")]
        return out


def _comm_lib_version(groups: Sequence[ProcessGroup]) -> str:
    names = sorted({pg.backend_name for pg in groups})
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
    from . import watchdog

    dog = watchdog.existing()
    groups = dog.groups() if dog is not None else []
    return pickle.dumps(get().dump(groups, include_collectives, include_stack_traces, only_active))
