"""Asking a running job what it is doing (``nccl-pg why``, the launcher's
autopsy): raise an incident that asks every process for its report
(report.py), gather the reports within a deadline, ask the processes of this
host that did not answer for their C-level stacks (stacks.py), line the
ranks up with the flight-recorder analysis (trace.py) and say, one line per
problem, who is to blame and where it is.

Everything read back is untrusted input (anyone with the store's secret can
write the keys; the stacks file is read from the dump directory): a report
is at most ``cap`` bytes and all of them together at most ``total_cap``, is
JSON, and only the fields below are taken, each checked for its type; the
recorder part goes through the trace tool's own checks.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import DistError
from ..store import Store
from . import dump, frames, incidents, report, stacks, trace
from .incidents import Signal
from .verdicts import Look, collective, typical_step

CAP = 128 * 1024  # bytes of one process's report, by default
# The most ranks an inquiry expects when the job's size is not known from its launcher or the command line: the
# size the store claims is untrusted (a forged one must not make the reader allocate for 16 million ranks).
MAX_WORLD = 1 << 16
TOTAL_CAP = 64 << 20  # bytes of all reports read, at most
_BATCH = 8 << 20  # bytes asked for in one multi_get, at most
STACKS_WAIT = 1.0  # seconds for a silent rank's C-level handler to write its stacks
DUMP_PREFIX = "rank_"  # the answers as dumps, for the trace tool: <dir>/rank_<r>.json


@dataclass
class Rank:
    """What is known of one process (its lowest global rank)."""

    rank: int
    ranks: list[int]
    answered: str | None  # "store" (its report), "c-stack" (only its C-level handler), None
    host: str = ""
    pid: int | None = None
    devices: list[str] = field(default_factory=list)
    where: dict[str, Any] | None = None
    pending: list[str] = field(default_factory=list)  # "all_reduce #2 of group 0 for 3.1 s"
    stack: list[frames.Frame] = field(default_factory=list)  # the focus thread's frames, outermost first
    cut: list[str] = field(default_factory=list)
    c_stack_path: str | None = None
    dump_path: str | None = None  # its debug dump in the analysis, written before it was asked
    dump_reason: str = ""
    gone: str = ""  # how it ended, when it did ("exited with code 1")

    def who(self) -> str:
        """"rank 1 (host, pid 42, cuda:1)"."""
        bits = [b for b in (self.host, f"pid {self.pid}" if self.pid else "", ", ".join(self.devices)) if b]
        return f"rank {self.rank}" + (f" ({', '.join(bits)})" if bits else "")

    def at(self) -> str:
        """"train.py:123 in eval_step"."""
        w = self.where
        if not w or not w.get("file"):
            return ""
        return f"{w['file']}:{w['line']} in {w['func']}"


@dataclass
class Inquiry:
    incident: int | None
    world: int | None
    waited: float
    ranks: dict[int, Rank]  # by rank: every process that answered, and the silent ranks
    silent: list[int]
    analysis: dict[str, Any] | None
    notes: list[str]
    verdicts: list[dict[str, Any]] = field(default_factory=list)
    dumps_dir: str | None = None
    answers: dict[int, dict[str, Any]] = field(default_factory=dict)  # the checked reports (and dumps), by rank
    looked_at: float = 0.0  # time.monotonic() of the look
    asked: bool = True  # the processes were asked (False: no listener; only stacks and dumps)


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _str(v: Any, limit: int = 4096) -> str:
    return v[:limit] if isinstance(v, str) else ""


def _frames(v: Any) -> list[list[Any]]:
    out = []
    for f in v if isinstance(v, list) else []:
        if isinstance(f, list) and len(f) >= 3 and _int(f[1]) is not None:
            out.append([_str(f[0]), f[1], _str(f[2], 256), _str(f[3], report.LINE_MAX) if len(f) > 3 else ""])
    return out[-report.DEPTH_MAX:]


def checked(raw: bytes, cap: int) -> dict[str, Any] | None:
    """A report read from the store, as plain values of known types (None
    if it is over ``cap`` bytes or not a report)."""
    if len(raw) > cap:
        return None
    try:
        d = json.loads(raw)
    except (ValueError, RecursionError):  # the parser's own bound on nesting (a forged report 60,000 deep)
        return None
    if not isinstance(d, dict) or _int(d.get("rank")) is None:
        return None
    ranks = [r for r in d.get("ranks", []) if _int(r) is not None and 0 <= r < 1 << 24] \
        if isinstance(d.get("ranks"), list) else []
    w = d.get("where")
    threads = [{"name": _str(t.get("name"), 256), "ident": _int(t.get("ident")), "main": bool(t.get("main")),
                "frames": _frames(t.get("frames"))} for t in d.get("threads", []) if isinstance(t, dict)] \
        if isinstance(d.get("threads"), list) else []
    groups = [g for g in d.get("groups", []) if isinstance(g, dict)] if isinstance(d.get("groups"), list) else []
    return {
        "rank": d["rank"], "ranks": ranks or [d["rank"]], "world": _int(d.get("world")), "pid": _int(d.get("pid")),
        "host": _str(d.get("host"), 255), "time": d.get("time") if isinstance(d.get("time"), (int, float)) else None,
        "devices": [_str(x, 64) for x in d.get("devices", []) if isinstance(x, str)]
        if isinstance(d.get("devices"), list) else [],
        "where": {"file": _str(w.get("file")), "line": _int(w.get("line")) or 0, "func": _str(w.get("func"), 256),
                  "code": _str(w.get("code"), report.LINE_MAX), "thread": _str(w.get("thread"), 256)}
        if isinstance(w, dict) and w.get("file") else None,
        "threads": threads, "groups": groups,
        "cut": [_str(c, 256) for c in d.get("cut", []) if isinstance(c, str)] if isinstance(d.get("cut"), list) else [],
        # for the trace tool, which checks these itself
        "version": d.get("version"), "pg_config": d.get("pg_config"), "pg_status": d.get("pg_status"),
        "entries": d.get("entries"), "reason": _str(d.get("reason")), "job": _str(d.get("job"), 64) or None,
    }


def _pending(groups: list[dict[str, Any]]) -> list[str]:
    out = []
    for g in groups:
        for p in g.get("pending", []) if isinstance(g.get("pending"), list) else []:
            if isinstance(p, dict):
                age = p.get("age_s")
                out.append(collective(_str(p.get("op"), 64), _int(p.get("seq")), _str(g.get("name"), 64)) + " for "
                           + (f"{age:.1f} s" if isinstance(age, (int, float)) else "? s"))
    return out


def inquire(store: Store, reason: str, timeout: float, cap: int = CAP, world: int | None = None,
            dump: bool = False, local: Callable[[], Mapping[int, int]] | None = None, signum: int = 0,
            dumps_dir: str | None = None, total_cap: int = TOTAL_CAP, gone: Callable[[], Mapping[int, str]] | None = None,
            dump_of: Callable[[int], str | None] | None = None,
            straggler_ms: float = trace.stragglers.THRESHOLD_MS, ask: bool = True,
            known: Mapping[int, int] | None = None) -> Inquiry:
    """Ask the job on ``store`` (see the module's docstring). ``world``: its
    size, if known (else as the first process to answer says); ``local``:
    {rank: pid} of its processes on this host, for C-level stacks (sent
    ``signum``); ``dumps_dir``: where the answers are kept as dumps (else a
    temporary directory, removed); ``gone``: what is known of ranks that
    ended ({rank: "exited with code 1"}, asked once the answers are in); ``dump_of``: the path of a debug
    dump a silent rank wrote during this job, if any (it joins the answers
    in the analysis); ``straggler_ms``: the analysis's straggler threshold
    (``trace.stragglers``, from the recorders' timestamps); ``ask``: False
    when no process listens (the launcher's autopsy of a job whose ranks
    cannot answer): only the C-level stacks and the dumps speak; ``known``:
    {rank: pid} of ranks of this host, to name a silent (or ended) one."""
    t0 = time.monotonic()
    deadline = t0 + timeout
    notes: list[str] = []
    cap = max(1024, min(cap, incidents.REPORT_MAX))
    gen: int | None = None
    if ask:
        origin = f"inquiry:{socket.gethostname()}:{os.getpid()}"
        gen = incidents.raise_signal(store, Signal(reason, origin, answer=False, dump=dump, report=cap),
                                     incidents.newest(store) + 1)
        incidents.note_latest(store, gen)
        try:
            store.wait([incidents.reports_all_key(gen)], max(deadline - time.monotonic(), 0.001))
        except DistError:
            pass  # someone did not answer in time: read what is there
    waited = time.monotonic() - t0
    read_by = time.monotonic() + max(1.0, timeout / 2)
    if gen is not None and world is None and store.check([incidents.reports_world_key(gen)]):
        w = incidents.parse_gen(store.get(incidents.reports_world_key(gen)))
        world = w if w is not None and w > 0 else None
        if world is not None and world > MAX_WORLD:
            notes.append(f"the store says the job has {world} ranks; asking at most {MAX_WORLD} (give the size: "
                         "--world-size)")
            world = MAX_WORLD
    answers = _read(store, gen, world, cap, total_cap, read_by, notes) if gen is not None else {}
    ranks: dict[int, Rank] = {}
    covered: set[int] = set()
    for r, a in sorted(answers.items()):
        covered.update(a["ranks"])
        focus = a["threads"][0]["frames"] if a["threads"] else []
        focus_thread = a["where"]["thread"] if a["where"] else ""
        for t in a["threads"]:
            if t["name"] == focus_thread:
                focus = t["frames"]
        ranks[r] = Rank(r, a["ranks"], "store", a["host"], a["pid"], a["devices"], a["where"], _pending(a["groups"]),
                        [frames.Frame(*f) for f in focus], a["cut"])
    expected = set(range(world)) if world else set()
    bound = world or MAX_WORLD  # a rank a report names beyond the job's size is not one
    for a in answers.values():  # members of the groups they are in
        for g in a["groups"]:
            if isinstance(g.get("ranks"), list):
                expected.update(r for r in g["ranks"][:bound] if _int(r) is not None and 0 <= r < bound)
    silent = sorted(expected - covered)
    if world is None and not answers:
        notes.append("no process answered, and the job's size is unknown (give it: --world-size)")
    pids = dict(local()) if local is not None and silent and signum else {}
    asked = {r: pids[r] for r in silent if r in pids}
    replies = stacks.request_all(asked, signum, STACKS_WAIT, cap)
    for r in silent:
        ranks[r] = Rank(r, [r], None)
        if known and r in known:
            ranks[r].pid, ranks[r].host = known[r], socket.gethostname()
        pid = pids.get(r)
        if pid is None:
            continue
        ranks[r].pid = pid
        got = replies.get(r)
        if got is None:
            notes.append(f"rank {r} (pid {pid}, this host): no C-level stacks (no handler for signal {signum}, "
                         "or nothing written)")
            continue
        threads = got.threads()
        if threads:
            ranks[r].answered, ranks[r].c_stack_path = "c-stack", got.path
            ranks[r].host = socket.gethostname()
            ranks[r].stack = threads[0].frames
            ranks[r].where = _where(ranks[r].stack)
    ended = dict(gone()) if gone is not None and silent else {}
    for r in silent:
        if r in ended:
            ranks[r].gone = ended[r]
        # Without asking, the dumps are the flight recorders there are: a live rank's C-level stack says where it
        # is now, but carries none (a rank still unwinding its failure when looked at has both).
        path = dump_of(r) if dump_of is not None and (ranks[r].answered is None or not ask) else None
        old = _from_dump(path, r, notes) if path else None
        if old is None:
            continue
        answers[r] = old
        k = ranks[r]
        k.dump_path, k.dump_reason = path, old["reason"]
        if k.answered is None:
            k.answered, k.host, k.pid = "dump", old["host"], old["pid"] or k.pid
            k.stack = [frames.Frame(*f) for f in old["threads"][0]["frames"]] if old["threads"] else []
            k.where = _where(k.stack)
    keep = dumps_dir is not None
    folder = dumps_dir or tempfile.mkdtemp(prefix="nccl_pg_why_")
    try:
        analysis = _analyze(folder, answers, straggler_ms) if answers else None
    finally:
        if not keep:
            with contextlib.suppress(OSError):
                for n in os.listdir(folder):
                    os.unlink(os.path.join(folder, n))
                os.rmdir(folder)
    return Inquiry(gen, world, waited, ranks, silent, analysis, notes, dumps_dir=dumps_dir, answers=answers,
                   looked_at=t0, asked=ask)


def _where(stack: list[frames.Frame]) -> dict[str, Any] | None:
    f = frames.user_frame(stack)
    return report.where(f) if f is not None else None


def _from_dump(path: str, rank: int, notes: list[str]) -> dict[str, Any] | None:
    """A debug dump (dump.read: untrusted input), in the form of a checked report."""
    try:
        d = dump.read(path)
    except dump.NotADump as exc:
        notes.append(f"rank {rank}: {path}: not a readable dump ({exc})")
        return None
    raw: dict[Any, Any] = d["threads"] if isinstance(d.get("threads"), dict) else {}
    parsed = frames.parse_python({_str(k, 256): [x for x in v if isinstance(x, str)] for k, v in raw.items()
                                  if isinstance(v, list)})
    parsed.sort(key=lambda t: t.name != "MainThread")
    threads = [{"name": t.name, "ident": None, "main": t.name == "MainThread",
                "frames": [report.wire(f) for f in t.frames[-report.DEPTH_MAX:]]} for t in parsed]
    return {"rank": rank, "ranks": [rank], "world": None, "pid": _int(d.get("pid")), "host": _str(d.get("host"), 255),
            "time": d.get("time") if isinstance(d.get("time"), (int, float)) else None, "devices": [], "where": None,
            "threads": threads, "cut": [],
            "groups": [g for g in d["groups"] if isinstance(g, dict)][:256] if isinstance(d.get("groups"), list) else [],
            "version": d.get("version"), "pg_config": d.get("pg_config"), "pg_status": d.get("pg_status"),
            "entries": d.get("entries"), "reason": _str(d.get("reason")), "job": _str(d.get("job"), 64) or None}


def _read(store: Store, gen: int, world: int | None, cap: int, total_cap: int, deadline: float,
          notes: list[str]) -> dict[int, dict[str, Any]]:
    """The reports there are, checked, by rank."""
    if world is None:
        return {}
    keys = incidents.present(store, [incidents.report_key(gen, r) for r in range(world)], deadline)
    out: dict[int, dict[str, Any]] = {}
    budget = total_cap
    per = max(1, _BATCH // cap)
    for i in range(0, len(keys), per):
        if budget < cap:
            notes.append(f"{len(keys) - i} more reports not read: over the {total_cap}-byte total")
            break
        batch = keys[i:i + per]
        for k, raw in zip(batch, store.multi_get(batch), strict=True):
            budget -= len(raw)
            a = checked(raw, cap)
            if a is None or not 0 <= a["rank"] < world:
                notes.append(f"{k}: not a report (or over {cap} bytes): ignored")
                continue
            out[a["rank"]] = a
    return out


def _analyze(folder: str, answers: Mapping[int, dict[str, Any]], straggler_ms: float) -> dict[str, Any]:
    """The reports as dumps in ``folder`` (0700), and the trace tool's analysis of them."""
    os.makedirs(folder, mode=0o700, exist_ok=True)
    for r, a in answers.items():
        d = {k: a[k] for k in ("version", "pg_config", "pg_status", "entries", "reason", "pid", "host", "time", "job")
             if a.get(k) is not None}
        d["rank"] = r
        d["threads"] = {f"{t['name']} ({t['ident']})": frames.format_traceback([frames.Frame(*f) for f in t["frames"]])
                        for t in a["threads"]}
        fd = os.open(os.path.join(folder, f"{DUMP_PREFIX}{r}.json"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC |
                     os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(d, f)
    return trace.analyze_dir(folder, DUMP_PREFIX, allow_incomplete_ranks=True, straggler_ms=straggler_ms)


def looks(inq: Inquiry) -> dict[str, dict[int, Look]]:
    """What this look shows of each group, by global rank (``verdicts.Look``:
    last issued, last completed, the age of its oldest operation in flight),
    from the ranks' reports."""
    out: dict[str, dict[int, Look]] = {}
    for a in inq.answers.values():
        for g in a["groups"]:
            name, ranks, me = g.get("name"), g.get("ranks"), _int(g.get("rank"))
            issued, completed = _int(g.get("issued")), _int(g.get("completed"))
            if not isinstance(name, str) or not isinstance(ranks, list) or me is None or not 0 <= me < len(ranks) \
                    or issued is None or completed is None or _int(ranks[me]) is None:
                continue
            ages = [p["age_s"] for p in g.get("pending", []) if isinstance(p, dict)
                    and isinstance(p.get("age_s"), (int, float))] if isinstance(g.get("pending"), list) else []
            out.setdefault(name, {})[ranks[me]] = Look(issued, completed, float(max(ages, default=0.0)))
    return out


def typical_steps(inq: Inquiry) -> dict[str, float | None]:
    """Each group's usual step (``verdicts.typical_step``), from the issue
    times of its collectives in one rank's recorder."""
    times: dict[str, list[float]] = {}
    for a in inq.answers.values():
        mine: dict[str, list[float]] = {}
        for e in a.get("entries") or [] if isinstance(a.get("entries"), list) else []:
            if isinstance(e, dict) and isinstance(e.get("process_group"), list) and e["process_group"] and \
                    _int(e.get("time_created_ns")) and not e.get("is_p2p"):
                mine.setdefault(str(e["process_group"][0]), []).append(e["time_created_ns"] / 1e9)
        for g, ts in mine.items():
            if len(ts) > len(times.get(g, [])):
                times[g] = ts[-64:]
    return {g: typical_step(ts) for g, ts in times.items()}
