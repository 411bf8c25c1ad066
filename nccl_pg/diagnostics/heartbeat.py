"""A rank's progress, kept in a small file its launcher reads: how `nccl-pg
run` knows that a job hangs without asking anyone (no store traffic, no
signal), and how each rank ended.

`nccl-pg run` gives each rank ``NCCL_PG_PROGRESS_FILE``. The rank's
watchdog poller (one per process, group/watchdog.py) keeps the file at each
poll through a shared mapping (``Writer.update``: a few bytes written in
place, no system call): when it last polled, how many operations it has
seen complete, its rank in the job's largest group (how the launcher names
a replacement, whose rank is decided when it joins), when its progress last changed (an operation issued or
completed), how many are in flight, since when the oldest, and that one's
and the last completed one's names; at an exit on an uncaught exception,
what it raised and where (``Writer.raised``: how the launcher tells an
exception from a death). The launcher reads it (``read``) every second and
at each rank's end. Nothing is written when the variable is not
set, and nothing per operation: the poller's own cadence.

The clock is CLOCK_MONOTONIC (``time.monotonic_ns``), the same for every
process of a host. A file is this user's regular file (0600), opened
without following links; a reader checks its magic and its pid.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import stat
import struct
import threading
import time
from dataclasses import dataclass

MAGIC = b"NPGP"
_NAME = 48  # bytes of an operation's name
_RAISED = 200  # bytes of what it raised, and of where
_LAYOUT = struct.Struct(f"<4sIiQQQIQ{_NAME}s{_NAME}s{_RAISED}s{_RAISED}s")
SIZE = _LAYOUT.size


@dataclass(frozen=True)
class Progress:
    """One read of a rank's file (times: time.monotonic(), seconds)."""

    pid: int
    rank: int  # its rank in the largest of its groups, the job's (-1: in none yet)
    polled: float  # the watchdog's last poll
    completed: int  # operations seen complete
    changed: float  # last issue or completion
    in_flight: int
    oldest: float  # issue time of the oldest in flight (0: none)
    oldest_op: str  # "all_reduce #2 of group 0"
    last_op: str  # the last completed
    raised: str = ""  # at an exit on an uncaught exception: "ValueError: ..." (else "")
    raised_at: str = ""  # and where: "train.py:12 in step"

    def describe(self) -> str:
        """Where the rank was, for how it ended: "in all_reduce #5 of group 0", "after ...", or ""."""
        if self.in_flight and self.oldest_op:
            return f"in {self.oldest_op}"
        return f"after {self.last_op}" if self.last_op else ""


def _text(raw: bytes) -> str:
    return raw.split(b"\0", 1)[0].decode("utf-8", "replace")


def read(path: str) -> Progress | None:
    """The file's content, or None (missing, not this user's regular file, not ours)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            return None
        raw = os.read(fd, SIZE)
    finally:
        os.close(fd)
    if len(raw) < SIZE:
        return None
    magic, pid, rank, polled, completed, changed, in_flight, oldest, oldest_op, last_op, raised, raised_at = \
        _LAYOUT.unpack(raw)
    if magic != MAGIC:
        return None
    return Progress(pid, rank, polled / 1e9, completed, changed / 1e9, in_flight, oldest / 1e9, _text(oldest_op),
                    _text(last_op), _text(raised), _text(raised_at))


class Writer:
    """This process's side: the file mapped, updated by the watchdog's poller."""

    def __init__(self, path: str) -> None:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
                raise OSError(f"{path} is not a regular file of this user's")
            os.ftruncate(fd, SIZE)
            self._map = mmap.mmap(fd, SIZE)
        finally:
            os.close(fd)
        self.path = path
        self.pid = os.getpid()
        self.completed = 0
        self._changed = time.monotonic_ns()
        self._last_op = b""
        self._raised = (b"", b"")
        self._lock = threading.Lock()  # the poller's updates and the exit's raised() write the same bytes
        self._poll: tuple[int, int, bytes] = (-1, 0, b"")  # the last update's rank, time and oldest operation
        self._state: tuple[int, int, int] = (0, 0, 0)  # completed, in flight, oldest (the last update's): what changed means

    def update(self, rank: int, completed_now: int, in_flight: int, oldest: float | None, oldest_op: str,
               last_op: str) -> None:
        """One poll of the process of job rank ``rank`` (-1: none yet): ``completed_now`` operations completed since the last,
        ``in_flight`` still are (the oldest issued at ``oldest``, monotonic
        seconds, named ``oldest_op``); ``last_op``: the last completed ("" if
        none this poll)."""
        now = time.monotonic_ns()
        self.completed += completed_now
        oldest_ns = 0 if oldest is None else int(oldest * 1e9)
        state = (self.completed, in_flight, oldest_ns)
        if state != self._state:
            self._changed, self._state = now, state
        if last_op:
            self._last_op = last_op.encode()[:_NAME]
        self._poll = (rank, now, oldest_op.encode()[:_NAME])
        self._write()

    def raised(self, summary: str, where: str) -> None:
        """At exit on an uncaught exception: what it raised ("ValueError: ...", its first line) and where."""
        self._raised = (summary.encode()[:_RAISED], where.encode()[:_RAISED])
        self._write()

    def _write(self) -> None:
        with self._lock, contextlib.suppress(ValueError):  # (ValueError: closed)
            (rank, now, oldest_op), (completed, in_flight, oldest_ns) = self._poll, self._state
            self._map[:SIZE] = _LAYOUT.pack(MAGIC, self.pid, rank, now, completed, self._changed, in_flight, oldest_ns,
                                            oldest_op, self._last_op, *self._raised)

    def close(self) -> None:
        with contextlib.suppress(ValueError, OSError):
            self._map.close()
