"""Who a rank is (host, pid) and where it is now, from its dump: the user's
frame (``frames.user_frame``) in the stack of the thread that issues its
operations. Three sources, best first: the dump's ``threads`` (the Python
stack of every thread when it dumped: our dumps), the rank's C-level stacks
file (``diagnostics.stacks``: faulthandler's, written on a signal or at an
operation's deadline, so also for a rank holding the GIL or stuck in C), and
an entry's ``frames`` (the stack where an operation was issued: torch's
dumps, and ours with ``NCCL_PG_TRACE_STACKS=1``; where the rank was, not
where it is)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..frames import Thread, user_frame
from .loading import Dump, outcome


def who(d: Dump) -> str:
    """"rank 1 (host vm, pid 123)", or as much of it as the dump says."""
    parts = [p for p in (f"host {d.host}" if d.host else "", f"pid {d.pid}" if d.pid is not None else "") if p]
    return f"rank {d.rank}" + (f" ({', '.join(parts)})" if parts else "")


def _thread_hint(d: Dump, group: str | None) -> tuple[int | None, str | None]:
    """The thread that issued the rank's newest operation (on ``group`` if it has one there)."""
    on_group = [e for e in d.entries if group is None or e["process_group"][0] == group] or d.entries
    if not on_group:
        return None, None
    e = on_group[-1]
    return e["thread_id"], e["thread_name"]


def locate(d: Dump, group: str | None = None) -> dict[str, Any]:
    """Where rank ``d`` is: {"file", "line", "function", "code", "thread",
    "source", "text"} or None, with "source" saying how it is known:
    "python" (its threads' stacks when it dumped), "c" (faulthandler's
    stacks), or "issue" (the stack where it issued its newest operation:
    where it was, not where it is). A rank that ended raising an exception
    is where it raised it: that is newer than any stack in its dump (a dump
    written at another's request while it unwound shows only its entry)."""
    if d.raised_at is not None:
        return {**d.raised_at.as_dict(), "thread": "MainThread", "source": "python",
                "text": f"at {d.raised_at.where}, where it raised the exception it ended on"}
    ident, name = _thread_hint(d, group)
    for threads in (d.threads, d.c_threads):
        t = pick(threads, ident, name)
        f = user_frame(t.frames) if t is not None else None
        if t is not None and f is not None:
            src = "python" if t.source == "python" else "c"
            thread = name if name and ident is not None and t.ident == ident else t.name  # faulthandler: no names
            return {**f.as_dict(), "thread": thread, "source": src,
                    "text": f"at {f}" + ("" if thread == "MainThread" else f" (thread {thread})")
                    + (" (C-level stack)" if src == "c" else "")}
    for e in reversed(d.entries):
        if e["frames"]:
            f = user_frame(e["frames"])
            if f is not None:
                kind = f"{e['_kind']} {e['_meta']}".strip()
                return {**f.as_dict(), "thread": e["thread_name"], "source": "issue",
                        "text": f"issued {kind} #{e['collective_seq_id'] or e['p2p_seq_id']} at {f}"}
    return {"file": None, "line": None, "function": None, "code": None, "thread": None, "source": None,
            "text": "no stack in its dump"}


def summary(d: Dump, group: str | None = None, stacks: bool = False) -> dict[str, Any]:
    """A rank for the report: who, where, what it is in, and (``stacks``) its stacks."""
    pending = [e for e in d.entries if outcome(e, d.tracks_states) != "completed"]
    out: dict[str, Any] = {"rank": d.rank, "host": d.host, "pid": d.pid, "reason": d.data.get("reason"),
                           "who": who(d), "at": locate(d, group)}
    if pending:
        e = pending[-1]
        seq = e["p2p_seq_id"] if e["_p2p"] else e["collective_seq_id"]
        out["in"] = {"op": f"{e['_kind']} {e['_meta']}".strip(), "seq": seq, "p2p": e["_p2p"],
                     "group": e["process_group"][0], "state": outcome(e, d.tracks_states)}
    else:
        out["in"] = None
    if stacks:
        out["stacks"] = [_thread_dict(t) for t in ordered_threads(d, group)]
    return out


def pick(threads: Sequence[Thread], ident: int | None, name: str | None) -> Thread | None:
    """The thread that issued the operations (by ident, else by name), else
    the main thread, else the one faulthandler ran on."""
    for want in (lambda t: ident is not None and t.ident == ident, lambda t: name is not None and t.name == name,
                 lambda t: t.name == "MainThread", lambda t: t.current):
        found = [t for t in threads if want(t)]
        if found:
            return found[0]
    return None


def format_thread(t: Thread, indent: str = "      ") -> list[str]:
    """The stack in traceback's order (innermost last), one line per frame."""
    head = f"{indent}{'C-level ' if t.source == 'c' else ''}stack of thread {t.name}" + (
        f" ({t.ident})" if t.ident is not None and t.source == "python" else "") + ", most recent call last:"
    lines = [head]
    for f in t.frames:
        lines.append(f"{indent}  {f}")
    if not t.frames:
        lines.append(f"{indent}  (no Python frame)")
    return lines


def ordered_threads(d: Dump, group: str | None = None) -> list[Thread]:
    """Every thread, the one that issues the rank's operations first, Python's before faulthandler's."""
    ident, name = _thread_hint(d, group)
    out: list[Thread] = []
    for threads in (d.threads, d.c_threads):
        chosen = pick(threads, ident, name)
        out += ([chosen] if chosen else []) + [t for t in threads if t is not chosen]
    return out


def _thread_dict(t: Thread) -> dict[str, Any]:
    return {"thread": t.name, "ident": t.ident, "source": t.source, "frames": [f.as_dict() for f in t.frames],
            "text": format_thread(t, "")}
