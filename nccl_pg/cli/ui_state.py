"""What the browser view of a job shows (ui.py serves it, as a page and as
JSON at ``/api/state``): one look at the job, taken when a page asks.

A look is one inquiry (diagnostics/inquiry.py: what ``nccl-pg why`` does),
judged by ``findings.settle`` against the previous look, so that the view
names a hang by the same rule and in the same words as ``why``. From the
same answers it takes, per rank: host, pid, state, the collective it is in
per group and for how long, the last one it completed there, its straggler
score (``trace.stragglers``); the stacks of the ranks a verdict blames; a
timeline of each rank's last collectives (the trace tool's Chrome trace of
the answers' flight recorders, ``trace.chrome_trace``, cut to the newest);
and the elastic job's membership records (elastic/records.py).

Everything here comes from the ranks' answers, which are untrusted: the
recorder part is read back through the trace tool's checks, the rest is
taken field by field with its type checked; the page shows every string as
text (never as markup).
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..diagnostics import findings, inquiry, report, stacks, trace
from ..diagnostics.trace import loading
from ..diagnostics.verdicts import op_name
from ..elastic.records import LATEST_KEY, Config, Records, config_key
from ..errors import DistError
from ..store import Store

VERSION = 1
TIMELINE_ENTRIES = 24  # the newest recorder entries per rank in the timeline
TIMELINE_RANKS = 256  # ranks drawn in the timeline, at most (the table lists them all)
MEMBERSHIP_SHOWN = 32  # the newest membership records shown
MIN_INTERVAL = 1.0  # seconds: pages that ask sooner after a look get that look (many tabs: one inquiry)


@dataclass
class Job:
    """The job a view asks. ``connect``: a client of its store and how to
    close it; ``address``: the store's host and port (to find its ranks on
    this host for their C-level stacks); ``world``: its size, if known;
    ``gone``: how its ranks that ended did, if known ({rank: "exited with
    code 1"}: the launcher's); ``launcher_pid``: the launcher serving the
    page, if any."""

    label: str
    connect: Callable[[], tuple[Store, Callable[[], None]]]
    address: tuple[str, int]
    world: int | None = None
    gone: Callable[[], Mapping[int, str]] | None = None
    launcher_pid: int | None = None
    reason: str = "asked by the browser view"


class View:
    """The looks of one job, taken when a page asks and never otherwise."""

    def __init__(self, job: Job, timeout: float, signum: int, cap: int = inquiry.CAP) -> None:
        self.job, self.timeout, self.signum, self.cap = job, timeout, signum, cap
        self._lock = threading.Lock()
        self._previous: inquiry.Inquiry | None = None
        self._state: dict[str, Any] | None = None
        self._at = 0.0  # time.monotonic() when ``_state`` was made
        self._members: dict[int, Config] = {}  # membership records read so far (each is written once)

    def state(self) -> dict[str, Any]:
        """The newest look: a new one unless one was made since this call
        began or within ``MIN_INTERVAL`` (one inquiry at a time; pages that
        ask meanwhile share it)."""
        asked = time.monotonic()
        with self._lock:
            if self._state is not None and self._at >= asked - MIN_INTERVAL:
                return self._state
            self._state = self._look()
            self._at = time.monotonic()
            return self._state

    def _look(self) -> dict[str, Any]:
        job = self.job
        head: dict[str, Any] = {"v": VERSION, "job": job.label, "launcher_pid": job.launcher_pid,
                                "asked_at": time.time(), "ended": None}
        try:
            store, close = job.connect()
        except (OSError, DistError, ValueError) as exc:
            return {**head, "ended": f"the job has ended, or its store at {job.address[0]}:{job.address[1]} cannot "
                                     f"be reached: {exc}"}
        folder = tempfile.mkdtemp(prefix="nccl_pg_ui_")
        try:
            inq = inquiry.inquire(store, job.reason, self.timeout, self.cap, job.world, False,
                                  lambda: stacks.find_ranks(*job.address, self.signum), self.signum,
                                  dumps_dir=folder, gone=job.gone)
            findings.settle(inq, self._previous)
            self._previous = inq
            dumps = loading.load_dir(folder, inquiry.DUMP_PREFIX).dumps
            members = self._membership(store)
        except (OSError, DistError) as exc:
            return {**head, "ended": f"the job has ended, or its store at {job.address[0]}:{job.address[1]} stopped "
                                     f"answering: {exc}"}
        finally:
            close()
            shutil.rmtree(folder, ignore_errors=True)
        return {**head, **describe(inq, dumps), "membership": members}

    def _membership(self, store: Store) -> list[dict[str, Any]] | None:
        """The newest membership records of an elastic job (None: not elastic); only those not read before are
        asked for."""
        if not store.check([LATEST_KEY]):
            return None
        records = Records(store)
        try:
            latest = records.latest()
            want = [u for u in range(max(0, latest - MEMBERSHIP_SHOWN + 1), latest + 1) if u not in self._members]
            for u, raw in zip(want, store.multi_get([config_key(u) for u in want]) if want else [], strict=True):
                self._members[u] = Config.decode(raw, config_key(u))
        except ValueError as exc:  # a malformed record: said, not fatal
            return [{"uuid": None, "members": [], "why": str(exc)}]
        shown = sorted(u for u in self._members if u > latest - MEMBERSHIP_SHOWN)
        return [{"uuid": u, "members": list(self._members[u].members), "why": self._members[u].why} for u in shown]


# --- one look, as the page's data ---------------------------------------------------------------------


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _str(v: Any, limit: int = 256) -> str:
    return v[:limit] if isinstance(v, str) else ""


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def describe(inq: inquiry.Inquiry, dumps: Mapping[int, loading.Dump]) -> dict[str, Any]:
    """One look (its verdicts set) as the page shows it."""
    blamed = {r for v in inq.verdicts if v["problem"] for r in v["ranks"]}
    scores = ((inq.analysis or {}).get("stragglers") or {}).get("ranks") or {}
    ranks = []
    for r, k in sorted(inq.ranks.items()):
        d = dumps.get(r)
        groups = _groups((inq.answers.get(r) or {}).get("groups"), d)
        ranks.append({
            "rank": r, "ranks": k.ranks, "host": k.host, "pid": k.pid, "devices": k.devices,
            "answered": k.answered, "state": _state(k, groups), "where": k.at(), "gone": k.gone or None,
            "groups": groups, "straggler": scores.get(str(r)), "culprit": r in blamed,
            "stack": [report.wire(f) for f in k.stack] if r in blamed else [],
        })
    return {
        "incident": inq.incident, "world": inq.world, "waited_s": round(inq.waited, 3),
        "answered": len(inq.ranks) - len(inq.silent), "ok": not findings.problem(inq),
        "verdicts": [{k: v[k] for k in ("kind", "class", "problem", "ranks", "text", "where")} for v in inq.verdicts],
        "ranks": ranks, "stragglers": findings.straggler_lines(inq), "timeline": timeline(dumps),
        "notes": list(inq.notes),
    }


def _state(k: inquiry.Rank, groups: list[dict[str, Any]]) -> str:
    if k.gone:
        return "ended"
    if k.answered is None:
        return "no answer"
    if k.answered == "c-stack":
        return "C-level stack only"
    if k.answered == "dump":
        return "its debug dump only"
    return "in a collective" if any(g["in"] for g in groups) or k.pending else "in its own code"


def _groups(raw: Any, d: loading.Dump | None) -> list[dict[str, Any]]:
    """Per group of a rank's answer: the collective it is in and for how long (its oldest in flight), the last it
    completed (its flight recorder's newest completed entry)."""
    last = _last_completed(d) if d is not None else {}
    out = []
    for g in raw if isinstance(raw, list) else []:
        if not isinstance(g, dict) or not isinstance(g.get("name"), str):
            continue
        pending = [p for p in g.get("pending") or [] if isinstance(p, dict)] if isinstance(g.get("pending"),
                                                                                              list) else []
        oldest = pending[0] if pending else None
        name = _str(g["name"], 64)
        out.append({
            "group": name, "desc": _str(g.get("desc"), 128), "state": _str(g.get("state"), 32),
            "in": f"{op_name(_str(oldest.get('op'), 64))} #{_int(oldest.get('seq'))}" if oldest else None,
            "for_s": _num(oldest.get("age_s")) if oldest else None, "in_flight": len(pending),
            "last": last.get(name),
        })
        if len(out) >= 64:
            break
    return out


def _last_completed(d: loading.Dump) -> dict[str, str]:
    """Per group, the newest entry of the rank's recorder that completed: "all_reduce #12"."""
    last = {}
    for e in d.entries:
        if loading.outcome(e, d.tracks_states) == "completed":
            seq = e["p2p_seq_id"] if e["_p2p"] else e["collective_seq_id"]
            last[str(e["process_group"][0])] = f"{op_name(e['_kind'])} #{seq}"
    return last


def timeline(dumps: Mapping[int, loading.Dump]) -> dict[str, Any]:
    """Each rank's newest recorder entries, from the trace tool's Chrome trace: per entry its group, name,
    start and end (ms from the earliest shown; no end: not completed when the rank answered, which was at
    ``now_ms``)."""
    shown = dict(sorted(dumps.items())[:TIMELINE_RANKS])
    chrome = trace.chrome_trace({r: _newest(d) for r, d in shown.items()})
    t0 = chrome["otherData"]["time_origin_ns"]
    rows: dict[str, list[dict[str, Any]]] = {str(r): [] for r in shown}
    for ev in chrome["traceEvents"]:
        if ev["ph"] not in ("X", "i"):
            continue
        done = ev["cat"] == "completed"
        rows[str(ev["pid"])].append({
            "group": ev["args"]["group"], "name": ev["name"], "state": ev["cat"], "start_ms": round(ev["ts"] / 1e3, 3),
            "end_ms": round((ev["ts"] + ev.get("dur", 0.0)) / 1e3, 3) if done else None})
    now = {str(r): round((d.time * 1e9 - t0) / 1e6, 3) for r, d in shown.items() if d.time is not None and t0}
    return {"ranks": rows, "now_ms": now, "left_out": max(0, len(dumps) - len(shown))}


def _newest(d: loading.Dump) -> loading.Dump:
    """The dump with only its newest entries (those the timeline draws)."""
    return loading.Dump(d.rank, d.path, d.data, d.entries[-TIMELINE_ENTRIES:], True, d.tracks_states, d.host, d.pid)
