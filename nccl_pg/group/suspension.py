"""Suspend and resume a process group: free its communicator's GPU memory
between phases (RL rollouts, inference) and take it back (NCCL >= 2.29.7:
ncclCommSuspend, ncclCommResume, ncclCommMemStats; docs/NCCL_BACKEND.md,
"Suspend and resume").

Both are collective: every rank of the group calls them, each within its
deadline. NCCL's suspend synchronizes the device and waits in a barrier for
every rank, so it must not meet an operation in flight: ``suspend`` first
waits (within the deadline) for the group's pending operations, in order, and
refuses, naming them, if they do not finish; nothing is suspended then. While
suspended the group refuses operations (NCCL: "The communicator cannot be
used for any NCCL operations while suspended"), and the watchdog leaves it
alone: a suspended group has nothing pending and is not stuck. A rank that
never suspends leaves the others' barrier waiting: at the deadline they fail,
and their communicators are aborted (only the abort flag ends NCCL's wait).
The host backend holds no GPU memory: it refuses, saying so.
"""

from __future__ import annotations

from collections.abc import Callable

from ..comm.base import Communicator
from ..errors import DistBackendError
from ..timeouts import Timeout, to_seconds
from .core import GroupCore, GroupState


class Suspension(GroupCore):
    """suspend(), resume() and mem_stats() of a process group (see ProcessGroup)."""

    def _memory_comm(self, what: str) -> Communicator:
        """The communicator (made now if the group is lazy), if it can suspend; else why not."""
        comm = self._comm if self._state is GroupState.SUSPENDED else self._ready()[0]
        assert comm is not None
        why = comm.suspend_refusal()
        if why is not None:
            raise DistBackendError(f"process group {self.uid} ({self.group_desc!r}) on rank {self._rank}: cannot "
                                   f"{what}: {why}")
        return comm

    def suspend(self, timeout: Timeout | None = None) -> None:
        """Free the communicator's suspendable GPU memory (collective; every
        rank within ``timeout``, default the group's). Pending operations are
        waited for first; if they do not finish, nothing is suspended."""
        limit = self._timeout if timeout is None else to_seconds(timeout, "suspend timeout")
        with self._lock:
            self._check_open()
        comm = self._memory_comm("suspend")
        if not self._wait_for_pending_works(limit):
            pending = ", ".join(f"{w.op_type.name} seq {w.seq}" for w in sorted(self._pending, key=lambda w: w.seq))
            raise DistBackendError(f"timeout: process group {self.uid} ({self.group_desc!r}) on rank {self._rank}: "
                                   f"suspend refused: operations still in flight after {limit:.3f} s ({pending}); "
                                   "NCCL's suspend would wait for them for good (cudaDeviceSynchronize)")
        with self._lock:
            self._check_open()
            self._state = GroupState.SUSPENDED
        self._memory_step("suspend", lambda: comm.suspend(limit))

    def resume(self, timeout: Timeout | None = None) -> None:
        """Take the memory back (collective; every rank within ``timeout``,
        default the group's); operations work again."""
        limit = self._timeout if timeout is None else to_seconds(timeout, "resume timeout")
        with self._lock:
            if self._state is not GroupState.SUSPENDED:
                raise DistBackendError(f"process group {self.uid} ({self.group_desc!r}) on rank {self._rank}: resume "
                                       f"of a group that is not suspended ({self._state.value})")
            comm = self._comm
        assert comm is not None
        self._memory_step("resume", lambda: comm.resume(limit))
        with self._lock:
            if self._state is GroupState.SUSPENDED:
                self._state = GroupState.OPEN

    def _memory_step(self, what: str, step: Callable[[], None]) -> None:
        """The communicator's suspend or resume; a failure (its communicator aborted: a barrier with a rank
        that never came) leaves the group for its error handling."""
        try:
            step()
        except BaseException as exc:
            with self._lock:
                if self._state is GroupState.SUSPENDED:
                    self._state = GroupState.OPEN
            self._handle_error(DistBackendError(f"process group {self.uid} ({self.group_desc!r}) on rank "
                                                f"{self._rank}: {what} failed: {exc}"))
            raise

    @property
    def suspended(self) -> bool:
        return self._state is GroupState.SUSPENDED

    def mem_stats(self) -> dict[str, int]:
        """The GPU memory its communicator holds (ncclCommMemStats):
        ``suspendable_bytes``, ``persistent_bytes``, ``total_bytes`` and
        ``suspended`` (0 or 1)."""
        with self._lock:
            if self._state is not GroupState.SUSPENDED:
                self._check_open()
        return self._memory_comm("read memory statistics").mem_stats()
