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
from collections.abc import Callable, Mapping
from typing import Any

from . import frames, report, trace, verdicts
from .classify import STALLS, Facts, classify
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
        reason = str((inq.answers.get(r) or {}).get("reason") or "")
        victim = "" if not k.gone else "its operation timed out" if "timeout" in reason[:40] else \
            "its group was aborted" if "abort" in reason[:40] else ""
        out[r] = Facts(k.who(), k.answered, k.at(), k.gone, "", stale, victim)
    return out


def judge(inq: Inquiry) -> list[Verdict]:
    """The verdicts of one look (``ok`` when there is no problem)."""
    found = classify(inq.analysis or {}, facts(inq), inq.silent, inq.waited)
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


def ask(look: Callable[[], Inquiry], budget: float) -> Inquiry:
    """Look (``look``: one ``inquiry.inquire``), and look again when a group
    is held up by an operation too young to call stuck, within ``budget``
    seconds from now; the last look, with its verdicts set."""
    end = time.monotonic() + budget
    first = look()
    found = judge(first)
    held = {v.extra["group"] for v in found if _stall_kind(v)}
    steps = typical_steps(first)
    a = looks(first)
    young = {g: s for g in held if (s := verdicts.stall(a.get(g, {}))) is not None
             and s.age_s < verdicts.stuck_after(steps.get(g))}
    if not young:
        first.verdicts = [v.as_dict() for v in found]
        return first
    wait = max(verdicts.stuck_after(steps.get(g)) - s.age_s for g, s in young.items())
    time.sleep(max(0.0, min(wait, end - time.monotonic() - 0.5)))
    second = look()
    again = judge(second)
    b = looks(second)
    out: list[Verdict] = []
    settled: set[str] = set()
    for g, s in young.items():
        if verdicts.stuck(a.get(g, {}), b.get(g, {}), steps.get(g)) is not None:
            continue  # it persisted: the second look's verdicts say it
        settled.add(g)
        out.append(_not_stuck(first, second, g, s, b.get(g, {}), steps.get(g)))
    out += [v for v in again if not (_stall_kind(v) and v.extra["group"] in settled)
            and not (v.kind == "ok" and out)]
    second.verdicts = [v.as_dict() for v in out]
    second.notes.append(f"looked twice, {second.looked_at - first.looked_at:.2f} s apart: a hang is named only "
                        "once it persists")
    return second


def _not_stuck(first: Inquiry, second: Inquiry, group: str, s: verdicts.Stall, now: Mapping[int, verdicts.Look],
               step: float | None) -> Verdict:
    op = next((v.extra.get("op", "") for v in judge(first) if v.extra.get("group") == group), "")
    desc = next((str(g.get("desc") or "") for g in (first.analysis or {}).get("groups", [])
                 if g.get("name") == group), "")
    coll = collective(op or "collective", s.seq, group, desc)
    waited = ", ".join(map(str, s.waiting))
    gap = second.looked_at - first.looked_at
    usual = f"; the group's usual step is {step * 1e3:.0f} ms" if step else ""
    b = verdicts.stall(now)
    if b is None or b.seq != s.seq:
        return Verdict("in_progress", (), f"{coll} was in flight on ranks {waited} for {s.age_s:.2f} s at the first "
                       f"look; {gap:.2f} s later it had completed{usual}", extra={"group": group, "seq": s.seq})
    return Verdict("slow", (), f"{coll} has been in flight on ranks {waited} for {b.age_s:.2f} s, waiting for "
                   f"{', '.join(map(str, b.holding)) or 'its peers'}; a hang is named after "
                   f"{verdicts.stuck_after(step):.1f} s{usual}: ask again", extra={"group": group, "seq": s.seq})


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
