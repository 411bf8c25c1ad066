"""The watchdog: one set of threads per process, serving every process group.

- the poller polls pending Works without blocking (event queries,
  communicator errors, deadlines) every ``NCCL_PG_WATCHDOG_INTERVAL``, so a
  Work nobody waits on still completes, fails or times out, and a broken
  communicator is acted on even when nothing is pending;
- the hook runner runs completion hooks in the order Works finish, off both
  the caller's thread and the poller (a slow hook never stalls polling);
- diagnosis (diagnosis.py) does all store traffic, only when something went
  wrong: a listener per store parked on the next incident's signal, and one
  thread that turns timed-out operations into errors naming the ranks to
  blame; the poller never blocks on the store;
- the monitor ends the process with SIGABRT, after a dump, if the poller
  has not completed a poll for ``NCCL_PG_HEARTBEAT_TIMEOUT`` seconds.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import logging
import os
import signal
import stat
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from .. import env
from ..diagnostics import diagnosis, dump, frames, group_view, heartbeat, stacks
from . import forks

if TYPE_CHECKING:
    from ..comm.base import Backend
    from ..diagnostics.group_view import GroupView
    from .work import Work

log = logging.getLogger(__name__)

# The monitor looks at the heartbeat this many times per heartbeat timeout (so a stall is reported within
# 1.25 timeouts), and at least once a second so that a short timeout is not overshot by much.
_HEARTBEAT_CHECKS = 4
_HEARTBEAT_CHECK_MAX = 1.0
# At exit, the longest wait for the diagnosis threads to leave their store calls: an incident in progress ends
# within its budget (2 s at most) and the time to read the answers.
_EXIT_JOIN = 5.0


class Watched(Protocol):
    """What the watchdog needs of a process group (ProcessGroup is one)."""

    @property
    def diag(self) -> GroupView: ...

    @property
    def comm_backend(self) -> Backend: ...

    def check_comm(self) -> None:
        """Act on a communicator broken while nothing was pending (never blocks)."""


class Watchdog:
    def __init__(self) -> None:
        # One lock, a condition per kind of sleeper, so that each wake-up reaches only whom it concerns: a
        # completion hook queued (once per finished Work when hooks exist) wakes the hook runner, not the poller.
        lock = threading.RLock()
        self._cond = threading.Condition(lock)  # the poller sleeps here between polls
        self._hooks_due = threading.Condition(lock)  # the hook runner waits here for calls
        self._progress = threading.Condition(lock)  # drain() waits here: a poll or a call is done
        self._pending: list[Work] = []
        self._groups: weakref.WeakSet[Watched] = weakref.WeakSet()
        self._calls: collections.deque[tuple[object, Callable[[], None]]] = collections.deque()
        self._running: set[object] = set()  # owners whose call is running now
        self._interval, self._heartbeat_timeout = env.watchdog_timing()
        self._heartbeat = time.monotonic()
        self._threads: dict[str, threading.Thread] = {}
        self._dump_on_timeout = env.DUMP_ON_TIMEOUT.get()
        self._pipe: tuple[int, int, str] | None = None  # (rank, fd, path) of the dump pipe
        self._pipe_refused: int | None = None  # the rank whose pipe could not be made or was not ours
        self._dumped: set[str] = set()  # the dump files this process wrote: one line each, however often rewritten
        self.diagnosis = diagnosis.Diagnosis(group_view.views, self.write_dump, lambda: self._dump_on_timeout)
        # C-level stack dumps (a signal's handler, a timer at the pending operations' deadline), with the dumps
        self._stacks = stacks.this_process() if self._dump_on_timeout else None
        self._owner = forks.Owner()
        self._progress_file = _progress_writer()  # under `nccl-pg run`: this rank's progress, for the launcher
        atexit.register(self._at_exit)
        self._start("poller", self._poll_loop)
        self._start("hooks", self._hook_loop)
        if env.ENABLE_MONITORING.get():
            self._start("monitor", self._monitor_loop)

    def _start(self, name: str, target: Callable[[], None]) -> None:
        t = threading.Thread(target=target, name=f"nccl_pg-{name}", daemon=True)
        self._threads[name] = t
        t.start()

    # --- registration ------------------------------------------------------------------

    def watch_group(self, pg: Watched) -> None:
        with self._cond:
            self._groups.add(pg)
        self.diagnosis.watch(pg.diag)

    def groups(self) -> list[Watched]:
        with self._cond:
            return list(self._groups)

    def watch(self, work: Work) -> None:
        with self._cond:  # no wake-up: the poller comes by within an interval anyway
            self._pending.append(work)

    def call_soon(self, owner: object, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the hook runner; ``owner`` is what ``drain`` waits for."""
        with self._cond:
            self._calls.append((owner, fn))
            self._hooks_due.notify()

    def drain(self, owner: object, works: Callable[[], list[Work]], timeout: float) -> bool:
        """Wait until ``works()`` have all finished and ``owner``'s queued calls
        have run; False if ``timeout`` passed first."""
        deadline = time.monotonic() + timeout
        while True:
            pending = [w for w in works() if not w.is_completed()]
            with self._cond:
                if not pending and not self._busy(owner):
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._progress.wait(min(left, self._interval))

    def _busy(self, owner: object) -> bool:
        return owner in self._running or any(o is owner for o, _ in self._calls)

    # --- poller --------------------------------------------------------------------------

    def _poll_loop(self) -> None:
        prepared: set[int] = set()  # backends whose prepare_poller() ran on this thread
        while True:
            groups = self.groups()
            for pg in groups:
                backend = pg.comm_backend
                if id(backend) not in prepared:
                    prepared.add(id(backend))
                    try:
                        backend.prepare_poller()
                    except Exception:
                        log.exception("watchdog: preparing the poller for the %s backend failed", backend.name)
            with self._cond:
                works = list(self._pending)
            done: set[int] = set()  # ids of the Works finished; one finished after its poll goes at the next
            for w in works:
                try:
                    if w.is_completed():
                        done.add(id(w))
                except Exception:  # the watchdog must outlive any one bad Work
                    log.exception("watchdog: polling %r failed", w)
            for pg in groups:
                try:
                    pg.check_comm()
                except Exception:
                    log.exception("watchdog: checking %r failed", pg)
            self._check_pipe()
            left = [w for w in works if id(w) not in done]
            self._keep_stacks(left)
            if self._progress_file is not None:
                self._note_progress(groups, works, done, left)
            # The loop variables would keep the last Work, and through it its group, alive until the next poll
            # that has one: a group its user dropped (``del pg``) must be freed now.
            groups = works = left = w = pg = backend = None  # type: ignore[assignment]
            with self._cond:
                self._pending = [w for w in self._pending if id(w) not in done]
                self._heartbeat = time.monotonic()
                self._progress.notify_all()
                self._cond.wait(self._interval)

    def _note_progress(self, groups: list[Watched], works: list[Work], done: set[int],
                       left: list[Work]) -> None:
        """This poll in the progress file (heartbeat.py): the process's rank in the job (that of the largest
        open group: every group's ranks are the job's), what completed, what is in flight since when."""
        assert self._progress_file is not None
        # The newest of the largest open groups: an elastic job's earlier worlds may linger, revoked.
        open_groups = [pg for pg in groups if pg.diag.state() is None]
        world = max(open_groups, key=lambda pg: (pg.diag.size, pg.diag.uid), default=None)
        rank = -1 if world is None else world.diag.global_rank(world.diag.rank)
        oldest = min(left, key=lambda w: w.issued_at, default=None)
        finished = [w for w in works if id(w) in done and w.is_success()]
        last = max(finished, key=lambda w: w.issued_at, default=None)
        try:
            self._progress_file.update(rank, len(finished), len(left), None if oldest is None else oldest.issued_at,
                                  "" if oldest is None else oldest.name(), "" if last is None else last.name())
        except Exception:  # the file is only a help to the launcher: never the poller's end
            log.debug("watchdog: progress file update failed", exc_info=True)

    # --- hook runner ---------------------------------------------------------------------

    def _hook_loop(self) -> None:
        while True:
            with self._cond:
                while not self._calls:
                    self._hooks_due.wait()
                owner, fn = self._calls.popleft()
                self._running.add(owner)
            try:
                fn()
            except Exception:
                log.exception("watchdog: a completion hook raised")
            finally:
                with self._cond:
                    self._running.discard(owner)
                    self._progress.notify_all()
            owner = fn = None  # type: ignore[assignment]  # (references to a group: see _poll_loop)

    # --- dumps --------------------------------------------------------------------------

    def ending(self) -> None:
        """The process is about to end itself (SIGABRT): no C-level stack dump
        may start now (one racing the teardown can crash the process)."""
        if self._stacks is not None:
            self._stacks.cancel()

    def _keep_stacks(self, pending: list[Work]) -> None:
        """The C-level stacks' file once a group is open, and their timer at
        the earliest deadline of the operations pending (stacks.py)."""
        if self._stacks is None:
            return
        if self._stacks.file is None:
            views = [v for v in group_view.views() if v.state() is None]
            if not views or not self._stacks.open(views[0].global_rank(views[0].rank)):
                return
        self._stacks.keep(min((w.deadline for w in pending), default=None), self._interval)

    def _check_pipe(self) -> None:
        """A byte written to ``<dump prefix><rank>.pipe`` asks for a dump
        (written off the poller, by the diagnosis thread)."""
        if not self._dump_on_timeout:
            return
        views = [v for v in group_view.views() if v.state() is None]
        if not views:
            return
        rank = views[0].global_rank(views[0].rank)
        if rank == self._pipe_refused:
            return
        if self._pipe is None or self._pipe[0] != rank:
            self._open_pipe(rank)
        if self._pipe is None:
            return
        try:
            data = os.read(self._pipe[1], 4096)
        except BlockingIOError:
            return
        if data:
            self.diagnosis.submit(lambda: self._dump_on_request(rank))

    def _dump_on_request(self, rank: int) -> None:
        self.write_dump("requested through the dump pipe", rank)

    def _open_pipe(self, rank: int) -> None:
        """Make the pipe (0600) if it is not there, and open it only if it is a
        FIFO of this user's: a file or link planted in its place is refused."""
        self._close_pipe()
        path = dump.path_for(rank) + ".pipe"
        try:
            with contextlib.suppress(FileExistsError):
                os.mkfifo(path, 0o600)
            if not _own_fifo(os.lstat(path)):
                raise OSError(f"{path} is not a named pipe of this user's; refusing it")
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
            if not _own_fifo(os.fstat(fd)):  # replaced between the check and the open
                os.close(fd)
                raise OSError(f"{path} is not a named pipe of this user's; refusing it")
            self._pipe = (rank, fd, path)
        except OSError as exc:  # e.g. an unwritable directory: dumps on timeout still work
            log.warning("nccl_pg: no dump pipe for rank %d: %s", rank, exc)
            self._pipe_refused = rank

    def _at_exit(self) -> None:
        if self._owner.here():  # a forked child's exit must not unlink its parent's pipe
            raised = getattr(sys, "last_value", None)  # the uncaught exception this process ends on, if any
            if raised is not None and self._progress_file is not None:  # first: the groups' aborts come next
                at = frames.raised_at(raised)
                self._progress_file.raised(frames.raised_line(raised), at.where if at is not None else "")
            self._close_pipe(for_good=True)
            if self._stacks is not None:
                self._stacks.close()
            # No thread of ours may still be inside a store's blocking call when the interpreter finalizes (torch's
            # store client aborts the process if its call returns then): end the listeners and incident threads.
            left = self.diagnosis.close_all(_EXIT_JOIN)
            if left:
                log.warning("nccl_pg: %d diagnosis thread(s) still in a store call at exit: %s", len(left),
                            ", ".join(t.name for t in left))

    def _close_pipe(self, for_good: bool = False) -> None:
        if for_good:  # at exit: the poller, still running, must not create the pipe again
            self._dump_on_timeout = False
        if self._pipe is not None:
            _, fd, path = self._pipe
            self._pipe = None
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(path)

    def signal_dump(self, group: Watched, reason: str) -> int:
        """Ask every other rank sharing ``group``'s store to write its dump
        (this one writes its own with ``write_dump``); returns the incident's
        number."""
        return self.diagnosis.watch(group.diag).raise_signal(reason, answer=False, dump=True)

    def write_dump(self, reason: str, rank: int) -> str | None:
        if rank < 0:  # in no group (never was, or every one went): a dump would name no rank
            log.debug("nccl_pg: no dump (%s): this process is in no process group", reason)
            return None
        try:
            path = dump.write(reason, rank, group_view.views())
        except OSError as exc:
            log.error("nccl_pg: could not write the debug dump: %s", exc)
            return None
        if path in self._dumped:  # (a signalled dump brought up to date by the rank's own failure: issue 32)
            log.info("nccl_pg: rank %d rewrote its debug dump %s (%s)", rank, path, reason)
        else:
            self._dumped.add(path)
            log.warning("nccl_pg: rank %d wrote a debug dump to %s (%s)", rank, path, reason)
        return path

    # --- monitor --------------------------------------------------------------------------

    def _monitor_loop(self) -> None:
        while True:
            time.sleep(min(self._heartbeat_timeout / _HEARTBEAT_CHECKS, _HEARTBEAT_CHECK_MAX))
            stalled = time.monotonic() - self._heartbeat
            if stalled > self._heartbeat_timeout:
                views = group_view.views()
                rank = views[0].global_rank(views[0].rank) if views else -1
                reason = (f"the watchdog thread made no progress for {stalled:.1f} s "
                          f"(NCCL_PG_HEARTBEAT_TIMEOUT={self._heartbeat_timeout:g})")
                path = self.write_dump(reason, rank)
                print(f"nccl_pg: rank {rank}: {reason}; dump: {path}; ending the process with SIGABRT",
                      file=sys.stderr, flush=True)
                self.ending()
                os.kill(os.getpid(), signal.SIGABRT)


def _progress_writer() -> heartbeat.Writer | None:
    """The progress file `nccl-pg run` asked for (NCCL_PG_PROGRESS_FILE), unless another live process of
    this job keeps it already (a child of the rank that made a group of its own)."""
    path = env.PROGRESS_FILE.get()
    if path is None:
        return None
    held = heartbeat.read(path)
    if held is not None and held.pid != os.getpid() and os.path.exists(f"/proc/{held.pid}"):
        return None
    try:
        return heartbeat.Writer(path)
    except OSError as exc:
        log.warning("nccl_pg: no progress file for the launcher: %s", exc)
        return None


def _own_fifo(st: os.stat_result) -> bool:
    return stat.S_ISFIFO(st.st_mode) and st.st_uid == os.getuid()


_watchdog: Watchdog | None = None
_lock = threading.Lock()


def get() -> Watchdog:
    global _watchdog
    dog = _watchdog
    if dog is not None:  # once started, read without the lock (every issued operation asks)
        return dog
    with _lock:
        if _watchdog is None:
            _watchdog = Watchdog()
        return _watchdog


def existing() -> Watchdog | None:
    """The watchdog if one was started (never starts one)."""
    return _watchdog


def _forget_after_fork() -> None:
    global _watchdog, _lock
    _watchdog, _lock = None, threading.Lock()  # its threads did not survive the fork


os.register_at_fork(after_in_child=_forget_after_fork)
