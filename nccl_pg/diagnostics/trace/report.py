"""The analysis's report in plain words: the verdict line (whom to look at
first, and the first thing stuck) and the text ``nccl-pg trace`` prints."""

from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence
from typing import Any

from ..verdicts import group_desc
from .stragglers import MIN_COLLECTIVES

_WHY = {"no_dump": "no dump", "ranks_missing": "missing from {op} #{seq} on group {group!r}",
        "op_mismatch": "different op at #{seq} on group {group!r}",
        "size_mismatch": "sizes of {op} #{seq} on group {group!r}",
        "dtype_mismatch": "dtypes of {op} #{seq} on group {group!r}",
        "p2p_unmatched": "no {op} partner on group {group!r}", "p2p_mismatch": "send/recv sizes",
        "membership_mismatch": "group membership", "unreadable": "unreadable dump"}


def blame(problems: Sequence[Mapping[str, Any]], n_dumps: int) -> dict[int, list[str]]:
    """{rank: why to look at it}, in rank order: the ranks the problems name
    as the odd ones out (not those of a size rule every rank broke)."""
    out: dict[int, list[str]] = collections.defaultdict(list)
    for p in problems:
        if p["kind"] in _WHY and (p["kind"] != "size_mismatch" or len(p["ranks"]) < n_dumps):
            for r in p["ranks"]:
                reason = _WHY[p["kind"]].format(**{k: p.get(k) for k in ("op", "seq", "group")})
                if reason not in out[r]:
                    out[r].append(reason)
    return dict(sorted(out.items()))


def verdict(problems: Sequence[Mapping[str, Any]], n_dumps: int, first: Mapping[str, Any] | None) -> str:
    """One line: whom to look at first, and the first thing stuck."""
    if not problems:
        return "consistent: nothing missing, nothing mismatched, everything completed"
    located = {w["rank"]: w for p in problems for w in p.get("where") or ()}
    parts = [f"rank {r}{_whereabouts(located.get(r))}: {', '.join(rs[:3])}"
             for r, rs in blame(problems, n_dumps).items()]
    text = ("look at " + "; ".join(parts)) if parts else f"{len(problems)} problem(s)"
    if first is not None:
        where = f"{first['op']} #{first['seq']}" if first.get("seq") is not None else first["op"]
        text += f"; first stuck: {where} on group {first['group']!r}"
    return text


def _whereabouts(w: Mapping[str, Any] | None) -> str:
    """" (host vm, pid 12, at train.py:10 in eval_step)" from a problem's "where" of the rank; "" if unknown."""
    if not w:
        return ""
    at = w.get("at") or {}
    parts = [f"host {w['host']}" if w.get("host") else "", f"pid {w['pid']}" if w.get("pid") is not None else "",
             f"at {at['file']}:{at['line']} in {at['function']}" if at.get("source") in ("python", "c") else ""]
    parts = [p for p in parts if p]
    return f" ({', '.join(parts)})" if parts else ""


def format_text(report: Mapping[str, Any]) -> str:
    """The report in plain words."""
    lines = [f"nccl-pg trace: {len(report['ranks'])} dump(s) in {report.get('dir', '?')} "
             f"(prefix {report.get('prefix', '')!r}"
             + (f", job {report['job']}" if report.get("job") else "") + f"), ranks {_span(report['ranks'])}"
             + (f" of {_span(report['expected_ranks'])} expected" if report["ranks_without_dump"] else "")]
    filters = report.get("filters") or {}
    shown = [f"{k} {v}" for k, v in filters.items() if v is not None]
    if shown:
        lines.append(f"  showing only what concerns {' and '.join(shown)}")
    for g in report["groups"]:
        last = g.get("last_collective_seq") or {}
        tail = ", ".join(f"{r}:{s}" for r, s in last.items())
        lines.append(f"  group {g['name']!r} ({group_desc(g['desc'], g['ranks']) or '?'}): ranks {g['ranks']}"
                     + (f"; last collective per rank {tail}" if tail else ""))
    problems = report["problems"]
    if not problems and shown:
        lines.append("no problem concerns what is shown.")
    elif not problems:
        lines.append("OK: every collective and send/recv lines up across the ranks, and every one completed.")
    else:
        lines.append(f"{len(problems)} problem(s):")
        first = report.get("first_incomplete")
        for i, p in enumerate(problems, 1):
            mark = "  <- first collective that did not complete anywhere" if p is first or p.get("first") else ""
            lines.append(f"  {i}. [{p['kind']}] {p['message']}{mark}")
            for w in p.get("where") or ():
                if p["kind"] == "ranks_missing":
                    lines.append(f"       {w['text']}")
    lines += _rank_details(report)
    straggling = report.get("stragglers") or {}
    if straggling.get("stragglers") or straggling.get("collectives", 0) >= MIN_COLLECTIVES:
        lines += straggling.get("summary") or []
    for n in report["notes"]:
        lines.append(f"  note: {n}")
    shown_verdicts = [v for v in report.get("verdicts") or () if v.get("problem") or v.get("kind") == "victim"]
    if shown_verdicts:
        lines.append("verdicts:")
        lines += [f"  {v['text']}" for v in shown_verdicts]
    if problems:
        lines.append(f"verdict: {report['verdict']}")
    return "\n".join(lines)


def _rank_details(report: Mapping[str, Any]) -> list[str]:
    """Who and where each culprit (or each chosen rank) is, and its stacks if they were asked for."""
    details = report.get("rank_details") or []
    if not details:
        return []
    chosen = (report.get("filters") or {}).get("ranks") is not None
    lines = ["ranks:" if chosen else "culprits (where each is now):"]
    for r in details:
        now = r.get("in")
        doing = (f"in {now['op']} #{now['seq']} on group {now['group']!r} ({now['state']})" if now
                 else "in no operation" if r.get("dump", True) else "no dump")
        lines.append(f"  {r['who']}: {doing}; {r['at']['text']}")
        if r.get("blame"):
            lines.append(f"    why: {'; '.join(r['blame'])}")
        for t in r.get("stacks") or ():
            lines += [f"    {line}" for line in t["text"]]
    return lines


def _span(ranks: Sequence[int]) -> str:
    return "[" + ", ".join(map(str, ranks)) + "]"

