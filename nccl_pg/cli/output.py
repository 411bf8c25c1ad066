"""The launcher's own output (its stdout and stderr), never blocking its loop.

`nccl-pg run` has one single-threaded loop that passes the ranks' output
through, reaps them, keeps the deadlines (``--max-time``, the grace period)
and handles signals. If it wrote to its stdout directly, a reader that does
not read (``| less`` left on a page, ``| tee`` to a slow disk, a terminal
paused with Ctrl-S, a slow CI log collector) would block it inside
``write``: no deadline, no signal, no reaping until the reader moves.

So each output is a ``Sink``: the loop appends whole lines to a bounded
buffer (``LIMIT`` bytes) and a thread of the sink's writes them out with
``os.write`` on a duplicate of the descriptor (no Python-level lock is held
while it blocks, so the interpreter can exit past it). A line that does not
fit is dropped and counted; once the buffer has room again, a line says how
many were dropped. Nothing here sets O_NONBLOCK on the descriptor: its open
file description is shared with the shell and the ranks, which must not see
their writes fail.
"""

from __future__ import annotations

import collections
import contextlib
import os
import sys
import threading
import time

LIMIT = 4 << 20  # bytes waiting to be written, at most, per output


class Sink:
    """One output of the launcher, written by its own thread (see the module's docstring)."""

    def __init__(self, fd: int, name: str, limit: int = LIMIT) -> None:
        self.fd = os.dup(fd)
        self.limit = limit
        self._queue: collections.deque[bytes] = collections.deque()
        self._size = 0
        self._busy = False  # the thread holds data it has taken off the queue
        self._dropped = 0  # lines dropped since the last note
        self.dropped_total = 0
        self._closed = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=f"nccl-pg-run-{name}", daemon=True)
        self._thread.start()

    def write(self, data: bytes, lines: int = 1) -> bool:
        """Queue ``data`` (``lines`` whole lines); never blocks. False when it
        was dropped: the buffer is full (nobody reads this output fast
        enough)."""
        with self._cond:
            if self._closed:
                return False
            if self._size + len(data) > self.limit:
                self._dropped += lines
                self.dropped_total += lines
                return False
            if self._dropped:
                note = (f"nccl-pg run: {self._dropped} line(s) of output dropped here: this output was not read "
                        "fast enough (a full pipe or a paused terminal)\n").encode()
                self._queue.append(note)
                self._size += len(note)
                self._dropped = 0
            self._queue.append(data)
            self._size += len(data)
            self._cond.notify()
            return True

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                chunk = b"".join(self._queue)
                self._queue.clear()
                self._busy = True
            try:
                view = memoryview(chunk)
                while view:
                    view = view[os.write(self.fd, view):]
            except OSError:  # the reader went away (EPIPE): nothing more can be written
                with self._cond:
                    self._closed = True
                    self._queue.clear()
            finally:
                with self._cond:
                    self._size -= len(chunk)
                    self._busy = False
                    self._cond.notify_all()

    def flush(self, timeout: float) -> bool:
        """Wait at most ``timeout`` seconds for what is queued to be written;
        False if it was not (the reader is stalled)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._queue or self._busy:
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    return not (self._queue or self._busy)
                self._cond.wait(left)
        return True

    def close(self, timeout: float) -> bool:
        """Write out what is queued (at most ``timeout`` seconds), then stop;
        a thread still blocked in a write is left behind (a daemon: it does
        not hold up the exit). False if something was not written."""
        done = self.flush(timeout)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if done:
            self._thread.join(timeout)
            with contextlib.suppress(OSError):
                os.close(self.fd)
        return done


class Console:
    """The launcher's stdout and stderr as sinks (``log``: a line of its own on stderr)."""

    def __init__(self, limit: int = LIMIT) -> None:
        for f in (sys.stdout, sys.stderr):  # what was printed before goes first
            with contextlib.suppress(OSError, ValueError):
                f.flush()
        self.out = Sink(1, "stdout", limit)
        self.err = Sink(2, "stderr", limit)

    def log(self, line: str) -> None:
        self.err.write(line.encode("utf-8", "replace") + b"\n")

    def close(self, timeout: float) -> None:
        """Each sink gets ``timeout`` seconds to write out what it holds."""
        self.out.close(timeout)
        self.err.close(timeout)
