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
from .group_view import GroupView


@dataclass(frozen=True)
class Answer:
    """One rank's progress on one group, as it answered (``time``: its wall
    clock then)."""

    issued: int
    completed: int
    p2p_issued: int
    pid: int
    host: str
    time: float

    def encode(self) -> bytes:
        return json.dumps([self.issued, self.completed, self.p2p_issued, self.pid, self.host, self.time]).encode()

    @classmethod
    def decode(cls, raw: bytes) -> Answer | None:
        """None for anything that is not an answer (the store is shared)."""
        try:
            i, c, p, pid, host, t = json.loads(raw)
            if all(isinstance(x, int) for x in (i, c, p, pid)) and isinstance(host, str) and \
                    isinstance(t, (int, float)):
                return cls(i, c, p, pid, host, float(t))
        except (ValueError, TypeError):
            pass
        return None


def snapshot(view: GroupView) -> Answer:
    issued, completed, p2p = view.counts()
    return Answer(issued, completed, p2p, os.getpid(), socket.gethostname(), time.time())


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
        parts.append(f"ranks {_globals(view, behind)} never issued this collective "
                     f"(last sequence number they issued on this group: {last})")
    if silent:
        parts.append(silence(view, silent, waited, old or {}))
    if not behind:
        stuck = _globals(view, sorted(r for r, a in answers.items() if a.completed < seq))
        if silent:
            parts.append(f"every rank that answered issued it (it has not completed on ranks {stuck})")
        else:
            parts.append(f"every rank issued it; it has not completed on ranks {stuck}: a rank stopped making "
                         "progress inside it (hung or frozen process, or a network problem)")
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
             old: Mapping[int, Answer], peers: Sequence[int] | None = None) -> list[Culprit]:
    """The ranks ``explain`` (or, with ``peers``, ``explain_p2p``) blames for
    ``what`` (e.g. "ALLREDUCE seq 2 on group 0"), with the host and pid they
    answered with (now, or at an earlier incident; unknown for a rank never
    heard from)."""
    def one(r: int, reason: str) -> Culprit:
        a = answers.get(r) or old.get(r)
        return Culprit(view.global_rank(r), reason, a.host if a else None, a.pid if a else None)

    if peers is not None:
        return [one(p, f"did not complete its side of {what}") for p in sorted(peers)]
    behind = [one(r, f"never issued {what}") for r, a in sorted(answers.items()) if a.issued < seq]
    return behind + [one(r, f"did not answer the diagnosis of {what}") for r in sorted(silent)]


def describe(found: Sequence[Culprit]) -> str:
    """Where the culprits run, for the error's text."""
    where = [f"rank {c.rank} is pid {c.pid} on {c.host}" for c in found if c.pid is not None]
    return f"culprits: {', '.join(where)}" if where else ""


def encode_verdict(gen: int, why: str, found: Sequence[Culprit] = ()) -> bytes:
    return json.dumps({"gen": gen, "why": why,
                       "culprits": [[c.rank, c.reason, c.host, c.pid] for c in found]}).encode()


def decode_verdict(raw: bytes) -> tuple[int, str, tuple[Culprit, ...]] | None:
    try:
        d: Any = json.loads(raw)
        if isinstance(d, dict) and isinstance(d.get("gen"), int) and isinstance(d.get("why"), str):
            found = tuple(Culprit(int(r), str(why), None if h is None else str(h), None if p is None else int(p))
                          for r, why, h, p in d.get("culprits", []))
            return d["gen"], d["why"], found
    except (ValueError, TypeError):
        pass
    return None
