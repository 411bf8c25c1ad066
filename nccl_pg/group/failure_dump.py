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
        self._dumped = self._signalled = False
        self._quiet = False  # another dump of this process came within QUIET before ours

    def own(self, error: BaseException, rank: int) -> None:
        """This rank's dump for ``error`` (global rank ``rank``), once: before
        the failed Work's waiters wake, so that a process ending on the error
        leaves it."""
        with self._lock:
            if self._dumped:
                return
            self._dumped = True
        if not env.DUMP_ON_TIMEOUT.get() or "debug dump:" in str(error):  # a timeout has written its dump
            return
        self._quiet = dump.written_within(QUIET)
        watchdog.get().write_dump(str(error), rank)

    def first(self, error: BaseException, rank: int, view: GroupView, uid: int) -> None:
        """The group's first failure, in its error handling: this rank's dump
        (``own``), then the signal asking the other ranks of ``view`` (group
        ``uid``) for theirs, once, and not within the quiet period. The signal
        goes after the waiters woke, as the error handling does: sooner, it
        reaches a culprit still unwinding its own exception, whose dump would
        then show it in the harness's code instead of where it raised."""
        self.own(error, rank)
        with self._lock:
            if self._signalled:
                return
            self._signalled = True
        if env.DUMP_ON_TIMEOUT.get() and "debug dump:" not in str(error) and not self._quiet:
            watchdog.get().diagnosis.request_dumps(view, f"failure on group {uid}: {error}")
