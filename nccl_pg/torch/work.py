"""torch Works over our Works, and our errors as torch's exception types.

A torch Future must complete as soon as its operation does (DDP's reducer
blocks on it every step), sooner than the watchdog's 0.1 s poll: each torch
group has one completer thread that waits on its operations in issue order
(a group's stream is in order) and settles their futures.
"""

from __future__ import annotations

import queue
import threading
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as tdist

from .. import errors
from ..work import Work

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
    if timeout is None:
        return None
    s = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout) / 1000.0
    return s if s > 0 else None  # torch's kNoTimeout is 0 ms


class TorchWork(tdist.Work):
    """One operation as torch sees it; ``tensors`` are its results."""

    def __init__(self, slot: Slot, tensors: list[torch.Tensor], completer: Completer) -> None:
        super().__init__()
        self._slot = slot
        self._tensors = tensors
        self._completer = completer
        self._future: torch.futures.Future | None = None
        self._lock = threading.Lock()

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

    def result(self) -> list[torch.Tensor]:
        return self._tensors

    def get_future(self) -> torch.futures.Future:
        with self._lock:
            if self._future is None:
                cuda = sorted({t.device for t in self._tensors if t.is_cuda}, key=str)
                self._future = torch.futures.Future(devices=cuda) if cuda else torch.futures.Future()
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
            self._future.set_result(self._tensors)


class Completer:
    """A thread that settles futures in the order they were asked for."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._queue: queue.SimpleQueue[TorchWork | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, work: TorchWork) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
        self._queue.put(work)

    def _run(self) -> None:
        while (work := self._queue.get()) is not None:
            work._settle()

    def stop(self) -> None:
        """Settle what was submitted, then end (each wait is bounded by the
        group timeout, or released by an abort)."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join()
