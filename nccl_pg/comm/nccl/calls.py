"""How NcclCommunicator calls NCCL (a mixin of communicator.py): every call
under the family's lock (family.py), operations issued and, on a nonblocking
communicator, polled out of ncclInProgress against the timeout; async jobs
(init, split, shrink, revoke, finalize) polled; errors recorded; aborts that
never overlap another call of the family unless a blocking call is stuck in
NCCL (the ``blocking`` variant only, see docs/NCCL_BACKEND.md).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from ...errors import DistBackendError
from ..base import CallTimeout, CommConfig, CommState, Communicator
from . import _lib
from ._lib import IN_PROGRESS, SUCCESS, bindings
from .device import adopt_thread, device_guard, restore_device
from .family import Family
from .stream import CudaStream, _AbortFlag

log = logging.getLogger(__name__)
_POLL = 0.002  # seconds between ncclCommGetAsyncError polls while an async job is in progress
_ABORT_WAIT = 2.0  # seconds abort() waits for a call (or an open group) of the family before it goes on without


class Calls(Communicator):
    # Set by NcclCommunicator.__init__ (calls.py only reads and updates them).
    name: str
    device: int
    config: CommConfig
    _rank: int
    _family: Family
    _lock: Any  # the family's RLock
    _flag: _AbortFlag
    _state: CommState
    _error: BaseException | None
    _state_lock: threading.Lock
    _ready: threading.Event
    _ctl: Any
    _ops: Any
    _src: Any
    _children: list[Any]
    _freed: bool
    _abort_pending: bool
    _calling_since: float | None
    _settles: bool  # operations on the nonblocking communicator: each one polled out of ncclInProgress
    _group_depth: int
    _nccl_open: int  # NCCL groups this communicator's owner thread has open (closed by an abort on that thread)
    _group_owner: int | None
    _captured: int  # operations captured into CUDA graphs
    _streams: list[CudaStream]
    _ctl_idle: threading.Event  # no async job (init, split, shrink, revoke, finalize) left to poll

    # --- one call ----------------------------------------------------------------------------------

    def _call(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        """One binding call; whatever it raises (NCCLError, or the binding
        refusing an argument) becomes a DistBackendError naming the call."""
        try:
            return fn(*args)
        except Exception as exc:
            err = DistBackendError(f"{self.name}: {what} failed on rank {self._rank}: {type(exc).__name__}: {exc}")
            if what in ("ncclCommInitRankConfig", "ncclCommInitRankScalable"):
                raise err from exc
            self._set_error(err)
            first = self._error
            raise (first if self._flag.aborted and first is not None else err) from exc  # an abort: say why

    def _busy(self, what: str) -> CallTimeout:
        return CallTimeout(f"timeout: {self.name}: {what} on rank {self._rank} waited {self.config.timeout:.1f} s "
                           "for another thread's NCCL call (or open group) on this communicator's family")

    def _wait_ctl_idle(self, deadline: float, what: str) -> None:
        if not self._ctl_idle.wait(max(deadline - time.monotonic(), 0.0)):
            raise DistBackendError(f"timeout: {self.name}: {what} waited for a split still in progress on rank "
                                   f"{self._rank}")

    def _enter_ops(self, what: str) -> None:
        """Take the family for an operation. On the nonblocking variant operations share the control
        communicator with splits, whose jobs leave it ncclInProgress until polled out (ncclCommEnsureReady
        refuses it meanwhile): wait (bounded) for a job in progress first."""
        if self._settles and not self._ctl_idle.is_set():
            self._wait_ctl_idle(time.monotonic() + self.config.timeout, what)
        self._acquire(what)

    def _acquire(self, what: str) -> None:
        if not self._lock.acquire(timeout=self.config.timeout):
            raise self._busy(what)

    def _check_live(self, what: str) -> None:
        if self._freed or self._ctl is None:
            raise self._error or DistBackendError(f"{self.name}: cannot {what}: {self._state.value}")

    def _issue(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        """An operation on the operations communicator (an enqueue, a group
        end) under the family lock; outside a group, on the nonblocking
        communicator, polled until NCCL finished it (bounded); marked as in
        progress for async_error()'s deadline (blocking variant)."""
        self._enter_ops(what)
        try:
            if self._freed:
                raise self._error or DistBackendError(f"{self.name}: {self._state.value}")
            self._calling_since = time.monotonic()
            try:
                result = self._call(what, fn, *args)
                if self._settles and self._group_depth == 0:
                    self._settle(what)
                return result
            finally:
                with self._state_lock:
                    self._calling_since = None
                if self._abort_pending and self._group_depth == 0:
                    self._abort_family_locked()
        finally:
            self._lock.release()

    def _settle(self, what: str) -> None:
        """The call returned ncclInProgress (a nonblocking group end runs on an NCCL thread, group.cc
        ncclGroupEndInternal): poll until it completed, before any other call (ncclCommEnsureReady refuses the
        communicator meanwhile). Bounded by the timeout; an abort requested meanwhile ends it."""
        b = bindings()
        deadline = time.monotonic() + self.config.timeout
        polls, pause = 0, 20e-6
        while True:
            code = int(self._call("ncclCommGetAsyncError", b.comm_get_async_error, self._ops))
            if code == SUCCESS:
                return
            if code != IN_PROGRESS:
                err = DistBackendError(f"{self.name}: {what} failed on rank {self._rank}: {_lib.error_text(code)}")
                self._set_error(err)
                raise err
            if self._flag.aborted or self._abort_pending:
                raise self._error or DistBackendError(f"{self.name}: aborted on rank {self._rank}")
            if time.monotonic() >= deadline:
                err = CallTimeout(f"timeout: {self.name}: {what} on rank {self._rank} did not complete within "
                                  f"{self.config.timeout:.1f} s (still in progress in NCCL)")
                self._set_error(err)
                raise err
            polls += 1
            if polls < 64:
                time.sleep(0)
            else:
                time.sleep(pause)
                pause = min(pause * 2, 1e-3)

    def _poll(self, deadline: float, what: str, comm: Any = None) -> None:
        """Poll ``comm`` (the control communicator by default) until it leaves ncclInProgress; raises its error
        or a timeout."""
        code = self._settled(deadline, what, comm)
        if code != SUCCESS:
            raise DistBackendError(f"{self.name}: NCCL {what} failed on rank {self._rank}: {_lib.error_text(code)}")

    def _settled(self, deadline: float, what: str, comm: Any = None) -> int:
        """Poll ``comm`` (the control communicator by default) until it leaves ncclInProgress; its
        ncclCommGetAsyncError then. Raises a timeout."""
        b = bindings()
        try:
            while True:
                self._acquire(what)
                try:
                    self._check_live(what)
                    target = self._ctl if comm is None else comm
                    code = int(self._call("ncclCommGetAsyncError", b.comm_get_async_error, target))
                finally:
                    self._lock.release()
                if code != IN_PROGRESS:
                    return code
                if time.monotonic() >= deadline:
                    raise DistBackendError(f"timeout: {self.name}: NCCL {what} on rank {self._rank} did not finish "
                                           f"within {self.config.timeout:.1f} s")
                time.sleep(_POLL)
        finally:
            self._ctl_idle.set()

    # --- errors ------------------------------------------------------------------------------------

    def _set_error(self, error: BaseException, state: CommState = CommState.ERROR) -> None:
        with self._state_lock:
            if self._error is None:
                self._error = error
            if self._state not in (CommState.DESTROYED, CommState.ABORTED):
                self._state = state

    def async_error(self) -> BaseException | None:
        if self._error is not None or self._state is not CommState.READY:
            return self._error
        since = self._calling_since
        if not self._settles and since is not None and time.monotonic() - since > self.config.timeout:
            self._stop_stuck_call()
            return self._error
        if not self._lock.acquire(blocking=False):
            return None  # a call is in progress: the next poll looks
        try:
            if self._freed or self._ops is None:
                return self._error
            code = int(self._call("ncclCommGetAsyncError", bindings().comm_get_async_error, self._ops))
        except DistBackendError:
            return self._error
        finally:
            self._lock.release()
        if code not in (SUCCESS, IN_PROGRESS):
            self._set_error(DistBackendError(f"{self.name}: NCCL error on rank {self._rank}: "
                                             f"{_lib.error_text(code)} (ncclCommGetAsyncError)"))
        return self._error

    def _stop_stuck_call(self) -> None:
        """Blocking variant: a call on the blocking operations communicator has not returned for the timeout
        (connection set-up waiting for a peer that never comes, a launch queue full behind a stuck kernel):
        fail, and abort the control communicator, whose abort flag the call sees (shared)."""
        self._set_error(CallTimeout(
            f"timeout: {self.name}: an NCCL call on rank {self._rank} did not return within "
            f"{self.config.timeout:.1f} s (waiting for peers that never reached the same operation?); aborted"))
        self._abort_handles(wait=0.0)

    # --- aborts -----------------------------------------------------------------------------------

    def _members(self) -> list[Calls]:
        """The NcclCommunicators of this one's family (itself at least)."""
        return self._family.members() or [self]

    def _abort_handles(self, wait: float = _ABORT_WAIT) -> None:
        """ncclCommAbort every communicator of the family, never while another call of it is in progress
        (communicators.rst, "Fault Tolerance"). A call or a group holding the family past ``wait`` aborts on its
        way out (its calls return: nonblocking ones at once, polls see the flag). Blocking variant: a call
        stuck inside NCCL only returns once the abort flag it shares with the control communicator is set, so
        that one is aborted at once: the one overlap left, which the user guide forbids."""
        members = self._members()
        self._flag.aborted = True
        for m in members:
            if m is not self:
                Calls._aborted_with(m, self.name)
        if self._lock.acquire(timeout=wait) if wait else self._lock.acquire(blocking=False):
            try:
                self._abort_family_locked()
            finally:
                self._lock.release()
            return
        for m in members:
            Calls._abort_stuck(m)
        if self._lock.acquire(timeout=_ABORT_WAIT):  # the call returned: finish here
            try:
                self._abort_family_locked()
            finally:
                self._lock.release()

    @staticmethod
    def _aborted_with(m: Calls, name: str) -> None:
        m._set_error(DistBackendError(f"{m.name}: aborted with {name}, which shares its NCCL resources "
                                      "(CommConfig.split_share)"), CommState.ABORTED)
        m._ready.set()

    @staticmethod
    def _abort_stuck(m: Calls) -> None:
        """The family is held: its holder aborts on its way out. A blocking call stuck inside NCCL is reached
        through its control communicator's abort flag (shared)."""
        with m._state_lock:
            m._abort_pending = True
            ctl = m._ctl if not m._settles and m._calling_since is not None else None
            if ctl is not None:
                m._ctl = None
        if ctl is not None:
            prev = device_guard(m.device)
            try:
                m._abort_one("control", ctl)
            finally:
                restore_device(prev)

    def _abort_family_locked(self) -> None:
        members = self._members()
        handles: list[tuple[Calls, str, Any]] = []
        for m in members:
            handles += Calls._handles_of(m)
        if not handles:
            return
        if any(Calls._captured_ops(m) for m in members):
            # NCCL's abort waits for the CUDA graphs that captured collectives (init.cc commReclaim ->
            # commDestroySync, localPersistentRefs): on a helper thread, so that this one stays bounded
            t = threading.Thread(target=self._abort_all, args=(handles, True), daemon=True,
                                 name=f"nccl_pg-nccl-abort-{self.name}")
            t.start()
            t.join(_ABORT_WAIT)
            if t.is_alive():
                log.warning("%s: ncclCommAbort waits until the CUDA graphs that captured this communicator's "
                            "operations are destroyed; it finishes then", self.name)
        else:
            self._abort_all(handles, False)

    @staticmethod
    def _handles_of(m: Calls) -> list[tuple[Calls, str, Any]]:
        m._close_own_groups()
        return [(m, which, comm) for which, comm in m._take_handles()]

    @staticmethod
    def _captured_ops(m: Calls) -> int:
        return m._captured

    def _abort_all(self, handles: list[tuple[Calls, str, Any]], own_thread: bool) -> None:
        if own_thread:
            adopt_thread(self.device)
            prev = None
        else:
            prev = device_guard(self.device)  # NCCL restores the caller's device: make it ours (no context on 0)
        try:
            for m, which, comm in handles:
                Calls._abort_handle(m, which, comm)
        finally:
            restore_device(prev)

    @staticmethod
    def _abort_handle(m: Calls, which: str, comm: Any) -> None:
        if comm.handle:  # a child NCCL has not written (its split still NULL after the parent's abort) is nothing
            m._abort_one(which, comm)

    @staticmethod
    def _stopped(m: Calls) -> None:
        """After an abort: the buffers kept for its operations go (they were stopped); init waiters return."""
        for s in m._streams:
            s.release_kept()
        m._ready.set()

    def _take_handles(self) -> list[tuple[str, Any]]:
        with self._state_lock:
            ctl, ops, src, children = self._ctl, self._ops, self._src, self._children
            self._ctl = self._ops = self._src = None
            self._children = []
            self._freed = True
            self._abort_pending = False
        out: list[tuple[str, Any]] = []
        if ctl is not None:
            out.append(("control", ctl))
        out += [("split", c) for c in children]  # written once the parent's abort ended their jobs (see below)
        for which, comm in (("split source", src), ("operations", ops)):
            if comm is not None and comm is not ctl and all(comm is not c for _, c in out):
                out.append((which, comm))
        return out

    def _close_own_groups(self) -> None:
        """An abort on the thread that has this communicator's NCCL group open closes it first: group state is
        thread-local (group.cc), and a group left open would queue this thread's later calls for good."""
        if self._nccl_open and self._group_owner == threading.get_ident():
            for _ in range(self._nccl_open):
                try:
                    bindings().group_end()
                except Exception:  # the group's launch failed: the communicator goes anyway
                    pass
            self._nccl_open = 0

    def _abort_one(self, which: str, comm: Any) -> None:
        try:
            bindings().comm_abort(comm)
        except Exception as exc:  # abort must not raise; the communicator is unusable either way
            self._set_error(DistBackendError(f"{self.name}: ncclCommAbort of the {which} communicator failed on "
                                             f"rank {self._rank}: {exc}"))
