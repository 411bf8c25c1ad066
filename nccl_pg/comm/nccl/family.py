"""The communicator family: the NCCL communicators that share resources, and
how calls on them are serialized and aborted (docs/NCCL_BACKEND.md, "The
communicator family", says it in one paragraph).

NCCL decides sharing from the *parent's* config (init.cc
ncclCommInitChildComm @ v2.30.7-1: ``comm->shareResources = !comm->revokedFlag
&& (isShrink ? (!(flags & NCCL_SHRINK_ABORT) && comm->config.shrinkShare) :
comm->config.splitShare)``), and a child that shares takes the parent's abort
flag itself (``childComm->abortFlag = comm->abortFlag``): an abort of any of
them sets it for all. So a family has one fate (aborting one member aborts
them all), one lock for every NCCL call on any member (threadsafety.rst: no
NCCL calls in parallel on a parent and a child sharing resources), and never
an ncclCommAbort while another of its calls is in progress
(communicators.rst, "Fault Tolerance").
"""

from __future__ import annotations

import threading
from typing import Any

from .stream import _AbortFlag


class Family:
    __slots__ = ("lock", "flag", "_members", "_guard")

    def __init__(self) -> None:
        self.lock = threading.RLock()  # every NCCL call on a member; held from group_start to group_end
        self.flag = _AbortFlag()  # set once the family is aborted: waits on its streams return
        self._members: list[Any] = []  # the NcclCommunicators
        self._guard = threading.Lock()  # the member list only (the family lock may be held inside NCCL)

    def join(self, comm: Any) -> None:
        with self._guard:
            self._members.append(comm)

    def leave(self, comm: Any) -> None:
        with self._guard:
            if comm in self._members:
                self._members.remove(comm)

    def members(self) -> list[Any]:
        with self._guard:
            return list(self._members)
