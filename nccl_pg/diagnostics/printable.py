"""Text from untrusted sources made safe to print on an operator's terminal.

Reports, dumps, stacks files and job records can be written by anyone who
holds the store's secret or can write the dump folder; a string in them may
hold terminal control sequences (ESC ... : clear the screen, set the window
title, write the clipboard with OSC 52; BEL; C1 controls such as CSI,
U+009B). Every tool that prints such text (``nccl-pg why``, ``trace``, the
launcher's autopsy, the test harness's verdict) passes it through ``safe``:
control characters become visible escapes (``\\x1b``), and nothing else
changes. Newlines are kept only where a caller says a text may span lines.
"""

from __future__ import annotations

import re

# C0 controls but tab and newline, DEL, C1 controls; and the Unicode line/paragraph separators and bidi overrides,
# which reorder or split what the operator reads
_UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
_UNSAFE_LINE = re.compile("[\x00-\x08\x0a-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def _escape(m: re.Match[str]) -> str:
    c = ord(m.group())
    return f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}"


def safe(text: str, lines: bool = True) -> str:
    """``text`` with its control characters escaped; ``lines=False``: its
    newlines too (a field printed on one line)."""
    return (_UNSAFE if lines else _UNSAFE_LINE).sub(_escape, text)
