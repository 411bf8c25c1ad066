"""The watchdog: one set of threads per process, serving every process group.

- the poller polls pending Works without blocking (event queries,
  communicator errors, deadlines) every ``NCCL_PG_WATCHDOG_INTERVAL``, so a
  Work nobody waits on still completes, fails or times out, and a broken
  communicator is acted on even when nothing is pending;
- the hook runner runs completion hooks in the order Works finish, off both
  the caller's thread and the poller (a slow hook never stalls polling);
- the reporter does all store traffic: it publishes each group's progress
  when it changes (progress.py) and watches for the dump signal a timed-out
  rank raises, so the poller never blocks on the store;
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
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

from . import dump, env, forks, progress

if TYPE_CHECKING:
    from .process_group import ProcessGroup
    from .work import Work

log = logging.getLogger(__name__)

DUMP_SIGNAL = "nccl_pg/dump_signal"
# How often the reporter looks for a dump signal.
_SIGNAL_POLL = 1.0


class Watchdog:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._pending: list[Work] = []
        self._groups: weakref.WeakSet[ProcessGroup] = weakref.WeakSet()
        self._calls: collections.deque[tuple[object, Callable[[], None]]] = collections.deque()
        self._running: set[object] = set()  # owners whose call is running now
        self._interval = env.WATCHDOG_INTERVAL.get()
        self._heartbeat_timeout = env.HEARTBEAT_TIMEOUT.get()
        self._heartbeat = time.monotonic()
        self._published: weakref.WeakKeyDictionary[ProcessGroup, tuple[int, int, int]] = weakref.WeakKeyDictionary()
        self._signals_seen: set[bytes] = set()
        self._threads: dict[str, threading.Thread] = {}
        self._dump_on_timeout = env.DUMP_ON_TIMEOUT.get()
        self._pipe: tuple[int, int, str] | None = None  # (rank, fd, path) of the dump pipe
        self._owner = forks.Owner()
        atexit.register(self._at_exit)
        self._start("poller", self._poll_loop)
        self._start("hooks", self._hook_loop)
        self._start("reporter", self._report_loop)
        if env.ENABLE_MONITORING.get():
            self._start("monitor", self._monitor_loop)

    def _start(self, name: str, target: Callable[[], None]) -> None:
        t = threading.Thread(target=target, name=f"nccl_pg-{name}", daemon=True)
        self._threads[name] = t
        t.start()

    # --- registration ------------------------------------------------------------------

    def watch_group(self, pg: ProcessGroup) -> None:
        with self._cond:
            self._groups.add(pg)

    def groups(self) -> list[ProcessGroup]:
        with self._cond:
            return list(self._groups)

    def watch(self, work: Work) -> None:
        with self._cond:  # no wake-up: the poller comes by within an interval anyway
            self._pending.append(work)

    def call_soon(self, owner: object, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the hook runner; ``owner`` is what ``drain`` waits for."""
        with self._cond:
            self._calls.append((owner, fn))
            self._cond.notify_all()

    def drain(self, owner: object, works: Callable[[], list[Work]], timeout: float) -> bool:
        """Wait until ``works()`` have all finished and ``owner``'s queued calls
        have run; False if ``timeout`` passed first."""
        deadline = time.monotonic() + timeout
        while True:
            pending = [w for w in works() if not w._poll()]
            with self._cond:
                if not pending and not self._busy(owner):
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, self._interval))

    def _busy(self, owner: object) -> bool:
        return owner in self._running or any(o is owner for o, _ in self._calls)

    # --- poller --------------------------------------------------------------------------

    def _poll_loop(self) -> None:
        prepared: set[int] = set()  # backends whose prepare_poller() ran on this thread
        while True:
            groups = self.groups()
            for pg in groups:
                if id(pg._backend) not in prepared:
                    prepared.add(id(pg._backend))
                    try:
                        pg._backend.prepare_poller()
                    except Exception:
                        log.exception("watchdog: preparing the poller for the %s backend failed", pg._backend.name)
            with self._cond:
                works = list(self._pending)
            for w in works:
                try:
                    w._poll()
                except Exception:  # the watchdog must outlive any one bad Work
                    log.exception("watchdog: polling %r failed", w)
            for pg in groups:
                try:
                    pg._check_comm()
                except Exception:
                    log.exception("watchdog: checking %r failed", pg)
            # The loop variables would keep the last Work, and through it its group, alive until the next poll
            # that has one: a group its user dropped (``del pg``) must be freed now.
            groups = works = w = pg = None  # type: ignore[assignment]
            with self._cond:
                self._pending = [w for w in self._pending if not w._done.is_set()]
                self._heartbeat = time.monotonic()
                self._cond.notify_all()
                self._cond.wait(self._interval)

    # --- hook runner ---------------------------------------------------------------------

    def _hook_loop(self) -> None:
        while True:
            with self._cond:
                while not self._calls:
                    self._cond.wait()
                owner, fn = self._calls.popleft()
                self._running.add(owner)
            try:
                fn()
            except Exception:
                log.exception("watchdog: a completion hook raised")
            finally:
                with self._cond:
                    self._running.discard(owner)
                    self._cond.notify_all()
            owner = fn = None  # type: ignore[assignment]  # (references to a group: see _poll_loop)

    # --- reporter ------------------------------------------------------------------------

    def _report_loop(self) -> None:
        next_signal_check = 0.0
        while True:
            for pg in self.groups():
                self._publish(pg)
            pg = None  # type: ignore[assignment]  # (see _poll_loop)
            now = time.monotonic()
            if now >= next_signal_check:
                next_signal_check = now + _SIGNAL_POLL
                self._check_dump_signal()
            self._check_pipe()
            time.sleep(self._interval)

    def _publish(self, pg: ProcessGroup) -> None:
        if pg._closed is not None:
            return
        state = (pg._seq, pg._completed_seq, pg._seq_p2p)
        if self._published.get(pg) == state:
            return
        try:
            progress.publish(pg, progress.snapshot(pg))
            self._published[pg] = state
        except Exception as exc:  # the store may be gone; the next change retries
            log.debug("watchdog: publishing progress of %r failed: %s", pg, exc)

    def publish_now(self, pg: ProcessGroup) -> None:
        """Publish from the calling thread (a timing-out rank, before it reads
        everyone else's)."""
        progress.publish(pg, progress.snapshot(pg))

    def _check_dump_signal(self) -> None:
        # An aborted group's store still works (only destroy may have closed it): a rank whose group the error
        # handling aborted still answers the others' dump signals.
        stores = {id(pg._store): pg for pg in self.groups() if pg._closed != "destroyed"}
        for pg in stores.values():
            try:
                if not pg._store.check([DUMP_SIGNAL]):
                    continue
                value = pg._store.get(DUMP_SIGNAL)
            except Exception:
                continue
            if value not in self._signals_seen:
                self._signals_seen.add(value)
                self.write_dump(f"signalled: {value.decode(errors='replace')}", pg._global_rank_of(pg.rank()))

    def _check_pipe(self) -> None:
        """A byte written to ``<dump prefix><rank>.pipe`` asks for a dump."""
        groups = [g for g in self.groups() if g._closed is None]
        if not self._dump_on_timeout or not groups:
            return
        rank = groups[0]._global_rank_of(groups[0].rank())
        if self._pipe is None or self._pipe[0] != rank:
            self._open_pipe(rank)
        if self._pipe is None:
            return
        try:
            data = os.read(self._pipe[1], 4096)
        except BlockingIOError:
            return
        if data:
            self.write_dump("requested through the dump pipe", rank)

    def _open_pipe(self, rank: int) -> None:
        self._close_pipe()
        path = dump.path_for(rank) + ".pipe"
        try:
            if not os.path.exists(path):
                os.mkfifo(path)
            self._pipe = (rank, os.open(path, os.O_RDONLY | os.O_NONBLOCK), path)
        except OSError as exc:  # e.g. an unwritable directory: dumps on timeout still work
            log.debug("nccl_pg: no dump pipe at %s: %s", path, exc)
            self._dump_on_timeout = False

    def _at_exit(self) -> None:
        if self._owner.here():  # a forked child's exit must not unlink its parent's pipe
            self._close_pipe(for_good=True)

    def _close_pipe(self, for_good: bool = False) -> None:
        if for_good:  # at exit: the reporter, still running, must not create the pipe again
            self._dump_on_timeout = False
        if self._pipe is not None:
            _, fd, path = self._pipe
            self._pipe = None
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(path)

    def signal_dump(self, pg: ProcessGroup, reason: str) -> None:
        """Ask every rank sharing ``pg``'s store to write its dump."""
        value = f"{reason} @ {time.time():.6f}".encode()
        self._signals_seen.add(value)  # this rank writes its own dump directly
        pg._store.set(DUMP_SIGNAL, value)

    def write_dump(self, reason: str, rank: int) -> str | None:
        try:
            path = dump.write(reason, rank, self.groups())
        except OSError as exc:
            log.error("nccl_pg: could not write the debug dump: %s", exc)
            return None
        log.warning("nccl_pg: rank %d wrote a debug dump to %s (%s)", rank, path, reason)
        return path

    # --- monitor --------------------------------------------------------------------------

    def _monitor_loop(self) -> None:
        while True:
            time.sleep(min(self._heartbeat_timeout / 4, 1.0))
            stalled = time.monotonic() - self._heartbeat
            if stalled > self._heartbeat_timeout:
                groups = self.groups()
                rank = groups[0]._global_rank_of(groups[0].rank()) if groups else -1
                reason = (f"the watchdog thread made no progress for {stalled:.1f} s "
                          f"(NCCL_PG_HEARTBEAT_TIMEOUT={self._heartbeat_timeout:g})")
                path = self.write_dump(reason, rank)
                print(f"nccl_pg: rank {rank}: {reason}; dump: {path}; ending the process with SIGABRT",
                      file=sys.stderr, flush=True)
                os.kill(os.getpid(), signal.SIGABRT)


_watchdog: Watchdog | None = None
_lock = threading.Lock()


def get() -> Watchdog:
    global _watchdog
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
