"""What an inquiry (inquiry.py) found, as verdicts of the catalogue
(verdicts.py, through classify.py) and in words: the text of ``nccl-pg
why``, its JSON, the launcher's autopsy lines and its Markdown report.

``ask`` applies the rule that a hang is named only once it persists
(``verdicts.stuck``): when the first look finds a group held up by an
operation younger than ``verdicts.stuck_after`` (many times the group's
usual step), it looks again once the operation is that old (within the
caller's budget); if something moved, the verdict is "in progress", if it
has not moved yet but is still young, "slow"; only a stall that persists is
named as a hang (exit 1).

Every string that came from the ranks (paths, function names, source lines,
host names) is untrusted: each line printed goes through
``printable.safe``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from . import frames, report, trace, verdicts
from .classify import STALLS, Facts, classify, victim_of
from .inquiry import Inquiry, looks, typical_steps
from .printable import safe
from .verdicts import Verdict, collective

MAX_SHOWN = 64  # verdicts of silent ranks listed one by one; the rest are counted


def facts(inq: Inquiry) -> dict[int, Facts]:
    out = {}
    for r, k in inq.ranks.items():
        stale = ""
        if k.answered == "dump":
            t = (inq.answers.get(r) or {}).get("time")
            age = f", written {time.time() - t:.1f} s ago," if isinstance(t, (int, float)) else ""
            stale = f"its debug dump{age} has it" + (f" at {k.at()}" if k.at() else " without a stack")
        victim = victim_of(str((inq.answers.get(r) or {}).get("reason") or ""), k.gone)
        out[r] = Facts(k.who(), k.answered, k.at(), k.gone, "", stale, victim)
    return out


def judge(inq: Inquiry) -> list[Verdict]:
    """The verdicts of one look (``ok`` when there is no problem). Without
    asking (no listener: the launcher's autopsy of ranks that cannot answer),
    a rank whose dump is in the analysis is not "silent": nobody asked it."""
    silent = inq.silent if inq.asked else [r for r in inq.silent if inq.ranks[r].answered != "dump"
                                           or inq.ranks[r].gone]
    found = classify(inq.analysis or {}, facts(inq), silent, inq.waited if inq.asked else None)
    if len(found) > MAX_SHOWN:
        rest = len(found) - MAX_SHOWN
        inq.notes.append(f"{rest} more verdicts not listed (see --json)")
    if not found:
        n = len([r for r in inq.ranks.values() if r.answered])
        busy = sum(len(r.pending) for r in inq.ranks.values())
        found.append(Verdict("ok", (), f"{n} process(es) answered; the ranks line up"
                             + (f" ({busy} operation(s) in flight)" if busy else " (nothing in flight)")))
    return found


def _stall_kind(v: Verdict) -> bool:
    return v.kind in STALLS and v.extra.get("group") is not None and v.kind != "stuck_in_c"


def _held(found: list[Verdict]) -> dict[str, Any]:
    """The groups a look finds held up, and at which collective: {group: seq}."""
    return {v.extra["group"]: v.extra.get("seq") for v in found if _stall_kind(v)}


def _age(inq: Inquiry, group: str) -> float:
    """How long the group's oldest operation in flight (a collective, or a send or recv) has been, as its ranks
    say (0: none in flight, which a snapshot of ranks answering a moment apart can show while they move). When
    every rank in the stall has ended (known from its dump: the launcher's autopsy), nothing can move any more:
    as old as a hang, whatever the dumps say (a failed operation is no longer in flight in its rank's dump)."""
    found = looks(inq).get(group, {})
    held = verdicts.stall(found)
    if held is not None and held.waiting and all(r in inq.ranks and inq.ranks[r].gone for r in held.waiting):
        return float("inf")
    return max((lk.age_s for lk in found.values()), default=0.0)


def ask(look: Callable[[], Inquiry], budget: float) -> Inquiry:
    """Look (``look``: one ``inquiry.inquire``), and look again while a group
    is held up by a collective too young to call stuck: soon at first (a
    healthy job has moved on within a few of its steps), then once it would
    be old enough; within ``budget`` seconds from now. The last look, its
    verdicts set: a group that moved is "in progress", one held up at the
    same collective but still too young "slow", one held up at the same
    collective for ``verdicts.stuck_after`` a hang."""
    end = time.monotonic() + budget
    first = look()
    steps = typical_steps(first)
    found = judge(first)
    at = _held(found)
    young = {g: seq for g, seq in at.items() if _age(first, g) < verdicts.stuck_after(steps.get(g))}
    last, moved = first, set()
    gap = max(0.1, min(0.5, 3 * max((steps.get(g) or 0.0) for g in young))) if young else 0.0
    while young:
        left = end - time.monotonic() - 0.5
        if left <= 0:
            break
        wait = min(gap, max(verdicts.stuck_after(steps.get(g)) - _age(last, g) for g in young))
        time.sleep(max(0.0, min(wait, left)))
        last = look()
        found = judge(last)
        now = _held(found)
        moved |= {g for g, seq in young.items() if now.get(g) != seq}
        young = {g: seq for g, seq in young.items() if g not in moved
                 and _age(last, g) < verdicts.stuck_after(steps.get(g))}
        gap = max(0.1, max(verdicts.stuck_after(steps.get(g)) for g in young) / 2) if young else 0.0
    if last is first and not young:
        first.verdicts = [v.as_dict() for v in found]
        return first
    return _conclude(first, last, found, moved, young, steps)


def settle(inq: Inquiry, before: Inquiry | None = None) -> Inquiry:
    """``inq``'s verdicts set by the same rule as ``ask``'s, when the looks
    are someone else's to take (a browser view asks once per refresh):
    ``before`` is the previous look at the same job, if any. A group held
    up by an operation younger than ``verdicts.stuck_after`` is "in
    progress" when it was not held at that collective in ``before``, else
    "slow"; an older one is named as ``ask`` names it after its looks."""
    steps = typical_steps(inq)
    found = judge(inq)
    young = {g: seq for g, seq in _held(found).items() if _age(inq, g) < verdicts.stuck_after(steps.get(g))}
    if not young:
        inq.verdicts = [v.as_dict() for v in found]
        return inq
    earlier = _held(judge(before)) if before is not None else {}
    same = {g: seq for g, seq in young.items() if before is None or earlier.get(g) == seq}
    return _conclude(before or inq, inq, found, set(), same, steps)


def _conclude(first: Inquiry, last: Inquiry, found: list[Verdict], moved: set[str], young: dict[str, Any],
              steps: dict[str, float | None]) -> Inquiry:
    """``last``'s verdicts once the looks are over: a group held up that
    ``moved`` since ``first`` (or is held at a collective ``first`` did not
    show) is "in progress", one still ``young`` at the same collective
    "slow", one older than ``stuck_after`` keeps its verdict."""
    out: list[Verdict] = []
    final = _held(found)
    not_stuck = {g for g, seq in final.items() if g in moved or g in young
                 or _age(last, g) < verdicts.stuck_after(steps.get(g))}
    for g in sorted(not_stuck):
        out.append(_not_stuck(first, last, g, final[g], g not in young, steps.get(g)))
    out += [v for v in found if not (_stall_kind(v) and v.extra["group"] in not_stuck)
            and not (v.kind == "ok" and out)]
    last.verdicts = [v.as_dict() for v in out or [Verdict("ok", (), "the ranks line up")]]
    if last is not first:
        last.notes.append(f"looked again {last.looked_at - first.looked_at:.2f} s after the first look: a hang is "
                          "named only once it persists")
    return last


def _not_stuck(first: Inquiry, last: Inquiry, group: str, seq: Any, moved: bool, step: float | None
               ) -> Verdict:
    """"in progress" (it moved since the first look) or "slow" (held at the same collective, too young to call
    stuck)."""
    v = next((v for v in judge(last) if _stall_kind(v) and v.extra.get("group") == group), None)
    g: dict[str, Any] = next((g for g in (last.analysis or {}).get("groups", []) if g.get("name") == group), {})
    op = str((v.extra.get("op") if v else None) or "collective")
    desc = verdicts.group_desc(str(g.get("desc") or ""), g.get("ranks") or [])
    coll = collective(op, seq, group, desc) if not isinstance(seq, str) else \
        f"a {op} ({seq}) of group {group}" + (f" ({desc})" if desc else "")
    s = verdicts.stall(looks(last).get(group, {}))
    waiting = f" on ranks {', '.join(map(str, s.waiting))} for {s.age_s:.2f} s" if s else ""
    who = f", waiting for {'ranks' if len(v.ranks) > 1 else 'rank'} {', '.join(map(str, v.ranks))}" \
        if v is not None and v.ranks else ""
    usual = f"; the group's usual step is {step * 1e3:.0f} ms" if step else ""
    hang = verdicts.stuck_after(step)
    if moved:
        return Verdict("in_progress", (), f"group {group} moves: {last.looked_at - first.looked_at:.2f} s after "
                       f"the first look, {coll} was in flight{waiting}{who}; a hang is named after {hang:.1f} s"
                       f"{usual}", extra={"group": group, "seq": seq})
    return Verdict("slow", (), f"{coll} has been in flight{waiting}{who}; a hang is named after {hang:.1f} s"
                   f"{usual}: ask again", extra={"group": group, "seq": seq})


def one_look(inq: Inquiry) -> Inquiry:
    """``inq`` with its verdicts set from this one look."""
    inq.verdicts = [v.as_dict() for v in judge(inq)]
    return inq


def problem(inq: Inquiry) -> bool:
    return any(v["problem"] for v in inq.verdicts)


# --- words -----------------------------------------------------------------------------------------


def straggler_lines(inq: Inquiry) -> list[str]:
    """The ranks consistently last at a group's collectives, and by how much (``trace.stragglers``), in words."""
    found = (inq.analysis or {}).get("stragglers")
    return [safe(s, lines=False) for s in found["summary"]] if found else [
        "stragglers: no rank answered with its flight recorder"]


def format_text(inq: Inquiry, stragglers: bool = False) -> str:
    """The verdict lines, every rank, the notes; ``stragglers``: the late ranks too."""
    lines = [f"nccl-pg why: incident {inq.incident}, "
             + (f"{len(inq.ranks) - len(inq.silent)} of {inq.world} ranks answered" if inq.world else
                f"{len(inq.ranks)} answered")
             + f" in {inq.waited:.2f} s"]
    lines += [f"  {v['text']}" for v in inq.verdicts[:MAX_SHOWN]]
    lines.append("ranks:")
    for _, k in sorted(inq.ranks.items())[:4 * MAX_SHOWN]:
        how = {"store": "", "c-stack": " [C-level stack only]", "dump": " [its debug dump only]",
               None: " [no answer]"}[k.answered] + (f" [{k.gone}]" if k.gone else "")
        where = f" at {k.at()}" if k.at() else ""
        busy = f"; in {'; '.join(k.pending)}" if k.pending else ""
        lines.append(safe(f"  {k.who()}{how}{where}{busy}", lines=False))
    if len(inq.ranks) > 4 * MAX_SHOWN:
        lines.append(f"  ... {len(inq.ranks) - 4 * MAX_SHOWN} more (see --json)")
    if stragglers:
        lines += straggler_lines(inq)
    lines += [safe(f"note: {n}", lines=False) for n in inq.notes]
    return "\n".join(lines)


def to_json(inq: Inquiry) -> dict[str, Any]:
    return {
        "ok": not problem(inq), "incident": inq.incident, "world": inq.world,
        "waited_s": round(inq.waited, 3), "verdicts": inq.verdicts, "silent": inq.silent,
        "ranks": {str(r): {"ranks": k.ranks, "answered": k.answered, "host": k.host, "pid": k.pid,
                           "devices": k.devices, "where": k.where, "pending": k.pending,
                           "stack": [report.wire(f) for f in k.stack],
                           "cut": k.cut, "c_stack_file": k.c_stack_path, "dump_file": k.dump_path, "gone": k.gone or None}
                  for r, k in sorted(inq.ranks.items())},
        "stragglers": (inq.analysis or {}).get("stragglers"), "analysis": inq.analysis, "notes": inq.notes,
        "dumps_dir": inq.dumps_dir,
    }


def to_markdown(inq: Inquiry, title: str) -> str:
    out = [f"# {safe(title, lines=False)}", "", f"Incident {inq.incident}; {len(inq.ranks) - len(inq.silent)} of "
           f"{inq.world if inq.world else '?'} ranks answered within {inq.waited:.2f} s.", "", "## Verdict", ""]
    out += [f"- {v['text']}" for v in inq.verdicts]
    out += ["", "## Ranks", "", "| rank | host | pid | answered | where | in flight |", "|---|---|---|---|---|---|"]
    for r, k in sorted(inq.ranks.items()):
        out.append(safe(f"| {r} | {k.host} | {k.pid or ''} | {k.answered or 'no'} | {k.at()} | "
                        f"{'; '.join(k.pending)} |", lines=False))
    blamed = sorted({r for v in inq.verdicts if v["problem"] for r in v["ranks"]})
    for r in blamed:
        b = inq.ranks.get(r)
        if b is None or not b.stack:
            continue
        how = {"c-stack": "C-level stack (faulthandler)", "dump": f"stack in its debug dump ({b.dump_reason[:80]})"
               }.get(b.answered or "", "stack")
        out += ["", safe(f"## {b.who()}: {how}", lines=False), "", "```"]
        out += [safe(line.rstrip("\n")) for line in frames.format_traceback(b.stack)]
        out.append("```")
    if inq.analysis is not None:
        out += ["", "## Flight recorders (nccl-pg trace)", "", "```", safe(trace.format_text(inq.analysis)), "```"]
    if inq.notes:
        out += ["", "## Notes", ""] + [safe(f"- {n}", lines=False) for n in inq.notes]
    return "\n".join(out) + "\n"
