"""The watchdog's watch of CUDA-graph replays (docs/NCCL_BACKEND.md,
"Watched replays"; the design of torchcomms' GraphEventTracker, without its
per-replay host callback).

A collective captured into a CUDA graph runs at every replay, where no host
code issues it. At capture, the group puts two event record nodes around it
into the graph (``Stream.record_replayed``: cudaEventRecordWithFlags with
cudaEventRecordExternal), which every replay records again and the host can
query: ``start`` before the collective, ``end`` after it. A launch of the
graph re-arms both (they read not ready until the replay reaches them).

On each watchdog poll, per graph this group captured into:

- idle (the last collective's ``end`` complete; before any replay it is too):
  one event query, nothing else. No work at all per replay;
- otherwise each collective of the graph: ``end`` complete, it is done; not,
  it is in flight since the first poll that saw it so, or since its ``start``
  newly completed (a later replay reached it: progress). In flight past the
  group's timeout, it is named (group, collective, its place among the
  group's collectives in the graph, the capture): the first collective the
  replay reached and did not finish (those after it wait behind it; with
  none reached, the first not finished), and the group's error
  handling applies, as to a timed-out operation. Replays launched back to back
  faster than they complete count as one stretch, as an eager operation counts
  from its issue.

A graph's entries go once CUDA says the graph and every instantiation of it
were destroyed (``Stream.capture_gone``: a user object's destructor), and all
of them with the group. While some are alive, a revoke of the group's
communicator is refused (``refuse_if_alive``). Their plans hold the
communicator (enqueue.cc ncclLaunchPrepare, localPersistentRefs), which NCCL's
finalize and abort wait for, but a revoke sets finalizeCalled (init.cc
ncclCommRevoke), so the abort after it frees the communicator at once
(commReclaim skips commDestroySync): the graphs' replays and destruction
(enqueue.cc persistentDestructor) would use freed memory.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..comm.base import Event


@dataclass
class _Entry:
    op: str  # OpType name
    place: int  # 1-based, among this group's collectives in the graph
    start: Event
    end: Event
    timeout: float
    since: float | None = None  # in flight since (monotonic); None: done or idle
    started: bool = False  # its start was complete at the last poll
    reported: bool = False  # named for this stretch already


@dataclass
class _Graph:
    capture: int  # the capture's id (cudaStreamGetCaptureInfo)
    gone: Callable[[], bool] | None
    entries: list[_Entry] = field(default_factory=list)
    busy: bool = False  # something was in flight at the last poll


@dataclass(frozen=True)
class Stuck:
    """A collective whose replay did not complete within its timeout."""

    op: str
    place: int
    of: int  # collectives this group captured into the graph
    capture: int
    elapsed: float
    timeout: float

    def describe(self) -> str:
        return (f"{self.op} (collective {self.place} of {self.of} this group captured into CUDA graph capture "
                f"{self.capture}) has been in flight in a replay for {self.elapsed:.3f} s, past its timeout of "
                f"{self.timeout:.3f} s")


class ReplayWatch:
    """The captured collectives of one process group."""

    def __init__(self) -> None:
        self._graphs: dict[int, _Graph] = {}
        self._lock = threading.Lock()

    def __bool__(self) -> bool:
        return bool(self._graphs)

    def captured(self, capture: int, op: str, start: Event, end: Event, timeout: float,
                 probe: Callable[[], Callable[[], bool] | None]) -> None:
        """One collective captured between ``start`` and ``end`` (recorded into the graph). ``probe`` makes the
        graph's lifetime probe (``Stream.capture_gone``), called at the graph's first collective."""
        with self._lock:
            g = self._graphs.get(capture)
            if g is None:
                g = self._graphs[capture] = _Graph(capture, probe())
            g.entries.append(_Entry(op, len(g.entries) + 1, start, end, timeout))

    def poll(self, now: float | None = None) -> list[Stuck]:
        """Never blocks; the collectives newly past their timeout."""
        now = time.monotonic() if now is None else now
        out: list[Stuck] = []
        with self._lock:
            graphs = list(self._graphs.values())
        for g in graphs:
            if not g.busy and g.entries[-1].end.query():
                if g.gone is not None and g.gone():
                    with self._lock:
                        self._graphs.pop(g.capture, None)
                continue
            waiting: list[_Entry] = []
            for e in g.entries:
                if e.end.query():
                    e.since, e.started, e.reported = None, False, False
                    continue
                started = e.start.query()
                if e.since is None or (started and not e.started):
                    e.since, e.reported = now, False
                e.started = started
                waiting.append(e)
            g.busy = bool(waiting)
            # The replay waits in the first collective it reached and did not finish; those after it wait behind
            # it. With none reached (a later launch re-armed every start), in the first not finished.
            at = next((w for w in waiting if w.started), waiting[0]) if waiting else None
            if at is not None and at.since is not None and not at.reported and now - at.since > at.timeout:
                at.reported = True
                out.append(Stuck(at.op, at.place, len(g.entries), g.capture, now - at.since, at.timeout))
        return out

    def captures(self) -> int:
        return len(self._graphs)

    def refuse_if_alive(self, what: str, where: str) -> None:
        """A RuntimeError (not a DistBackendError: nothing happened, the group stays as it was) when ``what``,
        which revokes or replaces the communicator, would leave live graphs on a freed one (the module's doc)."""
        alive = self.alive()
        if alive:
            raise RuntimeError(
                f"{where}: {what} refused: CUDA graph capture(s) {', '.join(map(str, alive))} captured this group's "
                f"collectives and are not destroyed. Their kernels belong to this group's communicator, which {what} "
                "would revoke or replace, and NCCL frees a revoked communicator without waiting for such graphs "
                "(init.cc ncclCommRevoke): destroy them and every instantiation (e.g. del graph), then "
                f"{what} again and capture them anew on the new group; or abort the group first (NCCL's abort waits "
                "until they are destroyed)")

    def alive(self) -> list[int]:
        """The captures whose graph, or an instantiation of it, may still be alive (destroyed ones are dropped)."""
        out = []
        with self._lock:
            graphs = list(self._graphs.values())
        for g in graphs:
            if g.gone is not None and g.gone():
                with self._lock:
                    self._graphs.pop(g.capture, None)
            else:
                out.append(g.capture)
        return sorted(out)
