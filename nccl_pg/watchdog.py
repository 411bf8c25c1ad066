"""The watchdog: one thread per process, serving every process group.

It polls pending Works without blocking (event queries, communicator
errors, deadlines), so a Work nobody waits on still completes, fails or
times out; and it runs completion hooks, off the caller's thread, in the
order Works finish.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from . import env

if TYPE_CHECKING:
    from .work import Work

log = logging.getLogger(__name__)


class Watchdog:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._pending: list[Work] = []
        self._calls: collections.deque[tuple[object, Callable[[], None]]] = collections.deque()
        self._running: set[object] = set()  # owners whose call is running now
        self._thread: threading.Thread | None = None
        self._interval = env.WATCHDOG_INTERVAL.get()

    def watch(self, work: Work) -> None:
        with self._cond:
            self._pending.append(work)
            self._ensure_thread()
            self._cond.notify()

    def call_soon(self, owner: object, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the watchdog thread (completion hooks); ``owner`` is
        what ``drain`` waits for."""
        with self._cond:
            self._calls.append((owner, fn))
            self._ensure_thread()
            self._cond.notify()

    def drain(self, owner: object, works: Callable[[], list[Work]], timeout: float) -> bool:
        """Wait until ``works()`` have all finished and ``owner``'s queued calls
        have run; False if ``timeout`` passed first."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while any(not w._poll() for w in works()) or self._busy(owner):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, self._interval))
        return True

    def _busy(self, owner: object) -> bool:
        return owner in self._running or any(o is owner for o, _ in self._calls)

    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._loop, name="nccl_pg-watchdog", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._calls:
                    self._cond.wait()
                works = list(self._pending)
            for w in works:
                try:
                    w._poll()
                except Exception:  # the watchdog must outlive any one bad Work
                    log.exception("watchdog: polling %r failed", w)
            self._run_calls()
            with self._cond:
                self._pending = [w for w in self._pending if not w._done.is_set()]
                self._cond.notify_all()
                if self._pending and not self._calls:
                    self._cond.wait(self._interval)

    def _run_calls(self) -> None:
        while True:
            with self._cond:
                if not self._calls:
                    return
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


_watchdog: Watchdog | None = None
_lock = threading.Lock()


def get() -> Watchdog:
    global _watchdog
    with _lock:
        if _watchdog is None:
            _watchdog = Watchdog()
        return _watchdog


def _forget_after_fork() -> None:
    global _watchdog, _lock
    _watchdog, _lock = None, threading.Lock()  # the thread did not survive the fork


os.register_at_fork(after_in_child=_forget_after_fork)
