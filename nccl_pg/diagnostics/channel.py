"""One store's incidents, for this process: the listener parked on the next
incident's signal, the incidents raised here, the answers and reports this
process gives, and its dumps for them (the protocol: incidents.py).

Per store the ranks share, each process keeps one listener thread parked in
a wait on the key of the next incident: the server holds the wait and
answers it when the key is set, so a healthy job costs one parked request
per process, renewed every ``PARK`` seconds. The wait is a ``Parking``
(store/base.py), which ``close`` ends at once: the listener, and this
store's incident thread, end with the last group on the store (``close``,
from the diagnosis when a group is destroyed) and before the interpreter
finalizes (at exit), so that no thread of ours is inside a foreign
library's blocking call then (torch's store client aborts the process when
one returns during finalization).
"""

from __future__ import annotations

import collections
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable

from ..store import FileStore, HashStore, Store
from ..store.base import Unparked
from . import dump, incidents, progress, report
from .group_view import GroupView
from .incidents import Signal, all_key, answer_key, count_key, signal_key

log = logging.getLogger(__name__)

# Deadline of the parked wait. Renewing it is a healthy job's only store traffic: one request per process
# every 10 minutes (17 requests/s at 10,000 processes, well under 0.1% of a store server's throughput).
PARK = 600.0
# The same for a store in a file, where renewing costs no server anything.
FILE_PARK = 1.0
# A listener whose store failed (rather than timing the park out) retries after 1, 2, 4, ... s, at most this.
RETRY_CAP = 60.0
# Earlier incidents kept in mind, for what a silent rank last said.
LOOKBACK = 3
# A failure's dump request is not answered by a process that wrote a dump this recently: that failure is most
# likely a consequence of the first, whose dumps show where everyone was.
FAILURE_QUIET = 30.0  # as the group layer's own failure dumps (group/core.py _DUMP_QUIET)
# An incident thread with nothing to do for this long ends (the next incident starts another).
RUNNER_IDLE = 30.0


class Channel:
    """One store's incidents, for this process: the listener thread, the
    incidents raised here, and this process's dumps for them."""

    def __init__(self, store: Store, views: Callable[[], list[GroupView]], write_dump: Callable[[str, int],
                 str | None], dumps: Callable[[], bool], gone: Callable[[Channel], bool]) -> None:
        self.store = store
        self.token = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
        self._views, self._write_dump, self._dumps, self._gone = views, write_dump, dumps, gone
        self._lock = threading.Lock()
        self.latest = 0  # newest incident seen or raised here
        self.recent: collections.deque[int] = collections.deque(maxlen=LOOKBACK + 1)
        # this rank's dumps by what they were for (incident numbers, timed-out operations' claims)
        self._dumped: collections.OrderedDict[str, tuple[str | None, tuple[tuple[str, tuple[int, int, int]], ...]]] = \
            collections.OrderedDict()
        self._dumping = threading.Lock()  # held while a dump is written (not the channel's: that one stays quick)
        self._job: Callable[[], None] | None = None  # this store's incident work, queued or running
        self._jobs = threading.Condition(self._lock)
        self._runner: threading.Thread | None = None
        self._warned: set[bytes] = set()  # malformed hints reported already
        self.closed = False
        self._rank = -1  # the last global rank seen here (dumps are named after it)
        # in-process stores need no listener: every rank on them is in this process, on this channel
        self.thread = None if isinstance(store, HashStore) else \
            threading.Thread(target=self._listen, name="nccl_pg-signals", daemon=True)
        self._parking = None if self.thread is None else store.parking()

    def views(self) -> list[GroupView]:
        return self._views()

    def close(self) -> None:
        """End the listener (its parked wait at once) and the incident thread
        (once its job, if any, is done); idempotent."""
        with self._lock:
            self.closed = True
            self._jobs.notify_all()
        if self._parking is not None:
            self._parking.close()

    def threads(self) -> list[threading.Thread]:
        """This channel's threads (to join at exit)."""
        return [t for t in (self.thread, self._runner) if t is not None]

    # --- the listener ---------------------------------------------------------------------

    def _listen(self) -> None:
        assert self._parking is not None
        gen: int | None = None
        retry = 1.0
        park = FILE_PARK if isinstance(self.store, FileStore) else PARK
        while not self.closed:
            if self._gone(self):  # every group on this store is gone: so is the listener
                return
            t0 = time.monotonic()
            try:
                if gen is None:
                    gen = incidents.newest(self.store, self._warned)
                    self._saw(gen)
                self._parking.wait([signal_key(gen + 1)], park)
            except Unparked:
                return
            except Exception as exc:
                if time.monotonic() - t0 < park / 2 and not self.closed:  # not the park running out: it failed
                    log.debug("nccl_pg: signal listener on %r: %s; retrying in %.0f s", self.store, exc, retry)
                    with self._lock:  # close() wakes it: at exit it must end, not sleep past the join
                        self._jobs.wait_for(lambda: self.closed, retry)
                    retry = min(retry * 2, RETRY_CAP)
                continue
            retry = 1.0
            gen += 1
            try:
                self._on_signal(gen)
            except Exception as exc:  # the store went away meanwhile: the next wait says so
                log.debug("nccl_pg: answering incident %d on %r failed: %s", gen, self.store, exc)

    def _saw(self, gen: int) -> None:
        with self._lock:
            self.latest = max(self.latest, gen)
            if gen and gen not in self.recent:
                self.recent.append(gen)

    def _on_signal(self, gen: int) -> None:
        sig = Signal.decode(self.store.get(signal_key(gen)))
        self._saw(gen)
        if sig is None:
            log.warning("nccl_pg: incident %d on %r is not a signal of ours; skipped", gen, self.store)
            return
        if sig.answer:
            self.answer(gen, sig.counted)
        # A failure's request (no claims: not a timeout's) finds this process's own dump of the same failure, just
        # written, more often than not: one dump, one line.
        fresh = not sig.claims and dump.written_within(FAILURE_QUIET)
        if sig.dump and sig.origin != self.token and self._dumps() and not fresh:
            self.dump_once([f"gen {gen}", *sig.claims], f"signalled: {sig.reason}")
        if sig.report:
            self.report(gen, sig.report, sig.reason)

    def answer(self, gen: int, counted: dict[str, int]) -> None:
        """This process's progress on every group it has on this store (one
        request), then one ``add`` per group whose answers are counted."""
        views = [v for v in self.views() if v.state() != "destroyed"]
        if not views:
            return
        by_rank: dict[int, list[GroupView]] = collections.defaultdict(list)  # (thread ranks share a process)
        for v in views:
            by_rank[v.global_rank(v.rank)].append(v)
        about = {r: progress.whereabouts(vs) for r, vs in by_rank.items()}
        self.store.multi_set([answer_key(gen, v.ident, v.rank) for v in views],
                             [progress.snapshot(v, *about[v.global_rank(v.rank)]).encode() for v in views])
        for ident, n in collections.Counter(v.ident for v in views if v.ident in counted).items():
            if self.store.add(count_key(gen, ident), n) == counted[ident]:
                self.store.set(all_key(gen, ident), b"1")

    def report(self, gen: int, cap: int, reason: str) -> None:
        """This process's report (report.py), then its share of the count
        (the report that brings it to the world size says so)."""
        views = [v for v in self.views() if v.state() != "destroyed"]
        if not views:
            return
        raw = report.build(views, cap, reason)
        ranks = sorted({v.global_rank(v.rank) for v in views})
        world = max(max(v.global_ranks(), default=-1) + 1 for v in views)
        self.store.set(incidents.report_key(gen, ranks[0]), raw)
        incidents.count_report(self.store, gen, len(ranks), world)

    # --- incident work ----------------------------------------------------------------------

    def run(self, job: Callable[[], None], wait: float = 0.0) -> bool:
        """Run ``job`` on this store's incident thread (one per store, kept
        while it is used: no thread or connection per incident). False, and
        not run, while an earlier job has not finished within ``wait``
        seconds: the store has not answered it yet. (An incident waits: the
        job before it is often about to end, the previous incident's after
        it published its verdict, or this process's dump request for
        another of its groups' failure.)"""
        deadline = time.monotonic() + wait
        with self._lock:
            while self._job is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._jobs.wait(left)
            self._job = job
            if self._runner is None or not self._runner.is_alive():
                self._runner = threading.Thread(target=self._run_jobs, name="nccl_pg-incident", daemon=True)
                self._runner.start()
            self._jobs.notify_all()
        return True

    def _run_jobs(self) -> None:
        me = threading.current_thread()
        while True:
            with self._lock:
                idle = time.monotonic() + RUNNER_IDLE
                while self._job is None:
                    left = idle - time.monotonic()
                    if self.closed or left <= 0:
                        if self._runner is me:
                            self._runner = None
                        return
                    self._jobs.wait(left)
                job = self._job
            try:
                job()
            except Exception:
                log.exception("nccl_pg: incident work on %r failed", self.store)
            with self._lock:
                self._job = job = None  # type: ignore[assignment]
                self._jobs.notify_all()  # a job waiting to run

    # --- raising ----------------------------------------------------------------------------

    def raise_signal(self, reason: str, answer: bool, dump: bool, claims: list[str] | None = None,
                     counted: dict[str, int] | None = None) -> int:
        """A new incident; returns its number."""
        with self._lock:
            start = self.latest + 1
        gen = incidents.raise_signal(self.store, Signal(reason, self.token, answer, dump, claims or [],
                                                        counted or {}), start)
        self._saw(gen)
        if self.thread is None:
            self._on_signal(gen)
        else:
            incidents.note_latest(self.store, gen)
        return gen

    # --- dumps ---------------------------------------------------------------------------------

    def earlier(self, gen: int) -> list[int]:
        """Incidents before ``gen`` seen here, newest first (at most LOOKBACK)."""
        with self._lock:
            return sorted((g for g in self.recent if g < gen), reverse=True)[:LOOKBACK]

    def rank(self) -> int:
        """The global rank this process's dumps for this store are named after
        (the last known, when its groups went meanwhile; -1 if never known)."""
        views = sorted(self.views(), key=lambda v: v.uid)
        if views:
            self._rank = views[0].global_rank(views[0].rank)
        return self._rank

    def dump_once(self, about: list[str], reason: str) -> str | None:
        """This rank's dump for an incident, known by any of ``about``
        (its number, the claims of its timed-out operations): written once,
        whether the signal or this rank's own timeout comes first, unless
        this rank moved since (it issued or completed operations after it
        dumped at the signal): a dump must show where it is when it fails,
        not where it was when another rank failed."""
        with self._dumping:
            now = self._progress()
            seen = [a for a in about if a in self._dumped]
            if seen and not _moved(self._dumped[seen[0]][1], now):
                path = self._dumped[seen[0]][0]
            else:
                path = self._write_dump(reason, self.rank())
            for a in about:
                self._dumped[a] = (path, now)
            while len(self._dumped) > 64:
                self._dumped.popitem(last=False)
            return path

    def _progress(self) -> tuple[tuple[str, tuple[int, int, int]], ...]:
        """Where this process is on every group of this store (what a dump would show)."""
        return tuple(sorted((v.ident, v.counts()) for v in self.views()))


def _moved(before: tuple[tuple[str, tuple[int, int, int]], ...],
           now: tuple[tuple[str, tuple[int, int, int]], ...]) -> bool:
    """Whether a group present at both moments issued or completed something in between (a group that went, by
    an abort or a destroy, did not move)."""
    old = dict(before)
    return any(ident in old and old[ident] != counts for ident, counts in now)


def join(threads: list[threading.Thread], timeout: float) -> list[threading.Thread]:
    """Join ``threads`` within ``timeout`` seconds in all; those still alive."""
    deadline = time.monotonic() + timeout
    for t in threads:
        if t is not threading.current_thread():
            t.join(max(0.0, deadline - time.monotonic()))
    return [t for t in threads if t.is_alive()]
