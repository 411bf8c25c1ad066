"""Where a rank is: its threads' stacks as its dump holds them, and the top
of the one that matters ("where the culprit is now").

Three sources, best first:

- ``threads``: our dumps' Python stack of every thread, as
  ``traceback.format_stack`` writes it, keyed "<thread name> (<ident>)";
- the rank's C-level stacks file, ``<dump prefix><rank>.stacks``: what
  ``faulthandler`` wrote (every thread, from a C-level handler, so also for
  a rank holding the GIL or stuck in C), after a header line naming the
  rank, pid, host and main thread;
- an entry's ``frames``: the stack where an operation was issued (torch's
  dumps, and ours with ``NCCL_PG_TRACE_STACKS=1``): where the rank was, not
  where it is.

"The top" is the innermost frame that is not the library's own (nccl_pg,
Python's standard library, torch.distributed): the user's line that called
into them, or the line a rank busy in user code is on.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

_PY_FRAME = re.compile(r'\s*File "(?P<file>.*)", line (?P<line>\d+), in (?P<func>.*)')
_C_FRAME = re.compile(r'\s*File "(?P<file>.*)", line (?P<line>\d+) in (?P<func>.*)')
_C_THREAD = re.compile(r"(?P<current>Current thread|Thread) (?P<ident>0x[0-9a-fA-F]+)(?P<rest>.*)"
                       r"\(most recent call first\):\s*")
_C_LONE = re.compile(r"Stack \(most recent call first\):\s*")
_THREAD_KEY = re.compile(r"(?P<name>.*) \((?P<ident>\d+)\)")
_STDLIB = re.compile(r"[/\\]lib[/\\]python3\.\d+[/\\](?!(site|dist)-packages[/\\])")
_OURS = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # nccl_pg/


@dataclass(frozen=True)
class Frame:
    file: str
    line: int
    function: str
    code: str = ""

    def __str__(self) -> str:
        return f"{self.file}:{self.line} in {self.function}" + (f": {self.code}" if self.code else "")

    def as_dict(self) -> dict[str, Any]:
        return {"file": self.file, "line": self.line, "function": self.function, "code": self.code}


@dataclass
class Thread:
    name: str
    ident: int | None
    frames: list[Frame]  # outermost first
    source: str  # "python" (the dump's thread stacks) or "c" (faulthandler)
    current: bool = False  # faulthandler's "Current thread": the one that wrote them


def python_threads(threads: Mapping[str, Sequence[str]]) -> list[Thread]:
    """Our dumps' ``threads``: {"<name> (<ident>)": format_stack lines}."""
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


def c_threads(text: str) -> list[Thread]:
    """faulthandler's text: blocks of "Thread 0x…" (or "Current thread 0x…",
    or "Stack") and their frames, innermost first. Lines it does not know are
    skipped (a truncated file still gives what it has). A file written to
    several times holds several dumps: a thread's latest block wins."""
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
            out.append(Thread(name or (f"{ident:#x}" if ident is not None else "?"), ident, [], "c",
                              current=t is None or t.group("current") != "Thread"))
            continue
        f = _C_FRAME.fullmatch(line)
        if f is not None and out:
            inner_first.append(Frame(f.group("file"), int(f.group("line")), f.group("func")))
    close()
    latest = {(t.ident if t.ident is not None else id(t)): t for t in out}
    return list(latest.values())


_HEADER = re.compile(r"# nccl_pg C-level stacks: rank (?P<rank>\d+), pid (?P<pid>\d+), host (?P<host>\S{1,255}), "
                     r"main thread (?P<main>0x[0-9a-fA-F]{1,16})\s*")


def stacks_header(line: str) -> dict[str, Any]:
    """The header of a rank's stacks file: {"rank", "pid", "host", "main"}, or {} if it is not one."""
    m = _HEADER.fullmatch(line)
    if m is None:
        return {}
    return {"rank": int(m.group("rank")), "pid": int(m.group("pid")), "host": m.group("host"),
            "main": int(m.group("main"), 16)}


def entry_frames(frames: Iterable[Mapping[str, Any]]) -> list[Frame]:
    """An entry's ``frames`` (innermost first, {name, filename, line}), outermost first."""
    return [Frame(str(f.get("filename", "?")), int(f.get("line") or 0), str(f.get("name", "?")))
            for f in frames][::-1]


def is_library(frame: Frame) -> bool:
    """nccl_pg's own code (by its path in the package), Python's standard
    library, interpreter internals, or torch.distributed."""
    path = frame.file.replace("\\", "/")
    if path.startswith("<frozen ") or _STDLIB.search(path) or "/torch/distributed/" in path:
        return True
    head, sep, tail = path.rpartition("/nccl_pg/")
    return bool(sep) and _ours(tail)


@functools.lru_cache(maxsize=1024)
def _ours(relative: str) -> bool:
    """Whether this package has a module at ``relative`` (a path below nccl_pg/)."""
    return relative.endswith(".py") and os.path.isfile(os.path.join(_OURS, relative))


def top(frames: Sequence[Frame]) -> Frame | None:
    """The innermost frame outside the library (the innermost of all if every
    frame is the library's)."""
    for f in reversed(frames):
        if not is_library(f):
            return f
    return frames[-1] if frames else None


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
