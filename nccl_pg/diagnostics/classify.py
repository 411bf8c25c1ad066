"""From the flight-recorder analysis (``trace.analyze``'s report) and what
else is known of each rank to verdicts of the catalogue (verdicts.py): one
``Verdict`` per culprit, in the words every tool prints. ``nccl-pg why``
and the launcher's autopsy (findings.py) and ``nccl-pg trace`` call
``classify`` on the same analysis, so they name the same class and culprit.

What decides the class of a rank that never joined the collective its
group waits in: it ended (``dead``), it answered only through its C-level
stack or left only that (``stuck_in_c``), it waits in another collective
(``never_joined``), else, with nothing in flight, it is in its own code
(``stuck_in_user_code``).
Every rank issued it and it does not complete: ``slow_link``. Ranks that
did not answer at all: ``no_answer`` (or ``dead``, ``stuck_in_c``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import DistBackendError, DistError, DistNetworkError, DistStoreError
from .verdicts import Verdict, collective, group_desc


@dataclass
class Facts:
    """What is known of a rank besides its flight recorder: how it is named
    (``who``), how it answered ("store": its report, "c-stack": only its
    C-level stack, "dump": only a dump written earlier, None: nothing),
    where it is (``where``: "train.py:9 in eval_step"), how it ended
    (``gone``: "exited with code 1", "was killed by signal SIGKILL"), the
    collective it was last in when it ended (``last_op``), and a note on a
    dump older than the incident (``stale``)."""

    who: str = ""
    answered: str | None = "dump"
    where: str = ""
    gone: str = ""
    last_op: str = ""
    stale: str = ""
    victim: str = ""  # why it failed when it did not cause it ("its own timeout of all_reduce #2 of group 0")


# The classes of a group held up: "stuck" only once it persists (verdicts.stuck).
STALLS = ("stuck_in_user_code", "never_joined", "slow_link", "stuck_in_c", "p2p_deadlock")


# The errors a rank suffers from its peers or its communicator (torch's have the same names); any other exception
# it ended on (a NanError, a ValueError of its own code) it caused.
_SUFFERED = {c.__name__ for c in (DistError, DistBackendError, DistNetworkError, DistStoreError)}


def victim_of(reason: str, gone: str = "") -> str:
    """Why a rank failed, when its dump's reason says it failed because of another (its operation timed out,
    failed, or its group was aborted), in words; "" otherwise, and for a rank that ended (``gone``) raising an
    exception of its own: a dump it wrote at another's request, while it unwound that exception, says why the
    others failed, not why it did."""
    raised = re.match(r"raised (\w+)", gone)
    if raised is not None and raised.group(1) not in _SUFFERED:
        return ""
    head = reason[:160]
    return "its operation timed out" if "timeout" in head else "its group was aborted" if "abort" in head else \
        "its operation failed" if " failed" in head else ""


def _ranks(ranks: Sequence[Any]) -> str:
    rs = [str(r) for r in ranks]
    return ("rank " if len(rs) == 1 else "ranks ") + ", ".join(rs)


def _desc(analysis: Mapping[str, Any], group: Any) -> str:
    g: Mapping[str, Any] = next((g for g in analysis.get("groups", []) if g.get("name") == group), {})
    return group_desc(str(g.get("desc") or ""), [r for r in g.get("ranks") or [] if isinstance(r, int)])


def _at(w: Mapping[str, Any] | None) -> str:
    at = (w or {}).get("at") or {}
    if at.get("source") in ("python", "c") and at.get("file"):
        return f"{at['file']}:{at['line']} in {at['function']}"
    return ""


def classify(analysis: Mapping[str, Any], facts: Mapping[int, Facts] | None = None, silent: Sequence[int] = (),
             waited: float | None = None) -> list[Verdict]:
    """The verdicts of an analysis: a culprit's class from ``facts`` and the
    problems; ``silent``: ranks that did not answer within ``waited`` s (a
    live inquiry). Problems that only restate another's (a collective not
    completed because of a rank already named) give no verdict of their own."""
    facts = facts or {}
    out: list[Verdict] = []
    named: set[int] = set()

    def who(r: int) -> str:
        f = facts.get(r)
        return f.who if f is not None and f.who else f"rank {r}"

    def add(kind: str, ranks: Sequence[int], text: str, where: str = "", **extra: Any) -> None:
        out.append(Verdict(kind, tuple(ranks), text, where, extra))
        named.update(ranks)

    problems = list(analysis.get("problems", []))
    waiting_for: dict[int, str] = {}  # silent rank -> the collective waiting for it
    for p in problems:
        if p.get("kind") == "not_completed" and p.get("seq") is not None:
            coll = collective(str(p.get("op")), p.get("seq"), str(p.get("group")), _desc(analysis, p.get("group")))
            for r in list(p.get("missing") or []) + [r for r in silent if r not in p.get("ranks", [])]:
                waiting_for.setdefault(r, f"{coll}, which {_ranks(p.get('ranks', []))} issued")
    for p in problems:
        kind = p.get("kind")
        culprits = [r for r in p.get("ranks", []) if isinstance(r, int)]
        if kind == "ranks_missing":
            coll = collective(str(p.get("op")), p.get("seq"), str(p.get("group")), _desc(analysis, p.get("group")))
            at_op = {"group": p.get("group"), "seq": p.get("seq"), "op": p.get("op")}
            for w in p.get("where", []):
                r = w.get("rank")
                if not isinstance(r, int) or r in named:
                    continue
                f = facts.get(r, Facts())
                text = f"{who(r)} never joined {coll}, which {_ranks(p.get('present', []))} issued"
                where = f.where or _at(w)
                cur = w.get("current") or {}
                elsewhere = bool(cur) and cur.get("state") != "completed" and (
                    cur.get("group") != p.get("group") or cur.get("seq") != p.get("seq"))
                stale = f"; {f.stale}" if f.stale else ""
                if f.gone and f.victim:  # it ended on its own failure, later: the state it was in is the cause
                    stale += f"; it then {f.gone}"
                if f.gone and not f.victim:
                    add(_ended(f), [r], f"{who(r)} {f.gone}" + (f" {f.last_op}" if f.last_op else "")
                        + f"; it never joined {coll}, which {_ranks(p.get('present', []))} issued{stale}", where,
                        **at_op)
                elif elsewhere:
                    inside = collective(str(cur.get("op", "")).split(" ")[0], cur.get("seq"), str(cur.get("group")),
                                        _desc(analysis, cur.get("group")))
                    verb = "was in" if f.stale else "waits in"
                    add("never_joined", [r], f"{text}; it {verb} {inside} instead{stale}", where, **at_op)
                elif f.answered == "c-stack" or (w.get("at") or {}).get("source") == "c":
                    add("stuck_in_c", [r], f"{text}; its C-level stack has it{stale}", where, **at_op)
                else:  # nothing in flight: it is in its own code (where, if its stack says)
                    add("stuck_in_user_code", [r], text + stale, where, **at_op)
        elif kind == "not_completed":
            missing = [r for r in p.get("missing") or [] if isinstance(r, int)]
            unknown = set(silent) | set(analysis.get("ranks_without_dump") or [])
            if missing or any(r in unknown for r in _members(analysis, p.get("group"))):
                continue  # the ranks it waits for, or may wait for, have their own verdicts
            if p.get("seq") is None:
                add("p2p_deadlock", culprits, f"{p.get('message')}")
                continue
            coll = collective(str(p.get("op")), p.get("seq"), str(p.get("group")), _desc(analysis, p.get("group")))
            add("slow_link", [], f"{coll} has not completed on {_ranks(p.get('ranks', []))}: every rank issued it; "
                "it does not move (a partitioned or very slow network, or a peer frozen inside it)",
                group=p.get("group"), seq=p.get("seq"), op=p.get("op"))
        elif kind in ("op_mismatch", "size_mismatch", "dtype_mismatch", "p2p_mismatch", "membership_mismatch"):
            head = who(culprits[0]) if len(culprits) == 1 else _ranks(culprits)
            where = facts[culprits[0]].where if len(culprits) == 1 and culprits[0] in facts else ""
            add("mismatch", culprits, f"{head}: {p.get('message')}", where)
        elif kind == "p2p_unmatched":
            f = facts.get(culprits[0], Facts()) if culprits else Facts()
            add("p2p_deadlock", culprits, f"{who(culprits[0]) if culprits else '?'}: {p.get('message')}",
                f.where or _at((p.get("where") or [None])[0]), group=p.get("group"), seq=f"p2p {p.get('p2p_seq')}",
                op=p.get("op"))
        elif kind == "no_dump":
            located = {w.get("rank"): w for w in p.get("where") or ()}
            for r in culprits:
                if r in named or r in silent:
                    continue
                f = facts.get(r, Facts())
                if f.gone:
                    add(_ended(f), [r], f"{who(r)} {f.gone}" + (f" {f.last_op}" if f.last_op else "")
                        + "; it left no dump", f.where)
                elif r in located:
                    add("stuck_in_c", [r], f"{who(r)} left no dump; its C-level stack has it", _at(located[r]))
                else:
                    add("no_answer", [r], f"{who(r)} left no dump: crashed, killed, or hung without dumping")
        elif kind == "unreadable":
            if not all(r in silent for r in culprits):
                add("unreadable", culprits, str(p.get("message")))
    victims = [r for r in silent if r not in named and facts.get(r, Facts()).victim]
    culprits_ = [r for r in silent if r not in named and r not in victims]
    if not named and not culprits_:
        culprits_, victims = culprits_ + victims, []  # nobody else to blame: they are the story
    for r in culprits_:
        f = facts.get(r, Facts(answered=None))
        waits = f"; {waiting_for[r]}, waits for it" if r in waiting_for else ""
        late = f" within {waited:.1f} s" if waited is not None else ""
        if f.gone:
            add(_ended(f), [r], f"{who(r)} {f.gone}" + (f" {f.last_op}" if f.last_op else "")
                + f" before it answered{waits}", f.where)
        elif f.answered == "c-stack":
            add("stuck_in_c", [r], f"{who(r)} did not answer{late}: its GIL is held, or it is stuck in C{waits}; its "
                "C-level stack has it", f.where)
        elif f.answered == "dump":
            add("no_answer", [r], f"{who(r)} did not answer{late}{waits}; {f.stale or 'its debug dump has it'}",
                f.where)
        else:
            add("no_answer", [r], f"{who(r)} did not answer{late} (dead, frozen, its GIL held, or on another host "
                f"without its stack){waits}")
    if victims:  # they failed because of the culprits named: one line for them all
        how = sorted({re.sub(r" (in|after) .*$", "", facts[r].gone) or "failed" for r in victims})
        add("victim", victims, f"{_ranks(victims)} then {' or '.join(how)}, each as {facts[victims[0]].victim} "
            f"waiting for {_ranks(sorted(named))}")
    return out


def _ended(f: Facts) -> str:
    """The class of a rank that ended on its own: it raised (the harness knows), or it died."""
    return "exception" if f.gone.startswith("raised ") else "dead"


def _members(analysis: Mapping[str, Any], group: Any) -> list[int]:
    return next((list(g.get("ranks") or []) for g in analysis.get("groups", []) if g.get("name") == group), [])
