"""ProcessGroup: one rank's view of a group of processes, over a backend.

It owns (lazily, or eagerly on request) one communicator and one stream,
numbers its operations, checks arguments, turns list-shaped arguments into
the flat buffers the Communicator contract takes (copies run on the same
stream), and hands out Works watched by the process-wide watchdog.
Ranks here are group ranks; distributed.py maps global ranks onto them.
"""

from __future__ import annotations

import atexit
from collections.abc import Sequence
from typing import Any, ClassVar

from ..comm.base import CommState, check_exclude
from ..errors import DistBackendError
from ..store import Store
from . import watchdog
from .collectives import Collectives
from .core import GroupState
from .options import Options

# shrink flags (torch's values): stop the parent's in-flight operations first, or not
SHRINK_DEFAULT = 0x00
SHRINK_ABORT = 0x01


class ProcessGroup(Collectives):
    """A group of ``size`` ranks; this process is ``rank``. Its parts, in
    nccl_pg/group/: core.py (state, communicator lifecycle, failures),
    issuing.py (one operation, coalescing), collectives.py (the
    operations); here, shrink and revoke."""

    @property
    def supports_shrinking(self) -> bool:
        """Every group can shrink: through its communicator's own shrink when
        that is alive and able (ncclCommShrink from NCCL 2.27, the host
        backend), else through a fresh communicator of the survivors."""
        return True

    def check_shrink(self, exclude: Sequence[int], flags: int) -> list[int]:
        """The sorted group ranks to exclude; raises on bad arguments."""
        if isinstance(flags, bool) or flags not in (SHRINK_DEFAULT, SHRINK_ABORT):
            raise ValueError(f"invalid shrink_flags {flags!r}: use SHRINK_DEFAULT ({SHRINK_DEFAULT}) or "
                             f"SHRINK_ABORT ({SHRINK_ABORT}, to stop operations still in flight first)")
        return check_exclude(exclude, self._size, self._rank)

    def shrink(self, excluded: list[int], abort_first: bool, options: Options | None, *, group_name: str,
               group_desc: str, uid: int, global_ranks: Sequence[int] | None = None) -> ProcessGroup:
        """Collective over the ranks not in ``excluded`` (from
        ``check_shrink``; only the survivors call it): a new group of the
        survivors, in their order. This group is left to the caller to destroy."""
        with self._lock:
            if self._state is GroupState.DESTROYED:
                raise DistBackendError(f"process group {self.uid} ({self.group_desc!r}) on rank {self._rank} was "
                                       "destroyed; it cannot be shrunk")
            comm = self._comm
            native = comm is not None and comm.supports_shrink and comm.state not in (
                CommState.ABORTED, CommState.DESTROYED, CommState.INITIALIZING)
            if abort_first:  # the failures that follow are this rank's doing: no error handling on them
                self._error_handled = True
                if self._state is GroupState.OPEN:
                    self._state, self._close_reason = GroupState.REVOKED, "shrink_group(SHRINK_ABORT)"
        survivors = [r for r in range(self._size) if r not in excluded]
        child = ProcessGroup(self._store, survivors.index(self._rank), len(survivors), options or self.options,
                             backend=self._backend, device_id=self._device, group_name=group_name,
                             group_desc=group_desc, uid=uid, global_ranks=global_ranks)
        if native:
            assert comm is not None
            if not abort_first and self._stream is not None and not self._stream.synchronize(child._timeout):
                raise DistBackendError(f"timeout: process group {self.uid} ({self.group_desc!r}) on rank "
                                       f"{self._rank}: operations issued before a shrink did not finish within "
                                       f"{child._timeout:.1f} s (SHRINK_ABORT stops them instead)")
            child._set_comm(comm.shrink(excluded, child._comm_config(), abort_first))
        else:
            if abort_first:
                self.abort()
            if self._comm is not None and self._device is not None:
                child.eager_init()  # an eager parent gets an eager child; a lazy one, a lazy child
        return child

    def revoke(self) -> None:
        """Stop this group's in-flight operations (they fail, saying
        "revoked") and refuse later ones, but keep the communicator for
        ``shrink_group``; local and bounded. Where the communicator cannot
        revoke (NCCL < 2.28.7) it is aborted, and a shrink builds a fresh one."""
        with self._lock:
            self._error_handled = True  # a revoke's failures are not errors to handle
            if self._state is GroupState.OPEN:
                self._state, self._close_reason = GroupState.REVOKED, "revoke_process_group()"
            comm = self._comm
        if comm is None:
            return
        if comm.supports_revoke and comm.state is not CommState.INITIALIZING:
            comm.revoke()
        else:
            comm.abort()


def _close_leftovers() -> None:
    """At exit: groups never destroyed are aborted (bounded), with a warning
    instead of a hang or a silent loss of pending work. Only this process's
    own groups: a forked child leaves its parent's alone."""
    dog = watchdog.existing()
    for pg in dog.groups() if dog is not None else []:
        if isinstance(pg, ProcessGroup):
            pg.close_left_open()


atexit.register(_close_leftovers)


class ProcessGroupHost(ProcessGroup):
    """The CPU backend's group (numpy arrays, TCP between ranks)."""

    def __init__(self, store: Store, rank: int, size: int, options: Options | None = None, **kwargs: Any) -> None:
        super().__init__(store, rank, size, options, backend="host", **kwargs)


class ProcessGroupNCCL(ProcessGroup):
    """The NCCL backend's group; raises ValueError where no GPU exists."""

    def __init__(self, store: Store, rank: int, size: int, options: Options | None = None, **kwargs: Any) -> None:
        super().__init__(store, rank, size, options, backend="nccl", **kwargs)

    Options: ClassVar[type[Options]] = Options  # torch's ProcessGroupNCCL.Options
