"""What a process says about itself when asked (``nccl-pg why``, the
launcher's autopsy): its ranks, host, pid and device, every live group's
counters and pending operations, its flight recorder in PyTorch's dump
layout, the Python stack of every thread, and where it is ("where": the
user's frame, ``frames.user_frame``, in the thread that matters: the one
that issued its oldest pending operation, else the main thread).

The report is JSON of at most ``cap`` bytes: when it does not fit, older
completed recorder entries go first, then the stacks of other threads, then
frames far from the innermost; what was cut is listed under "cut". It is
built only when asked: nothing here runs in a healthy job.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

from . import dump as dump_mod
from . import flight_recorder, frames, group_view
from .group_view import GroupView

VERSION = 1
LINE_MAX = 200  # characters of a source line kept per frame
DEPTH_MAX = 64  # frames kept per thread (the innermost)


def wire(f: frames.Frame) -> list[Any]:
    """A frame as a report holds it: [file, line, function, source line]."""
    return [f.file, f.line, f.function, f.code[:LINE_MAX]]


def where(f: frames.Frame) -> dict[str, Any]:
    """A report's "where" (with "thread" added by the caller)."""
    return {"file": f.file, "line": f.line, "func": f.function, "code": f.code[:LINE_MAX]}


def stacks() -> list[dict[str, Any]]:
    """Every thread's stack, the main thread first."""
    threads = {t.ident: t for t in threading.enumerate()}
    main = threading.main_thread().ident
    out = [{"name": threads[i].name if i in threads else "?", "ident": i, "main": i == main,
            "frames": [wire(x) for x in frames.of_frame(f, DEPTH_MAX)]}
           for i, f in sys._current_frames().items()]  # noqa: SLF001 - the stdlib's one way to them
    out.sort(key=lambda t: (not t["main"], str(t["name"])))
    return out


def where_now(views: Sequence[GroupView]) -> frames.Frame | None:
    """Where the rank of ``views`` is in the user's code: the thread that
    issued its oldest operation in flight, else (a process of one rank) the
    main thread, as ``_focus`` chooses for a report. None when it cannot be
    told: a process that holds several ranks (thread ranks: the main thread
    and the recorder are not this rank's alone)."""
    mine = {v.global_rank(v.rank) for v in views}
    if {v.global_rank(v.rank) for v in group_view.views()} - mine:
        return None  # the recorder and the threads are shared by ranks that cannot be told apart
    pending = [e for e in flight_recorder.get().entries() if e.state != "completed" and not e.retired]
    ident = pending[0].thread_id if pending else threading.main_thread().ident
    frame = sys._current_frames().get(ident or 0)  # noqa: SLF001 - the stdlib's one way to them
    if frame is None:
        return None
    return frames.user_frame(frames.of_frame(frame, DEPTH_MAX))


def _groups(views: Sequence[GroupView]) -> list[dict[str, Any]]:
    now = time.monotonic()
    out = []
    for v in views:
        a = v.activity()
        out.append({"name": v.name, "desc": v.desc, "uid": v.uid, "rank": v.rank, "size": v.size,
                    "ranks": v.global_ranks(), "backend": v.backend, "state": v.state() or "open",
                    "device": v.device(), "issued": a.issued, "completed": a.completed, "p2p_issued": a.p2p_issued,
                    "pending": [{"op": p.op, "seq": p.seq, "age_s": round(now - p.issued, 3)}
                                for p in sorted(a.pending, key=lambda p: p.seq)]})
    return out


def _focus(entries: Sequence[flight_recorder.Entry], threads: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The thread that issued the oldest operation not completed, else the main thread."""
    pending = [e for e in entries if e.state != "completed" and not e.retired]
    ident = pending[0].thread_id if pending else threading.main_thread().ident
    return next((t for t in threads if t["ident"] == ident), threads[0] if threads else None)


def build(views: Sequence[GroupView], cap: int, reason: str) -> bytes:
    """This process's report as JSON bytes, at most ``cap`` bytes (a larger
    one would not be read)."""
    views = [v for v in views if v.state() != "destroyed"]
    ranks = sorted({v.global_rank(v.rank) for v in views})
    world = max((max(v.global_ranks(), default=-1) + 1 for v in views), default=0)
    rec = flight_recorder.get()
    entries = rec.entries()
    threads = stacks()
    focus = _focus(entries, threads)
    dump = rec.dump(views, include_stack_traces=False)
    all_entries = dump.pop("entries", [])
    open_: list[dict[str, Any]] = []
    done: list[dict[str, Any]] = []
    for e in all_entries:
        (done if e["state"] == "completed" or e["retired"] else open_).append(e)
    devices = sorted({d for v in views if (d := v.device()) is not None})
    report: dict[str, Any] = {
        "v": VERSION, "reason": reason, "rank": ranks[0] if ranks else -1, "ranks": ranks, "world": world,
        "pid": os.getpid(), "host": socket.gethostname(), "time": time.time(), "job": dump_mod.job_id(),
        "devices": devices,
        "visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "where": _where(focus),
        "groups": _groups(views), **dump, "entries": [], "threads": threads, "cut": [],
    }
    return _fit(report, open_, done, cap)


def _encode(report: dict[str, Any], entries: list[dict[str, Any]]) -> bytes:
    report["entries"] = sorted(entries, key=lambda e: e["record_id"])
    return json.dumps(report, separators=(",", ":"), default=str).encode()


def _where(focus: dict[str, Any] | None) -> dict[str, Any] | None:
    """Where the focus thread is in the user's code (``frames.user_frame``)."""
    if focus is None:
        return None
    f = frames.user_frame([frames.Frame(*x) for x in focus["frames"]])
    return {**(where(f) if f is not None else {}), "thread": focus["name"]}


def _fit(report: dict[str, Any], open_: list[dict[str, Any]], done: list[dict[str, Any]], cap: int) -> bytes:
    """Cut what matters least until the report fits in ``cap`` bytes."""
    raw = _encode(report, open_ + done)
    while len(raw) > cap and done:  # the oldest completed entries first, half of them at a time
        n = (len(done) + 1) // 2
        report["cut"].append(f"{n} older completed recorder entries")
        done = done[n:]
        raw = _encode(report, open_ + done)
    threads = report["threads"]
    for depth in (16, 4):  # other threads' stacks, from the outermost frames
        if len(raw) <= cap:
            break
        for t in threads[1:]:
            t["frames"] = t["frames"][-depth:]
        report["cut"].append(f"frames of other threads beyond the innermost {depth}")
        raw = _encode(report, open_ + done)
    if len(raw) > cap and len(threads) > 1:
        report["cut"].append(f"the stacks of {len(threads) - 1} other threads")
        report["threads"] = threads[:1]
        raw = _encode(report, open_ + done)
    while len(raw) > cap and open_:
        n = (len(open_) + 1) // 2
        report["cut"].append(f"{n} older pending recorder entries")
        open_ = open_[n:]
        raw = _encode(report, open_)
    if len(raw) > cap:  # what remains: who and where
        keep = ("v", "reason", "rank", "ranks", "world", "pid", "host", "time", "devices", "where", "cut")
        small = {k: report[k] for k in keep}
        small["cut"] = [*small["cut"], "everything else (the cap is too small)"]
        raw = json.dumps(small, separators=(",", ":"), default=str).encode()
    return raw
