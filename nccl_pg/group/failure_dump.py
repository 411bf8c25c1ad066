"""A group's dump for its first failure: this rank's own, and a signal that
asks every other rank of the group for theirs.

Once per group. The rank's own dump is written even within the quiet
period of another dump of this process (a dump signalled before the rank
reached the failed collective would say it never got there); only the
signal to the others keeps the quiet period (a failure that soon after
another is most likely its consequence, whose signal reached everyone).
"""

from __future__ import annotations

import threading

from .. import env
from ..diagnostics import dump
from ..diagnostics.group_view import GroupView
from . import watchdog

# A failure within this long of another dump of this process signals the other ranks no second time.
QUIET = 30.0


class FailureDump:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._done = False

    def first(self, error: BaseException, rank: int, view: GroupView, uid: int) -> None:
        """Dump for ``error`` on global rank ``rank`` of group ``view``
        (number ``uid``), unless this group dumped for a failure already."""
        with self._lock:
            if self._done:
                return
            self._done = True
        if not env.DUMP_ON_TIMEOUT.get() or "debug dump:" in str(error):  # a timeout has written its dump
            return
        dog = watchdog.get()
        quiet = dump.written_within(QUIET)
        dog.write_dump(str(error), rank)
        if not quiet:
            dog.diagnosis.request_dumps(view, f"failure on group {uid}: {error}")
