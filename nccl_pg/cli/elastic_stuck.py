"""Hung ranks under `nccl-pg run --elastic`: a rank the others' timed-out
operation names stuck has its stack taken, then the launcher stops it and
replaces it like a dead one.

The evidence: when an operation times out, the diagnosis names the ranks to
blame (``DistBackendError.culprits``: those that never issued it or did not
answer); ``Elastic.recover`` publishes them as a report in the job's store
(records.py, ``stuck/<n>``). Each launcher keeps one wait parked on the next
report (no polling), and acts on those of its own ranks that ``named_stuck``
names. ``named_stuck`` is the one rule, and it is the diagnosis's: an
operation that timed out has, by then, made no progress for its whole
timeout, far past ``verdicts.stuck_after`` (the age from which ``why``
calls a stall stuck), and its culprits are the ranks the diagnosis names
to every tool (diagnostics/verdicts.py: never joined, no answer).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable
from typing import Any

from .. import env, process_tree
from ..diagnostics import stacks
from ..elastic.records import STUCK_COUNT_KEY, Records, stuck_key
from ..errors import DistStoreError
from ..store import Store
from ..store.base import Unparked

log = logging.getLogger(__name__)

PARK = 600.0  # seconds of one parked wait for the next report (then renewed)
STACK_TIME = 2.0  # seconds a stuck rank's handler has to write its stack
STACK_CAP = 256 * 1024  # bytes of it kept


def named_stuck(report: dict[str, Any]) -> list[int]:
    """The members a report names stuck. Today's rule: no progress past a
    timeout, as the evidence says — an operation's timeout blamed them (the
    diagnosis: they never issued it, or did not answer), or they did not
    come to a recovery's configuration within a whole attempt."""
    suspects = report.get("suspects")
    if not isinstance(suspects, list):
        return []
    return sorted({s["member"] for s in suspects if isinstance(s, dict) and type(s.get("member")) is int
                   and s["member"] >= 0})


class StuckWatch:
    """The launcher's thread that reads the stuck reports. ``own()``: this
    launcher's live ranks, {member: guard pid}; ``stop(member, line)``: ask
    the launcher's loop to stop that rank (called on this thread, after its
    stack was taken); ``folder``: where the stacks go."""

    def __init__(self, store: Store, own: Callable[[], dict[int, int]], stop: Callable[[int, str], None],
                 folder: str) -> None:
        self.store, self._own, self._stop, self.folder = store, own, stop, folder
        self.records = Records(store)
        self._parking = store.parking()
        self._next = int(store.add(STUCK_COUNT_KEY, 0)) + 1  # reports from before this launcher are not its own
        self._closed = False
        self._handled: set[int] = set()
        self._thread = threading.Thread(target=self._run, name="nccl_pg-stuck-watch", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._closed = True
        self._parking.close()

    def _run(self) -> None:
        while not self._closed:
            try:
                self._parking.wait([stuck_key(self._next)], PARK)
                report = self.records.read_stuck(self._next)
            except Unparked:
                return
            except DistStoreError as exc:
                if self._closed:
                    return
                if not str(exc).startswith("timeout"):
                    log.warning("nccl-pg run: the stuck-rank watch's store failed: %s", exc)
                    threading.Event().wait(1.0)
                continue
            self._next += 1
            own = self._own()
            for member in named_stuck(report):
                if member in own and member not in self._handled:
                    self._handled.add(member)
                    self._stop(member, self._take_stack(member, own[member], report))

    def _take_stack(self, member: int, guard: int, report: dict[str, Any]) -> str:
        """Ask the rank for its C-level stack (its handler writes it); the line the launcher prints."""
        pid = _rank_pid(guard, report, member)
        reporter, uuid = report.get("reporter"), report.get("uuid")
        why = (f"it did not come to configuration {uuid} within member {reporter}'s attempt"
               if report.get("kind") == "absent" else
               f"member {reporter}'s operation timed out on it (configuration {uuid})")
        if pid is None:
            return f"{why}; its process was not found to take its stack"
        written = stacks.request(pid, env.STACKS_SIGNAL.get(), STACK_TIME, STACK_CAP)
        if written is None:
            return f"{why}; it wrote no stack within {STACK_TIME:g} s (no handler, or frozen)"
        path = os.path.join(self.folder, f"nccl_pg_stuck_member{member}.{pid}.txt")
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(f"{written.header}\n{written.text}")
        except OSError as exc:
            return f"{why}; its stack could not be saved ({exc})"
        main = next((t for t in written.threads() if t.name == "MainThread"), None)
        at = f" at {main.frames[-1].file}:{main.frames[-1].line}" if main is not None and main.frames else ""
        return f"{why}; its stack{at}: {path}"


def _rank_pid(guard: int, report: dict[str, Any], member: int) -> int | None:
    """The rank's own pid under its guard: the one the report names when it is there, else the guard's child."""
    below = process_tree.descendants(guard)
    for s in report.get("suspects", []):
        if isinstance(s, dict) and s.get("member") == member and s.get("host") in (None, socket.gethostname()) \
                and s.get("pid") in below:
            return int(s["pid"])
    return below[0] if below else None
