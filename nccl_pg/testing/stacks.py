"""Where a rank is in its own code: the source line a culprit is blamed at,
from a traceback (a rank that raised) or from the stacks that faulthandler
writes when asked by signal (a rank still running: sleeping, spinning, or
holding the GIL, since faulthandler's handler is C and needs no GIL)."""

from __future__ import annotations

import os
import re
import sysconfig
import traceback
from collections.abc import Sequence
from dataclasses import dataclass

_HERE = os.path.dirname(os.path.abspath(__file__))
# The harness's own entry point in a rank process: the bottom of the rank's main thread.
ENTRY = os.path.join(_HERE, "rank_main.py")

_LIBRARY = os.path.dirname(_HERE) + os.sep  # nccl_pg itself
_STDLIB = tuple({os.path.abspath(sysconfig.get_paths()[k]) + os.sep for k in ("stdlib", "platstdlib")})
_SITE = tuple({os.path.abspath(sysconfig.get_paths()[k]) + os.sep for k in ("purelib", "platlib")})

_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-f]+) \(most recent call first\):$")
_FRAME = re.compile(r'^  File "(.*)", line (\d+) in (.*)$')


@dataclass(frozen=True)
class Frame:
    file: str
    line: int
    function: str


def _rank(frame: Frame) -> int:
    """How much a frame looks like the test's own code: 2 for user code,
    1 for a third-party package, 0 for the standard library or nccl_pg."""
    path = os.path.abspath(frame.file) if not frame.file.startswith("<") else frame.file
    if path.startswith("<") or path.startswith(_LIBRARY) or path.startswith(_STDLIB):
        return 0
    return 1 if path.startswith(_SITE) else 2


def innermost_user_frame(frames: Sequence[Frame]) -> Frame | None:
    """The frame to blame in a stack listed innermost first: the innermost
    one in user code, else in a third-party package, else the innermost."""
    for level in (2, 1):
        for f in frames:
            if _rank(f) == level:
                return f
    return frames[0] if frames else None


def from_traceback(exc: BaseException) -> Frame | None:
    """Where ``exc`` was raised, in the rank's own code."""
    frames = [Frame(f.filename, f.lineno or 0, f.name) for f in traceback.extract_tb(exc.__traceback__)]
    return innermost_user_frame(frames[::-1])


def threads(text: str) -> list[tuple[str, list[Frame]]]:
    """faulthandler's dump (``dump_traceback(all_threads=True)``): each thread's
    header line and its frames, innermost first."""
    out: list[tuple[str, list[Frame]]] = []
    for line in text.splitlines():
        m = _THREAD.match(line)
        if m:
            out.append((line.rstrip(":"), []))
            continue
        f = _FRAME.match(line)
        if f and out:
            out[-1][1].append(Frame(f.group(1), int(f.group(2)), f.group(3)))
    return out


def main_thread(text: str, hint: str | None = None) -> list[Frame]:
    """The rank's main thread in a faulthandler dump, innermost first: the
    one started from the harness's entry point (without the harness's
    frames); if the dump cut that off (it keeps 100 frames), one with a
    frame in ``hint`` (the test function's file)."""
    found = threads(text)
    for want in (ENTRY, hint):
        for _, frames in found:
            ours = [os.path.abspath(f.file) == os.path.abspath(want) for f in frames] if want else []
            if any(ours):
                return frames[:ours.index(True)] if want == ENTRY else frames  # not the harness's own frames
    return found[0][1] if found else []


def format_frames(frames: Sequence[Frame]) -> str:
    """Innermost first, like faulthandler."""
    return "".join(f'  File "{f.file}", line {f.line} in {f.function}\n' for f in frames)
