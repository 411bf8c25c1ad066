"""Diagnosis on demand: when an operation times out, ask every rank where it
is; in steady state, send the store nothing.

Signals. The ranks of a job share a store (a group's PrefixStores all sit on
one; ``group_view.root_of``). Per such store, each process keeps a
``Channel`` (channel.py): a listener parked on the key of the next incident
(the protocol: incidents.py). Answering a timeout, each listener writes one
``multi_set`` of its progress on every group it is in (``<gen>/<group>/<rank>``)
and an ``add`` to the count of each timed-out group it is in (the answer that
completes a count sets one key, which the timed-out rank waits on), writes
its debug dump if asked, and parks on ``gen + 1``. A channel ends with the
last group on its store (``release``) and at exit (``close_all``).

Timeouts. The ranks whose operation timed out on a group claim the incident
(an ``add`` on a key of the group and the operation): the first raises the
signal, waits at most ``budget(timeout)`` for the members' answers (a wait
the server answers as soon as they are all in), names who answered with what
and who did not answer, and publishes that verdict; the others read the
verdict instead of everyone's answers. A store that does not answer costs
the error its patience (the budget, at least ``PATIENCE_MIN``), and the error
says it could not read progress.
One thread per process (``Diagnosis``) turns timed-out operations into
errors, batching those that time out together: one incident, one dump per
rank. Each store's incident work runs on at most one thread at a time, so a
hung store never piles up threads.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .. import env
from ..errors import Culprit
from ..store import Store
from . import frames, progress, stacks
from .channel import PARK, Channel, join
from .group_view import GroupView
from .incidents import NS, all_key, answer_key, count_key, present, signal_key
from .progress import Answer

__all__ = ["PARK", "Diagnosis", "Timeout", "all_key", "answer_key", "budget", "count_key", "longest", "signal_key"]

log = logging.getLogger(__name__)

# How long a timed-out rank waits for the others' answers: a tenth of the operation's timeout, at most 2 s,
# so that the error follows the timeout closely whatever it is; at least 0.3 s, so that a short timeout on a
# busy machine (store answers in a tenth of a second or more) still gets its explanation.
BUDGET_SHARE, BUDGET_MIN, BUDGET_CAP = 0.1, 0.3, 2.0
# How long the store gets to answer an incident's first request (from when it is sent: this rank's own dump comes
# first) before the error calls it unreachable: the budget, and at least this long. One round trip, but one that a
# loaded machine, or a long-lived process of many threads (its GIL, its garbage collector), can delay past a short
# budget; a healthy store called unreachable names no culprit. Under the goal of an error within T + 1 s.
PATIENCE_MIN = 0.6
# After the answers: reading them (and finding the silent ranks when some are) gets this much more, at least.
FINISH_MIN = 0.2
# Operations of a group that time out within this long after its last diagnosis here are explained by it:
# a burst of async operations timing out together is one incident.
REUSE = 1.0
# A silent rank of this host is asked for its C-level stacks (stacks.py), for at most this long.
C_STACKS_WAIT = 0.5


def _local_stacks(silent: dict[tuple[str, int], int]) -> dict[tuple[str, int], tuple[int, tuple[str, int, str] | None]]:
    """The silent ranks ({key: global rank}) that run on this host, found by their environment (the job's
    MASTER_ADDR and MASTER_PORT, their RANK), and where their C-level stacks put them: their GIL is held, or they
    are stuck in C, so their listener cannot answer."""
    addr, port, signum = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT", ""), env.STACKS_SIGNAL.get()
    if not silent or not addr or not port.isdigit() or not signum:
        return {}
    try:
        here = stacks.find_ranks(addr, int(port), signum)
    except OSError:
        return {}
    pids = {k: here[g] for k, g in silent.items() if g in here and here[g] != os.getpid()}
    replies = stacks.request_all(pids, signum, C_STACKS_WAIT, 1 << 20)
    out: dict[tuple[str, int], tuple[int, tuple[str, int, str] | None]] = {}
    for k, pid in pids.items():
        got = replies.get(k)
        threads = got.threads() if got is not None else []
        main = next((t for t in threads if t.name == "MainThread"), threads[0] if threads else None)
        f = frames.user_frame(main.frames) if main is not None else None
        out[k] = (pid, None if f is None else (f.file, f.line, f.function))
    return out


def budget(timeout: float) -> float:
    return min(BUDGET_CAP, max(BUDGET_MIN, BUDGET_SHARE * timeout))


def _patience(b: float) -> float:
    """How long the store gets to answer an incident of budget ``b`` at all."""
    return max(b, PATIENCE_MIN)


def _collect_time(b: float) -> float:
    """From the store's first answer: the budget for the others' answers, and the time to read them."""
    return b + max(b, FINISH_MIN)


def _work_time(b: float) -> float:
    """From the store's first answer to the end of the store work: collecting, then silent ranks' C stacks."""
    return _collect_time(b) + C_STACKS_WAIT + 0.05


def longest(timeout: float) -> float:
    """The longest the store work of an operation's diagnosis can take (``_Incident.deadline``, the store
    answering at the end of its patience): how long a caller waiting for its explanation may wait."""
    b = budget(timeout)
    return _patience(b) + _work_time(b)


@dataclass
class Timeout:
    """A timed-out operation, as the group hands it over: ``finish(why,
    dump_path, culprits)`` fails it with the explanation and the ranks it
    blames."""

    view: GroupView
    seq: int
    peers: tuple[int, ...] | None  # None: a collective; else a point-to-point operation's peers
    timeout: float
    deadline: float  # time.monotonic() at which it timed out
    what: str  # e.g. "ALLREDUCE seq 2 on group 1", for the other ranks' dumps
    text: str  # the error's first part ("timeout: process group ... ran for ...")
    finish: Callable[[str, str | None, tuple[Culprit, ...]], None]

    @property
    def key(self) -> tuple[str, str]:
        return self.view.ident, "c" if self.peers is None else "p"


@dataclass
class _Outcome:
    """What an incident's store work found, filled in as it goes (read by the
    diagnosis thread, which may give up on it)."""

    cond: threading.Condition = field(default_factory=threading.Condition)
    answered_at: float | None = None  # when the store first answered (time.monotonic())
    done: bool = False
    error: BaseException | None = None
    gen: int | None = None
    answers: dict[tuple[str, int], Answer] = field(default_factory=dict)
    silent: dict[str, list[int]] = field(default_factory=dict)
    old: dict[tuple[str, int], Answer] = field(default_factory=dict)
    # silent ranks of this host, by their C-level stacks: (ident, group rank) -> (pid, where)
    c_stacks: dict[tuple[str, int], tuple[int, tuple[str, int, str] | None]] = field(default_factory=dict)
    waited: float = 0.0
    # claim key -> (gen, why, culprits)
    verdicts: dict[str, tuple[int, str, tuple[Culprit, ...]]] = field(default_factory=dict)
    won: set[str] = field(default_factory=set)  # claim keys this rank raised

    def update(self, **kw: Any) -> None:
        with self.cond:
            for k, v in kw.items():
                setattr(self, k, v)
            self.cond.notify_all()


@dataclass(frozen=True)
class _Claim:
    """A group's first operation of a kind to time out in a batch."""

    key: str
    view: GroupView
    seq: int
    peers: tuple[int, ...] | None
    what: str


class _Incident:
    """The store work of one batch of timed-out operations on one store. It
    keeps no reference to the operations (only to views), so that a finished
    incident, kept for reuse, does not keep their groups alive."""

    def __init__(self, channel: Channel, requests: list[Timeout], dump: bool) -> None:
        self.channel, self.dump = channel, dump
        self.stuck = False  # not run: the store's incident thread is still busy with an earlier one
        self.budget = max(budget(r.timeout) for r in requests)
        self.patience = _patience(self.budget)
        self.start = time.monotonic()
        self.claims: dict[tuple[str, str], _Claim] = {}
        for r in sorted(requests, key=lambda r: r.seq):
            if r.key not in self.claims:
                # a point-to-point operation is this rank's with its peers: each side claims its own (both sides of a
                # deadlock blame their peer)
                mine = f".{r.view.rank}" if r.peers is not None else ""
                self.claims[r.key] = _Claim(f"{NS}/claim/{r.view.ident}/{r.key[1]}{r.seq}{mine}", r.view, r.seq,
                                            r.peers, r.what)
        self.out = _Outcome()

    def begin(self) -> None:
        """The store's time starts (this rank's dump, written before, is not the store's)."""
        self.start = time.monotonic()

    @property
    def collected_by(self) -> float:
        """When the answers (or the verdicts) must be read: the budget and the time to read them, from the
        store's first answer."""
        at = self.out.answered_at
        return (self.start + self.patience if at is None else at) + _collect_time(self.budget)

    @property
    def deadline(self) -> float:
        """Until when the diagnosis thread waits for the store work: the store's first answer within the
        patience; then until the answers are read, and silent ranks of this host have given their stacks."""
        at = self.out.answered_at
        return self.start + self.patience if at is None else at + _work_time(self.budget)

    def run(self) -> None:
        out, store = self.out, self.channel.store
        try:
            counts = {c.key: store.add(c.key, 1) for c in self.claims.values()}
            won = {k for k, n in counts.items() if n == 1}
            out.update(answered_at=time.monotonic(), won=won)
            if won:
                self._raise_and_collect([c for c in self.claims.values() if c.key in won])
            lost = [k for k in counts if k not in won]
            if lost:
                self._read_verdicts(lost)
        except BaseException as exc:  # reported by the diagnosis thread
            out.update(error=exc)
        finally:
            out.update(done=True)

    def _raise_and_collect(self, won: list[_Claim]) -> None:
        out, ch, store = self.out, self.channel, self.channel.store
        counted = {c.view.ident: c.view.size for c in won if c.peers is None}
        gen = ch.raise_signal(f"timeout of {won[0].what}", answer=True, dump=self.dump, claims=[c.key for c in won],
                              counted=counted)
        out.update(gen=gen)
        wanted: dict[str, set[int]] = collections.defaultdict(set)
        for c in won:
            wanted[c.view.ident] |= {p for p in (c.peers if c.peers is not None else range(c.view.size))
                                     if p != c.view.rank}
        keys = {answer_key(gen, ident, p): (ident, p) for ident, ranks in wanted.items() for p in sorted(ranks)}
        # a collective's group: its count's key; a point-to-point operation: its few peers' own keys
        awaited = [all_key(gen, ident) for ident in counted] + [k for k, (ident, _) in keys.items()
                                                                if ident not in counted]
        t0 = time.monotonic()
        try:
            store.wait(awaited, self.budget)
            found = list(keys)
        except Exception:  # someone did not answer in time (or the store failed: the search says)
            found = present(store, list(keys), self.collected_by)
        waited = min(time.monotonic() - t0, self.budget)
        answers: dict[tuple[str, int], Answer] = {}
        if found:
            for k, raw in zip(found, store.multi_get(found), strict=True):
                a = Answer.decode(raw)
                if a is not None:
                    answers[keys[k]] = a
        silent = {ident: [p for p in sorted(ranks) if (ident, p) not in answers] for ident, ranks in wanted.items()}
        old = self._lookback(gen, [(i, p) for i, ps in silent.items() for p in ps])
        out.update(answers=answers, silent=silent, waited=waited, old=old)  # enough to explain, if time runs out
        views = {c.view.ident: c.view for c in won}
        quiet = {(i, p): views[i].global_rank(p) for i, ps in silent.items() for p in ps}
        if quiet and time.monotonic() + C_STACKS_WAIT < self.deadline:
            out.update(c_stacks=_local_stacks(quiet))
        verdicts = {c.key: (gen, *self._explain(c, c.seq)) for c in won}
        out.update(verdicts=verdicts)
        store.multi_set([f"{k}/verdict" for k in verdicts], [progress.encode_verdict(*v) for v in verdicts.values()])

    def _lookback(self, gen: int, silent: list[tuple[str, int]]) -> dict[tuple[str, int], Answer]:
        """What silent ranks answered to the latest earlier incident seen here."""
        store = self.channel.store
        old: dict[tuple[str, int], Answer] = {}
        for g in self.channel.earlier(gen):
            todo = {answer_key(g, i, p): (i, p) for i, p in silent if (i, p) not in old}
            found = present(store, list(todo), self.collected_by)
            if found:
                for k, raw in zip(found, store.multi_get(found), strict=True):
                    a = Answer.decode(raw)
                    if a is not None:
                        old[todo[k]] = a
        return old

    def _read_verdicts(self, lost: list[str]) -> None:
        store = self.channel.store
        keys = [f"{k}/verdict" for k in lost]
        try:
            store.wait(keys, _collect_time(self.budget))
        except Exception:
            keys = present(store, keys, self.deadline)
        got = {}
        if keys:
            for k, raw in zip(keys, store.multi_get(keys), strict=True):
                v = progress.decode_verdict(raw)
                if v is not None:
                    got[k[:-len("/verdict")]] = v
        self.out.update(verdicts={**self.out.verdicts, **got})

    # --- words (in the diagnosis thread, once the work is done or given up on) ---------------------

    def _explain(self, c: _Claim, seq: int) -> tuple[str, tuple[Culprit, ...]]:
        out, v = self.out, c.view
        answers = {p: a for (i, p), a in out.answers.items() if i == v.ident}
        silent = [p for p in out.silent.get(v.ident, []) if c.peers is None or p in c.peers]
        old = {p: a for (i, p), a in out.old.items() if i == v.ident and p in silent}
        if c.peers is not None:
            why = progress.explain_p2p(v, c.peers, silent, out.waited, old)
        else:
            answers[v.rank] = progress.snapshot(v)
            why = progress.explain(v, seq, answers, silent, out.waited, old)
        local = {p: got for (i, p), got in out.c_stacks.items() if i == v.ident}
        found = tuple(progress.culprits(v, c.what, seq, answers, silent, old, c.peers, local))
        where = progress.describe(found)
        return (f"{why}; {where}" if where else why), found

    def why(self, r: Timeout) -> tuple[str, tuple[Culprit, ...]]:
        """``r``'s explanation from what was gathered, and the ranks it blames."""
        out, c = self.out, self.claims.get(r.key)
        late = _collect_time(self.budget)
        with out.cond:
            assert c is not None, "an incident explains only the kinds of operations it claimed"
            if out.answered_at is None:
                if self.stuck:
                    return ("store unreachable: could not read the other ranks' progress from the store: it has not "
                            "answered an "
                            "earlier diagnosis either (unreachable or overloaded)"), ()
                return (f"store unreachable: could not read the other ranks' progress from the store within "
                        f"{self.patience:.2f} s: "
                        "the store did not answer (unreachable or overloaded)"), ()
            if c.key in out.won:
                if c.view.ident in out.silent:
                    return self._explain(c, r.seq)
                if out.error is not None:
                    return f"could not read the other ranks' progress from the store: {out.error}", ()
                return f"could not read the other ranks' progress from the store within {late:.2f} s (too slow)", ()
            verdict = out.verdicts.get(c.key)
        if verdict is None:
            why = (f"another rank is gathering the diagnosis of this operation; its verdict did not arrive "
                   f"within {late:.2f} s")
            return (why if out.error is None else f"{why} ({out.error})"), ()
        if c.seq == r.seq:
            return verdict[1], verdict[2]
        return f"{verdict[1]} (said of seq {c.seq}, this group's first operation to time out here)", verdict[2]


class Diagnosis:
    """The process's diagnosis: a channel per store, one thread that turns
    timed-out operations into errors."""

    def __init__(self, views: Callable[[], list[GroupView]], write_dump: Callable[[str, int], str | None],
                 dumps: Callable[[], bool]) -> None:
        self._all_views, self._write_dump, self._dumps = views, write_dump, dumps
        self._lock = threading.Lock()
        self._channels: dict[int, Channel] = {}
        self._ended: list[Channel] = []  # channels closed whose threads may not have left yet
        self._queue: collections.deque[Timeout | Callable[[], None]] = collections.deque()
        self._cond = threading.Condition(self._lock)
        self._worker: threading.Thread | None = None
        # per group: when its last incident here ended, the incident, and this rank's dump path
        self._last: dict[str, tuple[float, _Incident, str | None]] = {}

    # --- channels ---------------------------------------------------------------------------------

    def _views_on(self, root: Store) -> list[GroupView]:
        return [v for v in self._all_views() if v.root is root and v.state() != "destroyed"]

    def watch(self, view: GroupView) -> Channel:
        """The channel of ``view``'s store (its listener started if need be)."""
        with self._lock:
            ch = self._channels.get(id(view.root))
            if ch is None:
                for old in [c for c in self._channels.values() if c.thread is None and not c.views()]:
                    del self._channels[id(old.store)]  # threadless channels of stores whose groups are gone
                root = view.root
                ch = Channel(root, lambda: self._views_on(root), self._write_dump, self._dumps, self._forget)
                self._channels[id(root)] = ch
                if ch.thread is not None:
                    ch.thread.start()
            return ch

    def _forget(self, ch: Channel) -> bool:
        """Called by a listener between waits: True (and it is dropped) once
        no group on its store is alive."""
        with self._lock:
            if self._views_on(ch.store):
                return False
            if self._channels.get(id(ch.store)) is ch:
                del self._channels[id(ch.store)]
            # closed, its threads may still be on their way out of a store call: joined at exit
            self._ended = [c for c in self._ended if any(t.is_alive() for t in c.threads())] + [ch]
        ch.close()
        return True

    def release(self, view: GroupView) -> None:
        """``view``'s group is destroyed: its store's channel (listener and
        incident thread) ends if no other group uses the store."""
        with self._lock:
            ch = self._channels.get(id(view.root))
        if ch is not None:
            self._forget(ch)

    def close_all(self, timeout: float) -> list[threading.Thread]:
        """At exit: end every channel and wait for their threads (at most
        ``timeout`` seconds), so that none is inside a store's blocking call
        when the interpreter finalizes; returns those still running."""
        with self._lock:
            channels, self._channels = list(self._channels.values()), {}
            channels += self._ended
            self._ended = []
        for ch in channels:
            ch.close()
        return join([t for ch in channels for t in ch.threads()], timeout)

    # --- the diagnosis thread -------------------------------------------------------------------

    def submit(self, item: Timeout | Callable[[], None]) -> None:
        """A timed-out operation to explain, or a call to make (a dump) off
        the caller's thread."""
        with self._cond:
            self._queue.append(item)
            if self._worker is None:
                self._worker = threading.Thread(target=self._work, name="nccl_pg-diagnosis", daemon=True)
                self._worker.start()
            self._cond.notify_all()

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._queue:
                    # an incident kept for reuse refers to its groups: let it go once it is of no use
                    if not self._cond.wait(REUSE * 2 if self._last else None):
                        self._last = {k: v for k, v in self._last.items() if v[0] + REUSE * 2 > time.monotonic()}
                batch, self._queue = list(self._queue), collections.deque()
            timeouts = [b for b in batch if isinstance(b, Timeout)]
            for call in batch:
                if not isinstance(call, Timeout):
                    try:
                        call()
                    except Exception:
                        log.exception("nccl_pg: a diagnosis call failed")
            if timeouts:
                self._explain(timeouts)
            batch = timeouts = call = None  # type: ignore[assignment]  # (no reference to groups between batches)

    def _explain(self, timeouts: list[Timeout]) -> None:
        fresh: dict[int, list[Timeout]] = collections.defaultdict(list)
        for t in timeouts:
            last = self._last.get(t.view.ident)
            if last is not None and t.deadline <= last[0] + REUSE and t.key in last[1].claims:
                self._finish(t, *last[1].why(t), last[2])
            else:
                fresh[id(t.view.root)].append(t)
        for requests in fresh.values():
            self._incident(requests)

    def _incident(self, requests: list[Timeout]) -> None:
        ch = self.watch(requests[0].view)
        inc = _Incident(ch, requests, self._dumps())
        # This rank's dump first, as it is now: a peer answering the signal may end meanwhile, and this rank
        # with its failure (error handling), before the others' answers are in.
        path = ch.dump_once([c.key for c in inc.claims.values()], requests[0].text) if self._dumps() else None
        inc.begin()
        if not ch.run(inc.run, inc.patience):  # the store has not answered an earlier job
            inc.stuck = True
            inc.out.update(done=True)
        out = inc.out
        with out.cond:
            while not out.done:
                now = time.monotonic()
                limit = inc.deadline
                if now >= limit:
                    break
                out.cond.wait(limit - now)
        whys = [inc.why(r) for r in requests]
        now = time.monotonic()
        for r in requests:
            self._last[r.view.ident] = (now, inc, path)
        for r, (why, found) in zip(requests, whys, strict=True):
            self._finish(r, why, found, path)

    def _finish(self, r: Timeout, why: str, found: tuple[Culprit, ...], path: str | None) -> None:
        try:
            r.finish(why, path, found)
        except Exception:
            log.exception("nccl_pg: failing a timed-out operation raised")

    # --- dumps elsewhere --------------------------------------------------------------------------

    def request_dumps(self, view: GroupView, reason: str) -> None:
        """Ask every rank on ``view``'s store for its dump, off the caller's
        thread, and not while the store has not answered an earlier request."""
        ch = self.watch(view)

        def send() -> None:
            try:
                ch.raise_signal(reason, answer=False, dump=True)
            except Exception as exc:
                log.debug("nccl_pg: could not ask the other ranks to dump: %s", exc)

        ch.run(send)
