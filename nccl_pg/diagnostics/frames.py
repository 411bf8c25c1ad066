"""Stack frames, wherever they come from, and which one is the user's: the
one place that parses faulthandler's text and Python's stack text, and
decides "where a rank is in its own code" for every tool (the harness's
verdict, ``nccl-pg why`` and the launcher's autopsy, ``nccl-pg trace``, a
process's report when asked).

Sources: a live frame or a traceback (``of_frame``, ``of_traceback``);
Python's stack text, ``traceback.format_stack``'s lines (``parse_python``:
our dumps' ``threads``); faulthandler's text (``parse_faulthandler``: what a
C-level handler writes, also for a thread holding the GIL or stuck in C).

"Where" (``user_frame``) is the innermost frame of user code; failing that,
of a third-party package (site-packages: e.g. the user's line is below a
frame of numpy's); failing that, the innermost frame. Never the library's
own (nccl_pg, Python's standard library, interpreter internals,
torch.distributed) when anything else is there. Paths are judged by their
shape as well as by this installation's folders, so that stacks from
another machine (a dump, a report) are judged alike.
"""

from __future__ import annotations

import functools
import os
import re
import sysconfig
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import FrameType, TracebackType
from typing import Any

LIBRARY, THIRD_PARTY, USER = 0, 1, 2  # what a frame's file is (``kind``)

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # nccl_pg/
_STDLIB = tuple({os.path.abspath(sysconfig.get_paths()[k]) + os.sep for k in ("stdlib", "platstdlib")})
_SITE = tuple({os.path.abspath(sysconfig.get_paths()[k]) + os.sep for k in ("purelib", "platlib")})
_STDLIB_SHAPE = re.compile(r"[/\\]lib[/\\]python3\.\d+[/\\](?!(site|dist)-packages[/\\])")
_SITE_SHAPE = re.compile(r"[/\\](site|dist)-packages[/\\]")

_PY_FRAME = re.compile(r'\s*File "(?P<file>.*)", line (?P<line>\d+), in (?P<func>.*)')
_C_FRAME = re.compile(r'\s*File "(?P<file>.*)", line (?P<line>\d+) in (?P<func>.*)')
_WHERE = re.compile(r"(?P<file>.+):(?P<line>\d+) in (?P<func>.+)")
_C_THREAD = re.compile(r"(?P<current>Current thread|Thread) (?P<ident>0x[0-9a-fA-F]+)(?P<rest>.*)"
                       r"\(most recent call first\):\s*")
_C_LONE = re.compile(r"Stack \(most recent call first\):\s*")
_THREAD_KEY = re.compile(r"(?P<name>.*) \((?P<ident>\d+)\)")


@dataclass(frozen=True)
class Frame:
    file: str
    line: int
    function: str
    code: str = ""  # the source line, where known

    def __str__(self) -> str:
        return f"{self.file}:{self.line} in {self.function}" + (f": {self.code}" if self.code else "")

    @property
    def where(self) -> str:
        """``file:line in function``."""
        return f"{self.file}:{self.line} in {self.function}"

    @classmethod
    def of_where(cls, text: str) -> Frame | None:
        """The frame a ``where`` names ("train.py:12 in step"); None if ``text`` is not one."""
        m = _WHERE.fullmatch(text)
        return cls(m["file"], int(m["line"]), m["func"]) if m else None

    def as_dict(self) -> dict[str, Any]:
        return {"file": self.file, "line": self.line, "function": self.function, "code": self.code}


@dataclass
class Thread:
    name: str
    ident: int | None
    frames: list[Frame]  # outermost first
    source: str  # "python" (Python's stack text or frames) or "c" (faulthandler)
    current: bool = False  # faulthandler's "Current thread": the one that wrote them


# --- sources ----------------------------------------------------------------------------------------


def of_frame(frame: FrameType, limit: int | None = None) -> list[Frame]:
    """A live frame's stack, outermost first (at most the innermost ``limit``)."""
    return _summaries(traceback.extract_stack(frame, limit))


def of_traceback(tb: TracebackType | None) -> list[Frame]:
    """Where an exception went, outermost first (the raising frame last)."""
    return _summaries(traceback.extract_tb(tb))


def _summaries(summary: traceback.StackSummary) -> list[Frame]:
    return [Frame(f.filename, f.lineno or 0, f.name, f.line or "") for f in summary]


def parse_python(threads: Mapping[str, Sequence[str]]) -> list[Thread]:
    """Python's stack text per thread: {"<name> (<ident>)": ``traceback.format_stack``
    lines} (our dumps' ``threads``). Lines that are not a frame are skipped."""
    out = []
    for key, lines in threads.items():
        m = _THREAD_KEY.fullmatch(key)
        name, ident = (m.group("name"), int(m.group("ident"))) if m else (key, None)
        frames = []
        for chunk in lines:
            first, _, rest = chunk.partition("\n")
            f = _PY_FRAME.fullmatch(first)
            if f is not None:
                frames.append(Frame(f.group("file"), int(f.group("line")), f.group("func"), rest.strip()))
        out.append(Thread(name, ident, frames, "python"))
    return out


def parse_faulthandler(text: str, main: int | None = None) -> list[Thread]:
    """faulthandler's text: blocks of "Thread 0x…" (or "Current thread 0x…",
    or "Stack") and their frames, innermost first. Lines it does not know are
    skipped (a truncated file still gives what it has). Text written to
    several times holds several dumps: a thread's latest block wins. The
    thread whose ident is ``main`` is named "MainThread" and comes first."""
    out: list[Thread] = []
    inner_first: list[Frame] = []

    def close() -> None:
        if out:
            out[-1].frames = inner_first[::-1]

    for line in text.splitlines():
        t = _C_THREAD.fullmatch(line)
        if t is not None or _C_LONE.fullmatch(line):
            close()
            inner_first = []
            ident = int(t.group("ident"), 16) if t is not None else None
            name = t.group("rest").strip(" []") if t is not None else ""
            if ident is not None and ident == main:
                name = "MainThread"
            out.append(Thread(name or (f"{ident:#x}" if ident is not None else "?"), ident, [], "c",
                              current=t is None or t.group("current") != "Thread"))
            continue
        f = _C_FRAME.fullmatch(line)
        if f is not None and out:
            inner_first.append(Frame(f.group("file"), int(f.group("line")), f.group("func")))
    close()
    latest = {(t.ident if t.ident is not None else id(t)): t for t in out}
    return sorted(latest.values(), key=lambda t: t.name != "MainThread")


def format_traceback(frames: Sequence[Frame]) -> list[str]:
    """Python's traceback lines, outermost first (``traceback.format_stack``'s
    form, which ``parse_python`` reads back)."""
    return traceback.format_list([traceback.FrameSummary(f.file, f.line, f.function, lookup_line=False, line=f.code)
                                  for f in frames])


# --- where ------------------------------------------------------------------------------------------


def kind(file: str) -> int:
    """LIBRARY (nccl_pg's own modules, Python's standard library, interpreter
    internals, torch.distributed), THIRD_PARTY (site-packages), or USER."""
    if file.startswith("<frozen "):
        return LIBRARY
    if file.startswith("<"):  # "<string>", "<stdin>": code the user gave
        return USER
    path = os.path.abspath(file)
    shape = file.replace("\\", "/")
    if path.startswith(_PACKAGE + os.sep) or path.startswith(_STDLIB) or _STDLIB_SHAPE.search(file) \
            or "/torch/distributed/" in shape:
        return LIBRARY
    _, sep, tail = shape.rpartition("/nccl_pg/")
    if sep and _ours(tail):  # this package, installed elsewhere (a dump from another machine)
        return LIBRARY
    return THIRD_PARTY if path.startswith(_SITE) or _SITE_SHAPE.search(file) else USER


@functools.lru_cache(maxsize=1024)
def _ours(relative: str) -> bool:
    """Whether this package has a module at ``relative`` (a path below nccl_pg/)."""
    return relative.endswith(".py") and os.path.isfile(os.path.join(_PACKAGE, relative))


def user_frame(frames: Sequence[Frame]) -> Frame | None:
    """Where a stack (outermost first) is in the user's code: its innermost
    frame of user code, else of a third-party package, else its innermost
    frame; None for no frame."""
    for want in (USER, THIRD_PARTY):
        for f in reversed(frames):
            if kind(f.file) == want:
                return f
    return frames[-1] if frames else None


def raised_at(exc: BaseException) -> Frame | None:
    """Where ``exc`` was raised, in the user's code (``user_frame`` of its traceback)."""
    return user_frame(of_traceback(exc.__traceback__))


def raised_line(exc: BaseException) -> str:
    """What ``exc`` is, as the tools quote it: "ValueError: rank 1 broke" (the first line of its message)."""
    return f"{type(exc).__name__}: {exc}".splitlines()[0]
