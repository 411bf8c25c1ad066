"""torch Works over our Works, and our errors as torch's exception types.

A torch Future must complete as soon as its operation does (DDP's reducer
blocks on it every step), sooner than the watchdog's 0.1 s poll: each torch
group has a few completer threads that wait for the operations whose futures
were asked for and settle them.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as tdist

from .. import errors
from ..group.work import Work
from ..timeouts import to_seconds

_THREADS = 16  # futures being waited for at once per group; more queue up
_KEPT = 16  # latest TorchWorks of a group kept alive (see Completer)
_MAP: tuple[tuple[type[BaseException], type[BaseException]], ...] = (
    (errors.DistStoreError, tdist.DistStoreError),
    (errors.DistNetworkError, tdist.DistNetworkError),
    (errors.DistError, tdist.DistBackendError),  # DistBackendError, NanError and the base class
)


def to_torch(exc: BaseException) -> BaseException:
    """The torch exception type torch code catches for ``exc``, same
    message; anything else unchanged."""
    if isinstance(exc, tdist.DistError):
        return exc
    for ours, theirs in _MAP:
        if isinstance(exc, ours):
            return theirs(str(exc))
    return exc


class Slot:
    """Where a torch Work finds its Work of ours: at once, or at the end of
    the coalescing block it was issued in."""

    __slots__ = ("work",)

    def __init__(self, work: Work | None = None) -> None:
        self.work = work


def _seconds(timeout: Any) -> float | None:
    """torch's Work.wait limit as ours: a timedelta, or a number of seconds
    (pybind11 reads a float as seconds); 0, torch's kNoTimeout, is no limit."""
    if timeout is None:
        return None
    s = to_seconds(timeout, "wait(timeout)", zero=True, forever=True)
    return s if s > 0 else None


class TorchWork(tdist.Work):
    """One operation as torch sees it; ``tensors`` are its results, shaped
    as torch's (a list of lists for the list-output collectives)."""

    def __init__(self, slot: Slot, tensors: list[Any], completer: Completer,
                 future_value: Callable[[], list[Any]] | None = None) -> None:
        super().__init__()
        self._slot = slot
        self._tensors = tensors
        self._future_value = future_value
        self._completer = completer
        self._future: torch.futures.Future | None = None
        self._lock = threading.Lock()
        completer.keep(self)

    def _work(self) -> Work:
        if self._slot.work is None:
            raise RuntimeError("nccl_pg: an operation issued inside a coalescing block has no result before "
                               "the block ends")
        return self._slot.work

    def wait(self, timeout: Any = None) -> bool:
        try:
            return self._work().wait(_seconds(timeout))
        except BaseException as exc:
            mapped = to_torch(exc)
            if mapped is exc:
                raise
            raise mapped from exc

    def is_completed(self) -> bool:
        return self._slot.work is not None and self._slot.work.is_completed()

    def is_success(self) -> bool:
        return self._slot.work is not None and self._slot.work.is_success()

    def exception(self) -> BaseException | None:
        exc = None if self._slot.work is None else self._slot.work.exception()
        return None if exc is None else to_torch(exc)

    def result(self) -> list[Any]:
        return self._tensors

    def _source_rank(self) -> int:
        """The group rank a receive got its data from (torch's recv() asks, for a receive from any source)."""
        try:
            return self._work().source_rank()
        except ValueError as exc:
            raise RuntimeError(str(exc)) from None

    source_rank = _source_rank

    def get_future(self) -> torch.futures.Future:
        with self._lock:
            if self._future is None:
                flat = [t for x in self._tensors for t in (x if isinstance(x, list) else [x])]
                cuda = sorted({t.device for t in flat if t.is_cuda}, key=str)
                self._future = torch.futures.Future(devices=cuda) if cuda else torch.futures.Future()
                if self.is_completed():  # settled before returning: C++ callers read value() at once
                    self._settle()
                else:
                    self._completer.submit(self)
            return self._future

    def _settle(self) -> None:
        """On the completer thread: wait, then complete the future."""
        assert self._future is not None
        try:
            self._work().wait()
        except BaseException as exc:
            mapped = to_torch(exc)
            if mapped is not exc:
                mapped.__cause__ = exc
            self._future.set_exception(mapped)
        else:
            self._future.set_result(self._tensors if self._future_value is None else self._future_value())


class Completer:
    """Threads that wait for operations and settle their futures. Several:
    a future's callbacks run on the thread that settles it, and a callback
    may issue another operation and wait for its future (torch's
    quantization hooks do) — one thread would then wait for itself.

    It also keeps the Python objects of the group's latest TorchWorks
    alive: torch may keep only a Work's C++ side (DDP keeps the all_reduce
    its Join notification issues in forward, to wait for it and read its
    future in backward), and once the Python object is gone torch's calls no
    longer reach our ``wait``/``get_future`` (the C++ defaults wait forever
    or raise "not implemented"). The last ``_KEPT`` operations are enough
    for that; more would hold their tensors too long."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._recent: deque[TorchWork] = deque(maxlen=_KEPT)

    def keep(self, work: TorchWork) -> None:
        self._recent.append(work)

    def submit(self, work: TorchWork) -> None:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(_THREADS, thread_name_prefix=self._name)
            self._pool.submit(work._settle)

    def stop(self) -> None:
        """Settle what was submitted (each wait is bounded by the group
        timeout, or released by an abort), then end the threads."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        self._recent.clear()
