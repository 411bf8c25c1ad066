"""Per-group progress, gathered on demand, and the words that explain a
timeout with it.

Nothing is published while a job is healthy. When an operation times out,
the rank that saw it asks every rank (diagnosis.py) and each answers with an
``Answer`` for every group it is in; ``explain`` then names the ranks that
never issued the operation, the ranks in which it is stuck, and the ranks
that did not answer at all (with what they said at an earlier incident, if
anything, marked as old).

``GroupView`` (group_view.py) is the small view of a group that diagnostics
read (the group hands it over; nothing here reaches into the group).
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import Culprit
from . import report as report_mod
from .group_view import GroupView
from .verdicts import collective, format_verdict, who


@dataclass(frozen=True)
class Answer:
    """One rank's progress on one group, as it answered (``time``: its wall
    clock then), where the process is in its code (``where``: file, line,
    function; None if not known) and the operation it waits in, on any
    group (``busy``: "all_reduce #3 of group 1", "" when none)."""

    issued: int
    completed: int
    p2p_issued: int
    pid: int
    host: str
    time: float
    where: tuple[str, int, str] | None = None
    busy: str = ""

    def encode(self) -> bytes:
        return json.dumps([self.issued, self.completed, self.p2p_issued, self.pid, self.host, self.time,
                           list(self.where) if self.where else None, self.busy]).encode()

    @classmethod
    def decode(cls, raw: bytes) -> Answer | None:
        """None for anything that is not an answer (the store is shared); an
        answer of an older version (six fields) has no where nor busy."""
        try:
            d = json.loads(raw)
            if not isinstance(d, list) or len(d) not in (6, 8):
                return None
            i, c, p, pid, host, t = d[:6]
            w, busy = (d[6], d[7]) if len(d) == 8 else (None, "")
            where = (str(w[0])[:4096], int(w[1]), str(w[2])[:256]) if isinstance(w, list) and len(w) == 3 and \
                isinstance(w[1], int) else None
            if all(isinstance(x, int) for x in (i, c, p, pid)) and isinstance(host, str) and \
                    isinstance(t, (int, float)) and isinstance(busy, str):
                return cls(i, c, p, pid, host[:255], float(t), where, busy[:200])
        except (ValueError, TypeError, RecursionError):
            pass
        return None

    def at(self) -> str:
        return f"{self.where[0]}:{self.where[1]} in {self.where[2]}" if self.where else ""


def snapshot(view: GroupView, where: tuple[str, int, str] | None = None, busy: str = "") -> Answer:
    issued, completed, p2p = view.counts()
    return Answer(issued, completed, p2p, os.getpid(), socket.gethostname(), time.time(), where, busy)


def whereabouts(views: Sequence[GroupView]) -> tuple[tuple[str, int, str] | None, str]:
    """Where this process is (the user's frame in the thread that issued its oldest operation in flight, else the
    main thread) and that operation, for an answer: as ``report.build`` says it. With nothing in flight, the
    last collective that failed, if any: its waiter may still be in it, raising (it timed out there a moment
    ago: in another collective, not in the user's code)."""
    oldest, failed = None, None
    for v in views:
        a = v.activity()
        for p in a.pending:
            if oldest is None or p.issued < oldest[1].issued:
                oldest = (v, p)
        if a.failed is not None and (failed is None or a.failed.issued > failed[1].issued):
            failed = (v, a.failed)
    busy = collective(oldest[1].op, oldest[1].seq, oldest[0].name) if oldest is not None else \
        collective(failed[1].op, failed[1].seq, failed[0].name) + " (failed)" if failed is not None else ""
    f = report_mod.where_now(views)
    return ((f.file, f.line, f.function) if f is not None else None), busy


def _globals(view: GroupView, ranks: Sequence[int]) -> list[int]:
    return [view.global_rank(r) for r in ranks]


def silence(view: GroupView, silent: Sequence[int], waited: float, old: Mapping[int, Answer]) -> str:
    """The ranks that did not answer, with what they said before, if anything."""
    text = (f"ranks {_globals(view, silent)} did not answer within {waited:.2f} s (dead, frozen, or its GIL "
            "held)")
    if old:
        now = time.time()
        said = ", ".join(f"rank {view.name_of(r)}: issued {a.issued}, completed {a.completed} "
                         f"({now - a.time:.1f} s ago)" for r, a in sorted(old.items()))
        text += f"; their last answers, to an earlier diagnosis, are old: {said}"
    return text


def explain(view: GroupView, seq: int, answers: Mapping[int, Answer], silent: Sequence[int], waited: float,
            old: Mapping[int, Answer] | None = None) -> str:
    """Who is to blame for collective ``seq`` not completing, in words.
    ``answers``: every rank that answered (this one included); ``silent``:
    the ranks that did not, within ``waited`` seconds."""
    parts: list[str] = []
    behind = sorted(r for r, a in answers.items() if a.issued < seq)
    if behind:
        last = ", ".join(f"rank {view.name_of(r)}: {answers[r].issued}" for r in behind)
        doing = "".join(f"; rank {view.global_rank(r)} waits in {answers[r].busy}" if answers[r].busy else
                        f"; rank {view.global_rank(r)} is at {answers[r].at()}" if answers[r].where else ""
                        for r in behind)
        parts.append(f"ranks {_globals(view, behind)} never issued this collective "
                     f"(last sequence number they issued on this group: {last}{doing})")
    if silent:
        parts.append(silence(view, silent, waited, old or {}))
    if not behind:
        stuck = _globals(view, sorted(r for r, a in answers.items() if a.completed < seq))
        if silent:
            parts.append(f"every rank that answered issued it (it has not completed on ranks {stuck})")
        else:
            parts.append(f"slow or partitioned link: every rank issued it; it has not completed on ranks {stuck}: a rank "
                         "stopped making progress inside it (hung or frozen process, or a network problem)")
    return "; ".join(parts)


def explain_p2p(view: GroupView, peers: Sequence[int], silent: Sequence[int], waited: float,
                old: Mapping[int, Answer] | None = None) -> str:
    """A point-to-point operation is numbered per pair, not per group: the
    peers are named, and those that did not answer."""
    text = (f"a point-to-point operation with ranks {_globals(view, peers)}: a peer did not post the matching "
            "operation")
    if silent:
        text += "; " + silence(view, silent, waited, old or {})
    return text


def culprits(view: GroupView, what: str, seq: int, answers: Mapping[int, Answer], silent: Sequence[int],
             old: Mapping[int, Answer], peers: Sequence[int] | None = None,
             c_stacks: Mapping[int, tuple[int, tuple[str, int, str] | None]] | None = None) -> list[Culprit]:
    """The ranks ``explain`` (or, with ``peers``, ``explain_p2p``) blames for
    ``what`` (e.g. "all_reduce #2 of group 0"), with the host and pid they
    answered with (now, or at an earlier incident; unknown for a rank never
    heard from), where each is and its class in the catalogue (verdicts.py).
    ``c_stacks``: {group rank: (pid, where)} of silent ranks of this host
    whose C-level stacks were read."""
    c_stacks = c_stacks or {}

    def one(r: int, reason: str, kind: str, where: tuple[str, int, str] | None = None) -> Culprit:
        a = answers.get(r) or old.get(r)
        host, pid = (a.host, a.pid) if a else (None, None)
        if r in c_stacks:
            host, pid = host or socket.gethostname(), c_stacks[r][0]
        file, line, func = where if where is not None else (None, None, None)
        return Culprit(view.global_rank(r), reason, host, pid, file, line, func, kind=kind)

    if peers is not None:
        return [one(p, f"did not complete its side of {what}", "p2p_deadlock") for p in sorted(peers)]
    behind = [one(r, f"never joined {what}" + (f"; it waits in {a.busy} instead" if a.busy else ""),
                  "never_joined" if a.busy else "stuck_in_user_code", a.where)
              for r, a in sorted(answers.items()) if a.issued < seq]
    quiet = []
    for r in sorted(silent):
        if r in c_stacks and c_stacks[r][1] is not None:
            quiet.append(one(r, f"did not answer the diagnosis of {what}: its GIL is held, or it is stuck in C; its "
                             "C-level stack has it", "stuck_in_c", c_stacks[r][1]))
        else:
            quiet.append(one(r, f"did not answer the diagnosis of {what}", "no_answer"))
    return behind + quiet


def describe(found: Sequence[Culprit]) -> str:
    """The culprits in the catalogue's words, for the error's text."""
    return "verdict: " + " | ".join(format_verdict(c.kind or "no_answer", f"{who(c.rank, c.host, c.pid)} {c.reason}",
                                                   c.where or "") for c in found) if found else ""


def encode_verdict(gen: int, why: str, found: Sequence[Culprit] = ()) -> bytes:
    return json.dumps({"gen": gen, "why": why, "culprits": [[c.rank, c.reason, c.host, c.pid, c.file, c.line,
                                                             c.function, c.kind] for c in found]}).encode()


def decode_verdict(raw: bytes) -> tuple[int, str, tuple[Culprit, ...]] | None:
    try:
        d: Any = json.loads(raw)
        if isinstance(d, dict) and isinstance(d.get("gen"), int) and isinstance(d.get("why"), str):
            found = []
            for c in d.get("culprits", []):
                r, why, h, p = c[:4]
                f, line, fn, kind = (c[4:8] if len(c) >= 8 else (None, None, None, ""))
                found.append(Culprit(int(r), str(why), None if h is None else str(h), None if p is None else int(p),
                                     None if f is None else str(f), None if line is None else int(line),
                                     None if fn is None else str(fn), kind=str(kind or "")))
            return d["gen"], d["why"], tuple(found)
    except (ValueError, TypeError, RecursionError):
        pass
    return None
