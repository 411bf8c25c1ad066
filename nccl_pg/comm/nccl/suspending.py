"""Suspend and resume (a mixin of communicator.py): ncclCommSuspend,
ncclCommResume and ncclCommMemStats of the control communicator (NCCL >=
2.29.7), as mem_manager.cc (v2.32.3-1) does them:

- both are collective: the job synchronizes the device (every stream: an
  operation still in flight would hold it for good) and meets every rank in a
  bootstrap barrier, which only the abort flag ends. So nothing may be in
  flight (``_idle_for`` waits for this communicator's streams, bounded), the
  job is polled against the deadline, and one that does not end by it (a
  rank that never suspends) is stopped by aborting the communicator;
- NCCL refuses a communicator whose memory manager is shared
  (``refCount > 1``: a ``splitShare`` family, init.cc commAlloc) with a bare
  ncclInvalidUsage: the ``blocking`` variant's operations communicator always
  shares the control one's, and so does a user split of a group with
  ``split_share`` set. Those are refused here, saying why, before NCCL is
  called; so is a second suspend (NCCL's job would fail and leave the
  communicator in that error);
- while suspended "the communicator cannot be used for any NCCL operations"
  (comms.rst): operations are refused (``_ops_comm``) until ``resume``.
"""

from __future__ import annotations

import time

from ...errors import DistBackendError
from ..base import CommState
from . import _lib
from ._lib import bindings
from .growing import Grows

SUSPEND_MEM = 0x01  # NCCL_SUSPEND_MEM
_STATS = {"suspendable_bytes": 0, "suspended": 1, "persistent_bytes": 2, "total_bytes": 3}  # ncclCommMemStat_t


class Suspends(Grows):
    def suspend_refusal(self) -> str | None:
        """Why NCCL would refuse to suspend this communicator (None: it would not)."""
        if self._version < _lib.V_SUSPEND:
            return (f"ncclCommSuspend needs NCCL >= 2.29.7; this is "
                    f"{'.'.join(map(str, _lib.version_tuple(self._version)))}")
        if self._mode == "blocking":
            return ("NCCL refuses to suspend communicators that share their memory manager (mem_manager.cc: \"Memory "
                    "suspend not supported with split_share communicators\"), and NCCL_PG_NCCL_OPS=blocking runs "
                    "operations on a communicator sharing the control one's; use the default (nonblocking)")
        if len(self._members()) > 1:
            return ("NCCL refuses to suspend communicators that share their memory manager (mem_manager.cc: \"Memory "
                    "suspend not supported with split_share communicators\"): a subgroup was split from this one "
                    "with split_share set; destroy it or split without split_share")
        return None

    def suspend(self, timeout: float) -> None:
        why = self.suspend_refusal()
        if why is not None:
            raise DistBackendError(f"{self.name}: cannot suspend on rank {self._rank}: {why}")
        if self._suspended:
            raise DistBackendError(f"{self.name}: rank {self._rank} is suspended already")
        self._memory_job("ncclCommSuspend", timeout, True)

    def resume(self, timeout: float) -> None:
        if not self._suspended:
            raise DistBackendError(f"{self.name}: resume on rank {self._rank}, which is not suspended")
        self._memory_job("ncclCommResume", timeout, False)

    def _memory_job(self, what: str, timeout: float, suspend: bool) -> None:
        """ncclCommSuspend/Resume of the control communicator, polled out of ncclInProgress by the deadline;
        a failure or a job past it aborts the communicator (its barrier would wait for good)."""
        deadline = time.monotonic() + timeout
        self._suspended = False  # _idle_for needs the communicator usable
        try:
            self._idle_for(what, deadline)
        finally:
            self._suspended = not suspend
        b = bindings()
        if suspend:
            self._start_job(what, b.comm_suspend, self._ctl, SUSPEND_MEM)
        else:
            self._start_job(what, b.comm_resume, self._ctl)
        try:
            self._poll(deadline, what.removeprefix("ncclComm").lower())
        except BaseException as exc:
            self._set_error(exc if isinstance(exc, DistBackendError) else DistBackendError(str(exc)))
            self.abort()  # the job may wait in a barrier for a rank that never comes: only the abort flag ends it
            raise
        self._suspended = suspend

    def mem_stats(self) -> dict[str, int]:
        self._need(_lib.V_SUSPEND, "ncclCommMemStats")
        if self._state is not CommState.READY:
            raise self._error or DistBackendError(f"{self.name}: memory statistics of a {self._state.value} "
                                                  "communicator")
        self._wait_ctl_idle(time.monotonic() + self.config.timeout, "ncclCommMemStats")
        self._acquire("ncclCommMemStats")
        try:
            self._check_live("read memory statistics")
            b = bindings()
            return {k: int(self._call("ncclCommMemStats", b.comm_mem_stats, self._ctl, v)) for k, v in _STATS.items()}
        finally:
            self._lock.release()
