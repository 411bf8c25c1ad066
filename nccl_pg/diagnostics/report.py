"""What a process says about itself when asked (``nccl-pg why``, the
launcher's autopsy): its ranks, host, pid and device, every live group's
counters and pending operations, its flight recorder in PyTorch's dump
layout, the Python stack of every thread, and where it is ("where": the
innermost frame of user code in the thread that matters: the one that
issued its oldest pending operation, else the main thread).

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
import sysconfig
import threading
import time
import traceback
from collections.abc import Sequence
from types import FrameType
from typing import Any

from . import flight_recorder
from .group_view import GroupView

VERSION = 1
LINE_MAX = 200  # characters of a source line kept per frame
DEPTH_MAX = 64  # frames kept per thread (the innermost)
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_STDLIB = tuple({os.path.abspath(p) + os.sep for p in (sysconfig.get_paths()["stdlib"],
                                                      sysconfig.get_paths()["platstdlib"])})
_TORCH_DIST = f"{os.sep}torch{os.sep}distributed{os.sep}"


def library_frame(filename: str) -> bool:
    """A frame of nccl_pg, the standard library or torch.distributed: not where the user's code is."""
    path = os.path.abspath(filename)
    return path.startswith(_PACKAGE) or path.startswith(_STDLIB) or _TORCH_DIST in path or filename.startswith("<frozen")


def where(frames: Sequence[Sequence[Any]]) -> dict[str, Any] | None:
    """The innermost frame of user code in ``frames`` ([file, line, function, source], outermost
    first), else the innermost frame; None for no frame."""
    if not frames:
        return None
    pick = next((f for f in reversed(frames) if not library_frame(str(f[0]))), frames[-1])
    return {"file": pick[0], "line": pick[1], "func": pick[2], "code": pick[3] if len(pick) > 3 else ""}


def _frames(frame: FrameType) -> list[list[Any]]:
    out = []
    for f in traceback.extract_stack(frame)[-DEPTH_MAX:]:
        out.append([f.filename, f.lineno or 0, f.name, (f.line or "")[:LINE_MAX]])
    return out


def stacks() -> list[dict[str, Any]]:
    """Every thread's stack, the main thread first."""
    threads = {t.ident: t for t in threading.enumerate()}
    main = threading.main_thread().ident
    out = [{"name": threads[i].name if i in threads else "?", "ident": i, "main": i == main, "frames": _frames(f)}
           for i, f in sys._current_frames().items()]  # noqa: SLF001 - the stdlib's one way to them
    out.sort(key=lambda t: (not t["main"], str(t["name"])))
    return out


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
        "pid": os.getpid(), "host": socket.gethostname(), "time": time.time(), "devices": devices,
        "visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "where": None if focus is None else {**(where(focus["frames"]) or {}), "thread": focus["name"]},
        "groups": _groups(views), **dump, "entries": [], "threads": threads, "cut": [],
    }
    return _fit(report, open_, done, cap)


def _encode(report: dict[str, Any], entries: list[dict[str, Any]]) -> bytes:
    report["entries"] = sorted(entries, key=lambda e: e["record_id"])
    return json.dumps(report, separators=(",", ":"), default=str).encode()


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
