"""The null backend: a measuring tool, not a transport.

Its communicator sends nothing and every operation completes the moment it
is enqueued, so that what a collective costs above the Communicator contract
(the group layer: argument checks, numbering, flight recorder, Work,
watchdog, wait) can be measured apart from any transport
(tools/bench_hot_path.py) and counted (tests/test_hot_path.py).

It keeps the contract where the contract is about the host side: numpy
arrays as the host backend takes them, streams whose events are complete
once recorded (and time like real ones), groups that must balance, abort and
injected failures that fail the operations that follow and show through
``async_error()``. What it cannot be is a collective: the communicator
leaves outputs as they are (an in-place operation is a no-op; an
out-of-place output is not written; list-shaped outputs, copied out of the
group layer's temporary buffer, come back zero), and ``split`` refuses,
since no rank learns the others' colors.
Not registered by default: ``nccl_pg.testing.register_null_backend()``
makes ``init_process_group("null", ...)`` use it, in the calling process.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..errors import DistBackendError
from ..reduce_op import ReduceOp
from .base import CommConfig, CommState, Communicator, Event, Stream
from .host.backend import CpuArrays, HostNanScan


class NullEvent(Event):
    """Complete once recorded; times with the clock read at its record."""

    time_ns: int | None = None  # a class default, no __init__: the null backend measures the layer above it

    def query(self) -> bool:
        return True

    def synchronize(self, timeout: float | None = None) -> bool:
        return True

    def elapsed_ms(self, end: Event) -> float:
        if not isinstance(end, NullEvent):
            raise TypeError(f"elapsed_ms needs a NullEvent, got {type(end).__name__}")
        if self.time_ns is None or end.time_ns is None:
            raise RuntimeError("elapsed_ms: both events must be recorded")
        return (end.time_ns - self.time_ns) / 1e6


class NullStream(Stream):
    """A stream whose work is done when enqueued: always idle."""

    capturing = False  # never in a CUDA graph (a plain attribute: read on every operation)

    def record(self, event: Event | None = None) -> NullEvent:
        if event is None:
            ev = NullEvent()
        elif isinstance(event, NullEvent):
            ev = event
        else:
            raise TypeError(f"a NullStream records NullEvents, got {type(event).__name__}")
        ev.time_ns = time.perf_counter_ns()
        return ev

    def wait_event(self, event: Event) -> None:
        if not isinstance(event, NullEvent):
            raise TypeError(f"a NullStream waits on NullEvents, got {type(event).__name__}")

    def query(self) -> bool:
        return True

    def synchronize(self, timeout: float | None = None) -> bool:
        return True


class NullCommunicator(Communicator):
    """``nranks`` ranks that never talk; see the module's docstring."""

    def __init__(self, rank: int, nranks: int, config: CommConfig) -> None:
        if not 0 <= rank < nranks:
            raise ValueError(f"rank {rank} out of range for {nranks} ranks")
        self.rank, self.nranks, self.config = rank, nranks, config
        self._state = CommState.READY
        self._error: BaseException | None = None
        self._depth = 0
        self._splits = 0

    def __repr__(self) -> str:
        return f"NullCommunicator(rank {self.rank}/{self.nranks}, {self._state.value})"

    # --- lifecycle ------------------------------------------------------------------

    @property
    def state(self) -> CommState:
        return self._state

    def wait_ready(self, timeout: float | None = None) -> None:
        if self._state is not CommState.READY:
            raise self._error or DistBackendError(f"null communicator: not ready ({self._state.value})")

    def async_error(self) -> BaseException | None:
        return self._error

    def fail(self, error: BaseException) -> None:
        """Break the communicator with ``error``, as a lost peer would (for
        tests of the layers above): the first cause stays."""
        if self._error is None:
            self._error, self._state = error, CommState.ERROR

    def split(self, color: int | None, key: int, config: CommConfig | None = None) -> Communicator | None:
        self._usable()
        self._splits += 1
        raise NotImplementedError("the null communicator cannot split: a split needs the other ranks' colors, "
                                  "and it never talks to them")

    @property
    def split_count(self) -> int:
        return self._splits

    def abort(self) -> None:
        self.fail(DistBackendError(f"null communicator aborted on rank {self.rank}"))
        if self._state is not CommState.DESTROYED:
            self._state = CommState.ABORTED

    def finalize(self, timeout: float | None = None) -> None:
        if self._error is not None:
            raise self._error

    def destroy(self) -> None:
        self.fail(DistBackendError(f"null communicator destroyed on rank {self.rank}"))
        self._state = CommState.DESTROYED

    def new_stream(self, high_priority: bool = False) -> NullStream:
        return NullStream()

    def new_event(self, timing: bool = False) -> NullEvent:
        return NullEvent()

    # --- operations: checked for a usable communicator, then done ------------------------

    def _usable(self) -> None:
        if self._error is not None:
            raise self._error

    def all_reduce(self, send: Any, recv: Any, op: ReduceOp, stream: Stream, scale: float | None = None) -> None:
        self._usable()

    def broadcast(self, send: Any, recv: Any, root: int, stream: Stream) -> None:
        self._usable()

    def reduce(self, send: Any, recv: Any, op: ReduceOp, root: int, stream: Stream,
               scale: float | None = None) -> None:
        self._usable()

    def all_gather(self, send: Any, recv: Any, stream: Stream) -> None:
        self._usable()

    def reduce_scatter(self, send: Any, recv: Any, op: ReduceOp, stream: Stream, scale: float | None = None) -> None:
        self._usable()

    def all_to_all(self, send: Any, recv: Any, stream: Stream, send_counts: Sequence[int] | None = None,
                   recv_counts: Sequence[int] | None = None) -> None:
        self._usable()

    def gather(self, send: Any, recv: Any, root: int, stream: Stream) -> None:
        self._usable()

    def scatter(self, send: Any, recv: Any, root: int, stream: Stream) -> None:
        self._usable()

    def send(self, buf: Any, peer: int, stream: Stream) -> None:
        self._usable()

    def recv(self, buf: Any, peer: int, stream: Stream) -> None:
        self._usable()

    def group_start(self) -> None:
        self._depth += 1

    def group_end(self) -> None:
        if self._depth == 0:
            raise RuntimeError("group_end() without group_start()")
        self._depth -= 1


class NullBackend(CpuArrays):
    """numpy arrays, taken and checked as the host backend does; copies and
    NaN scans run at once, in the caller's thread (the streams are always
    idle)."""

    name = "null"

    def create(self, store: Any, nranks: int, rank: int, config: CommConfig, device: Any = None) -> NullCommunicator:
        return NullCommunicator(rank, nranks, config)

    def empty(self, count: int, dtype: Any, device: Any = None) -> np.ndarray:
        # Zeros: the communicator never writes the group layer's temporaries, which list-shaped collectives
        # then copy into their outputs; those get defined contents.
        return np.zeros(count, dtype=dtype)

    def copy(self, dst: np.ndarray, src: np.ndarray, stream: Stream) -> None:
        np.copyto(dst, src)

    def find_nan(self, arrays: Sequence[Any], stream: Stream | None, trap: Callable[[int], str] | None,
                 device: Any = None) -> HostNanScan:
        scan = HostNanScan(list(arrays), trap)
        scan.run()
        return scan


NULL = NullBackend()
